"""Recovery: `manage.py up` outlives its own parts.

One `up`, as `make run` starts it (embedded PostgreSQL and Redis, virtual GPUs), a tiny causal LM
deployed, two clients sending requests one after another, at most ten a second (each request
accepted, an id came back, is polled until it ends) and an operator reading the deployment every
50 ms. Then each of up's processes in turn is SIGKILLed (the web server, the control
worker, beat, the agents' worker, the node agent, Redis, PostgreSQL), and `up` starts it again by
itself. Measured per kill:
- `detected`: SIGKILL → `up` says it died (it looks every 0.2 s);
- `first answer`: SIGKILL → the first answer to a request sent after the kill;
- `503s` / `refused`: what the clients met meanwhile (JSON 503s, connections refused or cut);
- `5xx`: any other server error (must be 0); `lost`: accepted requests that never ended done
  (must be 0).
Then PostgreSQL (every process of it) and Redis are each frozen (SIGSTOP) for longer than the
heartbeat timeout and let go (SIGCONT): a stall of the control plane's own servers, which must not
be read as the death of the node (no node written off, the same replica process serving after).
Last, beat is killed CRASH_LOOP times in a row, each time as soon as `up` has started it again: a
helper that crash-loops degrades the portal (/readyz names it) and stops nothing.

    python -m bench.recovery [--trials 1] [--no-record]

tests/gpuportal/test_recovery.py runs the same scenario and asserts what must hold.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path

import psutil
import redis

from bench.report import record, table
from gpuportal.stack import free_port
from gpuportal.stackenv import read_stack_env
from gpuportal.up import RESTART_LIMIT
from gpuportal.wire.requestqueue import REQUEST_PREFIX

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "recovery-bench-password"
NAME = "steady"
# up's processes, and how each shows in its command line. The web server's main process (its
# worker is its child, stopped by `up` with its process group).
PROCESSES = {
    "web": "granian",
    "control": "-Q control",
    "beat": " beat ",
    "agents": "-Q agents",
    "agent": "manage.py agent",
    "redis": "valkey-server",  # the embedded Redis (gpuportal.stack.EmbeddedRedis)
    "postgresql": "postgres -D",
}
# The short-lived `manage.py record_restart NAME` with which `up` writes a restart's Event names the
# process it records ("record_restart beat"). Taken for that process, it made beat two processes, and
# so not yet running again, for as long as the recorder ran: seconds after each of its restarts.
RECORDER = "record_restart"
# Frozen, each in turn, longer than the stack's heartbeat timeout (HEARTBEAT_TIMEOUT_S below).
STALLS = ("postgresql", "redis")
# Beats every second and a 12 s timeout (5 s and 20 s by default), so that a stall of 16 s
# outlasts the timeout without the scenario taking a minute per stall; the window in which a
# restarted agent adopts its replicas stays what it is by default (the timeout less two beats).
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 1.0, 12.0
STALL_S = 16.0
# Beat killed this many times in a row: once more than the restarts that stop the portal when a
# server needs them (RESTART_LIMIT), since a helper such as beat is held to no limit. `up` backs off
# at most RESTART_BACKOFF_MAX_S between restarts in this stack (30 s by default), so the loop
# takes seconds, not minutes.
CRASH_LOOP = RESTART_LIMIT + 1
RESTART_BACKOFF_MAX_S = 1.0
TERMINAL = {"done", "failed", "cancelled"}
# Each client pauses this long between two requests: ten a second each still meet every outage
# (each lasts seconds) many times over, where back to back they kept the machine's cores busy
# serving them, slowing the very restarts being timed (and whatever runs beside).
PACE_S = 0.1
CUT = (OSError, HTTPException)  # refused, reset, or closed while the server died


@dataclass
class Sent:
    """One request a client sent: accepted once an id came back."""

    at: float
    # When it was accepted (or given up at the end).
    answered_at: float | None = None
    # The longest one POST of it took to come back, whatever it said (each asks timeout_s 2).
    slowest_s: float = 0.0
    id: str | None = None
    status: str | None = None
    ended_at: float | None = None


@dataclass
class Seen:
    """What the clients met while one process was down."""

    unavailable: int = 0
    refused: int = 0
    # 504s: the portal could not tell whether a request was accepted (Redis went away mid-submit).
    unknown: int = 0
    server_errors: list[str] = field(default_factory=list)


class Stack:
    """One `manage.py up` in a data directory of its own, its output read by a thread."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.port = free_port()
        dropped = {"DATABASE_URL", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"}
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env |= {"GPUPORTAL_DATA_DIR": str(data_dir), "GPUPORTAL_ADMIN_PASSWORD": PASSWORD, "PYTHONUNBUFFERED": "1"}
        env |= {
            "GPUPORTAL_HEARTBEAT_S": f"{HEARTBEAT_S:g}",
            "GPUPORTAL_HEARTBEAT_TIMEOUT_S": f"{HEARTBEAT_TIMEOUT_S:g}",
            "GPUPORTAL_RESTART_BACKOFF_MAX_S": f"{RESTART_BACKOFF_MAX_S:g}",
        }
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--port", str(self.port), "--quiet",
             "--virtual-gpus", "1x4GiB", "--node", "steady"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.token = ""

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith("gpuportal is up"):
                self.up.set()

    def start(self, timeout: float = 240) -> None:
        if not self.up.wait(timeout):
            self.process.kill()
            raise RuntimeError("up did not come up:\n" + "\n".join(line for _, line in self.lines[-30:]))
        self.token = self.call("POST", "/api/auth/token/", {"username": "admin", "password": PASSWORD})[1]["token"]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)

    def call(
        self, method: str, path: str, body: dict | None = None, timeout: float = 30, key: str | None = None
    ) -> tuple[int, dict]:
        """The status and JSON body; a server that is down raises one of CUT. `key`: an
        Idempotency-Key."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", **({"Idempotency-Key": key} if key else {})},
        )
        if self.token:
            request.add_header("Authorization", f"Token {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw or b"{}")
            except ValueError:
                return err.code, {"body": raw[:200].decode(errors="replace")}

    def process_of(self, name: str) -> psutil.Process:
        found = []
        for child in psutil.Process(self.process.pid).children():
            try:
                line = " ".join(child.cmdline()) + " "
            except psutil.NoSuchProcess:  # a zombie too: one that just ended (a restart's recorder), not yet reaped
                continue
            if PROCESSES[name] in line and RECORDER not in line:
                found.append(child)
        (one,) = found
        return one

    def said_after(self, since: float, text: str) -> float | None:
        return next((at for at, line in list(self.lines) if at >= since and text in line), None)


class Clients:
    """Two clients sending requests one after another (PACE_S apart), each sent again under its Idempotency-Key until
    it is accepted; a third that sends no key and never sends again (whose 503s must not run);
    each accepted request is polled until it ends."""

    def __init__(self, stack: Stack, count: int = 2):
        self.stack = stack
        self.sent: list[Sent] = []
        self.seen = Seen()
        self.stopping = threading.Event()
        # The inputs of the keyless client's requests that were answered 503.
        self.refused_inputs: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(count)]
        self.threads.append(threading.Thread(target=self._client, args=(count, False), daemon=True))
        # An operator's dashboard beside them: it reads the database on every call, where the
        # clients' hot path may not (a cached token, a replica that claims requests in Redis).
        self.threads.append(threading.Thread(target=self._operator, daemon=True))
        for thread in self.threads:
            thread.start()

    def next_window(self) -> Seen:
        """Start counting what the clients meet afresh; the last window's counts."""
        seen, self.seen = self.seen, Seen()
        return seen

    def _client(self, index: int, keyed: bool = True) -> None:
        while not self.stopping.wait(PACE_S):
            sent = Sent(at=time.monotonic())
            self.sent.append(sent)
            text = f"{'client' if keyed else 'keyless'} {index} at {sent.at:.3f}"
            body = {"input": text, "params": {"max_tokens": 2}, "timeout_s": 2}
            # Not accepted (a 503, a 504, a cut connection): sent again under the same key until
            # it is, as a client that cannot tell whether it ran must. The key makes that safe.
            # The keyless client never sends again: its 503s must not have run.
            key = uuid.uuid4().hex if keyed else None
            answer = None
            while not self.stopping.is_set():
                tried = time.monotonic()
                code, answer = self._call("POST", f"/api/deployments/{NAME}/infer/", body, key=key)
                sent.slowest_s = max(sent.slowest_s, time.monotonic() - tried)
                if answer is not None and answer.get("id"):
                    break
                if not keyed:
                    if code == 503:
                        self.refused_inputs.append(text)
                    break
                self.stopping.wait(0.1)  # the server is on its way back
            sent.answered_at = time.monotonic()
            if answer is None or not answer.get("id"):
                if not keyed:
                    self.stopping.wait(0.1)
                continue
            sent.id = answer["id"]
            # The keyless client sends on without waiting for what it sent to end, to meet more of
            # each outage: what it had accepted is polled at the end (`unfinished`).
            while keyed and answer.get("status") not in TERMINAL and not self.stopping.is_set():
                self.stopping.wait(0.05)
                answer = self._try("GET", f"/api/requests/{sent.id}/") or {}
            sent.status = answer.get("status")
            sent.ended_at = time.monotonic() if sent.status in TERMINAL else None

    def _operator(self) -> None:
        while not self.stopping.wait(0.05):
            self._try("GET", f"/api/deployments/{NAME}/")

    def _try(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> dict | None:
        return self._call(method, path, body, key)[1]

    def _call(
        self, method: str, path: str, body: dict | None = None, key: str | None = None
    ) -> tuple[int | None, dict | None]:
        """The status (None for a cut) and the answer, None where nothing was accepted."""
        try:
            code, answer = self.stack.call(method, path, body, key=key)
        except CUT:
            self.seen.refused += 1
            return None, None
        if code == 503 and not answer.get("id"):  # an outage: nothing accepted, try again
            self.seen.unavailable += 1
            return code, None
        if code == 504 and answer.get("request"):  # Redis went away mid-submit: it may have run
            self.seen.unknown += 1
            return code, None
        if code >= 500 and not answer.get("id"):
            self.seen.server_errors.append(f"{method} {path}: {code} {answer}")
            return code, None
        return code, answer

    def slowest_post_s(self, since: float) -> float:
        """The longest one POST of a request still sending after `since` took to come back (a
        refused one counts too): `timeout_s` bounds it whatever the database does."""
        return max((s.slowest_s for s in list(self.sent) if (s.answered_at or time.monotonic()) >= since), default=0.0)

    def first_answer_after(self, since: float) -> float | None:
        ends = [s.ended_at for s in list(self.sent) if s.at > since and s.status == "done" and s.ended_at]
        return min(ends) - since if ends else None

    def finish(self, timeout: float = 60) -> None:
        """Stop sending, and wait for every accepted request still polled."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout)

    def run_twice(self) -> list[str]:
        """Requests of the keyed clients the portal holds that no client knows of: one accepted
        while its client met a 503, a 504 or a cut, and then sent again. Each client request, sent
        again under its key, must be the one the portal runs."""
        known = {sent.id for sent in list(self.sent) if sent.id}
        return sorted(id for id, text in self.held().items() if id not in known and text.startswith("client "))

    def ran_after_503(self) -> list[str]:
        """The keyless client's requests answered 503 that the portal holds all the same: a 503
        must mean "not run"."""
        return sorted(set(self.held().values()) & set(self.refused_inputs))

    def held(self) -> dict[str, str]:
        """{id: input} of every request the portal holds, read from its Redis: the API does not
        show a request's input."""
        env = read_stack_env(self.stack.data_dir / "stack.env")
        client = redis.Redis.from_url(env["REDIS_URL"])
        held = {}
        for key in client.scan_iter(f"{REQUEST_PREFIX}*", count=1000):
            raw = client.hget(key, "input")
            if raw is not None:
                held[key.decode().removeprefix(REQUEST_PREFIX)] = json.loads(raw)
        return held

    def unfinished(self) -> list[Sent]:
        """Accepted requests that did not end done: polled again now that nothing is killed."""
        lost = []
        for sent in self.sent:
            if sent.id is None or sent.status == "done":
                continue
            deadline = time.monotonic() + 30
            answer: dict = {}
            while time.monotonic() < deadline:
                answer = self._try("GET", f"/api/requests/{sent.id}/") or {}
                if answer.get("status") in TERMINAL:
                    break
                time.sleep(0.1)
            sent.status = answer.get("status")
            if sent.status != "done":
                lost.append(sent)
        return lost


@dataclass
class Recovery:
    process: str
    killed_at: float
    detected_s: float | None
    first_answer_s: float | None
    seen: Seen
    lost: int = 0


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def deploy(stack: Stack, model_dir: Path) -> None:
    wait_for(
        lambda: any(n["status"] == "online" for n in stack.call("GET", "/api/nodes/")[1].get("results", [])),
        120,
        "the node agent to register",
    )
    code, answer = stack.call("POST", "/api/deployments/", {"name": NAME, "model": {"source": str(model_dir)}})
    if code != 201:
        raise RuntimeError(f"deploy failed: {code} {answer}")
    wait_for(
        lambda: stack.call("GET", f"/api/replicas/?deployment={NAME}&state=serving")[1].get("results"),
        180,
        "the deployment to serve",
    )


def kill_each(stack: Stack, clients: Clients, processes: list[str]) -> list[Recovery]:
    """SIGKILL each process in turn; after each, wait until it runs again and the stack answers
    through it, so that no kill's window overlaps the next."""
    recoveries = []
    for name in processes:
        wait_for(lambda: clients.first_answer_after(time.monotonic() - 1), 60, "answers before the kill")
        clients.next_window()
        victim = stack.process_of(name)
        killed_at = time.monotonic()
        if name == "web":
            # The server and its worker, as a crash of the machine's web tier would: the main
            # process alone would leave its worker answering until `up` ends it.
            os.killpg(victim.pid, signal.SIGKILL)
        else:
            victim.kill()
        said = f"{name} was killed by SIGKILL"
        detected = wait_for(lambda t=killed_at, s=said: stack.said_after(t, s), 30, f"up to say {said}")
        wait_for(lambda n=name, old=victim.pid: _running_again(stack, n, old), 120, f"{name} to run again")
        back = time.monotonic()
        first = wait_for(lambda t=killed_at: clients.first_answer_after(t), 120, f"an answer after {name} was killed")
        wait_for(lambda t=back: clients.first_answer_after(t), 120, f"an answer once {name} is back")
        # And until /readyz says every process is ready: an agent is once it has registered again,
        # which it does after adopting the replicas it found. Answers alone come sooner (the
        # replica serves on while orphaned), and the next kill (Redis, after the agent) then fell
        # inside the new agent's start, which it slowed past the replica's adoption window.
        wait_for(lambda: readiness(stack).get("status") == "ready", 120, f"/readyz to say ready once {name} is back")
        recoveries.append(Recovery(name, killed_at, detected - killed_at, first, clients.next_window()))  # type: ignore[operator]
    return recoveries


@dataclass
class Stall:
    process: str
    # Let go → the first answer to a request sent after that.
    first_answer_s: float | None
    seen: Seen
    # Let go → the heartbeat sweep's Event saying the control plane stalled (its first sweep after).
    judged_s: float | None = None
    # The longest a POST /infer/ sent from the stall on took to come back (each asks timeout_s 2).
    slowest_post_s: float = 0.0


def stall_each(stack: Stack, clients: Clients, processes: tuple[str, ...]) -> list[Stall]:
    """Freeze each server, every process of it (PostgreSQL's backends too: its postmaster alone
    stopped would leave open connections answering), for STALL_S, then let it go."""
    stalls = []
    for name in processes:
        wait_for(lambda: clients.first_answer_after(time.monotonic() - 1), 60, "answers before the stall")
        clients.next_window()
        seen_before = stalls_seen(stack)
        main = stack.process_of(name)
        frozen = [main, *main.children(recursive=True)]
        stalled_at = time.monotonic()
        for process in frozen:
            process.suspend()
        try:
            # The stall itself: held for its length, as a frozen disk or a paused VM would.
            time.sleep(STALL_S)
        finally:
            for process in frozen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.resume()
        resumed = time.monotonic()
        first = wait_for(lambda t=resumed: clients.first_answer_after(t), 120, f"an answer once {name} runs again")
        # The first sweep after the stall has judged the nodes (a stall read as a death would
        # have written the node off in that very sweep).
        wait_for(lambda n=seen_before: stalls_seen(stack) > n, 60, f"the heartbeat sweep to see {name}'s stall")
        judged = time.monotonic() - resumed
        slowest = clients.slowest_post_s(stalled_at)
        stalls.append(Stall(name, first, clients.next_window(), judged, slowest))  # type: ignore[arg-type]
    return stalls


@dataclass
class CrashLoop:
    process: str
    kills: int
    # /readyz named it as down after how many of the kills (it may be back before a look).
    named_down: int
    # After the last kill: it runs again and /readyz says ready, nothing down.
    whole_after: bool
    seen: Seen


def crash_loop(stack: Stack, clients: Clients, name: str, kills: int) -> CrashLoop:
    """Kill `name` `kills` times in a row, each time as soon as `up` has started it again."""
    wait_for(lambda: clients.first_answer_after(time.monotonic() - 1), 60, "answers before the crash loop")
    clients.next_window()
    named = 0
    for _ in range(kills):
        victim = wait_for(lambda: _process_or_none(stack, name), 60, f"{name} to run")
        victim.kill()  # type: ignore[attr-defined]
        # While it is down, /readyz names it (until `up` has it ready again).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if name in readiness(stack).get("down", {}):
                named += 1
                break
            time.sleep(0.05)
        wait_for(lambda v=victim: _running_again(stack, name, v.pid), 60, f"{name} to run again")  # type: ignore[attr-defined]
    whole = wait_for(lambda: readiness(stack).get("status") == "ready", 120, "/readyz to say ready again")
    wait_for(lambda: clients.first_answer_after(time.monotonic() - 1), 60, "answers after the crash loop")
    return CrashLoop(name, kills, named, bool(whole), clients.next_window())


def _process_or_none(stack: Stack, name: str) -> psutil.Process | None:
    try:
        return stack.process_of(name)
    except (ValueError, psutil.NoSuchProcess):
        return None


def readiness(stack: Stack) -> dict:
    try:
        return stack.call("GET", "/readyz")[1]
    except CUT:
        return {}


def stalls_seen(stack: Stack) -> int:
    """The control.stalled Events so far; 0 while the API cannot answer."""
    try:
        code, body = stack.call("GET", "/api/events/?kind=control.stalled&page_size=1")
    except CUT:
        return 0
    return body.get("count", 0) if code == 200 else 0


def _running_again(stack: Stack, name: str, old_pid: int) -> bool:
    try:
        process = stack.process_of(name)
    except (ValueError, psutil.NoSuchProcess):  # none yet, or between two runs
        return False
    return process.pid != old_pid and process.is_running()


@dataclass
class Outcome:
    recoveries: list[Recovery]
    lost: list[Sent]
    # The processes whose restart is in the trail (Events of kind stack.restarted).
    restarted: set[str]
    exit_code: int
    said: list[str]
    # The serving replicas' processes before the first kill and after the last: the data plane
    # lives through every restart of the control plane (the agent's replicas are adopted).
    pids_before: list[int] = field(default_factory=list)
    pids_after: list[int] = field(default_factory=list)
    stalls: list[Stall] = field(default_factory=list)
    crash_loop: CrashLoop | None = None
    # Client requests the portal holds more than one of (sent again under their key).
    run_twice: list[str] = field(default_factory=list)
    # The keyless client's requests answered 503 that the portal holds anyway, and how many 503s
    # it met in all.
    ran_after_503: list[str] = field(default_factory=list)
    keyless_503s: int = 0
    # Events of the run: nodes written off (node.offline) and stalls the control plane saw.
    written_off: list[str] = field(default_factory=list)
    stalls_seen: int = 0


def run(
    processes: list[str], model_dir: Path, data_dir: Path, stalls: tuple[str, ...] = STALLS, crash_loops: bool = True
) -> Outcome:
    """The scenario, on a fresh `up` in `data_dir`, stopped at the end."""
    stack = Stack(data_dir)
    clients: Clients | None = None
    recoveries: list[Recovery] = []
    stalled: list[Stall] = []
    looped: CrashLoop | None = None
    twice: list[str] = []
    after_503: list[str] = []
    written_off: list[str] = []
    seen = 0
    lost: list[Sent] = []
    restarted: set[str] = set()
    pids: list[list[int]] = []
    try:
        stack.start()
        deploy(stack, model_dir)
        pids.append(serving_pids(stack))
        clients = Clients(stack)
        recoveries = kill_each(stack, clients, processes)
        stalled = stall_each(stack, clients, stalls)
        looped = crash_loop(stack, clients, "beat", CRASH_LOOP) if crash_loops else None
        clients.finish()
        pids.append(wait_for(lambda: serving_pids(stack), 60, "a serving replica after the kills"))  # type: ignore[arg-type]
        lost = clients.unfinished()
        twice = clients.run_twice()
        after_503 = clients.ran_after_503()
        written_off = [e["reason"] for e in stack.call("GET", "/api/events/?kind=node.offline")[1].get("results", [])]
        seen = stalls_seen(stack)
        # Each restart's Event is written by a process of its own: give the last one its moment.
        deadline = time.monotonic() + 30
        while not (restarted := _restarted(stack)) >= set(processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for sent in lost:  # counted against the last kill before it was sent
            before = [r for r in recoveries if r.killed_at <= sent.at]
            if before:
                before[-1].lost += 1
    finally:
        if clients is not None:
            clients.stopping.set()
        code = stack.stop()
    said = [line for _, line in stack.lines]
    return Outcome(recoveries, lost, restarted, code, said, *pids, stalls=stalled, crash_loop=looped,
                   run_twice=twice, written_off=written_off, stalls_seen=seen, ran_after_503=after_503,
                   keyless_503s=len(clients.refused_inputs) if clients is not None else 0)  # fmt: skip


def serving_pids(stack: Stack) -> list[int]:
    replicas = stack.call("GET", f"/api/replicas/?deployment={NAME}&state=serving")[1].get("results", [])
    return sorted(replica["pid"] for replica in replicas)


def _restarted(stack: Stack) -> set[str]:
    events = stack.call("GET", "/api/events/?kind=stack.restarted")[1].get("results", [])
    return {event["subject"].removeprefix("process ") for event in events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuportal.settings")
    import django

    django.setup()
    from inference.management.commands.make_tiny_model import write_tiny_model

    rows, stall_rows, loop_rows = [], [], []
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="gpuportal-recovery-") as tmp:
            model = write_tiny_model(Path(tmp) / "tiny", size_mb=2, seed=trial, log=lambda _: None).path
            outcome = run(list(PROCESSES), model, Path(tmp) / "var")
        for r in outcome.recoveries:
            rows.append([
                r.process, trial + 1, _ms(r.detected_s), _ms(r.first_answer_s), r.seen.unavailable, r.seen.unknown,
                r.seen.refused, len(r.seen.server_errors), r.lost, "yes" if r.process in outcome.restarted else "no",
            ])  # fmt: skip
        print(
            f"trial {trial + 1}: up exited {outcome.exit_code}, {len(outcome.lost)} accepted request(s) lost, "
            f"{len(outcome.ran_after_503)} of the keyless client's {outcome.keyless_503s} 503s run",
            file=sys.stderr,
        )
        for stall in outcome.stalls:
            stall_rows.append([
                stall.process, trial + 1, f"{STALL_S:g} s", _ms(stall.slowest_post_s), _ms(stall.first_answer_s),
                _ms(stall.judged_s),
                stall.seen.unavailable, stall.seen.unknown,
                stall.seen.refused, len(stall.seen.server_errors), len(outcome.written_off),
                "yes" if outcome.pids_after == outcome.pids_before else "no",
            ])  # fmt: skip
        if outcome.crash_loop is not None:
            loop = outcome.crash_loop
            loop_rows.append([
                loop.process, trial + 1, loop.kills, loop.named_down, "yes" if loop.whole_after else "no",
                loop.seen.unavailable, loop.seen.refused, len(loop.seen.server_errors), outcome.exit_code,
            ])  # fmt: skip
    headers = ["SIGKILL of", "trial", "detected", "first answer", "503s", "504s", "refused", "5xx", "lost", "Event"]
    stall_headers = ["SIGSTOP of", "trial", "for", "slowest POST", "first answer after", "stall seen after",
                     "503s", "504s", "refused", "5xx", "nodes written off", "same replica"]  # fmt: skip
    loop_headers = ["crash loop of", "trial", "kills", "named by /readyz", "whole after", "503s", "refused", "5xx",
                    "up's exit code"]  # fmt: skip
    text = "\n\n".join([table(headers, rows), table(stall_headers, stall_rows), table(loop_headers, loop_rows)])
    print(text)
    if not args.no_record:
        record(
            "recovery",
            "Recovery: each of up's processes SIGKILLed, its servers frozen, beat crash-looping, under two clients",
            "`python -m bench.recovery`: one `up` (embedded servers, 1 virtual GPU), a tiny causal LM,\n"
            "two clients sending requests one after another, at most ten a second, and polling each accepted\n"
            "one to its end, and a third that sends no Idempotency-Key and never sends again (none of its\n"
            "503s may run).\n"
            "`detected`: SIGKILL → `up` says so; `first answer`: SIGKILL → the first answer to a request\n"
            "sent after it; `503s`/`504s`/`refused`: what the clients met meanwhile (a 504: Redis went away\n"
            "before it said whether a submit was written, so it may run); `lost`: accepted requests\n"
            "that never ended done; `Event`: the restart is in the trail (`stack.restarted`). Then\n"
            f"PostgreSQL and Redis each frozen (SIGSTOP) for {STALL_S:g} s, beyond the stack's "
            f"{HEARTBEAT_TIMEOUT_S:g} s\nheartbeat timeout; `first answer after`: let go → the first answer to a "
            "request sent after it;\n`slowest POST`: the longest an `/infer/` asking `timeout_s` 2 took to come "
            "back from the stall on;\n`stall seen after`: let go → the heartbeat sweep's `control.stalled` Event. "
            f"Last, beat killed {CRASH_LOOP} times in a row,\neach as soon as `up` ran it again "
            "(`named by /readyz`: kills after which /readyz named it down).\n\n"
            + text
            + "\n\nReading it: only the web server and Redis are on the request path. The web comes back in about\n"
            "the time granian takes to import Django again; Redis in its restart plus the clients' retry, its\n"
            "append-only file keeping every accepted request. A PostgreSQL restart shows only in the operator's\n"
            "reads (JSON 503s): a request needs no database while a replica claims its deployment and the\n"
            "caller's token is cached. The control plane's processes are off the request path altogether.\n"
            "A frozen server writes off no node: the heartbeat sweep reads its own gap as the control plane's\n"
            "stall, and the agent's lease in Redis says the node lives (scheduling.core.liveness). While\n"
            "PostgreSQL is frozen, an `/infer/` comes back at once (the caller's token is trusted while it is\n"
            "read again); any 503s are the operator's reads. While Redis is frozen, a POST waits out the web's\n"
            "5 s Redis timeout and answers 503 (504 where its submit was sent before the freeze), and is sent\n"
            "again under its Idempotency-Key; a submit Redis runs once it resumes is past its deadline and\n"
            "writes nothing. Beat killed ten times in a row: named by /readyz after each kill, no request\n"
            "failed, `up` stayed up.",
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


if __name__ == "__main__":
    main()
