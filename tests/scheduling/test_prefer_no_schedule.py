"""PreferNoSchedule taints, as Kubernetes has them: `team=research:PreferNoSchedule` keeps nothing off
its node, but placement puts a deployment that does not tolerate it there last, when no other node
can host it as well (without evicting, or waking what sleeps there), and says so; what runs there
stays. Placement is pure (its `avoided_nodes`); the services read the taints
(gpuportal.wire.node_labels.avoidances)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.wire import node_labels
from inference.devices import virtual_gpus
from scheduling.core.placement import CachedReplica, Placement, PlacementRequest, place
from scheduling.core.state import OccupantView, Snapshot
from scheduling.models import Event, Node, Replica
from scheduling.services import node_marks, rollouts, scaling
from scheduling.services.errors import InvalidState
from scheduling.services.nodes import register_node
from tests.support.deployments import deploy, invariant_holds
from tests.support.factories import NO_OVERHEAD
from tests.support.views import gpu

GiB = 1024**3
MiB = 1024**2
NOW = datetime(2026, 1, 1, tzinfo=UTC)
PREFERRING = {"team": "research:PreferNoSchedule"}
AVOIDED = {"lab": "its taint team=research:PreferNoSchedule is not in d's placement.tolerations"}


# -- the rules -----------------------------------------------------------------------------------------


def test_a_prefer_no_schedule_taint_is_kept_with_its_effect_and_refuses_no_deployment():
    taints = node_labels.parse("team=research:PreferNoSchedule", taints=True)
    assert taints == PREFERRING
    marks = {"lab": ({}, taints), "plain": ({}, {})}

    assert node_labels.refusals(marks, "d", "", "") == {}, "it keeps nothing off"
    assert node_labels.avoidances(marks, "d", "") == AVOIDED
    assert node_labels.avoidances(marks, "d", "team") == {}, "a deployment that tolerates it has no last choice"
    assert node_labels.evicting(taints, {}) == {}, "and it moves nothing off"
    # A node with a hard taint too is refused: refusal goes first.
    both = {"lab": ({}, {**taints, "gpu": "a10"})}
    assert node_labels.refusals(both, "d", "", "") == {"lab": "its taint gpu=a10 is not in d's placement.tolerations"}


# -- the decision ------------------------------------------------------------------------------------


def test_placement_goes_to_a_node_it_avoids_only_when_no_other_can_host_it():
    snapshot = Snapshot({1: gpu(1, node="lab", total=8 * GiB), 2: gpu(2, node="plain", total=8 * GiB)}, NOW)
    request = PlacementRequest("d", "r-new", 3 * GiB, avoided_nodes=AVOIDED)

    for seed in range(20):
        chosen = place(snapshot, request, rng=random.Random(seed))
        assert isinstance(chosen, Placement) and chosen.node == "plain", seed
        assert "last choice" not in chosen.reason

    full = OccupantView("r-other", "other", "serving", 7 * GiB, dedicated=True)
    snapshot = Snapshot({1: gpu(1, node="lab", total=8 * GiB), 2: gpu(2, (full,), node="plain", total=8 * GiB)}, NOW)
    chosen = place(snapshot, request, rng=random.Random(0))
    assert isinstance(chosen, Placement) and chosen.node == "lab"
    assert chosen.reason.endswith(
        "node lab is a last choice: its taint team=research:PreferNoSchedule is not in d's placement.tolerations"
    ), chosen.reason


def test_a_node_it_avoids_is_used_before_anything_is_evicted_elsewhere():
    # An evictable tenant fills the node it prefers: Kubernetes evicts for a pod only where no node
    # fits it, and a PreferNoSchedule node fits.
    tenant = OccupantView("r-other", "other", "sleeping", 7 * GiB)
    snapshot = Snapshot({1: gpu(1, node="lab", total=8 * GiB), 2: gpu(2, (tenant,), node="plain", total=8 * GiB)}, NOW)

    chosen = place(snapshot, PlacementRequest("d", "r-new", 3 * GiB, avoided_nodes=AVOIDED), rng=random.Random(0))

    assert isinstance(chosen, Placement) and (chosen.node, chosen.evictions) == ("lab", ())


def test_a_sleeper_on_a_node_it_avoids_wakes_there_rather_than_a_new_replica_loads_elsewhere():
    # A wake is better than a load wherever it is: the taint ranks nodes within a level, not above it.
    sleeper = OccupantView("r-asleep", "d", "sleeping", 100 * MiB)
    snapshot = Snapshot({1: gpu(1, (sleeper,), node="lab", total=8 * GiB), 2: gpu(2, node="plain", total=8 * GiB)}, NOW)
    request = PlacementRequest("d", "r-new", GiB, cached=(CachedReplica("r-asleep", "lab"),), avoided_nodes=AVOIDED)

    chosen = place(snapshot, request, rng=random.Random(0))

    assert isinstance(chosen, Placement) and (chosen.node, chosen.promoted) == ("lab", "r-asleep")
    assert "last choice" not in chosen.reason, "it wakes where its weights are: no choice to explain"


@given(
    avoided=st.lists(st.booleans(), min_size=2, max_size=6),
    held=st.lists(st.integers(min_value=0, max_value=8), min_size=6, max_size=6),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_no_replica_goes_to_a_node_it_avoids_while_a_node_it_does_not_avoid_has_room(avoided, held, seed):
    names = [f"n{i}" for i in range(len(avoided))]
    tenants = {
        i: (OccupantView(f"t{i}", "other", "serving", held[i] * GiB, dedicated=True),) if held[i] else ()
        for i in range(len(names))
    }
    snapshot = Snapshot({i + 1: gpu(i + 1, tenants[i], node=name, total=8 * GiB) for i, name in enumerate(names)}, NOW)
    last = {name: "PreferNoSchedule" for name, no in zip(names, avoided, strict=True) if no}

    chosen = place(snapshot, PlacementRequest("d", "r-new", 3 * GiB, avoided_nodes=last), rng=random.Random(seed))

    preferred_with_room = [name for i, name in enumerate(names) if name not in last and 8 - held[i] >= 3]
    if preferred_with_room:
        assert isinstance(chosen, Placement) and chosen.node in preferred_with_room
    elif any(8 - held[i] >= 3 for i in range(len(names))):
        assert isinstance(chosen, Placement) and chosen.node in last


# -- the services ------------------------------------------------------------------------------------


def start_agent(name: str, **marks) -> Node:
    """The node's agent registering (one 1 GiB virtual GPU: room for three replicas of `deploy`)."""
    return register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True, **marks)


