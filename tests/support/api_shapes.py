"""The API's answers as its own OpenAPI schema shapes them, for tests that build an answer by hand
(the command line's): an answer built in another shape passes a test and fails against the portal.
`gpuportal node drain` read a failover pair's state as a string for days, where every answer gave
an object, because its test said so."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator


@cache
def _components() -> dict[str, Any]:
    """The schema's components, made JSON Schema: OpenAPI 3.0's `nullable` as a null type, and no
    `required` (a test's answer carries the fields the code under test reads, not every one)."""
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.renderers import OpenApiJsonRenderer

    schema = json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))
    return _json_schema(copy.deepcopy(schema["components"]["schemas"]))


def _json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _json_schema(value) for key, value in node.items() if key != "required"}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def shaped(component: str, answer: dict[str, Any]) -> dict[str, Any]:
    """`answer`, once it is checked against the schema's `component` (Replica, Deployment, GPU,
    Node, ...): an AssertionError naming each field the API would never answer that way."""
    schema = {"$ref": f"#/components/schemas/{component}", "components": {"schemas": _components()}}
    errors = sorted(Draft202012Validator(schema).iter_errors(answer), key=lambda e: list(e.absolute_path))
    wrong = [f"{'.'.join(str(p) for p in e.absolute_path) or '(the answer)'}: {e.message}" for e in errors]
    assert not wrong, f"not an answer of the API's {component}:\n" + "\n".join(wrong)
    return answer
