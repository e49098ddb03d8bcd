"""Crash-loop backoff: a replica that fails to load is replaced after a doubling backoff,
and after max_load_failures in a row the deployment is failed with the error: its waiting
requests end with it, new ones get a 503 naming it, and nothing more starts until an operator
retries (or changes its settings)."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from rest_framework.test import APIClient

from gpuportal.celery import app
from gpuportal.wire import commands
from scheduling.models import Deployment, DeploymentObserved, Event, Replica
from scheduling.services import deployments, reports
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.errors import Unavailable

pytestmark = pytest.mark.django_db

MiB = 1024**2
BROKEN = "SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered"
START, REPLACE = "inference.tasks.start_replica", "scheduling.tasks.replace_failed"


@pytest.fixture
def sent(monkeypatch, cluster, django_capture_on_commit_callbacks) -> list[tuple[str, list, float | None]]:
    """Tasks sent after each commit, recorded with their countdown: (task, args, countdown)."""
    recorded: list[tuple[str, list, float | None]] = []

    def send_task(name, args=None, queue=None, countdown=None, **kw):
        recorded.append((name, list(args or []), countdown))

    monkeypatch.setattr(app, "send_task", send_task)
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):  # only the queue's own keys
        client.delete(key)
    request_services.queue.cache_clear()
    return recorded


def broken(replicas: int = 1) -> Deployment:
    spec = DeploymentSpec(
        name="broken",
        source="/srv/models/truncated",
        replicas=replicas,
        override_bytes=100 * MiB,
        max_load_failures=3,
        backoff_s=2.0,
        backoff_max_s=3.0,
    )
    return create(spec, facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=100 * MiB))


def fail_load(capture, replica_id: str) -> None:
    with capture(execute=True):
        reports.report(replica_id, {"event": "failed", "kind": "load", "reason": BROKEN})


def pending() -> list[str]:
    return list(Replica.objects.filter(state=Replica.State.PENDING).values_list("pk", flat=True))


def test_a_failed_load_is_replaced_after_a_doubling_backoff_and_the_deployment_fails_at_the_limit(
    sent, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    with capture(execute=True):
        broken()
    (first,) = pending()
    waiting = request_services.queue().submit("broken", kind="generate", input="hi", params={}, owner="1")

    fail_load(capture, first)
    deployment = Deployment.objects.get()
    assert (deployment.status, deployment.observed.load_failures) == ("retrying", 1)
    assert sent[-1] == (REPLACE, ["broken"], 2.0)  # the backoff: 2 s
    assert pending() == [] and request_services.queue().get(waiting.id).status == "queued", "it waits"

    with capture(execute=True):
        (second,) = deployments.replace_failed("broken")
    assert sent[-1][0] == START and commands.decode(sent[-1][1][0]).replica_id == second
    fail_load(capture, second)
    assert sent[-1] == (REPLACE, ["broken"], 3.0)  # 4 s, capped at backoff_max_s

    with capture(execute=True):
        (third,) = deployments.replace_failed("broken")
    fail_load(capture, third)

    deployment.refresh_from_db()
    assert deployment.status == "failed" and deployment.observed.failed_reason == BROKEN
    assert sent[-1][0] != REPLACE, "given up: no more replacements"
    assert Replica.objects.count() == 3, "exactly max_load_failures loads were tried"
    assert Event.objects.filter(reason__startswith="failed: 3 load(s) in a row failed").exists()
    ended = request_services.queue().get(waiting.id)
    assert ended.status == "failed" and BROKEN in ended.error
    # A late replacement task finds nothing to do, and a new request is refused saying why.
    assert deployments.replace_failed("broken") == []
    with pytest.raises(Unavailable, match=r"deployment broken failed: SafetensorError"):
        request_services.submit("broken", kind="generate", input="hi", params={}, owner="1")
    assert Replica.objects.count() == 3


def test_an_operator_retries_a_failed_deployment_and_a_load_that_serves_resets_the_count(
    sent, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    with capture(execute=True):
        broken()
    DeploymentObserved.objects.update(load_failures=3, failed_reason=BROKEN)
    Replica.objects.update(state=Replica.State.FAILED)
    staff = APIClient()
    staff.force_authenticate(User.objects.create_user("ops", is_staff=True))

    refused = staff.post("/api/requests/", {"deployment": "broken", "input": "hi"}, format="json")
    assert refused.status_code == 503 and BROKEN in refused.json()["detail"]

    with capture(execute=True):
        response = staff.post("/api/deployments/broken/retry/")
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "ok" and response.json()["failed_reason"] == ""
    (fresh,) = pending()
    assert sent[-1][0] == START and commands.decode(sent[-1][1][0]).replica_id == fresh

    reports.report(fresh, {"event": "failed", "kind": "load", "reason": BROKEN})
    assert DeploymentObserved.objects.get().load_failures == 1
    with capture(execute=True):
        (again,) = deployments.replace_failed("broken")
    reports.report(again, {"event": "serving", "pid": 1})
    deployment = Deployment.objects.get()
    assert (deployment.status, deployment.observed.load_failures, deployment.observed.retry_at) == ("ok", 0, None)


def test_changing_a_failed_deployments_settings_tries_again(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        broken()
    DeploymentObserved.objects.update(load_failures=3, failed_reason=BROKEN)
    Replica.objects.update(state=Replica.State.FAILED)

    with django_capture_on_commit_callbacks(execute=True):
        deployments.update("broken", {"max_load_failures": 5})

    deployment = Deployment.objects.get()
    assert (deployment.status, deployment.max_load_failures) == ("ok", 5)
    assert len(pending()) == 1


def test_the_restart_settings_are_part_of_the_spec_and_bad_ones_are_refused(db, cluster):
    staff = APIClient()
    staff.force_authenticate(User.objects.create_user("ops", is_staff=True))
    body = {"name": "x", "model": {"source": "/nowhere"}, "restart": {"max_load_failures": 0}}
    response = staff.post("/api/deployments/", body, format="json")
    assert response.status_code == 400 and "max_load_failures" in str(response.json()["restart"])


# -- end to end: a real agent, replica processes and a control worker ---------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_truncated_checkpoint_ends_its_requests_with_the_load_error_and_serves_after_a_fix_and_a_retry(
    start_agent, control_worker, tmp_path
):
    from inference.management.commands.make_tiny_model import write_tiny_model
    from tests.support.processes import wait_until

    request_services.queue.cache_clear()
    start_agent("e2e", "1x4GiB")
    control_worker()
    staff = APIClient()
    staff.force_authenticate(User.objects.create_user("ops", is_staff=True))
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=9).path
    weights = model / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])  # the header reads; the tensors are cut short
    body = {
        "name": "broken",
        "model": {"source": str(model)},
        "memory": {"max_tokens": 64},
        "restart": {"max_load_failures": 2, "backoff_s": 0.2, "backoff_max_s": 0.5},
    }
    assert staff.post("/api/deployments/", body, format="json").status_code == 201

    answer = staff.post("/api/deployments/broken/infer/", {"input": "Hello", "timeout_s": 180}, format="json")

    assert answer.status_code == 503, answer.json()
    assert answer.json()["status"] == "failed" and "failed to load" in answer.json()["error"]
    assert "SafetensorError" in answer.json()["error"] or "safetensors" in answer.json()["error"].lower()
    shown = staff.get("/api/deployments/broken/").json()
    assert shown["status"] == "failed" and shown["failed_reason"]
    assert Replica.objects.count() == 2, "no more loads than max_load_failures"
    assert staff.post("/api/requests/", {"deployment": "broken", "input": "x"}, format="json").status_code == 503

    weights.write_bytes(intact)
    assert staff.post("/api/deployments/broken/retry/").status_code == 200
    wait_until(lambda: Replica.objects.filter(state="serving").exists(), 180, "the retried replica to serve")
    again = staff.post("/api/deployments/broken/infer/", {"input": "Hello", "timeout_s": 120}, format="json")
    assert again.status_code == 200 and again.json()["status"] == "done", again.json()
    assert staff.get("/api/deployments/broken/").json()["status"] == "ok"


def test_the_admin_retries_a_failed_deployment(sent, admin_client, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        dep = broken()
    DeploymentObserved.objects.update(load_failures=3, failed_reason=BROKEN)
    Replica.objects.update(state=Replica.State.FAILED)
    changelist = "/admin/scheduling/deployment/"
    assert "failed: SafetensorError" in admin_client.get(changelist).content.decode()

    with django_capture_on_commit_callbacks(execute=True):
        done = admin_client.post(changelist, {"_selected_action": [dep.pk], "action": "retry_deployments"})

    assert done.status_code == 302, done.content.decode()[-3000:]
    assert [str(m) for m in get_messages(done.wsgi_request)] == ["broken: load failures cleared; 1 replica(s) wanted"]
    assert Deployment.objects.get().status == "ok" and len(pending()) == 1
