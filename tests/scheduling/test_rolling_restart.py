"""Rolling restarts (scheduling.core.rollout decides each step, scheduling.services.rollouts takes
it): every replica started before the restart replaced one at a time, awake ones after a surge
serves beside them, sleepers parked, nothing woken, failover pairs through a new standby and a
switchover, with an Event for each step. The services run
here against the test's PostgreSQL on virtual GPUs with no processes: each replica's reports are
made by hand, as its process would make them."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuportal.wire.memory import MiB
from scheduling.core.rollout import Action, Member, Step, next_pair_step, next_step, progress
from scheduling.models import Deployment, DeploymentObserved, Event, FailoverLease, Occupant, Replica
from scheduling.services import reports, rollouts, sleep
from tests.support.api_shapes import shaped
from tests.support.deployments import START, STOP, body, invariant_holds, reserved, serve
from tests.support.pairs import serves_at, stands_by, takes_over

T0 = datetime(2026, 11, 30, 12, 0, 0)
SINCE = T0 + timedelta(hours=1)


def old(replica_id: str, state: str = "serving", minute: int = 0, pair: int | None = None) -> Member:
    return Member(replica_id, state, T0 + timedelta(minutes=minute), pair)


def new(replica_id: str, state: str = "serving", minute: int = 1, pair: int | None = None) -> Member:
    return Member(replica_id, state, SINCE + timedelta(minutes=minute), pair)


# -- the decision ------------------------------------------------------------------------------


def test_it_places_a_surge_for_the_oldest_awake_replica_first():
    members = [old("b", minute=5), old("a", minute=1), old("s", "sleeping", minute=0)]
    assert next_step(members, since=SINCE, surge_id="", wanted=3).action == Action.SURGE
    assert next_step(members, since=SINCE, surge_id="", wanted=3).replica_ids == ("a",)


def test_it_waits_while_the_surge_loads_then_stops_the_replica_it_replaces():
    loading = [old("a"), old("b", minute=1), new("n", "loading")]
    assert next_step(loading, since=SINCE, surge_id="n", wanted=2) == Step(
        Action.WAIT, ("n",), "replacement n is loading"
    )
    serving = [old("a"), old("b", minute=1), new("n")]
    assert next_step(serving, since=SINCE, surge_id="n", wanted=2) == Step(
        Action.STOP, ("a",), "replacement n serves in its place"
    )


def test_a_surge_serving_for_a_replica_that_slept_meanwhile_stops_the_sleeper_not_a_second_surge():
    members = [old("a", "sleeping"), new("n")]
    assert next_step(members, since=SINCE, surge_id="n", wanted=1).replica_ids == ("a",)
    assert next_step(members, since=SINCE, surge_id="n", wanted=1).action == Action.STOP


def test_outdated_sleepers_are_parked_together_and_nothing_is_woken():
    members = [old("a", "sleeping"), old("b", "deep_sleeping", minute=1), new("n")]
    assert next_step(members, since=SINCE, surge_id="", wanted=3) == Step(
        Action.PARK, ("a", "b"), "asleep: its next wake loads a new replica"
    )


def test_it_waits_for_a_replica_on_its_way_and_for_a_replacement_the_reconcile_placed():
    assert next_step([old("a", "draining"), old("b")], since=SINCE, surge_id="", wanted=2).action == Action.WAIT
    assert next_step([old("a", "waking"), old("b")], since=SINCE, surge_id="", wanted=2).action == Action.WAIT
    assert next_step([old("a"), new("n", "pending")], since=SINCE, surge_id="", wanted=2).action == Action.WAIT


def test_after_a_stop_with_no_surge_it_places_the_replacement_before_the_next():
    # The stopped one is gone from the members (stopping): one short of the two wanted.
    assert next_step([old("b")], since=SINCE, surge_id="", wanted=2).action == Action.TOP_UP


def test_a_move_replaces_only_its_replicas_and_leaves_the_others_as_they_are():
    members = [old("a"), old("b", minute=1), old("s", "sleeping", minute=2)]
    only = {"b"}
    assert next_step(members, since=SINCE, surge_id="", wanted=3, only=only) == Step(
        Action.SURGE, ("b",), "replica b started before the restart"
    )
    serving = [*members, new("n")]
    assert next_step(serving, since=SINCE, surge_id="n", wanted=3, only=only).replica_ids == ("b",)
    moved = [old("a"), old("s", "sleeping", minute=2), new("n")]
    assert next_step(moved, since=SINCE, surge_id="", wanted=3, only=only).action == Action.DONE
    assert progress(members, SINCE, only).left == 1 and progress(members, SINCE).left == 3


def test_it_is_done_once_only_parked_and_new_replicas_are_left_and_counts_them():
    members = [old("p", "parked"), new("n"), new("m", "sleeping", minute=2)]
    assert next_step(members, since=SINCE, surge_id="", wanted=3).action == Action.DONE
    assert progress(members, SINCE).replaced == 2 and progress(members, SINCE).left == 0
    assert progress([old("a"), new("n", "loading")], SINCE) == progress([new("n"), old("a")], SINCE)


RESTING = st.sampled_from(["serving", "serving", "sleeping", "deep_sleeping", "parked"])


@settings(max_examples=150)
@given(states=st.lists(RESTING, min_size=1, max_size=6), room=st.booleans())
def test_a_restart_replaces_every_replica_and_never_leaves_fewer_serving_than_one_less(states, room):
    """The steps played out, each new replica serving once placed: the restart ends, with every
    replica started since (or parked), in a bounded number of steps; with room for a surge the
    serving count never drops below where it began, and without it by at most one."""
    members = [old(f"o{i}", state, minute=i) for i, state in enumerate(states)]
    wanted = len(members)
    serving_before = states.count("serving")
    surge, made = "", 0
    for _ in range(4 * wanted + 4):
        step = next_step(members, since=SINCE, surge_id=surge, wanted=wanted)
        if step.action == Action.DONE:
            break
        if step.action == Action.SURGE and room:
            made += 1
            surge = f"n{made}"
            members.append(new(surge, minute=made))
        elif step.action in (Action.SURGE, Action.STOP):
            # No room: the replica goes first (SURGE refused), or the surge serves in its place.
            members = [m for m in members if m.id != step.replica_ids[0]]
            surge = ""
        elif step.action == Action.PARK:
            members = [Member(m.id, "parked", m.created_at) if m.id in step.replica_ids else m for m in members]
        elif step.action == Action.TOP_UP:
            made += 1
            members.append(new(f"n{made}", minute=made))
        else:
            raise AssertionError(f"nothing on its way, yet it waits: {step}")
        serving = sum(1 for m in members if m.state == "serving")
        assert serving >= serving_before - (0 if room else 1), (step, members)
    else:
        raise AssertionError(f"not done after {4 * wanted + 4} steps: {members}")
    assert all(m.created_at >= SINCE or m.state == "parked" for m in members)
    assert sum(1 for m in members if m.created_at >= SINCE) == serving_before


# -- failover pairs: the decision -----------------------------------------------------------------


def test_a_pairs_outdated_standby_is_renewed_then_its_active_steps_down_to_the_new_one():
    pair = [old("a", pair=1), old("s", "standby", minute=1, pair=1)]
    assert next_pair_step(pair, since=SINCE) == Step(Action.STANDBY, ("a", "s"), "standby s started before the restart")
    renewing = [old("a", pair=1), new("n", "pending", pair=1)]
    assert next_pair_step(renewing, since=SINCE).action == Action.WAIT
    ready = [old("a", pair=1), new("n", "standby", pair=1)]
    assert next_pair_step(ready, since=SINCE) == Step(
        Action.SWITCHOVER, ("a",), "its new standby n stands by to take over from it"
    )
    stepping_down = [old("a", "draining", pair=1), new("n", "standby", pair=1)]
    assert next_pair_step(stepping_down, since=SINCE).action == Action.WAIT
    taken_over = [new("n", pair=1), new("m", "standby", minute=2, pair=1)]
    assert next_pair_step(taken_over, since=SINCE).action == Action.DONE


def test_pairs_are_restarted_one_at_a_time_oldest_first():
    first = [old("a", pair=1), old("s", "standby", minute=1, pair=1)]
    second = [old("b", minute=2, pair=2), old("t", "standby", minute=3, pair=2)]
    assert next_pair_step(second + first, since=SINCE).replica_ids == ("a", "s")
    # The first pair's new standby still loads: the second pair keeps its standby meanwhile.
    loading = [old("a", pair=1), new("n", "loading", pair=1), *second]
    assert next_pair_step(loading, since=SINCE).action == Action.WAIT
    first_done = [new("n", pair=1), new("m", "standby", minute=2, pair=1), *second]
    assert next_pair_step(first_done, since=SINCE).replica_ids == ("b", "t")


def test_a_pair_without_a_standby_gets_one_and_a_pair_serving_nothing_is_waited_for():
    assert next_pair_step([old("a", pair=1)], since=SINCE) == Step(Action.STANDBY, ("a",), "replica a has no standby")
    # Its active died and the standby has the lock but has not reported waking yet.
    assert next_pair_step([old("s", "standby", pair=1)], since=SINCE).action == Action.WAIT
    # The last switchover's active has exited and its new standby not yet taken over: not done.
    last = [new("n", "standby", pair=1), new("m", pair=2), new("k", "standby", minute=2, pair=2)]
    assert next_pair_step(last, since=SINCE).action == Action.WAIT


def test_a_pair_short_of_the_need_gets_a_new_pair_beside_it_and_goes_once_that_one_stands_by():
    pair = [old("a", pair=1), old("s", "standby", minute=1, pair=1)]
    assert next_pair_step(pair, since=SINCE, short={1}).action == Action.SURGE
    placed = [*pair, new("n", "pending", pair=2), new("m", "pending", minute=2, pair=2)]
    assert next_pair_step(placed, since=SINCE, surge_id="n", short={1}).action == Action.WAIT
    serving = [*pair, new("n", pair=2), new("m", "standby", minute=2, pair=2)]
    assert next_pair_step(serving, since=SINCE, surge_id="n", short={1}) == Step(
        Action.STOP, ("a",), "the new pair of n serves and stands by in its place"
    )
    # Its standby failed for good: one is started beside it before the old pair goes.
    alone = [*pair, new("n", pair=2)]
    assert next_pair_step(alone, since=SINCE, surge_id="n", short={1}).replica_ids == ("n",)
    assert next_pair_step(alone, since=SINCE, surge_id="n", short={1}).action == Action.STANDBY


def _settle(members: list[Member], made: int, primaries: set[str]) -> tuple[list[Member], int]:
    """The world moves one member on, as pair members' processes would: a member loading serves
    (a primary) or stands by; an active that stepped down exits; then its standby takes over, and
    a fresh standby starts."""
    moving = next((m for m in members if m.state in ("pending", "draining")), None)
    if moving is not None and moving.state == "pending":
        settled = "serving" if moving.id in primaries else "standby"
        return [Member(m.id, settled, m.created_at, m.pair) if m is moving else m for m in members], made
    if moving is not None:
        return [m for m in members if m is not moving], made
    heir = next(m for m in members if not any(o.pair == m.pair and o.state == "serving" for o in members))
    made += 1
    rest = [Member(m.id, "serving", m.created_at, m.pair) if m is heir else m for m in members]
    return [*rest, new(f"n{made}", "pending", minute=made, pair=heir.pair)], made


@settings(max_examples=100)
@given(pairs=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=4))
def test_a_restart_of_pairs_replaces_every_member_and_never_leaves_a_pair_without_one_that_serves(pairs):
    """The steps played out against members that do as they are told, each pair with or without
    a standby, and fitting its reservation or short of the need (a new pair goes beside it): the
    restart ends with every member new and as many pairs, each whole; it acts only while every
    pair has a member serving (none while a takeover is under way), and one pair at most is
    without a standby."""
    members, short = [], set()
    for pair, (has_standby, is_short) in enumerate(pairs):
        members.append(old(f"a{pair}", minute=2 * pair, pair=pair))
        if has_standby:
            members.append(old(f"s{pair}", "standby", minute=2 * pair + 1, pair=pair))
        if is_short:
            short.add(pair)
    made, surge, primaries, next_pair = 0, "", set(), len(pairs)
    for _ in range(10 * len(pairs) + 4):
        step = next_pair_step(members, since=SINCE, surge_id=surge, short=short)
        if step.action == Action.DONE:
            break
        keys = {m.pair for m in members}
        if step.action != Action.WAIT:
            assert all(any(m.state == "serving" for m in members if m.pair == k) for k in keys), (step, members)
        if step.action == Action.STANDBY:
            made += 1
            pair = next(m.pair for m in members if m.id == step.replica_ids[0])
            members = [m for m in members if m.id not in step.replica_ids[1:]]
            members.append(new(f"n{made}", "pending", minute=made, pair=pair))
        elif step.action == Action.SWITCHOVER:
            members = [
                Member(m.id, "draining", m.created_at, m.pair) if m.id in step.replica_ids else m for m in members
            ]
        elif step.action == Action.SURGE:
            made += 2
            surge = f"n{made - 1}"
            primaries.add(surge)
            members += [new(surge, "pending", minute=made, pair=next_pair), new(f"n{made}", "pending", pair=next_pair)]
            next_pair += 1
        elif step.action == Action.STOP:
            gone = next(m.pair for m in members if m.id == step.replica_ids[0])
            assert gone in short and surge, step
            members, surge = [m for m in members if m.pair != gone], ""
        else:
            assert step.action == Action.WAIT, step
            members, made = _settle(members, made, primaries)
        without = [k for k in keys if not any(m.state == "standby" for m in members if m.pair == k)]
        assert len(without) <= 1 + sum(1 for has_standby, _ in pairs if not has_standby), (step, members)
    else:
        raise AssertionError(f"not done after {10 * len(pairs) + 4} steps: {members}")
    assert all(m.created_at >= SINCE for m in members)
    assert len({m.pair for m in members}) == len(pairs)
    for key in {m.pair for m in members}:
        assert sorted(m.state for m in members if m.pair == key) == ["serving", "standby"]


# -- the service, through the API ----------------------------------------------------------------


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    return lambda: django_capture_on_commit_callbacks(execute=True)


def live(name: str) -> dict[str, str]:
    """The deployment's replicas that have not ended, oldest first: id → state."""
    rows = Replica.objects.filter(deployment__name=name).exclude(state__in=["stopped", "failed"])
    return dict(rows.order_by("created_at").values_list("id", "state"))


