"""GET /metrics: Prometheus text with the counters and the state gauges."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from scheduling.models import Node, Replica
from tests.support import factories as f

pytestmark = pytest.mark.django_db


def scrape() -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}"""
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_report_gpu_bytes_nodes_and_replicas_from_the_database() -> None:
    node = f.node("node1")
    f.node("node2", status=Node.Status.DRAINING)
    gpu0 = f.gpu(node, 0, total_bytes=24 * f.GIB)
    f.gpu(node, 1, total_bytes=16 * f.GIB, virtual=False)
    dep = f.deployment()
    f.occupy(f.replica(dep, node, state=Replica.State.SERVING), gpu0, 3 * f.GIB)
    f.replica(dep, node, state=Replica.State.SERVING)
    f.replica(dep, node, state=Replica.State.SLEEPING)

    samples = scrape()

    total = samples["gpuportal_gpu_total_bytes"]
    assert total[(("gpu", "0"), ("node", "node1"), ("virtual", "true"))] == 24 * f.GIB
    assert total[(("gpu", "1"), ("node", "node1"), ("virtual", "false"))] == 16 * f.GIB
    assert samples["gpuportal_gpu_reserved_bytes"] == {
        (("gpu", "0"), ("node", "node1")): 3 * f.GIB,
        (("gpu", "1"), ("node", "node1")): 0,
    }
    assert samples["gpuportal_gpu_available_bytes"] == {
        (("gpu", "0"), ("node", "node1")): 21 * f.GIB,
        (("gpu", "1"), ("node", "node1")): 16 * f.GIB,
    }
    assert samples["gpuportal_nodes"] == {
        (("status", "online"),): 1,
        (("status", "draining"),): 1,
        (("status", "offline"),): 0,
    }
    replicas = samples["gpuportal_replicas"]
    assert set(replicas) == {(("state", state),) for state in Replica.State.values}
    assert replicas[(("state", "serving"),)] == 2
    assert replicas[(("state", "sleeping"),)] == 1
    assert replicas[(("state", "failed"),)] == 0
    assert samples["gpuportal_db_up"] == {(): 1}


def test_metrics_include_the_cas_conflict_counter_and_follow_it() -> None:
    from scheduling.metrics import CAS_CONFLICTS

    before = scrape()["gpuportal_cas_conflicts_total"][()]
    CAS_CONFLICTS.inc()
    assert scrape()["gpuportal_cas_conflicts_total"][()] == before + 1


def test_metrics_need_no_auth_and_state_reads_are_fresh_each_scrape() -> None:
    assert scrape()["gpuportal_nodes"][(("status", "online"),)] == 0
    f.node()
    assert scrape()["gpuportal_nodes"][(("status", "online"),)] == 1


