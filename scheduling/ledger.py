"""The one commit path (DESIGN §4): snapshot GPUs, let a pure module plan, commit with
compare-and-swap on the GPU rows. This module (with the server-side function it calls,
`gpuportal_ledger_commit` of migration 0005) is the only writer of GPU bytes, versions and
Occupant rows; services call it, nothing else does. Global lock order: deployment rows, then GPU
rows by primary key, then replica rows."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Func
from django.utils import timezone
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from scheduling.metrics import CAS_CONFLICTS, COMMITS
from scheduling.models import GPU
from scheduling.state import DeviceInfo, GPUView, IntentView, OccupantView, Plan, Snapshot


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


# One statement, so PostgreSQL answers from one consistent view: each GPU with its version and,
# built as JSON on the server, its occupants and active intents (no ORM: this is the hot path).
SNAPSHOT_SQL = """
SELECT g.id, n.name, n.status, g.index, g.total_bytes, g.available_bytes, g.version, g.virtual, g.health,
       g.wake_lock_holder_id, g.wake_lock_expires_at,
       COALESCE((SELECT json_agg(json_build_array(o.replica_id, d.name, r.state, o.reserved_bytes, o.since,
                                                  r.last_accessed, r.serving_since,
                                                  d.dedicated OR d.failover_standby, d.popular OR d.failover_standby,
                                                  d.min_runtime_s) ORDER BY o.since, o.id)
                 FROM scheduling_occupant o
                 JOIN scheduling_replica r ON r.id = o.replica_id
                 JOIN scheduling_deployment d ON d.id = r.deployment_id
                 WHERE o.gpu_id = g.id), '[]'),
       COALESCE((SELECT json_agg(json_build_array(i.id, i.waiting_replica_id, d.name, i.needed_bytes, i.deadline,
                                                  i.status) ORDER BY i.created_at, i.id)
                 FROM scheduling_preemptionintent i
                 JOIN scheduling_replica r ON r.id = i.waiting_replica_id
                 JOIN scheduling_deployment d ON d.id = r.deployment_id
                 WHERE i.gpu_id = g.id AND i.status IN ('waiting', 'victim_chosen')), '[]'),
       x.xmin
FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin) x
LEFT JOIN (scheduling_gpu g JOIN scheduling_node n ON n.id = g.node_id) ON {where}
ORDER BY g.id
"""


def _read(where: str, params: list) -> tuple[dict[int, GPUView], int]:
    """GPUs matching `where`, and the xmin of the snapshot they were read in (one statement)."""
    with _cursor() as cursor:
        cursor.execute(SNAPSHOT_SQL.format(where=where), params)
        rows = cursor.fetchall()
    # The xmin comes on every row, and on a row of NULLs when no GPU matched.
    return {row[0]: _gpu_view(row) for row in rows if row[0] is not None}, rows[0][-1]


def _gpu_view(row: tuple) -> GPUView:
    (gpu_id, node, node_status, index, total, available, version, virtual, health, holder, expires) = row[:11]
    occupants, intents = _json(row[11]), _json(row[12])
    return GPUView(
        id=gpu_id,
        node=node,
        node_status=node_status,
        index=index,
        total_bytes=total,
        available_bytes=available,
        version=version,
        virtual=virtual,
        health=health,
        occupants=tuple(
            OccupantView(
                replica_id=o[0],
                deployment=o[1],
                state=o[2],
                reserved_bytes=o[3],
                since=_time(o[4]),
                last_accessed=_time(o[5]),
                serving_since=_time(o[6]),
                dedicated=o[7],
                popular=o[8],
                min_runtime_s=o[9],
            )
            for o in occupants
        ),
        intents=tuple(
            IntentView(id=i[0], replica_id=i[1], deployment=i[2], needed_bytes=i[3], deadline=_time(i[4]), status=i[5])
            for i in intents
        ),
        wake_lock_holder=holder,
        wake_lock_expires_at=expires,
    )


def _json(value: str | list) -> list:
    # json arrives parsed or as text depending on the cursor's loaders.
    return json.loads(value) if isinstance(value, str) else value


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def snapshot(gpu_ids: Iterable[int] | None = None) -> Snapshot:
    """Read GPUs with their versions, occupants and active intents, without locking."""
    if gpu_ids is None:
        gpus, _ = _read("TRUE", [])
    else:
        gpus, _ = _read("g.id = ANY(%s)", [list(gpu_ids)])
    return Snapshot(gpus=gpus, taken_at=timezone.now())


class Mirror:
    """A snapshot kept in memory and refreshed with only the GPUs written since the last read.

    For a loop that decides often (the placement benchmark, a busy scheduler): a full read of
    hundreds of GPUs costs milliseconds, a refresh of the few that changed costs little. It may
    lag a commit that lands between refresh and decision, like any snapshot; the compare-and-swap
    at commit catches that, and the retry refreshes again. Occupant details that change without
    a ledger commit (a replica's state or last access) are refreshed only when their GPU is next
    written, so a decision that weighs them (fairness) should read a fresh `snapshot()` of the
    GPUs it acts on. Not thread-safe: one per thread.
    """

    def __init__(self) -> None:
        self._gpus: dict[int, GPUView] = {}
        self._xmin: int | None = None

    def snapshot(self, gpu_ids: Iterable[int] | None = None) -> Snapshot:
        if self._xmin is None:
            self._gpus, self._xmin = _read("TRUE", [])
        else:
            # Every transaction below the previous read's xmin had finished by then, so whatever
            # committed since carries a changed_txid at or above it: nothing is missed.
            changed, xmin = _read("g.changed_txid >= %s", [self._xmin])
            self._gpus.update(changed)
            self._xmin = xmin
        gpus = self._gpus if gpu_ids is None else {i: self._gpus[i] for i in gpu_ids if i in self._gpus}
        return Snapshot(gpus=dict(gpus), taken_at=timezone.now())

    def forget(self, gpu_ids: Iterable[int]) -> None:
        """Drop GPUs found gone at commit (their node was deleted)."""
        for gpu_id in gpu_ids:
            self._gpus.pop(gpu_id, None)


def _cursor() -> psycopg.Cursor:
    # Server-side binding: psycopg prepares a statement after a few runs, so PostgreSQL stops
    # re-planning the ledger's hot statements (Django's own cursors bind on the client).
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


COMMIT_SQL = (
    "SELECT gpu_id, version, available, outcome FROM gpuportal_ledger_commit(%s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


def commit(plan: Plan, *, apply: Callable[[Plan], None] | None = None) -> CommitResult:
    """Apply `plan` if every GPU it writes still has the version it was planned against.

    The compare-and-swap itself is one call of the server-side function `gpuportal_ledger_commit`
    (migration 0005): lock the GPU rows in primary-key order, check versions, apply, refuse an
    over-commit, recompute available bytes, bump versions, record Events. Alone it is one
    statement and one round trip. `apply` runs in the same transaction right after, so a
    service's writes to other rows (replica state, placement) land with the reservation or not
    at all.
    """
    plan.validate()
    if apply is None and not connection.in_atomic_block:
        rows = _call_commit(plan)
    else:
        with transaction.atomic():
            rows = _call_commit(plan)
            if apply is not None:
                apply(plan)
    COMMITS.inc()
    return CommitResult(
        plan=plan,
        versions={gpu_id: version for gpu_id, version, _, _ in rows},
        available={gpu_id: available for gpu_id, _, available, _ in rows},
    )


def _call_commit(plan: Plan) -> list[tuple[int, int, int, str]]:
    ids = plan.gpu_ids
    args = [
        ids,
        [plan.expected_versions[gpu_id] for gpu_id in ids],
        [plan.labels.get(gpu_id, str(gpu_id)) for gpu_id in ids],
        [r.gpu_id for r in plan.releases],
        [r.replica_id for r in plan.releases],
        [r.gpu_id for r in plan.reservations],
        [r.replica_id for r in plan.reservations],
        [r.reserved_bytes for r in plan.reservations],
        plan.reason,
    ]
    try:
        with _cursor() as cursor:
            cursor.execute(COMMIT_SQL, args)
            rows = cursor.fetchall()
    except psycopg.Error as err:
        over = OVER_COMMIT.search(str(err)) if err.sqlstate == OVER_COMMIT_SQLSTATE else None
        if over is None:
            raise
        gpu_id, total, used = (int(x) for x in over.groups())
        raise OverCommit(plan.labels.get(gpu_id, str(gpu_id)), total, used) from None
    stale = [
        (gpu_id, plan.expected_versions[gpu_id], version)
        for gpu_id, version, _, outcome in rows
        if outcome == "conflict"
    ]
    if stale:
        raise CasConflict(stale)
    return rows


# Raised by gpuportal_ledger_commit (migration 0005) with the GPU, its total and the reservation.
OVER_COMMIT_SQLSTATE = "GP001"
OVER_COMMIT = re.compile(r"gpuportal over-commit (\d+)/(\d+)/(\d+)")


def commit_with_retry(
    decide: Callable[[Snapshot], Plan | None],
    *,
    gpu_ids: Iterable[int] | None = None,
    apply: Callable[[Plan], None] | None = None,
    attempts: int | None = None,
    mirror: Mirror | None = None,
) -> CommitResult | None:
    """Snapshot → decide → commit, again from a fresh snapshot after each conflict.

    `decide` returns None when there is nothing to do. Backoff is jittered so that clients
    that collided do not collide again in lockstep; after `attempts` conflicts the last one
    is raised to the caller. With a `mirror`, snapshots are its incremental refreshes.
    """
    scope = list(gpu_ids) if gpu_ids is not None else None
    take = mirror.snapshot if mirror is not None else snapshot
    retrying = Retrying(
        retry=retry_if_exception_type(CasConflict),
        stop=stop_after_attempt(attempts or settings.GPUPORTAL_CAS_ATTEMPTS),
        wait=wait_random_exponential(multiplier=0.001, max=settings.GPUPORTAL_CAS_BACKOFF_MAX_S),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            plan = decide(take(scope))
            if plan is None:
                return None
            try:
                result = commit(plan, apply=apply)
            except CasConflict as conflict:
                CAS_CONFLICTS.inc()
                if mirror is not None:
                    mirror.forget(gpu_id for gpu_id, _, actual in conflict.stale if actual is None)
                raise
    return replace(result, attempts=retrying.statistics["attempt_number"])


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
        if changes:
            # Stamped like a commit, so mirrors pick up new, resized and lost GPUs.
            GPU.objects.filter(pk__in=[c.gpu_id for c in changes]).update(changed_txid=Func(function="txid_current"))
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
