"""The fair wake path (seed 001) on one virtual GPU that fits two of three deployments:
the intent and the wake lock, the fairness wait, LRU victims, failures with a reason, two wakes
at once, lock takeover, and the thrash check; and the targeting by cost: the GPU whose
victims are cheapest, victims that serve nothing preempted at once, a busy one waited for. No
processes: the preempt task's orchestration runs here on a fake clock, and what replica
processes would report (their requests in flight, in Redis) is fed in."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from gpuportal.wire.requestqueue import processing_key
from inference.devices import virtual_gpus
from scheduling.metrics import PREEMPTIONS
from scheduling.models import GPU, Deployment, Event, Occupant, PreemptionIntent, Replica
from scheduling.services import preemption, reports, sleep
from scheduling.services import replicas as replica_services
from scheduling.services import requests as request_services
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create, scale
from scheduling.services.errors import CannotPlace
from scheduling.services.nodes import register_node
from tests.support.deployments import MiB, asleep, invariant_holds, serve
from tests.support.factories import NO_OVERHEAD

PREEMPT, WAKE, TO_CACHE = "scheduling.tasks.preempt", "scheduling.tasks.wake", "inference.tasks.replica_to_cache"
LONG_AGO = timedelta(hours=1)


def busy(*replica_ids: str) -> None:
    """Each replica has taken a request and not finished it: the id sits in its processing list,
    as a replica's take leaves it (gpuportal.wire.requestqueue)."""
    client = request_services.queue().redis
    for replica_id in replica_ids:
        client.lpush(processing_key(replica_id), f"in-flight-on-{replica_id[:8]}")


def assert_not_over_committed() -> None:
    for gpu in GPU.objects.prefetch_related("occupants"):
        used = sum(o.reserved_bytes for o in gpu.occupants.all())
        assert used <= gpu.total_bytes and gpu.available_bytes == gpu.total_bytes - used, gpu
    assert invariant_holds()


class FakeClock:
    """A monotonic clock that only moves when slept on; `on_tick` plays the rest of the world."""

    def __init__(self, on_tick: Callable[[float], None] | None = None, start: float = 1000.0):
        self.t, self.start, self.on_tick = start, start, on_tick

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.t += max(seconds, 0.01)
        assert_not_over_committed()  # invariant 1 at every step of the wait
        if self.on_tick:
            self.on_tick(self.t - self.start)


def deploy(name: str, replicas: int = 1, *, need: int = 400 * MiB, **spec) -> Deployment:
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=need)
    spec.setdefault("max_wait_s", 5.0)
    return create(
        DeploymentSpec(name=name, source="/srv/models/tiny", replicas=replicas, override_bytes=need, **spec),
        facts=facts,
    )


def serving(name: str, *, last_accessed: datetime | None = None, **spec) -> str:
    """A deployment with one replica serving for an hour (past any min_runtime unless asked)."""
    deployment = deploy(name, **spec)
    replica_id = deployment.replicas.get().id
    serve(replica_id)
    Replica.objects.filter(pk=replica_id).update(
        serving_since=timezone.now() - LONG_AGO, last_accessed=last_accessed or timezone.now() - LONG_AGO
    )
    return replica_id


@pytest.fixture
def one_gpu(db) -> GPU:
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    return GPU.objects.get()


@pytest.fixture
def rq():
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):
        client.delete(key)
    return request_services.queue()


def intents_of(replica_id: str) -> list[PreemptionIntent]:
    return list(PreemptionIntent.objects.filter(waiting_replica_id=replica_id).order_by("pk"))


def preempt_ids(dispatched) -> list[list[int]]:
    return [args[0] for queue, task, args in dispatched if task == PREEMPT and queue == "control"]


# -- the wake writes an intent and takes the lock -------------------------------------------------


def test_a_wake_that_does_not_fit_writes_an_intent_takes_the_wake_lock_and_evicts_no_one(one_gpu, dispatched, rq):
    a, b = serving("a"), serving("b")
    busy(a, b)  # so that the wake waits out max_wait (idle victims are preempted at once, below)
    deploy("c", replicas=0, max_wait_s=7)

    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    (intent,) = intents_of(waker)
    assert intent.status == "waiting" and intent.gpu_id == one_gpu.pk and intent.needed_bytes == 400 * MiB
    assert intent.deadline == intent.created_at + timedelta(seconds=7)
    one_gpu.refresh_from_db()
    assert one_gpu.wake_lock_holder_id == waker
    ttl = (one_gpu.wake_lock_expires_at - timezone.now()).total_seconds()
    assert settings.GPUPORTAL_WAKE_LOCK_TTL_S - 5 < ttl <= settings.GPUPORTAL_WAKE_LOCK_TTL_S
    assert Replica.objects.get(pk=waker).state == "pending" and Replica.objects.get(pk=waker).node is None
    assert {Replica.objects.get(pk=r).state for r in (a, b)} == {"serving"}, "nobody evicted on the spot"
    assert Event.objects.filter(kind="gpu.wake_lock", replica=waker, reason__startswith="wake lock taken by c").exists()
    assert Event.objects.filter(kind="preemption.intent", replica=waker, gpu="node1/0").exists()
    assert_not_over_committed()
    # Asking again while the wake is under way does not start a second one.
    assert sleep.wake_deployment("c", reason="another request") == [waker]
    assert PreemptionIntent.objects.count() == 1


