"""Node labels and taints, a deployment's node selector and tolerations: an agent declares what its
host is (`--labels gpu=h100,zone=b`) and what it keeps off (`--taints team=research`); a
deployment's `placement.node_selector` keeps its replicas, new or woken, on the nodes whose labels
hold every pair it names, and only a deployment whose `placement.tolerations` name each of a
node's taints is placed there (gpuportal.wire.node_labels, placement's `refused_nodes`). Placement
is pure; the services read each node's labels and taints; bad syntax is a 400 naming the setting
wherever it is given."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.cli.client import CliError
from gpuportal.cli.render import nodes_table
from gpuportal.cli.setting_values import parse_value
from gpuportal.wire import deployment_spec, node_labels
from gpuportal.wire.commands import WireError
from gpuportal.wire.control import Call, decode_call, encode_call
from gpuportal.wire.memory import MiB
from gpuportal.wire.node_reports import DeviceInfo
from inference.devices import virtual_gpus
from scheduling.core.placement import CachedReplica, CantAccommodate, Placement, PlacementRequest, place
from scheduling.core.state import OccupantView, Snapshot
from scheduling.models import Deployment, DeploymentObserved, Event, Node, PreemptionIntent, Replica
from scheduling.services import deployments, sleep
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.errors import CannotPlace, InvalidInput
from scheduling.services.nodes import register_node
from tests.support.deployments import asleep, body, deploy, invariant_holds, serve
from tests.support.factories import NO_OVERHEAD
from tests.support.views import gpu

GiB = 1024**3
NOW = datetime(2026, 1, 1, tzinfo=UTC)
SELECTOR = deployment_spec.BY_NAME["node_selector"]
DASHBOARD = reverse("admin:scheduling_dashboard")
# What a node of one 1 GiB virtual GPU is labelled by its GPUs (gpu_labels, tested on its own below).
GPU_1GIB = {
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "1024",
    "nvidia.com/gpu.product": "Virtual-GPU-1-GiB",
}


# -- the syntax --------------------------------------------------------------------------------------


def test_labels_and_selectors_are_key_value_pairs_kept_in_one_canonical_order():
    assert node_labels.parse("") == {}
    assert node_labels.parse(" zone=b , gpu=h100,") == {"zone": "b", "gpu": "h100"}
    assert node_labels.canonical("zone=b, gpu=h100") == "gpu=h100,zone=b"
    assert node_labels.parse("nvidia.com/gpu.product=H100-SXM") == {"nvidia.com/gpu.product": "H100-SXM"}
    assert node_labels.matches({"gpu": "h100", "zone": "b"}, {"gpu": "h100"})
    assert not node_labels.matches({"gpu": "a10"}, {"gpu": "h100"})
    assert not node_labels.matches({}, {"gpu": "h100"}), "a node without the key does not match"
    assert node_labels.matches({}, {}), "an empty selector matches every node"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("gpu", "'gpu' is not key=value"),
        ("gpu=", "'' is no value for gpu"),
        ("=h100", "'' is no label key"),
        ("gpu=h 100", "'h 100' is no value for gpu"),
        ("-gpu=h100", "'-gpu' is no label key"),
        ("gpu=h100,gpu=a10", "gpu given twice (h100 and a10)"),
        ("k=" + "v" * 64, "is no value for k"),
    ],
)
def test_a_bad_label_or_selector_says_what_is_wrong(text, said):
    with pytest.raises(ValueError) as raised:
        node_labels.parse(text)
    assert said in str(raised.value)


# -- the decision ------------------------------------------------------------------------------------


def test_placement_neither_starts_nor_wakes_a_replica_on_a_node_it_refuses():
    sleeper = OccupantView("r-asleep", "d", "sleeping", 100 * MiB)
    snapshot = Snapshot({1: gpu(1, (sleeper,), node="a", total=24 * GiB), 2: gpu(2, node="b", total=24 * GiB)}, NOW)
    refused = {"a": "its labels do not match"}
    request = PlacementRequest("d", "r-new", GiB, cached=(CachedReplica("r-asleep", "a"),), refused_nodes=refused)

    for seed in range(10):
        placement = place(snapshot, request, rng=random.Random(seed))
        assert isinstance(placement, Placement) and placement.node == "b" and placement.promoted is None

    wake_there = PlacementRequest(
        "d", "r-asleep", GiB, cached=(CachedReplica("r-asleep", "a"),), allow_new=False, refused_nodes=refused
    )
    nowhere = place(snapshot, wake_there)
    assert isinstance(nowhere, CantAccommodate)
    assert nowhere.reasons["a"] == "its labels do not match"


@given(
    labels=st.lists(st.sampled_from(["gpu=h100", "gpu=a10", "zone=a", "zone=b", ""]), min_size=1, max_size=5),
    selector=st.sampled_from(["", "gpu=h100", "zone=b", "gpu=h100,zone=b"]),
    count=st.integers(min_value=1, max_value=6),
    seed=st.integers(min_value=0, max_value=100),
)
def test_no_replica_is_ever_placed_on_a_node_whose_labels_the_selector_does_not_match(labels, selector, count, seed):
    from scheduling.core.planning import place_all

    nodes = {f"n{i}": node_labels.parse(text) for i, text in enumerate(labels)}
    snapshot = Snapshot({i + 1: gpu(i + 1, node=name, total=8 * GiB) for i, name in enumerate(nodes)}, NOW)
    wanted = node_labels.parse(selector)
    refused = {name: "no match" for name, have in nodes.items() if not node_labels.matches(have, wanted)}
    requests = [PlacementRequest("d", f"r{i}", 3 * GiB, refused_nodes=refused) for i in range(count)]

    result = place_all(
        snapshot,
        requests,
        occupant_for=lambda p: OccupantView(p.replica_id, "d", "pending", 0),
        reason="scale",
        rng=random.Random(seed),
    )

    if isinstance(result, CantAccommodate):
        assert count > 2 * (len(nodes) - len(refused)), "refused only where the matching nodes are full"
    else:
        assert all(node_labels.matches(nodes[p.node], wanted) for p in result.placements)


# -- applied -----------------------------------------------------------------------------------------


@pytest.fixture
def labelled(db):
    """Node `h100` (gpu=h100, zone=b) and node `a10` (gpu=a10, zone=b), each one 1 GiB virtual GPU."""
    for name, labels in (("h100", {"gpu": "h100", "zone": "b"}), ("a10", {"gpu": "a10", "zone": "b"})):
        register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True, labels=labels)


def nodes_of(name: str) -> list[str]:
    return sorted(
        Replica.objects.filter(deployment__name=name, node__isnull=False).values_list("node__name", flat=True)
    )


def test_a_deployment_places_its_replicas_only_on_nodes_its_selector_matches(labelled, dispatched):
    deploy("big", replicas=3, node_selector="gpu=h100")

    assert nodes_of("big") == ["h100"] * 3
    with pytest.raises(CannotPlace) as refused:
        deployments.scale("big", 4)
    assert "its labels do not match big's placement.node_selector gpu=h100" in refused.value.reasons["a10"]
    assert nodes_of("big") == ["h100"] * 3 and invariant_holds()


def test_a_scale_past_what_the_matching_nodes_could_ever_hold_says_so_counting_only_them(labelled, dispatched):
    # Two GPUs of 1 GiB hold six replicas of 300 MiB, but the one it may use holds three.
    deploy("big", node_selector="gpu=h100")

    with pytest.raises(CannotPlace) as refused:
        deployments.scale("big", 5)

    assert "5 replicas of 300.0 MiB never fit at once: the 1 GPU(s) placement may use hold at most 3" in str(
        refused.value
    )


def test_a_deploy_that_no_node_matches_is_a_409_naming_the_selector_and_creates_nothing(
    labelled, staff, dispatched, tiny_model_dir
):
    response = staff.post(
        "/api/deployments/", body("nowhere", tiny_model_dir, placement={"node_selector": "gpu=b200"}), format="json"
    )

    assert response.status_code == 409, response.json()
    assert "placement.node_selector gpu=b200" in str(response.json())
    assert not Deployment.objects.filter(name="nowhere").exists()


def test_a_bad_selector_is_a_400_naming_it_and_a_good_one_is_stored_in_its_canonical_order(
    labelled, staff, dispatched, tiny_model_dir
):
    bad = staff.post(
        "/api/deployments/", body("typo", tiny_model_dir, placement={"node_selector": "gpu"}), format="json"
    )
    assert bad.status_code == 400
    assert "'gpu' is not key=value" in bad.json()["placement"]["node_selector"][0]
    assert not Deployment.objects.filter(name="typo").exists()

    good = staff.post(
        "/api/deployments/",
        body("fine", tiny_model_dir, placement={"node_selector": "zone=b, gpu=a10"}),
        format="json",
    )
    assert good.status_code == 201, good.json()
    assert good.json()["placement"]["node_selector"] == "gpu=a10,zone=b"
    assert nodes_of("fine") == ["a10"]

    patched = staff.patch("/api/deployments/fine/", {"placement": {"node_selector": "gpu=="}}, format="json")
    assert patched.status_code == 400 and "node_selector" in patched.json()["placement"]
    assert Deployment.objects.get(name="fine").placement_node_selector == "gpu=a10,zone=b", "nothing applied"


def test_a_service_caller_gets_the_same_refusal_as_the_api(labelled, dispatched):
    with pytest.raises(InvalidInput) as refused:
        deploy("typo", node_selector="gpu=h100,=x")
    assert refused.value.field == "placement.node_selector" and "'' is no label key" in str(refused.value)
    assert not Deployment.objects.filter(name="typo").exists()


def test_a_changed_selector_applies_to_the_replicas_placed_from_then_on_and_says_so(labelled, dispatched):
    deploy("chat", node_selector="gpu=a10")

    deployments.update("chat", {"node_selector": "gpu=h100"})
    deployments.scale("chat", 2)

    assert nodes_of("chat") == ["a10", "h100"], "the running one stays until a restart replaces it"
    changed = Event.objects.filter(deployment="chat", reason__startswith="settings changed").latest("pk")
    assert changed.reason == (
        "settings changed: placement.node_selector 'gpu=a10' → 'gpu=h100' (for replicas placed from now on); "
        "1 replica(s) on nodes it now refuses stay there until moved (gpuportal restart chat --misplaced)"
    )


def test_a_restart_of_the_misplaced_moves_only_the_replicas_its_placement_now_refuses(labelled, dispatched, staff):
    # Two replicas on h100, then only a10 may hold them, and a third is placed there.
    deploy("chat", replicas=2, node_selector="gpu=h100")
    deployments.update("chat", {"node_selector": "gpu=a10"})
    deployments.scale("chat", 3)
    for replica in Replica.objects.filter(deployment__name="chat", state="pending"):
        serve(replica.id)
    on_h100 = sorted(Replica.objects.filter(deployment__name="chat", node__name="h100").values_list("id", flat=True))
    assert len(on_h100) == 2 and nodes_of("chat") == ["a10", "h100", "h100"]
    assert staff.post("/api/deployments/nope/restart/", {"misplaced": True}, format="json").status_code == 404

    answer = staff.post("/api/deployments/chat/restart/", {"misplaced": True}, format="json")

    assert answer.status_code == 202, answer.json()
    assert answer.json()["rollout"]["left"] == 2
    began = Event.objects.filter(deployment="chat", reason__contains="2 replica(s) to move").get()
    assert "h100: its labels do not match chat's placement.node_selector gpu=a10" in began.reason
    (surge,) = Replica.objects.filter(deployment__name="chat", state="pending").exclude(node__name="h100")
    assert surge.node.name == "a10", "its replacement where its placement allows"
    assert DeploymentObserved.objects.get(deployment__name="chat").restart_only == " ".join(on_h100)

    second = staff.post("/api/deployments/chat/restart/", {"misplaced": True}, format="json")
    assert second.status_code == 409 and "under way" in second.json()["detail"]


@pytest.mark.django_db(transaction=True)
def test_the_command_line_moves_the_misplaced_alone(labelled, live_server, capsys, dispatched):
    from tests.support.cli import staff_cli

    moved = deploy("chat", node_selector="gpu=h100")
    deployments.update("chat", {"node_selector": "gpu=a10"})

    code, _, err = staff_cli(live_server, capsys, "restart", "chat")("--misplaced", "--no-wait")

    assert code == 0, err
    assert err.startswith("chat: moving its replicas off nodes its placement refuses, one at a time"), err
    assert DeploymentObserved.objects.get(deployment__name="chat").restart_only == moved
    assert nodes_of("chat") == ["a10", "h100"], "its replacement placed where it may be, beside it"


def test_a_restart_of_the_misplaced_with_none_misplaced_or_a_bad_body_changes_nothing(labelled, dispatched, staff):
    deploy("chat", node_selector="gpu=h100")

    none = staff.post("/api/deployments/chat/restart/", {"misplaced": True}, format="json")
    assert (none.status_code, none.json()) == (
        409,
        {"detail": "no replica of chat is on a node its placement refuses: nothing to move"},
    )
    bad = staff.post("/api/deployments/chat/restart/", {"misplaced": "maybe"}, format="json")
    assert (bad.status_code, bad.json()) == (400, {"misplaced": ["Must be a valid boolean."]})
    assert DeploymentObserved.objects.get(deployment__name="chat").restart_since is None


def asleep_on_a10_then_wanted_on_h100() -> str:
    """`chat`'s one replica, asleep on a10; its selector then changed to gpu=h100: its id."""
    sleeper = deploy("chat", node_selector="gpu=a10")
    sleep.sleep_replica(sleeper, reason="idle")
    asleep(sleeper)
    deployments.update("chat", {"node_selector": "gpu=h100"})
    return sleeper


