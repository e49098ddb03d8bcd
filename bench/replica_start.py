"""How long a replica takes from its start to serving, started the three ways an agent can start
one, side by side in one run: a fresh interpreter (`python -m inference.replica`), a fork of the
node's template (inference.forkserver, GPUPORTAL_REPLICA_FORKSERVER), and the node's warm spare
on its GPU (inference.spare_pool, GPUPORTAL_WARM_SPARES), forked from the template, its context
made before the start.

    python -m bench.replica_start [--starts 8] [--size-mb 2] [--deep] [--device cpu|cuda] [--no-record]

Each start goes through the supervisor, as the agent's do (inference.supervisor.Supervisor.start,
the spec a tiny deployment gets), and is timed from the call to the replica's `serving` event;
the ways alternate, so that the machine's other load falls on all alike. A start loads the model
from its files; with `--deep` it is the wake of a deep sleeper instead (its weights from the
node's host copy, written by a sleep and a deepen before the clock starts): the start the warm
spare is for. `cpu` is the replica process's own CPU time until it served; `unique` its unique set
size then (memory no other process shares: a forked replica shares the template's pages). The
template's own start is timed once: an agent pays it at start-up, not per replica; a spare is
waited for before each start, as the next one warms while the node has no start to make.

On the CPU the replicas run on a virtual GPU; `--device cuda` on GPU 0, where the context the
spare has made before the start is what it saves beyond the fork (it goes into bench/device_run.sh
as `start`).
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.report import record, table
from gpuportal.wire.commands import ReplicaSpec
from gpuportal.wire.memory import H100_CONTEXT_BYTES
from gpuportal.wire.states import ReplicaState as S
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.supervisor import FINAL_EVENTS, Supervisor

MiB = 1024**2
WAYS = ("fresh", "forked", "spare")
# What a small deployment reserves on a virtual GPU: the context the virtual backend models and
# room for the weights and their KV pool.
CONTEXT = H100_CONTEXT_BYTES
TIMEOUT_S = 180.0


def until(events: queue.Queue[dict[str, Any]], names: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while (event := events.get(timeout=max(0.01, deadline - time.monotonic())))["event"] not in names:
        if event["event"] in FINAL_EVENTS and event["event"] not in names:
            raise SystemExit(f"a replica ended before it served: {event}")
    return event


def replica_spec(model: Path, replica_id: str, size_mb: int, device: str) -> ReplicaSpec:
    reserved = CONTEXT + 3 * size_mb * MiB + 96 * MiB
    backend = "cuda" if device == "cuda" else "virtual"
    # On a GPU the allocator is not capped (no fraction): the bench's replicas share GPU 0 with
    # nothing the books would keep apart, and the cap changes nothing of a start's time.
    fraction = None if device == "cuda" else 0.03
    return ReplicaSpec(
        replica_id=replica_id, source=str(model), loader="transformers", dtype="float32", gpus=(0,),
        reserved_bytes_by_gpu={"0": reserved}, fraction=fraction, backend=backend, context_bytes=CONTEXT,
    )  # fmt: skip


def deep_asleep(supervisor: Supervisor, spec: ReplicaSpec, events: queue.Queue[dict[str, Any]]) -> ReplicaSpec:
    """Load the replica, sleep it and have it sleep deeply; returns the spec of its wake."""
    supervisor.start(spec, lambda _, event: events.put(event))
    until(events, {S.SERVING})
    supervisor.send(spec.replica_id, {"cmd": "sleep"})
    until(events, {S.SLEEPING})
    supervisor.send(spec.replica_id, {"cmd": "deepen", "path": str(supervisor.host_copy_path(spec.replica_id))})
    until(events, {S.DEEP_SLEEPING})
    return dataclasses.replace(spec, from_host_copy=True)


def start_once(supervisor: Supervisor, spec: ReplicaSpec, way: str, deep: bool) -> tuple[float, float, int]:
    """(seconds to serving, the replica's CPU seconds by then, its unique bytes then)."""
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    if deep:
        spec = deep_asleep(supervisor, spec, events)
    spare = _warm_spare(supervisor) if way == "spare" else None
    began = time.monotonic()
    supervisor.start(spec, lambda _, event: events.put(event))
    serving = until(events, {S.SERVING})
    took = time.monotonic() - began
    process = psutil.Process(serving["pid"])
    cpu = sum(process.cpu_times()[:2])
    unique = process.memory_full_info().uss
    if spare is not None and process.pid != spare:
        raise SystemExit("the replica did not run in the warm spare")
    supervisor.stop(spec.replica_id)
    until(events, set(FINAL_EVENTS))
    return took, cpu, unique


def _warm_spare(supervisor: Supervisor) -> int:
    """The pid of GPU 0's warm spare, once one is warm."""
    deadline = time.monotonic() + TIMEOUT_S
    while (pid := supervisor.warm_spares().get(0)) is None:
        if time.monotonic() > deadline:
            raise SystemExit("no warm spare within the timeout")
        time.sleep(0.05)
    return pid


def run(starts: int, size_mb: int, deep: bool, device: str) -> tuple[list[list[object]], float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", size_mb=size_mb, seed=5, log=lambda _: None).path
        supervisors = {way: Supervisor(Path(tmp) / way, host_copies=Path(tmp) / way / "copies") for way in WAYS}
        began = time.monotonic()
        for way in ("forked", "spare"):
            supervisors[way].use_forkserver(warm=True)
            if not supervisors[way].forkserver_ready(TIMEOUT_S):
                raise SystemExit("the replica template did not start")
        warm_s = time.monotonic() - began
        supervisors["spare"].keep_spares("cuda" if device == "cuda" else "virtual", [0], CONTEXT)
        samples: dict[str, list[tuple[float, float, int]]] = {way: [] for way in WAYS}
        try:
            for n in range(starts):
                order = WAYS if n % 2 == 0 else WAYS[::-1]
                for way in order:
                    spec = replica_spec(model, f"{way}-{n}", size_mb, device)
                    samples[way].append(start_once(supervisors[way], spec, way, deep))
        finally:
            for supervisor in supervisors.values():
                supervisor.stop_all()
                supervisor.close()
    rows: list[list[object]] = []
    medians = {}
    for way in WAYS:
        took = sorted(s[0] for s in samples[way])
        medians[way] = statistics.median(took)
        rows.append([
            way, starts, f"{medians[way]:.3f}", f"{took[-1]:.3f}",
            f"{statistics.median(s[1] for s in samples[way]):.2f}",
            f"{statistics.median(s[2] for s in samples[way]) / MiB:.0f}",
        ])  # fmt: skip
    rows.append(["fresh / forked", "", f"{medians['fresh'] / medians['forked']:.1f}x", "", "", ""])
    rows.append(["forked / spare", "", f"{medians['forked'] / medians['spare']:.1f}x", "", "", ""])
    return rows, warm_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=8, help="starts each way (default 8)")
    parser.add_argument("--size-mb", type=int, default=2, help="the tiny model's size (default 2 MiB)")
    parser.add_argument("--deep", action="store_true", help="each start a deep sleeper's wake from its host copy")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="a virtual GPU, or GPU 0")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.starts < 1 or args.size_mb < 1:
        parser.error("--starts and --size-mb must be at least 1")
    rows, warm_s = run(args.starts, args.size_mb, args.deep, args.device)
    result = table(["start", "starts", "to serving (median s)", "slowest s", "cpu (median s)", "unique MiB"], rows)
    print(result)
    print(f"the template's own start (imports, once per agent): {warm_s:.2f} s")
    if not args.no_record:
        what = "a deep sleeper's wake from its host copy" if args.deep else "a load from the model's files"
        where = "GPU 0" if args.device == "cuda" else "a virtual GPU"
        body = (
            f"A random Llama of {args.size_mb} MiB (`make_tiny_model`) on {where}, started {args.starts} times "
            f"each way through the supervisor, the ways alternating; each start is {what}, timed from "
            "`Supervisor.start` to the replica's `serving` event, then stopped. `fresh`: "
            "`python -m inference.replica` in a new interpreter; `forked`: forked from the agent's "
            "template, which imported torch, transformers and the replica program once "
            f"(its own start took {warm_s:.2f} s, once per agent); `spare`: the GPU's warm spare, forked "
            "from the template and its context made before the start (GPUPORTAL_WARM_SPARES). `cpu`: "
            "the replica process's CPU time by then; `unique`: its unique set size then (a forked "
            "replica shares the template's pages).\n\n" + result
        )
        section = "replica_start" + ("_deep" if args.deep else "") + ("_cuda" if args.device == "cuda" else "")
        record(section, f"Replica start ({what}, {where}): fresh, forked and warm spare", body)


if __name__ == "__main__":
    main()
