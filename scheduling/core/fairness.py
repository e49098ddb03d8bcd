"""Which occupant is preempted when a waking replica does not fit (seed 001), as pure functions.

The wake path (effects, elsewhere) writes a PreemptionIntent, waits up to the deployment's
`max_wait` for memory to be freed voluntarily (`wait_deadline`, `should_preempt`), and then asks
`choose_victim` which occupants must sleep. Nothing here reads the database or the clock: `now`
is a parameter, so the trace simulator can run the same rules on a simulated clock.

The seed's rules, in its order, on the GPUs the waiting replica needs and nowhere else:

    candidates = occupants of the needed GPUs
      -> filter: state == serving          (anything else frees nothing now, or is mid-transition)
      -> filter: not popular                (popular replicas are never preempted)
      -> filter: serving >= min_runtime     (what prevents thrashing, see below)
      -> filter: not the waiting replica itself
      -> sort: least recently accessed first, ties by replica id         (order="lru")
      -> preempt in that order until every needed GPU has room

Where this goes beyond the seed, on purpose:

- The seed evicts one candidate; a replica may need several GPUs, or more than one occupant's
  memory, so we take candidates in LRU order until *every* needed GPU has room. A candidate
  that frees nothing on a GPU that is still short is passed over: sleeping it would help no one.
  Then victims that turned out redundant (a later, larger victim freed their bytes too) are
  dropped again, most recently used first, so no replica is put to sleep for nothing. The
  result is irredundant: without any one of the victims some needed GPU would be short.
- A `dedicated` replica is not a victim either: the Deployment model documents it as "never
  evicted to make room for others", and placement keeps that rule too.
- A replica with no `serving_since` is not eligible: nothing proves it has served its
  min_runtime, and guessing in its disfavour is what thrashing is made of.
- `last_accessed = None` counts as the *oldest*: a serving replica that no request has reached
  since it started is the one whose sleep costs nobody anything. Putting it last instead would
  shield exactly the replicas nobody uses. It cannot cause thrashing: min_runtime still
  protects a replica that has just woken, whatever its last_accessed says.
- If nothing needs freeing (every needed GPU already has room), the answer is a `VictimChoice`
  with no victims: fitting is not a failure.

The cost order (order="cost", the default; the trace simulator chose it). Among the eligible,
the victims are ranked by what losing them costs, not by recency alone:

- first replicas serving nothing and idle past their idle timeout (the idle sweep could have
  slept them already), last replicas serving a request now (their requests would drain first);
- within each tier, the lowest `reload_s / seconds idle`: the reload a wake would cost, weighed
  by how soon the replica is likely to be wanted again. A 0.5B model idle for a second is a
  cheaper victim than a 32B idle for a minute, and the 32B goes once idle for long enough.
- then LRU and replica id. Occupants that report no reload cost, activity or idle timeout (the
  OccupantView defaults) all share one tier and one cost, so the order is then exactly LRU.

`prefer_wake` says when a deployment with a copy in CPU RAM should wait to wake it on
its node rather than load a new replica from disk elsewhere: when the disk load is the slower.
`wake_or_load` is the same rule over a deployment's `ReloadTimes`, with the reason its Event gives.

`choose_target` picks *where* a single-GPU waker goes when it fits nowhere: the GPU whose victims
(by `choose_victim`) are cheapest, so the wake never targets a GPU that only popular, dedicated
or young replicas hold; `choose_whole_gpus` does the same for a waker that needs whole GPUs (a
70B model: two of one node), GPU by GPU, and only GPUs that its victims leave empty.
`sleep_when_idle` says which idle replicas the idle sweep may put to sleep on its timer: those a
wake brings back within their SLO; the others leave only when their memory is wanted.
`sleep_early` lets the sweep put such a replica to sleep before its timer, once idle for max_wait,
when its node has no room for a copy asleep there (`short_of_room`), so that the copy's wake does
not wait for the replica's weights to leave.
`preempt_at_once` lets the waiter skip the rest of max_wait when every victim serves nothing at
that instant. The seed's guarantees are untouched: the filters above still decide who may be a
victim; the wait is never longer than max_wait, only shorter.

Why min_runtime prevents thrashing (invariant 3 of docs/architecture.md, the thrash check): a replica is a
victim only once `now - serving_since >= min_runtime_s`. As long as the wake path sets
`serving_since` to the time the replica (re)starts serving, and never carries it over a sleep,
a replica woken at t cannot be preempted before t + min_runtime. Two deployments that fit a GPU
only one at a time therefore swap at most once per min_runtime however fast they are
requested: each swap preempts the replica the previous swap woke. `tests/scheduling/test_fairness.py`
checks this as a property by simulating such request streams.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Literal

from gpuportal.wire import states
from gpuportal.wire.states import ReplicaState
from scheduling.core import settling
from scheduling.core.state import GPUView, OccupantView, Snapshot

# "cost": expired idle replicas first, busy ones last, and in between the lowest reload cost per
# second of idleness (see the module docstring); "lru": seed 001's least recently used first.
VictimOrder = Literal["cost", "lru"]
# The reload cost of an occupant that does not report one: the same for every such occupant, so
# that among them the cost order is exactly LRU.
UNKNOWN_RELOAD_S = 1.0
# Idleness is clamped to this from below (a replica accessed "now", or by a skewed clock later
# than now), so that its weight stays finite; ties then fall back to LRU.
MIN_IDLE_S = 1e-3


class Cause(StrEnum):
    """Why a needed GPU cannot be given room, for callers that branch on it (metrics, 503s)."""

    NO_OCCUPANTS = "no other occupants"
    SELF = "the waiting replica itself"
    POPULAR = "popular"
    DEDICATED = "dedicated"
    MIN_RUNTIME = "within min_runtime"
    NOT_SERVING = "not serving"
    NOT_ENOUGH_MEMORY = "not enough memory"


@dataclass(frozen=True)
class Victim:
    """One replica to preempt, what sleeping it frees, and why it was picked."""

    replica_id: str
    deployment: str
    # Bytes freed on every GPU of the input it occupies (needed or not), for the commit plan.
    freed_bytes_by_gpu: Mapping[int, int]
    last_accessed: datetime | None
    reason: str
    # Serving nothing and idle past its deployment's idle timeout: the idle sweep could have
    # slept it already (the cost order takes such replicas first).
    expired: bool = False
    # Known to serve no request at this instant: sleeping it cuts no one off (`preempt_at_once`).
    idle: bool = False


@dataclass(frozen=True)
class VictimChoice:
    """The replicas to preempt, least recently used first. Empty when everything already fits."""

    waiting_replica_id: str
    victims: tuple[Victim, ...]
    reason: str
    # Occupants of the needed GPUs that are not eligible: replica id -> why not (for Events).
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def victim_ids(self) -> tuple[str, ...]:
        return tuple(v.replica_id for v in self.victims)

    @property
    def freed_bytes(self) -> int:
        return sum(sum(v.freed_bytes_by_gpu.values()) for v in self.victims)


@dataclass(frozen=True)
class Shortfall:
    """A needed GPU that stays short even if every eligible occupant were preempted."""

    gpu_id: int
    label: str
    needed_bytes: int
    available_bytes: int
    freeable_bytes: int  # by preempting every eligible occupant of this GPU
    causes: tuple[Cause, ...]
    reason: str


@dataclass(frozen=True)
class NoVictim:
    """No set of eligible occupants frees enough: the wake fails, with this reason."""

    waiting_replica_id: str
    shortfalls: tuple[Shortfall, ...]  # only the GPUs that stay short, by GPU id
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        return "; ".join(s.reason for s in self.shortfalls)

    @property
    def causes(self) -> frozenset[Cause]:
        return frozenset(c for s in self.shortfalls for c in s.causes)


def eligible(occupant: OccupantView, *, waiting_replica_id: str, now: datetime) -> tuple[bool, str]:
    """Whether `occupant` may be preempted for `waiting_replica_id` at `now`, and why (not)."""
    cause, why = _verdict(occupant, waiting_replica_id, now)
    return cause is None, why


def choose_victim(
    gpus: Sequence[GPUView],
    *,
    waiting_replica_id: str,
    needed_bytes_by_gpu: Mapping[int, int],
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None = None,
    order: VictimOrder = "cost",
) -> VictimChoice | NoVictim:
    """Who must sleep so that `waiting_replica_id` fits. Pure: the views are not changed.

    `needed_bytes_by_gpu` maps GPU id -> the bytes that must be *available* on it for the wake:
    the replica's reservation there minus what it already holds (its sleeping residual). Every
    key must be one of `gpus`; `gpus` may hold more GPUs than are needed, and a victim's freed
    bytes are reported on all of them. `kept_bytes_by_gpu` is what a replica still holds on a
    GPU once asleep (its CUDA context on a real GPU; 0, the default, on a virtual one), so that
    the freed bytes are the ones that really come back. `order` is how candidates are ranked
    (`VictimOrder`); with no reload costs, activity or idle timeouts in the views, "cost" and
    "lru" give the same answer.

    Raises ValueError for a caller bug: no needed GPU, a negative need, a needed GPU that is
    not in `gpus`, or the same GPU twice.
    """
    by_id = _index(gpus)
    _check_needs(needed_bytes_by_gpu, by_id)
    kept = kept_bytes_by_gpu or {}
    needed_ids = sorted(needed_bytes_by_gpu)
    short = {
        gpu_id: needed_bytes_by_gpu[gpu_id] - by_id[gpu_id].available_bytes
        for gpu_id in needed_ids
        if needed_bytes_by_gpu[gpu_id] > by_id[gpu_id].available_bytes
    }
    candidates, ineligible = _candidates(by_id, needed_ids, waiting_replica_id, now, kept, order)
    skipped = {rid: why for rid, (_, why) in sorted(ineligible.items())}
    if not short:
        room = ", ".join(
            f"{by_id[g].label} has {_fmt_bytes(by_id[g].available_bytes)} of {_fmt_bytes(needed_bytes_by_gpu[g])}"
            for g in needed_ids
        )
        return VictimChoice(waiting_replica_id, (), f"no preemption needed: {room}", skipped)
    chosen = _greedy_lru(candidates, short)
    if chosen is None:
        return NoVictim(
            waiting_replica_id,
            tuple(
                _shortfall(by_id[g], needed_bytes_by_gpu[g], candidates, ineligible, waiting_replica_id, kept)
                for g in sorted(short)
                if _freeable(candidates, g) < short[g]
            ),
            skipped,
        )
    victims = tuple(_victim(c, chosen, candidates, by_id, short, now, order) for c in chosen)
    return VictimChoice(waiting_replica_id, victims, "; ".join(v.reason for v in victims), skipped)


def choose_for_wake(
    gpus: Sequence[GPUView],
    *,
    waiting_replica_id: str,
    needed_bytes_by_gpu: Mapping[int, int],
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int],
) -> VictimChoice | NoVictim:
    """choose_victim as a wake at its deadline asks it: counting what each victim keeps asleep
    (its CUDA context), and, where that leaves the waker short (a waker that needs whole GPUs,
    above all), counting none: such a victim's sleep report then finds the wake still short beside
    its context, and it sleeps deeply, giving all it held back (replica_reports._why_deeply). The
    NoVictim counting the kept contexts when neither finds victims."""
    choice = choose_victim(
        gpus,
        waiting_replica_id=waiting_replica_id,
        needed_bytes_by_gpu=needed_bytes_by_gpu,
        now=now,
        kept_bytes_by_gpu=kept_bytes_by_gpu,
    )
    if not isinstance(choice, NoVictim) or not any(kept_bytes_by_gpu.values()):
        return choice
    deeper = choose_victim(
        gpus, waiting_replica_id=waiting_replica_id, needed_bytes_by_gpu=needed_bytes_by_gpu, now=now
    )
    return choice if isinstance(deeper, NoVictim) else deeper


def room_at(
    gpus: Sequence[GPUView],
    *,
    waiting_replica_id: str,
    needed_bytes_by_gpu: Mapping[int, int],
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int],
) -> datetime | None:
    """When a wake that finds no victim now (choose_for_wake's NoVictim) would find one, as
    things stand but for the clock: the soonest moment a `min_runtime` lapses after which it does;
    None when no lapse helps (dedicated, popular or starting occupants in the way, or too little
    memory even with every young one gone). What a failed wake's `Retry-After` says. Pure."""
    by_id = _index(gpus)

    def found(at: datetime) -> bool:
        choice = choose_for_wake(
            gpus,
            waiting_replica_id=waiting_replica_id,
            needed_bytes_by_gpu=needed_bytes_by_gpu,
            now=at,
            kept_bytes_by_gpu=kept_bytes_by_gpu,
        )
        return isinstance(choice, VictimChoice)

    occupants = [o for gpu_id in needed_bytes_by_gpu for o in by_id[gpu_id].occupants]
    return settling.soonest(settling.lapses(occupants, now), found)


def sleepers_to_deepen(gpus: Sequence[GPUView], needed: Mapping[int, int], *, waiting_replica_id: str) -> list[str]:
    """Which sleepers on the GPUs a wake waits for sleep deeply at once: a sleeper serves no one,
    and only its process's exit gives back the CUDA context it holds there, so it goes before any
    serving replica is preempted, and without waiting out max_wait. Per GPU, the longest unused
    first, until what they hold covers what the waker still lacks there (`needed` less what is
    available); all of them when even that falls short (the rest is choose_victim's). Pure."""
    chosen: dict[str, None] = {}
    for gpu in sorted(gpus, key=lambda g: g.id):
        lacking = needed.get(gpu.id, 0) - gpu.available_bytes
        asleep = [
            o
            for o in gpu.occupants
            if o.state == ReplicaState.SLEEPING and o.replica_id != waiting_replica_id and o.reserved_bytes > 0
        ]
        oldest_first = sorted(asleep, key=lambda o: (o.last_accessed or datetime.min.replace(tzinfo=UTC), o.replica_id))
        for occupant in oldest_first:
            if lacking <= 0:
                break
            chosen[occupant.replica_id] = None
            lacking -= occupant.reserved_bytes
    return list(chosen)


def as_if_deep_asleep(snapshot: Snapshot, keep: Collection[str]) -> Snapshot:
    """The snapshot as it will be once its sleepers (but `keep`, a waker's own) sleep deeply:
    their occupants gone and what they held available. A wake's target is chosen on it, so that a
    GPU whose sleepers can give their contexts back costs no one's preemption (they are told to
    sleep deeply at once: `sleepers_to_deepen`). Pure."""
    gpus = {}
    for gpu_id, gpu in snapshot.gpus.items():
        going = [o for o in gpu.occupants if o.state == ReplicaState.SLEEPING and o.replica_id not in keep]
        if not going:
            gpus[gpu_id] = gpu
            continue
        freed = sum(o.reserved_bytes for o in going)
        staying = tuple(o for o in gpu.occupants if o not in going)
        gpus[gpu_id] = replace(gpu, occupants=staying, available_bytes=gpu.available_bytes + freed)
    return replace(snapshot, gpus=gpus)


def wait_deadline(created_at: datetime, max_wait_s: float) -> datetime:
    """When the fairness wait of an intent created at `created_at` ends (seed 001's maxWaitTime)."""
    if not math.isfinite(max_wait_s) or max_wait_s < 0:
        raise ValueError(f"max_wait_s must be a finite number >= 0, got {max_wait_s}")
    return created_at + timedelta(seconds=max_wait_s)


def should_preempt(now: datetime, deadline: datetime, freed_voluntarily: bool) -> bool:
    """Whether the waiter stops waiting for a voluntary sleep and picks a victim now.

    Memory freed voluntarily (an idle sleep, a scale-down) inside the wait means no one is
    preempted at all; otherwise the waiter is patient until the deadline, then preempts.
    """
    return not freed_voluntarily and now >= deadline


def preempt_at_once(choice: VictimChoice) -> bool:
    """Whether the waiter may preempt `choice`'s victims now rather than at its deadline: every
    one of them is known to serve no request at this instant. Sleeping them cuts no one off,
    while waiting max_wait for a voluntary release would only add to the waker's time to first
    token (seed 001 bounds the wait from above; preempting sooner is within the rule). A victim
    that is busy, or whose activity is unknown, keeps the full wait."""
    return bool(choice.victims) and all(v.idle for v in choice.victims)


def prefer_wake(*, load_s: float, wake_s: float, max_wait_s: float) -> bool:
    """Whether a deployment with a sleeping replica in some node's CPU RAM should wake it there,
    making room by a fair wait if need be, rather than load a new replica from disk on a GPU that
    happens to be free. Yes when the cold load is slower than the wake after the
    longest fair wait: the wake is then the sooner first token whatever the wait turns out to be,
    and the memory the cold load would take stays free for the next wake. On the planner's
    traces, cold loads of replicas that had a copy in CPU RAM were the first cause of missed SLOs
    at the GPU counts just below the target (an 8B model: 8 s from disk, 0.8 s from CPU RAM).
    A deployment whose disk load is the faster (a small model, a slow host link) loads as before.
    The simulator's `gpuportal-wake` policy applies it, and so does the live wake path
    (services.sleep.wake_deployment, through `wake_or_load`) when a request finds no replica awake."""
    return load_s > wake_s + max_wait_s


def sleep_when_idle(*, wake_s: float, slo_ttft_s: float) -> bool:
    """Whether the idle sweep should put an idle replica to sleep on its timer. Yes
    when a wake from CPU RAM brings it back within its SLO: the sleep frees memory ahead of need
    at no cost to anyone. No when the wake alone is longer than the SLO (a 70B model wakes in
    about 7 s against a 5 s SLO): the sleep would make the first request of its next burst miss
    for certain, while the memory it frees is not wanted by anyone yet. Such a replica still
    leaves as soon as someone needs its memory: idle, it is a victim the wake path preempts at
    once (`preempt_at_once`), and the cost order ranks it by its reload cost per second idle like
    any other. The capacity planner's bound (`planner.load_aware_bound`) holds exactly such
    deployments in memory; sleeping them on a timer is what kept the policies off that bound."""
    return wake_s <= slo_ttft_s


@dataclass(frozen=True)
class AsleepCopy:
    """A deployment with no replica awake whose weights sleep in one node's CPU RAM: the bytes a
    wake there reserves, how long the wake takes (measured, else estimated from its bytes), and
    from which share of a GPU its placement policy gives it whole GPUs."""

    deployment: str
    need_bytes: int
    wake_s: float
    whole_gpu_from: float


def short_of_room(gpus: Sequence[GPUView], asleep: Iterable[AsleepCopy], *, slo_ttft_s: float) -> AsleepCopy | None:
    """The largest copy asleep on a node (`gpus`, that node's GPUs) that the node has no room for
    as things are, among those a wake would bring back within the SLO once it had room; None when
    every such copy fits. Room as placement gives it: a need of the copy's `whole_gpu_from` of a
    GPU or more takes wholly free GPUs, a smaller one the free bytes of one GPU. A copy whose wake alone misses
    the SLO is left out: its next request misses however soon room is found (`sleep_when_idle`),
    so it finds room when it wakes, as a fair wake. `sleep_early` reads the answer."""
    if not gpus:
        return None
    smallest = min(g.total_bytes for g in gpus)
    whole_room = sum(g.total_bytes for g in gpus if not g.occupants and g.available_bytes >= g.total_bytes)
    room = max(g.available_bytes for g in gpus)
    short = []
    for copy in asleep:
        if not sleep_when_idle(wake_s=copy.wake_s, slo_ttft_s=slo_ttft_s):
            continue
        # Whole GPUs as soon as the need reaches the share on one of the node's GPUs (placement's test).
        whole = copy.need_bytes >= copy.whole_gpu_from * smallest
        if copy.need_bytes > (whole_room if whole else room):
            short.append(copy)
    return max(short, key=lambda c: (c.need_bytes, c.deployment), default=None)


def sleep_early(
    *, wake_s: float, slo_ttft_s: float, idle_s: float, max_wait_s: float, short: AsleepCopy | None
) -> bool:
    """Whether the idle sweep should put an idle replica to sleep before its idle timeout:
    when its node has no room for a copy asleep there that would wake within its SLO
    (`short`, from `short_of_room`), the replica's own wake is within its SLO too
    (`sleep_when_idle`), and it has been idle for its deployment's max_wait at least.

    Why: a wake that finds no room preempts an idle victim at once (`preempt_at_once`), but still
    waits for the victim's weights to leave before its own can come in: a 32B model wakes in 3.3 s
    against a 5 s SLO, and a victim of the same size takes as long to leave, so the first request
    of the burst misses. Sleeping the idle replica ahead of that wake costs its own next request no
    miss (it wakes within its SLO) and has the room free when the burst comes; the idle timeout
    (minutes) is for a node with room to spare, where an early sleep would only make wakes. In
    the capacity planner, the misses of `gpuportal-next` summed over the GPU counts around the
    bound fell by 24 % on seeds 2, 3, 6, 8 and 10 (9-20 GPUs), 38 % on seeds 1, 4, 5, 7 and 9
    (6-16) and 18 % on the production-like traces (5-18).
    Idle for max_wait at least: a shorter pause is inside a burst, and max_wait is how long a fair
    wake would wait for this replica's memory anyway before preempting it. Popular deployments,
    failover pairs and those that never sleep when idle stay out, as with the idle timeout (the
    callers' filter)."""
    return short is not None and idle_s >= max_wait_s and sleep_when_idle(wake_s=wake_s, slo_ttft_s=slo_ttft_s)


@dataclass(frozen=True)
class ReloadTimes:
    """How long one replica of a deployment takes to come up: loaded from disk, or woken from a
    node's CPU RAM; each measured by its replicas (DeploymentObserved.measured_load_s / measured_wake_s)
    or else estimated from its bytes, as the capacity planner does."""

    load_s: float
    wake_s: float
    load_measured: bool = False
    wake_measured: bool = False


@dataclass(frozen=True)
class WakeOrLoad:
    """`prefer_wake`'s answer for one deployment, and why, in words for its Event."""

    wake: bool
    reason: str


def wake_or_load(times: ReloadTimes, *, max_wait_s: float) -> WakeOrLoad:
    """`prefer_wake` over a deployment's reload times and its max_wait, with the reason."""
    wake = prefer_wake(load_s=times.load_s, wake_s=times.wake_s, max_wait_s=max_wait_s)
    load = f"a load from disk takes {describe_reload(times.load_s, times.load_measured)}"
    woken = (
        f"a wake from CPU RAM of {describe_reload(times.wake_s, times.wake_measured)} after a fair wait of "
        f"at most {describe_reload(max_wait_s, None)} (max_wait)"
    )
    if wake:
        return WakeOrLoad(True, f"{load}, longer than {woken}")
    return WakeOrLoad(False, f"{load}, no longer than {woken}")


def describe_reload(seconds: float, measured: bool | None) -> str:
    """A reload time for an Event, and (unless `measured` is None) whether it was measured."""
    # Three significant figures: reload times run from milliseconds (a tiny model) to minutes.
    said = f"{seconds:.3g} s"
    return said if measured is None else f"{said} ({'measured' if measured else 'estimated from its bytes'})"


@dataclass(frozen=True)
class Target:
    """Where a waking single-GPU replica goes when it fits nowhere as things are, and who must
    sleep there (`choice`, ready for the fair wait and its deadline)."""

    gpu_id: int
    # Bytes that must be available there: the reservation less what the waker already holds.
    needed_bytes: int
    choice: VictimChoice
    # What the victims cost, in the order targets are compared (lowest first), for Events.
    cost: tuple[float, ...]
    # False: no GPU has victims enough yet, but on this one only replicas still inside their
    # min_runtime, loading or already leaving stand in the way. Holding its wake lock keeps new
    # replicas off it, so choosing again once they settle succeeds; `choice` is that later one.
    ready: bool = True
    # Every GPU the waker needs and the bytes that must be available on each: {gpu_id:
    # needed_bytes} for a single-GPU target; for `choose_whole_gpus`, each of the whole GPUs of
    # one node (then `gpu_id` is the first of them and `needed_bytes` their sum).
    needed_bytes_by_gpu: Mapping[int, int] = field(default_factory=dict)

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.needed_bytes_by_gpu)) or (self.gpu_id,)


