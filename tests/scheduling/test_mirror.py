"""The services' snapshot: a ledger Mirror refreshed with only what changed must
decide as a fresh read of every GPU would, whatever changed: a node's status, a replica's state or
times, a deployment's fairness settings, a wake lock, a GPU's context or health, an intent, a GPU
gone, and what a transaction showed before it rolled back. On real PostgreSQL, with real commits:
inside one test transaction every write would be the reader's own, read again every time."""

from __future__ import annotations

import itertools
import random
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.devices import virtual_gpus
from scheduling import ledger
from scheduling.core.placement import CantAccommodate, PlacementRequest, place
from scheduling.core.planning import withhold_locked
from scheduling.core.state import Plan, Release, Reservation, Snapshot, SnapshotIndex
from scheduling.models import GPU, Deployment, Node, Occupant, PreemptionIntent, Replica
from scheduling.services import nodes
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
NEWCOMER = "newcomer"
_names = itertools.count(1)


def decide(snap: Snapshot, need: int = 500 * MiB, seed: int = 1) -> tuple:
    """What a deploy decides on this snapshot, as add_replicas does: its need with the GPUs'
    context, the GPUs another wake holds left out, then placement. Comparable across snapshots."""
    need += snap.index.contexts[0]
    snap, withheld = withhold_locked(snap, [NEWCOMER], timezone.now())
    result = place(snap, PlacementRequest("newcomer-dep", NEWCOMER, need), rng=random.Random(seed))
    if isinstance(result, CantAccommodate):
        return ("cannot", tuple(sorted(result.reasons.items())), tuple(withheld))
    return ("placed", result.gpu_ids, tuple(sorted(e.replica_id for e in result.evictions)))


def assert_as_fresh(mirror: ledger.Mirror, *, seed: int = 1, need: int = 500 * MiB) -> Snapshot:
    seen = mirror.snapshot()
    fresh = ledger.read()
    assert seen.gpus == fresh.gpus
    assert seen.index == SnapshotIndex.build(seen.gpus), "the patched index is the one the GPUs build"
    assert decide(seen, need, seed) == decide(fresh, need, seed)
    return seen


def reserve(gpu_id: int, replica_id: str, size: int) -> None:
    ledger.commit(Plan.against(ledger.read([gpu_id]), "test", [Reservation(gpu_id, replica_id, size)]))


def two_nodes() -> tuple[list[int], list[str]]:
    first, second = f"mirror{next(_names)}", f"mirror{next(_names)}"
    for name in (first, second):
        register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True)
    return [GPU.objects.get(node__name=name).pk for name in (first, second)], [first, second]


# -- each kind of change a decision reads ------------------------------------------------------------


def free_room() -> dict:
    """Two 1 GiB GPUs, the first holding 300 MiB, the second 600: a 500 MiB replica fits only on
    the first without an eviction, so it goes there."""
    gpus, names = two_nodes()
    holder, other = (factories.replica(factories.deployment(), state=Replica.State.SERVING) for _ in range(2))
    reserve(gpus[0], holder.id, 300 * MiB)
    reserve(gpus[1], other.id, 600 * MiB)
    return {"gpus": gpus, "nodes": names, "holder": holder}


def crowded() -> dict:
    """Both GPUs hold 600 MiB: a 500 MiB replica must evict, and only the first GPU's occupant
    may go (serving for an hour; the other is still loading, inside its min_runtime)."""
    gpus, names = two_nodes()
    old = factories.replica(
        factories.deployment(min_runtime_s=60),
        state=Replica.State.SERVING,
        serving_since=timezone.now() - timedelta(hours=1),
    )
    young = factories.replica(factories.deployment(min_runtime_s=60), state=Replica.State.LOADING)
    reserve(gpus[0], old.id, 600 * MiB)
    reserve(gpus[1], young.id, 600 * MiB)
    return {"gpus": gpus, "nodes": names, "old": old}


