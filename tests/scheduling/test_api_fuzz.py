"""No input gets a 500: schemathesis sends what the portal's own OpenAPI schema allows,
and much it does not, to every operation, through the WSGI app on the real PostgreSQL and Redis.
Bounded (a few examples per operation) and derandomized, so a failure shows again on the next run."""

from __future__ import annotations

import json
import re

import pytest
import schemathesis
from django.contrib.auth.models import User
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error

from gpuportal.wsgi import application


def _raw_schema() -> dict:
    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


schema = schemathesis.openapi.from_dict(_raw_schema())
schema.app = application


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