def nodes_of(name: str) -> list[str]:
    rows = Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed"))
    return sorted(rows.values_list("node__name", flat=True))


def test_replicas_fill_the_other_nodes_first_then_go_to_the_one_they_avoid_saying_why(db, dispatched):
    start_agent("lab", taints=node_labels.parse("team=research:PreferNoSchedule", taints=True))
    start_agent("plain")

    deploy("d", replicas=3)
    assert nodes_of("d") == ["plain", "plain", "plain"], "the node it avoids stays empty while another has room"

    scaling.scale("d", 4)

    assert nodes_of("d") == ["lab", "plain", "plain", "plain"], "then it is used, not refused"
    placed_there = Event.objects.filter(deployment="d", reason__contains="node lab is a last choice").count()
    assert placed_there == 1
    assert invariant_holds()


def test_an_operators_prefer_no_schedule_taint_leaves_what_runs_there_and_misplaces_nothing(db, dispatched, staff):
    start_agent("lab")
    deploy("d")

    answer = staff.patch("/api/nodes/lab/", {"taints": PREFERRING}, format="json")

    assert answer.status_code == 200 and answer.json()["taints"] == PREFERRING
    assert node_marks.evict_untolerated() == {}
    assert nodes_of("d") == ["lab"]
    with pytest.raises(InvalidState, match="no replica of d is on a node its placement refuses"):
        rollouts.restart("d", by="ops", misplaced=True)
