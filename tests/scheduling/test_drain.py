"""Draining a node: nothing new lands on it, its serving replicas sleep, and so do those that come
up there after the drain (they were loading or waking); and back to service."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from rest_framework.test import APIClient

from inference.devices import virtual_gpus
from scheduling.models import Deployment, DeploymentObserved, Event, Node, Occupant, Replica
from scheduling.services import nodes, reports, rollouts
from scheduling.services.nodes import register_node
from tests.support.deployments import STOP, TO_CACHE, body, invariant_holds, serve
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db

MiB = 1024**2


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
    assert Event.objects.filter(node="node1", reason__contains="drained by ops").exists()

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


def test_a_replica_loading_when_its_node_is_drained_goes_to_sleep_once_it_serves(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2, placement={"spread": True}))
    loading = {name: id_ for id_, name in Replica.objects.values_list("id", "node__name")}
    assert api("post", "/api/nodes/node1/drain/").status_code == 200
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        for replica_id in loading.values():
            serve(replica_id)

    assert Replica.objects.get(pk=loading["node1"]).state == "draining", "put to sleep as the drain would have"
    assert Replica.objects.get(pk=loading["node2"]).state == "serving", "another node's is not touched"
    assert [(task, args[0]) for _, task, args in dispatched] == [(TO_CACHE, loading["node1"])]
    assert Event.objects.filter(replica=loading["node1"], reason="node node1 was drained while it loaded").exists()


def test_a_replica_waking_when_its_node_is_drained_goes_back_to_sleep_once_woken(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica_id = Replica.objects.get().id
    serve(replica_id)
    assert api("post", f"/api/replicas/{replica_id}/sleep/").status_code == 200
    reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    assert api("post", f"/api/replicas/{replica_id}/wake/").json()["state"] == "waking"
    node = Replica.objects.get(pk=replica_id).node.name
    assert api("post", f"/api/nodes/{node}/drain/").status_code == 200

    reports.report(replica_id, {"event": "woken"})

    assert Replica.objects.get(pk=replica_id).state == "draining"
    assert Event.objects.filter(replica=replica_id, reason=f"node {node} was drained while it woke").exists()


@pytest.mark.django_db(transaction=True)
def test_a_replica_that_comes_up_while_a_drain_commits_is_put_to_sleep_by_one_or_the_other(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.select_related("node").get()
    reported = threading.Event()
    backend: list[int] = []

    def report_serving() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backend.append(cursor.fetchone()[0])
            serve(replica.id)
        finally:
            reported.set()
            connection.close()

    def waiting_on_a_lock() -> bool:
        if not backend:
            return False
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = %s", backend)
            return cursor.fetchone()[0] > 0

    with transaction.atomic():
        # The drain has marked the node and found nothing serving there, and has not committed:
        # the report, on its own connection, must not read the node as still online.
        assert nodes.drain(replica.node.name) == ([], [])
        report = threading.Thread(target=report_serving)
        report.start()
        wait_until(lambda: reported.is_set() or waiting_on_a_lock(), 30, "the report to finish or wait for the drain")
    report.join(30)

    assert Replica.objects.get(pk=replica.id).state == "draining", "neither the drain nor the report let it serve"


def test_a_request_when_every_node_is_drained_is_refused_naming_the_drain_and_how_to_undo_it(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    serve(Replica.objects.get().id)
    for node in ("node1", "node2"):
        assert api("post", f"/api/nodes/{node}/drain/").status_code == 200

    response = api("post", "/api/requests/", {"deployment": "tiny-a", "input": "Hello"})

    assert response.status_code == 409, response.json()
    assert response.json()["detail"] == (
        "cannot serve tiny-a: every node with a GPU is drained (node1, node2), and nothing is placed on a drained "
        "node: return one to service (`gpuportal node undrain node1`, POST /api/nodes/node1/undrain/)"
    )


def test_a_drained_nodes_sleeper_that_a_wake_loads_anew_elsewhere_is_stopped_and_its_memory_released(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    sleeper = Replica.objects.get().id
    serve(sleeper)
    node = Replica.objects.get(pk=sleeper).node.name
    assert api("post", f"/api/nodes/{node}/drain/").status_code == 200
    reports.report(sleeper, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    assert Replica.objects.get(pk=sleeper).state == "sleeping"
    dispatched.clear()

    response = api("post", "/api/requests/", {"deployment": "tiny-a", "input": "Hello"})

    assert response.status_code == 202, response.json()
    loaded = Replica.objects.exclude(pk=sleeper).get()
    assert loaded.state == "pending" and loaded.node.name != node, "loaded anew where it may be placed"
    stopped = Replica.objects.get(pk=sleeper)
    assert stopped.state == "stopping", "the sleeper it replaces leaves the drained node"
    stops = [(queue.removeprefix("node."), args[0]) for queue, task, args in dispatched if task == STOP]
    assert stops == [(node, sleeper)]
    assert Event.objects.filter(replica=sleeper, reason__contains=f"its node {node} is drained").exists()
    assert not Occupant.objects.filter(replica_id=sleeper).exists(), "what it held there released"
    assert Deployment.objects.get(name="tiny-a").replicas.filter(state__in=["pending", "sleeping"]).count() == 1


def test_a_wake_that_loads_elsewhere_stops_no_more_drained_sleepers_than_it_loaded(
    cluster, api, dispatched, tiny_model_dir
):
    # Two fit in the drained nodes' four GPUs, one in node3's.
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2, memory={"override_bytes": 600 * MiB}))
    sleepers = list(Replica.objects.order_by("created_at").values_list("id", flat=True))
    for replica_id in sleepers:
        serve(replica_id)
    for node in ("node1", "node2"):
        api("post", f"/api/nodes/{node}/drain/")
    for replica_id in sleepers:
        reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    deep = Replica.objects.get(pk=sleepers[1])
    deep.state = Replica.State.DEEP_SLEEPING
    deep.save(update_fields=["state"])
    register_node("node3", virtual_gpus("node3", "1x1GiB", NO_OVERHEAD), virtual=True)  # room for one

    response = api("post", "/api/requests/", {"deployment": "tiny-a", "input": "Hello"})

    assert response.status_code == 202, response.json()
    assert Replica.objects.exclude(pk__in=sleepers).get().node.name == "node3"
    states = dict(Replica.objects.filter(pk__in=sleepers).values_list("id", "state"))
    assert sorted(states.values()) == ["deep_sleeping", "stopping"], "one load, one sleeper replaced"
    assert states[sleepers[0]] == "stopping", "the oldest first"


# -- a drain that moves --------------------------------------------------------------------------


def live(name: str) -> dict[str, tuple[str, str]]:
    """The deployment's replicas that have not ended, oldest first: id → (state, node)."""
    rows = Replica.objects.filter(deployment__name=name).exclude(state__in=["stopped", "failed"])
    return {i: (state, node) for i, state, node in rows.order_by("created_at").values_list("id", "state", "node__name")}


