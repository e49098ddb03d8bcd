"""The fair wake path (seed 001, issue 5): who sleeps and who wakes when memory is short.

A wake that does not fit without evicting anyone does not evict at once. Instead it:

1. asks placement, with evictions allowed, where it *would* go (node, GPUs, bytes), without
   committing anything;
2. takes the WAKE LOCK of each of those GPUs (at most one wake in progress per GPU, DESIGN
   invariant 2); a lock held by a live replica and not expired makes this wake wait and retry;
   an expired one, or one whose holder is gone, stopped or failed, is taken over;
3. writes a PreemptionIntent per GPU (deadline = created_at + the deployment's max_wait_s);
4. leaves the waiting to the control task `scheduling.tasks.preempt` (`run_preemption`): it
   re-checks every second whether the waker fits without evictions (a voluntary sleep or a
   scale-down freed memory); at the deadline it asks fairness.choose_victim, puts the victims to
   sleep, waits for their memory, and places the waker, with evictions still forbidden: the
   commit path (compare-and-swap) is what claims the freed bytes.

Lock order, as everywhere: the deployment row, then GPU rows in primary-key order, then replica
rows. The wake lock columns live on the GPU rows. Placements keep off a GPU whose lock another
wake holds, so the memory a preemption frees there goes to the waker (planning.withhold_locked);
taking a lock bumps the GPU's version so that a plan made before it conflicts and looks again,
while renewing or releasing it bumps nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.expressions import RawSQL
from django.utils import timezone

from gpuportal.celery import app
from scheduling import events, fairness, ledger
from scheduling.metrics import PREEMPTION_WAIT_SECONDS, PREEMPTIONS
from scheduling.models import ACTIVE_INTENT_STATUSES, GPU, Deployment, Event, PreemptionIntent, Replica, new_replica_id
from scheduling.placement import POLICIES, CachedReplica, CantAccommodate, PlacementRequest, fmt_bytes, place
from scheduling.services import deployments
from scheduling.services import replicas as replica_services
from scheduling.services.deployments import GONE
from scheduling.services.errors import CannotPlace, InvalidState

log = logging.getLogger(__name__)

PREEMPT_TASK = "scheduling.tasks.preempt"
WAKE_TASK = "scheduling.tasks.wake"
CONTROL_QUEUE = "control"
# Seed 001: the waiter re-checks fit every second during max_wait, and polls the victims'
# release more often, since by then the waker is the one the user is waiting on.
CHECK_EVERY_S = 1.0
POLL_EVERY_S = 0.2
# Beyond the victims' drain_timeout: time for the process to move its weights and report.
RELEASE_GRACE_S = 30.0
# A wake that waits for another's lock asks again this much later (the holder's wake takes at
# least max_wait, so asking more often would only write more Events).
LOCK_RETRY_S = 2.0
# Rounds of victim choice before a wake gives up because freed memory keeps being taken.
VICTIM_ROUNDS = 2


@dataclass(frozen=True)
class Placed:
    """It fitted without evicting anyone after all: placed at once."""

    replica_ids: tuple[str, ...]


@dataclass(frozen=True)
class Preempting:
    """An intent per target GPU is written and the preempt task will finish the wake."""

    replica_id: str
    intent_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class WaitingForLock:
    """Another wake holds the lock of a GPU this one needs; nothing was written but an Event."""

    gpu: str
    holder: str
    reason: str


@dataclass(frozen=True)
class Outcome:
    """How a run of `run_preemption` ended."""

    status: str  # an intent status: satisfied, failed, cancelled
    reason: str
    replica_id: str = ""
    victims: tuple[str, ...] = field(default_factory=tuple)


# -- starting a wake ---------------------------------------------------------------------------


def in_progress(deployment: Deployment) -> list[str]:
    """Replicas of the deployment that already wait behind live intents (the caller holds the
    deployment row lock). Intents whose preempt task died (their lock lapsed or was taken over)
    are cancelled here, so a lost worker cannot keep a deployment from ever waking again."""
    now = timezone.now()
    live: list[str] = []
    intents = (
        PreemptionIntent.objects.select_related("gpu__node", "waiting_replica")
        .filter(waiting_replica__deployment=deployment, status__in=ACTIVE_INTENT_STATUSES)
        .order_by("pk")
    )
    stale: dict[str, list[PreemptionIntent]] = {}
    for intent in intents:
        gpu = intent.gpu
        held = gpu.wake_lock_holder_id == intent.waiting_replica_id and (
            gpu.wake_lock_expires_at is None or gpu.wake_lock_expires_at > now
        )
        if held:
            live.append(intent.waiting_replica_id)
        else:
            stale.setdefault(intent.waiting_replica_id, []).append(intent)
    for replica_id, abandoned in stale.items():
        if replica_id in live:
            continue
        _close(
            abandoned,
            PreemptionIntent.Status.CANCELLED,
            "abandoned: its wake lock lapsed or was taken over (the preempt task is gone)",
        )
        _drop_unplaced(replica_id, "its wake was abandoned (the preempt task is gone)")
    return list(dict.fromkeys(live))


def start(
    deployment: Deployment,
    *,
    reason: str,
    cached: tuple[CachedReplica, ...] | None = None,
    allow_new: bool = True,
) -> Placed | Preempting | WaitingForLock:
    """Begin the fair wake of one replica that does not fit without evictions.

    The caller holds the deployment row lock inside a transaction. CannotPlace (409) when not
    even evicting every evictable occupant would make room: no wait could help then.
    """
    if cached is None:
        cached = deployments.cached_of(deployment)
    snap = ledger.snapshot()
    need = deployments.need_bytes(deployment, snap)
    # Targeting only: where the waker would go if every non-dedicated occupant of other
    # deployments could leave. Popular and young ones count as movable here because max_wait
    # may change that (a voluntary sleep, min_runtime passing); whether anyone really is
    # preempted is fairness.choose_victim's call at the deadline. Dedicated ones never move, so
    # a GPU full of them is a 409 now rather than a wait that cannot succeed.
    request = PlacementRequest(
        deployment=deployment.name,
        replica_id=new_replica_id(),
        need_bytes=need.bytes,
        dedicated=True,
        cached=cached,
        allow_new=allow_new,
    )
    targeting = replace(POLICIES[deployment.memory_policy], protect_fairness=False)
    target = place(snap, request, policy=targeting)
    if isinstance(target, CantAccommodate):
        raise CannotPlace(target.reason, target.reasons)
    if not target.evictions:
        # Memory was freed between the caller's attempt and this snapshot: no one need wait...
        try:
            with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                decision = deployments.add_replicas(
                    deployment, 1, reason=reason, cached=cached, allow_new=allow_new, evictions=False
                )
            return Placed(tuple(p.replica_id for p in decision.placements))
        except CannotPlace:
            pass  # ...unless that room is on a GPU another wake holds: its lock decides below
    waker_id = target.promoted or target.replica_id
    residual = {
        gpu_id: sum(o.reserved_bytes for o in snap.gpus[gpu_id].occupants if o.replica_id == waker_id)
        for gpu_id in target.gpu_ids
    }
    needed = {gpu_id: max(1, target.bytes_by_gpu[gpu_id] - residual[gpu_id]) for gpu_id in target.gpu_ids}
    now = timezone.now()
    gpus = _lock_target_gpus(target.gpu_ids)
    if gpus is None:
        return WaitingForLock("", "", "waiting: the wake locks of its GPUs changed hands while they were being taken")
    for gpu in gpus:
        blocked = _held_by_another(gpu, waker_id, now)
        if blocked is not None:
            return _wait_for_lock(deployment, gpu, blocked, reason)
    if target.promoted:
        waker = Replica.objects.select_related("node").get(pk=waker_id)
    else:
        # The row exists before anything points at it (lock holder, intents); it has no node
        # until placed, and wake paths do not count it as awake (see sleep.awake_count).
        waker = Replica.objects.create(id=waker_id, deployment=deployment)
        events.record(
            Event.Kind.REPLICA_STATE,
            f"replica {waker_id[:8]}",
            f"waiting for room on {_labels(gpus)} for a new replica: {reason}",
            after={"state": Replica.State.PENDING, "gpus": [_label(g) for g in gpus]},
            deployment=deployment.name,
            replica=waker_id,
        )
    _take_locks(gpus, waker, deployment, now)
    intents = []
    for gpu in gpus:
        intent = PreemptionIntent.objects.create(
            gpu=gpu, waiting_replica=waker, needed_bytes=needed[gpu.pk], deadline=now
        )
        intent.deadline = fairness.wait_deadline(intent.created_at, deployment.max_wait_s)
        intent.save(update_fields=["deadline"])
        intents.append(intent)
        events.record(
            Event.Kind.PREEMPTION_INTENT,
            f"gpu {_label(gpu)}",
            f"{deployment.name} ({waker_id[:8]}) needs {fmt_bytes(needed[gpu.pk])} on gpu {_label(gpu)}: "
            f"waits up to its max_wait of {deployment.max_wait_s:g} s for memory freed voluntarily, "
            f"then preempts ({reason}); placement with evictions would be: {target.reason}",
            after={"intent": intent.pk, "needed_bytes": needed[gpu.pk], "deadline": intent.deadline.isoformat()},
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment.name,
            replica=waker_id,
        )
    ids = [i.pk for i in intents]
    transaction.on_commit(lambda: app.send_task(PREEMPT_TASK, args=[ids], queue=CONTROL_QUEUE))
    return Preempting(waker_id, tuple(ids), f"waiting up to {deployment.max_wait_s:g} s for room on {_labels(gpus)}")


def _lock_target_gpus(target_ids: Iterable[int]) -> list[GPU] | None:
    """Row-lock the target GPUs, and with them every GPU whose intents a takeover of their wake
    locks would cancel, all at once in primary-key order (the global lock order): cancelling a
    previous holder's intents must not lock a GPU below one already held. None when the holders
    changed between the look and the locks (the caller tries again later)."""
    targets = set(target_ids)

    def intents_of_holders(gpus: Iterable[tuple[int, str | None]]) -> set[int]:
        holders = {holder for pk, holder in gpus if pk in targets and holder is not None}
        return set(
            PreemptionIntent.objects.filter(
                waiting_replica_id__in=holders, status__in=ACTIVE_INTENT_STATUSES
            ).values_list("gpu_id", flat=True)
        )

    seen = GPU.objects.filter(pk__in=targets).values_list("pk", "wake_lock_holder_id")
    ids = targets | intents_of_holders(seen)
    locked = list(GPU.objects.select_for_update(of=("self",)).select_related("node").filter(pk__in=ids).order_by("pk"))
    if not intents_of_holders((g.pk, g.wake_lock_holder_id) for g in locked) <= ids:
        return None
    return [g for g in locked if g.pk in targets]


def _held_by_another(gpu: GPU, waker_id: str, now: datetime) -> Replica | None:
    """The live holder of the GPU's wake lock, if it is someone else and not expired."""
    if gpu.wake_lock_holder_id is None or gpu.wake_lock_holder_id == waker_id:
        return None
    if gpu.wake_lock_expires_at is not None and gpu.wake_lock_expires_at <= now:
        return None
    holder = Replica.objects.select_related("deployment").filter(pk=gpu.wake_lock_holder_id).first()
    if holder is None or holder.state in GONE:
        return None
    return holder


