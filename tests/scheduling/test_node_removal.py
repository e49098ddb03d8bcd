"""Removing a node that is gone for good (a retired host): its row and its GPUs' leave the books,
its ended replicas keep their history without it, and an Event says who removed it. Only an
offline node with nothing of the books on it: anything else is a 409 naming why, nothing removed."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from scheduling.models import GPU, Event, Node, Replica
from scheduling.services import nodes
from tests.support.deployments import body, serve

pytestmark = pytest.mark.django_db


def retired(api, tiny_model_dir) -> str:
    """node1, which served a replica of tiny-a and then stopped for good: the replica's id."""
    spread = {"spread": True}
    assert (
        api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2, placement=spread)).status_code
        == 201
    )
    on_node1 = Replica.objects.get(node__name="node1").id
    for replica in Replica.objects.all():
        serve(replica.id)
    nodes.mark_stopped("node1", "host retired")
    return on_node1


def test_an_offline_node_is_removed_with_its_gpus_and_its_replicas_keep_their_history(
    cluster, api, dispatched, tiny_model_dir
):
    ended = retired(api, tiny_model_dir)

    response = api("delete", "/api/nodes/node1/")

    assert response.status_code == 204
    assert not Node.objects.filter(name="node1").exists()
    assert not GPU.objects.filter(node__name="node1").exists()
    replica = Replica.objects.get(pk=ended)
    assert (replica.state, replica.node) == ("stopped", None), "its history stays, on no node"
    (removed,) = Event.objects.filter(kind="node.removed", node="node1")
    assert removed.reason == "removed by ops: its 2 GPU(s) leave the books" and removed.before["status"] == "offline"
    assert api("get", "/api/nodes/").json()["count"] == 1
    assert api("delete", "/api/nodes/node1/").status_code == 404


def test_the_records_a_removed_nodes_replicas_left_in_redis_are_still_stored(cluster, api, dispatched, tiny_model_dir):
    from gpuportal.wire import node_lease
    from gpuportal.wire.node_lease import NodeFence
    from gpuportal.wire.requestqueue import records_key
    from scheduling.models import RequestRecord
    from scheduling.services import queueing, traffic

    queue = queueing.queue()
    traffic.drain()  # what earlier tests left
    # A request its replica answered just before the node stopped: recorded in the node's list.
    had_epoch = queue.redis.exists(node_lease.epoch_key("node1"))
    fence = NodeFence("node1", node_lease.current_epoch(queue.redis, "node1"))
    node_lease.renew(queue.redis, "node1", 30, epoch=fence.epoch)
    try:
        request = queue.submit("tiny-a", kind="generate", input="hi", params={}, owner="1")
        assert queue.take("tiny-a", "a-replica", timeout=0, node=fence) is not None
        queue.finish(request.id, "a-replica", {"text": "hello"}, node=fence)
    finally:
        # No lease of node1 outlives the test, to be read by a later one's sweep.
        queue.redis.delete(node_lease.lease_key("node1"), *([] if had_epoch else [node_lease.epoch_key("node1")]))
    retired(api, tiny_model_dir)
    assert [r["id"] for r in queue.records(10, records_key("node1"))] == [request.id]

    assert api("delete", "/api/nodes/node1/").status_code == 204

    assert queue.record_counts([records_key("node1")]) == {records_key("node1"): 0}
    assert traffic.drain() == 1
    assert RequestRecord.objects.filter(request_id=request.id).exists()


@pytest.mark.parametrize("status", ["online", "draining"])
def test_a_node_whose_agent_may_still_beat_is_not_removed(cluster, api, status):
    Node.objects.filter(name="node1").update(status=status)

    response = api("delete", "/api/nodes/node1/")

    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"node node1 is {status}: stop its agent, or revoke its credential (`gpuportal node revoke node1`), "
        "before removing it"
    )
    assert GPU.objects.filter(node__name="node1").count() == 2
    assert not Event.objects.filter(kind="node.removed").exists()


def test_an_offline_node_the_books_still_place_a_replica_on_is_not_removed(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.select_related("node").get()
    serve(replica.id)
    # Offline, but not yet written off: the heartbeat sweep has not judged it.
    Node.objects.filter(pk=replica.node_id).update(status="offline")

    response = api("delete", f"/api/nodes/{replica.node.name}/")

    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"node {replica.node.name} still has 1 replica in the books (tiny-a {replica.id[:8]} serving): "
        "they end with the node's write-off, or with their deployment"
    )
    assert Node.objects.filter(pk=replica.node_id).exists()


def test_removing_needs_staff(cluster):
    viewer = APIClient()
    viewer.force_authenticate(User.objects.create_user("viewer"))
    Node.objects.filter(name="node1").update(status="offline")

    assert viewer.delete("/api/nodes/node1/").status_code == 403
    assert Node.objects.filter(name="node1").exists()


def test_a_removed_nodes_agent_that_starts_again_registers_it_anew(cluster, api, dispatched, tiny_model_dir):
    from inference.devices import virtual_gpus
    from tests.support.factories import NO_OVERHEAD

    retired(api, tiny_model_dir)
    assert api("delete", "/api/nodes/node1/").status_code == 204

    nodes.register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)

    assert Node.objects.get(name="node1").status == "online"
    assert GPU.objects.filter(node__name="node1").count() == 1


def test_the_admin_removes_selected_offline_nodes_and_says_why_it_keeps_the_others(cluster, admin_client):
    Node.objects.filter(name="node1").update(status="offline")
    ids = list(Node.objects.order_by("name").values_list("pk", flat=True))

    response = admin_client.post(
        "/admin/scheduling/node/", {"action": "remove_nodes", "_selected_action": ids}, follow=True
    )

    said = [str(m) for m in response.context["messages"]]
    assert "node1: removed, with its 2 GPU(s)" in said
    assert any(m.startswith("node2: node node2 is online: stop its agent") for m in said)
    assert list(Node.objects.values_list("name", flat=True)) == ["node2"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_agent_whose_node_was_removed_while_it_was_cut_off_stops_saying_how_to_register_again(start_agent, tmp_path):
    import signal

    from tests.support.processes import sweep_until_written_off

    agent = start_agent("gone", "1x2GiB")
    agent.send_signal(signal.SIGSTOP)  # cut off: its lease lapses and the sweep writes it off
    try:
        assert sweep_until_written_off("gone") == [["gone"]]
        nodes.remove("gone", by="ops")
    finally:
        agent.send_signal(signal.SIGCONT)

    code = agent.wait(60)

    log = (tmp_path / "agent-gone.log").read_text()
    assert code == 1, log[-3000:]
    assert "CommandError: node gone: the portal has no node of this name any more" in log, log[-3000:]
    assert not Node.objects.filter(name="gone").exists(), "a beat of a removed node brings back nothing"
