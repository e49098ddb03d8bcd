"""The state machines both planes speak: a replica's states, their named groups and the
transitions allowed between them; a deployment's status; a failover member's role.

The one place these names are written. The model's choices, the services' state changes, the
pure decisions, the simulator, the replica process, the CLI, the dashboard and the metrics import
them from here (a test holds every other module to it), and the state diagram in
docs/architecture.md is generated from `TRANSITIONS` (`python -m gpuportal.wire.states`).
Django-free, like the rest of the contract.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path


class ReplicaState(StrEnum):
    """Where a replica is in its life, as the control plane's books hold it."""

    # Placed (memory reserved on its GPUs), its process not yet reporting.
    PENDING = "pending"
    # Its process loads the weights from disk (progress in percent).
    LOADING = "loading"
    # Takes requests.
    SERVING = "serving"
    # Finishes what it took, then moves its weights to host memory (a sleep or an eviction).
    DRAINING = "draining"
    # Weights in the node's host cache; its process keeps only its CUDA context on the GPU.
    SLEEPING = "sleeping"
    # Weights on their way back from host memory to the GPU.
    WAKING = "waking"
    # A failover pair's second member: loaded, warm, waiting to take over from the active one.
    STANDBY = "standby"
    # Told to stop: it finishes what it took, then its process exits.
    STOPPING = "stopping"
    # Its process exited as asked. Ended: nothing leaves this state.
    STOPPED = "stopped"
    # Its process died or could not load; a replacement is a new replica.
    FAILED = "failed"
    # Wanted, but its weights are nowhere: it left a full host cache, and its next wake loads
    # it from disk. No process, no node, no reservation.
    PARKED = "parked"
    # Deep asleep: its weights wait in its node's host memory (a host copy its agent owns), its
    # process has exited and it holds no GPU memory. A wake starts a process on that node that
    # copies them back (waking), never reading the disk.
    DEEP_SLEEPING = "deep_sleeping"


S = ReplicaState

# A replica process's own state before it begins to load; the books count it as pending. Past
# that, a process speaks the books' names (loading, serving, draining, ...).
PROCESS_STARTING = "starting"

# -- named groups ---------------------------------------------------------------------------------

# On their way to serving: a placement counts them as coming, fairness never preempts them.
STARTING = frozenset({S.PENDING, S.LOADING, S.WAKING})
# Serving or on their way to it: what a waiting request may be answered by without a wake.
AWAKE = STARTING | {S.SERVING}
# Awake or draining: each may still answer a request it took, and holds its GPU memory whole.
ACTIVE = AWAKE | {S.DRAINING}
# Weights on the GPU in full, serving or finishing what they took: what serving is measured on.
HOLDING_WEIGHTS = frozenset({S.SERVING, S.DRAINING})
# Weights in (or on their way to) the node's host cache.
IN_HOST_CACHE = frozenset({S.SLEEPING, S.DRAINING, S.STANDBY, S.DEEP_SLEEPING})
# Asleep at either level: weights in the node's host memory, waiting for a wake on that node.
ASLEEP = frozenset({S.SLEEPING, S.DEEP_SLEEPING})
# Process gone for good. Nothing leaves these but a row's removal.
ENDED = frozenset({S.STOPPED, S.FAILED})
# Process gone or going: they hold no reservation the placement may count on.
GONE = ENDED | {S.STOPPING}
# A process of their own on their node, holding host RAM (scheduling.core.host_memory): awake,
# draining, asleep, standing by or still stopping.
WITH_PROCESS = ACTIVE | {S.SLEEPING, S.STANDBY, S.STOPPING}
# Count toward a deployment's replicas: serving, asleep, or on the way to either (a parked
# replica is still wanted: its next wake loads it). A failover standby is its active member's.
COUNTED = ACTIVE | {S.SLEEPING, S.DEEP_SLEEPING, S.PARKED}
# A failover member that can take over: loading or loaded and standing by.
READY_TO_TAKE_OVER = frozenset({S.PENDING, S.LOADING, S.STANDBY, S.WAKING})
# Moving between two resting states: shown as in transit by the CLI and the dashboard.
IN_TRANSIT = frozenset({S.PENDING, S.LOADING, S.WAKING, S.DRAINING, S.STOPPING})
# The awake states, the one nearest to serving first: what a waiting request's estimate reads.
AWAKE_NEAREST_FIRST: tuple[ReplicaState, ...] = (S.SERVING, S.WAKING, S.LOADING, S.PENDING)
# The order a list of replicas is shown in: serving first, ended last.
DISPLAY_ORDER: tuple[ReplicaState, ...] = (
    S.SERVING,
    S.STANDBY,
    S.SLEEPING,
    S.DEEP_SLEEPING,
    S.PENDING,
    S.LOADING,
    S.WAKING,
    S.DRAINING,
    S.STOPPING,
    S.PARKED,
    S.FAILED,
    S.STOPPED,
)

