"""Fleet: one control plane against N nodes of eight GPUs each.

The control plane is the real one, as `manage.py up` runs it: the web server (granian, 16
threads), the control worker (prefork, 2), the agents' worker (8 threads), celery beat on the
product's schedule, PostgreSQL and Redis, with the product's settings (a heartbeat every
GPUPORTAL_HEARTBEAT_S, a node offline after GPUPORTAL_HEARTBEAT_TIMEOUT_S). The nodes are
simulated (bench.fleet_node): light agents, 250 to a process, each speaking the real protocol
through the agent's own gateway (registration, a heartbeat with its books every beat, its lease
in Redis, its commands on its own queue answered with a replica's reports), with no replica
process behind them. For each fleet size, on a fresh database:

- `registered`: every node registered and online, from the first simulator's start;
- `placed`: a deployment of a tiny model (`placement.spread`) scaled 0 → R through the REST API:
  the call's answer (all R rows placed and committed, their start commands sent), then every
  replica `serving` (each simulated load takes --load-s);
- over --duration seconds of steady state: heartbeats answered per second against those offered
  (N / heartbeat period), their latency, the `agents` queue's depth, and the CPU of each
  control-plane process (with its children) per node per minute and as a share of one core;
- `PostgreSQL connections`: the most the run's database had open at once (pg_stat_activity,
  sampled every second, the benchmark's own included);
- `lost node`: a node serving replicas goes silent (its beats, its lease and its commands stop,
  as a host that lost its power): from then to the node offline, and to the deployment at R
  serving replicas again elsewhere.

    python -m bench.fleet [--nodes 10,100,1000] [--duration 60] [--replicas 100] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers. Each size runs in a process of its
own (a fresh stack and database); the table lands in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from bench.fleet_node import percentile_s
from bench.portal import ROOT, Http, Portal, servers, staff_key
from gpuportal.wire.states import ENDED

NAME = "fleet"
GiB = 1024**3
# What each replica is reserved (memory.override_bytes): a 1B model's serving footprint.
REPLICA_BYTES = 4 * GiB
NODES_PER_PROCESS = 250
PROCESSES = ("web", "control", "agents", "beat")
# How long each phase may take before the run says it did not finish (and goes on).
REGISTER_TIMEOUT_S = 300
PLACE_TIMEOUT_S = 300
LOST_TIMEOUT_S = 180


@dataclass
class Result:
    nodes: int
    heartbeat_s: float
    timeout_s: float
    registered_s: float | None = None
    place_call_s: float | None = None
    place_status: int | None = None
    placed: int = 0
    serving_s: float | None = None
    serving: int = 0
    window_s: float = 0.0
    offered_per_s: float = 0.0
    answered_per_s: float = 0.0
    failed_beats: int = 0
    beat_p50_s: float | None = None
    beat_p99_s: float | None = None
    agents_queue_max: int = 0
    agents_queue_mean: float = 0.0
    # Seconds of CPU over the window, by process (PROCESSES, then "postgres" backends of this
    # database, "redis" (the server's own figure) and "simulators" (the load generator).
    cpu_s: dict[str, float] = field(default_factory=dict)
    pg_connections_max: int = 0
    pg_connections_by_app: dict[str, int] = field(default_factory=dict)
    lost_node: str = ""
    lost_replicas: int = 0
    offline_s: float | None = None
    replaced_s: float | None = None
    notes: list[str] = field(default_factory=list)


def wait_until(predicate: Callable[[], object], timeout: float, every: float = 0.1) -> float | None:
    """Seconds until `predicate` held, or None after `timeout`."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            return None
        time.sleep(every)
    return time.monotonic() - began


def cpu_seconds(process: psutil.Process) -> float:
    """User and system CPU of a process and its children (a prefork pool, granian's worker)."""
    total = 0.0
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:  # a database backend that closed its connection meanwhile
        return 0.0
    for each in family:
        try:
            times = each.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


