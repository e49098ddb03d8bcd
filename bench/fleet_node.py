"""Simulated nodes for bench.fleet: many light node agents in one process, each speaking the real
node protocol with no replica process behind it.

A simulated node does what `inference.agent.NodeAgent` does on the wire, through the same code:
it registers its eight virtual GPUs (`inference.devices.virtual_gpus`) and heartbeats through
`inference.gateway.RemoteControl` (one Celery task on the `agents` queue per call, the answer on a
Redis list), renews its lease straight in Redis every beat (`gpuportal.wire.node_lease`), and takes
the commands the control plane sends on its own queue, `node.<name>` (`gpuportal.wire.commands`),
answering each with the reports a replica process would give (`progress` while it loads, then
`serving` with what it holds per GPU; `sleeping`, `woken`, `stopped`, `arena`). What it does not
do is run a model: a load is `load_s` of waiting. A question of what a model's files hold, sent to
a node's queue, is answered by the agent's own task (`inference.tasks.inspect_model`), which reads
them.

One process carries many nodes: a heartbeat thread per node (as an agent has), one consumer of
all their queues (kombu, as the agent's Celery worker consumes its own) and a pool of threads that
carry out commands.

    python -m bench.fleet_node --first 0 --count 250 --stats FILE --silence FILE

Runs until SIGTERM; writes its counters to --stats every second (bench.fleet reads them); a node
named in the --silence file stops beating and renewing its lease, and drops its commands, as a
host that lost its power would.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuportal.wire import commands, node_lease
from gpuportal.wire.commands import KeepArena, SleepReplica, StartReplica, StopReplica, WakeReplica
from gpuportal.wire.control import ControlPlane
from gpuportal.wire.node_reports import Books
from gpuportal.wire.states import ReplicaState as S

log = logging.getLogger(__name__)

GiB = 1024**3
# Eight 80 GiB GPUs, as an H100 host has; a host of 2 TiB with half of it for sleeping weights.
GPUS = "8x80GiB"
HOST_RAM_BYTES = 2048 * GiB
# How many replicas of one node load at once (the agent's load slots): one per GPU.
LOADS_PER_NODE = 8
# The progress a replica reports as it loads (inference.host.ReplicaHost.load), and its detail.
LOAD_STEPS = ((0, "starting on virtual GPUs"), (10, "preparing the device"), (25, "loading weights"))
LOADED_STEPS = ((85, "checking placement and memory cap"), (100, "loaded"))
# Latency buckets (seconds) of the answered heartbeats: bench.fleet reads percentiles out of them.
BUCKETS_S = tuple(round(0.001 * 1.25**i, 6) for i in range(50))


def node_name(index: int) -> str:
    return f"sim{index:04d}"


@dataclass
class SimReplica:
    """One replica process as its agent knows it: what it was started with, the state it last said
    it is in (inference.host.ReplicaHost.state), the host arena it keeps."""

    spec: commands.ReplicaSpec
    state: str = ""
    arena_bytes: int = 0
    # Set by a stop while it loads: the load ends there, as a killed process would.
    stopping: bool = False
    # One replica's reports go in the order it emitted them (the agent reads each on one thread).
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def reserved(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.spec.reserved_bytes_by_gpu.items()}

    @property
    def weights_bytes(self) -> int:
        # Not read from any file: half its reservation, the rest its pool, activations and context.
        return sum(self.reserved.values()) // 2

    def holds(self) -> dict[str, int]:
        """What NVML would show of the process per GPU: its reservation while its weights are on
        the GPU, its context alone while it sleeps."""
        if self.state in (S.SLEEPING, ""):
            return {index: self.spec.context_bytes for index in self.reserved}
        return self.reserved


class SimulatedNode:
    """One node agent on the wire, with no replica process behind it."""

    def __init__(
        self,
        name: str,
        control: ControlPlane,
        lease: Any,
        *,
        heartbeat_s: float,
        lease_ttl_s: float,
        load_s: float = 1.0,
        gpus: str = GPUS,
        sleep: Callable[[float], None] = time.sleep,
    ):
        from inference.devices import VirtualProfile, virtual_gpus

        self.name = name
        self.control = control
        # The Redis client the lease is renewed on (the agent's own, not the control plane's).
        self.lease = lease
        self.heartbeat_s = heartbeat_s
        self.lease_ttl_s = lease_ttl_s
        self.load_s = load_s
        self.devices = virtual_gpus(name, gpus, VirtualProfile())
        self.replicas: dict[str, SimReplica] = {}
        self.lock = threading.Lock()
        self.load_slots = threading.Semaphore(LOADS_PER_NODE)
        self.silent = threading.Event()
        self.stopped = threading.Event()
        self.epoch = 0
        self._sleep = sleep

    # -- what the agent says of itself -----------------------------------------------------------

    def register(self) -> None:
        self.epoch = int(
            self.control.register_node(
                self.name,
                self.devices,
                hostname=f"{socket.gethostname()}-{self.name}",
                cpu_cache_bytes=HOST_RAM_BYTES // 2,
                host_ram_bytes=HOST_RAM_BYTES,
                virtual=True,
                survivors=[],
            )
            or 0
        )

    def renew_lease(self) -> None:
        """As NodeAgent.renew_lease: written off meanwhile, it drops what it ran under the old epoch
        before it renews under the new one."""
        current = node_lease.renew(self.lease, self.name, self.lease_ttl_s, self.epoch)
        if current > self.epoch:
            with self.lock:
                self.replicas.clear()
            self.epoch = current
            node_lease.renew(self.lease, self.name, self.lease_ttl_s, self.epoch)

    def beat_once(self) -> list[str]:
        """One heartbeat as NodeAgent.beat_once sends it; replicas written off are dropped, and
        the beat sent again without books, as the agent stops them and beats again."""
        stale = self.control.heartbeat(self.name, books=self.books(), **self.processes())
        if not stale:
            return []
        with self.lock:
            for replica_id in stale:
                self.replicas.pop(replica_id, None)
        self.control.heartbeat(self.name, books=None, **self.processes())
        return list(stale)

    def books(self) -> Books:
        with self.lock:
            running = dict(self.replicas)
        said = {rid: r for rid, r in running.items() if r.state}
        return Books(
            usage={rid: r.holds() for rid, r in said.items()}, states={rid: r.state for rid, r in said.items()}
        )

    def processes(self) -> dict[str, Any]:
        with self.lock:
            running = dict(self.replicas)
        states = {rid: r.state for rid, r in running.items()}
        arenas = {rid: r.arena_bytes for rid, r in running.items() if r.state == S.SERVING}
        return {"running": sorted(states), "processes": states, "arenas": arenas}

    def run(self, on_beat: Callable[[float | None], None] = lambda latency: None) -> None:
        """The threads of NodeAgent.start_heartbeat: the lease at once and then every heartbeat_s
        on a thread of its own, and a beat every heartbeat_s after the last came back. `on_beat`:
        each beat's latency (None: it failed). A silent node returns at once."""
        if self.silent.is_set():
            return
        self.renew_lease()
        threading.Thread(target=self._renew, name=f"lease-{self.name}", daemon=True).start()
        while not self.stopped.wait(self.heartbeat_s):
            if self.silent.is_set():
                return
            began = time.monotonic()
            try:
                self.beat_once()
            except Exception as err:
                log.warning("heartbeat of %s failed: %s", self.name, err)
                on_beat(None)
            else:
                on_beat(time.monotonic() - began)

    def _renew(self) -> None:
        while not self.stopped.wait(self.heartbeat_s) and not self.silent.is_set():
            try:
                self.renew_lease()
            except Exception as err:
                log.warning("lease of %s not renewed: %s", self.name, err)

    # -- what the control plane asks of it ----------------------------------------------------

    def carry_out(self, task: str, payload: Mapping[str, Any]) -> str:
        """One command from the node's queue, as inference.tasks carries it out, with the replica's
        reports its process would send."""
        if self.silent.is_set():
            return "silent"
        command = commands.decode(payload)
        if commands.TASKS[command.kind] != task:
            raise commands.WireError(f"a {command.kind} command sent to {task}")
        match command:
            case StartReplica():
                return self._start(command)
            case SleepReplica():
                return self._sleep_replica(command)
            case WakeReplica():
                return self._wake(command)
            case StopReplica():
                return self._stop(command)
            case KeepArena():
                return self._arena(command)
        return "unknown"

    def report(self, replica_id: str, event: str, **fields: Any) -> None:
        if not self.silent.is_set():
            self.control.report(replica_id, {"event": event, **fields})

    def _start(self, command: StartReplica) -> str:
        spec = command.spec
        if (found := self.control.replica_state(spec.replica_id)) != S.PENDING:
            return f"skipped: replica is {found or 'gone'}"
        replica = SimReplica(spec)
        with self.lock:
            if spec.replica_id in self.replicas:
                return "running already"
            self.replicas[spec.replica_id] = replica
        with replica.lock:
            replica.state = S.LOADING
            for percent, detail in LOAD_STEPS:
                self.report(spec.replica_id, "progress", state=S.LOADING, percent=percent, detail=detail)
            with self.load_slots:
                self._sleep(self.load_s)
            if replica.stopping:
                return "stopped while loading"
            for percent, detail in LOADED_STEPS:
                self.report(spec.replica_id, "progress", state=S.LOADING, percent=percent, detail=detail)
            replica.state = S.SERVING
            self.report(spec.replica_id, "serving", pid=os.getpid(), **self._where(replica))
        return "started"

    def _where(self, replica: SimReplica) -> dict[str, Any]:
        """What a serving replica says of itself (inference.host.ReplicaHost.where): its need is
        its reservation, so the books and the hardware agree."""
        reserved = replica.reserved
        held = replica.holds()
        return {
            "weights_bytes": replica.weights_bytes,
            "process_bytes": sum(held.values()),
            "process_bytes_by_id": held,
            "need_bytes": sum(reserved.values()),
            "context_bytes": replica.spec.context_bytes,
            "context_measured_bytes": None,
            "gpu_mem_bytes_by_id": reserved,
            "gpus": list(replica.spec.gpus),
            "fraction": replica.spec.fraction,
            "param_devices": [],
            "kv": None,
        }

    def _replica(self, replica_id: str) -> SimReplica | None:
        with self.lock:
            return self.replicas.get(replica_id)

    def _awaited(self, replica_id: str, state: str) -> SimReplica | str:
        """The replica a sleep or wake is for, if the books still wait for it in `state`; else
        what the command came to ("skipped", or "no process" after reporting it failed)."""
        if self.control.replica_state(replica_id) != state:
            return "skipped"
        replica = self._replica(replica_id)
        if replica is None:
            self.report(replica_id, "failed", kind="crash", reason=f"no process on {self.name}")
            return "no process"
        return replica

    def _sleep_replica(self, command: SleepReplica) -> str:
        replica = self._awaited(command.replica_id, S.DRAINING)
        if isinstance(replica, str):
            return replica
        with replica.lock:
            replica.state, replica.arena_bytes = S.SLEEPING, 0
            residual = replica.holds()
            self.report(command.replica_id, "sleeping", residual_bytes_by_id=residual, cpu_bytes=replica.weights_bytes)
        return "sent"

    def _wake(self, command: WakeReplica) -> str:
        replica = self._awaited(command.replica_id, S.WAKING)
        if isinstance(replica, str):
            return replica
        with replica.lock:
            replica.spec = _replaced(replica.spec, command)
            replica.state = S.SERVING
            self.report(command.replica_id, "woken", **self._where(replica))
        return "sent"

    def _stop(self, command: StopReplica) -> str:
        with self.lock:
            replica = self.replicas.pop(command.replica_id, None)
        if replica is not None:
            replica.stopping = True
            with replica.lock:
                replica.state = S.STOPPING
        self.report(command.replica_id, "stopped")
        return "stopped" if replica is not None else "not running here"

    def _arena(self, command: KeepArena) -> str:
        replica = self._replica(command.replica_id)
        if replica is None:
            return "no process"
        with replica.lock:
            kept = replica.weights_bytes if command.keep and replica.state == S.SERVING else 0
            if kept != replica.arena_bytes:
                replica.arena_bytes = kept
                self.report(command.replica_id, "arena", kept_bytes=kept)
        return "sent"