# -- transitions ----------------------------------------------------------------------------------

# Any replica with a process may be told to stop, may exit, and may die; one whose CUDA context
# broke (a device-side assert) restarts in place: back to pending, its reservation kept.
_MAY_END = frozenset({S.STOPPING, S.STOPPED, S.FAILED})
_RESTARTS = frozenset({S.PENDING})

TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    # Serving straight from pending: a process that loaded before its progress was heard, or a
    # failover standby taking over before it stood by.
    S.PENDING: _MAY_END | {S.LOADING, S.SERVING, S.STANDBY},
    S.LOADING: _MAY_END | _RESTARTS | {S.SERVING, S.STANDBY},
    # Sleeping with no drain in the books: its process says it sleeps (its report is the truth of
    # where its weights are).
    S.SERVING: _MAY_END | _RESTARTS | {S.DRAINING, S.SLEEPING},
    S.DRAINING: _MAY_END | _RESTARTS | {S.SLEEPING},
    # Draining again: evicted from a GPU a whole-GPU replica takes, it is told to sleep once more
    # and its report gives back what it held there. Parked: left a full host cache. Deep asleep:
    # its process wrote its weights to the node's host memory and exited.
    S.SLEEPING: _MAY_END | {S.WAKING, S.PARKED, S.DRAINING, S.DEEP_SLEEPING},
    # Back to sleeping: a process whose wake never reached it says it still sleeps.
    S.WAKING: _MAY_END | _RESTARTS | {S.SERVING, S.SLEEPING},
    # Serving: it took the pair's lock over and woke.
    S.STANDBY: _MAY_END | _RESTARTS | {S.SERVING},
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    # Its process exits after all, or its deployment is deleted; its row stays until collected.
    S.FAILED: frozenset({S.STOPPING, S.STOPPED}),
    # No process: a wake starts one (waking, on its node: the host copy is there); a full host
    # cache parks it; a scale-down or a delete stops it (its agent deletes the copy).
    S.DEEP_SLEEPING: frozenset({S.WAKING, S.PARKED, S.STOPPING, S.STOPPED}),
    # A parked replica is never placed again: a load from disk is a new replica, and the parked
    # one is retired (stopped), or stopped with its deployment.
    S.PARKED: frozenset({S.STOPPING, S.STOPPED}),
}


class IllegalTransition(ValueError):
    """A state change the table does not allow."""

    def __init__(self, before: str, after: str):
        self.before, self.after = before, after
        super().__init__(f"a replica cannot go from {before} to {after}")


def allowed(before: str, after: str) -> bool:
    """Whether a replica may go from `before` to `after`. Staying put is always allowed: a report
    said again (an agent's resync) changes nothing."""
    if before == after:
        return True
    return ReplicaState(after) in TRANSITIONS[ReplicaState(before)]


def check(before: str, after: str) -> None:
    """Raise IllegalTransition unless `allowed(before, after)`."""
    if not allowed(before, after):
        raise IllegalTransition(before, after)


def sits_on(state: str, occupied: Iterable[int], held_by_index: Iterable[str | int]) -> list[int]:
    """The indexes of the GPUs a replica's process sits on: those it occupies; for a standby,
    which reserves nothing of its own (its context is in its pair's reservation), those its
    process holds memory on, the GPUs it would take over. How `gpuportal ps` and the dashboard
    name where it is."""
    indexes = sorted(int(i) for i in occupied)
    if not indexes and state == ReplicaState.STANDBY:
        indexes = sorted(int(i) for i in held_by_index)
    return indexes