def step(on_commit, name: str) -> Step | None:
    """One step of the restart, its dispatches run."""
    with on_commit():
        return rollouts.step(name)


def test_a_restart_replaces_each_awake_replica_once_its_replacement_serves_and_keeps_the_count(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    assert api("post", "/api/deployments/", body("r", tiny_model_dir, replicas=2)).status_code == 201
    first, second = live("r")
    serve(first), serve(second)

    answer = api("post", "/api/deployments/r/restart/")
    assert answer.status_code == 202, answer.json()
    shaped("Deployment", answer.json())
    assert answer.json()["rollout"]["left"] == 2 and answer.json()["rollout"]["replaced"] == 1
    # Its first step placed a surge beside the two: three replicas, two wanted.
    surge = [r for r in live("r") if r not in (first, second)]
    assert len(surge) == 1 and live("r")[surge[0]] == "pending"
    assert Deployment.objects.get(name="r").replicas_wanted == 2
    assert DeploymentObserved.objects.get(deployment__name="r").restart_surge == surge[0]

    assert step(on_commit, "r").action == Action.WAIT, "the surge has not served yet"
    assert live("r")[first] == "serving"
    serve(surge[0])
    dispatched.clear()
    assert step(on_commit, "r").action == Action.STOP
    assert live("r")[first] == "stopping" and reserved(first) == 0
    assert [(t, a[0]) for _, t, a in dispatched if t == STOP] == [(STOP, first)]

    assert step(on_commit, "r").action == Action.SURGE
    (surge2,) = [r for r in live("r") if r not in (first, second, surge[0])]
    # Its serving report asks the control worker for the next step at once, not at the next sweep.
    dispatched.clear()
    with on_commit():
        serve(surge2)
    assert ("control", "scheduling.tasks.advance_restarts", []) in [(q, t, list(a)) for q, t, a in dispatched]
    # One advance takes the steps that need no waiting: the stop, then the end.
    with on_commit():
        assert rollouts.advance("r").action == Action.DONE
    assert live("r")[second] == "stopping"
    assert step(on_commit, "r") is None, "none under way any more"

    shown = api("get", "/api/deployments/r/").json()
    assert shown["rollout"] is None
    assert sorted(r["id"] for r in shown["replicas"] if r["state"] == "serving") == sorted([surge[0], surge2])
    reasons = list(Event.objects.filter(deployment="r", kind="deployment.changed").values_list("reason", flat=True))
    assert any(r.startswith("rolling restart asked by ops: 2 replica(s) to replace") for r in reasons), reasons
    assert "rolling restart done: 2 replica(s) started since it was asked for" in reasons
    assert Event.objects.filter(replica=first, reason__contains="rolling restart: replacement").exists()
    assert invariant_holds()


def test_with_no_room_for_a_surge_the_oldest_goes_first_and_its_replacement_is_placed_in_its_room(
    cluster, api, tiny_model_dir, on_commit
):
    # Four replicas of 900 MiB fill the four 1 GiB GPUs: no room for a fifth beside them.
    big = body("full", tiny_model_dir, replicas=4, memory={"override_bytes": 900 * MiB, "max_tokens": 256})
    assert api("post", "/api/deployments/", big).status_code == 201
    ids = list(live("full"))
    for replica_id in ids:
        serve(replica_id)

    # Its first steps: no surge fits, so the oldest went first, and its replacement was placed in
    # the room it left; then it waits for that one to serve.
    assert api("post", "/api/deployments/full/restart/").status_code == 202
    assert live("full")[ids[0]] == "stopping"
    assert Event.objects.filter(replica=ids[0], reason__contains="no room for its replacement beside it").exists()
    (replacement,) = [r for r in live("full") if r not in ids]
    assert live("full")[replacement] == "pending" and len(live("full")) == 5
    assert invariant_holds()
    assert step(on_commit, "full").action == Action.WAIT
    serve(replacement)
    assert step(on_commit, "full").action == Action.STOP  # the next one goes first too
    assert step(on_commit, "full").action == Action.TOP_UP
    assert invariant_holds()


def test_a_deployment_short_of_replicas_with_no_room_for_them_ends_its_restart_saying_so(
    cluster, api, tiny_model_dir, on_commit
):
    big = body("short", tiny_model_dir, replicas=4, memory={"override_bytes": 900 * MiB, "max_tokens": 256})
    assert api("post", "/api/deployments/", big).status_code == 201
    for replica_id in live("short"):
        serve(replica_id)
    Deployment.objects.filter(name="short").update(replicas_wanted=5)  # more than the four GPUs hold

    assert api("post", "/api/deployments/short/restart/").status_code == 202

    assert DeploymentObserved.objects.get(deployment__name="short").restart_since is None
    assert set(live("short").values()) == {"serving"} and len(live("short")) == 4, "nothing stopped"
    assert Event.objects.filter(
        deployment="short", reason__startswith="rolling restart stopped: no room to place what the deployment lacks"
    ).exists()
    assert invariant_holds()


def test_sleepers_are_parked_not_woken_and_the_next_wake_loads_a_new_replica(cluster, api, tiny_model_dir, on_commit):
    assert api("post", "/api/deployments/", body("s", tiny_model_dir)).status_code == 201
    (sleeper,) = live("s")
    serve(sleeper)
    sleep.sleep_replica(sleeper, reason="idle")
    reports.report(sleeper, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})

    assert api("post", "/api/deployments/s/restart/").status_code == 202
    parked = Replica.objects.get(pk=sleeper)
    assert parked.state == "parked" and parked.node is None and reserved(sleeper) == 0
    assert Event.objects.filter(replica=sleeper, reason__contains="parked by a rolling restart").exists()
    assert live("s") == {sleeper: "parked"}, "nothing woken by the restart"
    assert DeploymentObserved.objects.get(deployment__name="s").restart_since is None, "done in the same call"
    assert step(on_commit, "s") is None

    with on_commit():
        woken = sleep.wake_deployment("s", reason="woken by a request")
    assert len(woken) == 1 and woken[0] != sleeper
    assert Replica.objects.get(pk=sleeper).state == "stopped"


