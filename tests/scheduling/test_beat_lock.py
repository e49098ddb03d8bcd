"""Two beats, one lock: only the beat holding the lock in Redis sends due tasks; when it stops
renewing (killed, frozen) the other takes over once the lease has run out, and when it stops on
purpose at once. Real Redis, two scheduler objects in this process: no beat process is started."""

from __future__ import annotations

import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import redis
from celery.beat import Scheduler
from celery.utils.imports import symbol_by_name
from django.conf import settings
from django_celery_beat.schedulers import DatabaseScheduler
from redis.backoff import NoBackoff
from redis.retry import Retry

from gpuportal.celery import app
from gpuportal.up import Options, Portal
from scheduling.beat_lock import BeatLock, LockedDatabaseScheduler, SendsOnlyWhileLocked


class Beat(SendsOnlyWhileLocked, Scheduler):
    """A scheduler whose one entry is due on every tick, and which records what it would send
    rather than publishing it."""

    producer = None  # nothing is published: apply_entry records instead

    def __init__(self, lock: BeatLock):
        self.lock, self.sent = lock, []
        super().__init__(app=app)
        self.update_from_dict({"sweep": {"task": "scheduling.tasks.expire_heartbeats", "schedule": timedelta(0)}})

    def make_beat_lock(self) -> BeatLock:
        return self.lock

    def apply_entry(self, entry, producer=None):
        self.sent.append(entry.name)

    def run(self, ticks: int) -> None:
        for _ in range(ticks):
            self.tick()


@pytest.fixture
def client():
    connection = redis.Redis.from_url(settings.REDIS_URL)
    yield connection
    connection.close()


@pytest.fixture
def key(client):
    name = f"test:beat-lock:{uuid.uuid4().hex}"
    yield name
    client.delete(name)


def two_beats(client, key, ttl_s: float) -> tuple[Beat, Beat]:
    return Beat(BeatLock(client, ttl_s, key=key)), Beat(BeatLock(client, ttl_s, key=key))


def test_only_the_beat_holding_the_lock_sends(client, key):
    first, second = two_beats(client, key, ttl_s=30)
    for _ in range(5):
        first.run(2)
        second.run(2)
    assert first.sent and first.holding
    assert second.sent == [] and not second.holding
    assert client.get(key).decode() == first.lock.holder


def test_a_waiting_beat_takes_over_once_the_holder_stops_renewing(client, key):
    first, second = two_beats(client, key, ttl_s=0.3)
    first.run(1)
    second.run(1)
    assert first.sent and second.sent == []
    # The first beat ticks no more (killed, frozen): its lease runs out on its own.
    deadline = time.monotonic() + 30
    while not second.sent and time.monotonic() < deadline:
        time.sleep(0.05)
        second.run(1)
    assert second.sent and second.holding
    # Back from its freeze, the first beat finds the lock taken and sends nothing more.
    before = list(first.sent)
    first.run(3)
    assert first.sent == before and not first.holding


def test_a_beat_that_stops_hands_the_lock_over_at_once(client, key):
    first, second = two_beats(client, key, ttl_s=30)
    first.run(1)
    first.close()
    assert client.get(key) is None
    second.run(1)
    assert second.sent and second.holding


def test_a_stopping_beat_leaves_a_lock_it_no_longer_holds_alone(client, key):
    first, second = two_beats(client, key, ttl_s=30)
    first.run(1)
    client.set(key, second.lock.holder)  # its lease ran out and the other took it meanwhile
    first.close()
    assert client.get(key).decode() == second.lock.holder


def test_a_beat_started_again_on_the_same_host_takes_the_lock_of_the_killed_one_at_once(client, key):
    # `up` starts beat again the moment it dies: a whole TTL without sweeps would follow each crash.
    dead = f"{socket.gethostname()}:{pid_gone()}:0000"
    client.set(key, dead, px=30_000)
    beat = Beat(BeatLock(client, 30, key=key))
    beat.run(1)
    assert beat.sent and client.get(key).decode() == beat.lock.holder


def test_a_holder_on_another_host_is_waited_out_though_no_such_pid_runs_here(client, key):
    elsewhere = f"another-host:{pid_gone()}:0000"
    client.set(key, elsewhere, px=30_000)
    beat = Beat(BeatLock(client, 30, key=key))
    beat.run(2)
    assert beat.sent == [] and client.get(key).decode() == elsewhere


def pid_gone() -> int:
    """A pid no process of this host has now."""
    return next(
        pid for pid in range(int(Path("/proc/sys/kernel/pid_max").read_text()) - 1, 1, -1) if not psutil.pid_exists(pid)
    )


def test_a_beat_that_cannot_reach_redis_sends_nothing_and_keeps_ticking(key):
    # Tried once: redis-py's default tries a refused connection again for seconds.
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    beat = Beat(BeatLock(unreachable, 30, key=key))
    assert beat.tick() > 0
    assert beat.sent == [] and not beat.holding


def test_every_way_the_product_starts_beat_uses_the_lock_scheduler(tmp_path: Path):
    scheduler = symbol_by_name(settings.CELERY_BEAT_SCHEDULER)
    assert scheduler is LockedDatabaseScheduler
    assert issubclass(scheduler, SendsOnlyWhileLocked) and issubclass(scheduler, DatabaseScheduler)
    (beat,) = [child for child in Portal(Options(data_dir=tmp_path)).plan_children() if child.name == "beat"]
    at = beat.argv.index("--scheduler")
    assert beat.argv[at + 1] == settings.CELERY_BEAT_SCHEDULER
