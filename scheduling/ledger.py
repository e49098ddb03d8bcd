"""The one commit path (DESIGN §4): snapshot GPUs, let a pure module plan, commit with
compare-and-swap on the GPU rows. This module is the only writer of GPU bytes, versions and
Occupant rows; services call it, nothing else does."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from scheduling import events, selectors
from scheduling.metrics import CAS_CONFLICTS, COMMITS
from scheduling.models import GPU, Event, Occupant
from scheduling.state import DeviceInfo, GPUView, IntentView, OccupantView, Plan, Snapshot

log = logging.getLogger(__name__)


class CasConflict(Exception):
    """A GPU changed between snapshot and commit; plan again from a fresh snapshot."""

    def __init__(self, stale: list[tuple[int, int, int | None]]):
        self.stale = stale  # (gpu id, expected version, actual version or None if gone)
        detail = ", ".join(f"gpu {g}: expected v{e}, found {'gone' if a is None else f'v{a}'}" for g, e, a in stale)
        super().__init__(f"stale plan ({detail})")


class OverCommit(Exception):
    """A plan would reserve more than a GPU holds. Nothing of it is applied."""

    def __init__(self, gpu_label: str, total: int, reserved: int):
        self.gpu_label, self.total, self.reserved = gpu_label, total, reserved
        super().__init__(f"gpu {gpu_label} would be over-committed: {reserved} B reserved of {total} B")


@dataclass(frozen=True)
class CommitResult:
    plan: Plan
    versions: dict[int, int]  # new version per GPU written
    available: dict[int, int]  # new available_bytes per GPU written
    attempts: int = 1


def snapshot(gpu_ids: Iterable[int] | None = None) -> Snapshot:
    """Read GPUs with their versions, occupants and active intents, without locking.

    Reads are not one transaction, but each GPU row (with its version) is read before its
    occupants: any commit landing in between bumps that version, so a plan built on the mix
    fails its compare-and-swap instead of acting on it.
    """
    gpus = selectors.gpus().order_by("pk")
    if gpu_ids is not None:
        gpus = gpus.filter(pk__in=list(gpu_ids))
    return Snapshot(gpus={g.pk: gpu_view(g) for g in gpus}, taken_at=timezone.now())


def gpu_view(gpu: GPU) -> GPUView:
    return GPUView(
        id=gpu.pk,
        node=gpu.node.name,
        node_status=gpu.node.status,
        index=gpu.index,
        total_bytes=gpu.total_bytes,
        available_bytes=gpu.available_bytes,
        version=gpu.version,
        virtual=gpu.virtual,
        health=gpu.health,
        occupants=tuple(
            OccupantView(
                replica_id=o.replica_id,
                deployment=o.replica.deployment.name,
                state=o.replica.state,
                reserved_bytes=o.reserved_bytes,
                since=o.since,
                last_accessed=o.replica.last_accessed,
                serving_since=o.replica.serving_since,
                dedicated=o.replica.deployment.dedicated,
                popular=o.replica.deployment.popular,
                min_runtime_s=o.replica.deployment.min_runtime_s,
            )
            for o in gpu.occupants.all()
        ),
        intents=tuple(
            IntentView(
                id=i.pk,
                replica_id=i.waiting_replica_id,
                deployment=i.waiting_replica.deployment.name,
                needed_bytes=i.needed_bytes,
                deadline=i.deadline,
                status=i.status,
            )
            for i in gpu.active_intents
        ),
        wake_lock_holder=gpu.wake_lock_holder_id,
        wake_lock_expires_at=gpu.wake_lock_expires_at,
    )


def commit(plan: Plan, *, apply: Callable[[Plan], None] | None = None) -> CommitResult:
    """Apply `plan` if every GPU it writes still has the version it was planned against.

    `apply` runs inside the same transaction, after the checks, so a service's writes to other
    rows (replica state, placement) land together with the reservation or not at all.
    """
    plan.validate()
    with transaction.atomic():
        # Why primary-key order: every commit locks GPU rows in the same global order, so two
        # commits can wait on each other but never in a cycle (no deadlock).
        locked = {g.pk: g for g in GPU.objects.select_for_update().filter(pk__in=plan.gpu_ids).order_by("pk")}
        stale = [
            (gpu_id, expected, locked[gpu_id].version if gpu_id in locked else None)
            for gpu_id, expected in sorted(plan.expected_versions.items())
            if gpu_id not in locked or locked[gpu_id].version != expected
        ]
        if stale:
            raise CasConflict(stale)

        before: dict[int, dict[str, int]] = {gpu_id: {} for gpu_id in plan.gpu_ids}
        for gpu_id, replica_id, held in Occupant.objects.filter(gpu_id__in=plan.gpu_ids).values_list(
            "gpu_id", "replica_id", "reserved_bytes"
        ):
            before[gpu_id][replica_id] = held
        for release in plan.releases:
            Occupant.objects.filter(gpu_id=release.gpu_id, replica_id=release.replica_id).delete()
        for reservation in plan.reservations:
            Occupant.objects.update_or_create(
                gpu_id=reservation.gpu_id,
                replica_id=reservation.replica_id,
                defaults={"reserved_bytes": reservation.reserved_bytes},
            )

        # Recomputed from the occupant rows, not adjusted by deltas: the rows are the truth and
        # nobody else writes them while we hold the GPU locks.
        reserved = dict(
            Occupant.objects.filter(gpu_id__in=plan.gpu_ids)
            .values_list("gpu_id")
            .annotate(total=Sum("reserved_bytes"))
            .values_list("gpu_id", "total")
        )
        versions: dict[int, int] = {}
        available: dict[int, int] = {}
        for gpu_id in plan.gpu_ids:
            gpu = locked[gpu_id]
            used = reserved.get(gpu_id, 0)
            if used > gpu.total_bytes:
                raise OverCommit(plan.labels.get(gpu_id, str(gpu_id)), gpu.total_bytes, used)
            gpu.available_bytes = gpu.total_bytes - used
            gpu.version += 1
            gpu.save(update_fields=["available_bytes", "version", "updated_at"])
            versions[gpu_id], available[gpu_id] = gpu.version, gpu.available_bytes

        _record_changes(plan, locked, before)
        if apply is not None:
            apply(plan)
    COMMITS.inc()
    return CommitResult(plan=plan, versions=versions, available=available)


def commit_with_retry(
    decide: Callable[[Snapshot], Plan | None],
    *,
    gpu_ids: Iterable[int] | None = None,
    apply: Callable[[Plan], None] | None = None,
    attempts: int | None = None,
) -> CommitResult | None:
    """Snapshot → decide → commit, again from a fresh snapshot after each conflict.

    `decide` returns None when there is nothing to do. Backoff is jittered so that clients
    that collided do not collide again in lockstep; after `attempts` conflicts the last one
    is raised to the caller.
    """
    scope = list(gpu_ids) if gpu_ids is not None else None
    retrying = Retrying(
        retry=retry_if_exception_type(CasConflict),
        stop=stop_after_attempt(attempts or settings.GPUPORTAL_CAS_ATTEMPTS),
        wait=wait_random_exponential(multiplier=0.001, max=settings.GPUPORTAL_CAS_BACKOFF_MAX_S),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            plan = decide(snapshot(scope))
            if plan is None:
                return None
            try:
                result = commit(plan, apply=apply)
            except CasConflict:
                CAS_CONFLICTS.inc()
                raise
    return replace(result, attempts=retrying.statistics["attempt_number"])


def _record_changes(plan: Plan, locked: dict[int, GPU], before: dict[int, dict[str, int]]) -> None:
    for release in plan.releases:
        freed = before[release.gpu_id].get(release.replica_id)
        if freed is None:
            continue
        label = plan.labels.get(release.gpu_id, str(release.gpu_id))
        events.record(
            Event.Kind.GPU_RELEASED,
            f"gpu {label}",
            f"released {freed} B of replica {release.replica_id[:8]}: {plan.reason}",
            before={"reserved_bytes": freed},
            after={"reserved_bytes": 0, "available_bytes": locked[release.gpu_id].available_bytes},
            gpu=label,
            replica=release.replica_id,
        )
    for reservation in plan.reservations:
        label = plan.labels.get(reservation.gpu_id, str(reservation.gpu_id))
        previous = before[reservation.gpu_id].get(reservation.replica_id, 0)
        events.record(
            Event.Kind.GPU_RESERVED,
            f"gpu {label}",
            f"reserved {reservation.reserved_bytes} B for replica {reservation.replica_id[:8]}: {plan.reason}",
            before={"reserved_bytes": previous},
            after={
                "reserved_bytes": reservation.reserved_bytes,
                "available_bytes": locked[reservation.gpu_id].available_bytes,
            },
            gpu=label,
            replica=reservation.replica_id,
        )


@dataclass(frozen=True)
class InventoryChange:
    gpu_id: int
    label: str
    kind: str  # "added", "resized", "lost", "found"
    before: dict | None
    after: dict | None


def sync_inventory(node_id: int, node_name: str, devices: list[DeviceInfo]) -> list[InventoryChange]:
    """Make the node's GPU rows match what its agent reports.

    A resize goes through the same lock order and version bump as a plan, so a concurrent plan
    on that GPU conflicts rather than reserving against the old size. A GPU that disappeared is
    marked lost, not deleted: its occupants and history stay visible.
    """
    changes: list[InventoryChange] = []
    with transaction.atomic():
        existing = {g.index: g for g in GPU.objects.select_for_update().filter(node_id=node_id).order_by("pk")}
        reported = {d.index for d in devices}
        for device in sorted(devices, key=lambda d: d.index):
            label = f"{node_name}/{device.index}"
            gpu = existing.get(device.index)
            if gpu is None:
                gpu = GPU.objects.create(
                    node_id=node_id,
                    index=device.index,
                    uuid=device.uuid,
                    product=device.product,
                    virtual=device.virtual,
                    total_bytes=device.total_bytes,
                    available_bytes=device.total_bytes,
                )
                changes.append(InventoryChange(gpu.pk, label, "added", None, _inventory_fields(gpu)))
                continue
            before = _inventory_fields(gpu)
            reserved = gpu.total_bytes - gpu.available_bytes
            gpu.uuid, gpu.product, gpu.virtual = device.uuid, device.product, device.virtual
            if gpu.total_bytes != device.total_bytes:
                gpu.total_bytes = device.total_bytes
                # Occupants that no longer fit stay recorded; the GPU shows as degraded and has
                # nothing available until they are released, rather than violating the CHECK.
                gpu.available_bytes = max(device.total_bytes - reserved, 0)
                gpu.health = GPU.Health.OK if reserved <= device.total_bytes else GPU.Health.DEGRADED
                gpu.version += 1
                kind = "resized"
            elif gpu.health == GPU.Health.LOST:
                gpu.health = GPU.Health.OK
                gpu.version += 1
                kind = "found"
            else:
                kind = ""
            gpu.save()
            if kind:
                changes.append(InventoryChange(gpu.pk, label, kind, before, _inventory_fields(gpu)))
        for index, gpu in existing.items():
            if index not in reported and gpu.health != GPU.Health.LOST:
                before = _inventory_fields(gpu)
                gpu.health = GPU.Health.LOST
                gpu.version += 1
                gpu.save(update_fields=["health", "version", "updated_at"])
                changes.append(InventoryChange(gpu.pk, f"{node_name}/{index}", "lost", before, _inventory_fields(gpu)))
    return changes


def _inventory_fields(gpu: GPU) -> dict:
    return {
        "uuid": gpu.uuid,
        "product": gpu.product,
        "total_bytes": gpu.total_bytes,
        "available_bytes": gpu.available_bytes,
        "health": gpu.health,
        "virtual": gpu.virtual,
    }