CHANGES = {
    # name: (cluster, change; every change is committed by whichever writer makes it in the product)
    "node goes offline": (free_room, lambda c: Node.objects.filter(name=c["nodes"][0]).update(status="offline")),
    "node drains": (free_room, lambda c: nodes.drain(c["nodes"][0])),
    "gpu lost": (free_room, lambda c: GPU.objects.filter(pk=c["gpus"][0]).update(health=GPU.Health.LOST)),
    "context measured": (
        free_room,
        lambda c: GPU.objects.filter(pk=c["gpus"][0]).update(context_bytes=500 * MiB),
    ),
    "wake lock taken": (
        free_room,
        lambda c: ledger.hold_wake_lock(
            c["gpus"][0], c["holder"].id, timezone.now() + timedelta(seconds=30), fresh=True
        ),
    ),
    "replica back to loading": (
        crowded,
        lambda c: Replica.objects.filter(pk=c["old"].id).update(state=Replica.State.LOADING),
    ),
    "replica started serving just now": (
        crowded,
        lambda c: Replica.objects.filter(pk=c["old"].id).update(serving_since=timezone.now()),
    ),
    "deployment made popular": (
        crowded,
        lambda c: Deployment.objects.filter(pk=c["old"].deployment_id).update(popular=True),
    ),
    "deployment made dedicated": (
        crowded,
        lambda c: Deployment.objects.filter(pk=c["old"].deployment_id).update(dedicated=True),
    ),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_after_each_kind_of_change_a_mirror_decides_as_a_fresh_read(change):
    cluster, make_change = CHANGES[change]
    case = cluster()
    mirror = ledger.Mirror()
    before = decide(assert_as_fresh(mirror))

    make_change(case)
    after = decide(assert_as_fresh(mirror))

    assert after != before, "the change matters to the decision (else this test shows nothing)"


@pytest.mark.django_db(transaction=True)
def test_a_wake_lock_renewed_and_released_reaches_a_mirror():
    case = free_room()
    gpu_id, holder = case["gpus"][0], case["holder"].id
    mirror = ledger.Mirror()
    ledger.hold_wake_lock(gpu_id, holder, timezone.now() + timedelta(seconds=1), fresh=True)
    assert_as_fresh(mirror)

    ledger.extend_wake_locks([gpu_id], timezone.now() + timedelta(minutes=5))  # no version bump
    assert mirror.snapshot().gpus[gpu_id].wake_lock_expires_at > timezone.now() + timedelta(minutes=4)
    ledger.release_wake_lock(gpu_id)  # no version bump either
    assert mirror.snapshot().gpus[gpu_id].wake_lock_holder is None
    assert_as_fresh(mirror)


@pytest.mark.django_db(transaction=True)
def test_a_replica_change_that_commits_after_a_mirror_read_is_not_lost():
    case = crowded()
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)
    written, release = threading.Event(), threading.Event()

    def slow_writer() -> None:
        # Takes its transaction id before the mirror reads, commits only afterwards.
        try:
            with transaction.atomic():
                Replica.objects.filter(pk=case["old"].id).update(state=Replica.State.LOADING)
                written.set()
                release.wait(30)
        finally:
            connection.close()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    assert written.wait(30)
    seen = assert_as_fresh(mirror)
    assert seen.gpus[case["gpus"][0]].occupants[0].state == Replica.State.SERVING, "not committed yet"
    release.set()
    writer.join()

    seen = assert_as_fresh(mirror)
    assert seen.gpus[case["gpus"][0]].occupants[0].state == Replica.State.LOADING


@pytest.mark.django_db(transaction=True)
def test_what_a_rolled_back_transaction_showed_a_mirror_is_read_again():
    case = free_room()
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)
    gpu_id = case["gpus"][0]

    with pytest.raises(RuntimeError), transaction.atomic():
        Node.objects.filter(name=case["nodes"][0]).update(status="offline")
        reserve(case["gpus"][1], case["holder"].id, 100 * MiB)
        seen = mirror.snapshot()
        assert seen.gpus[gpu_id].node_status == "offline", "its own writes, as the transaction sees them"
        raise RuntimeError("roll it all back")

    seen = assert_as_fresh(mirror)
    assert seen.gpus[gpu_id].node_status == "online"
    assert seen.gpus[case["gpus"][1]].available_bytes == 424 * MiB


@pytest.mark.django_db(transaction=True)
def test_a_deleted_gpu_leaves_a_mirror_and_a_new_one_joins_it():
    case = free_room()
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)

    Node.objects.filter(name=case["nodes"][1]).delete()  # its GPU goes with it: nothing left to stamp
    seen = assert_as_fresh(mirror)
    assert set(seen.gpus) == {case["gpus"][0]}

    register_node("mirror-late", virtual_gpus("mirror-late", "2x1GiB", NO_OVERHEAD), virtual=True)
    assert len(assert_as_fresh(mirror).gpus) == 3

    with connection.cursor() as cursor:  # as a test database's flush empties it
        cursor.execute("TRUNCATE scheduling_gpu CASCADE")
    assert assert_as_fresh(mirror).gpus == {}


