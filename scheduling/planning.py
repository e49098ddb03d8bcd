"""Placing several replicas as one decision (pure).

A deploy of N replicas, or a scale-up by N, is all or nothing: each replica is placed against the
snapshot as the previous placements left it, and the whole lot becomes one ledger plan. Versions
stay those of the real snapshot, so the plan conflicts if any GPU it writes moved meanwhile.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from scheduling.placement import CantAccommodate, Placement, PlacementRequest, Policy, place
from scheduling.state import GPUView, OccupantView, Plan, Release, Reservation, Snapshot


@dataclass(frozen=True)
class MultiPlacement:
    placements: tuple[Placement, ...]
    plan: Plan


def apply_placement(snapshot: Snapshot, placement: Placement, occupant: OccupantView) -> Snapshot:
    """The snapshot as it will be once `placement` is committed (versions unchanged)."""
    gpus = dict(snapshot.gpus)
    gone: dict[int, set[str]] = {}
    for eviction in placement.evictions:
        gone.setdefault(eviction.gpu_id, set()).add(eviction.replica_id)
    for gpu_id in placement.dropped_residuals:
        gone.setdefault(gpu_id, set()).add(placement.replica_id)
    for gpu_id in set(gone) | set(placement.gpu_ids):
        gpu = gpus[gpu_id]
        occupants = [o for o in gpu.occupants if o.replica_id not in gone.get(gpu_id, set())]
        if gpu_id in placement.bytes_by_gpu:
            occupants = [o for o in occupants if o.replica_id != placement.replica_id]
            occupants.append(replace(occupant, reserved_bytes=placement.bytes_by_gpu[gpu_id]))
        gpus[gpu_id] = _with_occupants(gpu, occupants)
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
    withheld = {
        gpu_id: gpu
        for gpu_id, gpu in snapshot.gpus.items()
        if gpu.wake_lock_holder is not None
        and gpu.wake_lock_holder not in mine
        and (gpu.wake_lock_expires_at is None or gpu.wake_lock_expires_at > now)
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
) -> MultiPlacement | CantAccommodate:
    """Place every request or none. `occupant_for` describes the placed replica as an occupant
    (its deployment's fairness settings), so later requests see it as the commit will."""
    rng = rng if rng is not None else random.Random()
    current = snapshot
    placements: list[Placement] = []
    promoted: set[str] = set()
    for request in requests:
        # A cached replica promoted for an earlier request is no longer cached for this one.
        request = replace(request, cached=tuple(c for c in request.cached if c.replica_id not in promoted))
        result = place(current, request, policy=policy, rng=rng)
        if isinstance(result, CantAccommodate):
            return result
        placements.append(result)
        if result.promoted:
            promoted.add(result.promoted)
        current = apply_placement(current, result, occupant_for(result))
    return MultiPlacement(tuple(placements), _combined_plan(snapshot, placements, reason))


def _combined_plan(snapshot: Snapshot, placements: Sequence[Placement], reason: str) -> Plan:
    releases: dict[tuple[int, str], Release] = {}
    reservations: dict[tuple[int, str], Reservation] = {}
    for placement in placements:
        plan = placement.to_plan(snapshot)
        for release in plan.releases:
            releases[(release.gpu_id, release.replica_id)] = release
        for reservation in plan.reservations:
            reservations[(reservation.gpu_id, reservation.replica_id)] = reservation
    detail = " | ".join(p.reason for p in placements if p.reason)
    return Plan.against(
        snapshot,
        f"{reason}: {detail}" if detail else reason,
        reservations=reservations.values(),
        releases=releases.values(),
    )
