"""The failover lock (seed 004 on PostgreSQL, inference/failover.py) at the level of the lock:
pair members as real processes (tests/support/failover_member.py) SIGKILLed, SIGSTOPped and cut off by
PostgreSQL restarts, and decide_claim on its own.

The restarts must not touch the session's shared PostgreSQL, so this module starts a private one
(migrated by `manage.py migrate`) and writes its rows with plain SQL; every test has a lease of
its own. Members print their grants and losses with time.monotonic(), which is one clock for every
process on Linux: the harness compares those times with each other and with its own kill times.
Deadlines are compared with the server's clock (now(), granted_at), never with a stopwatch.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.processes import die_with_parent
from gpuportal.stack import EmbeddedPostgres
from inference import failover
from inference.failover import LOCK_NAMESPACE, Claim, FailoverMember, LeaseConfig, LeaseRow, Stale, decide_claim
from tests.support.failover_member import application_name
from tests.support.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
WINDOW_S = 2.0  # the reconnect window of most members here: short, so a dead holder's window passes soon
# A restart with the holder alive: the holder must reconnect within window − margin − one renewal
# period; a wider window keeps that true on a loaded machine (it costs nothing: nobody waits it out).
ALIVE_RESTART_WINDOW_S = 4.0
STARTUP_S = 30  # a member to start, a grant that needs no window to pass
slow = pytest.mark.slow


# -- decide_claim: every branch, then properties ---------------------------------------------------

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
STARTED_BEFORE = T0 - timedelta(hours=1)  # the server the holder last renewed on
STARTED_SINCE = T0 - timedelta(seconds=5)  # the server after a restart
DEADLINE = T0 + timedelta(seconds=3)


def lease_row(
    holder: str | None = "holder", epoch: int = 4, deadline=DEADLINE, started=STARTED_BEFORE, closed: bool = False
) -> LeaseRow:
    return LeaseRow(holder=holder, epoch=epoch, reconnect_deadline=deadline, server_started_at=started, closed=closed)


@pytest.mark.parametrize(
    ("row", "me", "my_epoch", "now", "server_started", "expected"),
    [
        pytest.param(lease_row(), "holder", 4, T0, STARTED_SINCE, Claim.KEEP, id="reconnected-holder-keeps-its-epoch"),
        pytest.param(lease_row(), "holder", 4, T0 + timedelta(hours=1), STARTED_BEFORE, Claim.KEEP, id="keeps-late"),
        pytest.param(lease_row(holder="other", epoch=5), "holder", 4, T0, STARTED_SINCE, Claim.STALE, id="taken-over"),
        pytest.param(lease_row(epoch=5), "holder", 4, T0, STARTED_SINCE, Claim.STALE, id="own-name-newer-epoch"),
        pytest.param(lease_row(holder=None, epoch=5), "holder", 4, T0, STARTED_SINCE, Claim.STALE, id="cleared"),
        pytest.param(
            lease_row(holder=None, epoch=0, deadline=None, started=None),
            "me",
            None,
            T0,
            STARTED_SINCE,
            Claim.TAKE,
            id="never-held",
        ),
        pytest.param(lease_row(holder="me"), "me", None, T0, STARTED_SINCE, Claim.TAKE, id="own-name-fresh-process"),
        pytest.param(lease_row(started=None), "me", None, T0, STARTED_SINCE, Claim.TAKE, id="holder-never-renewed"),
        pytest.param(lease_row(), "me", None, T0, STARTED_BEFORE, Claim.TAKE, id="same-server-holder-died"),
        pytest.param(lease_row(deadline=None), "me", None, T0, STARTED_SINCE, Claim.TAKE, id="restart-no-deadline"),
        pytest.param(lease_row(), "me", None, T0, STARTED_SINCE, Claim.WAIT, id="restart-within-window"),
        pytest.param(lease_row(), "me", None, DEADLINE, STARTED_SINCE, Claim.TAKE, id="restart-window-just-over"),
        pytest.param(
            lease_row(),
            "me",
            None,
            DEADLINE + timedelta(hours=1),
            STARTED_SINCE,
            Claim.TAKE,
            id="restart-window-long-over",
        ),
        pytest.param(lease_row(closed=True), "me", None, T0, STARTED_BEFORE, Claim.CLOSED, id="pair-stopping-whole"),
        pytest.param(lease_row(closed=True), "holder", 4, T0, STARTED_SINCE, Claim.KEEP, id="closing-holder-keeps"),
    ],
)
def test_it_decides_each_claim_from_the_lease_row(row, me, my_epoch, now, server_started, expected):
    assert decide_claim(row, me, my_epoch, now, server_started) is expected


MEMBERS = ("a", "b")
instants = st.integers(-10, 10).map(lambda s: T0 + timedelta(seconds=s))
rows = st.builds(
    LeaseRow,
    holder=st.sampled_from((None, *MEMBERS)),
    epoch=st.integers(0, 3),
    reconnect_deadline=st.none() | instants,
    server_started_at=st.none() | st.sampled_from((STARTED_BEFORE, STARTED_SINCE)),
    closed=st.booleans(),
)
claims = st.fixed_dictionaries(
    {
        "row": rows,
        "me": st.sampled_from(MEMBERS),
        "my_epoch": st.none() | st.integers(0, 3),
        "now": instants,
        "server_started": st.sampled_from((STARTED_BEFORE, STARTED_SINCE)),
    }
)


@given(claims)
def test_it_lets_a_former_holder_only_keep_its_own_epoch_and_a_newcomer_only_take_wait_or_leave_a_closing_pair(
    claim,
):
    decided = decide_claim(**claim)
    row = claim["row"]
    if claim["my_epoch"] is None:
        # A newcomer never takes a closing pair's lock from another member.
        if row.closed and row.holder != claim["me"]:
            assert decided is Claim.CLOSED
        else:
            assert decided in (Claim.TAKE, Claim.WAIT)
    else:
        keeps = row.holder == claim["me"] and row.epoch == claim["my_epoch"]
        assert decided is (Claim.KEEP if keeps else Claim.STALE)


@given(claims)
def test_it_waits_only_for_another_named_holder_after_a_restart_within_its_window(claim):
    row = claim["row"]
    if decide_claim(**claim) is Claim.WAIT:
        assert row.holder not in (None, claim["me"])
        assert row.server_started_at not in (None, claim["server_started"])
        assert claim["now"] < row.reconnect_deadline


@given(claims, st.integers(0, 20))
def test_it_never_goes_back_to_waiting_once_a_takeover_is_allowed(claim, later_s):
    if decide_claim(**claim) is Claim.TAKE:
        later = {**claim, "now": claim["now"] + timedelta(seconds=later_s)}
        assert decide_claim(**later) is Claim.TAKE


# -- a private PostgreSQL, restarted at will -------------------------------------------------------


# -- the member side: a takeover's wake that hangs ----------------------------------------------


def test_a_takeover_whose_wake_runs_past_its_timeout_ends_the_process(monkeypatch):
    from inference import pairing

    exited = threading.Event()
    codes: list[int] = []
    monkeypatch.setattr(pairing, "_exit", lambda code: (codes.append(code), exited.set()))
    said: list[tuple[str, dict]] = []
    unhang = threading.Event()

    class Events:
        def emit(self, event: str, **fields: Any) -> None:
            said.append((event, fields))

    class HungHost:  # a ReplicaHost whose wake never returns (a stuck copy to the GPU)
        state, replica_id, fence, serving_tags, events = "standby", "standby-1", None, {}, Events()

        def wake_standby(self) -> None:
            unhang.wait(30)

        def where(self) -> dict:
            return {}

    class Requests:
        def raise_epoch(self, fence: str, epoch: int) -> int:
            return epoch

        # At the grant the dead active's requests are given back, before the wake hangs.
        def write_off(self, replica_id: str) -> None:
            said.append(("write_off", {"replica": replica_id}))

        def withdraw(self, deployment: str, replica_id: str) -> None:
            pass

        def requeue_from(self, replica_id: str, *, max_attempts: int, reason: str) -> dict[str, str]:
            return {}

    member = pairing.PairMember(
        HungHost(), Requests(), LeaseConfig("unused", 1, "standby-1", 10.0),
        role="standby", fence_name="pair-1", wake_timeout_s=0.2, liveness_every_s=1.0,
    )  # fmt: skip
    monkeypatch.setattr(member.member, "keep", lambda: None)
    grant = failover.Grant(2, True, "active-1", 1, time.monotonic())
    waking = threading.Thread(target=member.take_over, args=(grant,), daemon=True)
    waking.start()

    assert exited.wait(10), "the hung wake was not cut short"
    unhang.set()
    waking.join(10)
    failed = next(fields for event, fields in said if event == "failed")
    assert codes == [1] and "wake ran past its timeout" in failed["reason"]
    assert [e for e, _ in said].index("failed") < [e for e, _ in said].index("active")


@dataclass
class Server:
    pg: EmbeddedPostgres
    url: str
    deployment_id: int = 0

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=5)

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self.connect() as conn:
            return conn.execute(sql, params).fetchall()

    def restart(self, while_down: Callable[[], None] = lambda: None) -> None:
        """Stop (fast shutdown: every session dropped), run `while_down`, start on the same port."""
        self.pg.stop()
        while_down()
        self.pg.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from django.conf import settings

    root = tmp_path_factory.mktemp("failover-lock")
    pg = EmbeddedPostgres(pgdata=root / "pg" / "data", durable=False)
    url = pg.start()
    try:
        env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL, "GPUPORTAL_DATA_DIR": str(root)}
        migrated = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert migrated.returncode == 0, migrated.stdout[-2000:] + migrated.stderr[-3000:]
        srv = Server(pg, url)
        # The deployment and its observed record, which every deployment has (its columns take
        # their database defaults), in one statement.
        (srv.deployment_id,) = srv.query(
            "WITH made AS (INSERT INTO scheduling_deployment (name, model_source, loader, dtype, replicas_wanted, "
            "dedicated, min_runtime_s, max_wait_s, popular, idle_timeout_s, drain_timeout_s, max_tokens, "
            "failover_standby, memory_policy, created_at, updated_at) VALUES ('failover-lock', '/srv/models/tiny', "
            "'transformers', 'float32', 1, false, 10, 5, false, 300, 30, 2048, true, 'gpuportal', now(), now()) "
            "RETURNING id), observed AS (INSERT INTO scheduling_deploymentobserved (deployment_id) "
            "SELECT id FROM made) SELECT id FROM made"
        )[0]
        yield srv
    finally:
        pg.stop()


# -- pair members as processes ---------------------------------------------------------------------


class Member:
    """One tests/support/failover_member.py process, its JSON lines gathered by a reader thread."""

    def __init__(self, replica_id: str, dsn: str, lease_id: int, window_s: float, try_first: bool, log: Path):
        self.id = replica_id
        self.name = application_name(replica_id)
        self.log = log
        self.events: list[dict[str, Any]] = []
        self.killed_at: float | None = None  # time.monotonic() as the harness sent SIGKILL
        self.exited = False
        self._changed = threading.Condition()
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.support.failover_member", "--dsn", dsn, "--lease", str(lease_id)),
                    *("--replica-id", replica_id, "--window", str(window_s)),
                    *(["--try-first"] if try_first else []),
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                preexec_fn=die_with_parent(signal.SIGKILL),  # never outlive a killed pytest
            )
        threading.Thread(target=self._read, name=f"read-{self.name}", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.events.append(json.loads(line))
                self._changed.notify_all()
        with self._changed:
            self.exited = True
            self._changed.notify_all()

    def __repr__(self) -> str:
        return f"<member {self.id[:6]} pid {self.process.pid}>"

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.events if e["event"] == kind]

    def wait_for(self, predicate: Callable[[Member], Any], what: str, timeout: float = STARTUP_S) -> Any:
        with self._changed:
            found = self._changed.wait_for(lambda: predicate(self) or self.exited, timeout)
            if predicate(self):
                return predicate(self)
        how = "exited" if found else f"not within {timeout}s"
        raise AssertionError(f"{self} {how}, waiting for {what}; events {self.events}\n{self.stderr()[-3000:]}")

    def wait_grant(self, count: int = 1, timeout: float = STARTUP_S) -> dict[str, Any]:
        return self.wait_for(lambda m: m.of("grant")[count - 1 : count], f"grant #{count}", timeout)[0]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        # The member's interval ends here: past this instant it runs no code of its own.
        self.killed_at = time.monotonic()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Interval:
    """When a member may have served: from its grant to its loss for good, or its kill."""

    member: Member
    epoch: int
    start: float
    end: float


def interval_of(member: Member) -> Interval | None:
    grants = member.of("grant")
    if not grants:
        return None
    # A member keeps one epoch for life: a re-grant after a reconnect is a KEEP, never a new epoch.
    assert {g["epoch"] for g in grants} == {grants[0]["epoch"]}, grants
    assert grants[0]["took_over"], grants  # its first grant made it the holder
    assert not any(g["took_over"] for g in grants[1:]), grants
    ends = [e["t"] for e in member.of("lost")] + [e["t"] for e in member.of("loss") if e.get("final")]
    if member.killed_at is not None:
        ends.append(member.killed_at)
    assert ends, f"{member} is still alive: kill it before taking its interval"
    return Interval(member, grants[0]["epoch"], grants[0]["t"], min(ends))


@dataclass
class LeaseState:
    holder: str | None
    epoch: int
    granted_at: datetime | None
    reconnect_deadline: datetime | None
    server_started_at: datetime | None
    now: datetime
    postmaster_started: datetime


@dataclass
class Pair:
    """A fresh lease on the private server, and the members started on it."""

    server: Server
    lease_id: int
    logs: Path
    members: list[Member] = field(default_factory=list)

    def member(self, try_first: bool = False, window_s: float = WINDOW_S) -> Member:
        replica_id = self.new_replica()
        member = Member(
            replica_id, self.server.url, self.lease_id, window_s, try_first, self.logs / f"member-{len(self.members)}"
        )
        self.members.append(member)
        return member

    def new_replica(self) -> str:
        replica_id = uuid.uuid4().hex
        self.server.query(
            "INSERT INTO scheduling_replica (id, deployment_id, role, state, gpu_mem_bytes_by_id, epoch, "
            "failure_reason, failover_state, created_at, updated_at) "
            "VALUES (%s, %s, 'standby', 'standby', '{}', 0, '', '', now(), now()) RETURNING id",
            (replica_id, self.server.deployment_id),
        )
        return replica_id

    def state(self, lock_row: bool = False) -> LeaseState:
        # FOR UPDATE: wait out a renewal in flight, so the row read is the last one written.
        (row,) = self.server.query(
            "SELECT holder_id, epoch, granted_at, reconnect_deadline, server_started_at, now(), "
            "pg_postmaster_start_time() FROM scheduling_failoverlease WHERE id = %s"
            + (" FOR UPDATE" if lock_row else ""),
            (self.lease_id,),
        )
        return LeaseState(*row)

    def lock_sessions(self) -> dict[str, bool]:
        """application_name → whether that session holds (True) or waits for (False) the lock."""
        rows = self.server.query(
            "SELECT a.application_name, l.granted FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.objsubid = 2",
            (LOCK_NAMESPACE, self.lease_id),
        )
        return dict(rows)

    def wait_waiting(self, name: str) -> None:
        """Until the session of `name` (its application_name) waits in the server for the lock."""
        wait_until(lambda: self.lock_sessions().get(name) is False, STARTUP_S, f"{name} to wait for the lock")

    def server_now(self) -> datetime:
        return self.server.query("SELECT now()")[0][0]


@pytest.fixture
def pair(server, tmp_path):
    (lease_id,) = server.query(
        "INSERT INTO scheduling_failoverlease (deployment_id, slot, epoch) VALUES "
        "(%s, (SELECT coalesce(max(slot), -1) + 1 FROM scheduling_failoverlease WHERE deployment_id = %s), 0) "
        "RETURNING id",
        (server.deployment_id, server.deployment_id),
    )[0]
    p = Pair(server, lease_id, tmp_path)
    try:
        yield p
    finally:
        for member in p.members:
            if member.alive:
                member.kill()
            print(f"--- {member} events {member.events}\n{member.stderr()[-2000:]}")  # shown on failure
        with contextlib.suppress(psycopg.Error):
            print(f"--- lease {lease_id}: {p.state()}")
            ids = [m.id for m in p.members]
            print(f"replica rows: {server.query('SELECT id FROM scheduling_replica WHERE id = ANY(%s)', (ids,))}")


# -- the lock --------------------------------------------------------------------------------------


@slow
def test_it_gives_the_lock_to_the_standby_when_the_holder_is_sigkilled_at_a_higher_epoch_each_time(pair):
    holder = pair.member(try_first=True)
    first = holder.wait_grant()
    assert (first["epoch"], first["took_over"], first["previous_holder"]) == (1, True, None)
    epochs = [first["epoch"]]

    for _ in range(2):
        standby = pair.member()
        pair.wait_waiting(standby.name)
        assert standby.of("grant") == []  # the holder is alive: the lock is not free
        holder.kill()
        grant = standby.wait_grant()
        assert grant["took_over"] and grant["previous_holder"] == holder.id
        assert grant["previous_epoch"] == epochs[-1]
        assert grant["t"] > holder.killed_at
        epochs.append(grant["epoch"])
        state = pair.state()
        assert (state.holder, state.epoch) == (standby.id, grant["epoch"])
        holder = standby

    assert epochs == [1, 2, 3]


def in_process_member(pair: Pair, window_s: float, **hooks) -> FailoverMember:
    replica_id = pair.new_replica()
    dsn = psycopg.conninfo.make_conninfo(pair.server.url, application_name=application_name(replica_id))
    hooks.setdefault("on_lost", lambda reason: None)
    return FailoverMember(LeaseConfig(dsn, pair.lease_id, replica_id, window_s), **hooks)


def end_session_of(pair: Pair, member: FailoverMember) -> None:
    """The holder's lock session ends (its connection dropped) while its process lives on."""
    ended = pair.server.query(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = %s",
        (application_name(member.config.replica_id),),
    )
    assert ended == [(True,)]


