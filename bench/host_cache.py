"""The host cache under pressure: replicas put to sleep past their node's budget for host memory.

One node whose agent keeps at most BUDGET bytes of sleeping weights in host memory
(GPUPORTAL_HOST_CACHE_BYTES, here room for `--fits` of them), and `--deployments` deployments of
one tiny causal LM, a replica each, all serving. Each is used by one request and then put to
sleep, one after another, through the API (`POST /api/deployments/{name}/sleep/`), as an operator
or the idle sweep would; after each, once its replica sleeps and the control worker has trimmed
the node, the host cache as `/api/nodes/` counts it (scheduling.services.host_cache.used_bytes),
the share of it the arenas serving replicas keep for their next sleep (room spare, lent; dropped
before any sleeper is parked), and the replicas' states. Then one request to each deployment
wakes it, oldest first: from host memory where its weights are still there, from disk where the
trim parked them. Its own module, since it needs the control plane (the budget is the control
plane's) where bench.wake measures one replica's copies without one; `python -m bench.wake
--host-cache` runs both in one run.

    python -m bench.host_cache [--deployments 6] [--fits 2] [--size-mb 16] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.portal import Http, Portal, servers, staff_key, wait
from gpuportal.wire.states import ReplicaState as S

MiB = 1024**2
MS = 1000


class Api:
    """A fresh connection per call: the benchmark waits long between calls, past the web server's
    keep-alive, and a request's time includes a local connect either way (well under a millisecond)."""

    def __init__(self, port: int, key: str):
        self.port, self.key = port, key

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        http = Http(self.port, self.key)
        try:
            return http.post(path, body)
        finally:
            http.close()


@dataclass
class AfterSleep:
    """The node's host cache once the n-th deployment slept and the trim that followed it ran."""

    slept: str
    used_bytes: int
    kept_bytes: int  # of used_bytes, the arenas serving replicas keep for their next sleep
    sleeping: int
    parked: int
    left: list[str]  # the deployments whose replica this sleep's trim parked
    settled_s: float  # from the API call to that state


@dataclass
class Wake:
    deployment: str
    source: str  # "host" or "disk"
    answered_s: float


def node_state(names: list[str]) -> tuple[int, dict[str, str]]:
    """The host cache used on the node (what /api/nodes/ shows) and each deployment's replica
    state, the latest replica of each."""
    used, _, states = node_cache(names)
    return used, states


def node_cache(names: list[str]) -> tuple[int, int, dict[str, str]]:
    """`node_state`, with the kept arenas' share of what is used (gpuportal_host_cache_kept_bytes)."""
    from scheduling.core import host_cache as rules
    from scheduling.models import Node, Replica
    from scheduling.services import host_cache

    node = Node.objects.get(name="bench")
    held = host_cache.holders([node.pk])[node.pk]
    states: dict[str, str] = {}
    for replica in Replica.objects.filter(deployment__name__in=names).order_by("created_at"):
        states[replica.deployment.name] = replica.state
    return rules.used_bytes(held), rules.used_bytes([h for h in held if h.kept_arena]), states


def deploy_all(http: Api, model_dir: Path, names: list[str]) -> None:
    for name in names:
        body = {
            "name": name,
            "model": {"source": str(model_dir)},
            "replicas": 1,
            "memory": {"override_bytes": 200 * MiB, "max_tokens": 256},
            # Only this benchmark puts them to sleep, in its order: no idle sweep within the run.
            "sleep": {"idle_timeout_s": 86_400},
        }
        status, answer = http.post("/api/deployments/", body)
        if status != 201:
            raise SystemExit(f"deploy {name}: {status} {answer}")
    wait(lambda: set(node_state(names)[1].values()) == {"serving"}, 300, "every deployment to serve")


def sleep_in_turn(http: Api, names: list[str], budget: int) -> list[AfterSleep]:
    after: list[AfterSleep] = []
    parked_before: set[str] = set()
    for name in names:
        # Used once, then idle: the order they served in is the order the trim should park them.
        answered(http, name)
        began = time.monotonic()
        status, answer = http.post(f"/api/deployments/{name}/sleep/", {})
        if status != 200:
            raise SystemExit(f"sleep {name}: {status} {answer}")

        def settled(name: str = name) -> tuple[int, int, dict[str, str]] | None:
            used, kept, states = node_cache(names)
            moving = {S.DRAINING, S.STOPPING} & set(states.values())
            done = states[name] in (S.SLEEPING, S.PARKED) and not moving and used <= budget
            return (used, kept, states) if done else None

        used, kept, states = wait(settled, 120, f"{name} to sleep and the host cache to fit its budget")  # type: ignore[misc]
        settled_s = time.monotonic() - began
        parked = {n for n, state in states.items() if state == S.PARKED}
        left = sorted(parked - parked_before)
        parked_before = parked
        sleeping = sum(state == S.SLEEPING for state in states.values())
        after.append(AfterSleep(name, used, kept, sleeping, len(parked), left, settled_s))
        print(
            f"slept {name}: host cache {used / MiB:.0f} MiB of {budget / MiB:.0f} ({kept / MiB:.0f} kept), {states}",
            flush=True,
        )
    return after


