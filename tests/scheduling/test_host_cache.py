"""Host memory is scheduled like a GPU's: a node's host cache has a budget; a sleep
that passes it drops the arenas awake replicas keep, then parks the least valuable sleepers (their
processes stop, their weights are freed, they stay wanted), and the next wake loads a parked
replica from disk. Room the budget has spare is lent to serving replicas as kept arenas, counted
in the books from the grant."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuportal.wire.requestqueue import last_key
from gpuportal.wire.states import ASLEEP, AWAKE, IN_HOST_CACHE
from inference.devices import virtual_gpus
from scheduling.core.host_cache import HostHolder, grants, holds, trim, used_bytes
from scheduling.models import Deployment, DeploymentObserved, Event, Node, Replica
from scheduling.services import deployments, host_cache, queueing, reports, sleep
from scheduling.services.nodes import register_node
from tests.support.deployments import START, STOP, deploy, invariant_holds, serve
from tests.support.factories import NO_OVERHEAD
from tests.support.lock_waits import waiting
from tests.support.processes import wait_until

MiB = 1024**2
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def holder(name: str, state: str = "sleeping", mib: int = 100, idle_s: float = 0, **kw) -> HostHolder:
    return HostHolder(name, f"dep-{name}", state, mib * MiB, NOW - timedelta(seconds=idle_s), **kw)


# -- the choice, pure -------------------------------------------------------------------------------


def test_the_longest_unused_sleeper_leaves_first_and_only_as_many_as_the_budget_needs():
    held = [holder("recent", idle_s=10), holder("oldest", idle_s=900), holder("older", idle_s=300)]

    assert trim(held, budget_bytes=250 * MiB).park == ("oldest",)
    assert trim(held, budget_bytes=150 * MiB).park == ("oldest", "older")
    assert trim(held, budget_bytes=300 * MiB).park == ()


def test_a_popular_sleeper_leaves_after_the_others_and_a_standby_or_a_draining_one_never():
    held = [
        holder("popular", idle_s=900, popular=True),
        holder("plain", idle_s=10),
        holder("standby", state="standby", idle_s=5000),
        holder("draining", state="draining", idle_s=5000),
    ]

    decided = trim(held, budget_bytes=150 * MiB)

    assert decided.park == ("plain", "popular") and decided.over_bytes == 50 * MiB


def test_a_kept_arena_is_dropped_before_any_sleeper_leaves_the_most_recently_used_replicas_first():
    held = [
        holder("sleeper", idle_s=5000),
        holder("keeps-idle", state="serving", idle_s=600, kept_arena=True),
        holder("keeps-busy", state="serving", idle_s=1, kept_arena=True),
    ]

    decided = trim(held, budget_bytes=200 * MiB)
    assert decided.drop == ("keeps-busy",) and decided.park == ()
    decided = trim(held, budget_bytes=50 * MiB)
    assert decided.drop == ("keeps-busy", "keeps-idle") and decided.park == ("sleeper",)


def test_an_arena_is_kept_only_in_awake_states_where_a_sleepers_weights_are_counted_once():
    kept = holder("k", state="serving", kept_arena=True)

    assert holds(kept) and holds(holder("s")) and not holds(holder("asleep-now", state="sleeping", kept_arena=True))
    assert used_bytes([kept, holder("s"), holder("x", state="serving")]) == 200 * MiB


def test_room_spare_is_lent_to_the_replicas_likeliest_to_sleep_first_and_never_past_the_budget():
    held = [holder("sleeper")]
    candidates = [
        holder("busy", state="serving", idle_s=1, kept_arena=True),
        holder("idle", state="serving", idle_s=900, kept_arena=True),
        holder("popular", state="serving", idle_s=5000, popular=True, kept_arena=True),
        holder("huge", state="serving", idle_s=9000, mib=1000, kept_arena=True),
    ]

    # 250 MiB of budget, 100 held: room for one arena of 100 MiB; `huge` would not fit at all.
    assert grants(held, candidates, 250 * MiB) == ("idle",)
    assert grants(held, candidates, 400 * MiB) == ("idle", "busy", "popular")
    assert grants(held, candidates, 90 * MiB) == ()


holders_drawn = st.lists(
    st.builds(
        HostHolder,
        replica_id=st.uuids().map(str),
        deployment=st.sampled_from(["a", "b", "c"]),
        state=st.sampled_from(sorted(IN_HOST_CACHE | AWAKE)),
        host_bytes=st.integers(0, 10_000),
        last_accessed=st.none() | st.datetimes(timezones=st.just(UTC)),
        popular=st.booleans(),
        kept_arena=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda h: h.replica_id,
)


@given(held=holders_drawn, budget=st.integers(0, 40_000))
def test_after_a_trim_the_host_fits_its_budget_unless_only_what_may_not_leave_is_left(held, budget):
    decided = trim(held, budget)
    gone = set(decided.park) | set(decided.drop)
    left = [h for h in held if h.replica_id not in gone]

    assert all(h.state in ASLEEP and not h.kept_arena for h in held if h.replica_id in decided.park)
    assert all(h.kept_arena and holds(h) for h in held if h.replica_id in decided.drop)
    assert used_bytes(left) - budget == decided.over_bytes or (decided.over_bytes == 0 and used_bytes(left) <= budget)
    if decided.over_bytes:
        assert not [h for h in left if h.state in ASLEEP and not h.kept_arena], "a sleeper that could leave stayed"
        assert not [h for h in left if h.kept_arena and holds(h)], "a kept arena that could go stayed"
    if decided.park:  # no sleeper parked while an arena was kept, and no more than needed
        assert not [h for h in left if h.kept_arena and holds(h)]
        last = next(h for h in held if h.replica_id == decided.park[-1])
        assert used_bytes(left) + last.host_bytes > budget
    elif decided.drop:
        last = next(h for h in held if h.replica_id == decided.drop[-1])
        assert used_bytes(left) + last.host_bytes > budget


@given(held=holders_drawn, candidates=holders_drawn, budget=st.integers(0, 40_000))
def test_what_is_lent_never_takes_the_host_past_its_budget(held, candidates, budget):
    candidates = [
        HostHolder(f"new-{c.replica_id}", c.deployment, "serving", c.host_bytes, c.last_accessed, c.popular, True)
        for c in candidates
    ]
    lent = set(grants(held, candidates, budget))

    after = used_bytes([*held, *(c for c in candidates if c.replica_id in lent)])
    assert after <= max(budget, used_bytes(held))
    assert not lent or after <= budget
    # Nothing lent is taken back by the next trim: a balance run twice changes nothing the second time.
    again = trim([*held, *(c for c in candidates if c.replica_id in lent)], budget)
    assert not lent or (again.drop, again.park) == ((), ())


# -- applied ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_host(db) -> Node:
    """One node of two 1 GiB GPUs whose host cache holds 250 MiB of sleeping weights."""
    return register_node("edge", virtual_gpus("edge", "2x1GiB", NO_OVERHEAD), virtual=True, cpu_cache_bytes=250 * MiB)


def asleep(name: str, *, idle_s: float) -> str:
    """A deployment with 100 MiB of weights whose one replica served, then slept."""
    replica_id = deploy(name)
    DeploymentObserved.objects.filter(deployment__name=name).update(weight_bytes=100 * MiB)
    Replica.objects.filter(pk=replica_id).update(last_accessed=NOW - timedelta(seconds=idle_s))
    sleep.sleep_replica(replica_id, reason="idle")
    reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    return replica_id


def test_a_sleep_past_the_budget_parks_the_longest_unused_sleeper_and_its_next_wake_loads_it_from_disk(
    small_host, dispatched, django_capture_on_commit_callbacks
):
    oldest = asleep("a", idle_s=900)
    asleep("b", idle_s=300)
    with django_capture_on_commit_callbacks(execute=True):
        newest = asleep("c", idle_s=10)
    # Each sleep asked the control worker to trim the node's host cache once it was committed.
    assert ("control", "scheduling.tasks.trim_host_cache", ["edge"]) in dispatched

    with django_capture_on_commit_callbacks(execute=True):
        assert host_cache.trim("edge") == [oldest]

    parked = Replica.objects.get(pk=oldest)
    assert parked.state == "parked" and parked.node is None and not parked.occupancies.exists()
    assert ("node.edge", STOP, [oldest]) in [(q, t, a[:1]) for q, t, a in dispatched]
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 200 * MiB}
    assert Event.objects.filter(kind="host_cache", replica=oldest, reason__contains="left the host cache").exists()
    assert invariant_holds()
    assert Replica.objects.get(pk=newest).state == "sleeping"
    # Its process's end, when it comes, leaves it parked: it is still wanted.
    reports.report(oldest, {"event": "stopped"})
    assert Replica.objects.get(pk=oldest).state == "parked"
    # Still wanted, so no reconcile loads it again now...
    assert deployments.reconcile_all("test") == {}
    # ...but the next wake does, from disk: a new replica placed, and the parked one retired.
    dispatched.clear()
    with django_capture_on_commit_callbacks(execute=True):
        woken = sleep.wake_deployment("a", reason="woken by a request")
    assert len(woken) == 1 and woken[0] != oldest
    assert [t for _, t, _ in dispatched] == [START]
    assert Replica.objects.get(pk=oldest).state == "stopped"
    assert sleep.awake_count(Deployment.objects.get(name="a")) == 1


def test_a_sleeper_whose_process_exits_unasked_is_parked_and_its_deployment_stays_asleep(small_host, dispatched):
    # What `up` stopped and started again does to a sleeping deployment: its agent stops its
    # replicas' processes. It was asleep before and is asleep after; a request wakes it.
    sleeper = asleep("a", idle_s=10)
    reports.report(sleeper, {"event": "stopped"})

    parked = Replica.objects.get(pk=sleeper)
    assert parked.state == "parked" and parked.node is None and not parked.occupancies.exists()
    assert Event.objects.filter(replica=sleeper, reason__contains="stays asleep").exists()
    assert deployments.reconcile_all("test") == {}
    assert sleep.awake_count(Deployment.objects.get(name="a")) == 0
    assert ("control", "scheduling.tasks.reconcile") not in [(q, t) for q, t, _ in dispatched]
    assert invariant_holds()


def test_among_sleepers_no_request_reached_the_one_made_first_leaves_first(small_host):
    age_min = {"first": 3, "second": 2, "third": 1}
    made = {}
    # Rows written newest first, so that neither the rows' order nor the sleeps' says who is oldest.
    for name in ["third", "second", "first"]:
        made[name] = deploy(name)
        DeploymentObserved.objects.filter(deployment__name=name).update(weight_bytes=100 * MiB)
        Replica.objects.filter(pk=made[name]).update(
            last_accessed=None, created_at=NOW - timedelta(minutes=age_min[name])
        )
        sleep.sleep_replica(made[name], reason="idle")
        reports.report(made[name], {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})

    # Counted as last used when it was made (the rows' own order is whatever PostgreSQL reads).
    held = {h.deployment: h.last_accessed for h in host_cache.holders([small_host.pk])[small_host.pk]}
    assert held == {name: NOW - timedelta(minutes=age) for name, age in age_min.items()}
    assert host_cache.trim("edge") == [made["first"]]


def test_a_sleeper_whose_last_request_only_redis_has_seen_stays_before_one_unused_for_longer(small_host):
    # The rows say `recent` was idle longest: its last request came after the beat last copied
    # the times into PostgreSQL, and it went to sleep before the next copy.
    recent = asleep("recent", idle_s=900)
    older = asleep("older", idle_s=300)
    asleep("newest", idle_s=10)
    queueing.queue().redis.set(last_key(recent), (NOW - timedelta(seconds=5)).timestamp())

    assert host_cache.trim("edge") == [older]


def test_the_node_api_and_metrics_show_the_host_cache_budget_and_use(small_host, staff, dispatched, client):
    asleep("a", idle_s=10)

    (node,) = staff.get("/api/nodes/").json()["results"]

    assert node["host_cache_budget_bytes"] == 250 * MiB and node["host_cache_used_bytes"] == 100 * MiB
    assert node["host_cache_kept_bytes"] == 0  # a sleeper's weights, no arena kept by an awake replica
    assert node["host_ram_bytes"] == 0  # a node registered without saying, as an agent of the version before
    scraped = {
        (sample.name, sample.labels.get("node")): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
        for sample in family.samples
    }
    assert scraped[("gpuportal_host_cache_budget_bytes", "edge")] == 250 * MiB
    assert scraped[("gpuportal_host_cache_used_bytes", "edge")] == 100 * MiB


def test_the_dashboard_shows_each_nodes_host_cache_use_and_budget(small_host, admin_client, dispatched):
    from django.urls import reverse

    asleep("a", idle_s=10)

    body = admin_client.get(reverse("admin:scheduling_dashboard_fragment")).content.decode()

    assert '<small class="gp-host-cache">host cache 100.00 MiB of 250.00 MiB</small>' in body
    # An arena lent to a serving replica shows as such.
    keeper = deploy("b")
    DeploymentObserved.objects.filter(deployment__name="b").update(weight_bytes=50 * MiB)
    assert host_cache.grant("edge") == [keeper]
    body = admin_client.get(reverse("admin:scheduling_dashboard_fragment")).content.decode()
    assert "host cache 150.00 MiB of 250.00 MiB (50.00 MiB kept for sleeps)</small>" in body


def kept_arena_commands(dispatched) -> list[list]:
    return [args for _, task, args in dispatched if task == "inference.tasks.replica_arena"]


def test_a_serving_replica_is_lent_an_arena_from_spare_room_counted_from_the_grant(
    small_host, staff, client, dispatched, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        serving = deploy("a")
    # Coming to serve asked the control worker to balance the node's host cache.
    assert ("control", "scheduling.tasks.trim_host_cache", ["edge"]) in dispatched
    DeploymentObserved.objects.filter(deployment__name="a").update(weight_bytes=100 * MiB)

    with django_capture_on_commit_callbacks(execute=True):
        assert host_cache.balance("edge") == {"parked": [], "granted": [serving]}

    assert Replica.objects.get(pk=serving).arena_kept_bytes == 100 * MiB
    assert kept_arena_commands(dispatched) == [[serving, True]]
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 100 * MiB}
    (node,) = staff.get("/api/nodes/").json()["results"]
    assert node["host_cache_used_bytes"] == node["host_cache_kept_bytes"] == 100 * MiB
    assert staff.get(f"/api/replicas/{serving}/").json()["arena_kept_bytes"] == 100 * MiB
    scraped = {
        (sample.name, sample.labels.get("node")): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
        for sample in family.samples
    }
    assert scraped[("gpuportal_host_cache_used_bytes", "edge")] == 100 * MiB
    assert scraped[("gpuportal_host_cache_kept_bytes", "edge")] == 100 * MiB
    assert Event.objects.filter(kind="host_cache", replica=serving, reason__contains="keeps a 100 MiB arena").exists()
    # Balanced again, nothing changes: it keeps what it has.
    assert host_cache.balance("edge") == {"parked": [], "granted": []}
    # Its own word on the size it allocated (alignment adds a little) replaces the grant's figure.
    reports.report(serving, {"event": "arena", "kept_bytes": 100 * MiB + 4096})
    assert Replica.objects.get(pk=serving).arena_kept_bytes == 100 * MiB + 4096


def test_a_replica_that_could_not_allocate_its_granted_arena_is_no_longer_counted_for_one(
    small_host, dispatched, django_capture_on_commit_callbacks
):
    serving = deploy("a")
    DeploymentObserved.objects.filter(deployment__name="a").update(weight_bytes=100 * MiB)
    with django_capture_on_commit_callbacks(execute=True):
        assert host_cache.balance("edge")["granted"] == [serving]

    # A plain `arena 0` may be an earlier drop's answer crossing this grant: it changes nothing.
    reports.report(serving, {"event": "arena", "kept_bytes": 0})
    assert Replica.objects.get(pk=serving).arena_kept_bytes == 100 * MiB
    reports.report(serving, {"event": "arena", "kept_bytes": 0, "failed": "MemoryError: cannot pin"})

    assert Replica.objects.get(pk=serving).arena_kept_bytes == 0
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 0}
    (event,) = Event.objects.filter(kind="host_cache", replica=serving, reason__contains="could not allocate")
    assert "MemoryError: cannot pin" in event.reason and event.before == {"arena_kept_bytes": 100 * MiB}


def test_an_arena_is_not_lent_past_the_budget_nor_to_a_sleeper(small_host, dispatched):
    big = deploy("big")
    DeploymentObserved.objects.filter(deployment__name="big").update(weight_bytes=300 * MiB)
    asleep("a", idle_s=10)

    assert host_cache.grant("edge") == []
    assert Replica.objects.get(pk=big).arena_kept_bytes == 0
    assert kept_arena_commands(dispatched) == []


def test_a_sleep_past_the_budget_drops_a_kept_arena_before_it_parks_a_sleeper(
    small_host, dispatched, django_capture_on_commit_callbacks
):
    sleeper = asleep("a", idle_s=900)
    keeper = deploy("b")
    DeploymentObserved.objects.filter(deployment__name="b").update(weight_bytes=100 * MiB)
    assert host_cache.grant("edge") == [keeper]
    asleep("c", idle_s=10)  # 300 MiB held now against a budget of 250
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert host_cache.trim("edge") == []

    assert Replica.objects.get(pk=keeper).arena_kept_bytes == 0
    assert Replica.objects.get(pk=sleeper).state == "sleeping"
    assert kept_arena_commands(dispatched) == [[keeper, False]]
    assert Event.objects.filter(kind="host_cache", replica=keeper, reason__contains="drops the").exists()
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 200 * MiB}
    # Its report of the arena it kept, late, does not lend it back: only the control plane grants,
    # and tells it again to drop what it holds unaccounted (the first drop may have been lost).
    dispatched.clear()
    with django_capture_on_commit_callbacks(execute=True):
        reports.report(keeper, {"event": "arena", "kept_bytes": 100 * MiB})
    assert Replica.objects.get(pk=keeper).arena_kept_bytes == 0
    assert kept_arena_commands(dispatched) == [[keeper, False]]
    # Its word that it dropped one says nothing new.
    dispatched.clear()
    with django_capture_on_commit_callbacks(execute=True):
        reports.report(keeper, {"event": "arena", "kept_bytes": 0})
    assert kept_arena_commands(dispatched) == []


def test_a_replica_that_keeps_an_arena_counts_once_asleep_and_its_arena_again_once_woken(small_host, dispatched):
    keeper = deploy("a")
    DeploymentObserved.objects.filter(deployment__name="a").update(weight_bytes=100 * MiB)
    assert host_cache.grant("edge") == [keeper]

    sleep.sleep_replica(keeper, reason="idle")
    reports.report(keeper, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 100 * MiB}  # its weights, in its arena
    sleep.wake_deployment("a", reason="woken by a request")
    reports.report(keeper, {"event": "woken"})

    assert Replica.objects.get(pk=keeper).state == "serving"
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 100 * MiB}  # the arena its wake kept
    serve(keeper)  # said again: changes nothing
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 100 * MiB}


def test_a_replica_that_loads_afresh_keeps_no_arena_until_it_is_lent_one_again(small_host, dispatched):
    keeper = deploy("a")
    DeploymentObserved.objects.filter(deployment__name="a").update(weight_bytes=100 * MiB)
    assert host_cache.grant("edge") == [keeper]
    # Its process restarted under the same id (after a CUDA assert, say) and loaded again.
    Replica.objects.filter(pk=keeper).update(state="loading")

    serve(keeper)

    assert Replica.objects.get(pk=keeper).arena_kept_bytes == 0
    assert host_cache.used_bytes([small_host.pk]) == {small_host.pk: 0}
    assert host_cache.grant("edge") == [keeper]


@pytest.mark.django_db(transaction=True)
def test_two_balances_of_one_node_take_turns_so_they_never_lend_the_same_room_twice(monkeypatch, dispatched):
    from django.db import connection, connections

    from scheduling.core import host_cache as rules

    register_node("edge", virtual_gpus("edge", "2x1GiB", NO_OVERHEAD), virtual=True, cpu_cache_bytes=150 * MiB)
    late = deploy("late")  # made first, so the likelier to sleep of the two once it serves
    Replica.objects.filter(pk=late).update(state="loading")
    deploy("early")
    DeploymentObserved.objects.update(weight_bytes=100 * MiB)  # room for one arena
    decided, go_on = threading.Event(), threading.Event()
    choose = rules.grants
    results: dict[str, dict] = {}

    def first_pauses_once_it_has_chosen(*args):
        chosen = choose(*args)
        if not decided.is_set():
            decided.set()
            go_on.wait(30)
        return chosen

    monkeypatch.setattr(rules, "grants", first_pauses_once_it_has_chosen)

    def balance(who: str) -> None:
        try:
            results[who] = host_cache.balance("edge")
        finally:
            connections.close_all()

    first = threading.Thread(target=balance, args=("first",))
    first.start()
    assert decided.wait(30)  # it chose `early`, the only one serving when it looked
    serve(late)
    second = threading.Thread(target=balance, args=("second",))
    second.start()
    # Why a wait on pg_locks: the second balance must be queued on the node's lock while the first
    # holds its choice unapplied, or the test proves nothing. Without the lock the second would
    # read the room as spare, lend it to `late`, and the first then lend it again to `early`.
    with connection.cursor() as cursor:

        def queued() -> bool:
            return waiting(cursor, "advisory") == 1

        wait_until(queued, 30, "the second balance to wait for the first")
    go_on.set()
    first.join(30)
    second.join(30)

    assert results["first"]["granted"] and results["second"]["granted"] == []
    node = Node.objects.get(name="edge")
    assert host_cache.used_bytes([node.pk]) == {node.pk: 100 * MiB}