def _wait_for_lock(deployment: Deployment, gpu: GPU, holder: Replica, reason: str) -> WaitingForLock:
    why = (
        f"waiting for the wake lock of gpu {_label(gpu)} held by {holder.deployment.name} ({holder.id[:8]}) "
        f"until {gpu.wake_lock_expires_at.isoformat() if gpu.wake_lock_expires_at else 'it is released'}"
    )
    # One Event per wait, not per retry: a retry every few seconds would otherwise flood the trail.
    if not Event.objects.filter(
        kind=Event.Kind.GPU_WAKE_LOCK, deployment=deployment.name, gpu=_label(gpu), after__waiting_for=holder.id
    ).exists():
        events.record(
            Event.Kind.GPU_WAKE_LOCK,
            f"gpu {_label(gpu)}",
            f"{deployment.name} {why}: {reason}",
            after={"waiting_for": holder.id},
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment.name,
        )
    return WaitingForLock(_label(gpu), holder.id, why)


def wake_later(name: str, reason: str) -> None:
    """Ask the control queue to wake this deployment once the caller's transaction committed."""
    transaction.on_commit(lambda: app.send_task(WAKE_TASK, args=[name, reason], queue=CONTROL_QUEUE))


def retry_later(name: str, reason: str) -> None:
    """Ask the control queue to try this wake again once the lock may be free."""
    transaction.on_commit(
        lambda: app.send_task(WAKE_TASK, args=[name, reason], queue=CONTROL_QUEUE, countdown=LOCK_RETRY_S)
    )


