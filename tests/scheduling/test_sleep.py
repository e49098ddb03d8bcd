"""Sleep and wake: the idle sweep, operator controls by REST and admin, waking by promotion or by
placing anew, concurrent wakes; on virtual GPUs without processes (what agents are sent is
recorded, what replica processes report is fed in), then once end to end with real processes."""

from __future__ import annotations

import threading
from datetime import timedelta

import psutil
import pytest
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.db import connection, transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from rest_framework.test import APIClient

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_KERNEL_GROWTH_BYTES
from inference.devices import virtual_gpus
from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, Occupant, Replica
from scheduling.services import reports, sleep
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.errors import CannotPlace, InvalidState
from scheduling.services.nodes import register_node
from scheduling.tasks import sleep_idle
from tests.support.deployments import (
    FROM_CACHE,
    LOAD_TIMEOUT,
    START,
    STOP,
    TO_CACHE,
    MiB,
    all_in,
    asleep,
    body,
    deploy_serving,
    invariant_holds,
    reserved,
    serve,
    states,
)
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import wait_until

NOT_SERVING = "only a serving replica can be put to sleep"


@pytest.fixture
def clean_queues():
    """The request queues in Redis, emptied of what earlier tests left (only the portal's keys:
    REDIS_URL may point at a developer's Redis)."""
    client = request_services.queue().redis
    for key in client.scan_iter("gp:*"):
        client.delete(key)
    yield
    for key in client.scan_iter("gp:*"):
        client.delete(key)


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    """Run the on_commit dispatches of service calls made outside a request (sweeps, reports)."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def awake_count(name: str) -> int:
    return Replica.objects.filter(deployment__name=name, state__in=["pending", "loading", "serving", "waking"]).count()


# -- operator controls by REST ---------------------------------------------------------------------


def test_a_sleeping_replica_keeps_its_place_in_replicas_wanted(cluster, api, dispatched, tiny_model_dir):
    first, second = deploy_serving(api, tiny_model_dir, replicas=2)
    dispatched.clear()

    response = api("post", f"/api/replicas/{first}/sleep/")

    assert response.status_code == 200 and response.json()["state"] == "draining"
    assert response.json()["id"] == first
    assert dispatched == [(f"node.{Replica.objects.get(pk=first).node.name}", TO_CACHE, [first])]
    assert reserved(first) == 300 * MiB, "kept until the process says what it still holds"
    assert Deployment.objects.get().replicas_wanted == 2, "sleep is not a scale-down"
    assert Event.objects.filter(replica=first, reason="put to sleep by ops").exists()

    asleep(first)
    assert Replica.objects.get(pk=first).state == "sleeping" and reserved(first) == 0
    assert Replica.objects.get(pk=second).state == "serving" and invariant_holds()


def test_sleeping_a_deployment_sleeps_every_serving_replica(cluster, api, dispatched, tiny_model_dir):
    deploy_serving(api, tiny_model_dir, replicas=2)
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/sleep/")

    assert response.status_code == 200
    assert {r["state"] for r in response.json()["replicas"]} == {"draining"}
    assert response.json()["replicas_wanted"] == 2
    assert [task for _, task, _ in dispatched] == [TO_CACHE, TO_CACHE]
    # Nothing serving: a second sleep has nothing to do and says so with an unchanged deployment.
    dispatched.clear()
    assert api("post", "/api/deployments/tiny-a/sleep/").status_code == 200 and dispatched == []


def test_waking_a_replica_promotes_it_on_its_own_node(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    node = Replica.objects.get().node
    api("post", f"/api/replicas/{replica_id}/sleep/")
    asleep(replica_id)
    dispatched.clear()

    response = api("post", f"/api/replicas/{replica_id}/wake/")

    assert response.status_code == 200, response.json()
    assert response.json()["id"] == replica_id and response.json()["state"] == "waking"
    assert response.json()["node"] == node.name and reserved(replica_id) == 300 * MiB
    assert dispatched == [(node.queue, FROM_CACHE, [replica_id, []])]
    assert Event.objects.filter(replica=replica_id, reason__startswith="promoted from the CPU cache").exists()
    reports.report(replica_id, {"event": "woken"})
    assert Replica.objects.get(pk=replica_id).state == "serving" and Replica.objects.count() == 1


def test_waking_a_deployment_promotes_the_cached_replica_then_does_nothing(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    api("post", "/api/deployments/tiny-a/sleep/")
    asleep(replica_id)
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/wake/")

    assert response.status_code == 200
    assert [(r["id"], r["state"]) for r in response.json()["replicas"]] == [(replica_id, "waking")]
    assert [task for _, task, _ in dispatched] == [FROM_CACHE]
    dispatched.clear()
    assert api("post", "/api/deployments/tiny-a/wake/").status_code == 200
    assert dispatched == [] and Replica.objects.count() == 1, "already awake: a no-op"
    assert sleep.wake_deployment("tiny-a", reason="test") == []


def test_waking_a_deployment_with_nothing_cached_places_a_new_replica(cluster, api, dispatched, tiny_model_dir):
    (failed,) = deploy_serving(api, tiny_model_dir)
    reports.report(failed, {"event": "failed", "reason": "killed"})
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/wake/")

    assert response.status_code == 200
    fresh = Replica.objects.exclude(pk=failed).get()
    assert fresh.state == "pending" and reserved(fresh.id) == 300 * MiB
    assert dispatched == [(fresh.node.queue, START, [fresh.id, []])]
    placed = Event.objects.get(replica=fresh.id, kind=Event.Kind.REPLICA_STATE)
    assert placed.reason.startswith("placed: ") and "new replica" in placed.reason
    assert placed.reason.endswith("; woken by ops: 0 → 1 awake")


def test_a_deployment_scaled_to_zero_wakes_one_replica(cluster, api, dispatched, tiny_model_dir, on_commit):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    api("post", f"/api/replicas/{replica_id}/evict/")
    asleep(replica_id)
    assert Deployment.objects.get().replicas_wanted == 0

    with on_commit():
        assert sleep.wake_deployment("tiny-a", reason="a request arrived") == [replica_id]

    assert Replica.objects.get().state == "waking" and Deployment.objects.get().replicas_wanted == 0


def test_scaling_a_deployment_to_zero_stops_its_sleeping_replicas_too(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    # Asleep, each keeps a process (and, on a real GPU, its context) and its copy of the weights:
    # a scale to 0 stops them all, and a request later loads one anew. A scale to 1 would keep them.
    ids = deploy_serving(api, tiny_model_dir, replicas=2)
    api("post", "/api/deployments/tiny-a/sleep/")
    for replica_id in ids:
        asleep(replica_id)
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/scale/", {"replicas": 0})

    assert response.status_code == 200
    assert sorted(Replica.objects.filter(pk__in=ids).values_list("state", flat=True)) == ["stopping", "stopping"]
    assert sorted(args[0] for _, task, args in dispatched if task == STOP) == sorted(ids)
    assert Event.objects.filter(reason__endswith="0 → 0, its 2 sleeping replica(s) too").count() == 2
    with on_commit():
        (placed,) = sleep.wake_deployment("tiny-a", reason="a request arrived")
    assert placed not in ids, "loaded anew: nothing was left asleep to promote"
    assert invariant_holds()


def test_waking_a_deployment_brings_back_as_many_as_it_wants(cluster, api, dispatched, tiny_model_dir, on_commit):
    ids = deploy_serving(api, tiny_model_dir, replicas=3)
    api("post", "/api/deployments/tiny-a/sleep/")
    for replica_id in ids[:2]:
        asleep(replica_id)
    reports.report(ids[2], {"event": "failed", "reason": "killed"})

    with on_commit():
        woken = sleep.wake_deployment("tiny-a", reason="a request arrived")

    assert len(woken) == 3 and set(ids[:2]) < set(woken), "both cached ones promoted, one placed anew"
    assert awake_count("tiny-a") == 3 and invariant_holds()


def test_when_not_all_wanted_fit_a_wake_brings_back_one(cluster, api, dispatched, tiny_model_dir, on_commit):
    ids = deploy_serving(api, tiny_model_dir, replicas=2, memory={"override_bytes": 600 * MiB})
    api("post", "/api/deployments/tiny-a/sleep/")
    for replica_id in ids:
        asleep(replica_id)
    # Three of the four 1 GiB GPUs go to a replica that may never be evicted.
    pinned = body("pinned", tiny_model_dir, replicas=3, dedicated=True, memory={"override_bytes": 1024 * MiB})
    assert api("post", "/api/deployments/", pinned).status_code == 201

    with on_commit():
        woken = sleep.wake_deployment("tiny-a", reason="a request arrived")

    assert len(woken) == 1 and awake_count("tiny-a") == 1 and invariant_holds()
    assert Event.objects.filter(reason__contains="0 → 1 awake (not all 2 wanted fit)").exists()


def test_a_wake_that_cannot_fit_is_a_409_with_reasons_and_changes_nothing(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    api("post", "/api/deployments/tiny-a/sleep/")
    asleep(replica_id)
    pinned = body("pinned", tiny_model_dir, replicas=4, dedicated=True, memory={"override_bytes": 1024 * MiB})
    assert api("post", "/api/deployments/", pinned).status_code == 201
    dispatched.clear()

    for path in (f"/api/replicas/{replica_id}/wake/", "/api/deployments/tiny-a/wake/"):
        response = api("post", path)
        assert response.status_code == 409, (path, response.json())
        assert "cannot place tiny-a" in response.json()["detail"] and response.json()["reasons"]

    assert Replica.objects.filter(deployment__name="tiny-a").count() == 1
    assert Replica.objects.get(pk=replica_id).state == "sleeping" and dispatched == []
    with pytest.raises(CannotPlace):
        sleep.wake_replica(replica_id, reason="test")


def test_wrong_states_are_409s(cluster, api, tiny_model_dir):
    assert api("post", "/api/deployments/", body("tiny-a", tiny_model_dir)).status_code == 201
    pending = Replica.objects.get()

    response = api("post", f"/api/replicas/{pending.id}/sleep/")
    assert response.status_code == 409 and "pending" in response.json()["detail"]
    assert NOT_SERVING in response.json()["detail"]
    serve(pending.id)
    response = api("post", f"/api/replicas/{pending.id}/wake/")
    assert response.status_code == 409 and "only a sleeping replica can be woken" in response.json()["detail"]
    with pytest.raises(InvalidState):
        sleep.wake_replica(pending.id, reason="test")


def test_controls_need_staff_and_unknown_names_are_404(cluster, api, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    user = APIClient()
    user.force_authenticate(User.objects.create_user("viewer"))
    anonymous = APIClient()
    paths = [
        "/api/deployments/tiny-a/sleep/",
        "/api/deployments/tiny-a/wake/",
        f"/api/replicas/{replica_id}/sleep/",
        f"/api/replicas/{replica_id}/wake/",
    ]
    for path in paths:
        assert user.post(path).status_code == 403, path
        assert anonymous.post(path).status_code == 401, path
    assert Replica.objects.get().state == "serving"
    for path in ["/api/deployments/nope/sleep/", "/api/deployments/nope/wake/"]:
        assert api("post", path).status_code == 404, path
    for path in ["/api/replicas/0123456789abcdef/sleep/", "/api/replicas/0123456789abcdef/wake/"]:
        assert api("post", path).status_code == 404, path


def test_the_schema_lists_the_sleep_and_wake_controls(staff):
    paths = staff.get("/api/schema/", {"format": "json"}).json()["paths"]
    for path in [
        "/api/deployments/{name}/sleep/",
        "/api/deployments/{name}/wake/",
        "/api/replicas/{id}/sleep/",
        "/api/replicas/{id}/wake/",
    ]:
        assert "post" in paths[path], path


# -- the idle sweep ----------------------------------------------------------------------------------


def test_the_sweep_sleeps_only_replicas_idle_past_their_timeout(cluster, api, dispatched, tiny_model_dir, on_commit):
    now = timezone.now()
    idle = deploy_serving(api, tiny_model_dir, "idle", sleep={"idle_timeout_s": 60})[0]
    fresh = deploy_serving(api, tiny_model_dir, "fresh", sleep={"idle_timeout_s": 60})[0]
    never = deploy_serving(api, tiny_model_dir, "never", sleep={"idle_timeout_s": 0})[0]
    popular = deploy_serving(api, tiny_model_dir, "popular", sleep={"idle_timeout_s": 60}, fairness={"popular": True})[
        0
    ]
    untouched = deploy_serving(api, tiny_model_dir, "untouched", sleep={"idle_timeout_s": 60})[0]
    long_ago = now - timedelta(seconds=300)
    Replica.objects.update(serving_since=long_ago, last_accessed=long_ago)
    Replica.objects.filter(pk=fresh).update(last_accessed=now - timedelta(seconds=10))
    Replica.objects.filter(pk=untouched).update(last_accessed=None)  # never asked: idle since it served
    dispatched.clear()

    with on_commit():
        slept = sleep.sweep_idle(now=now)

    assert sorted(slept) == sorted([idle, untouched])
    assert sorted(args[0] for _, task, args in dispatched if task == TO_CACHE) == sorted(slept)
    states_now = dict(Replica.objects.values_list("id", "state"))
    assert states_now[idle] == states_now[untouched] == "draining"
    assert states_now[fresh] == states_now[never] == states_now[popular] == "serving"
    assert Event.objects.get(replica=idle, kind=Event.Kind.REPLICA_STATE, after__state="draining").reason == (
        "slept after 300 s idle"
    )
    assert Deployment.objects.get(name="idle").replicas_wanted == 1, "sleep is not a scale-down"
    assert sleep.sweep_idle(now=now) == [], "a draining replica is not swept twice"


def test_the_sweep_keeps_awake_a_replica_whose_wake_would_miss_the_slo_and_says_so_once(
    cluster, api, dispatched, tiny_model_dir, on_commit, settings
):
    # Kept awake (fairness.sleep_when_idle): its next first request would miss for certain, while
    # the memory a sleep frees is wanted by no one yet; a wake that needs it preempts it then.
    settings.GPUPORTAL_TTFT_SLO_S = 5.0
    slow = deploy_serving(api, tiny_model_dir, "slow", sleep={"idle_timeout_s": 60})[0]
    quick = deploy_serving(api, tiny_model_dir, "quick", sleep={"idle_timeout_s": 60})[0]
    DeploymentObserved.objects.filter(deployment__name="slow").update(measured_wake_s=7.0)
    DeploymentObserved.objects.filter(deployment__name="quick").update(measured_wake_s=0.5)
    now = timezone.now()
    long_ago = now - timedelta(seconds=300)
    Replica.objects.update(serving_since=long_ago, last_accessed=long_ago)

    with on_commit():
        assert sleep.sweep_idle(now=now) == [quick]
        assert sleep.sweep_idle(now=now + timedelta(seconds=30)) == []

    assert Replica.objects.get(pk=slow).state == "serving"
    (kept,) = Event.objects.filter(replica=slow, reason__startswith=sleep.KEPT_AWAKE)
    assert kept.reason.startswith("kept awake after 300 s idle: a wake from CPU RAM takes 7 s (measured), longer than")
    assert kept.after == {"state": "serving", "wake_s": 7.0, "slo_ttft_s": 5.0}
    settings.GPUPORTAL_TTFT_SLO_S = 10.0  # an operator who will wait longer lets it sleep
    assert sleep.sweep_idle(now=now + timedelta(seconds=60)) == [slow]


def _one_gpu_with_a_copy_asleep(api, model_dir, *, copy_mib: int, copy_wake_s: float) -> tuple[str, str]:
    """One node of one 1 GiB GPU: `copy` asleep in its CPU RAM (needing `copy_mib`, waking in
    `copy_wake_s`), and two serving replicas of 300 MiB, `idle` idle for 10 s, `recent` for 1 s
    (max_wait is 5 s, the idle timeouts 300 s). Returns (idle, recent)."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    memory = {"override_bytes": copy_mib * MiB, "max_tokens": 256}
    (copy,) = deploy_serving(api, model_dir, "copy", memory=memory)
    sleep.sleep_replica(copy, reason="put to sleep by an operator")
    asleep(copy)
    DeploymentObserved.objects.filter(deployment__name="copy").update(measured_wake_s=copy_wake_s)
    (idle,) = deploy_serving(api, model_dir, "idle", sleep={"idle_timeout_s": 300})
    (recent,) = deploy_serving(api, model_dir, "recent", sleep={"idle_timeout_s": 300})
    Deployment.objects.filter(name__in=["idle", "recent"]).update(max_wait_s=5.0)
    DeploymentObserved.objects.filter(deployment__name__in=["idle", "recent"]).update(measured_wake_s=0.5)
    now = timezone.now()
    Replica.objects.filter(pk__in=[idle, recent]).update(serving_since=now - timedelta(seconds=300))
    Replica.objects.filter(pk=idle).update(last_accessed=now - timedelta(seconds=10))
    Replica.objects.filter(pk=recent).update(last_accessed=now - timedelta(seconds=1))
    return idle, recent


