"""Inference requests: the Redis queue's guarantees, and the REST path (a stand-in replica thread
serves the queue here; tests/inference/test_serving.py runs real replica processes)."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpuportal.wire import sampling
from gpuportal.wire.requestqueue import (
    REQUEST_PREFIX,
    STREAM_RESTART,
    Fence,
    KeyTakenOver,
    NotTaken,
    RequestQueue,
    StaleEpoch,
    StreamSplice,
    WrittenOff,
    live_key,
    processing_key,
    queue_key,
)
from gpuportal.wire.requestqueue.protocol import BELL_TTL_S, BLOCK_SLICE_S, stream_bell_key, stream_readers_key
from gpuportal.wire.requestqueue.web import SHARED_READ_WAIT_S
from inference.devices import virtual_gpus
from inference.serving import Server
from scheduling.api.inputs import SamplingInput
from scheduling.api.requests import InferInput, fast_inputs, params_of
from scheduling.models import Replica
from scheduling.services import reports
from scheduling.services import requests as request_services
from scheduling.services.errors import InvalidInput, NotFound
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import StandIn, wait_until

MiB = 1024**2


@pytest.fixture
def rq() -> RequestQueue:
    client = redis.Redis.from_url(settings.REDIS_URL)
    # Only the queue's own keys: REDIS_URL may point at a developer's Redis.
    for key in client.scan_iter("gp:*"):
        client.delete(key)
    return RequestQueue(client)


def submit(rq: RequestQueue, deployment: str = "tiny", text: str = "hi") -> str:
    return rq.submit(deployment, kind="generate", input=text, params={}, owner="1").id


# -- the queue -----------------------------------------------------------------------------------


def test_requests_are_taken_oldest_first_and_end_with_their_output(rq):
    first, second = submit(rq, text="one"), submit(rq, text="two")

    taken = rq.take("tiny", "replica-a", timeout=1)
    assert (taken.id, taken.status, taken.replica, taken.attempts) == (first, "dispatched", "replica-a", 1)
    rq.start(first, "replica-a")
    assert rq.get(first).status == "running"
    rq.finish(first, "replica-a", {"text": "ONE"})

    done = rq.wait(first, timeout=1)
    assert done.status == "done" and done.output == {"text": "ONE"}
    assert done.created_at <= done.dispatched_at <= done.started_at <= done.finished_at
    assert rq.redis.llen(processing_key("replica-a")) == 0
    assert rq.take("tiny", "replica-b", timeout=1).id == second


def test_a_request_taken_by_a_waiting_replica_is_stamped_when_it_was_taken(rq):
    taken: list = []
    waiting = threading.Thread(target=lambda: taken.append(rq.take("tiny", "a", timeout=10)))
    waiting.start()
    # The replica blocks in Redis before the request exists (a bounded wait for that, not a sleep).
    for _ in range(1000):
        if any(c.get("cmd") == "blmove" for c in rq.redis.client_list()):
            break
    request_id = submit(rq)
    waiting.join(10)

    request = taken[0]
    assert request.id == request_id
    assert request.created_at <= request.dispatched_at


def test_a_take_still_works_after_redis_forgot_its_scripts(rq):
    request_id = submit(rq)
    rq.redis.script_flush()  # what a restarted Redis has forgotten

    taken = rq.take("tiny", "a", timeout=1)

    assert taken is not None and taken.id == request_id and taken.status == "dispatched" and taken.attempts == 1


def test_a_request_moved_but_never_marked_is_served_by_the_next_take(rq):
    request_id = submit(rq)
    # A take whose connection broke between the move and its marking.
    rq.redis.lmove(queue_key("tiny"), processing_key("a"), "RIGHT", "LEFT")

    taken = rq.take("tiny", "a", timeout=0)

    assert taken is not None and taken.id == request_id and taken.replica == "a"
    assert rq.take("tiny", "a", timeout=0) is None


def test_what_a_dead_replica_had_taken_goes_back_to_the_head_of_the_queue(rq):
    lost, waiting = submit(rq, text="lost"), submit(rq, text="waiting")
    assert rq.take("tiny", "dead", timeout=1).id == lost

    assert rq.requeue_from("dead", max_attempts=3, reason="replica died") == {lost: "requeued"}

    again = rq.take("tiny", "alive", timeout=1)
    assert again.id == lost and again.attempts == 2, "first in line again, its attempts counted"
    assert rq.take("tiny", "alive", timeout=1).id == waiting


def test_a_request_that_used_its_attempts_fails_saying_why(rq):
    request_id = submit(rq)
    for replica in ("a", "b"):
        rq.take("tiny", replica, timeout=1)
        rq.requeue_from(replica, max_attempts=2, reason=f"replica {replica} died")

    failed = rq.get(request_id)
    assert failed.status == "failed" and failed.error == "replica b died; gave up after 2 attempt(s)"
    assert rq.depth("tiny") == 0


def test_a_request_taken_as_its_replica_sleeps_is_given_back_without_costing_an_attempt(rq):
    request_id = submit(rq)
    taken = rq.take("tiny", "sleepy", timeout=1)

    rq.give_back(taken, "sleepy")

    back = rq.take("tiny", "other", timeout=1)
    assert back.id == request_id and back.attempts == 1


def test_a_written_off_replica_gives_back_nothing_that_is_no_longer_its(rq):
    # Its request was given back for it and another replica took it; the orphan, stopping at the
    # end of its adoption window, must not take it from the new owner.
    request_id = submit(rq)
    taken = rq.take("tiny", "orphan", timeout=1)
    rq.write_off("orphan")
    rq.requeue_from("orphan", max_attempts=3, reason="lost with its node")
    assert rq.take("tiny", "replacement", timeout=1).id == request_id

    rq.give_back(taken, "orphan")

    now = rq.get(request_id)
    assert (now.status, now.replica) == ("dispatched", "replacement") and rq.depth("tiny") == 0


def test_only_a_waiting_request_can_be_cancelled(rq):
    waiting, taken = submit(rq), submit(rq)
    rq.redis.lrem(queue_key("tiny"), 1, taken)  # as if a replica held it
    assert rq.cancel(waiting) and rq.get(waiting).status == "cancelled"
    assert not rq.cancel(taken)


def test_waiters_block_until_the_end_and_all_of_them_see_it(rq):
    request_id = submit(rq)
    seen: list[str] = []
    ready = threading.Barrier(3)

    def waiter() -> None:
        ready.wait()
        seen.append(RequestQueue.from_url(settings.REDIS_URL).wait(request_id, timeout=10).status)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    ready.wait()
    rq.take("tiny", "a", timeout=1)
    rq.finish(request_id, "a", {"text": "x"})
    for thread in threads:
        thread.join()
    assert seen == ["done", "done"]


def test_a_wait_longer_than_the_clients_socket_timeout_ends_with_the_request_not_an_error(rq):
    # redis-py gives clients a 5 s socket timeout by default: one blocking read longer than that
    # raised TimeoutError (an /infer/ answered 500 while a replacement replica loaded).
    request_id = submit(rq)
    impatient = RequestQueue(redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.5))

    request = impatient.wait(request_id, timeout=3.5)

    assert request is not None and request.status == "queued"


def test_results_are_fenced_by_the_failover_epoch(rq):
    first, second = submit(rq), submit(rq)
    rq.take("tiny", "old", timeout=1)
    rq.take("tiny", "new", timeout=1)
    assert rq.raise_epoch("pair", 1) == 1
    assert rq.raise_epoch("pair", 2) == 2
    assert rq.raise_epoch("pair", 1) == 2, "a late raise of an older epoch must not lower the fence"

    with pytest.raises(StaleEpoch):
        rq.finish(first, "old", {"text": "late"}, fence=Fence("pair", 1))
    rq.finish(second, "new", {"text": "on time"}, fence=Fence("pair", 2))

    assert rq.get(first).status == "dispatched" and rq.get(first).output is None
    assert rq.redis.lrange(processing_key("old"), 0, -1) == [first.encode()], "kept for its re-queue"
    done = rq.get(second)
    assert done.status == "done" and done.output == {"text": "on time"}
    assert rq.wait(second, timeout=1).status == "done" and not rq.redis.llen(processing_key("new"))


def test_a_written_off_replicas_late_answer_is_refused_and_the_new_one_lands(rq):
    # A replica on a node that went silent keeps running; the control plane gave its request back,
    # and another replica took it (fence the replicas of a partitioned node).
    request_id = submit(rq)
    assert rq.take("tiny", "partitioned", timeout=1).id == request_id
    assert rq.requeue_from("partitioned", max_attempts=3, reason="lost with its node") == {request_id: "requeued"}

    with pytest.raises(NotTaken):
        rq.finish(request_id, "partitioned", {"text": "late"})
    assert rq.get(request_id).status == "queued", "a refused answer changes nothing"

    assert rq.take("tiny", "replacement", timeout=1).id == request_id
    with pytest.raises(NotTaken):
        rq.fail(request_id, "partitioned", "late failure", "error")
    rq.finish(request_id, "replacement", {"text": "on time"})
    done = rq.wait(request_id, timeout=1)
    assert done.status == "done" and done.output == {"text": "on time"} and done.replica == "replacement"


def test_a_written_off_replica_takes_nothing_more_and_a_request_its_take_moved_goes_back_first(rq):
    # Its agent is gone (or cut off) but it still runs: once written off it must take nothing,
    # or a request would be left with a replica nobody hears from again.
    held, waiting = submit(rq, text="held"), submit(rq, text="waiting")
    assert rq.take("tiny", "orphan", timeout=1).id == held
    rq.write_off("orphan")
    assert rq.requeue_from("orphan", max_attempts=3, reason="lost with its node") == {held: "requeued"}

    with pytest.raises(WrittenOff, match="replica orphan was written off by the control plane"):
        rq.take("tiny", "orphan", timeout=1)
    assert not rq.redis.llen(processing_key("orphan")), "what its take moved went back"
    assert [rq.take("tiny", "replacement", timeout=1).id for _ in range(2)] == [held, waiting], "in their order"

    # A take that moved a request just before the write-off and marks it just after gives it back.
    late = submit(rq, text="late")
    rq.redis.lmove(queue_key("tiny"), processing_key("racer"), "RIGHT", "LEFT")
    rq.write_off("racer")
    with pytest.raises(WrittenOff):
        rq.take("tiny", "racer", timeout=0)
    assert rq.get(late).status == "queued" and rq.take("tiny", "replacement", timeout=1).id == late


def test_a_request_given_back_before_its_replica_starts_it_stays_queued_for_the_next(rq):
    # The replica took it, was written off and had it given back, then got round to starting it:
    # a `running` written over `queued` would make every take pass it by.
    request_id = submit(rq)
    assert rq.take("tiny", "orphan", timeout=1).id == request_id
    rq.write_off("orphan")
    rq.requeue_from("orphan", max_attempts=3, reason="lost with its node")

    rq.start(request_id, "orphan")
    rq.started({request_id: 1.0}, "orphan")

    assert rq.get(request_id).status == "queued"
    assert rq.take("tiny", "replacement", timeout=1).id == request_id
    rq.start(request_id, "replacement")
    assert rq.get(request_id).status == "running"


def test_a_streamed_request_run_again_after_its_replica_died_sends_no_text_twice(rq):
    request_id = rq.submit("tiny", kind="generate", input="hi", params={"stream": True}, owner="1").id
    rq.take("tiny", "dead", timeout=1)
    for piece in ("Once", " upon"):
        rq.chunk(request_id, piece)
    rq.requeue_from("dead", max_attempts=3, reason="replica dead died")
    rq.take("tiny", "alive", timeout=1)
    for piece in ("Once", " up", "on a", " time"):  # the re-run starts over, in other pieces
        rq.chunk(request_id, piece)
    rq.finish(request_id, "alive", {"text": "Once upon a time"})

    chunks, ended = rq.read_stream(request_id, 0, timeout=1)
    splice = StreamSplice()
    sent = [text for chunk in chunks if (text := splice.feed(chunk))]

    assert ended and "".join(sent) == "Once upon a time"
    assert sent == ["Once", " upon", " a", " time"]


def test_a_splice_sends_a_sampled_rerun_only_beyond_what_was_sent():
    splice = StreamSplice()
    assert [splice.feed(c) for c in ("abc", "de", STREAM_RESTART, "xy", "zwv", "q")] == ["abc", "de", "", "", "", "q"]


def test_streamed_chunks_arrive_in_order_then_the_end(rq):
    request_id = submit(rq)
    rq.take("tiny", "a", timeout=1)
    for piece in ("Hel", "lo", "!"):
        rq.chunk(request_id, piece)
    rq.finish(request_id, "a", {"text": "Hello!"})

    chunks, ended = rq.read_stream(request_id, 0, timeout=1)
    assert chunks == ["Hel", "lo", "!"] and ended


def test_a_steps_pieces_of_several_streams_land_in_one_call_each_in_its_own_order(rq):
    first, second = submit(rq), submit(rq)
    rq.take("tiny", "a", timeout=1)
    rq.take("tiny", "a", timeout=1)

    rq.chunks([(first, "Hel"), (second, "Good")], "a")
    rq.chunks([(first, "lo"), (second, "bye")], "a")
    rq.finish(first, "a", {"text": "Hello"})
    rq.finish(second, "a", {"text": "Goodbye"})

    assert rq.read_stream(first, 0, timeout=1) == (["Hel", "lo"], True)
    assert rq.read_stream(second, 0, timeout=1) == (["Good", "bye"], True)
    # A ring nobody took (every request's end rings) is kept a minute, not the request's day.
    rq.finish(submit(rq), "", {"text": "unstreamed"})
    assert all(0 < rq.redis.ttl(k) <= BELL_TTL_S for k in rq.redis.keys("gp:stream:*:bell"))


def test_a_stream_reader_blocks_until_a_piece_rings_rather_than_polling(rq, monkeypatch):
    request_id = submit(rq)
    rq.take("tiny", "a", timeout=1)
    blocking = threading.Event()
    reads = []
    real_blpop, real_pipeline = rq.redis.blpop, rq.redis.pipeline

    def blpop(*args, **kwargs):
        blocking.set()
        return real_blpop(*args, **kwargs)

    def pipeline(*args, **kwargs):
        reads.append(1)
        return real_pipeline(*args, **kwargs)

    monkeypatch.setattr(rq.redis, "blpop", blpop)
    monkeypatch.setattr(rq.redis, "pipeline", pipeline)
    got = []
    reader = threading.Thread(target=lambda: got.append(rq.read_stream(request_id, 0, timeout=60)))
    reader.start()
    assert blocking.wait(10), "the reader found nothing and blocked"
    writer = RequestQueue(redis.Redis.from_url(settings.REDIS_URL))

    writer.chunk(request_id, "Hel", "a")
    reader.join(60)

    assert got == [(["Hel"], False)]
    assert len(reads) == 2, "one read before blocking, one after the ring: no polling in between"


def test_a_reader_among_several_of_one_stream_passes_on_the_ring_that_woke_it_and_waits_short(rq, monkeypatch):
    request_id = submit(rq)
    rq.take("tiny", "a", timeout=1)
    waits: list[float] = []
    blocking = threading.Event()
    real_blpop = rq.redis.blpop

    def blpop(keys, timeout):
        waits.append(timeout)
        blocking.set()
        return real_blpop(keys, timeout)

    monkeypatch.setattr(rq.redis, "blpop", blpop)
    got = []

    def follow() -> None:
        with rq.reading(request_id):
            got.append(rq.read_stream(request_id, 0, timeout=60))

    with rq.reading(request_id):  # another reader of the same stream: this test
        reader = threading.Thread(target=follow)
        reader.start()
        assert blocking.wait(10), "the reader found nothing and waits"
        writer = RequestQueue(redis.Redis.from_url(settings.REDIS_URL))
        writer.chunk(request_id, "Hel", "a")
        reader.join(60)
        # The writer rang once, and the ring woke the reader: what is left is the ring it passed on.
        passed = writer.redis.lpop(stream_bell_key(request_id))
        still = int(rq.redis.get(stream_readers_key(request_id)))
    alone = []
    monkeypatch.setattr(rq.redis, "blpop", lambda keys, timeout: alone.append(timeout) or real_blpop(keys, timeout))
    with rq.reading(request_id):
        rq.read_stream(request_id, 1, timeout=0.2)
        writer.chunk(request_id, "lo", "a")
        assert rq.read_stream(request_id, 1, timeout=1) == (["lo"], False)
    left_alone = writer.redis.llen(stream_bell_key(request_id))

    assert got == [(["Hel"], False)]
    assert passed == b"1", "the ring passed on, for the other reader waiting"
    # Its waits were short while another read the stream too: a ring it missed costs it no slice.
    assert waits and all(wait <= SHARED_READ_WAIT_S for wait in waits)
    assert still == 1, "the first reader counted out as it left, the other still in"
    assert alone[0] > SHARED_READ_WAIT_S, "alone, it waits on the bell"
    assert left_alone == 0, "alone, it passes no ring on (the writer's it silenced before its read)"
    assert int(rq.redis.get(stream_readers_key(request_id))) == 0, "each reader counted out as it left"
    assert SHARED_READ_WAIT_S < BLOCK_SLICE_S


# -- the REST path -------------------------------------------------------------------------------


@pytest.fixture
def serving_deployment(db, rq, tiny_model_dir):
    """A deployment with one replica marked serving (no process: a thread answers its queue)."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    deployment = factories.deployment(name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB)
    replica = Replica.objects.create(deployment=deployment, state=Replica.State.SERVING)
    request_services.queue.cache_clear()
    return replica


