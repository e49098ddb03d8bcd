"""Sleep and wake: idle replicas park their weights in CPU RAM and come back on demand.

Sleep is temporary: unlike an operator's evict it leaves `replicas_wanted` alone, so the
deployment still wants its replicas and the next wake brings back as many. A wake promotes
sleeping replicas first (their process and weights are still there) and places new ones only
when none is cached.

Lock order, as in `deployments`: the deployment row, then GPU rows (the ledger), then replica rows.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F
from django.db.models.functions import Greatest
from django.utils import timezone

from scheduling import locks
from scheduling.models import Deployment, Replica
from scheduling.placement import CachedReplica
from scheduling.services import deployments, preemption, queueing
from scheduling.services import replicas as replica_services
from scheduling.services.deployments import AWAKE
from scheduling.services.errors import CannotPlace, InvalidState, ServiceError

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
        if replica.state != Replica.State.SLEEPING or replica.node is None:
            raise InvalidState(f"replica {replica_id} is {replica.state}, only a sleeping replica can be woken")
        if replica_id in preemption.in_progress(deployment):
            return replica
        why = f"{reason}: wake replica {replica_id[:8]}"
        cached = (CachedReplica(replica.id, replica.node.name),)
        try:
            with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                deployments.add_replicas(deployment, 1, reason=why, cached=cached, allow_new=False, evictions=False)
        except CannotPlace:
            outcome = preemption.start(deployment, reason=why, cached=cached, allow_new=False)
            if isinstance(outcome, preemption.WaitingForLock):
                raise InvalidState(f"replica {replica_id} is {outcome.reason}; try again later") from None
    return replica_services.get(replica_id)


def wake_deployment(name: str, *, reason: str) -> list[str]:
    """Make sure at least max(1, replicas_wanted) replicas are awake (pending, loading, serving or
    waking): sleeping ones are promoted first, new ones placed for the rest. Returns the ids of
    the replicas this call promoted or placed; [] when enough were already awake.

    Safe to call concurrently (the request path calls it for every request that finds no awake
    replica): the deployment row lock makes wakes of one deployment take turns, and each counts
    the replicas the previous one added. When not all wanted replicas fit, one is enough to
    serve: it places one rather than refusing.

    Placement here never evicts (issue 5). When not even one fits in free memory, the fair wake
    path starts (services.preemption): a wake lock and intents on the GPUs it needs, and the
    preempt task waits out max_wait before choosing a victim; this returns the id of the replica
    that waits. A wake that finds another wake holding the lock returns [] and retries from the
    control queue. CannotPlace (409) only when not even evicting everyone evictable would help.
    (Operator scale-ups, deployments.scale, still evict at once: the operator asked for it.)
    """
    if _awake_enough(Deployment.objects.filter(name=name).first()):
        return []  # the common case, without taking the row lock
    with transaction.atomic():
        deployment = deployments.get(name, lock=True)
        waiting = preemption.in_progress(deployment)
        if waiting:
            return waiting  # a fair wake is already under way: one is enough
        awake = awake_count(deployment)
        missing = max(1, deployment.replicas_wanted) - awake
        if missing <= 0:
            return []
        why = f"{reason}: {awake} → {awake + missing} awake"
        attempts = [(missing, why)]
        if awake == 0 and missing > 1:
            attempts.append((1, f"{reason}: 0 → 1 awake (not all {missing} wanted fit)"))
        for count, because in attempts:
            try:
                with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                    decision = deployments.add_replicas(deployment, count, reason=because, evictions=False)
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


def awake_enough(name: str) -> bool:
    """Whether the deployment has max(1, replicas wanted) replicas awake (a pair counts once)."""
    return _awake_enough(Deployment.objects.filter(name=name).first())


def _awake_enough(deployment: Deployment | None) -> bool:
    if deployment is None:
        return False  # let the locked path raise NotFound
    return awake_count(deployment) >= max(1, deployment.replicas_wanted)


def sweep_idle(now: datetime | None = None) -> list[str]:
    """Put to sleep every serving replica idle for longer than its deployment's idle_timeout_s
    (0: never; popular deployments: never). Returns the ids put to sleep.

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
    return slept


def _sleep_idle_of(deployment_id: int, now: datetime) -> list[str]:
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(pk=deployment_id, skip_locked=True)
        # Re-checked under the lock: the settings may have changed since the candidates were read.
        if deployment is None or deployment.popular or deployment.failover_standby or deployment.idle_timeout_s <= 0:
            return []
        cutoff = now - timedelta(seconds=deployment.idle_timeout_s)
        idle = locks.lock_replicas(
            Replica.objects.filter(deployment=deployment, state=Replica.State.SERVING)
            .annotate(idle_since=Greatest(F("last_accessed"), F("serving_since")))
            .filter(idle_since__lt=cutoff),
            skip_locked=True,
        )
        for replica in idle:
            idle_s = int((now - replica.idle_since).total_seconds())
            sleep_replica(replica.id, reason=f"slept after {idle_s} s idle", deployment=deployment)
    return [r.id for r in idle]
