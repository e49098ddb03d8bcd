"""A stall is not a death: a node is written off only when it was silent while the control plane
could hear it, and its own lease in Redis has expired too."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.wire import node_lease, replies
from inference.devices import virtual_gpus
from scheduling import locks
from scheduling.core.liveness import Beat, Hearing, hear, judge
from scheduling.models import Event, Node
from scheduling.services import nodes
from tests.support.factories import NO_OVERHEAD

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
TIMEOUT_S, STALL_S = 20.0, 10.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# -- the decision, pure ---------------------------------------------------------------------------


def test_a_node_silent_past_the_timeout_while_the_control_plane_listened_is_lost():
    heard = hear(Hearing(at(25), None), at(30), STALL_S)

    (verdict,) = judge([Beat("quiet", at(5)), Beat("alive", at(28))], heard.hearing, at(30), TIMEOUT_S, leased=())

    assert heard.deaf_for_s is None
    assert (verdict.name, verdict.silent_s, verdict.lost) == ("quiet", 25.0, True)


def test_silence_while_the_control_plane_heard_nothing_does_not_count():
    # The last sweep ran at 0 s; PostgreSQL froze; the next sweep runs at 30 s.
    heard = hear(Hearing(at(0), None), at(30), STALL_S)

    assert heard.deaf_for_s == 30.0 and heard.hearing.heard_since == at(30)
    assert judge([Beat("box", at(-1))], heard.hearing, at(30), TIMEOUT_S, leased=()) == []
    # Sweeps on time from then on: the node that really is gone is lost a timeout after hearing came back.
    later = heard.hearing
    for second in range(35, 55, 5):
        later = hear(later, at(second), STALL_S).hearing
        assert judge([Beat("box", at(-1))], later, at(second), TIMEOUT_S, leased=()) == []
    later = hear(later, at(55), STALL_S).hearing
    assert [v.name for v in judge([Beat("box", at(-1))], later, at(55), TIMEOUT_S, leased=())] == ["box"]


def test_a_node_whose_lease_is_held_is_alive_though_its_heartbeats_are_not_recorded():
    heard = hear(Hearing(at(25), None), at(30), STALL_S)

    (verdict,) = judge([Beat("box", at(0))], heard.hearing, at(30), TIMEOUT_S, leased={"box"})

    assert verdict.leased and not verdict.lost


@given(
    gaps=st.lists(st.floats(min_value=0.5, max_value=40), min_size=1, max_size=30),
    last_beat=st.floats(min_value=-60, max_value=0),
)
def test_no_node_is_lost_sooner_than_a_timeout_after_the_control_plane_could_hear_again(gaps, last_beat):
    hearing, now = Hearing(None, None), at(0)
    regained = None  # the books began with the control plane hearing
    for gap in gaps:
        now += timedelta(seconds=gap)
        heard = hear(hearing, now, STALL_S)
        hearing = heard.hearing
        if heard.deaf_for_s is not None:
            regained = now
        lost = [v for v in judge([Beat("box", at(last_beat))], hearing, now, TIMEOUT_S, leased=()) if v.lost]
        since = at(last_beat) if regained is None else max(at(last_beat), regained)
        assert bool(lost) == ((now - since).total_seconds() > TIMEOUT_S)


SWEEP_EVERY_S = 5.0


@given(
    heartbeat_ms=st.integers(min_value=500, max_value=10_000),
    outage_ms=st.integers(min_value=0, max_value=60_000),
    # When, within a sweep's interval, Redis died after one sweep and the first sweep ran after it.
    swept_before_ms=st.integers(min_value=0, max_value=int(SWEEP_EVERY_S * 1000)),
    swept_after_ms=st.integers(min_value=0, max_value=int(SWEEP_EVERY_S * 1000)),
    # The last renewal Redis kept: the agent renews once a beat, and a file synced every second
    # loses the last second's writes when Redis is killed.
    renewed_before_ms=st.integers(min_value=0, max_value=11_000),
)
def test_a_redis_outage_long_enough_to_lapse_a_lease_is_read_as_a_stall(
    heartbeat_ms, outage_ms, swept_before_ms, swept_after_ms, renewed_before_ms
):
    heartbeat_s = heartbeat_ms / 1000
    renewed_before_s = min(renewed_before_ms / 1000, heartbeat_s + 1)
    timeout_s = max(TIMEOUT_S, STALL_S + heartbeat_s + 1)  # a timeout that leaves the lease its room
    ttl_s = node_lease.ttl_s(heartbeat_s, timeout_s, STALL_S)
    killed = at(0)
    back = killed + timedelta(milliseconds=outage_ms)
    sweep = back + timedelta(milliseconds=swept_after_ms)
    # Redis drops a key once its clock passes the expiry.
    lapsed = sweep > killed - timedelta(seconds=renewed_before_s) + timedelta(seconds=ttl_s)

    heard = hear(Hearing(killed - timedelta(milliseconds=swept_before_ms), None), sweep, STALL_S)

    # The sweep runs over Redis, so the outage is a gap between two sweeps: either the lease is
    # still held when the sweep reads it, or the gap is a stall and silence counts afresh.
    assert not lapsed or heard.deaf_for_s is not None
    assert ttl_s <= timeout_s, "a dead node is written off no later than its heartbeats alone would have it"


# -- the sweep ------------------------------------------------------------------------------------


@pytest.fixture
def box(db) -> str:
    nodes.register_node("box", virtual_gpus("box", "1x1GiB", NO_OVERHEAD), virtual=True)
    node_lease.release(replies.client(settings.REDIS_URL), "box")
    return "box"


def test_a_sweep_after_a_stall_writes_off_no_node_and_says_why(box):
    Node.objects.filter(name=box).update(last_heartbeat=at(-1))
    assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S, stall_s=STALL_S) == []

    assert nodes.expire_heartbeats(now=at(30), timeout_s=TIMEOUT_S, stall_s=STALL_S) == []

    assert Node.objects.get(name=box).status == Node.Status.ONLINE
    stalled = Event.objects.get(kind=Event.Kind.CONTROL_STALLED)
    assert stalled.reason.startswith("no heartbeat sweep for 30 s") and stalled.after == {"deaf_for_s": 30.0}
    for second in range(35, 51, 5):
        assert nodes.expire_heartbeats(now=at(second), timeout_s=TIMEOUT_S, stall_s=STALL_S) == []
    assert nodes.expire_heartbeats(now=at(55), timeout_s=TIMEOUT_S, stall_s=STALL_S) == [box]
    offline = Event.objects.get(kind=Event.Kind.NODE_OFFLINE)
    assert offline.reason == "no heartbeat for 25 s (timeout 20 s)" and offline.after["lease"] == "expired"


def test_a_node_that_renews_its_lease_is_not_written_off_until_the_lease_expires(box):
    client = replies.client(settings.REDIS_URL)
    Node.objects.filter(name=box).update(last_heartbeat=at(-45))
    node_lease.renew(client, box, ttl_s=60, epoch=node_lease.current_epoch(client, box))
    try:
        assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S) == []
        assert Node.objects.get(name=box).status == Node.Status.ONLINE
        assert not Event.objects.filter(kind=Event.Kind.NODE_OFFLINE).exists()
    finally:
        node_lease.release(client, box)

    assert nodes.expire_heartbeats(now=at(1), timeout_s=TIMEOUT_S) == [box]


@pytest.mark.django_db(transaction=True)
def test_a_sweep_while_another_holds_the_hearing_judges_nothing():
    nodes.register_node("held", virtual_gpus("held", "1x1GiB", NO_OVERHEAD), virtual=True)
    node_lease.release(replies.client(settings.REDIS_URL), "held")
    Node.objects.filter(name="held").update(last_heartbeat=at(-2))
    assert nodes.expire_heartbeats(now=at(-1), timeout_s=TIMEOUT_S) == []  # the hearing row exists
    Node.objects.filter(name="held").update(last_heartbeat=at(-45))
    holding, release = threading.Event(), threading.Event()

    def other_sweep() -> None:
        # Its own connection: the row lock is held across threads as two workers' sweeps hold it.
        try:
            with transaction.atomic():
                assert locks.lock_hearing() is not None
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=other_sweep)
    thread.start()
    try:
        assert holding.wait(30)
        # Two sweeps at once would each read the other's gap as a stall: the second judges nothing.
        assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S) == []
    finally:
        release.set()
        thread.join(30)
    assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S) == ["held"]


def test_a_sweep_scheduled_less_often_than_the_stall_threshold_does_not_read_its_own_interval_as_a_stall(
    box, beat_schedules
):
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every_30_s, _ = IntervalSchedule.objects.get_or_create(every=30, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(task=nodes.EXPIRE_TASK).update(interval=every_30_s)
    Node.objects.filter(name=box).update(last_heartbeat=at(-1))

    assert nodes.stall_threshold_s() == 60.0
    assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S) == []
    assert nodes.expire_heartbeats(now=at(30), timeout_s=TIMEOUT_S) == [box], "30 s apart is its rhythm"
    assert not Event.objects.filter(kind=Event.Kind.CONTROL_STALLED).exists()


def test_a_node_the_sweep_writes_off_is_fenced_by_a_new_epoch_which_its_agent_learns_on_registering(box):
    client = replies.client(settings.REDIS_URL)
    before = node_lease.current_epoch(client, box)
    Node.objects.filter(name=box).update(last_heartbeat=at(-45))

    assert nodes.expire_heartbeats(now=at(0), timeout_s=TIMEOUT_S) == [box]

    # Its replicas' takes, chunks and answers under the old epoch are refused from now on
    # (tests/inference/test_node_fence.py); an agent that registers starts its replicas under this one.
    assert node_lease.current_epoch(client, box) == before + 1
    devices = virtual_gpus(box, "1x1GiB", NO_OVERHEAD)
    assert nodes.register_and_fence(box, devices, virtual=True) == before + 1
