"""Failover pairs on the control-plane side (seed 004), without processes: what the agents are
sent is recorded, and what pair members report (standing by, serving at an epoch, taking over,
failing, stopping) is fed to `replicas.report` as their node agent would relay it. The pair's
FailoverLease row learns its holder and epoch from those reports alone (the lock is the node's).
The same behaviours end to end with real processes are in tests/inference/test_failover.py, and the lock
itself in tests/inference/test_failover_lock.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.messages import get_messages
from django.utils import timezone

from scheduling.models import GPU, Deployment, Event, FailoverLease, Node, Occupant, Replica
from scheduling.services import replicas as replica_services
from scheduling.services import requests as request_services
from scheduling.services import sleep
from scheduling.services.replicas import RECONCILE_TASK
from tests.support.deployments import START, STOP, MiB, body, invariant_holds
from tests.support.pairs import serves_at, stands_by, takes_over

pytestmark = pytest.mark.django_db

PAIR_BYTES = 300 * MiB  # the override `body` deploys with: what one pair reserves on its GPU


# -- what pair members report ----------------------------------------------------------------------


def crashes(report, replica: Replica, reason: str = "SIGKILL") -> None:
    report(replica, "failed", kind="crash", reason=reason)


# -- reading the outcome ---------------------------------------------------------------------------


def fresh(replica: Replica) -> Replica:
    return Replica.objects.select_related("node").get(pk=replica.pk)


def members(name: str) -> tuple[Replica, Replica]:
    """(primary, standby) of a deployment's only pair, as placed."""
    primary = Replica.objects.select_related("node").get(deployment__name=name, role="primary")
    standby = Replica.objects.select_related("node").get(deployment__name=name, role="standby")
    return primary, standby


def gpu_of(replica: Replica) -> GPU:
    (index,) = replica.gpu_mem_bytes_by_id
    return GPU.objects.get(node=replica.node, index=int(index))


def holders() -> dict[str, int]:
    """Every reservation in the ledger: {replica id: bytes}."""
    return dict(Occupant.objects.values_list("replica_id", "reserved_bytes"))


def tasks(dispatched, task: str) -> list[str]:
    """The replicas `task` was dispatched for, in order."""
    return [args[0] for _, sent, args in dispatched if sent == task]


def events(kind: str, **filters) -> list[Event]:
    return list(Event.objects.filter(kind=kind, **filters).order_by("time"))


def deploy_pair(api, model_dir, name: str = "pair", **overrides) -> tuple[Replica, Replica]:
    response = api("post", "/api/deployments/", body(name, model_dir, failover={"standby": True}, **overrides))
    assert response.status_code == 201, response.json()
    return members(name)


@pytest.fixture
def ready_pair(cluster, api, report, dispatched, tiny_model_dir) -> tuple[Replica, Replica]:
    """A failover deployment `pair` whose primary serves at epoch 1 and whose standby stands by."""
    primary, standby = deploy_pair(api, tiny_model_dir)
    stands_by(report, standby)
    serves_at(report, primary, epoch=1)
    dispatched.clear()
    return fresh(primary), fresh(standby)


# -- pairing ---------------------------------------------------------------------------------------


def test_it_places_a_failover_deployment_as_a_primary_and_a_standby_sharing_one_reservation(
    cluster, api, dispatched, tiny_model_dir
):
    response = api("post", "/api/deployments/", body("pair", tiny_model_dir, failover={"standby": True}))

    assert response.status_code == 201, response.json()
    deployment = Deployment.objects.get(name="pair")
    assert deployment.failover_standby is True
    [lease] = FailoverLease.objects.filter(deployment=deployment)
    primary, standby = members("pair")
    assert (primary.role, standby.role) == ("primary", "standby")
    assert primary.lease_id == standby.lease_id == lease.pk
    assert primary.node == standby.node
    assert (
        primary.gpu_mem_bytes_by_id
        == standby.gpu_mem_bytes_by_id
        == {next(iter(primary.gpu_mem_bytes_by_id)): PAIR_BYTES}
    )
    assert primary.state == standby.state == "pending"
    assert holders() == {primary.id: PAIR_BYTES}, "one reservation for the pair, on its primary"
    assert sorted(tasks(dispatched, START)) == sorted([primary.id, standby.id])
    assert {queue for queue, _, _ in dispatched} == {primary.node.queue}
    assert invariant_holds()
    assert deployment.replicas.count() == 2 and deployment.replicas_wanted == 1