def choose_target(
    gpus: Sequence[GPUView],
    *,
    waiting_replica_id: str,
    need_bytes: int,
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None = None,
    whole_gpu_from: float = 0.99,
) -> Target | None:
    """The GPU where making room for a replica of `need_bytes` costs least, and its victims.

    Placement's targeting (scheduling.core.placement) picks the GPU with the fewest evictions as if every
    non-dedicated occupant could leave, and only then asks who may; a GPU whose occupants turn
    out popular, young or busy makes the wake fail and start again (the trace simulator: the
    large models starve that way). Here every GPU that can hold the need as a fraction is asked
    `choose_victim` first, and the cheapest answer wins: no busy victim if possible (its requests
    would drain first), then the shortest sleep of the victims (the waker loads only once their
    weights are out: that wait is part of its time to first token), then the least reload cost
    per second of idleness (what losing them is likely to cost later), then best fit, then GPU id.

    When no GPU has victims enough now, the GPUs are judged as they will be once every
    occupant still loading has served its min_runtime and every one draining has left: the
    cheapest of those is returned with `ready=False` (popular and dedicated replicas stay put
    either way, so such a target never waits on them).

    None when the need is a whole GPU or more (placement's multi-GPU search handles those) or
    when not even that helps; the caller then falls back to placement's targeting.
    """
    if need_bytes <= 0:
        raise ValueError(f"need_bytes must be positive, got {need_bytes}")
    best = _cheapest_target(gpus, waiting_replica_id, need_bytes, now, kept_bytes_by_gpu, whole_gpu_from)
    if best is not None:
        return best
    settled, later = _settled(gpus, now)
    best = _cheapest_target(settled, waiting_replica_id, need_bytes, later, kept_bytes_by_gpu, whole_gpu_from)
    return None if best is None else replace(best, ready=False)


