"""One replica's life: evicting it to the CPU cache, and what its process reports through the
node agent (loading progress, serving, sleeping, woken, failed, stopped)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from scheduling import events, ledger, memory
from scheduling.metrics import SLEEP_SECONDS, WAKE_SECONDS
from scheduling.models import GPU, Deployment, Event, FailoverState, Replica
from scheduling.services import dispatch
from scheduling.services.errors import InvalidState, NotFound
from scheduling.state import Plan, Release, Reservation, Snapshot

log = logging.getLogger(__name__)


def get(replica_id: str) -> Replica:
    try:
        return Replica.objects.select_related("deployment", "node").get(pk=replica_id)
    except Replica.DoesNotExist:
        raise NotFound(f"no replica with id {replica_id!r}") from None


def evict(replica_id: str, *, reason: str = "evicted by an operator", deployment: Deployment | None = None) -> Replica:
    """Send a serving replica to the CPU cache and want one replica fewer: an operator's scale-down
    that keeps the weights at hand (a later scale-up promotes it rather than loading anew)."""
    return to_cache(
        replica_id,
        reason=f"evicting to the CPU cache: {reason}",
        deployment=deployment,
        scale_down=True,
        refused="only a serving replica can be evicted",
    )


def to_cache(
    replica_id: str,
    *,
    reason: str,
    deployment: Deployment | None = None,
    scale_down: bool,
    refused: str,
) -> Replica:
    """Move a serving replica's weights to CPU RAM (draining, then the process reports `sleeping`).

    Its reservation is kept until its process says what it still holds (on a real GPU, its CUDA
    context), so the ledger never under-counts. `scale_down` also lowers `replicas_wanted`
    (evict); without it the deployment still wants the replica back (idle sleep). `deployment`,
    when given, is already locked by the caller. `refused` ends the 409 of a replica that is
    not serving.
    """
    with transaction.atomic():
        replica = get(replica_id)
        # Lock order: the deployment row before anything the ledger locks, then the replica row.
        deployment = deployment or Deployment.objects.select_for_update().get(pk=replica.deployment_id)
        replica = Replica.objects.select_for_update(of=("self",)).select_related("node").get(pk=replica_id)
        if replica.state != Replica.State.SERVING:
            raise InvalidState(f"replica {replica_id} is {replica.state}, {refused}")
        if replica.lease_id is not None:
            raise InvalidState(
                f"replica {replica_id} is the active member of a failover pair, which never sleeps: "
                f"switch over with POST /api/deployments/{replica.deployment.name}/failover/, or scale down"
            )
        set_state(replica, Replica.State.DRAINING, reason)
        if scale_down and deployment.replicas_wanted > 0:
            before = deployment.replicas_wanted
            deployment.replicas_wanted -= 1
            deployment.save(update_fields=["replicas_wanted", "updated_at"])
            events.record(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {deployment.name}",
                f"{reason} (replica {replica_id[:8]}): {before} → {deployment.replicas_wanted} replica(s) wanted",
                before={"replicas": before},
                after={"replicas": deployment.replicas_wanted},
                deployment=deployment.name,
                replica=replica_id,
            )
        dispatch.to_node(replica.node.queue, dispatch.TO_CACHE, replica.id)
    return replica


# -- reports from replica processes, relayed by their node agent -------------------------------


def report(replica_id: str, event: dict[str, Any]) -> None:
    """Apply one event from a replica process. Unknown replicas (deleted meanwhile) are ignored."""
    kind = event.get("event")
    handler = HANDLERS.get(kind) or PAIR_ONLY.get(kind)
    if handler is None:
        log.warning("replica %s reported an unknown event %r", replica_id, kind)
        return
    with transaction.atomic():
        replica = Replica.objects.select_related("deployment", "node").filter(pk=replica_id).first()
        if replica is None:
            log.info("replica %s reported %s after it was deleted; ignoring", replica_id, kind)
            return
        if replica.lease_id is not None:
            # A failover pair member: its reports carry epochs, and its end hands the pair over.
            # The members' agents relay on threads of their own, so the old active's end and its
            # standby's takeover can arrive at once: the deployment row lock (first, as always)
            # makes a pair's reports take turns, and each reads the rows the previous one wrote.
            from scheduling.services import failover

            Deployment.objects.select_for_update().filter(pk=replica.deployment_id).first()
            replica = Replica.objects.select_related("deployment", "node").get(pk=replica_id)
            handler = failover.HANDLERS.get(kind, handler)
        before = replica.state
        handler(replica, event)
        if (
            replica.state in ENDED
            and before not in (*ENDED, Replica.State.STOPPING)
            and replica.role != Replica.Role.STANDBY  # its pair replaces it (failover.on_gone)
            and event.get("kind") not in LOAD_FAILURES  # the backoff puts it back (note_load_failure)
        ):
            # It ended without being asked to: its deployment may be a replica short, and the
            # reconcile puts one back.
            why = f"replica {replica.id[:8]} of {replica.deployment.name} {replica.state}"
            dispatch.to_control(RECONCILE_TASK, why)


def _progress(replica: Replica, event: dict[str, Any]) -> None:
    percent = max(0, min(100, int(event.get("percent") or 0)))
    if replica.state == Replica.State.PENDING:
        set_state(replica, Replica.State.LOADING, f"loading weights: {event.get('detail') or 'started'}")
    Replica.objects.filter(pk=replica.pk).update(progress=percent)


def on_serving(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state not in (Replica.State.PENDING, Replica.State.LOADING, Replica.State.WAKING):
        return
    deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id)
    from scheduling.services import deployments  # deployments builds on this module

    deployments.note_loaded(deployment)
    measured = _measured_bytes(deployment, event)
    context = event.get("context_measured_bytes")
    record_context(replica, context if isinstance(context, int) else 0)
    if measured and measured != deployment.memory_measured_bytes:
        set_measured_need(
            deployment,
            measured,
            replica,
            f"measured {memory.human_bytes(measured)} per replica after loading "
            f"(estimate was {memory.human_bytes(deployment.memory_estimate_bytes or 0)}); "
            "placement uses the measurement from now on",
        )
    now = timezone.now()
    if replica.state == Replica.State.WAKING:
        WAKE_SECONDS.observe(_seconds_in(replica, Replica.State.WAKING, now))
    replica.pid = event.get("pid") or replica.pid
    replica.serving_since = now
    replica.last_accessed = replica.last_accessed or now
    replica.progress = 100
    weights = event.get("weights_bytes")
    detail = f"loaded ({memory.human_bytes(weights)} of weights)" if weights else "loaded"
    set_state(replica, Replica.State.SERVING, detail, extra=["pid", "serving_since", "last_accessed", "progress"])


def _woken(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state != Replica.State.WAKING:
        return
    replica.serving_since = timezone.now()
    WAKE_SECONDS.observe(_seconds_in(replica, Replica.State.WAKING, replica.serving_since))
    replica.progress = 100
    set_state(replica, Replica.State.SERVING, "woken from the CPU cache", extra=["serving_since", "progress"])


def _sleeping(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state == Replica.State.DRAINING:
        SLEEP_SECONDS.observe(_seconds_in(replica, Replica.State.DRAINING, timezone.now()))
    residual = {str(k): int(v) for k, v in (event.get("residual_bytes_by_id") or {}).items()}
    held = sum(residual.values())
    reserve_exactly(
        replica,
        {int(index): bytes_ for index, bytes_ in residual.items() if bytes_ > 0},
        reason=f"asleep in the CPU cache, still holding {memory.human_bytes(held)} on its GPU(s)",
    )
    replica.gpu_mem_bytes_by_id = {k: v for k, v in residual.items() if v > 0}
    replica.gpu_memory_fraction = None
    replica.serving_since = None
    set_state(
        replica,
        Replica.State.SLEEPING,
        f"weights moved to CPU RAM; holds {memory.human_bytes(held)} on its GPU(s)",
        extra=["gpu_mem_bytes_by_id", "gpu_memory_fraction", "serving_since"],
    )
    # A request accepted while this replica still served (so it woke nothing), or one its drain
    # handed back, waits with nothing awake to take it: the last replica to fall asleep wakes
    # the deployment again, as the next request would have.
    from scheduling.services import sleep  # the sleep service builds on this module

    # Its claim to take requests first (the replica withdrew it as it began to drain, unless
    # Redis failed it then): what was queued on its strength is in the queue by the check below.
    _withdraw(replica)
    if sleep.awake_count(replica.deployment) == 0:
        wake_for_waiting(replica.deployment.name, f"replica {replica.id[:8]} slept")


def _failed(replica: Replica, event: dict[str, Any]) -> None:
    reason = str(event.get("reason") or "replica process failed")
    if replica.state in (Replica.State.STOPPING, Replica.State.STOPPED):
        _stopped(replica, event)
        return
    load_failure = event.get("kind") in LOAD_FAILURES
    # The deployment row first, as everywhere (then GPU rows, then replica rows): a failed load
    # moves its crash-loop count (scheduling.services.deployments.note_load_failure).
    deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id) if load_failure else None
    requeue_taken(replica, f"replica {replica.id[:8]} failed: {reason}")
    restartable = _restarts_in_last_hour(replica) < settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR
    if event.get("kind") == "cuda_assert" and restartable:
        # A device-side assert poisons the CUDA context for good: only a fresh process recovers.
        # The reservation stays; the new process loads into the same place.
        replica.failure_reason = reason
        replica.progress = 0
        set_state(
            replica,
            Replica.State.PENDING,
            f"restarting after a CUDA device-side assert: {reason}",
            extra=["failure_reason", "progress"],
            kind=Event.Kind.REPLICA_RESTARTED,
        )
        dispatch.to_node(replica.node.queue, dispatch.START, replica.id, [])
        return
    reserve_exactly(replica, {}, reason=f"replica failed: {reason}")
    replica.failure_reason = reason
    replica.pid = None
    replica.serving_since = None
    set_state(replica, Replica.State.FAILED, reason, extra=["failure_reason", "pid", "serving_since"])
    if deployment is None:
        wake_for_waiting(replica.deployment.name, f"replica {replica.id[:8]} failed: {reason}")
        return
    from scheduling.services import deployments  # deployments builds on this module

    # A replacement after a backoff, or, at the limit, a failed deployment whose waiting
    # requests have nothing left to wait for.
    if not deployments.note_load_failure(deployment, replica.id, reason):
        fail_waiting_if_none_may_serve(replica, reason)


RECONCILE_TASK = "scheduling.tasks.reconcile"
ENDED = (Replica.State.STOPPED, Replica.State.FAILED)
# Failures of a load (a broken checkpoint, a reservation too small to serve): retried after a backoff.
LOAD_FAILURES = ("load", "oom")

# Replicas that serve, or are on their way to it: while one is, a request may still be answered.
MAY_SERVE = (
    Replica.State.PENDING,
    Replica.State.LOADING,
    Replica.State.WAKING,
    Replica.State.SERVING,
    Replica.State.DRAINING,
)


def fail_waiting_if_none_may_serve(replica: Replica, reason: str) -> None:
    """A deployment gave up after failed loads (a broken checkpoint, a reservation too small to
    serve): if no other replica of it serves or is on its way, the requests that wait would wait
    for nothing. They end now, saying why (issue 16: they used to wait until they expired)."""
    deployment = replica.deployment
    if deployment.replicas.exclude(pk=replica.pk).filter(state__in=MAY_SERVE).exists():
        return
    why = f"no replica of {deployment.name} can serve: replica {replica.id[:8]} failed to load: {reason}"
    name = deployment.name

    def fail_them() -> None:
        from scheduling.services import requests as request_services

        try:
            failed = request_services.fail_waiting(name, why, kind="load")
        except redis.RedisError as err:
            log.warning("cannot end the requests waiting for %s (Redis: %s)", name, err)
            return
        if failed:
            events.record(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                f"ended {len(failed)} waiting request(s): {why}",
                after={"failed_requests": failed},
                deployment=name,
                replica=replica.id,
            )

    # After the commit: the failure is recorded first, so a request that arrives meanwhile and
    # finds nothing to serve it is admitted against the failed replica's state, not a stale one.
    transaction.on_commit(fail_them)


def wake_for_waiting(deployment_name: str, reason: str) -> None:
    """Requests wait (some re-queued from a dead replica) and the waking is on no one: the next
    request would wake the deployment, but a client waiting for its answer sends none. The
    control plane's wake (a promotion, or a new replica) runs once this has committed.
    Not after a load failure or an OOM: a replacement would only fail the same way."""
    from scheduling.services import preemption
    from scheduling.services import requests as request_services

    try:
        waiting = request_services.queue_depth(deployment_name)
    except redis.RedisError as err:
        # What the replica reported is recorded all the same; the next request wakes it instead.
        log.warning("cannot see whether requests wait for %s (Redis: %s)", deployment_name, err)
        return
    if waiting > 0:
        preemption.wake_later(deployment_name, f"requests waiting after {reason}")


def _stopped(replica: Replica, event: dict[str, Any]) -> None:
    requeue_taken(replica, f"replica {replica.id[:8]} stopped")
    reserve_exactly(replica, {}, reason="replica stopped")
    replica.pid = None
    replica.serving_since = None
    set_state(replica, Replica.State.STOPPED, "process exited", extra=["pid", "serving_since"])


def lose_with_node(node_name: str, reason: str) -> list[str]:
    """The node's replica processes are gone with it (its agent stopped, went silent, or started
    anew: replica processes die with their agent). Each is stopped as if it had said so: what it
    had taken goes back to the queue, its claim to take requests and its reservations are
    released through the commit path. Returns the deployments that lost one.

    Failover pairs go whole: a standby stands beside its active member on the same node
    (failover.start_standby), so no member is left to take the pair's lock over. A member that
    still runs on a node that was only cut off is fenced all the same: the requests it had are
    given back, so its late answers are refused (inference.requestqueue.NotTaken), and its agent
    stops it when it is heard again (nodes.heartbeat).
    """
    lost = Replica.objects.filter(node__name=node_name).exclude(state__in=(Replica.State.STOPPED, Replica.State.FAILED))
    deployments: set[str] = set()
    for replica_id in lost.order_by("pk").values_list("pk", flat=True):
        # One replica at a time, as its own report would be: the deployment row (a pair's reports
        # take turns on it), then the GPU rows the ledger locks, then the replica row set_state
        # writes (the global lock order).
        with transaction.atomic():
            replica = Replica.objects.select_related("deployment", "node").filter(pk=replica_id).first()
            if replica is None or replica.state in (Replica.State.STOPPED, Replica.State.FAILED):
                continue
            if replica.lease_id is not None:
                Deployment.objects.select_for_update().filter(pk=replica.deployment_id).first()
            requeue_taken(replica, f"replica {replica.id[:8]} {reason}")
            reserve_exactly(replica, {}, reason=f"replica {reason}")
            replica.pid = None
            replica.serving_since = None
            extra = ["pid", "serving_since"]
            if replica.lease_id is not None:
                replica.failover_state = FailoverState.DEAD
                extra.append("failover_state")
            set_state(replica, Replica.State.STOPPED, reason, extra=extra)
            deployments.add(replica.deployment.name)
    return sorted(deployments)


def requeue_taken(replica: Replica, reason: str) -> None:
    """Requests the replica had taken go back to its deployment's queue: nothing accepted is lost.

    Right away rather than on commit: if this transaction rolled back, the requests would merely
    have been re-queued early, whereas deferring could lose them to a crash in between.
    """
    # Imported here: the request service builds on this module's neighbours (wake, placement).
    from scheduling.services import requests as request_services

    # The claim to take requests before the check for what waits (wake_for_waiting): a request
    # queued on its strength is then in the queue when the check looks.
    _withdraw(replica)
    request_services.requeue_from(replica.id, reason)


def _withdraw(replica: Replica) -> None:
    from scheduling.services import requests as request_services

    try:
        request_services.withdraw_live(replica.deployment.name, replica.id)
    except redis.RedisError as err:  # the claim lapses on its own (LIVE_TTL_S) if it is still there
        log.warning("cannot withdraw replica %s's claim to take requests (Redis: %s)", replica.id, err)


HANDLERS = {
    "progress": _progress,
    "serving": on_serving,
    "woken": _woken,
    "sleeping": _sleeping,
    "failed": _failed,
    "stopped": _stopped,
}


def _pair_report_from_a_plain_replica(replica: Replica, event: dict[str, Any]) -> None:
    log.warning("replica %s is in no failover pair but reported %s; ignoring", replica.id, event.get("event"))


# Reports only failover pair members make (scheduling.services.failover handles them).
PAIR_ONLY = dict.fromkeys(("failover", "lease", "standby", "active"), _pair_report_from_a_plain_replica)


def _measured_bytes(deployment: Deployment, event: dict[str, Any]) -> int | None:
    """What one replica holds serving at max_tokens, as the replica composed it from measured
    parts with scheduling.memory's formula (its weights as allocated, the pool, the activation
    reserve, its context, what NVML shows outside the allocator): the need the next replica is
    reserved and sizes its pool against. Not NVML's figure at load: it has no activations yet,
    and a replica reserved it would size its pool below zero (issue 15).

    Replicas of an older build report no need: then their tensor bytes plus the reserves the
    estimate budgets beside them."""
    if isinstance(event.get("need_bytes"), int) and event["need_bytes"] > 0:
        return int(event["need_bytes"])
    weights = event.get("weights_bytes")
    if not weights:
        return None
    reserves = max(0, (deployment.memory_estimate_bytes or 0) - (deployment.weight_bytes or 0))
    return int(weights) + reserves


def set_measured_need(deployment: Deployment, measured: int, replica: Replica, reason: str) -> None:
    """Record the deployment's measured need, with an Event saying why (the caller holds its row)."""
    before = deployment.memory_measured_bytes
    deployment.memory_measured_bytes = measured
    deployment.save(update_fields=["memory_measured_bytes", "updated_at"])
    events.record(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        reason,
        before={"measured_bytes": before},
        after={"measured_bytes": measured},
        deployment=deployment.name,
        replica=replica.id,
    )


