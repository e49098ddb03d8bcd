"""Ended replicas are garbage-collected: past a retention they go, but the newest few of
each deployment stay for their errors, and every replica's Events stay."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from scheduling.models import Event, Replica
from scheduling.services.cleanup import collect_ended_replicas
from tests.support import factories

pytestmark = pytest.mark.django_db

HOUR = 3600


def ended(dep, state: str, hours_ago: float) -> Replica:
    replica = factories.replica(dep, state=state, failure_reason=f"ended {hours_ago} h ago")
    factories.event(replica=replica.id, reason=f"replica {replica.id[:8]} {state}")
    # updated_at moves with every save: set it as it was when the replica ended.
    Replica.objects.filter(pk=replica.pk).update(updated_at=timezone.now() - timedelta(hours=hours_ago))
    return replica


def test_it_removes_replicas_ended_past_the_retention_but_keeps_the_newest_for_their_errors():
    dep = factories.deployment("tiny")
    old = [ended(dep, Replica.State.FAILED, 5 + i) for i in range(4)]  # newest first: 5, 6, 7, 8 h ago
    recent = ended(dep, Replica.State.STOPPED, 0.1)
    serving = factories.replica(dep, state=Replica.State.SERVING)
    sleeping = factories.replica(dep, state=Replica.State.SLEEPING)
    Replica.objects.filter(pk__in=[serving.pk, sleeping.pk]).update(updated_at=timezone.now() - timedelta(days=3))

    removed = collect_ended_replicas(retention_s=HOUR, keep=3)

    # The newest three ended (the recent one and the two newest old ones) stay; the rest go.
    assert sorted(removed) == sorted(r.id for r in old[2:])
    assert set(Replica.objects.values_list("pk", flat=True)) == {
        recent.id,
        old[0].id,
        old[1].id,
        serving.id,
        sleeping.id,
    }
    # Their Events are the audit trail: kept, and one more says what went and why.
    assert all(Event.objects.filter(replica=r.id).exists() for r in old)
    (sweep,) = Event.objects.filter(reason__startswith="removed 2 replica(s) that ended over 1 h ago")
    assert sweep.deployment == "tiny" and "the last 3 ended are kept for their errors" in sweep.reason

    assert collect_ended_replicas(retention_s=HOUR, keep=3) == []  # nothing more to do


def test_each_deployment_keeps_its_own_newest_and_a_replica_still_holding_memory_stays():
    a, b = factories.deployment("a"), factories.deployment("b")
    a_old = [ended(a, Replica.State.FAILED, 2 + i) for i in range(2)]
    b_old = [ended(b, Replica.State.STOPPED, 2 + i) for i in range(2)]
    gpu = factories.gpu(factories.node())
    holding = ended(b, Replica.State.FAILED, 10)
    factories.occupy(holding, gpu, 1024)

    removed = collect_ended_replicas(retention_s=HOUR, keep=1)

    assert sorted(removed) == sorted([a_old[1].id, b_old[1].id])
    assert Replica.objects.filter(pk=holding.pk).exists(), "its reservation is released through the ledger first"


def test_the_sweep_runs_on_a_beat_schedule_editable_in_the_admin(beat_schedules):
    task = PeriodicTask.objects.get(name="collect ended replicas")
    assert task.task == "scheduling.tasks.collect_ended_replicas" and task.queue == "control" and task.enabled
