"""The one commit path (docs/architecture.md, the ledger): snapshot GPUs, let a pure module plan, commit with
compare-and-swap on the GPU rows. A snapshot of every GPU is this process's Mirror, refreshed with
only the GPUs whose view changed since its last read (the services decide on it, so it
must equal a fresh read, which the change stamps the database puts on every row a view is built
from make it), and the compare-and-swap stays the safety net for what lands after.

This module (with the server-side function it calls, `gpuportal_ledger_commit`, whose SQL is in
scheduling/sql/) is the only writer of GPU bytes, versions and Occupant rows; services call it,
nothing else does. Global lock order: deployment rows, then GPU rows by primary key, then replica
rows."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from gpuportal.wire.node_reports import DeviceInfo
from scheduling import locks
from scheduling.core.state import GPUView, IntentView, OccupantView, Plan, Snapshot, SnapshotIndex
from scheduling.metrics import CAS_CONFLICTS, COMMITS
from scheduling.models import GPU


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


# The snapshot read is one call of the server-side function `gpuportal_ledger_read` (migration
# 0020): one statement, so PostgreSQL answers from one consistent view, with each GPU's
# occupants and active intents built as JSON on the server (no ORM: this is the hot path). It
# also returns that view's snapshot (as text), for a Mirror's next read.
READ_SQL = "SELECT * FROM gpuportal_ledger_read(%s, %s::bigint[], %s::bigint[])"

# The server-side functions as the database holds them now: the file of each (scheduling/sql/),
# which the migration that last changed it loaded. A change is a new file and a new migration.
SQL_DIR = Path(__file__).resolve().parent / "sql"
SQL_FUNCTIONS = {
    "gpuportal_ledger_commit": "ledger_commit_v4.sql",
    "gpuportal_ledger_read": "ledger_read_v5.sql",
    "gpuportal_ledger_stamp": "ledger_stamp_v1.sql",
    "gpuportal_ledger_gpus_gone": "ledger_gone_v2.sql",
}

# Where a row of `gpuportal_ledger_read` ends what a view is built from; then whether it was built
# from the reader's own uncommitted writes, the GPU generation (bumped by deletions), and the
# read's snapshot.
VIEW_COLUMNS = 17
INTENTS, MINE, GENERATION = 14, 17, 18


@dataclass(frozen=True)
class _Rows:
    rows: list[tuple]
    seen: str  # the snapshot they were read in, as PostgreSQL writes it
    generation: int  # bumped whenever GPU rows are deleted


def _read(seen: str | None, ids: list[int] | None, again: Iterable[int] = ()) -> _Rows:
    """Rows of the GPUs asked for (`ids`); else of every GPU, or with `seen` of those whose view
    changed since that snapshot, and `again`."""
    args = [seen, None if ids is None else _int_array(ids), _int_array(again) if seen is not None else None]
    with _cursor() as cursor:
        cursor.execute(READ_SQL, args)
        rows = cursor.fetchall()
    # The snapshot and generation come on every row, and on a row of NULLs when no GPU matched.
    return _Rows([row for row in rows if row[0] is not None], rows[0][-1], rows[0][GENERATION])


def _gpu_view(row: tuple, known: dict[tuple, OccupantView] | None = None) -> GPUView:
    """A GPUView from a row of `gpuportal_ledger_read`. `known`, when given, maps raw occupant
    entries to views already built from them: they are reused, and it is updated to hold
    exactly this GPU's, so that a Mirror builds only the occupants that changed."""
    (gpu_id, node, node_status, index, total, available, version, virtual, health, holder, expires) = row[:11]
    context, standby_context, raw_occupants, raw_intents, node_id, foreign = row[11:VIEW_COLUMNS]
    occupants = []
    fresh: dict[tuple, OccupantView] = {}
    for entry in json.loads(raw_occupants) if raw_occupants != "[]" else ():
        key = tuple(entry)
        view = known.get(key) if known is not None else None
        if view is None:
            view = _occupant_view(entry)
        occupants.append(view)
        fresh[key] = view
    if known is not None:
        known.clear()
        known.update(fresh)
    intents = json.loads(raw_intents) if raw_intents != "[]" else ()
    return GPUView(
        id=gpu_id,
        node=node,
        node_id=node_id,
        node_status=node_status,
        index=index,
        # What placement may reserve: other tenants' use is out of its reach (GPUView).
        total_bytes=total - foreign,
        available_bytes=available,
        foreign_bytes=foreign,
        version=version,
        virtual=virtual,
        health=health,
        occupants=tuple(occupants),
        intents=tuple(
            IntentView(id=i[0], replica_id=i[1], deployment=i[2], needed_bytes=i[3], deadline=_time(i[4]), status=i[5])
            for i in intents
        )
        if intents
        else (),
        wake_lock_holder=holder,
        wake_lock_expires_at=expires,
        context_bytes=context,
        standby_context_bytes=standby_context,
    )


def _occupant_view(o: list) -> OccupantView:
    return OccupantView(
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


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


# The views last built from each GPU's row by `read`, by GPU id, with that row: a read that finds
# a row unchanged reuses its view rather than parse and build it again (a few microseconds a GPU).
# Shared by the process's threads; two that race store equal views.
_VIEWS: dict[int, tuple[tuple, GPUView]] = {}


def read(gpu_ids: Iterable[int] | None = None) -> Snapshot:
    """Read GPUs (these, or every one) afresh with their versions, occupants and active intents,
    without locking."""
    gpus = {}
    for row in _read(None, None if gpu_ids is None else list(gpu_ids)).rows:
        raw = row[:VIEW_COLUMNS]
        known = _VIEWS.get(row[0])
        if known is not None and known[0] == raw:
            gpus[row[0]] = known[1]
        else:
            gpus[row[0]] = view = _gpu_view(row)
            _VIEWS[row[0]] = (raw, view)
    return Snapshot(gpus=gpus, taken_at=timezone.now())


def snapshot(gpu_ids: Iterable[int] | None = None) -> Snapshot:
    """Every GPU, from this process's Mirror brought up to date (what a fresh `read()` would return,
    for a few changed rows' cost); or only `gpu_ids`, read afresh. Without locking."""
    if gpu_ids is not None:
        return read(gpu_ids)
    return mirror().snapshot()


class Mirror:
    """A snapshot of every GPU kept in memory, refreshed with only the GPUs whose view changed
    since its last read: equal to a fresh `read()` taken at the refresh, for a few rows' cost.

    A view changes when a row it is built from does, and the database stamps each such row with
    the transaction that changed it (`gpuportal_ledger_stamp`): the GPU row (a commit, a wake
    lock, an inventory change), its node's status, an occupant's replica (its state, last access,
    serving since) or deployment (its fairness settings). Active preemption intents, which leave
    nothing to stamp when deleted, are read every time. A view built from this process's own
    uncommitted writes is read again next time, since its transaction may roll back. A deleted
    GPU leaves no stamp either: deletions bump a generation, and a refresh that finds it changed
    reads everything.

    Like any snapshot it may lag a commit that lands between refresh and decision; the
    compare-and-swap at commit catches that, and the retry refreshes again.

    The threads of a process share one (`mirror()`), each refresh on the caller's connection and
    in its transaction, one at a time: a refresh then reads only what changed since the last one,
    whichever thread took it, where a Mirror per thread read what changed since that thread's own
    last (the web's threads take turns leading the scale batches, so each read about as many
    batches' changes as there are threads). Sharing is sound because what a read returns is
    judged by the snapshots themselves, not by who read: a refresh returns every row stamped by a
    transaction the previous snapshot did not see as committed (the caller's own included, since
    a read lists its own transaction as running), so another thread's uncommitted writes come back
    once they commit, and views built from one thread's own uncommitted writes are read again by
    the next refresh, whoever makes it, in that caller's transaction.
    """

    def __init__(self) -> None:
        self._gpus: dict[int, GPUView] = {}
        # Per GPU, the raw row it was built from and its occupants by raw entry: a GPU read again
        # unchanged (a refresh can return one) costs a comparison, a changed one rebuilds only
        # the occupants that changed. Building views is most of a refresh's cost in Python.
        self._rows: dict[int, tuple] = {}
        self._occupants: dict[int, dict[tuple, OccupantView]] = {}
        self._seen: str | None = None  # the snapshot of the last read, as PostgreSQL writes it
        self._generation: int | None = None  # the GPU generation the last read found
        # GPUs to read next time whatever their stamps: those built from this process's own
        # uncommitted writes, and those with active intents (which carry no stamp).
        self._again: set[int] = set()
        # The index of the whole-cluster snapshot last handed out, patched with what changed
        # since rather than rebuilt (placement's lookups; SnapshotIndex.updated). None: rebuild.
        self._index: SnapshotIndex | None = None
        # Refreshes one at a time, so that each statement's snapshot is taken after the one before
        # it (what the stamps are judged against); reentrant for a refresh that starts over.
        self._lock = threading.RLock()
        # How long a snapshot waits for another thread's refresh before it reads every GPU afresh
        # itself: a refresh is one round trip, so only a stuck one (a connection to a database
        # gone quiet) is waited out, and the threads behind it are not held up by it.
        self.wait_s = 1.0

    def snapshot(self, gpu_ids: Iterable[int] | None = None) -> Snapshot:
        if not self._lock.acquire(timeout=self.wait_s):
            return read(gpu_ids)
        try:
            self._refresh()
            now = timezone.now()
            if gpu_ids is not None:
                return Snapshot(gpus={i: self._gpus[i] for i in gpu_ids if i in self._gpus}, taken_at=now)
            gpus = dict(self._gpus)
            if self._index is None:
                self._index = SnapshotIndex.build(gpus)
            return Snapshot.indexed(gpus, now, self._index)
        finally:
            self._lock.release()

    def _refresh(self) -> None:
        # The first read is a full one; later ones return only the GPUs whose views changed
        # since, and those asked for again (gpuportal_ledger_read says why that misses nothing).
        full = self._seen is None
        asked = sorted(self._again)
        read = _read(self._seen, None, asked)
        if not full and read.generation != self._generation:
            # GPUs were deleted since (or a deletion this mirror saw was rolled back): read all.
            self._seen = None
            self._refresh()
            return
        self._seen, self._generation, self._again = read.seen, read.generation, set()
        changed = []
        returned = set()
        for row in read.rows:
            gpu_id = row[0]
            returned.add(gpu_id)
            if row[MINE] or row[INTENTS] != "[]":
                self._again.add(gpu_id)
            if self._rows.get(gpu_id) == row[:VIEW_COLUMNS]:
                continue
            self._gpus[gpu_id] = view = _gpu_view(row, self._occupants.setdefault(gpu_id, {}))
            self._rows[gpu_id] = row[:VIEW_COLUMNS]
            changed.append(view)
        if self._index is not None:
            self._index = self._index.updated(changed)
        # Gone: on a full read, what it did not return; else what was asked for again and not
        # found (a GPU its own transaction inserted, rolled back since).
        self.forget((set(self._gpus) if full else set(asked)) - returned)

    def forget(self, gpu_ids: Iterable[int]) -> None:
        """Drop GPUs found gone (their node was deleted)."""
        with self._lock:
            for gpu_id in gpu_ids:
                if self._gpus.pop(gpu_id, None) is not None:
                    self._index = None  # a GPU gone: the next snapshot builds its index anew
                self._rows.pop(gpu_id, None)
                self._occupants.pop(gpu_id, None)
                self._again.discard(gpu_id)


# This process's Mirror of each database its threads read (tests and benchmarks switch databases).
_mirrors: dict[tuple, Mirror] = {}
_mirrors_lock = threading.Lock()


def mirror() -> Mirror:
    """This process's Mirror of the database the calling thread's connection points at."""
    params = connection.settings_dict
    key = (connection.alias, params.get("HOST"), params.get("PORT"), params.get("NAME"))
    found = _mirrors.get(key)
    if found is None:
        with _mirrors_lock:
            found = _mirrors.setdefault(key, Mirror())
    return found


def _forget_mirrors() -> None:
    # A child forked while another thread of its parent refreshed would inherit that Mirror's
    # lock held by a thread it does not have: it starts with none.
    global _mirrors_lock
    _mirrors.clear()
    _mirrors_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_mirrors)


def _cursor() -> psycopg.Cursor:
    # Server-side binding: psycopg prepares a statement after a few runs, so PostgreSQL stops
    # re-planning the ledger's hot statements (Django's own cursors bind on the client).
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


# The arrays go as text in PostgreSQL's array syntax, cast on the server: psycopg's own list
# adaptation inspects every element to choose a type, which cost more client CPU than the rest
# of the call (about 45 µs of 70 per commit).
COMMIT_SQL = (
    "SELECT gpu_id, version, available, outcome FROM gpuportal_ledger_commit("
    "%s::bigint[], %s::bigint[], %s::text[], %s::bigint[], %s::text[], %s::bigint[], %s::text[], %s::bigint[], %s)"
)


def _int_array(values: Iterable[int]) -> str:
    return "{" + ",".join(str(int(v)) for v in values) + "}"


def _text_array(values: Iterable[str]) -> str:
    # Every element double-quoted, with backslash before backslash and double quote: the array
    # syntax's own escaping, so commas, braces, spaces and empty strings arrive unchanged.
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


def commit(plan: Plan, *, apply: Callable[[Plan], None] | None = None) -> CommitResult:
    """Apply `plan` if every GPU it writes still has the version it was planned against.

    The compare-and-swap itself is one call of the server-side function `gpuportal_ledger_commit`
    (migrations 0005 and 0011): lock the GPU rows in primary-key order, check versions, apply, refuse an
    over-commit, recompute available bytes, bump versions, record Events. Alone it is one
    statement and one round trip. `apply` runs in the same transaction right after, so a
    service's writes to other rows (replica state, placement) land with the reservation or not
    at all.
    """
    plan.validate()
    if apply is None and not connection.in_atomic_block:
        rows = _call_commit(plan)
    else:
        # No savepoint (two round trips of a commit's ten): a refused commit undoes itself in the
        # database and is raised only once this block is left, so the caller's transaction goes
        # on (to plan again); an error in `apply` leaves that transaction to roll back whole, as
        # the half of a decision it holds must.
        with transaction.atomic(savepoint=False):
            rows = _call_commit(plan, refuse=False)
            refusal = _refusal(plan, rows)
            if refusal is None and apply is not None:
                apply(plan)
        if refusal is not None:
            raise refusal
    COMMITS.inc()
    return CommitResult(
        plan=plan,
        versions={gpu_id: version for gpu_id, version, _, _ in rows},
        available={gpu_id: available for gpu_id, _, available, _ in rows},
    )


def _call_commit(plan: Plan, *, refuse: bool = True) -> list[tuple[int, int, int, str]]:
    """The commit function's rows; a refusal (CasConflict, OverCommit) raised unless `refuse` is
    False (the caller asks `_refusal`)."""
    ids = plan.gpu_ids  # ascending: the function's lock order and over-commit report rely on it
    args = [
        _int_array(ids),
        _int_array(plan.expected_versions[gpu_id] for gpu_id in ids),
        _text_array(plan.labels.get(gpu_id, str(gpu_id)) for gpu_id in ids),
        _int_array(r.gpu_id for r in plan.releases),
        _text_array(r.replica_id for r in plan.releases),
        _int_array(r.gpu_id for r in plan.reservations),
        _text_array(r.replica_id for r in plan.reservations),
        _int_array(r.reserved_bytes for r in plan.reservations),
        plan.reason,
    ]
    with _cursor() as cursor:
        cursor.execute(COMMIT_SQL, args)
        rows = cursor.fetchall()
    refusal = _refusal(plan, rows) if refuse else None
    if refusal is not None:
        raise refusal
    return rows


def _refusal(plan: Plan, rows: list[tuple[int, int, int, str]]) -> CasConflict | OverCommit | None:
    """Why the commit function refused the plan (it then wrote nothing), or None: a GPU found
    changed (each one's version planned on and found), or the GPU it would over-commit."""
    for gpu_id, total, used, outcome in rows:
        if outcome == "over-commit":
            return OverCommit(plan.labels.get(gpu_id, str(gpu_id)), total, used)
    stale = [
        (gpu_id, plan.expected_versions[gpu_id], version)
        for gpu_id, version, _, outcome in rows
        if outcome == "conflict"
    ]
    return CasConflict(stale) if stale else None


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
    is raised to the caller. Snapshots are `snapshot(gpu_ids)`'s (every GPU: this process's
    Mirror), or refreshes of the `mirror` given.
    """
    scope = list(gpu_ids) if gpu_ids is not None else None
    take = mirror.snapshot if mirror is not None else snapshot
    limit = attempts or settings.GPUPORTAL_CAS_ATTEMPTS
    # A plain loop rather than a retry library: this runs on every placement, and building and
    # driving a tenacity Retrying cost more than the loop's own work.
    attempt = 1
    while True:
        plan = decide(take(scope))
        if plan is None:
            return None
        try:
            result = commit(plan, apply=apply)
        except CasConflict as conflict:
            CAS_CONFLICTS.inc()
            if mirror is not None:
                mirror.forget(gpu_id for gpu_id, _, actual in conflict.stale if actual is None)
            if attempt >= limit:
                raise
            # Full jitter under an exponential bound: 1 ms, 2 ms, 4 ms ... up to the maximum.
            time.sleep(random.uniform(0, min(settings.GPUPORTAL_CAS_BACKOFF_MAX_S, 0.001 * 2 ** (attempt - 1))))
            attempt += 1
            continue
        return result if attempt == 1 else replace(result, attempts=attempt)


# -- wake locks: who may wake a replica onto a GPU; the caller holds the GPU rows -----------------


def hold_wake_lock(gpu_id: int, holder_id: str, expires: datetime, *, fresh: bool) -> None:
    """The GPU's wake lock is `holder_id`'s until `expires`. `fresh` (taken, or taken over, rather
    than renewed) bumps the GPU's version: placements keep off a GPU another wake holds
    (planning.withhold_locked), so a plan made from a snapshot older than this lock must
    conflict at commit and look again."""
    changes: dict = {"wake_lock_holder_id": holder_id, "wake_lock_expires_at": expires}
    if fresh:
        changes["version"] = F("version") + 1
    # Every write of a GPU row is stamped by the database (gpuportal_ledger_stamp), so Mirrors
    # see the lock, its renewal and its release, bumped or not.
    GPU.objects.filter(pk=gpu_id).update(**changes)


def extend_wake_locks(gpu_ids: list[int], expires: datetime) -> None:
    """Renew locks their holder still holds: no version bump (a plan made before the renewal is
    as safe as one made after)."""
    GPU.objects.filter(pk__in=gpu_ids).update(wake_lock_expires_at=expires)


def release_wake_lock(gpu_id: int) -> None:
    """The wake is over. No version bump: a GPU freed of a lock only widens what plans may use."""
    GPU.objects.filter(pk=gpu_id).update(wake_lock_holder=None, wake_lock_expires_at=None)


# -- other tenants: memory on a GPU that no replica of the portal holds -------------------------


@dataclass(frozen=True)
class ForeignChange:
    """Other tenants' use of one GPU, recorded: before and after, with the GPU's books then."""

    gpu_id: int
    before: int
    after: int
    total_bytes: int
    reserved_bytes: int  # what the portal's occupants reserve there
    available_before: int
    available_after: int


def record_foreign(gpu_id: int, foreign_bytes: int) -> ForeignChange | None:
    """Other tenants now hold `foreign_bytes` on this GPU: it leaves placement's reach, as an
    occupant the portal does not own would. Under the GPU's row lock, like a commit: the version
    is bumped, so a plan made against the old figure conflicts and plans again. None when the GPU
    is gone. One row, in the caller's transaction (or its own): it cannot close a circle of
    waits with a commit that locks GPUs in primary-key order."""
    if foreign_bytes < 0:
        raise ValueError(f"foreign_bytes must be >= 0, got {foreign_bytes}")
    with transaction.atomic():
        locked = locks.lock_gpus([gpu_id])
        if not locked:
            return None
        gpu = locked[0]
        reserved = sum(gpu.occupants.values_list("reserved_bytes", flat=True))
        available = max(0, gpu.total_bytes - foreign_bytes - reserved)
        GPU.objects.filter(pk=gpu_id).update(
            foreign_bytes=foreign_bytes, available_bytes=available, version=F("version") + 1
        )
    return ForeignChange(
        gpu_id, gpu.foreign_bytes, foreign_bytes, gpu.total_bytes, reserved, gpu.available_bytes, available
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
        existing = {g.index: g for g in locks.lock_node_gpus(node_id)}
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
                    **_accounting_fields(device),
                )
                changes.append(InventoryChange(gpu.pk, label, "added", None, _inventory_fields(gpu)))
                continue
            before = _inventory_fields(gpu)
            reserved = sum(gpu.occupants.values_list("reserved_bytes", flat=True))
            gpu.uuid, gpu.product, gpu.virtual = device.uuid, device.product, device.virtual
            for name, value in _accounting_fields(device).items():
                setattr(gpu, name, value)
            if gpu.total_bytes != device.total_bytes:
                gpu.total_bytes = device.total_bytes
                # Occupants that no longer fit stay recorded; the GPU shows as degraded and has
                # nothing available until they are released, rather than violating the CHECK.
                # Other tenants' use stays out of reach whatever the size.
                gpu.available_bytes = max(device.total_bytes - gpu.foreign_bytes - reserved, 0)
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
    # New, resized and lost GPUs reach Mirrors by the stamp the database puts on every GPU write.
    return changes


def _accounting_fields(device: DeviceInfo) -> dict:
    """What a registration says of the GPU's accounting; a context the agent did not measure
    (None) leaves the row's own, which its replicas measured, or the default."""
    fields: dict = {"nvml_total_bytes": device.nvml_total_bytes}
    if device.context_bytes is not None:
        fields["context_bytes"] = device.context_bytes
    if device.standby_context_bytes is not None:
        fields["standby_context_bytes"] = device.standby_context_bytes
    return fields


def _inventory_fields(gpu: GPU) -> dict:
    return {
        "uuid": gpu.uuid,
        "product": gpu.product,
        "total_bytes": gpu.total_bytes,
        "available_bytes": gpu.available_bytes,
        "health": gpu.health,
        "virtual": gpu.virtual,
    }