def _cheapest_target(
    gpus: Sequence[GPUView],
    waiting_replica_id: str,
    need_bytes: int,
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None,
    whole_gpu_from: float,
) -> Target | None:
    by_id = _index(gpus)
    best: Target | None = None
    for gpu_id in sorted(by_id):
        gpu = by_id[gpu_id]
        if need_bytes >= whole_gpu_from * gpu.total_bytes:
            continue
        own = sum(o.reserved_bytes for o in gpu.occupants if o.replica_id == waiting_replica_id)
        needed = max(1, need_bytes - own)
        choice = choose_victim(
            gpus,
            waiting_replica_id=waiting_replica_id,
            needed_bytes_by_gpu={gpu_id: needed},
            now=now,
            kept_bytes_by_gpu=kept_bytes_by_gpu,
        )
        if isinstance(choice, NoVictim):
            continue
        cost = _target_cost(gpu, needed, choice, by_id, now)
        if best is None or cost < best.cost:
            best = Target(gpu_id, needed, choice, cost, needed_bytes_by_gpu={gpu_id: needed})
    return best


def choose_whole_gpus(
    gpus: Sequence[GPUView],
    *,
    waiting_replica_id: str,
    need_bytes: int,
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None = None,
    slo_ttft_s: float | None = None,
    waiting_requests: int | None = None,
) -> Target | None:
    """`choose_target` for a replica that needs whole GPUs (a need of a GPU or more, which
    placement splits over the fewest whole GPUs of one node): the node and GPUs where emptying
    them costs least, and who must sleep there.

    Placement's targeting counts every non-dedicated occupant as movable, so a 70B wake could
    wait on two GPUs of which one holds a popular or a young replica: `choose_victim` then finds
    no victim at the deadline and the wake starts again after a backoff (the capacity planner: the
    70B deployments "waiting for room"). Here, per node, the GPUs are taken one at a time, each
    the one that adds least to the cost of emptying the GPUs already taken (`choose_victim` over
    them all, so a victim spanning two of them is counted once), only GPUs that `choose_victim`
    can empty completely, until their memory reaches the need; the greedy starts from each GPU in
    turn and keeps the cheapest complete set. The cheapest node's set wins, by the cost order of
    `choose_target` with one key more after the busy victims: the fewest victims (emptying a GPU
    evicts everyone on it, and each victim is a wake that must find room again; placement's own
    targeting also counts evictions first), then the longest sleep, then reload cost per second
    idle, then waste, then GPU ids. A GPU is whole only with no other occupant at all
    (placement's rule), so one holding an occupant that may not be preempted is never taken.

    As `choose_target`: when no node can be emptied now, the GPUs are judged as they will be
    once occupants still loading have served their min_runtime and draining ones have left, and
    the cheapest is returned with `ready=False`; None when not even that helps.

    Two guards against the cascade that emptying GPUs starts (each victim must wake again and,
    on a full cluster, preempt in turn, as on the production-like trace):

    - `slo_ttft_s`: victims whose wake from CPU RAM (`reload_s`) is longer than the SLO are
      ranked after the busy victims and before the number of victims, fewest first: the next
      request of such a victim misses for certain (the replicas `sleep_when_idle` keeps awake),
      while a victim that wakes within the SLO loses nothing if it finds room again.
    - `waiting_requests` (the requests queued for the waker's deployment): a target with more
      victims than that is refused (None: the caller falls back to placement's targeting, which
      waits for the occupants it counts on), since it would trade more replicas' next requests
      for fewer of the waker's; a single victim is always allowed, as one wake for one.
    """
    if need_bytes <= 0:
        raise ValueError(f"need_bytes must be positive, got {need_bytes}")
    best = _cheapest_whole(gpus, waiting_replica_id, need_bytes, now, kept_bytes_by_gpu, slo_ttft_s)
    if best is None:
        settled, later = _settled(gpus, now)
        best = _cheapest_whole(settled, waiting_replica_id, need_bytes, later, kept_bytes_by_gpu, slo_ttft_s)
        best = None if best is None else replace(best, ready=False)
    if best is not None and waiting_requests is not None and len(best.choice.victims) > max(1, waiting_requests):
        return None
    return best