def test_it_makes_the_primary_that_serves_at_an_epoch_the_active_member(cluster, api, report, tiny_model_dir):
    primary, standby = deploy_pair(api, tiny_model_dir)

    stands_by(report, standby)
    serves_at(report, primary, epoch=1)

    primary, standby = fresh(primary), fresh(standby)
    assert (primary.state, primary.failover_state, primary.epoch) == ("serving", "active", 1)
    assert (standby.state, standby.failover_state, standby.progress) == ("standby", "standby", 100)
    assert holders() == {primary.id: PAIR_BYTES}, "standing by holds nothing more"
    [grant] = events(Event.Kind.FAILOVER_GRANT, replica=primary.id)
    assert grant.after == {"epoch": 1}
    assert sleep.awake_count(Deployment.objects.get(name="pair")) == 1


# -- a takeover ------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["the old active's failure", "the standby's takeover"])
def test_when_the_active_dies_its_standby_takes_the_reservation_and_a_fresh_standby_is_started(
    ready_pair, report, dispatched, first
):
    active, standby = ready_pair
    gpu = gpu_of(active)
    available = gpu.available_bytes

    if first == "the old active's failure":
        crashes(report, active)
    else:
        takes_over(report, standby, epoch=2, previous=active)

    # Whichever arrives first, the pair's bytes move to the standby in one commit: never released.
    assert holders() == {standby.id: PAIR_BYTES}
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    assert fresh(active).failover_state == "dead"

    if first == "the old active's failure":
        old = fresh(active)
        assert (old.state, old.failure_reason, old.pid) == ("failed", "SIGKILL", None)
        assert fresh(standby).state == "standby", "it serves once it says so"
        takes_over(report, standby, epoch=2, previous=active)
    else:
        crashes(report, active)

    old, new = fresh(active), fresh(standby)
    assert (old.state, old.failover_state) == ("failed", "dead")
    assert (new.state, new.role, new.epoch, new.failover_state) == ("serving", "primary", 2, "active")
    assert new.serving_since is not None and new.pid == 5001
    [replacement] = Replica.objects.filter(lease=active.lease_id, role="standby")
    assert replacement.state == "pending" and replacement.node == new.node
    assert replacement.gpu_mem_bytes_by_id == new.gpu_mem_bytes_by_id
    # (A reconcile is asked for too, as for any replica that ended unasked; it finds the pair whole.)
    assert [d for d in dispatched if d[1] != RECONCILE_TASK] == [(new.node.queue, START, [replacement.id, []])]
    # The ledger: the new active holds the pair's bytes; the old one and the fresh standby nothing.
    assert holders() == {new.id: PAIR_BYTES}
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    assert invariant_holds()
    [takeover] = events(Event.Kind.FAILOVER_TAKEOVER, deployment="pair")
    assert takeover.replica == new.id
    assert takeover.before == {"holder": active.id, "epoch": 1}
    assert takeover.after["holder"] == new.id and takeover.after["epoch"] == 2
    assert sleep.awake_count(Deployment.objects.get(name="pair")) == 1


