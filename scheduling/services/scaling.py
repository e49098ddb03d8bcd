"""Scaling deployments: bring each one's awake replicas to the count asked for (to 0: stop every
replica, the sleeping ones too).

Scale calls that arrive together in one process (the web serves the API on threads of one
process) are committed together (`scheduling.group_commit`): one transaction
locks their deployments in primary-key order and reads their census in one statement, places
every scale-up on one snapshot (each on the snapshot as the ones before it left it, releases of
the scale-downs first), and commits one ledger plan, the new replica rows, the state changes and
the Events in one statement each. A call that cannot be placed fails alone (409) and leaves no
trace; the others commit. A lone call is a batch of one, on the same path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire import node_labels, states
from gpuportal.wire.states import AWAKE, GONE
from scheduling import hot_sql, ledger, locks
from scheduling.core.host_memory import HostView
from scheduling.core.placement import CachedReplica
from scheduling.core.planning import plan_of, without_releases
from scheduling.core.state import Plan, Snapshot
from scheduling.group_commit import Group
from scheduling.models import Deployment, Event, Replica
from scheduling.services import not_found, outbox, placing
from scheduling.services.errors import CannotPlace, InvalidInput, InvalidState
from scheduling.services.placing import (
    PLAIN_COUNTED,
    Ask,
    Stop,
    apply_placements,
    apply_stops,
    releases_of,
    retire_parked,
)

# The most calls one batch holds: enough for every thread of the web (16) and then some; a
# longer batch would make its first caller wait for the last one's placement.
BATCH_LIMIT = 32
# How long a batch's leader waits to gather as many calls as its last batch held (group_commit):
# a caller answered by a batch is back within 1 ms (a thread's wake-up and its next call), and a
# lone caller never waits for it.
GATHER_S = 0.001


@dataclass(frozen=True)
class ScaleIntent:
    name: str
    replicas: int
    reason: str
    # The count the caller decided from (the autoscaler): another count found under the lock
    # means someone scaled it since, and this intent changes nothing (compare-and-swap).
    expected: int | None = None
    # False: stop awake replicas beyond the count, but wake or place none (the autoscaler's
    # scale-down: a deployment whose replicas fell asleep is not woken by its load falling).
    wake: bool = True


@dataclass(frozen=True)
class _Census:
    """A deployment's replicas, read for a scale call under its lock: what it counts awake, what
    it may promote, whether any is parked, and each replica's state and node for a stop."""

    awake: list[str]  # newest first, failover standbys left out (they go with their active member)
    cached: tuple[CachedReplica, ...]
    parked: bool
    rows: dict[str, tuple[str, str | None]]  # replica id → (state, node name)
    host_bytes: int = 0  # the most host RAM one of its processes was measured holding

    @classmethod
    def of(cls, rows: Sequence[tuple]) -> _Census:
        awake, cached, parked, by_id, most = [], [], False, {}, 0
        for replica_id, state, role, node, host_bytes in rows:
            by_id[replica_id] = (state, node)
            most = max(most, host_bytes)
            if state in AWAKE and role != Replica.Role.STANDBY:
                awake.append(replica_id)
            elif state in states.ASLEEP and node is not None:
                cached.append(CachedReplica(replica_id, node))
            parked = parked or state == Replica.State.PARKED
        return cls(awake=awake, cached=tuple(cached), parked=parked, rows=by_id, host_bytes=most)


@functools.cache
def _census_sql() -> str:
    # Built once: every batch of scale calls runs it.
    return hot_sql.statement("scale_census", gone=", ".join(repr(state) for state in states.names(sorted(GONE))))


@dataclass
class _Scaling:
    """One call of a batch, as the batch read it under its deployment's lock."""

    intent: ScaleIntent
    deployment: Deployment
    census: _Census
    ask: Ask | None = None  # the replicas it adds
    stop: Stop | None = None  # the replicas it stops
    error: CannotPlace | None = None
    before: int = 0  # the replicas it wanted before

    @property
    def why(self) -> str:
        return f"{self.intent.reason}: {len(self.census.awake)} → {self.intent.replicas}"


