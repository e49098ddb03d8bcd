"""Scale calls committed together (scheduling.services.scaling): a batch scales
several deployments in one transaction, each as it would alone; one that cannot be placed fails
alone; concurrent calls of one process share a batch. On virtual GPUs, no processes."""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext

from gpuportal.wire.memory import MiB
from gpuportal.wire.states import AWAKE
from inference.devices import virtual_gpus
from scheduling import locks
from scheduling.models import Deployment, Event, Replica
from scheduling.services import deployments, scaling
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
from scheduling.services.errors import CannotPlace, NotFound
from scheduling.services.nodes import register_node
from scheduling.services.scaling import ScaleIntent, scale_together
from tests.support.deployments import START, STOP, invariant_holds, reserved
from tests.support.factories import NO_OVERHEAD
from tests.support.lock_waits import waiting
from tests.support.processes import wait_until

TIMEOUT = 30


def made(name: str, replicas: int, need_mib: int = 300) -> None:
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=need_mib * MiB)
    spec = DeploymentSpec(name=name, source="/srv/models/tiny", replicas=replicas, override_bytes=need_mib * MiB)
    create(spec, facts=facts)


def awake(name: str) -> list[Replica]:
    return list(Replica.objects.filter(deployment__name=name, state__in=AWAKE).order_by("created_at"))


def changed(name: str) -> list[str]:
    return list(
        Event.objects.filter(kind=Event.Kind.DEPLOYMENT_CHANGED, deployment=name)
        .order_by("pk")
        .values_list("reason", flat=True)
    )


def test_a_batch_scales_several_deployments_up_and_down_in_one_transaction(
    cluster, dispatched, django_capture_on_commit_callbacks
):
    made("up", 1)
    made("down", 2)
    made("gone", 1)
    stopping = [r.id for r in awake("down")[1:]] + [r.id for r in awake("gone")]
    dispatched.clear()

    with django_capture_on_commit_callbacks(execute=True):
        outcomes = scale_together(
            [
                ScaleIntent("up", 3, "scaled by a test"),
                ScaleIntent("down", 1, "scaled by a test"),
                ScaleIntent("gone", 0, "scaled by a test"),
            ]
        )

    assert [o.name for o in outcomes] == ["up", "down", "gone"]
    assert [o.replicas_wanted for o in outcomes] == [3, 1, 0]
    assert dict(Deployment.objects.values_list("name", "replicas_wanted")) == {"up": 3, "down": 1, "gone": 0}
    assert (len(awake("up")), len(awake("down")), len(awake("gone"))) == (3, 1, 0)
    assert set(Replica.objects.filter(state=Replica.State.STOPPING).values_list("id", flat=True)) == set(stopping)
    assert all(reserved(replica_id) == 0 for replica_id in stopping), "a stopped replica's memory is released"
    assert sum(reserved(r.id) for r in awake("up")) == 3 * 300 * MiB
    assert sorted(task for _, task, _ in dispatched) == [START, START, STOP, STOP]
    assert changed("up")[-1] == "scaled by a test: 1 → 3 replica(s)"
    assert changed("down")[-1] == "scaled by a test: 2 → 1 replica(s)"
    assert changed("gone")[-1] == "scaled by a test: 1 → 0 replica(s)"
    assert invariant_holds()


def test_a_batch_of_calls_runs_as_many_statements_as_one_call(cluster):
    for name in ("a", "b", "c", "d"):
        made(name, 1)

    with CaptureQueriesContext(connections["default"]) as one:
        scale_together([ScaleIntent("a", 2, "one")])
    with CaptureQueriesContext(connections["default"]) as four:
        scale_together([ScaleIntent(name, 2, "four") for name in ("b", "c", "d", "a")])

    assert len(four.captured_queries) == len(one.captured_queries), [q["sql"][:60] for q in four.captured_queries]
    assert [len(awake(name)) for name in "abcd"] == [2, 2, 2, 2]


def test_a_scale_up_that_cannot_be_placed_fails_alone_and_leaves_no_trace(cluster):
    made("fits", 1)
    made("huge", 1, need_mib=900)
    huge_before = set(Replica.objects.filter(deployment__name="huge").values_list("id", flat=True))

    fits, huge, missing = scale_together(
        [ScaleIntent("fits", 2, "a test"), ScaleIntent("huge", 9, "a test"), ScaleIntent("nope", 1, "a test")]
    )

    assert isinstance(huge, CannotPlace) and "huge" not in str(fits)
    assert isinstance(missing, NotFound) and "nope" in str(missing)
    assert fits.replicas_wanted == 2 and len(awake("fits")) == 2
    assert Deployment.objects.get(name="huge").replicas_wanted == 1
    assert set(Replica.objects.filter(deployment__name="huge").values_list("id", flat=True)) == huge_before
    assert not [reason for reason in changed("huge") if "→ 9" in reason]
    assert invariant_holds()


