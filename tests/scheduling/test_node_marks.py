"""Labels and taints an operator sets on a node (`PATCH /api/nodes/NAME/`, `gpuportal node label`
and `taint`, as kubectl's): over what its agent says, kept across the agent's restarts, all or
none; and tolerations that name a taint's key alone (any value, Kubernetes' `Exists`)."""

from __future__ import annotations

import re
import threading

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpuportal.cli import app
from gpuportal.cli.client import CliError
from gpuportal.cli.nodes import mark_changes, moved_line
from gpuportal.wire import deployment_spec, node_labels
from inference.devices import virtual_gpus
from scheduling.models import Deployment, DeploymentObserved, Event, Node, Replica
from scheduling.services import deployments, node_marks
from scheduling.services.errors import CannotPlace, InvalidInput, NotFound
from scheduling.services.nodes import register_node
from scheduling.services.replicas import RECONCILE_TASK
from tests.support.deployments import deploy, invariant_holds
from tests.support.factories import NO_OVERHEAD

GPU_1GIB = {
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "1024",
    "nvidia.com/gpu.product": "Virtual-GPU-1-GiB",
}
TOLERATIONS = deployment_spec.BY_NAME["tolerations"]
MAP = '{"zone": "b", "gpu": null}'


def start_agent(name: str = "box", **marks) -> Node:
    """The node's agent registering, as it does at each start (one 1 GiB virtual GPU)."""
    return register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True, **marks)


def nodes_of(name: str) -> list[str]:
    return sorted(
        Replica.objects.filter(deployment__name=name, node__isnull=False).values_list("node__name", flat=True)
    )


# -- the rules -----------------------------------------------------------------------------------------


def test_operators_set_their_own_labels_over_the_agents_and_remove_only_those():
    agent = {"zone": "a", "gpu": "h100"}

    layer, refused = node_labels.changed(agent, {}, {"pool": "fast", "zone": "c"})
    assert (layer, refused) == ({"pool": "fast", "zone": "c"}, {})
    assert node_labels.merged(agent, layer) == {"gpu": "h100", "zone": "c", "pool": "fast"}, "the operator's win"

    layer, refused = node_labels.changed(agent, layer, {"zone": None})
    assert layer == {"pool": "fast"} and not refused
    assert node_labels.merged(agent, layer)["zone"] == "a", "the agent's value again"

    _, refused = node_labels.changed(agent, layer, {"gpu": None, "rack": None, "bad key": "x", "ok": "-x"})
    assert refused["gpu"] == "gpu=h100 is its agent's: start the agent without it, or set another value"
    assert refused["rack"] == "it has no rack"
    assert "'bad key' is no label key" in refused["bad key"]
    assert "'-x' is no value for ok" in refused["ok"]

    full = {f"k{i}": "v" for i in range(node_labels.MAX_PAIRS)}
    layer, refused = node_labels.changed(agent, {}, full)
    assert layer == full and not refused, "the operators' own count, not the agent's beside them"
    _, refused = node_labels.changed(agent, full, {"one": "more"})
    assert refused == {"one": f"at most {node_labels.MAX_PAIRS} set by operators, and this makes 33"}
    assert node_labels.changed(agent, full, {"k0": None}) == ({k: v for k, v in full.items() if k != "k0"}, {})


def test_a_bare_key_tolerates_any_value_of_its_taint():
    assert node_labels.parse_tolerations(" team , gpu=h100") == {"team": None, "gpu": "h100"}
    assert node_labels.canonical_tolerations("team, gpu=h100") == "gpu=h100,team"
    assert node_labels.untolerated({"team": "research", "gpu": "a10"}, {"team": None, "gpu": "h100"}) == {"gpu": "a10"}
    assert node_labels.untolerated({"team": "research"}, {"team": None}) == {}
    refused = node_labels.refusals({"lab": ({}, {"team": "research"}), "rack": ({}, {"rack": "7"})}, "d", "", "team")
    assert refused == {"rack": "its taint rack=7 is not in d's placement.tolerations"}

    for text, said in (("team=a,team", "team given twice (a and any value)"), ("-team", "'-team' is no label key")):
        with pytest.raises(ValueError, match=re.escape(said)):
            node_labels.canonical_tolerations(text)
    with pytest.raises(ValueError, match="'team' is not key=value"):
        node_labels.canonical("team")  # a node selector has no bare keys
    assert TOLERATIONS.check("team") == "team"


# -- the service -----------------------------------------------------------------------------------------