def answered(http: Api, name: str) -> None:
    body = {"input": "Hello", "params": {"max_tokens": 1}, "timeout_s": 120}
    status, answer = http.post(f"/api/deployments/{name}/infer/", body)
    if status != 200 or answer.get("status") != "done":
        raise SystemExit(f"request to {name}: {status} {answer}")


def wake_each(http: Api, names: list[str]) -> list[Wake]:
    wakes: list[Wake] = []
    for name in names:
        source = "disk" if node_state(names)[1][name] == "parked" else "host"
        began = time.monotonic()
        answered(http, name)
        wakes.append(Wake(name, source, time.monotonic() - began))
        print(f"woke {name} from {source}: {MS * wakes[-1].answered_s:.0f} ms", flush=True)
    return wakes


def report(after: list[AfterSleep], wakes: list[Wake], budget: int, weight_bytes: int) -> tuple[str, str]:
    from bench.report import table

    rows = [
        [
            n + 1,
            a.slept,
            f"{a.used_bytes / MiB:.1f}",
            f"{a.kept_bytes / MiB:.1f}",
            f"{budget / MiB:.1f}",
            a.sleeping,
            a.parked,
            ", ".join(a.left) or "-",
            f"{a.settled_s:.2f}",
        ]
        for n, a in enumerate(after)
    ]
    headers = [
        "sleeps",
        "put to sleep",
        "host cache MiB",
        "of it kept arenas MiB",
        "budget MiB",
        "sleeping",
        "parked",
        "parked now",
        "settled s",
    ]
    by_source = {s: [w.answered_s for w in wakes if w.source == s] for s in ("host", "disk")}
    wake_rows = [
        [source, len(times), f"{MS * statistics.median(times):.0f}", f"{MS * max(times):.0f}"]
        for source, times in by_source.items()
        if times
    ]
    # No row over the budget: the run waits for each trim to bring the cache within it, and
    # stops, saying so, if one never does.
    detail = (
        table(["first request wakes it from", "deployments", "p50 ms", "max ms"], wake_rows)
        + f"\n\nWeights {weight_bytes / MiB:.1f} MiB per replica (what its host copy counts). "
        + "After every sleep the trim brought the host cache within its budget."
    )
    return table(headers, rows), detail


def run(deployments: int = 6, fits: int = 2, size_mb: int = 16, *, record_it: bool = True) -> None:
    """The measurement, printed and (`record_it`) recorded in its own section; bench.wake's
    `--host-cache` runs it after its copies, so that one run measures both."""
    if not 0 < fits < deployments:
        raise ValueError("fits must be at least 1 and fewer than the deployments (or nothing is under pressure)")
    with servers("gpuportal-bench-host-cache-", "gpuportal_bench_host_cache") as tmp:
        from bench.report import record
        from inference.inspection import read_model
        from inference.management.commands.make_tiny_model import write_tiny_model

        model_dir = write_tiny_model(tmp / "tiny", size_mb=size_mb, seed=7, log=lambda _: None).path
        # What a deploy's inspection will count for each replica's host copy (the agent runs the same).
        weight_bytes = int(read_model(str(model_dir), "transformers", "float32").weight_bytes or 0)
        # Room for `fits` sleepers and half of one more: each one past it must park the oldest.
        budget = int((fits + 0.5) * weight_bytes)
        os.environ["GPUPORTAL_HOST_CACHE_BYTES"] = str(budget)  # the agent's setting, read as it starts
        names = [f"m{n}" for n in range(deployments)]
        with Portal(tmp, web_threads=4, control=True, agents={"bench": "1x8GiB"}) as portal:
            key = staff_key()
            portal.ready(key)
            api = Api(portal.port, key)
            deploy_all(api, model_dir, names)
            after = sleep_in_turn(api, names, budget)
            wakes = wake_each(api, names)
        table, detail = report(after, wakes, budget, weight_bytes)
        print("\n" + table + "\n\n" + detail)
        if record_it:
            described = (
                f"`python -m bench.host_cache --deployments {deployments} --fits {fits} "
                f"--size-mb {size_mb}` (or `python -m bench.wake --host-cache`, after its copies): one node "
                f"agent (a virtual GPU of 8 GiB, on the CPU) whose host "
                f"cache holds {fits} sleeping replicas and half of one more, {deployments} deployments "
                "of a tiny causal LM, a replica each, each used by one request and then put to sleep through the "
                "API, one after another; then one request to each, oldest first. Settled: from the sleep call "
                "until the replica sleeps and the control worker's trim has parked what no longer fits. Kept "
                "arenas: room the budget has spare, lent to serving replicas for their next sleep (a sleep past "
                "the budget drops them before it parks anyone)." + "\n\n" + table + "\n\n" + detail
            )
            record("host-cache", "Host cache under pressure: sleeping replicas past the node's budget", described)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=6)
    parser.add_argument("--fits", type=int, default=2, help="how many sleeping replicas the budget holds")
    parser.add_argument("--size-mb", type=int, default=16, help="the tiny model's weights")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if not 0 < args.fits < args.deployments:
        parser.error("--fits must be at least 1 and fewer than --deployments (or nothing is under pressure)")
    run(args.deployments, args.fits, args.size_mb, record_it=not args.no_record)


if __name__ == "__main__":
    main()