def test_the_sweep_sleeps_an_idle_replica_before_its_timeout_when_its_node_has_no_room_for_a_copy_asleep_there(
    db, api, dispatched, tiny_model_dir, on_commit, settings
):
    # Asleep early (fairness.sleep_early): 424 MiB free, the copy needs 500 MiB and wakes within the
    # SLO; a wake would otherwise first wait for a victim's weights to leave.
    settings.GPUPORTAL_TTFT_SLO_S = 5.0
    idle, recent = _one_gpu_with_a_copy_asleep(api, tiny_model_dir, copy_mib=500, copy_wake_s=0.5)
    dispatched.clear()

    with on_commit():
        slept = sleep.sweep_idle()

    assert slept == [idle]
    assert [args for _, task, args in dispatched if task == TO_CACHE] == [[idle]]
    assert Replica.objects.get(pk=recent).state == "serving", "idle for less than max_wait: inside a burst"
    reason = Event.objects.get(replica=idle, kind=Event.Kind.REPLICA_STATE, after__state="draining").reason
    assert reason.startswith(
        "slept after 10 s idle, before its idle timeout: its node has no room for the wake of copy"
    )
    assert reason.endswith("(fairness.sleep_early)")
    assert Deployment.objects.get(name="idle").replicas_wanted == 1, "sleep is not a scale-down"


