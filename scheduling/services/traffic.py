"""The portal's recorded traffic: every ended request's record, pushed onto Redis by the
request-ending script (gpuportal.wire.requestqueue._END), drained here into RequestRecord rows,
pruned after GPUPORTAL_REQUEST_RECORD_RETENTION_S, and read back as a trace file's rows and a
catalogue of the live deployments (what `export_trace` writes and the planner reads)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire import memory
from gpuportal.wire.requestqueue import COUNT_KIND, records_key
from scheduling import ledger
from scheduling.core.state import Snapshot
from scheduling.models import Deployment, Node, RequestRecord
from scheduling.services import placing
from scheduling.services.queueing import queue
from scheduling.simulation.traces import CatalogueEntry, TraceRow

log = logging.getLogger(__name__)

BATCH = 1000
# One drain moves at most this many batches, so that a backlog is worked off over a few runs of
# the beat task rather than in one that outlives its interval.
MAX_BATCHES = 50


def drain(batch: int = BATCH, max_batches: int = MAX_BATCHES) -> int:
    """Move the records of ended requests from Redis into PostgreSQL, oldest first in each list
    (the web's, and each node's: records_key); the count. A record is removed from Redis only
    once stored, and a record stored twice (a drain that died between the two steps) is one row:
    the request id is unique."""
    moved, batches = 0, max_batches
    q = queue()
    # Every node the books know, offline ones too (their lists may still hold records); only those
    # holding any are read, one round trip telling which.
    nodes = Node.objects.order_by("name").values_list("name", flat=True)
    held = q.record_counts([records_key(), *(records_key(name) for name in nodes)])
    for key in (key for key, count in held.items() if count):
        while batches > 0:
            batches -= 1
            raw = q.raw_records(batch, key)
            if not raw:
                break
            rows = [r for r in (_row(_parsed(item)) for item in raw) if r is not None]
            with transaction.atomic():
                RequestRecord.objects.bulk_create(rows, ignore_conflicts=True)
            q.drop_raw_records(raw, key)
            moved += len(rows)
            if len(raw) < batch:
                break
    return moved


def prune(now: datetime | None = None) -> int:
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.GPUPORTAL_REQUEST_RECORD_RETENTION_S)
    deleted, _ = RequestRecord.objects.filter(created_at__lt=cutoff).delete()
    return deleted


def record_requests() -> dict[str, int]:
    """The beat task's work: drain, then prune."""
    return {"drained": drain(), "pruned": prune()}


def trace_rows(
    since: datetime, until: datetime | None = None, *, statuses: Iterable[str] = ("done",)
) -> Iterator[TraceRow]:
    """Recorded requests as a trace's rows: arrival is when the portal accepted the request.
    Only those with both token counts (a request that failed or was cancelled has no answer)."""
    records = RequestRecord.objects.filter(
        created_at__gte=since, status__in=list(statuses), prompt_tokens__isnull=False, output_tokens__gte=1
    )
    if until is not None:
        records = records.filter(created_at__lt=until)
    values = records.order_by("created_at", "id").values_list(
        "created_at", "deployment", "prompt_tokens", "output_tokens"
    )
    for n, (created, deployment, prompt, output) in enumerate(values.iterator(chunk_size=5000), start=1):
        yield TraceRow(n, created.timestamp(), deployment, prompt, output)


def skipped_count(since: datetime, until: datetime | None = None) -> int:
    """Recorded requests `trace_rows` leaves out: ended without an answer's token counts (but
    token counts, which ask for no answer)."""
    records = (
        RequestRecord.objects.filter(created_at__gte=since)
        .exclude(status="done", prompt_tokens__isnull=False, output_tokens__gte=1)
        .exclude(kind=COUNT_KIND)
    )
    if until is not None:
        records = records.filter(created_at__lt=until)
    return records.count()


def live_catalogue() -> tuple[CatalogueEntry, ...]:
    """The portal's deployments as a catalogue: their bytes (weights, and the memory need in its
    order of trust), settings, and the load and wake times their replicas measured."""
    snap = ledger.snapshot()
    return tuple(catalogue_entry(d, snap) for d in Deployment.objects.select_related("observed").order_by("name"))


def catalogue_entry(d: Deployment, snapshot: Snapshot | None = None) -> CatalogueEntry:
    """One deployment as the planner sees it; the live wake path reads its reload times from the
    same entry (services.sleep), so that both judge a deployment by the same figures. With
    `snapshot`, its need is what one replica reserves (placing.need_bytes: under its memory
    policy, with the CUDA context, and a failover standby's) as those GPUs count it; without one
    the need is left out (the wake path reads only the reload times, which come from the weights)."""
    need = _reserved_need(d, snapshot) if snapshot is not None else None
    weights = weight_bytes_of(d)
    return CatalogueEntry(
        name=d.name,
        dtype=d.dtype,
        weight_bytes=weights,
        need_bytes=need or None,
        popular=d.popular,
        dedicated=d.dedicated,
        min_runtime_s=d.min_runtime_s,
        max_wait_s=d.max_wait_s,
        idle_timeout_s=d.idle_timeout_s,
        load_s=d.observed.measured_load_s,
        wake_s=d.observed.measured_wake_s,
        # One scaled to 0 still has its requests planned for: a request brings one back.
        replicas=max(1, d.replicas_wanted),
        autoscale=d.autoscale_policy,
        node_selector=d.placement_node_selector,
        tolerations=d.placement_tolerations,
    )


def weight_bytes_of(d: Deployment) -> int:
    """What the cost model moves for a load or a wake of the deployment: its weights as read from
    its files, else most of its need (an older row read none), never nothing."""
    return d.observed.weight_bytes or int((d.memory_need_bytes or 0) * 0.8) or memory.MiB


def _reserved_need(d: Deployment, snapshot: Snapshot) -> int | None:
    # The planner fits replicas onto GPUs by this figure: the bare model size (an override, an
    # estimate) left out the context each replica's reservation holds, 0.3-0.8 GB on an H100.
    try:
        return placing.need_bytes(d, snapshot).bytes
    except ValueError:  # no figure at all yet (a deployment still being inspected)
        return None


def _parsed(raw: bytes) -> dict[str, Any]:
    try:
        found = json.loads(raw)
    except ValueError:
        return {"unreadable": raw[:200]}  # dropped by _row, with a warning
    return found if isinstance(found, dict) else {"unreadable": found}


def _row(record: dict[str, Any]) -> RequestRecord | None:
    try:
        return RequestRecord(
            request_id=str(record["id"]),
            deployment=str(record.get("deployment") or ""),
            kind=str(record.get("kind") or ""),
            status=str(record.get("status") or ""),
            created_at=_required_stamp(record.get("created_at")),
            started_at=_stamp(record.get("started_at")),
            finished_at=_stamp(record.get("finished_at")),
            first_token_at=_stamp(record.get("first_token_at")),
            prompt_tokens=_tokens(record.get("prompt_tokens")),
            output_tokens=_tokens(record.get("output_tokens")),
        )
    except (KeyError, TypeError, ValueError) as err:
        # A record this code cannot read (written by another version) is dropped, said once.
        log.warning("dropped an unreadable request record %r: %s", record, err)
        return None


def _required_stamp(value: Any) -> datetime:
    stamp = _stamp(value)
    if stamp is None:
        raise ValueError("no created_at")
    return stamp


def _stamp(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    return datetime.fromtimestamp(float(value), UTC)


def _tokens(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    number = int(value)
    return number if number >= 0 else None