def test_the_preempt_task_is_enqueued_on_the_control_queue_once_committed(
    one_gpu, dispatched, django_capture_on_commit_callbacks
):
    serving("a"), serving("b")
    deploy("c", replicas=0)

    with django_capture_on_commit_callbacks(execute=True):
        (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    assert preempt_ids(dispatched) == [[i.pk for i in intents_of(waker)]]
    assert not [task for _, task, _ in dispatched if task == TO_CACHE]


# -- the fairness wait -------------------------------------------------------------------------------


def test_a_voluntary_sleep_inside_max_wait_places_the_waker_without_preempting_anyone(one_gpu, dispatched, rq):
    a, b = serving("a"), serving("b")
    busy(a, b)  # victims with requests in flight get the whole max_wait
    deploy("c", replicas=0, max_wait_s=5)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")
    preempted_before = PREEMPTIONS._value.get()

    def world(elapsed: float) -> None:
        if elapsed >= 2 and Replica.objects.get(pk=b).state == "serving":
            sleep.sleep_replica(b, reason="slept after 300 s idle")
            asleep(b)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == ()
    assert "freed voluntarily" in outcome.reason and clock.t - clock.start < 5, "before the deadline"
    placed = Replica.objects.get(pk=waker)
    assert placed.state == "pending" and placed.node.name == "node1"
    assert Replica.objects.get(pk=a).state == "serving"
    assert PREEMPTIONS._value.get() == preempted_before
    assert not Event.objects.filter(kind="preemption.victim").exists()
    assert {i.status for i in intents_of(waker)} == {"satisfied"}
    one_gpu.refresh_from_db()
    assert one_gpu.wake_lock_holder is None and one_gpu.wake_lock_expires_at is None
    assert Event.objects.filter(kind="gpu.wake_lock", reason__startswith="wake lock released by c").exists()
    assert_not_over_committed()


def test_at_the_deadline_the_least_recently_used_eligible_occupant_is_preempted_then_the_waker_placed(
    one_gpu, dispatched, rq
):
    now = timezone.now()
    older = serving("a", last_accessed=now - timedelta(minutes=30))
    newer = serving("b", last_accessed=now - timedelta(minutes=1))
    busy(older, newer)
    deploy("c", replicas=0, max_wait_s=5)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")
    preempted_before = PREEMPTIONS._value.get()
    seen: dict[str, float] = {}

    def world(elapsed: float) -> None:
        # The victim's process: drains for a moment, then reports its weights in CPU RAM.
        if Replica.objects.get(pk=older).state == "draining":
            seen.setdefault("draining", elapsed)
            if elapsed - seen["draining"] >= 0.5:
                asleep(older)
        assert Replica.objects.get(pk=waker).node is None or "draining" in seen, "no placement before the victim"

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (older,), outcome
    assert seen["draining"] >= 5, "preempted only once max_wait had passed"
    assert PREEMPTIONS._value.get() == preempted_before + 1
    victim_event = Event.objects.get(kind="preemption.victim")
    # Both reload as fast (same weights): the cost order is least recently used first.
    assert victim_event.replica == older and "cheapest to lose eligible occupant" in victim_event.reason
    assert "idle since" in victim_event.reason and "reloads in" in victim_event.reason
    assert Event.objects.filter(replica=older, reason__startswith="preempted for c: ").exists()
    assert Replica.objects.get(pk=older).state == "sleeping" and Replica.objects.get(pk=newer).state == "serving"
    (intent,) = intents_of(waker)
    assert intent.status == "satisfied" and intent.victim_id == older
    placed = Replica.objects.get(pk=waker)
    assert placed.state == "pending" and placed.node.name == "node1"
    assert Event.objects.filter(kind="preemption.outcome", replica=waker, after__status="satisfied").exists()
    assert_not_over_committed()
    # The waker's process loads and serves; the wake-time histogram sees it.
    serve(waker)
    assert Replica.objects.get(pk=waker).state == "serving"


def test_when_every_occupant_is_popular_or_within_min_runtime_the_wake_fails_and_its_requests_end_with_the_reason(
    one_gpu, dispatched, rq
):
    serving("a", popular=True)
    young = serving("b", min_runtime_s=600)
    Replica.objects.filter(pk=young).update(serving_since=timezone.now())
    deploy("c", replicas=0, max_wait_s=2)

    request = request_services.submit("c", kind="generate", input="hi", params={}, owner="1")
    assert request.status == "waking"
    (waker,) = Replica.objects.filter(deployment__name="c").values_list("id", flat=True)

    clock = FakeClock()
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "failed"
    assert "all occupants of gpu node1/0 are popular or within min_runtime" in outcome.reason
    ended = rq.get(request.id)
    assert ended.status == "failed" and "all occupants of gpu node1/0 are popular or within min_runtime" in ended.error
    assert Replica.objects.get(pk=waker).state == "failed", "a waker that got no place is not left pending"
    assert {i.status for i in intents_of(waker)} == {"failed"}
    assert Replica.objects.filter(state="serving").count() == 2 and not Event.objects.filter(kind="preemption.victim")
    one_gpu.refresh_from_db()
    assert one_gpu.wake_lock_holder is None
    # The next request starts a fresh wake rather than finding a failed one in the way.
    assert request_services.submit("c", kind="generate", input="hi", params={}, owner="1").status == "waking"
    assert PreemptionIntent.objects.filter(status="waiting").count() == 1


def test_a_wake_refused_only_for_a_young_replica_tells_its_requests_when_to_ask_again(one_gpu, dispatched, rq):
    # Either one's leaving makes room: the sooner to settle, b, says when.
    young = [serving("a", min_runtime_s=600), serving("b", min_runtime_s=300)]
    Replica.objects.filter(pk__in=young).update(serving_since=timezone.now())
    deploy("c", replicas=0, max_wait_s=2)
    request = request_services.submit("c", kind="generate", input="hi", params={}, owner="1")
    (waker,) = Replica.objects.filter(deployment__name="c").values_list("id", flat=True)

    clock = FakeClock()
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    # About 300 s from b's serving_since, less the moments the test took: the wait was a fake one.
    ended = rq.get(request.id)
    assert outcome.status == "failed" and ended.status == "failed", outcome.reason
    assert ended.retry_after_s is not None and 290 <= ended.retry_after_s <= 300, ended.retry_after_s
    assert ended.error.endswith(f"; room in {ended.retry_after_s} s, once their min_runtime lapses"), ended.error


# Deep asleep, it holds nothing on the GPU and waits as itself all the same; its promotion starts
# a process from its node's host copy, which reports serving.
@pytest.mark.parametrize("deep", [False, True], ids=["asleep", "deep-asleep"])
def test_a_cached_replica_waits_as_itself_and_is_promoted_after_the_preemption(one_gpu, dispatched, deep):
    sleeper = serving("c")
    sleep.sleep_replica(sleeper, reason="test")
    asleep(sleeper)
    if deep:
        reports.report(sleeper, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})
    victim = serving("a")
    serving("b", last_accessed=timezone.now())
    assert GPU.objects.get().available_bytes < 400 * MiB

    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    before = "deep_sleeping" if deep else "sleeping"
    assert waker == sleeper and Replica.objects.get(pk=sleeper).state == before

    def world(elapsed: float) -> None:
        if Replica.objects.get(pk=victim).state == "draining":
            asleep(victim)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)
    assert outcome.status == "satisfied" and outcome.victims == (victim,)
    assert Replica.objects.get(pk=sleeper).state == "waking", "promoted from the CPU cache"
    reports.report(sleeper, {"event": "serving", "pid": 99} if deep else {"event": "woken"})
    assert Replica.objects.get(pk=sleeper).state == "serving"
    assert_not_over_committed()


