"""Failover pairs (seed 004): an active replica and a sleeping standby on the same GPUs, sharing
one lock on their node (inference.failover) whose holder is the only member with weights on the GPU.

What the control plane does around the lock, which itself needs none of it to fail over:
- pairs up a newly placed replica of a failover deployment (a FailoverLease and a standby);
- keeps the ledger true as members come and go: the pair's reservation is held by its active
  member's occupant, and passes to the standby the moment the active is gone (never released in
  between, so no placement can take the memory the standby is about to wake into);
- records each grant, loss and takeover with its epoch, refuses reports that carry a stale epoch,
  and starts a fresh standby after a takeover so the pair is whole again;
- a planned switchover: the active drains (the preemption barrier) and exits; the standby takes over.

Lock order, as everywhere: the deployment row, then GPU rows (the ledger), then replica rows.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from scheduling import ledger, locks
from scheduling.core import effects
from scheduling.core.state import Plan, Release, Reservation, Snapshot
from scheduling.models import Deployment, Event, FailoverLease, FailoverState, Replica
from scheduling.services import outbox
from scheduling.services import replicas as replica_services
from scheduling.services.errors import InvalidState

log = logging.getLogger(__name__)


# -- pairing -------------------------------------------------------------------------------------


def pair_up(deployment: Deployment, primary: Replica) -> Replica:
    """Give a newly placed replica its lease and a standby on the same GPUs (inside the placement's
    commit; the caller dispatches the primary). The pair's reservation stays on the primary."""
    slot = (FailoverLease.objects.filter(deployment=deployment).aggregate(m=Max("slot"))["m"] or 0) + 1
    lease = FailoverLease.objects.create(deployment=deployment, slot=slot)
    primary.lease = lease
    primary.role = Replica.Role.PRIMARY
    replica_services.set_failover_state_of(primary, FailoverState.INIT)
    primary.save(update_fields=["lease", "role", "failover_state", "updated_at"])
    return start_standby(lease, primary, reason=f"pair {slot} of {deployment.name}: standby for {primary.id[:8]}")


def start_standby(lease: FailoverLease, active: Replica, *, reason: str) -> Replica:
    """A fresh standby beside `active`: it will load the same weights into host memory and wait."""
    standby = Replica.objects.create(
        deployment_id=lease.deployment_id,
        node=active.node,
        role=Replica.Role.STANDBY,
        lease=lease,
        failover_state=FailoverState.INIT,
        # What it wakes into when it takes over: the pair's GPUs and bytes.
        gpu_mem_bytes_by_id=dict(active.gpu_mem_bytes_by_id),
        gpu_memory_fraction=active.gpu_memory_fraction,
    )
    deployment_name = Deployment.objects.values_list("name", flat=True).get(pk=lease.deployment_id)
    outbox.note(
        Event.Kind.REPLICA_STATE,
        f"replica {standby.id[:8]}",
        f"standby placed beside {active.id[:8]} on its GPUs {sorted(active.gpu_mem_bytes_by_id)}: {reason}",
        after={"state": standby.state, "role": standby.role, "lease": lease.pk},
        node=active.node.name if active.node else "",
        deployment=deployment_name,
        replica=standby.id,
    )
    if active.node is not None:
        outbox.want(effects.start(active.node.name, standby.id, []))
    return standby


def failed_standbys(lease_id: int) -> int:
    """How many of the pair's standbys failed in the last hour: past GPUPORTAL_MAX_RESTARTS_PER_HOUR
    none is started again, rather than one a crash loop."""
    since = timezone.now() - timedelta(hours=1)
    return Replica.objects.filter(
        lease=lease_id, state=Replica.State.FAILED, role=Replica.Role.STANDBY, updated_at__gte=since
    ).count()


def close_pairs(replica_ids: set[str]) -> int:
    """Record the leases of these members closed (their pairs are being stopped whole), inside the
    stop's transaction; the stops it sends close the lock on the node (StopReplica.close_pair), so
    a standby granted the lock as its active member exits leaves it. Leases are written after the
    replica rows (the lock order). Returns how many were closed."""
    leases = Replica.objects.filter(id__in=replica_ids, lease__isnull=False).values("lease_id")
    return FailoverLease.objects.filter(id__in=leases, closed_at__isnull=True).update(closed_at=timezone.now())


def partners(replica_ids: set[str]) -> set[str]:
    """The other members of these replicas' pairs that still run: they stop with them."""
    leases = Replica.objects.filter(pk__in=replica_ids, lease__isnull=False).values_list("lease_id", flat=True)
    return set(
        Replica.objects.filter(lease__in=list(leases))
        .exclude(state__in=(Replica.State.STOPPED, Replica.State.FAILED))
        .values_list("pk", flat=True)
    ) - set(replica_ids)


