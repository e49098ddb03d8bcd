"""An agent's calls reach the control plane as tasks on the `agents` queue and come back answered
(the agent never runs the control plane's services). Here the task runs on a thread with
its own connection, as a worker thread would, over the real PostgreSQL and Redis; the tests that
start real agents (test_agent.py and every e2e test) run it on the real `agents` worker."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
import redis
from django.conf import settings
from django.db import connection

from gpuportal.wire.control import AGENT_CALL_TASK, AGENT_QUEUE, ControlError
from gpuportal.wire.node_reports import Books, DeviceInfo
from inference.gateway import RemoteControl
from scheduling.models import GPU, Event, Node, Replica
from scheduling.services import node_gateway
from tests.support import factories

GIB = 1024**3


class Worker:
    """Carries out what RemoteControl sends as the `agents` worker would: each task on a thread."""

    def __init__(self, deliver: bool = True):
        self.deliver = deliver
        self.sent: list[tuple[str, str, float]] = []

    def send_task(self, name: str, *, args: list, queue: str, expires: float, declare: list) -> None:
        # Never declared: declaring reads the queue's length, which a node's Redis user may not.
        assert declare == []
        self.sent.append((name, queue, expires))
        if self.deliver:
            thread = threading.Thread(target=self._run, args=(args[0],))
            thread.start()

    def _run(self, payload: dict) -> None:
        from scheduling.tasks import agent_call

        try:
            agent_call(payload)
        finally:
            connection.close()


def remote(worker: Worker) -> RemoteControl:
    return RemoteControl(worker, settings.REDIS_URL)  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_an_agent_registers_beats_and_reports_through_the_agents_queue():
    worker = Worker()
    control = remote(worker)
    gpu = DeviceInfo(index=0, uuid="GPU-gw-0", product="Virtual GPU", total_bytes=4 * GIB, virtual=True)

    control.register_node("gw", [gpu], hostname="h", cpu_cache_bytes=GIB, virtual=True, survivors=[])
    node = Node.objects.get(name="gw")
    assert node.status == Node.Status.ONLINE and GPU.objects.get(node=node).uuid == "GPU-gw-0"

    replica = factories.replica(factories.deployment("d"), on=node, state=Replica.State.PENDING)
    assert control.heartbeat("gw", books=Books(), running=[replica.id]) == []
    control.report(replica.id, {"event": "progress", "percent": 40, "detail": "2 of 5 shards"})
    replica.refresh_from_db()
    assert (replica.state, replica.progress) == (Replica.State.LOADING, 40)
    assert control.replica_state(replica.id) == "loading"
    assert control.replica_state("gone") is None

    control.node_stopping("gw", "agent stopped")
    control.node_stopped("gw", "agent stopped")
    assert Node.objects.get(name="gw").status == Node.Status.OFFLINE
    assert Event.objects.filter(kind=Event.Kind.NODE_STOPPED, node="gw").exists()
    assert {(name, queue) for name, queue, _ in worker.sent} == {(AGENT_CALL_TASK, AGENT_QUEUE)}


@pytest.mark.django_db(transaction=True)
def test_a_call_the_control_plane_refuses_comes_back_as_its_error():
    control = remote(Worker())
    with pytest.raises(ControlError, match="heartbeat: NotFound: no node named 'never-registered'"):
        control.heartbeat("never-registered", books=None, running=[])


@pytest.mark.django_db(transaction=True)
def test_a_report_that_cannot_be_recorded_is_logged_by_the_agent_and_the_next_one_goes_through(caplog):
    control = remote(Worker())
    replica = factories.replica(factories.deployment("d"), on=factories.node("gw"), state=Replica.State.PENDING)

    control.report(replica.id, {"event": "progress", "percent": "forty"})  # the handler's int() refuses it
    assert "could not report progress of replica" in caplog.text
    control.report(replica.id, {"event": "progress", "percent": 60})
    replica.refresh_from_db()
    assert replica.progress == 60


@pytest.mark.django_db(transaction=True)
def test_a_call_nobody_answers_fails_after_its_wait_and_expires_with_it():
    worker = Worker(deliver=False)
    with pytest.raises(ControlError, match="no answer to replica_state within 1 s"):
        remote(worker).call("replica_state", "r1", timeout_s=1)
    assert worker.sent[0][2] == 1, "a call its caller gave up on is never applied late"


@pytest.mark.django_db(transaction=True)
def test_a_call_the_control_plane_cannot_read_is_answered_with_why():
    reply_to = f"gp:agent-reply:{uuid.uuid4().hex}"
    assert node_gateway.answer({"v": 99, "call": "report", "reply_to": reply_to}) == "unreadable"
    answer = json.loads(redis.Redis.from_url(settings.REDIS_URL).lpop(reply_to))
    assert answer == {"ok": False, "error": "call version 99 is not the control plane's (1): upgrade one side"}


def replica_waiting_an_hour(state: str) -> Replica:
    """A replica of node gw unchanged for an hour in `state`: past every lost command's grace."""
    from datetime import timedelta

    from django.utils import timezone

    replica = factories.replica(
        factories.deployment("d"), on=factories.node("gw"), state=state, gpu_mem_bytes_by_id={"0": GIB}
    )
    Replica.objects.filter(pk=replica.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    return replica


def refusal_of_a_beat(**kwargs) -> dict:
    """What the control plane answers a heartbeat call with these fields (checked: unreadable)."""
    reply_to = f"gp:agent-reply:{uuid.uuid4().hex}"
    call = {"v": 1, "call": "heartbeat", "reply_to": reply_to, "args": ["gw"], "kwargs": kwargs}
    assert node_gateway.answer(call) == "unreadable"
    return json.loads(redis.Redis.from_url(settings.REDIS_URL).lpop(reply_to))


@pytest.mark.django_db(transaction=True)
def test_a_beat_carries_the_state_of_each_replica_process_and_a_lost_wake_is_sent_again(dispatched):
    from tests.support.deployments import FROM_CACHE

    control = remote(Worker())
    replica = replica_waiting_an_hour(Replica.State.WAKING)

    assert control.heartbeat("gw", books=None, running=[replica.id], processes={replica.id: "sleeping"}) == []
    assert [(queue, task, args) for queue, task, args in dispatched] == [("node.gw", FROM_CACHE, [replica.id, []])]
    assert Event.objects.filter(replica=replica.id, reason__contains="its wake command was lost").exists()


@pytest.mark.django_db(transaction=True)
def test_a_beat_whose_process_states_are_not_states_is_refused_saying_why():
    answer = refusal_of_a_beat(processes=["r1"])
    assert answer["ok"] is False and "processes must map replica ids to states" in answer["error"]


@pytest.mark.django_db(transaction=True)
def test_a_beat_whose_arenas_are_not_byte_counts_is_refused_saying_why():
    answer = refusal_of_a_beat(processes={"r1": "serving"}, arenas={"r1": -5})
    assert answer["ok"] is False and "arenas must map replica ids to byte counts" in answer["error"]


@pytest.mark.django_db(transaction=True)
def test_a_beat_carries_the_arenas_replicas_keep_and_a_lost_drop_is_sent_again(dispatched):
    control = remote(Worker())
    replica = replica_waiting_an_hour(Replica.State.SERVING)

    beat = {"books": None, "running": [replica.id], "processes": {replica.id: "serving"}}
    assert control.heartbeat("gw", **beat, arenas={replica.id: GIB}) == []
    # The books lend it no arena: the drop that never arrived is sent again.
    assert [(queue, task, args) for queue, task, args in dispatched] == [
        ("node.gw", "inference.tasks.replica_arena", [replica.id, False])
    ]
    assert Event.objects.filter(replica=replica.id, reason__contains="the drop was lost, sent again").exists()


def _url_of_a_user_redis_does_not_know() -> str:
    server = redis.Redis.from_url(settings.REDIS_URL).connection_pool.connection_kwargs
    return f"redis://node-nobody-{uuid.uuid4().hex[:6]}:wrong@{server['host']}:{server['port']}/{server['db']}"


@pytest.mark.django_db(transaction=True)
def test_a_user_redis_refuses_is_a_refusal_at_once_not_an_outage_waited_out(caplog):
    from celery import Celery

    from inference.gateway import RedisRefused

    url = _url_of_a_user_redis_does_not_know()
    # The answer's list refuses it (the call itself goes out on a broker that takes it)...
    control = RemoteControl(Worker(deliver=False), url)  # type: ignore[arg-type]
    with pytest.raises(RedisRefused, match=r"Redis refused the node's user: .*(password|user)"):
        control.heartbeat("gw", books=None, running=[])
    # ...and so does the broker, which kombu reports as an error of its own.
    app = Celery("refused", broker=url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = False
    with pytest.raises(RedisRefused, match="Redis refused the node's user"):
        RemoteControl(app, url).heartbeat("gw", books=None, running=[])
    assert "retrying" not in caplog.text, "no outage's retries"