def test_a_wake_short_of_room_has_the_longest_unused_sleeper_there_sleep_deeply_and_preempts_no_one(
    one_gpu, dispatched, django_capture_on_commit_callbacks
):
    from scheduling import tasks

    waker = serving("c", need=300 * MiB)
    old = serving("a", need=300 * MiB, last_accessed=timezone.now() - timedelta(hours=2))
    recent = serving("b", need=300 * MiB, last_accessed=timezone.now() - timedelta(minutes=5))
    for replica_id in (old, recent):
        sleep.sleep_replica(replica_id, reason="test")
        reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 300 * MiB}})
    sleep.sleep_replica(waker, reason="test")
    asleep(waker)
    dispatched.clear()

    # It needs 300 MiB and a 300 MiB context; two sleepers' contexts leave 424 MiB.
    with django_capture_on_commit_callbacks(execute=True):
        assert sleep.wake_deployment("c", reason="a request arrived") == [waker]

    (deepen,) = [args for queue, task, args in dispatched if task == "scheduling.tasks.deepen_sleepers"]
    assert deepen[0] == [old], "one sleeper's context covers the shortfall: the longest unused"
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.deepen_sleepers(*deepen) == [old]
    assert ("node.node1", "inference.tasks.replica_deepen", [old]) in dispatched
    reports.report(old, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})

    clock = FakeClock()
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)
    assert outcome.status == "satisfied" and outcome.victims == ()
    assert Replica.objects.get(pk=waker).state == "waking" and Replica.objects.get(pk=recent).state == "sleeping"
    assert clock.t - clock.start < 5.0, "placed before max_wait: the sleeper's memory came back at once"
    assert_not_over_committed()


def young_one_falls_asleep_during_the_wait(answer: dict[str, Any]) -> tuple[str, str, str, FakeClock]:
    """A waker (c) and, in its way, a replica inside its min_runtime (b): no victim. b falls asleep
    of its own accord during the wait (the idle sweep's early sleep), its sleep keeping a context
    there that leaves c too little room; 0.3 s after the wait is over, b's process answers the
    deep sleep it is told with `answer`. The node's CUDA context is known (300 MiB, measured by
    an earlier sleeper), so needs count it. (young, request, waker) and the wait's clock."""
    earlier = serving("z", need=100 * MiB)
    sleep.sleep_replica(earlier, reason="test")
    reports.report(earlier, {"event": "sleeping", "residual_bytes_by_id": {"0": 300 * MiB}})
    reports.report(earlier, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})
    young = serving("b", need=400 * MiB, min_runtime_s=600)
    Replica.objects.filter(pk=young).update(serving_since=timezone.now())
    deploy("c", replicas=0, need=500 * MiB, max_wait_s=5)
    request = request_services.submit("c", kind="generate", input="hi", params={}, owner="1")
    (waker,) = Replica.objects.filter(deployment__name="c").values_list("id", flat=True)
    answered = []

    def world(elapsed: float) -> None:
        state = Replica.objects.get(pk=young).state
        if elapsed >= 4 and state == "serving":
            sleep.sleep_replica(young, reason="idle, and its node has no room for the waker")
            reports.report(young, {"event": "sleeping", "residual_bytes_by_id": {"0": 300 * MiB}})
        elif elapsed >= 5.3 and state == "sleeping" and not answered:
            answered.append(answer)
            reports.report(young, answer)

    return young, request.id, waker, FakeClock(world)


def test_a_replica_that_fell_asleep_during_the_wait_sleeps_deeply_for_the_waker_rather_than_the_wake_failing(
    one_gpu, dispatched, rq
):
    # Its deep sleep gives the room back, a moment after the wait is over.
    young, request, waker, clock = young_one_falls_asleep_during_the_wait(
        {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB}
    )

    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (), outcome
    assert outcome.reason.startswith(f"placed once {young[:8]} slept deeply"), outcome.reason
    assert Replica.objects.get(pk=young).state == "deep_sleeping"
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert rq.get(request).status != "failed"
    assert Event.objects.filter(replica=young, reason__startswith="told to sleep deeply").exists()
    assert_not_over_committed()


def test_a_sleeper_whose_process_refuses_the_deep_sleep_is_not_waited_for(one_gpu, dispatched, rq):
    # Its node has no room for its host copy: its process refuses the deep sleep, and the wake goes
    # on at once (here: to fail, no one else being evictable) rather than wait out the grace for
    # room that is not coming.
    young, request, waker, clock = young_one_falls_asleep_during_the_wait(
        {"event": "error", "cmd": "deepen", "reason": "no room for its host copy"}
    )

    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "failed" and Replica.objects.get(pk=young).state == "sleeping", outcome
    assert clock.t - clock.start < 5 + 2, f"waited {clock.t - clock.start:.1f} s for a deep sleep refused"
    assert rq.get(request).status == "failed"


