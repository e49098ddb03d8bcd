"""fairness.prefer_wake in the live wake path: a deployment with nothing awake whose copy
sleeps in one node's CPU RAM, where it does not fit as things are, while another node's GPU is free
enough for a cold load. When the load from disk is slower than the wake after max_wait, the copy
waits for room on its own node by the fair wake path (intents, victims, promotion); when it is the
faster (a small model), a new replica loads from disk as before. The same for a copy not asleep
yet: a request finding the only replica draining to sleep waits for it, and its sleeping report
wakes the deployment. Load and wake times are the deployment's measured figures, else the capacity
planner's estimate from its bytes. Two virtual
nodes of one 1 GiB GPU each, no processes: the preempt task runs here on a fake clock, and what
replica processes would report is fed in."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from gpuportal.wire.requestqueue import processing_key, queue_key
from inference.devices import virtual_gpus
from scheduling.core import fairness
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, PreemptionIntent, Replica
from scheduling.services import preemption, reports, sleep
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.nodes import register_node
from tests.support import factories as f
from tests.support.deployments import MiB, asleep, invariant_holds
from tests.support.factories import NO_OVERHEAD

LONG_AGO = timedelta(hours=1)
NEED = 400 * MiB
PREFERRED = "rather than loading a new replica from disk"


@pytest.fixture
def two_nodes(db) -> tuple[GPU, GPU]:
    """(the GPU of node1, free; the GPU of node2, where the copy sleeps)."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "1x1GiB", NO_OVERHEAD), virtual=True)
    return GPU.objects.get(node__name="node1"), GPU.objects.get(node__name="node2")


@pytest.fixture
def rq():
    """Redis without the processing lists earlier tests left: a victim is busy only if made so."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):
        client.delete(key)
    yield request_services.queue()
    for key in client.scan_iter("gp:*"):
        client.delete(key)


def deploy(
    name: str,
    *,
    weight_bytes: int = 10 * MiB,
    load_s: float | None = None,
    wake_s: float | None = None,
    **spec,
) -> Deployment:
    """A deployment with no replica yet, its replicas' measured load and wake times as given."""
    spec.setdefault("max_wait_s", 5.0)
    deployment = create(
        DeploymentSpec(name=name, source="/srv/models/tiny", replicas=0, override_bytes=NEED, **spec),
        facts=ModelFacts(weight_bytes=weight_bytes, estimate_bytes=NEED),
    )
    DeploymentObserved.objects.filter(pk=deployment.pk).update(measured_load_s=load_s, measured_wake_s=wake_s)
    deployment.refresh_from_db()
    return deployment


def serving_on(gpu: GPU, name: str, *, idle_for: timedelta = LONG_AGO, **spec) -> str:
    """A replica serving for an hour on `gpu` (placed by hand, so which GPU holds whom is fixed)."""
    deployment = Deployment.objects.filter(name=name).first() or deploy(name, **spec)
    replica = f.replica(
        deployment,
        gpu.node,
        state="serving",
        serving_since=timezone.now() - LONG_AGO,
        last_accessed=timezone.now() - idle_for,
    )
    f.occupy(replica, gpu, NEED)
    return replica.id


def copy_asleep_on(gpu: GPU, name: str) -> str:
    """The deployment's one replica, put to sleep on `gpu`: its weights in that node's CPU RAM."""
    copy = serving_on(gpu, name)
    sleep.sleep_replica(copy, reason="idle")
    asleep(copy)
    return copy


def busy(*replica_ids: str) -> None:
    client = request_services.queue().redis
    for replica_id in replica_ids:
        client.lpush(processing_key(replica_id), f"in-flight-on-{replica_id[:8]}")


def the_rule_said(deployment: str) -> list[Event]:
    return list(Event.objects.filter(deployment=deployment, reason__contains=PREFERRED))


class FakeClock:
    def __init__(self, on_tick) -> None:
        self.t, self.start, self.on_tick = 1000.0, 1000.0, on_tick

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.01)
        assert invariant_holds()
        self.on_tick(self.t - self.start)


