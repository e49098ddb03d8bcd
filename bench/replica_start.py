"""How long a replica takes from its start to serving, started the two ways an agent can start
one: a fresh interpreter (`python -m inference.replica`) and a fork of the node's template
(inference.forkserver, GPUPORTAL_REPLICA_FORKSERVER), side by side in one run.

    python -m bench.replica_start [--starts 8] [--size-mb 2] [--no-record]

Each start goes through the supervisor, as the agent's do (inference.supervisor.Supervisor.start,
the same spec a tiny deployment gets on a virtual GPU), and is timed from the call to the
replica's `serving` event; the two ways alternate, so that the machine's other load falls on
both alike. `cpu` is the replica process's own CPU time until it served; `unique` its unique
set size then (memory no other process shares: a forked replica shares the template's pages).
The template's own start is timed once: an agent pays it at start-up, not per replica.
"""

from __future__ import annotations

import argparse
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
WAYS = ("fresh", "forked")
# What a small deployment reserves on a virtual GPU: the context the virtual backend models and
# room for the weights and their KV pool.
CONTEXT = H100_CONTEXT_BYTES
RESERVED = CONTEXT + 96 * MiB
TIMEOUT_S = 120.0


def until(events: queue.Queue[dict[str, Any]], names: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while (event := events.get(timeout=max(0.01, deadline - time.monotonic())))["event"] not in names:
        if event["event"] in FINAL_EVENTS:
            raise SystemExit(f"a replica ended before it served: {event}")
    return event


def start_once(supervisor: Supervisor, model: Path, replica_id: str) -> tuple[float, float, int]:
    """(seconds to serving, the replica's CPU seconds by then, its unique bytes then)."""
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    replica = ReplicaSpec(
        replica_id=replica_id, source=str(model), loader="transformers", dtype="float32", gpus=(0,),
        reserved_bytes_by_gpu={"0": RESERVED}, fraction=0.03, backend="virtual", context_bytes=CONTEXT,
    )  # fmt: skip
    began = time.monotonic()
    supervisor.start(replica, lambda _, event: events.put(event))
    serving = until(events, {S.SERVING})
    took = time.monotonic() - began
    process = psutil.Process(serving["pid"])
    cpu = sum(process.cpu_times()[:2])
    unique = process.memory_full_info().uss
    supervisor.stop(replica_id)
    until(events, set(FINAL_EVENTS))
    return took, cpu, unique


def run(starts: int, size_mb: int) -> tuple[list[list[object]], float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", size_mb=size_mb, seed=5, log=lambda _: None).path
        supervisors = {way: Supervisor(Path(tmp) / way) for way in WAYS}
        began = time.monotonic()
        supervisors["forked"].use_forkserver(warm=True)
        if not supervisors["forked"].forkserver_ready(TIMEOUT_S):
            raise SystemExit("the replica template did not start")
        warm_s = time.monotonic() - began
        samples: dict[str, list[tuple[float, float, int]]] = {way: [] for way in WAYS}
        try:
            for n in range(starts):
                order = WAYS if n % 2 == 0 else WAYS[::-1]
                for way in order:
                    samples[way].append(start_once(supervisors[way], model, f"{way}-{n}"))
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
            way, starts, f"{medians[way]:.2f}", f"{took[-1]:.2f}",
            f"{statistics.median(s[1] for s in samples[way]):.2f}",
            f"{statistics.median(s[2] for s in samples[way]) / MiB:.0f}",
        ])  # fmt: skip
    rows.append(["fresh / forked", "", f"{medians['fresh'] / medians['forked']:.1f}x", "", "", ""])
    return rows, warm_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=8, help="starts each way (default 8)")
    parser.add_argument("--size-mb", type=int, default=2, help="the tiny model's size (default 2 MiB)")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.starts < 1 or args.size_mb < 1:
        parser.error("--starts and --size-mb must be at least 1")
    rows, warm_s = run(args.starts, args.size_mb)
    result = table(["start", "starts", "to serving (median s)", "slowest s", "cpu (median s)", "unique MiB"], rows)
    print(result)
    print(f"the template's own start (imports, once per agent): {warm_s:.2f} s")
    if not args.no_record:
        body = (
            f"A random Llama of {args.size_mb} MiB (`make_tiny_model`) on a virtual GPU, started "
            f"{args.starts} times each way through the supervisor, the two ways alternating; each start "
            "timed from `Supervisor.start` to the replica's `serving` event, then stopped. `fresh`: "
            "`python -m inference.replica` in a new interpreter; `forked`: forked from the agent's "
            "template, which imported torch, transformers and the replica program once "
            f"(its own start took {warm_s:.2f} s, once per agent). `cpu`: the replica process's CPU "
            "time by then; `unique`: its unique set size then (a forked replica shares the "
            "template's pages).\n\n" + result
        )
        record("replica_start", "Replica start: a fresh interpreter against a fork of the template", body)


if __name__ == "__main__":
    main()