def scale(
    name: str,
    replicas: int,
    *,
    reason: str = "scaled by an operator",
    expected: int | None = None,
    wake: bool = True,
) -> Deployment:
    """Bring the number of awake replicas to `replicas`: cached ones are promoted before new ones
    are created; scaling down stops the most recently started first (they have served least), and
    scaling to 0 stops the sleeping ones too.
    With `expected`, only if the deployment still wants that many (InvalidState if not). With
    `wake=False`, at most `replicas` awake: fewer are left as they are."""
    if replicas < 0:
        raise InvalidInput("replicas", "must be 0 or more")
    intent = ScaleIntent(name, replicas, reason, expected, wake)
    if transaction.get_connection().in_atomic_block or not settings.GPUPORTAL_SCALE_TOGETHER:
        # In a caller's transaction (an update that scales): what it locked and wrote is its own
        # to commit, so no other call may share it.
        (outcome,) = scale_together([intent])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    return _GROUP.submit(intent)


def _run_batch(intents: list[ScaleIntent]) -> list[Deployment | Exception]:
    try:
        return scale_together(intents)
    except Exception:
        if len(intents) == 1:
            raise
        # A batch that failed whole (a database error, conflicts past the ledger's retries): each
        # call alone, so that each caller gets its own outcome and no call's fault fails another.
        return [_alone(intent) for intent in intents]


def _alone(intent: ScaleIntent) -> Deployment | Exception:
    try:
        return scale_together([intent])[0]
    except Exception as err:
        return err


# One name per batch: two calls for one deployment are ordered by its lock, the second in the
# next batch, as they would be one after the other.
_GROUP: Group[ScaleIntent, Deployment] = Group(
    _run_batch, key=lambda intent: intent.name, limit=BATCH_LIMIT, gather_s=GATHER_S
)


@locks.retry_deadlocks
def scale_together(intents: Sequence[ScaleIntent]) -> list[Deployment | Exception]:
    """Each intent's deployment scaled, in one transaction; per intent, its deployment or the error
    its caller raises (NotFound, CannotPlace: that intent changed nothing). Names are distinct."""
    outcomes: list[_Scaling | Exception] = []
    # Its Events are written in one statement at the end (a call that cannot be placed records
    # nothing before its placement fails).
    with transaction.atomic(), outbox.gathered():
        # The deployment row locks serialise scale operations of each deployment, so the census
        # read with them stays true until the commit.
        read = _locking([intent.name for intent in intents])
        hosts: dict[str, HostView] | None = None
        marks: dict[str, node_labels.Marks] | None = None
        for intent in intents:
            if intent.name not in read:
                outcomes.append(not_found.deployment(intent.name))
                continue
            deployment, census = read[intent.name]
            if intent.expected is not None and deployment.replicas_wanted != intent.expected:
                outcomes.append(
                    InvalidState(
                        f"deployment {intent.name} was scaled meanwhile: it wants {deployment.replicas_wanted} "
                        f"replica(s), not {intent.expected}"
                    )
                )
                continue
            scaling = _Scaling(intent, deployment, census, before=deployment.replicas_wanted)
            if hosts is None and intent.wake and intent.replicas > len(census.awake):
                # Read once for the batch: its asks share the hosts and the nodes' labels and taints.
                selected = any(d.placement_node_selector for d, _ in read.values())
                hosts, marks = placing.host_views(), placing.node_marks(labels=selected)
            _plan_intent(scaling, hosts or {}, marks or {})
            outcomes.append(scaling)
        scalings = [o for o in outcomes if isinstance(o, _Scaling)]
        _commit(scalings)
        done = [s for s in scalings if s.error is None]
        _write_wanted(done)
        for scaling in done:
            _after(scaling)
    return [(o.error or o.deployment) if isinstance(o, _Scaling) else o for o in outcomes]


def _locking(names: list[str]) -> dict[str, tuple[Deployment, _Census]]:
    """The deployments' rows locked (in primary-key order) and their census, by name; a name with
    no deployment is left out."""
    deployments, (rows,) = locks.lock_deployments_reading(names, _census_sql())
    by_id: dict[int, list[tuple]] = {d.pk: [] for d in deployments}
    for deployment_id, *row in rows:
        by_id[deployment_id].append(row)
    return {d.name: (d, _Census.of(by_id[d.pk])) for d in deployments}