@pytest.mark.django_db(transaction=True)
def test_a_refresh_stuck_in_another_thread_does_not_hold_up_a_snapshot():
    free_room()
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)
    mirror.wait_s = 0.05
    refreshing, unstuck = threading.Event(), threading.Event()

    def stuck() -> None:
        # Holds the refresh as a thread whose read waits on a database gone quiet would.
        with mirror._lock:
            refreshing.set()
            unstuck.wait(30)

    thread = threading.Thread(target=stuck)
    thread.start()
    try:
        assert refreshing.wait(30)
        Node.objects.filter(name=free_room()["nodes"][0]).update(status="offline")
        seen = mirror.snapshot()
        assert thread.is_alive(), "answered while the other refresh still held the Mirror"
        assert seen.gpus == ledger.read().gpus, "a fresh read of every GPU, what changed included"
    finally:
        unstuck.set()
        thread.join()
    assert_as_fresh(mirror)


@pytest.mark.django_db(transaction=True)
def test_a_deletion_a_mirror_saw_roll_back_does_not_hide_the_next_one():
    # Deletions leave no stamp, only a new generation: the generation a rolled-back deletion
    # showed must never come back for a later deletion to wear (it would pass as seen).
    case = free_room()
    register_node("mirror-third", virtual_gpus("mirror-third", "1x1GiB", NO_OVERHEAD), virtual=True)
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)

    with pytest.raises(RuntimeError), transaction.atomic():
        Node.objects.filter(name=case["nodes"][1]).delete()
        assert case["gpus"][1] not in mirror.snapshot().gpus, "its own deletion, as it sees it"
        raise RuntimeError("roll it back")
    Node.objects.filter(name="mirror-third").delete()

    seen = assert_as_fresh(mirror)
    assert set(seen.gpus) == set(case["gpus"])


@pytest.mark.django_db(transaction=True)
def test_the_services_snapshot_is_one_mirror_of_this_database_for_every_thread():
    free_room()
    assert ledger.mirror() is ledger.mirror()
    assert ledger.snapshot().gpus == ledger.read().gpus
    other: list[ledger.Mirror] = []
    thread = threading.Thread(target=lambda: (other.append(ledger.mirror()), connection.close()))
    thread.start()
    thread.join()
    assert other[0] is ledger.mirror(), "the web's threads refresh one Mirror"


@pytest.mark.django_db(transaction=True)
def test_threads_sharing_a_mirror_each_see_their_own_transaction():
    case = crowded()
    mirror = ledger.Mirror()
    assert_as_fresh(mirror)
    gpu_id, old = case["gpus"][0], case["old"].id
    written, checked, rechecked = threading.Event(), threading.Event(), threading.Event()
    seen_by_writer: list[str] = []

    def writer() -> None:
        # Its own connection and transaction; it reads through the Mirror the test reads too,
        # before and after the test's refresh replaced the view it built from its own write.
        try:
            with transaction.atomic():
                Replica.objects.filter(pk=old).update(state=Replica.State.LOADING)
                seen_by_writer.append(mirror.snapshot().gpus[gpu_id].occupants[0].state)
                written.set()
                assert checked.wait(30)
                seen_by_writer.append(mirror.snapshot().gpus[gpu_id].occupants[0].state)
                rechecked.set()
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    assert written.wait(30)
    seen = assert_as_fresh(mirror)
    assert seen.gpus[gpu_id].occupants[0].state == Replica.State.SERVING, "another thread's write, not committed"
    checked.set()
    assert rechecked.wait(30)
    thread.join()

    assert seen_by_writer == [Replica.State.LOADING, Replica.State.LOADING], "its own write, both times"
    seen = assert_as_fresh(mirror)
    assert seen.gpus[gpu_id].occupants[0].state == Replica.State.LOADING, "committed since"


# -- any sequence of changes ---------------------------------------------------------------------------


STATES = [s.value for s in Replica.State]


@st.composite
def changes(draw) -> list[tuple]:
    """Changes of every kind, some made inside a transaction that rolls back after the mirror read
    it, each followed or not by a refresh checked against a fresh read."""
    steps = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(
            st.sampled_from(
                [
                    *("reserve", "release", "node", "replica", "times", "deployment", "lock", "context", "health"),
                    *("intent", "intent status", "intent gone", "new node", "node gone"),
                ]
            )
        )
        steps.append(
            (
                kind,
                draw(st.integers(0, 10**6)),  # which row, and what value, chosen from it
                draw(st.booleans()),  # made inside a transaction that rolls back
                draw(st.booleans()),  # a refresh checked afterwards
            )
        )
    return steps