def test_metrics_aggregate_processes_in_multiprocess_mode(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import values
    from prometheus_client.metrics import Counter

    # A counter written by "another process" into the shared directory.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    values.ValueClass = values.get_value_class()
    try:
        other = Counter("gpuportal_test_other_total", "Written through the multiprocess files.", registry=None)
        other.inc(3)
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.get_value_class()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    samples = scrape()

    assert samples["gpuportal_test_other_total"] == {(): 3}
    assert "gpuportal_replicas" in samples


def test_metrics_show_the_queue_depth_of_each_deployment(client) -> None:
    from scheduling.services import requests as request_services

    f.deployment("busy")
    f.deployment("quiet")
    request_services.queue.cache_clear()
    queue = request_services.queue()
    for key in queue.redis.scan_iter("gp:*"):
        queue.redis.delete(key)
    for n in range(3):
        queue.submit("busy", kind="generate", input=f"q{n}", params={}, owner="1")

    families = {m.name: m for m in text_string_to_metric_families(client.get("/metrics").content.decode())}

    depths = {s.labels["deployment"]: s.value for s in families["gpuportal_queue_depth"].samples}
    assert depths == {"busy": 3.0, "quiet": 0.0}


def test_kv_pool_figures_published_by_replicas_show_in_metrics_the_api_and_the_admin(admin_client) -> None:
    from django.conf import settings
    from redis import Redis
    from rest_framework.test import APIClient

    from gpuportal.wire import kvstats
    from scheduling.services import requests as request_services

    request_services.queue.cache_clear()
    node = f.node("node1")
    dep = f.deployment("tiny")
    serving = f.replica(dep, node, state=Replica.State.SERVING)
    asleep = f.replica(dep, node, state=Replica.State.SLEEPING)
    redis = Redis.from_url(settings.REDIS_URL)
    figures = {"block_tokens": 16, "blocks_total": 512, "blocks_used": 40, "blocks_peak": 64, "allocations": 9}
    cache = {"blocks_cached": 12, "prefix_queried": 900, "prefix_hits": 640}
    kvstats.publish(redis, serving.id, {**figures, "frees": 5, "utilisation": 40 / 512, **cache})
    # What the sleeper published while it served has yet to expire: its pool is gone all the same.
    kvstats.publish(redis, asleep.id, {**figures, "blocks_used": 7, "blocks_peak": 9})

    samples = scrape()
    labels = (("deployment", "tiny"), ("replica", serving.id))
    assert samples["gpuportal_kv_blocks_total"] == {labels: 512}
    assert samples["gpuportal_kv_blocks_used"] == {labels: 40}
    assert samples["gpuportal_kv_blocks_cached"] == {labels: 12}
    assert samples["gpuportal_prefix_cache_queried_tokens_total"] == {labels: 900}
    assert samples["gpuportal_prefix_cache_hit_tokens_total"] == {labels: 640}

    from django.contrib.auth.models import User

    api = APIClient()
    api.force_authenticate(User.objects.create_user("viewer"))
    assert api.get(f"/api/replicas/{serving.id}/").json()["kv"]["blocks_used"] == 40
    assert api.get(f"/api/replicas/{asleep.id}/").json()["kv"] is None
    listed = admin_client.get("/admin/scheduling/replica/").content.decode()
    assert "40 / 512 (peak 64), 12 cached" in listed and "7 / 512" not in listed
    # A replica that stops publishing stops being shown: the figures expire with it.
    assert 0 < redis.ttl(kvstats.kv_key(serving.id)) <= kvstats.TTL_S


# The series /metrics must cover (docker/grafana/gpuportal-dashboard.json uses them).
REQUIRED_SERIES = {
    "gpuportal_gpu_total_bytes",
    "gpuportal_gpu_reserved_bytes",
    "gpuportal_gpu_measured_bytes",
    "gpuportal_replicas",
    "gpuportal_requests",
    "gpuportal_requests_accepted_total",
    "gpuportal_queue_depth",
    "gpuportal_cas_conflicts_total",
    "gpuportal_preemptions_total",
    "gpuportal_wake_seconds_bucket",
    "gpuportal_sleep_seconds_bucket",
    "gpuportal_failover_active",
    "gpuportal_kv_blocks_total",
    "gpuportal_kv_blocks_used",
    "gpuportal_request_latency_seconds",
    "gpuportal_request_ttft_seconds",
    "gpuportal_request_queue_seconds",
    "gpuportal_request_per_output_token_seconds",
    "gpuportal_output_tokens_per_second",
}


def test_metrics_cover_every_series_the_dashboard_needs() -> None:
    node = f.node("node1")
    f.gpu(node, 0)
    f.deployment("tiny-a", failover_standby=True)
    from django.conf import settings
    from redis import Redis

    from gpuportal.wire import kvstats
    from scheduling.metrics import REQUESTS_ACCEPTED

    REQUESTS_ACCEPTED.labels(deployment="tiny-a")  # a labelled counter shows once it has a child

    serving = f.replica(f.deployment("lm"), node, state=Replica.State.SERVING)
    kvstats.publish(Redis.from_url(settings.REDIS_URL), serving.id, {"blocks_total": 8, "blocks_used": 1})
    # A request recorded a minute ago: the latency series have a deployment to show.
    from datetime import timedelta

    from django.utils import timezone

    from scheduling.models import RequestRecord

    began = timezone.now() - timedelta(seconds=60)
    RequestRecord.objects.create(
        request_id="r1", deployment="lm", status="done", created_at=began, started_at=began,
        finished_at=began + timedelta(seconds=2), first_token_at=began + timedelta(seconds=1),
        prompt_tokens=3, output_tokens=8,
    )  # fmt: skip

    assert set(scrape()) >= REQUIRED_SERIES


def test_measured_bytes_sum_the_measured_footprint_of_serving_occupants() -> None:
    node = f.node("node1")
    gpu0, gpu1 = f.gpu(node, 0), f.gpu(node, 1)
    measured = f.deployment("measured", memory_measured_bytes=3 * f.GIB)
    unmeasured = f.deployment("unmeasured")
    f.occupy(f.replica(measured, node, state=Replica.State.SERVING), gpu0, 4 * f.GIB)
    f.occupy(f.replica(measured, node, state=Replica.State.SLEEPING), gpu0, 0)  # asleep: holds no weights
    f.occupy(f.replica(unmeasured, node, state=Replica.State.SERVING), gpu1, 2 * f.GIB)

    assert scrape()["gpuportal_gpu_measured_bytes"] == {
        (("gpu", "0"), ("node", "node1")): 3 * f.GIB,
        (("gpu", "1"), ("node", "node1")): 0,
    }


def test_requests_by_status_count_the_waiting_and_taken_lists_and_acceptances(dispatched) -> None:
    from scheduling.services import requests as request_services

    node = f.node("node1")
    f.gpu(node, 0)
    dep = f.deployment("counted", loader="torch-module")
    replica = f.replica(dep, node, state=Replica.State.SERVING)
    queue = request_services.queue()
    for key in queue.redis.scan_iter("gp:*"):
        queue.redis.delete(key)
    before = scrape().get("gpuportal_requests_accepted_total", {}).get((("deployment", "counted"),), 0)

    for _ in range(3):
        request_services.submit("counted", kind="forward", input=[[1.0]], params={}, owner="1")
    assert queue.take("counted", replica.id, timeout=1) is not None

    samples = scrape()
    assert samples["gpuportal_requests"] == {(("status", "waiting"),): 2, (("status", "taken"),): 1}
    assert samples["gpuportal_requests_accepted_total"][(("deployment", "counted"),)] == before + 3


def test_a_request_for_a_deployment_that_does_not_exist_counts_nowhere_and_adds_no_label(dispatched) -> None:
    from scheduling.services import requests as request_services
    from scheduling.services.errors import NotFound

    with pytest.raises(NotFound):
        request_services.submit("no-such-deployment", kind="generate", input="hi", params={}, owner="1")
    with pytest.raises(NotFound):
        request_services.run("no-such-deployment", kind="generate", input="hi", params={}, owner="1", timeout=1)

    labels = scrape().get("gpuportal_requests_accepted_total", {})
    assert (("deployment", "no-such-deployment"),) not in labels


def test_the_grafana_dashboard_parses_and_uses_only_series_metrics_exposes() -> None:
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(
        (Path(__file__).resolve().parents[2] / "docker/grafana/gpuportal-dashboard.json").read_text()
    )
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"gpuportal_[a-z_]+", target["expr"])
    }
    test_metrics_cover_every_series_the_dashboard_needs()  # the rows that make every series show
    exposed = set(scrape())

    assert used, "the dashboard queries no series"
    assert used <= exposed, f"not in /metrics: {sorted(used - exposed)}"
    assert used >= REQUIRED_SERIES, f"series the dashboard leaves out: {sorted(REQUIRED_SERIES - used)}"


def test_requests_that_end_are_counted_by_status_whichever_process_ends_them() -> None:
    from django.conf import settings

    from gpuportal.wire.requestqueue import Fence, RequestQueue
    from scheduling.services import requests as request_services

    request_services.queue.cache_clear()
    rq = RequestQueue.from_url(settings.REDIS_URL)
    before = scrape().get("gpuportal_requests_finished_total", {})
    queue = f"metrics-{uuid.uuid4().hex[:8]}"  # a queue of its own: Redis is shared between tests
    done, failed, fenced = (rq.submit(queue, kind="generate", input="hi", params={}, owner="1") for _ in range(3))
    for _ in range(3):
        rq.take(queue, "replica-a", timeout=1)
    rq.finish(done.id, "replica-a", {"text": "ok"})
    rq.fail(failed.id, "replica-a", "broken", "error")
    rq.raise_epoch("pair-x", 1)
    rq.finish(fenced.id, "replica-a", {"text": "ok"}, fence=Fence("pair-x", 1))  # a failover member's path

    after = scrape()["gpuportal_requests_finished_total"]
    assert after[(("status", "done"),)] - before.get((("status", "done"),), 0) == 2
    assert after[(("status", "failed"),)] - before.get((("status", "failed"),), 0) == 1
