"""Scaling a deployment: bring its awake replicas to the count asked for."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from scheduling import events, hot_sql, locks
from scheduling.models import Deployment, Event, Replica
from scheduling.placement import CachedReplica
from scheduling.services.errors import InvalidInput
from scheduling.services.placing import AWAKE, GONE, PLAIN_COUNTED, add_replicas, retire_parked, stop_replicas


@dataclass(frozen=True)
class _Census:
    """A deployment's replicas, read in one query for a scale call: what it counts awake, what it
    may promote, whether any is parked, and each replica's state and node for a stop."""

    awake: list[str]  # newest first, failover standbys left out (they go with their active member)
    cached: tuple[CachedReplica, ...]
    parked: bool
    rows: dict[str, tuple[str, str | None]]  # replica id → (state, node name)

    @classmethod
    def locking(cls, name: str) -> tuple[Deployment, _Census]:
        """The deployment's row locked, and its census."""
        deployment, (rows,) = locks.lock_deployment_reading(name, (_CENSUS_SQL, [name]))
        awake, cached, parked, by_id = [], [], False, {}
        for replica_id, state, role, node in rows:
            by_id[replica_id] = (state, node)
            if state in AWAKE and role != Replica.Role.STANDBY:
                awake.append(replica_id)
            elif state == Replica.State.SLEEPING and node is not None:
                cached.append(CachedReplica(replica_id, node))
            parked = parked or state == Replica.State.PARKED
        return deployment, cls(awake=awake, cached=tuple(cached), parked=parked, rows=by_id)


# Not the gone ones: nothing here counts or stops them, and their rows pile up until swept.
_CENSUS_SQL = (
    "SELECT r.id, r.state, r.role, n.name FROM scheduling_replica r "
    "LEFT JOIN scheduling_node n ON n.id = r.node_id "
    "WHERE r.deployment_id = (SELECT id FROM scheduling_deployment WHERE name = %s) "
    f"AND r.state NOT IN ({', '.join(repr(str(state)) for state in GONE)}) "
    "ORDER BY r.created_at DESC"
)


@locks.retry_deadlocks
def scale(name: str, replicas: int, *, reason: str = "scaled by an operator") -> Deployment:
    """Bring the number of awake replicas to `replicas`: cached ones are promoted before new ones
    are created; scaling down stops the most recently started first (they have served least)."""
    if replicas < 0:
        raise InvalidInput("replicas", "must be 0 or more")
    # Its Events are written in one statement at the end (nothing inside catches and goes on).
    with transaction.atomic(), events.gathered():
        # The deployment row lock serialises scale operations of one deployment, so the census
        # read with it stays true until the commit.
        deployment, census = _Census.locking(name)
        awake = census.awake
        before = deployment.replicas_wanted
        if replicas > len(awake):
            add_replicas(
                deployment,
                replicas - len(awake),
                reason=f"{reason}: {len(awake)} → {replicas}",
                cached=census.cached,
                parked=census.parked,
            )
        elif replicas < len(awake):
            stopping = awake[: len(awake) - replicas]
            stop_replicas(
                deployment,
                stopping,
                reason=f"{reason}: {len(awake)} → {replicas}",
                known={replica_id: census.rows[replica_id] for replica_id in stopping},
            )
        deployment.replicas_wanted = replicas
        hot_sql.update(deployment, ["replicas_wanted"])
        if census.parked:
            # Parked replicas beyond the new count are wanted no more.
            surplus = deployment.replicas.filter(PLAIN_COUNTED).count() - replicas
            retire_parked(deployment, surplus, reason=f"{reason}: no longer wanted")
        if before != replicas:
            events.record(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                f"{reason}: {before} → {replicas} replica(s)",
                before={"replicas": before},
                after={"replicas": replicas},
                deployment=name,
            )
    return deployment
