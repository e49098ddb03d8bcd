"""The statements a scale call sends without the ORM (scheduling.hot_sql, locks.lock_deployments_reading):
they write and read exactly what the ORM would, inside the caller's transaction."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import ProgrammingError, connection, connections, transaction
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext

from scheduling import hot_sql, locks
from scheduling.models import Deployment, DeploymentObserved, Event, Replica
from scheduling.services.observing import save_observed
from tests.support import factories
from tests.support.lock_waits import waiting
from tests.support.processes import wait_until

CENSUS = "SELECT id FROM scheduling_replica WHERE deployment_id = ANY(%s)"


def _row(obj: object, *, leave: tuple[str, ...]) -> dict:
    return {k: v for k, v in model_to_dict(obj).items() if k not in leave}


@pytest.mark.django_db
def test_it_writes_the_replica_rows_bulk_create_would():
    dep, node = factories.deployment("hot"), factories.node("n1")
    by_hand = Replica(id="a" * 32, deployment=dep, node=node, gpu_mem_bytes_by_id={"0": 5}, gpu_memory_fraction=0.5)
    by_orm = Replica(id="b" * 32, deployment=dep, node=node, gpu_mem_bytes_by_id={"0": 5}, gpu_memory_fraction=0.5)

    hot_sql.insert([by_hand])
    Replica.objects.bulk_create([by_orm])

    hand, orm = Replica.objects.get(pk="a" * 32), Replica.objects.get(pk="b" * 32)
    assert _row(hand, leave=("id",)) == _row(orm, leave=("id",))
    assert hand.created_at is not None and hand.updated_at is not None
    assert not by_hand._state.adding, "the instance knows it is saved, as after bulk_create"


@pytest.mark.django_db
def test_it_writes_events_with_and_without_their_json_as_the_orm_does():
    made = [
        Event(kind=Event.Kind.REPLICA_STATE, subject="r", reason="with", before={"state": "x"}, after=[1, "y"]),
        Event(kind=Event.Kind.DEPLOYMENT_CHANGED, subject="d", reason="without", deployment="d"),
    ]
    hot_sql.insert(made)

    written = list(Event.objects.order_by("id"))
    assert [(e.reason, e.before, e.after, e.deployment) for e in written] == [
        ("with", {"state": "x"}, [1, "y"], ""),
        ("without", None, None, "d"),
    ]
    assert Event.objects.filter(before__isnull=True).count() == 1, "None is SQL NULL, not JSON null"
    assert all(e.time is not None for e in written)


@pytest.mark.django_db
def test_it_updates_a_row_as_save_with_update_fields_does():
    dep = factories.deployment("hot", replicas_wanted=1)
    stamped = dep.updated_at
    dep.replicas_wanted, dep.popular = 4, True  # popular is not named: left as the row has it

    hot_sql.update(dep, ["replicas_wanted"])

    row = Deployment.objects.get(pk=dep.pk)
    assert (row.replicas_wanted, row.popular) == (4, False)
    assert row.updated_at > stamped, "auto_now dates move as with save()"


@pytest.mark.django_db
def test_it_reads_the_locked_deployment_and_its_observed_record_as_the_orm_reads_them():
    dep = factories.deployment("hot", replicas_wanted=3, min_runtime_s=2.5, failed_reason="x", measured_load_s=1.5)
    rep = factories.replica(dep)

    with transaction.atomic():
        [locked], (rows, names) = locks.lock_deployments_reading(
            ["hot", "not-there"], CENSUS, "SELECT name FROM scheduling_deployment WHERE id = ANY(%s)"
        )

    assert model_to_dict(locked) == model_to_dict(Deployment.objects.get(pk=dep.pk))
    assert (locked.created_at, locked.updated_at) == (dep.created_at, dep.updated_at)
    with CaptureQueriesContext(connection) as reading:
        observed = locked.observed
    assert len(reading) == 0, "read with the lock: its readers under the lock ask nothing more"
    assert model_to_dict(observed) == model_to_dict(DeploymentObserved.objects.get(pk=dep.pk))
    assert (observed.failed_reason, observed.measured_load_s, observed.deployment) == ("x", 1.5, locked)
    assert rows == [(rep.id,)]
    assert names == [("hot",)], "each query's rows, in order"


@pytest.mark.parametrize("model", [Deployment, DeploymentObserved])
def test_models_read_by_hand_need_no_database_converters(model):
    # hot_sql.instance builds a Deployment and its observed record from the raw row: a field
    # Django converts on the way out of the database would come back wrong from it.
    assert not [f.name for f in model._meta.concrete_fields if f.get_db_converters(connection)]
    assert not [f.name for f in model._meta.concrete_fields if connection.ops.get_db_converters(f)]


@pytest.mark.django_db
def test_a_missing_deployment_is_left_out_and_a_bad_statement_is_djangos_error():
    with transaction.atomic():
        assert locks.lock_deployments_reading(["nope"], CENSUS) == ([], [[]])
    factories.deployment("hot")
    with pytest.raises(ProgrammingError), transaction.atomic():
        locks.lock_deployments_reading(["hot"], "SELECT no_such_column FROM scheduling_replica WHERE id = ANY(%s)")


def _read_after_a_wait(write: Callable[[], object], read: Callable[[], object]) -> tuple[object, object]:
    """(what `write` returned, what `read` returned): `write` runs in a transaction that holds the
    deployment "hot"'s row lock, `read` in another's that waited for that lock until the first
    committed."""
    holding, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def waiter() -> None:
        try:
            holding.wait(10)
            with transaction.atomic():
                seen["read"] = read()
        finally:
            connections.close_all()
            done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    with transaction.atomic():
        locks.lock_deployment("hot")
        written = write()
        holding.set()
        # Why a wait on pg_locks: the other thread must be queued on this row lock before this
        # transaction commits, or the test proves nothing.
        with connections["default"].cursor() as cur:

            def queued() -> bool:
                return waiting(cur, "transactionid") > 0

            wait_until(queued, 10, "the other transaction to wait for the deployment's row lock", every=0.01)
    assert done.wait(10)
    thread.join()
    return written, seen["read"]


@pytest.mark.django_db(transaction=True)
def test_the_read_beside_the_lock_sees_what_the_locks_previous_holder_committed():
    """The census is read once the lock is granted, as a statement of its own: a replica the
    lock's previous holder added and committed while we waited is in it."""
    dep = factories.deployment("hot")

    added, rows = _read_after_a_wait(
        lambda: factories.replica(dep), lambda: locks.lock_deployments_reading(["hot"], CENSUS)[1][0]
    )

    assert rows == [(added.id,)]  # type: ignore[attr-defined]


def _by_orm(name: str) -> Deployment:
    return locks.lock_deployment(name)


def _by_hand(name: str) -> Deployment:
    return locks.lock_deployments_reading([name])[0][0]


@pytest.mark.parametrize("lock", [_by_orm, _by_hand], ids=["orm", "hot-sql"])
@pytest.mark.django_db(transaction=True)
def test_the_observed_record_read_with_the_lock_is_what_its_previous_holder_committed(lock):
    """The record is read in the locking statement: one that waited for the lock must see what the
    previous holder wrote to the record, not the record as it was when the statement began (in
    READ COMMITTED, only the rows a statement locks are read again after its wait)."""
    deployment = factories.deployment("hot")

    def write() -> None:
        deployment.observed.load_failures = 2
        save_observed(deployment, ["load_failures"])

    _, failures = _read_after_a_wait(write, lambda: lock("hot").observed.load_failures)

    assert failures == 2
