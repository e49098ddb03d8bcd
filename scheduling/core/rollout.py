"""A rolling restart's next step: which replica of a deployment is replaced next, and how. Pure (no
ORM), so hypothesis can test it and the simulator could reuse it.

A restart replaces every replica that was started before it was asked for (`since`), so that
settings which apply to replicas placed from now on (`memory.max_tokens`, `memory.override_bytes`,
`placement.spread`) reach all of them, and each process starts afresh, as Kubernetes' `rollout
restart` does; or, for a move (`only`: a drained node's replicas), those alone. One replica at a
time, and serving goes on throughout:

- an awake replica is replaced by a surge: one more replica is placed beside the old ones (the
  deployment's `replicas` unchanged), and only once it serves is the oldest outdated replica
  stopped. Where the surge does not fit, the oldest is stopped first and a replacement placed in
  its room; its requests wait in the queue meanwhile, as they wait for a wake;
- a sleeping replica is parked: its process (or its host copy) goes and it holds nothing, and its
  deployment's next wake loads a new replica from disk. A restart wakes nothing;
- a replica on its way (loading, waking, draining) is waited for, and so is a replacement that
  has not served yet.

A replacement that fails to load leaves the outdated replicas serving: the crash-loop backoff
replaces it, and once the deployment has given up the restart stops (the service's part).

A deployment of failover pairs (seed 004) is restarted a pair at a time, and no pair is ever
left without a member that serves or one ready to take over (`next_pair_step`): its outdated
standby is stopped and a new one started beside the active member; once the new one stands by,
the active steps down to it as in a planned switchover (a takeover, ~145 ms on an H200, with
the requests in flight given back), and the takeover's fresh standby completes the pair. A pair
whose reservation the need has outgrown is replaced by a new pair beside it instead.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from gpuportal.wire.states import ASLEEP, COUNTED, GONE, IN_TRANSIT, STARTING, ReplicaState


class Action(StrEnum):
    DONE = "done"  # nothing outdated is left
    WAIT = "wait"  # something is on its way; the next step comes once it settles
    SURGE = "surge"  # place one replica more; `replica_ids`: the one it replaces
    STOP = "stop"  # stop `replica_ids` (one); a surge serving in its place, or none fitting
    PARK = "park"  # park the outdated sleepers `replica_ids`
    TOP_UP = "top-up"  # place what the deployment lacks of its `replicas` (after a stop with no surge, mostly)
    # Failover pairs: a new standby beside the active `replica_ids[0]`, its outdated standby
    # `replica_ids[1:]` (if any) stopped; then the outdated active `replica_ids` steps down to it.
    STANDBY = "standby"
    SWITCHOVER = "switchover"


@dataclass(frozen=True)
class Member:
    """One of the deployment's replicas, as the step reads it. `pair`: its failover pair (its
    lease), for a deployment of pairs, whose standbys are members too; None elsewhere, where a
    standby is none."""

    id: str
    state: str
    created_at: datetime
    pair: int | None = None


@dataclass(frozen=True)
class Step:
    action: Action
    replica_ids: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Progress:
    """How far a restart is: replicas of the deployment started since it was asked for, and those
    started before it that still hold a process, a copy or a reservation."""

    replaced: int
    left: int


def outdated(members: Sequence[Member], since: datetime, only: Collection[str] | None = None) -> list[Member]:
    """The replicas a restart asked for at `since` has still to replace, oldest first. A parked one
    holds nothing and its next wake is a new replica already; an ended one is gone. `only`: a
    move's replicas (those on a drained node), the others left as they are."""
    return sorted(
        (
            m
            for m in members
            if m.created_at < since
            and m.state not in GONE
            and m.state != ReplicaState.PARKED
            and (only is None or m.id in only)
        ),
        key=lambda m: (m.created_at, m.id),
    )


def progress(members: Sequence[Member], since: datetime, only: Collection[str] | None = None) -> Progress:
    fresh = sum(1 for m in members if m.created_at >= since and m.state not in GONE)
    return Progress(replaced=fresh, left=len(outdated(members, since, only)))


