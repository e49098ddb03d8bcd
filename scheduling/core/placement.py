"""Where a replica goes and what must make room for it (seeds 000 and 002), as a pure function.

`place(snapshot, request)` looks at every node, gives each a candidate level and the best way to
host the replica there, picks the best level (ties at random), and returns a `Placement` (which
turns into a ledger `Plan`) or a `CantAccommodate` with a reason per node. Nothing here reads
the database or the clock: the snapshot's `taken_at` is "now", and randomness comes from an
injected `random.Random`, so the same snapshot, request and seed always give the same answer.

Per node (seed 000): a replica whose need fits one GPU is fractional (reserves its need) or, at
or above the policy's threshold, takes a whole GPU; the GPU search takes a GPU with room, else
the GPU that needs the fewest evictions of evictable replicas. A need larger than any GPU of the
node (or one that found no single GPU) is split over the fewest whole GPUs of that node.

Where this departs from the seed, on purpose:
- a whole GPU is one with no occupant at all, not one with "enough" free memory: a whole-GPU
  reservation is the GPU's total, so anyone still there would be over-committed;
- evicting a tenant frees only the bytes it holds, not the GPU it sits on;
- the answer is one complete plan or none: nothing is reserved unless everything fits;
- a new replica never reuses a cached replica's id on another node (the cached copy lives in
  its own node's CPU RAM and process, so "moving" it is really creating a new one).

Reading of DEPLOYED (seed 002, and the seed's `Node.evaluate`): a node is DEPLOYED when the
*requested replica id* already runs there, which makes a repeated request a no-op (a retry
after a commit that did land). A sibling replica of the same deployment does not make a node
DEPLOYED: with a fresh id per scale-up step, reading DEPLOYED per deployment would turn every
scale-up into "nothing to do" on the node that already serves it. Nodes with siblings are
therefore neither preferred nor avoided; the seed breaks ties at random and so do we.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import IntEnum, StrEnum
from typing import Literal, NamedTuple, TypeVar

from gpuportal.wire import states
from gpuportal.wire.states import ReplicaState
from scheduling.core.state import GPUView, Holdings, OccupantView, Plan, Release, Reservation, Snapshot, SnapshotIndex

MIN_FRACTION = 0.01
MAX_FRACTION = 0.99


T = TypeVar("T")


class CandidateLevel(IntEnum):
    """How good a node is for the replica; lower is better (seed 002)."""

    DEPLOYED = 0
    CACHED_AND_FREE = 1
    FREE = 2
    CACHED_AND_FULL = 3
    FULL = 4
    CANT_ACCOMMODATE = 5


class Mode(StrEnum):
    FRACTIONAL = "fractional"
    WHOLE = "whole"
    MULTI = "multi"


@dataclass(frozen=True)
class Policy:
    """The knobs that differ between our placement and the seed's, for side-by-side runs."""

    name: str
    # A single-GPU need at or above this share of the GPU reserves the whole GPU.
    whole_gpu_from: float
    # True: the GPU left with the least free memory (fights fragmentation). False: any GPU with
    # room, at random (the seed's shuffle-then-first-fit, which is the same distribution).
    best_fit: bool
    # "fewest": the fewest tenants that free enough, the smallest such. "smallest_first": evict
    # in ascending size until enough is free (the seed's order).
    victims: Literal["fewest", "smallest_first"]
    # Invariant 3 of docs/architecture.md: popular replicas, and those inside their min_runtime, are never
    # victims. Off, the seed's rule applies: only a dedicated request may evict a young replica.
    protect_fairness: bool
    # False: never evict anyone, only use free memory. The fair wake path (services/preemption)
    # places with this off, because who sleeps for a wake is fairness.py's call, after max_wait.
    evictions: bool = True


GPUPORTAL = Policy("gpuportal", whole_gpu_from=MAX_FRACTION, best_fit=True, victims="fewest", protect_fairness=True)
# need = model size x 3 is memory.py's `ndif` policy; placement keeps the seed's 0.8 threshold.
NDIF = Policy("ndif", whole_gpu_from=0.8, best_fit=False, victims="smallest_first", protect_fairness=False)
POLICIES: Mapping[str, Policy] = {p.name: p for p in (GPUPORTAL, NDIF)}


@dataclass(frozen=True)
class CachedReplica:
    """A sleeping replica of the deployment: weights in `node`'s CPU RAM, process alive there."""

    replica_id: str
    node: str


