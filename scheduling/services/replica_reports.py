"""What a replica process reports through its node agent (loading progress, serving, sleeping,
woken, failed, stopped), applied to the books: a report may move its deployment's crash-loop
count or wake what requests wait for, so this builds on the deployment, sleep and preemption
services. Failover pair members' reports are scheduling.services.pair_reports'; both are reached
through scheduling.services.reports."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from gpuportal.wire import memory
from scheduling import locks
from scheduling.core import effects
from scheduling.metrics import SLEEP_SECONDS, WAKE_SECONDS
from scheduling.models import (
    ACTIVE_INTENT_STATUSES,
    GPU,
    Deployment,
    DeploymentObserved,
    Event,
    Node,
    Occupant,
    PreemptionIntent,
    Replica,
)
from scheduling.services import deep_sleep, deployments, host_cache, outbox, preemption, queueing, replicas, sleep

log = logging.getLogger(__name__)


# Failures of a load (a broken checkpoint, a reservation too small to serve): retried after a backoff.
LOAD_FAILURES = ("load", "oom")


def _progress(replica: Replica, event: dict[str, Any]) -> None:
    percent = max(0, min(100, int(event.get("percent") or 0)))
    if replica.state == Replica.State.PENDING:
        replicas.set_state(replica, Replica.State.LOADING, f"loading weights: {event.get('detail') or 'started'}")
    Replica.objects.filter(pk=replica.pk).update(progress=percent)


def measured_reason(measured: int, estimate: int, context: int | None) -> str:
    """Why the deployment's need changed, its figures comparable: a footprint measured with its
    CUDA context in it is set beside the estimate and that context, not the estimate alone (which
    read "need 819 MiB" at deploy, then "measured 819 MiB (estimate was 97 MiB)")."""
    human = memory.human_bytes
    if context:
        compared = f"the estimate {human(estimate)} and the CUDA context {human(context)}, {human(estimate + context)}"
        return (
            f"measured {human(measured)} per replica after loading, its CUDA context included ({compared}); "
            "placement uses the measurement from now on"
        )
    return (
        f"measured {human(measured)} per replica after loading (the estimate was {human(estimate)}); "
        "placement uses the measurement from now on"
    )


def on_serving(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state not in (Replica.State.PENDING, Replica.State.LOADING, Replica.State.WAKING):
        return
    deployment = locks.lock_deployment_of(replica)
    drained = _node_drained(replica)
    did = "woke" if replica.state == Replica.State.WAKING else "loaded"

    deployments.note_loaded(deployment)
    measured = _measured_bytes(deployment, event)
    context = event.get("context_measured_bytes")
    replicas.record_context(replica, context if isinstance(context, int) else 0)
    # The context the replica's footprint counted, when the need is its footprint.
    counted = event.get("context_bytes") if isinstance(event.get("need_bytes"), int) else None
    counted = counted if isinstance(counted, int) and counted > 0 else None
    record = deployment.observed
    if measured and (measured, counted) != (record.memory_measured_bytes, record.memory_measured_context_bytes):
        replicas.set_measured_need(
            deployment, measured, replica, measured_reason(measured, record.memory_estimate_bytes or 0, counted),
            context=counted,
        )  # fmt: skip
    now = timezone.now()
    deep = replica.state == Replica.State.WAKING and replica.host_copy_bytes > 0
    if deep:
        # Woken from deep sleep (a process started for it): slower than a wake from the first
        # level, whose measured time fairness weighs, so it is not recorded as one.
        took = {}
    elif replica.state == Replica.State.WAKING:
        woke_in = _seconds_in(replica, Replica.State.WAKING, now)
        WAKE_SECONDS.observe(woke_in)
        took = {"measured_wake_s": woke_in}
    else:
        took = {"measured_load_s": max(0.0, (now - replica.created_at).total_seconds())}
    replica.pid = event.get("pid") or replica.pid
    replica.serving_since = now
    replica.last_accessed = replica.last_accessed or now
    replica.progress = 100
    replica.asleep_since = None
    replica.host_copy_bytes = 0  # its process deleted the copy once it held the weights
    extra = ["pid", "serving_since", "last_accessed", "progress", "asleep_since", "host_copy_bytes"]
    if replica.state != Replica.State.WAKING and replica.arena_kept_bytes:
        # A fresh process (a restart under the same id) keeps no arena until it is told again:
        # the balance below lends it one anew, rather than the books counting one it lacks.
        replica.arena_kept_bytes = 0
        extra.append("arena_kept_bytes")
    weights = event.get("weights_bytes")
    detail = f"loaded ({memory.human_bytes(weights)} of weights)" if weights else "loaded"
    if deep:
        detail = f"woken from deep sleep: {detail}, from its node's host copy"
    replicas.set_state(replica, Replica.State.SERVING, detail, extra=extra)
    # Last, and as an UPDATE of these columns alone: a save of the record above (its measured
    # need) must not write back what this replaces. Under the deployment's row lock, taken above.
    if took:
        DeploymentObserved.objects.filter(pk=deployment.pk).update(**took)
    _lend_host_room(replica)
    if record.restart_since is not None:
        outbox.want(effects.advance_restarts())
    if drained:
        _sleep_on_a_drained_node(replica, deployment, did)


def _woken(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state != Replica.State.WAKING:
        return
    drained = _node_drained(replica)
    replica.serving_since = timezone.now()
    woke_in = _seconds_in(replica, Replica.State.WAKING, replica.serving_since)
    WAKE_SECONDS.observe(woke_in)
    replica.progress = 100
    replica.asleep_since = None
    replicas.set_state(
        replica, Replica.State.SERVING, "woken from the CPU cache", extra=["serving_since", "progress", "asleep_since"]
    )
    # The report holds its deployment's row lock already (services.reports), which covers the
    # observed record: no new lock order.
    DeploymentObserved.objects.filter(pk=replica.deployment_id).update(measured_wake_s=woke_in)
    _lend_host_room(replica)
    if drained:
        _sleep_on_a_drained_node(replica, replica.deployment, "woke")


def _node_drained(replica: Replica) -> bool:
    """Whether the node the replica came up on is draining, read under the node's row lock
    (after the deployment's, before the replica's row is written, as the lock order has it). A
    drain takes that lock to mark the node and then puts to sleep what serves there: whichever
    commits first, the other sees it, so a replica that was loading or waking when its node was
    drained cannot end up serving there unseen by both."""
    if replica.node is None:
        return False
    return locks.lock_node(replica.node.name).status == Node.Status.DRAINING


def _sleep_on_a_drained_node(replica: Replica, deployment: Deployment, did: str) -> None:
    """A replica that came up on a node drained meanwhile goes to sleep, as the drain put to sleep
    what served there; one a drain's move is to replace serves until its replacement does. A
    failover pair's active member never sleeps (its pair's own reports handle it, not these)."""
    if replica.lease_id is not None:
        return
    if replica.id in deployment.observed.restart_only.split():
        outbox.want(effects.advance_restarts())  # its move's next step: its replacement
        return
    replicas.sleep_replica(
        replica.id, reason=f"node {replica.node.name} was drained while it {did}", deployment=deployment
    )


def _lend_host_room(replica: Replica) -> None:
    """A replica came awake: it left the host cache's room (woken), or may use some (loaded). The
    control worker balances the node's cache, which may let it keep an arena for its next sleep."""
    if replica.node is not None and replica.node.cpu_cache_bytes > 0:
        outbox.want(effects.trim_host_cache(replica.node.name))