def names(states: Iterable[ReplicaState]) -> list[str]:
    """Plain strings, for a query parameter or raw SQL."""
    return [str(s) for s in states]


# -- a node's status ------------------------------------------------------------------------------


class NodeStatus(StrEnum):
    """Whether placement may use a node: its agent beats (online), an operator took it out of
    service (draining: nothing new lands there, what serves there sleeps), or it went silent,
    stopped or was written off (offline)."""

    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


# -- a deployment's status ------------------------------------------------------------------------


class DeploymentStatus(StrEnum):
    """What its loads came to: fine, replacing a failed load after a backoff, or given up."""

    OK = "ok"
    RETRYING = "retrying"
    FAILED = "failed"


class Rollout(StrEnum):
    """A rolling restart's turns, as its `deployment.changed` Events carry them (`after.rollout`):
    how a command that waited for one tells an end short of its goal from its end."""

    BEGAN = "began"
    DONE = "done"
    STOPPED = "stopped"  # short of replacing every replica: the Event's reason says why


# -- failover -------------------------------------------------------------------------------------


class Role(StrEnum):
    """A replica's part in its deployment: the one that serves, or a failover pair's standby."""

    PRIMARY = "primary"
    STANDBY = "standby"


class FailoverState(StrEnum):
    """Liveness by state: what a failover pair member is doing, as it reports it."""

    INIT = "init"
    STANDBY = "standby"
    WAKING = "waking"
    ACTIVE = "active"
    DEAD = "dead"


# A member's way through a takeover: it starts, stands by (or, finding the lock free, is active
# at once), wakes when it takes the lock over, and serves; dead from anywhere (its process gone,
# its lock passed on). A new standby is a new replica, so nothing comes back from dead or active.
FAILOVER_TRANSITIONS: dict[FailoverState, frozenset[FailoverState]] = {
    FailoverState.INIT: frozenset(
        {FailoverState.STANDBY, FailoverState.WAKING, FailoverState.ACTIVE, FailoverState.DEAD}
    ),
    FailoverState.STANDBY: frozenset({FailoverState.WAKING, FailoverState.ACTIVE, FailoverState.DEAD}),
    FailoverState.WAKING: frozenset({FailoverState.ACTIVE, FailoverState.DEAD}),
    FailoverState.ACTIVE: frozenset({FailoverState.DEAD}),
    FailoverState.DEAD: frozenset(),
}


def failover_allowed(before: str, after: str) -> bool:
    """Whether a pair member may go from `before` to `after` ("" : not yet a member)."""
    if before == after or not before:
        return True
    return FailoverState(after) in FAILOVER_TRANSITIONS[FailoverState(before)]


# -- a capacity plan ------------------------------------------------------------------------------


class PlanState(StrEnum):
    """How far a capacity plan asked of the control worker has got."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# -- the diagram ----------------------------------------------------------------------------------


def mermaid() -> str:
    """The replica state diagram (Mermaid), drawn from TRANSITIONS: docs/architecture.md holds it."""
    lines = ["stateDiagram-v2", f"    [*] --> {S.PENDING}"]
    for before in ReplicaState:
        for after in sorted(TRANSITIONS[before], key=list(ReplicaState).index):
            lines.append(f"    {before} --> {after}")
    lines.extend(f"    {s} --> [*]" for s in sorted(ENDED, key=list(ReplicaState).index))
    return "\n".join(lines) + "\n"


def write_docs(path: Path) -> None:
    """Put the diagram between the state-diagram markers of `path` (docs/architecture.md)."""
    text = path.read_text()
    begin, end = "<!-- state-diagram:begin -->\n", "<!-- state-diagram:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}```mermaid\n{mermaid()}```\n{end}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs(Path(__file__).resolve().parents[2] / "docs" / "architecture.md")
    else:
        print(mermaid(), end="")
