"""A request its caller asks stopped (cancelled through the REST API, or its stream's client gone)
ends where a replica generates it: `cancelled`, with what was generated until then, its KV blocks
free for the others at once. The serving loop runs in-process over real Redis; the web's side
through a live server. (tests/inference/test_serving.py runs real replica processes.)"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.requestqueue import STOPPED, RequestQueue, stops_key
from inference.batching import Batcher
from inference.devices import virtual_gpus
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.serving import Server, StopWhenAsked
from scheduling.models import Replica
from scheduling.services import queueing
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.cli import staff_cli
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import wait_until
from tests.support.serving import host_for

MiB = 1024**2
# Long enough that no answer ends by itself before its stop (min_tokens: no end of text either).
LONG = {"max_tokens": 600, "min_tokens": 600}
# Tokens a gated answer has before its replica's steps wait for the ask to stop it (see `gated`).
SOME = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-stopping"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture
def rq() -> Iterator[RequestQueue]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield RequestQueue(client)
    client.close()


Pause = tuple[int, Callable[[], Any], str]  # at so many tokens, until this holds, said so


@pytest.fixture
def gated(monkeypatch):
    """A replica's answers pause when one has so many tokens, until a condition holds (an ask to
    stop it has reached Redis, say): none can end by itself before it is stopped, however fast the
    machine. Returns `gate(server, *pauses)`, for a serving loop not started yet."""
    pauses: dict[str, list[Pause]] = {}
    every_step = Batcher.step

    def step(self: Batcher) -> list:
        waiting = pauses.get(getattr(self, "replica_id", ""))
        if waiting and any(len(s.generated) >= waiting[0][0] for s in self.running):
            _, condition, what = waiting.pop(0)
            wait_until(condition, 30, what)
        return every_step(self)

    def gate(server: Server, *at: Pause) -> None:
        replica = server.host.replica_id
        pauses[replica] = sorted(at, key=lambda pause: pause[0])
        made = server._batcher_for

        def batcher_for(paged: Any) -> Batcher:  # the batch made at the first request knows its replica
            batch = made(paged)
            batch.replica_id = replica  # type: ignore[attr-defined]
            return batch

        server._batcher_for = batcher_for  # type: ignore[method-assign]

    monkeypatch.setattr(Batcher, "step", step)
    return gate


def asked(rq: RequestQueue, replica_id: str, at: int = SOME) -> Pause:
    """At `at` tokens, until an ask to stop one of the replica's requests has reached Redis."""
    return (at, lambda: rq.redis.exists(stops_key(replica_id)), "the ask to stop to reach Redis")


def serve(host: Any, rq: RequestQueue, deployment: str, gate: Any = None, *pauses: Pause) -> Server:
    server = Server(host, rq, deployment, poll_s=0.05)
    if gate is not None:
        gate(server, *pauses)
    server.start()
    return server


def halt(server: Server) -> None:
    server.stopped.set()
    server.join(10)


def test_a_generation_asked_stopped_ends_cancelled_with_its_text_so_far_and_frees_its_blocks(tiny, rq, gated):
    model, tokenizer = tiny
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    host = host_for(model, tokenizer)
    long = rq.submit(deployment, kind="generate", input="Once upon", params={**LONG, "stream": True}, owner="u")
    server = serve(host, rq, deployment, gated, asked(rq, host.replica_id))
    try:
        pieces, _ = rq.read_stream(long.id, 0, 30)  # it generates
        assert pieces and rq.stop(long.id, "cancelled by its owner") == "stopping"
        other = rq.submit(deployment, kind="generate", input="Hello", params={"max_tokens": 5}, owner="u")
        stopped, answered = rq.wait(long.id, 30), rq.wait(other.id, 30)
    finally:
        halt(server)

    assert stopped is not None and stopped.status == "cancelled", stopped
    assert stopped.error == "cancelled by its owner"
    output = stopped.output
    assert output["finish_reason"] == STOPPED
    assert 0 < output["usage"]["completion_tokens"] < LONG["max_tokens"], output["usage"]
    streamed = "".join(rq.read_stream(long.id, 0, 0)[0])
    assert output["text"].startswith(streamed), "the answer is what was streamed, and what had not settled yet"
    assert stopped.started_at and stopped.first_token_at and stopped.finished_at
    # The others go on: one asked next is answered, and every block of the pool is free again.
    assert answered is not None and answered.status == "done"
    assert host.paged.pool.blocks_available == host.paged.pool.blocks_total, "free, or kept by the prefix cache"