def _arena(replica: Replica, event: dict[str, Any]) -> None:
    kept = event.get("kept_bytes")
    if event.get("failed"):
        host_cache.note_unkept(replica, str(event["failed"]))
    elif isinstance(kept, int) and not isinstance(kept, bool) and kept >= 0:
        host_cache.note_kept(replica, kept)


def _why_deeply(replica: Replica, residual: dict[str, int], booked: dict[int, int]) -> str | None:
    """Why a replica just asleep must sleep deeply at once, if it must: the room its context holds
    went to another replica while it fell asleep (an eviction: placement freed its whole
    reservation), or a wake waits on one of its GPUs for more room than is left there beside that
    context (it was preempted for that wake)."""
    held = {int(k) for k, v in residual.items() if v > 0}
    if any(booked.get(index, 0) < residual[str(index)] for index in held):
        return (
            "its GPU's room went to another replica while it fell asleep (an eviction), and its CUDA context "
            "still held there comes back only when its process exits"
        )
    waiting = (
        PreemptionIntent.objects.filter(
            gpu__node_id=replica.node_id,
            gpu__index__in=held,
            status__in=ACTIVE_INTENT_STATUSES,
            needed_bytes__gt=F("gpu__available_bytes"),
        )
        .exclude(waiting_replica_id=replica.id)
        .values_list("waiting_replica_id", flat=True)
        .first()
    )
    if waiting is not None:
        return f"a wake ({waiting[:8]}) waits on its GPU for more room than its CUDA context leaves there"
    return None


