"""The commit path (docs/architecture.md, the ledger): snapshot → plan → compare-and-swap commit, on real PostgreSQL."""

from __future__ import annotations

import random
import threading

import pytest
from django.db import IntegrityError, OperationalError, connection, transaction
from prometheus_client import REGISTRY

from inference.devices import virtual_gpus
from scheduling import ledger
from scheduling.core.state import Plan, Release, Reservation, SnapshotIndex
from scheduling.ledger import CasConflict, OverCommit, commit, commit_with_retry, snapshot
from scheduling.models import GPU, Deployment, Event, Occupant, Replica
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
GiB = 1024**3


def conflicts_counted() -> float:
    return REGISTRY.get_sample_value("gpuportal_cas_conflicts_total") or 0.0


def make_replicas(count: int, deployment: str = "tiny") -> list[str]:
    dep = Deployment.objects.filter(name=deployment).first() or factories.deployment(deployment)
    return [Replica.objects.create(deployment=dep).id for _ in range(count)]


def invariant_violations() -> list[str]:
    """One statement, so PostgreSQL answers from one consistent snapshot even mid-commit."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT g.id, g.total_bytes, g.available_bytes, COALESCE(SUM(o.reserved_bytes), 0)
            FROM scheduling_gpu g LEFT JOIN scheduling_occupant o ON o.gpu_id = g.id
            GROUP BY g.id
            """
        )
        rows = cursor.fetchall()
    return [
        f"gpu {gpu_id}: total {total}, available {available}, reserved {reserved}"
        for gpu_id, total, available, reserved in rows
        if reserved > total or available != total - reserved
    ]


@pytest.fixture
def gpu_ids(db) -> list[int]:
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    return list(GPU.objects.order_by("pk").values_list("pk", flat=True))


def test_a_plan_commits_and_bumps_the_version(gpu_ids):
    replica = make_replicas(1)[0]
    gpu_id = gpu_ids[0]

    result = commit_with_retry(
        lambda snap: Plan.against(snap, "test placement", [Reservation(gpu_id, replica, 300 * MiB)]),
        gpu_ids=[gpu_id],
    )

    gpu = GPU.objects.get(pk=gpu_id)
    assert result is not None and result.attempts == 1
    assert gpu.version == 1 == result.versions[gpu_id]
    assert gpu.available_bytes == GiB - 300 * MiB
    assert Occupant.objects.get(gpu_id=gpu_id, replica_id=replica).reserved_bytes == 300 * MiB
    event = Event.objects.get(kind=Event.Kind.GPU_RESERVED)
    assert event.gpu == "node1/0" and "test placement" in event.reason
    assert GPU.objects.get(pk=gpu_ids[1]).version == 0, "a GPU the plan does not write keeps its version"


def test_a_release_frees_exactly_the_replicas_bytes(gpu_ids):
    small, big = make_replicas(2)
    gpu_id = gpu_ids[0]
    commit_with_retry(
        lambda snap: Plan.against(
            snap, "two tenants", [Reservation(gpu_id, small, 100 * MiB), Reservation(gpu_id, big, 600 * MiB)]
        )
    )

    commit_with_retry(lambda snap: Plan.against(snap, "evict the small one", releases=[Release(gpu_id, small)]))

    gpu = GPU.objects.get(pk=gpu_id)
    assert gpu.available_bytes == GiB - 600 * MiB
    assert list(gpu.occupants.values_list("replica_id", flat=True)) == [big]
    released = Event.objects.get(kind=Event.Kind.GPU_RELEASED)
    assert released.before == {"reserved_bytes": 100 * MiB} and "evict the small one" in released.reason


def test_a_stale_plan_conflicts_and_changes_nothing(gpu_ids):
    first, second = make_replicas(2)
    gpu_id = gpu_ids[0]
    stale = snapshot([gpu_id])
    commit(Plan.against(snapshot([gpu_id]), "someone else", [Reservation(gpu_id, first, 100 * MiB)]))
    counted = conflicts_counted()

    with pytest.raises(CasConflict) as raised:
        commit(Plan.against(stale, "stale", [Reservation(gpu_id, second, 100 * MiB)]))

    assert raised.value.stale == [(gpu_id, 0, 1)]
    assert not Occupant.objects.filter(replica_id=second).exists()
    assert GPU.objects.get(pk=gpu_id).version == 1
    assert conflicts_counted() == counted, "a bare commit() reports the conflict; counting is the retry loop's"


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_change_makes_the_plan_conflict_and_the_retry_succeeds():
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    gpu_id = GPU.objects.get().pk
    mine, theirs = make_replicas(2)
    seen_versions: list[int] = []

    def other_client() -> None:
        # A separate thread has its own database connection: a truly concurrent writer.
        try:
            commit_with_retry(lambda snap: Plan.against(snap, "theirs", [Reservation(gpu_id, theirs, 100 * MiB)]))
        finally:
            connection.close()

    def decide(snap):
        seen_versions.append(snap.gpus[gpu_id].version)
        if len(seen_versions) == 1:
            writer = threading.Thread(target=other_client)
            writer.start()
            writer.join()
        return Plan.against(snap, "mine", [Reservation(gpu_id, mine, 200 * MiB)])

    counted = conflicts_counted()
    result = commit_with_retry(decide, gpu_ids=[gpu_id])

    assert seen_versions == [0, 1], "the retry planned again from a fresh snapshot"
    assert result is not None and result.attempts == 2
    assert conflicts_counted() == counted + 1
    gpu = GPU.objects.get(pk=gpu_id)
    assert gpu.version == 2 and gpu.available_bytes == GiB - 300 * MiB
    assert invariant_violations() == []


@pytest.mark.django_db(transaction=True)
def test_a_conflict_inside_a_transaction_lets_go_of_the_gpu_and_the_transaction_goes_on():
    # The ledger takes no savepoint around its commit; the conflict must still release the row
    # it locked (a retry may plan on other GPUs, and holding this one could close a circle of
    # waits) and leave the caller's transaction usable for that retry.
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    gpu_id = GPU.objects.get().pk
    mine, theirs = make_replicas(2)
    stale = snapshot([gpu_id])
    commit(Plan.against(snapshot([gpu_id]), "theirs", [Reservation(gpu_id, theirs, 100 * MiB)]))
    others_found_it_locked: list[bool] = []
    applied: list[str] = []

    def lock_from_another_connection() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT id FROM scheduling_gpu WHERE id = %s FOR UPDATE NOWAIT", [gpu_id])
            others_found_it_locked.append(False)
        except OperationalError:
            others_found_it_locked.append(True)
        finally:
            connection.close()

    with transaction.atomic():
        with pytest.raises(CasConflict):
            commit(Plan.against(stale, "stale", [Reservation(gpu_id, mine, 100 * MiB)]), apply=applied.append)
        other = threading.Thread(target=lock_from_another_connection)
        other.start()
        other.join()
        commit(Plan.against(snapshot([gpu_id]), "fresh", [Reservation(gpu_id, mine, 100 * MiB)]), apply=applied.append)

    assert others_found_it_locked == [False]
    assert [plan.reason for plan in applied] == ["fresh"], "apply runs for the commit that landed only"
    assert Occupant.objects.filter(replica_id=mine).exists()
    assert invariant_violations() == []


@pytest.mark.django_db(transaction=True)
def test_it_gives_up_after_the_bounded_number_of_attempts():
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    gpu_id = GPU.objects.get().pk
    mine, theirs = make_replicas(2)
    plans = 0

    def bump_from_another_connection() -> None:
        try:
            commit(Plan.against(snapshot([gpu_id]), "churn", [Reservation(gpu_id, theirs, random.randint(1, 9) * MiB)]))
        finally:
            connection.close()

    def decide(snap):
        nonlocal plans
        plans += 1
        writer = threading.Thread(target=bump_from_another_connection)
        writer.start()
        writer.join()
        return Plan.against(snap, "always late", [Reservation(gpu_id, mine, MiB)])

    counted = conflicts_counted()
    with pytest.raises(CasConflict):
        commit_with_retry(decide, attempts=3)

    assert plans == 3
    assert conflicts_counted() == counted + 3
    assert not Occupant.objects.filter(replica_id=mine).exists()


def test_a_plan_that_would_over_commit_applies_nothing(gpu_ids):
    fits, too_big = make_replicas(2)
    first, second = gpu_ids
    snap = snapshot()
    plan = Plan.against(snap, "multi-GPU", [Reservation(first, fits, 512 * MiB), Reservation(second, too_big, GiB + 1)])

    with pytest.raises(OverCommit) as raised:
        commit(plan)

    assert raised.value.gpu_label == "node1/1"
    assert not Occupant.objects.exists(), "the reservation on the GPU that fit was rolled back too"
    assert list(GPU.objects.values_list("version", "available_bytes")) == [(0, GiB), (0, GiB)]
    assert not Event.objects.filter(kind=Event.Kind.GPU_RESERVED).exists()