def _take_locks(gpus: list[GPU], waker: Replica, deployment: Deployment, now: datetime) -> None:
    expires = now + timedelta(seconds=settings.GPUPORTAL_WAKE_LOCK_TTL_S)
    for gpu in gpus:  # already locked, in pk order
        previous = gpu.wake_lock_holder_id
        if previous == waker.id:
            how = "renewed"
        elif previous is None and gpu.wake_lock_expires_at is None:
            how = "taken"
        else:
            how = "taken over"
        if how == "taken over":
            # Said before the previous wake is cancelled below, which changes its holder's state.
            old = Replica.objects.filter(pk=previous).values_list("state", flat=True).first() if previous else None
            if previous is None or old is None:
                why = "its holder is gone"
            elif old in GONE:
                why = f"its holder {previous[:8]} is {old}"
            else:
                why = f"it expired at {gpu.wake_lock_expires_at.isoformat()} without being released"
            text = f"wake lock taken over by {deployment.name} ({waker.id[:8]}): {why}"
        else:
            text = f"wake lock {how} by {deployment.name} ({waker.id[:8]}) to wake it; expires {expires.isoformat()}"
        if how == "taken over" and previous is not None:
            # The previous holder's wake is dead: its intents must not stay active for ever.
            _close(
                list(PreemptionIntent.objects.filter(waiting_replica_id=previous, status__in=ACTIVE_INTENT_STATUSES)),
                PreemptionIntent.Status.CANCELLED,
                f"its wake lock on gpu {_label(gpu)} was taken over by {deployment.name} ({waker.id[:8]})",
            )
            _drop_unplaced(previous, "its wake lock was taken over: the wake is abandoned")
        changes: dict = {"wake_lock_holder": waker, "wake_lock_expires_at": expires}
        if how != "renewed":
            # Placements keep off a GPU another wake holds (planning.withhold_locked). A plan made
            # from a snapshot older than this lock must conflict at commit and look again.
            changes.update(version=F("version") + 1, changed_txid=RawSQL("txid_current()", []))
        GPU.objects.filter(pk=gpu.pk).update(**changes)
        events.record(
            Event.Kind.GPU_WAKE_LOCK,
            f"gpu {_label(gpu)}",
            text,
            before={"holder": previous, "expires_at": _iso(gpu.wake_lock_expires_at)},
            after={"holder": waker.id, "expires_at": expires.isoformat()},
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment.name,
            replica=waker.id,
        )
        gpu.wake_lock_holder_id, gpu.wake_lock_expires_at = waker.id, expires