def _cheapest_whole(
    gpus: Sequence[GPUView],
    waiting_replica_id: str,
    need_bytes: int,
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None,
    slo_ttft_s: float | None = None,
) -> Target | None:
    by_node: dict[str, list[GPUView]] = {}
    for gpu in sorted(_index(gpus).values(), key=lambda g: g.id):
        by_node.setdefault(gpu.node, []).append(gpu)
    best: Target | None = None
    for node in sorted(by_node):
        target = _whole_on_node(by_node[node], waiting_replica_id, need_bytes, now, kept_bytes_by_gpu, slo_ttft_s)
        if target is not None and (best is None or target.cost < best.cost):
            best = target
    return best


def _whole_on_node(
    gpus: list[GPUView],
    waiting_replica_id: str,
    need_bytes: int,
    now: datetime,
    kept_bytes_by_gpu: Mapping[int, int] | None,
    slo_ttft_s: float | None = None,
) -> Target | None:
    """The cheapest set of whole GPUs of one node: from each GPU in turn, the GPUs that add least
    to the cost of emptying those taken so far, until their memory reaches the need; the
    cheapest complete set of those starts (so a victim spanning two GPUs, which empties both at
    the cost of one, is found whichever GPU the greedy would have taken first)."""
    # Only a GPU whose every occupant may be a victim now can be emptied (a necessary condition,
    # cheap to check; choose_victim still judges each set, on every GPU's view of a replica).
    # On a large cluster most nodes hold some popular, dedicated or young replica.
    emptiable = [g for g in gpus if all(_may_leave(o, waiting_replica_id, now) for o in g.occupants)]
    if sum(g.total_bytes for g in emptiable) < need_bytes:
        return None
    by_id = {g.id: g for g in gpus}
    # The greedy meets the same set of GPUs from each of its members: judged once.
    judged: dict[frozenset[int], tuple[tuple[float, ...], dict[int, int], VictimChoice] | None] = {}

    def empty(taken: Mapping[int, int], gpu: GPUView) -> tuple[tuple[float, ...], dict[int, int], VictimChoice] | None:
        key = frozenset((*taken, gpu.id))
        if key not in judged:
            judged[key] = _empty(taken, gpu)
        return judged[key]

    def _empty(taken: Mapping[int, int], gpu: GPUView) -> tuple[tuple[float, ...], dict[int, int], VictimChoice] | None:
        own = sum(o.reserved_bytes for o in gpu.occupants if o.replica_id == waiting_replica_id)
        needed = {**taken, gpu.id: max(1, gpu.total_bytes - own)}
        choice = choose_victim(
            gpus,
            waiting_replica_id=waiting_replica_id,
            needed_bytes_by_gpu=needed,
            now=now,
            kept_bytes_by_gpu=kept_bytes_by_gpu,
        )
        if isinstance(choice, NoVictim) or not _emptied(gpu, choice, waiting_replica_id):
            return None
        cost = _group_cost([by_id[g] for g in needed], sum(needed.values()), choice, by_id, now, slo_ttft_s)
        return cost, needed, choice

    best: Target | None = None
    for start in emptiable:
        step = empty({}, start)
        while step is not None and sum(by_id[g].total_bytes for g in step[1]) < need_bytes:
            taken = step[1]
            options = [o for g in emptiable if g.id not in taken and (o := empty(taken, g)) is not None]
            step = min(options, key=lambda o: o[0]) if options else None
        if step is None:
            continue
        cost, needed, choice = step
        if best is None or cost < best.cost:
            best = Target(
                min(needed), sum(needed.values()), choice, cost, needed_bytes_by_gpu=dict(sorted(needed.items()))
            )
    return best


