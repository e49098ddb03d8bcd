"""A replica process outlives its node agent for its adoption window, and the agent's next run takes
it over instead of loading its model again (restart restores)."""

from __future__ import annotations

import dataclasses
import json
import queue
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from gpuportal.wire.node_reports import Survivor
from inference import adoption as adoption_socket
from inference.supervisor import Supervisor
from scheduling.core import adoption
from tests.support.processes import wait_until
from tests.support.replicas import LOAD_TIMEOUT_S, TINY_MLP, Events, gone, spec

ROOT = Path(__file__).resolve().parents[2]

# -- which survivors the books keep (pure) ------------------------------------------------------

ROW_STATES = ("pending", "loading", "serving", "draining", "sleeping", "waking", "standby", "stopping")


def survivor(state: str, last: str | None) -> Survivor:
    return Survivor(replica_id="r1", pid=4242, state=state, last=last)


@pytest.mark.parametrize(
    ("process", "last", "kept_with"),
    [
        ("loading", None, {"pending", "loading"}),
        # Its `serving` report may have died with the old agent: the resync brings the books along.
        ("serving", "serving", {"pending", "loading", "serving"}),
        ("serving", "woken", {"waking", "serving"}),
        ("sleeping", "sleeping", {"draining", "sleeping"}),
        ("waking", "sleeping", {"waking"}),
        ("draining", "serving", {"draining"}),
        ("stopping", "serving", {"stopping"}),
    ],
)
def test_it_keeps_a_survivor_only_where_its_books_agree(process, last, kept_with):
    kept = {row for row in ROW_STATES if adoption.keeps(row, survivor(process, last))}
    assert kept == kept_with


def test_it_refuses_a_survivor_behind_its_books_saying_why():
    # The books put it to sleep, but the old agent died before the command reached the process.
    behind = survivor("serving", "serving")
    assert not adoption.keeps("draining", behind)
    assert adoption.why_not("draining", behind) == (
        "its process says serving (last reported serving) but its books say draining: a command or report "
        "was lost with the old agent"
    )
    # A process in a state no table row names (a failover standby, a stale one) is never kept.
    assert not any(adoption.keeps(row, survivor("standby", None)) for row in ROW_STATES)


# -- the processes --------------------------------------------------------------------------

AGENT = textwrap.dedent(
    """
    import json, sys, threading
    from gpuportal.wire.node_lease import NodeFence
    from inference.supervisor import ReplicaSpec, Supervisor

    def on_event(replica_id, event):
        print(json.dumps(event), flush=True)

    supervisor = Supervisor(sys.argv[1])
    supervisor.node_fence = NodeFence("box", 4)
    supervisor.start(ReplicaSpec(**json.loads(sys.argv[2])), on_event)
    threading.Event().wait()
    """
)


class DoomedAgent:
    """A supervisor in a process of its own, as in a node agent, for the test to kill."""

    def __init__(self, log_dir: Path, window_s: float):
        record = dataclasses.replace(spec(TINY_MLP, loader="torch-module"), adoption_window_s=window_s).record()
        self.process = subprocess.Popen(
            [sys.executable, "-c", AGENT, str(log_dir), json.dumps(record)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.process.stdout], daemon=True).start()

    def serving_pid(self) -> int:
        while True:
            event = json.loads(self.lines.get(timeout=LOAD_TIMEOUT_S))
            assert event["event"] not in {"failed", "stopped"}, event
            if event["event"] == "serving":
                return int(event["pid"])

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)
        self.process.stdout.close()


def orphan(log_dir: Path, window_s: float) -> tuple[int, int]:
    """(the pid of a serving replica whose agent was then SIGKILLed, that agent's pid)."""
    doomed = DoomedAgent(log_dir, window_s)
    try:
        return doomed.serving_pid(), doomed.process.pid
    finally:
        doomed.kill()


