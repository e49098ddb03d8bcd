"""An outage of PostgreSQL or Redis, or a body too big, gets a JSON answer naming it:
503 with Retry-After, 413; never Django's HTML 500 or 400. The outages are real: the web's
connection is pointed at a port where nothing listens, and then back."""

from __future__ import annotations

import contextlib
import json

import pytest
from django.contrib.auth.models import User
from django.db import OperationalError, connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpuportal.stack import free_port
from scheduling.api.outages import outage_response
from scheduling.services import queueing
from tests.support import factories


@contextlib.contextmanager
def database_unreachable():
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = str(free_port())
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port


@contextlib.contextmanager
def redis_unreachable(settings):
    url = settings.REDIS_URL
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    queueing.queue.cache_clear()
    try:
        yield
    finally:
        settings.REDIS_URL = url
        queueing.queue.cache_clear()


@pytest.mark.django_db(transaction=True)
def test_with_postgresql_unreachable_the_api_answers_a_json_503_naming_it_and_recovers_after():
    client = APIClient()
    client.force_authenticate(User.objects.create_user("ops", is_staff=True))

    with database_unreachable():
        response = client.get("/api/deployments/")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/json" and response["Retry-After"] == "2"
    assert response.json() == {"detail": "the database is unreachable; retry shortly", "dependency": "postgresql"}

    assert client.get("/api/deployments/").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_with_redis_unreachable_a_v1_call_answers_a_503_in_openai_shape_naming_it(settings):
    factories.deployment("tiny")
    token = Token.objects.create(user=User.objects.create_user("dev")).key
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "timeout": 1}

    with redis_unreachable(settings):
        response = client.post("/v1/completions", body, format="json")

    assert response.status_code == 503 and response["Retry-After"] == "2"
    assert response.json()["error"]["code"] == "redis"
    message = response.json()["error"]["message"]
    assert message.startswith("Redis (the request queues and the task broker) is unreachable")


@pytest.mark.django_db(transaction=True)
def test_an_outage_answers_anthropics_and_ollamas_callers_in_their_own_error_shapes(settings):
    factories.deployment("tiny")
    token = Token.objects.create(user=User.objects.create_user("dev")).key
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {token}")
    said = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "timeout": 1}

    with redis_unreachable(settings):
        anthropic = client.post("/v1/messages", {**said, "max_tokens": 2}, format="json")
        ollama = client.post("/api/chat", {**said, "stream": False}, format="json")

    assert (
        anthropic.status_code == ollama.status_code == 503 and anthropic["Retry-After"] == ollama["Retry-After"] == "2"
    )
    error = anthropic.json()["error"]
    assert anthropic.json()["type"] == "error" and error["type"] == "overloaded_error"
    assert error["message"].startswith("Redis (the request queues and the task broker) is unreachable")
    assert ollama.json() == {"error": error["message"]}


@pytest.mark.django_db
def test_a_body_over_the_limit_is_a_json_413_on_the_api_and_on_v1(staff, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    big = json.dumps({"model": "tiny", "prompt": "x" * 4096})

    api = staff.post("/api/deployments/", big, content_type="application/json")
    assert api.status_code == 413 and "request body too large" in api.json()["detail"]

    token = Token.objects.create(user=User.objects.create_user("dev")).key
    v1 = APIClient(HTTP_AUTHORIZATION=f"Bearer {token}").post("/v1/completions", big, content_type="application/json")
    assert v1.status_code == 413 and v1.json()["error"]["code"] == "request_too_large"


def test_a_deadlock_that_escaped_the_retries_is_a_503_to_retry_and_other_errors_are_left_alone():
    import psycopg

    deadlock = OperationalError("deadlock detected")
    deadlock.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    response = outage_response(deadlock)
    assert response is not None and response.status_code == 503
    assert json.loads(response.content)["detail"].startswith("the database asked to retry")
    assert outage_response(ValueError("a bug")) is None
