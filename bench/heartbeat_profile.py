"""Heartbeat cost on the control plane: what one node's beat costs the agents' worker, measured
in one process, without the rest of the fleet's noise.

A fleet of simulated nodes (bench.fleet_node.SimulatedNode, 8 virtual GPUs each) is set up in a
database of its own through the real path: each node's credential issued as `gpuportal node add`
does, each registered through its own gateway (inference.gateway.RemoteControl), a deployment of
R replicas (`placement.spread`, 4 GiB each, as bench.fleet's) placed by `scaling.scale` as the
API's scale is, and each replica's start carried out by its node with the reports a process
gives, until nothing is left to send. The broker is the one thing stood in for: an agent's call is
applied at once by the task the agents' worker runs (scheduling.tasks.agent_call), a node's
command handed to its simulated node, a control task run in this process. Every replica is then
aged past the longest grace (a fleet that has run a while), and every node beats once.

Then, for each kind of beat, the payload the agent sends (encoded as on the wire, with its
credential) is applied by scheduling.tasks.agent_call in a loop:

- `idle`: a node that runs nothing (most of a large fleet: its quiet beat);
- `hosting (simulated)`: a node serving one replica, as bench.fleet_node beats (books, running,
  processes, arenas);
- `hosting (agent)`: the same node as inference.agent.NodeAgent beats, with each process's host
  RAM and the deep sleepers' copies it holds (none) as well (left out where the control plane
  under test does not take them).

Each is measured for CPU per beat of this process (time.process_time) and of its PostgreSQL
backend, wall time, SQL statements and Redis round trips per beat, then profiled (cProfile) for
where the time goes.

    python -m bench.heartbeat_profile [--nodes 1000] [--replicas 100] [--beats 2000] [--no-record]
        [--json FILE] [--beside LABEL=FILE ...]

--json keeps this run's figures; --beside puts another run's (another commit's) beside this one's
in the table. Uses DATABASE_URL (a fresh database, --database) and REDIS_URL when set, else an
embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import setup_database, stop
from bench.fleet import REPLICA_BYTES
from bench.fleet_node import SimulatedNode, node_name

GiB = 1024**3
NAME = "fleet"
# A serving replica's process holds this much host RAM beside its arena (its PSS).
HOST_BYTES = 3 * GiB
KINDS = ("idle", "hosting (simulated)", "hosting (agent)")
# The functions of a beat's path whose share of its time the table shows: (module path, function).
PHASES = (
    ("scheduling/services/node_gateway.py", "answer", "the whole call (node_gateway.answer)"),
    ("gpuportal/wire/control.py", "decode_call", "decode the call"),
    ("django/db/__init__.py", "close_old_connections", "close_old_connections"),
    ("scheduling/services/node_credentials.py", "check_call", "credential check"),
    ("scheduling/services/nodes.py", "heartbeat", "nodes.heartbeat"),
    ("scheduling/services/nodes.py", "_quiet_beat", "  quiet beat (one statement)"),
    ("scheduling/locks.py", "lock_node", "  lock the node's row"),
    ("scheduling/services/nodes.py", "written_off", "  written_off"),
    ("scheduling/services/books.py", "check", "  books.check"),
    ("scheduling/services/lost_commands.py", "resend", "  lost_commands.resend"),
    ("scheduling/services/nodes.py", "record_host_bytes", "  record_host_bytes"),
    ("scheduling/services/nodes.py", "copies_to_forget", "  copies_to_forget"),
    ("scheduling/services/node_credentials.py", "revoked", "revoked? (second look)"),
    ("gpuportal/wire/replies.py", "answer", "the answer to Redis"),
)


@dataclass
class Measured:
    kind: str
    beats: int
    cpu_ms: float
    wall_ms: float
    pg_cpu_ms: float | None
    statements: float
    redis_round_trips: float
    # {phase label: share of the profiled beat's time, in %}
    phases: dict[str, float] = field(default_factory=dict)
    # The top functions by cumulative time under cProfile: (where, ms per beat, calls per beat).
    top: list[tuple[str, float, float]] = field(default_factory=list)
    sql: list[str] = field(default_factory=list)
    # The same beats through a real agents' worker (`worker_cost`): its CPU per beat (the
    # process, Celery's consumer and pool included), and beats it answered per second of wall time.
    worker_cpu_ms: float | None = None
    worker_per_s: float | None = None


@dataclass
class Run:
    commit: str
    nodes: int
    replicas: int
    setup_s: float
    measured: list[Measured]


# -- the broker, stood in for --------------------------------------------------------------------


class Broker:
    """What the product sends through Celery, delivered in this process: an agent's call applied
    at once by the agents' worker's task, a node's command kept for its simulated node, a control
    task kept for `settle`."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str, Any]] = []
        self.control: list[tuple[str, list[Any]]] = []
        self.dropped: list[str] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, queue: str | None = None, **_: Any) -> None:
        from gpuportal.wire.control import AGENT_CALL_TASK
        from scheduling.services.dispatch import CONTROL_QUEUE
        from scheduling.tasks import agent_call

        args = list(args or [])
        if name == AGENT_CALL_TASK:
            agent_call(*args)
        elif queue == CONTROL_QUEUE:
            self.control.append((name, args))
        elif queue and queue.startswith("node."):
            self.commands.append((queue, name, args[0] if args else None))
        else:
            self.dropped.append(name)

    @contextmanager
    def installed(self) -> Iterator[Broker]:
        from gpuportal.celery import app

        saved = app.send_task
        app.send_task = self.send_task  # type: ignore[method-assign]
        try:
            yield self
        finally:
            app.send_task = saved  # type: ignore[method-assign]