# -- the orchestration the preempt task runs ---------------------------------------------------


def run_preemption(
    intent_ids: Iterable[int],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], datetime] | None = None,
) -> Outcome:
    """Wait out max_wait for a voluntary release, else preempt fairly, then place the waker.

    `clock` and `sleep` drive the waits (tests inject fakes); `now`, the wall time that fairness
    judges min_runtime by, defaults to the start time advanced by `clock`.
    """
    ids = sorted(intent_ids)
    intents = list(
        PreemptionIntent.objects.select_related("waiting_replica__deployment")
        .filter(pk__in=ids, status__in=ACTIVE_INTENT_STATUSES)
        .order_by("pk")
    )
    if not intents:
        return Outcome(PreemptionIntent.Status.CANCELLED, "no active intent left: nothing to do")
    waker = intents[0].waiting_replica
    deployment = waker.deployment
    started, base = clock(), timezone.now()
    wall = now or (lambda: base + timedelta(seconds=clock() - started))
    renewer = _Renewer(waker.id, [i.gpu_id for i in intents], clock)
    wait_s = max(0.0, max((i.deadline - base).total_seconds() for i in intents))
    end_of_wait = started + wait_s

    # The fairness wait: anything freed voluntarily means no one is preempted.
    while True:
        done = _try_place(ids, "memory was freed voluntarily during the fairness wait: no one preempted")
        if done is not None:
            return done
        if clock() >= end_of_wait:
            break
        renewer.renew()
        sleep(min(CHECK_EVERY_S, max(0.0, end_of_wait - clock())))

    # Least recently used means the last request, which replicas record in Redis; bring those
    # times into the rows the snapshot reads, or a replica that just served could look idle.
    # Imported here: the request service wakes deployments through this module.
    from scheduling.services import requests as request_services

    preempted: list[str] = []
    # Placements keep off a GPU whose wake lock we hold, so what the victims free is ours; but
    # memory can still be taken by a report (a sleeping victim keeping more than expected): then
    # the victims are chosen again, from who is left, rather than failing the wake.
    for _ in range(VICTIM_ROUNDS):
        request_services.sync_last_accessed()
        snap = ledger.snapshot([i.gpu_id for i in intents])
        kept = {g.id: settings.GPUPORTAL_CUDA_CONTEXT_BYTES for g in snap.gpus.values() if not g.virtual}
        choice = fairness.choose_victim(
            list(snap.gpus.values()),
            waiting_replica_id=waker.id,
            needed_bytes_by_gpu={i.gpu_id: i.needed_bytes for i in intents},
            now=wall(),
            kept_bytes_by_gpu=kept,
        )
        if isinstance(choice, fairness.NoVictim):
            return _fail(ids, f"cannot wake {deployment.name}: {choice.reason}", victims=preempted)

        victims = _preempt(ids, deployment, choice)
        preempted += victims
        limit = clock() + _drain_limit(victims)
        holding = (Replica.State.SERVING, Replica.State.DRAINING)
        while Replica.objects.filter(pk__in=victims, state__in=holding).exists():
            if clock() >= limit:
                return _fail(
                    ids,
                    f"cannot wake {deployment.name}: the preempted replicas "
                    f"({', '.join(v[:8] for v in victims)}) did not release their memory in time",
                    victims=preempted,
                )
            renewer.renew()
            sleep(POLL_EVERY_S)
        who = ", ".join(v[:8] for v in preempted) or "no one (room was free by then)"
        done = _try_place(ids, f"placed after preempting {who}: {choice.reason}", victims=preempted)
        if done is not None:
            return done
    return _fail(
        ids,
        f"cannot wake {deployment.name}: the memory the preempted replicas released was claimed by another "
        f"placement, {VICTIM_ROUNDS} times",
        victims=preempted,
    )


