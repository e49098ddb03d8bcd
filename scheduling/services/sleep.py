"""Sleep and wake: idle replicas park their weights in CPU RAM and come back on demand.

Sleep is temporary: unlike an operator's evict it leaves `replicas_wanted` alone, so the
deployment still wants its replicas and the next wake brings back as many (a request's wake of
an autoscaled deployment, as many as its waiting requests want: the autoscaler wakes the rest as
they grow). A wake promotes sleeping replicas first (their process and weights are still there)
and places new ones only when none is cached, or none fits on its node as things are. In that
last case a deployment with nothing awake whose load from disk is slower than a wake after its
max_wait (fairness.prefer_wake) wakes its copy all the same, by the fair wake path, rather than
load a new replica; and one whose replica is still draining to sleep waits for that copy, which
its sleeping report wakes.

Lock order, as in `deployments`: the deployment row, then GPU rows (the ledger), then replica rows.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Greatest
from django.utils import timezone

from gpuportal.wire.states import ASLEEP, AWAKE
from scheduling import ledger, locks
from scheduling.core import autoscale, costs, fairness
from scheduling.core.placement import POLICIES, CachedReplica, Placement, place
from scheduling.core.planning import withhold_locked
from scheduling.core.state import Snapshot
from scheduling.models import Deployment, Event, Replica, new_replica_id
from scheduling.services import deployments, outbox, placing, preemption, queueing, traffic
from scheduling.services import replicas as replica_services
from scheduling.services.errors import CannotPlace, InvalidState, ServiceError, TransitionRefused

log = logging.getLogger(__name__)

# Putting one replica to sleep is a replica's state change (preemption uses it too); the sleep
# service's callers find it here.
sleep_replica = replica_services.sleep_replica


def sleep_deployment(name: str, *, reason: str) -> list[str]:
    """Put every serving replica of the deployment to sleep; returns their ids."""
    with transaction.atomic():
        deployment = deployments.get(name, lock=True)
        serving = list(
            deployment.replicas.filter(state=Replica.State.SERVING).order_by("pk").values_list("id", flat=True)
        )
        for replica_id in serving:
            sleep_replica(replica_id, reason=reason, deployment=deployment)
    return serving


def awake_count(deployment: Deployment) -> int:
    """Replicas that count as awake for a wake: AWAKE, less a fair wake's waiter that has no
    place yet (it exists only to hold a wake lock and intents; a dead preempt task must not
    leave it counting as awake forever, see preemption.in_progress). A failover pair counts
    once, whichever member is up: a standby about to take over serves as well as its active."""
    awake = deployment.replicas.filter(state__in=AWAKE).exclude(state=Replica.State.PENDING, node=None)
    if not deployment.failover_standby:
        return awake.count()
    pairs = (
        deployment.replicas.filter(lease__isnull=False, state__in=(*AWAKE, Replica.State.STANDBY))
        .values("lease_id")
        .distinct()
        .count()
    )
    return pairs + awake.filter(lease__isnull=True).count()


def wake_replica(replica_id: str, *, reason: str) -> Replica:
    """Promote this sleeping replica back onto a GPU of its own node (its weights are in that
    node's RAM). When it fits only by evicting someone, the fair wake path (services.preemption)
    takes over: the replica stays sleeping until the preempt task places it. CannotPlace (409,
    with reasons) when not even evictions would make room; InvalidState (409) when it is not
    sleeping, or when another wake holds the lock of the GPU it needs (try again later)."""
    replica = replica_services.get(replica_id)
    with transaction.atomic():
        # The deployment row lock serialises this with scale, evict, sleep and other wakes, so
        # the state read below cannot be changed by another service before the commit.
        deployment = deployments.get(replica.deployment.name, lock=True)
        replica = replica_services.get(replica_id)
        if replica.state not in ASLEEP:
            why = "only a sleeping replica can be woken"
            raise TransitionRefused(replica_id, replica.state, Replica.State.WAKING, why)
        if replica.node is None:
            raise InvalidState(f"replica {replica_id} is asleep on no node, only a sleeping replica can be woken")
        if replica_id in preemption.in_progress(deployment):
            return replica
        why = f"{reason}: wake replica {replica_id[:8]}"
        cached = (CachedReplica(replica.id, replica.node.name),)
        try:
            with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                placing.add_replicas(deployment, 1, reason=why, cached=cached, allow_new=False, evictions=False)
        except CannotPlace:
            outcome = preemption.start(deployment, reason=why, cached=cached, allow_new=False)
            if isinstance(outcome, preemption.WaitingForLock):
                raise InvalidState(f"replica {replica_id} is {outcome.reason}; try again later") from None
    return replica_services.get(replica_id)


def wake_deployment(name: str, *, reason: str, for_requests: bool = False) -> list[str]:
    """Make sure at least max(1, replicas_wanted) replicas are awake (pending, loading, serving or
    waking): sleeping ones are promoted first, new ones placed for the rest. Returns the ids of
    the replicas this call promoted or placed; [] when enough were already awake. `for_requests`:
    woken for the requests waiting in its queue; an autoscaled deployment then wakes no more than
    they want (autoscale.wanted), and its sweep wakes more as they grow (autoscale.decide's
    `awake`), rather than all its last burst wanted for one request.

    Safe to call concurrently (the request path calls it for every request that finds no awake
    replica): the deployment row lock makes wakes of one deployment take turns, and each counts
    the replicas the previous one added. When not all wanted replicas fit, one is enough to
    serve: it places one rather than refusing.

    Placement here never evicts. When not even one fits in free memory, the fair wake
    path starts (services.preemption): a wake lock and intents on the GPUs it needs, and the
    preempt task waits out max_wait before choosing a victim; this returns the id of the replica
    that waits. A wake that finds another wake holding the lock returns [] and retries from the
    control queue. CannotPlace (409) only when not even evicting everyone evictable would help.
    With nothing awake, a sleeping copy that does not fit on its node as things are waits there by
    the fair wake path rather than a new replica load from disk on a free GPU, when the load is the
    slower (fairness.prefer_wake, `_wake_copy_rather_than_load`), and so does a replica still
    draining to sleep (`_wait_for_draining_copy`: its id is returned, and its sleep wakes it).
    (Operator scale-ups, deployments.scale, still evict at once: the operator asked for it.)
    """
    seen = Deployment.objects.filter(name=name).first()
    if _awake_enough(seen):
        return []  # the common case, without taking the row lock
    # Read before the row lock, not under it: a Redis round trip (or its timeout, when Redis is
    # down) would hold up every other wake and request of the deployment waiting on that lock.
    waiting_requests = _waiting_requests(seen) if for_requests and seen is not None else None
    with transaction.atomic():
        deployment = deployments.get(name, lock=True)
        waiting = preemption.in_progress(deployment)
        if waiting:
            return waiting  # a fair wake is already under way: one is enough
        awake = awake_count(deployment)
        missing = _wanted_awake(deployment, waiting_requests) - awake
        if missing <= 0:
            return []
        if awake == 0:
            # A request waits for this wake: the one place where a copy in CPU RAM may be worth
            # a fair wait rather than a load from disk (with a replica awake it is served already).
            # A copy on its way there (draining to sleep) is one too.
            woken = _wait_for_draining_copy(deployment, reason=f"{reason}: 0 → 1 awake")
            if woken is None:
                woken = _wake_copy_rather_than_load(deployment, reason=f"{reason}: 0 → 1 awake")
            if woken is not None:
                return woken
        why = f"{reason}: {awake} → {awake + missing} awake"
        attempts = [(missing, why)]
        if awake == 0 and missing > 1:
            attempts.append((1, f"{reason}: 0 → 1 awake (not all {missing} wanted fit)"))
        for count, because in attempts:
            try:
                with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                    decision = placing.add_replicas(deployment, count, reason=because, evictions=False, wake=True)
                return [p.replica_id for p in decision.placements]
            except CannotPlace:
                continue
        outcome = preemption.start(deployment, reason=f"{reason}: {awake} → {awake + 1} awake")
        if isinstance(outcome, preemption.Placed):
            return list(outcome.replica_ids)
        if isinstance(outcome, preemption.Preempting):
            return [outcome.replica_id]
        preemption.retry_later(name, reason)
        return []


def _waiting_requests(deployment: Deployment) -> int | None:
    """How many requests wait in an autoscaled deployment's queue (None: not autoscaled, or its
    queue unreadable, when a wake brings back all it wants)."""
    if deployment.autoscale_policy is None:
        return None
    try:
        return queueing.queue().depths([deployment.name])[deployment.name]
    except redis.RedisError as err:
        log.warning("wake of %s: cannot read its queue (%s): waking all it wants", deployment.name, err)
        return None


def _wanted_awake(deployment: Deployment, waiting_requests: int | None) -> int:
    wanted, policy = max(1, deployment.replicas_wanted), deployment.autoscale_policy
    if waiting_requests is None or policy is None:
        return wanted
    # The request that asks for this wake may not be queued yet: one at least.
    return min(wanted, autoscale.wanted(max(1, waiting_requests), policy))


def wake_again(name: str, *, reason: str) -> list[str]:
    """A wake that found another wake holding its GPU's lock, asked again (`wake_deployment`).
    Refused now, not even evictions making room (dedicated replicas took the GPUs meanwhile), its
    waiting requests end with the reason, as a failed fair wake's do, rather than wait out their
    timeout with nothing on its way to serve them; unless a replica of it is awake to serve them.
    A deployment deleted meanwhile had its requests ended by the delete."""
    try:
        return wake_deployment(name, reason=reason, for_requests=True)
    except CannotPlace as err:
        deployment = Deployment.objects.filter(name=name).first()
        if deployment is not None and not awake_count(deployment):
            queueing.fail_waiting(name, f"cannot wake {name}: {err}")
        raise


def reload_times(deployment: Deployment) -> fairness.ReloadTimes:
    """The deployment's load from disk and wake from CPU RAM: what its replicas measured, else the
    cost model's estimate from its weights (scheduling.core.costs, which the capacity planner's
    simulator uses too, with the weights its catalogue entry carries, so that both judge it alike)."""
    weights, hardware, observed = traffic.weight_bytes_of(deployment), costs.hardware(), deployment.observed
    return fairness.ReloadTimes(
        load_s=costs.disk_load_s(weights, hardware, observed.measured_load_s),
        wake_s=costs.ram_wake_s(weights, hardware, observed.measured_wake_s),
        load_measured=observed.measured_load_s is not None,
        wake_measured=observed.measured_wake_s is not None,
    )


class _LoadAfterAll(Exception):
    """Raised inside the savepoint of a fair wake of the copy, to undo it and load from disk."""


def _wait_for_draining_copy(deployment: Deployment, *, reason: str) -> list[str] | None:
    """fairness.prefer_wake for a copy not asleep yet: with nothing awake but a replica draining to
    sleep (a preemption's victim finishing its requests, an idle sleep), a request waits for that
    copy rather than start a load from disk, where the load is the slower. The replica's sleeping
    report then wakes the deployment (`Replica.wake_when_asleep`), and the copy wakes as any other.
    Loading anew instead would take a second replica's memory, often by preempting someone else,
    for a first token later than the copy's (a 32B model: 32 s from disk, 3.3 s from CPU RAM). The
    capacity planner's simulator waits likewise (for every deployment: it does not load the small
    ones anew either, a difference of a second or so at most). Returns the draining replicas' ids,
    with an Event for each newly waited for; None to wake as before: none draining, or the load the
    faster.

    The caller holds the deployment row lock, which the replica's report takes first too: either
    the report came first (the copy is asleep, woken as usual below) or it comes after this commits
    and finds the flag, whatever the queue holds by then (the request is queued only after this)."""
    draining = list(
        deployment.replicas.filter(state=Replica.State.DRAINING, node__isnull=False)
        .order_by("pk")
        .values_list("id", "node__name", "wake_when_asleep")
    )
    if draining:
        # Not on a node its node selector or tolerations keep it off: it could not wake there.
        refused = placing.node_refusals(deployment)
        draining = [row for row in draining if row[1] not in refused]
    if not draining:
        return None
    times = reload_times(deployment)
    choice = fairness.wake_or_load(times, max_wait_s=deployment.max_wait_s)
    if not choice.wake:
        return None
    newly = [(replica_id, node) for replica_id, node, flagged in draining if not flagged]
    Replica.objects.filter(pk__in=[replica_id for replica_id, _ in newly]).update(wake_when_asleep=True)
    for replica_id, node in newly:
        outbox.note(
            Event.Kind.REPLICA_STATE,
            f"replica {replica_id[:8]}",
            f"waiting for it to finish draining and wake from the CPU RAM of {node} rather than loading a new "
            f"replica from disk: {choice.reason} (fairness.prefer_wake), the drain at most "
            f"{deployment.drain_timeout_s:g} s; {reason}",
            before={"choice": "load from disk"},
            after={"choice": "wake once asleep", "load_s": times.load_s, "wake_s": times.wake_s},
            node=node,
            deployment=deployment.name,
            replica=replica_id,
        )
    return [replica_id for replica_id, _, _ in draining]


def _wake_copy_rather_than_load(deployment: Deployment, *, reason: str) -> list[str] | None:
    """fairness.prefer_wake in the live wake path: where placement in free memory would load a new
    replica from disk because no sleeping copy fits on its node, and the load is the slower, the
    copy waits for room on its node by the fair wake path instead (a wait of at most max_wait,
    shorter when its victims serve nothing). Returns the copy's id (promoted, or waiting behind
    its intents), with an Event saying why; None to wake as before: nothing cached, the copy fits
    as things are, nothing fits anywhere (the fair path then targets the copy's node anyway), the
    load is the faster, or fairness finds no victims on the copy's node (popular, dedicated: a wait
    that would end in a failed wake) or another wake holds its lock (a wait without the bound
    max_wait gives): the rule's premise is gone then. The caller holds the deployment row lock."""
    cached = placing.cached_of(deployment)
    if not cached:
        return None
    times = reload_times(deployment)
    choice = fairness.wake_or_load(times, max_wait_s=deployment.max_wait_s)
    if not choice.wake or not _loads_from_disk(deployment, cached):
        return None
    because = f"{reason}, its copy in CPU RAM rather than a load from disk"
    try:
        with transaction.atomic():  # a savepoint: a wake that falls back leaves no rows or Events
            outcome = preemption.start(deployment, reason=because, cached=cached, allow_new=False, by_cost_only=True)
            if isinstance(outcome, preemption.WaitingForLock):
                raise _LoadAfterAll(outcome.reason)
    except (CannotPlace, _LoadAfterAll) as err:
        log.info("%s: loading from disk after all, its copy cannot wake: %s", deployment.name, err)
        return None
    if isinstance(outcome, preemption.Placed):
        woken, how = list(outcome.replica_ids), "promoted: room was freed meanwhile"
    else:
        woken, how = [outcome.replica_id], outcome.reason
    # allow_new=False: whoever woke or waits is one of the copies.
    copy = woken[0]
    node = next(c.node for c in cached if c.replica_id == copy)
    outbox.note(
        Event.Kind.REPLICA_STATE,
        f"replica {copy[:8]}",
        f"waking the copy in the CPU RAM of {node} rather than loading a new replica from disk on a free GPU: "
        f"{choice.reason} (fairness.prefer_wake); {how}; {reason}",
        before={"choice": "load from disk"},
        after={
            "choice": "wake from CPU RAM",
            "load_s": times.load_s,
            "wake_s": times.wake_s,
            "max_wait_s": deployment.max_wait_s,
            "load_measured": times.load_measured,
            "wake_measured": times.wake_measured,
        },
        node=node,
        deployment=deployment.name,
        replica=copy,
    )
    return woken