@dataclass(frozen=True)
class PlacementRequest:
    """One replica to place.

    `need_bytes` is the replica's whole need. `gpus`: None lets placement choose (one GPU if the
    need fits one, else the fewest whole GPUs of a node); 1 forbids splitting; n >= 2 asks for
    exactly n whole GPUs. `replica_id` is the id a new replica gets; `cached` lists sleeping
    replicas of the deployment, promoted in preference to creating one (the promoted replica
    keeps its own id). `allow_new=False` only promotes (a wake rather than a scale-up).
    `dedicated` matters only under `ndif`, where (as in the seed) a dedicated request may evict
    replicas still inside their min_runtime; `gpuportal` keeps invariant 3 (docs/architecture.md) for everyone.
    `spread` (a deployment's `placement.spread`) trades packing for isolation: among the nodes and
    GPUs that can host it without evictions, the replica goes where the fewest of its siblings
    are, then to the emptiest GPU, rather than to the fullest GPU that fits (best fit packs, so
    that large replicas still find whole GPUs later).
    `host_refused`: {node: why} of the nodes whose host RAM has no room for a new replica's
    process (scheduling.core.host_memory); a cached replica there may still be promoted, since
    its process runs already.
    `refused_nodes`: {node: why} of the nodes where no replica of the deployment may run, neither
    a new one nor a sleeping one promoted: those its `placement.node_selector` does not match, or
    whose taints its `placement.tolerations` do not name (gpuportal.wire.node_labels).
    `avoided_nodes`: {node: why} of the nodes it goes to last (a PreferNoSchedule taint it does
    not tolerate): at each level, only when no other node can host it there; so one is used
    before anything is evicted elsewhere, as Kubernetes scores such a node low but keeps it.
    """

    deployment: str
    replica_id: str
    need_bytes: int
    gpus: int | None = None
    dedicated: bool = False
    cached: tuple[CachedReplica, ...] = ()
    allow_new: bool = True
    spread: bool = False
    host_refused: Mapping[str, str] = field(default_factory=dict, hash=False)
    refused_nodes: Mapping[str, str] = field(default_factory=dict, hash=False)
    avoided_nodes: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.need_bytes <= 0:
            raise ValueError(f"need_bytes must be positive, got {self.need_bytes}")
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"gpus must be at least 1, got {self.gpus}")


class Eviction(NamedTuple):
    replica_id: str
    gpu_id: int
    freed_bytes: int


@dataclass(frozen=True)
class Placement:
    """Where the replica goes, what is evicted for it, and why."""

    deployment: str
    replica_id: str  # the replica that will run: the promoted one, or the new one
    node: str
    gpu_ids: tuple[int, ...]
    bytes_by_gpu: Mapping[int, int]
    fraction: float | None  # for torch.cuda.set_per_process_memory_fraction; None on several GPUs
    mode: Mode
    level: CandidateLevel
    evictions: tuple[Eviction, ...] = ()
    promoted: str | None = None
    # GPUs where the promoted replica held an empty (0-byte) residual it no longer needs.
    dropped_residuals: tuple[int, ...] = ()
    reason: str = ""

    @property
    def evicted_replicas(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.replica_id for e in self.evictions))

    def to_plan(self, snapshot: Snapshot) -> Plan:
        """The ledger plan, against the snapshot this placement was computed from."""
        if self.level is CandidateLevel.DEPLOYED:
            return Plan.against(snapshot, self.reason)
        releases = [Release(e.gpu_id, e.replica_id) for e in self.evictions]
        releases += [Release(gpu_id, self.replica_id) for gpu_id in self.dropped_residuals]
        reservations = [Reservation(gpu_id, self.replica_id, self.bytes_by_gpu[gpu_id]) for gpu_id in self.gpu_ids]
        return Plan.against(snapshot, self.reason, reservations=reservations, releases=releases)


@dataclass(frozen=True)
class CantAccommodate:
    """No node can host the replica; `reasons` says why, per node."""

    deployment: str
    need_bytes: int
    reasons: Mapping[str, str]
    level: CandidateLevel = CandidateLevel.CANT_ACCOMMODATE
    # In a plan that places several at once (planning.place_all): which one this is, of how many.
    ordinal: int = 1
    asked: int = 1
    # Where the GPUs could not hold all the deployment's replicas even with nothing else on them,
    # that said (planning.ceiling); the reasons per node then matter less.
    ceiling: str = ""

    @property
    def reason(self) -> str:
        per_node = "; ".join(f"{node}: {why}" for node, why in sorted(self.reasons.items())) or "no nodes"
        head = f"cannot place {self.deployment} ({fmt_bytes(self.need_bytes)})"
        if self.asked > 1:
            # The reasons describe the GPUs as the replicas before it left them, not as they are.
            fit = f"the {self.ordinal - 1} before it fit, " if self.ordinal > 1 else ""
            head += f", replica {self.ordinal} of {self.asked} placed together ({fit}nothing is applied)"
        if self.ceiling:
            head += f"; {self.ceiling}"
        return f"{head}: {per_node}"