@pytest.mark.parametrize(
    ("copy_mib", "copy_wake_s", "why"),
    [(400, 0.5, "the copy fits as things are"), (500, 7.0, "the copy's wake misses the SLO however soon room comes")],
)
def test_the_sweep_leaves_an_idle_replica_to_its_timeout_when_no_copy_asleep_on_its_node_wants_the_room(
    db, api, dispatched, tiny_model_dir, on_commit, settings, copy_mib, copy_wake_s, why
):
    settings.GPUPORTAL_TTFT_SLO_S = 5.0
    idle, recent = _one_gpu_with_a_copy_asleep(api, tiny_model_dir, copy_mib=copy_mib, copy_wake_s=copy_wake_s)

    with on_commit():
        assert sleep.sweep_idle() == [], why

    assert Replica.objects.get(pk=idle).state == Replica.objects.get(pk=recent).state == "serving"


def test_a_request_accepted_as_the_last_replica_was_swept_wakes_the_deployment_once_it_sleeps(
    cluster, api, dispatched, tiny_model_dir, on_commit, clean_queues
):
    (replica_id,) = deploy_serving(api, tiny_model_dir, sleep={"idle_timeout_s": 60})
    long_ago = timezone.now() - timedelta(seconds=300)
    Replica.objects.update(serving_since=long_ago, last_accessed=long_ago)
    # The request is accepted while the replica still serves (so it does not wake anything)...
    request = request_services.submit("tiny-a", kind="generate", input="hi", params={}, owner="1")
    assert request.status == "queued"
    # ...and the sweep puts that replica to sleep the same instant: its drain hands the request
    # back to the queue, with nothing awake to take it and no client sending another.
    with on_commit():
        assert sleep.sweep_idle() == [replica_id]
    dispatched.clear()

    with on_commit():
        asleep(replica_id)

    assert (
        "control",
        "scheduling.tasks.wake",
        ["tiny-a", f"requests waiting after replica {replica_id[:8]} slept"],
    ) in (dispatched)


