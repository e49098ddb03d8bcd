"""Placement throughput from concurrent clients: through the control plane's services, as a deploy or
scale through the REST API runs it, and through the ledger alone.

100 nodes × 8 virtual GPUs of 80 GiB (state only: no processes). Each client is its own OS
process with its own PostgreSQL connection, as web and worker processes are.

**Services** (the path the product runs). Each call is a top-level service call
in its own transaction, as the API view makes it: `deployments.scale(name, n ± 1)` on one of the
client's deployments, or (one call in ten) `deployments.create` of a small deployment of its own
(one replica; its model's sizes given, as a node would have read them) or `delete` of one. 40
deployments of 1 to 20 GiB of weights fill about half the cluster at the start, shared among the
clients. What the services send after a commit (Celery tasks to node agents, the Redis call that
ends a deleted deployment's requests) is recorded in the client, not sent: nothing leaves the
process. Two ways to snapshot, side by side:
- `incremental`: each decision reads the process's ledger Mirror, refreshed with only the GPUs
  whose view changed since its last read (a GPU row written, or a node, replica or deployment row
  a view is built from): `ledger.snapshot()`, what the services use;
- `full`: each decision reads every GPU afresh (`ledger.read()`), as the services did before
  the Mirror (the rest of the call is today's).
After each row, no GPU may be over-committed: available = total − reserved ≥ 0 on every GPU.

**Ledger loop**: snapshot → `place` → compare-and-swap commit, or a release, with
nothing of the services around it (no deployment lock, replica rows or Events beyond the
commit's own). Each client places a new replica of a random deployment or releases one it placed,
keeping the cluster about half full; the policies `gpuportal` (measured/estimated need, best fit)
and `ndif` (size × 3, random fit). Snapshots from a ledger `Mirror` (`mirror` rows) or read afresh
(`full` rows, `gpuportal` only, at `--full-clients`).

    python -m bench.placement [--seconds 3] [--service-clients 1,8] [--clients 1,4,8,16]
                              [--full-clients 1,8] [--policy gpuportal,ndif] [--cpu] [--no-record]
                              [--section placement]
    python -m bench.placement --profile incremental   # one services client under cProfile

`--cpu` adds the CPU each call cost, in the client processes and in their PostgreSQL backends
(read from /proc, so only for a server on this machine, such as the embedded one).

Uses DATABASE_URL when set (in a fresh database `gpuportal_bench_placement`), else an embedded
PostgreSQL.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bench.common import effects_kept, register_cluster, setup_database, stop

GiB = 1024**3
DEPLOYMENTS = 40
POOL_PER_CLIENT = 400
CLUSTER_BYTES = 100 * 8 * 80 * GiB
SERVICE_HEADERS = [
    "how",
    "clients",
    "commits/s",
    "p50 ms",
    "p99 ms",
    "conflicts/commit",
    "refused",
    "scaled up",
    "scaled down",
    "created",
    "deleted",
    "over-committed GPUs",
    "scales per batch",
]
LEDGER_HEADERS = [
    "snapshot",
    "policy",
    "clients",
    "commits/s",
    "p50 ms",
    "p99 ms",
    "conflicts/commit",
    "refused",
    "placed",
    "released",
    "over-committed GPUs",
]
CPU_HEADERS = ["client CPU ms/call", "server CPU ms/call"]


class Loop(Protocol):
    """One client's calls, one per `step()`; what it measured, for the row."""

    latencies: list[float]

    def step(self) -> None: ...

    def tally(self) -> dict: ...


# -- the services: what a deploy or scale through the REST API runs ---------------------------------

SERVICE_DEPLOYMENTS = 40
# Of every 100 calls, how many create or delete a small deployment rather than scale one.
CHURN_PERCENT = 10
# How the clients run: a process each (incremental or full snapshots), or a thread each of one
# process as the web serves them (scale calls committed together, or each alone).
SERVICE_WAYS = ("incremental", "full", "threads", "threads-alone")


@dataclass(frozen=True)
class Model:
    """A deployment the services benchmark scales: its sizes and its replicas at the start."""

    name: str
    weights: int
    estimate: int
    base: int