def place(
    snapshot: Snapshot,
    request: PlacementRequest,
    *,
    policy: str | Policy = "gpuportal",
    rng: random.Random | None = None,
) -> Placement | CantAccommodate:
    """Decide where `request`'s replica goes. Pure: the snapshot is not changed.

    Raises ValueError when `request.replica_id` is held by another deployment, or by a replica
    that is not running and not listed in `request.cached` (a caller bug, not a placement).
    """
    chosen_policy = POLICIES[policy] if isinstance(policy, str) else policy
    rng = rng if rng is not None else random.Random()
    index = snapshot.index
    deployed = _already_deployed(request, index.holdings.get(request.replica_id, ()))
    if deployed is not None:
        return deployed
    by_node, reasons = index.usable, dict(index.unusable)
    candidates = _candidates(snapshot.taken_at, request, chosen_policy, by_node, reasons, index.holdings)
    # Evictions are only looked for when no node has room without them: every level that
    # needs one (CACHED_AND_FULL, FULL) ranks below every level that does not. Each node is
    # only asked whether it can host (stopping at the first GPU that can); the full GPU search
    # runs on the chosen node alone, which keeps a placement over hundreds of nodes cheap.
    for allow_evictions in (False, True) if chosen_policy.evictions else (False,):
        found = _first_hosting(candidates, by_node, allow_evictions, rng, index.holdings)
        if found is not None:
            node, ticket = found
            option = _node_option(by_node[node], ticket, allow_evictions, rng)
            if not isinstance(option, _Option):
                raise AssertionError(f"node {node} said it could host, then could not: {option}")
            return _placement(index, node, ticket, option, _ticket_level(ticket, allow_evictions))
    for node, ticket in candidates:
        why = _node_option(by_node[node], ticket, chosen_policy.evictions, rng)
        reasons[node] = _join(reasons.get(node), str(why))
    return CantAccommodate(request.deployment, request.need_bytes, reasons)


def cached_replicas(snapshot: Snapshot, deployment: str) -> tuple[CachedReplica, ...]:
    """Sleeping replicas of `deployment` as the snapshot shows them (through their residual
    occupants), for callers that have no better list."""
    seen: dict[str, CachedReplica] = {}
    for gpu in snapshot.index.ordered:
        for o in gpu.occupants:
            if o.deployment == deployment and o.state == ReplicaState.SLEEPING:
                seen.setdefault(o.replica_id, CachedReplica(o.replica_id, gpu.node))
    return tuple(seen.values())


def gpu_fraction(reserved_bytes: int, total_bytes: int) -> float:
    """The cap handed to the replica process (seed 000): reserved / total in [0.01, 0.99]."""
    return min(MAX_FRACTION, max(MIN_FRACTION, reserved_bytes / total_bytes))


def is_evictable(occupant: OccupantView, request: PlacementRequest, policy: Policy, now: datetime) -> bool:
    return _protected_as(occupant, request, policy, now) is None


def protection(occupant: OccupantView, request: PlacementRequest, policy: Policy, now: datetime) -> str | None:
    """Why `occupant` may not be evicted to place `request`'s replica; None: it may be."""
    kind = _protected_as(occupant, request, policy, now)
    if kind != "young":
        return _PROTECTIONS.get(kind, kind) if kind is not None else None
    served = (now - occupant.serving_since).total_seconds() if occupant.serving_since is not None else 0.0
    left = math.ceil(occupant.min_runtime_s - served)
    return f"serving for less than its fairness.min_runtime_s ({occupant.min_runtime_s:g} s): {left} s more"


_PROTECTIONS = {
    "sibling": "of the same deployment",
    "dedicated": "dedicated",
    "popular": "popular (fairness.popular)",
}


def _protected_as(occupant: OccupantView, request: PlacementRequest, policy: Policy, now: datetime) -> str | None:
    """The rule, once: what protects `occupant` ("sibling", "dedicated", "popular", "young", or
    "still " and its state), None: nothing. A constant, not a sentence: placement asks it of every
    occupant it looks at, and `protection` words it only for a refusal."""
    # Evicting a sibling to place a sibling only churns; a sleeping one is promoted instead. First,
    # as the reason: a sibling may be one this very plan placed a moment ago, still pending.
    if occupant.deployment == request.deployment:
        return "sibling"
    # An eviction sends its victim to sleep: a replica still starting has nothing to put to sleep
    # yet (the state machine has no way from there to draining).
    if occupant.state in states.STARTING:
        return _STILL[occupant.state]
    if occupant.dedicated:
        return "dedicated"
    if policy.protect_fairness and occupant.popular:
        return "popular"
    if not _inside_min_runtime(occupant, now) or (not policy.protect_fairness and request.dedicated):
        return None
    return "young"


_STILL = {state: f"still {state}" for state in states.STARTING}


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --- the pieces ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ticket:
    """One way to satisfy the request: promote a cached replica (on its node), or create one (on
    any node). Nothing in it depends on the node, so one ticket for a new replica serves every
    node: a placement over hundreds of nodes builds a handful of tickets, not one per node."""

    replica_id: str
    promoted: bool
    residual: Mapping[int, int]  # the replica's own occupants: gpu id -> bytes
    request: PlacementRequest
    policy: Policy
    now: datetime

    def evictable(self, occupant: OccupantView) -> bool:
        return is_evictable(occupant, self.request, self.policy, self.now)

    def protection(self, occupant: OccupantView) -> str | None:
        return protection(occupant, self.request, self.policy, self.now)

    def others(self, gpu: GPUView) -> tuple[OccupantView, ...]:
        if gpu.id not in self.residual:
            return gpu.occupants
        return tuple(o for o in gpu.occupants if o.replica_id != self.replica_id)


@dataclass(frozen=True)
class _Option:
    """A concrete way to host the ticket's replica on some GPUs of its node."""

    gpus: tuple[GPUView, ...]
    bytes_by_gpu: Mapping[int, int]
    victims: tuple[OccupantView, ...]  # occupants of those GPUs that must go
    mode: Mode
    waste: int  # bytes of the chosen GPUs left unused after placement
    moves: bool = False  # a promoted replica leaves the GPU where it holds its residual

    @property
    def eviction_count(self) -> int:
        return len({v.replica_id for v in self.victims})


