"""A start command lost after its placement committed (the broker blinked as it was sent; there is
no outbox) is sent again by the node's next heartbeat once the grace is over: the replica is still
pending and the agent does not run its process. Sending it twice is harmless (the agent refuses to
start a replica it runs), and of two heartbeats only one resends."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduling.models import Event, Replica
from scheduling.services import nodes
from tests.support.deployments import START, body

pytestmark = pytest.mark.django_db


def test_a_pending_replica_the_agent_does_not_run_gets_its_start_again_once(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    assert api("post", "/api/deployments/", body("tiny-a", tiny_model_dir)).status_code == 201
    (replica,) = Replica.objects.filter(deployment__name="tiny-a")
    dispatched.clear()  # as if that START never reached the agent
    node = replica.node.name
    later = timezone.now() + timedelta(seconds=120)

    nodes.heartbeat(node, running=[], now=timezone.now())  # within the grace: nothing yet
    assert dispatched == []
    nodes.heartbeat(node, running=[replica.id], now=later)  # it runs: nothing was lost
    assert dispatched == []

    with django_capture_on_commit_callbacks(execute=True):
        assert nodes.resend_lost_starts(node, [], later) == [replica.id]
        assert nodes.resend_lost_starts(node, [], later) == [], "claimed by the first: no second resend"
        nodes.heartbeat(node, running=[], now=later)
    assert [(q, t, a[:1]) for q, t, a in dispatched] == [(f"node.{node}", START, [replica.id])]
    assert Event.objects.filter(replica=replica.id, reason__contains="its start command was lost").count() == 1


def test_a_replica_that_left_pending_is_not_started_again(cluster, api, dispatched, tiny_model_dir):
    assert api("post", "/api/deployments/", body("tiny-b", tiny_model_dir)).status_code == 201
    (replica,) = Replica.objects.filter(deployment__name="tiny-b")
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.LOADING)

    assert nodes.resend_lost_starts(replica.node.name, [], timezone.now() + timedelta(seconds=120)) == []