def _may_leave(occupant: OccupantView, waiting_replica_id: str, now: datetime) -> bool:
    return occupant.replica_id == waiting_replica_id or _verdict(occupant, waiting_replica_id, now)[0] is None


def _emptied(gpu: GPUView, choice: VictimChoice, waiting_replica_id: str) -> bool:
    """Whether no one but the waker is left on `gpu` once `choice`'s victims sleep."""
    leaving = set(choice.victim_ids) | {waiting_replica_id}
    return all(o.replica_id in leaving for o in gpu.occupants)


def _settled(gpus: Sequence[GPUView], now: datetime) -> tuple[list[GPUView], datetime]:
    """The GPUs once transitions end: occupants starting up serve from `now`, draining ones are
    gone (their bytes available), and the returned instant is when every min_runtime has passed."""
    longest = max((o.min_runtime_s for g in gpus for o in g.occupants), default=0.0)
    later = now + timedelta(seconds=longest)
    out = []
    for gpu in gpus:
        occupants = []
        for o in gpu.occupants:
            if o.state == ReplicaState.DRAINING:
                continue
            if o.state in states.STARTING:
                o = replace(o, state=ReplicaState.SERVING, serving_since=now, last_accessed=now)
            occupants.append(o)
        reserved = sum(o.reserved_bytes for o in occupants)
        out.append(replace(gpu, occupants=tuple(occupants), available_bytes=gpu.total_bytes - reserved))
    return out, later