def record_context(replica: Replica, context: int, *, standby: bool = False) -> None:
    """A real replica's measured CUDA context becomes its node's figure for that GPU model: the
    next need and pool count it instead of the default (issue 15); a standby's, that of the
    standbys. Only ever raised, since a context grows as forward passes load kernels, and a lower
    reading is an earlier moment (a GPU whose context is below the default keeps the default:
    safe rather than tight). Virtual GPUs keep their node's profile."""
    if replica.node_id is None or replica.node.virtual or context <= 0:
        return
    field = "standby_context_bytes" if standby else "context_bytes"
    indices = [int(i) for i in replica.gpu_mem_bytes_by_id]
    products = list(
        GPU.objects.filter(node_id=replica.node_id, index__in=indices).values_list("product", flat=True).distinct()
    )
    updated = GPU.objects.filter(node_id=replica.node_id, product__in=products, **{f"{field}__lt": context})
    if updated.update(**{field: context, "context_measured": True}):
        what = "a standby's CUDA context" if standby else "CUDA context"
        events.record(
            Event.Kind.GPU_CHANGED,
            f"node {replica.node.name}",
            f"{what} measured at {memory.human_bytes(context)} per process by replica {replica.id[:8]} "
            f"({', '.join(sorted(products))}); needs and KV pools count it from now on",
            after={field: context},
            node=replica.node.name,
            replica=replica.id,
        )