def settle(broker: Broker, nodes: dict[str, SimulatedNode], *, rounds: int = 50) -> None:
    """Deliver what was sent, and what that sends, until nothing is left."""
    from gpuportal.celery import app
    from gpuportal.wire.commands import node_queue

    by_queue = {node_queue(name): node for name, node in nodes.items()}
    for _ in range(rounds):
        if not broker.commands and not broker.control:
            return
        commands, broker.commands = broker.commands, []
        for queue, task, payload in commands:
            by_queue[queue].carry_out(task, payload)
        control, broker.control = broker.control, []
        seen: set[str] = set()
        for task, args in control:
            # Many reconciles asked at once are one reconcile's work: run once a round.
            key = task if task.endswith("reconcile") else f"{task}{args}"
            if key not in seen:
                seen.add(key)
                app.tasks[task](*args)
    raise SystemExit(f"still sending after {rounds} rounds: {broker.commands[:3]} {broker.control[:3]}")


# -- the fleet -----------------------------------------------------------------------------------


def build_fleet(broker: Broker, nodes: int, replicas: int) -> tuple[dict[str, SimulatedNode], dict[str, str]]:
    """Nodes registered, a deployment placed and serving, everything aged past its graces."""
    from datetime import timedelta

    from django.conf import settings
    from django.db.models import F

    from gpuportal.celery import app
    from gpuportal.wire import node_lease, replies
    from inference.gateway import RemoteControl
    from scheduling.models import Replica
    from scheduling.services import deployments, node_credentials, scaling
    from scheduling.services.deployments import DeploymentSpec, ModelFacts

    lease = replies.client(settings.REDIS_URL)
    ttl = node_lease.ttl_s(
        settings.GPUPORTAL_HEARTBEAT_S, settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S, settings.GPUPORTAL_CONTROL_STALL_S
    )
    tokens = {node_name(i): node_credentials.issue(node_name(i), "bench") for i in range(nodes)}
    fleet = {
        name: SimulatedNode(
            name,
            RemoteControl(app, settings.REDIS_URL, token=token, node=name),
            lease,
            heartbeat_s=settings.GPUPORTAL_HEARTBEAT_S,
            lease_ttl_s=ttl,
            load_s=0.0,
            sleep=lambda _: None,
        )
        for name, token in tokens.items()
    }
    for node in fleet.values():
        node.register()
        node.renew_lease()
    broker.control.clear()  # reconciles of a fleet with no deployment yet: nothing to do
    spec = DeploymentSpec(
        name=NAME,
        source="/srv/models/tiny",
        replicas=0,
        override_bytes=REPLICA_BYTES,
        max_tokens=256,
        spread=True,
        idle_timeout_s=86400.0,
    )
    deployments.create(spec, facts=ModelFacts(weight_bytes=2 * 1024**2, estimate_bytes=REPLICA_BYTES))
    scaling.scale(NAME, replicas)
    settle(broker, fleet)
    serving = Replica.objects.filter(deployment__name=NAME, state=Replica.State.SERVING).count()
    if serving != replicas:
        raise SystemExit(f"{serving} of {replicas} replicas serving after the placement settled")
    # A fleet that has run a while: every replica's last change older than the longest grace.
    Replica.objects.update(updated_at=F("updated_at") - timedelta(hours=1))
    for node in fleet.values():
        node.beat_once()
    settle(broker, fleet)
    return fleet, tokens