def test_a_replica_that_sleeps_with_nothing_waiting_wakes_nothing(cluster, api, dispatched, tiny_model_dir, on_commit):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    sleep.sleep_replica(replica_id, reason="put to sleep by an operator")
    dispatched.clear()

    with on_commit():
        asleep(replica_id)

    assert [task for _, task, _ in dispatched] == []


def test_a_replica_just_woken_is_not_idle_whatever_its_last_request(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir, sleep={"idle_timeout_s": 60})
    now = timezone.now()
    Replica.objects.update(last_accessed=now - timedelta(hours=1), serving_since=now - timedelta(seconds=5))

    assert sleep.sweep_idle(now=now) == []
    assert sleep.sweep_idle(now=now + timedelta(seconds=60)) == [replica_id]


def test_the_beat_task_runs_the_sweep(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir, sleep={"idle_timeout_s": 1})
    five_s_ago = timezone.now() - timedelta(seconds=5)
    Replica.objects.update(last_accessed=five_s_ago, serving_since=five_s_ago)

    assert sleep_idle.apply().get() == [replica_id]
    assert Replica.objects.get().state == "draining"


def test_the_sweep_is_scheduled_every_5_s_on_the_control_queue(beat_schedules):
    schedule = PeriodicTask.objects.get(name="sleep idle replicas")
    assert schedule.task == "scheduling.tasks.sleep_idle" and schedule.enabled
    assert (schedule.interval.every, schedule.interval.period, schedule.queue) == (5, "seconds", "control")