def test_a_plan_must_name_the_versions_of_every_gpu_it_writes(gpu_ids):
    replica = make_replicas(1)[0]
    plan = Plan(reason="sloppy", expected_versions={}, reservations=(Reservation(gpu_ids[0], replica, MiB),))

    with pytest.raises(ValueError, match="without an expected version"):
        commit(plan)
    with pytest.raises(ValueError, match="not in the snapshot"):
        Plan.against(snapshot([gpu_ids[0]]), "elsewhere", [Reservation(gpu_ids[1], replica, MiB)])


def test_the_database_refuses_an_over_committed_row_even_without_the_ledger(gpu_ids):
    with pytest.raises(IntegrityError), transaction.atomic():
        GPU.objects.filter(pk=gpu_ids[0]).update(available_bytes=-1)


def test_a_replica_holding_a_reservation_cannot_be_deleted_around_the_ledger(gpu_ids):
    from django.db.models import ProtectedError

    replica = make_replicas(1)[0]
    commit_with_retry(lambda snap: Plan.against(snap, "hold", [Reservation(gpu_ids[0], replica, MiB)]))

    with pytest.raises(ProtectedError):
        Replica.objects.get(pk=replica).delete()


def test_the_snapshot_carries_versions_occupants_and_intents(gpu_ids):
    from datetime import timedelta

    from django.utils import timezone

    from scheduling.models import PreemptionIntent

    holder, waiter = make_replicas(2)
    commit_with_retry(lambda snap: Plan.against(snap, "hold", [Reservation(gpu_ids[0], holder, 700 * MiB)]))
    PreemptionIntent.objects.create(
        gpu_id=gpu_ids[0],
        waiting_replica_id=waiter,
        needed_bytes=500 * MiB,
        deadline=timezone.now() + timedelta(seconds=5),
    )

    view = snapshot().gpus[gpu_ids[0]]

    assert (view.version, view.available_bytes, view.label) == (1, GiB - 700 * MiB, "node1/0")
    assert [(o.replica_id, o.reserved_bytes) for o in view.occupants] == [(holder, 700 * MiB)]
    assert [(i.replica_id, i.needed_bytes) for i in view.intents] == [(waiter, 500 * MiB)]