def test_a_wake_that_needs_more_than_its_victims_contexts_leave_has_them_sleep_deeply_rather_than_fail(
    one_gpu, dispatched, rq
):
    # The node's contexts measured at 300 MiB: a victim asleep keeps that much here, and the waker
    # (500 MiB and its own context) fits only once its victim has given the GPU all back.
    GPU.objects.update(context_bytes=300 * MiB)
    victim = serving("a", need=400 * MiB)
    busy(victim)
    deploy("c", replicas=0, need=500 * MiB, max_wait_s=5)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    def world(elapsed: float) -> None:
        replica = Replica.objects.get(pk=victim)
        if replica.state == "draining":
            reports.report(victim, {"event": "sleeping", "residual_bytes_by_id": {"0": 300 * MiB}})
        elif replica.state == "sleeping" and Event.objects.filter(
            replica=victim, reason__startswith="told to sleep deeply"
        ):
            reports.report(victim, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (victim,), outcome
    assert Replica.objects.get(pk=victim).state == "deep_sleeping"
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert_not_over_committed()


def test_a_wake_that_needs_an_idle_victim_besides_the_sleepers_contexts_preempts_it_at_once(
    one_gpu, dispatched, rq, django_capture_on_commit_callbacks
):
    # A sleeper's 200 MiB context (the node's, measured by its sleep), then an idle replica: the
    # waker needs more than the sleeper's deep sleep gives back, so the idle one goes too, and at
    # once (sleeping it cuts no one off), rather than after max_wait.
    asleep_ = serving("a", need=300 * MiB, last_accessed=timezone.now() - timedelta(hours=2))
    sleep.sleep_replica(asleep_, reason="test")
    reports.report(asleep_, {"event": "sleeping", "residual_bytes_by_id": {"0": 200 * MiB}})
    idle = serving("b", need=300 * MiB)
    deploy("c", replicas=0, need=400 * MiB, max_wait_s=30)
    assert GPU.objects.get().available_bytes == 324 * MiB
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    (intent,) = intents_of(waker)
    assert intent.deadline == intent.created_at, "its victim serves nothing: no max_wait"
    assert "preempting at once" in Event.objects.get(kind="preemption.intent", replica=waker).reason
    (deepen,) = [args for _, task, args in dispatched if task == "scheduling.tasks.deepen_sleepers"]
    assert deepen[0] == [asleep_]

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(pk__in=[asleep_, idle]):
            if replica.state == "draining":
                reports.report(replica.id, {"event": "sleeping", "residual_bytes_by_id": {"0": 200 * MiB}})
            elif replica.state == "sleeping" and Event.objects.filter(
                replica=replica.id, reason__startswith="told to sleep deeply"
            ):
                reports.report(replica.id, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})

    clock = FakeClock(world)
    outcome = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (idle,), outcome
    assert clock.t - clock.start < 30, "placed without waiting out max_wait"
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert_not_over_committed()


# -- targeting by cost, and when not to wait -------------------------------------------------------


def occupant(name: str, gpu: GPU, reserved: int, *, idle_for: timedelta = LONG_AGO) -> str:
    """A replica of a deployment made for it, serving for an hour on `gpu` alone (placed by hand,
    so that which GPU holds whom does not depend on placement's tie-breaking)."""
    from tests.support import factories as f

    deployment = Deployment.objects.filter(name=name).first() or deploy(name, replicas=0, need=reserved)
    replica = f.replica(
        deployment,
        gpu.node,
        state="serving",
        serving_since=timezone.now() - LONG_AGO,
        last_accessed=timezone.now() - idle_for,
    )
    f.occupy(replica, gpu, reserved)
    return replica.id


@pytest.fixture
def two_gpus(db) -> tuple[GPU, GPU]:
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    first, second = GPU.objects.order_by("index")
    return first, second


def test_victims_are_chosen_for_the_wakers_need_as_it_is_at_the_deadline_not_as_its_intent_was_written(
    two_gpus, dispatched, rq
):
    gpu, other = two_gpus
    now = timezone.now()
    older, newer = occupant("a", gpu, 300 * MiB), occupant("b", gpu, 300 * MiB)
    busy(older, newer)
    deploy("x", replicas=0, need=150 * MiB, dedicated=True)
    occupant("x", gpu, 150 * MiB)
    # The other GPU can make no room: a dedicated replica, and one inside its min_runtime.
    deploy("y", replicas=0, need=400 * MiB, dedicated=True)
    occupant("y", other, 400 * MiB)
    deploy("z", replicas=0, need=550 * MiB, min_runtime_s=600)
    young = occupant("z", other, 550 * MiB)
    Replica.objects.filter(pk=young).update(serving_since=now, gpu_mem_bytes_by_id={"1": 550 * MiB})
    deploy("c", replicas=0, need=500 * MiB, max_wait_s=5)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")
    (intent,) = intents_of(waker)
    assert intent.gpu_id == gpu.pk and intent.needed_bytes == 500 * MiB

    def world(elapsed: float) -> None:
        if elapsed >= 2 and Replica.objects.get(pk=young).state == "serving":
            # The node's first sleep measures its CUDA context, 150 MiB: from now on every new
            # replica there reserves it too, the waker's 500 MiB becoming 650.
            sleep.sleep_replica(young, reason="idle")
            reports.report(young, {"event": "sleeping", "residual_bytes_by_id": {"1": 150 * MiB}})
            # And a sleeps of its own accord: 574 MiB free, the 500 the intent says but not 650.
            sleep.sleep_replica(older, reason="idle")
            asleep(older)
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (newer,), outcome
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert_not_over_committed()


def test_a_wake_targets_the_gpu_whose_victims_are_idle_not_the_one_with_busy_replicas(two_gpus, dispatched, rq):
    busy_gpu, idle_gpu = two_gpus
    # One busy replica on the first GPU: placement's fewest-evictions targeting would pick it (one
    # eviction against two on the other GPU), and the wake would wait for its request to drain.
    hot = occupant("hot", busy_gpu, 800 * MiB)
    busy(hot)
    ages = {"w": 40, "x": 30, "y": 20, "z": 10}  # minutes idle
    idle = [occupant(name, idle_gpu, 230 * MiB, idle_for=timedelta(minutes=m)) for name, m in ages.items()]
    deploy("c", replicas=0, max_wait_s=30)

    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    (intent,) = intents_of(waker)
    assert intent.gpu_id == idle_gpu.pk and intent.needed_bytes == 400 * MiB
    assert intent.deadline == intent.created_at, "its victims serve nothing: no max_wait"
    said = Event.objects.get(kind="preemption.intent", replica=waker).reason
    assert "gpu node1/1, where making room costs least" in said and "serving no request" in said, said
    assert "preempting at once" in said, said

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and set(outcome.victims) == set(idle[:2]), outcome
    assert clock.t - clock.start < 1, "no fairness wait"
    assert Replica.objects.get(pk=hot).state == "serving", "the busy replica was left alone"
    assert {Replica.objects.get(pk=r).state for r in idle[2:]} == {"serving"}
    assert Occupant.objects.get(replica_id=waker).gpu_id == idle_gpu.pk
    assert_not_over_committed()


