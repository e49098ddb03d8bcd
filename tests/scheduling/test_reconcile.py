"""The portal keeps what the operator asked for: replicas lost with a node (its agent
stopped, went silent, or started anew) are released through the commit path, their requests go
back to the queue, and replacements are placed on the nodes still online."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from gpuportal.celery import app
from gpuportal.wire import node_lease
from scheduling.models import Deployment, DeploymentObserved, Event, Node, Occupant, Replica
from scheduling.services import deployments, nodes, reports
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from tests.support.deployments import MiB, invariant_holds, serve

pytestmark = pytest.mark.django_db

RECONCILE, START = "scheduling.tasks.reconcile", "inference.tasks.start_replica"


@pytest.fixture
def sent(monkeypatch, cluster) -> list[tuple[str, list, str | None]]:
    """Tasks sent after each commit: (task, args, queue)."""
    recorded: list[tuple[str, list, str | None]] = []
    monkeypatch.setattr(
        app, "send_task", lambda name, args=None, queue=None, **kw: recorded.append((name, list(args or []), queue))
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):  # only the queue's own keys
        client.delete(key)
    request_services.queue.cache_clear()
    return recorded


def deploy(capture, replicas: int) -> Deployment:
    """Replicas of 400 MiB: two fit a 1 GiB GPU of the cluster (two nodes of two)."""
    spec = DeploymentSpec(name="tiny", source="/srv/models/tiny", replicas=replicas, override_bytes=400 * MiB)
    with capture(execute=True):
        deployment = create(spec, facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=400 * MiB))
        for replica_id in deployment.replicas.values_list("pk", flat=True):
            serve(replica_id)
    return deployment


def on(node: str) -> list[Replica]:
    return list(Replica.objects.filter(node__name=node).order_by("pk"))


def test_replicas_lost_with_a_silent_node_are_released_requeued_and_placed_on_another(
    sent, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=2)
    node = Replica.objects.first().node.name
    other = "node2" if node == "node1" else "node1"
    lost = [r for r in on(node) if r.state == "serving"]
    queue = request_services.queue()
    taken = queue.submit("tiny", kind="generate", input="hi", params={}, owner="1")
    assert queue.take("tiny", lost[0].id, timeout=1).id == taken.id
    Node.objects.filter(name=node).update(last_heartbeat=timezone.now() - timedelta(minutes=5))

    with capture(execute=True):
        assert nodes.expire_heartbeats() == [node]

    for replica in lost:
        replica.refresh_from_db()
        assert replica.state == "stopped" and replica.pid is None
        assert not Occupant.objects.filter(replica=replica).exists()
    assert Event.objects.filter(reason__startswith=f"lost with node {node} (no heartbeat").count() == len(lost)
    assert queue.get(taken.id).status == "queued", "nothing accepted is lost"
    assert invariant_holds()
    assert (RECONCILE, [f"node(s) {node} went offline"], "control") in sent

    with capture(execute=True):
        placed = deployments.reconcile_all("reconciled: test")

    assert sorted(r.id for r in on(other) if r.state == "pending") == sorted(placed["tiny"])
    assert len(placed["tiny"]) == len(lost)
    assert {queue_ for task, _, queue_ in sent if task == START} >= {f"node.{other}"}
    assert Event.objects.filter(reason__contains=f"reconciled: test: {2 - len(lost)} of 2 replica(s)").exists()


def test_an_agent_that_stops_has_its_replicas_placed_elsewhere(sent, django_capture_on_commit_callbacks):
    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=1)
    (replica,) = Replica.objects.all()
    node = replica.node.name

    # The agent stops its replicas (each says so), then the node.
    with capture(execute=True):
        reports.report(replica.id, {"event": "stopped"})
        nodes.mark_stopped(node, "agent stopped")
        deployments.reconcile_all("reconciled: test")

    (replacement,) = Replica.objects.exclude(pk=replica.pk)
    assert replacement.node.name != node and replacement.state == "pending"


def test_a_restarted_agent_finds_its_predecessors_replicas_lost_and_the_deployment_restarted(
    sent, django_capture_on_commit_callbacks
):
    from inference.devices import virtual_gpus
    from tests.support.factories import NO_OVERHEAD

    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=1)
    (old,) = Replica.objects.all()

    with capture(execute=True):
        nodes.register_node(old.node.name, virtual_gpus(old.node.name, "2x1GiB", NO_OVERHEAD), virtual=True)
        deployments.reconcile_all("reconciled: test")

    old.refresh_from_db()
    assert old.state == "stopped" and old.pid is None
    assert Event.objects.filter(replica=old.id, reason__startswith="lost: the agent of node").exists()
    (fresh,) = Replica.objects.exclude(pk=old.pk)
    assert fresh.state == "pending", "restarted without waiting for a request"


def test_a_restarted_agent_keeps_the_survivors_its_books_agree_with_and_loses_the_rest(
    sent, django_capture_on_commit_callbacks
):
    from gpuportal.wire.node_reports import Survivor
    from inference.devices import virtual_gpus
    from tests.support.factories import NO_OVERHEAD

    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=3)
    # Three on two nodes: one node runs two or three of them.
    node = max(Node.objects.all(), key=lambda n: n.replicas.count())
    kept, behind, *dead = Replica.objects.filter(node=node).order_by("pk")
    queue = request_services.queue()
    taken = queue.submit("tiny", kind="generate", input="hi", params={}, owner="1")
    assert queue.take("tiny", kept.id, timeout=1).id == taken.id
    # The books put `behind` to sleep, but the old agent died before the command reached it.
    Replica.objects.filter(pk=behind.pk).update(state="draining")
    reserved_before = sum(o.reserved_bytes for o in Occupant.objects.filter(replica=kept))

    survivors = [Survivor(r.id, 4242, "serving", "serving") for r in (kept, behind)]
    with capture(execute=True):
        nodes.register_node(
            node.name, virtual_gpus(node.name, "2x1GiB", NO_OVERHEAD), virtual=True, survivors=survivors
        )

    kept.refresh_from_db()
    assert kept.state == "serving" and kept.pid == 4242
    assert sum(o.reserved_bytes for o in Occupant.objects.filter(replica=kept)) == reserved_before
    assert queue.get(taken.id).status == "dispatched", "the survivor goes on with what it had taken"
    adopted = Event.objects.get(kind=Event.Kind.REPLICA_ADOPTED)
    assert adopted.replica == kept.id
    assert adopted.reason == (
        f"its process (pid 4242) outlived the agent of node {node.name} and was taken over by the new one (serving)"
    )
    for lost in (behind, *dead):
        lost.refresh_from_db()
        assert lost.state == "stopped" and not Occupant.objects.filter(replica=lost).exists()
    assert Event.objects.filter(
        replica=behind.id, reason__endswith="its books say draining: a command or report was lost with the old agent"
    ).exists()
    assert invariant_holds()
    # The agent's first beat learns which of the processes it took over to stop.
    assert nodes.heartbeat(node.name, running=[kept.id, behind.id]) == [behind.id]


def test_reconcile_counts_sleeping_replicas_never_stops_any_and_leaves_a_failed_deployment_alone(
    sent, django_capture_on_commit_callbacks
):
    from scheduling.services import sleep

    capture = django_capture_on_commit_callbacks
    deployment = deploy(capture, replicas=2)
    first, second = Replica.objects.order_by("pk")
    with capture(execute=True):
        sleep.sleep_replica(first.id, reason="test")
    assert deployments.reconcile_all("reconciled: test") == {}, "a sleeping replica still counts"

    Deployment.objects.filter(pk=deployment.pk).update(replicas_wanted=1)
    assert deployments.reconcile_all("reconciled: test") == {}
    assert Replica.objects.exclude(state="stopped").count() == 2, "nothing is stopped by a reconcile"

    Replica.objects.filter(pk=second.pk).update(state="failed")
    Replica.objects.filter(pk=first.pk).update(state="failed")
    Deployment.objects.filter(pk=deployment.pk).update(replicas_wanted=2)
    DeploymentObserved.objects.filter(pk=deployment.pk).update(failed_reason="broken")
    assert deployments.reconcile_all("reconciled: test") == {}, "a deployment that gave up starts nothing"


def test_a_crashed_replica_is_put_back_by_a_reconcile_and_a_beat_sweep_reconciles_too(
    sent, django_capture_on_commit_callbacks, beat_schedules
):
    from django_celery_beat.models import PeriodicTask

    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=1)
    (crashed,) = Replica.objects.all()
    with capture(execute=True):
        reports.report(crashed.id, {"event": "failed", "kind": "crash", "reason": "killed by signal 9"})
    assert (RECONCILE, [f"replica {crashed.id[:8]} of tiny failed"], "control") in sent

    with capture(execute=True):
        (fresh,) = deployments.reconcile_all("reconciled: test")["tiny"]
    assert Replica.objects.get(pk=fresh).state == "pending"

    sweep = PeriodicTask.objects.get(name="reconcile deployments")
    assert (sweep.task, sweep.queue, sweep.args, sweep.enabled) == (
        RECONCILE,
        "control",
        '["the periodic sweep"]',
        True,
    )


def test_a_replica_that_ends_unasked_sets_off_a_reconcile_and_one_stopped_on_purpose_does_not(
    sent, django_capture_on_commit_callbacks
):

    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=2)
    with capture(execute=True):
        deployments.scale("tiny", 1)
    stopping = Replica.objects.get(state="stopping")
    sent.clear()
    with capture(execute=True):
        reports.report(stopping.id, {"event": "stopped"})
    assert [task for task, _, _ in sent if task == RECONCILE] == [], "a stop on purpose leaves nothing to put back"

    exited = Replica.objects.get(state="serving")
    with capture(execute=True):
        reports.report(exited.id, {"event": "stopped"})  # its process exited on its own
    assert (RECONCILE, [f"replica {exited.id[:8]} of tiny stopped"], "control") in sent


def test_a_node_heard_again_after_it_was_written_off_stops_its_stale_replicas_before_it_takes_work(
    sent, django_capture_on_commit_callbacks
):
    capture = django_capture_on_commit_callbacks
    deploy(capture, replicas=1)
    (replica,) = Replica.objects.all()
    node = replica.node.name
    Node.objects.filter(name=node).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    with capture(execute=True):
        assert nodes.expire_heartbeats() == [node]
    sent.clear()

    # Its agent was only cut off: it still runs the replica the control plane wrote off.
    with capture(execute=True):
        assert nodes.heartbeat(node, running=[replica.id]) == [replica.id]
    assert Node.objects.get(name=node).status == Node.Status.OFFLINE, "no new work while it still runs"
    assert Event.objects.filter(node=node, reason__contains="still runs 1 replica process(es) written off").exists()
    assert sent == []

    with capture(execute=True):
        assert nodes.heartbeat(node, running=[]) == []
    assert Node.objects.get(name=node).status == Node.Status.ONLINE
    assert (RECONCILE, [f"node {node} is back"], "control") in sent

    # Online, a process the books do not know (deleted, or stopped meanwhile) is stale all the same.
    assert nodes.heartbeat(node, running=["no-such-replica"]) == ["no-such-replica"]
    assert Node.objects.get(name=node).status == Node.Status.ONLINE


# -- end to end: two real agents, one SIGKILLed under load ---------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_agents_replica_is_replaced_on_the_other_node_with_no_request_lost(
    start_agent, control_worker, staff, tmp_path, how
):
    import signal

    from inference.management.commands.make_tiny_model import write_tiny_model
    from tests.support.load import SteadyLoad
    from tests.support.processes import sweep_until_written_off, wait_until

    request_services.queue.cache_clear()
    agents = {"left": start_agent("left", "1x8GiB"), "right": start_agent("right", "1x8GiB")}
    control_worker()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=11).path
    # 1.4 GiB and a context each: either GPU holds both, so the survivor can take them all.
    body = {"name": "tiny", "model": {"source": str(model)}, "replicas": 2, "memory": {"override_bytes": 1400 * MiB}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201

    def serving_on(node: str) -> int:
        return Replica.objects.filter(state="serving", node__name=node).count()

    wait_until(lambda: serving_on("left") + serving_on("right") == 2, 180, "two replicas to serve")
    doomed = "left" if serving_on("left") else "right"  # placement may have put both on one node
    keeper = "right" if doomed == "left" else "left"

    with SteadyLoad(clients=2) as load:
        load.wait_for(10)
        # SIGKILL: its replicas outlive it, waiting to be adopted, until the control plane writes
        # them off (then they take nothing more and end). SIGTERM: it takes its node out of
        # placement, stops its replicas (they finish what they took), and says its node stopped.
        agents[doomed].send_signal(getattr(signal, how))
        agents[doomed].wait(60)
        if how == "SIGKILL":
            # Beat does not run in tests: expire the silent node as its sweep would.
            sweep_until_written_off(doomed)
        else:
            assert Node.objects.get(name=doomed).status == Node.Status.OFFLINE
        wait_until(lambda: serving_on(keeper) == 2, 180, "replacements to serve on the other node")
        before = len(load.results)
        load.wait_for(before + 10)

    assert load.results and all(code == 200 for code, _ in load.results), [r for r in load.results if r[0] != 200]
    if how == "SIGKILL":
        assert Event.objects.filter(reason__startswith=f"lost with node {doomed}").exists()
    else:
        assert Event.objects.filter(kind=Event.Kind.NODE_STOPPED, node=doomed).exists()
    assert Replica.objects.exclude(state="stopped").count() == 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_cut_off_agents_replica_is_replaced_and_fenced_and_its_node_returns_only_without_it(
    start_agent, control_worker, staff, tmp_path
):
    import signal

    from inference.management.commands.make_tiny_model import write_tiny_model
    from tests.support.load import SteadyLoad
    from tests.support.processes import sweep_until_written_off, wait_until
    from tests.support.replicas import gone

    request_services.queue.cache_clear()
    agents = {"left": start_agent("left", "1x8GiB"), "right": start_agent("right", "1x8GiB")}
    control_worker()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=12).path
    body = {"name": "tiny", "model": {"source": str(model)}, "replicas": 1, "memory": {"override_bytes": 1400 * MiB}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    stale = wait_until(lambda: Replica.objects.filter(state="serving").first(), 180, "the replica to serve")
    cut_off = stale.node.name
    keeper = "right" if cut_off == "left" else "left"

    def partition(node: str, other: str) -> Replica:
        """Cut the node's agent off (its replica process lives on and still reaches Redis) until
        its replica is replaced on the other node, then let it be heard again."""
        written_off = Replica.objects.get(node__name=node, state="serving")
        agents[node].send_signal(signal.SIGSTOP)
        sweep_until_written_off(node)
        wait_until(lambda: Replica.objects.filter(state="serving", node__name=other).exists(), 180, "a replacement")
        agents[node].send_signal(signal.SIGCONT)
        # gone(): the process may end between a check that it exists and a look at its status.
        wait_until(lambda: gone(written_off.pid), 60, "the written-off replica process to be stopped")
        wait_until(lambda: Node.objects.get(name=node).status == Node.Status.ONLINE, 60, f"{node} to be back")
        return written_off

    # Under load: the written-off replica's answers to the requests given back are refused
    # (it exits on the first), and every request is answered once, by someone.
    with SteadyLoad(clients=2) as load:
        load.wait_for(10)
        first = partition(cut_off, keeper)
        before = len(load.results)
        load.wait_for(before + 10)
    assert load.results and all(code == 200 for code, _ in load.results), [r for r in load.results if r[0] != 200]
    assert Replica.objects.get(pk=first.pk).state == "stopped"

    # Idle: the written-off replica takes nothing more (Redis refuses its next take) and ends on
    # its own, or its agent, heard again, stops it; either way before its node comes back.
    second = partition(keeper, cut_off)
    assert Replica.objects.get(pk=second.pk).state == "stopped"
    log = (tmp_path / "replicas" / keeper / f"replica-{second.id}.log").read_text()
    stopped_by_agent = Event.objects.filter(
        node=keeper,
        reason__contains=f"still runs 1 replica process(es) written off while it was silent ({second.id[:8]})",
    ).exists()
    fenced = (f"replica {second.id} was written off by the control plane", f"node {keeper} was written off after")
    # Or its agent, resumed, found its node's epoch raised as it renewed the lease, and stopped it
    # before its first beat (so no beat named it): the replica, its lease lapsed meanwhile, had
    # paused rather than seen the epoch itself.
    agent_log = (tmp_path / f"agent-{keeper}.log").read_text()
    fenced_by_agent = f"node {keeper} was written off by the control plane (its epoch went from" in agent_log
    assert stopped_by_agent or fenced_by_agent or any(why in log for why in fenced), log[-2000:]
    assert [r.node.name for r in Replica.objects.exclude(state="stopped")] == [cut_off], [
        (r.id[:8], r.node_id, r.state, r.failure_reason) for r in Replica.objects.all()
    ]
    # Each written off node was fenced by a new epoch, and no GPU is held twice: the books equal
    # what the processes hold (no over-commit seen by a heartbeat), every reservation accounted.
    fenced_at = redis.Redis.from_url(settings.REDIS_URL).mget([node_lease.epoch_key(n) for n in (cut_off, keeper)])
    assert all(int(epoch or 0) >= 1 for epoch in fenced_at), fenced_at
    assert invariant_holds()
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    (live,) = Replica.objects.exclude(state="stopped")
    assert Occupant.objects.filter(replica=live).exists() and not Occupant.objects.exclude(replica=live).exists()