class _Renewer:
    """Keeps the wake lock from expiring while its holder is alive and working."""

    def __init__(self, waker_id: str, gpu_ids: list[int], clock: Callable[[], float]):
        self.waker_id, self.gpu_ids, self.clock = waker_id, sorted(gpu_ids), clock
        self.last = clock()

    def renew(self) -> None:
        if self.clock() - self.last < settings.GPUPORTAL_WAKE_LOCK_TTL_S / 4:
            return
        self.last = self.clock()
        expires = timezone.now() + timedelta(seconds=settings.GPUPORTAL_WAKE_LOCK_TTL_S)
        with transaction.atomic():
            held = list(
                GPU.objects.select_for_update(of=("self",))
                .filter(pk__in=self.gpu_ids, wake_lock_holder_id=self.waker_id)
                .order_by("pk")
                .values_list("pk", flat=True)
            )
            GPU.objects.filter(pk__in=held).update(wake_lock_expires_at=expires)


def _drain_limit(victims: list[str]) -> float:
    drains = Replica.objects.filter(pk__in=victims).values_list("deployment__drain_timeout_s", flat=True)
    return max(drains, default=0.0) + RELEASE_GRACE_S


def _preempt(ids: list[int], deployment: Deployment, choice: fairness.VictimChoice) -> list[str]:
    """Put each victim to sleep (each under its own deployment's lock, never two at once), then
    record the choice on the intents."""
    from scheduling.services import sleep as sleep_services  # sleep builds on this module

    slept: list[str] = []
    for victim in choice.victims:
        try:
            sleep_services.sleep_replica(victim.replica_id, reason=f"preempted for {deployment.name}: {victim.reason}")
            PREEMPTIONS.inc()
        except InvalidState:
            pass  # it stopped serving meanwhile (an idle sleep, a scale-down): it is leaving anyway
        slept.append(victim.replica_id)
    with transaction.atomic():
        for intent in PreemptionIntent.objects.select_related("gpu__node").filter(pk__in=ids).order_by("pk"):
            victim = next((v for v in choice.victims if v.freed_bytes_by_gpu.get(intent.gpu_id, 0) > 0), None)
            intent.status = PreemptionIntent.Status.VICTIM_CHOSEN
            intent.victim_id = victim.replica_id if victim else None
            intent.save(update_fields=["status", "victim"])
        for victim in choice.victims:
            events.record(
                Event.Kind.PREEMPTION_VICTIM,
                f"replica {victim.replica_id[:8]}",
                f"preempted for {deployment.name}: {victim.reason}",
                after={"freed_bytes_by_gpu": {str(k): v for k, v in victim.freed_bytes_by_gpu.items()}},
                deployment=victim.deployment,
                replica=victim.replica_id,
            )
    return slept


