"""GET /metrics: Prometheus text, unauthenticated like most exporters.

Two kinds of series: counters incremented where things happen (scheduling.metrics; summed
across processes when PROMETHEUS_MULTIPROC_DIR is set), and gauges of the state read from
PostgreSQL at scrape time, so they are right whichever process changed the rows."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

from django.db import DatabaseError
from django.db.models import Count, Sum
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

import scheduling.metrics  # noqa: F401  registers the control plane's counters
from gpuportal.wire import states
from scheduling.models import GPU, Deployment, Node, Occupant, Replica

logger = logging.getLogger(__name__)


class StateCollector:
    """Gauges of GPUs, nodes and replicas, read from the database on each collect()."""

    def collect(self) -> Iterator[Metric]:
        try:
            metrics = self._state_metrics()
        except DatabaseError:
            # The counters are still worth serving; the missing gauges and db_up=0 say why.
            logger.warning("metrics: cannot read the state from the database", exc_info=True)
            metrics = []
            up = 0
        else:
            up = 1
        yield from metrics
        yield GaugeMetricFamily("gpuportal_db_up", "Whether this scrape could read the state (1) or not.", up)

    def _state_metrics(self) -> list[Metric]:
        total = GaugeMetricFamily("gpuportal_gpu_total_bytes", "GPU memory.", labels=["node", "gpu", "virtual"])
        reserved = GaugeMetricFamily(
            "gpuportal_gpu_reserved_bytes", "GPU memory reserved by occupants.", labels=["node", "gpu"]
        )
        available = GaugeMetricFamily(
            "gpuportal_gpu_available_bytes", "GPU memory free to place replicas.", labels=["node", "gpu"]
        )
        overcommit = GaugeMetricFamily(
            "gpuportal_gpu_overcommit_bytes",
            "Bytes a GPU's replica processes held beyond their reservations at the last heartbeat "
            "(NVML, or the virtual GPU's model of it), with other tenants' use reaching into reserved "
            "memory; 0 when the books are honest.",
            labels=["node", "gpu"],
        )
        foreign = GaugeMetricFamily(
            "gpuportal_gpu_foreign_bytes",
            "GPU memory other tenants hold (processes that are not the portal's replicas, beyond the "
            "driver's reserve) at the last heartbeat that changed it; out of placement's reach.",
            labels=["node", "gpu"],
        )
        spare = GaugeMetricFamily(
            "gpuportal_gpu_spare_bytes",
            "Of gpuportal_gpu_foreign_bytes, what the node's own warm spares hold or are held to "
            "(GPUPORTAL_WARM_SPARES): a CUDA context per GPU, out of placement's reach.",
            labels=["node", "gpu"],
        )
        free = GaugeMetricFamily(
            "gpuportal_gpu_nvml_free_bytes",
            "Free memory NVML reported at the last heartbeat (a virtual GPU's: total less its processes').",
            labels=["node", "gpu"],
        )
        rows = GPU.objects.values_list(
            "node__name",
            "index",
            "virtual",
            "total_bytes",
            "available_bytes",
            "overcommit_bytes",
            "nvml_free_bytes",
            "foreign_bytes",
            "spare_bytes",
        )
        for row in rows:
            (
                node,
                index,
                virtual,
                total_bytes,
                available_bytes,
                overcommit_bytes,
                nvml_free_bytes,
                foreign_bytes,
                spare_bytes,
            ) = row
            gpu = str(index)
            total.add_metric([node, gpu, "true" if virtual else "false"], total_bytes)
            reserved.add_metric([node, gpu], max(0, total_bytes - foreign_bytes - available_bytes))
            available.add_metric([node, gpu], available_bytes)
            overcommit.add_metric([node, gpu], overcommit_bytes)
            foreign.add_metric([node, gpu], foreign_bytes)
            spare.add_metric([node, gpu], spare_bytes)
            if nvml_free_bytes is not None:
                free.add_metric([node, gpu], nvml_free_bytes)

        nodes = _count_by("gpuportal_nodes", "Nodes by status.", "status", Node, Node.Status.values)
        replicas = _count_by(
            "gpuportal_replicas", "Replicas by state.", "state", Replica, [s.value for s in states.ReplicaState]
        )
        return [
            total,
            reserved,
            available,
            overcommit,
            foreign,
            spare,
            free,
            _measured_bytes(),
            *_host_cache(),
            nodes,
            replicas,
            *_deployments(),
            _requests_in_flight(),
            _requests_finished(),
            *_request_latency(),
            *_failover_states(),
            *_kv_blocks(),
        ]


def _host_cache() -> list[Metric]:
    """Per node, its host cache's budget, what sleeping weights (and standbys', and awake replicas'
    kept arenas) use of it, and of that the kept arenas (host memory is scheduled like a
    GPU's)."""
    from scheduling.services import host_cache

    budget = GaugeMetricFamily(
        "gpuportal_host_cache_budget_bytes", "Host RAM a node gives sleeping replicas' weights.", labels=["node"]
    )
    used = GaugeMetricFamily(
        "gpuportal_host_cache_used_bytes",
        "Host RAM a node's sleeping, draining and standby replicas' weights, and awake replicas' kept arenas, use.",
        labels=["node"],
    )
    kept = GaugeMetricFamily(
        "gpuportal_host_cache_kept_bytes",
        "Of the host cache used, what awake replicas keep as arenas for their next sleep.",
        labels=["node"],
    )
    nodes = {}
    for pk, name, budget_bytes in Node.objects.values_list("pk", "name", "cpu_cache_bytes"):
        nodes[pk] = name
        budget.add_metric([name], budget_bytes)
    for pk, (used_bytes, kept_bytes) in host_cache.usage(nodes).items():
        used.add_metric([nodes[pk]], used_bytes)
        kept.add_metric([nodes[pk]], kept_bytes)
    return [budget, used, kept]


def _measured_bytes() -> Metric:
    """Per GPU, the sum of the measured footprint (DeploymentObserved.memory_measured_bytes: the serving
    footprint a replica composed from measured parts, gpuportal.wire.memory) of its
    serving occupants whose deployment has been measured. Occupants in other states, or not yet
    measured, add nothing: compare with reserved bytes to see how much of a reservation is used."""
    family = GaugeMetricFamily(
        "gpuportal_gpu_measured_bytes",
        "Measured memory of a GPU's serving occupants (deployments not yet measured count 0).",
        labels=["node", "gpu"],
    )
    sums = dict(
        Occupant.objects.filter(
            replica__state=Replica.State.SERVING, replica__deployment__observed__memory_measured_bytes__gt=0
        )
        .values_list("gpu_id")
        .annotate(n=Sum("replica__deployment__observed__memory_measured_bytes"))
        .order_by()
    )
    for gpu_id, node, index in GPU.objects.values_list("pk", "node__name", "index"):
        family.add_metric([node, str(index)], sums.get(gpu_id, 0))
    return family


def _requests_in_flight() -> Metric:
    """Requests by status, from the Redis lists that hold them (no SCAN of the request hashes):
    `waiting` = in a deployment's queue (status queued or waking), `taken` = in an awake
    replica's processing list (dispatched or running). Finished requests are not counted here;
    gpuportal_requests_accepted_total counts what came in."""
    from redis.exceptions import RedisError

    from scheduling.services import requests as request_services

    family = GaugeMetricFamily(
        "gpuportal_requests",
        "Requests in flight by status (waiting in a queue, taken by a replica).",
        labels=["status"],
    )
    names = Deployment.objects.values_list("name", flat=True)
    replicas = Replica.objects.exclude(state__in=(Replica.State.STOPPED,)).values_list("id", flat=True)
    try:
        waiting = request_services.queue().depths(names)
        taken = request_services.queue().in_flight(replicas)
    except RedisError:
        logger.warning("metrics: cannot read request lists from Redis", exc_info=True)
        return family
    family.add_metric(["waiting"], sum(waiting.values()))
    family.add_metric(["taken"], sum(taken.values()))
    return family


def _requests_finished() -> Metric:
    """Requests that ended, by status: counted in Redis by whoever ends them (replicas, the web),
    in the same round trip, so the figure is the portal's whatever process ended them."""
    from redis.exceptions import RedisError

    from scheduling.services import requests as request_services

    family = CounterMetricFamily(
        "gpuportal_requests_finished", "Requests that ended, by status (done, failed, cancelled).", labels=["status"]
    )
    try:
        counts = request_services.queue().finished_counts()
    except RedisError:
        logger.warning("metrics: cannot read finished-request counts from Redis", exc_info=True)
        return family
    for status, count in counts.items():
        family.add_metric([status], count)
    return family


# (TrafficStats' quantiles, the series, what it measures) of gauges._request_latency.
_LATENCY_SERIES = (
    ("latency_s", "gpuportal_request_latency_seconds", "From a request's acceptance to its answer (those done)"),
    ("ttft_s", "gpuportal_request_ttft_seconds", "From a request's acceptance to its first token (batching replicas)"),
    (
        "queue_s",
        "gpuportal_request_queue_seconds",
        "From a request's acceptance to a replica taking it (a wake or a load included)",
    ),
    (
        "per_output_token_s",
        "gpuportal_request_per_output_token_seconds",
        "A done request's time on its replica over the tokens it generated",
    ),
)


def _request_latency() -> list[Metric]:
    """Per deployment, the quantiles of its recorded requests of the last few minutes, as a
    Prometheus summary shows them (scheduling.services.traffic_stats: the records are drained
    each minute, so the newest minute is missing), and the tokens its done requests generated
    per second over that window."""
    from scheduling.services import traffic_stats

    window = f"{traffic_stats.METRICS_WINDOW_S:g} s"
    families = {
        attribute: GaugeMetricFamily(name, f"{what}, last {window}.", labels=["deployment", "quantile"])
        for attribute, name, what in _LATENCY_SERIES
    }
    tokens = GaugeMetricFamily(
        "gpuportal_output_tokens_per_second",
        f"Tokens generated per second by a deployment's requests done in the last {window} recorded.",
        labels=["deployment"],
    )
    for found in traffic_stats.stats(traffic_stats.METRICS_WINDOW_S):
        for attribute, family in families.items():
            quantiles = getattr(found, attribute)
            if quantiles is not None:
                for label, value in (("0.5", quantiles.p50), ("0.95", quantiles.p95), ("0.99", quantiles.p99)):
                    family.add_metric([found.deployment, label], value)
        tokens.add_metric([found.deployment], found.output_tokens_per_s)
    return [*families.values(), tokens]


def _kv_blocks() -> list[Metric]:
    """Each awake causal-LM replica's KV block pool, as it last published it in Redis."""
    from scheduling.selectors import kv_stats

    total = GaugeMetricFamily(
        "gpuportal_kv_blocks_total", "Blocks in a replica's KV-cache pool.", labels=["deployment", "replica"]
    )
    used = GaugeMetricFamily(
        "gpuportal_kv_blocks_used",
        "Blocks of a replica's KV-cache pool held by sequences.",
        labels=["deployment", "replica"],
    )
    cached = GaugeMetricFamily(
        "gpuportal_kv_blocks_cached",
        "Blocks of a replica's KV-cache pool its prefix cache keeps and no sequence holds (free to take).",
        labels=["deployment", "replica"],
    )
    # Counters since the replica's pool was made (its wake), as vLLM's prefix_cache_queries/_hits.
    queried = CounterMetricFamily(
        "gpuportal_prefix_cache_queried_tokens",
        "Prompt tokens a replica looked up in its prefix cache since its KV pool was made.",
        labels=["deployment", "replica"],
    )
    hits = CounterMetricFamily(
        "gpuportal_prefix_cache_hit_tokens",
        "Prompt tokens a replica found in its prefix cache (their K/V not computed again).",
        labels=["deployment", "replica"],
    )
    awake = dict(Replica.objects.filter(state__in=states.HOLDING_WEIGHTS).values_list("id", "deployment__name"))
    for replica_id, stats in sorted(kv_stats(awake).items()):
        labels = [awake[replica_id], replica_id]
        total.add_metric(labels, stats.get("blocks_total", 0))
        used.add_metric(labels, stats.get("blocks_used", 0))
        cached.add_metric(labels, stats.get("blocks_cached", 0))
        queried.add_metric(labels, stats.get("prefix_queried", 0))
        hits.add_metric(labels, stats.get("prefix_hits", 0))
    return [total, used, cached, queried, hits]


def _failover_states() -> list[Metric]:
    """Each live pair member's state, and per failover deployment how many members are active:
    0 is an outage, more than 1 a split brain (invariant 4 of docs/architecture.md)."""
    by_state = GaugeMetricFamily(
        "gpuportal_failover_state",
        "1 for each failover pair member in the state it reports (init, standby, waking, active, dead).",
        labels=["deployment", "replica", "state"],
    )
    active = GaugeMetricFamily(
        "gpuportal_failover_active",
        "Failover pair members active per deployment (per pair: 1 is healthy, 0 an outage, 2 split-brain).",
        labels=["deployment"],
    )
    counts: dict[str, int] = dict.fromkeys(
        Deployment.objects.filter(failover_standby=True).values_list("name", flat=True), 0
    )
    members = (
        Replica.objects.filter(lease__isnull=False)
        .exclude(state__in=states.ENDED)
        .values_list("deployment__name", "id", "failover_state")
    )
    for deployment, replica_id, state in members:
        by_state.add_metric([deployment, replica_id, state or states.FailoverState.INIT], 1)
        if state == states.FailoverState.ACTIVE:
            counts[deployment] = counts.get(deployment, 0) + 1
    for deployment, n in sorted(counts.items()):
        active.add_metric([deployment], n)
    return [by_state, active]


def _deployments() -> list[Metric]:
    """Per deployment, the replicas it wants (an operator's count, or the autoscaler's), and the
    requests waiting, read from Redis at scrape time (one round trip)."""
    from redis.exceptions import RedisError

    from scheduling.services import requests as request_services

    wanted = GaugeMetricFamily(
        "gpuportal_deployment_replicas_wanted",
        "Replicas a deployment wants: as scaled, or as its autoscaler set them.",
        labels=["deployment"],
    )
    family = GaugeMetricFamily(
        "gpuportal_queue_depth", "Requests waiting for a replica, per deployment.", labels=["deployment"]
    )
    rows = list(Deployment.objects.order_by("name").values_list("name", "replicas_wanted"))
    for name, count in rows:
        wanted.add_metric([name], count)
    try:
        depths = request_services.queue().depths(name for name, _ in rows)
    except RedisError:
        logger.warning("metrics: cannot read queue depths from Redis", exc_info=True)
        return [wanted, family]
    for name, depth in depths.items():
        family.add_metric([name], depth)
    return [wanted, family]


def _count_by(name: str, documentation: str, field: str, model: type, values: Iterable[str]) -> Metric:
    # Every value gets a sample, 0 included, so a series does not vanish when its last row leaves.
    counts = dict(model.objects.values_list(field).annotate(n=Count("pk")).order_by())
    family = GaugeMetricFamily(name, documentation, labels=[field])
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family


class _Delegate:
    """Exposes another registry's metrics inside a per-scrape registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return self.registry.collect()


def scrape_registry() -> CollectorRegistry:
    """A fresh registry for one scrape: this process's (or all processes') counters plus the
    state gauges. Fresh, so the DB-reading collector never lands on the global REGISTRY, where
    any other exporter in the process would run its queries."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
    else:
        registry.register(_Delegate(REGISTRY))
    registry.register(StateCollector())
    return registry


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse(generate_latest(scrape_registry()), content_type=CONTENT_TYPE_LATEST)