def test_a_wake_goes_where_sleepers_can_make_room_by_sleeping_deeply_rather_than_preempt_anyone(
    two_gpus, dispatched, rq, django_capture_on_commit_callbacks
):
    first, second = two_gpus
    idle = occupant("idle", first, 800 * MiB)  # serving no one for an hour: a cheap victim
    sleeper = occupant("asleep", second, 800 * MiB)
    Replica.objects.filter(pk=sleeper).update(state="sleeping", serving_since=None)
    deploy("waker", replicas=0, need=600 * MiB)  # nothing awake, nothing cached: a new replica
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        sleep.wake_deployment("waker", reason="a request arrived")

    (intent,) = PreemptionIntent.objects.all()
    assert intent.gpu_id == second.pk, "its sleeper's room, not the idle replica's"
    assert intent.deadline > intent.created_at, "it waits for the sleeper rather than preempt at once"
    (deepen,) = [args for _, task, args in dispatched if task == "scheduling.tasks.deepen_sleepers"]
    assert deepen[0] == [sleeper]
    assert Replica.objects.get(pk=idle).state == "serving"


def test_a_wake_whose_victims_serve_nothing_preempts_without_waiting_out_max_wait(one_gpu, dispatched, rq):
    now = timezone.now()
    older = serving("a", last_accessed=now - timedelta(minutes=30))
    newer = serving("b", last_accessed=now - timedelta(minutes=1))
    deploy("c", replicas=0, max_wait_s=60)
    seen: dict[str, float] = {}

    outcome = preemption.start(Deployment.objects.get(name="c"), reason="a request arrived")

    assert isinstance(outcome, preemption.Preempting) and "its victims serve no request" in outcome.reason
    (intent,) = intents_of(outcome.replica_id)
    assert intent.deadline == intent.created_at
    event = Event.objects.get(kind="preemption.intent", replica=outcome.replica_id)
    assert event.after["at_once"] is True and event.after["deadline"] == intent.created_at.isoformat()
    assert "its victims serve no request: preempting at once, without waiting out max_wait" in event.reason

    def world(elapsed: float) -> None:
        if Replica.objects.get(pk=older).state == "draining":
            seen.setdefault("draining", elapsed)
            asleep(older)

    clock = FakeClock(world)
    done = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert done.status == "satisfied" and done.victims == (older,), done
    assert seen["draining"] < 1, "preempted at once, not after the 60 s max_wait"
    assert Replica.objects.get(pk=newer).state == "serving"
    assert Replica.objects.get(pk=outcome.replica_id).node.name == "node1"
    assert_not_over_committed()


def test_a_busy_victim_still_gets_the_whole_max_wait(one_gpu, dispatched, rq):
    a, b = serving("a"), serving("b")
    busy(a)  # b serves nothing, but a alone would not make room: b is the victim...
    Replica.objects.filter(pk=b).update(last_accessed=timezone.now())
    deploy("c", replicas=0, need=700 * MiB, max_wait_s=4)  # ...a 700 MiB need: both must go

    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    (intent,) = intents_of(waker)
    assert intent.deadline == intent.created_at + timedelta(seconds=4), "one victim is busy: the whole max_wait"
    said = Event.objects.get(kind="preemption.intent", replica=waker).reason
    assert "waits up to its max_wait of 4 s" in said and "1 request(s) in flight" in said, said
    seen: dict[str, float] = {}

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            seen.setdefault(replica.id, elapsed)
            asleep(replica.id)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and set(outcome.victims) == {a, b}, outcome
    assert min(seen.values()) >= 4, "no one preempted before max_wait"
    assert_not_over_committed()