def test_when_the_primary_dies_holding_the_lock_while_loading_its_standby_inherits_the_reservation(
    cluster, api, report, dispatched, tiny_model_dir
):
    primary, standby = deploy_pair(api, tiny_model_dir)
    stands_by(report, standby)
    # The primary took the free lock at once (it reported the grant), and is loading.
    report(primary, "failover", state="init")
    report(primary, "lease", what="grant", epoch=1, previous_holder=None, previous_epoch=0)
    assert FailoverLease.objects.get(pk=primary.lease_id).holder_id == primary.id
    report(primary, "progress", percent=40)
    assert fresh(primary).state == "loading"
    gpu = gpu_of(primary)
    available = gpu.available_bytes

    crashes(report, primary, reason="killed while loading")

    # Its process ended, so the standby is granted the lock and wakes into the pair's memory:
    # that memory must still be reserved for it, as when a serving active dies.
    assert fresh(primary).state == "failed"
    assert holders() == {standby.id: PAIR_BYTES}
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    takes_over(report, standby, epoch=2, previous=primary)
    assert fresh(standby).state == "serving" and holders() == {standby.id: PAIR_BYTES}
    assert invariant_holds()


def test_when_the_standby_gets_the_free_lock_before_its_primary_the_pair_still_holds_its_bytes_once(
    cluster, api, report, dispatched, tiny_model_dir
):
    # The standby starts at once; its primary's start may wait for evicted victims to let go. A
    # standby standing by first finds the lock free (never held) and takes it at epoch 1.
    primary, standby = deploy_pair(api, tiny_model_dir)
    gpu = gpu_of(primary)
    available = gpu.available_bytes
    stands_by(report, standby)
    takes_over(report, standby, epoch=1, previous=None)
    # The primary then finds the lock taken and stands by in its place.
    report(primary, "failover", state="init")
    report(primary, "standby", pid=4001, weights_bytes=10 * MiB, residual_bytes_by_id={"0": 0})

    assert fresh(standby).state == "serving" and fresh(primary).state == "standby"
    assert sum(holders().values()) == PAIR_BYTES, holders()
    assert holders() == {standby.id: PAIR_BYTES}
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    alive = Replica.objects.filter(lease=primary.lease_id).exclude(state__in=["stopped", "failed"])
    assert alive.count() == 2, "the primary standing by makes the pair whole: no third member"
    assert invariant_holds()


def test_a_pair_counts_once_as_awake_while_its_standby_is_about_to_take_over(ready_pair, report):
    active, standby = ready_pair
    deployment = Deployment.objects.get(name="pair")
    assert sleep.awake_count(deployment) == 1

    crashes(report, active)

    assert fresh(active).state == "failed" and fresh(standby).state == "standby"
    assert sleep.awake_count(deployment) == 1, "the standby standing by counts for the pair"


def test_the_lease_follows_the_grants_its_members_report_and_never_moves_back(ready_pair, report):
    active, standby = ready_pair
    lease = FailoverLease.objects.get(pk=active.lease_id)
    assert (lease.holder_id, lease.epoch) == (active.id, 1), "the primary's grant, as it reported it"

    # Two members' reports cross on their agent's reader threads: the newer grant stands.
    report(standby, "lease", what="grant", epoch=2, previous_holder=active.id, previous_epoch=1)
    report(active, "lease", what="grant", epoch=1, previous_holder=None, previous_epoch=0)

    lease.refresh_from_db()
    assert (lease.holder_id, lease.epoch) == (standby.id, 2)
    assert [e.after["epoch"] for e in events(Event.Kind.FAILOVER_GRANT)] == [1, 2, 1], "each grant is on record"


def test_it_refuses_a_report_carrying_an_older_epoch_than_the_lease(ready_pair, report, dispatched):
    active, standby = ready_pair
    # Another member of the pair has since taken the lock at epoch 3, and said so.
    report(active, "lease", what="grant", epoch=3, previous_holder=None, previous_epoch=2)
    assert FailoverLease.objects.get(pk=active.lease_id).epoch == 3
    before = {r.id: (r.state, r.role, r.epoch, r.failover_state) for r in Replica.objects.all()}
    ledger = holders()

    report(standby, "active", epoch=2, previous_holder=active.id, previous_epoch=1, takeover_s=0.005, pid=5001)

    assert {r.id: (r.state, r.role, r.epoch, r.failover_state) for r in Replica.objects.all()} == before
    assert holders() == ledger and dispatched == []
    assert events(Event.Kind.FAILOVER_TAKEOVER) == []
    [stale] = events(Event.Kind.FAILOVER_STALE, replica=standby.id)
    assert (stale.before, stale.after) == ({"epoch": 2}, {"epoch": 3})
    assert "epoch 2" in stale.reason and "epoch 3" in stale.reason


# -- a planned switchover --------------------------------------------------------------------------


def test_a_switchover_is_refused_without_a_failover_standby(cluster, api, report, tiny_model_dir):
    assert api("post", "/api/deployments/", body("plain", tiny_model_dir)).status_code == 201
    report(Replica.objects.get(deployment__name="plain"), "serving", pid=4001, weights_bytes=10 * MiB)

    response = api("post", "/api/deployments/plain/failover/")

    assert response.status_code == 409
    assert "failover.standby" in response.json()["detail"]
    assert Replica.objects.get(deployment__name="plain").state == "serving"
    assert events(Event.Kind.FAILOVER_SWITCHOVER) == []


def test_a_switchover_waits_for_the_standby_to_stand_by(cluster, api, report, dispatched, tiny_model_dir):
    primary, standby = deploy_pair(api, tiny_model_dir)
    serves_at(report, primary, epoch=1)
    report(standby, "progress", percent=40)
    dispatched.clear()

    response = api("post", "/api/deployments/pair/failover/")

    assert response.status_code == 409
    assert "standby is still loading" in response.json()["detail"]
    assert fresh(primary).state == "serving" and dispatched == []
    assert events(Event.Kind.FAILOVER_SWITCHOVER) == []


def test_a_switchover_drains_the_active_and_its_exit_hands_the_reservation_to_the_standby(
    ready_pair, api, report, dispatched
):
    active, standby = ready_pair
    gpu = gpu_of(active)
    available = gpu.available_bytes

    response = api("post", "/api/deployments/pair/failover/")

    assert response.status_code == 200, response.json()
    assert fresh(active).state == "draining"
    assert dispatched == [(active.node.queue, STOP, [active.id])]
    [switchover] = events(Event.Kind.FAILOVER_SWITCHOVER, deployment="pair")
    assert switchover.replica == active.id and "planned switchover by ops" in switchover.reason
    assert holders() == {active.id: PAIR_BYTES}, "the active keeps the reservation while it drains"
    assert FailoverLease.objects.get(pk=active.lease_id).closed_at is None, "its standby is to take over"

    report(active, "stopped")

    old = fresh(active)
    assert (old.state, old.failover_state, old.failure_reason) == ("stopped", "dead", "")
    assert holders() == {standby.id: PAIR_BYTES}, "passed to the standby, not released"
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    assert fresh(standby).state == "standby"
    assert invariant_holds()

    takes_over(report, standby, epoch=2, previous=active)
    assert (fresh(standby).state, fresh(standby).epoch) == ("serving", 2)
    assert holders() == {standby.id: PAIR_BYTES}


def test_a_switchover_whose_takeover_arrives_before_the_old_actives_exit_ends_with_one_reservation(
    ready_pair, api, report, dispatched
):
    active, standby = ready_pair
    gpu = gpu_of(active)
    available = gpu.available_bytes
    assert api("post", "/api/deployments/pair/failover/").status_code == 200

    # The old active let go of the lock as it exited; its agent relays `stopped` a little later.
    takes_over(report, standby, epoch=2, previous=active)
    report(active, "stopped")

    old, new = fresh(active), fresh(standby)
    assert (old.state, old.failover_state) == ("stopped", "dead")
    assert (new.state, new.role, new.epoch) == ("serving", "primary", 2)
    [replacement] = Replica.objects.filter(lease=active.lease_id, role="standby")
    assert replacement.state == "pending"
    assert holders() == {new.id: PAIR_BYTES}, "the fresh standby holds nothing until it is needed"
    assert GPU.objects.get(pk=gpu.pk).available_bytes == available
    assert invariant_holds()


