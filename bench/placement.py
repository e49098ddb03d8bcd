"""Placement throughput: snapshot → place → compare-and-swap commit, from concurrent clients.

100 nodes × 8 virtual GPUs of 80 GiB (state only: no processes). Each client is its own OS
process with its own PostgreSQL connection and ledger Mirror, as web and worker processes are.
An operation places a new replica of a random deployment (sizes from 1 to 20 GiB of weights) or
releases one the client placed earlier, keeping the cluster about half full so that placements
keep searching and sometimes evict. Both policies run on the same cluster and clients:
`gpuportal` (measured/estimated need, best fit) and `ndif` (size × 3, random fit).

    python -m bench.placement [--seconds 3] [--clients 1,4,8,16] [--no-record]

Uses DATABASE_URL when set (in a fresh database `gpuportal_bench_placement`), else an embedded
PostgreSQL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

from bench.common import register_cluster, setup_database, stop

GiB = 1024**3
DEPLOYMENTS = 40
POOL_PER_CLIENT = 400
HEADERS = [
    "policy",
    "clients",
    "commits/s",
    "p50 ms",
    "p99 ms",
    "conflicts/commit",
    "refused",
    "placed",
    "released",
]


def create_state(clients: int) -> list[list[tuple[str, str, int, int]]]:
    """Deployments of spread sizes, and a pool of replica rows per client:
    (replica id, deployment, weight bytes, estimate bytes)."""
    from scheduling.models import Deployment, Replica

    rng = random.Random(7)
    deployments = []
    for n in range(DEPLOYMENTS):
        weights = int(rng.uniform(1, 20) * GiB)
        estimate = int(weights * 1.3) + GiB  # KV cache and activations beside the weights
        deployments.append(
            Deployment.objects.create(
                name=f"model-{n:02d}",
                model_source=f"/srv/models/{n}",
                weight_bytes=weights,
                memory_estimate_bytes=estimate,
                min_runtime_s=0,
            )
        )
    pools = []
    for _ in range(clients):
        rows = [Replica(deployment=rng.choice(deployments)) for _ in range(POOL_PER_CLIENT)]
        Replica.objects.bulk_create(rows)
        pools.append(
            [(r.id, r.deployment.name, r.deployment.weight_bytes, r.deployment.memory_estimate_bytes) for r in rows]
        )
    return pools


def reset_reservations() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE scheduling_occupant, scheduling_event")
        cursor.execute("UPDATE scheduling_gpu SET available_bytes = total_bytes, changed_txid = txid_current()")


def client(
    n: int, policy: str, pool: list[tuple[str, str, int, int]], seconds: float, start: mp.Barrier, out: mp.Queue
) -> None:
    from django.db import connection

    from scheduling import ledger, memory
    from scheduling.ledger import CasConflict
    from scheduling.placement import CantAccommodate, PlacementRequest, place
    from scheduling.state import Plan, Release

    rng = random.Random(1000 + n)
    mirror = ledger.Mirror()
    mirror.snapshot()  # the first, full read happens before the clock starts
    free = list(pool)
    placed: list[str] = []
    latencies: list[float] = []
    conflicts = refused = placements = releases = gave_up = 0

    def release_one(snap, replica_id: str):
        releases_ = [
            Release(g.id, replica_id)
            for g in snap.gpus.values()
            if any(o.replica_id == replica_id for o in g.occupants)
        ]
        return Plan.against(snap, "bench release", releases=releases_) if releases_ else None

    start.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        grow = not placed or (free and rng.random() < 0.5)
        began = time.perf_counter()
        if grow:
            replica_id, deployment, weights, estimate = free.pop(rng.randrange(len(free)))
            need = memory.need_for(policy, memory.NeedInputs(weight_bytes=weights, estimate_bytes=estimate)).bytes
            outcome: dict = {}

            def decide(snap, replica_id=replica_id, deployment=deployment, need=need, outcome=outcome):
                result = place(snap, PlacementRequest(deployment, replica_id, need), policy=policy, rng=rng)
                if isinstance(result, CantAccommodate):
                    outcome["refused"] = True
                    return None
                return result.to_plan(snap)

            try:
                result = ledger.commit_with_retry(decide, mirror=mirror)
            except CasConflict:
                gave_up += 1
                free.append((replica_id, deployment, weights, estimate))
                continue
            if result is None:
                refused += 1
                free.append((replica_id, deployment, weights, estimate))
                continue
            placements += 1
            placed.append(replica_id)
        else:
            replica_id = placed.pop(rng.randrange(len(placed)))
            try:
                result = ledger.commit_with_retry(lambda snap, r=replica_id: release_one(snap, r), mirror=mirror)
            except CasConflict:
                gave_up += 1
                placed.append(replica_id)
                continue
            releases += 1
            free.append(next(p for p in pool if p[0] == replica_id))
            if result is None:
                continue  # evicted by someone else's placement meanwhile: nothing to release
        latencies.append(time.perf_counter() - began)
        conflicts += result.attempts - 1
    connection.close()
    out.put(
        {
            "latencies": latencies,
            "conflicts": conflicts,
            "refused": refused,
            "placed": placements,
            "released": releases,
            "gave_up": gave_up,
        }
    )


def run(policy: str, clients: int, pools, seconds: float) -> dict:
    from django.db import connections

    reset_reservations()
    connections.close_all()  # children must not share the parent's connection across fork
    ctx = mp.get_context("fork")
    start = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=client, args=(n, policy, pools[n], seconds, start, out)) for n in range(clients)]
    for proc in procs:
        proc.start()
    start.wait()
    began = time.perf_counter()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    elapsed = time.perf_counter() - began
    for proc in procs:
        proc.join(30)
    latencies = sorted(x for r in results for x in r["latencies"])
    commits = len(latencies)
    return {
        "commits_per_s": commits / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(commits - 1, int(0.99 * commits))],
        "conflicts_per_commit": sum(r["conflicts"] for r in results) / max(1, commits),
        "refused": sum(r["refused"] for r in results),
        "placed": sum(r["placed"] for r in results),
        "released": sum(r["released"] for r in results),
        "gave_up": sum(r["gave_up"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]

    server = setup_database("gpuportal_bench_placement")
    try:
        from bench.report import record, table

        register_cluster(nodes=100, gpus_per_node=8, gpu_size="80GiB")
        pools = create_state(max(counts))
        rows = []
        for policy in ("gpuportal", "ndif"):
            for clients in counts:
                r = run(policy, clients, pools, args.seconds)
                rows.append(
                    [
                        policy,
                        clients,
                        f"{r['commits_per_s']:.0f}",
                        f"{r['p50_ms']:.2f}",
                        f"{r['p99_ms']:.2f}",
                        f"{r['conflicts_per_commit']:.3f}",
                        r["refused"],
                        r["placed"],
                        r["released"],
                    ]
                )
                print(table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
        report = table(HEADERS, rows)
        print("\n" + report)
        if not args.no_record:
            record(
                "placement",
                "Placement: snapshot, place, commit",
                f"`python -m bench.placement --seconds {args.seconds:g}`: 100 nodes × 8 virtual GPUs of 80 GiB, "
                f"{DEPLOYMENTS} deployments of 1 to 20 GiB of weights; each client is a process with its own "
                "connection and ledger Mirror; an operation places a replica (snapshot refresh, `place`, commit "
                "with Events) or releases one; latency includes retries. Refused: no node could host the "
                f"replica. {args.seconds:g} s per row.\n\n" + report,
            )
    finally:
        stop(server)


if __name__ == "__main__":
    main()