def payload(node: SimulatedNode, token: str, *, agent: bool) -> dict[str, Any]:
    """The heartbeat call as the node's gateway puts it on the wire."""
    from gpuportal.wire import replies
    from gpuportal.wire.control import OPTIONAL, Call, encode_call
    from scheduling.services import nodes

    kwargs: dict[str, Any] = {"books": node.books(), **node.processes()}
    if agent:
        kwargs["host_bytes"] = {rid: HOST_BYTES for rid in kwargs["running"]}
        kwargs["host_copies"] = []
    for key in OPTIONAL.get("heartbeat", ()):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
    # A control plane from before a field was added to the beat is sent the beat it took then.
    taken = inspect.signature(nodes.heartbeat).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in taken}
    return encode_call(Call("heartbeat", replies.new_list(f"agent:{node.name}"), (node.name,), kwargs, token=token))


# -- measuring -----------------------------------------------------------------------------------


class Counted:
    """SQL statements (their text too) and Redis round trips of this process while installed."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.redis = 0

    @contextmanager
    def installed(self) -> Iterator[Counted]:
        import redis.client
        from django.db import connection

        def execute(run: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
            self.statements.append(sql)
            return run(sql, params, many, context)

        from scheduling import hot_sql

        command, pipeline = redis.client.Redis.execute_command, redis.client.Pipeline.execute
        hot_execute = hot_sql._Cursor.execute

        def counted_hot(cursor: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            self.statements.append(str(query))
            return hot_execute(cursor, query, params, **kwargs)

        def counted_command(client: Any, *args: Any, **options: Any) -> Any:
            self.redis += 1
            return command(client, *args, **options)

        def counted_pipeline(pipe: Any, *args: Any, **options: Any) -> Any:
            self.redis += 1
            return pipeline(pipe, *args, **options)

        redis.client.Redis.execute_command = counted_command  # type: ignore[method-assign]
        redis.client.Pipeline.execute = counted_pipeline  # type: ignore[method-assign]
        hot_sql._Cursor.execute = counted_hot  # type: ignore[method-assign]
        try:
            with connection.execute_wrapper(execute):
                yield self
        finally:
            redis.client.Redis.execute_command = command  # type: ignore[method-assign]
            redis.client.Pipeline.execute = pipeline  # type: ignore[method-assign]
            hot_sql._Cursor.execute = hot_execute  # type: ignore[method-assign]


def backend_cpu_s() -> float | None:
    """CPU of this connection's PostgreSQL backend so far; None where it cannot be read."""
    import psutil
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


def _phase_shares(stats: pstats.Stats) -> dict[str, float]:
    by_function = stats.stats  # type: ignore[attr-defined]
    total = sum(v[3] for (path, _, name), v in by_function.items() if name == "agent_call")
    shares: dict[str, float] = {}
    for module, function, label in PHASES:
        spent = sum(v[3] for (path, _, name), v in by_function.items() if name == function and path.endswith(module))
        if spent:
            shares[label] = 100 * spent / total if total else 0.0
    return shares


