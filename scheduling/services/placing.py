"""Placing and stopping a deployment's replicas: the decisions a deploy, a scale, a wake and a
preemption share (snapshot → plan → commit, the rows, Events and commands it writes).

Lock order, the same everywhere (scheduling.locks): the deployment row, then GPU rows in
primary-key order (the ledger), then replica rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from django.db.models import Q
from django.utils import timezone

from gpuportal.wire import memory
from scheduling import events, hot_sql, ledger
from scheduling.models import GPU, Deployment, Event, Replica, new_replica_id
from scheduling.placement import POLICIES, CachedReplica, CantAccommodate, Placement, PlacementRequest, Policy
from scheduling.planning import place_all, withhold_locked
from scheduling.services import dispatch, failover, replica_specs
from scheduling.services import replicas as replica_services
from scheduling.services.errors import CannotPlace
from scheduling.services.replica_specs import contexts_of
from scheduling.state import GPUView, OccupantView, Plan, Release, Snapshot

# Replicas that are, or are about to be, on their GPUs: what `replicas` counts.
AWAKE = (Replica.State.PENDING, Replica.State.LOADING, Replica.State.SERVING, Replica.State.WAKING)
# Replicas whose process is gone or going; they hold no reservation.
GONE = (Replica.State.STOPPING, Replica.State.STOPPED, Replica.State.FAILED)
# Replicas that count toward a deployment's replicas while a failed load is replaced: serving,
# sleeping, or on their way to either. A failover standby is its active member's, not one more.
# A parked replica (issue 19: it left a full host cache) is still wanted: the next wake loads it.
COUNTED = (*AWAKE, Replica.State.DRAINING, Replica.State.SLEEPING, Replica.State.PARKED)
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


def releasing(replica_ids: set[str], reason: str) -> Callable[[Snapshot], Plan | None]:
    """A decision releasing every reservation the replicas hold, or None when they hold none."""

    def decide(snap: Snapshot) -> Plan | None:
        holdings = snap.index.holdings  # where each replica holds memory, without a walk of every GPU
        releases = sorted(
            (Release(gpu.id, replica_id) for replica_id in replica_ids for gpu, _ in holdings.get(replica_id, ())),
            key=lambda r: (r.gpu_id, r.replica_id),
        )
        return Plan.against(snap, reason, releases=releases) if releases else None

    return decide


def need_bytes(deployment: Deployment, snapshot: Snapshot) -> memory.Need:
    """The bytes one replica of the deployment reserves: its need under the deployment's policy
    (gpuportal.wire.memory's footprint) with a CUDA context, plus, in a failover pair, the context its
    sleeping standby keeps beside it. Contexts are the GPUs' own (measured per node and model, or
    the virtual GPU's), the largest among the snapshot's GPUs, so the need fits wherever it goes."""
    need = memory.need_for(
        deployment.memory_policy,
        memory.NeedInputs(
            weight_bytes=deployment.weight_bytes,
            estimate_bytes=deployment.memory_estimate_bytes,
            override_bytes=deployment.memory_override_bytes,
            measured_bytes=deployment.memory_measured_bytes,
        ),
    )
    context, standby_context = snapshot.index.contexts
    # A measured need is the replica's own footprint, its context included (as it was measured:
    # the GPUs' context may have grown since); others have none.
    if need.source == "measured":
        grown = memory.with_grown_context(need.bytes, deployment.memory_measured_context_bytes, context)
        need = replace(need, bytes=grown)
    else:
        need = replace(need, bytes=need.bytes + context)
    if deployment.failover_standby:
        need = replace(need, bytes=need.bytes + standby_context)
    return need


def gpu_contexts(gpu_ids: Iterable[int]) -> tuple[int, int]:
    """(serving context, standby context) in bytes: the largest of these GPUs' (issue 15)."""
    return contexts_of(GPU.objects.filter(pk__in=list(gpu_ids)))


def cached_of(deployment: Deployment) -> tuple[CachedReplica, ...]:
    """The deployment's sleeping replicas, each on the node whose RAM holds its weights: the
    replicas placement promotes before it creates new ones."""
    return tuple(
        CachedReplica(replica_id, node)
        for replica_id, node in deployment.replicas.filter(
            state=Replica.State.SLEEPING, node__isnull=False
        ).values_list("id", "node__name")
    )


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
) -> Decision:
    """Place `count` more replicas as one all-or-nothing decision, promoting sleeping ones first.

    `cached` narrows the sleeping replicas that may be promoted (default: all of the
    deployment's); `allow_new=False` only promotes, which is how one named replica is woken.
    `evictions=False` uses only free memory (the fair wake path: victims are fairness.py's
    call, not placement's). `new_ids` are rows the caller already created (a waker that held a
    wake lock under that id); they are kept even if unused. `parked=False`: the caller knows the
    deployment has no parked replica (none to retire for a new load). The caller holds the
    deployment row lock.
    """
    if cached is None:
        cached = cached_of(deployment)
    # Placement needs an id per request even when it may only promote; those ids never get rows.
    decision = Decision(new_ids=list(new_ids) if new_ids is not None else [new_replica_id() for _ in range(count)])
    policy: str | Policy = deployment.memory_policy
    if not evictions:
        policy = replace(POLICIES[deployment.memory_policy], evictions=False)

    mine = [*decision.new_ids, *(c.replica_id for c in cached)]

    def decide(snap: Snapshot) -> Plan:
        need = need_bytes(deployment, snap)
        snap, withheld = withhold_locked(snap, mine, timezone.now())
        requests = placement_requests(deployment, decision.new_ids, need.bytes, cached, allow_new=allow_new)
        result = place_all(
            snap,
            requests,
            occupant_for=lambda placement: _occupant_for(deployment, placement),
            reason=f"{reason} ({need})",
            policy=policy,
        )
        if isinstance(result, CantAccommodate):
            if withheld:
                locked = ", ".join(withheld)
                reasons = {**result.reasons, **{label: "another wake holds its wake lock" for label in withheld}}
                raise CannotPlace(f"{result.reason} (not counting {locked}: another wake holds its lock)", reasons)
            raise CannotPlace(result.reason, result.reasons)
        decision.placements = result.placements
        decision.gpus = snap.gpus
        return result.plan

    if allow_new and new_ids is None:
        # Rows written by the commit's apply, placed, and only for the ids placement used (a
        # promotion can make one unneeded). The occupants the ledger writes first point at them
        # before they exist: the foreign key is checked at commit.
        decision.created = {i: Replica(id=i, deployment=deployment) for i in decision.new_ids}
    ledger.commit_with_retry(decide, apply=lambda plan: apply_placements(deployment, decision, reason))
    loaded = sum(1 for p in decision.placements if p.promoted is None)
    if parked:
        retire_parked(deployment, loaded, reason=f"replaced by a load from disk ({reason})")
    return decision


