"""A node's own Redis user, kept by the control plane (`node_credential acl NAME --apply`),
reaches the queue, live claims and deleted mark of the deployments placed on its node and of no
other: granted before a replica's start is sent, swept back to the books a drain and a minute
after the last replica of a deployment left. Against the test's Valkey (or Redis 7) and
PostgreSQL, with users signed in as a node's agent would be; the starts are recorded, not run."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis
from django.conf import settings
from django.db import connection
from django_celery_beat.models import PeriodicTask

from gpuportal.wire import node_acl, replies
from gpuportal.wire.memory import MiB
from gpuportal.wire.requestqueue.protocol import deleted_key, live_key, queue_key
from inference.devices import virtual_gpus
from scheduling import tasks
from scheduling.models import Event, Node, Replica
from scheduling.services import deployments, node_credentials, node_users, queue_grants
from scheduling.services.deployments import DeploymentSpec, ModelFacts
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.lock_waits import waiting
from tests.support.processes import wait_until

PASSWORD = "pw-of-a-kept-node"


def admin() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def reaches(user: redis.Redis, deployment: str) -> bool:
    """Whether the user may read and write each key the deployment's name opens."""
    try:
        user.llen(queue_key(deployment))
        user.zcard(live_key(deployment, "text"))
        user.exists(deleted_key(deployment))
    except redis.exceptions.NoPermissionError:
        return False
    return True


def key_rules(node: str) -> set[str]:
    return set(admin().acl_getuser(node_acl.user_name(node))["keys"])


@pytest.fixture
def node():
    """A node name of the test's own (users are the server's, shared by the suite's processes),
    its user and keys dropped after."""
    name = f"kept-{uuid.uuid4().hex[:8]}"
    server = admin()
    if int(server.info("server")["redis_version"].split(".")[0]) < node_acl.MIN_REDIS[0]:
        pytest.skip("a node's rules need Redis 7: REDIS_URL names an older Redis")
    yield name
    server.execute_command("ACL", "DELUSER", node_acl.user_name(name))
    server.delete(queue_grants.until_key(name))


def registered(name: str) -> None:
    register_node(name, virtual_gpus(name, "1x4GiB", factories.NO_OVERHEAD), virtual=True)


def kept_user(node: str) -> redis.Redis:
    """The node's user made by the control plane, signed in as its agent would be."""
    return redis.Redis.from_url(node_credentials.make_redis_user(node, PASSWORD, by="ops"))


def deploy(name: str) -> str:
    """A deployment of one replica, placed on the books' GPUs, its start sent once committed."""
    spec = DeploymentSpec(name=name, source="/srv/models/tiny", replicas=1, override_bytes=300 * MiB)
    deployments.create(spec, facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB))
    return name


@pytest.mark.django_db
def test_a_kept_user_reaches_the_queues_of_the_deployments_on_its_node_and_no_other(
    node, dispatched, django_capture_on_commit_callbacks
):
    registered(node)
    with django_capture_on_commit_callbacks(execute=True):
        served = deploy(f"served-{node}")
    elsewhere = factories.deployment(f"elsewhere-{node}")
    factories.replica(elsewhere, factories.node(f"other-{node}"), state=Replica.State.SERVING)

    user = kept_user(node)

    assert reaches(user, served)
    assert not reaches(user, elsewhere.name)
    assert not reaches(user, "any-other-name")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.rpop(queue_key(elsewhere.name))
    made = Event.objects.get(kind=Event.Kind.NODE_CREDENTIAL, node=node)
    assert made.after == {"deployments": [served]}
    assert made.reason.endswith("reaching the queues of the deployments placed on it alone")


@pytest.mark.django_db
def test_a_start_is_sent_only_once_its_node_reaches_the_deployments_queue(
    node, monkeypatch, django_capture_on_commit_callbacks
):
    from gpuportal.celery import app

    registered(node)
    user = kept_user(node)
    name = f"placed-{node}"
    assert not reaches(user, name)
    reached_when_sent: list[bool] = []
    monkeypatch.setattr(app, "send_task", lambda *args, **kwargs: reached_when_sent.append(reaches(user, name)))

    with django_capture_on_commit_callbacks(execute=True):
        deploy(name)

    assert reached_when_sent == [True]
    lasts_until = float(admin().hget(queue_grants.until_key(node), name))
    assert lasts_until > queue_grants.time.time(), "the grant is remembered in force, for the sweeps"


