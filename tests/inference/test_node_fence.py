"""A node written off is fenced by its epoch: its replicas take nothing while its lease is not held
under the epoch they were started with, and once the control plane raises the epoch nothing they
take, stream or answer is accepted; its agent stops them all before it renews under the new one.

Real Redis; no process is started (the agent's supervisor is its own class, with the replica
processes it would stop recorded rather than run)."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis
from django.conf import settings

from gpuportal.wire import node_lease
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.requestqueue import LeaseLapsed, NodeWrittenOff, NotTaken, RequestQueue, WrittenOff
from gpuportal.wire.requestqueue.protocol import request_key


@pytest.fixture
def client():
    connection = redis.Redis.from_url(settings.REDIS_URL)
    yield connection
    connection.close()


@pytest.fixture
def node(client):
    name = f"fence-{uuid.uuid4().hex[:8]}"
    yield name
    client.delete(node_lease.epoch_key(name), node_lease.lease_key(name))


@pytest.fixture
def rq(client):
    return RequestQueue(client)


@pytest.fixture
def old() -> str:
    """A replica id of this test's own: a written-off mark outlives the test that set it."""
    return f"old-{uuid.uuid4().hex[:8]}"


def submit(rq: RequestQueue, deployment: str, stream: bool = False):
    return rq.submit(deployment, kind="generate", input="hi", params={"stream": stream}, owner="u")


def test_a_renewal_under_an_epoch_the_control_plane_raised_since_is_refused_and_names_the_new_one(client, node):
    assert node_lease.renew(client, node, ttl_s=30, epoch=0) == 0
    assert node_lease.held(client, [node]) == {node}

    assert node_lease.write_off(client, node) == 1

    assert node_lease.held(client, [node]) == set(), "writing a node off drops its lease"
    assert node_lease.renew(client, node, ttl_s=30, epoch=0) == 1
    assert node_lease.held(client, [node]) == set(), "nothing renewed under the old epoch"
    assert node_lease.renew(client, node, ttl_s=30, epoch=1) == 1
    assert node_lease.held(client, [node]) == {node}


def test_an_epoch_redis_forgot_is_restored_from_the_agent_that_holds_it(client, node):
    # A Redis restarted without its file: the agent had epoch 3 from the control plane.
    assert node_lease.renew(client, node, ttl_s=30, epoch=3) == 3
    assert node_lease.current_epoch(client, node) == 3
    assert node_lease.renew(client, node, ttl_s=30, epoch=2) == 3, "and an older epoch stays refused"


def test_a_replica_takes_nothing_while_its_node_holds_no_lease_under_its_epoch(client, rq, node):
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    request = submit(rq, deployment)
    fence = NodeFence(node, 0)

    with pytest.raises(LeaseLapsed):
        rq.take(deployment, "r1", timeout=0, node=fence)
    assert rq.get(request.id).status == "queued" and rq.depth(deployment) == 1, "given back untouched"

    node_lease.renew(client, node, ttl_s=30, epoch=0)
    taken = rq.take(deployment, "r1", timeout=0, node=fence)
    assert taken is not None and taken.id == request.id


def test_a_replica_of_a_written_off_node_streams_answers_and_takes_nothing_more(client, rq, node, old):
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    node_lease.renew(client, node, ttl_s=30, epoch=0)
    fence = NodeFence(node, 0)
    first = submit(rq, deployment, stream=True)
    second = submit(rq, deployment)
    taken = rq.take(deployment, old, timeout=0, node=fence)
    assert taken is not None and taken.id == first.id
    rq.chunk(first.id, "Hel", old, node=fence)

    node_lease.write_off(client, node)  # what the heartbeat sweep does before giving its work back

    with pytest.raises(NodeWrittenOff):
        rq.chunk(first.id, "lo", old, node=fence)
    with pytest.raises(NodeWrittenOff):
        rq.finish(first.id, old, {"text": "Hello"}, node=fence)
    with pytest.raises(WrittenOff):
        rq.take(deployment, old, timeout=0, node=fence)
    assert rq.get(second.id).status == "queued", "the refused take gave its request back"
    assert rq.read_stream(first.id, 0, 0) == (["Hel"], False), "no chunk after the write-off"
    assert not rq.get(first.id).final

    # Given back by the control plane and answered once, by a replica of a node in good standing.
    rq.requeue_from(old, max_attempts=3, reason="lost with its node")
    retaken = rq.take(deployment, "new", timeout=0)
    assert retaken is not None and retaken.id == first.id
    rq.finish(first.id, "new", {"text": "Hello"})
    assert rq.get(first.id).status == "done" and rq.get(first.id).replica == "new"