def test_a_cached_replica_is_woken_on_its_own_node(db, dispatched, rq):
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "1x1GiB", NO_OVERHEAD), virtual=True)
    near, far = GPU.objects.get(node__name="node1"), GPU.objects.get(node__name="node2")
    # c slept on node2: its weights are in node2's CPU RAM, so it wakes there, even though node1's
    # occupants serve nothing and node2's are busy (a new replica on node1 would load from disk).
    deploy("c", replicas=0, max_wait_s=3)
    sleeper = occupant("c", far, 300 * MiB)
    sleep.sleep_replica(sleeper, reason="test")
    asleep(sleeper)
    occupant("p", near, 400 * MiB), occupant("q", near, 400 * MiB)
    victim = occupant("a", far, 400 * MiB, idle_for=timedelta(minutes=30))
    other = occupant("b", far, 400 * MiB, idle_for=timedelta(minutes=1))
    busy(victim, other)

    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    assert waker == sleeper and Replica.objects.get(pk=sleeper).state == "sleeping"
    (intent,) = intents_of(waker)
    assert intent.gpu_id == far.pk and intent.deadline == intent.created_at + timedelta(seconds=3)
    assert near.pk not in {i.gpu_id for i in PreemptionIntent.objects.all()}

    def world(elapsed: float) -> None:
        if Replica.objects.get(pk=victim).state == "draining":
            asleep(victim)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([intent.pk], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (victim,), outcome
    promoted = Replica.objects.get(pk=sleeper)
    assert promoted.state == "waking" and promoted.node.name == "node2", "promoted from node2's CPU cache"
    assert Replica.objects.filter(deployment__name__in=("p", "q"), state="serving").count() == 2
    assert_not_over_committed()


@pytest.fixture
def two_nodes(db) -> tuple[list[GPU], list[GPU]]:
    """Two virtual nodes of two 1 GiB GPUs each: a 1.5 GiB need takes both GPUs of one node."""
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB", NO_OVERHEAD), virtual=True)
    return (
        list(GPU.objects.filter(node__name="node1").order_by("index")),
        list(GPU.objects.filter(node__name="node2").order_by("index")),
    )


def stuck_on_node1(how: str, gpu: GPU) -> str:
    """One small replica on node1 that fairness may not preempt: popular, or inside its min_runtime."""
    if how == "popular":
        deploy("hot", replicas=0, need=200 * MiB, popular=True)
        return occupant("hot", gpu, 200 * MiB)
    deploy("hot", replicas=0, need=200 * MiB, min_runtime_s=600)
    young = occupant("hot", gpu, 200 * MiB)
    Replica.objects.filter(pk=young).update(serving_since=timezone.now())
    return young


def wake_big_for_two_requests(rq) -> tuple[str, list[PreemptionIntent]]:
    """A deployment that needs two whole 1 GiB GPUs, woken by the first of two waiting requests
    (two victims are then not more than wait for it): its waker, and the intents it wrote."""
    deploy("big", replicas=0, need=1536 * MiB, max_wait_s=30)
    for _ in range(2):
        rq.submit("big", kind="generate", input="hi", params={}, owner="1")
    (waker,) = sleep.wake_deployment("big", reason="a request arrived")
    return waker, intents_of(waker)


@pytest.mark.parametrize("how", ["popular", "young"])
def test_a_wake_needing_two_whole_gpus_targets_the_node_fairness_can_empty_not_one_holding_a_replica_that_may_not_go(
    two_nodes, dispatched, rq, how
):
    (n1a, n1b), (n2a, n2b) = two_nodes
    # node1 has one GPU free and one small replica on the other: placement's targeting, which
    # counts every occupant as movable (and ties between nodes at random), may wait there for a
    # victim choose_victim cannot name. node2's two idle replicas can go.
    hot = stuck_on_node1(how, n1a)
    idle = [occupant("a", n2a, 400 * MiB, idle_for=timedelta(minutes=30)), occupant("b", n2b, 400 * MiB)]
    waker, intents = wake_big_for_two_requests(rq)

    assert {i.gpu_id for i in intents} == {n2a.pk, n2b.pk}
    assert {i.needed_bytes for i in intents} == {1024 * MiB}
    assert all(i.deadline == i.created_at for i in intents), "its victims serve nothing: no max_wait"
    said = Event.objects.filter(kind="preemption.intent", replica=waker).first().reason
    assert "whole gpus node2/0, node2/1, the GPUs of one node that fairness can empty" in said, said
    assert "no popular, dedicated or young occupant on them" in said and "serving no request" in said, said

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and set(outcome.victims) == set(idle), outcome
    assert Replica.objects.get(pk=hot).state == "serving", f"the {how} replica on node1 was left alone"
    assert set(Occupant.objects.filter(replica_id=waker).values_list("gpu_id", flat=True)) == {n2a.pk, n2b.pk}
    assert n1b.pk not in {i.gpu_id for i in PreemptionIntent.objects.all()}
    assert_not_over_committed()


def test_a_wake_needing_whole_gpus_empties_them_though_its_victims_asleep_would_keep_their_contexts(
    two_gpus, dispatched, rq
):
    # The node's contexts measured at 300 MiB: asleep, a victim keeps that much on its GPU, so
    # only its deep sleep empties the GPU; the waker needs both GPUs whole.
    GPU.objects.update(context_bytes=300 * MiB)
    first, second = two_gpus
    idle = {occupant("a", first, 400 * MiB, idle_for=timedelta(minutes=30)), occupant("b", second, 400 * MiB)}
    waker, intents = wake_big_for_two_requests(rq)

    assert {i.gpu_id for i in intents} == {first.pk, second.pk}
    assert all(i.deadline == i.created_at for i in intents), "its victims serve nothing: no max_wait"
    said = Event.objects.filter(kind="preemption.intent", replica=waker).first().reason
    assert "the GPUs of one node that fairness can empty" in said, said

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(pk__in=idle).select_related("deployment"):
            index = "0" if replica.deployment.name == "a" else "1"
            if replica.state == "draining":
                reports.report(replica.id, {"event": "sleeping", "residual_bytes_by_id": {index: 300 * MiB}})
            elif replica.state == "sleeping" and Event.objects.filter(
                replica=replica.id, reason__startswith="told to sleep deeply"
            ):
                reports.report(replica.id, {"event": "deep_sleeping", "host_copy_bytes": 10 * MiB})

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and set(outcome.victims) == idle, outcome
    assert set(Replica.objects.filter(pk__in=idle).values_list("state", flat=True)) == {"deep_sleeping"}
    assert set(Occupant.objects.filter(replica_id=waker).values_list("gpu_id", flat=True)) == {first.pk, second.pk}
    assert_not_over_committed()


def test_a_whole_gpu_target_with_more_victims_than_waiting_requests_falls_back_to_placements_targeting(
    two_nodes, dispatched, rq
):
    (n1a, _), (n2a, n2b) = two_nodes
    # The same cluster with one request waiting: emptying node2 would put two replicas to sleep
    # for it (and each must wake again), so fairness.choose_whole_gpus refuses and placement's
    # targeting decides (either node, at random), as before the whole-GPU rule.
    stuck_on_node1("popular", n1a)
    occupant("a", n2a, 400 * MiB), occupant("b", n2b, 400 * MiB)
    deploy("big", replicas=0, need=1536 * MiB, max_wait_s=30)
    rq.submit("big", kind="generate", input="hi", params={}, owner="1")

    (waker,) = sleep.wake_deployment("big", reason="a request arrived")

    said = Event.objects.filter(kind="preemption.intent", replica=waker).first().reason
    assert "placement with evictions would be" in said and "whole gpus" not in said, said
    assert len(intents_of(waker)) == 2


def test_enrich_weighs_reload_time_and_requests_in_flight_and_without_redis_assumes_a_busy_victim(
    one_gpu, dispatched, rq, settings, monkeypatch
):
    settings.GPUPORTAL_H2D_BYTES_PER_S = 5 * MiB
    a, b = serving("a"), serving("b")
    busy(a)
    request_services.queue().redis.lpush(processing_key(a), "another")
    stamp = timezone.now().replace(microsecond=0)
    request_services.queue().redis.set(f"gp:last:{b}", str(stamp.timestamp()))

    from scheduling import ledger

    views = {o.replica_id: o for o in preemption.enrich(ledger.snapshot()).gpus[one_gpu.pk].occupants}
    assert views[a].reload_s == pytest.approx(2.0), "10 MiB of weights at 5 MiB/s"
    assert (views[a].in_flight, views[b].in_flight) == (2, 0)
    assert views[b].last_accessed == stamp, "the last request Redis knows of, newer than the row's"

    def unreachable():
        raise redis.ConnectionError("Redis is down")

    monkeypatch.setattr(request_services.queue().redis, "pipeline", lambda **kw: unreachable())
    views = {o.replica_id: o for o in preemption.enrich(ledger.snapshot()).gpus[one_gpu.pk].occupants}
    assert views[a].in_flight is None and views[b].in_flight is None and views[a].reload_s == pytest.approx(2.0)
    deploy("c", replicas=0, max_wait_s=5)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")
    (intent,) = intents_of(waker)
    assert intent.deadline == intent.created_at + timedelta(seconds=5), "activity unknown: the whole max_wait"


# -- the wake lock -----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_deployments_waking_at_once_for_the_same_gpu_one_holds_the_wake_lock_the_other_waits(dispatched):
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    serving("a"), serving("b")
    deploy("c", replicas=0)
    deploy("d", replicas=0)
    barrier = threading.Barrier(2)
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def wake(name: str) -> None:
        try:
            barrier.wait()
            results[name] = sleep.wake_deployment(name, reason="a request arrived")
            assert_not_over_committed()
        except BaseException as err:  # reported below: a thread's exception is otherwise lost
            errors.append(err)
        finally:
            connection.close()

    threads = [threading.Thread(target=wake, args=(name,)) for name in ("c", "d")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors, errors
    (holder_name,) = [name for name, ids in results.items() if ids]
    (waiter_name,) = [name for name, ids in results.items() if not ids]
    (holder,) = results[holder_name]
    gpu = GPU.objects.get()
    assert gpu.wake_lock_holder_id == holder
    assert PreemptionIntent.objects.get().waiting_replica_id == holder, "only one wake in progress on the GPU"
    waited = Event.objects.get(kind="gpu.wake_lock", deployment=waiter_name)
    assert f"waiting for the wake lock of gpu node1/0 held by {holder_name} ({holder[:8]})" in waited.reason
    assert (("control", WAKE, [waiter_name, "a request arrived"])) in dispatched, "it asks again later"
    assert not Replica.objects.filter(deployment__name=waiter_name).exists()
    assert_not_over_committed()

    # Once the holder's wake is done (here: it fails, everyone being young), the waiter gets the lock.
    Replica.objects.filter(state="serving").update(serving_since=timezone.now())
    Deployment.objects.update(min_runtime_s=600)
    clock = FakeClock()
    assert (
        preemption.run_preemption([i.pk for i in intents_of(holder)], clock=clock, sleep=clock.sleep).status == "failed"
    )
    (second,) = sleep.wake_deployment(waiter_name, reason="a request arrived")
    assert GPU.objects.get().wake_lock_holder_id == second and second != holder


def test_a_retried_wake_that_can_no_longer_fit_ends_its_waiting_requests_saying_why(one_gpu, dispatched, rq):
    # The request waits while another wake holds the GPU's lock; meanwhile dedicated replicas
    # took the GPU, so the wake asked again can never place it.
    from scheduling import tasks

    deploy("c", replicas=0)
    waiting = rq.submit("c", kind="generate", input="hi", params={}, owner="1")
    serving("a", dedicated=True), serving("b", dedicated=True)

    assert tasks.wake("c", "a request arrived") == []

    ended = rq.get(waiting.id)
    assert ended.status == "failed" and ended.error_kind == "placement", ended
    assert ended.error.startswith("cannot wake c: cannot place c (400.0 MiB): node1: "), ended.error
    assert "(dedicated)" in ended.error


def test_memory_freed_on_a_gpu_another_wake_holds_goes_to_that_wake_not_to_other_placements(one_gpu, dispatched):
    older = serving("a")
    serving("b")
    deploy("c", replicas=0)
    deploy("d", replicas=0)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")
    version = GPU.objects.get().version
    asleep_reason = "put to sleep by its operator"
    sleep.sleep_replica(older, reason=asleep_reason)
    asleep(older)  # 400 MiB free now, on the GPU c's wake holds

    assert sleep.wake_deployment("d", reason="a request arrived") == [], "d waits for the lock instead"
    with pytest.raises(CannotPlace, match="another wake holds its lock"):
        scale("d", 1, reason="an operator scales up")
    assert not Replica.objects.filter(deployment__name="d", node__isnull=False).exists()

    clock = FakeClock()
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == () and "freed voluntarily" in outcome.reason
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert GPU.objects.get().version > version
    assert_not_over_committed()


def test_taking_a_wake_lock_bumps_the_gpu_version_so_a_plan_made_before_it_conflicts(one_gpu, dispatched):
    serving("a"), serving("b")
    deploy("c", replicas=0)
    before = GPU.objects.get().version

    sleep.wake_deployment("c", reason="a request arrived")

    after = GPU.objects.get()
    assert after.wake_lock_holder_id is not None and after.version == before + 1
    preemption.start(Deployment.objects.get(name="c"), reason="asked again")  # a renewal by the same waker
    assert GPU.objects.get().version == before + 1, "renewing its own lock bumps nothing"


def test_when_freed_memory_is_taken_before_the_waker_is_placed_victims_are_chosen_again(one_gpu, dispatched):
    now = timezone.now()
    older = serving("a", last_accessed=now - timedelta(minutes=30))
    newer = serving("b", last_accessed=now - timedelta(minutes=1))
    deploy("c", replicas=0, max_wait_s=1)
    (waker,) = sleep.wake_deployment("c", reason="a request arrived")

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)
            if replica.id == older:
                # The survivor reports it holds more than it reserved: the room freed for c is gone.
                survivor = Replica.objects.select_related("node", "deployment").get(pk=newer)
                replica_services.reserve_exactly(survivor, {0: 700 * MiB}, reason="measured more than reserved")

    clock = FakeClock(world)
    outcome = preemption.run_preemption([i.pk for i in intents_of(waker)], clock=clock, sleep=clock.sleep)

    assert outcome.status == "satisfied" and outcome.victims == (older, newer), outcome
    assert Replica.objects.get(pk=waker).node.name == "node1"
    assert Event.objects.filter(kind="preemption.victim", replica=newer).exists()
    assert_not_over_committed()


def test_the_admin_says_a_wake_waits_for_a_lock_rather_than_that_it_is_awake(one_gpu, dispatched, admin_client):
    from django.contrib.messages import get_messages

    serving("a"), serving("b")
    deploy("c", replicas=0)
    deploy("d", replicas=0)
    sleep.wake_deployment("c", reason="a request arrived")

    response = admin_client.post(
        "/admin/scheduling/deployment/",
        {"_selected_action": [Deployment.objects.get(name="d").pk], "action": "wake_deployments"},
        follow=True,
    )

    texts = [str(m) for m in get_messages(response.wsgi_request)]
    assert any("waiting for another wake's lock" in t for t in texts), texts


@pytest.mark.parametrize("how", ["expired", "holder failed", "holder deleted"])
def test_a_wake_lock_whose_holder_died_or_expired_is_taken_over_with_an_event(one_gpu, dispatched, how):
    serving("a"), serving("b")
    deploy("c", replicas=0)
    deploy("d", replicas=0)
    (dead,) = sleep.wake_deployment("c", reason="a request arrived")
    # The waker's worker was SIGKILLed: nothing renews the lock or runs its preempt task.
    if how == "expired":
        GPU.objects.update(wake_lock_expires_at=timezone.now() - timedelta(seconds=1))
    elif how == "holder failed":
        Replica.objects.filter(pk=dead).update(state="failed")
    else:
        PreemptionIntent.objects.filter(waiting_replica_id=dead).delete()
        Replica.objects.filter(pk=dead).delete()

    (taker,) = sleep.wake_deployment("d", reason="a request arrived")

    assert GPU.objects.get().wake_lock_holder_id == taker
    takeover = Event.objects.get(kind="gpu.wake_lock", reason__startswith="wake lock taken over by d")
    expected = {"expired": "expired at", "holder failed": "is failed", "holder deleted": "holder is gone"}[how]
    assert expected in takeover.reason
    assert not PreemptionIntent.objects.filter(waiting_replica_id=dead, status="waiting").exists()
    if how == "expired":
        assert Replica.objects.get(pk=dead).state == "failed", "the abandoned waker is not left pending"


def test_a_wake_whose_preempt_task_died_starts_over_once_its_lock_lapsed(one_gpu, dispatched):
    serving("a"), serving("b")
    deploy("c", replicas=0)
    (dead,) = sleep.wake_deployment("c", reason="a request arrived")
    GPU.objects.update(wake_lock_expires_at=timezone.now() - timedelta(seconds=1))

    (again,) = sleep.wake_deployment("c", reason="a request arrived")

    assert again != dead and Replica.objects.get(pk=dead).state == "failed"
    assert intents_of(dead)[0].status == "cancelled" and intents_of(again)[0].status == "waiting"


# -- what stays as it was ------------------------------------------------------------------------------


def test_a_gpu_full_of_dedicated_replicas_refuses_the_wake_at_once(one_gpu, dispatched):
    serving("a", dedicated=True), serving("b", dedicated=True)
    deploy("c", replicas=0)

    with pytest.raises(Exception, match="cannot place c"):
        sleep.wake_deployment("c", reason="a request arrived")
    assert not PreemptionIntent.objects.exists() and GPU.objects.get().wake_lock_holder is None


def test_the_wake_and_sleep_histograms_observe_reported_transitions(one_gpu, dispatched):
    from scheduling.metrics import SLEEP_SECONDS, WAKE_SECONDS

    replica_id = serving("a")

    def count(histogram) -> float:
        return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))

    wakes, sleeps = count(WAKE_SECONDS), count(SLEEP_SECONDS)
    sleep.sleep_replica(replica_id, reason="test")
    asleep(replica_id)
    sleep.wake_replica(replica_id, reason="test")
    reports.report(replica_id, {"event": "woken"})
    assert count(SLEEP_SECONDS) == sleeps + 1 and count(WAKE_SECONDS) == wakes + 1