@pytest.mark.django_db(transaction=True)
def test_sixteen_concurrent_clients_never_over_commit_a_gpu():
    register_node("node1", virtual_gpus("node1", "3x1GiB", NO_OVERHEAD), virtual=True)
    gpu_ids = list(GPU.objects.order_by("pk").values_list("pk", flat=True))
    clients, rounds = 16, 12
    owned = [make_replicas(2) for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    done = threading.Event()
    commits_per_gpu = {gpu_id: 0 for gpu_id in gpu_ids}
    expected_conflicts = 0
    lock = threading.Lock()
    errors: list[BaseException] = []
    violations: list[str] = []

    def client(n: int) -> None:
        nonlocal expected_conflicts
        rng = random.Random(n)
        try:
            start.wait()
            for _ in range(rounds):
                gpu_id = rng.choice(gpu_ids)
                replica = rng.choice(owned[n])

                def decide(snap, gpu_id=gpu_id, replica=replica):
                    gpu = snap.gpus[gpu_id]
                    if any(o.replica_id == replica for o in gpu.occupants):
                        return Plan.against(snap, f"client {n} releases", releases=[Release(gpu_id, replica)])
                    # Fit is judged on the snapshot only; the compare-and-swap makes that safe.
                    size = min(rng.randint(50, 400) * MiB, gpu.available_bytes)
                    return Plan.against(snap, f"client {n} reserves", [Reservation(gpu_id, replica, size)])

                try:
                    result = commit_with_retry(decide, gpu_ids=[gpu_id], attempts=50)
                except CasConflict:
                    with lock:
                        expected_conflicts += 50
                    continue
                with lock:
                    commits_per_gpu[gpu_id] += 1
                    expected_conflicts += result.attempts - 1
        except BaseException as err:  # surfaced by the main thread's assertion
            errors.append(err)
        finally:
            connection.close()

    def watcher() -> None:
        try:
            while not done.is_set():
                violations.extend(invariant_violations())
        finally:
            connection.close()

    counted = conflicts_counted()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    watch = threading.Thread(target=watcher)
    for thread in threads:
        thread.start()
    watch.start()
    start.wait()
    for thread in threads:
        thread.join()
    done.set()
    watch.join()

    assert errors == []
    assert violations == [], "the invariant held at every sample taken during the run"
    assert invariant_violations() == []
    assert sum(commits_per_gpu.values()) > 0
    for gpu in GPU.objects.all():
        assert gpu.version == commits_per_gpu[gpu.pk], "every commit, and only a commit, bumps the version"
    assert conflicts_counted() - counted == expected_conflicts
    assert ledger.snapshot().gpus.keys() == set(gpu_ids)


@pytest.mark.django_db(transaction=True)
def test_a_mirror_sees_a_commit_that_lands_after_its_read_started():
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    first, second = GPU.objects.order_by("pk").values_list("pk", flat=True)
    early, late = make_replicas(2)
    mirror = ledger.Mirror()
    assert set(mirror.snapshot().gpus) == {first, second}
    written, release = threading.Event(), threading.Event()

    def slow_writer() -> None:
        # Writes (taking its transaction id) before the mirror reads, commits only afterwards:
        # the case an "everything newer than what I saw" watermark would miss.
        try:
            with transaction.atomic():
                commit(Plan.against(snapshot([first]), "slow", [Reservation(first, late, 100 * MiB)]))
                written.set()
                release.wait(30)
        finally:
            connection.close()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    assert written.wait(30)
    commit(Plan.against(snapshot([second]), "quick", [Reservation(second, early, 200 * MiB)]))

    seen = mirror.snapshot()
    assert seen.gpus[second].available_bytes == GiB - 200 * MiB, "a committed change is picked up"
    assert seen.gpus[first].available_bytes == GiB, "an uncommitted one is not visible yet"

    release.set()
    writer.join()
    assert mirror.snapshot().gpus[first].available_bytes == GiB - 100 * MiB, "nor is it lost once it commits"


@pytest.mark.django_db(transaction=True)
def test_a_stale_mirror_costs_a_retry_not_an_over_commit():
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    gpu_id = GPU.objects.get().pk
    mine, theirs = make_replicas(2)
    mirror = ledger.Mirror()
    sizes: list[int] = []

    def other_client() -> None:
        try:
            commit(Plan.against(snapshot([gpu_id]), "theirs", [Reservation(gpu_id, theirs, 900 * MiB)]))
        finally:
            connection.close()

    def decide(snap):
        sizes.append(snap.gpus[gpu_id].available_bytes)
        if len(sizes) == 1:
            # Lands between the mirror's refresh and our commit: the mirror is now stale.
            writer = threading.Thread(target=other_client)
            writer.start()
            writer.join()
        # Takes all that the snapshot says is free.
        return Plan.against(snap, "mine", [Reservation(gpu_id, mine, snap.gpus[gpu_id].available_bytes)])

    result = commit_with_retry(decide, mirror=mirror, gpu_ids=[gpu_id])

    assert sizes == [GiB, GiB - 900 * MiB], "the retry refreshed the mirror"
    assert result.attempts == 2
    assert invariant_violations() == []
    assert GPU.objects.get().available_bytes == 0


@pytest.mark.django_db(transaction=True)
def test_a_mirror_reads_again_only_the_gpus_written_since_it_last_looked(monkeypatch):
    register_node("node1", virtual_gpus("node1", "4x1GiB", NO_OVERHEAD), virtual=True)
    written = GPU.objects.order_by("pk").values_list("pk", flat=True)[1]
    replica = make_replicas(1)[0]
    plan = Plan.against(snapshot([written]), "one", [Reservation(written, replica, 100 * MiB)])
    returned: list[list[int]] = []
    read = ledger._read

    def counting(seen, ids, again=()):
        found = read(seen, ids, again)
        returned.append([row[0] for row in found.rows])
        return found

    monkeypatch.setattr(ledger, "_read", counting)
    mirror = ledger.Mirror()
    mirror.snapshot()
    mirror.snapshot()
    commit(plan)
    seen = mirror.snapshot()
    mirror.snapshot()

    assert [len(r) for r in returned[:2]] == [4, 0], "a full read, then nothing new"
    assert returned[2:] == [[written], []], "the written GPU once, not again once seen"
    assert seen.gpus[written].available_bytes == GiB - 100 * MiB
    assert [o.replica_id for o in seen.gpus[written].occupants] == [replica]


def test_labels_and_reasons_reach_the_database_verbatim(gpu_ids):
    # The commit's arrays travel as text in PostgreSQL's array syntax: quotes, commas, braces,
    # backslashes and spaces must arrive unchanged.
    replica = make_replicas(1)[0]
    gpu_id = gpu_ids[0]
    label, reason = 'we"ird, {node}\\ 0', 'reason with "quotes", {braces} and \\'
    plan = Plan.against(snapshot([gpu_id]), reason, [Reservation(gpu_id, replica, MiB)])

    commit(Plan(plan.reason, plan.expected_versions, plan.reservations, labels={gpu_id: label}))

    event = Event.objects.get(kind=Event.Kind.GPU_RESERVED)
    assert (event.gpu, event.subject) == (label, f"gpu {label}")
    assert event.reason.endswith(reason)


@pytest.mark.django_db(transaction=True)
def test_a_mirror_read_inside_a_transaction_still_fetches_what_that_transaction_writes_after_it():
    register_node("node1", virtual_gpus("node1", "3x1GiB", NO_OVERHEAD), virtual=True)
    mine, theirs, later = GPU.objects.order_by("pk").values_list("pk", flat=True)
    first, second, third = make_replicas(3)
    mirror = ledger.Mirror()
    mirror.snapshot()

    def other_client() -> None:
        try:
            commit(Plan.against(snapshot([theirs]), "theirs", [Reservation(theirs, second, 100 * MiB)]))
        finally:
            connection.close()

    with transaction.atomic():
        # Our transaction takes its id, then another one that began later commits: our id is
        # below that snapshot's xmax and not in its running list, as if seen.
        commit(Plan.against(snapshot([mine]), "mine", [Reservation(mine, first, 100 * MiB)]))
        writer = threading.Thread(target=other_client)
        writer.start()
        writer.join()
        mirror.snapshot()
        commit(Plan.against(snapshot([later]), "later", [Reservation(later, third, 300 * MiB)]))

    assert mirror.snapshot().gpus[later].available_bytes == GiB - 300 * MiB, "written after the read: not lost"


@pytest.mark.django_db(transaction=True)
def test_a_mirrors_patched_index_stays_the_index_of_what_it_shows():
    register_node("node1", virtual_gpus("node1", "3x1GiB", NO_OVERHEAD), virtual=True)
    first, second, third = GPU.objects.order_by("pk").values_list("pk", flat=True)
    a, b = make_replicas(2)
    mirror = ledger.Mirror()
    mirror.snapshot()
    commit(Plan.against(snapshot([first]), "a", [Reservation(first, a, 100 * MiB)]))
    commit(Plan.against(snapshot([first, second]), "b", [Reservation(first, b, 50 * MiB)]))
    seen = mirror.snapshot()
    assert seen.index == SnapshotIndex.build(seen.gpus)
    assert [g.id for g, _ in seen.index.holdings[b]] == [first]

    # b moves to the second GPU; a node with new GPUs arrives: the index follows both.
    commit(
        Plan.against(
            snapshot([first, second]), "move", [Reservation(second, b, 50 * MiB)], releases=[Release(first, b)]
        )
    )
    register_node("node2", virtual_gpus("node2", "1x1GiB", NO_OVERHEAD), virtual=True)
    seen = mirror.snapshot()

    assert seen.index == SnapshotIndex.build(seen.gpus)
    assert [g.id for g, _ in seen.index.holdings[b]] == [second]
    assert set(seen.index.usable) == {"node1", "node2"} and third in seen.gpus


def test_a_snapshot_reuses_the_views_of_unchanged_gpus_and_builds_changed_ones_anew(gpu_ids):
    first, second = gpu_ids
    replica = make_replicas(1)[0]
    before = snapshot()

    commit(Plan.against(snapshot([first]), "one", [Reservation(first, replica, MiB)]))
    after = snapshot()

    assert after.gpus[second] is before.gpus[second], "the same row: the same view, not built again"
    assert after.gpus[first] is not before.gpus[first]
    assert after.gpus[first].available_bytes == GiB - MiB
    assert [o.replica_id for o in after.gpus[first].occupants] == [replica]
