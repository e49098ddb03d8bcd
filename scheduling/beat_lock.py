"""One beat sends, however many run: a lock in Redis that only the beat holding it sends due tasks
under.

One beat replica with a Recreate strategy is not enough on its own: a rollout that starts the new
pod before the old one has stopped, a node cut off from the API server whose pod is replaced while
it still runs, or an operator's second `celery beat` would each send every sweep twice. Every beat
ticks; each tick first takes the lock (`SET key value NX PX ttl`) or renews it while it is still
its own, and only then sends what is due. A beat that stops renewing (killed, frozen, cut off from
Redis) loses it once the TTL has passed and the next waiting beat takes over; one that stops on
purpose hands it back at once.

The lock cannot fence a beat frozen between its renewal and its send: the sweeps it sends are safe
to run twice, which is what makes a lease without fencing enough here.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import psutil
import redis
from django.conf import settings
from django_celery_beat.schedulers import DatabaseScheduler

logger = logging.getLogger(__name__)

LOCK_KEY = "gp:beat:lock"

# Both compare the holder before they act, in one step: a beat whose lease expired and was taken
# must neither extend nor delete its successor's.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Taken from a holder seen dead, only if it still holds it: two beats that saw the same dead holder
# cannot both take it.
_TAKE_OVER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) end "
    "return false"
)


class BeatLock:
    """The lease itself: Django-free, one Redis key whose value names its holder."""

    def __init__(self, client: redis.Redis, ttl_s: float, key: str = LOCK_KEY, holder: str | None = None):
        self.client = client
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.key = key
        # The host (a pod's name in Kubernetes) and pid say which beat holds it to an operator
        # reading Redis; the random part keeps two runs with the same pid apart.
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def hold(self) -> bool:
        """Whether this beat holds the lock for another TTL: renewed if it was its own, taken if it
        was free; False while another beat's lease runs."""
        if self.client.eval(_RENEW, 1, self.key, self.holder, self.ttl_ms):
            return True
        if self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms):
            return True
        # A beat killed on this host (`up` starts it again at once) need not be waited out for a
        # whole TTL: its pid is gone, so it sends nothing. Another host's holder, or a live pid
        # (or one reused since), is waited out.
        holder = self.holder_now()
        if holder is None or not _dead_here(holder):
            return False
        return bool(self.client.eval(_TAKE_OVER, 1, self.key, holder, self.holder, self.ttl_ms))

    def holder_now(self) -> str | None:
        value = self.client.get(self.key)
        return value.decode() if isinstance(value, bytes) else value

    def release(self) -> None:
        self.client.eval(_RELEASE, 1, self.key, self.holder)


def _dead_here(holder: str) -> bool:
    """Whether the holder named a process of this host that no longer runs."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    return host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid))


class SendsOnlyWhileLocked:
    """A celery beat Scheduler mixin: tick() sends due tasks only while this beat holds the lock,
    and close() hands the lock back. The schedule itself stays the scheduler's own."""

    def __init__(self, *args, **kwargs):
        self.beat_lock: BeatLock | None = None
        self.holding = False
        self._said: str | None = None
        super().__init__(*args, **kwargs)

    def make_beat_lock(self) -> BeatLock:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
        return BeatLock(client, settings.GPUPORTAL_BEAT_LOCK_TTL_S)

    def tick(self, *args, **kwargs) -> float:
        # Made on the first tick, not in __init__: `celery beat` also builds its scheduler lazily
        # just to describe it, and that one must not touch Redis.
        if self.beat_lock is None:
            self.beat_lock = self.make_beat_lock()
        lock = self.beat_lock
        # A tick sleeps at most a third of the TTL, so the holder renews twice before its lease
        # could run out, and a waiting beat looks that often.
        most = lock.ttl_ms / 3000
        try:
            held = lock.hold()
        except redis.RedisError as err:
            # Redis is the broker too: nothing could be sent now anyway. Waiting out the outage
            # keeps beat running rather than letting the error end the process.
            self._now(False, logging.WARNING, f"cannot reach Redis for the beat lock ({err}); sending nothing")
            return most
        if not held:
            self._now(False, logging.INFO, f"another beat holds the lock ({self._holder_now(lock)}); waiting")
            return most
        self._now(True, logging.INFO, f"holding the beat lock as {lock.holder}; sending due tasks")
        return min(super().tick(*args, **kwargs), most)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.beat_lock is not None and self.holding:
                try:
                    self.beat_lock.release()
                except redis.RedisError:
                    logger.warning("beat: could not hand back the beat lock; it expires on its own")
                self.holding = False

    def _now(self, held: bool, level: int, message: str) -> None:
        # Said when it changes, not on every tick: a waiting beat ticks every few seconds.
        if message != self._said:
            logger.log(level, "beat: %s", message)
            self._said = message
        self.holding = held

    @staticmethod
    def _holder_now(lock: BeatLock) -> str:
        try:
            return lock.holder_now() or "just handed back"
        except redis.RedisError:
            return "unknown"


class LockedDatabaseScheduler(SendsOnlyWhileLocked, DatabaseScheduler):
    """django-celery-beat's DatabaseScheduler (the schedules editable in the admin), sending only
    while it holds the beat lock. `celery -A gpuportal beat --scheduler
    scheduling.beat_lock:LockedDatabaseScheduler`: settings.CELERY_BEAT_SCHEDULER names it."""
