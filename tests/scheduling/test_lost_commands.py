"""A command lost after the decision that sent it committed (the broker blinked as it was sent;
there is no outbox) is sent again by the node's next heartbeat once its grace is over, judged only
on what the beat reports: the replica processes the agent runs, and the state each last said it is
in. A start: still pending, no process. A wake: still waking, the process asleep (or awake: its
`woken` report was lost). A sleep: still draining past the drain timeout, the process serving (or
asleep). A stop: still stopping past the drain timeout, the process still run; with no process left,
its lost `stopped` report is applied. Sending twice is harmless, and of two heartbeats only one
resends, with an Event."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from scheduling.models import Deployment, DeploymentObserved, Event, FailoverLease, Node, Replica
from scheduling.services import host_cache, lost_commands, nodes, reports
from tests.support import factories
from tests.support.deployments import (
    FROM_CACHE,
    START,
    STOP,
    TO_CACHE,
    MiB,
    asleep,
    body,
    invariant_holds,
    reserved,
    serve,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    """Run what a beat sends once its claims commit (the dispatches), as the heartbeat's caller would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def after(replica_id: str, seconds: float):
    """`seconds` after the replica's row last changed: where a grace begins."""
    return Replica.objects.get(pk=replica_id).updated_at + timedelta(seconds=seconds)


def serving(api, model_dir, name: str = "tiny-a", replicas: int = 1, drain_s: float = 10.0) -> list[str]:
    assert api("post", "/api/deployments/", body(name, model_dir, replicas=replicas)).status_code == 201
    Deployment.objects.filter(name=name).update(drain_timeout_s=drain_s)
    ids = list(Replica.objects.filter(deployment__name=name).order_by("pk").values_list("id", flat=True))
    for replica_id in ids:
        serve(replica_id)
    return ids


def waking(api, model_dir) -> Replica:
    """A replica promoted from the CPU cache whose wake command never reached its agent."""
    (replica_id,) = serving(api, model_dir)
    assert api("post", f"/api/replicas/{replica_id}/sleep/").status_code == 200
    asleep(replica_id)
    assert api("post", f"/api/replicas/{replica_id}/wake/").json()["state"] == "waking"
    return Replica.objects.select_related("node").get(pk=replica_id)


def lost(reason: str, replica_id: str) -> int:
    return Event.objects.filter(replica=replica_id, reason__contains=reason).count()


# -- start -----------------------------------------------------------------------------------------


def test_a_pending_replica_the_agent_does_not_run_gets_its_start_again_once(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    assert api("post", "/api/deployments/", body("tiny-a", tiny_model_dir)).status_code == 201
    (replica,) = Replica.objects.filter(deployment__name="tiny-a")
    dispatched.clear()  # as if that START never reached the agent
    node = replica.node.name
    later = timezone.now() + timedelta(seconds=120)

    nodes.heartbeat(node, running=[], now=timezone.now())  # within the grace: nothing yet
    assert dispatched == []
    nodes.heartbeat(node, running=[replica.id], now=later)  # it runs: nothing was lost
    assert dispatched == []

    with on_commit():
        assert lost_commands.resend_lost_starts(node, [], later) == [replica.id]
        assert lost_commands.resend_lost_starts(node, [], later) == [], "claimed by the first: no second resend"
        nodes.heartbeat(node, running=[], now=later)
    assert [(q, t, a[:1]) for q, t, a in dispatched] == [(f"node.{node}", START, [replica.id])]
    assert lost("its start command was lost", replica.id) == 1


def test_a_replica_that_left_pending_is_not_started_again(cluster, api, dispatched, tiny_model_dir):
    assert api("post", "/api/deployments/", body("tiny-b", tiny_model_dir)).status_code == 201
    (replica,) = Replica.objects.filter(deployment__name="tiny-b")
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.LOADING)

    assert lost_commands.resend_lost_starts(replica.node.name, [], timezone.now() + timedelta(seconds=120)) == []


# -- wake ------------------------------------------------------------------------------------------