def take_in_thread(member: FailoverMember) -> queue.Queue:
    granted: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: granted.put(member.acquire()), daemon=True).start()
    return granted


@slow
def test_it_rejects_the_renewal_of_a_superseded_holder(pair):
    old = in_process_member(pair, window_s=10)
    new = in_process_member(pair, window_s=10)
    try:
        assert old.try_acquire().epoch == 1
        granted = take_in_thread(new)
        pair.wait_waiting(application_name(new.config.replica_id))

        end_session_of(pair, old)
        grant = granted.get(timeout=STARTUP_S)
        assert (grant.epoch, grant.previous_holder, grant.previous_epoch) == (2, old.config.replica_id, 1)
        before = pair.state()

        # The superseded member writes with its old epoch, on a session of its own (the one that
        # held the lock is gone): the compare-and-swap refuses it and leaves the row as it was.
        old._conn.close()
        old._conn = psycopg.connect(old.config.dsn, autocommit=True)
        with pytest.raises(Stale):
            old.renew()
        after = pair.state()
        assert (after.holder, after.epoch, after.reconnect_deadline) == (
            new.config.replica_id,
            2,
            before.reconnect_deadline,
        )
        new.renew()  # the current holder's renewal still goes through
    finally:
        old.close()
        new.close()


@slow
def test_a_standby_granted_the_lock_of_a_pair_stopped_whole_leaves_it_and_waits_for_its_own_stop(pair, monkeypatch):
    declined = threading.Event()

    def recording_decide_claim(row, me, *args):
        claim = decide_claim(row, me, *args)
        if claim is Claim.CLOSED:
            declined.set()
        return claim

    monkeypatch.setattr(failover, "decide_claim", recording_decide_claim)
    active = in_process_member(pair, window_s=10)
    standby = in_process_member(pair, window_s=10)
    own_stop = threading.Event()
    outcome: queue.Queue = queue.Queue()

    def wait_for_the_lock() -> None:
        try:
            outcome.put(standby.acquire(own_stop))
        except InterruptedError as exc:
            outcome.put(exc)

    try:
        assert active.try_acquire().epoch == 1
        threading.Thread(target=wait_for_the_lock, daemon=True).start()
        pair.wait_waiting(application_name(standby.config.replica_id))
        # The control plane stops the pair whole (services.failover.close_pairs), then the active
        # member exits before the standby's own stop has reached it: the lock is free.
        closed = pair.server.query(
            "UPDATE scheduling_failoverlease SET closed_at = now() WHERE id = %s RETURNING id", (pair.lease_id,)
        )
        assert closed == [(pair.lease_id,)]
        active.close()

        assert declined.wait(STARTUP_S)
        state = pair.state()
        assert (state.holder, state.epoch) == (active.config.replica_id, 1)  # nobody took over
        own_stop.set()
        assert isinstance(outcome.get(timeout=STARTUP_S), InterruptedError)
        assert pair.state().epoch == 1
    finally:
        own_stop.set()
        active.close()
        standby.close()


