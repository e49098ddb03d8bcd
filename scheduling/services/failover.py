"""Failover pairs (seed 004): an active replica and a sleeping standby on the same GPUs, sharing
one lock (inference.failover) whose holder is the only member with weights on the GPU.

What the control plane does around the lock, which itself needs none of it to fail over:
- pairs up a newly placed replica of a failover deployment (a FailoverLease and a standby);
- keeps the ledger true as members come and go: the pair's reservation is held by its active
  member's occupant, and passes to the standby the moment the active is gone (never released in
  between, so no placement can take the memory the standby is about to wake into);
- records each grant, loss and takeover with its epoch, refuses reports that carry a stale epoch,
  and starts a fresh standby after a takeover so the pair is whole again;
- a planned switchover: the active drains (the barrier of issue 5) and exits; the standby takes over.

Lock order, as everywhere: the deployment row, then GPU rows (the ledger), then replica rows.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from scheduling import events, ledger, memory
from scheduling.metrics import FAILOVER_SECONDS, FAILOVERS
from scheduling.models import Deployment, Event, FailoverLease, FailoverState, Replica
from scheduling.services import dispatch
from scheduling.services import replicas as replica_services
from scheduling.services.errors import InvalidState
from scheduling.state import Plan, Release, Reservation, Snapshot

log = logging.getLogger(__name__)

# A member that may still take over: its process is starting, loading, or standing by.
READY_TO_TAKE_OVER = (Replica.State.PENDING, Replica.State.LOADING, Replica.State.STANDBY, Replica.State.WAKING)
# The active member's states, as the control plane sees them (draining: a planned switchover).
HOLDING = (Replica.State.SERVING, Replica.State.DRAINING)


# -- pairing -------------------------------------------------------------------------------------


def pair_up(deployment: Deployment, primary: Replica) -> Replica:
    """Give a newly placed replica its lease and a standby on the same GPUs (inside the placement's
    commit; the caller dispatches the primary). The pair's reservation stays on the primary."""
    slot = (FailoverLease.objects.filter(deployment=deployment).aggregate(m=Max("slot"))["m"] or 0) + 1
    lease = FailoverLease.objects.create(deployment=deployment, slot=slot)
    primary.lease = lease
    primary.role = Replica.Role.PRIMARY
    primary.failover_state = FailoverState.INIT
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
    events.record(
        Event.Kind.REPLICA_STATE,
        f"replica {standby.id[:8]}",
        f"standby placed beside {active.id[:8]} on its GPUs {sorted(active.gpu_mem_bytes_by_id)}: {reason}",
        after={"state": standby.state, "role": standby.role, "lease": lease.pk},
        node=active.node.name if active.node else "",
        deployment=deployment_name,
        replica=standby.id,
    )
    if active.node is not None:
        dispatch.to_node(active.node.queue, dispatch.START, standby.id, [])
    return standby


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
    from scheduling.services import deployments

    with transaction.atomic():
        deployment = deployments.get(name, lock=True)
        if not deployment.failover_standby:
            raise InvalidState(f"deployment {name} has no failover standby (failover.standby is false)")
        actives = list(
            Replica.objects.select_for_update(of=("self",))
            .select_related("node", "deployment")
            .filter(deployment=deployment, lease__isnull=False, state=Replica.State.SERVING)
            .order_by("pk")
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
            # Draining, not stopping: when it exits, the pair's reservation passes to the standby.
            replica_services.set_state(active, Replica.State.DRAINING, f"{reason}: stepping down for its standby")
            events.record(
                Event.Kind.FAILOVER_SWITCHOVER,
                f"replica {active.id[:8]}",
                f"{reason}: drains for up to {deployment.drain_timeout_s:g} s and exits; its standby takes over",
                node=active.node.name if active.node else "",
                deployment=name,
                replica=active.id,
            )
            if active.node is not None:
                dispatch.to_node(active.node.queue, dispatch.STOP, active.id)
    return [a.id for a in actives]


# -- reports from pair members, relayed by their node agent -------------------------------------


def is_stale(replica: Replica, event: dict[str, Any]) -> bool:
    """A report carrying an epoch older than the lease's is refused, and says so (invariant 4)."""
    epoch = event.get("epoch")
    if epoch is None or replica.lease_id is None:
        return False
    current = FailoverLease.objects.filter(pk=replica.lease_id).values_list("epoch", flat=True).first()
    if current is None or int(epoch) >= current:
        return False
    events.record(
        Event.Kind.FAILOVER_STALE,
        f"replica {replica.id[:8]}",
        f"refused a {event.get('event')} report at epoch {epoch}: the pair is at epoch {current}",
        before={"epoch": int(epoch)},
        after={"epoch": current},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )
    return True


def on_failover(replica: Replica, event: dict[str, Any]) -> None:
    state = str(event.get("state") or "")
    if state not in FailoverState.values or is_stale(replica, event):
        return
    set_failover_state(replica, state, f"pair member reports {state}")


def on_lease(replica: Replica, event: dict[str, Any]) -> None:
    """The history of the lock: every grant and loss, with its epoch."""
    what = event.get("what")
    epoch = event.get("epoch")
    if what == "grant":
        kind = Event.Kind.FAILOVER_GRANT
        how = "took over" if event.get("took_over") else "re-acquired it and kept its epoch"
        reason = f"lock granted at epoch {epoch}: {how} (previous holder {str(event.get('previous_holder'))[:8]})"
    else:
        kind = Event.Kind.FAILOVER_LOSS
        reason = f"lock lost at epoch {epoch}: {event.get('reason') or 'connection lost'}"
    events.record(
        kind,
        f"replica {replica.id[:8]}",
        reason,
        after={"epoch": epoch},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )
    if what == "grant" and replica.epoch != epoch and epoch is not None:
        Replica.objects.filter(pk=replica.pk).update(epoch=int(epoch))


def on_standby(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state not in (Replica.State.PENDING, Replica.State.LOADING):
        return
    replica.pid = event.get("pid") or replica.pid
    replica.progress = 100
    replica.failover_state = FailoverState.STANDBY
    # A primary that found the lock taken stands by too: whoever holds the lock is the active one.
    replica.role = Replica.Role.STANDBY
    weights = int(event.get("weights_bytes") or 0)
    residual = sum(int(v or 0) for v in (event.get("residual_bytes_by_id") or {}).values())
    # What a real standby holds is its context alone: the pair's reservation counts that figure.
    replica_services.record_context(replica, residual, standby=True)
    replica_services.set_state(
        replica,
        Replica.State.STANDBY,
        f"standing by: {memory.human_bytes(weights)} of weights in host memory, "
        f"{memory.human_bytes(residual)} on its GPU(s); waiting for the pair's lock",
        extra=["pid", "progress", "failover_state", "role"],
    )


def on_serving(replica: Replica, event: dict[str, Any]) -> None:
    """The primary that found the lock free loaded and serves: it is the pair's active member."""
    if is_stale(replica, event):
        return
    replica_services.on_serving(replica, event)
    if event.get("epoch") is not None:
        replica.epoch = int(event["epoch"])
        set_failover_state(replica, FailoverState.ACTIVE, f"active at epoch {replica.epoch}", extra=["epoch"])


def on_active(replica: Replica, event: dict[str, Any]) -> None:
    """The standby took the lock (so the active's process is gone), woke, and serves: a takeover."""
    if is_stale(replica, event) or replica.state not in READY_TO_TAKE_OVER:
        return  # e.g. stopping with its pair: the stop ends it
    deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id)
    epoch = int(event["epoch"])
    olds = list(
        Replica.objects.select_related("node", "deployment")
        .filter(lease=replica.lease_id)
        .exclude(pk=replica.pk)
        .exclude(state__in=(Replica.State.STOPPED, Replica.State.FAILED))
        .order_by("pk")
    )
    # Every other member gives up what it holds: the old active (dead, its report perhaps still on
    # its way), or a primary still loading that lost the race for a never-held lock (it will stand
    # by instead of loading onto the GPU).
    hand_over(replica, [o.id for o in olds])
    for old in olds:
        if old.state in HOLDING and old.failover_state != FailoverState.DEAD:
            # Its own `failed` report may still be on its way; what matters is that it no longer serves.
            set_failover_state(old, FailoverState.DEAD, f"superseded at epoch {epoch}: its lock passed on")
    takeover_s = float(event.get("takeover_s") or 0.0)
    now = timezone.now()
    replica.role = Replica.Role.PRIMARY
    replica.epoch = epoch
    replica.pid = event.get("pid") or replica.pid
    replica.serving_since = now
    replica.last_accessed = now
    replica.progress = 100
    replica.failover_state = FailoverState.ACTIVE
    replica_services.set_state(
        replica,
        Replica.State.SERVING,
        f"took over at epoch {epoch} from {str(event.get('previous_holder'))[:8]} "
        f"in {takeover_s * 1000:.0f} ms from the lock grant",
        extra=["role", "epoch", "pid", "serving_since", "last_accessed", "progress", "failover_state"],
    )
    FAILOVERS.labels(deployment=deployment.name).inc()
    FAILOVER_SECONDS.observe(takeover_s)
    events.record(
        Event.Kind.FAILOVER_TAKEOVER,
        f"deployment {deployment.name}",
        f"replica {replica.id[:8]} took over pair {replica.lease_id} at epoch {epoch}",
        before={"holder": event.get("previous_holder"), "epoch": event.get("previous_epoch")},
        after={"holder": replica.id, "epoch": epoch, "takeover_s": takeover_s},
        node=replica.node.name if replica.node else "",
        deployment=deployment.name,
        replica=replica.id,
    )
    if not any(o.state in READY_TO_TAKE_OVER for o in olds):
        lease = FailoverLease.objects.get(pk=replica.lease_id)
        start_standby(lease, replica, reason=f"the pair is whole again after the takeover at epoch {epoch}")


def on_gone(replica: Replica, event: dict[str, Any], *, stopped: bool) -> None:
    """A pair member's process ended (failed, or stopped). If it was the active member and its
    standby is still there, the pair's reservation passes to the standby rather than being
    released: the standby takes over on the lock alone and must find the memory still reserved."""
    reason = str(event.get("reason") or ("process exited" if stopped else "replica process failed"))
    replica_services.requeue_taken(replica, f"replica {replica.id[:8]} {'stopped' if stopped else 'failed'}: {reason}")
    leaving = replica.state == Replica.State.STOPPING  # a scale-down or delete: the whole pair goes
    successor = (
        Replica.objects.filter(lease=replica.lease_id, state__in=READY_TO_TAKE_OVER)
        .exclude(pk=replica.pk)
        .order_by("created_at")
        .first()
    )
    # Superseded: its standby took over already (that report came first) and holds the pair.
    superseded = replica.failover_state == FailoverState.DEAD
    # The lock holder is the active member, even while it still loads (it takes the lock first).
    holds_lock = FailoverLease.objects.filter(pk=replica.lease_id, holder_id=replica.id).exists()
    was_active = not superseded and (
        replica.state in HOLDING or replica.failover_state == FailoverState.ACTIVE or holds_lock
    )
    if was_active and successor is not None and not leaving:
        hand_over(successor, [replica.id])
        why = f"the pair's reservation passes to its standby {successor.id[:8]}"
    else:
        replica_services.reserve_exactly(replica, {}, reason=f"pair member gone: {reason}")
        why = "reservation released"
    replica.failure_reason = "" if stopped else reason
    replica.pid = None
    replica.serving_since = None
    replica.failover_state = FailoverState.DEAD
    replica_services.set_state(
        replica,
        Replica.State.STOPPED if stopped else Replica.State.FAILED,
        f"{reason}; {why}",
        extra=["failure_reason", "pid", "serving_since", "failover_state"],
    )
    if not was_active and not superseded and not leaving and not stopped and replica.lease_id is not None:
        _replace_failed_standby(replica, reason)


def _replace_failed_standby(replica: Replica, reason: str) -> None:
    """A standby died before it was needed: start another, unless standbys keep dying."""
    since = timezone.now() - timedelta(hours=1)
    failures = Replica.objects.filter(
        lease=replica.lease_id, state=Replica.State.FAILED, role=Replica.Role.STANDBY, updated_at__gte=since
    ).count()
    active = (
        Replica.objects.select_related("node")
        .filter(lease=replica.lease_id, state__in=(*HOLDING, Replica.State.PENDING, Replica.State.LOADING))
        .exclude(pk=replica.pk)
        .first()
    )
    if active is None:
        return
    if failures > settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR:
        events.record(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            f"not replacing this standby: {failures} standbys of the pair failed in the last hour (last: {reason})",
            deployment=replica.deployment.name,
            replica=replica.id,
        )
        return
    lease = FailoverLease.objects.get(pk=replica.lease_id)
    start_standby(lease, active, reason=f"replacing standby {replica.id[:8]}, which failed: {reason}")


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
        for gpu in snap.gpus.values():
            if gpu.node != node:
                continue
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
    replica.failover_state = state
    replica.save(update_fields=["failover_state", "updated_at", *(extra or [])])
    if before == state:
        return
    events.record(
        Event.Kind.FAILOVER_STATE,
        f"replica {replica.id[:8]}",
        reason,
        before={"failover_state": before},
        after={"failover_state": state},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )


HANDLERS = {
    "failover": on_failover,
    "lease": on_lease,
    "standby": on_standby,
    "serving": on_serving,
    "active": on_active,
    "failed": lambda replica, event: on_gone(replica, event, stopped=False),
    "stopped": lambda replica, event: on_gone(replica, event, stopped=True),
}
