"""A deployment that gave up after failed loads ends its waiting requests at once, with the load
error, instead of leaving them to wait for a replica that would fail the same way.
(How it comes to give up, after retries with a backoff, is tests/scheduling/test_crash_loop.py.)"""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from gpuportal.wire.requestqueue import RequestQueue
from scheduling.models import Event, Replica
from scheduling.services import reports
from scheduling.services import requests as request_services
from tests.support import factories

pytestmark = pytest.mark.django_db

BROKEN = "SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered"


@pytest.fixture
def rq() -> RequestQueue:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):  # only the queue's own keys
        client.delete(key)
    request_services.queue.cache_clear()
    return RequestQueue(client)


def waiting(rq: RequestQueue, deployment: str = "broken") -> str:
    return rq.submit(deployment, kind="generate", input="hi", params={}, owner="1", status="waking").id


def test_when_the_only_replica_fails_its_last_load_the_waiting_requests_end_with_its_error(
    rq, django_capture_on_commit_callbacks
):
    dep = factories.deployment("broken", max_load_failures=1)
    loading = factories.replica(dep, state=Replica.State.LOADING)
    first, second = waiting(rq), waiting(rq)

    with django_capture_on_commit_callbacks(execute=True):
        reports.report(loading.id, {"event": "failed", "kind": "load", "reason": BROKEN})

    for request_id in (first, second):
        ended = rq.get(request_id)
        assert ended.status == "failed", ended
        assert f"replica {loading.id[:8]} failed to load: {BROKEN}" in ended.error
        assert ended.error_kind == "load"  # answered 503 to a caller that waited, not 409
    assert rq.depth("broken") == 0
    event = Event.objects.get(reason__startswith="ended 2 waiting request(s)")
    assert event.deployment == "broken" and BROKEN in event.reason


def test_while_another_replica_serves_or_loads_the_requests_wait_for_it(rq, django_capture_on_commit_callbacks):
    dep = factories.deployment("broken", max_load_failures=1)
    failing = factories.replica(dep, state=Replica.State.LOADING)
    factories.replica(dep, state=Replica.State.PENDING)
    request_id = waiting(rq)

    with django_capture_on_commit_callbacks(execute=True):
        reports.report(failing.id, {"event": "failed", "kind": "oom", "reason": "out of memory"})

    assert rq.get(request_id).status == "waking" and rq.depth("broken") == 1


def test_a_crash_is_not_a_load_failure_its_requests_go_back_to_the_queue(
    rq, dispatched, django_capture_on_commit_callbacks
):
    dep = factories.deployment("flaky")
    crashed = factories.replica(dep, state=Replica.State.SERVING)
    request_id = waiting(rq, "flaky")

    with django_capture_on_commit_callbacks(execute=True):
        reports.report(crashed.id, {"event": "failed", "kind": "crash", "reason": "killed by signal 9"})

    assert rq.get(request_id).status != "failed" and rq.depth("flaky") == 1
    # ... and a fresh replica is woken for them, as before; the reconcile puts the lost one back.
    assert [task for _, task, _ in dispatched] == ["scheduling.tasks.wake", "scheduling.tasks.reconcile"]
