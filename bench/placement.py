"""Placement throughput: snapshot → place → compare-and-swap commit, from concurrent clients.

100 nodes × 8 virtual GPUs of 80 GiB (state only: no processes). Each client is its own OS
process with its own PostgreSQL connection and ledger Mirror, as web and worker processes are.
An operation places a new replica of a random deployment (sizes from 1 to 20 GiB of weights) or
releases one the client placed earlier, keeping the cluster about half full so that placements
keep searching and sometimes evict. Both policies run on the same cluster and clients:
`gpuportal` (measured/estimated need, best fit) and `ndif` (size × 3, random fit).

Snapshots come two ways, side by side: from a ledger `Mirror` (an incremental refresh: only the
GPUs written since the client last looked; the figures issue 3's target is about), and as the
control plane's services take them today, a full `ledger.snapshot()` of every GPU (the services
do not keep a Mirror: it would also have to learn of replica, deployment and node changes that
write no GPU row). The full-snapshot rows run `gpuportal` only, at `--full-clients`.

    python -m bench.placement [--seconds 3] [--clients 1,4,8,16] [--full-clients 1,8] [--policy gpuportal,ndif]
                              [--cpu] [--no-record]

`--cpu` adds the CPU each operation cost, in the client processes and in their PostgreSQL
backends (read from /proc, so only for a server on this machine, such as the embedded one).

Uses DATABASE_URL when set (in a fresh database `gpuportal_bench_placement`), else an embedded
PostgreSQL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
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


class Client:
    """One client's loop, one operation per `step()`: place a replica of its pool, or release
    one it placed. Shared by the benchmark's processes and by profiling."""

    def __init__(self, n: int, policy: str, pool: list[tuple[str, str, int, int]], *, mirrored: bool = True) -> None:
        from scheduling import ledger

        self.policy = policy
        self.pool = {p[0]: p for p in pool}
        self.rng = random.Random(1000 + n)
        self.mirror = ledger.Mirror() if mirrored else None
        if self.mirror is not None:
            self.mirror.snapshot()  # the first, full read happens before the clock starts
        self.free = list(pool)
        self.placed: list[str] = []
        # Where each placed replica was put: it is released from there, as a service releases a
        # replica from the node the database says it is on. Only this client places its pool's
        # replicas; others can only evict them, so it is found there or nowhere.
        self.where: dict[str, tuple[int, ...]] = {}
        self.latencies: list[float] = []
        self.conflicts = self.refused = self.placements = self.releases = self.gave_up = 0

    def step(self) -> None:
        from gpuportal.wire import memory
        from scheduling import ledger
        from scheduling.ledger import CasConflict
        from scheduling.placement import CantAccommodate, PlacementRequest, place
        from scheduling.state import Plan, Release

        rng = self.rng
        grow = not self.placed or (self.free and rng.random() < 0.5)
        began = time.perf_counter()
        if grow:
            entry = self.free.pop(rng.randrange(len(self.free)))
            replica_id, deployment, weights, estimate = entry
            need = memory.need_for(self.policy, memory.NeedInputs(weight_bytes=weights, estimate_bytes=estimate)).bytes
            request = PlacementRequest(deployment, replica_id, need)

            def decide(snap):
                result = place(snap, request, policy=self.policy, rng=rng)
                if isinstance(result, CantAccommodate):
                    return None
                return result.to_plan(snap)

            try:
                result = ledger.commit_with_retry(decide, mirror=self.mirror)
            except CasConflict:
                self.gave_up += 1
                self.free.append(entry)
                return
            if result is None:
                self.refused += 1
                self.free.append(entry)
                return
            self.placements += 1
            self.placed.append(replica_id)
            self.where[replica_id] = tuple(r.gpu_id for r in result.plan.reservations if r.replica_id == replica_id)
        else:
            replica_id = self.placed.pop(rng.randrange(len(self.placed)))
            gpu_ids = self.where[replica_id]

            def release(snap):
                releases = [
                    Release(gpu_id, replica_id)
                    for gpu_id in gpu_ids
                    if gpu_id in snap.gpus and any(o.replica_id == replica_id for o in snap.gpus[gpu_id].occupants)
                ]
                return Plan.against(snap, "bench release", releases=releases) if releases else None

            try:
                result = ledger.commit_with_retry(release, mirror=self.mirror)
            except CasConflict:
                self.gave_up += 1
                self.placed.append(replica_id)
                return
            self.releases += 1
            del self.where[replica_id]
            self.free.append(self.pool[replica_id])
            if result is None:
                return  # evicted by someone else's placement meanwhile: nothing to release
        self.latencies.append(time.perf_counter() - began)
        self.conflicts += result.attempts - 1