def _try_place(ids: list[int], why: str, *, victims: list[str] | None = None) -> Outcome | None:
    """Place the waker without evicting anyone; None (nothing changed) while it does not fit."""
    intent = PreemptionIntent.objects.select_related("waiting_replica").get(pk=ids[0])
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=intent.waiting_replica.deployment_id)
        intents = list(PreemptionIntent.objects.filter(pk__in=ids).order_by("pk"))
        if any(i.status not in ACTIVE_INTENT_STATUSES for i in intents):
            return Outcome(PreemptionIntent.Status.CANCELLED, "the intents were closed by someone else")
        waker = Replica.objects.select_related("node").get(pk=intent.waiting_replica_id)
        unplaced = waker.state == Replica.State.PENDING and waker.node_id is None
        if waker.state != Replica.State.SLEEPING and not unplaced:
            # Scaled down, stopped, or woken some other way: this wake has nothing left to do.
            outcome = Outcome(PreemptionIntent.Status.CANCELLED, f"the waiting replica is {waker.state} now", waker.id)
            _close(intents, outcome.status, outcome.reason)
            return outcome
        reason = f"woken after a fair wait: {why}"
        try:
            with transaction.atomic():
                if unplaced:
                    deployments.add_replicas(
                        deployment, 1, reason=reason, cached=(), new_ids=[waker.id], evictions=False
                    )
                else:
                    deployments.add_replicas(
                        deployment,
                        1,
                        reason=reason,
                        cached=(CachedReplica(waker.id, waker.node.name),),
                        allow_new=False,
                        evictions=False,
                    )
        except CannotPlace:
            return None
        _close(intents, PreemptionIntent.Status.SATISFIED, why)
    return Outcome(PreemptionIntent.Status.SATISFIED, why, waker.id, tuple(victims or ()))