# -- a planned switchover ------------------------------------------------------------------------


def switchover(name: str, *, reason: str = "planned switchover by an operator") -> list[str]:
    """Every pair of the deployment: the active member drains and exits, its standby takes over.
    Returns the ids of the members asked to step down. 409 if a pair has no standby ready."""
    with transaction.atomic():
        deployment = locks.lock_deployment(name)
        if not deployment.failover_standby:
            raise InvalidState(f"deployment {name} has no failover standby (failover.standby is false)")
        actives = locks.lock_replicas(
            Replica.objects.select_related("node", "deployment").filter(
                deployment=deployment, lease__isnull=False, state=Replica.State.SERVING
            )
        )
        if not actives:
            raise InvalidState(f"deployment {name} has no serving replica to switch over")
        for active in actives:
            if not Replica.objects.filter(lease=active.lease_id, state=Replica.State.STANDBY).exists():
                raise InvalidState(
                    f"replica {active.id} has no standby ready to take over (its standby is still loading, "
                    "or gone); try again once it stands by"
                )
        for active in actives:
            step_down(deployment, active, reason=reason)
    return [a.id for a in actives]


def step_down(deployment: Deployment, active: Replica, *, reason: str) -> None:
    """The pair's active member drains and exits; its standby takes over on the lock. The caller
    holds the deployment's row and the active's, and has seen a standby stand by."""
    # Draining, not stopping: when it exits, the pair's reservation passes to the standby.
    replica_services.set_state(active, Replica.State.DRAINING, f"{reason}: stepping down for its standby")
    outbox.note(
        Event.Kind.FAILOVER_SWITCHOVER,
        f"replica {active.id[:8]}",
        f"{reason}: drains for up to {deployment.drain_timeout_s:g} s and exits; its standby takes over",
        node=active.node.name if active.node else "",
        deployment=deployment.name,
        replica=active.id,
    )
    if active.node is not None:
        outbox.want(effects.stop(active.node.name, active.id))


def renew_standby(active: Replica, outdated: list[Replica], *, reason: str) -> Replica:
    """A new standby beside the pair's active member, and its `outdated` standbys stopped alone:
    the pair goes on (its lock stays open, so the stop closes nothing), and until the new one
    stands by the pair has no standby, as after a standby's crash. A standby holds none of the
    pair's reservation (the active does), so nothing is released. The caller holds the
    deployment's row and these replicas' rows."""
    for standby in outdated:
        replica_services.set_state(standby, Replica.State.STOPPING, f"stopping: {reason}")
        if standby.node is not None:
            outbox.want(effects.stop(standby.node.name, standby.id, drain_timeout_s=0))
    lease = FailoverLease.objects.get(pk=active.lease_id)
    return start_standby(lease, active, reason=reason)


# -- the ledger ----------------------------------------------------------------------------------


def hand_over(successor: Replica, from_ids: list[str]) -> None:
    """The pair's reservation moves, in one commit, from `from_ids` to `successor`: on each GPU the
    successor holds what they held (at least its own wake target), never more than is there."""
    successor_id = successor.id
    node = successor.node.name if successor.node else None
    target = {int(k): int(v) for k, v in successor.gpu_mem_bytes_by_id.items()}
    leaving = set(from_ids)

    def decide(snap: Snapshot) -> Plan | None:
        releases, reservations = [], []
        for gpu in snap.index.on_node.get(node, ()):  # its node's GPUs, without a walk of every GPU
            held_by_old = sum(o.reserved_bytes for o in gpu.occupants if o.replica_id in leaving)
            held = next((o.reserved_bytes for o in gpu.occupants if o.replica_id == successor_id), 0)
            releases += [Release(gpu.id, o.replica_id) for o in gpu.occupants if o.replica_id in leaving]
            wanted = max(held_by_old, target.get(gpu.index, 0)) if gpu.index in target else held
            if wanted != held:
                reservations.append(
                    Reservation(gpu.id, successor_id, min(wanted, held + held_by_old + gpu.available_bytes))
                )
        if not releases and not reservations:
            return None
        return Plan.against(snap, f"failover: pair reservation passes to {successor_id[:8]}", reservations, releases)

    ledger.commit_with_retry(decide)


def set_failover_state(replica: Replica, state: str, reason: str, *, extra: list[str] | None = None) -> None:
    before = replica.failover_state
    replica_services.set_failover_state_of(replica, state)
    replica.save(update_fields=["failover_state", "updated_at", *(extra or [])])
    if before == state:
        return
    outbox.note(
        Event.Kind.FAILOVER_STATE,
        f"replica {replica.id[:8]}",
        reason,
        before={"failover_state": before},
        after={"failover_state": state},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )
