"""Placing several replicas as one decision (pure).

A deploy of N replicas, or a scale-up by N, is all or nothing: each replica is placed against the
snapshot as the previous placements left it, and the whole lot becomes one ledger plan. Versions
stay those of the real snapshot, so the plan conflicts if any GPU it writes moved meanwhile.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from gpuportal.wire.states import AWAKE
from scheduling.core import host_memory, settling
from scheduling.core.host_memory import HostView
from scheduling.core.placement import (
    CandidateLevel,
    CantAccommodate,
    Placement,
    PlacementRequest,
    Policy,
    fmt_bytes,
    place,
)
from scheduling.core.state import GPUView, OccupantView, Plan, Release, Reservation, Snapshot


@dataclass(frozen=True)
class MultiPlacement:
    placements: tuple[Placement, ...]
    plan: Plan
    after: Snapshot  # the snapshot placed on, as it will be once the plan is committed


def apply_placement(snapshot: Snapshot, placement: Placement, occupant: OccupantView) -> Snapshot:
    """The snapshot as it will be once `placement` is committed (versions unchanged)."""
    gone: dict[int, set[str]] = {}
    for eviction in placement.evictions:
        gone.setdefault(eviction.gpu_id, set()).add(eviction.replica_id)
    for gpu_id in placement.dropped_residuals:
        gone.setdefault(gpu_id, set()).add(placement.replica_id)
    changed = []
    for gpu_id in set(gone) | set(placement.gpu_ids):
        gpu = snapshot.gpus[gpu_id]
        occupants = [o for o in gpu.occupants if o.replica_id not in gone.get(gpu_id, set())]
        if gpu_id in placement.bytes_by_gpu:
            occupants = [o for o in occupants if o.replica_id != placement.replica_id]
            occupants.append(replace(occupant, reserved_bytes=placement.bytes_by_gpu[gpu_id]))
        changed.append(_with_occupants(gpu, occupants))
    return _with_gpus(snapshot, changed)


def without_releases(snapshot: Snapshot, releases: Iterable[Release]) -> Snapshot:
    """The snapshot as it will be once these reservations are released (versions unchanged)."""
    gone: dict[int, set[str]] = {}
    for release in releases:
        gone.setdefault(release.gpu_id, set()).add(release.replica_id)
    changed = [
        _with_occupants(snapshot.gpus[gpu_id], [o for o in snapshot.gpus[gpu_id].occupants if o.replica_id not in ids])
        for gpu_id, ids in gone.items()
    ]
    return _with_gpus(snapshot, changed)


def _with_gpus(snapshot: Snapshot, changed: Sequence[GPUView]) -> Snapshot:
    """The snapshot with these GPUs' views replaced; its index patched rather than built anew
    where it has one (a batch of placements over hundreds of nodes would otherwise walk every
    GPU after each)."""
    if not changed:
        return snapshot
    gpus = dict(snapshot.gpus)
    for gpu in changed:
        gpus[gpu.id] = gpu
    if "index" in snapshot.__dict__:  # built already (cached_property keeps it there)
        index = snapshot.index.updated(changed)
        if index is not None:
            return Snapshot.indexed(gpus, snapshot.taken_at, index)
    return Snapshot(gpus=gpus, taken_at=snapshot.taken_at)


def _with_occupants(gpu: GPUView, occupants: list[OccupantView]) -> GPUView:
    reserved = sum(o.reserved_bytes for o in occupants)
    return replace(gpu, occupants=tuple(occupants), available_bytes=gpu.total_bytes - reserved)


def withhold_locked(snapshot: Snapshot, holders: Iterable[str], now: datetime) -> tuple[Snapshot, list[str]]:
    """The snapshot without the GPUs another wake holds the lock of (unexpired), and their labels.

    A wake lock says the memory being freed on that GPU is promised to its holder (seed 001): a
    placement that took it would make the fair wake preempt for nothing. `holders` are the
    replicas this placement is for; their own locks do not withhold anything.
    """
    mine = set(holders)
    locked = (snapshot.gpus[gpu_id] for gpu_id in snapshot.index.wake_locked)
    withheld = {
        gpu.id: gpu
        for gpu in locked
        if gpu.wake_lock_holder not in mine and (gpu.wake_lock_expires_at is None or gpu.wake_lock_expires_at > now)
    }
    if not withheld:
        return snapshot, []
    gpus = {gpu_id: gpu for gpu_id, gpu in snapshot.gpus.items() if gpu_id not in withheld}
    return replace(snapshot, gpus=gpus), sorted(g.label for g in withheld.values())


def place_all(
    snapshot: Snapshot,
    requests: Sequence[PlacementRequest],
    *,
    occupant_for: Callable[[Placement], OccupantView],
    reason: str,
    policy: str | Policy = "gpuportal",
    rng: random.Random | None = None,
    hosts: Mapping[str, HostView] | None = None,
    host_need_bytes: int = 0,
) -> MultiPlacement | CantAccommodate:
    """Place every request or none. `occupant_for` describes the placed replica as an occupant
    (its deployment's fairness settings), so later requests see it as the commit will.
    `hosts`: each node's host RAM, where a new replica's process takes `host_need_bytes`
    (scheduling.core.host_memory); each new replica placed counts against its node's for the next."""
    rng = rng if rng is not None else random.Random()
    current = snapshot
    placements: list[Placement] = []
    promoted: set[str] = set()
    room = dict(hosts or {})
    for request in requests:
        # A cached replica promoted for an earlier request is no longer cached for this one.
        request = replace(
            request,
            cached=tuple(c for c in request.cached if c.replica_id not in promoted),
            host_refused=host_memory.refusals(room, host_need_bytes),
        )
        result = place(current, request, policy=policy, rng=rng)
        if isinstance(result, CantAccommodate):
            wanted = len(requests) + len(_awake(snapshot, request.deployment) - {r.replica_id for r in requests})
            return replace(
                result,
                ordinal=len(placements) + 1,
                asked=len(requests),
                ceiling=ceiling(snapshot, request.need_bytes, wanted, request.refused_nodes),
            )
        placements.append(result)
        if result.promoted:
            promoted.add(result.promoted)
        elif result.node in room:
            room[result.node] = room[result.node].with_process(host_need_bytes)
        current = apply_placement(current, result, occupant_for(result))
    return MultiPlacement(tuple(placements), _combined_plan(snapshot, placements, reason), current)


def room_at(
    snapshot: Snapshot,
    requests: Sequence[PlacementRequest],
    *,
    occupant_for: Callable[[Placement], OccupantView],
    policy: str | Policy = "gpuportal",
    hosts: Mapping[str, HostView] | None = None,
    host_need_bytes: int = 0,
) -> datetime | None:
    """When `place_all`, refused on `snapshot`, would place them all as things stand but for the
    clock: the soonest moment a replica in the way leaves its `min_runtime` (settling); None when
    no such moment helps. Its ties broken alike at every moment tried. What a refusal's
    Retry-After says; asked only for one that is answered (it places the requests a few times)."""

    def placed(at: datetime) -> bool:
        result = place_all(
            replace(snapshot, taken_at=at),
            requests,
            occupant_for=occupant_for,
            reason="",
            policy=policy,
            rng=random.Random(0),
            hosts=hosts,
            host_need_bytes=host_need_bytes,
        )
        return not isinstance(result, CantAccommodate)

    occupants = [o for gpu in snapshot.gpus.values() for o in gpu.occupants]
    return settling.soonest(settling.lapses(occupants, snapshot.taken_at), placed)


def _awake(snapshot: Snapshot, deployment: str) -> set[str]:
    """The deployment's replicas holding (or about to hold) their whole need in the snapshot."""
    return {
        o.replica_id
        for gpu in snapshot.gpus.values()
        for o in gpu.occupants
        if o.deployment == deployment and o.state in AWAKE
    }


def ceiling(snapshot: Snapshot, need_bytes: int, wanted: int, refused: Collection[str] = ()) -> str:
    """Empty unless `wanted` replicas of `need_bytes` each could never be awake at once on the
    GPUs placement may use now, even with nothing else on them; then how many could. Said so that a
    refusal shows when no wait and no eviction will help (fewer replicas, or more GPUs, will).
    `refused`: nodes the deployment may not use at all (its node selector, its tolerations).
    Only for replicas of one GPU each: a larger one's bound depends on how nodes group GPUs."""
    gpus = [gpu for node, group in snapshot.index.usable.items() if node not in refused for gpu in group]
    if not gpus or need_bytes <= 0 or need_bytes > max(gpu.total_bytes for gpu in gpus):
        return ""
    most = sum(gpu.total_bytes // need_bytes for gpu in gpus)
    if wanted <= most:
        return ""
    return (
        f"{wanted} replicas of {fmt_bytes(need_bytes)} never fit at once: the {len(gpus)} GPU(s) placement "
        f"may use hold at most {most}, with nothing else on them"
    )


def _combined_plan(snapshot: Snapshot, placements: Sequence[Placement], reason: str) -> Plan:
    # Every GPU Event of the commit carries the plan's reason: one placement's whole reason, but
    # of several only where each went (each replica's own Event says why there), not every
    # placement's reason repeated in each of the others' Events.
    if len(placements) == 1:
        detail = placements[0].reason
    else:
        detail = "; ".join(_where(snapshot, p) for p in placements) + " (each replica's Event says why there)"
    return plan_of(snapshot, placements, (), f"{reason}: {detail}" if detail else reason)


def _where(snapshot: Snapshot, placement: Placement) -> str:
    gpus = ", ".join(f"{snapshot.gpus[g].node}/{snapshot.gpus[g].index}" for g in placement.gpu_ids)
    verb = "kept" if placement.level is CandidateLevel.DEPLOYED else "woke" if placement.promoted else "placed"
    evicted = f", evicting {', '.join(r[:8] for r in placement.evicted_replicas)}" if placement.evictions else ""
    return f"{verb} {placement.replica_id[:8]} on {gpus or placement.node}{evicted}"


def plan_of(snapshot: Snapshot, placements: Sequence[Placement], releases: Iterable[Release], reason: str) -> Plan:
    """One ledger plan for placements and releases decided together (a placement's own evictions
    among the releases), against the snapshot they were decided on."""
    released: dict[tuple[int, str], Release] = {(r.gpu_id, r.replica_id): r for r in releases}
    reservations: dict[tuple[int, str], Reservation] = {}
    for placement in placements:
        plan = placement.to_plan(snapshot)
        for release in plan.releases:
            released[(release.gpu_id, release.replica_id)] = release
        for reservation in plan.reservations:
            reservations[(reservation.gpu_id, reservation.replica_id)] = reservation
    return Plan.against(snapshot, reason, reservations=reservations.values(), releases=released.values())
