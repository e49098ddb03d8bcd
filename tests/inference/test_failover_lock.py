"""The failover lock (seed 004 on the node's own file lock, inference/failover.py) at the level of
the lock: pair members as real processes (tests/support/failover_member.py) SIGKILLed and
SIGSTOPped, a pair closed by its agent, and decide_claim on its own. No database: a GPU host holds
no credentials for it.

Members print their grants with time.monotonic(), which is one clock for every process on Linux:
the harness compares those times with each other and with its own kill times. Whether a member
holds the lock or waits for it is read from the kernel (/proc/locks), never guessed from a delay.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.processes import die_with_parent
from inference import failover
from inference.failover import Claim, FailoverMember, LeaseConfig, LeaseRow, Stale, decide_claim
from tests.support.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 30  # a member to start, and a grant
slow = pytest.mark.slow


# -- decide_claim: every branch, then a property ---------------------------------------------------


@pytest.mark.parametrize(
    ("row", "me", "expected"),
    [
        pytest.param(LeaseRow(None, 0), "me", Claim.TAKE, id="never-held"),
        pytest.param(LeaseRow("dead", 4), "me", Claim.TAKE, id="holder-died"),
        pytest.param(LeaseRow("me", 4), "me", Claim.TAKE, id="own-name-fresh-process"),
        pytest.param(LeaseRow("dead", 4, closed=True), "me", Claim.CLOSED, id="pair-stopping-whole"),
        pytest.param(LeaseRow(None, 0, closed=True), "me", Claim.CLOSED, id="closed-before-anyone-held-it"),
    ],
)
def test_it_decides_each_claim_from_the_lease_file(row, me, expected):
    assert decide_claim(row, me) is expected


@given(holder=st.none() | st.sampled_from(["a", "b"]), epoch=st.integers(0, 10**6), me=st.sampled_from(["a", "b"]))
def test_it_lets_anyone_take_an_open_pair_and_no_newcomer_take_a_closed_one(holder, epoch, me):
    assert decide_claim(LeaseRow(holder, epoch), me) is Claim.TAKE
    closed = decide_claim(LeaseRow(holder, epoch, closed=True), me)
    assert closed is (Claim.TAKE if holder == me else Claim.CLOSED)


# -- one process: the lease file -------------------------------------------------------------------


def test_each_grant_writes_a_higher_epoch_naming_its_holder_durably(tmp_path):
    said: list[dict[str, Any]] = []
    first = FailoverMember(LeaseConfig(tmp_path, "pair-a", "r1"), on_event=lambda kind, **f: said.append(f))
    grant = first.try_acquire()
    assert grant is not None and (grant.epoch, grant.previous_holder, grant.previous_epoch) == (1, None, 0)
    assert json.loads((tmp_path / "pair-a.lease").read_text()) == {"holder": "r1", "epoch": 1}
    assert (tmp_path / "pair-a.lock").stat().st_mode & 0o777 == 0o600

    second = FailoverMember(LeaseConfig(tmp_path, "pair-a", "r2"))
    assert second.try_acquire() is None, "the lock is held: a second descriptor cannot take it"
    other_pair = FailoverMember(LeaseConfig(tmp_path, "pair-b", "r3"))
    assert other_pair.try_acquire() is not None, "each pair has a lock of its own"
    first.close()  # the holder's process ends: the kernel frees the lock

    grant = second.try_acquire()
    assert grant is not None and (grant.epoch, grant.previous_holder, grant.previous_epoch) == (2, "r1", 1)
    assert said == [{"epoch": 1, "previous_holder": None, "previous_epoch": 0}]
    second.close()
    other_pair.close()


def test_an_unreadable_lease_file_is_no_grant(tmp_path):
    (tmp_path / "pair-a.lease").write_text("{not json")
    member = FailoverMember(LeaseConfig(tmp_path, "pair-a", "r1"))
    with pytest.raises(Stale, match="cannot be read"):
        member.try_acquire()
    # The lock went back with the refusal: a member that can read the file is not kept waiting.
    (tmp_path / "pair-a.lease").write_text('{"holder": "r0", "epoch": 7}')
    assert FailoverMember(LeaseConfig(tmp_path, "pair-a", "r2")).try_acquire().epoch == 8


def test_a_closed_pair_is_taken_by_no_newcomer_and_forgotten_whole(tmp_path):
    failover.close_pair(tmp_path, "pair-a")
    assert FailoverMember(LeaseConfig(tmp_path, "pair-a", "r1")).try_acquire() is None
    stop = threading.Event()
    waited: list[BaseException] = []

    def standby() -> None:
        try:
            FailoverMember(LeaseConfig(tmp_path, "pair-a", "r2")).acquire(stop)
        except BaseException as err:  # collected for the assertion below
            waited.append(err)

    thread = threading.Thread(target=standby, daemon=True)
    thread.start()
    stop.set()  # its own stop comes
    thread.join(STARTUP_S)
    assert not thread.is_alive() and [type(e) for e in waited] == [InterruptedError]

    failover.forget_pair(tmp_path, "pair-a")
    assert list(tmp_path.iterdir()) == []


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
        HungHost(), Requests(), LeaseConfig(Path("/nonexistent"), "pair-1", "standby-1"),
        role="standby", fence_name="pair-1", wake_timeout_s=0.2, liveness_every_s=1.0,
    )  # fmt: skip
    grant = failover.Grant(2, "active-1", 1, time.monotonic())
    waking = threading.Thread(target=member.take_over, args=(grant,), daemon=True)
    waking.start()

    assert exited.wait(10), "the hung wake was not cut short"
    unhang.set()
    waking.join(10)
    failed = next(fields for event, fields in said if event == "failed")
    assert codes == [1] and "wake ran past its timeout" in failed["reason"]
    assert [e for e, _ in said].index("failed") < [e for e, _ in said].index("active")


# -- pair members as processes ---------------------------------------------------------------------


def lock_holders(path: Path) -> dict[int, str]:
    """{pid: "holds" | "waits"} of the flock on `path`, as the kernel lists it in /proc/locks."""
    inode = path.stat().st_ino
    found: dict[int, str] = {}
    for line in Path("/proc/locks").read_text().splitlines():
        fields_ = line.split()
        waiting = fields_[1] == "->"
        rest = fields_[2:] if waiting else fields_[1:]
        if rest[0] != "FLOCK" or int(rest[4].rsplit(":", 1)[1]) != inode:
            continue
        found[int(rest[3])] = "waits" if waiting else "holds"
    return found


class Member:
    """One tests/support/failover_member.py process, its JSON lines gathered by a reader thread."""

    def __init__(self, replica_id: str, folder: Path, fence: str, try_first: bool, log: Path):
        self.id = replica_id
        self.log = log
        self.events: list[dict[str, Any]] = []
        self.killed_at: float | None = None  # time.monotonic() as the harness sent SIGKILL
        self.exited = False
        self._changed = threading.Condition()
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.support.failover_member", "--dir", str(folder), "--fence", fence),
                    *("--replica-id", replica_id),
                    *(["--try-first"] if try_first else []),
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                preexec_fn=die_with_parent(signal.SIGKILL),  # never outlive a killed pytest
            )
        threading.Thread(target=self._read, name=f"read-{replica_id[:6]}", daemon=True).start()

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

    def wait_grant(self, count: int = 1) -> dict[str, Any]:
        return self.wait_for(lambda m: m.of("grant")[count - 1 : count], f"grant #{count}")[0]

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
class Pair:
    """A pair's lock in a node folder of its own, and the members started on it."""

    folder: Path
    logs: Path
    fence: str = field(default_factory=lambda: uuid.uuid4().hex)
    members: list[Member] = field(default_factory=list)

    def member(self, try_first: bool = False) -> Member:
        member = Member(uuid.uuid4().hex, self.folder, self.fence, try_first, self.logs / f"member-{len(self.members)}")
        self.members.append(member)
        return member

    @property
    def lock_path(self) -> Path:
        return LeaseConfig(self.folder, self.fence, "").lock_path

    def lease(self) -> dict[str, Any]:
        return json.loads(LeaseConfig(self.folder, self.fence, "").lease_path.read_text())

    def wait_waiting(self, member: Member) -> None:
        """Until the kernel lists `member` waiting for the lock."""
        pid = member.process.pid
        wait_until(
            lambda: self.lock_path.exists() and lock_holders(self.lock_path).get(pid) == "waits",
            STARTUP_S,
            f"{member} to wait for the lock",
        )