def _sleeping(replica: Replica, event: dict[str, Any]) -> None:
    if replica.state in (Replica.State.SLEEPING, Replica.State.STOPPED, Replica.State.FAILED):
        # Said again (an adopting agent's resync), or too late: the books hold it already, and a
        # replica written off holds nothing.
        return
    if replica.state == Replica.State.DRAINING:
        SLEEP_SECONDS.observe(_seconds_in(replica, Replica.State.DRAINING, timezone.now()))
    # Read before set_state clears it: a request that found nothing awake waits for this copy.
    waited_for = replica.wake_when_asleep
    reported = {str(k): v for k, v in (event.get("residual_bytes_by_id") or {}).items()}
    # What stays on a GPU is the process's context as serving grew it (kernels its forward passes
    # loaded): the node's figure from now on, so the wake and the next replica count it.
    replicas.record_context(replica, max((int(v) for v in reported.values() if v is not None), default=0))
    # null: NVML could not see the process (a container without the host's PIDs): the GPU's own
    # context figure stands in, rather than 0, which would free memory the context still holds.
    unknown = [int(k) for k, v in reported.items() if v is None]
    estimates = dict(
        GPU.objects.filter(node_id=replica.node_id, index__in=unknown).values_list("index", "context_bytes")
    )
    residual = {k: int(v) if v is not None else estimates.get(int(k), 0) for k, v in reported.items()}
    held = sum(residual.values())
    replicas.reserve_exactly(
        replica,
        {int(index): bytes_ for index, bytes_ in residual.items() if bytes_ > 0},
        reason=f"asleep in the CPU cache, still holding {memory.human_bytes(held)} on its GPU(s)",
    )
    booked = dict(Occupant.objects.filter(replica_id=replica.id).values_list("gpu__index", "reserved_bytes"))
    replica.gpu_mem_bytes_by_id = {k: v for k, v in residual.items() if v > 0}
    replica.gpu_memory_fraction = None
    replica.serving_since = None
    replica.asleep_since = timezone.now()
    deep_after = replica.deployment.deep_sleep_after_s
    replicas.set_state(
        replica,
        Replica.State.SLEEPING,
        f"weights moved to CPU RAM; holds {memory.human_bytes(held)} on its GPU(s)"
        + (f" until it sleeps deeply in {deep_after:g} s (sleep.deep_after_s)" if deep_after > 0 else ""),
        extra=["gpu_mem_bytes_by_id", "gpu_memory_fraction", "serving_since", "asleep_since"],
    )
    why_deeply = _why_deeply(replica, residual, booked)
    if replica.node is not None and why_deeply:
        # Its process still holds its CUDA context there, and only its exit gives that back: it
        # sleeps deeply now rather than whenever its setting says.
        deep_sleep.tell(replica, why_deeply)
    # A request accepted while this replica still served (so it woke nothing), or one its drain
    # handed back, waits with nothing awake to take it: the last replica to fall asleep wakes
    # the deployment again, as the next request would have.

    # Its claim to take requests first (the replica withdrew it as it began to drain, unless
    # Redis failed it then): what was queued on its strength is in the queue by the check below.
    replicas.withdraw(replica)
    if sleep.awake_count(replica.deployment) == 0:
        if waited_for:
            # Its request may be queued only now (sleep._wait_for_draining_copy): no queue check.
            preemption.wake_later(replica.deployment.name, f"a request waited for replica {replica.id[:8]} to sleep")
        else:
            wake_for_waiting(replica.deployment.name, f"replica {replica.id[:8]} slept")


