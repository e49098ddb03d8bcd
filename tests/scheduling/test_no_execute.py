"""NoExecute taints, as Kubernetes has them: `team=research:NoExecute` keeps new replicas off as a
NoSchedule taint does, and also moves off what runs there and does not tolerate it, each replica
replaced elsewhere before it stops, or stopped where there is no room; whether the taint comes
from an operator, the node's agent, or a deployment that stops tolerating it."""

from __future__ import annotations

import pytest
from django.core.management.base import CommandError

from gpuportal.cli.client import CliError
from gpuportal.cli.nodes import mark_changes
from gpuportal.management.commands.agent import Command as AgentCommand
from gpuportal.wire import node_labels
from inference.devices import virtual_gpus
from scheduling import tasks
from scheduling.models import DeploymentObserved, Event, Node, Replica
from scheduling.services import deployments, node_marks
from scheduling.services.errors import InvalidInput
from scheduling.services.nodes import register_node
from scheduling.services.replicas import RECONCILE_TASK
from tests.support.deployments import asleep, deploy, invariant_holds
from tests.support.factories import NO_OVERHEAD

EVICTING = {"team": "research:NoExecute"}


def start_agent(name: str, **marks) -> Node:
    """The node's agent registering (one 1 GiB virtual GPU: room for three replicas of `deploy`)."""
    return register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True, **marks)


def on(name: str) -> list[tuple[str, str]]:
    """Where the deployment's replicas are, and in which state, those that have not ended."""
    rows = Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed"))
    return sorted(rows.values_list("node__name", "state"))


def reconciles(dispatched: list) -> list[str]:
    return [args[0] for _, task, args in dispatched if task == RECONCILE_TASK]


# -- the rules -----------------------------------------------------------------------------------------


def test_a_taints_effect_follows_its_value_and_a_noschedule_one_is_kept_by_its_value_alone():
    assert node_labels.parse("team=research:NoExecute, gpu=a10:NoSchedule,rack=7", taints=True) == {
        "team": "research:NoExecute",
        "gpu": "a10",
        "rack": "7",
    }
    assert node_labels.taint_of("research:NoExecute") == ("research", "NoExecute")
    assert node_labels.taint_of("research") == ("research", "NoSchedule")
    assert node_labels.checked({"gpu": "a10:NoSchedule"}, "taints") == {"gpu": "a10"}
    assert node_labels.changed({}, {}, {"team": "research:NoExecute"}, taints=True) == (EVICTING, {})

    for text, said in (
        ("team=research:Prefer", "'Prefer' is no taint effect for team: NoSchedule"),
        ("team=:NoExecute", "'' is no value for team"),
    ):
        with pytest.raises(ValueError, match=said):
            node_labels.parse(text, taints=True)
    with pytest.raises(ValueError, match="'a:NoExecute' is no value for zone"):
        node_labels.parse("zone=a:NoExecute")  # a label has no effect
    with pytest.raises(ValueError, match="'Never' is no taint effect"):
        node_labels.checked({"team": "x:Never"}, "taints")


def test_a_toleration_names_a_taint_whatever_its_effect_and_only_noexecute_evicts():
    taints = {"team": "research:NoExecute", "gpu": "a10"}

    assert node_labels.untolerated(taints, node_labels.parse_tolerations("team=research")) == {"gpu": "a10"}
    assert node_labels.untolerated(taints, node_labels.parse_tolerations("team,gpu=a10")) == {}
    assert node_labels.evicting(taints, {}) == {"team": "research:NoExecute"}
    assert node_labels.evicting(taints, node_labels.parse_tolerations("team")) == {}
    with pytest.raises(ValueError, match="a toleration names a taint whatever its effect: write team=research"):
        node_labels.canonical_tolerations("team=research:NoExecute")
    refused = node_labels.refusals({"lab": ({}, taints)}, "d", "", "gpu=a10")
    assert refused == {"lab": "its taint team=research:NoExecute is not in d's placement.tolerations"}


def test_the_command_line_and_the_agent_read_an_effect_and_refuse_one_there_is_not(monkeypatch):
    assert mark_changes(["team=research:NoExecute", "gpu-"], "taints") == {"team": "research:NoExecute", "gpu": None}
    with pytest.raises(CliError, match="taints: 'Sometimes' is no taint effect for team"):
        mark_changes(["team=research:Sometimes"], "taints")
    with pytest.raises(CliError, match="labels: 'research:NoExecute' is no value for team"):
        mark_changes(["team=research:NoExecute"], "labels")

    assert AgentCommand._pairs("--taints", "team=research:NoExecute", "X", taints=True) == EVICTING
    with pytest.raises(CommandError, match="--taints team=a:NoSchedul: 'NoSchedul' is no taint effect"):
        AgentCommand._pairs("--taints", "team=a:NoSchedul", "X", taints=True)


# -- the service -----------------------------------------------------------------------------------------