def _already_deployed(request: PlacementRequest, held: Holdings) -> Placement | None:
    if not held:
        return None
    gpu, occupant = held[0]
    if occupant.deployment != request.deployment:
        raise ValueError(f"replica {request.replica_id} belongs to {occupant.deployment}, not {request.deployment}")
    # On its GPUs or on its way there: a node holding it so has it DEPLOYED.
    if occupant.state not in states.ACTIVE:
        if any(c.replica_id == request.replica_id for c in request.cached):
            return None
        raise ValueError(
            f"replica {request.replica_id} holds GPU memory in state {occupant.state}; "
            "a new replica needs a fresh id, a sleeping one goes in `cached`"
        )
    bytes_by_gpu = {g.id: o.reserved_bytes for g, o in held}
    gpus = tuple(g for g, _ in held)
    return Placement(
        deployment=request.deployment,
        replica_id=request.replica_id,
        node=gpu.node,
        gpu_ids=tuple(bytes_by_gpu),
        bytes_by_gpu=bytes_by_gpu,
        fraction=_fraction(gpus, bytes_by_gpu),
        mode=_mode(gpus, bytes_by_gpu),
        level=CandidateLevel.DEPLOYED,
        reason=(
            f"replica {_short(request.replica_id)} of {request.deployment} already {occupant.state} "
            f"on {_labels(gpus)}: nothing to do"
        ),
    )


def _candidates(
    now: datetime,
    request: PlacementRequest,
    policy: Policy,
    by_node: Mapping[str, Sequence[GPUView]],
    reasons: dict[str, str],
    holdings: Mapping[str, Holdings],
) -> list[tuple[str, _Ticket]]:
    """(node, ticket) for every usable node, by node name: its cached replicas of the deployment,
    or else a new replica; `reasons` says why a node has neither."""
    cached_on: dict[str, list[CachedReplica]] = {}
    for c in request.cached:
        # Someone else may have woken it since the caller looked: then it is not cached.
        if all(o.state == ReplicaState.SLEEPING for _, o in holdings.get(c.replica_id, ())):
            cached_on.setdefault(c.node, []).append(c)
    # A request naming a cached replica is a wake of that replica: its id must not be reused
    # for a new replica elsewhere.
    can_create = request.allow_new and request.replica_id not in {c.replica_id for c in request.cached}
    common = {"request": request, "policy": policy, "now": now}
    new = _Ticket(replica_id=request.replica_id, promoted=False, residual={}, **common)
    candidates: list[tuple[str, _Ticket]] = []
    for node in sorted(by_node):
        if node in request.refused_nodes:
            reasons[node] = request.refused_nodes[node]
        elif node in cached_on:
            for c in cached_on[node]:
                residual = {g.id: o.reserved_bytes for g, o in holdings.get(c.replica_id, ())}
                candidates.append((node, _Ticket(replica_id=c.replica_id, promoted=True, residual=residual, **common)))
        elif can_create and node in request.host_refused:
            reasons[node] = request.host_refused[node]
        elif can_create:
            candidates.append((node, new))
        else:
            reasons[node] = f"no cached replica of {request.deployment} here, and no new one was asked for"
    return candidates


def _node_option(gpus: Sequence[GPUView], ticket: _Ticket, allow_evictions: bool, rng: random.Random) -> _Option | str:
    """The seed-000 tree for one node: one GPU if the need fits one, else (or failing that)
    the fewest whole GPUs. Refused, the reason names who holds the node's GPUs and may not be
    evicted, and why: what an operator waits for, or changes, to make room."""
    option = _node_tree(gpus, ticket, allow_evictions, rng)
    if isinstance(option, str) and allow_evictions and (held := _protected(gpus, ticket)):
        return f"{option}; {held}"
    return option


# How many of the replicas that may not be evicted a refusal names, per node.
PROTECTED_NAMED = 3


def _protected(gpus: Sequence[GPUView], ticket: _Ticket) -> str:
    """E.g. "not evictable: chat 214c38b8 on box/0 (dedicated)", the GPUs' order; "" if none."""
    held: dict[str, tuple[OccupantView, str, list[int]]] = {}
    for g in sorted(gpus, key=lambda g: g.index):
        for o in ticket.others(g):
            if o.replica_id in held:
                held[o.replica_id][2].append(g.index)
            elif (why := ticket.protection(o)) is not None:
                held[o.replica_id] = (o, why, [g.index])
    if not held:
        return ""
    node = gpus[0].node
    # The deployment's own replicas last: a refusal of replica 4 of 4 that named only the 3 placed
    # before it said nothing of the others', whose protection an operator may wait out or change.
    ordered = sorted(held.values(), key=lambda entry: entry[0].deployment == ticket.request.deployment)
    named = [
        f"{o.deployment} {o.replica_id[:8]} on {node}/{'+'.join(map(str, indexes))} ({why})"
        for o, why, indexes in ordered[:PROTECTED_NAMED]
    ]
    more = f" and {len(held) - PROTECTED_NAMED} more" if len(held) > PROTECTED_NAMED else ""
    return f"not evictable: {', '.join(named)}{more}"