def service_models() -> list[Model]:
    """Deployments of 1 to 20 GiB of weights, whose replicas fill about half of the cluster."""
    rng = random.Random(11)
    share = CLUSTER_BYTES // 2 // SERVICE_DEPLOYMENTS
    models = []
    for n in range(SERVICE_DEPLOYMENTS):
        weights = int(rng.uniform(1, 20) * GiB)
        estimate = int(weights * 1.3) + GiB  # KV cache and activations beside the weights
        models.append(Model(f"svc-{n:02d}", weights, estimate, max(1, share // (estimate + GiB))))
    return models


def spec_of(model: Model, replicas: int) -> tuple:
    from scheduling.services.deployments import DeploymentSpec, ModelFacts

    spec = DeploymentSpec(name=model.name, source=f"/srv/models/{model.name}", replicas=replicas)
    return spec, ModelFacts(weight_bytes=model.weights, estimate_bytes=model.estimate)


def reset_services(models: list[Model]) -> None:
    """No deployment, replica or reservation; then the models' deployments, each with its
    starting replicas, created through the services (placed as a deploy through the API is)."""
    from django.db import connection, transaction

    from scheduling.services import deployments

    with transaction.atomic(), connection.cursor() as cursor:
        # Django's foreign keys are checked at commit, so the order of these does not matter.
        cursor.execute("UPDATE scheduling_gpu SET wake_lock_holder_id = NULL, available_bytes = total_bytes")
        for table in (
            "occupant",
            "preemptionintent",
            "failoverlease",
            "replica",
            "deploymentobserved",
            "deployment",
            "event",
        ):
            cursor.execute(f"DELETE FROM scheduling_{table}")
    with effects_kept():
        for model in models:
            spec, facts = spec_of(model, model.base)
            deployments.create(spec, facts=facts)


def conflicts_counted() -> float:
    """The compare-and-swap conflicts this process's commits met so far (the ledger's metric, read
    from it alone: collecting the whole registry would cost the call more than it measures)."""
    from scheduling.metrics import CAS_CONFLICTS

    return next(s.value for s in CAS_CONFLICTS.collect()[0].samples if s.name.endswith("_total"))


def use_full_snapshots() -> None:
    """In this process, every decision reads every GPU afresh: the services' path before the
    incremental snapshot (the `full` rows)."""
    from scheduling import ledger

    ledger.snapshot = lambda gpu_ids=None: ledger.read(gpu_ids)


class ServiceClient:
    """One API client: each step is one top-level service call in its own transaction. It scales
    one of its deployments up or down by one, or (CHURN_PERCENT of calls) creates or deletes a
    small deployment of its own. It alone changes its deployments, so it knows their counts."""

    def __init__(self, n: int, models: list[Model]) -> None:
        from scheduling import ledger

        self.n = n
        self.rng = random.Random(2000 + n)
        self.models = {m.name: m for m in models}
        self.names = sorted(self.models)
        self.replicas = {m.name: m.base for m in models}
        self.churned: list[str] = []  # its small deployments, oldest first
        self.made = 0
        self.latencies: list[float] = []
        self.counts = {"scaled up": 0, "scaled down": 0, "created": 0, "deleted": 0}
        self.conflicts = self.refused = self.gave_up = 0
        ledger.snapshot()  # the first read (a Mirror's full one) happens before the clock starts

    def step(self) -> None:
        from scheduling.ledger import CasConflict
        from scheduling.services.errors import CannotPlace

        began = time.perf_counter()
        conflicts_before = conflicts_counted()
        try:
            kind = self._churn() if self.rng.randrange(100) < CHURN_PERCENT else self._scale()
        except CannotPlace:
            self.refused += 1
            return
        except CasConflict:
            self.gave_up += 1
            return
        finally:
            self.conflicts += int(conflicts_counted() - conflicts_before)
        self.latencies.append(time.perf_counter() - began)
        self.counts[kind] += 1

    def _scale(self) -> str:
        from scheduling.services import deployments

        name = self.rng.choice(self.names)
        now, base = self.replicas[name], self.models[name].base
        grow = now == 0 or (now < 2 * base and self.rng.random() < 0.5)
        deployments.scale(name, now + 1 if grow else now - 1)
        self.replicas[name] = now + 1 if grow else now - 1
        return "scaled up" if grow else "scaled down"

    def _churn(self) -> str:
        from scheduling.services import deployments

        if len(self.churned) < 2 or (len(self.churned) < 4 and self.rng.random() < 0.5):
            self.made += 1
            model = Model(f"c{self.n}-{self.made}", 2 * GiB, 4 * GiB, 1)
            spec, facts = spec_of(model, 1)
            deployments.create(spec, facts=facts)  # a refused one (409) left nothing behind
            self.churned.append(model.name)
            return "created"
        deployments.delete(self.churned.pop(0))
        return "deleted"

    def tally(self) -> dict:
        return {"conflicts": self.conflicts, "refused": self.refused, "gave_up": self.gave_up, **self.counts}


# -- the ledger loop: snapshot, place, commit, and nothing else -------------------------------------


def create_state(clients: int) -> list[list[tuple[str, str, int, int]]]:
    """Deployments of spread sizes, and a pool of replica rows per client:
    (replica id, deployment, weight bytes, estimate bytes)."""
    from scheduling.models import Deployment, DeploymentObserved, Replica

    rng = random.Random(7)
    deployments = []
    for n in range(DEPLOYMENTS):
        weights = int(rng.uniform(1, 20) * GiB)
        estimate = int(weights * 1.3) + GiB  # KV cache and activations beside the weights
        deployment = Deployment.objects.create(name=f"model-{n:02d}", model_source=f"/srv/models/{n}", min_runtime_s=0)
        # Every deployment has its observed record (what the portal measured or decided about it).
        DeploymentObserved.objects.create(deployment=deployment, weight_bytes=weights, memory_estimate_bytes=estimate)
        deployments.append(deployment)
    facts = {d.pk: (d.observed.weight_bytes, d.observed.memory_estimate_bytes) for d in deployments}
    pools = []
    for _ in range(clients):
        rows = [Replica(deployment=rng.choice(deployments)) for _ in range(POOL_PER_CLIENT)]
        Replica.objects.bulk_create(rows)
        pools.append([(r.id, r.deployment.name, *facts[r.deployment_id]) for r in rows])
    return pools


def reset_reservations() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE scheduling_occupant, scheduling_event")
        cursor.execute("UPDATE scheduling_gpu SET available_bytes = total_bytes")


class Client:
    """One client's loop, one operation per `step()`: place a replica of its pool, or release
    one it placed. Shared by the benchmark's processes and by profiling."""

    def __init__(self, n: int, policy: str, pool: list[tuple[str, str, int, int]], *, mirrored: bool = True) -> None:
        from scheduling import ledger

        self.policy = policy
        self.pool = {p[0]: p for p in pool}
        self.rng = random.Random(1000 + n)
        if not mirrored:
            use_full_snapshots()
        ledger.snapshot()  # the first read (a Mirror's full one) happens before the clock starts
        self.free = list(pool)
        self.placed: list[str] = []
        # Where each placed replica was put: it is released from there, as a service releases a
        # replica from the node the database says it is on. Only this client places its pool's
        # replicas; others can only evict them, so it is found there or nowhere.
        self.where: dict[str, tuple[int, ...]] = {}
        self.latencies: list[float] = []
        self.conflicts = self.refused = self.placements = self.releases = self.gave_up = 0

    def step(self) -> None:
        from scheduling.ledger import CasConflict

        grow = not self.placed or (self.free and self.rng.random() < 0.5)
        began = time.perf_counter()
        try:
            result = self._place() if grow else self._release()
        except CasConflict:
            self.gave_up += 1
            return
        if result is None:
            return
        self.latencies.append(time.perf_counter() - began)
        self.conflicts += result.attempts - 1

    def _place(self):
        from gpuportal.wire import memory
        from scheduling import ledger
        from scheduling.core.placement import CantAccommodate, PlacementRequest, place
        from scheduling.ledger import CasConflict

        rng = self.rng
        entry = self.free.pop(rng.randrange(len(self.free)))
        replica_id, deployment, weights, estimate = entry
        need = memory.need_for(self.policy, memory.NeedInputs(weight_bytes=weights, estimate_bytes=estimate)).bytes
        request = PlacementRequest(deployment, replica_id, need)

        def decide(snap):
            result = place(snap, request, policy=self.policy, rng=rng)
            return None if isinstance(result, CantAccommodate) else result.to_plan(snap)

        try:
            result = ledger.commit_with_retry(decide)
        except CasConflict:
            self.free.append(entry)
            raise
        if result is None:
            self.refused += 1
            self.free.append(entry)
            return None
        self.placements += 1
        self.placed.append(replica_id)
        self.where[replica_id] = tuple(r.gpu_id for r in result.plan.reservations if r.replica_id == replica_id)
        return result

    def _release(self):
        from scheduling import ledger
        from scheduling.core.state import Plan, Release
        from scheduling.ledger import CasConflict

        replica_id = self.placed.pop(self.rng.randrange(len(self.placed)))
        gpu_ids = self.where[replica_id]

        def release(snap):
            releases = [
                Release(gpu_id, replica_id)
                for gpu_id in gpu_ids
                if gpu_id in snap.gpus and any(o.replica_id == replica_id for o in snap.gpus[gpu_id].occupants)
            ]
            return Plan.against(snap, "bench release", releases=releases) if releases else None

        try:
            result = ledger.commit_with_retry(release)
        except CasConflict:
            self.placed.append(replica_id)
            raise
        self.releases += 1
        del self.where[replica_id]
        self.free.append(self.pool[replica_id])
        return result  # None: evicted by someone else's placement meanwhile, nothing to release

    def tally(self) -> dict:
        return {
            "conflicts": self.conflicts,
            "refused": self.refused,
            "gave_up": self.gave_up,
            "placed": self.placements,
            "released": self.releases,
        }


# -- running clients -------------------------------------------------------------------------------


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


def client(make: Callable[[], Loop], seconds: float, start: mp.Barrier, out: mp.Queue) -> None:
    from django.db import connection

    with effects_kept() as sent:
        loop = make()
        start.wait()
        server_before, client_before = backend_cpu_s(), time.process_time()
        grouped = scale_batches()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            loop.step()
        client_cpu = time.process_time() - client_before
        server_after = backend_cpu_s()
        batches, scales = (after - before for after, before in zip(scale_batches(), grouped, strict=True))
    server_cpu = None if server_before is None or server_after is None else server_after - server_before
    connection.close()
    out.put(
        {
            "latencies": loop.latencies,
            "client_cpu": client_cpu,
            "server_cpu": server_cpu,
            "sent": len(sent),
            "batches": batches,
            "scales": scales,
            **loop.tally(),
        }
    )


def scale_batches() -> tuple[int, int]:
    """How many batches this process's scale calls ran in so far, and how many calls they held."""
    from scheduling.services import scaling

    return scaling._GROUP.batches, scaling._GROUP.items


def threads_client(makers: list[Callable[[], Loop]], seconds: float, start: mp.Barrier, out: mp.Queue) -> None:
    """Each maker's loop on a thread of this one process, as the web serves API calls (granian's
    threads in one process): their scale calls can commit together (scheduling.group_commit)."""
    import threading

    from django.db import connection

    loops: list[Loop | None] = [None] * len(makers)
    cpu: list[float | None] = [None] * len(makers)
    ready = threading.Barrier(len(makers) + 1)
    go = threading.Event()

    def serve(n: int) -> None:
        loops[n] = loop = makers[n]()
        ready.wait()
        go.wait()
        before = backend_cpu_s()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            loop.step()
        after = backend_cpu_s()
        cpu[n] = None if before is None or after is None else after - before
        connection.close()

    with effects_kept() as sent:
        threads = [threading.Thread(target=serve, args=(n,)) for n in range(len(makers))]
        for thread in threads:
            thread.start()
        ready.wait()
        start.wait()
        client_before = time.process_time()
        grouped = scale_batches()
        go.set()
        for thread in threads:
            thread.join()
        client_cpu = time.process_time() - client_before
        batches, scales = (after - before for after, before in zip(scale_batches(), grouped, strict=True))
    tallies = [loop.tally() for loop in loops if loop is not None]
    out.put(
        {
            "latencies": [x for loop in loops if loop is not None for x in loop.latencies],
            "client_cpu": client_cpu,
            "server_cpu": None if any(c is None for c in cpu) else sum(cpu),  # type: ignore[misc]
            "sent": len(sent),
            "batches": batches,
            "scales": scales,
            **{key: sum(t[key] for t in tallies) for key in tallies[0]},
        }
    )


def run(makers: list[Callable[[], Loop]], seconds: float, *, threads: bool = False) -> dict:
    """Each maker's loop in a process of its own (`threads`: on a thread each of one process),
    started together; the row's figures."""
    from django.db import connections

    connections.close_all()  # children must not share the parent's connection across fork
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    if threads:
        start = ctx.Barrier(2)
        procs = [ctx.Process(target=threads_client, args=(makers, seconds, start, out))]
    else:
        start = ctx.Barrier(len(makers) + 1)
        procs = [ctx.Process(target=client, args=(make, seconds, start, out)) for make in makers]
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
    totals = {key: sum(r[key] for r in results) for key in results[0] if isinstance(results[0][key], int)}
    return {
        **totals,
        "commits_per_s": commits / elapsed,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(commits - 1, int(0.99 * commits))] if latencies else float("nan"),
        "conflicts_per_commit": totals["conflicts"] / max(1, commits),
        # CPU per call (ms), client processes and their PostgreSQL backends, whatever the wall
        # clock: on a shared or oversubscribed machine this is the steadier figure.
        "client_cpu_ms": 1000 * sum(r["client_cpu"] for r in results) / max(1, commits),
        "server_cpu_ms": None
        if any(r["server_cpu"] is None for r in results)
        else 1000 * sum(r["server_cpu"] for r in results) / max(1, commits),
        "over_committed": over_committed_gpus(),
    }


def over_committed_gpus() -> int:
    """GPUs whose books do not balance: available ≠ total − reserved, or reserved > total."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*) FROM scheduling_gpu g
            LEFT JOIN (SELECT gpu_id, SUM(reserved_bytes) AS reserved FROM scheduling_occupant GROUP BY gpu_id) o
                ON o.gpu_id = g.id
            WHERE g.available_bytes <> g.total_bytes - COALESCE(o.reserved, 0)
               OR COALESCE(o.reserved, 0) > g.total_bytes
            """
        )
        return cursor.fetchone()[0]


def service_row(how: str, clients: int, models: list[Model], seconds: float) -> dict:
    """`how`: `incremental` and `full`, a process per client; `threads`, a thread per client in
    one process, their scale calls committed together; `threads-alone`, the same threads with
    GPUPORTAL_SCALE_TOGETHER off (each call its own transaction)."""
    from django.conf import settings

    reset_services(models)
    shares = [models[n::clients] for n in range(clients)]

    def maker(n: int) -> Callable[[], Loop]:
        def make() -> Loop:
            if how == "full":
                use_full_snapshots()
            return ServiceClient(n, shares[n])

        return make

    settings.GPUPORTAL_SCALE_TOGETHER = how != "threads-alone"
    try:
        return run([maker(n) for n in range(clients)], seconds, threads=how.startswith("threads"))
    finally:
        settings.GPUPORTAL_SCALE_TOGETHER = True


def ledger_row(how: str, policy: str, clients: int, pools: list, seconds: float) -> dict:
    reset_reservations()

    def maker(n: int) -> Callable[[], Loop]:
        return lambda: Client(n, policy, pools[n], mirrored=how == "mirror")

    return run([maker(n) for n in range(clients)], seconds)


def cpu_cells(r: dict) -> list[str]:
    server = "n/a" if r["server_cpu_ms"] is None else f"{r['server_cpu_ms']:.3f}"
    return [f"{r['client_cpu_ms']:.3f}", server]


def figures(r: dict) -> list[str]:
    return [f"{r['commits_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['conflicts_per_commit']:.3f}"]


def profile(how: str, seconds: float) -> None:
    """One services client in this process under cProfile: where a call's time goes."""
    models = service_models()
    reset_services(models)
    with effects_kept():
        if how == "full":
            use_full_snapshots()
        loop = ServiceClient(0, models[:5])
        profiler = cProfile.Profile()
        deadline = time.perf_counter() + seconds
        profiler.enable()
        while time.perf_counter() < deadline:
            loop.step()
        profiler.disable()
    print(f"{len(loop.latencies)} calls, {loop.tally()}")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--service-clients", default="1,8", help="client counts for the services rows ('' for none)")
    parser.add_argument("--clients", default="1,4,8,16", help="client counts for the ledger loop's mirror rows")
    parser.add_argument("--full-clients", default="1,8", help="client counts for the ledger loop's full rows")
    parser.add_argument("--policy", default="gpuportal,ndif", help="ledger loop, comma-separated: gpuportal, ndif")
    parser.add_argument("--cpu", action="store_true", help="add client and PostgreSQL CPU per call")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument(
        "--section",
        default="placement",
        help="the BENCHMARKS.md section the run records (bench/device_run.sh: placement-device, a lent machine's)",
    )
    parser.add_argument("--profile", choices=["incremental", "full"], help="profile one services client instead")
    return parser.parse_args()


def counts(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def main() -> None:
    args = parse_args()
    policies = args.policy.split(",")
    service_counts, ledger_counts, full_counts = map(counts, (args.service_clients, args.clients, args.full_clients))
    record_it = not (
        args.no_record or args.profile or policies != ["gpuportal", "ndif"] or not service_counts or not ledger_counts
    )
    extra = CPU_HEADERS if args.cpu else []

    server = setup_database("gpuportal_bench_placement")
    try:
        from bench.report import table

        register_cluster(nodes=100, gpus_per_node=8, gpu_size="80GiB")
        if args.profile:
            profile(args.profile, args.seconds)
            return
        ledger_rows = []
        if ledger_counts or full_counts:
            pools = create_state(max(ledger_counts + full_counts))
            runs = [("mirror", policy, n) for policy in policies for n in ledger_counts]
            runs += [("full", "gpuportal", n) for n in full_counts]
            for how, policy, n in runs:
                r = ledger_row(how, policy, n, pools, args.seconds)
                cells = [how, policy, n, *figures(r), r["refused"], r["placed"], r["released"], r["over_committed"]]
                ledger_rows.append(cells + (cpu_cells(r) if args.cpu else []))
                print(table(LEDGER_HEADERS + extra, ledger_rows[-1:]).splitlines()[-1], flush=True)
        service_rows = []
        models = service_models()
        for n in service_counts:
            for how in SERVICE_WAYS:
                r = service_row(how, n, models, args.seconds)
                cells = [how, n, *figures(r), r["refused"], *(r[k] for k in ("scaled up", "scaled down"))]
                per_batch = f"{r['scales'] / r['batches']:.1f}" if r["batches"] else "-"
                cells += [r["created"], r["deleted"], r["over_committed"], per_batch]
                service_rows.append(cells + (cpu_cells(r) if args.cpu else []))
                print(table(SERVICE_HEADERS + extra, service_rows[-1:]).splitlines()[-1], flush=True)
        report(args, service_rows, ledger_rows, extra, record_it)
    finally:
        stop(server)


def report(args: argparse.Namespace, service_rows: list, ledger_rows: list, extra: list[str], record_it: bool) -> None:
    from bench.report import record, table

    services = table(SERVICE_HEADERS + extra, service_rows) if service_rows else ""
    ledger = table(LEDGER_HEADERS + extra, ledger_rows) if ledger_rows else ""
    print("\n" + services + "\n\n" + ledger)
    if not record_it:
        return
    elsewhere = "" if args.section == "placement" else f" ({args.section})"
    options = f"--seconds {args.seconds:g}{' --cpu' if args.cpu else ''}{elsewhere and ' --section ' + args.section}"
    record(
        args.section,
        f"Placement: through the services, and the ledger loop{elsewhere}",
        f"`python -m bench.placement {options}`: 100 nodes × 8 "
        "virtual GPUs of 80 GiB; each client has its own connection; latency includes retries; "
        f"{args.seconds:g} s per row; over-committed GPUs are counted after each row.\n\n"
        "**Services**, the path a deploy or scale through the REST API runs: each call is "
        f"`deployments.scale(name, n ± 1)` on one of {SERVICE_DEPLOYMENTS} deployments (1 to 20 GiB of weights, "
        f"about half the cluster at the start), or ({CHURN_PERCENT} % of calls) `create` or `delete` of a one-replica "
        "deployment; the tasks a call sends after its commit are built and recorded, not sent. Snapshot "
        "`incremental`: each client a process, deciding on its ledger Mirror, refreshed with what was written "
        "since its last read (what the services use); `full`: the same with every GPU read afresh for each "
        "decision (the services' snapshot before the Mirror). `threads`: each client a thread of one process, as "
        "the web serves API calls, scale calls that arrive together committed together (one transaction, one "
        "placement pass, one ledger commit, each kind of row in one statement); `threads-alone`: the same "
        "threads with GPUPORTAL_SCALE_TOGETHER off, each call its own transaction. Scales per batch: scale "
        "calls per transaction. Refused: no room (409).\n\n" + services + "\n\n"
        "**Ledger loop**: snapshot, `place`, compare-and-swap commit (or a release), nothing of the services "
        "around it; 40 deployments of 1 to 20 GiB, about half full. Snapshot `mirror`: a ledger Mirror; "
        "`full`: every GPU read afresh.\n\n" + ledger,
    )


if __name__ == "__main__":
    main()