def test_a_label_an_operator_sets_places_a_selector_there_and_outlives_the_agents_restart(db, dispatched):
    start_agent(labels={"zone": "a"})
    with pytest.raises(CannotPlace):
        deploy("fast", node_selector="pool=fast")

    node = node_marks.change("box", labels={"pool": "fast"}, by="ops")
    assert node.labels == {**GPU_1GIB, "zone": "a", "pool": "fast"} and node.operator_labels == {"pool": "fast"}
    (event,) = Event.objects.filter(kind="node.changed")
    assert event.reason == "ops set its labels: labels pool=fast added"
    assert event.before == {"labels": {**GPU_1GIB, "zone": "a"}} and event.after == {"labels": node.labels}
    deploy("fast", node_selector="pool=fast")
    assert nodes_of("fast") == ["box"]

    start_agent(labels={"zone": "b"})
    assert Node.objects.get(name="box").labels == {**GPU_1GIB, "zone": "b", "pool": "fast"}, "kept, and the agent's new"
    assert invariant_holds()


def test_an_operators_value_wins_over_the_agents_until_removed(db, dispatched):
    start_agent(labels={"zone": "a"})
    node_marks.change("box", labels={"zone": "c"}, by="ops")
    start_agent(labels={"zone": "a"})
    assert Node.objects.get(name="box").labels["zone"] == "c"

    node = node_marks.change("box", labels={"zone": None}, by="ops")
    assert node.labels["zone"] == "a" and node.operator_labels == {}
    assert Node.objects.get(name="box").labels["zone"] == "a"


def test_a_taint_an_operator_sets_keeps_new_replicas_off_and_leaves_what_runs_there(db, dispatched):
    start_agent()
    deploy("old")
    node_marks.change("box", taints={"team": "research"}, by="ops")

    assert nodes_of("old") == ["box"], "NoSchedule: what runs there stays"
    said = Event.objects.filter(kind="node.changed").latest("pk").reason
    assert said == (
        "ops set its taints: taints team=research added; replicas there their placement now refuses stay until "
        "moved: old (1) (gpuportal node taint box --move, or gpuportal restart NAME --misplaced)"
    )
    with pytest.raises(CannotPlace) as refused:
        deployments.scale("old", 2)
    assert refused.value.reasons["box"] == "its taint team=research is not in old's placement.tolerations"
    deploy("theirs", tolerations="team")
    assert nodes_of("theirs") == ["box"], "a bare key tolerates any value of it"

    node_marks.change("box", taints={"team": None}, by="ops")
    deployments.scale("old", 2)
    assert nodes_of("old") == ["box", "box"] and invariant_holds()


def test_moving_the_misplaced_off_a_tainted_node_replaces_them_elsewhere_and_leaves_who_tolerates_it(
    db, dispatched, staff, django_capture_on_commit_callbacks
):
    start_agent("box")
    deploy("old")
    deploy("theirs", tolerations="team")
    start_agent("other")
    staff.patch("/api/nodes/box/", {"taints": {"team": "research"}}, format="json")
    said = Event.objects.filter(kind="node.changed").latest("pk").reason
    assert said.endswith(
        "replicas there their placement now refuses stay until moved: old (1) "
        "(gpuportal node taint box --move, or gpuportal restart NAME --misplaced)"
    )
    (old,) = Replica.objects.filter(deployment__name="old").values_list("id", flat=True)

    with django_capture_on_commit_callbacks(execute=True):
        answer = staff.post("/api/nodes/box/move-misplaced/")

    assert (answer.status_code, answer.json()) == (200, {"moving": {"old": 1}, "staying": {}})
    assert nodes_of("old") == ["box", "other"], "its replacement elsewhere; it serves until that one does"
    assert nodes_of("theirs") == ["box"], "what tolerates the taint stays"
    assert DeploymentObserved.objects.get(deployment__name="old").restart_only == old
    again = staff.post("/api/nodes/box/move-misplaced/").json()
    assert again == {"moving": {}, "staying": {"old": 1}}, "its move under way"
    assert staff.post("/api/nodes/nope/move-misplaced/").status_code == 404
    user = APIClient()
    user.force_authenticate(User.objects.create_user("someone"))
    assert user.post("/api/nodes/box/move-misplaced/").status_code == 403