@slow
def test_it_tells_a_superseded_holder_that_reconnects_it_is_stale(pair, monkeypatch):
    decided: list[tuple[str, Claim]] = []

    def recording_decide_claim(row, me, *args):
        claim = decide_claim(row, me, *args)
        decided.append((me, claim))
        return claim

    monkeypatch.setattr(failover, "decide_claim", recording_decide_claim)
    lost: queue.Queue = queue.Queue()
    connection_lost = threading.Event()

    def on_event(kind: str, **fields) -> None:
        if kind == "loss" and not fields.get("final"):
            connection_lost.set()

    old = in_process_member(pair, window_s=10, on_lost=lost.put, on_event=on_event)
    new = in_process_member(pair, window_s=10)
    try:
        assert old.try_acquire().epoch == 1
        old.keep()
        granted = take_in_thread(new)
        pair.wait_waiting(application_name(new.config.replica_id))

        end_session_of(pair, old)
        assert granted.get(timeout=STARTUP_S).epoch == 2
        # The old holder noticed and tries to re-acquire within its window; the new one has the lock.
        assert connection_lost.wait(STARTUP_S)
        assert lost.empty()
        new.close()  # the lock is free again: the old holder gets it, and learns it was superseded

        reason = lost.get(timeout=STARTUP_S)
        assert "superseded" in reason
        assert (old.config.replica_id, Claim.STALE) in decided
        state = pair.state()
        assert (state.holder, state.epoch) == (new.config.replica_id, 2)  # the stale member wrote nothing
    finally:
        old.close()
        new.close()