def test_a_wake_loads_anew_on_a_matching_node_and_retires_the_sleeper_its_selector_no_longer_matches(
    labelled, dispatched
):
    sleeper = asleep_on_a10_then_wanted_on_h100()

    woken = sleep.wake_deployment("chat", reason="woken by a request", for_requests=True)

    assert len(woken) == 1 and woken != [sleeper]
    assert Replica.objects.get(pk=woken[0]).node.name == "h100"
    gone = Replica.objects.get(pk=sleeper)
    assert gone.state in (Replica.State.STOPPING, Replica.State.STOPPED)
    why = "its node a10: its labels do not match chat's placement.node_selector gpu=h100"
    assert Event.objects.filter(replica=sleeper, reason__contains=why).exists()
    assert invariant_holds()


def test_a_fair_wake_waits_for_room_on_a_matching_node_rather_than_wake_its_copy_on_one_it_no_longer_matches(
    labelled, dispatched
):
    # chat's copy sleeps on a10, whose GPU is free; its selector now wants h100, whose GPU another
    # deployment fills: the wake waits for room there (a fair wake's intent on h100's GPU) rather
    # than promote the copy where its selector says it must not run.
    sleeper = asleep_on_a10_then_wanted_on_h100()
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=900 * MiB)
    other = DeploymentSpec(name="other", source="/srv/models/tiny", override_bytes=900 * MiB, node_selector="gpu=h100")
    create(other, facts=facts)
    assert nodes_of("other") == ["h100"]

    woken = sleep.wake_deployment("chat", reason="woken by a request", for_requests=True)

    assert len(woken) == 1 and woken != [sleeper]
    waiting = PreemptionIntent.objects.filter(waiting_replica_id=woken[0])
    assert {i.gpu.node.name for i in waiting} == {"h100"}
    assert Replica.objects.get(pk=sleeper).state == Replica.State.SLEEPING, "not woken where it may not run"
    assert invariant_holds()