def test_the_admin_switches_over_a_ready_pair_and_says_why_it_cannot_for_a_deployment_without_one(
    ready_pair, api, admin_client, tiny_model_dir
):
    active, _ = ready_pair
    assert api("post", "/api/deployments/", body("plain", tiny_model_dir)).status_code == 201
    selected = list(Deployment.objects.filter(name__in=["pair", "plain"]).values_list("pk", flat=True))

    response = admin_client.post(
        "/admin/scheduling/deployment/",
        {"_selected_action": selected, "action": "switch_over_deployments"},
        follow=True,
    )

    assert response.status_code == 200
    messages = {m.level_tag: str(m) for m in get_messages(response.wsgi_request)}
    assert messages.keys() == {"success", "error"}, messages
    assert messages["success"].startswith("pair: 1 active replica(s) draining")
    assert messages["error"].startswith("plain: ") and "no failover standby" in messages["error"]
    assert fresh(active).state == "draining"
    [switchover] = events(Event.Kind.FAILOVER_SWITCHOVER, deployment="pair")
    assert "(admin)" in switchover.reason


# -- scaling and changing a failover deployment ----------------------------------------------------


def test_scaling_up_adds_whole_pairs_and_scaling_to_zero_stops_every_member(ready_pair, api, report, dispatched):
    response = api("post", "/api/deployments/pair/scale/", {"replicas": 2})

    assert response.status_code == 200, response.json()
    deployment = Deployment.objects.get(name="pair")
    assert deployment.replicas_wanted == 2
    leases = list(FailoverLease.objects.filter(deployment=deployment).order_by("slot"))
    assert [lease.slot for lease in leases] == [1, 2]
    second = list(Replica.objects.filter(lease=leases[1]).order_by("role"))
    assert [r.role for r in second] == ["primary", "standby"]
    assert sorted(tasks(dispatched, START)) == sorted(r.id for r in second)
    assert len(holders()) == 2 and invariant_holds()
    stands_by(report, second[1])
    serves_at(report, fresh(second[0]), epoch=1)
    assert sleep.awake_count(deployment) == 2
    everyone = list(Replica.objects.filter(deployment=deployment))
    assert len(everyone) == 4
    dispatched.clear()

    response = api("post", "/api/deployments/pair/scale/", {"replicas": 0})

    assert response.status_code == 200, response.json()
    assert {r.id: r.state for r in Replica.objects.all()} == {r.id: "stopping" for r in everyone}
    assert sorted(tasks(dispatched, STOP)) == sorted(r.id for r in everyone)
    assert tasks(dispatched, START) == []
    assert holders() == {} and invariant_holds()
    assert all(g.available_bytes == g.total_bytes for g in GPU.objects.all())
    # Both leases closed with the stops, and each stop closes its pair's lock on the node: a
    # standby granted a lock as its active exits leaves it.
    assert all(lease.closed_at is not None for lease in FailoverLease.objects.filter(deployment=deployment))
    assert sorted(a for _q, t, a in dispatched if t == STOP) == sorted([r.id, "close pair"] for r in everyone)
    dispatched.clear()

    # The members' exits arrive in any order: a standby first, then its active; nothing hands over.
    for replica in sorted(everyone, key=lambda r: r.role == "primary"):
        report(replica, "stopped")
        assert holders() == {}

    assert {r.state for r in Replica.objects.all()} == {"stopped"}
    assert {r.failover_state for r in Replica.objects.all()} == {"dead"}
    assert dispatched == [], "no replacement standby for a pair that is going"
    assert events(Event.Kind.FAILOVER_TAKEOVER) == []


def test_failover_standby_cannot_be_changed_on_an_existing_deployment(ready_pair, api):
    before = list(Replica.objects.order_by("pk").values_list("id", "state", "role"))

    response = api("patch", "/api/deployments/pair/", {"failover": {"standby": False}, "fairness": {"max_wait_s": 9}})

    assert response.status_code == 400
    assert "cannot be changed" in response.json()["failover.standby"][0]
    deployment = Deployment.objects.get(name="pair")
    assert deployment.failover_standby is True and deployment.max_wait_s == 5.0, "nothing applied"
    assert list(Replica.objects.order_by("pk").values_list("id", "state", "role")) == before

    response = api("patch", "/api/deployments/pair/", {"failover": {"standby": True}, "fairness": {"max_wait_s": 9}})

    assert response.status_code == 200, response.json()
    deployment.refresh_from_db()
    assert deployment.failover_standby is True and deployment.max_wait_s == 9.0
    assert list(Replica.objects.order_by("pk").values_list("id", "state", "role")) == before