def _node_tree(gpus: Sequence[GPUView], ticket: _Ticket, allow_evictions: bool, rng: random.Random) -> _Option | str:
    need, span = ticket.request.need_bytes, ticket.request.gpus
    single_reason = None
    if span == 1 or (span is None and need <= max(g.total_bytes for g in gpus)):
        single = _single_gpu(gpus, ticket, allow_evictions, rng)
        if isinstance(single, _Option) or span == 1:
            return single
        single_reason = single
    multi = _multi_gpu(gpus, ticket, span, allow_evictions, rng)
    if isinstance(multi, _Option) or single_reason is None:
        return multi
    return f"{single_reason}; split over whole GPUs: {multi}"


def _first_hosting(
    candidates: list[tuple[str, _Ticket]],
    by_node: Mapping[str, Sequence[GPUView]],
    allow_evictions: bool,
    rng: random.Random,
    holdings: Mapping[str, Holdings],
) -> tuple[str, _Ticket] | None:
    """A (node, ticket) chosen uniformly at random among those that can host at the best level.

    Level by level, best first: the first hosting candidate of a random order is a uniform
    choice among the hosting ones, found after asking a few nodes rather than all of them
    (placement runs on every decision, over hundreds of nodes).
    """
    by_level: dict[CandidateLevel, list[tuple[str, _Ticket]]] = {}
    levels: dict[int, CandidateLevel] = {}  # by ticket: the new replica's is shared by every node
    for candidate in candidates:
        ticket = candidate[1]
        level = levels.get(id(ticket))
        if level is None:
            level = levels[id(ticket)] = _ticket_level(ticket, allow_evictions)
        by_level.setdefault(level, []).append(candidate)
    for level in sorted(by_level):
        group = by_level[level]
        order = rng.sample(group, len(group)) if len(group) > 1 else group
        if len(order) > 1 and order[0][1].request.spread:
            # A stable sort of the random order: the nodes with the fewest siblings first, ties
            # still at random.
            siblings = _siblings_by_node(holdings, order[0][1], by_node)
            order = sorted(order, key=lambda c: siblings[c[0]])
        if len(order) > 1 and (avoided := order[0][1].request.avoided_nodes):
            # Stable again: the nodes it prefers not to go to, last; otherwise as chosen above.
            order = sorted(order, key=lambda c: c[0] in avoided)
        for node, ticket in order:
            if _can_host(by_node[node], ticket, allow_evictions):
                return node, ticket
    return None


def _can_host(gpus: Sequence[GPUView], ticket: _Ticket, allow_evictions: bool) -> bool:
    """Whether `_node_option` would find an option: the same tree, stopping at the first."""
    need, span = ticket.request.need_bytes, ticket.request.gpus
    if span == 1 or (span is None and need <= max(g.total_bytes for g in gpus)):
        fits = _on_gpu if allow_evictions else _fits_as_is
        if any(fits(g, ticket, allow_evictions) for g in gpus):
            return True
        if span == 1:
            return False
    return _whole_gpus_reachable(_whole_eligible(gpus, ticket, allow_evictions), need, span)


def _fits_as_is(gpu: GPUView, ticket: _Ticket, allow_evictions: bool = False) -> bool:
    """`_on_gpu(gpu, ticket, False) is not None`, without building the option: asked of every
    GPU of every node on each placement, so it must be cheap. Free memory is what `_on_gpu`
    computes: available plus the replica's own residual (all else the GPU holds is others')."""
    need, total = ticket.request.need_bytes, gpu.total_bytes
    if need > total:
        return False
    if need >= ticket.policy.whole_gpu_from * total:
        return not ticket.others(gpu)
    return gpu.available_bytes + ticket.residual.get(gpu.id, 0) >= need


def _single_gpu(gpus: Sequence[GPUView], ticket: _Ticket, allow_evictions: bool, rng: random.Random) -> _Option | str:
    options = [o for g in gpus if (o := _on_gpu(g, ticket, allow_evictions)) is not None]
    if options:
        return _pick(_best(options, lambda o: _gpu_key(o, ticket)), rng)
    return _single_gpu_reason(gpus, ticket)


def _gpu_key(option: _Option, ticket: _Ticket) -> tuple[int, ...]:
    if ticket.request.spread:
        # Evictions first as always; then away from its siblings, then the emptiest GPU.
        siblings = sum(_siblings(g, ticket) for g in option.gpus)
        return (option.eviction_count, siblings, int(option.moves), -option.waste)
    if not ticket.policy.best_fit:
        return (option.eviction_count,)
    # Staying on the GPU where a promoted replica already holds its CUDA context avoids a
    # second context; then best fit.
    return (option.eviction_count, int(option.moves), option.waste)