def apply_change(kind: str, pick: int, rng: random.Random) -> None:
    gpus = list(GPU.objects.order_by("pk").values_list("pk", flat=True))
    replicas = list(Replica.objects.order_by("pk").values_list("pk", flat=True))
    if not gpus or not replicas:
        return
    gpu_id, replica_id = gpus[pick % len(gpus)], replicas[pick % len(replicas)]
    now = timezone.now()
    if kind == "reserve":
        snap = ledger.read([gpu_id])
        held = sum(o.reserved_bytes for o in snap.gpus[gpu_id].occupants if o.replica_id == replica_id)
        room = snap.gpus[gpu_id].available_bytes + held
        ledger.commit(Plan.against(snap, "test", [Reservation(gpu_id, replica_id, rng.randint(0, room))]))
    elif kind == "release" and Occupant.objects.filter(gpu_id=gpu_id).exists():
        victim = Occupant.objects.filter(gpu_id=gpu_id).order_by("pk").first().replica_id
        ledger.commit(Plan.against(ledger.read([gpu_id]), "test", releases=[Release(gpu_id, victim)]))
    elif kind == "node":
        node = GPU.objects.get(pk=gpu_id).node_id
        Node.objects.filter(pk=node).update(status=rng.choice(["online", "offline", "draining"]))
    elif kind == "replica":
        Replica.objects.filter(pk=replica_id).update(state=rng.choice(STATES))
    elif kind == "times":
        field = rng.choice(["last_accessed", "serving_since"])
        Replica.objects.filter(pk=replica_id).update(**{field: now - timedelta(seconds=rng.randint(0, 120))})
    elif kind == "deployment":
        field = rng.choice(["dedicated", "popular", "failover_standby", "min_runtime_s"])
        value = rng.choice([0.0, 30.0, 120.0]) if field == "min_runtime_s" else rng.random() < 0.5
        Deployment.objects.filter(replicas=replica_id).update(**{field: value})
    elif kind == "lock":
        action = rng.choice(["take", "renew", "extend", "release"])
        expires = now + timedelta(seconds=rng.choice([-5, 5, 60]))
        if action == "release":
            ledger.release_wake_lock(gpu_id)
        elif action == "extend":
            ledger.extend_wake_locks([gpu_id], expires)
        else:
            ledger.hold_wake_lock(gpu_id, replica_id, expires, fresh=action == "take")
    elif kind == "context":
        GPU.objects.filter(pk=gpu_id).update(context_bytes=rng.choice([0, 100 * MiB, 300 * MiB]))
    elif kind == "health":
        GPU.objects.filter(pk=gpu_id).update(health=rng.choice(["ok", "ok", "lost", "degraded"]))
    elif kind == "intent":
        PreemptionIntent.objects.create(
            gpu_id=gpu_id, waiting_replica_id=replica_id, needed_bytes=100 * MiB, deadline=now + timedelta(seconds=5)
        )
    elif kind == "intent status":
        status = rng.choice([s.value for s in PreemptionIntent.Status])
        PreemptionIntent.objects.filter(gpu_id=gpu_id).update(status=status)
    elif kind == "intent gone":
        PreemptionIntent.objects.filter(gpu_id=gpu_id).delete()
    elif kind == "new node":
        node = factories.node(f"mirror{next(_names)}")
        for index in range(rng.randint(1, 2)):
            factories.gpu(node, index, total_bytes=1024 * MiB)
    elif kind == "node gone" and len(gpus) > 2:
        Node.objects.filter(gpus=gpu_id).delete()


class RolledBack(Exception):
    pass


@pytest.mark.django_db(transaction=True)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=changes(), seed=st.integers(0, 2**16), need=st.integers(1, 1100))
def test_after_any_changes_a_mirror_decides_as_a_fresh_read(steps, seed, need):
    # Each example starts from the same small cluster (the database outlives examples).
    Occupant.objects.all().delete()
    PreemptionIntent.objects.all().delete()
    GPU.objects.update(wake_lock_holder=None)
    Replica.objects.all().delete()
    Deployment.objects.all().delete()
    Node.objects.all().delete()
    gpus, _ = two_nodes()
    for n in range(4):
        deployment = factories.deployment(min_runtime_s=30.0 * (n % 2))
        first = factories.replica(deployment, state=Replica.State.SERVING, serving_since=timezone.now())
        reserve(gpus[n % 2], first.id, 200 * MiB)
        factories.replica(deployment, state=Replica.State.LOADING)
    rng = random.Random(seed)
    mirror = ledger.Mirror()
    assert_as_fresh(mirror, seed=seed, need=need * MiB)

    for kind, pick, rolled_back, refresh in steps:
        if rolled_back:
            try:
                with transaction.atomic():
                    apply_change(kind, pick, rng)
                    mirror.snapshot()  # sees this transaction's own writes, then they are undone
                    raise RolledBack
            except RolledBack:
                pass
        else:
            apply_change(kind, pick, rng)
        if refresh:
            assert_as_fresh(mirror, seed=seed, need=need * MiB)
    assert_as_fresh(mirror, seed=seed, need=need * MiB)