def _fail(ids: list[int], reason: str, *, victims: list[str] | None = None) -> Outcome:
    """The wake cannot happen: close the intents, drop an unplaced waker, and end the waiting
    requests with the reason, unless another replica of the deployment can still serve them."""
    from scheduling.services import requests as request_services  # requests builds on sleep, which builds on this

    intent = PreemptionIntent.objects.select_related("waiting_replica").get(pk=ids[0])
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=intent.waiting_replica.deployment_id)
        intents = list(PreemptionIntent.objects.filter(pk__in=ids, status__in=ACTIVE_INTENT_STATUSES).order_by("pk"))
        _close(intents, PreemptionIntent.Status.FAILED, reason)
        _drop_unplaced(intent.waiting_replica_id, reason)
        others_awake = (
            deployment.replicas.filter(state__in=deployments.AWAKE)
            .exclude(state=Replica.State.PENDING, node=None)
            .exists()
        )
    if not others_awake:
        request_services.fail_waiting(deployment.name, reason)
    return Outcome(PreemptionIntent.Status.FAILED, reason, intent.waiting_replica_id, tuple(victims or ()))


def _drop_unplaced(replica_id: str, reason: str) -> None:
    """A new waker that never got a place fails, so that it is not mistaken for a live replica."""
    waker = (
        Replica.objects.select_for_update(of=("self",))
        .select_related("deployment", "node")
        .filter(pk=replica_id)
        .first()
    )
    if waker is not None and waker.state == Replica.State.PENDING and waker.node_id is None:
        waker.failure_reason = reason
        replica_services.set_state(waker, Replica.State.FAILED, reason, extra=["failure_reason"])


def _close(intents: list[PreemptionIntent], status: str, reason: str) -> None:
    """End the intents with `status`, release their wake locks, and say why (Events, histogram)."""
    if not intents:
        return
    waker_id = intents[0].waiting_replica_id
    gpus = {
        g.pk: g
        for g in GPU.objects.select_for_update(of=("self",))
        .select_related("node")
        .filter(pk__in=[i.gpu_id for i in intents])
        .order_by("pk")
    }
    deployment = Replica.objects.filter(pk=waker_id).values_list("deployment__name", flat=True).first() or ""
    for intent in intents:
        before = intent.status
        intent.status = status
        intent.save(update_fields=["status"])
        gpu = gpus[intent.gpu_id]
        waited = max(0.0, (timezone.now() - intent.created_at).total_seconds())
        PREEMPTION_WAIT_SECONDS.observe(waited)
        events.record(
            Event.Kind.PREEMPTION_OUTCOME,
            f"gpu {_label(gpu)}",
            f"intent of {deployment} ({waker_id[:8]}) {status} after {waited:.1f} s: {reason}",
            before={"status": before},
            after={"status": status, "victim": intent.victim_id},
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment,
            replica=waker_id,
        )
    for gpu in gpus.values():
        if gpu.wake_lock_holder_id != waker_id:
            continue  # taken over meanwhile: the lock is someone else's now
        GPU.objects.filter(pk=gpu.pk).update(wake_lock_holder=None, wake_lock_expires_at=None)
        events.record(
            Event.Kind.GPU_WAKE_LOCK,
            f"gpu {_label(gpu)}",
            f"wake lock released by {deployment} ({waker_id[:8]}): its wake {status}",
            before={"holder": waker_id, "expires_at": _iso(gpu.wake_lock_expires_at)},
            after={"holder": None},
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment,
            replica=waker_id,
        )


def _label(gpu: GPU) -> str:
    return f"{gpu.node.name}/{gpu.index}"


def _labels(gpus: list[GPU]) -> str:
    return ("gpu " if len(gpus) == 1 else "gpus ") + ", ".join(_label(g) for g in gpus)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


__all__ = [
    "Outcome",
    "Placed",
    "Preempting",
    "WaitingForLock",
    "in_progress",
    "retry_later",
    "run_preemption",
    "start",
]