def test_a_chunk_for_a_request_given_back_to_another_replica_is_refused(rq, old):
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    request = submit(rq, deployment, stream=True)
    rq.take(deployment, old, timeout=0)
    rq.write_off(old)
    rq.requeue_from(old, max_attempts=3, reason="written off")
    rq.take(deployment, "new", timeout=0)

    with pytest.raises(NotTaken):
        rq.chunk(request.id, "late", old)
    rq.chunk(request.id, "fresh", "new")
    assert "late" not in rq.read_stream(request.id, 0, 0)[0]


def test_a_steps_pieces_land_but_for_a_request_given_back_and_a_fence_refuses_them_all(client, rq, node, old):
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    node_lease.renew(client, node, ttl_s=30, epoch=0)
    fence = NodeFence(node, 0)
    kept, lost = submit(rq, deployment, stream=True), submit(rq, deployment, stream=True)
    rq.take(deployment, old, timeout=0, node=fence)
    rq.take(deployment, old, timeout=0, node=fence)
    client.hset(request_key(lost.id), "replica", "another")  # handed to another replica meanwhile

    with pytest.raises(NotTaken):
        rq.chunks([(lost.id, "late"), (kept.id, "Hel")], old, node=fence)
    assert rq.read_stream(kept.id, 0, 0) == (["Hel"], False), "the other request's piece still landed"
    assert rq.read_stream(lost.id, 0, 0) == ([], False)

    node_lease.write_off(client, node)

    # Every piece refused, and the fence named rather than the one request given back.
    with pytest.raises(NodeWrittenOff):
        rq.chunks([(lost.id, "x"), (kept.id, "lo")], old, node=fence)
    assert rq.read_stream(kept.id, 0, 0) == (["Hel"], False)


class Stops:
    """The agent's supervisor, as far as a fenced renewal uses it: what it runs, what it stops,
    and whether the lease was held when it stopped them."""

    def __init__(self, client, node: str, running: list[str]):
        self.client, self.node, self.running = client, node, running
        self.node_fence: NodeFence | None = None
        self.stopped: list[str] = []
        self.lease_held_at_stop: set[str] | None = None

    def states(self) -> dict[str, str]:
        return dict.fromkeys(self.running, "serving")

    def arenas(self) -> dict[str, int]:
        return {}

    def host_bytes(self) -> dict[str, int]:
        return {}

    def deep_sleepers(self) -> dict[str, dict]:
        return {}

    def stop_written_off(self, replica_ids, timeout: float = 5.0) -> list[str]:
        self.lease_held_at_stop = node_lease.held(self.client, [self.node])
        self.stopped, self.running = list(replica_ids), []
        return self.stopped


class SlowStops(Stops):
    """Stops whose processes take their time to end (a stop waits up to 5 s for each): the
    stop begins, and ends only when the test lets it. What each start was given is recorded."""

    def __init__(self, client, node: str, running: list[str]):
        super().__init__(client, node, running)
        self.stopping, self.let_go = threading.Event(), threading.Event()
        self.calls = 0
        self.started: list[tuple[str, NodeFence | None, list[str]]] = []

    def stop_written_off(self, replica_ids, timeout: float = 5.0) -> list[str]:
        self.calls += 1
        self.stopping.set()
        assert self.let_go.wait(30), "the test never let the stop end"
        return super().stop_written_off(replica_ids, timeout)

    def start(self, spec, on_event) -> None:
        self.started.append((spec.replica_id, self.node_fence, list(self.running)))


def test_an_agent_that_finds_its_node_written_off_stops_its_replicas_before_it_renews(client, node):
    from inference.agent import NodeAgent

    agent = NodeAgent(node, control=None, backend="virtual", heartbeat_s=1)
    agent.supervisor = Stops(client, node, ["a", "b"])
    agent._hold_epoch(0)
    agent.renew_lease()
    node_lease.write_off(client, node)

    agent.renew_lease()

    assert agent.supervisor.stopped == ["a", "b"]
    assert agent.supervisor.lease_held_at_stop == set(), "nothing renewed while they still ran"
    assert agent.epoch == 1 and agent.supervisor.node_fence == NodeFence(node, 1), "what it starts next"
    assert node_lease.held(client, [node]) == {node}


