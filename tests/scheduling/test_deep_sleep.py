"""Deep sleep in the books (scheduling.services.deep_sleep): sleepers past sleep.deep_after_s are
told to sleep deeply, their report gives back every byte of GPU memory, a wake starts a process on
their node from its host copy, the host cache counts and parks them, and an agent that starts
again keeps those whose copies it holds. No replica processes: what agents are sent is recorded,
what replica processes report is fed in (their side: tests/inference/test_deep_sleep.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import torch
from django.utils import timezone

from gpuportal.wire.commands import StartReplica, WakeReplica
from gpuportal.wire.node_reports import Survivor
from inference.devices import virtual_gpus
from scheduling.core.host_cache import HostHolder, trim, used_bytes
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, PreemptionIntent, Replica
from scheduling.services import deep_sleep, host_cache, nodes, replica_specs, reports, sleep
from scheduling.services import replicas as replicas_services
from scheduling.services.nodes import register_node
from tests.support.deployments import START, STOP, MiB, body, deploy_serving, invariant_holds, reserved, serve
from tests.support.factories import NO_OVERHEAD

DEEPEN = "inference.tasks.replica_deepen"
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def asleep(replica_id: str, *, context: int = 0) -> None:
    """What the replica process reports once its weights are in CPU RAM; asleep ten minutes now."""
    reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": context}})
    Replica.objects.filter(pk=replica_id).update(asleep_since=timezone.now() - timedelta(seconds=600))


def deep(replica_id: str, copy: int = 10 * MiB) -> None:
    """What the replica process reports once its weights are in the host copy, as it exits."""
    reports.report(replica_id, {"event": "deep_sleeping", "host_copy_bytes": copy, "exit_code": 0})


def deep_asleep(api, model_dir, name: str = "tiny-a", copy: int = 10 * MiB) -> str:
    """A deployment deployed, its one replica asleep, then deep asleep: that replica's id."""
    (replica_id,) = deploy_serving(api, model_dir, name, sleep={"deep_after_s": 60})
    sleep.sleep_replica(replica_id, reason="idle")
    asleep(replica_id)
    deep(replica_id, copy)
    return replica_id


