"""bench.fleet's simulated node speaks the node protocol as an agent does: its calls travel through
the agent's own gateway (RemoteControl) and are applied by the control plane's (the `agents`
task, here on a thread with its own connection, as a worker thread would, over the real PostgreSQL
and Redis), its lease is the one the heartbeat sweep reads, and the commands placement sends it are
answered with the reports that bring its replicas to serving. No process is started."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import connection

from bench.fleet_node import BUCKETS_S, Counters, SimulatedNode, percentile_s
from gpuportal.wire import commands, node_lease
from gpuportal.wire.control import AGENT_CALL_TASK
from gpuportal.wire.memory import GiB
from scheduling.models import GPU, Event, Node, Replica
from scheduling.services import deployments
from scheduling.services.deployments import DeploymentSpec, ModelFacts
from tests.support.deployments import invariant_holds


class AgentsWorker:
    """What RemoteControl sends, carried out as the `agents` worker would: each call on a thread."""

    def send_task(self, name: str, *, args: list, queue: str, expires: float, declare: list) -> None:
        assert (name, queue, declare) == (AGENT_CALL_TASK, "agents", [])
        threading.Thread(target=self._run, args=(args[0],)).start()

    def _run(self, payload: dict) -> None:
        from scheduling.tasks import agent_call

        try:
            agent_call(payload)
        finally:
            connection.close()


@pytest.fixture
def node_commands(monkeypatch) -> list[tuple[str, dict[str, Any]]]:
    """What the control plane sends to node queues, kept as sent (task, encoded command) for the
    simulated node to carry out; its control tasks (reconciles, the host cache) are not run."""
    from gpuportal.celery import app

    sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(name: str, args: list | None = None, queue: str | None = None, **kwargs: Any) -> None:
        if name in commands.TASKS.values():
            sent.append((name, args[0]))

    monkeypatch.setattr(app, "send_task", send_task)
    return sent


@pytest.fixture
def node() -> SimulatedNode:
    from inference.gateway import RemoteControl

    lease = redis.Redis.from_url(settings.REDIS_URL)
    lease.delete(node_lease.lease_key("sim0000"))
    control = RemoteControl(AgentsWorker(), settings.REDIS_URL)  # type: ignore[arg-type]
    return SimulatedNode("sim0000", control, lease, heartbeat_s=5, lease_ttl_s=16, load_s=0)


@pytest.mark.django_db(transaction=True)
def test_a_simulated_node_registers_eight_gpus_renews_its_lease_and_beats(node):
    node.register()
    node.renew_lease()

    assert node.beat_once() == []
    registered = Node.objects.get(name="sim0000")
    assert (registered.status, registered.virtual) == (Node.Status.ONLINE, True)
    gpus = GPU.objects.filter(node=registered)
    assert gpus.count() == 8 and {g.nvml_total_bytes for g in gpus} == {80 * GiB}
    assert node_lease.held(node.lease, ["sim0000", "sim9999"]) == {"sim0000"}


@pytest.mark.django_db(transaction=True)
def test_placed_replicas_are_started_report_serving_and_agree_with_the_books(node, node_commands):
    node.register()
    facts = ModelFacts(weight_bytes=2 * GiB, estimate_bytes=4 * GiB)
    spec = DeploymentSpec(name="fleet", source="/srv/models/tiny", replicas=3, override_bytes=4 * GiB, spread=True)
    deployments.create(spec, facts=facts)
    starts = [(task, payload) for task, payload in node_commands if task == commands.TASKS["start"]]
    assert len(starts) == 3

    for task, payload in starts:
        assert node.carry_out(task, payload) == "started"

    replicas = Replica.objects.filter(deployment__name="fleet")
    assert set(replicas.values_list("state", flat=True)) == {Replica.State.SERVING}
    # A heartbeat carrying what they hold per GPU: no over-commit, nothing written off, no
    # command taken for lost.
    assert node.beat_once() == []
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    assert sorted(node.processes()["running"]) == sorted(replicas.values_list("pk", flat=True))
    assert invariant_holds()

    deployments.scale("fleet", 2)
    (stop,) = [(t, p) for t, p in node_commands if t == commands.TASKS["stop"]]
    assert node.carry_out(*stop) == "stopped"
    assert replicas.filter(state=Replica.State.STOPPED).count() == 1
    assert len(node.processes()["running"]) == 2


@pytest.mark.django_db(transaction=True)
def test_a_silent_node_beats_no_more_and_drops_its_commands(node, node_commands):
    node.register()
    deployments.create(
        DeploymentSpec(name="fleet", source="/srv/models/tiny", replicas=1, override_bytes=4 * GiB),
        facts=ModelFacts(weight_bytes=2 * GiB, estimate_bytes=4 * GiB),
    )
    node.silent.set()

    node.run()  # returns at its first beat, without renewing its lease
    assert node.carry_out(*node_commands[0]) == "silent"
    assert not node_lease.held(node.lease, ["sim0000"])
    assert Replica.objects.get(deployment__name="fleet").state == Replica.State.PENDING


def test_beat_latencies_are_counted_in_buckets_read_back_as_percentiles():
    counters = Counters()
    for latency in [0.002] * 90 + [0.5] * 9 + [None]:
        counters.beat(latency)

    record = counters.record()
    assert (record["beats"], record["failed_beats"]) == (99, 1)
    assert 0.002 <= percentile_s(record["latency"], 0.5) < 0.003
    assert 0.5 <= percentile_s(record["latency"], 0.99) < 0.5 * 1.25
    assert percentile_s([0] * (len(BUCKETS_S) + 1), 0.5) is None