def backend_cpu_s() -> float | None:
    """CPU seconds used so far by this connection's PostgreSQL backend, when it runs on this
    machine (the embedded server does); None where /proc cannot tell."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(
    n: int,
    policy: str,
    pool: list[tuple[str, str, int, int]],
    seconds: float,
    start: mp.Barrier,
    out: mp.Queue,
    mirrored: bool,
) -> None:
    from django.db import connection

    loop = Client(n, policy, pool, mirrored=mirrored)
    start.wait()
    server_before, client_before = backend_cpu_s(), time.process_time()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        loop.step()
    client_cpu = time.process_time() - client_before
    server_after = backend_cpu_s()
    server_cpu = None if server_before is None or server_after is None else server_after - server_before
    connection.close()
    out.put(
        {
            "latencies": loop.latencies,
            "conflicts": loop.conflicts,
            "refused": loop.refused,
            "placed": loop.placements,
            "released": loop.releases,
            "gave_up": loop.gave_up,
            "client_cpu": client_cpu,
            "server_cpu": server_cpu,
        }
    )


def run(policy: str, clients: int, pools, seconds: float, *, mirrored: bool = True) -> dict:
    from django.db import connections

    reset_reservations()
    connections.close_all()  # children must not share the parent's connection across fork
    ctx = mp.get_context("fork")
    start = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=client, args=(n, policy, pools[n], seconds, start, out, mirrored)) for n in range(clients)
    ]
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
        # CPU per operation (ms), client processes and their PostgreSQL backends, whatever the
        # wall clock: on a shared or oversubscribed machine this is the steadier figure.
        "client_cpu_ms": 1000 * sum(r["client_cpu"] for r in results) / max(1, commits),
        "server_cpu_ms": None
        if any(r["server_cpu"] is None for r in results)
        else 1000 * sum(r["server_cpu"] for r in results) / max(1, commits),
    }


def cpu_cells(r: dict) -> list[str]:
    server = "n/a" if r["server_cpu_ms"] is None else f"{r['server_cpu_ms']:.3f}"
    return [f"{r['client_cpu_ms']:.3f}", server]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--full-clients", default="1,8", help="client counts for the full-snapshot rows ('' for none)")
    parser.add_argument("--policy", default="gpuportal,ndif", help="comma-separated: gpuportal, ndif")
    parser.add_argument(
        "--cpu", action="store_true", help="add client and PostgreSQL CPU per operation (implies --no-record)"
    )
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    full_counts = [int(c) for c in args.full_clients.split(",") if c]
    policies = args.policy.split(",")
    headers = ["snapshot", *HEADERS] + (["client CPU ms/op", "server CPU ms/op"] if args.cpu else [])
    record_it = not (args.no_record or args.cpu or policies != ["gpuportal", "ndif"])
    runs = [("mirror", policy, clients) for policy in policies for clients in counts]
    runs += [("full", "gpuportal", clients) for clients in full_counts]

    server = setup_database("gpuportal_bench_placement")
    try:
        from bench.report import record, table

        register_cluster(nodes=100, gpus_per_node=8, gpu_size="80GiB")
        pools = create_state(max(counts + full_counts))
        rows = []
        for how, policy, clients in runs:
            r = run(policy, clients, pools, args.seconds, mirrored=how == "mirror")
            rows.append(
                [
                    how,
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
                + (cpu_cells(r) if args.cpu else [])
            )
            print(table(headers, rows[-1:]).splitlines()[-1], flush=True)
        report = table(headers, rows)
        print("\n" + report)
        if record_it:
            record(
                "placement",
                "Placement: snapshot, place, commit",
                f"`python -m bench.placement --seconds {args.seconds:g}`: 100 nodes × 8 virtual GPUs of 80 GiB, "
                f"{DEPLOYMENTS} deployments of 1 to 20 GiB of weights; each client is a process with its own "
                "connection; an operation places a replica (snapshot, `place`, commit with Events) or releases "
                "one; latency includes retries. Snapshot `mirror`: each client refreshes a ledger Mirror (only "
                "the GPUs written since it last looked); `full`: it reads every GPU, as the control plane's "
                "services do. Refused: no node could host the replica. "
                f"{args.seconds:g} s per row.\n\n" + report,
            )
    finally:
        stop(server)


if __name__ == "__main__":
    main()