class Sampler:
    """Every second: this database's connections, and the depth of the `agents` and `control`
    queues in Redis."""

    def __init__(self) -> None:
        import redis
        from django.conf import settings

        self.redis = redis.Redis.from_url(settings.REDIS_URL)
        self.connections: list[int] = []
        self.by_app: dict[str, int] = {}
        self.agents_depth: list[tuple[float, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from django.db import connection

        try:
            while not self.stopping.wait(1.0):
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pid, coalesce(nullif(application_name, ''), backend_type) FROM pg_stat_activity "
                        "WHERE datname = current_database()"
                    )
                    rows = cursor.fetchall()
                self.connections.append(len(rows))
                if len(rows) >= max(self.connections):
                    counted: dict[str, int] = {}
                    for _, app in rows:
                        counted[app] = counted.get(app, 0) + 1
                    self.by_app = counted
                self.agents_depth.append((time.monotonic(), int(self.redis.llen("agents"))))
        finally:
            connection.close()

    def depth_between(self, start: float, end: float) -> list[int]:
        return [depth for at, depth in self.agents_depth if start <= at <= end]

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


def backend_pids() -> list[int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
        )
        return [pid for (pid,) in cursor.fetchall()]


def redis_cpu_s(client: object) -> float:
    info = client.info("cpu")  # type: ignore[attr-defined]
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Simulators:
    """The simulated nodes, NODES_PER_PROCESS to a process (bench.fleet_node)."""

    def __init__(self, tmp: Path, nodes: int, load_s: float, env: dict[str, str]):
        from bench.fleet_node import node_name
        from scheduling.services import node_credentials

        self.tmp = tmp
        # Each node's own credential, issued as an operator would (`gpuportal node add`): every
        # call of every simulated node is checked, as the portal's default has it.
        tokens = tmp / "node-tokens.json"
        issued = {node_name(i): node_credentials.issue(node_name(i), "bench") for i in range(nodes)}
        tokens.write_text(json.dumps(issued))
        tokens.chmod(0o600)
        self.silence_file = tmp / "silent-nodes"
        self.stats_files: list[Path] = []
        self.processes: list[subprocess.Popen] = []
        for first in range(0, nodes, NODES_PER_PROCESS):
            count = min(NODES_PER_PROCESS, nodes - first)
            stats = tmp / f"fleet-{first}.json"
            argv = [sys.executable, "-m", "bench.fleet_node", "--first", str(first), "--count", str(count),
                    "--stats", str(stats), "--silence", str(self.silence_file), "--load-s", f"{load_s:g}",
                    "--tokens", str(tokens)]  # fmt: skip
            with open(tmp / f"fleet-{first}.log", "a") as log:
                self.processes.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            self.stats_files.append(stats)

    def counters(self) -> dict:
        """The processes' counters summed."""
        total: dict = {"registered": 0, "beats": 0, "failed_beats": 0, "latency": None}
        for path in self.stats_files:
            try:
                record = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                continue
            for key in ("registered", "beats", "failed_beats"):
                total[key] += record[key]
            latency = record["latency"]
            total["latency"] = (
                latency if total["latency"] is None else [a + b for a, b in zip(total["latency"], latency, strict=True)]
            )
        return total

    def silence(self, name: str) -> None:
        self.silence_file.write_text(name + "\n")

    def cpu_s(self) -> float:
        return sum(cpu_seconds(psutil.Process(p.pid)) for p in self.processes if p.poll() is None)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def run_size(nodes: int, *, duration_s: float, replicas: int, load_s: float) -> Result:
    """One fleet size on a fresh stack and database."""
    os.environ["GPUPORTAL_MAX_REPLICAS"] = str(max(32, replicas))
    with servers("gpuportal-bench-fleet-", "gpuportal_bench_fleet") as tmp:
        from django.conf import settings

        from inference.management.commands.make_tiny_model import write_tiny_model

        result = Result(nodes, settings.GPUPORTAL_HEARTBEAT_S, settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S)
        model_dir = write_tiny_model(tmp / "tiny", size_mb=2, seed=3, log=lambda _: None).path
        with Portal(tmp, web_threads=16, control=True, beat=True, agents={}, control_pool="prefork") as portal:
            key = staff_key()
            portal.ready(key)
            sampler = Sampler()
            simulators = Simulators(tmp, nodes, load_s, {**portal.env, "GPUPORTAL_MAX_REPLICAS": str(replicas)})
            try:
                _measure(result, portal, simulators, sampler, key, model_dir, duration_s, replicas)
            finally:
                simulators.stop()
                sampler.stop()
                result.pg_connections_max = max(sampler.connections, default=0)
                result.pg_connections_by_app = sampler.by_app
    return result


def _measure(
    result: Result,
    portal: Portal,
    simulators: Simulators,
    sampler: Sampler,
    key: str,
    model_dir: Path,
    duration_s: float,
    replicas: int,
) -> None:
    import redis
    from django.conf import settings

    from scheduling.models import Node, Replica

    nodes = result.nodes
    online = Node.objects.filter(status=Node.Status.ONLINE)
    result.registered_s = wait_until(lambda: online.count() >= nodes, REGISTER_TIMEOUT_S, every=0.5)
    print(f"{nodes} nodes: registered in {result.registered_s} s", flush=True)
    if result.registered_s is None:
        # Measured all the same, against the nodes that did: how far it got is the finding.
        result.notes.append(f"only {online.count()} of {nodes} nodes online {REGISTER_TIMEOUT_S} s after they started")
    http = Http(portal.port, key)
    body = {
        "name": NAME,
        "model": {"source": str(model_dir)},
        "replicas": 0,
        "memory": {"override_bytes": REPLICA_BYTES, "max_tokens": 256},
        "placement": {"spread": True},
        # Steady for the whole run: no idle sweep puts them to sleep meanwhile.
        "sleep": {"idle_timeout_s": 86400},
    }
    code, answer = http.post("/api/deployments/", body)
    if code != 201:
        raise SystemExit(f"deploy failed: {code} {answer}")
    time.sleep(2 * result.heartbeat_s)  # every node beating at its pace before the scale

    of_it = Replica.objects.filter(deployment__name=NAME)
    began = time.monotonic()
    code, answer = http.post(f"/api/deployments/{NAME}/scale/", {"replicas": replicas})
    result.place_call_s = time.monotonic() - began
    result.place_status = code
    result.placed = of_it.exclude(node=None).exclude(state__in=ENDED).count()
    print(f"scale to {replicas}: {code} in {result.place_call_s:.2f} s, {result.placed} placed", flush=True)
    if code != 200:
        result.notes.append(f"scale answered {code}: {str(answer)[:200]}")
        return
    serving = of_it.filter(state=Replica.State.SERVING)
    waited = wait_until(lambda: serving.count() >= replicas, PLACE_TIMEOUT_S, every=0.1)
    result.serving = serving.count()
    result.serving_s = None if waited is None else time.monotonic() - began
    print(f"serving: {result.serving} after {result.serving_s} s", flush=True)
    if waited is None:
        result.notes.append(f"{result.serving} of {replicas} serving after {PLACE_TIMEOUT_S} s")

    # Steady state: what placement set off (host-cache balances, arena grants) has settled.
    client = redis.Redis.from_url(settings.REDIS_URL)
    wait_until(lambda: client.llen("control") == 0 and client.llen("agents") < nodes / 10, 60, every=0.5)
    time.sleep(result.heartbeat_s)
    _steady_window(result, portal, simulators, sampler, client, duration_s)
    _lose_a_node(result, simulators, replicas)


def _steady_window(
    result: Result, portal: Portal, simulators: Simulators, sampler: Sampler, client: object, duration_s: float
) -> None:
    procs = {name: psutil.Process(portal.processes[name].pid) for name in PROCESSES}
    pg = [psutil.Process(pid) for pid in backend_pids() if psutil.pid_exists(pid)]
    before = {name: cpu_seconds(p) for name, p in procs.items()}
    pg_before = {p.pid: cpu_seconds(p) for p in pg}
    redis_before, sim_before = redis_cpu_s(client), simulators.cpu_s()
    counted_before = simulators.counters()
    start = time.monotonic()
    time.sleep(duration_s)
    end = time.monotonic()
    counted_after = simulators.counters()
    result.window_s = end - start
    result.cpu_s = {name: cpu_seconds(p) - before[name] for name, p in procs.items()}
    # The backends open all through the window (a connection closed meanwhile took its figure with it).
    result.cpu_s["postgres"] = sum(
        max(0.0, cpu_seconds(p) - pg_before[p.pid]) for p in pg if p.is_running() and pg_before[p.pid]
    )
    result.cpu_s["redis"] = redis_cpu_s(client) - redis_before
    result.cpu_s["simulators"] = simulators.cpu_s() - sim_before
    beats = counted_after["beats"] - counted_before["beats"]
    result.offered_per_s = result.nodes / result.heartbeat_s
    result.answered_per_s = beats / result.window_s
    result.failed_beats = counted_after["failed_beats"] - counted_before["failed_beats"]
    if counted_after["latency"] and counted_before["latency"]:
        window = [a - b for a, b in zip(counted_after["latency"], counted_before["latency"], strict=True)]
        result.beat_p50_s, result.beat_p99_s = percentile_s(window, 0.5), percentile_s(window, 0.99)
    depths = sampler.depth_between(start, end)
    result.agents_queue_max = max(depths, default=0)
    result.agents_queue_mean = sum(depths) / len(depths) if depths else 0.0
    print(
        f"steady {result.window_s:.0f} s: {result.answered_per_s:.1f}/{result.offered_per_s:.1f} beats/s, "
        f"cpu {json.dumps({k: round(v, 1) for k, v in result.cpu_s.items()})}",
        flush=True,
    )


def _lose_a_node(result: Result, simulators: Simulators, replicas: int) -> None:
    from django.db.models import Count

    from scheduling.models import Node, Replica

    busiest = (
        Replica.objects.filter(deployment__name=NAME, state=Replica.State.SERVING)
        .values("node__name")
        .annotate(n=Count("id"))
        .order_by("-n", "node__name")
        .first()
    )
    if busiest is None:
        result.notes.append("no node serves a replica: no node lost")
        return
    result.lost_node, result.lost_replicas = busiest["node__name"], busiest["n"]
    simulators.silence(result.lost_node)
    began = time.monotonic()
    result.offline_s = wait_until(
        lambda: Node.objects.filter(name=result.lost_node, status=Node.Status.OFFLINE).exists(), LOST_TIMEOUT_S
    )
    elsewhere = Replica.objects.filter(deployment__name=NAME, state=Replica.State.SERVING).exclude(
        node__name=result.lost_node
    )
    if result.offline_s is not None and wait_until(lambda: elsewhere.count() >= replicas, LOST_TIMEOUT_S):
        result.replaced_s = time.monotonic() - began
    print(f"lost {result.lost_node}: offline after {result.offline_s} s, replaced after {result.replaced_s} s")


# -- the table ------------------------------------------------------------------------------------


def _s(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "> 30 s" if math.isinf(value) else f"{value * 1000:.0f} ms"


def rows(results: list[Result]) -> tuple[list[str], list[list[object]]]:
    headers = ["", *[f"{r.nodes} nodes ({8 * r.nodes} GPUs)" for r in results]]

    def per_node_minute(r: Result, name: str) -> str:
        if not r.window_s or name not in r.cpu_s:
            return "-"
        share = r.cpu_s[name] / r.window_s
        return f"{1000 * r.cpu_s[name] / r.nodes / (r.window_s / 60):.0f} ms ({100 * share:.0f} % of a core)"

    def serving(r: Result) -> str:
        return _s(r.serving_s) if r.serving_s is not None else f"{r.serving} serving"

    table = [
        ["nodes registered after", *[_s(r.registered_s) for r in results]],
        ["heartbeats answered / offered per s",
         *[f"{r.answered_per_s:.1f} / {r.offered_per_s:.1f}" if r.window_s else "-" for r in results]],
        ["heartbeat p50 / p99", *[f"{_ms(r.beat_p50_s)} / {_ms(r.beat_p99_s)}" for r in results]],
        ["heartbeats failed in the window", *[r.failed_beats if r.window_s else "-" for r in results]],
        ["`agents` queue depth, mean / max",
         *[f"{r.agents_queue_mean:.0f} / {r.agents_queue_max}" if r.window_s else "-" for r in results]],
        *[
            [f"CPU of {name} per node per minute", *[per_node_minute(r, name) for r in results]]
            for name in (*PROCESSES, "postgres", "redis", "simulators")
        ],
        ["PostgreSQL connections at most", *[r.pg_connections_max for r in results]],
        ["scale 0 → R: placed (the API call)",
         *[f"{_s(r.place_call_s, 2)} ({r.placed} placed)" if r.place_call_s else "-" for r in results]],
        ["scale 0 → R: all serving", *[serving(r) for r in results]],
        ["lost node: offline after", *[_s(r.offline_s) for r in results]],
        ["lost node: its replicas serving elsewhere after", *[_s(r.replaced_s) for r in results]],
    ]  # fmt: skip
    return headers, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="10,100,1000", help="fleet sizes, comma-separated (default 10,100,1000)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of steady state measured per size")
    parser.add_argument("--replicas", type=int, default=100, help="replicas the deployment is scaled to (100)")
    parser.add_argument("--load-s", type=float, default=1.0, help="how long a simulated replica takes to load (1)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # one size, its figures to this file
    args = parser.parse_args()
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--nodes takes whole numbers separated by commas, not {args.nodes!r}")
    if not sizes or any(n < 1 for n in sizes):
        parser.error("--nodes needs at least one size, each at least 1")
    if args.duration <= 0 or args.replicas < 1 or args.load_s < 0:
        parser.error("--duration must be > 0, --replicas >= 1 and --load-s >= 0")

    if args.result is not None:
        (size,) = sizes
        result = run_size(size, duration_s=args.duration, replicas=args.replicas, load_s=args.load_s)
        args.result.write_text(json.dumps(asdict(result)))
        return

    results = []
    for size in sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            argv = [sys.executable, "-m", "bench.fleet", "--nodes", str(size), "--duration", f"{args.duration:g}",
                    "--replicas", str(args.replicas), "--load-s", f"{args.load_s:g}", "--result", out.name]  # fmt: skip
            code = subprocess.run(argv, cwd=ROOT).returncode
            text = Path(out.name).read_text()
        if code != 0 or not text:
            raise SystemExit(f"the run of {size} nodes failed ({code})")
        results.append(Result(**json.loads(text)))
    report(results, args)


def report(results: list[Result], args: argparse.Namespace) -> None:
    from bench.report import record, table

    headers, body = rows(results)
    text = table(headers, body)
    notes = [f"{r.nodes} nodes: {note}" for r in results for note in r.notes]
    connections = "; ".join(
        f"{r.nodes} nodes: " + ", ".join(f"{app} {n}" for app, n in sorted(r.pg_connections_by_app.items()))
        for r in results
    )
    detail = "\n".join([f"PostgreSQL connections at their most, by application: {connections}.", *notes])
    print("\n" + text + "\n\n" + detail)
    if args.no_record:
        return
    first = results[0]
    record(
        "fleet",
        "Fleet: one control plane against 10, 100 and 1,000 nodes of eight GPUs",
        f"`python -m bench.fleet --nodes {args.nodes} --duration {args.duration:g} --replicas {args.replicas} "
        f"--load-s {args.load_s:g}` at commit {_commit()}: the real web, control worker (prefork, 2), agents' "
        f"worker (8 threads), beat, PostgreSQL and Redis, against simulated nodes of 8 × 80 GiB virtual GPUs "
        f"(bench.fleet_node: the agent's own gateway, lease and command queues, no replica process) heartbeating "
        f"every {first.heartbeat_s:g} s (offline after {first.timeout_s:g} s). R = {args.replicas}, a tiny model "
        f"reserved {REPLICA_BYTES // GiB} GiB per replica with `placement.spread`; a simulated load takes "
        f"{args.load_s:g} s. CPU is user + system over the steady window of {args.duration:g} s, per node per "
        "minute and as a share of one core; `postgres` is the backends of the run's database, `redis` the whole "
        "server (shared with other work when REDIS_URL is set), `simulators` the load generator on the same "
        "two cores.\n\n" + text + "\n\n" + detail + "\n\n" + reading(results),
    )


def reading(results: list[Result]) -> str:
    """Where it stops scaling, read off the figures: the first size whose heartbeats are not all
    answered, and the process that spends the most CPU there."""
    lines = []
    for r in results:
        if not r.window_s:
            continue
        busiest = max(PROCESSES, key=lambda name: r.cpu_s.get(name, 0.0))
        share = r.cpu_s.get(busiest, 0.0) / r.window_s
        kept_up = r.answered_per_s >= 0.95 * r.offered_per_s
        lines.append(
            f"At {r.nodes} nodes the control plane {'kept up with' if kept_up else 'fell behind'} its heartbeats "
            f"({r.answered_per_s:.0f} of {r.offered_per_s:.0f} a second answered); its busiest process was "
            f"{busiest}, at {100 * share:.0f} % of a core."
        )
    lines.append("Where the time goes, and why it falls behind: docs/fleet.md.")
    return "\n".join(lines)


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
