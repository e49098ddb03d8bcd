"""The admin shows everything and never writes what the ledger owns."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.urls import reverse

from scheduling.models import (
    GPU,
    CapacityPlan,
    Deployment,
    Event,
    FailoverLease,
    Node,
    Occupant,
    PreemptionIntent,
    Replica,
)
from tests.support import factories as f

pytestmark = pytest.mark.django_db

MODELS = [Node, GPU, Deployment, Replica, Occupant, PreemptionIntent, FailoverLease, Event]


def url(model: type, view: str, *args: object) -> str:
    return reverse(f"admin:scheduling_{model._meta.model_name}_{view}", args=args)


@pytest.fixture
def world() -> dict:
    node = f.node("node1")
    gpu = f.gpu(node, 0)
    dep = f.deployment("tiny-a")
    rep = f.replica(dep, node, state="serving", gpu_memory_fraction=0.1, pid=1234)
    occupant = f.occupy(rep, gpu, 2 * f.GIB)
    waiting = f.replica(dep, node, state="waking")
    f.intent(waiting, gpu, f.GIB, victim=rep)
    gpu.wake_lock_holder = waiting
    gpu.save(update_fields=["wake_lock_holder"])
    FailoverLease.objects.create(deployment=dep, holder=rep, epoch=3)
    event = f.event(subject="replica tiny-a/x", reason="placed on node1/0")
    return {"node": node, "gpu": gpu, "deployment": dep, "replica": rep, "occupant": occupant, "event": event}


def test_every_model_is_registered() -> None:
    assert all(admin.site.is_registered(model) for model in MODELS)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_changelist_renders_for_a_superuser(admin_client, world: dict, model: type) -> None:
    response = admin_client.get(url(model, "changelist"))
    assert response.status_code == 200
    assert response.context["cl"].result_count == model.objects.count() > 0


def test_the_gpu_changelist_shows_bytes_in_gib_and_the_wake_lock(admin_client, world: dict) -> None:
    content = admin_client.get(url(GPU, "changelist")).content.decode()
    assert "24.00 GiB" in content
    assert "22.00 GiB" in content
    assert str(world["gpu"].wake_lock_holder) in content


def test_the_deployment_changelist_shows_the_need_placement_reserves_its_context_included(admin_client) -> None:
    f.gpu(f.node("node1"), 0, context_bytes=f.GIB // 2)
    f.gpu(f.node("node2"), 0, context_bytes=f.GIB)  # the largest, as placement counts it
    f.deployment("big", memory_estimate_bytes=2 * f.GIB)

    content = admin_client.get(url(Deployment, "changelist")).content.decode()

    assert "3.00 GiB" in content and "2.00 GiB" not in content


def test_the_deployment_changelist_counts_the_replicas_that_have_not_ended(admin_client) -> None:
    dep = f.deployment("tiny-a")
    f.replica(dep, state="serving")
    f.replica(dep, state="sleeping")
    f.replica(dep, state="stopped")
    f.replica(dep, state="failed")

    listed = admin_client.get(url(Deployment, "changelist"))

    (row,) = listed.context["cl"].result_list
    assert row.replica_count == 2, "the stopped and the failed are history"


def test_the_admin_is_titled_for_the_portal_and_shows_a_replicas_share_of_its_gpu_in_percent(
    admin_client, world: dict
) -> None:
    index = admin_client.get(reverse("admin:index")).content.decode()
    assert "gpuportal administration" in index and "Django administration" not in index
    replicas = admin_client.get(url(Replica, "changelist")).content.decode()
    assert "10.0 %" in replicas and "0.1<" not in replicas
    deployment = admin_client.get(url(Deployment, "change", world["deployment"].pk)).content.decode()
    assert "10.0 %" in deployment


def test_the_gpu_page_shows_occupants_and_refuses_edits(admin_client, world: dict) -> None:
    gpu: GPU = world["gpu"]
    page = admin_client.get(url(GPU, "change", gpu.pk))
    assert page.status_code == 200
    assert world["replica"].id in page.content.decode()  # the occupant inline

    response = admin_client.post(url(GPU, "change", gpu.pk), {"health": "degraded", "total_bytes": 1, "version": 99})

    assert response.status_code == 403
    before = (gpu.health, gpu.total_bytes, gpu.available_bytes, gpu.version)
    gpu.refresh_from_db()
    assert (gpu.health, gpu.total_bytes, gpu.available_bytes, gpu.version) == before


@pytest.mark.parametrize("model", MODELS)
def test_no_row_can_be_added_from_the_admin(admin_client, world: dict, model: type) -> None:
    assert admin_client.get(url(model, "add")).status_code == 403


def test_occupants_and_events_cannot_be_changed_or_deleted(admin_client, world: dict) -> None:
    occupant, event = world["occupant"], world["event"]

    response = admin_client.post(url(Occupant, "change", occupant.pk), {"reserved_bytes": 1})
    assert response.status_code == 403
    assert admin_client.post(url(Occupant, "delete", occupant.pk), {"post": "yes"}).status_code == 403
    assert admin_client.post(url(Event, "change", event.pk), {"reason": "rewritten"}).status_code == 403
    assert admin_client.post(url(Event, "delete", event.pk), {"post": "yes"}).status_code == 403

    occupant.refresh_from_db()
    event.refresh_from_db()
    assert occupant.reserved_bytes == 2 * f.GIB
    assert event.reason == "placed on node1/0"
    # Read-only pages still open, for looking.
    assert admin_client.get(url(Event, "change", event.pk)).status_code == 200
    assert admin_client.get(url(Occupant, "change", occupant.pk)).status_code == 200


@pytest.mark.parametrize("model", [Node, GPU, Deployment, Replica])
def test_state_rows_cannot_be_changed_or_deleted_until_services_own_the_controls(
    admin_client, world: dict, model: type
) -> None:
    row = model.objects.first()
    assert admin_client.post(url(model, "delete", row.pk), {"post": "yes"}).status_code == 403
    assert admin_client.post(url(model, "change", row.pk), {}).status_code == 403
    assert model.objects.filter(pk=row.pk).exists()
    assert admin_client.get(url(model, "change", row.pk)).status_code == 200, "still open for looking"


def test_the_event_changelist_has_a_date_hierarchy(admin_client, world: dict) -> None:
    response = admin_client.get(url(Event, "changelist"))
    assert response.context["cl"].date_hierarchy == "time"
    assert "placed on node1/0" in response.content.decode()


def test_the_event_changelist_shows_each_time_to_the_second(admin_client, world: dict) -> None:
    from django.utils import timezone

    event = Event.objects.filter(reason__contains="placed on node1/0").first()
    page = admin_client.get(url(Event, "changelist")).content.decode()
    assert timezone.localtime(event.time).strftime("%Y-%m-%d %H:%M:%S") in page


@pytest.mark.django_db
def test_a_plans_answer_says_where_the_target_holds_from_when_a_later_count_falls_short(admin_client) -> None:
    policies = [
        {"policy": "gpuportal-next", "fewest_gpus": 12, "holds_from": 15},
        {"policy": "gpuportal", "fewest_gpus": 18, "holds_from": 18},
        {"policy": "dedicated", "fewest_gpus": None, "holds_from": None},
    ]
    CapacityPlan.objects.create(state=CapacityPlan.State.DONE, percent=100, result={"policies": policies})

    page = admin_client.get(reverse("admin:scheduling_capacityplan_changelist")).content.decode()

    assert "gpuportal-next 12 (holds from 15), gpuportal 18, dedicated -" in page
