"""For tests that run other processes (agents, replicas, `up`): where they find the test
database, and waiting on what they do, whose only trace is rows or HTTP answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from gpuportal.wire.requestqueue import TOO_LONG

T = TypeVar("T")


def database_url_of_this_test() -> str:
    """The URL of the database this test runs on (pytest-django's test database)."""
    from django.db import connection

    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def wait_until(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    # Another process writes to PostgreSQL or answers HTTP: there is no Event to block on, so poll
    # with a deadline that fails the test with what was awaited.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class StandIn(threading.Thread):
    """Serves a deployment's queue the way a replica does, without a model: upper-cases text,
    streams it in three pieces when asked, and fails input that says 'too long' as a model would.
    For tests of the request path above the replica (tests/inference/test_serving.py runs real replicas)."""

    def __init__(self, replica_id: str, count: int, deployment: str = "tiny"):
        super().__init__(daemon=True)
        from django.conf import settings

        from gpuportal.wire.requestqueue import RequestQueue

        self.replica_id, self.count, self.deployment = replica_id, count, deployment
        self.queue = RequestQueue.from_url(settings.REDIS_URL)

    def run(self) -> None:
        for _ in range(self.count):
            request = self.queue.take(self.deployment, self.replica_id, timeout=10)
            if request is None:
                return
            self.queue.start(request.id, self.replica_id)
            text = str(request.input[-1]["content"] if request.kind == "chat" else request.input)
            if "too long" in text:
                self.queue.fail(request.id, self.replica_id, "input too long: 300 prompt tokens", TOO_LONG)
                continue
            answer = text.upper()
            if request.params.get("stream"):
                third = max(1, len(answer) // 3)
                for start in range(0, len(answer), third):
                    self.queue.chunk(request.id, answer[start : start + third])
            usage = {"prompt_tokens": len(text), "completion_tokens": len(answer), "total_tokens": 2 * len(text)}
            self.queue.finish(request.id, self.replica_id, {"text": answer, "finish_reason": "stop", "usage": usage})
