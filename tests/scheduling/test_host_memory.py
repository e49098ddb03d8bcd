"""Host RAM as a resource: a node's host cache and its replicas' processes share
its RAM, and no new replica's process is started past it. The decision is pure
(scheduling.core.host_memory, placement's `host_refused`); the services feed it each node's RAM,
cache budget and measured processes, which the agents' heartbeats keep."""

from __future__ import annotations

import os
import random
from datetime import UTC, datetime

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.devices import virtual_gpus
from inference.host_ram import proportional_bytes
from scheduling import ledger
from scheduling.core.host_memory import HostView, refusal, refusals
from scheduling.core.placement import CachedReplica, CantAccommodate, Placement, PlacementRequest, place
from scheduling.core.planning import place_all
from scheduling.core.state import OccupantView, Snapshot
from scheduling.models import GPU, Deployment, Event, Replica
from scheduling.services import deployments, placing, sleep
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.errors import CannotPlace
from scheduling.services.nodes import heartbeat, register_node
from tests.support.deployments import deploy
from tests.support.factories import NO_OVERHEAD
from tests.support.views import gpu

MiB = 1024**2
GiB = 1024**3
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def host(node: str, ram: int = 16 * GiB, cache: int = 8 * GiB, processes: int = 0, each: int = GiB) -> HostView:
    return HostView(node, ram, cache, processes * each, processes)


# -- the decision ----------------------------------------------------------------------------------------


def test_a_host_with_room_for_the_process_takes_it_and_one_without_says_why_with_the_figures():
    roomy, full = host("a"), host("b", processes=7, each=GiB)  # 16 GiB: 8 of cache, 7 of processes

    assert refusal(roomy, 2 * GiB) is None
    why = refusal(full, 2 * GiB)
    assert why == (
        "host RAM: a new replica's process needs 2.0 GiB, and the host has 1.0 GiB of its 16.0 GiB left "
        "(host cache budget 8.0 GiB + 7 replica process(es) 7.0 GiB)"
    )
    assert refusal(host("c", ram=0), 100 * GiB) is None, "a host whose RAM is unknown is not judged"


def test_a_hosts_warm_spares_take_room_as_processes_and_the_refusal_names_them():
    spared = HostView("a", 16 * GiB, 8 * GiB, 6 * GiB, 6, spare_bytes=GiB, spares=1)

    assert spared.free_bytes == GiB
    assert refusal(spared, GiB) is None
    assert refusal(spared, 2 * GiB) == (
        "host RAM: a new replica's process needs 2.0 GiB, and the host has 1.0 GiB of its 16.0 GiB left "
        "(host cache budget 8.0 GiB + 6 replica process(es) 6.0 GiB + 1 warm spare(s) 1.0 GiB)"
    )


def test_a_new_replica_goes_only_to_a_node_whose_host_has_room_for_its_process():
    snapshot = Snapshot({1: gpu(1, node="a", total=24 * GiB), 2: gpu(2, node="b", total=24 * GiB)}, NOW)
    refused = refusals({"a": host("a", processes=8), "b": host("b")}, GiB)

    for seed in range(10):
        request = PlacementRequest("d", "r-new", GiB, host_refused=refused)
        placement = place(snapshot, request, rng=random.Random(seed))
        assert isinstance(placement, Placement) and placement.node == "b"

    nowhere = place(
        snapshot,
        PlacementRequest(
            "d", "r-new", GiB, host_refused=refusals({"a": host("a", processes=8), "b": host("b", processes=8)}, GiB)
        ),
    )
    assert isinstance(nowhere, CantAccommodate)
    assert set(nowhere.reasons) == {"a", "b"} and all("host RAM" in why for why in nowhere.reasons.values())
    assert "host cache budget 8.0 GiB + 8 replica process(es) 8.0 GiB" in nowhere.reason