def _top(stats: pstats.Stats, beats: int, count: int = 25) -> list[tuple[str, float, float]]:
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "bench/heartbeat_profile.py" in path or name in ("<module>", "agent_call"):
            continue
        short = path.split("site-packages/")[-1].replace(str(Path.cwd()) + "/", "")
        rows.append((f"{short}:{line}({name})", 1000 * cumulative / beats, calls / beats))
    return sorted(rows, key=lambda row: -row[1])[:count]


def measure(kind: str, call: dict[str, Any], beats: int, profile_beats: int) -> Measured:
    from django.conf import settings

    from gpuportal.wire import replies
    from scheduling.tasks import agent_call

    answers = replies.client(settings.REDIS_URL)
    for _ in range(max(20, beats // 20)):  # warm: caches, the node's credential used just now
        agent_call(call)
    answers.delete(call["reply_to"])
    pg_before = backend_cpu_s()
    with Counted().installed() as counted:
        began_cpu, began = time.process_time(), time.perf_counter()
        for _ in range(beats):
            agent_call(call)
        cpu, wall = time.process_time() - began_cpu, time.perf_counter() - began
    pg_after = backend_cpu_s()
    answers.delete(call["reply_to"])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(profile_beats):
        agent_call(call)
    profiler.disable()
    answers.delete(call["reply_to"])
    stats = pstats.Stats(profiler)
    with Counted().installed() as one:
        agent_call(call)
    answers.delete(call["reply_to"])
    return Measured(
        kind,
        beats,
        cpu_ms=1000 * cpu / beats,
        wall_ms=1000 * wall / beats,
        pg_cpu_ms=None if pg_before is None or pg_after is None else 1000 * (pg_after - pg_before) / beats,
        statements=len(counted.statements) / beats,
        redis_round_trips=counted.redis / beats,
        phases=_phase_shares(stats),
        top=_top(stats, profile_beats),
        sql=[" ".join(s.split())[:160] for s in one.statements],
    )


@contextmanager
def agents_worker() -> Iterator[Any]:
    """The agents' worker as `manage.py up` and bench.fleet start it (8 threads), on this run's
    database and Redis; yields its psutil.Process."""
    import psutil
    import redis
    from django.conf import settings

    from gpuportal.wire.control import AGENT_QUEUE

    redis.Redis.from_url(settings.REDIS_URL).delete(AGENT_QUEUE)
    argv = [sys.executable, "-m", "celery", "-A", "gpuportal", "worker", "-Q", AGENT_QUEUE, "-n",
            "agents-heartbeat@%h", "--pool", "threads", "--concurrency", "8", "--without-gossip",
            "--without-mingle"]  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(argv, cwd=root, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        worker = psutil.Process(process.pid)
        _answered(_sent_calls([_fresh({"v": 0, "call": "heartbeat", "args": ["x"], "reply_to": "x"})]), 60)
        yield worker
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _fresh(call: dict[str, Any]) -> dict[str, Any]:
    from gpuportal.wire import replies

    return {**call, "reply_to": replies.new_list("agent:heartbeat-profile")}


def _sent_calls(calls: list[dict[str, Any]]) -> list[str]:
    from gpuportal.celery import app
    from gpuportal.wire.control import AGENT_CALL_TASK, AGENT_QUEUE

    for call in calls:
        app.send_task(AGENT_CALL_TASK, args=[call], queue=AGENT_QUEUE, expires=300)
    return [call["reply_to"] for call in calls]


def _answered(lists: list[str], timeout_s: float) -> None:
    from django.conf import settings

    from gpuportal.wire import replies

    client = replies.client(settings.REDIS_URL)
    for reply_to in lists:
        try:
            replies.wait(client, reply_to, timeout_s, "a heartbeat")
        except replies.NoAnswer as err:
            if "no answer" in str(err):
                raise
        client.delete(reply_to)


def worker_cost(worker: Any, call: dict[str, Any], beats: int) -> tuple[float, float]:
    """(CPU ms per beat of the agents' worker, beats answered per second) for `beats` copies of
    `call` queued at once, as the queue of a fleet the worker cannot keep up with is."""
    from bench.fleet import cpu_seconds

    calls = [_fresh(call) for _ in range(beats)]
    began_cpu, began = cpu_seconds(worker), time.perf_counter()
    _answered(_sent_calls(calls), 300)
    return 1000 * (cpu_seconds(worker) - began_cpu) / beats, beats / (time.perf_counter() - began)


def run(
    nodes: int, replicas: int, beats: int, profile_beats: int, database: str, rounds: int, worker_beats: int
) -> Run:
    os.environ.setdefault("GPUPORTAL_MAX_REPLICAS", str(max(32, replicas)))
    server = setup_database(database)
    try:
        from scheduling.models import Node, Replica

        broker = Broker()
        with broker.installed():
            began = time.monotonic()
            fleet, tokens = build_fleet(broker, nodes, replicas)
            setup_s = time.monotonic() - began
            print(f"{nodes} nodes registered, {replicas} replicas serving: {setup_s:.0f} s", flush=True)
            hosting = Replica.objects.filter(deployment__name=NAME).order_by("node__name").first().node.name
            idle = Node.objects.exclude(replicas__isnull=False).order_by("name").first().name
            calls = {
                "idle": payload(fleet[idle], tokens[idle], agent=True),
                "hosting (simulated)": payload(fleet[hosting], tokens[hosting], agent=False),
                "hosting (agent)": payload(fleet[hosting], tokens[hosting], agent=True),
            }
            # Rounds alternate the kinds, so that a machine that slows down meanwhile slows each.
            runs: dict[str, list[Measured]] = {kind: [] for kind in KINDS}
            for _ in range(rounds):
                for kind in KINDS:
                    runs[kind].append(measure(kind, calls[kind], beats, profile_beats))
            if broker.commands or broker.control:
                print(f"note: the beats sent {len(broker.commands)} commands, {len(broker.control)} control tasks")
        measured = [min(each, key=lambda m: m.cpu_ms) for each in runs.values()]
        if worker_beats:
            with agents_worker() as worker:
                for m in measured:
                    worker_cost(worker, calls[m.kind], max(50, worker_beats // 10))  # warm its threads
                    costs = [worker_cost(worker, calls[m.kind], worker_beats) for _ in range(rounds)]
                    m.worker_cpu_ms, m.worker_per_s = min(costs)
        return Run(_commit(), nodes, replicas, setup_s, measured)
    finally:
        stop(server)


# -- the table -----------------------------------------------------------------------------------


def columns(runs: list[tuple[str, Run]]) -> tuple[list[str], list[list[object]]]:
    """One column per (run, kind of beat)."""
    headers = [""]
    cells: list[Measured] = []
    for label, each in runs:
        for m in each.measured:
            headers.append(f"{label}: {m.kind}")
            cells.append(m)

    def fig(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows: list[list[object]] = [
        ["CPU ms per beat, agent_call in one process", *[fig(m.cpu_ms) for m in cells]],
        ["CPU ms per beat, its PostgreSQL backend", *[fig(m.pg_cpu_ms) for m in cells]],
        ["wall ms per beat", *[fig(m.wall_ms) for m in cells]],
        ["SQL statements per beat", *[fig(m.statements, 0) for m in cells]],
        ["Redis round trips per beat", *[fig(m.redis_round_trips, 0) for m in cells]],
        ["CPU ms per beat, the agents' worker (Celery, 8 threads)", *[fig(m.worker_cpu_ms) for m in cells]],
        ["beats per s answered by that worker, queue full", *[fig(m.worker_per_s, 0) for m in cells]],
    ]
    labels = [label for _, _, label in PHASES]
    for label in labels:
        if any(label in m.phases for m in cells):
            rows.append([f"% of the beat: {label.strip()}", *[fig(m.phases.get(label), 0) for m in cells]])
    return headers, rows


def describe(runs: list[tuple[str, Run]]) -> str:
    lines = []
    for label, each in runs:
        lines.append(
            f"`{label}`: commit {each.commit}, {each.nodes} nodes, {each.replicas} replicas serving "
            f"(set up in {each.setup_s:.0f} s)."
        )
    return "\n".join(lines)


def details(each: Run) -> str:
    out = []
    for m in each.measured:
        out.append(f"\n{m.kind}: {len(m.sql)} statements")
        out.extend(f"    {sql}" for sql in m.sql)
        out.append("  top by cumulative time (cProfile, ms per beat under the profiler, calls per beat):")
        out.extend(f"    {ms:7.3f} ms {calls:6.1f}x  {where}" for where, ms, calls in m.top)
    return "\n".join(out)


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
    )
    return (found.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def _loaded(path: Path) -> Run:
    record = json.loads(path.read_text())
    record["measured"] = [Measured(**{**m, "top": [tuple(t) for t in m["top"]]}) for m in record["measured"]]
    return Run(**record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes of 8 virtual GPUs (1000)")
    parser.add_argument("--replicas", type=int, default=100, help="replicas placed, one a node (100)")
    parser.add_argument("--beats", type=int, default=2000, help="beats timed per kind and round (2000)")
    parser.add_argument("--profile-beats", type=int, default=300, help="beats profiled per kind and round (300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every kind; the cheapest counts (3)")
    parser.add_argument(
        "--worker-beats",
        type=int,
        default=1000,
        help="beats queued at once per kind and round for a real agents' worker (1000; 0: none)",
    )
    parser.add_argument("--database", default="beat_heartbeat_profile", help="the database made afresh for it")
    parser.add_argument("--label", default="this run", help="this run's name in the table")
    parser.add_argument("--json", type=Path, help="write this run's figures here")
    parser.add_argument("--beside", action="append", default=[], metavar="LABEL=FILE", help="another run's --json")
    parser.add_argument("--details", action="store_true", help="print each beat's statements and top functions")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.nodes < 2 or not 1 <= args.replicas < args.nodes or args.beats < 1 or args.rounds < 1:
        parser.error("--nodes must be at least 2, --replicas between 1 and nodes - 1, --beats and --rounds >= 1")
    beside = []
    for each in args.beside:
        label, _, path = each.partition("=")
        if not path:
            parser.error(f"--beside takes LABEL=FILE, not {each!r}")
        beside.append((label, _loaded(Path(path))))

    this = run(args.nodes, args.replicas, args.beats, args.profile_beats, args.database, args.rounds, args.worker_beats)
    if args.json:
        args.json.write_text(json.dumps(asdict(this)))
    runs = [*beside, (args.label, this)]
    from bench.report import record, table

    headers, rows = columns(runs)
    text = table(headers, rows)
    print("\n" + text + "\n\n" + describe(runs))
    if args.details:
        print(details(this))
    if args.no_record:
        return
    record(
        "heartbeat",
        "Heartbeat cost on the control plane",
        f"`python -m bench.heartbeat_profile --nodes {args.nodes} --replicas {args.replicas} --beats {args.beats} "
        f"--rounds {args.rounds}`: {args.nodes} simulated nodes of 8 virtual GPUs registered through their own "
        f"gateways, {args.replicas} replicas placed (`placement.spread`) and serving, every replica aged past "
        "its graces; then each kind of beat, as its agent puts it on the wire, applied by the agents' worker's "
        "task (`scheduling.tasks.agent_call`) in one process, in rounds that alternate the kinds (the cheapest "
        "round counts). CPU is this process's (`time.process_time`) and its PostgreSQL backend's per beat; the "
        "shares are of the beat's time under cProfile.\n\n" + text + "\n\n" + describe(runs),
    )


if __name__ == "__main__":
    main()
