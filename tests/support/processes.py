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


def sweep_until_written_off(node: str, silence_s: float = 2.0) -> list[list[str]]:
    """Runs the heartbeat sweep, as beat would (beat runs in no test), until it writes `node` off
    for a silence of `silence_s`; returns what each sweep that wrote anything off wrote off.

    How long that may take once the node's agent is cut off: its lease lapses within its TTL,
    and a beat it sent just before may be applied as late as that call's expiry
    (gpuportal.wire.control.TIMEOUTS_S) on a loaded host, counting the silence afresh. Another
    node written off by the same sweep (its agent starved past its own lease) does not hide this
    one. A timeout says what each sweep wrote off, and how the books and Redis saw the nodes."""
    from gpuportal.wire.control import TIMEOUTS_S
    from scheduling.services import nodes

    swept: list[list[str]] = []

    def written_off() -> bool:
        if expired := nodes.expire_heartbeats(timeout_s=silence_s):
            swept.append(expired)
        return node in expired

    try:
        wait_until(written_off, TIMEOUTS_S["heartbeat"] + 30, f"the sweep to write {node} off")
    except AssertionError as err:
        raise AssertionError(f"{err}; the sweeps wrote off {swept}; {_liveness_now()}") from None
    return swept


def _liveness_now() -> str:
    """What the sweep judges by: each node's status and silence in the books, its lease and epoch
    in Redis, and the sweep's own hearing."""
    import redis
    from django.conf import settings
    from django.utils import timezone

    from gpuportal.wire import node_lease
    from scheduling.models import Hearing, Node

    client = redis.Redis.from_url(settings.REDIS_URL)
    now = timezone.now()
    rows = list(Node.objects.order_by("name").values_list("name", "status", "last_heartbeat"))
    held = node_lease.held(client, [name for name, _, _ in rows])
    said = [
        f"{name} {status}, {'never heard' if beat is None else f'silent {(now - beat).total_seconds():.1f} s'}, "
        f"lease {'held' if name in held else 'lapsed'}, epoch {node_lease.current_epoch(client, name)}"
        for name, status, beat in rows
    ]
    return f"nodes: {'; '.join(said)}; hearing: {Hearing.objects.first()}"


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
            output = {"text": answer, "finish_reason": "stop", "usage": usage}
            if (alternatives := request.params.get("logprobs")) is not None:
                # A token a character, as inference.token_logprobs.entries gives them.
                top = [["?", -1.0], ["!", -2.0]][:alternatives]
                output["logprobs"] = [{"token": c, "logprob": -0.5, "top": top} for c in answer]
                if request.params.get("echo"):  # the prompt's characters too, the first with none
                    output["prompt_logprobs"] = [
                        {"token": c, "logprob": None if i == 0 else -0.25, "top": None if i == 0 else top}
                        for i, c in enumerate(text)
                    ]
            self.queue.finish(request.id, self.replica_id, output)
