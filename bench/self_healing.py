"""Self-healing: how long the portal takes to put back what the operator asked for.

One run, on the same tiny causal LM, two node agents, a control worker and celery beat on the
product's own schedule and settings (heartbeat every GPUPORTAL_HEARTBEAT_S, a node offline after
GPUPORTAL_HEARTBEAT_TIMEOUT_S, expired by the beat sweep), side by side:
- `node loss`: the agent of a node serving a replica is SIGKILLed and not started again, under
  steady load (its replica outlives it for the adoption window, then stops). Measured: SIGKILL →
  node offline (the detection), node offline → the deployment at its full count of serving
  replicas again (the reconcile's placement and a load).
- `agent crash`: the agent of a node serving a replica is SIGKILLed and started again at once,
  under steady load, as `make run` does when its agent dies. Measured: SIGKILL → the new agent
  registered, then → its replica taken over (`replica.adopted`), the same process serving on.
- `restart`: every agent is stopped (SIGTERM) and started anew, as `make run` stopped and started
  is. Measured: agents started → the deployment at full count, without a request.
- `cold start`: the same deployment scaled up by one: scale → the new replica serving. The
  baseline the other two pay once their detection is over.

    python -m bench.self_healing [--trials 3] [--clients 2] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time

from bench.failover import Load
from bench.portal import Portal, servers, staff_key, wait
from gpuportal.wire.states import ReplicaState as S

MiB = 1024**2
NAME = "heal"
AGENTS = {"left": "1x4GiB", "right": "1x4GiB"}


def serving(count: int, *, off: str | None = None):
    """True once `count` replicas of the deployment serve (none of them on node `off`)."""
    from scheduling.models import Replica

    def check() -> bool:
        replicas = Replica.objects.filter(deployment__name=NAME, state=S.SERVING)
        if off is not None:
            replicas = replicas.exclude(node__name=off)
        return replicas.count() == count

    return check


def node_is(name: str, status: str):
    from scheduling.models import Node

    return lambda: Node.objects.filter(name=name, status=status).exists()


def settled():
    """Nothing of the deployment on its way (no replica pending, loading, waking or stopping)."""
    from scheduling.models import Replica

    busy = (S.PENDING, S.LOADING, S.WAKING, S.STOPPING, S.DRAINING)
    return lambda: not Replica.objects.filter(deployment__name=NAME, state__in=busy).exists()


MS = 1000


def cold_starts(trials: int) -> list[float]:
    """Seconds from a scale-up by one to the new replica serving (then back to two)."""
    from scheduling.services import deployments

    cold: list[float] = []
    for trial in range(trials):
        began = time.monotonic()
        deployments.scale(NAME, 3, reason="bench: cold start")
        wait(serving(3), 300, "the third replica to serve")
        cold.append(time.monotonic() - began)
        deployments.scale(NAME, 2, reason="bench: back to two")
        wait(lambda: serving(2)() and settled()(), 300, "the scale-down")
        print(f"cold start {trial + 1}: {MS * cold[-1]:.0f} ms", flush=True)
    return cold


def node_losses(portal: Portal, trials: int) -> tuple[list[float], list[float]]:
    """(detection, then full count) seconds per SIGKILL of the agent of a node serving a replica;
    the agent is started again after each."""
    from scheduling.models import Replica

    detect: list[float] = []
    heal: list[float] = []
    for trial in range(trials):
        node = Replica.objects.filter(deployment__name=NAME, state=S.SERVING).values_list("node__name", flat=True)[0]
        killed_at = time.monotonic()
        portal.agents[node].send_signal(signal.SIGKILL)  # its replica outlives it for its adoption window
        portal.agents[node].wait(30)
        wait(node_is(node, "offline"), 120, f"node {node} to go offline")
        offline_at = time.monotonic()
        wait(serving(2, off=node), 300, "the replacements to serve")
        detect.append(offline_at - killed_at)
        heal.append(time.monotonic() - offline_at)
        print(f"node loss {trial + 1}: offline after {MS * detect[-1]:.0f} ms, full count {MS * heal[-1]:.0f} ms later")
        portal.start_agent(node)
        wait(node_is(node, "online"), 120, f"node {node} to come back")
    return detect, heal


def more_than(rows, count: int):
    return lambda: rows.count() > count


def agent_crashes(portal: Portal, trials: int) -> tuple[list[float], list[float]]:
    """(agent registered, replica taken over) seconds after the SIGKILL of the agent of a node
    serving a replica, started again at once; the deployment stays at its full count throughout."""
    from scheduling.models import Event, Replica

    registered: list[float] = []
    adopted: list[float] = []
    for trial in range(trials):
        wait(lambda: serving(2)() and settled()(), 300, "the deployment to settle")
        replica = Replica.objects.filter(deployment__name=NAME, state=S.SERVING).select_related("node").first()
        assert replica is not None
        node = replica.node.name
        onlines = Event.objects.filter(kind=Event.Kind.NODE_ONLINE, node=node)
        adoptions = Event.objects.filter(kind=Event.Kind.REPLICA_ADOPTED, replica=replica.pk)
        online_before, adopted_before = onlines.count(), adoptions.count()
        killed_at = time.monotonic()
        portal.agents[node].send_signal(signal.SIGKILL)
        portal.agents[node].wait(30)
        portal.start_agent(node)
        wait(more_than(onlines, online_before), 120, f"the agent of {node} to register again")
        registered.append(time.monotonic() - killed_at)
        wait(more_than(adoptions, adopted_before), 120, f"the new agent of {node} to take its replica over")
        adopted.append(time.monotonic() - killed_at)
        same = Replica.objects.get(pk=replica.pk)
        if same.state != S.SERVING or same.pid != replica.pid:
            raise SystemExit(f"agent crash {trial + 1}: replica {replica.pk} is {same.state}, pid {same.pid}")
        print(f"agent crash {trial + 1}: taken over {MS * adopted[-1]:.0f} ms after the SIGKILL", flush=True)
    return registered, adopted


def restarts(portal: Portal, trials: int) -> tuple[list[float], list[float]]:
    """(agents registered, deployment at full count) seconds after every agent is started anew."""
    from scheduling.models import Node, Replica

    registered: list[float] = []
    restored: list[float] = []
    for trial in range(trials):
        wait(lambda: serving(2)() and settled()(), 300, "the deployment to settle")
        for process in portal.agents.values():
            process.send_signal(signal.SIGTERM)
        for process in portal.agents.values():
            process.wait(120)
        wait(lambda: not Replica.objects.filter(deployment__name=NAME, state=S.SERVING).exists(), 60, "stop")
        started_at = time.monotonic()
        for name in AGENTS:
            portal.start_agent(name)
        wait(lambda: Node.objects.filter(status="online").count() == len(AGENTS), 120, "the agents to register")
        registered.append(time.monotonic() - started_at)
        wait(serving(2), 300, "the deployment to serve again")
        restored.append(time.monotonic() - started_at)
        print(f"restart {trial + 1}: serving {MS * restored[-1]:.0f} ms after the agents started", flush=True)
    return registered, restored


def report(
    cold: list[float],
    losses: tuple[list[float], list[float]],
    crashes: tuple[list[float], list[float]],
    restarted: tuple[list[float], list[float]],
) -> str:
    from bench.report import table

    p50 = statistics.median
    detect, heal = losses
    crash_registered, adopted = crashes
    registered, restored = restarted
    loading = [r - g for r, g in zip(restored, registered, strict=True)]
    rows = [
        ["cold start (scale 2 → 3)", len(cold), "", f"{MS * p50(cold):.0f}", "", "1.0"],
        [
            "node loss: agent SIGKILLed under load",
            len(heal),
            f"{MS * p50(detect):.0f}",
            f"{MS * p50(heal):.0f}",
            f"{MS * p50([d + h for d, h in zip(detect, heal, strict=True)]):.0f}",
            f"{p50(heal) / p50(cold):.1f}",
        ],
        [
            "agent crash: SIGKILLed, started again, replica taken over",
            len(adopted),
            f"{MS * p50(crash_registered):.0f}",
            f"{MS * p50([a - r for a, r in zip(adopted, crash_registered, strict=True)]):.0f}",
            f"{MS * p50(adopted):.0f}",
            f"{p50([a - r for a, r in zip(adopted, crash_registered, strict=True)]) / p50(cold):.2f}",
        ],
        [
            "restart: every agent stopped and started",
            len(restored),
            f"{MS * p50(registered):.0f}",
            f"{MS * p50(loading):.0f}",
            f"{MS * p50(restored):.0f}",
            f"{p50(loading) / p50(cold):.1f}",
        ],
    ]
    headers = ["trial", "n", "detect or register p50 ms", "then full count p50 ms", "total p50 ms", "÷ cold start"]
    return table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    with servers("gpuportal-bench-heal-", "gpuportal_bench_heal") as tmp:
        from django.conf import settings

        from bench.report import record
        from inference.management.commands.make_tiny_model import write_tiny_model
        from scheduling.services import deployments
        from scheduling.services.deployments import DeploymentSpec

        model_dir = write_tiny_model(tmp / "tiny", size_mb=2, seed=7, log=lambda _: None).path
        with Portal(tmp, web_threads=args.clients + 2, control=True, agents=AGENTS, beat=True) as portal:
            key = staff_key()
            portal.ready(key)
            deployments.create(
                DeploymentSpec(name=NAME, source=str(model_dir), replicas=2, override_bytes=512 * MiB, max_tokens=256)
            )
            wait(serving(2), 300, "two replicas to serve")

            cold = cold_starts(args.trials)
            load = Load(portal.port, key, NAME, args.clients)
            load.start()
            losses = node_losses(portal, args.trials)
            crashes = agent_crashes(portal, args.trials)
            load.finish()
            failed = load.failed()
            restarted = restarts(portal, args.trials)

            table = report(cold, losses, crashes, restarted)
            detail = (
                f"Settings: heartbeat every {settings.GPUPORTAL_HEARTBEAT_S:g} s, a node offline after "
                f"{settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S:g} s of silence, expired by the beat sweep (every 5 s). "
                f"Under node loss and agent crashes, {args.clients} clients sent {len(load.answers)} one-token "
                "`/infer/` requests; "
                f"{len(failed)} did not end `done`."
            )
            print("\n" + table + "\n\n" + detail)
            for failure in failed[:5]:
                print("failed:", failure)
            if not args.no_record:
                record(
                    "self_healing",
                    "Self-healing: node loss, agent crash and restart back to the full count",
                    f"`python -m bench.self_healing --trials {args.trials} --clients {args.clients}`: a tiny causal "
                    "LM (2 MB), 2 replicas wanted, two real node agents of one virtual GPU each, a control worker "
                    "and celery beat on the product's schedule. Node loss: from the SIGKILL of an agent serving a "
                    "replica to its node offline (detect), then to 2 replicas serving on the other node (full "
                    "count). Agent crash: an agent serving a replica SIGKILLed and started again at once; from the "
                    "SIGKILL to the new agent registered, then to its replica taken over (the same process serving on, "
                    "its model not loaded again). Restart: every agent SIGTERMed, then started; from the start to "
                    "the agents registered, "
                    "then to 2 replicas serving, with no request sent. `÷ cold start`: the part after detection "
                    "or registration against a plain scale-up measured in the same run.\n\n" + table + "\n\n" + detail,
                )
            if failed:
                raise SystemExit(f"{len(failed)} request(s) did not end done")


if __name__ == "__main__":
    main()