def test_waking_one_sleeper_on_a_node_its_selector_no_longer_matches_is_refused_naming_why(labelled, dispatched):
    sleeper = asleep_on_a10_then_wanted_on_h100()

    with pytest.raises(CannotPlace) as refused:
        sleep.wake_replica(sleeper, reason="woken by an operator")

    assert "placement.node_selector gpu=h100" in str(refused.value.reasons)
    assert Replica.objects.get(pk=sleeper).state == Replica.State.SLEEPING


def test_a_tainted_node_takes_only_the_deployments_that_tolerate_each_of_its_taints(db, dispatched):
    # Each node has room for three replicas of 300 MiB.
    taints = {"team": "research", "gpu": "h100"}
    register_node("reserved", virtual_gpus("reserved", "1x1GiB", NO_OVERHEAD), virtual=True, taints=taints)
    register_node("shared", virtual_gpus("shared", "1x1GiB", NO_OVERHEAD), virtual=True)

    deploy("anyone", replicas=3)
    assert nodes_of("anyone") == ["shared"] * 3, "untainted nodes only, though the tainted one has room"
    with pytest.raises(CannotPlace) as half:
        deploy("half", tolerations="team=research")
    assert half.value.reasons["reserved"] == "its taint gpu=h100 is not in half's placement.tolerations"
    assert not Deployment.objects.filter(name="half").exists()

    deploy("theirs", replicas=2, tolerations="team=research,gpu=h100")
    assert nodes_of("theirs") == ["reserved"] * 2
    assert invariant_holds()


