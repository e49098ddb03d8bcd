"""Failover: from SIGKILL of a serving replica to the first answer served in its place, under load.

One run, side by side on the same tiny causal LM, the same agent and web server:
- `standby`: a deployment with `failover.standby`: its active member is SIGKILLed; the standby
  takes the pair's lock, wakes, and serves (seed 004). After each trial the portal starts a fresh
  standby; the next trial waits for it to stand by.
- `no standby`: a plain deployment: its replica is SIGKILLed; its requests go back to the queue,
  and the control plane places and loads a new replica for them (a cold start).
Steady load throughout: clients send `POST /api/deployments/{name}/infer/` (one token) back to
back over kept-alive connections. Measured per trial: time from the SIGKILL to the first answer
served by the replacement, and every request that did not end `done` (a failed request).

    python -m bench.failover [--trials 20] [--baseline-trials 5] [--clients 2] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers.
"""

from __future__ import annotations

import argparse
import http.client as http_client
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.portal import Http, Portal, percentile, servers, staff_key, wait
from gpuportal.wire.states import ReplicaState as S

MiB = 1024**2


@dataclass
class Load:
    """Clients on their own threads and connections; every answer kept with when it arrived."""

    port: int
    key: str
    deployment: str
    clients: int
    answers: list[tuple[float, int, dict]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)

    def _client(self) -> None:
        http = Http(self.port, self.key)
        body = {"input": "Hello", "params": {"max_tokens": 1}, "timeout_s": 120}
        while not self.stop.is_set():
            try:
                status, answer = http.post(f"/api/deployments/{self.deployment}/infer/", body)
            except (OSError, http_client.HTTPException, ValueError) as exc:
                # The web server failing (or answering something that is not JSON) is a failed request too.
                status, answer = 599, {"error": f"{type(exc).__name__}: {exc}"}
                http.close()
                http = Http(self.port, self.key)
            with self.arrived:
                self.answers.append((time.monotonic(), status, answer))
                self.arrived.notify_all()
        http.close()

    def first_from(self, replica_ids: set[str] | None, after: float, exclude: set[str], timeout: float = 60) -> float:
        """When the first answer after `after` came from a replica in `replica_ids` (any other than
        `exclude` when None)."""

        def found() -> float | None:
            for at, status, answer in self.answers:
                who = answer.get("replica")
                mine = who and who not in exclude and (replica_ids is None or who in replica_ids)
                if at > after and status == 200 and mine:
                    return at
            return None

        with self.arrived:
            if not self.arrived.wait_for(lambda: found() is not None, timeout):
                recent = [(round(at - after, 3), status, answer) for at, status, answer in self.answers[-5:]]
                raise SystemExit(f"no answer from {replica_ids or 'a new replica'} in {timeout:.0f} s; last: {recent}")
            return found()  # type: ignore[return-value]

    def failed(self) -> list[dict]:
        return [answer for _, status, answer in self.answers if status != 200 or answer.get("status") != "done"]


def whole_pair(name: str, killed: set[str]):
    """(active, standby) once the pair is whole again: the killed members' ends recorded, the
    takeover recorded, and a fresh standby standing by."""
    from scheduling.models import Replica

    def check():
        members = list(Replica.objects.filter(deployment__name=name, lease__isnull=False))
        if any(m.state not in (S.FAILED, S.STOPPED) for m in members if m.id in killed):
            return None
        active = [m for m in members if m.state == S.SERVING and m.failover_state == "active"]
        standby = [m for m in members if m.state == S.STANDBY and m.failover_state == S.STANDBY]
        return (active[0], standby[0]) if len(active) == 1 and len(standby) == 1 else None

    return check


MS = 1000


@dataclass
class Phase:
    """One side of the comparison: seconds from each SIGKILL to the first answer after it, and
    the requests sent throughout."""

    times: list[float]
    answers: int
    failed: list