def test_failover_cannot_be_switched_on_for_a_deployment_created_without_it(cluster, api, tiny_model_dir):
    assert api("post", "/api/deployments/", body("plain", tiny_model_dir)).status_code == 201

    response = api("patch", "/api/deployments/plain/", {"failover": {"standby": True}})

    assert response.status_code == 400 and "failover.standby" in response.json()
    assert Deployment.objects.get(name="plain").failover_standby is False
    assert not FailoverLease.objects.exists() and Replica.objects.count() == 1
    assert api("patch", "/api/deployments/plain/", {"failover": {"standby": False}}).status_code == 200


# -- a pair never sleeps ---------------------------------------------------------------------------


@pytest.mark.parametrize("control", ["sleep", "evict"])
def test_a_pair_member_cannot_be_put_to_sleep_or_evicted(ready_pair, api, dispatched, control):
    active, standby = ready_pair

    response = api("post", f"/api/replicas/{active.id}/{control}/")

    assert response.status_code == 409
    assert "failover pair" in response.json()["detail"]
    assert api("post", f"/api/replicas/{standby.id}/{control}/").status_code == 409
    assert api("post", f"/api/deployments/pair/{control}/").status_code == 409
    assert (fresh(active).state, fresh(standby).state) == ("serving", "standby")
    assert Deployment.objects.get(name="pair").replicas_wanted == 1
    assert dispatched == [] and holders() == {active.id: PAIR_BYTES}


def test_a_drain_puts_its_nodes_plain_replicas_to_sleep_and_leaves_a_pair_serving_saying_why(
    ready_pair, api, report, dispatched, tiny_model_dir
):
    active, standby = ready_pair
    node = active.node.name
    spread = {"spread": True}  # one on each node: one beside the pair
    assert (
        api("post", "/api/deployments/", body("plain", tiny_model_dir, replicas=2, placement=spread)).status_code == 201
    )
    for plain in Replica.objects.filter(deployment__name="plain"):
        report(plain, "serving", pid=4002, weights_bytes=10 * MiB)
    on_node = set(Replica.objects.filter(deployment__name="plain", node__name=node).values_list("id", flat=True))
    assert on_node, "a plain replica beside the pair"

    response = api("post", f"/api/nodes/{node}/drain/")

    assert response.status_code == 200, response.json()
    assert Node.objects.get(name=node).status == "draining"
    assert {r.id for r in Replica.objects.filter(pk__in=on_node, state="draining")} == on_node
    assert (fresh(active).state, fresh(standby).state) == ("serving", "standby")
    (kept,) = events("node.draining", replica=active.id)
    assert "keeps serving there: it is the active member of a failover pair" in kept.reason


def test_the_idle_sweep_never_puts_a_pair_to_sleep(cluster, api, report, dispatched, tiny_model_dir):
    primary, standby = deploy_pair(api, tiny_model_dir, sleep={"idle_timeout_s": 1})
    stands_by(report, standby)
    serves_at(report, primary, epoch=1)
    assert api("post", "/api/deployments/", body("plain", tiny_model_dir, sleep={"idle_timeout_s": 1})).status_code == (
        201
    )
    plain = Replica.objects.get(deployment__name="plain")
    report(plain, "serving", pid=4002, weights_bytes=10 * MiB)
    long_ago = timezone.now() - timedelta(hours=2)
    Replica.objects.update(serving_since=long_ago, last_accessed=long_ago)

    slept = sleep.sweep_idle(now=timezone.now())

    assert slept == [plain.id], "the plain replica idle as long does sleep"
    assert (fresh(primary).state, fresh(standby).state) == ("serving", "standby")
    assert sleep.sweep_idle(now=timezone.now() + timedelta(days=1)) == []
    assert fresh(primary).state == "serving"