def _siblings_by_node(
    holdings: Mapping[str, Holdings], ticket: _Ticket, by_node: Mapping[str, Sequence[GPUView]]
) -> Counter[str]:
    """`_siblings` summed over each node's usable GPUs, for every node in one pass over the
    replicas the snapshot holds: asked of every GPU of a fleet of a thousand nodes, it was most of
    a spread placement's time."""
    counts: Counter[str] = Counter()
    usable: set[int] | None = None
    for replica_id, held in holdings.items():
        if replica_id == ticket.replica_id:
            continue
        for gpu, occupant in held:
            if occupant.deployment != ticket.request.deployment:
                continue
            if usable is None:  # built only once a sibling is found: most placements have none
                usable = {g.id for gpus in by_node.values() for g in gpus}
            if gpu.id in usable:
                counts[gpu.node] += 1
    return counts


def _siblings(gpu: GPUView, ticket: _Ticket) -> int:
    """Replicas of the ticket's deployment on `gpu`, other than the ticket's own."""
    return sum(1 for o in ticket.others(gpu) if o.deployment == ticket.request.deployment)


def _on_gpu(gpu: GPUView, ticket: _Ticket, allow_evictions: bool) -> _Option | None:
    need = ticket.request.need_bytes
    if need > gpu.total_bytes:
        return None
    others = ticket.others(gpu)
    moves = bool(ticket.residual) and gpu.id not in ticket.residual
    if need >= ticket.policy.whole_gpu_from * gpu.total_bytes:
        victims = _make_whole(others, ticket, allow_evictions)
        if victims is None:
            return None
        return _Option((gpu,), {gpu.id: gpu.total_bytes}, victims, Mode.WHOLE, gpu.total_bytes - need, moves)
    # The replica's own residual is replaced by its reservation, so it counts as free here.
    free = min(
        gpu.available_bytes + ticket.residual.get(gpu.id, 0),
        gpu.total_bytes - sum(o.reserved_bytes for o in others),
    )
    if free >= need:
        victims: tuple[OccupantView, ...] | None = ()
    elif allow_evictions:
        victims = _victims(others, need - free, ticket)
    else:
        victims = None
    if victims is None:
        return None
    freed = sum(v.reserved_bytes for v in victims)
    return _Option((gpu,), {gpu.id: need}, victims, Mode.FRACTIONAL, free + freed - need, moves)


def _make_whole(
    others: tuple[OccupantView, ...], ticket: _Ticket, allow_evictions: bool
) -> tuple[OccupantView, ...] | None:
    """Everyone else on the GPU, if they may all go; a 0-byte sleeper counts as an occupant."""
    if not others:
        return ()
    if allow_evictions and all(ticket.evictable(o) for o in others):
        return others
    return None


def _victims(others: Iterable[OccupantView], deficit: int, ticket: _Ticket) -> tuple[OccupantView, ...] | None:
    # Occupants holding nothing here free nothing by leaving.
    pool = sorted((o for o in others if o.reserved_bytes > 0 and ticket.evictable(o)), key=_victim_order)
    if sum(o.reserved_bytes for o in pool) < deficit:
        return None
    if ticket.policy.victims == "smallest_first":
        chosen: list[OccupantView] = []
        for o in pool:
            chosen.append(o)
            if sum(c.reserved_bytes for c in chosen) >= deficit:
                break
        return tuple(chosen)
    return _fewest_reaching(pool, deficit, size=lambda o: o.reserved_bytes, prefer=_victim_order)


def _victim_order(o: OccupantView) -> tuple[bool, int, str]:
    # A sleeper first: it serves no one, and evicted it sleeps deeply, which costs only its next
    # wake a process's start (scheduling.services.deep_sleep); then the smallest.
    return (o.state != ReplicaState.SLEEPING, o.reserved_bytes, o.replica_id)


def _fewest_reaching(
    items: Sequence[T], target: int, *, size: Callable[[T], int], prefer: Callable[[T], object]
) -> tuple[T, ...] | None:
    """The fewest items whose sizes sum to at least `target`; among sets of that count, a
    cheap greedy that fills each slot with the most preferred item that still lets the
    remaining slots reach the target (so a small tenant goes rather than a big one)."""
    ranked = sorted(items, key=size, reverse=True)
    total, count = 0, None
    for i, item in enumerate(ranked):
        total += size(item)
        if total >= target:
            count = i + 1
            break
    if count is None:
        return None
    chosen: list[T] = []
    remaining, left = ranked, target
    for slots in range(count, 0, -1):
        pick = min((c for c in remaining if _still_reaches(remaining, c, slots, left, size)), key=prefer)
        chosen.append(pick)
        remaining = [r for r in remaining if r is not pick]
        left -= size(pick)
    return tuple(chosen)


def _still_reaches(remaining: list[T], candidate: T, slots: int, left: int, size: Callable[[T], int]) -> bool:
    # `remaining` is sorted by size, largest first; the best the other slots can add is the
    # largest slots-1 items other than the candidate.
    best_rest = sum(size(r) for r in [r for r in remaining if r is not candidate][: slots - 1])
    return size(candidate) + best_rest >= left