def test_a_taint_lifted_asks_the_reconciler_to_place_what_a_deployment_lacks(
    db, dispatched, django_capture_on_commit_callbacks
):
    start_agent()
    deploy("short")
    node_marks.change("box", taints={"team": "research"}, by="ops")
    # A deployment short of a replica (as after a node's loss), which the taint keeps from its place.
    Deployment.objects.filter(name="short").update(replicas_wanted=2)
    assert deployments.reconcile_all("the beat") == {}

    with django_capture_on_commit_callbacks(execute=True):
        node_marks.change("box", taints={"team": None}, by="ops")
    assert [task for _, task, _ in dispatched if task == RECONCILE_TASK] == [RECONCILE_TASK]
    ((_, _, args),) = [d for d in dispatched if d[1] == RECONCILE_TASK]
    assert args == ["node box's taints changed"]
    assert list(deployments.reconcile_all(args[0])) == ["short"]
    assert nodes_of("short") == ["box", "box"]


@pytest.mark.parametrize(
    ("change", "field", "said"),
    [
        ({"labels": {"zone": None}}, "labels.zone", "zone=a is its agent's"),
        ({"labels": {"rack": None}}, "labels.rack", "it has no rack"),
        ({"taints": {"team": "x y"}}, "taints.team", "'x y' is no value for team"),
        ({"labels": {"pool": "fast"}, "taints": {"gone": None}}, "taints.gone", "it has no gone"),
    ],
)
def test_a_refused_change_names_what_is_wrong_and_changes_nothing(db, dispatched, change, field, said):
    start_agent(labels={"zone": "a"})
    before = Node.objects.values("labels", "taints", "operator_labels", "operator_taints").get(name="box")

    with pytest.raises(InvalidInput) as refused:
        node_marks.change("box", **change, by="ops")
    assert refused.value.field == field and said in refused.value.message
    assert Node.objects.values("labels", "taints", "operator_labels", "operator_taints").get(name="box") == before
    assert not Event.objects.filter(kind="node.changed").exists()
    with pytest.raises(NotFound):
        node_marks.change("nope", labels={"pool": "fast"}, by="ops")


def test_a_change_that_changes_nothing_records_nothing(db, dispatched):
    start_agent(labels={"zone": "a"})
    node_marks.change("box", labels={"pool": "fast"}, by="ops")
    node_marks.change("box", labels={"pool": "fast"}, taints={}, by="ops")
    assert Event.objects.filter(kind="node.changed").count() == 1

    node_marks.change("box", labels={"zone": "a"}, by="ops")
    last = Event.objects.filter(kind="node.changed").latest("pk")
    assert last.reason == "ops set its labels: labels as they were, set by operators now: pool=fast,zone=a"

    node_marks.change("box", labels={"zone": "c", "pool": None}, taints={"team": "research"}, by="ops")
    last = Event.objects.filter(kind="node.changed").latest("pk")
    assert last.reason == (
        "ops set its labels and taints: labels pool=fast removed, zone=a → zone=c; taints team=research added"
    )


@pytest.mark.django_db(transaction=True)
def test_an_agents_registration_and_an_operators_change_at_once_lose_neither(dispatched):
    start_agent()
    rounds = 6
    for round_ in range(rounds):
        # Both read the node and write it whole: only its row lock keeps one from writing over
        # what the other wrote.
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def run(call, barrier=barrier, errors=errors):
            from django.db import connection

            try:
                barrier.wait(10)
                call()
            except BaseException as err:  # pragma: no cover - shown by the assertion below
                errors.append(err)
            finally:
                connection.close()

        round_label = {f"r{round_}": "x"}
        threads = [
            threading.Thread(target=run, args=(lambda r=round_: start_agent(labels={"zone": f"z{r}"}),)),
            threading.Thread(target=run, args=(lambda lab=round_label: node_marks.change("box", labels=lab, by="o"),)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors
    node = Node.objects.get(name="box")
    assert node.operator_labels == {f"r{r}": "x" for r in range(rounds)}
    assert node.labels == {**GPU_1GIB, "zone": f"z{rounds - 1}", **node.operator_labels}


# -- the API and the command line ------------------------------------------------------------------------


def test_staff_set_and_remove_a_nodes_labels_and_taints_through_the_api(db, dispatched, staff):
    start_agent(labels={"zone": "a"})

    answer = staff.patch("/api/nodes/box/", {"labels": {"pool": "fast"}, "taints": {"team": "research"}}, format="json")
    assert answer.status_code == 200, answer.json()
    shown = answer.json()
    assert shown["labels"] == {**GPU_1GIB, "zone": "a", "pool": "fast"} and shown["operator_labels"] == {"pool": "fast"}
    assert shown["taints"] == {"team": "research"} == shown["operator_taints"]

    answer = staff.patch("/api/nodes/box/", {"taints": {"team": None}}, format="json")
    assert answer.status_code == 200 and answer.json()["taints"] == {}

    user = APIClient()
    user.force_authenticate(User.objects.create_user("someone"))
    assert user.patch("/api/nodes/box/", {"labels": {"pool": "slow"}}, format="json").status_code == 403
    assert staff.put("/api/nodes/box/", {"labels": {}}, format="json").status_code == 405


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (
            {"labels": ["pool=fast"]},
            {"labels": ['must map keys to values (null removes one): {"zone": "b", "gpu": null}']},
        ),
        ({"labels": {"pool": 3}}, {"labels": {"pool": ["must be a string, or null to remove it"]}}),
        ({"lables": {"pool": "fast"}}, {"lables": ["unknown field; did you mean 'labels'?"]}),
        (
            {"labels": {"zone": None}},
            {"labels.zone": ["node box: zone=a is its agent's: start the agent without it, or set another value"]},
        ),
    ],
)
def test_a_bad_patch_of_a_node_is_a_400_naming_what_is_wrong(db, dispatched, staff, sent, said):
    start_agent(labels={"zone": "a"})
    answer = staff.patch("/api/nodes/box/", sent, format="json")
    assert (answer.status_code, answer.json()) == (400, said)
    assert Node.objects.get(name="box").operator_labels == {}
    assert staff.patch("/api/nodes/nope/", {"labels": {"a": "b"}}, format="json").status_code == 404