def test_a_generation_alone_on_a_replica_without_a_pool_is_stopped_too(tiny, rq, monkeypatch):
    model, tokenizer = tiny
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    host = host_for(model, tokenizer, paged=False)
    # As `gated` holds a batch: a few tokens in, generate() waits for the ask to reach Redis.
    every_call = StopWhenAsked.__call__

    def gated(self: StopWhenAsked, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        if input_ids.shape[1] > SOME and not getattr(self, "waited", False):
            wait_until(lambda: rq.redis.exists(stops_key(host.replica_id)), 30, "the ask to stop to reach Redis")
            self.waited = True
        return every_call(self, input_ids, scores, **kwargs)

    monkeypatch.setattr(StopWhenAsked, "__call__", gated)
    long = rq.submit(deployment, kind="generate", input="Once upon", params={**LONG, "stream": True}, owner="u")
    server = serve(host, rq, deployment)
    try:
        assert rq.read_stream(long.id, 0, 30)[0], "it generates"
        assert rq.stop(long.id, "its caller left") == "stopping"
        stopped = rq.wait(long.id, 30)
    finally:
        halt(server)

    assert stopped is not None and (stopped.status, stopped.error) == ("cancelled", "its caller left"), stopped
    assert stopped.output["finish_reason"] == STOPPED
    assert 0 < stopped.output["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_request_asked_stopped_and_then_given_back_ends_unrun_at_the_replica_that_takes_it(tiny, rq):
    model, tokenizer = tiny
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    request = rq.submit(deployment, kind="generate", input="Hello", params={"max_tokens": 5}, owner="u")
    assert rq.take(deployment, "gone", timeout=1).id == request.id
    assert rq.stop(request.id, "cancelled by its owner") == "stopping"
    # Its replica died before it read the ask: the control plane gives its requests back.
    rq.requeue_from("gone", max_attempts=3, reason="its replica died")

    server = serve(host_for(model, tokenizer), rq, deployment)
    try:
        ended = rq.wait(request.id, 30)
    finally:
        halt(server)

    assert ended is not None and (ended.status, ended.error) == ("cancelled", "cancelled by its owner"), ended
    assert ended.output is None, "nothing of it ran again"


def test_only_a_request_that_has_not_ended_is_stopped(rq):
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    waiting = rq.submit(deployment, kind="generate", input="x", params={}, owner="u")
    assert rq.stop(waiting.id, "cancelled by its owner") == "cancelled"
    assert rq.get(waiting.id).status == "cancelled"
    assert rq.stop(waiting.id, "again") == "" and rq.stop("no-such-request", "x") == ""

    taken = rq.submit(deployment, kind="generate", input="x", params={}, owner="u")
    assert rq.take(deployment, "r1", timeout=1).id == taken.id
    assert rq.stop(taken.id, "its caller left") == "stopping"
    assert rq.asked_stops("r1") == {taken.id: "its caller left"}
    assert rq.asked_stops("r1") == {}, "read once"


# -- the web's side: a cancel through the REST API, a stream's client gone -----------------------


@pytest.fixture
def deployment(transactional_db, tiny) -> Replica:
    """Deployment "talk" with one serving replica in the books, whose loop runs here."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    request_services.queue.cache_clear()
    request_services.queue().fail_queued("talk", reason="left over from another test")
    made = factories.deployment(name="talk", model_source="tiny", memory_override_bytes=MiB)
    return Replica.objects.create(deployment=made, state=Replica.State.SERVING)


def test_a_running_request_cancelled_through_the_api_ends_cancelled_with_its_text_so_far(tiny, rq, gated, deployment):
    client = APIClient()
    client.force_authenticate(User.objects.create_user("alice"))
    host = host_for(*tiny)
    host.replica_id = deployment.id
    submitted = client.post("/api/requests/", {"deployment": "talk", "input": "Once", "params": LONG}, format="json")
    server = serve(host, rq, "talk", gated, asked(rq, host.replica_id))
    try:
        request_id = submitted.json()["id"]
        wait_until(lambda: rq.get(request_id).status == "running", 30, "the request to run")
        cancelled = client.delete(f"/api/requests/{request_id}/")
    finally:
        halt(server)

    assert cancelled.status_code == 200, cancelled.json()
    body = cancelled.json()
    assert (body["status"], body["error"]) == ("cancelled", "cancelled by its owner")
    assert (
        body["output"]["finish_reason"] == STOPPED
        and 0 < body["output"]["usage"]["completion_tokens"] < LONG["max_tokens"]
    )
    again = client.delete(f"/api/requests/{request_id}/")
    assert again.status_code == 409 and "it has ended" in again.json()["detail"]


def streamed(live_server: Any, key: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed /v1 completion of LONG tokens from `talk`, opened as its client opens it."""
    where = urlsplit(live_server.url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    body = json.dumps({"model": "talk", "prompt": "Once", "stream": True, **LONG})
    connection.request(
        "POST", "/v1/completions", body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    return connection, connection.getresponse()


def test_a_stream_whose_client_leaves_stops_its_request_at_the_replica(tiny, rq, gated, deployment, live_server):
    key = Token.objects.create(user=User.objects.create_user("bob")).key
    host = host_for(*tiny)
    host.replica_id = deployment.id
    left = threading.Event()
    # The answer waits for its client to leave; then a server notices a client gone only as a write
    # fails, so it goes on (each token a write) until the web's ask to stop it has reached Redis.
    client_left = (SOME, left.is_set, "the client to leave")
    server = serve(host, rq, "talk", gated, client_left, asked(rq, host.replica_id, at=SOME + 40))
    connection, response = streamed(live_server, key)
    try:
        assert response.status == 200
        first = next(line for line in response if line.startswith(b"data: "))
        request_id = json.loads(first.removeprefix(b"data: "))["id"].removeprefix("cmpl-")
        response.close()  # the client leaves mid-answer (Ctrl-C): its socket is closed
        connection.close()
        left.set()
        ended = rq.wait(request_id, 30)
    finally:
        left.set()
        connection.close()
        halt(server)

    assert ended is not None and ended.status == "cancelled", ended
    assert ended.error == "its caller left: the stream was closed"
    assert 0 < ended.output["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_cancel_its_replica_has_not_acted_on_yet_is_a_202_and_the_request_still_ends_cancelled(
    tiny, rq, deployment, monkeypatch
):
    monkeypatch.setattr(queueing, "STOP_WAIT_S", 0.1)
    client = APIClient()
    client.force_authenticate(User.objects.create_user("carol"))
    request_id = client.post("/api/requests/", {"deployment": "talk", "input": "Hi"}, format="json").json()["id"]
    # Its replica holds it, and reads no ask for now (a long forward pass, a freeze).
    assert rq.take("talk", deployment.id, timeout=1).id == request_id

    asked_now = client.delete(f"/api/requests/{request_id}/")

    assert asked_now.status_code == 202 and asked_now.json()["status"] == "dispatched", asked_now.json()
    rq.requeue_from(deployment.id, max_attempts=3, reason="its replica died")  # before it read the ask
    server = serve(host_for(*tiny), rq, "talk")
    try:
        ended = rq.wait(request_id, 30)
    finally:
        halt(server)
    assert ended is not None and (ended.status, ended.error) == ("cancelled", "cancelled by its owner"), ended


def test_a_stream_whose_request_is_cancelled_meanwhile_ends_with_an_error_event_saying_so(
    tiny, rq, gated, deployment, live_server
):
    user = User.objects.create_user("dave")
    key = Token.objects.create(user=user).key
    host = host_for(*tiny)
    host.replica_id = deployment.id
    server = serve(host, rq, "talk", gated, asked(rq, host.replica_id))
    connection, response = streamed(live_server, key)
    try:
        events = (line.removeprefix(b"data: ") for line in response if line.startswith(b"data: "))
        request_id = json.loads(next(events))["id"].removeprefix("cmpl-")
        client = APIClient()
        client.force_authenticate(user)
        assert client.delete(f"/api/requests/{request_id}/").status_code == 200
        rest = list(events)
    finally:
        connection.close()
        halt(server)

    assert rest[-1].strip() == b"[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error == {
        "message": f"request {request_id} was cancelled by its owner",
        "type": "cancelled",
        "param": None,
        "code": None,
    }


def test_the_command_line_lists_requests_and_cancels_them_by_the_start_of_their_ids(
    tiny, rq, gated, deployment, live_server, capsys
):
    cli = staff_cli(live_server, capsys)
    waiting = rq.submit("talk", kind="generate", input="Hi", params={}, owner="someone")
    code, out, _ = cli("requests", "talk")
    assert code == 0 and waiting.id[:12] in out and "queued" in out

    assert cli("cancel", waiting.id[:8]) == (0, f"{waiting.id[:12]}: cancelled before it ran", "")

    host = host_for(*tiny)
    host.replica_id = deployment.id
    long = rq.submit("talk", kind="generate", input="Once", params=LONG, owner="someone")
    server = serve(host, rq, "talk", gated, asked(rq, host.replica_id))
    try:
        wait_until(lambda: rq.get(long.id).status == "running", 30, "the request to run")
        code, out, _ = cli("cancel", long.id[:8])
    finally:
        halt(server)
    stopped = rq.get(long.id)
    assert code == 0 and out == f"{long.id[:12]}: stopped after {stopped.output['usage']['completion_tokens']} token(s)"

    code, out, _ = cli("requests", "--status", "cancelled")
    assert code == 0 and waiting.id[:12] in out and long.id[:12] in out
    code, out, err = cli("cancel", waiting.id, "zz")
    assert code == 1 and out == ""
    assert f"{waiting.id}: request {waiting.id} is cancelled: it has ended, and there is nothing to cancel" in err
    assert "zz: not a request id" in err


def test_a_v1_call_whose_request_is_cancelled_while_it_waits_is_a_409_its_client_does_not_retry(
    rq, deployment, live_server
):
    import openai

    user = User.objects.create_user("erin")
    key = Token.objects.create(user=user).key
    raised: list[Exception] = []

    def call() -> None:
        with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=2, timeout=30) as client:
            try:
                client.completions.create(model="talk", prompt="Hi", max_tokens=5)
            except openai.APIError as error:
                raised.append(error)

    begun = time.time()
    caller = threading.Thread(target=call)
    caller.start()

    def mine() -> list[Any]:  # this test's: the owner's index may hold an earlier run's
        found = rq.recent(str(user.pk), deployment="talk", status=None, offset=0, limit=10)[0]
        return [r for r in found if r.created_at and r.created_at >= begun]

    # No replica serves it: it waits until it is cancelled.
    (waiting,) = wait_until(mine, 30, "the call's request to be queued")
    client = APIClient()
    client.force_authenticate(user)
    assert client.delete(f"/api/requests/{waiting.id}/").status_code == 200
    caller.join(30)

    (error,) = raised
    assert isinstance(error, openai.ConflictError) and error.response.headers["x-should-retry"] == "false"
    assert error.body["message"] == f"request {waiting.id} was cancelled by its owner"
    assert len(mine()) == 1, "the client did not send it again"