@pytest.mark.django_db(transaction=True)
def test_the_sweep_skips_a_replica_another_transaction_holds(dispatched, tiny_model_dir):
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    deployment = _deploy_directly("held", tiny_model_dir, replicas=1, idle_timeout_s=1)
    replica_id = deployment.replicas.get().id
    serve(replica_id)
    later = timezone.now() + timedelta(seconds=10)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        # E.g. the request path stamping last_accessed while a request starts on this replica.
        try:
            with transaction.atomic():
                Replica.objects.select_for_update().get(pk=replica_id)
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        assert sleep.sweep_idle(now=later) == []
        assert holder.is_alive() and not release.is_set(), "it returned while the row stayed locked: skipped"
    finally:
        release.set()
        holder.join()
    assert sleep.sweep_idle(now=later) == [replica_id]


# -- concurrent wakes ----------------------------------------------------------------------------------


def _deploy_directly(name: str, model_dir, **spec) -> Deployment:
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB)
    return create(DeploymentSpec(name=name, source=str(model_dir), override_bytes=300 * MiB, **spec), facts=facts)


@pytest.mark.django_db(transaction=True)
def test_concurrent_wakes_add_exactly_the_replicas_wanted(dispatched, tiny_model_dir):
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB", NO_OVERHEAD), virtual=True)
    deployment = _deploy_directly("tiny-a", tiny_model_dir, replicas=2)
    cached, dead = deployment.replicas.order_by("pk").values_list("id", flat=True)
    for replica_id in (cached, dead):
        serve(replica_id)
    sleep.sleep_replica(cached, reason="test")
    asleep(cached)
    reports.report(dead, {"event": "failed", "reason": "killed"})
    assert awake_count("tiny-a") == 0

    callers = 8
    barrier = threading.Barrier(callers)
    woken: list[list[str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def wake() -> None:
        try:
            barrier.wait()
            result = sleep.wake_deployment("tiny-a", reason="a request arrived")
            with lock:
                woken.append(result)
        except BaseException as err:  # reported below: a thread's exception is otherwise lost
            with lock:
                errors.append(err)
        finally:
            connection.close()

    threads = [threading.Thread(target=wake) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors, errors
    added = [replica_id for result in woken for replica_id in result]
    assert len(added) == len(set(added)) == 2, woken
    assert cached in added, "the cached replica is promoted, not replaced"
    assert sorted(len(result) for result in woken) == [0] * (callers - 1) + [2], "one caller did it all"
    assert awake_count("tiny-a") == 2 and Replica.objects.count() == 3 and invariant_holds()
    assert [task for _, task, _ in dispatched].count(FROM_CACHE) == 1


# -- admin actions ---------------------------------------------------------------------------------------


def test_admin_actions_sleep_and_wake_through_the_services(cluster, api, admin_client, dispatched, tiny_model_dir):
    first, second = deploy_serving(api, tiny_model_dir, replicas=2)
    deployment = Deployment.objects.get()

    def run(changelist: str, action: str, selected: list) -> list[str]:
        response = admin_client.post(changelist, {"_selected_action": selected, "action": action}, follow=True)
        assert response.status_code == 200
        return [str(m) for m in get_messages(response.wsgi_request)]

    texts = run("/admin/scheduling/replica/", "sleep_replicas", [first])
    assert any("going to sleep" in t for t in texts) and Replica.objects.get(pk=first).state == "draining"
    assert Event.objects.filter(replica=first, reason="put to sleep by admin (admin)").exists()

    texts = run("/admin/scheduling/replica/", "wake_replicas", [first, second])
    assert sum("only a sleeping replica can be woken" in t for t in texts) == 2, "draining and serving: refused"
    asleep(first)
    texts = run("/admin/scheduling/replica/", "wake_replicas", [first])
    assert texts == [f"{Replica.objects.get(pk=first)}: waking on {Replica.objects.get(pk=first).node}"]
    assert Replica.objects.get(pk=first).state == "waking"
    assert Event.objects.filter(replica=first, reason__contains="; woken by admin (admin): wake replica").exists()

    reports.report(first, {"event": "woken"})
    texts = run("/admin/scheduling/deployment/", "sleep_deployments", [deployment.pk])
    assert texts == ["tiny-a: 2 serving replica(s) going to sleep"]
    asleep(first)
    asleep(second)
    texts = run("/admin/scheduling/deployment/", "wake_deployments", [deployment.pk])
    assert texts == ["tiny-a: waking 2 replica(s)"]
    assert {r.state for r in Replica.objects.all()} == {"waking"} and Replica.objects.count() == 2
    assert run("/admin/scheduling/deployment/", "wake_deployments", [deployment.pk]) == ["tiny-a: already awake"]


# -- end to end with real processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("agent")
def test_an_idle_replica_sleeps_with_its_process_alive_and_wakes_as_the_same_process(staff, tmp_path):
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3).path
    deploy = {
        "name": "sleepy",
        "model": {"source": str(model), "loader": "transformers", "dtype": "float32"},
        "replicas": 1,
        "memory": {"max_tokens": 128},
        "sleep": {"idle_timeout_s": 1},
    }
    assert staff.post("/api/deployments/", deploy, format="json").status_code == 201
    wait_until(all_in("sleepy", "serving", 1), LOAD_TIMEOUT, "the replica to serve")
    replica = Replica.objects.get()
    assert replica.pid and psutil.pid_exists(replica.pid)
    # Its need is now what it measured, counting the context as it was at the load.
    measured = DeploymentObserved.objects.get(deployment__name="sleepy")
    assert measured.memory_measured_bytes and measured.memory_measured_context_bytes == H100_CONTEXT_BYTES

    # Beat does not run in tests: sweep by hand until the idle timeout has passed.
    slept = wait_until(lambda: sleep.sweep_idle(), 10, "the sweep to find the replica idle")
    assert slept == [replica.id]
    wait_until(lambda: states("sleepy")[replica.id] == "sleeping", 60, "the replica to sleep")
    assert psutil.pid_exists(replica.pid), "asleep, its process lives on with the weights in CPU RAM"
    # What a GPU keeps of a sleeper is its CUDA context as serving grew it, the virtual one as the H100's
    # does, and that grown context is the GPU's figure from now on, so the wake counts it.
    grown = H100_CONTEXT_BYTES + H100_KERNEL_GROWTH_BYTES
    assert Occupant.objects.get(replica_id=replica.id).reserved_bytes == grown
    assert GPU.objects.get(pk=Occupant.objects.get(replica_id=replica.id).gpu_id).context_bytes == grown
    assert Event.objects.filter(replica=replica.id, reason__regex=r"^slept after \d+ s idle$").exists()

    # Woken into the need it measured, its KV pool would come out short by the growth (the H100's
    # 0-block pool of 2026-11-26): the wake is reserved the growth too, and it serves.
    assert sleep.wake_deployment("sleepy", reason="a request arrived") == [replica.id]
    wait_until(all_in("sleepy", "serving", 1), LOAD_TIMEOUT, "the replica to wake")
    assert sum(Replica.objects.get().gpu_mem_bytes_by_id.values()) >= (
        measured.memory_measured_bytes + H100_KERNEL_GROWTH_BYTES
    )
    woken = Replica.objects.get()
    assert woken.id == replica.id and woken.pid == replica.pid, "the same process, promoted from the cache"
    assert Event.objects.filter(replica=replica.id, reason="woken from the CPU cache").exists()
    assert sleep.wake_deployment("sleepy", reason="another request") == []