@slow
def test_it_keeps_the_holder_and_its_epoch_across_a_postgres_restart(pair):
    holder = pair.member(try_first=True, window_s=ALIVE_RESTART_WINDOW_S)
    assert holder.wait_grant()["epoch"] == 1
    standby = pair.member(window_s=ALIVE_RESTART_WINDOW_S)
    pair.wait_waiting(standby.name)
    started_before = pair.state().postmaster_started

    pair.server.restart()

    regrant = holder.wait_grant(2)
    assert (regrant["epoch"], regrant["took_over"]) == (1, False)
    assert [loss.get("final", False) for loss in holder.of("loss")] == [False]  # lost the session, not the lock
    pair.wait_waiting(standby.name)
    state = pair.state()
    assert state.postmaster_started > started_before
    assert (state.holder, state.epoch, state.server_started_at) == (holder.id, 1, state.postmaster_started)

    # Every deadline written before the restart has passed (renewals then were before the new
    # server started): were the holder dead, the standby would have taken over by now.
    window_over = state.postmaster_started + timedelta(seconds=ALIVE_RESTART_WINDOW_S)
    wait_until(lambda: pair.server_now() > window_over, 2 * ALIVE_RESTART_WINDOW_S + STARTUP_S, "the window to pass")
    assert pair.lock_sessions() == {holder.name: True, standby.name: False}
    assert holder.alive and holder.of("lost") == []
    assert standby.of("grant") == []
    assert "take" not in [c["claim"] for c in standby.of("claim")]
    state = pair.state()
    assert (state.holder, state.epoch) == (holder.id, 1)


