"""Starts and watches the replica processes of one node (inside the node agent).

One OS process per replica (docs/architecture.md). The supervisor spawns `python -m inference.replica`, writes
commands to its stdin, and a reader thread per replica turns its stdout events into `on_event`
calls. It knows nothing of Django or of the control plane: the agent passes callbacks.

Guarantees the agent can build on:
- every replica ends with exactly one final event, `stopped` or `failed`, delivered only once its
  process has exited and its id is free again (so a restart from inside the callback works);
- a process that dies without saying why is reported as `failed`, kind `crash`, with its exit code,
  signal and last stderr line;
- replicas die with the agent (PR_SET_PDEATHSIG, SIGKILL), even when the agent is SIGKILLed,
  unless their spec gives them an adoption window: then they outlive it that long, and the next
  agent of the node takes them over (`adopt_survivors`, inference.adoption) instead of loading
  their models again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpuportal import orphans
from gpuportal.processes import die_with_parent
from gpuportal.wire import prefix_cache, states
from gpuportal.wire.commands import ReplicaSpec
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.states import FailoverState
from gpuportal.wire.states import ReplicaState as S
from inference import adoption, failover, host_copy
from inference.forkserver import READY_TIMEOUT_S, ForkedProcess, ForkServer
from inference.host_ram import proportional_bytes
from inference.spare_pool import Process, Spare, SparePool

log = logging.getLogger(__name__)

EventCallback = Callable[[str, dict[str, Any]], None]

# The events a replica process ends with: they name the state it ends in.
FINAL_EVENTS = (S.STOPPED, S.FAILED, S.DEEP_SLEEPING)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# How long a replica that announced stopped/failed may take to exit before it is killed.
EXIT_GRACE_S = 10.0
# A replica's drain on stop when the command names none: inference.host.DEFAULT_DRAIN_TIMEOUT_S
# (not imported: the agent need not load the replica program's modules).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _may_take_a_spare(spec: ReplicaSpec) -> bool:
    """A failover pair's member stays a process of its own: its standby's context is a figure of
    its own (standby_context_bytes) that a spare's warm-up would outgrow."""
    return bool(spec.gpus) and spec.failover_lease is None


def fence_of(spec: ReplicaSpec) -> str:
    """The name of a failover member's pair (its result fence in Redis, its lock's files); "" for
    a replica of no pair."""
    if spec.failover_lease is None:
        return ""
    return spec.failover_fence or str(spec.failover_lease)


def replica_argv(
    spec: ReplicaSpec, python: str = sys.executable, node: NodeFence | None = None, pairs: Path | None = None
) -> list[str]:
    """The replica program's command line for a spec, fenced by its node's epoch where it has one.
    `pairs`: the node's folder of failover locks (inference.failover), for a pair's member."""
    args = [
        python,
        "-m",
        "inference.replica",
        "--replica-id",
        spec.replica_id,
        "--source",
        spec.source,
        "--loader",
        spec.loader,
        "--dtype",
        spec.dtype,
        "--gpus",
        ",".join(str(g) for g in spec.gpus),
        "--reserved-bytes-by-gpu",
        json.dumps(spec.reserved_bytes_by_gpu),
        "--backend",
        spec.backend,
    ]
    if spec.adapters:
        args += ["--adapters", spec.adapters]
    if spec.prefix_cache != prefix_cache.USER:
        args += ["--prefix-cache", spec.prefix_cache]
    if spec.fraction is not None:
        args += ["--fraction", repr(float(spec.fraction))]
    if spec.kv_max_tokens is not None:
        args += ["--kv-max-tokens", str(int(spec.kv_max_tokens))]
    if spec.context_bytes:
        args += ["--context-bytes", str(int(spec.context_bytes))]
    if spec.standby_context_bytes:
        args += ["--standby-context-bytes", str(int(spec.standby_context_bytes))]
    if spec.adoption_window_s > 0:
        args += ["--adoption-window", repr(float(spec.adoption_window_s))]
    if node is not None:
        args += ["--node", node.node, "--node-epoch", str(node.epoch)]
    if spec.deployment and spec.redis_url:
        # The queue's URL (with its password) goes by the environment (_child_env), never on a
        # command line, which every user of the host can read.
        args += ["--deployment", spec.deployment]
    if spec.failover_lease is not None:
        if pairs is None:
            raise ValueError(f"replica {spec.replica_id} is a failover pair's member: it needs the node's lock folder")
        args += [
            "--failover-dir",
            str(pairs),
            "--failover-fence",
            fence_of(spec),
            "--role",
            spec.role,
            "--wake-timeout",
            repr(float(spec.wake_timeout_s)),
            "--liveness-every",
            repr(max(0.05, spec.liveness_timeout_s / 6)),
        ]
    return args


