"""Every node's Redis user may push onto the `agents` queue: it is how an agent calls the control
plane. What else a node pushes there neither stops the control plane's agents worker nor has it
run anything but an agent's call (gpuportal.broker); and no worker takes remote control, which
any Redis user may publish. The last tests push at the session's agents worker itself."""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any

import pytest
import redis
from django.conf import settings
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.broker import QUEUE_TASKS, envelope_problem
from gpuportal.celery import app
from gpuportal.wire.control import AGENT_CALL_TASK, AGENT_QUEUE
from inference.gateway import RemoteControl
from scheduling.models import Node


def sent_as_celery_sends(task: str, args: list[Any]) -> dict[str, Any]:
    """The message Celery's producer writes for `task`, as it lies on the broker's list."""
    queue = f"broker-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(settings.REDIS_URL)
    app.send_task(task, args=args, queue=queue)
    try:
        (raw,) = client.lrange(queue, 0, -1)
        return json.loads(raw)
    finally:
        client.delete(queue, f"_kombu.binding.{queue}")


def test_an_agents_call_as_celery_sends_it_is_delivered():
    message = sent_as_celery_sends(AGENT_CALL_TASK, [{"call": "heartbeat"}])

    assert envelope_problem(message, AGENT_QUEUE) is None
    assert envelope_problem(message, "control") is None


def test_any_other_task_on_the_agents_queue_is_refused_naming_it():
    message = sent_as_celery_sends("scheduling.tasks.reconcile", ["a node asked"])

    problem = envelope_problem(message, AGENT_QUEUE)
    assert problem == ("task 'scheduling.tasks.reconcile': the 'agents' queue carries only scheduling.tasks.agent_call")
    assert envelope_problem(message, "control") is None, "the control queue, which no node may write to, carries any"


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ([], "not a message but a JSON list"),
        (1, "not a message but a JSON int"),
        ({}, "no properties"),
        ({"properties": 3}, "no properties"),
        ({"properties": {"delivery_info": {"exchange": "", "routing_key": "agents"}}}, "no delivery tag"),
        ({"properties": {"delivery_tag": "t", "delivery_info": {"exchange": ""}}}, "no delivery info"),
        ({"properties": {"delivery_tag": "t", "delivery_info": []}}, "no delivery info"),
    ],
)
def test_what_is_not_a_message_is_named(message, says):
    assert says in envelope_problem(message, AGENT_QUEUE)


def test_a_field_of_the_wrong_type_is_named():
    message = sent_as_celery_sends(AGENT_CALL_TASK, [{}])
    for key, value in (("headers", 5), ("body", ["x"]), ("content-type", 1)):
        assert envelope_problem({**message, key: value}, AGENT_QUEUE) == f"{key} is a {type(value).__name__}"
    tagged = {**message, "properties": {**message["properties"], "body_encoding": 64}}
    assert envelope_problem(tagged, AGENT_QUEUE) == "body_encoding is not a string"
    untasked = {**message, "headers": {}}
    assert "task None" in envelope_problem(untasked, AGENT_QUEUE)


def test_the_transport_delivers_a_message_fit_to_deliver_and_counts_what_it_drops():
    from kombu import Connection
    from prometheus_client import REGISTRY

    from gpuportal.broker import Transport

    def dropped(queue: str) -> float:
        return REGISTRY.get_sample_value("gpuportal_broker_messages_dropped_total", {"queue": queue}) or 0.0

    call = sent_as_celery_sends(AGENT_CALL_TASK, [{}])
    forged = sent_as_celery_sends("scheduling.tasks.reconcile", ["forged"])
    delivered: list[dict[str, Any]] = []
    with Connection(settings.REDIS_URL, transport=Transport) as connection:
        transport = connection.transport
        transport._callbacks[AGENT_QUEUE] = delivered.append
        before = dropped(AGENT_QUEUE)

        for message in (call, forged, [], {"properties": 3}):
            transport._deliver(message, AGENT_QUEUE)

    assert delivered == [call]
    assert dropped(AGENT_QUEUE) == before + 3


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
KEYS = st.sampled_from(["properties", "headers", "body", "content-type", "delivery_tag", "delivery_info", "task"])


@given(st.dictionaries(KEYS, JSON, max_size=6) | JSON, st.sampled_from([AGENT_QUEUE, "control", "node.a"]))
def test_no_json_value_makes_the_check_raise(message, queue):
    problem = envelope_problem(message, queue)

    assert problem is None or isinstance(problem, str)
    if problem is None:
        # What is delivered has everything kombu indexes, and on `agents` names the one task.
        assert isinstance(message["properties"]["delivery_tag"], str)
        assert isinstance(message["properties"]["delivery_info"]["routing_key"], str)
        if queue in QUEUE_TASKS:
            assert message["headers"]["task"] in QUEUE_TASKS[queue]


# -- at the session's agents worker ---------------------------------------------------------------


@pytest.fixture
def stale_node(db):
    """A node whose beat is long over: what a forged heartbeat sweep would write off."""
    from datetime import timedelta

    from django.utils import timezone

    name = f"stale-{uuid.uuid4().hex[:6]}"
    Node.objects.create(name=name, queue=f"node.{name}", last_heartbeat=timezone.now() - timedelta(days=1))
    return name


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_what_a_node_pushes_that_is_not_a_call_is_dropped_and_the_worker_answers_the_next_call(
    agents_worker, stale_node
):
    client = redis.Redis.from_url(settings.REDIS_URL)
    forged = sent_as_celery_sends("scheduling.tasks.expire_heartbeats", [])
    forged["headers"]["id"] = forged_id = f"forged-{uuid.uuid4().hex[:8]}"
    log_size = agents_worker.log_path.stat().st_size

    # What kombu's own decoding, left alone, ended the worker on ("Unrecoverable error").
    for pushed in ("a call", "[]", json.dumps({"properties": 3}), json.dumps(forged)):
        client.lpush(AGENT_QUEUE, pushed)
    # After them on the same list, one worker reads in order: answered, it read them first.
    assert RemoteControl(app, settings.REDIS_URL, timeout_s=30).replica_state("no-such-replica") is None

    assert agents_worker.poll() is None, "the worker still runs"
    with agents_worker.log_path.open() as log:
        log.seek(log_size)
        said = log.read()
    assert said.count("dropped a message on the broker that is not JSON") == 1
    assert "dropped a message on the 'agents' queue: not a message but a JSON list" in said
    assert "dropped a message on the 'agents' queue: no properties" in said
    assert "task 'scheduling.tasks.expire_heartbeats': the 'agents' queue carries only" in said
    assert f"[{forged_id}] received" not in said, "the forged task never reached the pool"
    assert Node.objects.get(name=stale_node).status == Node.Status.ONLINE, "nothing swept the stale node"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_agents_worker_takes_no_remote_control(agents_worker):
    # Asked as a node's Redis user could ask it, shutdown as well as ping: Pub/Sub takes no key,
    # so no ACL rule keeps a node out. A worker that took it would answer within the second.
    name = f"agents-{os.getpid()}@{socket.gethostname()}"

    assert app.control.ping(destination=[name], timeout=1) == []
    assert RemoteControl(app, settings.REDIS_URL, timeout_s=30).replica_state("no-such-replica") is None