@pytest.fixture(params=["token", "forced"])
def user_client(request, db) -> APIClient:
    """Alice's client, both ways: with a token header, /infer/ takes its fast path
    (scheduling.api.requests.fast_inputs); authenticated without one, it goes the DRF way."""
    client = APIClient()
    user = User.objects.create_user("alice")
    if request.param == "token":
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    else:
        client.force_authenticate(user)
    return client


def test_infer_runs_the_request_and_answers_with_its_output(serving_deployment, user_client):
    StandIn(serving_deployment.id, 1).start()

    response = user_client.post("/api/deployments/tiny/infer/", {"input": "hello", "timeout_s": 10}, format="json")

    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "done" and body["output"]["text"] == "HELLO"
    assert body["replica"] == serving_deployment.id and body["kind"] == "generate"
    assert all(body[k] for k in ("created_at", "dispatched_at", "started_at", "finished_at"))


def test_infer_answers_202_with_the_id_when_the_timeout_passes_first(serving_deployment, user_client):
    response = user_client.post("/api/deployments/tiny/infer/", {"input": "hello", "timeout_s": 0.2}, format="json")

    assert response.status_code == 202 and response.json()["status"] == "queued"
    request_id = response.json()["id"]
    StandIn(serving_deployment.id, 1).run()
    assert user_client.get(f"/api/requests/{request_id}/").json()["status"] == "done"