def test_a_replacement_that_fails_to_load_leaves_the_old_replica_serving_and_a_failed_deployment_ends_it(
    cluster, api, tiny_model_dir, on_commit
):
    crashy = body("c", tiny_model_dir, restart={"max_load_failures": 1})
    assert api("post", "/api/deployments/", crashy).status_code == 201
    (old_one,) = live("c")
    serve(old_one)
    assert api("post", "/api/deployments/c/restart/").status_code == 202
    (surge,) = [r for r in live("c") if r != old_one]
    reports.report(surge, {"event": "failed", "kind": "load", "reason": "a broken checkpoint"})

    assert step(on_commit, "c") is not None
    assert live("c") == {old_one: "serving"}
    assert api("get", "/api/deployments/c/").json()["rollout"] is None
    assert Event.objects.filter(
        deployment="c", reason__startswith="rolling restart stopped: its replacements failed to load"
    ).exists()


def pair_of(name: str) -> tuple[Replica, Replica]:
    """(active, standby) of the deployment's only pair: the members that serve and stand by, or
    were placed as such."""
    rows = Replica.objects.select_related("node").filter(deployment__name=name).exclude(state__in=["stopped", "failed"])
    by_role = {r.role: r for r in rows if r.state != "stopping"}
    return by_role["primary"], by_role["standby"]


