"""A replica outlives a Redis restart: what it writes while Redis is away (a request's
start, its chunks, its answer) is written once Redis is back, and the accepted request is still
there, since the embedded Redis keeps an append-only file. A Redis that stays away makes the
replica report itself failed and exit, never end its serving loop silently.

A private Redis, so that killing it touches no other test."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import redis

from gpuportal.stack import EmbeddedRedis
from gpuportal.wire.requestqueue import RequestQueue
from inference.serving import PatientQueue, Server
from tests.support.processes import wait_until

pytestmark = pytest.mark.slow  # a Redis server of its own


@pytest.fixture
def private_redis(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "redis", persist=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def killed(server: EmbeddedRedis) -> None:
    assert server.process is not None
    server.process.kill()  # SIGKILL: nothing saved on the way out
    server.process.wait(10)


def test_an_answer_written_while_redis_restarts_lands_once_it_is_back(private_redis, caplog):
    rq = RequestQueue.from_url(private_redis.url())
    # Every write synced at once, so that what the test wrote before the kill is on disk (the
    # portal runs `everysec`: at most a second of writes is at risk).
    rq.redis.config_set("appendfsync", "always")
    rq.submit("tiny", kind="generate", input="hi", params={}, owner="u")
    taken = rq.take("tiny", "r1", timeout=1)
    assert taken is not None
    lost: list[str] = []
    host = SimpleNamespace(
        replica_id="r1",
        loader="transformers",
        accepting=threading.Event(),
        fence=None,
        node_fence=None,
        on_queue_lost=lost.append,
    )
    server = Server(host, rq, "tiny")

    killed(private_redis)
    caplog.set_level(logging.WARNING, logger="inference.serving")
    writer = threading.Thread(
        target=server._record, args=(lambda fence: server.queue.finish(taken.id, "r1", {"text": "HI"}, fence),)
    )
    writer.start()
    wait_until(lambda: "Redis unreachable on finish; retrying" in caplog.text, 30, "the replica to wait for Redis")
    private_redis.start()
    writer.join(60)

    assert not writer.is_alive() and lost == []
    done = rq.get(taken.id)
    assert done is not None and done.status == "done" and done.output == {"text": "HI"}


def test_a_redis_that_stays_away_makes_the_replica_say_it_failed(private_redis):
    rq = RequestQueue.from_url(private_redis.url())
    lost: list[str] = []
    patient = PatientQueue(rq, lost.append, outage_s=0.5)
    killed(private_redis)

    with pytest.raises(redis.ConnectionError):
        patient.start("some-request", "r1")

    assert len(lost) == 1 and lost[0].startswith("Redis unreachable for 0.5 s on start")