def test_a_sleeping_replica_wakes_on_a_full_host_since_its_process_runs_there_already():
    sleeper = OccupantView("r-asleep", "d", "sleeping", 100 * MiB)
    snapshot = Snapshot({1: gpu(1, (sleeper,), node="a", total=24 * GiB)}, NOW)
    request = PlacementRequest(
        "d",
        "r-new",
        GiB,
        cached=(CachedReplica("r-asleep", "a"),),
        host_refused=refusals({"a": host("a", processes=8)}, GiB),
    )

    placement = place(snapshot, request)

    assert isinstance(placement, Placement) and placement.promoted == "r-asleep"


def test_each_new_replica_placed_counts_against_its_hosts_ram_for_the_next():
    snapshot = Snapshot({1: gpu(1, node="a", total=24 * GiB), 2: gpu(2, node="b", total=24 * GiB)}, NOW)
    hosts = {"a": host("a", processes=6), "b": host("b", processes=7)}  # room for 2 and for 1
    requests = [PlacementRequest("d", f"r{i}", GiB) for i in range(3)]

    result = place_all(snapshot, requests, occupant_for=_serving, reason="scale", hosts=hosts, host_need_bytes=GiB)

    assert not isinstance(result, CantAccommodate)
    assert sorted(p.node for p in result.placements) == ["a", "a", "b"]
    one_more = place_all(
        snapshot,
        [*requests, PlacementRequest("d", "r3", GiB)],
        occupant_for=_serving,
        reason="scale",
        hosts=hosts,
        host_need_bytes=GiB,
    )
    assert isinstance(one_more, CantAccommodate), "all or nothing: a fourth process fits no host"


@given(
    free=st.lists(st.integers(min_value=-2, max_value=4), min_size=1, max_size=4),
    count=st.integers(min_value=1, max_value=8),
    seed=st.integers(min_value=0, max_value=100),
)
def test_no_placement_takes_a_host_past_its_ram(free, count, seed):
    nodes = [f"n{i}" for i in range(len(free))]
    snapshot = Snapshot({i + 1: gpu(i + 1, node=node, total=24 * GiB) for i, node in enumerate(nodes)}, NOW)
    hosts = {node: host(node, processes=8 - room) for node, room in zip(nodes, free, strict=True)}
    requests = [PlacementRequest("d", f"r{i}", GiB) for i in range(count)]

    result = place_all(
        snapshot,
        requests,
        occupant_for=_serving,
        reason="scale",
        hosts=hosts,
        host_need_bytes=GiB,
        rng=random.Random(seed),
    )

    if isinstance(result, CantAccommodate):
        assert count > sum(max(0, room) for room in free)
    else:
        for node, room in zip(nodes, free, strict=True):
            assert sum(p.node == node for p in result.placements) <= max(0, room)


def _serving(placement: Placement) -> OccupantView:
    return OccupantView(placement.replica_id, "d", "pending", 0)


# -- applied -------------------------------------------------------------------------------------------------


@pytest.fixture
def small_host(db):
    """A virtual node of two 4 GiB GPUs on a host of 3 GiB of RAM, 1 GiB of it the host cache's:
    room for the processes of two replicas of 1 GiB (the default until one is measured)."""
    return register_node(
        "edge",
        virtual_gpus("edge", "2x4GiB", NO_OVERHEAD),
        virtual=True,
        cpu_cache_bytes=GiB,
        host_ram_bytes=3 * GiB,
    )


def test_a_deploy_whose_process_the_host_has_no_room_for_is_refused_naming_the_figures(
    small_host, staff, dispatched, tiny_model_dir
):
    deploy("a")
    deploy("b")

    said = refused_deploy(staff, "c", tiny_model_dir)

    assert "host RAM: a new replica's process needs 1.0 GiB, and the host has 0 B of its 3.0 GiB left" in said
    assert "host cache budget 1.0 GiB + 2 replica process(es) 2.0 GiB" in said