def holders() -> dict[str, int]:
    return dict(Occupant.objects.values_list("replica_id", "reserved_bytes"))


PAIR_BYTES = 300 * MiB  # what `body`'s override reserves for one pair


@pytest.fixture
def ready_pair(cluster, api, report, tiny_model_dir) -> tuple[Replica, Replica]:
    """A failover deployment `pair` whose primary serves at epoch 1 and whose standby stands by."""
    assert api("post", "/api/deployments/", body("pair", tiny_model_dir, failover={"standby": True})).status_code == 201
    active, standby = pair_of("pair")
    stands_by(report, standby)
    serves_at(report, active)
    return active, standby


def test_a_failover_pair_is_restarted_through_a_new_standby_and_a_switchover_keeping_one_reservation(
    ready_pair, api, report, dispatched, on_commit
):
    active, standby = ready_pair
    dispatched.clear()

    answer = api("post", "/api/deployments/pair/restart/")

    assert answer.status_code == 202, answer.json()
    # Shown after its first step: the old standby stopping, its replacement placed.
    assert (answer.json()["rollout"]["left"], answer.json()["rollout"]["replaced"]) == (1, 1)
    # Its first step: the old standby stopped alone (the pair's lock stays open: no "close pair"),
    # and a new one started beside the active, which serves throughout.
    _, renewed = pair_of("pair")
    assert renewed.id != standby.id and renewed.state == "pending" and renewed.lease_id == active.lease_id
    assert Replica.objects.get(pk=standby.id).state == "stopping"
    assert [(t, a) for _, t, a in dispatched if t in (START, STOP)] == [(STOP, [standby.id]), (START, [renewed.id, []])]
    assert FailoverLease.objects.get(pk=active.lease_id).closed_at is None
    assert holders() == {active.id: PAIR_BYTES}, "a standby holds none of the pair's reservation"
    report(standby, "stopped")
    assert step(on_commit, "pair").action == Action.WAIT, "the new standby has not stood by yet"

    # Its standing by asks for the next step at once: the active steps down to it.
    dispatched.clear()
    stands_by(report, renewed)
    assert ("control", "scheduling.tasks.advance_restarts", []) in [(q, t, list(a)) for q, t, a in dispatched]
    assert step(on_commit, "pair").action == Action.SWITCHOVER
    assert Replica.objects.get(pk=active.id).state == "draining"
    assert Event.objects.filter(
        kind=Event.Kind.FAILOVER_SWITCHOVER, replica=active.id, reason__startswith="rolling restart"
    ).exists()
    assert holders() == {active.id: PAIR_BYTES}, "the active keeps the reservation while it drains"

    report(active, "stopped")
    takes_over(report, renewed, epoch=2, previous=active)
    heir, fresh_standby = pair_of("pair")
    assert heir.id == renewed.id and heir.state == "serving" and fresh_standby.state == "pending"
    assert holders() == {renewed.id: PAIR_BYTES}
    assert step(on_commit, "pair").action == Action.WAIT
    stands_by(report, fresh_standby)
    assert step(on_commit, "pair").action == Action.DONE

    assert api("get", "/api/deployments/pair/").json()["rollout"] is None
    assert "rolling restart done: 2 replica(s) started since it was asked for" in Event.objects.filter(
        deployment="pair", kind="deployment.changed"
    ).values_list("reason", flat=True)
    assert live("pair") == {renewed.id: "serving", fresh_standby.id: "standby"}
    assert invariant_holds()