def with_standby(portal: Portal, key: str, model_dir: Path, trials: int, clients: int) -> tuple[Phase, list[dict]]:
    """The active member of a failover pair SIGKILLed under load, `trials` times; also what each
    takeover's member measured from its lock grant (takeover_s, and its steps)."""
    from scheduling.models import Event
    from scheduling.services import deployments
    from scheduling.services.deployments import DeploymentSpec

    deployments.create(
        DeploymentSpec(name="pair", source=str(model_dir), override_bytes=512 * MiB, max_tokens=256, standby=True)
    )
    killed: set[str] = set()
    wait(whole_pair("pair", killed), 300, "the first pair")
    load = Load(portal.port, key, "pair", clients)
    load.start()
    takeovers: list[float] = []
    first_answer: dict[str, float] = {}  # the standby that took over → SIGKILL to its first answer
    for trial in range(trials):
        active, standby = wait(whole_pair("pair", killed), 300, "a whole pair")  # type: ignore[misc]
        # Load must be flowing through the active member before the kill.
        load.first_from({active.id}, time.monotonic(), set())
        killed.add(active.id)
        killed_at = time.monotonic()
        os.kill(active.pid, signal.SIGKILL)
        served_at = load.first_from({standby.id}, killed_at, set())
        takeovers.append(served_at - killed_at)
        first_answer[standby.id] = takeovers[-1]
        print(f"standby trial {trial + 1}: {MS * takeovers[-1]:.0f} ms", flush=True)
    load.finish()
    takeover_events = Event.objects.filter(kind="failover.takeover", deployment="pair")
    # Each with the bench's own SIGKILL-to-first-answer of the same trial (keyed by the member).
    grant_to_serving = [{**e.after, "first_answer_s": first_answer.get(e.replica)} for e in takeover_events]
    deployments.delete("pair")
    return Phase(takeovers, len(load.answers), load.failed()), grant_to_serving


def without_standby(portal: Portal, key: str, model_dir: Path, trials: int, clients: int) -> Phase:
    """A plain replica SIGKILLed under load: the portal places and loads a new one."""
    from scheduling.models import Replica
    from scheduling.services import deployments
    from scheduling.services.deployments import DeploymentSpec

    deployments.create(DeploymentSpec(name="solo", source=str(model_dir), override_bytes=512 * MiB, max_tokens=256))
    restarts: list[float] = []
    load = Load(portal.port, key, "solo", clients)
    load.start()
    for trial in range(trials):
        replica = wait(
            lambda: Replica.objects.filter(deployment__name="solo", state=S.SERVING).first(), 300, "a replica"
        )
        load.first_from({replica.id}, time.monotonic(), set())  # type: ignore[union-attr]
        gone = set(Replica.objects.filter(deployment__name="solo").values_list("id", flat=True))
        killed_at = time.monotonic()
        os.kill(replica.pid, signal.SIGKILL)  # type: ignore[union-attr]
        served_at = load.first_from(None, killed_at, gone)
        restarts.append(served_at - killed_at)
        print(f"no-standby trial {trial + 1}: {MS * restarts[-1]:.0f} ms", flush=True)
    load.finish()
    return Phase(restarts, len(load.answers), load.failed())


STEP_LABELS = (
    ("fenced_s", "at"),
    ("given_back_s", "the dead member's requests given back at"),
    ("woken_s", "woken at"),
)