@pytest.mark.django_db
def test_a_start_whose_grant_meets_no_redis_is_not_sent_and_waits_for_the_heartbeat(
    node, monkeypatch, django_capture_on_commit_callbacks, caplog
):
    from gpuportal.celery import app

    registered(node)
    kept_user(node)
    sent: list[object] = []
    monkeypatch.setattr(app, "send_task", lambda *args, **kwargs: sent.append(args))

    def unreachable(*args, **kwargs):
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(queue_grants, "grant", unreachable)
    with django_capture_on_commit_callbacks(execute=True):
        deploy(f"unsent-{node}")

    assert sent == []
    replica = Replica.objects.get(deployment__name=f"unsent-{node}")
    assert replica.state == Replica.State.PENDING, "lost_commands sends it again past its grace"
    assert f"replica {replica.id}'s start is not sent" in caplog.text


@pytest.mark.django_db
def test_the_sweep_drops_a_deployment_whose_last_replica_left_a_drain_and_a_minute_ago_and_says_so(
    node, dispatched, django_capture_on_commit_callbacks, monkeypatch
):
    registered(node)
    with django_capture_on_commit_callbacks(execute=True):
        gone, staying, serving = (deploy(f"{what}-{node}") for what in ("gone", "staying", "serving"))
    user = kept_user(node)
    Replica.objects.filter(deployment__name__in=[gone, staying]).update(state=Replica.State.STOPPED)
    now = node_users.time.time()
    # The clock stands still from here: each sweep that sees `serving` on the node grants it its
    # drain and a minute from the sweep's time, and on a loaded machine the sweeps below ran more
    # than the second of slack the last check allows after `now` (so `serving` was kept).
    monkeypatch.setattr(node_users.time, "time", lambda: now)
    # When the sweep before this one last saw each on the node: `gone` longer ago than its drain
    # (30 s) and a minute, `staying` within them.
    admin().hset(queue_grants.until_key(node), mapping={gone: now - 1, staying: now + 30})

    assert node_users.sweep([node]) == {node: [gone]}

    assert not reaches(user, gone)
    assert reaches(user, staying) and reaches(user, serving)
    said = Event.objects.get(kind=Event.Kind.NODE_CREDENTIAL, node=node, reason__startswith="its Redis user no")
    assert said.reason == (
        f"its Redis user no longer reaches the queue of {gone}: no replica of it has been on the node "
        "for its drain and a minute"
    )
    assert said.after == {"deployments": sorted([staying, serving])}
    assert node_users.sweep([node]) == {}, "a second sweep finds nothing to drop"
    dropping = Event.objects.filter(kind=Event.Kind.NODE_CREDENTIAL, reason__startswith="its Redis user no longer")
    assert dropping.count() == 1

    # A deployment deleted while its replica drains: its rows are forgotten at once, and its grant
    # lasts for the drain and a minute past the last sweep that saw it (30 s and 60 s after `now`).
    with django_capture_on_commit_callbacks(execute=True):
        deployments.delete(serving)
    monkeypatch.setattr(node_users.time, "time", lambda: now + 60)
    assert node_users.sweep([node]) == {node: [staying]}
    assert reaches(user, serving)
    monkeypatch.setattr(node_users.time, "time", lambda: now + 30 + queue_grants.MARGIN_S + 1)
    assert node_users.sweep([node]) == {node: [serving]}
    assert not reaches(user, serving)


@pytest.mark.django_db
def test_the_sweep_puts_back_what_a_kept_user_lost_and_keeps_its_own_keys(node, dispatched):
    registered(node)
    replica = factories.replica(factories.deployment(f"back-{node}"))
    user = kept_user(node)
    Replica.objects.filter(pk=replica.pk).update(node_id=Node.objects.get(name=node).pk)
    wanted = set(node_acl.key_rules(node, [f"back-{node}"]))
    assert key_rules(node) != wanted and not reaches(user, f"back-{node}")

    assert node_users.sweep([node]) == {}

    assert key_rules(node) == wanted and reaches(user, f"back-{node}")
    user.ping()  # its password and connections untouched


@pytest.mark.django_db
def test_a_user_that_reaches_every_deployment_is_left_alone(node, dispatched, django_capture_on_commit_callbacks):
    """One loaded by hand from the line `node_credential acl NAME` prints: nothing keeps it."""
    registered(node)
    admin().execute_command(*node_acl.setuser_line(node, PASSWORD).split())
    before = key_rules(node)

    with django_capture_on_commit_callbacks(execute=True):
        deploy(f"hand-{node}")
    assert queue_grants.grant(node, f"hand-{node}") is False
    assert node_users.sweep([node]) == {}

    assert key_rules(node) == before
    assert admin().exists(queue_grants.until_key(node)) == 0


@pytest.mark.django_db
def test_a_control_plane_that_may_not_administer_redis_keeps_no_user_and_still_sends_starts(
    node, dispatched, django_capture_on_commit_callbacks, settings
):
    registered(node)
    server = admin()
    server.execute_command("ACL", "SETUSER", "cp-plain", "reset", "on", ">cp-pw", "~*", "&*", "+@all", "-@admin")
    kwargs = server.connection_pool.connection_kwargs
    settings.REDIS_URL = f"redis://cp-plain:cp-pw@{kwargs['host']}:{kwargs['port']}/{kwargs['db']}"
    try:
        assert queue_grants.grant(node, "whatever") is False
        assert node_users.sweep([node]) == {}
        with django_capture_on_commit_callbacks(execute=True):
            deploy(f"plain-{node}")
        assert [queue for queue, *_ in dispatched] == [f"node.{node}"]
    finally:
        server.execute_command("ACL", "DELUSER", "cp-plain")


@pytest.mark.django_db(transaction=True)
def test_a_sweep_that_read_the_books_before_a_placement_does_not_drop_the_grant_made_after_it(node, monkeypatch):
    """The sweep reads the books, then sets the user's keys anew: a placement committed and granted
    in between would be dropped but for the node's lock, which the grant waits for."""
    registered(node)
    user = kept_user(node)
    late = factories.deployment(f"late-{node}")
    books_read, go_on = threading.Event(), threading.Event()
    reading = node_users._serving

    def read_then_wait(name: str) -> dict[str, float]:
        read = reading(name)
        books_read.set()
        assert go_on.wait(30)
        return read

    monkeypatch.setattr(node_users, "_serving", read_then_wait)
    outcome: dict[str, object] = {}

    def in_a_thread(key: str, work) -> threading.Thread:
        def run() -> None:
            try:
                outcome[key] = work()
            finally:
                connection.close()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    sweeping = in_a_thread("sweep", lambda: node_users.sweep([node]))
    assert books_read.wait(30)
    # The placement commits after the sweep read the books, and is granted.
    factories.replica(late, Node.objects.get(name=node), state=Replica.State.PENDING)
    granting = in_a_thread("grant", lambda: queue_grants.grant(node, late.name))
    with connection.cursor() as cursor:
        wait_until(lambda: waiting(cursor, "advisory") > 0, 30, "the grant to wait for the node's lock", every=0.01)
    go_on.set()
    sweeping.join(30)
    granting.join(30)

    assert outcome == {"sweep": {}, "grant": True}
    assert reaches(user, late.name)


@pytest.mark.django_db
def test_revoking_a_node_forgets_what_its_user_reached(node, dispatched, django_capture_on_commit_callbacks):
    registered(node)
    with django_capture_on_commit_callbacks(execute=True):
        deploy(f"revoked-{node}")
    kept_user(node)
    node_credentials.issue(node, by="ops")
    assert admin().exists(queue_grants.until_key(node))

    with django_capture_on_commit_callbacks(execute=True):
        node_credentials.revoke(node, by="ops")

    assert admin().acl_getuser(node_acl.user_name(node)) is None
    assert not admin().exists(queue_grants.until_key(node))


def test_beat_sweeps_the_kept_users_every_minute(beat_schedules):
    schedule = PeriodicTask.objects.get(name="keep node users")
    assert schedule.task == tasks.keep_node_users.name == "scheduling.tasks.keep_node_users"
    assert (schedule.interval.every, schedule.interval.period, schedule.queue) == (60, "seconds", "control")
    assert schedule.enabled
