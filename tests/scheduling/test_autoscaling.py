"""The autoscaler (scheduling.core.autoscale decides, scheduling.services.autoscaling sweeps):
replicas by requests in flight, between a deployment's bounds; more at once, fewer only after
the scale-down window, with an Event saying why. The sweeps run here against the test's
PostgreSQL and Redis, on virtual GPUs with no processes: the requests are real ones, accepted by
the request service and taken from the queue as a replica takes them."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import DatabaseError, transaction
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.wire.memory import MiB
from gpuportal.wire.requestqueue import RequestQueue
from gpuportal.wire.states import AWAKE
from scheduling.core.autoscale import Decision, Policy, decide, wanted
from scheduling.models import Deployment, Event, Replica
from scheduling.services import autoscaling, queueing, scaling, sleep
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from tests.support.api_shapes import shaped
from tests.support.deployments import asleep, body, invariant_holds, serve

POLICY = Policy(min_replicas=1, max_replicas=4, target_in_flight=2, down_after_s=60)
T0 = 1_000_000.0


# -- the decision ------------------------------------------------------------------------------


def test_it_wants_a_replica_per_target_in_flight_within_the_bounds():
    assert [wanted(n, POLICY) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    # A whole ratio in decimal is that many replicas, though not in binary floating point.
    assert wanted(7, Policy(1, 20, 0.7, 0)) == 10


def test_it_scales_up_at_once_and_says_by_how_much_load():
    assert decide(1, 5, [], T0, POLICY) == Decision(3, "5 request(s) in flight, 2 per replica wanted")


def test_it_scales_down_only_once_every_sweep_of_the_window_wanted_fewer_and_to_the_most_they_wanted():
    calm = [(T0 - 61, 3), (T0 - 30, 1), (T0 - 5, 1)]
    assert decide(3, 0, calm, T0, POLICY) == Decision(
        1, "0 request(s) in flight, 2 per replica wanted; at most 1 wanted for 60 s", wake=False
    )
    burst = [(T0 - 61, 1), (T0 - 30, 2), (T0 - 5, 1)]
    assert decide(3, 0, burst, T0, POLICY) == Decision(
        2, "0 request(s) in flight, 2 per replica wanted; at most 2 wanted for 60 s", wake=False
    )
    assert decide(2, 0, burst, T0, POLICY) is None, "the burst 30 s ago wanted 2"


def test_it_waits_for_sweeps_that_cover_the_window_before_scaling_down():
    assert decide(3, 0, [(T0 - 30, 1), (T0 - 5, 1)], T0, POLICY) is None
    assert decide(3, 0, [], T0, POLICY) is None
    assert decide(3, 0, [], T0, Policy(1, 4, 2, 0)) == Decision(
        1, "0 request(s) in flight, 2 per replica wanted; at most 1 wanted for 0 s", wake=False
    )


def test_it_brings_a_count_outside_the_bounds_back_within_them_at_once_but_leaves_a_stopped_one_stopped():
    assert decide(1, 0, [], T0, Policy(2, 4, 2, 60)) == Decision(
        2, "below autoscale.min_replicas (0 request(s) in flight, 2 per replica wanted)"
    )
    assert decide(0, 100, [], T0, POLICY) is None, "scaled to 0 by an operator: stopped, not autoscaled"
    assert decide(7, 100, [], T0, POLICY) == Decision(
        4, "above autoscale.max_replicas (100 request(s) in flight, 2 per replica wanted)", wake=False
    )


def test_it_wakes_what_the_load_wants_where_fewer_are_awake_than_that_and_never_for_no_load():
    # Its last burst left it wanting 4; its replicas slept since, and a request woke one.
    assert decide(4, 5, [], T0, POLICY, awake=1) == Decision(
        3, "5 request(s) in flight, 2 per replica wanted; 1 of 4 awake"
    )
    assert decide(4, 5, [], T0, POLICY, awake=3) is None, "as many awake as the load wants"
    assert decide(4, 1, [], T0, POLICY, awake=1) is None, "one in flight: one awake is enough"
    assert decide(4, 5, [], T0, POLICY, awake=0) is None, "none awake: the requests' own wake is under way"


policies = st.builds(
    lambda least, extra, target, window: Policy(least, least + extra, target, window),
    st.integers(1, 8),
    st.integers(0, 8),
    st.floats(0.1, 50, allow_nan=False),
    st.floats(0, 600, allow_nan=False),
)
histories = st.lists(st.tuples(st.floats(T0 - 1200, T0), st.integers(0, 40)), max_size=20)


@given(policies, st.integers(0, 40), st.integers(0, 500), histories, st.none() | st.integers(0, 40))
def test_a_decision_stays_within_the_bounds_scales_up_to_the_load_and_never_down_below_the_window(
    policy, current, in_flight, recent, awake
):
    decision = decide(current, in_flight, recent, T0, policy, awake=awake)
    after = current if decision is None else decision.replicas
    now_wanted = wanted(in_flight, policy)
    assert policy.min_replicas <= now_wanted <= policy.max_replicas
    if policy.min_replicas <= current <= policy.max_replicas:
        assert policy.min_replicas <= after <= policy.max_replicas
        assert after >= now_wanted, "never fewer than the load wants now"
        if after < current and (decision is None or not decision.wake):
            in_window = [count for when, count in recent if when > T0 - policy.down_after_s]
            assert all(count <= after for count in in_window), "nor fewer than any sweep of the window wanted"
        if decision is not None and decision.wake:
            assert after > current or (awake and in_flight and awake < after), "woken for load only, some awake"
    elif current == 0:
        assert decision is None, "a deployment scaled to 0 stays stopped"
    else:
        assert policy.min_replicas <= after <= policy.max_replicas, "brought back within the bounds"
    assert decision is None or decision.replicas != current or (awake is not None and awake < current)


# -- the sweep, against PostgreSQL and Redis ---------------------------------------------------


@pytest.fixture
def named(cluster):
    """A fresh deployment name, its Redis keys dropped after the test."""
    name = f"auto-{uuid.uuid4().hex[:8]}"
    yield name
    for each in (name, f"{name}-failed", f"{name}-retrying", f"{name}-stopped"):
        queueing.queue().redis.delete(autoscaling.history_key(each), f"gp:queue:{each}")


def deploy(name: str, replicas: int, **autoscale: object) -> Deployment:
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB)
    spec = DeploymentSpec(
        name=name, source="/srv/models/tiny", replicas=replicas, override_bytes=300 * MiB, **autoscale
    )
    return create(spec, facts=facts)


def accept(name: str, count: int) -> list[str]:
    return [
        request_services.submit(name, kind="generate", input="hi", params={}, owner="alice").id for _ in range(count)
    ]


def awake(name: str) -> int:
    return Replica.objects.filter(deployment__name=name, state__in=AWAKE).count()


def all_asleep(name: str) -> None:
    """Every replica of the deployment serving, then asleep (idle), as its processes report it."""
    for replica_id in Replica.objects.filter(deployment__name=name).values_list("id", flat=True):
        serve(replica_id)
        sleep.sleep_replica(replica_id, reason="idle")
        asleep(replica_id)


def changes(name: str) -> list[str]:
    return list(
        Event.objects.filter(kind=Event.Kind.DEPLOYMENT_CHANGED, deployment=name, reason__startswith="autoscaled")
        .order_by("pk")
        .values_list("reason", flat=True)
    )


def test_a_sweep_scales_up_by_the_requests_waiting_and_taken_and_says_why(
    named, dispatched, django_capture_on_commit_callbacks
):
    deploy(named, 1, autoscale_max_replicas=4, autoscale_target_in_flight=2)
    accept(named, 5)
    (replica,) = Replica.objects.filter(deployment__name=named)
    taken = [queueing.queue().take(named, replica.id, 0) for _ in range(2)]
    assert all(request is not None for request in taken), "a replica took two: five in flight all the same"

    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {named: 3}

    assert Deployment.objects.get(name=named).replicas_wanted == 3
    assert awake(named) == 3
    assert changes(named) == ["autoscaled: 5 request(s) in flight, 2 per replica wanted: 1 → 3 replica(s)"]
    assert invariant_holds()
    # A sweep that finds the load unchanged changes nothing.
    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0 + 5) == {}


def test_a_sweep_scales_down_after_the_window_to_the_most_a_sweep_in_it_wanted(
    named, dispatched, django_capture_on_commit_callbacks
):
    deploy(named, 3, autoscale_max_replicas=4, autoscale_target_in_flight=2, autoscale_down_after_s=60)
    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {}, "no sweep before it to show the last minute was calm"
        ids = accept(named, 3)
        assert autoscaling.sweep(T0 + 10) == {}, "3 in flight want 2: the window is not over"
    for request_id in ids:
        queueing.cancel_unstarted(request_id, reason="the test is done with it")

    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0 + 65) == {named: 2}, "the sweep at T0 + 10 wanted 2"
        assert autoscaling.sweep(T0 + 69) == {}, "the sweep at T0 + 10 is still in the window"
        assert autoscaling.sweep(T0 + 71) == {named: 1}

    assert awake(named) == 1
    assert changes(named) == [
        "autoscaled: 0 request(s) in flight, 2 per replica wanted; at most 2 wanted for 60 s: 3 → 2 replica(s)",
        "autoscaled: 0 request(s) in flight, 2 per replica wanted; at most 1 wanted for 60 s: 2 → 1 replica(s)",
    ]
    assert invariant_holds()


def test_a_scale_down_of_a_deployment_whose_replicas_fell_asleep_wakes_none(
    named, dispatched, django_capture_on_commit_callbacks
):
    # Its three replicas slept, idle, before the window let it scale down: 3 → 1 wanted, and the
    # next request wakes one. It woke one at once (a scale to 1 brought 0 awake up to 1).
    deploy(named, 3, autoscale_max_replicas=4, autoscale_target_in_flight=2, autoscale_down_after_s=60)
    with django_capture_on_commit_callbacks(execute=True):
        all_asleep(named)
    assert awake(named) == 0
    sent = len(dispatched)

    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {}
        assert autoscaling.sweep(T0 + 65) == {named: 1}

    assert Deployment.objects.get(name=named).replicas_wanted == 1
    assert awake(named) == 0 and len(dispatched) == sent, "nothing woken, nothing told"
    assert changes(named) == [
        "autoscaled: 0 request(s) in flight, 2 per replica wanted; at most 1 wanted for 60 s: 3 → 1 replica(s)"
    ]
    assert invariant_holds()


def test_a_request_wakes_what_the_waiting_requests_want_and_the_sweep_wakes_more_as_they_grow(
    named, dispatched, django_capture_on_commit_callbacks
):
    # It wants 3 (its last burst's), all asleep. One request wakes one, not three; five in flight
    # then want three, and the sweep wakes two more: its count stays, what is awake follows the load.
    deploy(named, 3, autoscale_max_replicas=4, autoscale_target_in_flight=2, autoscale_down_after_s=60)
    with django_capture_on_commit_callbacks(execute=True):
        all_asleep(named)

    with django_capture_on_commit_callbacks(execute=True):
        accept(named, 1)
    assert awake(named) == 1, "one request wants one replica"
    with django_capture_on_commit_callbacks(execute=True):
        accept(named, 4)
        assert autoscaling.sweep(T0) == {named: 3}

    assert awake(named) == 3 and Deployment.objects.get(name=named).replicas_wanted == 3
    placed = Event.objects.filter(deployment=named, reason__contains="1 of 3 awake")
    assert placed.count() == 2, "each woken replica's Event says why"
    assert invariant_holds()


def test_a_deployment_without_autoscale_wakes_all_it_wants_for_one_request(
    named, dispatched, django_capture_on_commit_callbacks
):
    deploy(named, 3)
    with django_capture_on_commit_callbacks(execute=True):
        all_asleep(named)
        accept(named, 1)
    assert awake(named) == 3, "the next wake brings back as many as it wants (sleep.py)"


@pytest.mark.django_db(transaction=True)
def test_a_requests_wake_reads_the_queue_before_locking_the_deployment_and_wakes_all_when_it_cannot(
    named, dispatched, django_capture_on_commit_callbacks, monkeypatch, caplog
):
    import redis
    from django.db import connection

    deploy(named, 3, autoscale_max_replicas=4, autoscale_target_in_flight=2)
    with django_capture_on_commit_callbacks(execute=True):
        all_asleep(named)
    locked_while_read: list[bool] = []

    def redis_is_away(queue: RequestQueue, names: list[str]) -> dict[str, int]:
        # Asked from a connection of its own (a thread): is the deployment's row locked now?
        def try_lock() -> None:
            try:
                with transaction.atomic():
                    Deployment.objects.select_for_update(nowait=True).get(name=named)
                locked_while_read.append(False)
            except DatabaseError:
                locked_while_read.append(True)
            finally:
                connection.close()

        thread = threading.Thread(target=try_lock)
        thread.start()
        thread.join()
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(RequestQueue, "depths", redis_is_away)
    woken = sleep.wake_deployment(named, reason="woken by a request", for_requests=True)

    assert locked_while_read == [False], "a Redis round trip must not hold the deployment's row lock"
    assert len(woken) == 3 and awake(named) == 3, "no load read: it wakes all it wants"
    assert "cannot read its queue (Connection refused): waking all it wants" in caplog.text


def test_a_sweep_leaves_the_count_of_an_operators_scale_committed_after_it_read_the_deployment(
    named, dispatched, django_capture_on_commit_callbacks, monkeypatch
):
    deploy(named, 1, autoscale_max_replicas=4, autoscale_target_in_flight=1)
    accept(named, 4)
    read_load = autoscaling._load

    def an_operator_scales_meanwhile(names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        load = read_load(names)  # the deployments were read just before: wanting 1
        scaling.scale(named, 2, reason="scaled by an operator")
        return load

    monkeypatch.setattr(autoscaling, "_load", an_operator_scales_meanwhile)
    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {}

    assert Deployment.objects.get(name=named).replicas_wanted == 2
    assert changes(named) == []
    monkeypatch.setattr(autoscaling, "_load", read_load)
    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0 + 5) == {named: 4}, "the next sweep reads the operator's count"


def test_a_sweep_that_cannot_read_the_load_changes_nothing_and_says_why(named, dispatched, monkeypatch, caplog):
    import redis

    deploy(named, 2, autoscale_max_replicas=4, autoscale_down_after_s=0)

    def redis_is_away(names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(autoscaling, "_load", redis_is_away)
    assert autoscaling.sweep(T0) == {}, "no load read is not no load: nothing is stopped"
    assert Deployment.objects.get(name=named).replicas_wanted == 2
    assert "cannot read the requests in flight (Connection refused): no change this sweep" in caplog.text


def test_a_scale_up_with_room_for_fewer_takes_one_more_and_asks_again_next_sweep(
    named, dispatched, django_capture_on_commit_callbacks
):
    # Four GPUs of 1 GiB hold three replicas of 300 MiB each: twelve in all.
    deploy(named, 10, autoscale_max_replicas=32, autoscale_target_in_flight=1)
    accept(named, 20)

    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {named: 11}
        assert autoscaling.sweep(T0 + 5) == {named: 12}
        assert autoscaling.sweep(T0 + 10) == {}, "no room for a thirteenth: it asks again later"

    assert awake(named) == 12
    assert changes(named)[0] == (
        "autoscaled: 20 request(s) in flight, 1 per replica wanted; room for one more only: 10 → 11 replica(s)"
    )
    assert invariant_holds()


def test_a_deployment_without_autoscale_failing_or_scaled_to_zero_is_left_as_set(
    named, dispatched, django_capture_on_commit_callbacks
):
    deploy(named, 1)
    accept(named, 8)
    other = f"{named}-failed"
    deploy(other, 1, autoscale_max_replicas=4, autoscale_target_in_flight=1)
    observed = Deployment.objects.get(name=other).observed
    observed.failed_reason = "its loads failed"
    observed.save(update_fields=["failed_reason"])
    retrying = f"{named}-retrying"
    deploy(retrying, 1, autoscale_max_replicas=4, autoscale_target_in_flight=1)
    observed = Deployment.objects.get(name=retrying).observed
    observed.retry_at = timezone.now()
    observed.save(update_fields=["retry_at"])
    stopped = f"{named}-stopped"
    deploy(stopped, 0, autoscale_max_replicas=4, autoscale_min_replicas=2)

    with django_capture_on_commit_callbacks(execute=True):
        assert autoscaling.sweep(T0) == {}

    assert Deployment.objects.get(name=named).replicas_wanted == 1
    assert Deployment.objects.get(name=other).replicas_wanted == 1
    assert Deployment.objects.get(name=retrying).replicas_wanted == 1
    assert Deployment.objects.get(name=stopped).replicas_wanted == 0, "scaled to 0: stopped, not autoscaled"


def test_the_sweep_is_scheduled_every_5_s_on_the_control_queue_and_runs_as_a_task(beat_schedules):
    from django_celery_beat.models import PeriodicTask

    from scheduling import tasks

    schedule = PeriodicTask.objects.get(name="autoscale deployments")
    assert schedule.task == tasks.autoscale.name == "scheduling.tasks.autoscale" and schedule.enabled
    assert (schedule.interval.every, schedule.interval.period, schedule.queue) == (5, "seconds", "control")


# -- the settings, through the API -------------------------------------------------------------


def test_a_deploy_or_patch_whose_bounds_cross_is_a_400_naming_the_setting_and_applies_nothing(
    cluster, api, tiny_model_dir
):
    response = api(
        "post", "/api/deployments/", body("crossed", tiny_model_dir, autoscale={"max_replicas": 2, "min_replicas": 3})
    )
    assert response.status_code == 400, response.json()
    assert response.json()["autoscale.min_replicas"] == ["must be at most autoscale.max_replicas (2), got 3"]
    assert not Deployment.objects.filter(name="crossed").exists()

    assert (
        api(
            "post", "/api/deployments/", body("auto", tiny_model_dir, autoscale={"max_replicas": 4, "min_replicas": 2})
        ).status_code
        == 201
    )
    before = Deployment.objects.values().get(name="auto")
    response = api("patch", "/api/deployments/auto/", {"autoscale": {"max_replicas": 1}, "dedicated": True})
    assert response.status_code == 400, response.json()
    assert response.json()["autoscale.max_replicas"] == [
        "must be 0 (off) or at least autoscale.min_replicas (2), got 1"
    ]
    response = api("patch", "/api/deployments/auto/", {"autoscale": {"max_replicas": 33}})
    assert response.status_code == 400, response.json()
    assert "GPUPORTAL_MAX_REPLICAS" in str(response.json()), response.json()
    assert Deployment.objects.values().get(name="auto") == before

    response = api("patch", "/api/deployments/auto/", {"autoscale": {"max_replicas": 0, "target_in_flight": 8}})
    assert response.status_code == 200, response.json()
    assert response.json()["autoscale"] == {
        "max_replicas": 0,
        "min_replicas": 2,
        "target_in_flight": 8.0,
        "down_after_s": 300.0,
        "load": None,
    }


def test_the_api_shows_the_load_the_last_sweep_measured_reading_it_once_an_answer(
    named, api, dispatched, django_capture_on_commit_callbacks, monkeypatch
):
    from scheduling.api import serializers

    deploy(named, 1, autoscale_max_replicas=4, autoscale_target_in_flight=2)
    fixed = deploy(f"{named}-stopped", 1)
    accept(named, 5)
    with django_capture_on_commit_callbacks(execute=True):
        autoscaling.sweep(T0)
    monkeypatch.setattr(serializers.time, "time", lambda: T0 + 2.5)
    reads: list[int] = []
    reading = autoscaling.last_loads
    monkeypatch.setattr(autoscaling, "last_loads", lambda: reads.append(1) or reading())

    shown = {d["name"]: d["autoscale"]["load"] for d in api("get", "/api/deployments/").json()["results"]}

    assert shown[named] == {"in_flight": 5, "wanted": 3, "age_s": 2.5}
    assert shown[fixed.name] is None, "not autoscaled"
    assert len(reads) == 1, "one read of Redis for the whole list"
    assert api("get", f"/api/deployments/{named}/").json()["autoscale"]["load"]["wanted"] == 3
    # Autoscaling turned off everywhere: the next sweep leaves no figures behind.
    api("patch", f"/api/deployments/{named}/", {"autoscale": {"max_replicas": 0}})
    autoscaling.sweep(T0 + 5)
    assert reading() == {}


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_command_line_turns_autoscaling_on_changes_its_bounds_and_turns_it_off(live_server, capsys):
    from tests.support import factories as f
    from tests.support.cli import staff_cli

    f.deployment("tiny-a")
    run = staff_cli(live_server, capsys, "autoscale", "tiny-a")

    assert run("--min", "2") == (1, "", "error: autoscale: tiny-a is not autoscaled yet: give --max")
    assert run() == (0, "tiny-a: not autoscaled: 1 replica(s) kept as set", "")
    assert run("--max", "4", "--target", "2") == (
        0,
        "tiny-a: autoscaled between 1 and 4 replicas, 2 requests in flight each; fewer after 300 s",
        "",
    )
    assert run("--min", "2", "--down-after", "60")[1] == (
        "tiny-a: autoscaled between 2 and 4 replicas, 2 requests in flight each; fewer after 60 s"
    )
    assert run("--min", "5") == (
        1,
        "",
        "error: autoscale.min_replicas: must be at most autoscale.max_replicas (4), got 5",
    )
    assert run("--off", "--max", "3")[2] == "error: autoscale: --off takes no other flag"
    assert run("--target", "1")[1] == (
        "tiny-a: autoscaled between 2 and 4 replicas, 1 request in flight each; fewer after 60 s"
    )
    assert run("--target", "2")[0] == 0
    assert run()[1] == "tiny-a: autoscaled between 2 and 4 replicas, 2 requests in flight each; fewer after 60 s"
    assert run("--off") == (0, "tiny-a: not autoscaled: 1 replica(s) kept as set", "")
    deployment = Deployment.objects.get(name="tiny-a")
    assert (deployment.autoscale_max_replicas, deployment.autoscale_min_replicas) == (0, 2)
    assert (deployment.autoscale_target_in_flight, deployment.autoscale_down_after_s) == (2, 60)


def test_the_admin_sets_the_autoscale_settings_through_the_service_and_refuses_crossed_bounds(
    cluster, api, admin_client, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    deployment = Deployment.objects.get(name="tiny-a")
    changelist = "/admin/scheduling/deployment/"
    selected = {"_selected_action": [deployment.pk], "action": "edit_settings", "apply": "1"}

    done = admin_client.post(changelist, {**selected, "autoscale_max_replicas": 4, "autoscale_target_in_flight": 2})
    assert done.status_code == 302
    crossed = admin_client.post(changelist, {**selected, "autoscale_min_replicas": 5}, follow=True)
    assert "autoscale.min_replicas: must be at most autoscale.max_replicas (4), got 5" in crossed.content.decode()

    deployment.refresh_from_db()
    assert (deployment.autoscale_max_replicas, deployment.autoscale_min_replicas) == (4, 1)
    assert deployment.autoscale_target_in_flight == 2


def test_the_command_line_shows_what_the_autoscaler_last_measured_below_the_bounds():
    from gpuportal.cli import render

    auto = {"max_replicas": 4, "min_replicas": 1, "target_in_flight": 4.0, "down_after_s": 300.0}
    measured = {"in_flight": 9, "wanted": 3, "age_s": 2.0}

    def shown(load: dict | None) -> str:
        return render.autoscale_text(shaped("Deployment", {"replicas_wanted": 2, "autoscale": {**auto, "load": load}}))

    assert shown(measured) == (
        "autoscaled between 1 and 4 replicas, 4 requests in flight each; fewer after 300 s\n"
        "last measured 2 s ago: 9 request(s) in flight, wanting 3 replica(s); 2 set"
    )
    assert shown(None).count("\n") == 0


def test_ls_shows_an_autoscaled_deployments_bounds_beside_its_count():
    import io

    from rich.console import Console

    from gpuportal.cli import render

    auto = {"max_replicas": 4, "min_replicas": 1, "target_in_flight": 2.0, "down_after_s": 300.0}
    deployments = [
        {"name": "auto", "status": "ok", "replicas": [], "replicas_wanted": 2, "autoscale": auto},
        {
            "name": "fixed",
            "status": "ok",
            "replicas": [],
            "replicas_wanted": 2,
            "autoscale": {**auto, "max_replicas": 0},
        },
    ]
    out = io.StringIO()
    Console(file=out, width=200).print(render.deployments_table([shaped("Deployment", d) for d in deployments]))

    rows = {line.split()[0]: line for line in out.getvalue().splitlines()[1:]}
    assert "0/2 (auto 1–4)" in rows["auto"]
    assert "0/2 " in rows["fixed"] and "auto" not in rows["fixed"].replace("fixed", "")


def test_metrics_show_the_replicas_each_deployment_wants_as_the_autoscaler_sets_them(
    named, dispatched, django_capture_on_commit_callbacks, client
):
    from prometheus_client.parser import text_string_to_metric_families

    deploy(named, 1, autoscale_max_replicas=4, autoscale_target_in_flight=1)
    accept(named, 3)
    with django_capture_on_commit_callbacks(execute=True):
        autoscaling.sweep(T0)

    families = {m.name: m for m in text_string_to_metric_families(client.get("/metrics").content.decode())}
    wanted = {s.labels["deployment"]: s.value for s in families["gpuportal_deployment_replicas_wanted"].samples}
    assert wanted[named] == 3


def test_the_dashboard_shows_an_autoscaled_deployments_bounds_beside_its_count(admin_client, cluster, dispatched):
    from django.urls import reverse

    from tests.support import factories as f

    f.deployment(
        "auto", autoscale_max_replicas=4, autoscale_min_replicas=2, replicas_wanted=3, memory_override_bytes=300 * MiB
    )
    f.deployment("fixed", replicas_wanted=3)
    # What earlier tests of this process left: their requests and their sweeps' figures.
    keys = ("gp:queue:auto", autoscaling.history_key("auto"), autoscaling.LAST_KEY)
    queueing.queue().redis.delete(*keys)

    body = admin_client.get(reverse("admin:scheduling_dashboard_fragment")).content.decode()

    assert body.count("auto 2–4</span>") == 1
    row = body.partition('<tr data-deployment="auto">')[2].partition("</tr>")[0]
    assert "<td>3 <span" in row and "auto 2–4" in row

    # Once swept (two requests in flight, fewer than the minimum wants: nothing changes), the load.
    try:
        accept("auto", 2)
        assert autoscaling.sweep(T0) == {}
        body = admin_client.get(reverse("admin:scheduling_dashboard_fragment")).content.decode()
    finally:
        queueing.queue().redis.delete(*keys)
    row = body.partition('<tr data-deployment="auto">')[2].partition("</tr>")[0]
    assert "auto 2–4 · 2 in flight</span>" in row
    assert 'title="autoscaled by requests in flight; last sweep: 2 in flight, wanting 2"' in row