def _loads_from_disk(deployment: Deployment, cached: tuple[CachedReplica, ...]) -> bool:
    """Whether a wake in free memory (add_replicas with evictions=False, as wake_deployment's first
    attempt) would load a new replica from disk rather than promote a copy: placement's own answer
    on a snapshot, as the simulator asks it before applying the same rule. It reads; it commits nothing."""
    snap = ledger.snapshot()
    need = placing.need_bytes(deployment, snap)
    new_id = new_replica_id()
    snap, _ = withhold_locked(snap, [new_id, *(c.replica_id for c in cached)], timezone.now())
    (request,) = placing.placement_requests(deployment, [new_id], need.bytes, cached)
    result = place(snap, request, policy=replace(POLICIES[deployment.memory_policy], evictions=False))
    return isinstance(result, Placement) and result.promoted is None


def _idle(deployment: Deployment, now: datetime, idle_s: float | None = None) -> QuerySet[Replica]:
    """The deployment's serving replicas idle past `idle_s` (its idle_timeout_s by default), each
    with `idle_since`."""
    cutoff = now - timedelta(seconds=deployment.idle_timeout_s if idle_s is None else idle_s)
    return (
        Replica.objects.filter(deployment=deployment, state=Replica.State.SERVING)
        .annotate(idle_since=Greatest(F("last_accessed"), F("serving_since")))
        .filter(idle_since__lt=cutoff)
    )


def _kept_awake(deployment: Deployment, times: fairness.ReloadTimes, now: datetime) -> None:
    """fairness.sleep_when_idle said no: the deployment's idle replicas stay on their GPUs until a
    wake needs the memory (idle, they are the victims it preempts at once). Said by an Event once
    per idle stretch of each replica, not on every sweep. The caller holds the deployment row."""
    for replica_id, node, idle_since in _idle(deployment, now).values_list("id", "node__name", "idle_since"):
        said = Event.objects.filter(
            replica=replica_id, kind=Event.Kind.REPLICA_STATE, time__gte=idle_since, reason__startswith=KEPT_AWAKE
        )
        if said.exists():
            continue
        outbox.note(
            Event.Kind.REPLICA_STATE,
            f"replica {replica_id[:8]}",
            f"{KEPT_AWAKE} after {int((now - idle_since).total_seconds())} s idle: a wake from CPU RAM takes "
            f"{fairness.describe_reload(times.wake_s, times.wake_measured)}, longer than the "
            f"{settings.GPUPORTAL_TTFT_SLO_S:g} s to first token aimed for (GPUPORTAL_TTFT_SLO_S; "
            "fairness.sleep_when_idle); it sleeps when a wake needs its memory",
            before={"state": Replica.State.SERVING},
            after={"state": Replica.State.SERVING, "wake_s": times.wake_s, "slo_ttft_s": settings.GPUPORTAL_TTFT_SLO_S},
            node=node or "",
            deployment=deployment.name,
            replica=replica_id,
        )


# How the Event of a replica the idle sweep keeps awake begins (one per idle stretch).
KEPT_AWAKE = "kept awake"


def awake_enough(name: str) -> bool:
    """Whether the deployment has max(1, replicas wanted) replicas awake (a pair counts once)."""
    return _awake_enough(Deployment.objects.filter(name=name).first())


def _awake_enough(deployment: Deployment | None) -> bool:
    if deployment is None:
        return False  # let the locked path raise NotFound
    return awake_count(deployment) >= max(1, deployment.replicas_wanted)


def sweep_idle(now: datetime | None = None) -> list[str]:
    """Put to sleep every serving replica idle for longer than its deployment's idle_timeout_s
    (0: never; popular deployments: never; a deployment whose wake from CPU RAM alone is slower
    than GPUPORTAL_TTFT_SLO_S: not on the timer, fairness.sleep_when_idle); and, before the timer,
    those idle for max_wait on a node that has no room for a copy asleep there
    (fairness.sleep_early, `_sleep_early`). Returns the ids put to sleep.

    Idle since the later of its last request and its start of serving: a replica just woken
    by an operator has not been asked anything yet, and must not go straight back to sleep.
    Deployments and replicas another transaction holds (a wake, a request touching the replica)
    are skipped this round; beat runs the sweep again in a few seconds.
    """
    # Requests record their replica's last access in Redis; bring it over before judging idleness.
    # Imported here: the request service itself wakes deployments through this module.

    queueing.sync_last_accessed()
    now = now or timezone.now()
    idle_since = Greatest(F("last_accessed"), F("serving_since"))
    timeout = ExpressionWrapper(F("deployment__idle_timeout_s") * timedelta(seconds=1), output_field=DurationField())
    candidates = (
        Replica.objects.filter(
            state=Replica.State.SERVING,
            deployment__idle_timeout_s__gt=0,
            deployment__popular=False,
            # A failover pair keeps serving: its members never sleep (services.failover).
            deployment__failover_standby=False,
        )
        .annotate(idle_since=idle_since)
        .filter(idle_since__lt=now - timeout)
        .values_list("deployment_id", flat=True)
        .distinct()
    )
    slept: list[str] = []
    for deployment_id in sorted(candidates):
        try:
            slept += _sleep_idle_of(deployment_id, now)
        except ServiceError as err:
            # One deployment's trouble must not keep the others awake.
            log.warning("idle sweep of deployment %s: %s", deployment_id, err)
    return slept + _sleep_early(now)