def _replaced(spec: commands.ReplicaSpec, wake: WakeReplica) -> commands.ReplicaSpec:
    from dataclasses import replace

    return replace(spec, gpus=wake.gpus, reserved_bytes_by_gpu=dict(wake.reserved_bytes_by_gpu), fraction=wake.fraction)


# -- many nodes in one process -------------------------------------------------------------------


@dataclass
class Counters:
    """What this process's nodes did, cumulative (bench.fleet subtracts two readings)."""

    registered: int = 0
    beats: int = 0
    failed_beats: int = 0
    # Answered heartbeats per latency bucket (BUCKETS_S, the last one open-ended).
    latency: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    commands: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def beat(self, latency_s: float | None) -> None:
        with self.lock:
            if latency_s is None:
                self.failed_beats += 1
                return
            self.beats += 1
            self.latency[bisect.bisect_left(BUCKETS_S, latency_s)] += 1

    def command(self, kind: str) -> None:
        with self.lock:
            self.commands[kind] = self.commands.get(kind, 0) + 1

    def record(self) -> dict[str, Any]:
        with self.lock:
            return {
                "registered": self.registered,
                "beats": self.beats,
                "failed_beats": self.failed_beats,
                "latency": list(self.latency),
                "commands": dict(self.commands),
            }