def _target_cost(
    gpu: GPUView, needed: int, choice: VictimChoice, by_id: Mapping[int, GPUView], now: datetime
) -> tuple[float, ...]:
    views = {o.replica_id: o for g in by_id.values() for o in g.occupants}
    busy = sum(1 for v in choice.victims if (views[v.replica_id].in_flight or 0) > 0)
    weight = sum(_weight(v.last_accessed, views[v.replica_id].reload_s, now) for v in choice.victims)
    sleep = max((views[v.replica_id].reload_s or 0.0 for v in choice.victims), default=0.0)
    waste = gpu.available_bytes + choice.freed_bytes - needed
    return (float(busy), sleep, weight, float(waste), float(gpu.id))


def _group_cost(
    gpus: Sequence[GPUView],
    needed: int,
    choice: VictimChoice,
    by_id: Mapping[int, GPUView],
    now: datetime,
    slo_ttft_s: float | None = None,
) -> tuple[float, ...]:
    """`_target_cost` over several GPUs: busy victims, then victims whose wake misses
    `slo_ttft_s` (none counted without one), then how many victims (`choose_whole_gpus`), then the
    same order, waste summed, ties by the first GPU id."""
    cost = _target_cost(gpus[0], needed, choice, by_id, now)
    views = {o.replica_id: o for g in by_id.values() for o in g.occupants}
    slow = 0
    if slo_ttft_s is not None:
        reloads = (views[v.replica_id].reload_s for v in choice.victims)
        slow = sum(1 for r in reloads if r is not None and not sleep_when_idle(wake_s=r, slo_ttft_s=slo_ttft_s))
    waste = sum(g.available_bytes for g in gpus) + choice.freed_bytes - needed
    return (cost[0], float(slow), float(len(choice.victims)), *cost[1:3], float(waste), float(min(g.id for g in gpus)))


# --- the pieces ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    replica_id: str
    deployment: str
    last_accessed: datetime | None
    freed: Mapping[int, int]  # gpu id -> bytes freed, on every input GPU it occupies
    reload_s: float | None = None
    busy: bool = False  # known to serve a request now
    idle: bool = False  # known to serve none now
    expired: bool = False  # known to serve none, idle past its idle timeout


def _sort_key(c: _Candidate) -> tuple:
    # None first (see the module docstring), then oldest access, then id: a total order, so the
    # answer never depends on the order in which the snapshot listed occupants.
    if c.last_accessed is None:
        return (0, "", c.replica_id)
    return (1, c.last_accessed, c.replica_id)


def _cost_key(now: datetime) -> Callable[[_Candidate], tuple]:
    """Expired idle replicas first, busy ones last; in each tier the lowest reload cost per
    second of idleness, then LRU. The weight is what losing the replica costs (its reload) times
    how soon it is likely to be wanted again (the inverse of how long it has been idle): a small
    model idle for seconds is a cheaper victim than a large one idle for a minute."""

    def key(c: _Candidate) -> tuple:
        tier = 0 if c.expired else 2 if c.busy else 1
        return (tier, _weight(c.last_accessed, c.reload_s, now), *_sort_key(c))

    return key


