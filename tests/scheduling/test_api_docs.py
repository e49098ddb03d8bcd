"""The API's OpenAPI schema documents every operation: a one-line summary or a
description, and an example (of its body, its answer, or where it has neither, its path)."""

from __future__ import annotations

import json

import pytest
from drf_spectacular.drainage import GENERATOR_STATS
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer

from scheduling.api.examples import EXAMPLES

METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


def test_the_schema_is_made_without_a_warning_each_component_and_operation_under_a_name_of_its_own():
    # A warning here is a schema that says something wrong: two serializers under one name (one
    # of them then documented as the other), or a client generated from it naming a type
    # State55dEnum or an operation api_requests_retrieve_2.
    GENERATOR_STATS.reset()
    with GENERATOR_STATS.silence():
        made = SchemaGenerator().get_schema(request=None, public=True)

    assert not GENERATOR_STATS, sorted(GENERATOR_STATS._warn_cache) + sorted(GENERATOR_STATS._error_cache)
    components = made["components"]["schemas"]
    assert {"RollingRestartInput", "RestartInput", "AnthropicMessageInput", "MessageInput"} <= set(components)
    assert "max_load_failures" in components["RestartInput"]["properties"], "the spec's restart policy"
    assert "misplaced" in components["RollingRestartInput"]["properties"], "the rolling restart's body"
    assert {"ReplicaStateEnum", "DeploymentStatusEnum", "PullStateEnum"} <= set(components)


def operations(schema: dict):
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if method in METHODS:
                yield method, path, op


def has_example(op: dict) -> bool:
    contents = [*op.get("requestBody", {}).get("content", {}).values()]
    contents += [c for answer in op.get("responses", {}).values() for c in answer.get("content", {}).values()]
    return any("examples" in c or "example" in c for c in contents) or any(
        "example" in p for p in op.get("parameters", [])
    )


def test_every_operation_has_a_summary_or_a_description_and_an_example(schema):
    missing = [
        f"{method.upper()} {path}: "
        + ", ".join(
            what
            for what, ok in (
                ("no summary", op.get("summary") or op.get("description")),
                ("no example", has_example(op)),
            )
            if not ok
        )
        for method, path, op in operations(schema)
        if not (op.get("summary") or op.get("description")) or not has_example(op)
    ]
    assert missing == [], "\n".join(missing)


def test_the_summaries_are_one_line(schema):
    long = [f"{m.upper()} {p}" for m, p, op in operations(schema) if "\n" in (op.get("summary") or "")]
    assert long == []


def test_the_examples_of_a_deploy_and_an_answer_name_the_same_fields_as_the_schema(schema):
    deployment = set(schema["components"]["schemas"]["Deployment"]["properties"])
    shown = set(EXAMPLES[("get", "/api/deployments/{name}/")]["response"])
    assert shown == deployment
    replica = set(schema["components"]["schemas"]["Replica"]["properties"])
    assert set(EXAMPLES[("get", "/api/replicas/{id}/")]["response"]) == replica
    request = set(schema["components"]["schemas"]["Request"]["properties"])
    assert set(EXAMPLES[("get", "/api/requests/{id}/")]["response"]) == request
    gpu = set(schema["components"]["schemas"]["GPU"]["properties"])
    assert set(EXAMPLES[("get", "/api/gpus/{id}/")]["response"]) == gpu


def test_a_replicas_gpus_have_one_name_the_first_one_marked_deprecated(schema):
    replica = schema["components"]["schemas"]["Replica"]["properties"]

    assert replica["gpus"]["deprecated"] is True and "read gpu_indexes" in replica["gpus"]["description"]
    assert not replica["gpu_indexes"].get("deprecated") and not replica["gpu_ids"].get("deprecated")