def _deep_sleeping(replica: Replica, event: dict[str, Any]) -> None:
    """The sleeper wrote its weights to its node's host copy and its process exited: it holds no
    GPU memory now, and its node's host memory still holds its weights (scheduling.services.host_cache
    counts them as a sleeper's), for the next wake to start a process that copies them back."""
    if replica.state != Replica.State.SLEEPING:
        return  # said again, or too late: the books hold it already, or it went another way
    held = memory.human_bytes(sum(int(v) for v in (replica.gpu_mem_bytes_by_id or {}).values()))
    replicas.reserve_exactly(replica, {}, reason=f"replica {replica.id[:8]} sleeps deeply: its process exited")
    written = event.get("host_copy_bytes")
    if not isinstance(written, int) or isinstance(written, bool) or written <= 0:
        written = host_cache.host_bytes(replica) or 1  # unsaid: its weights' size, as a sleeper's
    copy = f"its {memory.human_bytes(written)} of weights"
    replica.gpu_mem_bytes_by_id = {}
    replica.pid = None
    replica.arena_kept_bytes = 0
    replica.host_copy_bytes = written
    node = replica.node.name if replica.node else "its node"
    replicas.set_state(
        replica,
        Replica.State.DEEP_SLEEPING,
        f"sleeps deeply: its process exited and gave back {held} of GPU memory; {copy} wait in node "
        f"{node}'s host memory for the next wake",
        extra=["gpu_mem_bytes_by_id", "pid", "arena_kept_bytes", "host_copy_bytes"],
    )


def _failed(replica: Replica, event: dict[str, Any]) -> None:
    reason = str(event.get("reason") or "replica process failed")
    if replica.state in (Replica.State.STOPPING, Replica.State.STOPPED):
        _stopped(replica, event)
        return
    load_failure = event.get("kind") in LOAD_FAILURES
    # The deployment row first, as everywhere (then GPU rows, then replica rows): a failed load
    # moves its crash-loop count (scheduling.services.deployments.note_load_failure).
    deployment = locks.lock_deployment_of(replica) if load_failure else None
    replicas.requeue_taken(replica, f"replica {replica.id[:8]} failed: {reason}")
    restartable = _restarts_in_last_hour(replica) < settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR
    if event.get("kind") == "cuda_assert" and restartable:
        # A device-side assert poisons the CUDA context for good: only a fresh process recovers.
        # The reservation stays; the new process loads into the same place.
        replica.failure_reason = reason
        replica.progress = 0
        replicas.set_state(
            replica,
            Replica.State.PENDING,
            f"restarting after a CUDA device-side assert: {reason}",
            extra=["failure_reason", "progress"],
            kind=Event.Kind.REPLICA_RESTARTED,
        )
        outbox.want(effects.start(replica.node.name, replica.id, []))
        return
    replicas.reserve_exactly(replica, {}, reason=f"replica failed: {reason}")
    replica.failure_reason = reason
    replica.pid = None
    replica.serving_since = None
    replicas.set_state(replica, Replica.State.FAILED, reason, extra=["failure_reason", "pid", "serving_since"])
    if deployment is None:
        wake_for_waiting(replica.deployment.name, f"replica {replica.id[:8]} failed: {reason}")
        return

    # A replacement after a backoff, or, at the limit, a failed deployment whose waiting
    # requests have nothing left to wait for.
    if not deployments.note_load_failure(deployment, replica.id, reason):
        replicas.fail_waiting_if_none_may_serve(replica, reason)