def _weight(last_accessed: datetime | None, reload_s: float | None, now: datetime) -> float:
    """Reload seconds per second of idleness: what losing the replica is likely to cost."""
    if last_accessed is None:
        return 0.0  # never accessed counts as idle for ever (the module docstring)
    idle = max(MIN_IDLE_S, (now - last_accessed).total_seconds())
    return (reload_s if reload_s is not None else UNKNOWN_RELOAD_S) / idle


def _order_key(order: VictimOrder, now: datetime) -> Callable[[_Candidate], tuple]:
    if order == "lru":
        return _sort_key
    if order == "cost":
        return _cost_key(now)
    raise ValueError(f"unknown victim order {order!r}: expected 'cost' or 'lru'")


def _verdict(occupant: OccupantView, waiting_replica_id: str, now: datetime) -> tuple[Cause | None, str]:
    """(None, why eligible) or (the first rule it fails, why)."""
    name = _name(occupant)
    if occupant.replica_id == waiting_replica_id:
        return Cause.SELF, f"{name} is the waiting replica itself"
    if occupant.state != ReplicaState.SERVING:
        return Cause.NOT_SERVING, f"{name} is {occupant.state}, not serving"
    if occupant.popular:
        return Cause.POPULAR, f"{name} is popular (never preempted)"
    if occupant.dedicated:
        return Cause.DEDICATED, f"{name} is dedicated (never evicted to make room)"
    if occupant.serving_since is None:
        return Cause.MIN_RUNTIME, f"{name} has no serving_since, so its min_runtime cannot be shown to have passed"
    served = (now - occupant.serving_since).total_seconds()
    if served < occupant.min_runtime_s:
        until = occupant.serving_since + timedelta(seconds=occupant.min_runtime_s)
        return Cause.MIN_RUNTIME, (
            f"{name} has served {_fmt_s(served)}, less than its min_runtime of {_fmt_s(occupant.min_runtime_s)} "
            f"(eligible from {until.isoformat()})"
        )
    return None, (
        f"{name} is eligible: serving for {_fmt_s(served)}, at least its min_runtime of "
        f"{_fmt_s(occupant.min_runtime_s)}"
    )


def _index(gpus: Sequence[GPUView]) -> dict[int, GPUView]:
    by_id: dict[int, GPUView] = {}
    for gpu in gpus:
        if gpu.id in by_id:
            raise ValueError(f"GPU {gpu.id} ({gpu.label}) is listed twice")
        by_id[gpu.id] = gpu
    return by_id


def _check_needs(needed: Mapping[int, int], by_id: Mapping[int, GPUView]) -> None:
    if not needed:
        raise ValueError("needed_bytes_by_gpu is empty: a waking replica needs at least one GPU")
    unknown = sorted(set(needed) - set(by_id))
    if unknown:
        raise ValueError(f"needed GPUs not among the given GPUs: {unknown}")
    negative = sorted(g for g, n in needed.items() if n < 0)
    if negative:
        raise ValueError(f"negative need on GPUs {negative}")


def _candidates(
    by_id: Mapping[int, GPUView],
    needed_ids: list[int],
    waiting_replica_id: str,
    now: datetime,
    kept: Mapping[int, int],
    order: VictimOrder = "lru",
) -> tuple[list[_Candidate], dict[str, tuple[Cause, str]]]:
    """Eligible replicas occupying a needed GPU, in victim order; and the ineligible ones, why.

    A replica is judged on every view of it the input holds (one per GPU it occupies): the
    views of one replica should agree, and if a torn snapshot makes them disagree, the most
    protective verdict wins.
    """
    needed = set(needed_ids)
    views: dict[str, list[tuple[GPUView, OccupantView]]] = {}
    for gpu_id in sorted(by_id):
        for o in by_id[gpu_id].occupants:
            views.setdefault(o.replica_id, []).append((by_id[gpu_id], o))
    candidates: list[_Candidate] = []
    ineligible: dict[str, tuple[Cause, str]] = {}
    for replica_id in sorted(views):
        held = views[replica_id]
        if replica_id == waiting_replica_id or not any(g.id in needed for g, _ in held):
            continue
        refusal: tuple[Cause, str] | None = None
        for _, o in held:
            cause, why = _verdict(o, waiting_replica_id, now)
            if cause is not None:
                refusal = (cause, why)
                break
        if refusal is not None:
            ineligible[replica_id] = refusal
            continue
        accesses = [o.last_accessed for _, o in held if o.last_accessed is not None]
        freed: dict[int, int] = {}
        for g, o in held:
            freed[g.id] = freed.get(g.id, 0) + max(0, o.reserved_bytes - kept.get(g.id, 0))
        # In doubt (views that disagree), count it as more used, busier and dearer to reload.
        last_accessed = max(accesses) if accesses else None
        reloads = [o.reload_s for _, o in held if o.reload_s is not None]
        in_flight = [o.in_flight for _, o in held]
        timeouts = [o.idle_timeout_s for _, o in held]
        idle_known = all(n == 0 for n in in_flight) and all(t is not None for t in timeouts)
        expired = idle_known and (
            last_accessed is None or (now - last_accessed).total_seconds() >= max(t or 0.0 for t in timeouts)
        )
        candidates.append(
            _Candidate(
                replica_id=replica_id,
                deployment=held[0][1].deployment,
                last_accessed=last_accessed,
                freed=freed,
                reload_s=max(reloads) if reloads else None,
                busy=any(n is not None and n > 0 for n in in_flight),
                idle=all(n == 0 for n in in_flight),
                expired=expired,
            )
        )
    candidates.sort(key=_order_key(order, now))
    return candidates, ineligible


def _greedy_lru(candidates: list[_Candidate], short: Mapping[int, int]) -> list[_Candidate] | None:
    """Candidates in victim order until no needed GPU is short, then without the redundant ones.

    None when even all of them are not enough. Skipping a candidate that frees nothing on a
    still-short GPU never loses a solution: the set of short GPUs only shrinks, so it would
    never help later either.
    """
    remaining = dict(short)
    chosen: list[_Candidate] = []
    for c in candidates:
        helps = [g for g in remaining if c.freed.get(g, 0) > 0]
        if not helps:
            continue
        chosen.append(c)
        for g in helps:
            remaining[g] -= c.freed[g]
            if remaining[g] <= 0:
                del remaining[g]
        if not remaining:
            break
    if remaining:
        return None
    # Last in victim order first, so that when either of two victims would do, the cheaper goes.
    for i in range(len(chosen) - 1, -1, -1):
        without = chosen[:i] + chosen[i + 1 :]
        if _enough(without, short):
            chosen = without
    return chosen