def test_a_pair_restart_ends_saying_so_when_its_new_standbys_keep_failing(ready_pair, api, report, on_commit, settings):
    settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR = 0
    active, standby = ready_pair
    assert api("post", "/api/deployments/pair/restart/").status_code == 202
    report(standby, "stopped")
    _, renewed = pair_of("pair")
    report(renewed, "failed", kind="load", reason="out of host memory")

    assert step(on_commit, "pair").action == Action.DONE
    assert DeploymentObserved.objects.get(deployment__name="pair").restart_since is None
    assert Event.objects.filter(
        deployment="pair", reason__startswith="rolling restart stopped: 1 standbys of replica"
    ).exists()
    assert live("pair") == {active.id: "serving"}, "the active serves on"


def test_a_pair_whose_reservation_no_longer_fits_the_need_is_replaced_by_a_new_pair_beside_it(
    ready_pair, api, report, dispatched, on_commit
):
    active, standby = ready_pair
    # A larger need than the pair was placed with: a new standby would wake into too little.
    assert api("patch", "/api/deployments/pair/", {"memory": {"override_bytes": 400 * MiB}}).status_code == 200

    assert api("post", "/api/deployments/pair/restart/").status_code == 202

    # Its first step: a whole new pair of the new size beside the old one, which serves on.
    new_pair = [r for r in Replica.objects.filter(deployment__name="pair").exclude(pk__in=[active.id, standby.id])]
    new_active = next(r for r in new_pair if r.role == "primary")
    new_standby = next(r for r in new_pair if r.role == "standby")
    assert new_active.lease_id == new_standby.lease_id != active.lease_id
    assert reserved(new_active.id) == 400 * MiB and reserved(active.id) == 300 * MiB
    assert live("pair")[active.id] == "serving" and live("pair")[standby.id] == "standby"
    assert DeploymentObserved.objects.get(deployment__name="pair").restart_surge == new_active.id

    serves_at(report, new_active)
    assert step(on_commit, "pair").action == Action.WAIT, "its new pair's standby loads"
    dispatched.clear()
    stands_by(report, new_standby)
    assert step(on_commit, "pair").action == Action.STOP
    # The old pair stops whole: its lock closed, so its standby does not take over.
    assert live("pair")[active.id] == "stopping" and live("pair")[standby.id] == "stopping"
    assert FailoverLease.objects.get(pk=active.lease_id).closed_at is not None
    assert {a[0] for _, t, a in dispatched if t == STOP} == {active.id, standby.id}
    assert reserved(active.id) == 0 and reserved(new_active.id) == 400 * MiB
    assert step(on_commit, "pair").action == Action.DONE
    assert invariant_holds()