@pytest.fixture
def pair(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    p = Pair(tmp_path / "failover", logs)
    try:
        yield p
    finally:
        for member in p.members:
            if member.alive:
                member.kill()
            print(f"--- {member} events {member.events}\n{member.stderr()[-2000:]}")  # shown on failure


@slow
def test_it_gives_the_lock_to_the_standby_when_the_holder_is_sigkilled_at_a_higher_epoch_each_time(pair):
    holder = pair.member(try_first=True)
    first = holder.wait_grant()
    assert (first["epoch"], first["previous_holder"]) == (1, None)
    epochs = [first["epoch"]]

    for _ in range(2):
        standby = pair.member()
        pair.wait_waiting(standby)
        assert standby.of("grant") == []  # the holder is alive: the lock is not free
        holder.kill()
        grant = standby.wait_grant()
        assert grant["previous_holder"] == holder.id and grant["previous_epoch"] == epochs[-1]
        assert grant["t"] > holder.killed_at
        epochs.append(grant["epoch"])
        assert pair.lease() == {"holder": standby.id, "epoch": grant["epoch"]}
        holder = standby

    assert epochs == [1, 2, 3]


@slow
def test_a_hung_holder_keeps_the_lock_until_it_is_killed(pair):
    # SIGSTOPped (hung), the holder still holds the lock: only its death passes it on, which its
    # node agent brings about (inference.supervisor's liveness watchdog).
    holder = pair.member(try_first=True)
    holder.wait_grant()
    standby = pair.member()
    pair.wait_waiting(standby)

    holder.pause()
    assert lock_holders(pair.lock_path) == {holder.process.pid: "holds", standby.process.pid: "waits"}
    assert standby.of("grant") == [] and pair.lease()["holder"] == holder.id

    holder.kill()
    assert standby.wait_grant()["previous_holder"] == holder.id


@slow
def test_a_standby_granted_the_lock_of_a_pair_stopped_whole_leaves_it_and_waits_for_its_own_stop(pair):
    holder = pair.member(try_first=True)
    holder.wait_grant()
    standby = pair.member()
    pair.wait_waiting(standby)

    # The agent closes the pair before it stops the members (inference.supervisor.stop), then the
    # active exits first.
    failover.close_pair(pair.folder, pair.fence)
    holder.kill()

    standby.wait_for(lambda m: m.of("claim"), "the lock's grant")
    assert [c["claim"] for c in standby.of("claim")] == ["closed"]
    # It gave the lock back and waits on for its own stop, never holding the pair.
    wait_until(lambda: lock_holders(pair.lock_path) == {}, STARTUP_S, "the lock to be given back")
    assert standby.alive and standby.of("grant") == [] and pair.lease()["holder"] == holder.id


@slow
def test_it_never_has_two_members_active_at_once_across_kills_and_stops(pair):
    pair.member(try_first=True).wait_grant()
    takeovers = 0
    for fault in ["sigkill", "sigstop-then-kill"] * 3:
        (holder,) = [m for m in pair.members if m.alive and m.of("grant")]
        standby = pair.member()
        pair.wait_waiting(standby)
        if fault == "sigstop-then-kill":
            holder.pause()
        holder.kill()
        standby.wait_grant()
        takeovers += 1

    for member in pair.members:
        if member.alive:
            member.kill()
    intervals = sorted(
        ((m.of("grant")[0]["epoch"], m.of("grant")[0]["t"], m.killed_at, m) for m in pair.members if m.of("grant")),
        key=lambda i: i[1],
    )
    history = "\n".join(f"{m} epoch {e}: {start:.3f} .. {end:.3f}" for e, start, end, m in intervals)
    # Each epoch is one member's, granted in increasing order, none skipped.
    assert [e for e, *_ in intervals] == list(range(1, takeovers + 2)), history
    # Epoch intervals never overlap: each grant comes after the previous holder was killed.
    for earlier, later in itertools.pairwise(intervals):
        assert later[1] > earlier[2], history
