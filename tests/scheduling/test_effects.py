"""Effects as values: a service says what it wants (Events, orders to agents, control tasks) and
the outbox alone does it; captured, it does none of it and hands the effects back to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.db import connection, transaction

from scheduling.core.effects import AfterCommit, Note, Order, ToControl
from scheduling.models import Event, Replica
from scheduling.services import outbox, replicas
from tests.support.deployments import TO_CACHE, deploy_serving

ROOT = Path(__file__).resolve().parents[2]


def test_a_service_run_captured_sends_nothing_and_hands_back_what_it_wanted(cluster, api, dispatched, tiny_model_dir):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    dispatched.clear()
    events_before, after_commit_before = Event.objects.count(), len(connection.run_on_commit)

    with outbox.captured() as wanted:
        replicas.sleep_replica(replica_id, reason="idle for the test")

    # Read in the same transaction, before any commit could send or roll back could hide anything.
    assert Event.objects.count() == events_before, "captured: no Event written"
    assert len(connection.run_on_commit) == after_commit_before, "captured: nothing to send after the commit"
    fx = wanted.effects
    node = Replica.objects.get(pk=replica_id).node.name
    assert fx.orders_for(replica_id) == [Order.SLEEP] and fx.orders[0].node == node
    assert any(
        isinstance(n, Note) and n.replica == replica_id and n.after == {"state": "draining"} for n in fx.notes
    ), fx.notes
    assert Replica.objects.get(pk=replica_id).state == "draining", "the books changed: only the effects wait"


def test_the_same_call_not_captured_writes_its_events_and_sends_its_order_after_commit(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    (replica_id,) = deploy_serving(api, tiny_model_dir)
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        replicas.sleep_replica(replica_id, reason="idle for the test")
        assert dispatched == [], "not before the commit"
        assert Event.objects.filter(replica=replica_id, reason="idle for the test").exists(), "inside it"

    assert callbacks and [task for _, task, _ in dispatched] == [TO_CACHE]


@pytest.mark.django_db(transaction=True)
def test_an_order_wanted_in_a_savepoint_that_rolls_back_is_never_sent(dispatched):
    # Why each effect is registered as it is wanted, not gathered to the end of the outer block:
    # a refused placement attempt runs in a savepoint, and what it wanted must go with it.
    with transaction.atomic():
        outbox.want(ToControl("scheduling.tasks.reconcile", ("kept",)))
        try:
            with transaction.atomic():
                outbox.want(ToControl("scheduling.tasks.reconcile", ("dropped",)))
                outbox.note(Event.Kind.DEPLOYMENT_CHANGED, "deployment a", "dropped too")
                raise RuntimeError("refused")
        except RuntimeError:
            pass

    assert [args for _, _, args in dispatched] == [["kept"]]
    assert not Event.objects.filter(reason="dropped too").exists()


@pytest.mark.django_db(transaction=True)
def test_after_commit_work_runs_only_once_the_transaction_commits():
    ran: list[str] = []
    with transaction.atomic():
        outbox.want(AfterCommit("record it", lambda: ran.append("after")))
        assert ran == []
    assert ran == ["after"]

    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.want(AfterCommit("never", lambda: ran.append("rolled back")))
        raise RuntimeError("rolled back")
    assert ran == ["after"]


# The modules that do effects: the outbox, and the two it hands them to.
DOERS = {"scheduling/services/outbox.py", "scheduling/services/dispatch.py", "scheduling/events.py"}
DOING = {
    ("events", "record"),
    ("events", "gathered"),
    ("dispatch", "send"),
    ("dispatch", "enqueue"),
    ("transaction", "on_commit"),
    ("app", "send_task"),
}


def test_only_the_outbox_and_what_it_hands_to_write_events_or_send_anything():
    # The control plane's packages; the GPU side has its own gateway (inference/gateway.py).
    doing: dict[str, set[str]] = {}
    for path in sorted((ROOT / "scheduling").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in DOING
            ):
                doing.setdefault(name, set()).add(f"{node.func.value.id}.{node.func.attr}")
    assert set(doing) <= DOERS, {k: v for k, v in doing.items() if k not in DOERS}
    assert len(DOERS) <= 3