def test_the_sweep_tells_a_replica_asleep_past_deep_after_to_sleep_deeply_and_no_other(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    (due,) = deploy_serving(api, tiny_model_dir, "due", sleep={"deep_after_s": 300})
    (recent,) = deploy_serving(api, tiny_model_dir, "recent", sleep={"deep_after_s": 900})
    (never,) = deploy_serving(api, tiny_model_dir, "never")
    (awake,) = deploy_serving(api, tiny_model_dir, "awake", sleep={"deep_after_s": 1})
    for replica_id in (due, recent, never):
        sleep.sleep_replica(replica_id, reason="idle")
        asleep(replica_id)
    dispatched.clear()

    now = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        told = deep_sleep.sweep_deep(now=now)

    assert told == [due]
    assert dispatched == [(f"node.{Replica.objects.get(pk=due).node.name}", DEEPEN, [due])]
    event = Event.objects.get(replica=due, reason__startswith=deep_sleep.DEEPENING)
    assert "asleep longer than sleep.deep_after_s (300 s)" in event.reason
    assert Replica.objects.get(pk=due).state == "sleeping", "the books wait for its report"
    assert Replica.objects.get(pk=awake).state == "serving"
    # Asked once: while its process writes the copy, the next sweeps leave it be...
    assert deep_sleep.sweep_deep(now=now + timedelta(seconds=5)) == []
    # ...and past RESEND_S without its report (a lost command), it is asked again.
    assert deep_sleep.sweep_deep(now=now + timedelta(seconds=deep_sleep.RESEND_S + 1)) == [due]


def test_a_deep_sleeper_gives_back_all_its_gpu_memory_and_keeps_its_node(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir, sleep={"deep_after_s": 60})
    sleep.sleep_replica(replica_id, reason="idle")
    asleep(replica_id, context=200 * MiB)
    node = Replica.objects.get(pk=replica_id).node
    assert reserved(replica_id) == 200 * MiB, "asleep, it holds its CUDA context"

    deep(replica_id)

    replica = Replica.objects.get(pk=replica_id)
    assert replica.state == "deep_sleeping" and replica.node == node and replica.pid is None
    assert replica.host_copy_bytes == 10 * MiB
    assert reserved(replica_id) == 0 and replica.gpu_mem_bytes_by_id == {}
    assert {g.available_bytes for g in GPU.objects.filter(node=node)} == {1024 * MiB}, "its node's GPUs are free"
    assert invariant_holds()
    event = Event.objects.get(replica=replica_id, after__state="deep_sleeping")
    assert "gave back 200 MiB of GPU memory" in event.reason and f"node {node.name}'s host memory" in event.reason
    assert Deployment.objects.get().replicas_wanted == 1, "still wanted: a deep sleep is no scale-down"
    deep(replica_id)  # said again: nothing changes
    assert Event.objects.filter(replica=replica_id, after__state="deep_sleeping").count() == 1


def test_a_wake_reserves_a_deep_sleepers_whole_need_on_its_node_and_starts_a_process_from_the_host_copy(
    cluster, api, dispatched, tiny_model_dir
):
    replica_id = deep_asleep(api, tiny_model_dir)
    node = Replica.objects.get(pk=replica_id).node
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/wake/")

    assert response.status_code == 200, response.json()
    assert [(r["id"], r["state"], r["node"]) for r in response.json()["replicas"]] == [
        (replica_id, "waking", node.name)
    ]
    assert reserved(replica_id) == 300 * MiB and Replica.objects.count() == 1
    # The wake's command is a start, of a process that reads the node's host copy.
    assert dispatched == [(node.queue, START, [replica_id, []])]
    command = replica_specs.wake(replica_id, [])
    assert isinstance(command, StartReplica) and command.spec.from_host_copy
    assert list(command.spec.reserved_bytes_by_gpu.values()) == [300 * MiB], "its whole need, on one GPU"

    reports.report(replica_id, {"event": "serving", "pid": 77, "weights_bytes": 10 * MiB})

    replica = Replica.objects.get(pk=replica_id)
    assert replica.state == "serving" and replica.pid == 77 and replica.asleep_since is None
    assert replica.host_copy_bytes == 0
    assert Event.objects.filter(replica=replica_id, reason__startswith="woken from deep sleep").exists()
    assert DeploymentObserved.objects.get().measured_wake_s is None, "not a wake from the first level"
    # Asleep again, the next wake is a plain one: its process holds the weights.
    sleep.sleep_replica(replica_id, reason="idle")
    asleep(replica_id)
    api("post", f"/api/replicas/{replica_id}/wake/")
    assert isinstance(replica_specs.wake(replica_id, []), WakeReplica)


def test_a_deep_sleeper_counts_in_its_node_host_cache_and_a_full_one_parks_it_deleting_its_copy(
    db, dispatched, django_capture_on_commit_callbacks, api, tiny_model_dir
):
    node = register_node("edge", virtual_gpus("edge", "2x1GiB", NO_OVERHEAD), virtual=True, cpu_cache_bytes=250 * MiB)
    ids = [deep_asleep(api, tiny_model_dir, name, 100 * MiB) for name in ("a", "b", "c")]
    Replica.objects.filter(pk=ids[0]).update(last_accessed=timezone.now() - timedelta(hours=1))
    assert host_cache.used_bytes([node.pk]) == {node.pk: 300 * MiB}
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert host_cache.trim("edge") == [ids[0]]

    parked = Replica.objects.get(pk=ids[0])
    assert parked.state == "parked" and parked.host_copy_bytes == 0
    assert dispatched == [("node.edge", STOP, [ids[0]])], "its agent deletes the copy"
    assert host_cache.used_bytes([node.pk]) == {node.pk: 200 * MiB}


def test_two_hundred_deep_sleepers_stay_within_their_nodes_host_budget():
    # One node of two virtual GPUs and 8 GiB of host cache: 200 deployments of 100 MiB asleep there.
    held = [HostHolder(f"r{i}", f"d{i}", "deep_sleeping", 100 * MiB, NOW - timedelta(seconds=i)) for i in range(200)]
    budget = 8 * 1024 * MiB

    decided = trim(held, budget)

    left = [h for h in held if h.replica_id not in decided.park]
    assert used_bytes(left) <= budget and decided.over_bytes == 0
    assert len(left) == budget // (100 * MiB), "only as many leave as the budget needs"
    assert set(decided.park) == {f"r{i}" for i in range(len(left), 200)}, "the longest unused leave first"


@pytest.mark.parametrize("holds_the_copy", [True, False])
def test_an_agent_starting_again_keeps_the_deep_sleepers_whose_copies_it_holds(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks, holds_the_copy
):
    replica_id = deep_asleep(api, tiny_model_dir)
    node = Replica.objects.get(pk=replica_id).node
    survivors = [Survivor(replica_id, 0, "deep_sleeping", "deep_sleeping")] if holds_the_copy else []
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        register_node(node.name, virtual_gpus(node.name, "2x1GiB", NO_OVERHEAD), virtual=True, survivors=survivors)

    replica = Replica.objects.get(pk=replica_id)
    if holds_the_copy:
        assert replica.state == "deep_sleeping" and replica.node == node
        assert Event.objects.filter(replica=replica_id, reason__contains="its host copy outlived").exists()
        assert (node.queue, STOP, [replica_id]) not in dispatched
    else:
        assert replica.state == "parked" and replica.node is None
        assert (node.queue, STOP, [replica_id]) in dispatched, "a copy it may still hold is deleted"


def test_deep_after_is_a_sleep_setting_a_patch_applies_at_once(cluster, api, tiny_model_dir):
    deploy_serving(api, tiny_model_dir)
    assert api("get", "/api/deployments/tiny-a/").json()["sleep"]["deep_after_s"] == 0

    bad = api("patch", "/api/deployments/tiny-a/", {"sleep": {"deep_after_s": -1}})
    assert bad.status_code == 400
    assert bad.json() == {"sleep": {"deep_after_s": ["Ensure this value is greater than or equal to 0."]}}

    good = api("patch", "/api/deployments/tiny-a/", {"sleep": {"deep_after_s": 120}})
    assert good.status_code == 200 and good.json()["sleep"]["deep_after_s"] == 120
    assert Deployment.objects.get().deep_sleep_after_s == 120


def test_a_placement_that_evicts_a_sleeper_has_it_sleep_deeply_since_only_that_gives_back_its_context(
    db, dispatched, django_capture_on_commit_callbacks, api, tiny_model_dir
):
    node = register_node("solo", virtual_gpus("solo", "1x1GiB", NO_OVERHEAD), virtual=True)
    (sleeper,) = deploy_serving(api, tiny_model_dir, "asleep")
    sleep.sleep_replica(sleeper, reason="idle")
    # Its context, 600 MiB (the GPU's figure from now on): the next replica, 300 MiB and a
    # context, cannot fit beside it.
    asleep(sleeper, context=600 * MiB)
    dispatched.clear()

    response = api("post", "/api/deployments/", body("next", tiny_model_dir))

    assert response.status_code == 201, response.json()
    (placed,) = Replica.objects.filter(deployment__name="next").values_list("id", flat=True)
    assert dispatched == [(node.queue, DEEPEN, [sleeper]), (node.queue, START, [placed, [sleeper]])]
    assert Replica.objects.get(pk=sleeper).state == "sleeping" and reserved(sleeper) == 0
    event = Event.objects.get(replica=sleeper, reason__startswith=deep_sleep.DEEPENING)
    assert "evicted to make room" in event.reason
    deep(sleeper)
    assert Replica.objects.get(pk=sleeper).state == "deep_sleeping" and invariant_holds()


def test_a_serving_replica_evicted_for_room_sleeps_deeply_once_asleep_since_its_room_went_to_another(
    db, dispatched, django_capture_on_commit_callbacks, api, tiny_model_dir
):
    node = register_node("solo", virtual_gpus("solo", "1x1GiB", NO_OVERHEAD), virtual=True)
    api("post", "/api/deployments/", body("small", tiny_model_dir, memory={"override_bytes": 600 * MiB}))
    (victim,) = Replica.objects.values_list("id", flat=True)
    serve(victim)
    Replica.objects.update(serving_since=timezone.now() - timedelta(minutes=5))
    assert (
        api("post", "/api/deployments/", body("big", tiny_model_dir, memory={"override_bytes": 900 * MiB})).status_code
        == 201
    )
    assert Replica.objects.get(pk=victim).state == "draining"
    dispatched.clear()

    # Its weights are in CPU RAM, and its process still holds 200 MiB of CUDA context on the GPU
    # whose room placement gave to `big` (124 MiB are left there).
    with django_capture_on_commit_callbacks(execute=True):
        asleep(victim, context=200 * MiB)

    assert dispatched == [(node.queue, DEEPEN, [victim])], "only its process's exit gives the context back"
    event = Event.objects.get(replica=victim, reason__startswith=deep_sleep.DEEPENING)
    assert "room went to another replica" in event.reason
    assert reserved(victim) == 124 * MiB and invariant_holds(), "no more than is free is booked meanwhile"
    deep(victim)
    assert Replica.objects.get(pk=victim).state == "deep_sleeping" and reserved(victim) == 0


@pytest.mark.parametrize("needed", [1024 * MiB, 1 * MiB])
def test_a_replica_preempted_for_a_wake_sleeps_deeply_where_its_context_leaves_that_wake_short(
    db, dispatched, django_capture_on_commit_callbacks, api, tiny_model_dir, needed
):
    node = register_node("solo", virtual_gpus("solo", "1x1GiB", NO_OVERHEAD), virtual=True)
    (victim,) = deploy_serving(api, tiny_model_dir, "small")
    (waker,) = deploy_serving(api, tiny_model_dir, "waker")
    # Preempted for a wake that waits on its GPU for `needed`: all of it, or a sliver.
    PreemptionIntent.objects.create(
        gpu=GPU.objects.get(), waiting_replica_id=waker, needed_bytes=needed, deadline=timezone.now()
    )
    sleep.sleep_replica(victim, reason="preempted")
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        asleep(victim, context=200 * MiB)

    if needed > 200 * MiB:
        assert dispatched == [(node.queue, DEEPEN, [victim])], "its context leaves the wake short"
        event = Event.objects.get(replica=victim, reason__startswith=deep_sleep.DEEPENING)
        assert f"a wake ({waker[:8]}) waits on its GPU" in event.reason
    else:
        assert dispatched == [] and Replica.objects.get(pk=victim).state == "sleeping", "room enough beside it"


def test_a_sleeper_whose_context_fits_stays_asleep_in_its_process(
    db, dispatched, django_capture_on_commit_callbacks, api, tiny_model_dir
):
    register_node("solo", virtual_gpus("solo", "1x1GiB", NO_OVERHEAD), virtual=True)
    (replica_id,) = deploy_serving(api, tiny_model_dir, "small")
    sleep.sleep_replica(replica_id, reason="idle")
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        asleep(replica_id, context=200 * MiB)

    assert dispatched == [] and reserved(replica_id) == 200 * MiB
    assert Replica.objects.get(pk=replica_id).state == "sleeping"


def test_deleting_a_deployment_sends_its_deep_sleepers_node_the_stop_that_deletes_the_copy(
    cluster, api, dispatched, tiny_model_dir
):
    replica_id = deep_asleep(api, tiny_model_dir)
    node = Replica.objects.get(pk=replica_id).node
    dispatched.clear()

    assert api("delete", "/api/deployments/tiny-a/").status_code in (200, 202, 204)

    assert not Replica.objects.filter(pk=replica_id).exists()
    assert [(q, t, a[:1]) for q, t, a in dispatched] == [(node.queue, STOP, [replica_id])]
    assert invariant_holds()


def test_the_sleepers_a_waiting_wake_deepens_are_the_longest_unused_until_its_shortfall_is_covered():
    from scheduling.core.fairness import sleepers_to_deepen
    from scheduling.core.state import GPUView, OccupantView

    def sleeper(name: str, hours: int, state: str = "sleeping") -> OccupantView:
        return OccupantView(name, f"d-{name}", state, 200 * MiB, last_accessed=NOW - timedelta(hours=hours))

    occupants = (sleeper("old", 9), sleeper("mid", 5), sleeper("new", 1), sleeper("busy", 20, "serving"))
    gpu = GPUView(
        id=1, node="n", index=0, total_bytes=1024 * MiB, available_bytes=224 * MiB, version=1, occupants=occupants
    )

    assert sleepers_to_deepen([gpu], {1: 224 * MiB}, waiting_replica_id="w") == [], "it fits as things are"
    assert sleepers_to_deepen([gpu], {1: 300 * MiB}, waiting_replica_id="w") == ["old"]
    assert sleepers_to_deepen([gpu], {1: 500 * MiB}, waiting_replica_id="w") == ["old", "mid"]
    # Short even with every sleeper gone: all of them (a serving one is choose_victim's to preempt).
    assert sleepers_to_deepen([gpu], {1: 1000 * MiB}, waiting_replica_id="w") == ["old", "mid", "new"]
    # The waker's own residual is not its to give up.
    assert sleepers_to_deepen([gpu], {1: 300 * MiB}, waiting_replica_id="old") == ["mid"]


def test_a_deepen_its_process_refused_leaves_it_asleep_and_says_why(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir, sleep={"deep_after_s": 60})
    sleep.sleep_replica(replica_id, reason="idle")
    asleep(replica_id)

    reason = "cannot write the host copy /dev/shm/x.pt: [Errno 28] No space left on device"
    reports.report(replica_id, {"event": "error", "cmd": "deepen", "reason": reason})

    assert Replica.objects.get(pk=replica_id).state == "sleeping"
    assert Event.objects.filter(replica=replica_id, reason=f"its process refused deepen: {reason}").exists()


def test_a_beat_returns_the_host_copies_the_books_no_longer_hold_asleep_there(cluster, api, dispatched, tiny_model_dir):
    kept, parked = deep_asleep(api, tiny_model_dir, "kept"), deep_asleep(api, tiny_model_dir, "parked")
    node = Replica.objects.get(pk=kept).node.name
    # Parked while its agent was away: the stop that deletes its copy never reached it.
    replicas_services.park(Replica.objects.get(pk=parked), "left the host cache")

    answer = nodes.heartbeat(node, running=[], host_copies=[kept, parked, "gone1234"])

    assert answer == sorted([parked, "gone1234"]), "a deep sleeper's own copy is kept"
    assert nodes.heartbeat(node, running=[], host_copies=[kept]) == []


def test_a_copy_written_off_is_deleted_by_the_agent_with_the_processes_it_stops(tmp_path):
    from inference import host_copy
    from inference.supervisor import Supervisor

    supervisor = Supervisor(tmp_path / "logs", host_copies=tmp_path / "copies")
    for replica_id in ("kept", "gone"):
        host_copy.save(torch.nn.Linear(2, 2), supervisor.host_copy_path(replica_id))

    assert supervisor.stop_written_off(iter(["gone"])) == [], "no process was stopped"

    assert sorted(supervisor.deep_sleepers()) == ["kept"]


def test_two_hundred_deep_sleeping_deployments_on_one_node_stay_within_its_host_budget(
    db, dispatched, django_capture_on_commit_callbacks
):
    from tests.support import factories

    # One node of two virtual GPUs whose host cache holds 8 GiB: 200 deployments of 100 MiB deep
    # asleep there would take 20 GiB. None of them holds any GPU memory.
    node = register_node("big", virtual_gpus("big", "2x24GiB", NO_OVERHEAD), virtual=True, cpu_cache_bytes=8192 * MiB)
    made = []
    for i in range(200):
        deployment = factories.deployment(f"d{i:03}", weight_bytes=100 * MiB)
        made.append(
            factories.replica(
                deployment,
                node,
                state="deep_sleeping",
                host_copy_bytes=100 * MiB,
                last_accessed=timezone.now() - timedelta(minutes=200 - i),
            ).id
        )
    assert {g.available_bytes for g in GPU.objects.filter(node=node)} == {24 * 1024 * MiB}

    with django_capture_on_commit_callbacks(execute=True):
        parked = host_cache.trim("big")

    assert host_cache.used_bytes([node.pk]) == {node.pk: (8192 // 100) * 100 * MiB}, "within the budget"
    assert sorted(parked) == sorted(made[: len(parked)]), "the longest unused left first"
    assert len(parked) == 200 - 8192 // 100, "only as many as the budget needs"
    assert sorted(a[0] for _, t, a in dispatched if t == STOP) == sorted(parked), "their copies are deleted"
    assert Replica.objects.filter(state="deep_sleeping").count() == 8192 // 100


def test_an_operator_has_sleepers_sleep_deeply_by_replica_or_by_deployment_and_a_serving_one_is_a_409(
    cluster, api, dispatched, tiny_model_dir
):
    first, second = deploy_serving(api, tiny_model_dir, replicas=2)
    sleep.sleep_replica(first, reason="idle")
    asleep(first)
    dispatched.clear()

    refused = api("post", f"/api/replicas/{second}/deep-sleep/")
    assert refused.status_code == 409 and (refused.json()["state"], refused.json()["wanted"]) == (
        "serving",
        "deep_sleeping",
    )
    assert "put it to sleep first" in refused.json()["detail"] and dispatched == []

    response = api("post", f"/api/replicas/{first}/deep-sleep/")
    assert response.status_code == 200 and response.json()["state"] == "sleeping", "deep once its process says so"
    assert [(t, a) for _, t, a in dispatched] == [(DEEPEN, [first])]
    assert Event.objects.filter(replica=first, reason__contains="put to sleep deeply by ops").exists()

    dispatched.clear()
    sleep.sleep_replica(second, reason="idle")
    asleep(second)
    whole = api("post", "/api/deployments/tiny-a/deep-sleep/")
    assert whole.status_code == 200
    assert sorted(a[0] for _, t, a in dispatched if t == DEEPEN) == sorted([first, second])
    assert api("post", "/api/deployments/nope/deep-sleep/").status_code == 404
