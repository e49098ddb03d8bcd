"""Sixteen clients change the same few deployments at once on two GPUs: creates of
one name, scales, settings changes, deletes, sleeps, wakes and evictions all collide. No call
gets a server error, every answer is one the API documents for the call, and afterwards the
books balance: each GPU's free bytes are its total less what its occupants reserve, and only
replicas that hold memory reserve any.

The node's agent is played by a thread: each command the control plane sends it (start, sleep,
wake, stop) is answered with the report its replica process would make, through the gateway the
agents worker applies reports with. So replicas serve, drain, sleep and stop while the clients
work, as they did under `up` when the red team found 37 of 192 such calls answered with a 500."""

from __future__ import annotations

import queue
import random
import threading
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from rest_framework.test import APIClient

from gpuportal.wire import commands
from gpuportal.wire.states import GONE
from inference.devices import virtual_gpus
from scheduling.models import ACTIVE_INTENT_STATUSES, GPU, Occupant, PreemptionIntent, Replica
from scheduling.services.node_gateway import ServicesGateway
from scheduling.services.nodes import register_node
from tests.support.deployments import body
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
CLIENTS = 16
CALLS_PER_CLIENT = 12  # 192 calls, as in the red team's storm
# Few names, so that calls collide: three deployments of up to four 300 MiB replicas want more
# than two 1 GiB GPUs hold (three each), so placements evict, or are refused, as they compete.
NAMES = ("alpha", "beta", "gamma")

# What the API may answer each call with when nothing is wrong: done, or a 4xx saying why not.
# 404: no such deployment, or it was deleted between this call's change and its answer (a create
# too: its deployment was made, and deleted by another client before the create answered).
# 409: the name is taken, or there is no room.
EXPECTED = {
    "create": {201, 404, 409},
    "scale": {200, 404, 409},
    "patch": {200, 404, 409},
    "delete": {204, 404},
    "sleep": {200, 404},
    "wake": {200, 404, 409},
    "evict": {200, 404},
}
# How often each call is made after the first (every client's first is a create, so that the
# storm opens with creates of one name racing): enough creates that deleted names come back.
WEIGHTS = {"create": 3, "scale": 5, "patch": 3, "delete": 1, "sleep": 2, "wake": 2, "evict": 2}


@dataclass(frozen=True)
class Call:
    op: str
    method: str
    path: str
    data: dict[str, Any] | None


@dataclass(frozen=True)
class Answer:
    client: int
    call: Call
    status: int
    body: str

    def __str__(self) -> str:
        call = self.call
        return f"client {self.client}: {call.method.upper()} {call.path} {call.data} -> {self.status} {self.body[:800]}"


@pytest.fixture
def two_gpus(db) -> None:
    """One node of two 1 GiB GPUs, as the red team's storm had (the `cluster` fixture's four
    GPUs would leave room enough that fewer placements compete)."""
    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)


class Agent(threading.Thread):
    """The node's agent: takes the commands the control plane sends once its decisions commit,
    and reports what each replica's process would, in the order they were sent. Tasks for the
    control queue (a preempt, a wake asked again, a reconcile) are kept, not run."""

    REPORTS = {
        "start": {"event": "serving", "pid": 4242, "weights_bytes": 10 * MiB, "need_bytes": 300 * MiB},
        "wake": {"event": "woken"},
        "sleep": {"event": "sleeping", "residual_bytes_by_id": {}},
        "stop": {"event": "stopped"},
    }
    KINDS = {task: kind for kind, task in commands.TASKS.items()}
    CLIENTS_DONE = object()

    def __init__(self) -> None:
        super().__init__(name="agent")
        self.commands: queue.Queue = queue.Queue()
        self.control: list[tuple[str, list]] = []
        self.errors: list[str] = []

    def send_task(self, name: str, args=None, queue=None, **options) -> None:  # as app.send_task
        if name in self.KINDS:
            self.commands.put((self.KINDS[name], commands.decode(args[0]).replica_id))
        else:
            self.control.append((name, list(args or ())))

    def run(self) -> None:
        gateway = ServicesGateway()
        clients_done = False
        try:
            while True:
                # Once the clients are done, what is left is answered. A report may send more
                # commands: they are queued before the report returns, and answered too.
                try:
                    item = self.commands.get_nowait() if clients_done else self.commands.get()
                except queue.Empty:
                    return
                if item is self.CLIENTS_DONE:
                    clients_done = True
                    continue
                kind, replica_id = item
                try:
                    gateway.report(replica_id, dict(self.REPORTS[kind]))
                except Exception as err:  # a report the books lost: the test says which
                    self.errors.append(f"{kind} of replica {replica_id}: {err!r}")
        finally:
            connection.close()  # this thread's own connection


def calls_of(client: int, model_dir) -> list[Call]:
    """The client's seeded-random calls over the shared names."""
    rng = random.Random(client)
    calls = []
    for n in range(CALLS_PER_CLIENT):
        name = rng.choice(NAMES)
        op = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0] if n else "create"
        path = f"/api/deployments/{name}/"
        if op == "create":
            calls.append(Call(op, "post", "/api/deployments/", body(name, model_dir, replicas=rng.randint(0, 2))))
        elif op == "scale":
            calls.append(Call(op, "post", f"{path}scale/", {"replicas": rng.randint(0, 4)}))
        elif op == "patch":
            change = rng.choice(
                [
                    {"replicas": rng.randint(0, 4)},
                    {"memory": {"override_bytes": rng.choice([200, 300, 400]) * MiB}},
                    {"memory": {"max_tokens": rng.choice([128, 256])}},
                    {"fairness": {"max_wait_s": rng.choice([0, 1, 5]), "popular": rng.random() < 0.3}},
                    {"sleep": {"idle_timeout_s": rng.choice([0, 60, 300])}},
                ]
            )
            calls.append(Call(op, "patch", path, change))
        elif op == "delete":
            calls.append(Call(op, "delete", path, None))
        else:
            calls.append(Call(op, "post", f"{path}{op}/", None))
    return calls


def storm(model_dir) -> list[Answer]:
    """Every client's calls, all clients at once; their answers."""
    user = User.objects.create_user("ops", is_staff=True)
    start = threading.Barrier(CLIENTS)
    answers: list[Answer] = []
    raised: list[str] = []

    def client(index: int) -> None:
        api = APIClient()  # its own client on its own thread: its own database connection
        api.force_authenticate(user)
        try:
            calls = calls_of(index, model_dir)
            start.wait()
            for call in calls:
                response = getattr(api, call.method)(call.path, call.data, format="json")
                answers.append(Answer(index, call, response.status_code, response.content.decode(errors="replace")))
        except Exception:
            # The test client raises what a view let escape: a server error. Django's test clients
            # hear every view's exception (got_request_exception is one signal for the process), so
            # one such error is raised by every client that had a call under way: the first
            # traceback is the one to read.
            raised.append(f"client {index}: {traceback.format_exc()}")
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,), name=f"client{i}") for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert raised == [], "calls that raised instead of answering:\n" + "\n".join(raised)
    return answers


def books_problems() -> list[str]:
    """What does not balance in the books, in words (nothing when they are intact)."""
    problems = []
    with connection.cursor() as cursor:
        # One statement: the GPU rows and their occupants as of one moment.
        cursor.execute(
            """
            SELECT g.id, g.total_bytes, g.available_bytes, COALESCE(SUM(o.reserved_bytes), 0)
            FROM scheduling_gpu g LEFT JOIN scheduling_occupant o ON o.gpu_id = g.id
            GROUP BY g.id ORDER BY g.id
            """
        )
        for gpu, total, available, reserved in cursor.fetchall():
            if reserved > total or available != total - reserved:
                problems.append(f"gpu {gpu}: total {total}, available {available}, its occupants reserve {reserved}")
    # Occupants of a deleted deployment cannot be (Occupant.replica is PROTECT, a replica goes with
    # its deployment): a delete that left any would have failed. A stopped one's can be.
    for occupant in Occupant.objects.select_related("replica", "gpu"):
        replica = occupant.replica
        if replica.state in GONE:
            problems.append(f"{occupant}: its replica is {replica.state}")
        elif replica.node_id != occupant.gpu.node_id:
            problems.append(f"{occupant}: on another node than its replica")
    # A placed replica on its way to serving, serving or draining holds its reservation, and its
    # own record of it (the REST shape) says what its occupants hold; a sleeper holds what it said.
    for replica in Replica.objects.exclude(state__in=GONE).exclude(node=None).prefetch_related("occupancies__gpu"):
        held = {str(o.gpu.index): o.reserved_bytes for o in replica.occupancies.all()}
        if held != replica.gpu_mem_bytes_by_id or (not held and replica.state != Replica.State.SLEEPING):
            problems.append(
                f"replica {replica.id} ({replica.state}) records {replica.gpu_mem_bytes_by_id}, occupants hold {held}"
            )
    # A wake lock keeps other placements off its GPU: it must belong to a wake still under way.
    for gpu in GPU.objects.exclude(wake_lock_holder=None):
        if not PreemptionIntent.objects.filter(
            gpu=gpu, waiting_replica_id=gpu.wake_lock_holder_id, status__in=ACTIVE_INTENT_STATUSES
        ).exists():
            problems.append(f"gpu {gpu}: its wake lock is held by {gpu.wake_lock_holder_id}, which waits for nothing")
    return problems


@pytest.mark.django_db(transaction=True)
def test_sixteen_clients_changing_deployments_at_once_get_no_server_error_and_leave_the_books_balanced(
    two_gpus, tiny_model_dir, monkeypatch
):
    from gpuportal.celery import app

    agent = Agent()
    # What the services send after their commits (with transaction=True, on_commit runs for real)
    # goes to the agent played here, or is kept: nothing leaves this process.
    monkeypatch.setattr(app, "send_task", agent.send_task)
    agent.start()
    try:
        answers = storm(tiny_model_dir)
    finally:
        agent.commands.put(Agent.CLIENTS_DONE)
        agent.join()

    seen = Counter(f"{a.call.op} {a.status}" for a in answers)
    server_errors = [str(a) for a in answers if a.status >= 500]
    assert server_errors == [], f"{len(server_errors)} of {len(answers)} calls ({seen}):\n" + "\n".join(server_errors)
    unexpected = [str(a) for a in answers if a.status not in EXPECTED[a.call.op]]
    assert unexpected == [], f"answers the API does not document ({seen}):\n" + "\n".join(unexpected)
    assert len(answers) == CLIENTS * CALLS_PER_CLIENT
    assert agent.errors == [], "reports that could not be recorded:\n" + "\n".join(agent.errors)
    assert books_problems() == []