def _sleep_early(now: datetime) -> list[str]:
    """fairness.sleep_early: serving replicas idle for their deployment's max_wait, on a node that
    has no room for a copy asleep there which would wake within GPUPORTAL_TTFT_SLO_S, sleep before
    their idle timeout (those that wake within it themselves). Returns the ids put to sleep."""
    idle_since = Greatest(F("last_accessed"), F("serving_since"))
    max_wait = ExpressionWrapper(F("deployment__max_wait_s") * timedelta(seconds=1), output_field=DurationField())
    idle = dict(
        Replica.objects.filter(
            state=Replica.State.SERVING,
            node__isnull=False,
            deployment__idle_timeout_s__gt=0,
            deployment__popular=False,
            deployment__failover_standby=False,
        )
        .annotate(idle_since=idle_since)
        .filter(idle_since__lt=now - max_wait)
        .values_list("id", "node__name")
    )
    if not idle:
        return []
    snap = ledger.snapshot()
    short = _short_of_room(sorted(set(idle.values())), snap)
    pressed = {rid: short[node] for rid, node in idle.items() if short[node] is not None}
    by_deployment = Replica.objects.filter(pk__in=pressed).values_list("deployment_id", flat=True).distinct()
    slept: list[str] = []
    for deployment_id in sorted(by_deployment):
        try:
            slept += _sleep_early_of(deployment_id, pressed, now)
        except ServiceError as err:
            log.warning("early sleep of deployment %s: %s", deployment_id, err)
    return slept