def _multi_gpu(
    gpus: Sequence[GPUView], ticket: _Ticket, span: int | None, allow_evictions: bool, rng: random.Random
) -> _Option | str:
    need = ticket.request.need_bytes
    capacity = sum(g.total_bytes for g in gpus)
    if need > capacity and span is None:
        return f"needs {fmt_bytes(need)}, more than the node's {len(gpus)} GPU(s) hold ({fmt_bytes(capacity)})"
    if span is not None and span > len(gpus):
        return f"needs {span} GPUs, the node has {len(gpus)} healthy"
    eligible = _whole_eligible(gpus, ticket, allow_evictions)
    order = {g.id: rank for rank, g in enumerate(rng.sample(gpus, len(gpus)))}

    def prefer(item: tuple[GPUView, tuple[OccupantView, ...]]) -> tuple[int, int, int]:
        g, victims = item
        fit = g.total_bytes if ticket.policy.best_fit else 0
        return (len({v.replica_id for v in victims}), fit, order[g.id])

    chosen = _whole_gpus(eligible, need, span, prefer)
    if chosen is None:
        how = "empty" if not allow_evictions else "empty or emptied by evicting non-protected replicas"
        count = f"{span} GPUs" if span else "whole GPUs"
        return f"needs {count} for {fmt_bytes(need)}; only {len(eligible)} of {len(gpus)} can be had {how}"
    picked = tuple(sorted((g for g, _ in chosen), key=lambda g: g.index))
    victims = tuple(v for _, vs in chosen for v in vs)
    bytes_by_gpu = {g.id: g.total_bytes for g in picked}
    mode = Mode.MULTI if len(picked) > 1 else Mode.WHOLE
    moves = bool(ticket.residual) and not (set(ticket.residual) & set(bytes_by_gpu))
    return _Option(picked, bytes_by_gpu, victims, mode, sum(bytes_by_gpu.values()) - need, moves)


def _whole_eligible(
    gpus: Sequence[GPUView], ticket: _Ticket, allow_evictions: bool
) -> list[tuple[GPUView, tuple[OccupantView, ...]]]:
    """GPUs that are whole, or can be made whole, each with who must leave it."""
    eligible = []
    for g in gpus:
        victims = _make_whole(ticket.others(g), ticket, allow_evictions)
        if victims is not None:
            eligible.append((g, victims))
    return eligible


def _whole_gpus_reachable(
    eligible: list[tuple[GPUView, tuple[OccupantView, ...]]], need: int, span: int | None
) -> bool:
    sizes = sorted((g.total_bytes for g, _ in eligible), reverse=True)
    if span is None:
        return sum(sizes) >= need
    return len(sizes) >= span and sum(sizes[:span]) >= need


def _whole_gpus(
    eligible: list[tuple[GPUView, tuple[OccupantView, ...]]],
    need: int,
    span: int | None,
    prefer: Callable[[tuple[GPUView, tuple[OccupantView, ...]]], object],
) -> tuple[tuple[GPUView, tuple[OccupantView, ...]], ...] | None:
    def size(item: tuple[GPUView, tuple[OccupantView, ...]]) -> int:
        return item[0].total_bytes

    if not _whole_gpus_reachable(eligible, need, span):
        return None
    if span is None:
        return _fewest_reaching(eligible, need, size=size, prefer=prefer)
    # A fixed count: fill each slot with the most preferred GPU that keeps the need reachable.
    chosen: list[tuple[GPUView, tuple[OccupantView, ...]]] = []
    remaining, left = sorted(eligible, key=size, reverse=True), need
    for slots in range(span, 0, -1):
        pick = min((c for c in remaining if _still_reaches(remaining, c, slots, left, size)), key=prefer)
        chosen.append(pick)
        remaining = [r for r in remaining if r is not pick]
        left -= size(pick)
    return tuple(chosen)


def _single_gpu_reason(gpus: Sequence[GPUView], ticket: _Ticket) -> str:
    need = ticket.request.need_bytes
    fitting = [g for g in gpus if g.total_bytes >= need]
    if not fitting:
        return f"needs {fmt_bytes(need)}, more than any GPU holds"
    whole = [g for g in fitting if need >= ticket.policy.whole_gpu_from * g.total_bytes]
    if whole and len(whole) == len(fitting):
        return (
            f"needs a whole GPU ({fmt_bytes(need)} is at least {ticket.policy.whole_gpu_from:.0%} of one) "
            "and every GPU holds a replica that cannot be evicted"
        )
    most_free = max(fitting, key=lambda g: g.available_bytes)
    return (
        f"no GPU has {fmt_bytes(need)} free, nor can free it by evicting replicas that may be evicted "
        "(protected: dedicated, of the same deployment, and under gpuportal popular or inside min_runtime); "
        f"most free: {fmt_bytes(most_free.available_bytes)} on {most_free.label}"
    )


def _inside_min_runtime(occupant: OccupantView, now: datetime) -> bool:
    if occupant.min_runtime_s <= 0:
        return False
    # Not yet past min_runtime whatever serving_since says: evicting it throws away a load.
    if occupant.state in states.STARTING:
        return True
    if occupant.state != ReplicaState.SERVING or occupant.serving_since is None:
        return False
    return (now - occupant.serving_since).total_seconds() < occupant.min_runtime_s


