"""The failover lock client (seed 004, carried onto PostgreSQL). Runs inside a replica process; no Django.

A failover pair (an active replica and a standby on the same GPUs) shares one lock: a PostgreSQL
session-level advisory lock keyed by the pair's FailoverLease id, held by the replica process on a
dedicated connection of its own. The connection IS the lock:

- leader election and resource safety at once: the lock is free only once the holder's session
  ended, and on one host that means its process (and every byte it held on the GPU) is gone;
- fencing by process death: there is no release call on the failure path;
- the persistent half is the FailoverLease row: holder, epoch, and `reconnect_deadline`, which
  the holder pushes forward while it is healthy. Every grant that changes the holder bumps the
  epoch by compare-and-swap; every renewal is a compare-and-swap on (holder, epoch), so a holder
  that was superseded learns it is stale on its next renewal.

Reconnect window: a PostgreSQL restart drops every session, the holder's included, without the
holder dying. The lease row records the server's start time at each renewal; a lock granted on a
server that started since then follows a restart, so the grantee must leave the lock to the named
holder until `reconnect_deadline` passes. The holder re-acquires and keeps its epoch; or, if it
cannot before its own deadline (a margin before the row's), it stops serving, so two replicas never
serve at once.

Why not Django's connection: Django and Celery close and recycle connections, and a session lock
dies with its session. Why never through a transaction-pooling proxy: it would hand the session,
and the lock with it, to someone else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

import psycopg

from gpuportal.wire import failover_lease as lease
from gpuportal.wire.failover_lease import LOCK_NAMESPACE

log = logging.getLogger("inference.failover")


class Claim(Enum):
    TAKE = "take"  # become the holder: bump the epoch
    KEEP = "keep"  # still the holder (re-acquired after a reconnect): same epoch
    WAIT = "wait"  # the named holder may still be alive and reconnecting: leave it the lock
    STALE = "stale"  # we were the holder, and someone took over since
    CLOSED = "closed"  # the pair is being stopped whole: no one takes over (our own stop is on its way)


@dataclass(frozen=True)
class LeaseRow:
    holder: str | None
    epoch: int
    reconnect_deadline: datetime | None
    server_started_at: datetime | None
    closed: bool = False  # the control plane stopped the pair whole (FailoverLease.closed_at)


def decide_claim(row: LeaseRow, me: str, my_epoch: int | None, now: datetime, server_started: datetime) -> Claim:
    """What the holder of a freshly granted lock may do (pure: the tests drive every branch).

    `my_epoch` is the epoch we held before, if we were the holder (a reconnect), else None.
    """
    if my_epoch is not None:
        # A holder reconnecting keeps its lock even in a closing pair: it is draining to its stop.
        return Claim.KEEP if row.holder == me and row.epoch == my_epoch else Claim.STALE
    if row.closed and row.holder != me:
        return Claim.CLOSED
    if row.holder is None or row.holder == me:
        return Claim.TAKE
    restarted = row.server_started_at is not None and row.server_started_at != server_started
    # The lock was free because every session dropped, not because the holder's process died:
    # the holder may be reconnecting. Only once its window has passed is it presumed dead.
    if restarted and row.reconnect_deadline is not None and now < row.reconnect_deadline:
        return Claim.WAIT
    return Claim.TAKE


@dataclass(frozen=True)
class LeaseConfig:
    dsn: str
    lease_id: int
    replica_id: str
    reconnect_window_s: float = 10.0

    @property
    def renew_every_s(self) -> float:
        # Often enough that the row's deadline is never far behind; at most once a second.
        return max(0.05, min(1.0, self.reconnect_window_s / 5))

    @property
    def give_up_margin_s(self) -> float:
        # The holder stops serving this long before the standby may take over: room to stop.
        return max(0.05, min(1.0, self.reconnect_window_s / 4))


@dataclass(frozen=True)
class Grant:
    epoch: int
    took_over: bool  # False: the holder kept its epoch (a reconnect)
    previous_holder: str | None
    previous_epoch: int
    granted_monotonic: float


class Stale(Exception):
    """This member's epoch has been superseded: it must stop serving and exit."""