def refused_deploy(staff, name: str, model_dir) -> str:
    """A deploy the API refuses with a 409, creating nothing: what it said."""
    response = staff.post(
        "/api/deployments/",
        {"name": name, "model": {"source": str(model_dir)}, "memory": {"override_bytes": 300 * MiB}},
        format="json",
    )
    assert response.status_code == 409, response.json()
    assert not Deployment.objects.filter(name=name).exists(), "nothing half-applied"
    return str(response.json())


def test_a_gpus_warm_spare_counts_as_a_process_of_its_hosts_ram(small_host, staff, dispatched, tiny_model_dir):
    # The agent's beat booked a spare's slot on one GPU (GPUPORTAL_WARM_SPARES): its process
    # takes host RAM as a replica's does, leaving room for one replica's process of two.
    spared = GPU.objects.get(node=small_host, index=0)
    ledger.record_foreign(spared.pk, 500 * MiB)
    GPU.objects.filter(pk=spared.pk).update(spare_bytes=500 * MiB)
    assert placing.host_views()["edge"].spares == 1
    deploy("a")

    said = refused_deploy(staff, "b", tiny_model_dir)

    assert "+ 1 replica process(es) 1.0 GiB + 1 warm spare(s) 1.0 GiB" in said, said


def test_a_scale_up_past_the_hosts_ram_places_nothing_and_an_event_says_why_with_the_figures(small_host, dispatched):
    deploy("a")
    Deployment.objects.filter(name="a").update(replicas_wanted=3)

    deployments.reconcile_all("test")

    # Two more processes of 1 GiB where the host has room for one: all or nothing, as any scale.
    assert Replica.objects.filter(deployment__name="a").count() == 1
    event = Event.objects.filter(deployment="a", reason__contains="no room for more").latest("pk")
    assert "host RAM" in event.reason and "host cache budget 1.0 GiB" in event.reason, event.reason


def test_the_heartbeat_keeps_each_processs_measured_host_ram_which_then_sizes_the_next(small_host, dispatched):
    first = deploy("a")

    heartbeat("edge", running=[first], host_bytes={first: 400 * MiB})

    assert Replica.objects.get(pk=first).host_bytes == 400 * MiB
    a = Deployment.objects.get(name="a")
    assert placing.host_need_bytes(a) == 400 * MiB
    # Measured, a process takes 400 MiB, not the default 1 GiB: the host has room for four in all.
    assert placing.host_views()["edge"].process_bytes == 400 * MiB
    Deployment.objects.filter(name="a").update(replicas_wanted=5)
    deployments.reconcile_all("test")
    assert Replica.objects.filter(deployment__name="a").count() == 5
    # A small move is not written again; a large one is.
    heartbeat("edge", running=[first], host_bytes={first: 410 * MiB})
    assert Replica.objects.get(pk=first).host_bytes == 400 * MiB
    heartbeat("edge", running=[first], host_bytes={first: 700 * MiB})
    assert Replica.objects.get(pk=first).host_bytes == 700 * MiB


def test_a_wake_that_needs_a_new_process_on_a_full_host_is_refused_rather_than_preempting(small_host, dispatched):
    deploy("a")
    deploy("b")
    create(
        DeploymentSpec(name="c", source="/srv/models/tiny", replicas=0, override_bytes=300 * MiB),
        facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB),
    )

    with pytest.raises(CannotPlace) as refused:
        sleep.wake_deployment("c", reason="woken by a request")

    assert "host RAM" in str(refused.value)
    assert not Event.objects.filter(kind=Event.Kind.PREEMPTION_INTENT).exists(), "no GPU emptied for nothing"
    assert all(state == "serving" for state in Replica.objects.values_list("state", flat=True))


# -- the agent's figure ----------------------------------------------------------------------------------------


def test_a_processs_host_ram_is_its_proportional_share_and_none_once_it_is_gone():
    held = proportional_bytes(os.getpid())
    assert held is not None and 0 < held <= _rss(os.getpid())

    gone = next(pid for pid in range(4_000_000, 0, -1) if not psutil.pid_exists(pid))
    assert proportional_bytes(gone) is None


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss
