"""Commit path throughput: optimistic compare-and-swap against a global lock, side by side.

Each operation is what a scheduling decision costs in the ledger: snapshot the GPU(s), decide
(reserve or release on one GPU), commit. `cas` is the project's path (ledger.commit_with_retry);
`global-lock` does the same under one PostgreSQL advisory lock, the simple alternative that never
conflicts but serialises every decision. Two GPU sets: `spread` (any of 100 nodes × 8 GPUs) and
`hot` (every client on the same 8 GPUs, the worst case for conflicts).

    python -m bench.commit_path [--seconds 3] [--clients 1,4,8,16] [--no-record]

Uses DATABASE_URL when set (in a fresh database `gpuportal_bench`), else an embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from bench.common import register_cluster, setup_database, stop


def populate(nodes: int, gpus_per_node: int, replicas: int) -> tuple[list[int], list[str]]:
    from scheduling.models import Deployment, DeploymentObserved, Replica

    gpu_ids = register_cluster(nodes, gpus_per_node, "80GiB")
    dep = Deployment.objects.create(name="bench", model_source="/srv/models/bench")
    DeploymentObserved.objects.create(deployment=dep)  # every deployment has its record
    ids = [Replica.objects.create(deployment=dep).id for _ in range(replicas)]
    return gpu_ids, ids


def run(mode: str, gpu_ids: list[int], replica_ids: list[str], clients: int, seconds: float) -> dict:
    from django.db import connection, transaction

    from scheduling import ledger
    from scheduling.core.state import Plan, Release, Reservation
    from scheduling.ledger import CasConflict

    latencies: list[float] = []
    conflicts = failures = 0
    lock = threading.Lock()
    barrier = threading.Barrier(clients)
    GiB = 1024**3

    def decide_for(rng: random.Random, gpu_id: int, replica: str):
        def decide(snap):
            gpu = snap.gpus[gpu_id]
            if any(o.replica_id == replica for o in gpu.occupants):
                return Plan.against(snap, "bench release", releases=[Release(gpu_id, replica)])
            size = min(rng.randint(1, 8) * GiB, gpu.available_bytes)
            return Plan.against(snap, "bench reserve", [Reservation(gpu_id, replica, size)])

        return decide

    def client(n: int) -> None:
        nonlocal conflicts, failures
        rng = random.Random(n)
        mine = replica_ids[n::clients]
        own_latencies, own_conflicts, own_failures = [], 0, 0
        barrier.wait()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            gpu_id, replica = rng.choice(gpu_ids), rng.choice(mine)
            decide = decide_for(rng, gpu_id, replica)
            started = time.perf_counter()
            if mode == "cas":
                try:
                    result = ledger.commit_with_retry(decide, gpu_ids=[gpu_id])
                    own_conflicts += result.attempts - 1
                except CasConflict:
                    own_failures += 1
                    continue
            else:
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT pg_advisory_xact_lock(424242)")
                    ledger.commit(decide(ledger.snapshot([gpu_id])))
            own_latencies.append(time.perf_counter() - started)
        connection.close()
        with lock:
            latencies.extend(own_latencies)
            conflicts += own_conflicts
            failures += own_failures

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "commits_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "conflicts_per_commit": conflicts / max(1, len(latencies)),
        "gave_up": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]

    server = setup_database("gpuportal_bench")
    try:
        from bench.report import record, table

        gpu_ids, replica_ids = populate(nodes=100, gpus_per_node=8, replicas=16 * 32)
        hot = gpu_ids[:8]
        rows = []
        for gpu_set, ids in (("spread (800 GPUs)", gpu_ids), ("hot (8 GPUs)", hot)):
            for clients in client_counts:
                cas = run("cas", ids, replica_ids, clients, args.seconds)
                locked = run("global-lock", ids, replica_ids, clients, args.seconds)
                rows.append(
                    [
                        gpu_set,
                        clients,
                        f"{cas['commits_per_s']:.0f}",
                        f"{cas['p50_ms']:.2f}",
                        f"{cas['p99_ms']:.2f}",
                        f"{cas['conflicts_per_commit']:.2f}",
                        cas["gave_up"],
                        f"{locked['commits_per_s']:.0f}",
                        f"{locked['p99_ms']:.2f}",
                        f"{cas['commits_per_s'] / locked['commits_per_s']:.2f}×",
                    ]
                )
                print(table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
        report = table(HEADERS, rows)
        print("\n" + report)
        if not args.no_record:
            record(
                "commit_path",
                "Commit path: compare-and-swap against a global lock",
                f"`python -m bench.commit_path --seconds {args.seconds:g}`: each operation snapshots one GPU, "
                "reserves or releases on it, and commits (the ledger's whole path, Events included); "
                f"{args.seconds:g} s per cell, threads with their own PostgreSQL connections, 100 nodes × 8 "
                "virtual GPUs of 80 GiB (state only). `cas ÷ lock` is the throughput ratio measured in the "
                "same run.\n\n" + report,
            )
    finally:
        stop(server)


HEADERS = [
    "GPUs",
    "clients",
    "cas commits/s",
    "cas p50 ms",
    "cas p99 ms",
    "conflicts/commit",
    "gave up",
    "lock commits/s",
    "lock p99 ms",
    "cas ÷ lock",
]

if __name__ == "__main__":
    main()
