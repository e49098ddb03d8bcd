"""What failover pair members report through their node agent (seed 004): the lock's grants
and losses with their epochs, standing by, serving, a takeover, a member's end. The lock is the
node's (inference.failover): the pair's FailoverLease row learns its holder and epoch from these
reports alone, and a report carrying an older epoch than the row's is refused. Reached through
scheduling.services.reports."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.utils import timezone

from gpuportal.wire import memory, states
from scheduling import locks
from scheduling.core import effects
from scheduling.metrics import FAILOVER_SECONDS, FAILOVERS
from scheduling.models import DeploymentObserved, Event, FailoverLease, FailoverState, Replica
from scheduling.services import failover, outbox, replica_reports
from scheduling.services import replicas as replica_services

log = logging.getLogger(__name__)


# -- reports from pair members, relayed by their node agent -------------------------------------


def is_stale(replica: Replica, event: dict[str, Any]) -> bool:
    """A report carrying an epoch older than the lease's is refused, and says so (invariant 4)."""
    epoch = event.get("epoch")
    if epoch is None or replica.lease_id is None:
        return False
    current = FailoverLease.objects.filter(pk=replica.lease_id).values_list("epoch", flat=True).first()
    if current is None or int(epoch) >= current:
        return False
    outbox.note(
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


def record_holder(replica: Replica, epoch: int) -> None:
    """The member holds its pair's lock at `epoch`, as it reported: the lease row moves forward
    only (two members' reports cross on their agent's reader threads; the newer epoch wins).
    Written under the deployment's row lock, which every report holds (scheduling.services.reports),
    and after the replica rows it touches (the lock order)."""
    FailoverLease.objects.filter(pk=replica.lease_id, epoch__lte=epoch).update(
        holder_id=replica.id, epoch=epoch, granted_at=timezone.now()
    )


def on_failover(replica: Replica, event: dict[str, Any]) -> None:
    state = str(event.get("state") or "")
    if state not in FailoverState.values or is_stale(replica, event):
        return
    failover.set_failover_state(replica, state, f"pair member reports {state}")


def on_lease(replica: Replica, event: dict[str, Any]) -> None:
    """The history of the lock: every grant and loss, with its epoch."""
    what = event.get("what")
    epoch = event.get("epoch")
    if what == "grant":
        kind = Event.Kind.FAILOVER_GRANT
        previous = event.get("previous_holder")
        how = f"took over from {str(previous)[:8]}" if previous else "the pair's first holder"
        reason = f"lock granted at epoch {epoch}: {how}"
    else:
        kind = Event.Kind.FAILOVER_LOSS
        reason = f"lock lost at epoch {epoch}: {event.get('reason') or 'connection lost'}"
    outbox.note(
        kind,
        f"replica {replica.id[:8]}",
        reason,
        after={"epoch": epoch},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )
    if what == "grant" and epoch is not None:
        record_holder(replica, int(epoch))
        if replica.epoch != epoch:
            Replica.objects.filter(pk=replica.pk).update(epoch=int(epoch))


def on_standby(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state not in (Replica.State.PENDING, Replica.State.LOADING):
        return
    replica.pid = event.get("pid") or replica.pid
    replica.progress = 100
    replica_services.set_failover_state_of(replica, FailoverState.STANDBY)
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
    _restart_goes_on(replica)


def on_serving(replica: Replica, event: dict[str, Any]) -> None:
    """The primary that found the lock free loaded and serves: it is the pair's active member."""
    if is_stale(replica, event):
        return
    replica_reports.on_serving(replica, event)
    if event.get("epoch") is not None:
        replica.epoch = int(event["epoch"])
        record_holder(replica, replica.epoch)  # its grant's report may have been lost
        failover.set_failover_state(replica, FailoverState.ACTIVE, f"active at epoch {replica.epoch}", extra=["epoch"])


def on_active(replica: Replica, event: dict[str, Any]) -> None:
    """The standby took the lock (so the active's process is gone), woke, and serves: a takeover."""
    if is_stale(replica, event) or replica.state not in states.READY_TO_TAKE_OVER:
        return  # e.g. stopping with its pair: the stop ends it
    deployment = locks.lock_deployment_of(replica)
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
    failover.hand_over(replica, [o.id for o in olds])
    for old in olds:
        if old.state in states.HOLDING_WEIGHTS and old.failover_state != FailoverState.DEAD:
            # Its own `failed` report may still be on its way; what matters is that it no longer serves.
            failover.set_failover_state(old, FailoverState.DEAD, f"superseded at epoch {epoch}: its lock passed on")
    takeover_s = float(event.get("takeover_s") or 0.0)
    # Where the takeover's time went, as the member measured it from the grant.
    raw_steps = event.get("steps") if isinstance(event.get("steps"), dict) else {}
    steps = {k: float(v) for k, v in raw_steps.items() if isinstance(v, int | float)}
    now = timezone.now()
    replica.role = Replica.Role.PRIMARY
    replica.epoch = epoch
    replica.pid = event.get("pid") or replica.pid
    replica.serving_since = now
    replica.last_accessed = now
    replica.progress = 100
    replica_services.set_failover_state_of(replica, FailoverState.ACTIVE)
    replica_services.set_state(
        replica,
        Replica.State.SERVING,
        f"took over at epoch {epoch} from {str(event.get('previous_holder'))[:8]} "
        f"in {takeover_s * 1000:.0f} ms from the lock grant",
        extra=["role", "epoch", "pid", "serving_since", "last_accessed", "progress", "failover_state"],
    )
    record_holder(replica, epoch)  # the lease row after the replica rows, as everywhere
    FAILOVERS.labels(deployment=deployment.name).inc()
    FAILOVER_SECONDS.observe(takeover_s)
    outbox.note(
        Event.Kind.FAILOVER_TAKEOVER,
        f"deployment {deployment.name}",
        f"replica {replica.id[:8]} took over pair {replica.lease_id} at epoch {epoch}",
        before={"holder": event.get("previous_holder"), "epoch": event.get("previous_epoch")},
        after={
            "holder": replica.id,
            "epoch": epoch,
            "takeover_s": takeover_s,
            "steps": steps,
            "given_back": event.get("given_back"),
        },
        node=replica.node.name if replica.node else "",
        deployment=deployment.name,
        replica=replica.id,
    )
    if not any(o.state in states.READY_TO_TAKE_OVER for o in olds):
        lease = FailoverLease.objects.get(pk=replica.lease_id)
        failover.start_standby(lease, replica, reason=f"the pair is whole again after the takeover at epoch {epoch}")
    _restart_goes_on(replica)


def on_gone(replica: Replica, event: dict[str, Any], *, stopped: bool) -> None:
    """A pair member's process ended (failed, or stopped). If it was the active member and its
    standby is still there, the pair's reservation passes to the standby rather than being
    released: the standby takes over on the lock alone and must find the memory still reserved."""
    reason = str(event.get("reason") or ("process exited" if stopped else "replica process failed"))
    replica_services.requeue_taken(replica, f"replica {replica.id[:8]} {'stopped' if stopped else 'failed'}: {reason}")
    leaving = replica.state == Replica.State.STOPPING  # a scale-down or delete: the whole pair goes
    successor = (
        Replica.objects.filter(lease=replica.lease_id, state__in=states.READY_TO_TAKE_OVER)
        .exclude(pk=replica.pk)
        .order_by("created_at")
        .first()
    )
    # Superseded: its standby took over already (that report came first) and holds the pair.
    superseded = replica.failover_state == FailoverState.DEAD
    # The lock holder is the active member, even while it still loads (it takes the lock first).
    holds_lock = FailoverLease.objects.filter(pk=replica.lease_id, holder_id=replica.id).exists()
    was_active = not superseded and (
        replica.state in states.HOLDING_WEIGHTS or replica.failover_state == FailoverState.ACTIVE or holds_lock
    )
    if was_active and successor is not None and not leaving:
        failover.hand_over(successor, [replica.id])
        why = f"the pair's reservation passes to its standby {successor.id[:8]}"
    else:
        replica_services.reserve_exactly(replica, {}, reason=f"pair member gone: {reason}")
        why = "reservation released"
    replica.failure_reason = "" if stopped else reason
    replica.pid = None
    replica.serving_since = None
    replica_services.set_failover_state_of(replica, FailoverState.DEAD)
    replica_services.set_state(
        replica,
        Replica.State.STOPPED if stopped else Replica.State.FAILED,
        f"{reason}; {why}",
        extra=["failure_reason", "pid", "serving_since", "failover_state"],
    )
    if not was_active and not superseded and not leaving and not stopped and replica.lease_id is not None:
        _replace_failed_standby(replica, reason)
    _restart_goes_on(replica)


def _restart_goes_on(replica: Replica) -> None:
    """A member of a deployment under a rolling restart stood by, took over or ended: the
    restart's next step now (after the commit), rather than at the beat's next sweep."""
    if DeploymentObserved.objects.filter(pk=replica.deployment_id, restart_since__isnull=False).exists():
        outbox.want(effects.advance_restarts())


def _replace_failed_standby(replica: Replica, reason: str) -> None:
    """A standby died before it was needed: start another, unless standbys keep dying."""
    failures = failover.failed_standbys(replica.lease_id)
    active = (
        Replica.objects.select_related("node")
        .filter(
            lease=replica.lease_id, state__in=(*states.HOLDING_WEIGHTS, Replica.State.PENDING, Replica.State.LOADING)
        )
        .exclude(pk=replica.pk)
        .first()
    )
    if active is None:
        return
    if failures > settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR:
        outbox.note(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            f"not replacing this standby: {failures} standbys of the pair failed in the last hour (last: {reason})",
            deployment=replica.deployment.name,
            replica=replica.id,
        )
        return
    lease = FailoverLease.objects.get(pk=replica.lease_id)
    failover.start_standby(lease, active, reason=f"replacing standby {replica.id[:8]}, which failed: {reason}")


HANDLERS = {
    "failover": on_failover,
    "lease": on_lease,
    "standby": on_standby,
    "serving": on_serving,
    "active": on_active,
    "failed": lambda replica, event: on_gone(replica, event, stopped=False),
    "stopped": lambda replica, event: on_gone(replica, event, stopped=True),
}