# -- the node's side ---------------------------------------------------------------------------------


def test_a_nodes_gpus_label_it_with_their_product_count_and_memory_as_kubernetes_names_them():
    def device(index: int, product: str, gib: int) -> DeviceInfo:
        return DeviceInfo(index, f"GPU-{index}", product, gib * GiB - 500 * MiB, False, nvml_total_bytes=gib * GiB)

    eight = [device(i, "NVIDIA H100 80GB HBM3", 80) for i in range(8)]
    assert node_labels.gpu_labels(eight) == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "81920",
    }
    mixed = [device(0, "NVIDIA A10", 24), device(1, "NVIDIA L4", 22)]
    assert node_labels.gpu_labels(mixed) == {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "22528"}
    assert node_labels.gpu_labels([]) == {}
    assert node_labels.gpu_labels(virtual_gpus("v", "2x4GiB", NO_OVERHEAD))["nvidia.com/gpu.product"] == (
        "Virtual-GPU-4-GiB"
    )


def test_a_deployment_selects_nodes_by_their_gpus_with_no_label_declared(db, dispatched):
    register_node("big", virtual_gpus("big", "1x2GiB", NO_OVERHEAD), virtual=True)
    register_node("small", virtual_gpus("small", "1x1GiB", NO_OVERHEAD), virtual=True)

    deploy("chat", replicas=2, node_selector="nvidia.com/gpu.product=Virtual-GPU-2-GiB")

    assert nodes_of("chat") == ["big", "big"]


def test_an_agent_declares_its_labels_at_registration_and_a_change_of_them_is_an_event(db, dispatched):
    devices = virtual_gpus("edge", "1x1GiB", NO_OVERHEAD)
    gpus = node_labels.gpu_labels(devices)
    register_node("edge", devices, virtual=True, labels={"gpu": "a10"})
    assert Node.objects.get(name="edge").labels == {**gpus, "gpu": "a10"}
    assert Event.objects.filter(node="edge", reason__contains="labels gpu=a10,nvidia.com/gpu.count=1").exists()

    register_node("edge", devices, virtual=True, labels={"gpu": "a10", "zone": "b"})
    latest = Event.objects.filter(node="edge").latest("pk").reason
    assert latest.endswith("; labels zone=b added"), latest

    register_node("edge", devices, virtual=True, labels={"gpu": "h100"})  # started again with other --labels
    assert Node.objects.get(name="edge").labels == {**gpus, "gpu": "h100"}
    assert Event.objects.filter(node="edge").latest("pk").reason.endswith("; labels gpu=a10 → gpu=h100, zone=b removed")

    register_node("edge", devices, virtual=True, taints={"team": "research"})  # and without --labels
    assert Node.objects.get(name="edge").labels == gpus, "only what its GPUs say"
    latest = Event.objects.filter(node="edge").latest("pk").reason
    assert latest.endswith("; labels gpu=h100 removed; taints team=research added"), latest


@pytest.mark.parametrize(
    ("given", "env", "declared"),
    [
        pytest.param({"gpu": "h100"}, "zone=a", {"gpu": "h100"}, id="--labels"),
        pytest.param(None, "zone=a, gpu=a10", {"zone": "a", "gpu": "a10"}, id="GPUPORTAL_NODE_LABELS"),
        pytest.param(None, "", None, id="none: not sent"),
    ],
)
def test_an_agent_registers_with_the_labels_and_taints_it_was_given_else_those_of_its_environment(
    tmp_path, settings, monkeypatch, given, env, declared
):
    from inference.agent import LABELS_ENV, TAINTS_ENV, NodeAgent

    settings.GPUPORTAL_DATA_DIR = str(tmp_path)
    monkeypatch.setenv(LABELS_ENV, env)
    monkeypatch.delenv(TAINTS_ENV, raising=False)
    sent: list[dict] = []

    class Control:
        def register_node(self, node: str, devices, **details) -> int:
            sent.append(details)
            return 1

    NodeAgent("edge", control=Control(), backend="virtual", labels=given).register()
    monkeypatch.setenv(TAINTS_ENV, "team=research")
    NodeAgent("edge", control=Control(), backend="virtual", labels=given).register()
    NodeAgent("edge", control=Control(), backend="virtual", labels=given, taints={"team": "infra"}).register()

    assert [details["labels"] for details in sent] == [declared] * 3
    assert [details["taints"] for details in sent] == [None, {"team": "research"}, {"team": "infra"}]