def wake_for_waiting(deployment_name: str, reason: str) -> None:
    """Requests wait (some re-queued from a dead replica) and the waking is on no one: the next
    request would wake the deployment, but a client waiting for its answer sends none. The
    control plane's wake (a promotion, or a new replica) runs once this has committed.
    Not after a load failure or an OOM: a replacement would only fail the same way."""

    try:
        waiting = queueing.queue_depth(deployment_name)
    except redis.RedisError as err:
        # What the replica reported is recorded all the same; the next request wakes it instead.
        log.warning("cannot see whether requests wait for %s (Redis: %s)", deployment_name, err)
        return
    if waiting > 0:
        preemption.wake_later(deployment_name, f"requests waiting after {reason}")


def _stopped(replica: Replica, event: dict[str, Any]) -> None:
    replicas.requeue_taken(replica, f"replica {replica.id[:8]} stopped")
    replicas.reserve_exactly(replica, {}, reason="replica stopped")
    replica.pid = None
    replica.serving_since = None
    if replica.state in (Replica.State.PARKED, Replica.State.DEEP_SLEEPING):
        # Parked out of the host cache, or deep asleep: its process was meant to go, and the
        # replica stays wanted, for the next wake to load from disk or from the host copy.
        replica.save(update_fields=["pid", "serving_since", "updated_at"])
        return
    if replica.state == Replica.State.SLEEPING:
        # A sleeper whose process went without being told to (its agent stopped, `up` with it):
        # its deployment was asleep and stays so. Parked, it is still wanted, so no reconcile
        # loads a replacement that would serve with no request; the next wake loads it from disk.
        node = replica.node.name if replica.node else "its node"
        replicas.park(
            replica,
            f"its sleeping process on {node} exited: parked, so that its deployment stays asleep; "
            "the next wake loads it from disk",
            extra=["pid", "serving_since"],
        )
        return
    replicas.set_state(replica, Replica.State.STOPPED, "process exited", extra=["pid", "serving_since"])


def _refused(replica: Replica, event: dict[str, Any]) -> None:
    """Its process refused a command (a deepen that found no room for its host copy, a wake it
    was not asleep for): nothing changed there, and the trail says why. What sent the command
    sends it again if it still wants it (the deep sleep sweep, the lost-command repairs)."""
    command, reason = str(event.get("cmd") or "a command"), str(event.get("reason") or "no reason given")
    outbox.note(
        Event.Kind.REPLICA_STATE,
        f"replica {replica.id[:8]}",
        f"its process refused {command}: {reason}",
        before={"state": replica.state},
        after={"state": replica.state, "refused": command},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )


HANDLERS = {
    "progress": _progress,
    "serving": on_serving,
    "woken": _woken,
    "sleeping": _sleeping,
    "failed": _failed,
    "stopped": _stopped,
    "arena": _arena,
    "deep_sleeping": _deep_sleeping,
    "error": _refused,
}


def _pair_report_from_a_plain_replica(replica: Replica, event: dict[str, Any]) -> None:
    log.warning("replica %s is in no failover pair but reported %s; ignoring", replica.id, event.get("event"))


# Reports only failover pair members make (scheduling.services.failover handles them).
PAIR_ONLY = dict.fromkeys(("failover", "lease", "standby", "active"), _pair_report_from_a_plain_replica)


def _measured_bytes(deployment: Deployment, event: dict[str, Any]) -> int | None:
    """What one replica holds serving at max_tokens, as the replica composed it from measured
    parts with gpuportal.wire.memory's formula (its weights as allocated, the pool, the activation
    reserve, its context, what NVML shows outside the allocator): the need the next replica is
    reserved and sizes its pool against. Not NVML's figure at load: it has no activations yet,
    and a replica reserved it would size its pool below zero.

    Replicas of an older build report no need: then their tensor bytes plus the reserves the
    estimate budgets beside them."""
    if isinstance(event.get("need_bytes"), int) and event["need_bytes"] > 0:
        return int(event["need_bytes"])
    weights = event.get("weights_bytes")
    if not weights:
        return None
    record = deployment.observed
    reserves = max(0, (record.memory_estimate_bytes or 0) - (record.weight_bytes or 0))
    return int(weights) + reserves


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