@pytest.mark.slow
def test_a_replica_outlives_its_agent_and_the_next_one_takes_it_over(tmp_path):
    log_dir = tmp_path / "logs"
    pid, agent_pid = orphan(log_dir, window_s=60)
    assert not gone(pid), "the replica outlives its agent"
    assert psutil.Process(pid).ppid() != agent_pid

    events = Events()
    successor = Supervisor(log_dir)
    try:
        hellos = successor.adopt_survivors(events)
        hello = {"event": "hello", "replica_id": "r1", "pid": pid, "state": "serving", "last": "serving"}
        # And the node epoch it serves under, under which its adopter holds the node's lease
        # while it registers (tests/inference/test_agent.py).
        assert hellos == {"r1": {**hello, "node_epoch": 4}}
        assert successor.running() == ["r1"] and successor.pid("r1") == pid
        successor.resume()
        # The books may have missed its last report with the old agent: it says it again.
        successor.send("r1", {"cmd": "resync"})
        _, serving = events.until("serving", timeout=10)
        assert serving["pid"] == pid and serving["weights_bytes"] > 0
        successor.send("r1", {"cmd": "ping"})
        _, pong = events.until("pong", timeout=10)
        assert pong["state"] == "serving"

        # Commands reach it through its new agent, and it ends like any replica.
        assert successor.stop("r1", drain_timeout_s=0) is None  # its exit code went to whoever reaped it
        assert events.final(timeout=30)["event"] == "stopped"
        wait_until(lambda: gone(pid), 10, "the adopted replica to exit")
        assert successor.running() == []
        assert not list(log_dir.glob("*.adopt")), "an ended replica leaves nothing to adopt"
    finally:
        successor.stop_all(timeout=5)


@pytest.mark.slow
def test_an_orphan_nobody_adopts_stops_after_its_window_and_is_not_adopted_later(tmp_path):
    log_dir = tmp_path / "logs"
    pid, _ = orphan(log_dir, window_s=1)
    wait_until(lambda: gone(pid), 30, "the orphan to stop after its adoption window")
    assert "no agent adopted it within 1 s; stopping" in (log_dir / "replica-r1.log").read_text()

    successor = Supervisor(log_dir)
    assert successor.adopt_survivors(Events()) == {}
    assert successor.running() == []
    assert not list(log_dir.glob("*.adopt")), "the record of a replica that is gone is removed"


@pytest.mark.slow
def test_a_replica_without_a_window_dies_with_its_agent(tmp_path):
    pid, _ = orphan(tmp_path / "logs", window_s=0)
    wait_until(lambda: gone(pid), 10, "the replica to die with its agent")
    assert Supervisor(tmp_path / "logs").adopt_survivors(Events()) == {}


@pytest.mark.slow
@pytest.mark.parametrize("unread", [False, True], ids=["idle", "with-a-command-unread"])
def test_an_adopted_replica_that_is_killed_is_reported_as_a_crash(tmp_path, unread):
    log_dir = tmp_path / "logs"
    pid, _ = orphan(log_dir, window_s=60)
    events = Events()
    successor = Supervisor(log_dir)
    try:
        assert list(successor.adopt_survivors(events)) == ["r1"]
        successor.resume()
        replica = psutil.Process(pid)
        if unread:
            # Its stream is a Unix socket: a peer that dies with data unread in it resets the
            # connection instead of closing it. That is its end as well: the reader thread used to
            # die of the reset, leaving the replica counted as running and never failed.
            replica.suspend()
            successor.send("r1", {"cmd": "ping"})  # stopped, it never reads this
        replica.kill()
        failed = events.final(timeout=30)
        assert failed["event"] == "failed" and failed["kind"] == "crash"
        assert failed["reason"].startswith(("replica process exited: ", "replica process exited, with no error"))
        assert successor.running() == []
    finally:
        successor.stop_all(timeout=5)


@pytest.mark.slow
def test_an_adopter_that_dies_with_events_unread_leaves_the_replica_waiting_for_the_next(tmp_path):
    # The adopter's death resets the socket (the replica's events unread in it) rather than
    # closing it: the replica's command thread must take that as the agent gone, and wait again.
    log_dir = tmp_path / "logs"
    pid, _ = orphan(log_dir, window_s=60)
    doomed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    doomed.connect(adoption_socket.socket_name(adoption_socket.address(log_dir, "r1")))
    doomed.settimeout(10)
    doomed.sendall(b'{"cmd": "ping"}\n')  # it answers with a pong; nobody reads it
    # Its hello and its pong wait in the socket, unread (peeked at, not taken), as the adopter dies.
    wait_until(lambda: b'"pong"' in doomed.recv(65536, socket.MSG_PEEK), 10, "the pong to be written")
    assert f'"pid":{pid}'.encode() in doomed.recv(65536, socket.MSG_PEEK)
    doomed.close()

    events = Events()
    successor = Supervisor(log_dir)
    try:
        hellos = wait_until(lambda: successor.adopt_survivors(events), 30, "the replica to wait for an adopter again")
        assert hellos["r1"]["pid"] == pid and not gone(pid)
    finally:
        successor.stop_all(timeout=5)