def test_submit_then_poll_and_only_the_owner_or_staff_sees_it(serving_deployment, user_client):
    response = user_client.post("/api/requests/", {"deployment": "tiny", "input": "poll me"}, format="json")
    assert response.status_code == 202
    request_id = response.json()["id"]
    StandIn(serving_deployment.id, 1).run()

    assert user_client.get(f"/api/requests/{request_id}/").json()["output"]["text"] == "POLL ME"
    stranger = APIClient()
    stranger.force_authenticate(User.objects.create_user("mallory"))
    assert stranger.get(f"/api/requests/{request_id}/").status_code == 404
    staff = APIClient()
    staff.force_authenticate(User.objects.create_user("ops", is_staff=True))
    assert staff.get(f"/api/requests/{request_id}/").status_code == 200
    assert APIClient().get(f"/api/requests/{request_id}/").status_code == 401


def test_an_input_too_long_for_the_model_is_a_400(serving_deployment, user_client):
    StandIn(serving_deployment.id, 1).start()
    response = user_client.post("/api/deployments/tiny/infer/", {"input": "too long", "timeout_s": 10}, format="json")
    assert response.status_code == 400 and response.json()["input"] == ["input too long: 300 prompt tokens"]


def test_a_waiting_request_can_be_cancelled_by_its_owner(serving_deployment, user_client):
    request_id = user_client.post("/api/requests/", {"deployment": "tiny", "input": "x"}, format="json").json()["id"]

    response = user_client.delete(f"/api/requests/{request_id}/")

    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert user_client.delete(f"/api/requests/{request_id}/").status_code == 409


