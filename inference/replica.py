"""The replica host program: one OS process per replica (docs/architecture.md), started by the node agent.

    python -m inference.replica --replica-id ID --source S --loader L --dtype D --gpus 0 \\
        --reserved-bytes-by-gpu '{"0": 734003200}' --fraction 0.03 --backend virtual|cuda

It speaks JSON lines: commands on stdin, events on stdout (one object a line, flushed), logs on
stderr. Only the protocol may reach stdout, so whatever else writes to file descriptor 1 (a
library's print, a C extension) is sent to stderr instead.

Events:   progress {state, percent, detail} · serving {pid, weights_bytes, process_bytes,
          gpu_mem_bytes_by_id, ...} · sleeping {residual_bytes_by_id, ...} · woken {gpu_mem_bytes_by_id, ...}
          · pong {state, pid, arena_bytes} · error {cmd, reason} (a command refused; the replica carries on)
          · failed {reason, kind: oom|load|cuda_assert|crash}, then exit 1 · stopped, then exit 0
          · hello {replica_id, pid, state, last} (first to an agent that adopted it)
          · arena {kept_bytes, failed?} (the host arena an awake replica keeps for its next sleep:
          ready, or 0 once dropped, or 0 with `failed` when it could not be allocated; a sleep
          consumes it into the arena its `sleeping` counts as cpu_bytes).
Commands: sleep {drain_timeout_s} · wake {gpus, reserved_bytes_by_gpu, fraction} · stop {drain_timeout_s}
          · arena {keep} (whether it may keep a host arena while awake)
          · ping · resync (emit the last state event again). EOF on stdin: the agent is gone: exit, or
          with --adoption-window, wait that long for a new agent on --adopt-address (inference.adoption).

Sleep and stop pass the preemption barrier: no new request starts, the one in flight
has `drain_timeout_s` (default 30) to finish, then it is cut short and given back to the head of
its queue, and only then are the weights moved or released.

`--backend cuda` follows seed 000: target the first GPU, cap the process with
set_per_process_memory_fraction, place weights with accelerate under max_memory (0 on GPUs it does
not own) and check where they landed; sleep packs them into one pinned host allocation (an
arena, inference.arena) and lifts the cap; wake targets the possibly new GPUs, queues the
arena's copies there, allocates the KV pool while they run, synchronises once and frees the
arena. `--backend virtual` runs the same host on CPU (sleep and wake through the
same arena, with plain host copies) and enforces the reservation in software: weights bigger than
it fail exactly like an out-of-memory.

No Django here: the process must start fast and must not hold database connections.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gpuportal.processes import tie_to_parent, untie_from_parent
from gpuportal.wire import prefix_cache
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.requestqueue import RequestQueue
from gpuportal.wire.states import PROCESS_STARTING, Role
from gpuportal.wire.states import ReplicaState as S
from inference import warm_spare
from inference.backends import (
    BACKENDS,
    Backend,
    CudaBackend,
    Placement,
    ReplicaFailure,
    VirtualBackend,
    classify_failure,
)
from inference.event_stream import EventWriter, protocol_stream
from inference.host import DEFAULT_KV_MAX_TOKENS, ReplicaHost
from inference.loaders import LOADERS
from inference.process_exit import exit_now as _exit
from inference.serving import Server

if TYPE_CHECKING:
    from inference.pairing import PairMember

log = logging.getLogger("inference.replica")


# -- the process ---------------------------------------------------------------------------------


def die_with_parent() -> None:
    """SIGKILL when the agent dies, however it dies (the supervisor also sets this before exec)."""
    try:
        tie_to_parent(signal.SIGKILL)
    except OSError as exc:  # not Linux: the agent's stdin EOF still ends us
        log.warning("cannot set PR_SET_PDEATHSIG: %s", exc)


def read_commands(
    stream: Iterable[str], host: ReplicaHost, commands: queue.Queue[Any], on_eof: Callable[[], None] | None = None
) -> None:
    """The command thread: answer pings at once, queue the rest for the main thread. At EOF the
    agent is gone: exit, or, for a replica that may outlive it, `on_eof` (inference.adoption)."""
    for line in _until_gone(stream):
        text = line.strip()
        if not text:
            continue
        try:
            command = json.loads(text)
        except json.JSONDecodeError:
            command = None
        if not isinstance(command, dict) or not isinstance(command.get("cmd"), str):
            host.events.emit("error", cmd=None, reason=f"not a JSON command object: {text[:200]!r}")
            continue
        if command["cmd"] == "ping":
            host.ping()
        elif command["cmd"] == "resync":
            host.events.resync()
        elif command["cmd"] == "stop" and host.state in {PROCESS_STARTING, S.LOADING}:
            # A load can take minutes and cannot be interrupted; nothing is worth saving yet.
            log.info("stop while loading: exiting now")
            host.events.emit("stopped")
            _exit(0)
        else:
            commands.put(command)
    if on_eof is not None:
        on_eof()
        return
    log.info("stdin closed: the agent is gone; exiting")
    _exit(0)


def _until_gone(stream: Iterable[str]) -> Iterator[str]:
    """The agent's lines until it is gone. An adopter's stream is a Unix socket, and an agent that
    dies with our events unread in it resets the connection rather than closing it: that is its
    end too, and this thread must live on to wait for the next adopter, or exit."""
    try:
        yield from stream
    except OSError as err:
        log.info("the agent's stream ended (%s)", err)


def give_up(host: ReplicaHost, commands: queue.Queue[Any]) -> None:
    """No agent adopted this orphan: stop as a scale-down would, giving back what it had taken
    (a load cannot be interrupted and holds nothing worth saving: exit at once)."""
    if host.state in {PROCESS_STARTING, S.LOADING}:
        _exit(0)
    commands.put({"cmd": "stop", "drain_timeout_s": 0})


def run(host: ReplicaHost, commands: queue.Queue[Any], pair: PairMember | None = None) -> int:
    """The main thread: load, then run queued commands until stopped. Returns the exit code."""
    try:
        if pair is None:
            host.load()
        else:
            pair.start(commands)
        # Stopped, or deep asleep: its weights are in the node's host copy, and nothing is left here.
        while host.state not in (S.STOPPED, S.DEEP_SLEEPING):
            command = commands.get()
            # Callables come from this process's own threads (a failover lock grant): they run
            # here so that every transition stays on the main thread.
            command() if callable(command) else host.handle(command)
        return 0
    except ReplicaFailure as failure:
        log.error("%s failed (%s): %s", host.replica_id, failure.kind, failure.reason)
        host.events.emit("failed", reason=failure.reason, kind=failure.kind)
        return 1
    except Exception as exc:  # a bug in this program: still tell the agent why before dying
        failure = classify_failure(exc, "crash")
        log.exception("%s crashed", host.replica_id)
        host.events.emit("failed", reason=failure.reason, kind=failure.kind)
        return 1


def adopt_later(host: ReplicaHost, commands: queue.Queue[Any], args: argparse.Namespace) -> Callable[[], None]:
    """Let this replica outlive its agent (inference.adoption); returns what the command reader
    calls at EOF."""
    from inference.adoption import Orphanage

    orphanage = Orphanage(
        args.adopt_address,
        args.adoption_window,
        host=host,
        events=host.events,
        serve_commands=lambda stream: read_commands(stream, host, commands, orphanage.orphaned),
        give_up=lambda: give_up(host, commands),
    )
    host.events.on_broken = orphanage.orphaned
    return orphanage.orphaned


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference.replica", description=__doc__.split("\n")[0])
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--source", required=True, help="Model directory, hf:org/name, or package.module:factory.")
    parser.add_argument("--loader", required=True, choices=LOADERS)
    parser.add_argument("--dtype", required=True, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--gpus", required=True, help="GPU ids, comma-separated: 0 or 0,1.")
    parser.add_argument("--reserved-bytes-by-gpu", required=True, help='JSON: {"0": 734003200}')
    parser.add_argument("--fraction", default=None, help="Memory fraction cap of a single-GPU replica.")
    parser.add_argument("--adapters", default="", help="LoRA adapters served beside the model: name=source,...")
    parser.add_argument(
        "--prefix-cache", choices=prefix_cache.MODES, default=prefix_cache.USER, help="whose requests share KV blocks"
    )
    parser.add_argument("--backend", choices=BACKENDS, default="virtual")
    parser.add_argument("--deployment", default="", help="Serve this deployment's request queue.")
    parser.add_argument("--redis-url", default=os.environ.get("GPUPORTAL_REDIS_URL", ""), help="The request queue.")
    parser.add_argument("--node", default="", help="The node it runs on, whose epoch fences it.")
    parser.add_argument("--node-epoch", type=int, default=None, help="The node's epoch at its start.")
    parser.add_argument(
        "--failover-dir", default="", help="A failover pair's member: its node's folder of pair locks (seed 004)."
    )
    parser.add_argument("--failover-fence", default="", help="Names the pair: its lock's files, its result fence.")
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.PRIMARY.value)
    parser.add_argument("--wake-timeout", type=float, default=60.0, help="A takeover's wake past this exits.")
    parser.add_argument("--liveness-every", type=float, default=0.5, help="Seconds between `alive` events.")
    parser.add_argument(
        "--kv-max-tokens",
        type=int,
        default=DEFAULT_KV_MAX_TOKENS,
        help="The deployment's memory.max_tokens: sizes the activation budget left out of the KV pool.",
    )
    parser.add_argument(
        "--context-bytes", type=int, default=0, help="CUDA context of a serving replica the reservation counts."
    )
    parser.add_argument(
        "--standby-context-bytes",
        type=int,
        default=0,
        help="A failover pair's standby's context, also in the reservation (never in the KV pool).",
    )
    parser.add_argument(
        "--adoption-window",
        type=float,
        default=0.0,
        help="Seconds to outlive the agent, waiting for a new one to adopt it (0: die with the agent).",
    )
    parser.add_argument("--adopt-address", default="", help="Abstract socket name an adopter connects to.")
    parser.add_argument(
        "--host-copy", default="", help="Wake from deep sleep: the weights from this host copy, not the source's files."
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def placement_from_args(args: argparse.Namespace) -> Placement:
    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gpus must be comma-separated GPU ids, got {args.gpus!r}") from None
    try:
        reserved = json.loads(args.reserved_bytes_by_gpu)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--reserved-bytes-by-gpu is not JSON: {exc}") from None
    fraction = None if args.fraction in (None, "", "none", "null") else float(args.fraction)
    return Placement.parse(gpus, reserved, fraction)


def main(argv: list[str] | None = None, events: TextIO | None = None) -> None:
    """The replica program. `events`: the protocol's stream where this process already kept it (a
    warm spare becoming this replica, inference.warm_spare); else fd 1 becomes it here."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [warm_spare.FLAG]:
        # Warm on its GPU, then this replica: the one it is told to become.
        argv, events = warm_spare.wait_to_become(argv[1:])
    args = parse_args(argv)
    adoptable = args.adoption_window > 0 and bool(args.adopt_address)
    if not adoptable:
        die_with_parent()
    else:
        # A warm spare dies with its agent; the replica it became outlives it for its window.
        untie_from_parent()
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s replica {args.replica_id} pid {os.getpid()}: %(message)s",
        force=True,
    )
    # Never the hub, whatever the environment says: a node has no network and a download would
    # blow the memory plan. PCI bus order makes torch's GPU indices NVML's, which the agent reports.
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Progress bars redraw with carriage returns: noise in a log file, and progress goes out as events.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    writer = EventWriter(protocol_stream() if events is None else events)
    try:
        placement = placement_from_args(args)
    except ValueError as exc:
        writer.emit("failed", reason=f"bad arguments: {exc}", kind="load")
        _exit(2)
    backend: Backend = CudaBackend() if args.backend == "cuda" else VirtualBackend()
    host = ReplicaHost(
        replica_id=args.replica_id,
        source=args.source,
        loader=args.loader,
        dtype=args.dtype,
        adapters=args.adapters,
        prefix_cache=args.prefix_cache,
        placement=placement,
        backend=backend,
        events=writer,
        kv_max_tokens=args.kv_max_tokens,
        context_bytes=args.context_bytes,
        standby_context_bytes=args.standby_context_bytes,
        node_fence=NodeFence(args.node, args.node_epoch) if args.node and args.node_epoch is not None else None,
        host_copy=Path(args.host_copy) if args.host_copy else None,
    )
    commands: queue.Queue[Any] = queue.Queue()
    on_eof = adopt_later(host, commands, args) if adoptable else None
    threading.Thread(target=read_commands, args=(sys.stdin, host, commands, on_eof), name="stdin", daemon=True).start()
    requests = RequestQueue.from_url(args.redis_url) if args.redis_url else None
    if args.deployment and requests is not None:
        Server(host, requests, args.deployment).start()
    pair = None
    if args.failover_dir:
        from inference.pairing import PairMember

        if not args.failover_fence or requests is None:
            writer.emit("failed", reason="a failover member needs --failover-fence and --redis-url", kind="load")
            _exit(2)
        pair = PairMember.from_args(host, requests, args)
    _exit(run(host, commands, pair))


if __name__ == "__main__":
    main()