class FailoverMember:
    """One pair member's side of the lock. `acquire` (blocking) or `try_acquire`, then `keep`.

    `on_lost(reason)` is called at most once, from the keeper thread, when the lock is gone for
    good (stale, or not re-acquired within the window): the caller stops serving and exits.
    """

    def __init__(
        self, config: LeaseConfig, on_lost: Callable[[str], None], on_event: Callable[..., None] | None = None
    ):
        self.config = config
        self.on_lost = on_lost
        self.on_event = on_event or (lambda *a, **k: None)
        self.epoch: int | None = None
        self._conn: psycopg.Connection | None = None
        self._closed = threading.Event()
        self._lost = False
        self._lose_lock = threading.Lock()
        # Monotonic time until which serving is safe without a renewal (see LeaseConfig).
        self.safe_until = 0.0

    # -- acquiring -----------------------------------------------------------------------------

    def try_acquire(self) -> Grant | None:
        """Take the lock if it is free and ours to take; None otherwise (without waiting)."""
        conn = self._connect_retrying()
        if not self._lock_call(conn, lease.TRY_LOCK):
            conn.close()
            return None
        grant = self._claim(conn)
        if grant is None:
            self._unlock(conn)
            conn.close()
        return grant

    def acquire(self, stop: threading.Event | None = None) -> Grant:
        """Block until the lock is granted and ours to take (the standby's wait)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            conn: psycopg.Connection | None = None
            try:
                conn = self._connect_retrying(stop)
                self._lock_call(conn, lease.LOCK)  # blocks in the server until granted
                grant = self._claim(conn)
                if grant is not None:
                    return grant
                self._unlock(conn)
            except psycopg.OperationalError as exc:
                # A restart drops the waiting session too: reconnect and wait again.
                log.warning("lock wait interrupted (%s); waiting again", " ".join(str(exc).split()))
            if conn is not None:
                conn.close()
            stop.wait(0.2)
        raise InterruptedError("stopped while waiting for the failover lock")

    def _claim(self, conn: psycopg.Connection) -> Grant | None:
        """With the lock held: decide, and write the lease by compare-and-swap. None: not ours yet."""
        cfg = self.config
        # Before the transaction: the deadline written below counts from its start (now()), and
        # the row lock may keep us waiting; our safe time must not start later than the row's.
        before = time.monotonic()
        with conn.transaction():
            found = conn.execute(lease.READ_FOR_CLAIM, (cfg.lease_id,)).fetchone()
            if found is None:
                raise Stale(f"failover lease {cfg.lease_id} no longer exists")
            row = LeaseRow(*found[:5])
            now, server_started = found[5], found[6]
            claim = decide_claim(row, cfg.replica_id, self.epoch, now, server_started)
            if claim is Claim.WAIT:
                log.info(
                    "lock granted after a PostgreSQL restart, but %s (epoch %d) may reconnect until %s: leaving it",
                    row.holder,
                    row.epoch,
                    row.reconnect_deadline,
                )
                return None
            if claim is Claim.CLOSED:
                # Not ours, and never will be: wait on (acquire's loop) until our own stop comes.
                log.info("lock granted, but the pair is being stopped whole: not taking over")
                return None
            if claim is Claim.STALE:
                raise Stale(f"epoch {self.epoch} superseded: the lease is at epoch {row.epoch}, held by {row.holder}")
            epoch = row.epoch + 1 if claim is Claim.TAKE else row.epoch
            updated = conn.execute(
                lease.CLAIM,
                (
                    cfg.replica_id,
                    epoch,
                    claim is Claim.TAKE,
                    cfg.reconnect_window_s,
                    server_started,
                    cfg.lease_id,
                    row.epoch,
                ),
            ).rowcount
            if updated != 1:  # cannot happen under FOR UPDATE; refuse rather than guess
                raise Stale(f"lease {cfg.lease_id} changed under its row lock")
        self._conn = conn
        self.epoch = epoch
        self.safe_until = before + cfg.reconnect_window_s - cfg.give_up_margin_s
        grant = Grant(epoch, claim is Claim.TAKE, row.holder, row.epoch, time.monotonic())
        self.on_event(
            "grant", epoch=epoch, took_over=grant.took_over, previous_holder=row.holder, previous_epoch=row.epoch
        )
        return grant

    # -- keeping -------------------------------------------------------------------------------

    def keep(self) -> threading.Thread:
        """Start the keeper: renew the lease, notice a lost connection, re-acquire or give up.
        And its watchdog: a renewal or reconnect can hang (a dead network path has no error to
        raise), and the give-up must come before the standby may take over all the same."""
        thread = threading.Thread(target=self._keep, name="failover-keeper", daemon=True)
        thread.start()
        threading.Thread(target=self._watch_deadline, name="failover-deadline", daemon=True).start()
        return thread

    def _watch_deadline(self) -> None:
        while not self._closed.is_set() and not self._lost:
            left = self.safe_until - time.monotonic()
            if left <= 0:
                self._lose("no renewal of the failover lease within the reconnect window (hung connection?)")
                return
            self._closed.wait(min(left, 0.1))

    def renew(self) -> None:
        """One renewal: push the reconnect deadline forward, by compare-and-swap on (holder, epoch)."""
        assert self._conn is not None and self.epoch is not None
        before = time.monotonic()
        updated = self._conn.execute(
            lease.RENEW,
            (self.config.reconnect_window_s, self.config.lease_id, self.config.replica_id, self.epoch),
        ).rowcount
        if updated != 1:
            raise Stale(f"epoch {self.epoch} superseded: the lease no longer names this replica at that epoch")
        self.safe_until = before + self.config.reconnect_window_s - self.config.give_up_margin_s

    def _keep(self) -> None:
        cfg = self.config
        while not self._closed.wait(cfg.renew_every_s):
            try:
                self.renew()
                continue
            except Stale as exc:
                self._lose(str(exc))
                return
            except (psycopg.Error, OSError) as exc:
                log.warning("failover lock connection lost (%s); re-acquiring", " ".join(str(exc).split()))
                self.on_event("loss", epoch=self.epoch, reason="lock connection lost; re-acquiring")
            if not self._reacquire():
                return

    def _reacquire(self) -> bool:
        """Until our safe deadline: reconnect and take the lock back at the same epoch."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        while not self._closed.is_set():
            if time.monotonic() >= self.safe_until:
                self._lose("lost the failover lock and could not re-acquire it within the reconnect window")
                return False
            try:
                conn = psycopg.connect(self.config.dsn, autocommit=True, connect_timeout=1)
            except psycopg.OperationalError:
                self._closed.wait(0.1)
                continue
            try:
                if self._lock_call(conn, lease.TRY_LOCK) and self._claim(conn) is not None:
                    log.info("failover lock re-acquired at epoch %s", self.epoch)
                    return True
            except Stale as exc:
                conn.close()
                self._lose(str(exc))
                return False
            except psycopg.Error:
                pass
            conn.close()
            self._closed.wait(0.1)
        return False

    def _lose(self, reason: str) -> None:
        with self._lose_lock:  # the keeper and its watchdog may both get here: once is enough
            if self._lost or self._closed.is_set():
                return
            self._lost = True
        log.error("failover lock lost at epoch %s: %s", self.epoch, reason)
        self.on_event("loss", epoch=self.epoch, reason=reason, final=True)
        self.on_lost(reason)

    def close(self) -> None:
        """Only on a planned exit; a dying process needs no call: its session ends with it."""
        self._closed.set()
        if self._conn is not None:
            self._conn.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _connect_retrying(self, stop: threading.Event | None = None, timeout_s: float = 60.0) -> psycopg.Connection:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # autocommit: a session lock must not sit inside a long-open transaction.
                return psycopg.connect(self.config.dsn, autocommit=True, connect_timeout=2)
            except psycopg.OperationalError:
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    raise
                time.sleep(0.2)

    def _lock_call(self, conn: psycopg.Connection, call: str) -> bool:
        result = conn.execute(call, (LOCK_NAMESPACE, self.config.lease_id)).fetchone()
        return result is None or result[0] is not False  # pg_advisory_lock returns void (None)

    def _unlock(self, conn: psycopg.Connection) -> None:
        conn.execute(lease.UNLOCK, (LOCK_NAMESPACE, self.config.lease_id))