@slow
def test_it_hands_the_lock_over_only_after_the_window_when_the_holder_died_with_the_restart(pair):
    holder = pair.member(try_first=True)
    assert holder.wait_grant()["epoch"] == 1
    standby = pair.member()
    pair.wait_waiting(standby.name)

    # Stopped, the holder renews no more: the deadline read now is the one the standby must respect.
    holder.pause()
    before = pair.state(lock_row=True)
    assert before.holder == holder.id
    # It dies while the server is down, so it is the restart, not its death, that frees the lock.
    pair.server.restart(while_down=holder.kill)
    restarted = pair.state()
    assert restarted.postmaster_started < before.reconnect_deadline  # back within the window

    grant = standby.wait_grant(timeout=2 * WINDOW_S + STARTUP_S)
    assert (grant["epoch"], grant["took_over"], grant["previous_holder"]) == (2, True, holder.id)
    after = pair.state()
    assert (after.holder, after.epoch) == (standby.id, 2)
    assert after.granted_at >= before.reconnect_deadline  # taken over only once the window was over
    # Granted the free lock within the window, the standby left it to the holder until then.
    claims = [c["claim"] for c in standby.of("claim")]
    assert claims[-1] == "take" and "wait" in claims[:-1]


# -- history under faults --------------------------------------------------------------------------


