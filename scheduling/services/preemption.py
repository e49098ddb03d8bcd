"""The fair wake path (seed 001; its targeting and timing chosen on the trace simulator):
who sleeps and who wakes when memory is short.

A wake that does not fit without evicting anyone does not evict at once. Instead it:

1. picks its target GPU without committing anything. The snapshot is first `enrich`ed with what
   the victims would cost: each occupant's reload time (its weights over the host-to-device
   link, GPUPORTAL_H2D_BYTES_PER_S) and its requests in flight (its Redis processing list).
   fairness.choose_target then asks, on every GPU the waker may use (a cached replica only on
   its own node, where its weights are; a new one anywhere; healthy GPUs of online nodes whose
   wake lock is free or its own), who would have to sleep, and takes the cheapest: no busy
   victim if possible, then the shortest sleep, then the least reload cost per second idle. This
   is the policy `gpuportal` of bench/simulate, measured there. A need of a whole GPU or more (a
   70B model over two GPUs of one node) asks fairness.choose_whole_gpus for the GPUs it can empty
   (no popular, dedicated or young occupant on them; victims whose wake misses the SLO
   last; no more victims than requests wait for the waker). For what neither decides (no GPU
   that could ever make room as things stand, or a whole-GPU target refused by those guards),
   placement with evictions allowed says where the waker *would* go (the fewest evictions);
2. takes the WAKE LOCK of each of those GPUs (at most one wake in progress per GPU, invariant
   2 of docs/architecture.md); a lock held by a live replica and not expired makes this wake wait and retry;
   an expired one, or one whose holder is gone, stopped or failed, is taken over;
3. writes a PreemptionIntent per GPU. Its deadline is created_at + the deployment's max_wait_s,
   unless every victim of the chosen target serves no request right now
   (fairness.preempt_at_once): then the deadline is created_at itself, since waiting for a
   voluntary release would only delay the waker while sleeping those victims cuts no one off. A
   busy victim, or one whose activity is unknown (Redis unreachable), keeps the whole max_wait;
4. leaves the rest to the control task `scheduling.tasks.preempt` (`run_preemption`): until the
   deadline it re-checks every second whether the waker fits without evictions (a voluntary
   sleep or a scale-down freed memory); at the deadline it asks fairness.choose_victim (the cost
   order, on an enriched snapshot), puts the victims to sleep, waits for their memory, and places
   the waker, with evictions still forbidden: the commit path (compare-and-swap) is what claims
   the freed bytes.

Lock order, as everywhere: the deployment row, then GPU rows in primary-key order, then replica
rows. The wake lock columns live on the GPU rows. Placements keep off a GPU whose lock another
wake holds, so the memory a preemption frees there goes to the waker (planning.withhold_locked);
taking a lock bumps the GPU's version so that a plan made before it conflicts and looks again,
while renewing or releasing it bumps nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire.states import ASLEEP, AWAKE, GONE
from scheduling import ledger, locks
from scheduling.core import effects, fairness, settling
from scheduling.core.placement import POLICIES, CachedReplica, CantAccommodate, PlacementRequest, fmt_bytes, place
from scheduling.core.planning import withhold_locked
from scheduling.core.state import OccupantView, Snapshot
from scheduling.metrics import PREEMPTION_WAIT_SECONDS, PREEMPTIONS
from scheduling.models import ACTIVE_INTENT_STATUSES, GPU, Deployment, Event, PreemptionIntent, Replica, new_replica_id
from scheduling.services import deep_sleep, outbox, placing, queueing
from scheduling.services import replicas as replica_services
from scheduling.services.errors import CannotPlace, InvalidState

log = logging.getLogger(__name__)

PREEMPT_TASK = "scheduling.tasks.preempt"
DEEPEN_TASK = "scheduling.tasks.deepen_sleepers"
WAKE_TASK = "scheduling.tasks.wake"
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
    by_cost_only: bool = False,
) -> Placed | Preempting | WaitingForLock:
    """Begin the fair wake of one replica that does not fit without evictions.

    The caller holds the deployment row lock inside a transaction. CannotPlace (409) when not
    even evicting every evictable occupant would make room: no wait could help then.
    `by_cost_only`: only a target fairness.choose_target finds (victims fairness allows, now or
    once young replicas settle), else CannotPlace rather than placement's targeting, whose wait
    may end with no victim at all; for a caller with another way to wake (services.sleep's
    prefer_wake: a load from disk), as the simulator's `gpuportal-wake` policy does.
    """
    if cached is None:
        cached = placing.cached_of(deployment)
    # No row is locked here beyond the caller's deployment row: the snapshot and the enrichment
    # read without locks (Deployment rows by a plain SELECT, Redis), so the GPU rows are still
    # the next locks this transaction takes, as the global order wants.
    snap = enrich(ledger.snapshot())
    need = placing.need_bytes(deployment, snap)
    # A new replica's process needs host RAM too: no GPU is emptied on a node that could not
    # start it (evicting GPU occupants frees none of the host's RAM).
    host_refused = placing.host_refusals(deployment) if allow_new else {}
    # Nodes its node selector or tolerations keep it off: nothing of it wakes or starts there; and
    # those it goes to last (PreferNoSchedule), for placement's targeting.
    refused, avoided = placing.node_fit(deployment)
    # Costed on the GPUs as they will be once their sleepers sleep deeply (they are told to at
    # once, below): a GPU whose sleepers hold the room costs no one's preemption.
    deepened = fairness.as_if_deep_asleep(snap, keep={c.replica_id for c in cached})
    wake = _costed_wake(deployment, deepened, need.bytes, cached, allow_new, host_refused, refused)
    if wake is None and by_cost_only:
        raise CannotPlace(f"no GPU the waker may use can make room for {deployment.name} by preempting fairly", {})
    if wake is None:
        wake = _placement_wake(deployment, snap, need.bytes, cached, allow_new, host_refused, (refused, avoided))
    if not wake.victims:
        # Memory was freed between the caller's attempt and this snapshot: no one need wait...
        try:
            with transaction.atomic():  # a savepoint: a refused attempt leaves no rows behind
                decision = placing.add_replicas(
                    deployment, 1, reason=reason, cached=cached, allow_new=allow_new, evictions=False, wake=True
                )
            return Placed(tuple(p.replica_id for p in decision.placements))
        except CannotPlace:
            pass  # ...unless that room is on a GPU another wake holds: its lock decides below
    waker_id, needed = wake.waker_id, wake.needed_bytes_by_gpu
    now = timezone.now()
    gpus = _lock_target_gpus(sorted(needed))
    if gpus is None:
        return WaitingForLock("", "", "waiting: the wake locks of its GPUs changed hands while they were being taken")
    for gpu in gpus:
        blocked = _held_by_another(gpu, waker_id, now)
        if blocked is not None:
            return _wait_for_lock(deployment, gpu, blocked, reason)
    # Sleepers there give back their contexts by sleeping deeply: told on a task of their own,
    # since their rows' locks come after the GPU rows this transaction holds (the one lock order).
    # The wake then waits out max_wait for them rather than preempt anyone at once.
    sleepers = fairness.sleepers_to_deepen(
        [snap.gpus[g.pk] for g in gpus], wake.needed_bytes_by_gpu, waiting_replica_id=waker_id
    )
    # The victims (if any) were chosen on the GPUs as they will be once every sleeper there has
    # slept deeply (`deepened`): they must go as well, so idle ones go at once, beside the sleepers.
    waker = _waker(deployment, wake, gpus, reason)
    _take_locks(gpus, waker, deployment, now)
    ids = [i.pk for i in _record_intents(deployment, wake, gpus, waker, now, reason)]
    outbox.want(effects.to_control(PREEMPT_TASK, ids))
    if sleepers:
        why = f"{deployment.name} ({waker_id[:8]}) needs the memory its context holds on {_labels(gpus)}"
        outbox.want(effects.to_control(DEEPEN_TASK, sleepers, why))
    if wake.at_once:
        return Preempting(waker_id, tuple(ids), f"preempting at once on {_labels(gpus)}: its victims serve no request")
    return Preempting(waker_id, tuple(ids), f"waiting up to {deployment.max_wait_s:g} s for room on {_labels(gpus)}")


def _waker(deployment: Deployment, wake: _Wake, gpus: list[GPU], reason: str) -> Replica:
    """The replica that waits: the cached one promoted, or the row of a new one."""
    if wake.promoted:
        return Replica.objects.select_related("node").get(pk=wake.waker_id)
    # The row exists before anything points at it (lock holder, intents); it has no node until
    # placed, and wake paths do not count it as awake (see sleep.awake_count).
    waker = Replica.objects.create(id=wake.waker_id, deployment=deployment)
    outbox.note(
        Event.Kind.REPLICA_STATE,
        f"replica {wake.waker_id[:8]}",
        f"waiting for room on {_labels(gpus)} for a new replica: {reason}",
        after={"state": Replica.State.PENDING, "gpus": [_label(g) for g in gpus]},
        deployment=deployment.name,
        replica=wake.waker_id,
    )
    return waker


def _record_intents(
    deployment: Deployment, wake: _Wake, gpus: list[GPU], waker: Replica, now: datetime, reason: str
) -> list[PreemptionIntent]:
    """One intent per GPU the waker needs room on, each with the Event that says why."""
    intents = []
    for gpu in gpus:
        needed = wake.needed_bytes_by_gpu[gpu.pk]
        intent = PreemptionIntent.objects.create(gpu=gpu, waiting_replica=waker, needed_bytes=needed, deadline=now)
        # At once: the deadline is already here, so the preempt task chooses the victims as soon
        # as it runs (it still places the waker first if memory was freed meanwhile).
        intent.deadline = (
            intent.created_at if wake.at_once else fairness.wait_deadline(intent.created_at, deployment.max_wait_s)
        )
        intent.save(update_fields=["deadline"])
        intents.append(intent)
        if wake.at_once:
            how = f"its victims serve no request: preempting at once, without waiting out max_wait ({reason})"
        else:
            how = (
                f"waits up to its max_wait of {deployment.max_wait_s:g} s for memory freed voluntarily, "
                f"then preempts ({reason})"
            )
        outbox.note(
            Event.Kind.PREEMPTION_INTENT,
            f"gpu {_label(gpu)}",
            f"{deployment.name} ({waker.id[:8]}) needs {fmt_bytes(needed)} on gpu {_label(gpu)}: "
            f"{how}; target: {wake.why}",
            after={
                "intent": intent.pk,
                "needed_bytes": needed,
                "deadline": intent.deadline.isoformat(),
                "at_once": wake.at_once,
            },
            node=gpu.node.name,
            gpu=_label(gpu),
            deployment=deployment.name,
            replica=waker.id,
        )
    return intents


@dataclass(frozen=True)
class _Wake:
    """Where a fair wake goes and who waits there, however it was targeted."""

    waker_id: str
    promoted: bool  # a cached (sleeping) replica woken as itself, rather than a new one
    needed_bytes_by_gpu: dict[int, int]  # what must be available on each GPU: need less residual
    victims: bool  # whether anyone must make room (False: it fits as things are)
    at_once: bool  # its victims serve nothing: no max_wait
    why: str  # for the intent's Event


def _costed_wake(
    deployment: Deployment,
    snap: Snapshot,
    need: int,
    cached: tuple[CachedReplica, ...],
    allow_new: bool,
    host_refused: Mapping[str, str],
    refused: Mapping[str, str],
) -> _Wake | None:
    """fairness.choose_target over the GPUs the waker may use, as the simulator's engine does
    (bench/simulate, policy `gpuportal`): each cached replica may only wake on its own node's
    GPUs (its weights are in that node's CPU RAM), else a new replica may go to any node; the
    cheapest target of all wins. A need of a whole GPU or more (no GPU the waker may use can take
    it as a fraction) asks fairness.choose_whole_gpus instead, as `gpuportal-next` does: the GPUs
    of one node fairness can empty, victims whose wake misses GPUPORTAL_TTFT_SLO_S last, and no
    more victims than requests wait in the deployment's queue. None when no target is found or
    the whole-GPU one is refused: placement's targeting decides then."""
    tickets = [(c.replica_id, True, c.node) for c in cached if c.node not in refused]
    if not tickets and allow_new:
        tickets = [(new_replica_id(), False, None)]
    # The GPUs placement itself would consider (healthy, on online nodes; the snapshot index is
    # placement's own filter), so that the costed targeting never picks a GPU placement refuses.
    usable = snap.index.usable
    kept = _kept_bytes(snap)
    whole_gpu_from = POLICIES[deployment.memory_policy].whole_gpu_from
    waiting: int | None = None
    best: tuple[fairness.Target, str, bool] | None = None
    for replica_id, promoted, node in tickets:
        # Minus the GPUs another wake holds the lock of: the memory freed there is promised to it
        # (planning.withhold_locked, as add_replicas does); this waker's own locks stay.
        visible, _ = withhold_locked(snap, [replica_id], snap.taken_at)
        # A new replica goes to any node whose host has room for its process; a cached one
        # wakes on its own (its process runs there already).
        nodes = [n for n in usable if n not in host_refused and n not in refused] if node is None else [node]
        gpus = [g for n in nodes for g in usable.get(n, ()) if g.id in visible.gpus]
        if not gpus:
            continue
        if all(need >= whole_gpu_from * g.total_bytes for g in gpus):
            # Whole GPUs: the GPUs fairness can empty, with its guards against a cascade
            # of wakes (victims whose wake misses the SLO last, no more victims than requests wait).
            waiting = _queue_depth(deployment.name) if waiting is None else waiting
            target = fairness.choose_whole_gpus(
                gpus,
                waiting_replica_id=replica_id,
                need_bytes=need,
                now=snap.taken_at,
                # No context is kept on a GPU emptied for a waker: each victim's sleep report finds
                # the wake short beside its context, and it sleeps deeply (replica_reports._why_deeply).
                # Counted as kept, no GPU with an occupant could ever be emptied.
                kept_bytes_by_gpu=None,
                slo_ttft_s=settings.GPUPORTAL_TTFT_SLO_S,
                waiting_requests=waiting,
            )
        else:
            target = fairness.choose_target(
                gpus,
                waiting_replica_id=replica_id,
                need_bytes=need,
                now=snap.taken_at,
                kept_bytes_by_gpu=kept,
                whole_gpu_from=whole_gpu_from,
            )
        if target is not None and (best is None or target.cost < best[0].cost):
            best = (target, replica_id, promoted)
    if best is None:
        return None
    target, replica_id, promoted = best
    at_once = target.ready and fairness.preempt_at_once(target.choice)
    return _Wake(
        waker_id=replica_id,
        promoted=promoted,
        needed_bytes_by_gpu=dict(target.needed_bytes_by_gpu) or {target.gpu_id: target.needed_bytes},
        victims=bool(target.choice.victims) or not target.ready,
        at_once=at_once,
        why=_target_reason(target, snap),
    )


def _queue_depth(deployment_name: str) -> int:
    """Requests waiting for the deployment; 1 when Redis cannot say (then only a target with a
    single victim is taken by fairness.choose_whole_gpus, else placement's targeting)."""
    try:
        return queueing.queue_depth(deployment_name)
    except redis.RedisError:
        return 1


def _target_reason(target: fairness.Target, snap: Snapshot) -> str:
    views = {o.replica_id: o for g in snap.gpus.values() for o in g.occupants}
    victims = ", ".join(_victim_summary(v, views[v.replica_id]) for v in target.choice.victims) or "none"
    if len(target.gpu_ids) > 1:
        labels = ", ".join(snap.gpus[g].label for g in target.gpu_ids)
        why = (
            f"whole gpus {labels}, the GPUs of one node that fairness can empty at least cost (no popular, "
            "dedicated or young occupant on them; no busy victim if possible, then victims whose wake misses "
            f"the {settings.GPUPORTAL_TTFT_SLO_S:g} s SLO last, then the fewest victims, no more than requests "
            "wait for it)"
        )
    else:
        why = (
            f"gpu {snap.gpus[target.gpu_id].label}, where making room costs least (no busy victim if any GPU "
            "allows, then the shortest sleep, then the least reload cost per second idle)"
        )
    if not target.ready:
        return f"{why}; only once replicas inside their min_runtime, loading or leaving settle there: {victims}"
    return f"{why}; victims: {victims}"


def _victim_summary(victim: fairness.Victim, view: OccupantView) -> str:
    if victim.idle:
        activity = "serving no request"
    elif view.in_flight:
        activity = f"{view.in_flight} request(s) in flight"
    else:
        activity = "activity unknown"
    reload = "" if view.reload_s is None else f", reloads in {view.reload_s:.2g} s"
    return f"{victim.deployment} ({victim.replica_id[:8]}, {activity}{reload})"


def _placement_wake(
    deployment: Deployment,
    snap: Snapshot,
    need: int,
    cached: tuple[CachedReplica, ...],
    allow_new: bool,
    host_refused: Mapping[str, str],
    fit: tuple[Mapping[str, str], Mapping[str, str]],
) -> _Wake:
    """Placement's targeting: for what choose_target does not decide (a need of a whole
    GPU or more, or no GPU that can ever make room as things stand)."""
    # Targeting only: where the waker would go if every non-dedicated occupant of other
    # deployments could leave. Popular and young ones count as movable here because max_wait
    # may change that (a voluntary sleep, min_runtime passing); whether anyone really is
    # preempted is fairness.choose_victim's call at the deadline. Dedicated ones never move, so
    # a GPU full of them is a 409 now rather than a wait that cannot succeed.
    request = PlacementRequest(
        deployment=deployment.name,
        replica_id=new_replica_id(),
        need_bytes=need,
        dedicated=True,
        cached=cached,
        allow_new=allow_new,
        host_refused=host_refused,
        refused_nodes=fit[0],
        avoided_nodes=fit[1],
    )
    targeting = replace(POLICIES[deployment.memory_policy], protect_fairness=False)
    target = place(snap, request, policy=targeting)
    if isinstance(target, CantAccommodate):
        raise CannotPlace(target.reason, target.reasons)
    waker_id = target.promoted or target.replica_id
    residual = {
        gpu_id: sum(o.reserved_bytes for o in snap.gpus[gpu_id].occupants if o.replica_id == waker_id)
        for gpu_id in target.gpu_ids
    }
    return _Wake(
        waker_id=waker_id,
        promoted=target.promoted is not None,
        needed_bytes_by_gpu={
            gpu_id: max(1, target.bytes_by_gpu[gpu_id] - residual[gpu_id]) for gpu_id in target.gpu_ids
        },
        victims=bool(target.evictions),
        at_once=False,
        why=f"placement with evictions would be: {target.reason}",
    )


def enrich(snap: Snapshot) -> Snapshot:
    """The snapshot with what fairness's cost order weighs on each occupant:
    `reload_s`, its deployment's weights (its memory need if they are unknown) over
    GPUPORTAL_H2D_BYTES_PER_S, and `in_flight`, the requests it has taken and not finished (its
    Redis processing list). Its last request time is brought up to date from Redis too, so that
    a replica that just served does not look idle (`sync_last_accessed` copies it into the rows,
    but only now and then, and writing replica rows here would break the lock order).

    One query for the deployments and one Redis round trip. When Redis cannot be reached,
    in_flight stays None (unknown): such a victim counts as possibly busy and gets the whole
    max_wait, as before."""
    occupants = [o for g in snap.gpus.values() for o in g.occupants]
    if not occupants:
        return snap
    names = {o.deployment for o in occupants}
    reload_s: dict[str, float] = {}
    for d in (
        Deployment.objects.filter(name__in=names)
        .select_related("observed")
        .only(
            "name",
            "memory_policy",
            "memory_override_bytes",
            "failover_standby",
            "observed__weight_bytes",
            "observed__memory_estimate_bytes",
            "observed__memory_measured_bytes",
            "observed__memory_measured_context_bytes",
        )
    ):
        size = d.observed.weight_bytes or placing.need_bytes(d, snap).bytes
        reload_s[d.name] = size / settings.GPUPORTAL_H2D_BYTES_PER_S
    activity = _activity(sorted({o.replica_id for o in occupants}))

    def view(o: OccupantView) -> OccupantView:
        in_flight, last = activity.get(o.replica_id, (None, None))
        if last is not None and (o.last_accessed is None or last > o.last_accessed):
            o = replace(o, last_accessed=last)
        return replace(o, reload_s=reload_s.get(o.deployment), in_flight=in_flight)

    gpus = {gpu_id: replace(g, occupants=tuple(view(o) for o in g.occupants)) for gpu_id, g in snap.gpus.items()}
    return replace(snap, gpus=gpus)


def _activity(replica_ids: list[str]) -> dict[str, tuple[int | None, datetime | None]]:
    """{replica id: (requests in flight, last request time)} from Redis, in one pipeline."""

    try:
        activity = queueing.queue().activity(replica_ids)
    except redis.RedisError as err:
        log.warning("fair wake without request activity (Redis: %s): every victim counts as possibly busy", err)
        return {}
    return {
        replica_id: (count, None if last is None else datetime.fromtimestamp(last, tz=UTC))
        for replica_id, (count, last) in activity.items()
    }


def _kept_bytes(snap: Snapshot) -> dict[int, int]:
    """What a victim still holds on each GPU once asleep: its CUDA context (a virtual GPU models
    one too), as measured for that GPU or its default: the snapshot carries it."""
    return {gpu_id: gpu.context_bytes for gpu_id, gpu in snap.gpus.items()}


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
    locked = locks.lock_gpus(ids)
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
        outbox.note(
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
    outbox.want(effects.to_control(WAKE_TASK, name, reason))


def retry_later(name: str, reason: str) -> None:
    """Ask the control queue to try this wake again once the lock may be free."""
    outbox.want(effects.to_control(WAKE_TASK, name, reason, countdown=LOCK_RETRY_S))


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
        ledger.hold_wake_lock(gpu.pk, waker.id, expires, fresh=how != "renewed")
        outbox.note(
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

    done = _fairness_wait(ids, renewer, end_of_wait, clock, sleep)
    if done is not None:
        return done
    preempted: list[str] = []
    # Placements keep off a GPU whose wake lock we hold, so what the victims free is ours; but
    # memory can still be taken by a report (a sleeping victim keeping more than expected): then
    # the victims are chosen again, from who is left, rather than failing the wake.
    for _ in range(VICTIM_ROUNDS):
        # Least recently used means the last request, which replicas record in Redis; bring those
        # times into the rows the snapshot reads, or a replica that just served could look idle.
        queueing.sync_last_accessed()
        # With reload costs and requests in flight: the cost order (fairness's default) weighs
        # them; without, it would be plain LRU.
        snap = enrich(ledger.snapshot([i.gpu_id for i in intents]))
        needed = _needed_now(intents, snap, deployment, waker.id)
        asleep = fairness.sleepers_to_deepen(list(snap.gpus.values()), needed, waiting_replica_id=waker.id)
        if asleep:
            done = _deepen_for(ids, deployment, waker.id, asleep, renewer, clock, sleep, preempted)
            if done is not None:
                return done
            snap = enrich(ledger.snapshot([i.gpu_id for i in intents]))
        kept = _kept_bytes(snap)
        gpus = list(snap.gpus.values())
        choice = fairness.choose_for_wake(
            gpus, waiting_replica_id=waker.id, needed_bytes_by_gpu=needed, now=wall(), kept_bytes_by_gpu=kept
        )
        if isinstance(choice, fairness.NoVictim):
            at = fairness.room_at(
                gpus, waiting_replica_id=waker.id, needed_bytes_by_gpu=needed, now=wall(), kept_bytes_by_gpu=kept
            )
            retry_s = settling.seconds_until(wall(), at) if at is not None else None
            # A wait lifts it: said, and answered as Retry-After to the requests it fails.
            later = f"; room in {retry_s} s, once their min_runtime lapses" if retry_s is not None else ""
            why = f"cannot wake {deployment.name}: {choice.reason}{later}"
            return _fail(ids, why, victims=preempted, retry_after_s=retry_s)

        victims = _preempt(ids, deployment, choice)
        preempted += victims
        if not _wait_released(victims, renewer, clock, sleep):
            return _fail(
                ids,
                f"cannot wake {deployment.name}: the preempted replicas "
                f"({', '.join(v[:8] for v in victims)}) did not release their memory in time",
                victims=preempted,
            )
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


def _needed_now(
    intents: list[PreemptionIntent], snap: Snapshot, deployment: Deployment, waker_id: str
) -> dict[int, int]:
    """What each intent's GPU must have available for the waker: what the intent says, or more
    where the waker's need grew since it was written (a sleep measured the node's CUDA context
    larger meanwhile). The placement that ends the wait reserves the need as it is now: victims
    chosen for the old figure would leave it short, and the wake would fail saying its room was
    taken. Never less: a smaller need is placed all the same."""
    need = placing.need_bytes(deployment, snap).bytes
    found = {}
    for intent in intents:
        gpu = snap.gpus[intent.gpu_id]
        # Less what it holds there already (a sleeper's context); a need above one GPU takes it whole.
        own = sum(o.reserved_bytes for o in gpu.occupants if o.replica_id == waker_id)
        found[intent.gpu_id] = max(intent.needed_bytes, min(need, gpu.total_bytes) - own)
    return found


def _deepen_for(
    ids: list[int],
    deployment: Deployment,
    waker_id: str,
    asleep: list[str],
    renewer: _Renewer,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    preempted: list[str],
) -> Outcome | None:
    """Sleepers on the waker's GPUs, past its wait: each holds only its CUDA context, which comes
    back when its process exits, and serves no one, so it sleeps deeply rather than the wake fail
    for want of a serving victim. Such a sleeper fell asleep during the wait (the idle sweep's
    early sleep, for this very wake) or is a victim whose sleep kept its context; its deep sleep
    may be under way already, a moment from giving the room back (deepen_replica tells it once).
    Waited for as a preempted replica is; the waker placed if that made room, else None (victims
    are chosen from who is left)."""
    why = f"{deployment.name} ({waker_id[:8]}) needs the memory its context holds, past its wait"
    # A deep sleep told up to RESEND_S ago is not told again: its refusal may be that old.
    since = timezone.now() - timedelta(seconds=deep_sleep.RESEND_S)
    deep_sleep.deepen_all(asleep, reason=why)
    limit = clock() + RELEASE_GRACE_S
    sleeping = Replica.objects.filter(pk__in=asleep, state=Replica.State.SLEEPING)
    while still := set(sleeping.values_list("pk", flat=True)):
        # One whose process refused the deep sleep (no room for its host copy) gives nothing back:
        # waited for no longer, so the victims are chosen now rather than at the end of the grace.
        if clock() >= limit or still <= _refused_deepen(still, since):
            return None
        renewer.renew()
        sleep(POLL_EVERY_S)
    who = ", ".join(replica_id[:8] for replica_id in asleep)
    return _try_place(ids, f"placed once {who} slept deeply, giving back its GPU memory", victims=preempted)


def _refused_deepen(replica_ids: set[str], since: datetime) -> set[str]:
    """Of these sleepers, those whose process refused a deep sleep since `since` (its report:
    replica_reports._refused)."""
    refused = Event.objects.filter(
        replica__in=replica_ids, kind=Event.Kind.REPLICA_STATE, time__gte=since, after__refused="deepen"
    )
    return set(refused.values_list("replica", flat=True))


def _fairness_wait(
    ids: list[int], renewer: _Renewer, end_of_wait: float, clock: Callable[[], float], sleep: Callable[[float], None]
) -> Outcome | None:
    """Until `end_of_wait`, place the waker as soon as memory is freed voluntarily (then no one is
    preempted); None once the wait is over and the victims must be chosen."""
    while True:
        done = _try_place(ids, "memory was freed voluntarily during the fairness wait: no one preempted")
        if done is not None:
            return done
        if clock() >= end_of_wait:
            return None
        renewer.renew()
        sleep(min(CHECK_EVERY_S, max(0.0, end_of_wait - clock())))


def _wait_released(
    victims: list[str], renewer: _Renewer, clock: Callable[[], float], sleep: Callable[[float], None]
) -> bool:
    """Whether the victims let go of their memory (asleep or gone) within their drain and a grace."""
    limit = clock() + _drain_limit(victims)
    holding = (Replica.State.SERVING, Replica.State.DRAINING)
    while Replica.objects.filter(pk__in=victims, state__in=holding).exists():
        if clock() >= limit:
            return False
        renewer.renew()
        sleep(POLL_EVERY_S)
    return True


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
            held = [g.pk for g in locks.lock_gpus(self.gpu_ids) if g.wake_lock_holder_id == self.waker_id]
            ledger.extend_wake_locks(held, expires)


def _drain_limit(victims: list[str]) -> float:
    drains = Replica.objects.filter(pk__in=victims).values_list("deployment__drain_timeout_s", flat=True)
    return max(drains, default=0.0) + RELEASE_GRACE_S


def _preempt(ids: list[int], deployment: Deployment, choice: fairness.VictimChoice) -> list[str]:
    """Put each victim to sleep (each under its own deployment's lock, never two at once), then
    record the choice on the intents."""

    slept: list[str] = []
    for victim in choice.victims:
        try:
            replica_services.sleep_replica(
                victim.replica_id, reason=f"preempted for {deployment.name}: {victim.reason}"
            )
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
            outbox.note(
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
        deployment = locks.lock_deployment_of(intent.waiting_replica)
        intents = list(PreemptionIntent.objects.filter(pk__in=ids).order_by("pk"))
        if any(i.status not in ACTIVE_INTENT_STATUSES for i in intents):
            return Outcome(PreemptionIntent.Status.CANCELLED, "the intents were closed by someone else")
        waker = Replica.objects.select_related("node").get(pk=intent.waiting_replica_id)
        unplaced = waker.state == Replica.State.PENDING and waker.node_id is None
        if waker.state not in ASLEEP and not unplaced:
            # Scaled down, stopped, or woken some other way: this wake has nothing left to do.
            outcome = Outcome(PreemptionIntent.Status.CANCELLED, f"the waiting replica is {waker.state} now", waker.id)
            _close(intents, outcome.status, outcome.reason)
            return outcome
        reason = f"woken after a fair wait: {why}"
        try:
            with transaction.atomic():
                if unplaced:
                    placing.add_replicas(
                        deployment, 1, reason=reason, cached=(), new_ids=[waker.id], evictions=False, wake=True
                    )
                else:
                    placing.add_replicas(
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


def _fail(
    ids: list[int], reason: str, *, victims: list[str] | None = None, retry_after_s: int | None = None
) -> Outcome:
    """The wake cannot happen: close the intents, drop an unplaced waker, and end the waiting
    requests with the reason (and when asking again may succeed), unless another replica of the
    deployment can still serve them."""

    intent = PreemptionIntent.objects.select_related("waiting_replica").get(pk=ids[0])
    with transaction.atomic():
        deployment = locks.lock_deployment_of(intent.waiting_replica)
        intents = list(PreemptionIntent.objects.filter(pk__in=ids, status__in=ACTIVE_INTENT_STATUSES).order_by("pk"))
        _close(intents, PreemptionIntent.Status.FAILED, reason)
        _drop_unplaced(intent.waiting_replica_id, reason)
        others_awake = (
            deployment.replicas.filter(state__in=AWAKE).exclude(state=Replica.State.PENDING, node=None).exists()
        )
    if not others_awake:
        queueing.fail_waiting(deployment.name, reason, retry_after_s=retry_after_s)
    return Outcome(PreemptionIntent.Status.FAILED, reason, intent.waiting_replica_id, tuple(victims or ()))


def _drop_unplaced(replica_id: str, reason: str) -> None:
    """A new waker that never got a place fails, so that it is not mistaken for a live replica."""
    waker = next(
        iter(locks.lock_replicas(Replica.objects.select_related("deployment", "node").filter(pk=replica_id))), None
    )
    if waker is not None and waker.state == Replica.State.PENDING and waker.node_id is None:
        waker.failure_reason = reason
        replica_services.set_state(waker, Replica.State.FAILED, reason, extra=["failure_reason"])


def _close(intents: list[PreemptionIntent], status: str, reason: str) -> None:
    """End the intents with `status`, release their wake locks, and say why (Events, histogram)."""
    if not intents:
        return
    waker_id = intents[0].waiting_replica_id
    gpus = {g.pk: g for g in locks.lock_gpus(i.gpu_id for i in intents)}
    deployment = Replica.objects.filter(pk=waker_id).values_list("deployment__name", flat=True).first() or ""
    for intent in intents:
        before = intent.status
        intent.status = status
        intent.save(update_fields=["status"])
        gpu = gpus[intent.gpu_id]
        waited = max(0.0, (timezone.now() - intent.created_at).total_seconds())
        PREEMPTION_WAIT_SECONDS.observe(waited)
        outbox.note(
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
        ledger.release_wake_lock(gpu.pk)
        outbox.note(
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
    "enrich",
    "in_progress",
    "retry_later",
    "run_preemption",
    "start",
]