def report(standby: Phase, solo: Phase, takeovers: list[dict]) -> tuple[str, str]:
    """(the table, the sentence under it)."""
    from bench.report import table

    rows = [
        [
            label,
            len(phase.times),
            f"{MS * statistics.median(phase.times):.0f}",
            f"{MS * percentile(phase.times, 0.99):.0f}",
            phase.answers,
            len(phase.failed),
        ]
        for label, phase in (
            ("standby takes over (failover.standby)", standby),
            ("no standby: a new replica is placed and loaded", solo),
        )
    ]
    headers = ["after SIGKILL of the serving replica", "trials", "p50 ms", "p99 ms", "requests", "failed"]
    ratio = statistics.median(solo.times) / statistics.median(standby.times)
    grant_to_serving = [t["takeover_s"] for t in takeovers] or [0.0]
    # Where the takeover's time went, from the grant, as each member reported it.
    steps = {
        name: statistics.median(t["steps"][name] for t in takeovers)
        for name in ("fenced_s", "given_back_s", "woken_s")
        if takeovers and all(name in t.get("steps", {}) for t in takeovers)
    }
    rest = [t["first_answer_s"] - t["takeover_s"] for t in takeovers if t.get("first_answer_s") is not None]
    detail = (
        "Within the takeover, from the standby's lock grant to taking requests (reported by the replica): "
        f"p50 {MS * statistics.median(grant_to_serving):.1f} ms, max {MS * max(grant_to_serving):.1f} ms"
        + (
            " (p50 from the grant: results fenced "
            + ", ".join(f"{label} {MS * steps[name]:.1f} ms" for name, label in STEP_LABELS if name in steps)
            + ")"
            if steps
            else ""
        )
        + (
            # The replica's clock starts at the grant, the bench's at the SIGKILL: what is left is
            # the SIGKILL to the grant plus taking requests to the first answer, not told apart.
            f"; the rest of SIGKILL-to-first-answer (SIGKILL to the grant, plus taking requests to the "
            f"first answer): p50 {MS * statistics.median(rest):.1f} ms, max {MS * max(rest):.1f} ms"
            if rest
            else ""
        )
        + f". The standby answers first {ratio:.0f}× sooner than a restart without one."
    )
    return table(headers, rows), detail


def described(args: argparse.Namespace, table: str, detail: str) -> str:
    return (
        f"`python -m bench.failover --trials {args.trials} --baseline-trials {args.baseline_trials} "
        f"--clients {args.clients}{' --device cuda' if args.device == 'cuda' else ''}`: a tiny causal LM (2 MB) "
        f"{'on the GPU' if args.device == 'cuda' else 'on a virtual GPU (CPU)'}, {args.clients} clients "
        "sending one-token `/infer/` requests back to back over HTTP (granian), a real node agent and "
        "real replica processes. Time = from the SIGKILL to the first answer served by the replacement; "
        "failed = requests that did not end `done`, over the whole run.\n\n" + table + "\n\n" + detail
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--baseline-trials", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the node agent serves on this machine's GPUs (NVML's) instead of a virtual one",
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda" and not _cuda_available():
        parser.error("--device cuda: torch finds no CUDA device on this machine")
    # Real GPUs: the agent registers the machine's own; a CPU run keeps its one virtual GPU.
    agents: dict[str, str | None] | None = {"bench": None} if args.device == "cuda" else None

    with servers("gpuportal-bench-failover-", "gpuportal_bench_failover") as tmp:
        from bench.report import record
        from inference.management.commands.make_tiny_model import write_tiny_model

        model_dir = write_tiny_model(tmp / "tiny", size_mb=2, seed=5, log=lambda _: None).path
        # The control plane's worker: without a standby, it is what places the replacement.
        with Portal(tmp, web_threads=args.clients + 2, control=True, agents=agents) as portal:
            key = staff_key()
            portal.ready(key)
            standby, grant_to_serving = with_standby(portal, key, model_dir, args.trials, args.clients)
            solo = without_standby(portal, key, model_dir, args.baseline_trials, args.clients)
            table, detail = report(standby, solo, grant_to_serving)
            print("\n" + table + "\n\n" + detail)
            for failure in (standby.failed + solo.failed)[:5]:
                print("failed:", failure)
            if not args.no_record:
                title = "Failover: a standby against a restart, after SIGKILL under load"
                if args.device == "cuda":  # its own section: the CPU figures stay beside it
                    record("failover-gpu", f"{title}, on a GPU", described(args, table, detail))
                else:
                    record("failover", title, described(args, table, detail))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
