"""The capacity planner as the product runs it: `manage.py plan` and `POST /api/plan/`
(on the control worker, with progress). What to plan is read here (a trace file's text or the
recorded traffic; a catalogue file or the live deployments; the GPUs the portal has), the
planning itself is scheduling.simulation.planner's, pure."""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from gpuportal.wire import node_labels
from scheduling.core import effects
from scheduling.models import GPU, CapacityPlan, Node
from scheduling.services import outbox, traffic
from scheduling.services.errors import NotFound
from scheduling.simulation import config as sim_config
from scheduling.simulation import planner
from scheduling.simulation.trace import Trace
from scheduling.simulation.traces import (
    CatalogueEntry,
    RowError,
    TraceFileError,
    TraceRow,
    build_trace,
    catalogue_from,
    parse_trace,
)

PLAN_TASK = "scheduling.tasks.plan_capacity"
GiB = 1024**3


@dataclass(frozen=True)
class Inputs:
    trace: Trace
    config: sim_config.Config
    current_gpus: int
    skipped: tuple[RowError, ...]


def prepare(
    *,
    trace_text: str | None = None,
    fmt: str | None = None,
    since: datetime | None = None,
    catalogue: Sequence[CatalogueEntry] | None = None,
    skip_bad: bool = False,
    gpu_memory_gib: float | None = None,
    current_gpus: int | None = None,
    warm_spares: bool | None = None,
) -> Inputs:
    """The trace, config and GPU count to plan with. The trace is a file's text, else the traffic
    recorded since `since`; the catalogue is the one given, else the portal's deployments (with the
    load and wake times they measured). The GPUs are of the kind the portal has most of, and as
    many as it has now, unless told otherwise (the config's cluster when it has none), with warm
    spares where its GPUs keep them (GPUPORTAL_WARM_SPARES), unless told. Raises TraceFileError
    for rows that are not requests, unless `skip_bad`."""
    entries = tuple(catalogue) if catalogue is not None else traffic.live_catalogue()
    known = {e.name for e in entries}
    if trace_text is not None:
        parsed = parse_trace(trace_text, fmt=fmt, known=known)
        rows, errors = parsed.rows, parsed.errors
    else:
        rows, errors = _recorded(since, known)
    if errors and not skip_bad:
        raise TraceFileError("the trace has rows that are not requests (skip them with --skip-bad)", errors)
    if not rows:
        raise TraceFileError("the trace", ["no requests to plan for"])
    config = sim_config.load()
    sizes = Counter(GPU.objects.values_list("total_bytes", flat=True))
    gib = gpu_memory_gib or (sizes.most_common(1)[0][0] / GiB if sizes else config.cluster.gpu_memory_gib)
    gpus = current_gpus or sum(sizes.values()) or config.cluster.gpus
    if warm_spares is None:
        warm_spares = config.cluster.warm_spares or GPU.objects.filter(spare_bytes__gt=0).exists()
    pools, nodes = live_pools()
    cluster = replace(config.cluster, gpu_memory_gib=gib, warm_spares=warm_spares)
    if pools:
        cluster = replace(cluster, pools=pools, pooled_of=nodes)
    config = replace(config, cluster=cluster)
    return Inputs(build_trace(rows, entries, config), config, gpus, tuple(errors))


def live_pools() -> tuple[tuple[sim_config.Pool, ...], int]:
    """The portal's nodes with GPUs as the simulator's pools (those alike in labels and taints,
    as many as there are of each; none where no node is marked), and how many such nodes there
    are: a plan of more or fewer GPUs keeps each pool's share of them."""
    marks = Counter(
        (node_labels.text(labels or {}), node_labels.text(taints or {}))
        for labels, taints in Node.objects.filter(gpus__isnull=False).distinct().values_list("labels", "taints")
    )
    pools = tuple(
        sim_config.Pool(count, labels, taints) for (labels, taints), count in sorted(marks.items()) if labels or taints
    )
    return pools, sum(marks.values())


def _recorded(since: datetime | None, known: set[str]) -> tuple[tuple[TraceRow, ...], tuple[RowError, ...]]:
    traffic.drain()  # what ended a moment ago is planned for too
    rows, errors = [], []
    for row in traffic.trace_rows(since or timezone.now() - timedelta(days=7)):
        if row.deployment in known:
            rows.append(row)
        else:
            errors.append(RowError(row.line, f"unknown deployment {row.deployment!r} (deleted since?)"))
    return tuple(rows), tuple(errors)


def compute(
    inputs: Inputs,
    *,
    target: float | None = None,
    slo_ttft_s: float | None = None,
    policies: Sequence[str] = planner.DEFAULT_POLICIES,
    progress: planner.Progress | None = None,
) -> tuple[planner.Plan, float]:
    """The plan and how long it took (seconds, wall clock: the planner's cost per simulated hour)."""
    began = time.perf_counter()
    result = planner.plan(
        inputs.trace,
        inputs.config,
        current_gpus=inputs.current_gpus,
        target=target,
        slo_ttft_s=slo_ttft_s,
        policies=policies,
        progress=progress,
    )
    return result, time.perf_counter() - began


# --- the API's plans, on the control worker ------------------------------------------------


def submit(
    user: Any, *, trace_text: str | None, fmt: str | None, since: datetime | None, options: dict
) -> CapacityPlan:
    """Check what can be checked at once (the rows, the catalogue), then leave the rest to the
    control worker's task. Raises TraceFileError for a trace or catalogue it cannot use."""
    catalogue = catalogue_from(options["catalogue"]) if options.get("catalogue") is not None else None
    if trace_text is not None:
        known = {e.name for e in (catalogue if catalogue is not None else traffic.live_catalogue())}
        parsed = parse_trace(trace_text, fmt=fmt, known=known)
        if parsed.errors and not options.get("skip_bad"):
            raise TraceFileError("the trace has rows that are not requests (skip them with skip_bad)", parsed.errors)
        if not parsed.rows:
            raise TraceFileError("the trace", ["no requests to plan for"])
    with transaction.atomic():
        plan = CapacityPlan.objects.create(
            requested_by=user if getattr(user, "pk", None) else None,
            trace=trace_text or "",
            since=since,
            options={**options, "format": fmt, "recorded": trace_text is None},
        )
        outbox.want(effects.to_control(PLAN_TASK, plan.pk))
    return plan


def run(plan_id: int) -> str:
    """The control worker's task: compute a submitted plan, writing its progress as it goes."""
    plan = CapacityPlan.objects.filter(pk=plan_id).first()
    if plan is None or plan.state in (CapacityPlan.State.DONE, CapacityPlan.State.FAILED):
        return "nothing to do"
    CapacityPlan.objects.filter(pk=plan_id).update(state=CapacityPlan.State.RUNNING, percent=0)
    options = plan.options
    try:
        catalogue = catalogue_from(options["catalogue"]) if options.get("catalogue") is not None else None
        inputs = prepare(
            trace_text=None if options.get("recorded") else plan.trace,
            fmt=options.get("format"),
            since=plan.since,
            catalogue=catalogue,
            skip_bad=bool(options.get("skip_bad")),
            gpu_memory_gib=options.get("gpu_memory_gib"),
            current_gpus=options.get("current_gpus"),
            warm_spares=options.get("warm_spares"),
        )
        result, elapsed = compute(
            inputs,
            target=options.get("target"),
            slo_ttft_s=options.get("slo_ttft_s"),
            progress=_progress_writer(plan_id),
        )
    except (TraceFileError, ValueError) as err:
        CapacityPlan.objects.filter(pk=plan_id).update(
            state=CapacityPlan.State.FAILED, error=str(err), finished_at=timezone.now()
        )
        return f"failed: {err}"
    CapacityPlan.objects.filter(pk=plan_id).update(
        state=CapacityPlan.State.DONE,
        percent=100,
        result=planner.record(result),
        table=planner.render(result),
        plot_png=planner.plot(result),
        skipped_rows=[str(e) for e in inputs.skipped[:100]],
        elapsed_s=elapsed,
        finished_at=timezone.now(),
    )
    return "done"


def _progress_writer(plan_id: int) -> Callable[[int, int], None]:
    shown = [-1]

    def write(done: int, total: int) -> None:
        # The last few percent are the bounds and the per-deployment runs: 99 until written.
        percent = min(99, int(100 * done / max(1, total)))
        if percent != shown[0]:
            shown[0] = percent
            CapacityPlan.objects.filter(pk=plan_id).update(percent=percent)

    return write


def get(plan_id: int) -> CapacityPlan:
    plan = CapacityPlan.objects.filter(pk=plan_id).first()
    if plan is None:
        raise NotFound(f"no capacity plan {plan_id}")
    return plan


def shown(plan: CapacityPlan) -> dict[str, Any]:
    """The API's answer: the state and progress, then the result, its table and its plot."""
    png = bytes(plan.plot_png) if plan.plot_png else None
    return {
        "id": plan.pk,
        "state": plan.state,
        "percent": plan.percent,
        "error": plan.error,
        "skipped_rows": plan.skipped_rows,
        "result": plan.result,
        "table": plan.table,
        "plot_png": base64.b64encode(png).decode() if png else None,
        "elapsed_s": plan.elapsed_s,
        "created_at": plan.created_at,
        "finished_at": plan.finished_at,
    }