def _ticket_level(ticket: _Ticket, evicting: bool) -> CandidateLevel:
    if evicting:
        return CandidateLevel.CACHED_AND_FULL if ticket.promoted else CandidateLevel.FULL
    return CandidateLevel.CACHED_AND_FREE if ticket.promoted else CandidateLevel.FREE


def _best(items: list[T], key: Callable[[T], tuple[int, ...]]) -> list[T]:
    best = min(key(i) for i in items)
    return [i for i in items if key(i) == best]


def _pick(ties: list[T], rng: random.Random) -> T:
    # No draw for a single candidate, so unrelated ties elsewhere do not shift the rng.
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def _placement(index: SnapshotIndex, node: str, ticket: _Ticket, option: _Option, level: CandidateLevel) -> Placement:
    evictions = _evictions(index, option.victims)
    dropped = tuple(
        gpu_id for gpu_id, held in sorted(ticket.residual.items()) if held == 0 and gpu_id not in option.bytes_by_gpu
    )
    placement = Placement(
        deployment=ticket.request.deployment,
        replica_id=ticket.replica_id,
        node=node,
        gpu_ids=tuple(g.id for g in option.gpus),
        bytes_by_gpu=dict(option.bytes_by_gpu),
        fraction=_fraction(option.gpus, option.bytes_by_gpu),
        mode=option.mode,
        level=level,
        evictions=evictions,
        promoted=ticket.replica_id if ticket.promoted else None,
        dropped_residuals=dropped,
    )
    return _with_reason(placement, option, ticket.policy, ticket.request.avoided_nodes.get(node))


def _evictions(index: SnapshotIndex, victims: tuple[OccupantView, ...]) -> tuple[Eviction, ...]:
    """Every occupant of every victim: a replica spread over several GPUs cannot keep running
    on some of them, so it leaves all of them (each GPU gets back only what it held there)."""
    if not victims:
        return ()
    ids = list(dict.fromkeys(v.replica_id for v in victims))
    return tuple(Eviction(r, g.id, o.reserved_bytes) for r in ids for g, o in index.holdings[r])


def _fraction(gpus: Sequence[GPUView], bytes_by_gpu: Mapping[int, int]) -> float | None:
    if len(gpus) != 1:
        return None
    # Of the whole GPU, other tenants' share included: the allocator's cap is a share of it all.
    return gpu_fraction(bytes_by_gpu[gpus[0].id], gpus[0].total_bytes + gpus[0].foreign_bytes)


def _mode(gpus: Sequence[GPUView], bytes_by_gpu: Mapping[int, int]) -> Mode:
    if len(gpus) > 1:
        return Mode.MULTI
    return Mode.WHOLE if bytes_by_gpu[gpus[0].id] >= gpus[0].total_bytes else Mode.FRACTIONAL


def _with_reason(placement: Placement, option: _Option, policy: Policy, avoided: str | None = None) -> Placement:
    who = (
        f"cached replica {_short(placement.replica_id)}"
        if placement.promoted
        else f"new replica {_short(placement.replica_id)}"
    )
    where = _labels(option.gpus)
    if option.mode is Mode.FRACTIONAL:
        (gpu,) = option.gpus
        size = f"{fmt_bytes(placement.bytes_by_gpu[gpu.id])} of {fmt_bytes(gpu.total_bytes)}"
        what = f"{size}, fraction {placement.fraction:.2f}"
    elif option.mode is Mode.WHOLE:
        what = "the whole GPU"
    else:
        what = f"{len(option.gpus)} whole GPUs"
    fit = "best fit" if policy.best_fit else "random fit"
    body = f"{who} of {placement.deployment} on {where} ({what}); {placement.level.name}, {fit}, policy {policy.name}"
    if avoided and not placement.promoted:
        # A sleeper wakes where its weights are: no choice of node to explain.
        body += f"; node {placement.node} is a last choice: {avoided}"
    if not placement.evictions:
        verb = "woke" if placement.promoted else "placed"
        return _replace_reason(placement, f"{verb} {body}")
    order = "fewest evictions" if policy.victims == "fewest" else "fewest evictions, smallest tenants first"
    evicted = ", ".join(_short(r) for r in placement.evicted_replicas)
    reason = f"evicted {evicted} to fit {placement.deployment} on {where}: {order}; {body}"
    return _replace_reason(placement, reason)


def _replace_reason(placement: Placement, reason: str) -> Placement:
    return replace(placement, reason=reason)


def _labels(gpus: Iterable[GPUView]) -> str:
    labels = [g.label for g in gpus]
    return ("gpu " if len(labels) == 1 else "gpus ") + ", ".join(labels)


def _short(replica_id: str) -> str:
    return replica_id[:8]


def _join(first: str | None, second: str) -> str:
    if first is None or first == second:
        return second
    return f"{first}; {second}"


__all__ = [
    "GPUPORTAL",
    "MAX_FRACTION",
    "MIN_FRACTION",
    "NDIF",
    "POLICIES",
    "CachedReplica",
    "CandidateLevel",
    "CantAccommodate",
    "Eviction",
    "Mode",
    "Placement",
    "PlacementRequest",
    "Policy",
    "cached_replicas",
    "fmt_bytes",
    "gpu_fraction",
    "is_evictable",
    "place",
    "protection",
]
