"""Waiting for a deployment to reach what was asked of it (serving, or asleep), with a progress
display: a bar per replica on a terminal, a line per change of state anywhere else (a CI log).

The API only says where things are, so this polls the deployment. What counts as done, failed or
stalled is decided by `verdict`, a pure function of one answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from gpuportal.cli import render
from gpuportal.cli.client import Client, CliError
from gpuportal.wire import states
from gpuportal.wire.states import DeploymentStatus
from gpuportal.wire.states import ReplicaState as S

POLL_S = 0.5
# Nothing on its way and the goal not reached, this long: the portal is not going to get there
# (a wake that found no room, a scale whose replicas were preempted) and waiting longer is pointless.
STALL_S = 10.0


@dataclass(frozen=True)
class Goal:
    """`count` replicas in `state`: at least that many (a wake), or exactly (a scale; a sleep is
    exactly 0 serving). A replica's bar fills as it reaches `towards` (by default `state`)."""

    state: str
    count: int
    at_least: bool = False
    towards: str = ""
    # States on their way for this goal besides those in transit: a sleeper told to sleep deeply
    # is one until its process says it is deep asleep.
    moving: frozenset[str] = frozenset()
    # States that count towards `count` as `state` does: a retry starts what a deployment lacks,
    # and its sleepers are not lacking.
    also: frozenset[str] = frozenset()
    # A rolling restart: done once the deployment shows none under way (its `rollout` null), the
    # replicas' counts aside.
    rollout: bool = False

    def describe(self) -> str:
        if self.rollout:
            return "every replica replaced"
        named = " or ".join([self.state, *sorted(self.also)])
        return f"{'at least ' if self.at_least else ''}{self.count} {named}"


@dataclass(frozen=True)
class Verdict:
    outcome: str  # done, failed, waiting, stalled (nothing on its way, goal not reached)
    message: str = ""


def failed_ids(deployment: dict[str, Any]) -> set[str]:
    return {r["id"] for r in deployment.get("replicas", []) if r.get("state") == S.FAILED}


def verdict(deployment: dict[str, Any], goal: Goal, failed_before: set[str]) -> Verdict:
    name = deployment["name"]
    if deployment.get("status") == DeploymentStatus.FAILED:
        return Verdict("failed", f"{name} failed: {deployment.get('failed_reason') or 'no reason given'}")
    live = render.live_replicas(deployment)
    newly_failed = [r for r in live if r.get("state") == S.FAILED and r["id"] not in failed_before]
    if newly_failed:
        replica = newly_failed[0]
        message = f"{name}: replica {render.short_id(replica['id'])} failed: {replica.get('failure_reason') or '?'}"
        if deployment.get("status") == DeploymentStatus.RETRYING:
            message += f"\nthe portal tries again after a backoff: see `gpuportal ls` and `gpuportal events -d {name}`"
        return Verdict("failed", message)
    if goal.rollout and deployment.get("rollout") is not None:
        # Its steps come from the portal's sweep every few seconds, with nothing on its way between
        # two of them: not a stall.
        return Verdict("waiting")
    reached = sum(1 for r in live if r.get("state") == goal.state or r.get("state") in goal.also)
    in_transit = any(r.get("state") in states.IN_TRANSIT or r.get("state") in goal.moving for r in live)
    enough = reached >= goal.count if goal.at_least else reached == goal.count
    if enough and not in_transit:
        return Verdict("done")
    if not in_transit and deployment.get("status") != DeploymentStatus.RETRYING:
        return Verdict("stalled", f"{name}: {render.state_counts(live)}, wanted {goal.describe()}, nothing on its way")
    return Verdict("waiting")


def changes(seen: dict[str, str], deployment: dict[str, Any]) -> list[Text]:
    """A line for each replica whose state is not the one last seen (new ones included); `seen`
    is brought up to date."""
    lines = []
    for replica in deployment.get("replicas", []):
        state = replica.get("state", "?")
        if seen.get(replica["id"]) == state or (replica["id"] not in seen and state == S.STOPPED):
            continue
        seen[replica["id"]] = state
        line = Text(f"{deployment['name']}: ")
        line.append_text(render.replica_line(replica))
        lines.append(line)
    return lines


def bar_percent(replica: dict[str, Any], goal: Goal) -> float | None:
    """How far a replica is towards the goal's state, or None where that is not known (the bar
    pulses): the load's own percent while loading, when the API gives it."""
    state = replica.get("state")
    if state == (goal.towards or goal.state):
        return 100.0
    if state == S.LOADING and replica.get("progress") is not None:
        return float(replica["progress"])
    return None


class Display:
    """A bar per replica on a terminal; elsewhere, nothing but the lines of `changes`."""

    def __init__(self, console: Console, goal: Goal, seen: dict[str, str] | None = None):
        self.console, self.goal = console, goal
        # The state each replica was last printed in: shared by the waits of one command (a deep
        # sleep waits for the sleep, then for the deep sleep), so none is printed twice.
        self.seen: dict[str, str] = {} if seen is None else seen
        self.tasks: dict[str, TaskID] = {}
        self.progress: Progress | None = None
        if console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )

    def __enter__(self) -> Display:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def show(self, deployment: dict[str, Any]) -> None:
        for line in changes(self.seen, deployment):
            self.console.print(line)
        if self.progress is None:
            return
        for replica in render.live_replicas(deployment):
            description = (
                f"{deployment['name']} {render.short_id(replica['id'])} "
                f"{replica.get('state', '?'):<8} {render.placement(replica)}"
            )
            percent = bar_percent(replica, self.goal)
            if replica["id"] not in self.tasks:
                self.tasks[replica["id"]] = self.progress.add_task(description, total=None)
            self.progress.update(
                self.tasks[replica["id"]],
                description=description,
                total=None if percent is None else 100,
                completed=percent or 0,
            )


def wait_for(
    client: Client,
    start: dict[str, Any],
    goal: Goal,
    *,
    console: Console,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
    seen: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Poll the deployment until its verdict is done (its last answer returned); CliError when it
    fails, stalls or runs out of time. `start` is the answer of the call that began the operation:
    replicas already failed then are not this operation's failure. `seen`: the states an earlier
    wait of the same command printed (Display)."""
    name = start["name"]
    failed_before = failed_ids(start)
    began = clock()
    stalled_since: float | None = None
    deployment = start
    with Display(console, goal, seen) as display:
        while True:
            display.show(deployment)
            found = verdict(deployment, goal, failed_before)
            now = clock()
            if found.outcome == "done":
                return deployment
            if found.outcome == "failed":
                raise CliError(found.message)
            if found.outcome == "stalled":
                stalled_since = now if stalled_since is None else stalled_since
                if now - stalled_since >= STALL_S:
                    raise CliError(found.message)
            else:
                stalled_since = None
            if now - began >= timeout_s:
                live = render.state_counts(render.live_replicas(deployment))
                raise CliError(
                    f"{name}: {live} after {timeout_s:.0f} s, wanted {goal.describe()};"
                    " the portal goes on without this command waiting"
                )
            pause(POLL_S)
            deployment = client.get(f"/api/deployments/{name}/")