def percentile_s(buckets: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile of the counted latencies."""
    total = sum(buckets)
    if not total:
        return None
    seen = 0
    for i, count in enumerate(buckets):
        seen += count
        if seen >= q * total:
            return BUCKETS_S[i] if i < len(BUCKETS_S) else float("inf")
    return float("inf")


class Fleet:
    """The nodes of one process: a heartbeat thread each, one consumer of all their queues."""

    def __init__(
        self,
        names: list[str],
        *,
        load_s: float,
        tokens: Mapping[str, str] | None = None,
        registrations: int = 8,
        workers: int = 64,
    ):
        from django.conf import settings

        from gpuportal.celery import app
        from gpuportal.wire import replies
        from inference.gateway import RemoteControl

        self.app = app
        tokens = tokens or {}
        lease = replies.client(settings.REDIS_URL)
        ttl = node_lease.ttl_s(
            settings.GPUPORTAL_HEARTBEAT_S, settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S, settings.GPUPORTAL_CONTROL_STALL_S
        )
        self.nodes = {
            # Each with its own credential on its calls, as each agent is.
            name: SimulatedNode(
                name,
                RemoteControl(app, settings.REDIS_URL, token=tokens.get(name), node=name),
                lease,
                heartbeat_s=settings.GPUPORTAL_HEARTBEAT_S,
                lease_ttl_s=ttl,
                load_s=load_s,
            )
            for name in names
        }
        self.counters = Counters()
        self.stopping = threading.Event()
        # Nodes booting at once register a few at a time, as hosts of a rack come up.
        self.registering = threading.Semaphore(registrations)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="command")

    def start(self) -> None:
        threading.Thread(target=self._consume, name="consumer", daemon=True).start()
        for node in self.nodes.values():
            threading.Thread(target=self._node, args=(node,), name=node.name, daemon=True).start()

    def _node(self, node: SimulatedNode) -> None:
        with self.registering:
            while not self.stopping.is_set():
                try:
                    node.register()
                    break
                except Exception as err:
                    log.warning("registration of %s failed: %s; again in 1 s", node.name, err)
                    self.stopping.wait(1)
        with self.counters.lock:
            self.counters.registered += 1
        # Hosts that came up together do not beat in step.
        if self.stopping.wait(random.uniform(0, node.heartbeat_s)):
            return
        node.run(self.counters.beat)

    def _consume(self) -> None:
        """Every node's queue, on one connection, as the agents' Celery workers consume them;
        each command carried out on the pool."""
        from kombu import Consumer

        from gpuportal.wire.commands import node_queue

        by_queue = {node_queue(name): node for name, node in self.nodes.items()}
        queues = [self.app.amqp.queues[name] for name in by_queue]
        with self.app.connection_for_read() as conn:

            def received(body: Any, message: Any) -> None:
                task = message.headers.get("task", "")
                queue = message.delivery_info.get("routing_key", "")
                message.ack()
                args = body[0] if isinstance(body, list | tuple) and body else []
                self.pool.submit(self._carry_out, by_queue.get(queue), task, args[0] if args else None)

            with Consumer(conn, queues=queues, callbacks=[received], accept=["json"]):
                while not self.stopping.is_set():
                    try:
                        conn.drain_events(timeout=1)
                    except TimeoutError:
                        continue

    def _carry_out(self, node: SimulatedNode | None, task: str, payload: Any) -> None:
        from gpuportal.wire.inspection import INSPECT_TASK

        try:
            if task == INSPECT_TASK:
                from inference.tasks import inspect_model

                inspect_model(payload)  # the agent's own task: it reads the files and answers
                self.counters.command("inspect")
            elif node is not None:
                node.carry_out(task, payload)
                self.counters.command(task.rpartition(".")[2])
        except Exception:
            log.exception("command %s on %s failed", task, node.name if node else "?")

    def silence(self, names: set[str]) -> None:
        for name in names & set(self.nodes):
            self.nodes[name].silent.set()

    def stop(self) -> None:
        self.stopping.set()
        for node in self.nodes.values():
            node.stopped.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, required=True, help="index of this process's first node")
    parser.add_argument("--count", type=int, required=True, help="how many nodes this process carries")
    parser.add_argument("--stats", type=Path, required=True, help="where its counters are written every second")
    parser.add_argument("--silence", type=Path, required=True, help="a file naming nodes that go silent")
    parser.add_argument("--load-s", type=float, default=1.0, help="how long a replica's load takes (default 1)")
    parser.add_argument("--tokens", type=Path, default=None, help="JSON: each node's credential")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuportal.settings")
    import django

    django.setup()
    tokens = json.loads(args.tokens.read_text()) if args.tokens else {}
    fleet = Fleet([node_name(i) for i in range(args.first, args.first + args.count)], load_s=args.load_s, tokens=tokens)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    fleet.start()
    while not done.wait(1.0):
        if args.silence.exists():
            fleet.silence(set(args.silence.read_text().split()))
        partial = args.stats.with_suffix(".tmp")
        partial.write_text(json.dumps(fleet.counters.record()))
        partial.replace(args.stats)
    fleet.stop()


if __name__ == "__main__":
    main()