def test_a_drain_that_moves_a_failover_pair_places_a_new_pair_elsewhere_and_stops_the_old_one_whole(
    ready_pair, api, report, dispatched, on_commit
):
    active, standby = ready_pair
    there = active.node.name

    answer = api("post", f"/api/nodes/{there}/drain/", {"move": True})

    assert answer.status_code == 200, answer.json()
    # Its first step: a whole new pair on another node; the old one serves and stands by meanwhile.
    new_pair = list(Replica.objects.filter(deployment__name="pair").exclude(pk__in=[active.id, standby.id]))
    new_active = next(r for r in new_pair if r.role == "primary")
    new_standby = next(r for r in new_pair if r.role == "standby")
    assert {r.node.name for r in new_pair} != {there} and new_active.node_id == new_standby.node_id
    assert live("pair")[active.id] == "serving" and live("pair")[standby.id] == "standby"
    observed = DeploymentObserved.objects.get(deployment__name="pair")
    assert sorted(observed.restart_only.split()) == sorted([active.id, standby.id]), "the pair moves whole"
    assert not Event.objects.filter(reason__contains="keeps serving there").exists()

    serves_at(report, new_active)
    stands_by(report, new_standby)
    assert step(on_commit, "pair").action == Action.STOP
    assert live("pair")[active.id] == "stopping" and live("pair")[standby.id] == "stopping"
    assert step(on_commit, "pair").action == Action.DONE
    assert DeploymentObserved.objects.get(deployment__name="pair").restart_only == ""
    assert invariant_holds()