def _seconds_in(replica: Replica, state: str, now: datetime) -> float:
    """How long the replica has been in `state`: since the Event that put it there (updated_at
    moves with unrelated saves, the Event does not)."""
    entered = (
        Event.objects.filter(replica=replica.id, kind=Event.Kind.REPLICA_STATE, after__state=state)
        .order_by("-time")
        .values_list("time", flat=True)
        .first()
    )
    return max(0.0, (now - (entered or replica.updated_at)).total_seconds())


def _restarts_in_last_hour(replica: Replica) -> int:
    since = timezone.now() - timedelta(hours=1)
    return Event.objects.filter(replica=replica.id, kind=Event.Kind.REPLICA_RESTARTED, time__gte=since).count()


def reserve_exactly(replica: Replica, bytes_by_index: dict[int, int], *, reason: str) -> None:
    """Make the replica's reservations exactly `bytes_by_index` on its node's GPUs."""
    if replica.node_id is None:
        return
    replica_id = replica.id

    def decide(snap: Snapshot) -> Plan | None:
        on_node = {g.index: g for g in snap.gpus.values() if g.node == replica.node.name}
        releases = [
            Release(g.id, replica_id)
            for g in on_node.values()
            if g.index not in bytes_by_index and any(o.replica_id == replica_id for o in g.occupants)
        ]
        reservations = []
        for index, wanted in bytes_by_index.items():
            gpu = on_node.get(index)
            if gpu is None:
                continue
            held = next((o.reserved_bytes for o in gpu.occupants if o.replica_id == replica_id), 0)
            if held != wanted:
                # What the process still holds is real memory: record it even if the GPU is full,
                # by taking no more than is free, and say so, rather than failing the report.
                reservations.append(Reservation(gpu.id, replica_id, min(wanted, held + gpu.available_bytes)))
        if not releases and not reservations:
            return None
        return Plan.against(snap, reason, reservations=reservations, releases=releases)

    ledger.commit_with_retry(decide)


def set_state(
    replica: Replica,
    state: str,
    reason: str,
    *,
    extra: list[str] | None = None,
    kind: str = Event.Kind.REPLICA_STATE,
) -> None:
    before = replica.state
    replica.state = state
    replica.save(update_fields=["state", "updated_at", *(extra or [])])
    if before == state and kind == Event.Kind.REPLICA_STATE:
        return
    events.record(
        kind,
        f"replica {replica.id[:8]}",
        reason,
        before={"state": before},
        after={"state": state},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )
