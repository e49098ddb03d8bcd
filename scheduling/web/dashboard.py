"""The operator's dashboard: one admin page showing where every byte of every GPU went
and why, with the controls beside it.

Reads come from `selectors` in a fixed number of queries whatever the number of rows (the test
holds it to that with 8 nodes × 8 GPUs and 100 deployments); Redis figures (queue depth, requests
per minute, KV pools) are one round trip each. The controls are in `dashboard_controls`."""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import wraps
from typing import Any

import redis
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.models import User
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db.models import Count, F, Max
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from gpuportal.wire import deployment_spec, node_labels, states
from gpuportal.wire.states import FailoverState
from gpuportal.wire.states import ReplicaState as S
from scheduling import requeststats, selectors
from scheduling.models import GPU, Deployment, Event, FailoverLease, Replica
from scheduling.services import autoscaling, host_cache, traffic_stats
from scheduling.services import requests as request_services

EVENT_LIMIT = 50
# The requests the page lists: those replicas hold, then the oldest waiting.
REQUEST_LIMIT = 50

# Which bar segment an occupant's replica state falls in (five colours with the free one): a
# segment is named for the state it shows, the states on their way to it drawn with it.
SEGMENT_OF_STATE = {
    S.SERVING: S.SERVING,
    S.PENDING: S.WAKING,
    S.LOADING: S.WAKING,
    S.WAKING: S.WAKING,
    S.DRAINING: S.DRAINING,
    S.STOPPING: S.DRAINING,
    # What a sleeping replica (or a standby, loaded then slept) still holds: its CUDA context.
    S.SLEEPING: S.SLEEPING,
    S.STANDBY: S.SLEEPING,
}
SEGMENT_ORDER = (S.SERVING, S.WAKING, S.DRAINING, S.SLEEPING)


def deployment_hue(name: str) -> int:
    """A deployment's own colour in the bars, the same on every page and refresh: a
    hue from its name, stepped by the golden angle so that names alike land far apart."""
    return round(zlib.crc32(name.encode()) * 137.508) % 360


# Two deployments' colours at least this far apart on the colour wheel, where the wheel has room;
# and how many golden-angle steps from its own hue a deployment's colour may be looked for.
MIN_HUE_APART = 30
HUE_CANDIDATES = 36


def hue_distance(a: int, b: int) -> int:
    """Degrees between two hues, the short way round the colour wheel."""
    return min(abs(a - b), 360 - abs(a - b))


def deployment_hues(names: Iterable[str]) -> dict[str, int]:
    """The colours of the deployments on one page: each its name's own hue, moved on by the golden
    angle while it is near one already given (names taken in order, so the same deployments get
    the same colours on every refresh). Two names' hues alone can land a few degrees apart and
    read as one colour. Past about ten deployments the wheel has no more room for 30 degrees
    between each: each then takes the hue farthest from those given."""
    given: dict[str, int] = {}

    def apart(hue: int) -> int:
        return min((hue_distance(hue, h) for h in given.values()), default=360)

    for name in sorted(set(names)):
        own = deployment_hue(name)
        candidates = [round(own + step * 137.508) % 360 for step in range(HUE_CANDIDATES)]
        # The first far enough from every colour given; failing that, the one farthest from them.
        far = [hue for hue in candidates if apart(hue) >= MIN_HUE_APART]
        given[name] = far[0] if far else max(candidates, key=apart)
    return given


def striped(hues: dict[str, int]) -> set[str]:
    """The deployments painted with stripes over their colour: those whose colour lies within
    MIN_HUE_APART of one given before it (names in order), which past about ten deployments the
    colour wheel cannot keep apart by hue alone. A colour, then a pattern: any number stay told
    apart from their neighbours."""
    seen: list[int] = []
    marked: set[str] = set()
    for name in sorted(hues):
        hue = hues[name]
        if any(hue_distance(hue, h) < MIN_HUE_APART for h in seen):
            marked.add(name)
        seen.append(hue)
    return marked


def human_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class Segment:
    kind: str  # serving, waking, draining, sleeping, free, foreign (other tenants)
    bytes: int
    percent: float
    deployment: str = ""
    replica: str = ""
    state: str = ""
    measured: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "free":
            return f"free {human_bytes(self.bytes)}"
        if self.kind == "foreign":
            return f"other tenants {human_bytes(self.bytes)}"
        if self.kind == "spare":
            return f"warm spare {human_bytes(self.bytes)}"
        measured = f", measured {human_bytes(self.measured)}" if self.measured is not None else ""
        return f"{self.deployment} ({self.state}): reserved {human_bytes(self.bytes)}{measured}"

    @property
    def short(self) -> str:
        """What fits in the bar itself: the full label is its tooltip and in the legend."""
        if self.kind in ("free", "foreign", "spare"):
            return self.label
        return f"{self.deployment} · {self.state} · {human_bytes(self.bytes)}"

    # Its deployment's colour on this page (deployment_hues), given once every segment is known,
    # and whether stripes tell it from a deployment of a near colour (`striped`).
    hue: int | None = None
    striped: bool = False


@dataclass
class GpuRow:
    gpu: GPU
    segments: list[Segment]
    occupants: list[Segment]

    @property
    def label(self) -> str:
        return f"{self.gpu.node.name}/{self.gpu.index}"

    @property
    def others_bytes(self) -> int:
        """What other tenants hold: foreign_bytes less the node's own warm spare."""
        return _outside(self.gpu)[1]


@dataclass
class NodeRow:
    name: str
    status: str
    heartbeat_age_s: float | None
    virtual: bool
    gpus: list[GpuRow] = field(default_factory=list)
    # Its host cache: what sleeping weights (and kept arenas) use of the budget its
    # agent reported, and of that the arenas serving replicas keep for their next sleep.
    host_used: int = 0
    host_budget: int = 0
    host_kept: int = 0
    # Its labels and taints, `key=value,...` (what deployments' node selectors match, and what
    # their tolerations must name), and of them those operators set (its form's); "" none.
    labels: str = ""
    taints: str = ""
    operator_labels: str = ""
    operator_taints: str = ""

    @property
    def drained(self) -> bool:
        return self.status == states.NodeStatus.DRAINING


def _gpu_row(gpu: GPU) -> GpuRow:
    total = gpu.total_bytes or 1
    occupants = []
    for occ in sorted(gpu.occupants.all(), key=lambda o: (o.replica.deployment.name, o.replica_id)):
        replica = occ.replica
        holding = replica.state in states.HOLDING_WEIGHTS
        measured = replica.deployment.observed.memory_measured_bytes if holding else None
        occupants.append(
            Segment(
                kind=SEGMENT_OF_STATE.get(replica.state, S.DRAINING),
                bytes=occ.reserved_bytes,
                percent=round(100 * occ.reserved_bytes / total, 2),
                deployment=replica.deployment.name,
                replica=replica.id,
                state=replica.state,
                measured=measured,
            )
        )
    free = Segment(kind="free", bytes=gpu.available_bytes, percent=round(100 * gpu.available_bytes / total, 2))
    segments = sorted(occupants, key=lambda s: SEGMENT_ORDER.index(s.kind) if s.kind in SEGMENT_ORDER else 9)
    # Other tenants' memory at the end of the bar, beside what is free but never part of it, and
    # the node's warm spare (inference.spare_pool), which placement keeps out of as well.
    spare, others = _outside(gpu)
    outside = [
        Segment(kind=kind, bytes=held, percent=round(100 * held / total, 2))
        for kind, held in (("spare", spare), ("foreign", others))
        if held
    ]
    return GpuRow(gpu=gpu, segments=[*segments, free, *outside], occupants=occupants)


def _outside(gpu: GPU) -> tuple[int, int]:
    """What placement keeps out of besides the reservations: the node's warm spare, and what
    other tenants hold (foreign_bytes counts both)."""
    spare = min(gpu.spare_bytes, gpu.foreign_bytes)
    return spare, gpu.foreign_bytes - spare


def _heartbeat_age(last: datetime | None, now: datetime) -> float | None:
    return None if last is None else max(0.0, (now - last).total_seconds())


def _deployment_rows() -> list[dict[str, Any]]:
    """100 deployments in three queries: the rows, replica counts by state, last accesses."""
    rows = list(
        Deployment.objects.order_by("name").values(
            "name",
            "replicas_wanted",
            "failover_standby",
            "autoscale_min_replicas",
            "autoscale_max_replicas",
            # Under the names the page has always read them by: one join, no query of its own.
            failed_reason=F("observed__failed_reason"),
            load_failures=F("observed__load_failures"),
            retry_at=F("observed__retry_at"),
            restart_since=F("observed__restart_since"),
            restart_only=F("observed__restart_only"),
        )
    )
    by_state: dict[str, Counter[str]] = defaultdict(Counter)
    for name, state, n in Replica.objects.values_list("deployment__name", "state").annotate(n=Count("pk")).order_by():
        by_state[name][state] = n
    last = dict(Replica.objects.values_list("deployment__name").annotate(last=Max("last_accessed")).order_by())
    names = [row["name"] for row in rows]
    rates = requeststats.per_minute(names)
    latency = {t.deployment: t.latency_s for t in traffic_stats.stats(traffic_stats.METRICS_WINDOW_S)}
    depths = _queue_depths(names)
    loads = autoscaling.last_loads() if any(row["autoscale_max_replicas"] for row in rows) else {}
    for row in rows:
        name = row["name"]
        row["states"] = sorted(by_state[name].items())
        row["last_access"] = last.get(name)
        row["rpm"] = rates.get(name)
        row["latency_p95_s"] = quantiles.p95 if (quantiles := latency.get(name)) is not None else None
        row["queue_depth"] = depths.get(name)
        row["autoscale_load"] = loads.get(name)
    return rows


def _queue_depths(names: list[str]) -> dict[str, int]:
    """services.requests.queue_depth for every deployment, batched: one pipeline of LLENs rather
    than a round trip per row. {} when Redis cannot be read (the page shows "–")."""
    from redis.exceptions import RedisError

    try:
        return request_services.queue().depths(names)
    except RedisError:
        return {}


def _pairs() -> list[dict[str, Any]]:
    leases = FailoverLease.objects.select_related("deployment").prefetch_related("members")
    pairs = []
    for lease in leases:
        members = [m for m in lease.members.all() if m.state not in states.ENDED]
        active = [m for m in members if m.failover_state == FailoverState.ACTIVE]
        standby = [m for m in members if m.failover_state != FailoverState.ACTIVE]
        pairs.append({"lease": lease, "active": active, "standby": standby})
    return pairs


def _live_requests(replicas: list[Replica], names: list[str]) -> tuple[list[dict[str, Any]], int | None]:
    """The requests replicas generate, then those waiting for the deployments `names`, oldest
    first (at most REQUEST_LIMIT), and how many there are in all (None when Redis cannot say):
    two round trips to Redis, one query for their owners' names."""
    try:
        found, total = request_services.queue().live_requests([r.id for r in replicas], names, REQUEST_LIMIT)
    except redis.RedisError:  # the rest of the page does without them
        return [], None
    owners = {r.owner for r in found if r.owner.isdigit()}
    usernames = {str(pk): name for pk, name in User.objects.filter(pk__in=owners).values_list("pk", "username")}
    held = {"dispatched": 0, "running": 0}
    rows = [
        {
            "id": r.id,
            "deployment": r.deployment,
            "owner": usernames.get(r.owner, r.owner or "–"),
            "status": r.status,
            "replica": r.replica,
            "created_at": datetime.fromtimestamp(r.created_at, tz=UTC) if r.created_at else None,
            "started_at": datetime.fromtimestamp(r.started_at, tz=UTC) if r.started_at else None,
        }
        for r in sorted(found, key=lambda r: (r.status not in held, r.created_at or 0.0))
    ]
    return rows, total


def event_filters(request: HttpRequest) -> dict[str, str]:
    return {key: request.GET.get(key, "").strip() for key in ("kind", "deployment", "gpu")}


def context(request: HttpRequest) -> dict[str, Any]:
    """Everything the page shows, in a fixed number of queries."""
    now = timezone.now()
    nodes = list(selectors.nodes())
    host_usage = host_cache.usage([n.pk for n in nodes])
    node_rows: dict[str, NodeRow] = {
        n.name: NodeRow(
            n.name,
            n.status,
            _heartbeat_age(n.last_heartbeat, now),
            n.virtual,
            host_used=host_usage.get(n.pk, (0, 0))[0],
            host_kept=host_usage.get(n.pk, (0, 0))[1],
            host_budget=n.cpu_cache_bytes,
            labels=node_labels.text(n.labels or {}),
            taints=node_labels.text(n.taints or {}),
            operator_labels=node_labels.text(n.operator_labels or {}),
            operator_taints=node_labels.text(n.operator_taints or {}),
        )
        for n in nodes
    }
    intents, locks = [], []
    for gpu in selectors.gpus():
        row = _gpu_row(gpu)
        node_rows[gpu.node.name].gpus.append(row)
        intents.extend((row.label, intent) for intent in gpu.active_intents)
        if gpu.wake_lock_holder_id:
            locks.append((row.label, gpu))
    replicas = list(
        selectors.replicas().exclude(state=Replica.State.STOPPED).order_by("deployment__name", "created_at")
    )
    kv = selectors.kv_figures(replicas)
    why = selectors.state_reasons(r.id for r in replicas)
    for replica in replicas:
        replica.kv = kv.get(replica.id)
        # Why it is asleep, draining, parked...: beside its state, not only in the events list.
        replica.why = why.get(replica.id, "")
        # A replica's occupancies are all on its own node.
        node = replica.node.name if replica.node else "?"
        occupied = [o.gpu.index for o in replica.occupancies.all()]
        indexes = states.sits_on(replica.state, occupied, replica.gpu_mem_bytes_by_id or {})
        replica.gpu_labels = ", ".join(f"{node}/{index}" for index in indexes)
    deployments = _deployment_rows()
    live, live_total = _live_requests(replicas, [row["name"] for row in deployments])
    filters = event_filters(request)
    shown = sorted({seg.deployment for node in node_rows.values() for row in node.gpus for seg in row.occupants})
    painted = [seg for node in node_rows.values() for row in node.gpus for seg in (*row.segments, *row.occupants)]
    hues = deployment_hues(seg.deployment for seg in painted if seg.deployment)
    with_stripes = striped(hues)
    for seg in painted:
        seg.hue = hues.get(seg.deployment)
        seg.striped = seg.deployment in with_stripes
    return {
        "legend": [(name, hues[name], name in with_stripes) for name in shown],
        "now": now,
        "nodes": list(node_rows.values()),
        "intents": intents,
        "locks": locks,
        "pairs": _pairs(),
        "deployments": deployments,
        "replicas": replicas,
        "live_requests": live,
        "live_total": live_total,
        "events": list(selectors.events(**{k: v for k, v in filters.items() if v})[:EVENT_LIMIT]),
        "filters": filters,
        "event_kinds": sorted(Event.Kind.values),
        "fragment_url": reverse("admin:scheduling_dashboard_fragment"),
        # The API's own cap (GPUPORTAL_MAX_REPLICAS), read per page as the API reads it per request.
        "max_replicas": getattr(settings, deployment_spec.BY_NAME["replicas"].max_setting),
    }


# -- access ---------------------------------------------------------------------------------------


def staff_only(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Anonymous users go to the admin login (and come back); signed-in non-staff get 403.
    (admin_view would send non-staff to the login page too, which hides that they lack rights.)"""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), reverse("admin:login"))
        if not (request.user.is_active and request.user.is_staff):
            raise PermissionDenied("the dashboard is for staff")
        return view(request, *args, **kwargs)

    return wrapped


# -- pages ----------------------------------------------------------------------------------------


@never_cache
@require_GET
@staff_only
def page(request: HttpRequest) -> HttpResponse:
    return render_page(request)


# The deploy form's settings (each named as in the spec) and what it shows before anything is
# typed: the spec's defaults, and its lower bounds for the number fields.
DEPLOY_SETTINGS = ("loader", "dtype", "replicas", "max_tokens")
DEPLOY_DEFAULTS = {name: str(deployment_spec.BY_NAME[name].default) for name in DEPLOY_SETTINGS}
DEPLOY_MINIMA = {name: deployment_spec.BY_NAME[name].min for name in DEPLOY_SETTINGS}


def render_page(
    request: HttpRequest, *, deploy_form: dict[str, str] | None = None, deploy_errors: list[str] | None = None
) -> HttpResponse:
    """The page; with a refused deploy's form as it was typed, and why it was refused (a 400)."""
    # Without the admin's model sidebar: the bars need the width.
    ctx = {
        **admin.site.each_context(request),
        **context(request),
        "title": "GPU dashboard",
        "is_nav_sidebar_enabled": False,
        "deploy_form": {**DEPLOY_DEFAULTS, **(deploy_form or {})},
        "deploy_errors": deploy_errors or [],
        "deploy_minima": DEPLOY_MINIMA,
        "loaders": deployment_spec.BY_NAME["loader"].choices,
        "dtypes": deployment_spec.BY_NAME["dtype"].choices,
    }
    return render(request, "admin/scheduling/dashboard.html", ctx, status=400 if deploy_errors else 200)


@never_cache
@require_GET
@staff_only
def fragment(request: HttpRequest) -> HttpResponse:
    """The refreshing part of the page, fetched every few seconds by static/scheduling/dashboard.js."""
    return render(request, "admin/scheduling/dashboard_body.html", context(request))