def test_labels_and_taints_travel_in_the_registration_call_and_bad_ones_are_refused_there():
    devices = virtual_gpus("edge", "1x1GiB", NO_OVERHEAD)
    fields = {"hostname": "h", "cpu_cache_bytes": 0, "virtual": True, "survivors": []}
    sent = encode_call(Call("register_node", "r", ("edge", devices), {**fields, "labels": {"gpu": "h100"}}))

    assert decode_call(sent).kwargs["labels"] == {"gpu": "h100"}
    bad = encode_call(Call("register_node", "r", ("edge", devices), {**fields, "labels": {"gpu": "h 100"}}))
    with pytest.raises(WireError, match="'h 100' is no value for gpu"):
        decode_call(bad)
    tainted = encode_call(Call("register_node", "r", ("edge", devices), {**fields, "taints": {"team": "x"}}))
    assert decode_call(tainted).kwargs["taints"] == {"team": "x"}
    badly = encode_call(Call("register_node", "r", ("edge", devices), {**fields, "taints": ["team=x"]}))
    with pytest.raises(WireError, match="taints must map keys to values"):
        decode_call(badly)


@pytest.mark.parametrize("flag", ["--labels", "--taints"])
def test_the_agent_command_refuses_bad_labels_or_taints_before_it_starts_anything(monkeypatch, flag):
    monkeypatch.delenv("GPUPORTAL_NODE_LABELS", raising=False)
    monkeypatch.delenv("GPUPORTAL_NODE_TAINTS", raising=False)
    with pytest.raises(CommandError, match=f"{flag} gpu: 'gpu' is not key=value"):
        call_command("agent", "--node", "edge", flag, "gpu")


# -- shown ---------------------------------------------------------------------------------------------


def test_the_api_and_the_command_line_show_each_nodes_labels_and_taints(labelled, staff):
    register_node("lab", virtual_gpus("lab", "1x1GiB", NO_OVERHEAD), virtual=True, taints={"team": "research"})
    listed = {n["name"]: (n["labels"], n["taints"]) for n in staff.get("/api/nodes/").json()["results"]}
    assert listed == {
        "a10": ({**GPU_1GIB, "gpu": "a10", "zone": "b"}, {}),
        "h100": ({**GPU_1GIB, "gpu": "h100", "zone": "b"}, {}),
        "lab": (GPU_1GIB, {"team": "research"}),
    }

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(nodes_table(staff.get("/api/nodes/").json()["results"], [], []))
    shown = console.export_text()
    # Those its agent declared: what its GPUs say is the GPUS column's, and `gpus`' and the API's.
    assert "LABELS" in shown and "gpu=h100,zone=b" in shown and "nvidia.com" not in shown
    assert "TAINTS" in shown and "team=research" in shown
    unlabelled = Console(width=200, record=True)
    unlabelled.print(nodes_table([{"name": "plain", "status": "online", "labels": GPU_1GIB}], [], []))
    assert "LABELS" not in unlabelled.export_text(), "no column where no agent declared labels"
    assert "TAINTS" not in unlabelled.export_text()


def test_the_dashboard_shows_each_nodes_labels_and_taints_beside_its_name(labelled, admin_client):
    register_node("lab", virtual_gpus("lab", "1x1GiB", NO_OVERHEAD), virtual=True, taints={"team": "research"})
    page = admin_client.get(DASHBOARD).content.decode()

    for kind in ("h100", "a10"):
        shown = node_labels.text({**GPU_1GIB, "gpu": kind, "zone": "b"})
        assert f'<small class="gp-node-labels">{shown}</small>' in page
    assert '<small class="gp-node-taints">tainted team=research</small>' in page


def test_the_command_line_checks_a_selector_before_it_sends_it():
    assert parse_value(SELECTOR, "zone=b,gpu=h100", "set") == "gpu=h100,zone=b"
    with pytest.raises(CliError, match=r"set: placement\.node_selector: 'gpu' is not key=value"):
        parse_value(SELECTOR, "gpu", "set")