def settle(pair: Pair) -> tuple[Member, Member]:
    """Wait until one live member holds the lock at the lease's epoch and another waits for it,
    starting a fresh member in place of each one that is gone. Returns (holder, standby)."""

    def settled() -> tuple[Member, Member] | None:
        live = [m for m in pair.members if m.alive]
        while len(live) < 2:
            live.append(pair.member())
        locks, state = pair.lock_sessions(), pair.state()
        holders = [m for m in live if locks.get(m.name) is True]
        waiting = [m for m in live if locks.get(m.name) is False]
        if len(holders) != 1 or len(waiting) != len(live) - 1:
            return None
        (holder,) = holders
        # Its latest word is a grant at the lease's epoch (not a loss it is still recovering from).
        news = [e for e in holder.events if e["event"] in ("grant", "loss")]
        if state.holder != holder.id or not news or (news[-1]["event"], news[-1]["epoch"]) != ("grant", state.epoch):
            return None
        return holder, waiting[0]

    return wait_until(settled, 3 * WINDOW_S + STARTUP_S, "one holder and one standby")


@slow
def test_it_never_has_two_members_active_at_once_across_kills_stops_and_restarts(pair):
    pair.member(try_first=True)
    faults: list[str] = []
    takeovers = 0

    for fault in ["sigkill", "sigstop", "restart", "restart-holder-dead"] * 2:
        holder, standby = settle(pair)
        state = pair.state()
        faults.append(f"{fault} of {holder} at epoch {state.epoch}")
        if fault == "sigkill":
            holder.kill()
        elif fault == "sigstop":
            holder.pause()
            # Stopped, it keeps its session, so it keeps the lock, even once the lease's deadline
            # has passed: the deadline matters only after a restart.
            deadline = pair.state(lock_row=True).reconnect_deadline
            wait_until(lambda d=deadline: pair.server_now() > d, 2 * WINDOW_S + STARTUP_S, "the deadline to pass")
            assert pair.lock_sessions() == {holder.name: True, standby.name: False}
            assert standby.of("grant") == []
            assert (pair.state().holder, pair.state().epoch) == (holder.id, state.epoch)
            holder.kill()  # as the node agent kills a hung replica
        elif fault == "restart":
            pair.server.restart()
        else:
            holder.pause()
            deadline = pair.state(lock_row=True).reconnect_deadline
            pair.server.restart(while_down=holder.kill)
        new_holder, _ = settle(pair)
        after = pair.state()
        if holder.alive:  # a live holder is never superseded: it keeps the lock and its epoch
            assert (new_holder, after.epoch) == (holder, state.epoch), faults
        else:
            assert new_holder is not holder and after.epoch == state.epoch + 1, faults
            takeovers += 1
        if fault == "restart-holder-dead":
            assert after.granted_at >= deadline, faults

    # Stopped first, then killed: a standby left running would take over from the killed holder.
    live = [m for m in pair.members if m.alive]
    for member in live:
        member.pause()
    for member in live:
        member.kill()
    intervals = sorted(filter(None, map(interval_of, pair.members)), key=lambda i: i.start)
    history = "\n".join(f"{i.member} epoch {i.epoch}: {i.start:.3f} .. {i.end:.3f}" for i in intervals)

    # Each epoch is one member's, granted in increasing order, none skipped.
    assert [i.epoch for i in intervals] == list(range(1, len(intervals) + 1)), history
    assert len(intervals) == 1 + takeovers, (faults, history)
    # Epoch intervals never overlap: each grant comes after the previous holder lost or was killed.
    for earlier, later in itertools.pairwise(intervals):
        assert later.start > earlier.end, history
    # Sampled continuously (at every instant where the count can rise, and on a fine grid), the
    # number of members active at once is never above 1.
    first, last = intervals[0].start, intervals[-1].end
    grid = [first + k * 0.005 for k in range(int((last - first) / 0.005) + 1)]
    for t in sorted({i.start for i in intervals} | set(grid)):
        assert sum(i.start <= t < i.end for i in intervals) <= 1, (t, history)