def test_a_noexecute_taint_moves_off_what_does_not_tolerate_it_each_replaced_elsewhere_first(
    db, dispatched, django_capture_on_commit_callbacks
):
    start_agent("box")
    deploy("old")
    deploy("theirs", tolerations="team")
    start_agent("other")

    with django_capture_on_commit_callbacks(execute=True):
        node_marks.change("box", taints=EVICTING, by="ops")

    said = Event.objects.filter(kind="node.changed").latest("pk").reason
    assert said == (
        "ops set its taints: taints team=research:NoExecute added; replicas there that do not tolerate its "
        "NoExecute taints are moved off, each replaced elsewhere before it stops (stopped if there is no room): "
        "old (1)"
    )
    assert reconciles(dispatched) == ["node box's taints changed"]
    assert on("old") == [("box", "serving")], "nothing moves before the reconcile"

    tasks.reconcile("node box's taints changed")

    assert on("old") == [("box", "serving"), ("other", "pending")], "it serves until its replacement does"
    (old,) = Replica.objects.filter(deployment__name="old", node__name="box").values_list("id", flat=True)
    assert DeploymentObserved.objects.get(deployment__name="old").restart_only == old
    assert on("theirs") == [("box", "serving")], "what tolerates the taint stays"
    began = Event.objects.filter(deployment="old", reason__contains="NoExecute").latest("pk").reason
    assert began.startswith("move off node box, whose taint team=research:NoExecute it does not tolerate"), began
    assert node_marks.evict_untolerated() == {}, "a move under way is not begun again"
    assert invariant_holds()


def test_a_noexecute_taint_stops_what_it_cannot_move_for_want_of_room(db, dispatched):
    start_agent("box")
    deploy("old")
    node_marks.change("box", taints=EVICTING, by="ops")

    assert node_marks.evict_untolerated() == {"box": {"old": 1}}

    assert on("old") == [("box", "stopping")], "evicted, as Kubernetes evicts"
    (ended,) = Event.objects.filter(deployment="old", after__rollout="stopped").values_list("reason", flat=True)
    assert ended.startswith("move: no room for replica") and ended.endswith(
        "it stops all the same: node box's taint team=research:NoExecute is NoExecute and old does not tolerate it; "
        "nothing is left to move"
    )
    assert DeploymentObserved.objects.get(deployment__name="old").restart_since is None, "the move ended"
    assert node_marks.evict_untolerated() == {}, "nothing left there to move"
    assert invariant_holds()


def test_a_sleeper_on_a_noexecute_node_is_parked_and_its_next_wake_loads_elsewhere(db, dispatched):
    start_agent("box")
    asleep(deploy("old"))
    start_agent("other")
    node_marks.change("box", taints=EVICTING, by="ops")

    assert node_marks.evict_untolerated() == {"box": {"old": 1}}

    assert on("old") == [(None, "parked")], "it holds nothing on the node any more"
    assert node_marks.evict_untolerated() == {}
    assert invariant_holds()


def test_a_noschedule_taint_still_leaves_what_runs_there(db, dispatched):
    start_agent("box")
    start_agent("other", taints={"team": "research"})
    deploy("old")
    node_marks.change("box", taints={"team": "research"}, by="ops")

    assert node_marks.evict_untolerated() == {}
    assert on("old") == [("box", "serving")]


def test_a_deployment_that_stops_tolerating_a_noexecute_taint_is_moved_off(
    db, dispatched, django_capture_on_commit_callbacks
):
    # The agent's own taint, as its --taints team=research:NoExecute registers it.
    start_agent("box", taints=node_labels.parse("team=research:NoExecute", taints=True))
    deploy("theirs", tolerations="team")
    start_agent("other")

    with django_capture_on_commit_callbacks(execute=True):
        deployments.update("theirs", {"tolerations": ""})

    said = Event.objects.filter(deployment="theirs", reason__startswith="settings changed").latest("pk").reason
    assert said == (
        "settings changed: placement.tolerations 'team' → '' (for replicas placed from now on); 1 replica(s) on "
        "nodes whose NoExecute taints it no longer tolerates are moved off, each replaced elsewhere before it stops"
    )
    assert reconciles(dispatched) == ["deployment theirs's placement changed"]
    assert node_marks.evict_untolerated() == {"box": {"theirs": 1}}
    assert on("theirs") == [("box", "serving"), ("other", "pending")]


def test_a_taint_with_an_effect_there_is_not_is_refused_naming_it(db, dispatched, staff):
    start_agent("box")

    with pytest.raises(InvalidInput) as refused:
        node_marks.change("box", taints={"team": "research:noexecute"}, by="ops")
    assert refused.value.field == "taints.team"
    assert "NoSchedule (the default), PreferNoSchedule or NoExecute" in refused.value.message

    answer = staff.patch("/api/nodes/box/", {"taints": {"team": "a:NoExecute", "gpu": "b:Never"}}, format="json")
    assert answer.status_code == 400 and "'Never' is no taint effect for gpu" in str(answer.json())
    assert Node.objects.get(name="box").taints == {}, "nothing half-applied"
    assert staff.patch("/api/nodes/box/", {"taints": EVICTING}, format="json").json()["taints"] == EVICTING