def serving_spread(api, model_dir) -> None:
    """Deployment m's two replicas, one a node (placement.spread), each serving."""
    spread = body("m", model_dir, replicas=2, placement={"spread": True})
    assert api("post", "/api/deployments/", spread).status_code == 201
    for replica_id in live("m"):
        serve(replica_id)


def test_a_drain_that_moves_replaces_each_serving_replica_elsewhere_before_it_stops(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    serving_spread(api, tiny_model_dir)
    (moved,) = [i for i, (_, node) in live("m").items() if node == "node1"]
    (kept,) = [i for i, (_, node) in live("m").items() if node == "node2"]
    dispatched.clear()

    answer = api("post", "/api/nodes/node1/drain/", {"move": True})

    assert answer.status_code == 200 and answer.json()["status"] == "draining"
    (surge,) = [i for i in live("m") if i not in (moved, kept)]
    assert live("m") == {moved: ("serving", "node1"), kept: ("serving", "node2"), surge: ("pending", "node2")}
    assert not [task for _, task, _ in dispatched if task == TO_CACHE], "nothing put to sleep: it serves on"
    assert Event.objects.filter(
        deployment="m",
        reason="move off node node1 (drained by ops): 1 replica(s) to move, one at a time",
    ).exists()
    rollout = api("get", "/api/deployments/m/").json()["rollout"]
    assert (rollout["left"], rollout["move"]) == (1, True)

    with django_capture_on_commit_callbacks(execute=True):
        serve(surge)
    with django_capture_on_commit_callbacks(execute=True):
        rollouts.advance("m")
    assert live("m") == {moved: ("stopping", "node1"), kept: ("serving", "node2"), surge: ("serving", "node2")}
    assert [args[0] for _, task, args in dispatched if task == STOP] == [moved]
    observed = DeploymentObserved.objects.get(deployment__name="m")
    assert (observed.restart_since, observed.restart_only) == (None, ""), "the move is done; the other stays"
    # Its Events call it what it was: a move, not a rolling restart of the deployment.
    said = list(Event.objects.filter(deployment="m", reason__contains="replica").values_list("reason", flat=True))
    assert "move done: 1 replica(s) started since it was asked for" in said, said
    assert not [reason for reason in said if "rolling restart" in reason], said
    assert invariant_holds()


def test_a_drain_that_moves_with_no_room_elsewhere_puts_what_serves_there_to_sleep(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    # Four replicas of 900 MiB fill the four 1 GiB GPUs: no room elsewhere for node1's two.
    full = body("full", tiny_model_dir, replicas=4, memory={"override_bytes": 900 * MiB, "max_tokens": 256})
    assert api("post", "/api/deployments/", full).status_code == 201
    for replica_id in live("full"):
        serve(replica_id)
    on_node1 = sorted(i for i, (_, node) in live("full").items() if node == "node1")

    api("post", "/api/nodes/node1/drain/", {"move": True})
    with django_capture_on_commit_callbacks(execute=True):
        rollouts.advance("full")  # the beat's sweep: the next replica's turn

    assert len(live("full")) == 4, "nothing placed, nothing stopped"
    assert {live("full")[i][0] for i in on_node1} == {"draining"}, "they sleep there, as a drain without a move"
    for replica_id in on_node1:
        assert Event.objects.filter(
            replica=replica_id, reason__contains=f"no room for replica {replica_id[:8]}'s replacement elsewhere"
        ).exists()
    observed = DeploymentObserved.objects.get(deployment__name="full")
    assert (observed.restart_since, observed.restart_only) == (None, "")
    assert invariant_holds()


def test_a_drain_that_cannot_move_a_deployment_restarting_already_puts_its_replica_to_sleep(
    cluster, api, dispatched, tiny_model_dir
):
    serving_spread(api, tiny_model_dir)
    assert api("post", "/api/deployments/m/restart/").status_code == 202
    on_node1 = [i for i, (state, node) in live("m").items() if node == "node1" and state == "serving"]

    assert nodes.drain("node1", move=True) == (on_node1, [])
    assert {live("m")[i][0] for i in on_node1} == {"draining"}


def test_an_undrain_keeps_what_its_drain_had_still_to_move_and_stops_the_replacement_on_its_way(
    cluster, api, dispatched, tiny_model_dir
):
    serving_spread(api, tiny_model_dir)
    (moved,) = [i for i, (_, node) in live("m").items() if node == "node1"]
    api("post", "/api/nodes/node1/drain/", {"move": True})
    (surge,) = [i for i in live("m") if live("m")[i] == ("pending", "node2")]

    assert api("post", "/api/nodes/node1/undrain/").status_code == 200

    assert live("m")[moved] == ("serving", "node1"), "it stays where it serves"
    assert live("m")[surge][0] == "stopping", "its replacement would be one replica too many"
    observed = DeploymentObserved.objects.get(deployment__name="m")
    assert (observed.restart_since, observed.restart_only, observed.restart_surge) == (None, "", "")
    ended = Event.objects.filter(deployment="m", after__rollout="stopped").latest("pk").reason
    assert ended == (
        "move off node node1: node node1 returned to service by ops; 1 replica(s) stay there, and "
        f"replacement {surge[:8]} stops; nothing is left to move"
    )
    assert invariant_holds()


def test_an_undrain_leaves_the_move_of_what_the_nodes_taint_now_keeps_off(cluster, api, dispatched, tiny_model_dir):
    from scheduling.services import node_marks

    serving_spread(api, tiny_model_dir)
    api("post", "/api/nodes/node1/drain/", {"move": True})
    node_marks.change("node1", taints={"team": "research"}, by="ops")
    before = DeploymentObserved.objects.get(deployment__name="m").restart_only

    assert api("post", "/api/nodes/node1/undrain/").status_code == 200

    assert before and DeploymentObserved.objects.get(deployment__name="m").restart_only == before, "it moves on"


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        ({"move": "perhaps"}, {"move": ["Must be a valid boolean."]}),
        ({"mvoe": True}, {"mvoe": ["unknown field; did you mean 'move'?"]}),
    ],
)
def test_a_bad_drain_is_a_400_naming_what_is_wrong_and_drains_nothing(cluster, api, sent, said):
    answer = api("post", "/api/nodes/node1/drain/", sent)
    assert (answer.status_code, answer.json()) == (400, said)
    assert Node.objects.get(name="node1").status == "online"


def test_a_drain_that_moves_takes_a_replica_loading_there_too_which_serves_until_its_replacement_does(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    spread = body("m", tiny_model_dir, replicas=2, placement={"spread": True})
    assert api("post", "/api/deployments/", spread).status_code == 201
    (loading,) = [i for i, (_, node) in live("m").items() if node == "node1"]
    (kept,) = [i for i, (_, node) in live("m").items() if node == "node2"]
    serve(kept)

    api("post", "/api/nodes/node1/drain/", {"move": True})
    assert DeploymentObserved.objects.get(deployment__name="m").restart_only == loading
    assert len(live("m")) == 2, "its move waits for it to come up"
    with django_capture_on_commit_callbacks(execute=True):
        serve(loading)

    assert live("m")[loading] == ("serving", "node1"), "not put to sleep: its move replaces it"
    with django_capture_on_commit_callbacks(execute=True):
        rollouts.advance("m")
    (surge,) = [i for i in live("m") if i not in (loading, kept)]
    assert live("m")[surge] == ("pending", "node2")
    with django_capture_on_commit_callbacks(execute=True):
        serve(surge)
        rollouts.advance("m")
    assert live("m")[loading][0] == "stopping" and invariant_holds()