@pytest.mark.django_db
def test_a_scale_down_frees_memory_that_a_scale_up_of_the_same_batch_takes():
    register_node("solo", virtual_gpus("solo", "2x1GiB", NO_OVERHEAD), virtual=True)
    made("full", 2, need_mib=900)  # one GPU each: nothing is left free
    made("next", 0, need_mib=900)
    leaving = awake("full")[-1]
    gpu_left = Replica.objects.get(pk=leaving.id).gpu_mem_bytes_by_id

    scale_together([ScaleIntent("full", 1, "a test"), ScaleIntent("next", 1, "a test")])

    (placed,) = awake("next")
    assert placed.gpu_mem_bytes_by_id.keys() == gpu_left.keys(), "on the GPU the scale-down released"
    assert Replica.objects.get(pk=leaving.id).state == Replica.State.STOPPING
    assert not Replica.objects.filter(state=Replica.State.DRAINING).exists(), "nobody evicted for it"
    assert invariant_holds()


@pytest.mark.django_db(transaction=True)
def test_concurrent_calls_of_one_process_share_a_batch_and_each_gets_its_own_outcome():
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB", NO_OVERHEAD), virtual=True)
    names = [f"d{n}" for n in range(4)]  # 8 replicas of 300 MiB: room on the 3 GPUs huge leaves
    for name in names:
        made(name, 1)
    made("huge", 1, need_mib=900)
    wanted = {name: 2 for name in names} | {"huge": 5}
    outcomes: dict[str, object] = {}
    batches = scaling._GROUP.batches

    def call(name: str) -> None:
        try:
            outcomes[name] = deployments.scale(name, wanted[name], reason="a thread")
        except CannotPlace as err:
            outcomes[name] = err
        finally:
            connections.close_all()

    held = names[:1]  # one batch of the process at a time
    with transaction.atomic():
        for name in held:
            locks.lock_deployment(name)
        leaders = [threading.Thread(target=call, args=(name,)) for name in held]
        for thread in leaders:
            thread.start()
        # Why a wait on pg_locks: each of these calls must lead a batch and be held on its row
        # lock inside it before the others arrive, or they might not queue behind them.
        with connections["default"].cursor() as cur:

            def queued() -> bool:
                return waiting(cur, "transactionid") >= len(held)

            wait_until(queued, TIMEOUT, "the leading batches to wait for their row locks", every=0.01)
        others = [threading.Thread(target=call, args=(name,)) for name in [*names[len(held) :], "huge"]]
        for thread in others:
            thread.start()
        assert scaling._GROUP.wait_queued(len(others), TIMEOUT)
    for thread in [*leaders, *others]:
        thread.join(TIMEOUT)

    assert scaling._GROUP.batches - batches == len(held) + 1, "the held batches, then all who queued behind them"
    assert {name: outcome.replicas_wanted for name, outcome in outcomes.items() if name != "huge"} == {
        name: 2 for name in names
    }
    assert isinstance(outcomes["huge"], CannotPlace)
    assert dict(Deployment.objects.values_list("name", "replicas_wanted")) == {name: 2 for name in names} | {"huge": 1}
    assert all(len(awake(name)) == 2 for name in names)
    assert invariant_holds()


def test_a_batch_that_fails_whole_runs_each_call_alone_and_only_the_faulty_one_fails(cluster, monkeypatch):
    made("good", 1)
    made("bad", 1)
    after = scaling._after

    def faulty(scaling_: scaling._Scaling) -> None:
        if scaling_.deployment.name == "bad":
            raise RuntimeError("a fault in bad's part")
        after(scaling_)

    monkeypatch.setattr(scaling, "_after", faulty)

    good, bad = scaling._run_batch([ScaleIntent("good", 2, "a test"), ScaleIntent("bad", 2, "a test")])

    assert good.replicas_wanted == 2 and len(awake("good")) == 2
    assert isinstance(bad, RuntimeError)
    assert Deployment.objects.get(name="bad").replicas_wanted == 1 and len(awake("bad")) == 1, "rolled back whole"
    assert invariant_holds()


@pytest.mark.django_db(transaction=True)
def test_a_scale_that_waited_for_a_deleted_deployment_answers_not_found_though_its_name_was_made_again():
    """The race the storm found (KeyError for a deployment id): the scale's lock waits on the old
    row, which a transaction deletes and then makes the name again, with a replica. The lock then
    finds nothing (its snapshot predates the new row) while a census read by name, a statement
    later, would see the new deployment's replica. It answers 404, as if it came just before."""
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    made("again", 1)
    outcome: dict[str, object] = {}

    def scale_it() -> None:
        try:
            outcome["scaled"] = scale_together([ScaleIntent("again", 2, "a thread")])[0]
        except Exception as err:  # what the old census raised (a KeyError): the assertion shows it
            outcome["scaled"] = err
        finally:
            connections.close_all()

    thread = threading.Thread(target=scale_it)
    with transaction.atomic():
        deployments.delete("again", reason="a test")
        made("again", 1)
        thread.start()
        # Why a wait on pg_locks: the scale must be queued on the old row's lock before this
        # transaction commits, or it would simply find the new deployment.
        with connections["default"].cursor() as cur:

            def queued() -> bool:
                return waiting(cur, "transactionid") > 0

            wait_until(queued, TIMEOUT, "the scale to wait for the old deployment's row lock", every=0.01)
    thread.join(TIMEOUT)

    assert isinstance(outcome["scaled"], NotFound), outcome
    assert len(awake("again")) == 1, "the new deployment is as its create left it"
    assert invariant_holds()
