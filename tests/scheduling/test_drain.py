"""Draining a node: nothing new lands on it, its serving replicas sleep; and back to service."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from scheduling.models import Event, Node, Replica
from tests.support.deployments import body, serve

pytestmark = pytest.mark.django_db


def test_a_drained_node_takes_no_new_replica_and_its_replicas_sleep(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2))
    for replica_id in Replica.objects.values_list("id", flat=True):
        serve(replica_id)
    on_node1 = list(Replica.objects.filter(node__name="node1").values_list("id", flat=True))
    dispatched.clear()

    response = api("post", "/api/nodes/node1/drain/")

    assert response.status_code == 200 and response.json()["status"] == "draining"
    assert set(Replica.objects.filter(pk__in=on_node1).values_list("state", flat=True)) <= {"draining"}
    assert [task for _, task, _ in dispatched] == ["inference.tasks.replica_to_cache"] * len(on_node1)
    assert Event.objects.filter(node="node1", reason__contains="drained by an operator").exists()

    api("post", "/api/deployments/tiny-a/scale/", {"replicas": 4})
    assert not Replica.objects.filter(node__name="node1", state="pending").exists(), "nothing new on node1"

    response = api("post", "/api/nodes/node1/undrain/")
    assert response.status_code == 200 and Node.objects.get(name="node1").status == "online"
    assert api("post", "/api/nodes/node1/undrain/").status_code == 409


def test_drain_controls_need_staff_and_a_known_node(cluster, api):
    viewer = APIClient()
    viewer.force_authenticate(User.objects.create_user("viewer"))
    assert viewer.post("/api/nodes/node1/drain/").status_code == 403
    assert viewer.get("/api/nodes/node1/").status_code == 200
    assert api("post", "/api/nodes/nope/drain/").status_code == 404
    Node.objects.filter(name="node2").update(status=Node.Status.OFFLINE)
    assert api("post", "/api/nodes/node2/drain/").status_code == 409