def _plan_intent(scaling: _Scaling, hosts: dict[str, HostView], marks: dict[str, node_labels.Marks]) -> None:
    deployment, census, wanted = scaling.deployment, scaling.census, scaling.intent.replicas
    awake = census.awake
    if wanted > len(awake) and scaling.intent.wake:
        scaling.ask = Ask.of(
            deployment,
            wanted - len(awake),
            reason=scaling.why,
            cached=census.cached,
            hosts=hosts,
            host_need=placing.process_need(census.host_bytes),
            marks=marks,
        )
    elif wanted < len(awake) or (wanted == 0 and census.cached):
        stopping, why = awake[: len(awake) - wanted], scaling.why
        if wanted == 0 and census.cached:
            # Scaled to 0, it is stopped: its sleepers too, with the contexts and host copies they
            # hold (as Kubernetes' scale to zero ends every pod). A scale to more keeps them: the
            # cache a wake promotes from, deepened or evicted when their room is wanted.
            stopping = [*stopping, *(c.replica_id for c in census.cached)]
            why += f", its {len(census.cached)} sleeping replica(s) too"
        known = {replica_id: census.rows[replica_id] for replica_id in stopping}
        scaling.stop = Stop.of(deployment, stopping, reason=why, known=known)


def _commit(scalings: list[_Scaling]) -> None:
    """One ledger plan for every scaling's releases and placements; an up that does not fit is
    left out with its error, and the rest commit."""
    stops = [s.stop for s in scalings if s.stop is not None]
    ups = [s for s in scalings if s.ask is not None]

    def decide(snap: Snapshot) -> Plan | None:
        releases = releases_of((replica_id for stop in stops for replica_id in stop.ids), snap)
        # The scale-downs first: their memory is free for the batch's scale-ups, as it would be
        # for a call committed after them.
        current = without_releases(snap, releases)
        now = timezone.now()
        for scaling in ups:
            scaling.error = None
            try:
                current = scaling.ask.place(current, now)  # type: ignore[union-attr]
            except CannotPlace as err:
                scaling.error = err
        placed = [s.ask for s in ups if s.error is None]
        placements = [p for ask in placed for p in ask.decision.placements]  # type: ignore[union-attr]
        if not placements and not releases:
            return None
        return plan_of(snap, placements, releases, _plan_reason(scalings))

    def apply(plan: Plan | None = None) -> None:
        asks = [s.ask for s in ups if s.error is None]
        victims = {e.replica_id for ask in asks for p in ask.decision.placements for e in p.evictions}  # type: ignore[union-attr]
        stopping = {replica_id for stop in stops for replica_id in stop.ids}
        if victims and stopping:
            # Both kinds of replica rows are written below, each kind in primary-key order: taken
            # together first, so the batch holds them in the one global order.
            locks.lock_replica_ids(victims | stopping)
        apply_stops(stops)
        apply_placements(asks)  # type: ignore[arg-type]

    if ledger.commit_with_retry(decide, apply=apply) is None:
        apply()  # nothing was reserved (stopping replicas still pending, or no room): stops all the same


def _plan_reason(scalings: list[_Scaling]) -> str:
    """What the ledger's Events say the batch's reservations and releases were for."""
    moving = [s for s in scalings if s.error is None and (s.ask is not None or s.stop is not None)]
    if len(moving) == 1:
        (scaling,) = moving
        return scaling.ask.plan_reason if scaling.ask is not None else scaling.why
    return "; ".join(f"{s.deployment.name} {s.why}" for s in moving)


def _write_wanted(done: list[_Scaling]) -> None:
    if not done:
        return
    for scaling in done:
        scaling.deployment.replicas_wanted = scaling.intent.replicas
    with hot_sql.cursor() as cursor:
        ids, wanted = [s.deployment.pk for s in done], [s.intent.replicas for s in done]
        cursor.execute(hot_sql.statement("scale_wanted"), [timezone.now(), ids, wanted])


def _after(scaling: _Scaling) -> None:
    """What a committed scaling leaves besides its placements and stops: parked replicas retired
    and its Event."""
    deployment, intent, census = scaling.deployment, scaling.intent, scaling.census
    if census.parked:
        if scaling.ask is not None:
            retire_parked(deployment, scaling.ask.loaded, reason=f"replaced by a load from disk ({scaling.why})")
        # Parked replicas beyond the new count are wanted no more.
        surplus = deployment.replicas.filter(PLAIN_COUNTED).count() - intent.replicas
        retire_parked(deployment, surplus, reason=f"{intent.reason}: no longer wanted")
    before = scaling.before
    if before != intent.replicas:
        outbox.note(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {deployment.name}",
            f"{intent.reason}: {before} → {intent.replicas} replica(s)",
            before={"replicas": before},
            after={"replicas": intent.replicas},
            deployment=deployment.name,
        )