# -- the thrash check ------------------------------------------------------------------------------------


def test_two_deployments_requested_alternately_faster_than_min_runtime_swap_at_most_once_per_min_runtime(
    one_gpu, dispatched
):
    min_runtime = 10.0
    base = timezone.now()
    clock = FakeClock()

    def wall() -> datetime:
        return base + timedelta(seconds=clock.t - clock.start)

    for name in ("x", "y"):
        deploy(name, replicas=0, need=700 * MiB, min_runtime_s=min_runtime, max_wait_s=1, idle_timeout_s=0)
    (first,) = sleep.wake_deployment("x", reason="first request")
    serve(first)
    Replica.objects.filter(pk=first).update(serving_since=wall())

    def world(elapsed: float) -> None:
        for replica in Replica.objects.filter(state="draining"):
            asleep(replica.id)  # a victim's process, quick to park its weights

    clock.on_tick = world
    swaps: list[float] = []
    while clock.t - clock.start < 60:
        for name in ("y", "x"):  # each asked for every 0.5 s, faster than min_runtime
            ids = sleep.wake_deployment(name, reason="a request arrived")
            waiting = [i.pk for i in PreemptionIntent.objects.filter(status="waiting").order_by("pk")]
            if waiting:
                outcome = preemption.run_preemption(waiting, clock=clock, sleep=clock.sleep, now=wall)
                if outcome.status == "satisfied":
                    swaps.append(clock.t - clock.start)
                    placed = Replica.objects.get(pk=outcome.replica_id)
                    reports.report(placed.id, {"event": "woken" if placed.state == "waking" else "serving"})
                    Replica.objects.filter(pk=placed.id).update(serving_since=wall())
            elif ids:
                raise AssertionError(f"{name} was placed without a swap while the GPU fits only one: {ids}")
            clock.sleep(0.5)
            assert Replica.objects.filter(state="serving").count() <= 1

    assert swaps, "some swap happens once min_runtime has passed"
    gaps = [later - earlier for earlier, later in itertools.pairwise(swaps)]
    assert all(gap >= min_runtime for gap in gaps), swaps
    assert len(swaps) <= 60 / min_runtime + 1
    assert_not_over_committed()