def _short_of_room(nodes: list[str], snap: Snapshot) -> dict[str, fairness.AsleepCopy | None]:
    """fairness.short_of_room for each of `nodes`: its GPUs in `snap`, and the deployments with
    nothing awake whose copy sleeps in its CPU RAM (each judged once, wherever its copies are)."""
    there: dict[str, set[int]] = {node: set() for node in nodes}
    for deployment_id, node in Replica.objects.filter(state__in=ASLEEP, node__name__in=nodes).values_list(
        "deployment_id", "node__name"
    ):
        there[node].add(deployment_id)
    copies: dict[int, fairness.AsleepCopy] = {}
    asleep_there = Deployment.objects.filter(pk__in=set().union(*there.values())).select_related("observed")
    for deployment in asleep_there.order_by("pk"):
        if awake_count(deployment):
            continue
        copies[deployment.pk] = fairness.AsleepCopy(
            deployment.name,
            placing.need_bytes(deployment, snap).bytes,
            reload_times(deployment).wake_s,
            POLICIES[deployment.memory_policy].whole_gpu_from,
        )
    slo = settings.GPUPORTAL_TTFT_SLO_S
    return {
        node: fairness.short_of_room(
            snap.index.on_node.get(node, ()),
            [copies[d] for d in sorted(ids) if d in copies],
            slo_ttft_s=slo,
        )
        for node, ids in there.items()
    }


def _sleep_early_of(deployment_id: int, pressed: dict[str, fairness.AsleepCopy], now: datetime) -> list[str]:
    """The replicas of one deployment among `pressed` (replica id -> the copy its node has no
    room for) that fairness.sleep_early sends to sleep, judged again under the locks."""
    slept: list[str] = []
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(pk=deployment_id, skip_locked=True)
        if deployment is None or deployment.popular or deployment.failover_standby or deployment.idle_timeout_s <= 0:
            return []
        times = reload_times(deployment)
        slo = settings.GPUPORTAL_TTFT_SLO_S
        idle = _idle(deployment, now, deployment.max_wait_s).filter(pk__in=pressed)
        for replica in locks.lock_replicas(idle, skip_locked=True):
            copy = pressed[replica.id]
            idle_s = (now - replica.idle_since).total_seconds()
            if not fairness.sleep_early(
                wake_s=times.wake_s, slo_ttft_s=slo, idle_s=idle_s, max_wait_s=deployment.max_wait_s, short=copy
            ):
                continue
            reason = (
                f"slept after {int(idle_s)} s idle, before its idle timeout: its node has no room for the wake of "
                f"{copy.deployment} (asleep there, it wakes in {fairness.describe_reload(copy.wake_s, None)}), and "
                f"this one wakes in {fairness.describe_reload(times.wake_s, times.wake_measured)}, within the "
                f"{slo:g} s to first token aimed for (fairness.sleep_early)"
            )
            sleep_replica(replica.id, reason=reason, deployment=deployment)
            slept.append(replica.id)
    return slept


def _sleep_idle_of(deployment_id: int, now: datetime) -> list[str]:
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(pk=deployment_id, skip_locked=True)
        # Re-checked under the lock: the settings may have changed since the candidates were read.
        if deployment is None or deployment.popular or deployment.failover_standby or deployment.idle_timeout_s <= 0:
            return []
        times = reload_times(deployment)
        if not fairness.sleep_when_idle(wake_s=times.wake_s, slo_ttft_s=settings.GPUPORTAL_TTFT_SLO_S):
            _kept_awake(deployment, times, now)
            return []
        idle = locks.lock_replicas(_idle(deployment, now), skip_locked=True)
        for replica in idle:
            idle_s = int((now - replica.idle_since).total_seconds())
            sleep_replica(replica.id, reason=f"slept after {idle_s} s idle", deployment=deployment)
    return [r.id for r in idle]
