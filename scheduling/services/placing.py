"""Placing and stopping a deployment's replicas: the decisions a deploy, a scale, a wake and a
preemption share (snapshot → plan → commit, the rows, Events and commands it writes).

Lock order, the same everywhere (scheduling.locks): the deployment row, then GPU rows in
primary-key order (the ledger), then replica rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from django.conf import settings
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from gpuportal.wire import memory, node_labels, states
from gpuportal.wire.states import COUNTED
from scheduling import hot_sql, ledger
from scheduling.core import effects, host_memory, settling
from scheduling.core.host_memory import HostView
from scheduling.core.placement import POLICIES, CachedReplica, CantAccommodate, Placement, PlacementRequest, Policy
from scheduling.core.planning import apply_placement, place_all, plan_of, room_at, withhold_locked
from scheduling.core.state import GPUView, OccupantView, Plan, Release, Snapshot
from scheduling.models import GPU, Deployment, Event, Node, Replica, new_replica_id
from scheduling.services import deep_sleep, failover, outbox, replica_specs
from scheduling.services import replicas as replica_services
from scheduling.services.errors import CannotPlace
from scheduling.services.replica_specs import contexts_of

# A failover pair counts once while any member lives: between its active member's death and its
# standby's takeover report, the standby is the pair (a reconcile in that window must not place
# a second pair).
PLAIN_COUNTED = Q(lease__isnull=True, state__in=COUNTED)
PAIR_LIVE = Q(lease__isnull=False, state__in=(*COUNTED, Replica.State.STANDBY))


@dataclass
class Decision:
    """What the last planning attempt decided, for the effects after the commit."""

    placements: tuple[Placement, ...] = ()
    new_ids: list[str] = field(default_factory=list)
    # The rows this call creates for them, written by the commit's apply: no other transaction
    # sees them before it commits, so nothing need read them back.
    created: dict[str, Replica] = field(default_factory=dict)
    # The GPUs the plan was made on: the commit's compare-and-swap found the ones it writes
    # unchanged, so their node, index and contexts are the books' own.
    gpus: dict[int, GPUView] = field(default_factory=dict)


def releasing(replica_ids: Collection[str], reason: str) -> Callable[[Snapshot], Plan | None]:
    """A decision releasing every reservation the replicas hold, or None when they hold none."""

    def decide(snap: Snapshot) -> Plan | None:
        releases = releases_of(replica_ids, snap)
        return Plan.against(snap, reason, releases=releases) if releases else None

    return decide


def releases_of(replica_ids: Iterable[str], snap: Snapshot) -> list[Release]:
    """A release of each reservation the replicas hold, in GPU order."""
    holdings = snap.index.holdings  # where each replica holds memory, without a walk of every GPU
    return sorted(
        (Release(gpu.id, replica_id) for replica_id in replica_ids for gpu, _ in holdings.get(replica_id, ())),
        key=lambda r: (r.gpu_id, r.replica_id),
    )


def need_bytes(deployment: Deployment, snapshot: Snapshot) -> memory.Need:
    """The bytes one replica of the deployment reserves: its need under the deployment's policy
    (gpuportal.wire.memory's footprint) with a CUDA context, plus, in a failover pair, the context its
    sleeping standby keeps beside it. Contexts are the GPUs' own (measured per node and model, or
    the virtual GPU's), the largest among the snapshot's GPUs, so the need fits wherever it goes."""
    return need_with(deployment, snapshot.index.contexts)


def need_with(deployment: Deployment, contexts: tuple[int, int]) -> memory.Need:
    """`need_bytes` on GPUs of these (CUDA context, standby context) bytes."""
    observed = deployment.observed
    need = memory.need_for(
        deployment.memory_policy,
        memory.NeedInputs(
            weight_bytes=observed.weight_bytes,
            estimate_bytes=observed.memory_estimate_bytes,
            override_bytes=deployment.memory_override_bytes,
            measured_bytes=observed.memory_measured_bytes,
        ),
    )
    context, standby_context = contexts
    # A measured need is the replica's own footprint, its context included (as it was measured:
    # the GPUs' context may have grown since); others have none.
    if need.source == "measured":
        grown = memory.with_grown_context(need.bytes, observed.memory_measured_context_bytes, context)
        need = replace(need, bytes=grown)
    else:
        need = replace(need, bytes=need.bytes + context)
    if deployment.failover_standby:
        need = replace(need, bytes=need.bytes + standby_context)
    return need


def host_views() -> dict[str, HostView]:
    """Each node's host RAM as placement counts it, for the nodes whose agents reported theirs:
    its host cache's budget, its replicas' processes (as measured, or the default for one not
    measured yet) and its warm spares' (the default each). Three queries for any number of nodes."""
    nodes = Node.objects.filter(host_ram_bytes__gt=0).values_list("pk", "name", "host_ram_bytes", "cpu_cache_bytes")
    processes = {
        row["node_id"]: row
        for row in Replica.objects.filter(state__in=states.WITH_PROCESS, node__isnull=False, node__host_ram_bytes__gt=0)
        .values("node_id")
        .annotate(measured=Sum("host_bytes"), count=Count("pk"), unmeasured=Count("pk", filter=Q(host_bytes=0)))
    }
    # A GPU whose spare slot is booked has a spare process (warm, warming, or the next one after a take).
    spares = dict(
        GPU.objects.filter(spare_bytes__gt=0, node__host_ram_bytes__gt=0)
        .values("node_id")
        .annotate(count=Count("pk"))
        .values_list("node_id", "count")
    )
    default = settings.GPUPORTAL_REPLICA_HOST_BYTES
    views = {}
    for pk, name, ram, cache in nodes:
        found = processes.get(pk, {"measured": 0, "count": 0, "unmeasured": 0})
        held = int(found["measured"] or 0) + found["unmeasured"] * default
        kept = spares.get(pk, 0)
        views[name] = HostView(name, ram, cache, held, found["count"], spare_bytes=kept * default, spares=kept)
    return views


def host_need_bytes(deployment: Deployment) -> int:
    """The host RAM a new replica's process of the deployment is counted to take (`process_need`)."""
    return process_need(deployment.replicas.aggregate(most=Max("host_bytes"))["most"])


def process_need(most_measured: int | None) -> int:
    """The most host RAM one of a deployment's processes was measured holding, else the default."""
    return int(most_measured) if most_measured else settings.GPUPORTAL_REPLICA_HOST_BYTES


def host_refusals(deployment: Deployment) -> dict[str, str]:
    """{node: why} of the nodes whose host RAM has no room for a new replica's process of the
    deployment (scheduling.core.host_memory)."""
    return host_memory.refusals(host_views(), host_need_bytes(deployment))


def node_marks(*, labels: bool) -> dict[str, node_labels.Marks]:
    """The nodes' labels and taints, as `node_refusals` reads them: one query for any number.
    Without `labels` (no node selector to match), only the tainted nodes, their labels unread:
    most fleets taint none, and then this reads no row."""
    if not labels:
        tainted = Node.objects.exclude(taints={}).values_list("name", "taints")
        return {name: ({}, taints) for name, taints in tainted}
    rows = Node.objects.values_list("name", "labels", "taints")
    return {name: (labels or {}, taints or {}) for name, labels, taints in rows}


def node_refusals(deployment: Deployment, marks: dict[str, node_labels.Marks] | None = None) -> dict[str, str]:
    """{node: why} of the nodes whose labels its `placement.node_selector` does not match, or
    whose NoSchedule or NoExecute taints its `placement.tolerations` do not name
    (gpuportal.wire.node_labels): placement neither starts nor wakes a replica of it there.
    `marks`: `node_marks`, read here unless the caller read them (a batch reads them once for all
    its asks, with the labels where any of them has a node selector)."""
    return node_fit(deployment, marks)[0]


def node_fit(
    deployment: Deployment, marks: dict[str, node_labels.Marks] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(`node_refusals`, the nodes placement puts it on last: {node: why} of those whose
    PreferNoSchedule taints its tolerations do not name), from one read of the nodes' marks."""
    if marks is None:
        marks = node_marks(labels=bool(deployment.placement_node_selector))
    return (
        node_labels.refusals(
            marks, deployment.name, deployment.placement_node_selector, deployment.placement_tolerations
        ),
        node_labels.avoidances(marks, deployment.name, deployment.placement_tolerations),
    )


def gpu_contexts(gpu_ids: Iterable[int]) -> tuple[int, int]:
    """(serving context, standby context) in bytes: the largest of these GPUs'."""
    return contexts_of(GPU.objects.filter(pk__in=list(gpu_ids)))


def cached_of(deployment: Deployment) -> tuple[CachedReplica, ...]:
    """The deployment's sleeping replicas, deep asleep or not, each on the node whose RAM holds
    its weights: the replicas placement promotes before it creates new ones."""
    return tuple(
        CachedReplica(replica_id, node)
        for replica_id, node in deployment.replicas.filter(state__in=states.ASLEEP, node__isnull=False).values_list(
            "id", "node__name"
        )
    )


@dataclass
class Ask:
    """One deployment's share of a placement decision: `count` more replicas, all or none,
    promoting its sleeping ones first. Several asks (a batch of scale calls) place one after
    another on one snapshot and commit as one plan; `add_replicas` commits one alone."""

    deployment: Deployment
    reason: str
    cached: tuple[CachedReplica, ...]
    allow_new: bool
    policy: str | Policy
    decision: Decision
    plan_reason: str = ""
    # Each node's host RAM, and what a new replica's process takes of it: read once per ask, and
    # only when it may start a process (a wake of a sleeper starts none).
    hosts: dict[str, HostView] = field(default_factory=dict)
    host_need: int = 0
    # The nodes its node selector or its tolerations keep it off, and those it goes to last
    # (`node_fit`), read once per ask.
    refused: dict[str, str] = field(default_factory=dict)
    avoided: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        deployment: Deployment,
        count: int,
        *,
        reason: str,
        cached: tuple[CachedReplica, ...],
        allow_new: bool = True,
        evictions: bool = True,
        new_ids: list[str] | None = None,
        hosts: dict[str, HostView] | None = None,
        host_need: int | None = None,
        marks: dict[str, node_labels.Marks] | None = None,
    ) -> Ask:
        """`hosts`, `host_need` and `marks` (`host_views`, `host_need_bytes`, `node_marks`): read
        here unless the caller read them (a batch reads the hosts and marks once for all its asks)."""
        # Placement needs an id per request even when it may only promote; those ids never get rows.
        decision = Decision(new_ids=list(new_ids) if new_ids is not None else [new_replica_id() for _ in range(count)])
        if allow_new and new_ids is None:
            # Rows written by the commit's apply, placed, and only for the ids placement used (a
            # promotion can make one unneeded). The occupants the ledger writes first point at them
            # before they exist: the foreign key is checked at commit.
            decision.created = {i: Replica(id=i, deployment=deployment) for i in decision.new_ids}
        policy: str | Policy = deployment.memory_policy
        if not evictions:
            policy = replace(POLICIES[deployment.memory_policy], evictions=False)
        refused, avoided = node_fit(deployment, marks)
        ask = cls(deployment, reason, cached, allow_new, policy, decision, refused=refused, avoided=avoided)
        if allow_new:
            ask.hosts = host_views() if hosts is None else hosts
            ask.host_need = host_need_bytes(deployment) if host_need is None else host_need
        return ask

    def place(self, current: Snapshot, now: datetime) -> Snapshot:
        """Its placements on `current` (the snapshot as the asks placed before it left it), kept in
        its decision; the snapshot after them. CannotPlace if they do not all fit."""
        deployment, decision = self.deployment, self.decision
        need = need_bytes(deployment, current)
        mine = [*decision.new_ids, *(c.replica_id for c in self.cached)]
        view, withheld = withhold_locked(current, mine, now)
        requests = placement_requests(
            deployment,
            decision.new_ids,
            need.bytes,
            self.cached,
            allow_new=self.allow_new,
            refused=self.refused,
            avoided=self.avoided,
        )
        result = place_all(
            view,
            requests,
            occupant_for=lambda placement: _occupant_for(deployment, placement),
            reason=f"{self.reason} ({need})",
            policy=self.policy,
            hosts=self.hosts,
            host_need_bytes=self.host_need,
        )
        if isinstance(result, CantAccommodate):
            decision.placements = ()

            def retry_after() -> int | None:
                at = room_at(
                    view,
                    requests,
                    occupant_for=lambda placement: _occupant_for(deployment, placement),
                    policy=self.policy,
                    hosts=self.hosts,
                    host_need_bytes=self.host_need,
                )
                return settling.seconds_until(view.taken_at, at) if at is not None else None

            if withheld:
                locked = ", ".join(withheld)
                reasons = {**result.reasons, **{label: "another wake holds its wake lock" for label in withheld}}
                why = f"{result.reason} (not counting {locked}: another wake holds its lock)"
                raise CannotPlace(why, reasons, retry_after=retry_after)
            raise CannotPlace(result.reason, result.reasons, retry_after=retry_after)
        decision.placements = result.placements
        decision.gpus = current.gpus
        self.plan_reason = result.plan.reason
        if not withheld:
            return result.after
        for placement in result.placements:  # placed on a view without the withheld GPUs
            current = apply_placement(current, placement, _occupant_for(deployment, placement))
        return current

    @property
    def loaded(self) -> int:
        """How many of its placements load from disk rather than promote a sleeping replica."""
        return sum(1 for p in self.decision.placements if p.promoted is None)


def add_replicas(
    deployment: Deployment,
    count: int,
    *,
    reason: str,
    cached: tuple[CachedReplica, ...] | None = None,
    allow_new: bool = True,
    evictions: bool = True,
    new_ids: list[str] | None = None,
    parked: bool = True,
    wake: bool = False,
) -> Decision:
    """Place `count` more replicas as one all-or-nothing decision, promoting sleeping ones first.

    `cached` narrows the sleeping replicas that may be promoted (default: all of the
    deployment's); `allow_new=False` only promotes, which is how one named replica is woken.
    `evictions=False` uses only free memory (the fair wake path: victims are fairness.py's
    call, not placement's). `new_ids` are rows the caller already created (a waker that held a
    wake lock under that id); they are kept even if unused. `parked=False`: the caller knows the
    deployment has no parked replica (none to retire for a new load). `wake=True`: the loads are
    a wake's, which counted only the awake, so each replaces a sleeper it could not wake: one on a
    drained node is retired as well (retire_replaced). A top-up's loads, which count the sleepers,
    are not. The caller holds the deployment row lock.
    """
    ask = Ask.of(
        deployment,
        count,
        reason=reason,
        cached=cached_of(deployment) if cached is None else cached,
        allow_new=allow_new,
        evictions=evictions,
        new_ids=new_ids,
    )

    def decide(snap: Snapshot) -> Plan:
        ask.place(snap, timezone.now())
        return plan_of(snap, ask.decision.placements, (), ask.plan_reason)

    ledger.commit_with_retry(decide, apply=lambda plan: apply_placements([ask]))
    if parked:
        retire_replaced(deployment, ask.loaded, reason=reason, drained_sleepers=wake, refused=ask.refused)
    return ask.decision


def placement_requests(
    deployment: Deployment,
    replica_ids: list[str],
    need: int,
    cached: tuple[CachedReplica, ...],
    *,
    allow_new: bool = True,
    refused: dict[str, str] | None = None,
    avoided: dict[str, str] | None = None,
) -> list[PlacementRequest]:
    """What placement is asked for each replica of the deployment: its need, its settings and the
    sleeping copies it may promote instead. `refused` and `avoided`: `node_fit`, read here unless
    the caller read them."""
    if refused is None or avoided is None:
        refused, avoided = node_fit(deployment)
    return [
        PlacementRequest(
            deployment=deployment.name,
            replica_id=replica_id,
            need_bytes=need,
            dedicated=deployment.dedicated,
            cached=cached,
            allow_new=allow_new,
            spread=deployment.placement_spread,
            refused_nodes=refused,
            avoided_nodes=avoided,
        )
        for replica_id in replica_ids
    ]


def _occupant_for(deployment: Deployment, placement: Placement) -> OccupantView:
    """A placed replica as the snapshot shows it until its process reports."""
    return OccupantView(
        replica_id=placement.replica_id,
        deployment=deployment.name,
        state=Replica.State.PENDING,
        reserved_bytes=0,
        dedicated=deployment.dedicated,
        popular=deployment.popular,
        min_runtime_s=deployment.min_runtime_s,
    )


def retire_parked(deployment: Deployment, count: int, *, reason: str) -> int:
    """Parked replicas that new loads replace, or a lower count no longer wants:
    stopped, oldest first; how many. The caller holds the deployment row."""
    if count <= 0:
        return 0
    retired = list(deployment.replicas.filter(state=Replica.State.PARKED).order_by("created_at")[:count])
    for replica in retired:
        replica_services.set_state(replica, Replica.State.STOPPED, reason)
    return len(retired)


def retire_replaced(
    deployment: Deployment, loaded: int, *, reason: str, drained_sleepers: bool, refused: dict[str, str]
) -> None:
    """What `loaded` new loads from disk replace, one each: parked replicas (they hold nothing),
    then, for a wake's loads (`drained_sleepers`), sleepers (deep ones too) on drained nodes or on
    nodes its node selector or tolerations no longer let it use (`refused`: the ask's
    `node_refusals`, read once for its placement), oldest first.
    Nothing of it wakes on such a node, so such a sleeper is what a wake had to load anew
    elsewhere; kept, it would hold its process, its context and its host copy there, counted as one
    of the deployment's replicas, until the drain's end (for ever, for its placement). Its
    reservation is released and its process stopped, as a scale-down stops one. The caller holds
    the deployment row."""
    left = loaded - retire_parked(deployment, loaded, reason=f"replaced by a load from disk ({reason})")
    if left <= 0 or not drained_sleepers:
        return
    asleep = (Replica.State.SLEEPING, Replica.State.DEEP_SLEEPING)
    stranded = list(
        # Plain replicas: a failover pair's members stay and go as a pair (failover.py).
        deployment.replicas.filter(state__in=asleep, lease__isnull=True)
        .filter(Q(node__status=Node.Status.DRAINING) | Q(node__name__in=list(refused)))
        .order_by("created_at")
        .values_list("id", "state", "node__name", "node__status")[:left]
    )
    if not stranded:
        return
    drained = sorted({node for _, _, node, status in stranded if status == Node.Status.DRAINING})
    others = sorted({node for _, _, node, status in stranded if status != Node.Status.DRAINING})
    whys = [f"its node {', '.join(drained)} is drained"] if drained else []
    whys += [f"its node {node}: {refused[node]}" for node in others]
    why = f"replaced by a load from disk ({reason}): {'; '.join(whys)}"
    known = {replica_id: (state, node) for replica_id, state, node, _ in stranded}
    release_and_stop(Stop.of(deployment, list(known), reason=why, known=known))


def apply_placements(asks: Sequence[Ask]) -> None:
    """Inside the commit: record where each replica went (and, after the placement's own reason,
    the ask's: deploy, scale, wake), then send the agents to work."""
    placements = [(ask, p) for ask in asks for p in ask.decision.placements]
    victims = {e.replica_id for _, p in placements for e in p.evictions}
    # Most placements evict nobody: no query then (Django compiles even one it knows is empty).
    # Every ask's victims together, in primary-key order (the global lock order).
    for victim in _replicas_in_pk_order(victims) if victims else ():
        _mark_evicted(victim, next(p for _, p in placements if victim.id in p.evicted_replicas))
    placed = []
    for ask, placement in placements:
        gpus, created = ask.decision.gpus, ask.decision.created
        first = gpus[placement.gpu_ids[0]]
        by_index = {str(gpus[g].index): placement.bytes_by_gpu[g] for g in placement.gpu_ids}
        promoted = placement.promoted is not None
        replica = created.get(placement.replica_id) or Replica.objects.get(pk=placement.replica_id)
        before = {"state": replica.state, "node": replica.node_id and first.node, "gpus": replica.gpu_mem_bytes_by_id}
        replica.node_id = first.node_id
        replica.gpu_mem_bytes_by_id = by_index
        replica.gpu_memory_fraction = placement.fraction
        state = Replica.State.WAKING if promoted else Replica.State.PENDING
        if replica.id not in created:  # a new row is born pending; an existing one moves
            replica_services.check_transition(replica.id, replica.state, state)
        replica.state = state
        replica.progress = 0
        replica.failure_reason = ""
        placed.append((ask, placement, replica, before, first, promoted))
    # New rows in one statement; rows that were there (a promotion, a caller's own) saved each.
    hot_sql.insert([p[2] for p in placed if p[2].id in p[0].decision.created])
    for ask, placement, replica, before, first, promoted in placed:
        deployment = ask.deployment
        if replica.id not in ask.decision.created:
            replica.save()
        outbox.note(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            ("promoted from the CPU cache: " if promoted else "placed: ") + f"{placement.reason}; {ask.reason}",
            before=before,
            after={
                "state": replica.state,
                "node": first.node,
                "gpus": replica.gpu_mem_bytes_by_id,
                "level": placement.level.name,
            },
            node=first.node,
            gpu=first.label,
            deployment=deployment.name,
            replica=replica.id,
        )
        _send(ask, placement, replica, first, promoted)


def _send(ask: Ask, placement: Placement, replica: Replica, first: GPUView, promoted: bool) -> None:
    """The placed replica's command to its node (on commit), and its failover pair's start."""
    deployment, gpus = ask.deployment, ask.decision.gpus
    wait_for = [e.replica_id for e in placement.evictions]
    if deployment.failover_standby and not promoted and replica.lease_id is None:
        failover.pair_up(deployment, replica)
    if promoted:
        outbox.want(effects.wake(first.node, replica.id, wait_for))
    elif replica.lease_id is None:
        # Built now from the row as written and the GPUs' own contexts: the command the
        # committed books would give, without reading them back after the commit.
        views = [gpus[g] for g in placement.gpu_ids]
        contexts = (max(v.context_bytes for v in views), max(v.standby_context_bytes for v in views))
        command = replica_specs.start_placed(replica, contexts=contexts, virtual=first.virtual, wait_for=wait_for)
        outbox.want(effects.start_placed(first.node, command))
    else:
        outbox.want(effects.start(first.node, replica.id, wait_for))


def _replicas_in_pk_order(ids: set[str]) -> list[Replica]:
    return list(Replica.objects.select_related("node", "deployment").filter(id__in=ids).order_by("pk"))


def _mark_evicted(victim: Replica, placement: Placement) -> None:
    if victim.state == Replica.State.SLEEPING and victim.node is not None:
        # A sleeper holds only its CUDA context on the GPU, which its process gives back only by
        # exiting: it sleeps deeply, its weights kept in its node's host memory. Its reservation
        # went with this placement's release; its report moves it to deep_sleeping.
        deep_sleep.tell(victim, f"evicted to make room: {placement.reason}")
        return
    replica_services.set_state(
        victim, Replica.State.DRAINING, f"evicted to the CPU cache to make room: {placement.reason}"
    )
    if victim.node is not None:
        outbox.want(effects.sleep(victim.node.name, victim.id))
        if victim.node.cpu_cache_bytes > 0:  # its weights go to the node's host memory
            outbox.want(effects.trim_host_cache(victim.node.name))


@dataclass(frozen=True)
class Stop:
    """A deployment's replicas to release and stop (a failover pair whole). `known`: each one's
    state and node name as the caller read them under the deployment's lock, so they need not be
    read again (None: read them)."""

    deployment: Deployment
    ids: frozenset[str]
    reason: str
    known: dict[str, tuple[str, str | None]] | None

    @classmethod
    def of(
        cls,
        deployment: Deployment,
        replica_ids: Iterable[str],
        *,
        reason: str,
        known: dict[str, tuple[str, str | None]] | None = None,
    ) -> Stop:
        ids = set(replica_ids)
        if deployment.failover_standby:  # only such a deployment's replicas are paired (a setting it keeps)
            ids |= failover.partners(ids)  # a pair stops whole: its standby must not take over
        if known is not None and not ids <= set(known):
            known = None
        return cls(deployment, frozenset(ids), reason, known)


def release_and_stop(stop: Stop) -> None:
    """The stop's replicas released and stopped in one commit, as a scale-down's are; the caller
    holds their deployment's row."""
    # The global lock order: the deployment row (the caller's), the GPU rows (the ledger's
    # commit), then the replica rows (apply_stops, in primary-key order).
    if ledger.commit_with_retry(releasing(stop.ids, stop.reason), apply=lambda plan: apply_stops([stop])) is None:
        apply_stops([stop])  # they held nothing on the GPUs (a deep sleeper's copy is its node's)


def apply_stops(stops: Sequence[Stop]) -> None:
    """Inside the commit that released them: every stop's replicas marked stopping and their
    nodes told to stop them (on commit)."""
    known = sorted((replica_id, stop) for stop in stops if stop.known is not None for replica_id in stop.ids)
    read = [(replica_id, stop, *stop.known[replica_id]) for replica_id, stop in known]  # type: ignore[index]
    # One update for the replicas whose state the callers read, in primary-key order (the global
    # lock order).
    replica_services.set_states_of(
        [
            replica_services.KnownReplica(replica_id, state, node, stop.deployment, f"stopping: {stop.reason}")
            for replica_id, stop, state, node in read
        ],
        Replica.State.STOPPING,
    )
    for replica_id, stop, _, node in read:
        if node is not None:
            drain, paired = stop.deployment.drain_timeout_s, stop.deployment.failover_standby
            outbox.want(effects.stop(node, replica_id, drain_timeout_s=drain, close_pair=paired))
    unknown = {replica_id: stop for stop in stops if stop.known is None for replica_id in stop.ids}
    if unknown:
        query = Replica.objects.select_related("node", "deployment").filter(id__in=unknown).order_by("pk")
        for replica in query:
            replica_services.set_state(replica, Replica.State.STOPPING, f"stopping: {unknown[replica.id].reason}")
            if replica.node is not None:
                paired = unknown[replica.id].deployment.failover_standby
                outbox.want(effects.stop(replica.node.name, replica.id, close_pair=paired))
    for stop in stops:
        if stop.deployment.failover_standby:
            # The books' record that the pair stops whole; its stops close the lock on the node.
            failover.close_pairs(set(stop.ids))