def finish_preemption(replica_id: str) -> tuple[preemption.Outcome, float]:
    """Run the preempt task for the copy's intents, victims reporting asleep once draining."""

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)

    clock = FakeClock(world)
    ids = [i.pk for i in PreemptionIntent.objects.filter(waiting_replica_id=replica_id).order_by("pk")]
    outcome = preemption.run_preemption(ids, clock=clock, sleep=clock.sleep)
    return outcome, clock.t - clock.start


# -- slow disk: the copy wakes on its node ----------------------------------------------------------


def test_it_wakes_the_sleeping_copy_when_a_disk_load_would_be_slower(two_nodes, dispatched, rq):
    free, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0, max_wait_s=5.0)
    copy = copy_asleep_on(home, "big")
    older = serving_on(home, "a", idle_for=timedelta(minutes=30))
    serving_on(home, "b", idle_for=timedelta(minutes=1))
    assert GPU.objects.get(pk=home.pk).available_bytes < NEED <= GPU.objects.get(pk=free.pk).available_bytes

    request = request_services.submit("big", kind="generate", input="hi", params={}, owner="1")

    assert request.status == "waking"
    assert list(Replica.objects.filter(deployment__name="big").values_list("id", flat=True)) == [copy], "no new one"
    assert Replica.objects.get(pk=copy).state == "sleeping", "it waits as itself for room on its node"
    (intent,) = PreemptionIntent.objects.filter(waiting_replica_id=copy)
    assert intent.gpu_id == home.pk and intent.deadline == intent.created_at, "its victims serve nothing"
    assert GPU.objects.get(pk=free.pk).available_bytes == free.total_bytes, "the free GPU stays free"
    (said,) = the_rule_said("big")
    assert said.kind == Event.Kind.REPLICA_STATE and said.replica == copy and said.node == "node2"
    assert "a load from disk takes 30 s (measured), longer than a wake from CPU RAM of 2 s (measured)" in said.reason
    assert "after a fair wait of at most 5 s (max_wait)" in said.reason and "woken by a request" in said.reason
    assert said.before == {"choice": "load from disk"} and said.after["choice"] == "wake from CPU RAM"

    outcome, waited = finish_preemption(copy)

    assert outcome.status == "satisfied" and outcome.victims == (older,), outcome
    assert waited < 1, "preempted at once: no one was using the victim"
    woken = Replica.objects.get(pk=copy)
    assert woken.state == "waking" and woken.node.name == "node2", "promoted from node2's CPU RAM"
    assert Replica.objects.filter(deployment__name="big").count() == 1 and invariant_holds()


def test_the_copy_waits_out_max_wait_when_its_victims_are_busy_rather_than_load_from_disk(two_nodes, dispatched, rq):
    free, home = two_nodes
    deploy("big", load_s=60.0, wake_s=3.0, max_wait_s=4.0)
    copy = copy_asleep_on(home, "big")
    a = serving_on(home, "a", idle_for=timedelta(minutes=30))
    b = serving_on(home, "b", idle_for=timedelta(minutes=1))
    busy(a, b)

    assert sleep.wake_deployment("big", reason="a request arrived") == [copy]

    (intent,) = PreemptionIntent.objects.filter(waiting_replica_id=copy)
    assert intent.gpu_id == home.pk and intent.deadline == intent.created_at + timedelta(seconds=4)
    assert len(the_rule_said("big")) == 1
    # A second request while the copy waits starts nothing more: no load from disk after all.
    assert sleep.wake_deployment("big", reason="another request") == [copy]
    assert Replica.objects.filter(deployment__name="big").count() == 1 and len(the_rule_said("big")) == 1

    outcome, waited = finish_preemption(copy)

    assert outcome.status == "satisfied" and len(outcome.victims) == 1, outcome
    assert waited >= 4, "the fair wait: a busy victim keeps its max_wait"
    assert Replica.objects.get(pk=copy).state == "waking" and Replica.objects.get(pk=copy).node.name == "node2"
    assert GPU.objects.get(pk=free.pk).available_bytes == free.total_bytes and invariant_holds()


# -- a copy still draining: the request waits for it ----------------------------------------------


WAKE = "scheduling.tasks.wake"
WAITING_FOR_DRAIN = "waiting for it to finish draining"