class Watched:
    """A lock that says when a second holder asks for it (the first being the lease's renewal)."""

    def __init__(self, lock: threading.Lock):
        self.lock, self.asked, self.second = lock, 0, threading.Event()

    def __enter__(self) -> None:
        self.asked += 1
        if self.asked == 2:
            self.second.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _spec(replica_id: str):
    from gpuportal.wire.commands import ReplicaSpec

    return ReplicaSpec(replica_id, "/models/m", "transformers", "float16", (0,), {"0": 1 << 30})


def test_a_replica_started_while_the_old_epochs_replicas_stop_starts_under_the_new_epoch_once_they_are_gone(
    client, node
):
    # The node was cut off and written off; its agent, heard again, is back online in the books
    # and is sent a new replica while its lease's thread still stops what the old epoch ran.
    from inference.agent import NodeAgent

    agent = NodeAgent(node, control=None, backend="virtual", heartbeat_s=1)
    agent.supervisor = SlowStops(client, node, ["old"])
    agent._hold_epoch(0)
    agent.renew_lease()
    node_lease.write_off(client, node)
    agent._epoch_lock = lock = Watched(agent._epoch_lock)
    lease_thread = threading.Thread(target=agent.renew_lease, daemon=True)
    lease_thread.start()
    assert agent.supervisor.stopping.wait(30)

    starting = threading.Thread(target=agent.start, args=(_spec("new"),), daemon=True)
    starting.start()
    assert lock.second.wait(30), "the start asks for the lock the lease's catch-up holds"
    agent.supervisor.let_go.set()
    lease_thread.join(30)
    starting.join(30)

    # Had it not waited for the stop under way, it would have started beside "old", under epoch 0.
    assert agent.supervisor.started == [("new", NodeFence(node, 1), [])], "under the new epoch, the old ones gone"
    assert agent.supervisor.calls == 1, "the old epoch's replicas were stopped once"
    assert node_lease.held(client, [node]) == {node}


def test_a_replica_started_before_the_lease_thread_saw_the_write_off_stops_the_old_epochs_replicas_first(client, node):
    from inference.agent import NodeAgent

    agent = NodeAgent(node, control=None, backend="virtual", heartbeat_s=1)
    agent.supervisor = SlowStops(client, node, ["old"])
    agent.supervisor.let_go.set()
    agent._hold_epoch(0)
    agent.renew_lease()
    node_lease.write_off(client, node)

    agent.start(_spec("new"))

    assert agent.supervisor.stopped == ["old"]
    assert agent.supervisor.started == [("new", NodeFence(node, 1), [])]
    assert agent.epoch == 1 and node_lease.held(client, [node]) == {node}


class StuckControl:
    """A control plane whose heartbeat answers only when let go (an agents' worker far behind)."""

    def __init__(self) -> None:
        self.beating, self.let_go = threading.Event(), threading.Event()

    def heartbeat(self, node: str, **kwargs) -> list[str]:
        self.beating.set()
        self.let_go.wait(30)
        return []


def test_the_lease_is_renewed_while_a_heartbeat_waits_for_its_answer(client, node):
    from inference.agent import NodeAgent

    control = StuckControl()
    agent = NodeAgent(node, control=control, backend="virtual", heartbeat_s=0.05)
    agent.supervisor = Stops(client, node, [])
    agent.books = lambda: None
    agent._hold_epoch(0)
    agent.start_heartbeat()
    try:
        assert control.beating.wait(10)
        client.delete(node_lease.lease_key(node))  # what a lease that lapsed meanwhile would be
        assert _until_held(client, node), "the lease lapsed while one heartbeat waited for its answer"
        assert not control.let_go.is_set(), "and that heartbeat still waits"
    finally:
        control.let_go.set()
        agent._stop.set()


def _until_held(client, node: str) -> bool:
    """Whether the lease is held again within 10 s (renewals come every 0.05 s)."""
    pause = threading.Event()
    for _ in range(200):
        if node_lease.held(client, [node]):
            return True
        pause.wait(0.05)
    return False