class AdoptedProcess:
    """A replica process the node's previous agent started: not this agent's child, so it is
    watched through a pidfd, and its exit code goes to whoever reaps it: `up`, which records it
    (gpuportal.orphans), or else init (returncode stays None)."""

    returncode: int | None = None

    def __init__(self, pid: int, exits: Path | None = None):
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._exits = exits
        self._ended = False

    def wait(self, timeout: float | None = None) -> int | None:
        if self._ended:
            return self.returncode
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            raise subprocess.TimeoutExpired(f"replica pid {self.pid}", timeout or 0)
        self._ended = True
        self.returncode = orphans.exit_code(self._exits, self.pid)
        return self.returncode

    def kill(self) -> None:
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._pidfd)


@dataclass
class _Replica:
    spec: ReplicaSpec
    process: subprocess.Popen | ForkedProcess | AdoptedProcess
    on_event: EventCallback
    log_path: Path
    # Its command and event streams: the pipes of a process this agent started, the adoption
    # socket of one it took over.
    reader: IO[bytes]
    writer: IO[bytes]
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    # Set by stop(): an exit without `stopped` is then the stop we asked for, not a crash.
    stopping: bool = False
    # Set once the final event has been delivered.
    done: threading.Event = field(default_factory=threading.Event)
    # Liveness of a failover member: when it last said anything, and the state it last reported.
    last_seen: float = field(default_factory=time.monotonic)
    failover_state: str = ""
    # Why the watchdog killed it, for the final event.
    killed_because: str = ""
    # What NVML shows of it per GPU index (or, on a virtual GPU, the replica's model of that),
    # as it last reported: the agent checks the books against it every heartbeat.
    usage: dict[str, int] | None = None
    # The state it was in when it last reported (serving, sleeping, standby...): a figure is only
    # compared with the books of the same state (a serving figure against a sleeper's reservation
    # would read as an over-commit).
    usage_state: str = ""
    # The host arena it keeps for its next sleep, as it last said (an `arena` event or a pong);
    # None until it has said (an adopted process before its first pong).
    arena_bytes: int | None = None
    # What of its process's memory the host cache counts: its arena's bytes awake, its weights'
    # (the `cpu_bytes` of its sleep) asleep. Taken out of what the heartbeat says it holds.
    cached_bytes: int = 0
    # What it said it still holds per GPU index as it fell asleep (its residual context).
    residual: dict[str, int] = field(default_factory=dict)
    # Whether a reader thread delivers its events (an adopted one waits for `resume`).
    reading: bool = False
    # What an adopted replica said first: its state and its last state event.
    hello: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    """Thread-safe: the agent calls it from a pool of Celery task threads."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        exits: Path | None = None,
        host_copies: Path | None = None,
    ):
        self.log_dir = Path(log_dir)
        # The node's host copies of its deep sleepers' weights (inference.host_copy): they outlive
        # the replicas' processes, and this agent's too.
        self.host_copies = host_copies if host_copies is not None else host_copy.node_folder(self.log_dir)
        self.python = python
        self.env = env
        # Where `up` records how the replicas it reaped ended (gpuportal.orphans): an adopted
        # replica's exit code is there, not ours to wait for.
        self.exits = exits
        # The node's epoch its agent holds (gpuportal.wire.node_lease), given to each replica it
        # starts: the agent moves it on only once every replica of the old one is stopped.
        self.node_fence: NodeFence | None = None
        self._lock = threading.Lock()
        # Notified whenever a replica's state changes or it exits (held with _lock: one lock).
        self._changed = threading.Condition(self._lock)
        self._replicas: dict[str, _Replica] = {}
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Celery
        # task threads may come and go, so every fork happens on this one thread, which lives as long as
        # the supervisor (an executor never retires an idle worker).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-spawner")
        self._watchdog: threading.Thread | None = None
        # Whether replicas are forked from a template (use_forkserver), and the template once
        # the first start (or a warm-up) began it.
        self._forkserver_wanted = False
        self._template_service = ""
        self._forkserver: Future[ForkServer | None] | None = None
        # The warm spares, once the agent keeps some (keep_spares).
        self._spares: SparePool | None = None

    # -- API -----------------------------------------------------------------------------------

    def start(self, spec: ReplicaSpec, on_event: EventCallback) -> None:
        """Spawn the replica process; its events (progress, serving, ...) arrive on `on_event`."""
        # The template's imports are waited for before the lock: a heartbeat reading the
        # supervisor meanwhile must not wait for torch to import.
        if self._forkserver_wanted:
            self.forkserver_ready(READY_TIMEOUT_S)
        with self._lock:
            if spec.replica_id in self._replicas:
                pid = self._replicas[spec.replica_id].process.pid
                raise ValueError(f"replica {spec.replica_id} is already running (pid {pid})")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"replica-{spec.replica_id}.log"
            spare = self._spares.take(spec.gpus[0], spec.backend) if self._spares and _may_take_a_spare(spec) else None
            process = self._become(spare, spec, log_path) if spare is not None else None
            if process is None:
                process = self._spawner.submit(self._spawn, spec, log_path).result()
            assert process.stdout is not None and process.stdin is not None
            replica = _Replica(
                spec=spec,
                process=process,
                on_event=on_event,
                log_path=log_path,
                reader=process.stdout,
                writer=process.stdin,
            )
            self._replicas[spec.replica_id] = replica
            if spec.adoption_window_s > 0:
                self._write_record(spec, process.pid)
        log.info("replica %s started: pid %d, log %s", spec.replica_id, process.pid, log_path)
        if spec.failover_lease is not None:
            self._start_watchdog()
        self._start_reader(replica)

    def keep_spares(self, backend: str, gpus: list[int], context_bytes: int) -> None:
        """A warm spare on each of `gpus` from now on (inference.spare_pool): the next replica
        started on one runs in it, its CUDA context already made."""
        if self._forkserver_wanted:
            self._template()  # queued before the spares' starts, which fork from it
        with self._lock:
            if self._spares is None:
                self._spares = SparePool(self.log_dir, self._spawn_spare, self._spawner.submit)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._spares.keep(backend, gpus, context_bytes)

    def spare_slots(self) -> dict[str, int]:
        """{GPU index: bytes} the node's warm spares hold, or are held to, per GPU it keeps one on."""
        return self._spares.slots() if self._spares is not None else {}

    def spare_pids(self) -> set[int]:
        return self._spares.pids() if self._spares is not None else set()

    def warm_spares(self) -> dict[int, int]:
        """{GPU index: pid} of the warm spares ready now."""
        return self._spares.warm() if self._spares is not None else {}

    def _become(self, spare: Spare, spec: ReplicaSpec, log_path: Path) -> Process | None:
        """Tell the warm spare to become this replica; None where it cannot be told (it died)."""
        message = {
            "cmd": "become",
            "argv": self._argv(spec)[3:],
            "env": self._child_env(spec),
            "log": str(log_path),
            "name": spec.replica_id[:7],
        }
        try:
            assert spare.process.stdin is not None
            spare.process.stdin.write(json.dumps(message).encode() + b"\n")
            spare.process.stdin.flush()
        except (OSError, ValueError) as exc:
            log.warning(
                "the warm spare of GPU %d is gone (%s): replica %s starts the plain way",
                spare.gpu,
                exc,
                spec.replica_id,
            )
            return None
        log.info("replica %s runs in the warm spare of GPU %d (pid %d)", spec.replica_id, spare.gpu, spare.pid)
        return spare.process

    def host_copy_path(self, replica_id: str) -> Path:
        """Where a deep sleeper's weights wait (inference.host_copy)."""
        return host_copy.path_of(self.host_copies, replica_id)

    def forget_host_copy(self, replica_id: str) -> bool:
        """Delete a deep sleeper's host copy (it stops, or leaves the host cache); whether there was one."""
        forgotten = host_copy.forget(self.host_copy_path(replica_id))
        if forgotten:
            log.info("replica %s: host copy deleted", replica_id)
        return forgotten

    def deep_sleepers(self) -> dict[str, dict[str, Any]]:
        """The deep sleepers whose host copies this node holds, each as the hello of a survivor
        with no process (pid 0): a new agent offers them to the control plane with the processes
        it adopted, and the books keep those that agree (scheduling.core.adoption)."""
        running = set(self.running())
        return {
            replica_id: {"replica_id": replica_id, "pid": 0, "state": S.DEEP_SLEEPING, "last": S.DEEP_SLEEPING}
            for replica_id in host_copy.held(self.host_copies)
            if replica_id not in running
        }

    def adopt_survivors(self, on_event: EventCallback) -> dict[str, dict[str, Any]]:
        """Take over the replicas the node's previous agent left running (they wait for an adopter
        for their adoption window): {replica id: its hello (state, last state event, pid)}.

        Their events are not read until `resume`: the control plane first decides which it keeps
        (scheduling.services.nodes.register_node), on the state each said it was in, and an event
        read meanwhile could change the books under that decision. Records of replicas that are
        gone, or do not answer, are removed."""
        adopted: dict[str, dict[str, Any]] = {}
        for path in sorted(self.log_dir.glob("replica-*.adopt")):
            replica = self._adopt(path, on_event)
            if replica is None:
                path.unlink(missing_ok=True)
                continue
            with self._lock:
                self._replicas[replica.spec.replica_id] = replica
            adopted[replica.spec.replica_id] = replica.hello
            log.info("replica %s adopted: pid %d, %s", replica.spec.replica_id, replica.process.pid, replica.hello)
        return adopted

    def resume(self) -> None:
        """Start reading the events of the replicas `adopt_survivors` took over."""
        with self._lock:
            waiting = [r for r in self._replicas.values() if not r.reading]
        for replica in waiting:
            self._start_reader(replica)

    def _start_reader(self, replica: _Replica) -> None:
        replica.reading = True
        name = f"replica-{replica.spec.replica_id}"
        threading.Thread(target=self._watch, args=(replica,), name=name, daemon=True).start()

    def _adopt(self, path: Path, on_event: EventCallback) -> _Replica | None:
        try:
            record = json.loads(path.read_text())
            spec = ReplicaSpec(**record["spec"])
            pid = int(record["pid"])
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("unreadable adoption record %s: %s", path, exc)
            return None
        if spec.replica_id in self.running():
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader, writer = conn.makefile("rb"), conn.makefile("wb")
        # The files keep the socket open: closing it here leaves them the only owners.
        with conn:
            try:
                conn.settimeout(adoption.HELLO_TIMEOUT_S)
                conn.connect(adoption.socket_name(adoption.address(self.log_dir, spec.replica_id)))
                hello = json.loads(reader.readline() or b"null")
                conn.settimeout(None)
                if not isinstance(hello, dict) or hello.get("event") != "hello" or hello.get("pid") != pid:
                    raise ValueError(f"not the hello of pid {pid}: {hello!r}")
                process = AdoptedProcess(pid, self.exits)
            except (OSError, ValueError) as exc:
                log.info("replica %s (pid %d) cannot be adopted: %s", spec.replica_id, pid, exc)
                reader.close()
                writer.close()
                return None
        return _Replica(
            spec=spec,
            process=process,
            on_event=on_event,
            log_path=self.log_path(spec.replica_id),
            reader=reader,
            writer=writer,
            hello=hello,
        )

    def _record_path(self, replica_id: str) -> Path:
        return self.log_dir / f"replica-{replica_id}.adopt"

    def _write_record(self, spec: ReplicaSpec, pid: int) -> None:
        path = self._record_path(spec.replica_id)
        temporary = path.with_suffix(".tmp")
        temporary.unlink(missing_ok=True)
        # Only its owner may read it: the spec carries the queue's URL, password and all.
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(json.dumps({"pid": pid, "spec": spec.record()}))
        temporary.replace(path)  # a new agent reading it at this moment sees all of it or nothing

    def send(self, replica_id: str, command: dict[str, Any]) -> None:
        """Write one command. KeyError for an unknown replica; ProcessLookupError if it has just exited."""
        self._write(self._get(replica_id), command)

    def stop(
        self, replica_id: str, timeout: float = 10.0, drain_timeout_s: float | None = None, *, close_pair: bool = False
    ) -> int | None:
        """Ask the replica to stop, kill it after `timeout`; returns once its final event was delivered.

        With `drain_timeout_s`, the replica first lets its request in flight finish for that long (or
        gives it back to its queue), and the kill waits that much longer. Without it, the replica
        drains for its own default (inference.host.DEFAULT_DRAIN_TIMEOUT_S), so the kill waits
        for that. `close_pair`: a failover member whose pair stops whole (inference.failover): its
        partner does not take over. Returns the exit code (negative: the signal that ended it).
        KeyError for an unknown replica.
        """
        replica = self._get(replica_id)
        # Closed before the stop goes out: the partner is granted the lock only once this one has exited.
        fences = self._close_pairs([replica]) if close_pair else []
        replica.stopping = True
        command: dict[str, Any] = {"cmd": "stop"}
        if drain_timeout_s is not None:
            command["drain_timeout_s"] = drain_timeout_s
        drain = DEFAULT_DRAIN_TIMEOUT_S if drain_timeout_s is None else drain_timeout_s
        with contextlib.suppress(ProcessLookupError):
            self._write(replica, command)
        # The kill comes only after the drain had its time, plus `timeout` to release and exit.
        self._wait_or_kill(replica, drain + timeout)
        replica.done.wait(EXIT_GRACE_S)
        self._forget_pairs(fences)
        return replica.process.returncode

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every replica at once (they unload in parallel), killing those still alive after
        `timeout`. Their pairs are closed first: no standby takes over from an active stopping with it."""
        with self._lock:
            replicas = list(self._replicas.values())
        fences = self._close_pairs(replicas)
        self._stop_together(replicas, {"cmd": "stop"}, timeout)
        self._forget_pairs(fences)

    def stop_written_off(self, replica_ids: Iterable[str], timeout: float = 5.0) -> list[str]:
        """Stop, without a drain, replicas the control plane wrote off (nodes.heartbeat): it gave
        their requests back already, so nothing they hold is worth waiting for. Those already
        stopping (a scale-down's drain) are left to finish. Returns the ids stopped."""
        replica_ids = list(replica_ids)
        with self._lock:
            replicas = [r for rid in replica_ids if (r := self._replicas.get(rid)) is not None and not r.stopping]
        for replica in replicas:
            log.warning("replica %s was written off by the control plane; stopping it", replica.spec.replica_id)
        # A pair written off whole was replaced elsewhere: its standby must not take over here. A
        # member written off alone (its partner still counted) leaves the pair open for the next.
        going = {r.spec.replica_id for r in replicas}
        with self._lock:
            kept = {fence_of(r.spec) for rid, r in self._replicas.items() if rid not in going}
        fences = self._close_pairs([r for r in replicas if fence_of(r.spec) not in kept])
        self._stop_together(replicas, {"cmd": "stop", "drain_timeout_s": 0}, timeout)
        self._forget_pairs(fences)
        # One with no process here may be a deep sleeper the books no longer hold: its copy goes.
        for replica_id in set(replica_ids) - going - set(self.running()):
            self.forget_host_copy(replica_id)
        return [r.spec.replica_id for r in replicas]

    @property
    def pairs(self) -> Path:
        """The node's folder of failover pair locks (inference.failover)."""
        return self.log_dir / failover.LOCKS_FOLDER

    def _close_pairs(self, replicas: list[_Replica]) -> list[str]:
        fences = sorted({fence for r in replicas if (fence := fence_of(r.spec))})
        for fence in fences:
            failover.close_pair(self.pairs, fence)
        return fences

    def _forget_pairs(self, fences: list[str]) -> None:
        """The files of closed pairs none of whose members runs any more."""
        with self._lock:
            running = {fence_of(r.spec) for r in self._replicas.values()}
        for fence in fences:
            if fence not in running:
                failover.forget_pair(self.pairs, fence)

    def _stop_together(self, replicas: list[_Replica], command: dict[str, Any], timeout: float) -> None:
        for replica in replicas:
            replica.stopping = True
            with contextlib.suppress(ProcessLookupError):
                self._write(replica, command)
        deadline = time.monotonic() + timeout
        for replica in replicas:
            self._wait_or_kill(replica, max(0.0, deadline - time.monotonic()))
        for replica in replicas:
            replica.done.wait(EXIT_GRACE_S)

    def backend_of(self, replica_id: str) -> str | None:
        """The backend its spec names (virtual, cuda); None for a replica not running here."""
        with self._lock:
            replica = self._replicas.get(replica_id)
        return replica.spec.backend if replica is not None else None

    def pid(self, replica_id: str) -> int | None:
        with self._lock:
            replica = self._replicas.get(replica_id)
        return replica.process.pid if replica is not None else None

    def ping_all(self) -> None:
        """Ask every replica for its figures; the pongs refresh `usage` (a replica busy loading
        answers from its stdin thread, so this never waits on one)."""
        with self._lock:
            replicas = list(self._replicas.values())
        for replica in replicas:
            with contextlib.suppress(Exception):  # one that just exited: its reader reports it
                self._write(replica, {"cmd": "ping"})

    def usage(self) -> dict[str, tuple[int | None, dict[str, int] | None, str]]:
        """{replica id: (pid, its last reported bytes per GPU index, its state then)} of the
        running replicas."""
        with self._lock:
            return {
                rid: (r.process.pid, dict(r.usage) if r.usage is not None else None, r.usage_state)
                for rid, r in self._replicas.items()
            }

    def released(self, replica_ids: Iterable[str], timeout: float) -> list[str]:
        """Wait until the processes of these replicas (evicted to make room) have let go of their
        weights: each has said it sleeps, or has exited. Returns those that had not when the
        timeout passed. Replicas this supervisor does not run hold nothing of its GPUs."""
        ids = list(replica_ids)

        def holding() -> list[str]:
            return [rid for rid in ids if (r := self._replicas.get(rid)) is not None and r.usage_state == S.SERVING]

        with self._changed:
            self._changed.wait_for(lambda: not holding(), timeout)
            return holding()

    def exited(self, replica_ids: Iterable[str], timeout: float) -> list[str]:
        """Wait until the processes of these replicas have exited (a deep sleep's end); returns
        those still running when the timeout passed."""
        ids = list(replica_ids)

        def running() -> list[str]:
            return [rid for rid in ids if rid in self._replicas]

        with self._changed:
            self._changed.wait_for(lambda: not running(), timeout)
            return running()

    def sleepers(self, replica_ids: Iterable[str]) -> dict[str, tuple[int, dict[str, int]]]:
        """{replica id: (pid, what it said it still holds per GPU index)} of those of `replica_ids`
        that sleep in a process of their own."""
        with self._lock:
            return {
                rid: (r.process.pid, dict(r.residual))
                for rid in replica_ids
                if (r := self._replicas.get(rid)) is not None and r.usage_state == S.SLEEPING
            }

    def running(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def states(self) -> dict[str, str]:
        """{replica id: the state its process last said it is in ("" before it said any)} of the
        running replicas: what the heartbeat tells the control plane, which sends a wake or a
        sleep again when the process shows it never arrived (scheduling.services.lost_commands).
        A pong refreshes it every beat, a state event at once."""
        with self._lock:
            return {rid: r.usage_state for rid, r in self._replicas.items()}

    def arenas(self) -> dict[str, int]:
        """{replica id: the bytes of the host arena it keeps for its next sleep, 0 for none} of the
        running replicas that have said (a pong every beat): what the heartbeat tells the control
        plane, which sends a grant or a drop again when the process shows it never arrived.
        One that has not said yet is left out, so that no beat reads its silence as none."""
        with self._lock:
            return {rid: r.arena_bytes for rid, r in self._replicas.items() if r.arena_bytes is not None}

    def host_bytes(self) -> dict[str, int]:
        """{replica id: bytes} of host RAM each running replica's process holds outside what the
        host cache counts of it (its arena): what placement counts of its node's RAM for it."""
        with self._lock:
            running = {rid: (r.process.pid, r.cached_bytes) for rid, r in self._replicas.items()}
        found = {}
        for rid, (pid, cached) in running.items():
            held = proportional_bytes(pid) if pid is not None else None
            if held is not None:
                found[rid] = max(0, held - cached)
        return found

    def log_path(self, replica_id: str) -> Path:
        return self.log_dir / f"replica-{replica_id}.log"

    # -- processes -----------------------------------------------------------------------------

    def use_forkserver(self, *, warm: bool = False, service: str = "") -> None:
        """Fork replicas from here on from a template that has imported torch and the replica
        program once (inference.forkserver). It starts with the first replica (whose start it
        then costs about what a fresh interpreter would), so that a node never given one
        spends nothing on it; `warm`, now. `service`: the address of the node's templates'
        service (`--listen`), which forks us a template already imported; without one, or if it
        does not answer, we start our own."""
        self._forkserver_wanted = True
        self._template_service = service
        if warm:
            self._template()

    def forkserver_ready(self, timeout: float) -> bool:
        """Whether the template has its imports done within `timeout` (False without one)."""
        if not self._forkserver_wanted:
            return False
        server = self._template().result(timeout)
        return server is not None and server.ready(timeout) and server.alive

    def _template(self) -> Future[ForkServer | None]:
        # Started on the spawner thread, which its PR_SET_PDEATHSIG ties it to.
        with self._lock:
            if self._forkserver is None:
                self._forkserver = self._spawner.submit(self._start_forkserver)
            return self._forkserver

    def close(self) -> None:
        """Stop the replica template, if there is one (the replicas it forked carry on), and
        remove the node's folder of host copies if it holds none. The warm spares go first: they
        are nobody's replicas yet."""
        if self._spares is not None:
            self._spares.close()
        if self._forkserver is not None and (server := self._forkserver.result()) is not None:
            server.close()
        host_copy.tidy(self.host_copies)

    def _start_forkserver(self) -> ForkServer | None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._template_service:
            try:
                return ForkServer.connect(self._template_service)
            except OSError as exc:
                log.warning(
                    "the templates' service at %s does not answer (%s): starting a template of our own",
                    self._template_service,
                    exc,
                )
        try:
            return ForkServer.start(self.python, self._base_env(), self.log_dir / "forkserver.log")
        except OSError as exc:
            log.warning("cannot start the replica template (%s): replicas start the plain way", exc)
            return None

    def _argv(self, spec: ReplicaSpec) -> list[str]:
        argv = replica_argv(spec, self.python, self.node_fence, self.pairs)
        if spec.adoption_window_s > 0:
            argv += ["--adopt-address", adoption.address(self.log_dir, spec.replica_id)]
        if spec.from_host_copy:
            argv += ["--host-copy", str(self.host_copy_path(spec.replica_id))]
        return argv

    def _spawn(self, spec: ReplicaSpec, log_path: Path) -> subprocess.Popen | ForkedProcess:
        # An adoptable replica outlives us for its window; it ends itself after that.
        return self._run(
            self._argv(spec),
            self._child_env(spec),
            log_path,
            tie=spec.adoption_window_s <= 0,
            name=spec.replica_id[:7],
        )

    def _spawn_spare(self, arguments: list[str], backend: str, log_path: Path, name: str) -> Process:
        """A warm spare's process (inference.spare_pool), started as a replica's is: it dies with us."""
        argv = [self.python, "-m", "inference.replica", *arguments]
        return self._run(argv, self._device_env(backend), log_path, tie=True, name=name)

    def _run(self, argv: list[str], env: dict[str, str], log_path: Path, *, tie: bool, name: str) -> Process:
        """`python -m inference.replica ...`, forked from the template where there is one."""
        server = self._forkserver.result() if self._forkserver is not None else None
        if server is not None and server.alive:
            # argv is [python, -m, inference.replica, *arguments]: the template runs the last part.
            forked = server.spawn(argv[3:], env, log_path, tie=tie, name=name)
            if forked is not None:
                return forked
        with log_path.open("ab") as log_file:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
                preexec_fn=die_with_parent(signal.SIGKILL) if tie else None,
                close_fds=True,
            )

    def _child_env(self, spec: ReplicaSpec) -> dict[str, str]:
        env = self._device_env(spec.backend)
        if spec.deployment and spec.redis_url:
            env["GPUPORTAL_REDIS_URL"] = spec.redis_url
        return env

    def _device_env(self, backend: str) -> dict[str, str]:
        env = self._base_env()
        if backend == "cuda":
            # The replica targets its GPUs itself (set_device, max_memory), by NVML index: it must see them all.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        return env

    def _base_env(self) -> dict[str, str]:
        """What every replica's environment holds, the template's too."""
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        env["HF_HUB_OFFLINE"] = "1"
        # The agent reports NVML's GPU indices; PCI bus order makes them torch's indices too.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # `python -m inference.replica` must import this project whatever the agent's working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def _watch(self, replica: _Replica) -> None:
        """The reader thread: deliver events until the final one, then reap the process and report its end."""
        final: dict[str, Any] | None = None
        for raw in _lines(replica):
            event = self._parse(replica, raw)
            if event is None:
                continue
            replica.last_seen = time.monotonic()
            if event["event"] == "alive":  # a heartbeat: for the watchdog, not the control plane
                replica.failover_state = str(event.get("failover_state") or replica.failover_state)
                continue
            with self._changed:
                _note_usage(replica, event)
                self._changed.notify_all()  # a waker may be waiting for this one to let go (released)
            if event["event"] == "failover":
                replica.failover_state = str(event.get("state") or "")
            elif event["event"] == "active" or (event["event"] == "serving" and event.get("failover_state")):
                replica.failover_state = FailoverState.ACTIVE
            if event["event"] in FINAL_EVENTS:
                final = event
                break
            self._deliver(replica, event)
        code = self._reap(replica)
        with self._lock:
            if self._replicas.get(replica.spec.replica_id) is replica:
                del self._replicas[replica.spec.replica_id]
                self._record_path(replica.spec.replica_id).unlink(missing_ok=True)
                self._changed.notify_all()
        if final is None:
            final = self._unannounced_exit(replica, code)
        self._deliver(replica, {**final, "exit_code": code})
        replica.done.set()

    def _reap(self, replica: _Replica) -> int | None:
        process = replica.process
        try:
            code = process.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "replica %s still alive %.0f s after its last event; killing it", replica.spec.replica_id, EXIT_GRACE_S
            )
            process.kill()
            code = process.wait()
        for stream in (replica.writer, replica.reader):
            with contextlib.suppress(OSError):
                stream.close()
        if isinstance(process, AdoptedProcess | ForkedProcess):
            process.close()
        return code

    def _unannounced_exit(self, replica: _Replica, code: int | None) -> dict[str, Any]:
        how = describe_exit(code)
        if replica.killed_because:
            return {"event": "failed", "kind": "hung", "reason": f"killed by its node agent: {replica.killed_because}"}
        if replica.stopping:
            # We asked it to stop and then had to kill it (or it died on the way): still a stop.
            return {"event": "stopped", "forced": True, "reason": f"replica process {how} while stopping"}
        words = last_words(replica.log_path)
        if words:
            return {"event": "failed", "kind": "crash", "reason": f"replica process {how}: {words}"}
        # Neither we nor the agent sent it (killed_because, stopping): from outside the process.
        outside = ": SIGKILL comes from outside it (the kernel's OOM killer, or a kill -9)" if code == -9 else ""
        reason = f"replica process {how}, with no error in its log{outside}"
        return {"event": "failed", "kind": "crash", "reason": reason}

    def _wait_or_kill(self, replica: _Replica, timeout: float) -> None:
        try:
            replica.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("replica %s still running %.0f s after stop; killing it", replica.spec.replica_id, timeout)
            with contextlib.suppress(ProcessLookupError):
                replica.process.kill()
            replica.process.wait()

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None:
                return
            self._watchdog = threading.Thread(target=self._watch_liveness, name="replica-watchdog", daemon=True)
        self._watchdog.start()

    def _watch_liveness(self) -> None:
        """Kill active failover members that stopped heartbeating (seed 004: a hung engine is
        found by its liveness, and its death is what passes the lock to the standby)."""
        while True:
            time.sleep(0.1)
            with self._lock:
                replicas = [r for r in self._replicas.values() if r.spec.failover_lease is not None]
            now = time.monotonic()
            for replica in replicas:
                silent = now - replica.last_seen
                if replica.failover_state != FailoverState.ACTIVE or silent <= replica.spec.liveness_timeout_s:
                    continue
                if replica.killed_because or isinstance(replica.process, AdoptedProcess):
                    continue
                if replica.process.poll() is not None:
                    continue
                replica.killed_because = f"active but silent for {silent:.1f} s (hung)"
                log.error("replica %s %s: killing it", replica.spec.replica_id, replica.killed_because)
                with contextlib.suppress(ProcessLookupError):
                    replica.process.kill()

    # -- plumbing ------------------------------------------------------------------------------

    def _get(self, replica_id: str) -> _Replica:
        with self._lock:
            try:
                return self._replicas[replica_id]
            except KeyError:
                raise KeyError(f"no running replica {replica_id!r} on this node") from None

    def _write(self, replica: _Replica, command: dict[str, Any]) -> None:
        line = (json.dumps(command, separators=(",", ":")) + "\n").encode()
        with replica.write_lock:
            try:
                replica.writer.write(line)
                replica.writer.flush()
            except (BrokenPipeError, ValueError, OSError):  # ValueError: the pipe was closed on reap
                raise ProcessLookupError(f"replica {replica.spec.replica_id} has exited") from None

    def _parse(self, replica: _Replica, raw: bytes) -> dict[str, Any] | None:
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return None
        try:
            event = json.loads(text)
        except json.JSONDecodeError:
            event = None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            log.warning("replica %s wrote a line that is not an event: %.200s", replica.spec.replica_id, text)
            return None
        return event

    def _deliver(self, replica: _Replica, event: dict[str, Any]) -> None:
        try:
            replica.on_event(replica.spec.replica_id, event)
        except Exception:  # the callback's bug must not stop us reading (and so block the replica's stdout)
            log.exception("on_event failed for replica %s event %s", replica.spec.replica_id, event.get("event"))


