"""The operator's dashboard: what it shows, its refresh fragment, and its controls, each
through the services (an Event per change), staff only, with the outcome as an admin message."""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.devices import virtual_gpus
from scheduling.models import Deployment, DeploymentObserved, Event, FailoverLease, Node, Replica
from scheduling.services import queueing, reports
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories as f
from tests.support.deployments import deploy
from tests.support.factories import NO_OVERHEAD

pytestmark = pytest.mark.django_db

DASHBOARD = reverse("admin:scheduling_dashboard")
FRAGMENT = reverse("admin:scheduling_dashboard_fragment")


@pytest.fixture
def viewer(db) -> Client:
    client = Client()
    client.force_login(User.objects.create_user("viewer"))
    return client


def outcome(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# -- access ------------------------------------------------------------------------------------------


def test_the_admin_index_links_to_the_dashboard(admin_client) -> None:
    assert DASHBOARD in admin_client.get(reverse("admin:index")).content.decode()


@pytest.mark.parametrize("url", [DASHBOARD, FRAGMENT])
def test_the_dashboard_is_staff_only(admin_client, viewer, client, url) -> None:
    assert admin_client.get(url).status_code == 200
    assert viewer.get(url).status_code == 403
    anonymous = client.get(url)
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith(reverse("admin:login")) and "next=" in anonymous["Location"]


# -- what it shows -----------------------------------------------------------------------------------


def test_it_shows_nodes_gpus_and_each_occupants_bar_segment(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    page = admin_client.get(DASHBOARD).content.decode()
    assert "node1/0" in page and "virtual GPU" in page
    assert f'data-replica="{replica_id}"' in page
    assert "tiny-a (serving): reserved 300.00 MiB" in page
    assert "gp-seg-free" in page
    assert "heartbeat" in page


def test_each_deployment_has_its_own_colour_in_the_bars_and_the_key_whatever_its_state(
    cluster, admin_client, dispatched
) -> None:
    from scheduling.web.dashboard import deployment_hues

    first, second = deploy("tiny-a"), deploy("tiny-b")
    body = admin_client.get(FRAGMENT).content.decode()

    hues = deployment_hues(["tiny-a", "tiny-b"])
    hue_a, hue_b = hues["tiny-a"], hues["tiny-b"]
    assert hue_a != hue_b and deployment_hues(["tiny-b", "tiny-a"]) == hues, "stable across renders"
    assert (
        f'<li data-deployment="tiny-a"><span class="gp-swatch" style="background-color: hsl({hue_a} 55% 38%)">' in body
    )
    for replica_id, hue in ((first, hue_a), (second, hue_b)):
        assert f'background-color: hsl({hue} 55% 38%)"\n        data-replica="{replica_id}"' in body
    # The bar itself holds a short label, readable in the segment; the whole one is its tooltip.
    assert "tiny-a · serving · 300.00 MiB" in body and 'title="tiny-a (serving): reserved 300.00 MiB' in body


def test_deployments_whose_names_give_near_colours_are_painted_far_apart_the_same_each_time() -> None:
    from scheduling.web.dashboard import MIN_HUE_APART, deployment_hue, deployment_hues

    # These two names' own hues are a degree apart: one colour to the eye.
    assert abs(deployment_hue("model-1") - deployment_hue("model-36")) <= 3
    hues = deployment_hues(["model-36", "model-1"])
    apart = abs(hues["model-1"] - hues["model-36"])
    assert min(apart, 360 - apart) >= MIN_HUE_APART
    assert deployment_hues(["model-1", "model-36"]) == hues
    assert deployment_hues(["model-1"]) == {"model-1": deployment_hue("model-1")}, "alone: its own hue"
    many = deployment_hues(f"d{i}" for i in range(12))
    assert len(set(many.values())) == 12


def test_past_the_colours_the_wheel_has_room_for_a_deployment_near_another_gets_stripes() -> None:
    from scheduling.web.dashboard import MIN_HUE_APART, deployment_hues, striped

    few = deployment_hues(["tiny-a", "tiny-b", "big"])
    assert striped(few) == set(), "colours alone while they are far apart"
    many = deployment_hues(f"model-{i:02d}" for i in range(24))
    marked = striped(many)
    assert marked and striped(dict(reversed(list(many.items())))) == marked, "the same each refresh"
    plain = sorted(name for name in many if name not in marked)
    for i, a in enumerate(plain):
        for b in plain[i + 1 :]:
            apart = abs(many[a] - many[b])
            assert min(apart, 360 - apart) >= MIN_HUE_APART, (a, b)


def test_a_striped_deployment_is_striped_in_the_bars_and_the_key(admin_client) -> None:
    from scheduling.web.dashboard import deployment_hues, striped

    node = f.node("node1")
    gpus = [f.gpu(node, i) for i in range(4)]
    names = [f"model-{i:02d}" for i in range(24)]
    for i, name in enumerate(names):
        f.occupy(f.replica(f.deployment(name), node, state="serving"), gpus[i % 4], 64 * 1024**2)
    marked = sorted(striped(deployment_hues(names)))

    body = admin_client.get(FRAGMENT).content.decode()

    for name in names:
        key = body[body.index(f'<li data-deployment="{name}">') :][:120]
        assert ("gp-striped" in key) == (name in marked), (name, key)


def test_a_message_shows_the_deployments_name_as_written_and_scale_keeps_to_the_replica_cap(
    cluster, admin_client, dispatched, settings
) -> None:
    deploy("ui-tiny")

    page = admin_client.post(control("scale", "ui-tiny"), {"replicas": "2"}, follow=True).content.decode()

    assert "ui-tiny: scaled to 2" in page and "Ui-tiny" not in page
    body = admin_client.get(FRAGMENT).content.decode()
    assert f'max="{settings.GPUPORTAL_MAX_REPLICAS}"' in body and 'max="256"' not in body


def test_a_sleeping_replica_shows_why_beside_its_state_from_its_latest_state_event(admin_client) -> None:
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="sleeping")
    f.event(kind="replica.state", subject=f"replica {replica.id[:8]}", reason="loaded", replica=replica.id)
    f.event(kind="replica.state", subject="r", reason="idle 300 s: put to sleep", replica=replica.id)
    f.event(kind="gpu.changed", subject="gpu node1/0", reason="not a state", replica=replica.id)

    body = admin_client.get(FRAGMENT).content.decode()

    row = body[body.index(f'<tr data-replica="{replica.id}">') :]
    row = row[: row.index("</tr>")]
    assert '<div class="gp-why gp-why-state">idle 300 s: put to sleep</div>' in row


def test_a_serving_replica_shows_its_kv_blocks_those_cached_and_its_prefix_cache_hit_rate(admin_client) -> None:
    from django.conf import settings
    from redis import Redis

    from gpuportal.wire import kvstats
    from scheduling.services import requests as request_services

    request_services.queue.cache_clear()
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    figures = {"block_tokens": 16, "blocks_total": 128, "blocks_used": 3, "blocks_peak": 9, "blocks_cached": 24}
    with Redis.from_url(settings.REDIS_URL) as redis:
        kvstats.publish(redis, replica.id, {**figures, "prefix_queried": 4000, "prefix_hits": 3000})

    body = admin_client.get(FRAGMENT).content.decode()

    row = body[body.index(f'<tr data-replica="{replica.id}">') :]
    row = row[: row.index("</tr>")]
    assert "3 / 128 (peak 9), 24 cached" in row and "prefix cache: 75% of prompt tokens" in row


def test_a_failed_replica_shows_why_beside_it_and_events_show_their_seconds(admin_client) -> None:
    node = f.node("node1")
    dep = f.deployment("broken")
    f.replica(dep, node, state="failed", failure_reason="CUDA out of memory: tried to allocate 2.00 GiB")
    f.event(kind="replica.state", subject="replica x", reason="failed to load")

    body = admin_client.get(FRAGMENT).content.decode()

    assert '<div class="gp-why">CUDA out of memory: tried to allocate 2.00 GiB</div>' in body
    assert " s ago</small>" in body


def test_a_deploy_from_the_page_is_checked_as_the_api_checks_it_and_made_by_the_service(
    cluster, admin_client, dispatched, tiny_model_dir
) -> None:
    url = reverse("admin:scheduling_dashboard_deploy")
    form = {"name": "tiny-a", "source": str(tiny_model_dir), "loader": "transformers", "dtype": "float32"}

    refused = admin_client.post(url, {**form, "name": "Not A Slug!", "replicas": "99", "override_mib": "lots"})
    assert refused.status_code == 400
    page = refused.content.decode()
    assert "memory.override_bytes: a number of MiB" in page
    refused = admin_client.post(url, {**form, "name": "Not A Slug!", "replicas": "99"})
    page = refused.content.decode()
    assert refused.status_code == 400 and "name: Enter a valid" in page and "replicas: at most 32" in page
    assert 'value="Not A Slug!"' in page, "the form comes back as it was typed"
    assert not Deployment.objects.exists()

    made = admin_client.post(url, {**form, "replicas": "2", "override_mib": "300", "spread": "on"})
    assert made.status_code == 302 and outcome(made) == ["tiny-a: deployed, 2 replica(s)"]
    deployment = Deployment.objects.get(name="tiny-a")
    assert deployment.memory_override_bytes == 300 * 1024**2 and deployment.placement_spread
    assert deployment.replicas.count() == 2
    assert Event.objects.filter(deployment="tiny-a", reason__startswith="placed: ").count() == 2

    again = admin_client.post(url, {**form, "replicas": "1"})
    assert again.status_code == 400 and "Refused: " in again.content.decode() and "tiny-a" in again.content.decode()


def test_delete_asks_for_confirmation_then_deletes_through_the_service(cluster, admin_client, dispatched) -> None:
    deploy("tiny-a")
    url = reverse("admin:scheduling_dashboard_delete", args=["tiny-a"])

    asked = admin_client.post(url)
    assert asked.status_code == 200 and "Delete tiny-a?" in asked.content.decode()
    assert Deployment.objects.filter(name="tiny-a").exists()

    done = admin_client.post(url, {"confirm": "yes"})
    assert outcome(done) == ["tiny-a: deleted"]
    assert not Deployment.objects.filter(name="tiny-a").exists()
    assert Event.objects.filter(deployment="tiny-a", reason__startswith="deleted by admin (dashboard)").exists()


def test_it_shows_intents_wake_locks_pairs_and_deployment_figures(admin_client) -> None:
    node = f.node("node1")
    gpu = f.gpu(node, 0)
    dep = f.deployment("tiny-a", failover_standby=True)
    active = f.replica(dep, node, state="serving", failover_state="active", last_accessed=timezone.now())
    f.occupy(active, gpu, 2 * f.GIB)
    waiting = f.replica(dep, node, state="waking")
    f.intent(waiting, gpu, f.GIB)
    gpu.wake_lock_holder, gpu.wake_lock_expires_at = waiting, timezone.now()
    gpu.save(update_fields=["wake_lock_holder", "wake_lock_expires_at"])
    lease = FailoverLease.objects.create(deployment=dep, holder=active, epoch=7)
    standby = f.replica(
        dep, node, state="standby", failover_state="standby", lease=lease, role="standby",
        gpu_mem_bytes_by_id={"0": 518 * 1024**2},
    )  # fmt: skip
    Replica.objects.filter(pk=active.pk).update(lease=lease)

    body = admin_client.get(FRAGMENT).content.decode()

    assert "Waiting preemption intents" in body and str(waiting) in body and "1.00 GiB" in body
    assert "Wake locks" in body and "No GPU is locked" not in body
    assert "tiny-a#0" in body and "<td>7</td>" in body and "standby/standby" in body
    assert 'data-deployment="tiny-a"' in body and "serving 1" in body and "waking 1" in body
    # The standby reserves nothing of its own, and is shown on the GPU its process sits on.
    row = body[body.index(f'data-replica="{standby.id}"') :]
    row = row[: row.index("</tr>")]
    assert "<td>node1/0</td>" in row, row


def test_each_deployment_shows_the_p95_latency_of_its_requests_of_the_last_minutes(admin_client) -> None:
    from datetime import timedelta

    from scheduling.models import RequestRecord

    f.deployment("busy")
    f.deployment("idle")
    now = timezone.now()
    for n in range(1, 21):  # 1..20 s from acceptance to answer: p95 interpolates to 19.05 s
        began = now - timedelta(seconds=200)
        RequestRecord.objects.create(
            request_id=f"r{n}", deployment="busy", status="done", created_at=began,
            started_at=began, finished_at=began + timedelta(seconds=n), output_tokens=4,
        )  # fmt: skip

    body = admin_client.get(FRAGMENT).content.decode()

    busy = body[body.index('data-deployment="busy"') :]
    idle = body[body.index('data-deployment="idle"') :]
    assert "<td>19.05 s</td>" in busy[: busy.index("</tr>")]
    assert " s</td>" not in idle[: idle.index("</tr>")], "no request, no figure"


def test_a_failed_or_retrying_deployment_says_so(admin_client) -> None:
    f.deployment("broken", failed_reason="SafetensorError: incomplete metadata", load_failures=3)
    f.deployment("flaky", load_failures=1, retry_at=timezone.now())
    f.deployment("fine")

    body = admin_client.get(FRAGMENT).content.decode()

    assert "failed: SafetensorError: incomplete metadata" in body
    assert "retrying after 1 failed load(s)" in body
    assert body.count("gp-state-failed") == 1


def test_a_deployment_under_a_rolling_restart_says_so(admin_client) -> None:
    f.deployment("rolling")
    f.deployment("still")
    DeploymentObserved.objects.filter(deployment__name="rolling").update(restart_since=timezone.now())

    body = admin_client.get(FRAGMENT).content.decode()

    rolling = body[body.index('data-deployment="rolling"') :]
    still = body[body.index('data-deployment="still"') :]
    assert ">restarting</span>" in rolling[: rolling.index("</tr>")]
    assert "restarting" not in still[: still.index("</tr>")]


def test_the_event_timeline_filters_by_kind_deployment_and_gpu(admin_client) -> None:
    f.event(kind="gpu.reserved", subject="gpu node1/0", reason="because-one", deployment="a", gpu="node1/0")
    f.event(kind="gpu.reserved", subject="gpu node1/1", reason="because-two", deployment="b", gpu="node1/1")
    f.event(kind="replica.state", subject="replica x", reason="because-three", deployment="a")

    def reasons(**query) -> set[str]:
        body = admin_client.get(FRAGMENT, query).content.decode()
        return {r for r in ("because-one", "because-two", "because-three") if r in body}

    assert reasons() == {"because-one", "because-two", "because-three"}
    assert reasons(kind="gpu.reserved") == {"because-one", "because-two"}
    assert reasons(deployment="a") == {"because-one", "because-three"}
    assert reasons(gpu="node1/1") == {"because-two"}


def test_it_renders_8_nodes_of_8_gpus_and_100_deployments_in_a_fixed_number_of_queries(
    admin_client, django_assert_max_num_queries
) -> None:
    gpus = [f.gpu(node, i, total_bytes=8 * f.GIB) for node in [f.node(f"n{n}") for n in range(8)] for i in range(8)]
    for d in range(100):
        dep = f.deployment(f"dep-{d:03}")
        gpu = gpus[d % len(gpus)]
        f.occupy(f.replica(dep, gpu.node, state="serving"), gpu, f.GIB)
        f.replica(dep, gpu.node, state="sleeping")
    for d in range(200):
        f.event(subject=f"replica {d}", deployment=f"dep-{d % 100:03}")

    with django_assert_max_num_queries(20):
        page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    content = page.content.decode()
    assert content.count('class="gp-gpu"') == 64
    assert content.count("<tr data-deployment=") == 100
    with django_assert_max_num_queries(16):
        assert admin_client.get(FRAGMENT).status_code == 200


def test_it_lists_what_replicas_generate_then_what_waits_and_cancels_a_request_after_asking(
    admin_client, monkeypatch
) -> None:
    monkeypatch.setattr(queueing, "STOP_WAIT_S", 0.1)  # no replica runs here to stop it
    name = f"req-{uuid.uuid4().hex[:8]}"
    serving = f.replica(f.deployment(name), state="serving")
    alice = User.objects.create_user("alice")
    queue = request_services.queue()
    held = queue.submit(name, kind="generate", input="first", params={}, owner=str(alice.pk))
    waiting = queue.submit(name, kind="generate", input="second", params={}, owner=str(alice.pk))
    assert queue.take(name, serving.id, timeout=1).id == held.id

    rows = re.findall(r'<tr data-request="(\w+)">(.*?)</tr>', admin_client.get(FRAGMENT).content.decode(), re.S)
    assert [request_id for request_id, _ in rows] == [held.id, waiting.id], "what replicas hold first"
    assert "dispatched" in rows[0][1] and serving.id[:8] in rows[0][1] and "alice" in rows[0][1]
    assert "queued" in rows[1][1]

    asked = admin_client.post(control("cancel", waiting.id))
    assert asked.status_code == 200 and b"Cancel request" in asked.content and queue.get(waiting.id).status == "queued"
    done = admin_client.post(control("cancel", waiting.id), {"confirm": "yes"})
    assert outcome(done) == [f"request {waiting.id[:12]}: cancelled before it ran"]
    stopping = admin_client.post(control("cancel", held.id), {"confirm": "yes"})
    assert outcome(stopping)[-1] == f"request {held.id[:12]}: asked to stop; still dispatched"
    assert queue.get(held.id).stop_asked == "cancelled by staff"
    again = admin_client.post(control("cancel", waiting.id), {"confirm": "yes"})
    said = f"Refused: request {waiting.id} is cancelled: it has ended, and there is nothing to cancel"
    assert outcome(again)[-1] == said


# -- controls -----------------------------------------------------------------------------------------


def control(name: str, *args: str) -> str:
    return reverse(f"admin:scheduling_dashboard_{name}", args=args)


def test_sleep_puts_a_serving_replica_to_sleep_through_the_service(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    response = admin_client.post(control("replica", replica_id, "sleep"))
    assert response.status_code == 302 and response["Location"] == DASHBOARD
    assert Replica.objects.get(pk=replica_id).state == "draining"
    assert Event.objects.filter(replica=replica_id, reason__contains="(dashboard)").exists()
    assert any("going to sleep" in m for m in outcome(response))


@pytest.mark.parametrize("deep", [False, True], ids=["asleep", "deep-asleep"])
def test_wake_brings_a_sleeping_replica_back(cluster, admin_client, dispatched, deep) -> None:
    replica_id = deploy("tiny-a")
    admin_client.post(control("replica", replica_id, "sleep"))
    reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    if deep:
        reports.report(replica_id, {"event": "deep_sleeping", "host_copy_bytes": 10 * 2**20})
    page = admin_client.get(DASHBOARD).content.decode()
    assert f"gp-state-{'deep_sleeping' if deep else 'sleeping'}" in page
    assert control("replica", replica_id, "wake") in page, "its Wake button"

    response = admin_client.post(control("replica", replica_id, "wake"))

    assert Replica.objects.get(pk=replica_id).state == "waking"
    assert Event.objects.filter(replica=replica_id, reason__contains="woken by admin (dashboard)").exists()
    assert any("waking on" in m for m in outcome(response))


def test_evict_asks_for_confirmation_then_evicts(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    asked = admin_client.post(control("replica", replica_id, "evict"))
    assert asked.status_code == 200 and b"Evict replica" in asked.content and b'name="confirm"' in asked.content
    assert Replica.objects.get(pk=replica_id).state == "serving"

    response = admin_client.post(control("replica", replica_id, "evict"), {"confirm": "yes"})

    assert response.status_code == 302 and Replica.objects.get(pk=replica_id).state == "draining"
    assert Event.objects.filter(replica=replica_id, reason__contains="evicted by admin (dashboard)").exists()


def test_a_refused_control_says_why(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    response = admin_client.post(control("replica", replica_id, "wake"))
    assert response.status_code == 302
    (message,) = outcome(response)
    assert message.startswith("Refused:") and "sleeping" in message


def test_scale_up_at_once_and_scale_down_after_confirmation(cluster, admin_client, dispatched) -> None:
    deploy("tiny-a")
    response = admin_client.post(control("scale", "tiny-a"), {"replicas": "2"})
    assert response.status_code == 302 and any("scaled to 2" in m for m in outcome(response))
    assert Replica.objects.filter(deployment__name="tiny-a").exclude(state="stopping").count() == 2
    assert Event.objects.filter(deployment="tiny-a", kind="deployment.changed", reason__contains="1 → 2").exists()

    asked = admin_client.post(control("scale", "tiny-a"), {"replicas": "1"})
    assert asked.status_code == 200 and b"Scale tiny-a down" in asked.content

    admin_client.post(control("scale", "tiny-a"), {"replicas": "1", "confirm": "yes"})
    assert Event.objects.filter(deployment="tiny-a", kind="deployment.changed", reason__contains="2 → 1").exists()


def test_switchover_asks_then_goes_through_the_failover_service(cluster, admin_client, dispatched) -> None:
    deploy("plain")
    asked = admin_client.post(control("switchover", "plain"))
    assert asked.status_code == 200 and b"Switch over plain" in asked.content

    response = admin_client.post(control("switchover", "plain"), {"confirm": "yes"})

    # The service is reached, and refuses a deployment without a standby, saying so.
    (message,) = outcome(response)
    assert "has no failover standby" in message


def test_restart_asks_then_starts_a_rolling_restart_through_the_service(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    assert f'action="{control("restart", "tiny-a")}"' in admin_client.get(DASHBOARD).content.decode()
    asked = admin_client.post(control("restart", "tiny-a"))
    assert asked.status_code == 200 and b"Restart tiny-a?" in asked.content
    assert DeploymentObserved.objects.get(deployment__name="tiny-a").restart_since is None

    done = admin_client.post(control("restart", "tiny-a"), {"confirm": "yes"})

    assert outcome(done) == [
        "tiny-a: rolling restart under way; the deployment shows how far it is and the events each step"
    ]
    assert DeploymentObserved.objects.get(deployment__name="tiny-a").restart_since is not None
    assert Replica.objects.filter(deployment__name="tiny-a").exclude(pk=replica_id).count() == 1, "its surge"
    asked_by = "rolling restart asked by admin (dashboard)"
    assert Event.objects.filter(deployment="tiny-a", reason__startswith=asked_by).exists()
    again = admin_client.post(control("restart", "tiny-a"), {"confirm": "yes"})
    said = outcome(again)
    assert any(m.startswith("Refused: a rolling restart of tiny-a is under way") for m in said), said


def test_drain_and_return_to_service(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    node = Replica.objects.get(pk=replica_id).node.name
    assert admin_client.post(control("drain", node)).status_code == 200  # the confirmation page

    response = admin_client.post(control("drain", node), {"confirm": "yes"})

    assert Node.objects.get(name=node).status == "draining"
    assert Replica.objects.get(pk=replica_id).state == "draining"
    assert Event.objects.filter(node=node, kind="node.draining", reason__contains="(dashboard)").exists()
    assert any("1 serving replica(s) going to sleep" in m for m in outcome(response))

    response = admin_client.post(control("undrain", node))

    assert Node.objects.get(name=node).status == "online"
    assert Event.objects.filter(node=node, kind="node.online", reason__contains="(dashboard)").exists()


def test_drain_moving_replicas_asks_then_replaces_them_on_another_node(cluster, admin_client, dispatched) -> None:
    replica_id = deploy("tiny-a")
    node = Replica.objects.get(pk=replica_id).node.name
    asked = admin_client.post(control("drain", node), {"move": "yes"})
    assert "each serving replica is replaced on another node, then stops" in asked.content.decode()

    response = admin_client.post(control("drain", node), {"move": "yes", "confirm": "yes"})

    assert Node.objects.get(name=node).status == "draining"
    assert Replica.objects.get(pk=replica_id).state == "serving", "it serves until its replacement does"
    (replacement,) = Replica.objects.exclude(pk=replica_id)
    assert replacement.node.name != node
    assert any("1 moving to other nodes, 0 serving replica(s) going to sleep" in m for m in outcome(response))
    assert 'title="replacing some of the replicas started before' in admin_client.get(DASHBOARD).content.decode()


def test_a_node_named_as_a_cloud_names_its_hosts_is_shown_and_drained(admin_client, dispatched) -> None:
    # EKS names a node by its host: dots, which the dashboard's links once refused (a 500 for all).
    name = "ip-10-0-1-2.ec2.internal"
    register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True)
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200 and f'data-node="{name}"' in page.content.decode()

    admin_client.post(control("drain", name), {"confirm": "yes"})
    assert Node.objects.get(name=name).status == "draining"
    admin_client.post(control("undrain", name))
    assert Node.objects.get(name=name).status == "online"


def test_a_nodes_labels_and_taints_are_set_from_its_form_through_the_service(cluster, admin_client, dispatched):
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True, labels={"zone": "a"})
    response = admin_client.post(control("marks", "node1"), {"labels": "pool=fast, zone=c", "taints": "team=research"})

    node = Node.objects.get(name="node1")
    assert (node.operator_labels, node.operator_taints) == ({"pool": "fast", "zone": "c"}, {"team": "research"})
    (event,) = Event.objects.filter(kind="node.changed")
    assert event.reason.startswith("admin (dashboard) set its labels and taints: labels pool=fast added, zone=a → ")
    assert any(m.startswith("node node1: labels nvidia.com/gpu.count=2,") for m in outcome(response))
    page = admin_client.get(DASHBOARD).content.decode()
    assert 'name="labels" value="pool=fast,zone=c"' in page and 'name="taints" value="team=research"' in page

    # What the form leaves out, operators set no more: the agent's own shows again.
    admin_client.post(control("marks", "node1"), {"labels": "pool=fast", "taints": ""})
    node = Node.objects.get(name="node1")
    assert (node.operator_labels, node.operator_taints, node.labels["zone"]) == ({"pool": "fast"}, {}, "a")

    refused = admin_client.post(control("marks", "node1"), {"labels": "pool", "taints": ""})
    assert any(m.startswith("Refused: labels: 'pool' is not key=value") for m in outcome(refused))
    assert Node.objects.get(name="node1").operator_labels == {"pool": "fast"}

    # A taint's effect after its value, as kubectl writes it (tests/scheduling/test_no_execute.py).
    admin_client.post(control("marks", "node1"), {"labels": "pool=fast", "taints": "team=research:NoExecute"})
    assert Node.objects.get(name="node1").operator_taints == {"team": "research:NoExecute"}
    page = admin_client.get(DASHBOARD).content.decode()
    assert 'name="taints" value="team=research:NoExecute"' in page
    refused = admin_client.post(control("marks", "node1"), {"labels": "pool=fast", "taints": "team=research:Later"})
    assert any("'Later' is no taint effect for team" in m for m in outcome(refused))


CONTROLS = [
    ("replica", "abc", "sleep"),
    ("replica", "abc", "wake"),
    ("replica", "abc", "evict"),
    ("scale", "tiny-a"),
    ("switchover", "tiny-a"),
    ("restart", "tiny-a"),
    ("drain", "node1"),
    ("undrain", "node1"),
    ("marks", "node1"),
]


@pytest.mark.parametrize("target", CONTROLS, ids=lambda t: "-".join(t))
def test_controls_refuse_non_staff_and_send_anonymous_users_to_login(viewer, client, target) -> None:
    url = control(*target)
    data = {"confirm": "yes", "replicas": "1"}
    assert viewer.post(url, data).status_code == 403
    anonymous = client.post(url, data)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith(reverse("admin:login"))
    assert not Event.objects.exists()


def test_controls_need_a_csrf_token(db) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.create_user("ops", is_staff=True))
    assert client.post(control("drain", "node1"), {"confirm": "yes"}).status_code == 403


def test_controls_only_accept_post(admin_client) -> None:
    assert admin_client.get(control("drain", "node1")).status_code == 405


def test_a_browser_asking_for_the_favicon_gets_one_without_logging_in(client):
    response = client.get("/favicon.ico")

    assert response.status_code == 200 and response["Content-Type"] == "image/svg+xml"
    assert response.content.startswith(b"<svg")