def test_a_pair_with_no_room_for_a_new_pair_beside_it_is_left_serving_with_its_standby(ready_pair, api, on_commit):
    active, standby = ready_pair
    # More than any node's two 1 GiB GPUs hold together: no new pair fits anywhere.
    assert api("patch", "/api/deployments/pair/", {"memory": {"override_bytes": 3 * 1024 * MiB}}).status_code == 200

    assert api("post", "/api/deployments/pair/restart/").status_code == 202

    assert DeploymentObserved.objects.get(deployment__name="pair").restart_since is None
    assert live("pair") == {active.id: "serving", standby.id: "standby"}, "nothing of the pair touched"
    [stopped] = Event.objects.filter(deployment="pair", reason__startswith="rolling restart stopped")
    assert f"no room for a new pair beside the pair of {active.id[:8]}" in stopped.reason, stopped.reason
    assert stopped.after == {"rollout": "stopped"}
    assert invariant_holds()


def test_a_restart_is_refused_naming_why_and_changes_nothing(cluster, api, client, tiny_model_dir, on_commit):
    assert api("post", "/api/deployments/", body("a", tiny_model_dir)).status_code == 201
    (replica_id,) = live("a")
    serve(replica_id)
    assert api("post", "/api/deployments/a/restart/").status_code == 202
    again = api("post", "/api/deployments/a/restart/")
    assert again.status_code == 409 and "a rolling restart of a is under way" in again.json()["detail"]

    assert api("post", "/api/deployments/", body("none", tiny_model_dir, replicas=0)).status_code == 201
    empty = api("post", "/api/deployments/none/restart/")
    assert empty.status_code == 409 and "has no replica to restart" in empty.json()["detail"]
    assert DeploymentObserved.objects.get(deployment__name="none").restart_since is None

    missing = api("post", "/api/deployments/nope/restart/")
    assert missing.status_code == 404
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_user("viewer"))
    assert client.post("/api/deployments/a/restart/").status_code == 403