def _enough(chosen: list[_Candidate], short: Mapping[int, int]) -> bool:
    return all(sum(c.freed.get(g, 0) for c in chosen) >= need for g, need in short.items())


def _freeable(candidates: Iterable[_Candidate], gpu_id: int) -> int:
    return sum(c.freed.get(gpu_id, 0) for c in candidates)


def _victim(
    c: _Candidate,
    chosen: list[_Candidate],
    candidates: list[_Candidate],
    by_id: Mapping[int, GPUView],
    short: Mapping[int, int],
    now: datetime,
    order: VictimOrder = "lru",
) -> Victim:
    on = sorted(g for g in short if c.freed.get(g, 0) > 0)
    # `candidates` is in victim order: those before this one rank as cheaper (or older) victims.
    ahead = candidates[: candidates.index(c)]
    older = [o for o in ahead if any(o.freed.get(g, 0) > 0 for g in on)]
    # Candidates ahead on the same short GPUs that are not victims were dropped as redundant:
    # this victim frees what they would have, so sleeping them as well would help no one.
    spared = [o for o in older if o not in chosen]
    # Without reload costs the cost order is LRU, and reads as such.
    by_cost = order == "cost" and any(o.reload_s is not None for o in candidates)
    cheaper = "cheaper" if by_cost else "older"
    if spared:
        rank = "eligible occupant"
        why_not_older = (
            f"; spares {_plural(len(spared), f'{cheaper} eligible occupant')} "
            f"({', '.join(_short(o.replica_id) for o in spared)}), not needed once this one sleeps"
        )
    else:
        which = "cheapest to lose" if by_cost else "least recently used"
        rank = f"next {which} eligible occupant" if older else f"{which} eligible occupant"
        why_not_older = ""
    if c.last_accessed is None:
        idle = "never accessed since it started serving"
    else:
        idle = f"idle since {c.last_accessed.isoformat()} ({_fmt_s((now - c.last_accessed).total_seconds())} ago)"
    if c.expired:
        idle += ", past its idle timeout"
    if order == "cost" and c.reload_s is not None:
        idle += f", reloads in {_fmt_s(c.reload_s)}"
    frees = ", ".join(f"{_fmt_bytes(c.freed[g])} on {by_id[g].label}" for g in on)
    return Victim(
        replica_id=c.replica_id,
        deployment=c.deployment,
        freed_bytes_by_gpu=dict(sorted(c.freed.items())),
        last_accessed=c.last_accessed,
        reason=(
            f"{rank} of {_labels(by_id[g] for g in on)}: {c.deployment} ({_short(c.replica_id)}), "
            f"{idle}, frees {frees}{why_not_older}"
        ),
        expired=c.expired,
        idle=c.idle,
    )


def _shortfall(
    gpu: GPUView,
    needed: int,
    candidates: list[_Candidate],
    ineligible: Mapping[str, tuple[Cause, str]],
    waiting_replica_id: str,
    kept: Mapping[int, int],
) -> Shortfall:
    others = sorted({o.replica_id for o in gpu.occupants if o.replica_id != waiting_replica_id})
    refused = [ineligible[rid] for rid in others if rid in ineligible]
    freeable = _freeable(candidates, gpu.id)
    need = f"needs {_fmt_bytes(needed)}, {_fmt_bytes(gpu.available_bytes)} available"
    label = _labels([gpu])
    if not others:
        return Shortfall(
            gpu.id,
            gpu.label,
            needed,
            gpu.available_bytes,
            0,
            (Cause.NO_OCCUPANTS,),
            f"{label} has no other occupant to preempt ({need})",
        )
    # In the seed's order, so that the same mix always reads the same way.
    order = (Cause.POPULAR, Cause.DEDICATED, Cause.MIN_RUNTIME, Cause.NOT_SERVING)
    present = tuple(c for c in order if any(r[0] is c for r in refused))
    details = "; ".join(why for _, why in refused)
    if not any(rid not in ineligible for rid in others):
        reason = f"all occupants of {label} are {' or '.join(present)} ({need}): {details}"
        return Shortfall(gpu.id, gpu.label, needed, gpu.available_bytes, 0, present, reason)
    eligible_count = sum(1 for c in candidates if gpu.id in c.freed)
    reason = (
        f"not enough memory on {label} even after preempting every eligible occupant: {need} "
        f"+ {_fmt_bytes(freeable)} from {_plural(eligible_count, 'eligible occupant')}"
    )
    if kept.get(gpu.id):
        reason += f" (each keeps {_fmt_bytes(kept[gpu.id])} once asleep)"
    if details:
        reason += f"; the others: {details}"
    return Shortfall(
        gpu.id, gpu.label, needed, gpu.available_bytes, freeable, (Cause.NOT_ENOUGH_MEMORY, *present), reason
    )


def _name(o: OccupantView) -> str:
    return f"{o.deployment} ({_short(o.replica_id)})"


def _short(replica_id: str) -> str:
    return replica_id[:8]


def _labels(gpus: Iterable[GPUView]) -> str:
    labels = [g.label for g in gpus]
    return ("gpu " if len(labels) == 1 else "gpus ") + ", ".join(labels)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if abs(seconds) >= 10 or seconds == int(seconds) else f"{seconds:.1f} s"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def popular_crowding(gpus: Sequence[GPUView], *, smallest_other_need: int | None) -> list[str]:
    """Warnings for GPUs where popular replicas (never preempted) leave too little for anything
    else: less than the smallest need of the non-popular deployments, or nothing at all."""
    warnings = []
    for gpu in sorted(gpus, key=lambda g: g.id):
        popular = sum(o.reserved_bytes for o in gpu.occupants if o.popular)
        if not popular:
            continue
        left = gpu.total_bytes - popular
        floor = smallest_other_need if smallest_other_need is not None else 1
        if left < floor:
            needed = f", and the smallest other deployment needs {smallest_other_need} B" if smallest_other_need else ""
            warnings.append(
                f"popular deployments hold {popular} B of gpu {gpu.label} ({gpu.total_bytes} B): only {left} B "
                f"is left for anything else{needed}; popular replicas are never preempted"
            )
    return warnings
