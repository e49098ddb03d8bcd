"""No input gets a 500: schemathesis sends what the portal's own OpenAPI schema allows,
and much it does not, to every operation, through the WSGI app on the real PostgreSQL and Redis.
Bounded (a few examples per operation) and derandomized, so a failure shows again on the next run."""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import pytest
import schemathesis
from django.contrib.auth.models import User
from django.test import Client
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.python._constants.orchestrator import build_constants_pool

from gpuportal.wsgi import application


def _raw_schema() -> dict:
    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


schema = schemathesis.openapi.from_dict(_raw_schema())
schema.app = application
# The literals schemathesis reads from the app's source, to generate with, read once here: each
# operation's test is a clone of `schema` (below), and a clone made before the reading reads the
# whole source again, 65 times in each of `make test`'s processes (two-thirds of collecting this
# file, a fifth of collecting the suite). Clones share what the schema read before them.
build_constants_pool(schema)


@pytest.fixture
def token(db) -> str:
    return Token.objects.create(user=User.objects.create_user("ops", is_staff=True, is_superuser=True)).key


def _no_server_error_from(label: str):
    """The test of one operation (`POST /api/deployments/`), a function of its own: schemathesis
    gives the tests it makes for one function a single node id, and pytest-xdist (`make test`),
    which schedules by node id, would run only one of them."""

    # Transactional: the WSGI app closes the database connection after each request, as it does
    # in production, so the rows it reads must be committed.
    @pytest.mark.django_db(transaction=True)
    @schema.include(name=label).parametrize()
    @settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    def test(case, token, cluster):
        case.call_and_validate(headers={"Authorization": f"Token {token}"}, checks=[not_a_server_error])

    return test


OPERATIONS = [result.ok().label for result in schema.get_all_operations()]
for _label in OPERATIONS:
    _name = "test_" + re.sub(r"[^a-z0-9]+", "_", _label.lower()).strip("_") + "_answers_no_server_error"
    globals()[_name] = _no_server_error_from(_label)


def test_every_operation_of_the_schema_has_its_test():
    tests = [name for name in globals() if name.startswith("test_") and name.endswith("_answers_no_server_error")]
    assert len(tests) == len(OPERATIONS) > 30 and any("post_api_deployments" in name for name in tests)


# -- hostile bodies and paths -------------------------------------------------------------------------
# What schemathesis does not send on its own: JSON nested past any sane depth, NUL and lone
# surrogates in any string (PostgreSQL stores neither), in bodies shaped like each operation's
# own (its field names as keys, so validators past the parser see them too) and in path parameters.


def _body_operations() -> list[tuple[str, str, list[str]]]:
    """(method, path template, the field names its body schema knows) of every operation with a body."""
    raw = _raw_schema()
    components = raw.get("components", {}).get("schemas", {})

    def names(node: object, seen: set[str]) -> set[str]:
        found: set[str] = set()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                found |= names(components.get(ref.rsplit("/", 1)[-1], {}), seen | {ref})
            found |= set(node.get("properties", {}))
            for value in node.values():
                found |= names(value, seen)
        elif isinstance(node, list):
            for value in node:
                found |= names(value, seen)
        return found

    operations = []
    for path, methods in raw["paths"].items():
        for method, operation in methods.items():
            if isinstance(operation, dict) and "requestBody" in operation:
                operations.append((method, path, sorted(names(operation["requestBody"], set()))))
    return operations


BODY_OPERATIONS = _body_operations()
HOSTILE_TEXT = st.text(
    alphabet=st.sampled_from(["a", "-", "\x00", "\ud800", "\udfff", "é", "%", "\u2028", "/", " "]) | st.characters(),
    max_size=10,
)
LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | HOSTILE_TEXT


def _values(keys: list[str]):
    key = st.sampled_from(keys) | HOSTILE_TEXT if keys else HOSTILE_TEXT
    return st.recursive(
        LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(key, inner, max_size=5), max_leaves=24
    )


@st.composite
def hostile_calls(draw) -> tuple[str, str, str]:
    method, template, keys = draw(st.sampled_from(BODY_OPERATIONS))
    path = re.sub(r"\{[^}]+\}", lambda _: quote(draw(HOSTILE_TEXT) or "x", safe=""), template)
    if draw(st.booleans()):
        depth = draw(st.integers(min_value=1, max_value=200))
        body = "[" * depth + "]" * depth if draw(st.booleans()) else '{"a":' * depth + "1" + "}" * depth
    else:
        body = json.dumps(draw(st.dictionaries(st.sampled_from(keys) if keys else HOSTILE_TEXT, _values(keys))))
    return method, path, body


@pytest.mark.django_db(transaction=True)
@given(call=hostile_calls())
@settings(max_examples=50, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_bodies_and_path_parameters_get_no_server_error(call, token, cluster):
    method, path, body = call
    client = Client(HTTP_AUTHORIZATION=f"Token {token}", raise_request_exception=False)
    response = getattr(client, method)(path, data=body, content_type="application/json")
    assert response.status_code < 500, (method, path, body[:300], response.content[:300])