@pytest.mark.parametrize(
    ("path", "data", "field"),
    [
        ("/api/deployments/tiny/infer/", {}, "input"),
        ("/api/deployments/tiny/infer/", {"input": 5}, "input"),
        ("/api/deployments/tiny/infer/", {"input": [{"role": "user"}]}, "input"),
        ("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": -1}, "timeout_s"),
        ("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": 10_000}, "timeout_s"),
        ("/api/deployments/tiny/infer/", {"input": "x", "params": {"max_tokens": 0}}, "params"),
        ("/api/deployments/tiny/infer/", {"input": "x", "params": {"temperature": 3}}, "params"),
        ("/api/deployments/tiny/infer/", {"input": "x", "params": {"top_p": 0}}, "params"),
        ("/api/deployments/tiny/infer/", {"input": "x", "params": {"stop": [1]}}, "params"),
        ("/api/deployments/tiny/infer/", {"input": "x", "params": {"beams": 4}}, "params"),
        ("/api/deployments/tiny/infer/", {"input": "x", "extra": 1}, "extra"),
        ("/api/requests/", {"input": "x"}, "deployment"),
        ("/api/requests/", {"deployment": "Not A Slug", "input": "x"}, "deployment"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_queues_nothing(serving_deployment, user_client, rq, path, data, field):
    response = user_client.post(path, data, format="json")

    assert response.status_code == 400 and field in response.json(), response.json()
    assert rq.depth("tiny") == 0


def test_unknown_deployments_and_requests_are_404(serving_deployment, user_client):
    assert user_client.post("/api/deployments/nope/infer/", {"input": "x"}, format="json").status_code == 404
    assert user_client.get(f"/api/requests/{uuid.uuid4().hex}/").status_code == 404


def test_a_deployment_that_can_never_be_placed_is_refused_at_once_with_409(db, rq, user_client, tiny_model_dir):
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    factories.deployment(name="giant", model_source=str(tiny_model_dir), memory_override_bytes=2 * 1024**3)
    request_services.queue.cache_clear()

    response = user_client.post("/api/deployments/giant/infer/", {"input": "x"}, format="json")

    assert response.status_code == 409 and "no node can ever hold" in response.json()["detail"]
    assert rq.depth("giant") == 0 and not Replica.objects.exists()


def test_a_request_for_a_sleeping_deployment_wakes_it_and_says_waking(db, rq, user_client, tiny_model_dir, dispatched):
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    factories.deployment(name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB, replicas_wanted=0)
    request_services.queue.cache_clear()

    response = user_client.post("/api/requests/", {"deployment": "tiny", "input": "wake up"}, format="json")

    assert response.status_code == 202 and response.json()["status"] == "waking"
    assert Replica.objects.filter(deployment__name="tiny", state="pending").count() == 1
    assert rq.depth("tiny") == 1


def test_requests_of_a_failed_replica_are_requeued_not_lost(serving_deployment, user_client, rq):
    request_id = user_client.post("/api/requests/", {"deployment": "tiny", "input": "x"}, format="json").json()["id"]
    rq.take("tiny", serving_deployment.id, timeout=1)

    reports.report(serving_deployment.id, {"event": "failed", "kind": "crash", "reason": "killed"})

    back = rq.get(request_id)
    assert back.status == "queued" and rq.depth("tiny") == 1


def test_last_access_is_copied_into_the_database(serving_deployment, rq):
    request_id = submit(rq)
    rq.take("tiny", serving_deployment.id, timeout=1)
    rq.finish(request_id, serving_deployment.id, {"text": "x"})

    assert request_services.sync_last_accessed() == 1
    serving_deployment.refresh_from_db()
    assert serving_deployment.last_accessed is not None


def test_deleting_a_deployment_ends_its_waiting_requests_saying_why(serving_deployment, user_client, rq):
    from scheduling.services import deployments

    request_id = user_client.post("/api/requests/", {"deployment": "tiny", "input": "x"}, format="json").json()["id"]

    from django.test import TestCase

    with TestCase.captureOnCommitCallbacks(execute=True):
        deployments.delete("tiny")

    ended = user_client.get(f"/api/requests/{request_id}/").json()
    assert ended["status"] == "failed" and ended["error"] == "deployment tiny was deleted"


# -- the live claim: requests queued without a database read -------------------------------------


STARTING = (Replica.State.PENDING, Replica.State.WAKING)


def sleeping_deployment(tiny_model_dir) -> Replica:
    """A deployment whose only replica the database says is asleep (so a request must wake it)."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    deployment = factories.deployment(name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB)
    request_services.queue.cache_clear()
    return Replica.objects.create(deployment=deployment, state=Replica.State.SLEEPING)


def test_a_request_for_a_replica_that_claims_to_take_requests_is_queued_without_asking_the_database(
    db, rq, tiny_model_dir, dispatched
):
    # The database says asleep, the claim says taking: only a submit that never asked the
    # database queues it as plainly `queued` and wakes nothing.
    replica = sleeping_deployment(tiny_model_dir)
    rq.announce("tiny", "text", replica.id)

    submitted = request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")

    assert submitted.status == "queued" and rq.depth("tiny") == 1
    assert not Replica.objects.filter(state__in=STARTING).exists(), "nothing woken"


def test_without_a_claim_the_request_is_admitted_by_the_database_which_wakes_the_deployment(
    db, rq, tiny_model_dir, dispatched
):
    sleeping_deployment(tiny_model_dir)

    submitted = request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")

    assert submitted.status == "waking" and rq.depth("tiny") == 1
    assert Replica.objects.filter(state__in=STARTING).exists(), "woken"


def test_a_claim_that_lapsed_or_is_for_other_input_admits_nothing_by_itself(db, rq, tiny_model_dir, dispatched):
    replica = sleeping_deployment(tiny_model_dir)
    rq.announce("tiny", "tensor", replica.id)  # a plain module's claim: no use for text
    rq.redis.zadd(live_key("tiny", "text"), {replica.id: 1.0})  # expired long ago

    submitted = request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")

    assert submitted.status == "waking" and rq.depth("tiny") == 1


def test_a_request_of_the_wrong_kind_finds_no_claim_and_is_refused_as_before(serving_deployment, rq):
    rq.announce("tiny", "text", serving_deployment.id)

    with pytest.raises(InvalidInput, match="causal LM"):  # a tensor for a causal LM
        request_services.submit("tiny", kind="forward", input=[[1.0]], params={}, owner="1")
    assert rq.depth("tiny") == 0


def test_run_waits_for_the_answer_of_a_request_queued_on_a_claim(serving_deployment, rq):
    rq.announce("tiny", "text", serving_deployment.id)
    StandIn(serving_deployment.id, 1).start()

    submitted, final = request_services.run("tiny", kind="generate", input="hi", params={}, owner="1", timeout=10)

    assert final is not None and final.status == "done" and final.output["text"] == "HI"
    assert final.id == submitted.id and rq.live("tiny", "text") == [serving_deployment.id]


def test_a_renewal_never_brings_back_a_withdrawn_claim_and_says_it_found_none(rq):
    assert rq.announce("tiny", "text", "r1")
    assert rq.live("tiny", "text") == ["r1"]
    assert rq.take_renewing("tiny", "r1", 0, "text") == (None, True)
    assert rq.live("tiny", "text") == ["r1"]

    rq.withdraw("tiny", "r1")

    assert rq.take_renewing("tiny", "r1", 0, "text") == (None, False)
    assert rq.live("tiny", "text") == []


def test_a_replica_claims_again_once_redis_lost_its_claim_but_not_for_a_deleted_deployment(rq):
    host = SimpleNamespace(replica_id="r1", loader="transformers", accepting=threading.Event(), node_fence=None)
    host.accepting.set()
    server = Server(host, rq, "tiny")
    server._announce()
    assert server.live and rq.live("tiny", "text") == ["r1"]

    rq.redis.delete(live_key("tiny", "text"))  # a Redis restarted without persistence
    server._take(0)
    server._announce()  # what the serving loop does on its next turn

    assert rq.live("tiny", "text") == ["r1"]
    rq.forget_live("tiny")  # deleted: its stop is on its way to the replica
    server._take(0)
    server._announce()
    assert not server.live and rq.live("tiny", "text") == []


def test_a_claim_made_as_the_replica_stops_taking_is_withdrawn_not_left(rq):
    host = SimpleNamespace(replica_id="r1", loader="transformers", accepting=threading.Event(), node_fence=None)
    server = Server(host, rq, "tiny")
    host.accepting.set()
    server._announce()

    host.accepting.clear()  # what ReplicaHost's state setter does, then it calls on_stop_taking
    host.on_stop_taking()

    assert not server.live and rq.live("tiny", "text") == []
    server._announce()
    assert rq.live("tiny", "text") == []


@pytest.mark.parametrize("report", [{"event": "sleeping"}, {"event": "failed", "kind": "crash", "reason": "killed"}])
def test_the_control_plane_withdraws_the_claim_of_a_replica_that_reports_it_stopped_taking(
    serving_deployment, rq, dispatched, report
):
    # A replica withdraws its own claim as it drains; one that died cannot, and its claim would
    # otherwise admit requests without a wake until it lapsed.
    from django.test import TestCase

    rq.announce("tiny", "text", serving_deployment.id)
    queued = submit(rq)

    with TestCase.captureOnCommitCallbacks(execute=True):
        reports.report(serving_deployment.id, report)

    assert rq.live("tiny", "text") == []
    assert rq.get(queued).status == "queued"
    assert dispatched, "a request waits and nothing is awake: the deployment is woken again"


def test_deleting_a_deployment_forgets_its_claims_and_ends_what_was_queued_on_them(serving_deployment, rq):
    from django.test import TestCase

    from scheduling.services import deployments

    rq.announce("tiny", "text", serving_deployment.id)
    queued = request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")

    with TestCase.captureOnCommitCallbacks(execute=True):
        deployments.delete("tiny")

    assert rq.live("tiny", "text") == []
    assert rq.get(queued.id).status == "failed"
    with pytest.raises(NotFound):
        request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")


# -- /infer/'s fast path reads input exactly as its serializer does ------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_params = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-1, 5000) | _json,
        "temperature": st.floats(-1, 3) | st.integers(-1, 3) | _json,
        "top_p": st.floats(-0.5, 1.5) | _json,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | _json,
        "top_k": st.integers(-3, 5) | st.floats(-2, 5) | _json,
        "seed": st.integers(-(2**64), 2**65) | _json,
        "presence_penalty": st.floats(-3, 3) | _json,
        "repetition_penalty": st.floats(-1, 11) | st.integers(-1, 11) | _json,
        "beams": _json,
    },
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=5) | st.just([{"role": "user", "content": "hi"}]) | _json,
        "params": _params | _json,
        "timeout_s": st.floats(-1, 10_000) | st.integers(-1, 10_000) | _json,
        "extra": _json,
    },
)


@given(_bodies)
def test_the_fast_path_accepts_only_what_the_serializer_accepts_and_reads_it_the_same(body):
    fast = fast_inputs(body)
    if fast is None:
        return  # the serializer judges it, with its own errors
    serializer = InferInput(data=body)
    assert serializer.is_valid(), serializer.errors
    data = serializer.validated_data
    assert fast == (data["input"], params_of(data), data.get("timeout_s", settings.GPUPORTAL_INFER_TIMEOUT_S))


@pytest.mark.parametrize(
    "body",
    [
        {"input": "Hello", "params": {"max_tokens": 1}},
        {"input": [{"role": "user", "content": "Hi"}], "timeout_s": 30},
        {"input": "x", "params": {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"]}},
        {"input": [[0.5, 1.0]], "params": {"stop": "END"}, "timeout_s": 2.5},
    ],
)
def test_the_fast_path_takes_the_shapes_clients_send_most(body):
    assert fast_inputs(body) is not None


def test_the_sampling_parameters_are_kept_as_given_and_a_bad_one_is_refused_naming_it():
    assert tuple(SamplingInput().fields) == (*sampling.NAMES, *sampling.LISTED_NAMES), "each declared in the wire"
    sampled = {"temperature": 0.8, "top_k": 40, "min_p": 0.05, "seed": 7, "frequency_penalty": 0.5}
    serializer = InferInput(data={"input": "hi", "params": sampled})
    assert serializer.is_valid(), serializer.errors
    assert params_of(serializer.validated_data) == {"max_tokens": 16, "top_p": 1.0, "stop": [], **sampled}
    assert fast_inputs({"input": "hi", "params": sampled})[1] == params_of(serializer.validated_data)
    # Left out, or null: the replica's default (gpuportal.wire.sampling), nothing stored.
    nulled = InferInput(data={"input": "hi", "params": {"seed": None}})
    assert nulled.is_valid() and params_of(nulled.validated_data) == {
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop": [],
    }

    refused = InferInput(data={"input": "hi", "params": {"top_k": 2.5, "repetition_penalty": 0}})
    assert not refused.is_valid()
    assert refused.errors == {
        "params": {"top_k": ["must be a whole number"], "repetition_penalty": ["must be above 0 and at most 10"]}
    }


def test_a_logit_bias_is_kept_with_its_biases_as_numbers_and_a_bad_one_is_refused_naming_it():
    biased = {"input": "hi", "params": {"logit_bias": {"17": -100, "3": 2}}}
    serializer = InferInput(data=biased)
    assert serializer.is_valid(), serializer.errors
    assert params_of(serializer.validated_data)["logit_bias"] == {"17": -100.0, "3": 2.0}
    assert fast_inputs(biased)[1] == params_of(serializer.validated_data)
    assert "logit_bias" not in fast_inputs({"input": "hi", "params": {"logit_bias": {}}})[1], "none asked"

    bad = {"input": "hi", "params": {"logit_bias": {"17": 200}}}
    assert fast_inputs(bad) is None
    refused = InferInput(data=bad)
    assert not refused.is_valid()
    assert refused.errors == {"params": {"logit_bias": ["17: must be from -100 to 100"]}}


def test_stop_token_ids_are_kept_on_either_path_and_a_bad_one_is_refused_naming_it():
    stopping = {"input": "hi", "params": {"stop_token_ids": [7, 3]}}
    serializer = InferInput(data=stopping)
    assert serializer.is_valid(), serializer.errors
    assert params_of(serializer.validated_data)["stop_token_ids"] == [3, 7]
    assert fast_inputs(stopping)[1] == params_of(serializer.validated_data)

    bad = {"input": "hi", "params": {"stop_token_ids": 7}}
    assert fast_inputs(bad) is None
    refused = InferInput(data=bad)
    assert not refused.is_valid()
    assert refused.errors == {"params": {"stop_token_ids": ["must be a list of token ids, such as [128009]"]}}


def test_a_format_is_kept_as_the_queue_keeps_v1s_and_a_bad_one_is_refused_naming_it():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    def kept(**params: Any) -> dict[str, Any]:
        serializer = InferInput(data={"input": "hi", "params": params})
        assert serializer.is_valid(), serializer.errors
        assert fast_inputs({"input": "hi", "params": params}) is None, "left to the serializer"
        return params_of(serializer.validated_data)

    assert kept(format="json")["json_schema"] == {"type": "object"}, "Ollama's: any JSON object"
    assert kept(format=schema)["json_schema"] == schema
    assert "format" not in kept(format=schema), "kept by the name the replica reads"
    assert kept(format=schema)["json_schema_field"] == "format", "the caller's name, for the replica's refusal"
    assert kept(guided_choice=["yes", "no"])["guided_choice"] == ["yes", "no"]
    assert kept(guided_regex="[0-9]+")["guided_regex"] == "[0-9]+"
    assert not {"json_schema", "format"} & set(kept(format=None)), "null: free text"

    for params, refused in [
        ({"format": "yaml"}, {"format": ['must be "json" or a JSON Schema object']}),
        ({"format": {"x": "y" * 70_000}}, {"format": ["a schema of at most 65536 bytes"]}),
        ({"guided_choice": []}, {"guided_choice": ["must be a non-empty list of non-empty strings"]}),
        ({"guided_regex": ""}, {"guided_regex": ["must be a regular expression of 1 to 4096 characters"]}),
        (
            {"format": "json", "guided_regex": "[0-9]+"},
            {"guided_regex": ["one format at a time: format and guided_regex were both given"]},
        ),
    ]:
        serializer = InferInput(data={"input": "hi", "params": params})
        assert not serializer.is_valid()
        assert serializer.errors == {"params": refused}, params


def test_min_tokens_beyond_max_tokens_is_refused_naming_it_on_either_path():
    kept = {"input": "hi", "params": {"max_tokens": 8, "min_tokens": 8}}
    assert fast_inputs(kept)[1]["min_tokens"] == 8

    beyond = {"input": "hi", "params": {"max_tokens": 8, "min_tokens": 9}}
    assert fast_inputs(beyond) is None, "left to the serializer, which says why"
    refused = InferInput(data=beyond)
    assert not refused.is_valid()
    assert refused.errors == {"params": {"min_tokens": ["must be at most max_tokens (8)"]}}
    default = InferInput(data={"input": "hi", "params": {"min_tokens": 17}})
    assert not default.is_valid(), "beyond the default max_tokens (16) too"


@pytest.mark.parametrize(
    "body",
    [{"input": float("inf")}, {"input": [[0.5, float("nan")]]}, {"input": [{"role": "user", "x": -float("inf")}]}],
    ids=["infinity", "nan-in-a-tensor", "in-a-message"],
)
def test_the_fast_path_leaves_infinity_and_nan_to_the_serializer_which_refuses_them(body):
    # Python's json reads the literals Infinity and NaN, so a client can send them (hypothesis found it).
    assert fast_inputs(body) is None
    assert not InferInput(data=body).is_valid()


@pytest.mark.django_db(transaction=True)
def test_a_request_is_accepted_after_the_database_dropped_the_web_processs_connection(rq, tiny_model_dir):
    from django.db import connection, connections

    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    deployment = factories.deployment(name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB)
    Replica.objects.create(deployment=deployment, state=Replica.State.SERVING)
    request_services.queue.cache_clear()
    connection.ensure_connection()
    # What a restarted database does to every kept connection: the server ends its session.
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])
    finally:
        other.close()

    request = request_services.submit("tiny", kind="generate", input="hi", params={}, owner="1")

    assert request.status == "queued" and rq.depth("tiny") == 1


# -- listing -------------------------------------------------------------------------------------


def test_the_list_shows_the_callers_requests_newest_first_and_staff_see_everyones(serving_deployment, user_client):
    sent = [
        user_client.post("/api/requests/", {"deployment": "tiny", "input": f"n{i}"}, format="json").json()["id"]
        for i in range(3)
    ]
    stranger = APIClient()
    stranger.force_authenticate(User.objects.create_user("mallory"))
    theirs = stranger.post("/api/requests/", {"deployment": "tiny", "input": "mine"}, format="json").json()["id"]

    mine = user_client.get("/api/requests/")
    assert mine.status_code == 200
    assert [r["id"] for r in mine.json()["results"]] == sent[::-1]
    assert mine.json()["next"] is None and mine.json()["previous"] is None
    staff = APIClient()
    staff.force_authenticate(User.objects.create_user("ops", is_staff=True))
    assert [r["id"] for r in staff.get("/api/requests/").json()["results"]] == [theirs, *sent[::-1]]
    assert APIClient().get("/api/requests/").status_code == 401


def test_the_list_filters_by_status_and_deployment_and_pages_with_links(serving_deployment, user_client):
    sent = [
        user_client.post("/api/requests/", {"deployment": "tiny", "input": f"n{i}"}, format="json").json()["id"]
        for i in range(5)
    ]
    StandIn(serving_deployment.id, 2).run()  # the two oldest are served; three wait

    done = user_client.get("/api/requests/?status=done").json()["results"]
    assert [r["id"] for r in done] == sent[1::-1]
    first = user_client.get("/api/requests/?status=queued&deployment=tiny&page_size=2").json()
    assert [r["id"] for r in first["results"]] == [sent[4], sent[3]] and first["previous"] is None
    second = user_client.get(first["next"]).json()
    assert [r["id"] for r in second["results"]] == [sent[2]] and second["next"] is None
    assert second["previous"].endswith("page=1") or "page=1&" in second["previous"]
    assert user_client.get("/api/requests/?deployment=other").json()["results"] == []


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("status=finished", "status"),
        ("page=0", "page"),
        ("page_size=5000", "page_size"),
        ("deployment=a%20b", "deployment"),
    ],
)
def test_a_bad_list_filter_is_a_400_naming_the_parameter(serving_deployment, user_client, query, parameter):
    response = user_client.get(f"/api/requests/?{query}")
    assert response.status_code == 400 and list(response.json()) == [parameter]


# -- Idempotency-Key -------------------------------------------------------------------------------


def queued_ids(rq: RequestQueue, deployment: str = "tiny") -> list[str]:
    return [raw.decode() for raw in rq.redis.lrange(queue_key(deployment), 0, -1)]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/deployments/tiny/infer/", {"input": "once", "timeout_s": 0.1}),
        ("/api/requests/", {"deployment": "tiny", "input": "once"}),
    ],
)
def test_a_retry_with_the_same_key_is_the_first_request_and_queues_nothing_more(
    serving_deployment, user_client, rq, path, body
):
    first = user_client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY="order-17")
    again = user_client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY="order-17")

    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and queued_ids(rq) == [first.json()["id"]]
    other = user_client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY="order-18")
    assert other.json()["id"] != first.json()["id"] and len(queued_ids(rq)) == 2


def test_a_retry_of_a_request_that_ended_answers_with_its_output_and_runs_nothing(serving_deployment, user_client, rq):
    StandIn(serving_deployment.id, 1).start()
    body = {"input": "hello", "timeout_s": 10}
    first = user_client.post("/api/deployments/tiny/infer/", body, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert first.status_code == 200 and first.json()["output"]["text"] == "HELLO"

    again = user_client.post("/api/deployments/tiny/infer/", body, format="json", HTTP_IDEMPOTENCY_KEY="k")

    assert again.status_code == 200 and again.json() == first.json()
    assert queued_ids(rq) == [], "nothing queued for the retry"


@pytest.mark.parametrize(
    ("path", "first", "then"),
    [
        ("/api/requests/", {"deployment": "tiny", "input": "once"}, {"deployment": "tiny", "input": "twice"}),
        (
            "/api/requests/",
            {"deployment": "tiny", "input": "once", "params": {"max_tokens": 4}},
            {"deployment": "tiny", "input": "once", "params": {"max_tokens": 5}},
        ),
    ],
)
def test_a_key_sent_again_with_another_request_is_a_422_naming_the_first_and_queues_nothing(
    serving_deployment, user_client, rq, path, first, then
):
    accepted = user_client.post(path, first, format="json", HTTP_IDEMPOTENCY_KEY="order-17")
    assert accepted.status_code in (200, 202), accepted.content[:300]
    queued = queued_ids(rq)

    reused = user_client.post(path, then, format="json", HTTP_IDEMPOTENCY_KEY="order-17")

    assert reused.status_code == 422, reused.content[:300]
    assert "Idempotency-Key 'order-17' was first sent with another request" in reused.content.decode()
    assert queued_ids(rq) == queued, "nothing queued for it"


def test_the_same_key_from_another_caller_is_another_request(serving_deployment, user_client, rq):
    bob = APIClient()
    bob.force_authenticate(User.objects.create_user("bob"))
    body = {"deployment": "tiny", "input": "mine"}

    alice_id = user_client.post("/api/requests/", body, format="json", HTTP_IDEMPOTENCY_KEY="k").json()["id"]
    bob_id = bob.post("/api/requests/", body, format="json", HTTP_IDEMPOTENCY_KEY="k").json()["id"]

    assert alice_id != bob_id and sorted(queued_ids(rq)) == sorted([alice_id, bob_id])


def test_a_key_whose_request_was_never_written_is_taken_over_by_the_retry(serving_deployment, user_client, rq):
    # The key claimed, then Redis died before the request itself was written: the retry runs it.
    owner = str(User.objects.get(username="alice").pk)
    assert rq.claim_idempotency_key(owner, "lost", "never-written") == "never-written"

    retry = user_client.post("/api/requests/", {"deployment": "tiny", "input": "x"}, format="json",
                             HTTP_IDEMPOTENCY_KEY="lost")  # fmt: skip

    assert retry.status_code == 202 and queued_ids(rq) == [retry.json()["id"]] != ["never-written"]


def test_a_slow_first_submit_whose_key_its_retry_took_over_queues_nothing_beside_the_retry(rq):
    # The first web process claimed the key, then waited (the database admitting it) while its
    # client gave up and sent the request again: the retry found no request under the key and took
    # it over. The first submit, when it comes, must not queue a second copy.
    assert rq.claim_idempotency_key("1", "k", "first") == "first"
    assert rq.claim_idempotency_key("1", "k", "retry") == "retry"
    rq.submit("tiny", kind="generate", input="x", params={}, owner="1", request_id="retry", under_key=("1", "k"))

    with pytest.raises(KeyTakenOver) as taken:
        rq.submit("tiny", kind="generate", input="x", params={}, owner="1", request_id="first", under_key=("1", "k"))

    assert taken.value.first == "retry" and rq.get("first") is None
    assert queued_ids(rq) == ["retry"]


def test_a_client_that_retried_while_its_first_post_was_slow_gets_one_request_from_both(
    serving_deployment, user_client, rq, monkeypatch
):
    submit = RequestQueue._submit
    retried: list = []

    def slow(self, *args, **kwargs):
        if not retried:  # the first post, before its submit: its client sends it again meanwhile
            retried.append(None)
            retried[0] = user_client.post(
                "/api/requests/", {"deployment": "tiny", "input": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="slow"
            )
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(RequestQueue, "_submit", slow)
    first = user_client.post(
        "/api/requests/", {"deployment": "tiny", "input": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="slow"
    )

    retry = retried[0]
    assert first.status_code == retry.status_code == 202, (first.json(), retry.json())
    assert first.json()["id"] == retry.json()["id"] and queued_ids(rq) == [retry.json()["id"]]


def test_a_first_post_whose_retry_has_taken_its_key_but_not_yet_queued_is_a_503_and_queues_nothing(
    serving_deployment, user_client, rq, monkeypatch
):
    owner = str(User.objects.get(username="alice").pk)
    submit = RequestQueue._submit

    def overtaken(self, *args, **kwargs):
        # The retry claims the key (the first request not written yet) and has not submitted.
        assert rq.claim_idempotency_key(owner, "late", "the-retry") == "the-retry"
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(RequestQueue, "_submit", overtaken)
    first = user_client.post(
        "/api/requests/", {"deployment": "tiny", "input": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="late"
    )

    assert first.status_code == 503 and "send it again" in first.json()["detail"], first.json()
    assert queued_ids(rq) == []


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9", "tab\there"])
@pytest.mark.parametrize(
    "path", ["/api/deployments/tiny/infer/", "/api/requests/", "/v1/completions", "/v1/embeddings"]
)
def test_a_key_that_cannot_be_one_is_a_400_naming_the_header_and_queues_nothing(
    serving_deployment, user_client, rq, path, key
):
    body = {"deployment": "tiny", "input": "x", "model": "tiny", "prompt": "x"}
    if path != "/api/requests/":
        body.pop("deployment")

    response = user_client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY=key)

    assert response.status_code == 400, response.json()
    assert "Idempotency-Key" in json.dumps(response.json()) and queued_ids(rq) == []


# -- a 503 means not run ---------------------------------------------------------------------------


@pytest.fixture
def answer_lost(monkeypatch, rq):
    """Redis runs each submit, then the connection dies before its answer comes back; `then`
    runs between the two (a replica that takes the request meanwhile); `error`, what the web
    meets (a dead Redis's cut connection, by default; a frozen one's timeout)."""
    submit = RequestQueue._submit
    state = SimpleNamespace(then=lambda request_id: None, error=redis.ConnectionError("Connection closed by server."))

    def lost(self, *args, **kwargs):
        submitted = submit(self, *args, **kwargs)
        if submitted is None:
            return None  # no replica claims to take it now: nothing written, the long way follows
        state.then(submitted[0].id)
        raise state.error

    monkeypatch.setattr(RequestQueue, "_submit", lost)
    return state


def written_requests(rq: RequestQueue) -> list:
    return [rq.get(key.decode().removeprefix(REQUEST_PREFIX)) for key in rq.redis.scan_iter(f"{REQUEST_PREFIX}*")]


def test_a_submit_whose_answer_redis_lost_is_withdrawn_so_its_503_means_it_will_not_run(
    serving_deployment, user_client, rq, answer_lost
):
    response = user_client.post("/api/requests/", {"deployment": "tiny", "input": "x"}, format="json")

    assert response.status_code == 503
    (written,) = written_requests(rq)
    assert written.status == "cancelled" and written.error == request_services.WITHDRAWN
    assert queued_ids(rq) == [], "no replica will take it"


def test_a_submit_whose_answer_was_lost_after_a_replica_took_it_answers_with_its_id(
    serving_deployment, user_client, rq, answer_lost
):
    answer_lost.then = lambda request_id: rq.take("tiny", serving_deployment.id, timeout=1)

    response = user_client.post("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": 1}, format="json")

    assert response.status_code == 202, "accepted after all: it runs, and the caller has its id"
    assert response.json()["status"] == "dispatched" and response.json()["replica"] == serving_deployment.id


def test_a_keyed_submit_whose_answer_was_lost_stays_for_the_retry_under_its_key(
    serving_deployment, user_client, rq, answer_lost, monkeypatch
):
    failed = user_client.post(
        "/api/requests/", {"deployment": "tiny", "input": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="k1"
    )
    # Not a 503: it was written, and runs. Nothing is withdrawn: the retry under the key finds it.
    assert failed.status_code == 504 and "same Idempotency-Key" in failed.json()["detail"]
    monkeypatch.undo()  # Redis answers again

    retry = user_client.post(
        "/api/requests/", {"deployment": "tiny", "input": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="k1"
    )

    (written,) = written_requests(rq)
    assert retry.status_code == 202 and retry.json()["id"] == written.id and written.status == "queued"
    assert failed.json()["request"] == written.id


def test_a_submit_whose_answer_was_lost_with_redis_not_back_in_time_is_a_504_naming_it_not_a_503(
    serving_deployment, user_client, rq, answer_lost, monkeypatch
):
    monkeypatch.setattr(request_services, "WITHDRAW_FOR_S", 0.3)
    # Redis stays away for the whole look-up: whether the request was written cannot be known.
    monkeypatch.setattr(
        RequestQueue, "cancel", lambda *args, **kwargs: (_ for _ in ()).throw(redis.ConnectionError("refused"))
    )

    response = user_client.post("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": 1}, format="json")

    (written,) = written_requests(rq)
    assert response.status_code == 504, "it may run: a 503 would say it did not"
    assert response.json()["request"] == written.id and f"/api/requests/{written.id}/" in response.json()["detail"]
    assert written.status == "queued"


def test_a_submit_redis_runs_past_its_deadline_writes_nothing_and_is_a_503(
    serving_deployment, user_client, rq, monkeypatch
):
    monkeypatch.setattr(RequestQueue, "submit_deadline", lambda self: "1.0")  # long past, on any clock

    response = user_client.post("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": 1}, format="json")

    assert response.status_code == 503 and response.json()["dependency"] == "redis"
    assert written_requests(rq) == [] and queued_ids(rq) == []


def test_a_submit_reckons_its_deadline_from_when_it_goes_not_from_before_it_had_a_connection(rq, monkeypatch):
    # A web process whose threads all submit at once can wait for a connection (and, on a loaded
    # host, for the interpreter's lock) past the deadline: its submit then went to a Redis that ran
    # it at once and was refused as late, a 503 for nothing.
    web = RequestQueue.from_url(settings.REDIS_URL, socket_timeout=0.2)  # a deadline 0.1 s ahead
    pool = web.redis.connection_pool
    had = pool.get_connection

    def late_connection(*args, **kwargs):
        time.sleep(0.3)  # a connection had past that deadline
        return had(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", late_connection)
    queued = web.submit("tiny", kind="generate", input="x", params={}, owner="u")

    assert queued is not None and queued_ids(rq) == [queued.id]


@pytest.fixture
def frozen_redis(tmp_path):
    """A Redis server of its own, to freeze (SIGSTOP) and let go."""
    from gpuportal.stack import EmbeddedRedis

    server = EmbeddedRedis(data_dir=tmp_path / "redis", persist=False)
    server.start()
    try:
        yield server
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()


@pytest.mark.slow  # a Redis server of its own
def test_a_submit_that_reaches_a_frozen_redis_is_refused_when_it_resumes_so_its_timeout_ran_nothing(frozen_redis):
    from gpuportal.wire.requestqueue import SubmitTooLate, done_key

    web = RequestQueue.from_url(frozen_redis.url(), socket_timeout=1.0)
    web.submit_deadline()  # Redis's clock measured while it answers
    request_id = uuid.uuid4().hex
    frozen_redis.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(redis.TimeoutError) as timed_out:
            web.submit("tiny", kind="generate", input="x", params={}, owner="u", request_id=request_id)
        assert not isinstance(timed_out.value, SubmitTooLate), "the web gave up before Redis ran it"
    finally:
        frozen_redis.process.send_signal(signal.SIGCONT)
    # Redis runs the submit it held once it resumes: past its deadline, so it says 'refused' where
    # the answer is waited for, and writes nothing.
    other = redis.Redis.from_url(frozen_redis.url())
    assert other.blpop([done_key(request_id)], timeout=30) == (done_key(request_id).encode(), b"refused")
    assert other.keys(f"{REQUEST_PREFIX}*") == [] and other.llen(queue_key("tiny")) == 0


@pytest.mark.slow  # a Redis server of its own
def test_a_request_accepted_before_redis_froze_comes_back_accepted_not_as_an_error(frozen_redis):
    web = RequestQueue.from_url(frozen_redis.url(), socket_timeout=1.0)
    other = redis.Redis.from_url(frozen_redis.url())
    outcome: list = []
    waiting = threading.Thread(
        target=lambda: outcome.append(
            web.submit_and_wait("tiny", kind="generate", input="x", params={}, owner="u", timeout=30)
        )
    )
    waiting.start()
    # Frozen once the submit is written, while the web waits for the request's end.
    wait_until(lambda: other.llen(queue_key("tiny")) == 1, 30, "the submit to be written")
    frozen_redis.process.send_signal(signal.SIGSTOP)
    try:
        waiting.join(60)
    finally:
        frozen_redis.process.send_signal(signal.SIGCONT)

    ((request, final),) = outcome
    assert final is None and request.status == "queued", "accepted: its end is polled once Redis is back"
    assert other.lrange(queue_key("tiny"), 0, -1) == [request.id.encode()]