def placement_requests(
    deployment: Deployment,
    replica_ids: list[str],
    need: int,
    cached: tuple[CachedReplica, ...],
    *,
    allow_new: bool = True,
) -> list[PlacementRequest]:
    """What placement is asked for each replica of the deployment: its need, its settings and the
    sleeping copies it may promote instead."""
    return [
        PlacementRequest(
            deployment=deployment.name,
            replica_id=replica_id,
            need_bytes=need,
            dedicated=deployment.dedicated,
            cached=cached,
            allow_new=allow_new,
            spread=deployment.placement_spread,
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


def retire_parked(deployment: Deployment, count: int, *, reason: str) -> None:
    """Parked replicas (issue 19) that new loads replace, or a lower count no longer wants:
    stopped, oldest first. The caller holds the deployment row."""
    if count <= 0:
        return
    for replica in deployment.replicas.filter(state=Replica.State.PARKED).order_by("created_at")[:count]:
        replica_services.set_state(replica, Replica.State.STOPPED, reason)


def apply_placements(deployment: Deployment, decision: Decision, reason: str) -> None:
    """Inside the commit: record where each replica went (and, after the placement's own reason,
    the caller's: deploy, scale, wake), then send the agents to work."""
    gpus = decision.gpus
    victims = {e.replica_id for p in decision.placements for e in p.evictions}
    # Most placements evict nobody: no query then (Django compiles even one it knows is empty).
    for victim in _replicas_in_pk_order(victims) if victims else ():
        _mark_evicted(victim, next(p for p in decision.placements if victim.id in p.evicted_replicas))
    placed = []
    for placement in decision.placements:
        first = gpus[placement.gpu_ids[0]]
        by_index = {str(gpus[g].index): placement.bytes_by_gpu[g] for g in placement.gpu_ids}
        promoted = placement.promoted is not None
        replica = decision.created.get(placement.replica_id) or Replica.objects.get(pk=placement.replica_id)
        before = {"state": replica.state, "node": replica.node_id and first.node, "gpus": replica.gpu_mem_bytes_by_id}
        replica.node_id = first.node_id
        replica.gpu_mem_bytes_by_id = by_index
        replica.gpu_memory_fraction = placement.fraction
        replica.state = Replica.State.WAKING if promoted else Replica.State.PENDING
        replica.progress = 0
        replica.failure_reason = ""
        placed.append((placement, replica, before, first, promoted))
    # New rows in one statement; rows that were there (a promotion, a caller's own) saved each.
    hot_sql.insert([p[1] for p in placed if p[1].id in decision.created])
    for placement, replica, before, first, promoted in placed:
        if replica.id not in decision.created:
            replica.save()
        events.record(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            ("promoted from the CPU cache: " if promoted else "placed: ") + f"{placement.reason}; {reason}",
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
        wait_for = [e.replica_id for e in placement.evictions]
        if deployment.failover_standby and not promoted and replica.lease_id is None:
            failover.pair_up(deployment, replica)
        if promoted:
            dispatch.wake(first.node, replica.id, wait_for)
        elif replica.lease_id is None:
            # Built now from the row as written and the GPUs' own contexts: the command the
            # committed books would give, without reading them back after the commit.
            views = [gpus[g] for g in placement.gpu_ids]
            contexts = (max(v.context_bytes for v in views), max(v.standby_context_bytes for v in views))
            command = replica_specs.start_placed(replica, contexts=contexts, virtual=first.virtual, wait_for=wait_for)
            dispatch.start_placed(first.node, command)
        else:
            dispatch.start(first.node, replica.id, wait_for)


def _replicas_in_pk_order(ids: set[str]) -> list[Replica]:
    return list(Replica.objects.select_related("node", "deployment").filter(id__in=ids).order_by("pk"))


def _mark_evicted(victim: Replica, placement: Placement) -> None:
    replica_services.set_state(
        victim, Replica.State.DRAINING, f"evicted to the CPU cache to make room: {placement.reason}"
    )
    if victim.node is not None:
        dispatch.sleep(victim.node.name, victim.id)
        if victim.node.cpu_cache_bytes > 0:  # its weights go to the node's host memory
            dispatch.trim_host_cache(victim.node.name)


def stop_replicas(
    deployment: Deployment,
    replica_ids: list[str],
    *,
    reason: str,
    known: dict[str, tuple[str, str | None]] | None = None,
) -> None:
    """Release and stop the replicas (a failover pair whole). `known`: each one's state and node
    name as the caller read them under the deployment's lock, so they need not be read again."""
    ids = set(replica_ids)
    if deployment.failover_standby:  # only such a deployment's replicas are paired (a setting it keeps)
        ids |= failover.partners(ids)  # a pair stops whole: its standby must not take over
    if known is not None and not ids <= set(known):
        known = None

    def apply(plan: Plan | None = None) -> None:
        if known is not None:
            # One update per replica, in primary-key order (the global lock order).
            for replica_id in sorted(ids):
                state, node = known[replica_id]
                replica_services.set_state_of(
                    replica_id, state, Replica.State.STOPPING, f"stopping: {reason}", node=node, deployment=deployment
                )
                if node is not None:
                    dispatch.stop(node, replica_id, drain_timeout_s=deployment.drain_timeout_s)
        else:
            for replica in Replica.objects.select_related("node", "deployment").filter(id__in=ids).order_by("pk"):
                replica_services.set_state(replica, Replica.State.STOPPING, f"stopping: {reason}")
                if replica.node is not None:
                    dispatch.stop(replica.node.name, replica.id)
        if deployment.failover_standby:
            # The stops go out on commit, this with them: no member takes over from one that exits.
            failover.close_pairs(ids)

    if ledger.commit_with_retry(releasing(ids, reason), apply=apply) is None:
        apply()  # nothing was reserved (e.g. still pending): stop them all the same