def test_a_lost_wake_is_sent_again_after_the_grace_while_the_process_still_sleeps(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = waking(api, tiny_model_dir)
    dispatched.clear()  # the WAKE that never arrived
    node, grace = replica.node.name, settings.GPUPORTAL_WAKE_GRACE_S
    asleep_ = {replica.id: "sleeping"}

    nodes.heartbeat(node, running=[replica.id], processes=asleep_, now=after(replica.id, grace - 1))
    assert dispatched == [], "within the grace: the wake may still wait in the agent's queue"
    past = after(replica.id, grace + 1)
    for in_progress in ("waking", ""):  # waking now, or a state it has not said yet
        nodes.heartbeat(node, running=[replica.id], processes={replica.id: in_progress}, now=past)
    assert dispatched == []

    with on_commit():
        nodes.heartbeat(node, running=[replica.id], processes=asleep_, now=past)
        nodes.heartbeat(node, running=[replica.id], processes=asleep_, now=past)  # a second beat: claimed
    assert dispatched == [(replica.node.queue, FROM_CACHE, [replica.id, []])]
    assert lost("its wake command was lost, sent again", replica.id) == 1
    event = Event.objects.get(replica=replica.id, reason__contains="its wake command was lost")
    assert event.after["resent"] == "wake" and event.after["process"] == "sleeping"

    dispatched.clear()
    with on_commit():  # the next grace: still asleep, sent once more
        nodes.heartbeat(node, running=[replica.id], processes=asleep_, now=past + timedelta(seconds=grace + 1))
    assert [t for _, t, _ in dispatched] == [FROM_CACHE]

    reports.report(replica.id, {"event": "woken"})
    dispatched.clear()
    with on_commit():
        nodes.heartbeat(node, running=[replica.id], processes=asleep_, now=past + timedelta(hours=1))
    assert dispatched == [] and Replica.objects.get(pk=replica.id).state == "serving"


def test_a_wake_whose_woken_report_was_lost_is_sent_again_for_the_process_to_say_so_again(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = waking(api, tiny_model_dir)
    dispatched.clear()

    with on_commit():
        nodes.heartbeat(
            replica.node.name,
            running=[replica.id],
            processes={replica.id: "serving"},
            now=after(replica.id, settings.GPUPORTAL_WAKE_GRACE_S + 1),
        )
    assert dispatched == [(replica.node.queue, FROM_CACHE, [replica.id, []])]
    assert lost("its woken report was lost", replica.id) == 1


def test_a_wake_sent_again_waits_for_the_replicas_still_draining_on_its_gpus(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = waking(api, tiny_model_dir)
    dispatched.clear()
    (mine,) = replica.occupancies.select_related("gpu")
    other = factories.deployment("other")
    victim = factories.replica(other, replica.node, state=Replica.State.DRAINING)
    factories.occupy(victim, mine.gpu, 100 * MiB)
    elsewhere = replica.node.gpus.exclude(pk=mine.gpu_id).first()
    factories.occupy(factories.replica(other, replica.node, state=Replica.State.DRAINING), elsewhere, 100 * MiB)
    now = after(replica.id, settings.GPUPORTAL_WAKE_GRACE_S + 1)

    with on_commit():
        assert lost_commands.resend_lost_wakes(replica.node.name, [replica.id], {replica.id: "sleeping"}, now) == [
            replica.id
        ]
    assert dispatched == [(replica.node.queue, FROM_CACHE, [replica.id, [victim.id]])]


def test_a_waking_replica_the_agent_runs_no_process_for_is_sent_its_wake_for_the_agent_to_say_so(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = waking(api, tiny_model_dir)
    dispatched.clear()

    with on_commit():
        nodes.heartbeat(
            replica.node.name, running=[], processes={}, now=after(replica.id, settings.GPUPORTAL_WAKE_GRACE_S + 1)
        )
    assert [t for _, t, _ in dispatched] == [FROM_CACHE]
    assert lost("the wake is sent again for the agent to report it gone", replica.id) == 1


# -- sleep -----------------------------------------------------------------------------------------


def test_a_lost_sleep_is_sent_again_after_the_drain_timeout_and_the_grace(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    (replica_id,) = serving(api, tiny_model_dir, drain_s=10)
    assert api("post", f"/api/replicas/{replica_id}/sleep/").json()["state"] == "draining"
    dispatched.clear()  # the SLEEP that never arrived
    node = Replica.objects.get(pk=replica_id).node
    allowed = 10 + settings.GPUPORTAL_SLEEP_GRACE_S
    still = {replica_id: "serving"}

    nodes.heartbeat(node.name, running=[replica_id], processes=still, now=after(replica_id, allowed - 1))
    assert dispatched == [], "within the drain timeout and the grace"
    past = after(replica_id, allowed + 1)
    nodes.heartbeat(node.name, running=[replica_id], processes={replica_id: "draining"}, now=past)
    assert dispatched == [], "draining: the sleep arrived and runs"

    with on_commit():
        nodes.heartbeat(node.name, running=[replica_id], processes=still, now=past)
        nodes.heartbeat(node.name, running=[replica_id], processes=still, now=past)
    assert dispatched == [(node.queue, TO_CACHE, [replica_id])]
    assert lost("its sleep command was lost, sent again", replica_id) == 1
    assert reserved(replica_id) == 300 * MiB, "its reservation is kept until its process says what it holds"

    asleep(replica_id)
    dispatched.clear()
    with on_commit():
        nodes.heartbeat(node.name, running=[replica_id], processes=still, now=past + timedelta(hours=1))
    assert dispatched == [] and Replica.objects.get(pk=replica_id).state == "sleeping"


def test_a_sleep_whose_sleeping_report_was_lost_is_sent_again_for_the_process_to_say_so_again(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    (replica_id,) = serving(api, tiny_model_dir, drain_s=0)
    api("post", f"/api/replicas/{replica_id}/sleep/")
    dispatched.clear()
    node = Replica.objects.get(pk=replica_id).node
    now = after(replica_id, settings.GPUPORTAL_SLEEP_GRACE_S + 1)

    with on_commit():
        nodes.heartbeat(node.name, running=[replica_id], processes={replica_id: "sleeping"}, now=now)
    assert dispatched == [(node.queue, TO_CACHE, [replica_id])]
    assert lost("its sleeping report was lost", replica_id) == 1


def test_a_failover_member_stepping_down_is_never_sent_a_sleep(cluster, dispatched, on_commit):
    node = factories.node("n-pair")
    dep = factories.deployment("paired")
    lease = FailoverLease.objects.create(deployment=dep)
    member = factories.replica(dep, node, state=Replica.State.DRAINING, lease=lease)
    now = timezone.now() + timedelta(hours=1)

    with on_commit():
        nodes.heartbeat(node.name, running=[member.id], processes={member.id: "serving"}, now=now)
    assert dispatched == []


# -- stop ------------------------------------------------------------------------------------------


def scaled_down(api, model_dir) -> tuple[Replica, str]:
    """Two serving replicas, one of them then scaled down: (the stopping one, the other's id)."""
    serving(api, model_dir, replicas=2, drain_s=10)
    assert api("post", "/api/deployments/tiny-a/scale/", {"replicas": 1}).status_code == 200
    stopping = Replica.objects.select_related("node").get(state=Replica.State.STOPPING)
    (kept,) = Replica.objects.exclude(pk=stopping.pk).values_list("pk", flat=True)
    return stopping, kept


def test_a_lost_stop_is_sent_again_after_the_grace(cluster, api, dispatched, tiny_model_dir, on_commit):
    stopping, kept = scaled_down(api, tiny_model_dir)
    dispatched.clear()  # the STOP that never arrived
    node, allowed = stopping.node, 10 + settings.GPUPORTAL_STOP_GRACE_S
    both = [stopping.id, kept]

    nodes.heartbeat(
        node.name, running=both, processes=dict.fromkeys(both, "serving"), now=after(stopping.id, allowed - 1)
    )
    assert dispatched == [], "within the drain timeout and the grace: it may still be draining"

    past = after(stopping.id, allowed + 1)
    with on_commit():
        nodes.heartbeat(node.name, running=both, processes=dict.fromkeys(both, "serving"), now=past)
        nodes.heartbeat(node.name, running=both, now=past)  # a second beat (and an agent that says no states)
    assert dispatched == [(node.queue, STOP, [stopping.id])]
    assert lost("its stop command was lost, sent again", stopping.id) == 1
    assert Replica.objects.get(pk=stopping.id).state == "stopping", "stopped once its process says so"


def test_a_stopping_replica_the_agent_no_longer_runs_is_stopped_as_its_lost_report_would_have(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    stopping, kept = scaled_down(api, tiny_model_dir)
    dispatched.clear()
    past = after(stopping.id, 10 + settings.GPUPORTAL_STOP_GRACE_S + 1)

    nodes.heartbeat(stopping.node.name, running=[kept], now=after(stopping.id, 5))
    assert Replica.objects.get(pk=stopping.id).state == "stopping", "within the grace: its report may be on its way"
    with on_commit():
        nodes.heartbeat(stopping.node.name, running=[kept], processes={kept: "serving"}, now=past)
        nodes.heartbeat(stopping.node.name, running=[kept], processes={kept: "serving"}, now=past)

    replica = Replica.objects.get(pk=stopping.id)
    assert (replica.state, replica.pid) == ("stopped", None)
    assert reserved(stopping.id) == 0 and invariant_holds()
    assert lost("its stopped report was lost, applied now", stopping.id) == 1
    # Through the report's own path: the same Event a `stopped` report writes, once.
    assert Event.objects.filter(replica=stopping.id, reason="process exited", after__state="stopped").count() == 1
    assert dispatched == [], "nothing to send, and a scale-down's stop sets off no reconcile"


# -- an end nobody reported -------------------------------------------------------------------------


def test_a_serving_replica_the_agent_no_longer_runs_fails_as_its_lost_report_would_have(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    # Its process was killed and the agent's `failed` report timed out: without the beat, the
    # books would count it serving on memory nobody holds, and never replace it.
    gone, kept = serving(api, tiny_model_dir, replicas=2)
    node = Replica.objects.get(pk=gone).node.name
    dispatched.clear()
    grace = settings.GPUPORTAL_END_GRACE_S

    nodes.heartbeat(node, running=[kept], processes={kept: "serving"}, now=after(gone, grace - 1))
    assert Replica.objects.get(pk=gone).state == "serving", "within the grace: its report may be on its way"
    nodes.heartbeat(
        node, running=[gone, kept], processes={gone: "serving", kept: "serving"}, now=after(gone, grace + 1)
    )
    assert Replica.objects.get(pk=gone).state == "serving", "its process runs: nothing was lost"

    past = after(gone, grace + 1)
    with on_commit():
        nodes.heartbeat(node, running=[kept], processes={kept: "serving"}, now=past)
        nodes.heartbeat(node, running=[kept], processes={kept: "serving"}, now=past)  # a second beat: once

    replica = Replica.objects.get(pk=gone)
    assert (replica.state, replica.pid) == ("failed", None)
    assert "its failed report was lost, applied now" in replica.failure_reason
    assert reserved(gone) == 0 and invariant_holds()
    said = Event.objects.filter(replica=gone, reason__contains="its failed report was lost, applied now")
    assert said.filter(after__resent="failed report").count() == 1, "of two beats, one applies it"
    assert said.filter(after__state="failed").count() == 1, "through the report's own path, once"
    assert Replica.objects.get(pk=kept).state == "serving"
    assert [t for _q, t, _a in dispatched] == ["scheduling.tasks.reconcile"], "a replacement is placed"


def test_a_sleeping_replica_whose_process_is_gone_fails_but_a_parked_one_has_no_process_to_lose(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    asleep_id, parked_id = serving(api, tiny_model_dir, replicas=2)
    for replica_id in (asleep_id, parked_id):
        assert api("post", f"/api/replicas/{replica_id}/sleep/").status_code == 200
        asleep(replica_id)
    Replica.objects.filter(pk=parked_id).update(state=Replica.State.PARKED)
    node = Replica.objects.get(pk=asleep_id).node.name

    with on_commit():
        nodes.heartbeat(node, running=[], processes={}, now=after(asleep_id, settings.GPUPORTAL_END_GRACE_S + 1))

    assert Replica.objects.get(pk=asleep_id).state == "failed"
    assert Replica.objects.get(pk=parked_id).state == "parked"


def test_a_report_repeated_for_a_command_sent_twice_changes_nothing(cluster, api, dispatched, tiny_model_dir):
    replica = waking(api, tiny_model_dir)

    def state_events() -> int:
        return Event.objects.filter(replica=replica.id, kind=Event.Kind.REPLICA_STATE).count()

    reports.report(replica.id, {"event": "woken"})
    seen = state_events()
    reports.report(replica.id, {"event": "woken"})  # a wake of an awake replica: said again
    assert state_events() == seen and Replica.objects.get(pk=replica.id).state == "serving"

    api("post", f"/api/replicas/{replica.id}/sleep/")
    asleep(replica.id)
    seen = state_events()
    asleep(replica.id)  # a sleep of a sleeping one: said again
    assert state_events() == seen and reserved(replica.id) == 0

    Replica.objects.filter(pk=replica.id).update(state=Replica.State.STOPPING)
    reports.report(replica.id, {"event": "stopped"})
    seen = state_events()
    reports.report(replica.id, {"event": "stopped"})  # a stop of a gone one: the agent says stopped again
    assert state_events() == seen
    assert Replica.objects.get(pk=replica.id).state == "stopped" and invariant_holds()


# -- arena -----------------------------------------------------------------------------------------

ARENA = "inference.tasks.replica_arena"


def arena_commands(dispatched) -> list[tuple[str, list]]:
    return [(queue, args) for queue, task, args in dispatched if task == ARENA]


def granted(api, model_dir, on_commit) -> Replica:
    """A serving replica lent a 100 MiB host arena by its node's balance (its grant committed)."""
    (replica_id,) = serving(api, model_dir)
    replica = Replica.objects.select_related("node").get(pk=replica_id)
    Node.objects.filter(pk=replica.node_id).update(cpu_cache_bytes=1024 * MiB)
    DeploymentObserved.objects.filter(pk=replica.deployment_id).update(weight_bytes=100 * MiB)
    with on_commit():
        assert host_cache.balance(replica.node.name)["granted"] == [replica_id]
    assert Replica.objects.get(pk=replica_id).arena_kept_bytes == 100 * MiB
    return replica


def test_a_lost_arena_grant_is_sent_again_while_the_serving_process_keeps_none(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = granted(api, tiny_model_dir, on_commit)
    dispatched.clear()  # the grant that never arrived
    node, grace = replica.node, settings.GPUPORTAL_ARENA_GRACE_S
    beat = {"running": [replica.id], "processes": {replica.id: "serving"}}
    none = {replica.id: 0}

    nodes.heartbeat(node.name, **beat, arenas=none, now=after(replica.id, grace - 1))
    assert dispatched == [], "within the grace: its arena may still be being allocated and pinned"
    past = after(replica.id, grace + 1)
    nodes.heartbeat(node.name, **beat, arenas={replica.id: 100 * MiB}, now=past)  # it keeps one: nothing lost
    nodes.heartbeat(node.name, running=[replica.id], processes={replica.id: "draining"}, arenas=none, now=past)
    nodes.heartbeat(node.name, **beat, arenas={}, now=past)  # it has not said yet (adopted, no pong yet)
    nodes.heartbeat(node.name, **beat, now=past)  # an agent that says nothing of arenas
    assert dispatched == []

    with on_commit():
        nodes.heartbeat(node.name, **beat, arenas=none, now=past)
        nodes.heartbeat(node.name, **beat, arenas=none, now=past)  # a second beat: claimed
    assert arena_commands(dispatched) == [(node.queue, [replica.id, True])]
    assert lost("the grant was lost, sent again", replica.id) == 1
    event = Event.objects.get(replica=replica.id, reason__contains="the grant was lost")
    assert event.after["resent"] == "arena keep" and event.after["process"] == "serving"
    assert Replica.objects.get(pk=replica.id).arena_kept_bytes == 100 * MiB, "the books counted it all along"


def test_a_lost_arena_drop_is_sent_again_while_the_process_still_keeps_what_the_books_no_longer_count(
    cluster, api, dispatched, tiny_model_dir, on_commit
):
    replica = granted(api, tiny_model_dir, on_commit)
    Node.objects.filter(pk=replica.node_id).update(cpu_cache_bytes=50 * MiB)  # the arena no longer fits
    with on_commit():
        host_cache.balance(replica.node.name)
    assert Replica.objects.get(pk=replica.id).arena_kept_bytes == 0
    assert arena_commands(dispatched)[-1] == (replica.node.queue, [replica.id, False])
    dispatched.clear()  # the drop that never arrived: the process keeps its arena
    node, grace = replica.node, settings.GPUPORTAL_ARENA_GRACE_S
    beat = {"running": [replica.id], "processes": {replica.id: "serving"}, "arenas": {replica.id: 100 * MiB}}

    nodes.heartbeat(node.name, **beat, now=after(replica.id, grace - 1))
    assert dispatched == [], "within the grace: the drop may still wait in the agent's queue"
    with on_commit():
        nodes.heartbeat(node.name, **beat, now=after(replica.id, grace + 1))
    assert arena_commands(dispatched) == [(node.queue, [replica.id, False])]
    assert lost("the drop was lost, sent again", replica.id) == 1
    # Its process's word that it dropped it leaves nothing more to send.
    reports.report(replica.id, {"event": "arena", "kept_bytes": 0})
    dispatched.clear()
    nodes.heartbeat(
        node.name,
        running=beat["running"],
        processes=beat["processes"],
        arenas={replica.id: 0},
        now=after(replica.id, grace + 1),
    )
    assert dispatched == []


# -- a node with nothing waiting -------------------------------------------------------------------


def test_a_beat_finds_no_lost_command_in_one_query_while_no_replica_has_waited_a_grace(
    cluster, api, dispatched, tiny_model_dir, django_assert_num_queries
):
    # Most nodes of a large fleet host nothing, or nothing that changed a grace ago: their beats
    # look for lost commands once, not once per kind.
    (replica_id,) = serving(api, model_dir=tiny_model_dir)
    node = Replica.objects.get(pk=replica_id).node.name
    dispatched.clear()
    now = timezone.now()
    beat = {"running": [replica_id], "processes": {replica_id: "serving"}, "arenas": {replica_id: 0}}

    for name in (node, "node2" if node == "node1" else "node1"):
        with django_assert_num_queries(1):
            found = lost_commands.resend(name, beat["running"], beat["processes"], now, arenas=beat["arenas"])
        assert found == {kind: [] for kind in ("start", "stop", "end", "wake", "sleep", "arena")}
    assert dispatched == []


def test_a_beat_of_a_node_serving_for_a_while_looks_for_every_kind_of_lost_command_in_one_query(
    cluster, api, dispatched, tiny_model_dir, django_assert_num_queries
):
    # Its serving replica is past every grace at every beat: each kind reading the node's replicas
    # on its own made six statements of every such beat.
    (replica_id,) = serving(api, model_dir=tiny_model_dir)
    node = Replica.objects.get(pk=replica_id).node.name
    dispatched.clear()
    later = timezone.now() + timedelta(hours=1)
    beat = {"running": [replica_id], "processes": {replica_id: "serving"}, "arenas": {replica_id: 0}}

    with django_assert_num_queries(1):
        found = lost_commands.resend(node, beat["running"], beat["processes"], later, arenas=beat["arenas"])

    assert found == {kind: [] for kind in ("start", "stop", "end", "wake", "sleep", "arena")}
    assert dispatched == []
