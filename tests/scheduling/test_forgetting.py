"""A deployment forgotten in one statement (scheduling.services.forgetting) leaves the rows as
Django's cascade leaves them."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, models, transaction

from scheduling.models import (
    GPU,
    Deployment,
    DeploymentObserved,
    DeploymentRevision,
    FailoverLease,
    Occupant,
    PreemptionIntent,
    Replica,
)
from scheduling.services.forgetting import forget_deployment
from tests.support import factories

pytestmark = pytest.mark.django_db

MiB = 1024**2


class _RolledBack(Exception):
    pass


def _rows() -> dict[str, list[tuple]]:
    """Every row a deployment's delete may touch, by the columns its relations use."""
    return {
        "deployments": sorted(Deployment.objects.values_list("id", "name")),
        "observed": sorted(DeploymentObserved.objects.values_list("deployment_id", "load_failures")),
        "revisions": sorted(DeploymentRevision.objects.values_list("deployment_id", "number")),
        "replicas": sorted(Replica.objects.values_list("id", "deployment_id", "lease_id")),
        "leases": sorted(FailoverLease.objects.values_list("id", "deployment_id", "holder_id")),
        "intents": sorted(PreemptionIntent.objects.values_list("id", "waiting_replica_id", "victim_id")),
        "wake_locks": sorted(GPU.objects.values_list("id", "wake_lock_holder_id")),
        "occupants": sorted(Occupant.objects.values_list("id", "replica_id")),
    }


def _as_django_deletes(deployment: Deployment) -> dict[str, list[tuple]]:
    """The rows after Django's own `delete()`, then undone."""
    try:
        with transaction.atomic():
            deployment.delete()
            after = _rows()
            raise _RolledBack
    except _RolledBack:
        return after


def _tangled_world() -> Deployment:
    """A deployment to delete whose replicas, leases and intents reach into another's rows every
    way the models allow, beside that other deployment's own."""
    node = factories.node()
    first, second = factories.gpu(node, 0), factories.gpu(node, 1)
    gone, kept = factories.deployment("gone", load_failures=1), factories.deployment("kept", load_failures=2)
    r1, r2 = factories.replica(gone, node), factories.replica(gone, node)
    k1, k2 = factories.replica(kept, node), factories.replica(kept, node)
    own_lease = FailoverLease.objects.create(deployment=gone, holder=r1)
    kept_lease = FailoverLease.objects.create(deployment=kept, slot=0, holder=r2)  # held by a replica of gone
    FailoverLease.objects.create(deployment=kept, slot=1, holder=k1)
    Replica.objects.filter(pk=r2.pk).update(lease=own_lease)
    Replica.objects.filter(pk=k2.pk).update(lease=own_lease)  # another's replica in gone's lease
    Replica.objects.filter(pk=k1.pk).update(lease=kept_lease)
    factories.intent(r1, first, MiB)  # one of gone's waits: goes
    factories.intent(k1, first, MiB, victim=r2)  # one of gone's is the victim: kept, victim cleared
    factories.intent(r2, second, MiB, victim=k1)  # waits and has a victim of kept: goes
    factories.intent(k2, second, MiB, victim=k1)  # nothing of gone's: untouched
    GPU.objects.filter(pk=first.pk).update(wake_lock_holder=r1)
    GPU.objects.filter(pk=second.pk).update(wake_lock_holder=k1)
    factories.occupy(k1, second, MiB)
    for deployment in (gone, kept):
        DeploymentRevision.objects.create(deployment=deployment, number=1, settings={}, cause="deployed")
    return gone


def test_it_leaves_the_rows_as_djangos_cascade_leaves_them():
    gone = _tangled_world()
    gone_id = gone.pk  # Django's delete sets the instance's to None
    kept_id = Deployment.objects.get(name="kept").pk
    expected = _as_django_deletes(gone)

    held = dict(GPU.objects.values_list("pk", "wake_lock_holder_id"))

    cleared = forget_deployment(gone_id)

    assert _rows() == expected
    first = GPU.objects.get(index=0).pk
    assert cleared == [(first, held[first])], "the wake lock gone's r1 held, and whose; not kept's k1's"
    # The differential check above is only as good as the world: it did delete and clear things.
    assert [name for _, name in expected["deployments"]] == ["kept"]
    assert [deployment for deployment, _ in expected["observed"]] == [kept_id], "its observed record went with it"
    assert expected["revisions"] == [(kept_id, 1)], "its revisions went with it"
    assert sorted(lease is None for *_, lease in expected["replicas"]) == [False, True]  # k2 left gone's lease
    assert sorted(victim is None for *_, victim in expected["intents"]) == [False, True]
    assert sorted(holder is None for *_, holder in expected["leases"]) == [False, True]
    assert sorted(holder is None for _, holder in expected["wake_locks"]) == [False, True]


def test_it_follows_every_relation_the_models_declare():
    """A relation added to these models without its place in the statement fails here."""
    declared = {
        (rel.related_model.__name__, rel.field.name, rel.on_delete.__name__)
        for model in (Deployment, Replica, FailoverLease)
        for rel in model._meta.related_objects
        if isinstance(rel, models.ManyToOneRel)
    }

    assert declared == {
        ("DeploymentObserved", "deployment", "CASCADE"),
        ("DeploymentRevision", "deployment", "CASCADE"),
        ("Replica", "deployment", "CASCADE"),
        ("FailoverLease", "deployment", "CASCADE"),
        ("PreemptionIntent", "waiting_replica", "CASCADE"),
        ("PreemptionIntent", "victim", "SET_NULL"),
        ("GPU", "wake_lock_holder", "SET_NULL"),
        ("FailoverLease", "holder", "SET_NULL"),
        ("Replica", "lease", "SET_NULL"),
        ("Occupant", "replica", "PROTECT"),
    }


def test_a_replica_still_holding_a_reservation_stops_the_whole_delete():
    node = factories.node()
    gpu = factories.gpu(node)
    gone = factories.deployment("gone")
    factories.occupy(factories.replica(gone, node), gpu, MiB)
    before = _rows()

    # The foreign key is checked at the commit (deferred): asked for at once here, as a commit would.
    with pytest.raises(IntegrityError), transaction.atomic():
        forget_deployment(gone.pk)
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")

    assert _rows() == before