def test_a_request_while_the_last_replica_drains_waits_for_its_copy_rather_than_load_from_disk(
    two_nodes, dispatched, rq, django_capture_on_commit_callbacks
):
    free, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0, max_wait_s=5.0, drain_timeout_s=20.0)
    draining = serving_on(home, "big")
    sleep.sleep_replica(draining, reason="preempted for a wake")  # its requests finishing: draining
    assert GPU.objects.get(pk=free.pk).available_bytes >= NEED, "room for a load from disk on node1"

    request = request_services.submit("big", kind="generate", input="hi", params={}, owner="1")
    again = request_services.submit("big", kind="generate", input="again", params={}, owner="1")

    assert request.status == again.status == "waking"
    assert list(Replica.objects.filter(deployment__name="big").values_list("id", flat=True)) == [draining]
    assert Replica.objects.get(pk=draining).wake_when_asleep and not PreemptionIntent.objects.exists()
    assert GPU.objects.get(pk=free.pk).available_bytes == free.total_bytes, "the free GPU stays free"
    (said,) = Event.objects.filter(deployment="big", reason__contains=WAITING_FOR_DRAIN)
    assert said.replica == draining and said.node == "node2" and "the drain at most 20 s" in said.reason
    assert "a load from disk takes 30 s (measured), longer than a wake from CPU RAM of 2 s" in said.reason
    dispatched.clear()

    # Its sleeping report wakes the deployment, whatever the queue showed when it came: the request
    # that decided to wait is queued only after that decision committed.
    request_services.queue().redis.delete(queue_key("big"))
    with django_capture_on_commit_callbacks(execute=True):
        asleep(draining)

    assert [(task, args[0]) for _, task, args in dispatched] == [(WAKE, "big")]
    copy = Replica.objects.get(pk=draining)
    assert copy.state == "sleeping" and not copy.wake_when_asleep
    assert sleep.wake_deployment("big", reason=dispatched[0][2][1]) == [draining]
    assert Replica.objects.get(pk=draining).state == "waking", "the copy woke on node2, as any sleeping one"
    assert Replica.objects.filter(deployment__name="big").count() == 1 and invariant_holds()


def test_a_draining_replica_leaving_otherwise_stops_being_waited_for(two_nodes, dispatched, rq):
    _, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0)
    draining = serving_on(home, "big")
    sleep.sleep_replica(draining, reason="idle")
    assert sleep.wake_deployment("big", reason="a request arrived") == [draining]
    assert Replica.objects.get(pk=draining).wake_when_asleep

    reports.report(draining, {"event": "failed", "reason": "killed"})

    assert not Replica.objects.get(pk=draining).wake_when_asleep, "a later sleep of it wakes nothing by itself"


def test_a_small_model_loads_from_disk_as_before_while_its_replica_drains(two_nodes, dispatched, rq):
    _, home = two_nodes
    deploy("small", load_s=0.5, wake_s=0.1, max_wait_s=5.0)
    draining = serving_on(home, "small")
    sleep.sleep_replica(draining, reason="idle")

    (fresh,) = sleep.wake_deployment("small", reason="a request arrived")

    assert fresh != draining and Replica.objects.get(pk=fresh).state == "pending", "a new one, loading from disk"
    assert not Replica.objects.get(pk=draining).wake_when_asleep
    assert not Event.objects.filter(reason__contains=WAITING_FOR_DRAIN).exists()


# -- fast disk: a new replica loads as before ------------------------------------------------------


def test_it_loads_from_disk_as_before_when_the_disk_load_is_the_faster(two_nodes, dispatched, rq):
    _, home = two_nodes
    deploy("small", load_s=0.5, wake_s=0.1, max_wait_s=5.0)
    copy = copy_asleep_on(home, "small")
    serving_on(home, "a"), serving_on(home, "b")

    (fresh,) = sleep.wake_deployment("small", reason="a request arrived")

    assert fresh != copy and Replica.objects.get(pk=copy).state == "sleeping"
    placed = Replica.objects.get(pk=fresh)
    assert placed.state == "pending" and placed.node.name == "node1", "a new replica, loading from disk on node1"
    assert not PreemptionIntent.objects.exists() and the_rule_said("small") == []
    assert Replica.objects.filter(state="serving").count() == 2, "nobody preempted"
    assert invariant_holds()