def test_a_reconcile_between_the_actives_death_and_the_takeover_counts_the_standby_as_the_pair(
    ready_pair, report, dispatched, django_capture_on_commit_callbacks
):
    from scheduling.services import deployments

    active, _ = ready_pair
    crashes(report, active)  # its death is recorded; the standby's takeover report is still on its way
    assert (RECONCILE_TASK, ["replica " + active.id[:8] + " of pair failed"]) in [(t, a) for _, t, a in dispatched]

    with django_capture_on_commit_callbacks(execute=True):
        assert deployments.reconcile_all("reconciled: test") == {}, "the standby is the pair: no second pair"
    assert Replica.objects.filter(deployment__name="pair").count() == 2


# -- a pair lost with its node ----------------------------------------------------------------------


def test_a_pair_lost_with_its_node_goes_whole_and_the_reconcile_places_a_new_pair(
    ready_pair, dispatched, django_capture_on_commit_callbacks
):
    from scheduling.services import deployments

    capture = django_capture_on_commit_callbacks
    active, standby = ready_pair
    node = active.node.name
    request_services.queue.cache_clear()
    queue = request_services.queue()
    queue.fail_queued("pair", reason="left over from another test")
    taken = queue.submit("pair", kind="generate", input="hi", params={}, owner="1")
    assert queue.take("pair", active.id, timeout=1).id == taken.id

    # Its standby stands beside it, on the same node: nothing of the pair is left to take over.
    with capture(execute=True):
        replica_services.lose_with_node(node, f"lost with node {node} (test)")

    for member in (fresh(active), fresh(standby)):
        assert (member.state, member.failover_state, member.pid) == ("stopped", "dead", None)
    assert holders() == {}
    assert queue.get(taken.id).status == "queued", "what the active had taken goes back"
    assert invariant_holds()

    Node.objects.filter(name=node).update(status=Node.Status.OFFLINE)
    dispatched.clear()
    with capture(execute=True):
        deployments.reconcile_all("reconciled: test")
    primary, second = Replica.objects.exclude(pk__in=[active.pk, standby.pk]).order_by("role")
    assert (primary.role, second.role) == ("primary", "standby")
    assert primary.lease_id == second.lease_id != active.lease_id, "a new pair, with a lease of its own"
    assert primary.node.name == second.node.name != node
    assert sorted(tasks(dispatched, START)) == sorted([primary.id, second.id])


# -- a standby that dies before it is needed --------------------------------------------------------


def test_a_failed_standby_is_replaced_until_standbys_keep_failing(ready_pair, report, dispatched, settings):
    settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR = 1
    active, standby = ready_pair

    crashes(report, standby, reason="standby lost its host memory")

    assert (fresh(standby).state, fresh(standby).failover_state) == ("failed", "dead")
    assert fresh(standby).failure_reason == "standby lost its host memory"
    [replacement] = Replica.objects.filter(lease=active.lease_id, role="standby", state="pending")
    assert replacement.node == active.node and replacement.gpu_mem_bytes_by_id == active.gpu_mem_bytes_by_id
    assert dispatched == [(active.node.queue, START, [replacement.id, []])]
    assert fresh(active).state == "serving" and holders() == {active.id: PAIR_BYTES}
    assert events(Event.Kind.REPLICA_STATE, replica=replacement.id)[0].reason.startswith("standby placed beside")
    dispatched.clear()

    stands_by(report, replacement)
    crashes(report, replacement, reason="standby lost its host memory again")

    assert fresh(replacement).state == "failed"
    assert dispatched == [], "no third standby after two failed within the hour"
    assert not Replica.objects.filter(lease=active.lease_id, role="standby", state="pending").exists()
    [refusal] = [e for e in events(Event.Kind.REPLICA_STATE, replica=replacement.id) if "not replacing" in e.reason]
    assert "2 standbys of the pair failed in the last hour" in refusal.reason
    assert fresh(active).state == "serving" and holders() == {active.id: PAIR_BYTES}
    assert invariant_holds()