def test_the_sweep_is_scheduled_every_5_s_on_the_control_queue_and_runs_as_a_task(beat_schedules):
    from django_celery_beat.models import PeriodicTask

    from scheduling import tasks

    schedule = PeriodicTask.objects.get(name="advance rolling restarts")
    assert schedule.task == tasks.advance_restarts.name == "scheduling.tasks.advance_restarts" and schedule.enabled
    assert (schedule.interval.every, schedule.interval.period, schedule.queue) == (5, "seconds", "control")
    assert tasks.advance_restarts() == {}


def test_the_admin_restarts_the_selected_deployments_and_names_one_it_cannot(
    cluster, api, admin_client, tiny_model_dir, on_commit
):
    from django.contrib.messages import get_messages

    assert api("post", "/api/deployments/", body("a", tiny_model_dir)).status_code == 201
    (replica_id,) = live("a")
    serve(replica_id)
    assert api("post", "/api/deployments/", body("idle", tiny_model_dir, replicas=0)).status_code == 201
    selected = list(Deployment.objects.order_by("name").values_list("pk", flat=True))

    with on_commit():
        done = admin_client.post(
            "/admin/scheduling/deployment/", {"_selected_action": selected, "action": "restart_deployments"}
        )

    assert done.status_code == 302, done.content.decode()[-3000:]
    said = [str(m) for m in get_messages(done.wsgi_request)]
    assert "a: rolling restart under way; the dashboard and the events show each step" in said
    assert any(m.startswith("idle: deployment idle has no replica to restart") for m in said), said
    assert len(live("a")) == 2, "its surge placed beside it"


@pytest.mark.django_db(transaction=True)
def test_the_command_line_says_a_restart_that_stopped_short_and_why(cluster, live_server, capsys, dispatched):
    from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
    from tests.support.cli import staff_cli

    # Four replicas fill the four 1 GiB GPUs, and the deployment wants a fifth: no room for it.
    spec = DeploymentSpec(name="short", source="/srv/models/tiny", replicas=4, override_bytes=900 * MiB, max_tokens=256)
    create(spec, facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB))
    for replica_id in live("short"):
        serve(replica_id)
    Deployment.objects.filter(name="short").update(replicas_wanted=5)

    code, _, err = staff_cli(live_server, capsys, "restart", "short")("--timeout", "30")

    assert code == 1
    assert err.splitlines()[-1].startswith(
        "error: short: rolling restart stopped: no room to place what the deployment lacks of its 5 replica(s)"
    ), err
    assert Event.objects.filter(deployment="short", after__rollout="stopped").exists()
    assert set(live("short").values()) == {"serving"}, "nothing stopped"