@pytest.mark.parametrize(
    ("weight_bytes", "wakes"),
    [(16 * 10**9, True), (10 * MiB, False)],
    ids=["8 s from disk against 0.8 s from RAM", "a tiny model"],
)
def test_without_measured_times_it_decides_on_the_planners_estimate_from_the_weights(
    two_nodes, dispatched, rq, weight_bytes, wakes
):
    _, home = two_nodes
    deployment = deploy("unmeasured", weight_bytes=weight_bytes, max_wait_s=1.0)
    copy = copy_asleep_on(home, "unmeasured")
    serving_on(home, "a"), serving_on(home, "b")

    # config.toml's [hardware]: 2 GB/s from disk, 20 GB/s from CPU RAM, as the planner assumes.
    times = sleep.reload_times(deployment)
    assert times.load_s == pytest.approx(weight_bytes / 2e9) and times.wake_s == pytest.approx(weight_bytes / 20e9)
    assert not times.load_measured and not times.wake_measured

    (woken,) = sleep.wake_deployment("unmeasured", reason="a request arrived")

    assert (woken == copy) is wakes
    said = the_rule_said("unmeasured")
    if wakes:
        assert len(said) == 1 and "8 s (estimated from its bytes)" in said[0].reason, said
        assert PreemptionIntent.objects.get().gpu_id == home.pk
    else:
        assert said == [] and Replica.objects.get(pk=woken).node.name == "node1"


# -- where the rule does not change the choice --------------------------------------------------------


def test_a_copy_that_fits_on_its_node_is_promoted_with_no_word_of_the_rule(two_nodes, dispatched, rq):
    _, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0)
    copy = copy_asleep_on(home, "big")

    assert sleep.wake_deployment("big", reason="a request arrived") == [copy]

    assert Replica.objects.get(pk=copy).state == "waking" and not PreemptionIntent.objects.exists()
    assert the_rule_said("big") == []


def test_a_copy_whose_node_can_never_make_room_loads_from_disk_after_all(two_nodes, dispatched, rq):
    _, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0)
    copy = copy_asleep_on(home, "big")
    serving_on(home, "p", popular=True), serving_on(home, "q", popular=True)  # never preempted

    (fresh,) = sleep.wake_deployment("big", reason="a request arrived")

    assert fresh != copy and Replica.objects.get(pk=fresh).node.name == "node1"
    assert Replica.objects.get(pk=copy).state == "sleeping"
    assert not PreemptionIntent.objects.exists() and the_rule_said("big") == []
    assert GPU.objects.get(pk=home.pk).wake_lock_holder_id is None, "the attempt left no lock behind"
    assert invariant_holds()


def test_with_a_replica_awake_a_missing_one_loads_from_disk_as_before(two_nodes, dispatched, rq):
    free, home = two_nodes
    deploy("big", load_s=30.0, wake_s=2.0)
    copy = copy_asleep_on(home, "big")
    serving_on(home, "a"), serving_on(home, "b")
    serving_on(free, "big")  # requests are served meanwhile: more replicas are a matter of capacity
    Deployment.objects.filter(name="big").update(replicas_wanted=2)

    (fresh,) = sleep.wake_deployment("big", reason="a request arrived")

    assert fresh != copy and Replica.objects.get(pk=fresh).node.name == "node1"
    assert not PreemptionIntent.objects.exists() and the_rule_said("big") == []


# -- the decision, pure ---------------------------------------------------------------------------


def test_wake_or_load_is_prefer_wake_with_its_reason():
    slow = fairness.wake_or_load(fairness.ReloadTimes(8.0, 0.8, load_measured=True), max_wait_s=1.0)
    assert slow.wake and slow.reason == (
        "a load from disk takes 8 s (measured), longer than a wake from CPU RAM of 0.8 s (estimated from its "
        "bytes) after a fair wait of at most 1 s (max_wait)"
    )
    fast = fairness.wake_or_load(fairness.ReloadTimes(1.5, 0.8), max_wait_s=1.0)
    assert not fast.wake and "no longer than" in fast.reason
    assert not fairness.wake_or_load(fairness.ReloadTimes(2.0, 1.0), max_wait_s=1.0).wake, "a tie loads from disk"