def next_step(
    members: Sequence[Member], *, since: datetime, surge_id: str, wanted: int, only: Collection[str] | None = None
) -> Step:
    """What the restart asked for at `since` does next. `surge_id`: the replica it placed ahead of
    the one it replaces ("" if none); `wanted`: the deployment's `replicas`; `only`: a move's
    replicas, the only ones it replaces."""
    old = outdated(members, since, only)
    surge = next((m for m in members if m.id == surge_id and m.state not in GONE), None)
    if surge is not None and surge.state in STARTING:
        return Step(Action.WAIT, (surge.id,), f"replacement {surge.id[:8]} is {surge.state}")
    moving = [m for m in old if m.state in IN_TRANSIT]
    if moving:
        return Step(Action.WAIT, (moving[0].id,), f"replica {moving[0].id[:8]} is {moving[0].state}")
    starting = [m for m in members if m.created_at >= since and m.state in STARTING]
    if starting:
        return Step(Action.WAIT, (starting[0].id,), f"replacement {starting[0].id[:8]} is {starting[0].state}")
    # Before the end too: the last replica may have gone first for want of room for a surge.
    if sum(1 for m in members if m.state in COUNTED) < wanted:
        return Step(Action.TOP_UP, why="the deployment lacks a replica (one stopped before its replacement)")
    if not old:
        return Step(Action.DONE, why="every replica started before the restart is replaced")
    awake = [m for m in old if m.state == ReplicaState.SERVING]
    asleep = [m for m in old if m.state in ASLEEP]
    if surge is not None:
        # The surge serves (or has served and slept): the replica it was placed for goes, awake
        # ones first (an outdated one may have slept meanwhile: then a sleeper goes, since the
        # surge already counts in its place).
        target = (awake or asleep or old)[0]
        return Step(Action.STOP, (target.id,), f"replacement {surge.id[:8]} serves in its place")
    if awake:
        return Step(Action.SURGE, (awake[0].id,), f"replica {awake[0].id[:8]} started before the restart")
    if asleep:
        return Step(Action.PARK, tuple(m.id for m in asleep), "asleep: its next wake loads a new replica")
    # Outdated, but neither awake, asleep nor on its way (a standby's state, which only a deployment
    # of pairs has, and next_pair_step restarts those): nothing this step can do.
    return Step(Action.WAIT, (old[0].id,), f"replica {old[0].id[:8]} is {old[0].state}")


def next_pair_step(
    members: Sequence[Member],
    *,
    since: datetime,
    surge_id: str = "",
    short: Collection[int] = (),
    only: Collection[str] | None = None,
) -> Step:
    """What the restart asked for at `since` does next in a deployment of failover pairs: one pair
    at a time, oldest first, and only while nothing of the deployment is on its way and every pair
    has a member serving, so every other pair keeps its standby throughout. A pair with no member
    serving (its standby about to take over, its primary loading) is waited for, and so the
    restart ends only once its last takeover is done; the reconcile replaces a pair lost whole.

    A pair in `short` (its reservation is less than the deployment needs now: a new standby could
    not wake into it) is not restarted in place: a whole new pair is placed beside it (a surge,
    `surge_id` its primary), and once that one serves and stands by, the old pair stops whole. A
    move (`only`: the pairs of a drained node) replaces its pairs so, since a new standby in
    place would sit on the same GPUs, and leaves the others as they are."""
    moving = [m for m in members if m.state in IN_TRANSIT]
    if moving:
        return Step(Action.WAIT, (moving[0].id,), f"replica {moving[0].id[:8]} is {moving[0].state}")
    pairs: dict[object, list[Member]] = {}
    for m in sorted(members, key=lambda m: (m.created_at, m.id)):
        pairs.setdefault(m.pair if m.pair is not None else m.id, []).append(m)
    # New pairs too: a switchover's standby has yet to take over.
    unserved = next((p for p in pairs.values() if all(m.state != ReplicaState.SERVING for m in p)), None)
    if unserved is not None:
        return Step(Action.WAIT, (unserved[0].id,), f"pair of {unserved[0].id[:8]} has no member serving")
    surge = next((m for m in members if m.id == surge_id), None)
    for pair in pairs.values():
        if all(m.created_at >= since for m in pair):
            continue
        if only is not None and not any(m.id in only for m in pair):
            continue
        active = next(m for m in pair if m.state == ReplicaState.SERVING)
        standby = next((m for m in pair if m.state == ReplicaState.STANDBY), None)
        if active.pair in short or only is not None:
            return _pair_surge_step(pairs, active, surge)
        if standby is None:
            return Step(Action.STANDBY, (active.id,), f"replica {active.id[:8]} has no standby")
        if standby.created_at < since:
            return Step(Action.STANDBY, (active.id, standby.id), f"standby {standby.id[:8]} started before the restart")
        if active.created_at < since:
            return Step(
                Action.SWITCHOVER, (active.id,), f"its new standby {standby.id[:8]} stands by to take over from it"
            )
        # Both members new, and an outdated one neither serving, standing by nor on its way.
        stuck = next(m for m in pair if m.created_at < since)
        return Step(Action.WAIT, (stuck.id,), f"replica {stuck.id[:8]} is {stuck.state}")
    return Step(Action.DONE, why="every replica started before the restart is replaced")


def _pair_surge_step(pairs: dict[object, list[Member]], active: Member, surge: Member | None) -> Step:
    """The next step for a pair replaced by a new pair beside it (its reservation is short)."""
    if surge is None:
        why = f"the pair of {active.id[:8]} reserves less than the deployment needs now: a new pair goes beside it"
        return Step(Action.SURGE, (active.id,), why)
    # Every pair has a member serving here (next_pair_step waited for that), the surge's too.
    placed = pairs[surge.pair if surge.pair is not None else surge.id]
    serving = next(m for m in placed if m.state == ReplicaState.SERVING)
    if not any(m.state == ReplicaState.STANDBY for m in placed):
        return Step(Action.STANDBY, (serving.id,), f"replica {serving.id[:8]} has no standby")
    return Step(Action.STOP, (active.id,), f"the new pair of {surge.id[:8]} serves and stands by in its place")
