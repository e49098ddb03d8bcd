"""Writing Events: one at a time, or a call's Events together (events.gathered)."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from scheduling import events
from scheduling.models import Event


@pytest.mark.django_db
def test_events_gathered_in_a_block_are_written_together_as_it_ends():
    with CaptureQueriesContext(connection) as queries, events.gathered():
        first = events.record(Event.Kind.DEPLOYMENT_CHANGED, "deployment a", "one", deployment="a")
        with events.gathered():  # an inner block writes with the outer one
            events.record(Event.Kind.REPLICA_STATE, "replica r", "two", replica="r")
        assert not Event.objects.exists(), "nothing is written before the block ends"
        assert first is None, "nothing to hand back before it is written"
        reads = len(queries)

    assert len(queries) - reads == 1, "one INSERT for the block's Events"
    assert list(Event.objects.order_by("id").values_list("reason", flat=True)) == ["one", "two"]


@pytest.mark.django_db
def test_a_block_left_by_an_error_writes_nothing_and_the_next_record_is_written_at_once():
    with pytest.raises(RuntimeError), transaction.atomic(), events.gathered():
        events.record(Event.Kind.DEPLOYMENT_CHANGED, "deployment a", "lost", deployment="a")
        raise RuntimeError("the call failed")

    assert not Event.objects.exists()
    written = events.record(Event.Kind.DEPLOYMENT_CHANGED, "deployment a", "now", deployment="a")
    assert written.pk is not None and Event.objects.get().reason == "now"


EVERY_FIELD = [
    # (kind, subject, reason, keywords): each column, empty and not, JSON of every shape and None.
    (
        Event.Kind.REPLICA_STATE,
        "replica r1",
        "scaled: 3 → 2",
        {
            "before": {"state": "serving"},
            "after": {"state": "stopping"},
            "node": "n1",
            "deployment": "d",
            "replica": "r1",
        },
    ),
    (
        Event.Kind.GPU_RESERVED,
        'gpu "n1/0"',
        "quotes ' \" and \\ backslash, ünïcode ✓",
        {"gpu": "n1/0", "before": None, "after": [1, 2.5, None, True, "x"]},
    ),
    (Event.Kind.DEPLOYMENT_CHANGED, "deployment d", "", {"before": {"nested": {"a": [{}]}}, "after": 3}),
    (Event.Kind.HOST_CACHE, "node n2", "a string as JSON", {"before": "text", "after": None, "node": "n2"}),
]


@pytest.mark.django_db
def test_events_gathered_are_the_rows_recorded_one_at_a_time():
    for kind, subject, reason, keywords in EVERY_FIELD:
        events.record(kind, subject, reason, **keywords)
    with events.gathered():
        for kind, subject, reason, keywords in EVERY_FIELD:
            events.record(kind, subject, reason, **keywords)

    fields = ["kind", "subject", "reason", "before", "after", "node", "gpu", "deployment", "replica"]
    rows = list(Event.objects.order_by("id").values_list(*fields))
    alone, together = rows[: len(EVERY_FIELD)], rows[len(EVERY_FIELD) :]
    assert together == alone
    # A None is SQL NULL either way (what `before__isnull` finds), not a JSON null.
    assert Event.objects.filter(before__isnull=True).count() == 2
    times = list(Event.objects.order_by("id").values_list("time", flat=True))
    assert times == sorted(times), "each Event's own time, in the order recorded"


@pytest.mark.django_db(transaction=True)
def test_an_event_for_the_console_is_told_once_it_commits_and_not_if_it_rolls_back(caplog):
    caplog.set_level("INFO", logger="scheduling.lifecycle")
    with pytest.raises(RuntimeError), transaction.atomic():
        events.record(Event.Kind.REPLICA_STATE, "replica 3f2a1b2c", "never", after={"state": "serving"}, console=True)
        raise RuntimeError("rolled back")
    assert caplog.messages == []

    with transaction.atomic():
        events.record(
            Event.Kind.REPLICA_STATE, "replica 3f2a1b2c", "loaded", after={"state": "serving"}, deployment="tiny-a",
            console=True,
        )  # fmt: skip
        events.record(Event.Kind.REPLICA_STATE, "replica 3f2a1b2c", "quiet", after={"state": "loading"})
        assert caplog.messages == [], "not before the commit"

    assert caplog.messages == ["[gpuportal] tiny-a: replica 3f2a1b2c serving: loaded"]


@pytest.mark.django_db(transaction=True)
def test_the_console_is_told_of_a_replica_serving_asleep_or_failed_and_not_of_the_steps_between(caplog):
    from scheduling.services import replicas
    from tests.support import factories

    caplog.set_level("INFO", logger="scheduling.lifecycle")
    replica = factories.replica(factories.deployment("tiny-a"), None, state="pending")
    for state in ("loading", "serving", "draining", "sleeping", "waking", "failed"):
        with transaction.atomic():
            replicas.set_state(replica, state, f"now {state}")

    short = replica.id[:8]
    assert caplog.messages == [
        f"[gpuportal] tiny-a: replica {short} serving: now serving",
        f"[gpuportal] tiny-a: replica {short} sleeping: now sleeping",
        f"[gpuportal] tiny-a: replica {short} failed: now failed",
    ]
