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
        assert first.pk is None
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