def _lines(replica: _Replica) -> Iterator[bytes]:
    """What the replica writes, line by line, until its stream ends. An adopted replica's stream
    is a Unix socket: one that dies with our commands still unread in it (a ping, killed before it
    read it) resets the connection rather than closing it, and that is its end too. A reader
    thread that died of it would leave the replica counted as running, its end never reported."""
    try:
        yield from replica.reader
    except OSError as err:
        log.info("replica %s: its stream ended (%s)", replica.spec.replica_id, err)


# The state a replica is in when it sends each event that carries its figures (a state event
# names the state it reached, `woken` aside).
_STATE_OF_EVENT = {S.SERVING: S.SERVING, "woken": S.SERVING, S.SLEEPING: S.SLEEPING, S.STANDBY: S.STANDBY}


def _note_usage(replica: _Replica, event: dict[str, Any]) -> None:
    state = str(event.get("state") or "") if event.get("event") == "pong" else _STATE_OF_EVENT.get(event["event"], "")
    if state:
        replica.usage_state = state
    arena = event.get("kept_bytes") if event.get("event") == "arena" else event.get("arena_bytes")
    if isinstance(arena, int) and not isinstance(arena, bool) and arena >= 0:
        replica.arena_bytes = arena
        if replica.usage_state not in states.IN_HOST_CACHE:
            replica.cached_bytes = arena
    elif event.get("event") == "sleeping":
        replica.arena_bytes = 0  # the sleep packed its weights into the arena it kept
    if isinstance(weights := event.get("cpu_bytes"), int) and not isinstance(weights, bool) and weights >= 0:
        replica.cached_bytes = weights
    figures = event.get("process_bytes_by_id")
    if not isinstance(figures, dict) and event.get("event") in {S.SLEEPING, S.STANDBY}:
        figures = event.get("residual_bytes_by_id")  # what a sleeper still holds
    if event.get("event") == "sleeping" and isinstance(residual := event.get("residual_bytes_by_id"), dict):
        with contextlib.suppress(TypeError, ValueError):
            replica.residual = {str(k): int(v) for k, v in residual.items() if v is not None}
    if isinstance(figures, dict):
        try:
            replica.usage = {str(k): int(v) for k, v in figures.items() if v is not None}
        except (TypeError, ValueError):
            log.warning("replica %s reported unreadable GPU figures: %.200s", replica.spec.replica_id, figures)


def describe_exit(code: int | None) -> str:
    """'exited with code -9 (signal SIGKILL)' or 'exited with code 1' ('exited' for a process
    this agent adopted: its code went to whoever reaped it)."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"exited with code {code} (signal {name})"
    return f"exited with code {code}"


# One of a replica's own log records that says nothing of a death (inference.replica's format).
_ROUTINE_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|DEBUG) ")


def last_words(path: Path) -> str:
    """What a replica process that died unasked said last: its log's last line, unless that is
    a routine record (INFO, DEBUG), which says nothing of the death: a crash's reason ended with
    "100%: loaded 200 MiB in 0.4 s" after a SIGKILL an hour later. An error record, the last line
    of a traceback, or what the CUDA runtime printed as it aborted is kept. "" when none."""
    line = last_line(path)
    return "" if _ROUTINE_RECORD.match(line) else line


def last_line(path: Path, max_bytes: int = 4096) -> str:
    """The last non-empty line of a log, read from its end (a replica's log can grow large)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")