def test_the_command_line_says_what_a_move_off_a_node_moves_and_what_stays():
    assert moved_line("box", {"moving": {}, "staying": {}}) == "nothing on node box is refused there: nothing to move"
    assert moved_line("box", {"moving": {"b": 2, "a": 1}, "staying": {"c": 1}}) == (
        "moving off node box, each replaced elsewhere before it stops: a (1), b (2); "
        "staying until their restarts are done: c (1)"
    )
    assert moved_line("box", {"moving": {}, "staying": {"c": 1}}) == (
        "nothing moves off node box now; staying until their restarts are done: c (1)"
    )


def test_the_command_line_reads_kubectls_changes_and_refuses_bad_ones_before_sending():
    assert mark_changes(["pool=fast", "zone-", "nvidia.com/gpu.product=H100"], "labels") == {
        "pool": "fast",
        "zone": None,
        "nvidia.com/gpu.product": "H100",
    }
    for items, said in (
        (["pool"], "labels: 'pool' is not key=value or key-"),
        (["bad key=x"], "labels: 'bad key' is no label key"),
        (["-x-"], "labels: '-x' is no label key"),
        (["pool=a", "pool-"], "labels: pool given twice"),
    ):
        with pytest.raises(CliError, match=said):
            mark_changes(items, "labels")


@pytest.mark.django_db(transaction=True)
def test_node_label_and_taint_change_a_node_and_print_where_it_stands(live_server, dispatched, capsys):
    start_agent(labels={"zone": "a"})
    staff = User.objects.create_user("ops", is_staff=True)
    env = {"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": Token.objects.create(user=staff).key}

    assert app.main(["node", "label", "box", "pool=fast"], env=env) == 0
    assert capsys.readouterr().out == "node box: labels pool=fast,zone=a (set by operators: pool=fast)\n"
    deploy("old")
    start_agent("other")
    assert app.main(["node", "taint", "box", "team=research", "--move"], env=env) == 0
    assert capsys.readouterr().out == (
        "node box: taints team=research (set by operators: team=research)\n"
        "moving off node box, each replaced elsewhere before it stops: old (1)\n"
    )
    assert nodes_of("old") == ["box", "other"]
    assert app.main(["node", "taint", "box", "--move"], env=env) == 0, "no change: what is refused there moves"
    assert capsys.readouterr().out.splitlines()[1] == (
        "nothing moves off node box now; staying until their restarts are done: old (1)"
    )
    assert app.main(["node", "taint", "box"], env=env) == 1
    assert "node taint: give KEY=VALUE to set, KEY- to remove, or --move" in capsys.readouterr().err
    assert app.main(["node", "taint", "box", "team-"], env=env) == 0
    assert capsys.readouterr().out == "node box: taints none (set by operators: none)\n"

    assert app.main(["node", "label", "box", "zone-"], env=env) == 1
    said = capsys.readouterr().err
    assert "labels.zone" in said and "zone=a is its agent's" in said
    assert Node.objects.get(name="box").operator_labels == {"pool": "fast"}
