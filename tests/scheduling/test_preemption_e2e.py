"""The fair wake path end to end: a real agent with one virtual GPU that fits two of three
tiny deployments, real replica processes, a real control worker running the preempt task, and
requests through the REST API. The over-commit invariant is sampled all along from another
connection; a waker killed with SIGKILL while it holds the wake lock is taken over. Victims that
serve no request are preempted at once; to see the fairness wait, the tests that need
one mark the occupants busy, as a request they had taken and not finished would."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from datetime import datetime, timedelta

import psycopg
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpuportal.wire.requestqueue import processing_key, request_key
from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.models import Event, PreemptionIntent, Replica
from scheduling.services import requests as request_services
from tests.support.processes import database_url_of_this_test, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 1024**2
LOAD_TIMEOUT = 120
# Each replica reserves this and a CUDA context (722 MiB on the H100-like virtual GPU), and keeps
# the context reserved asleep. On GPU_SPEC (3.5 GiB, of which 3104 MiB can be allocated), two fit,
# three do not, and one asleep beside one serving leaves room for another to wake.
NEED = 400 * MiB
GPU_SPEC = "1x3584MiB"


class InvariantWatch(threading.Thread):
    """Samples invariant 1 (no over-commit, available = total - reserved) on every GPU, with its
    own connection, until stopped. One statement per sample, so it sees one consistent state."""

    SQL = """
        SELECT g.id, g.total_bytes, g.available_bytes, COALESCE(SUM(o.reserved_bytes), 0)
        FROM scheduling_gpu g LEFT JOIN scheduling_occupant o ON o.gpu_id = g.id
        GROUP BY g.id, g.total_bytes, g.available_bytes
    """

    def __init__(self):
        super().__init__(daemon=True)
        self.url = database_url_of_this_test()
        self.stopped = threading.Event()
        self.samples = 0
        self.violations: list[tuple] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.stopped.is_set():
                    for gpu, total, available, reserved in conn.execute(self.SQL).fetchall():
                        if reserved > total or available != total - reserved:
                            self.violations.append((gpu, total, available, reserved))
                    self.samples += 1
                    self.stopped.wait(0.05)
        except BaseException as err:  # reported by check()
            self.error = err

    def check(self) -> None:
        self.stopped.set()
        self.join(10)
        assert self.error is None, self.error
        assert self.samples > 10, "the invariant was sampled throughout"
        assert self.violations == [], self.violations


@pytest.fixture
def invariant():
    watch = InvariantWatch()
    watch.start()
    yield watch
    watch.check()


@pytest.fixture
def one_gpu(start_agent, control_worker, staff, tmp_path):
    """An agent with one virtual GPU (`GPU_SPEC`) and a control worker; returns (staff, deploy)."""
    request_services.queue.cache_clear()
    start_agent("e2e", GPU_SPEC)
    control_worker()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=5).path

    def deploy(name: str, replicas: int = 1, max_wait_s: float = 3.0) -> None:
        body = {
            "name": name,
            "model": {"source": str(model)},
            "replicas": replicas,
            "memory": {"override_bytes": NEED, "max_tokens": 256},
            "fairness": {"min_runtime_s": 1, "max_wait_s": max_wait_s},
            "sleep": {"idle_timeout_s": 0, "drain_timeout_s": 10},
        }
        response = staff.post("/api/deployments/", body, format="json")
        assert response.status_code == 201, response.json()

    return staff, deploy


def state_of(name: str) -> list[str]:
    states = list(Replica.objects.filter(deployment__name=name).values_list("state", flat=True))
    assert "failed" not in states, list(Replica.objects.values_list("deployment__name", "state", "failure_reason"))
    return states


def serving(*names: str):
    return lambda: all(state_of(name).count("serving") == 1 for name in names)


def settles_as(**states: str) -> None:
    """The books reach these states: a replica's report arrives through its agent and the agents
    worker, so it may come a moment after the request it served has finished."""

    def settled() -> bool:
        return all(state_of(name) == [state] for name, state in states.items())

    wait_until(settled, 30, f"the books to say {states}")


def submit(client: APIClient, name: str, text: str = "Hello", max_tokens: int = 8) -> dict:
    response = client.post(
        "/api/requests/", {"deployment": name, "input": text, "params": {"max_tokens": max_tokens}}, format="json"
    )
    assert response.status_code in (200, 201, 202), response.json()
    return response.json()


def finished(request_id: str, timeout: float = 90):
    return wait_until(
        lambda: (r := request_services.queue().get(request_id)).final and r, timeout, f"request {request_id} to end"
    )


def the_gpu(client: APIClient) -> dict:
    gpus = client.get("/api/gpus/").json()
    gpus = gpus["results"] if isinstance(gpus, dict) else gpus
    assert len(gpus) == 1, gpus
    return gpus[0]


def waits_for_room(client: APIClient, name: str) -> dict:
    """The request to `name` waits: an intent and the wake lock show on the GPU."""
    gpu = wait_until(
        lambda: (g := the_gpu(client))["intents"] and g["wake_lock"] and g, 10, "an intent and a wake lock"
    )
    assert [i["deployment"] for i in gpu["intents"]] == [name] and gpu["intents"][0]["status"] == "waiting", gpu
    assert gpu["wake_lock"]["deployment"] == name, gpu
    assert sorted(o["deployment"] for o in gpu["occupants"]) == ["a", "b"], "nothing evicted at once"
    return gpu


def busy(*names: str) -> None:
    """Each deployment's replica holds a request it has not finished, as its take leaves one: the
    id at the head of its processing list, the request `running` on it. A replica's idle take
    leaves such an id alone (it marks only ids still queued), so the replica stays busy for the
    test; were it to fail, the request would be re-queued and served like any other. A request
    in flight for real for long enough would need a slower model than the tiny one."""
    client = request_services.queue().redis
    replicas = Replica.objects.filter(deployment__name__in=names).values_list("id", "deployment__name")
    for replica_id, deployment in replicas:
        request_id = uuid.uuid4().hex
        fields = {
            "deployment": deployment,
            "kind": "generate",
            "input": json.dumps("Hi"),
            "params": json.dumps({"max_tokens": 1}),
            "status": "running",
            "replica": replica_id,
            "attempts": 1,
        }
        client.hset(request_key(request_id), mapping=fields)
        client.lpush(processing_key(replica_id), request_id)


def test_a_voluntary_sleep_within_max_wait_avoids_any_preemption(one_gpu, invariant):
    staff, deploy = one_gpu
    deploy("a")
    deploy("b")
    wait_until(serving("a", "b"), LOAD_TIMEOUT, "a and b to serve")
    busy("a", "b")  # victims serving nothing would be preempted at once: no wait to sleep within
    deploy("c", replicas=0, max_wait_s=8)

    request = submit(staff, "c")
    assert request["status"] == "waking", request
    waits_for_room(staff, "c")

    assert staff.post("/api/deployments/b/sleep/").status_code in (200, 202)

    done = finished(request["id"], LOAD_TIMEOUT)
    assert done.status == "done", (done.status, done.error)
    settles_as(b="sleeping", a="serving", c="serving")
    assert not Event.objects.filter(kind=Event.Kind.PREEMPTION_VICTIM).exists(), "no one was preempted"
    outcome = Event.objects.get(kind=Event.Kind.PREEMPTION_OUTCOME)
    assert outcome.after["status"] == "satisfied" and "freed voluntarily" in outcome.reason, outcome.reason
    assert PreemptionIntent.objects.get().victim_id is None
    gpu = the_gpu(staff)
    assert gpu["intents"] == [] and gpu["wake_lock"] is None


def test_after_max_wait_the_least_recently_used_is_preempted_and_the_waiting_request_completes(one_gpu, invariant):
    # What becomes of a request in flight on the victim (it finishes, or goes back to the head of
    # the queue) is tested with real processes in tests/inference/test_barrier.py. Here a request sent just
    # before the deadline would make its replica the most recently used one, as it should.
    staff, deploy = one_gpu
    deploy("a")
    deploy("b")
    wait_until(serving("a", "b"), LOAD_TIMEOUT, "a and b to serve")
    deploy("c", replicas=0, max_wait_s=3)
    # The one that started serving first is the older by serving time: using it makes the other
    # the least recently used, so the victim cannot come out right by the order of loading alone.
    first, second = Replica.objects.filter(deployment__name__in=("a", "b")).order_by("serving_since", "pk")
    used, lru = first.deployment.name, second.deployment.name
    answer = staff.post(f"/api/deployments/{used}/infer/", {"input": "Hi", "timeout_s": 60}, format="json")
    assert answer.status_code == 200, answer.json()
    busy("a", "b")  # both busy: neither is cheaper for that, and the wake waits out max_wait
    time.sleep(1.1)  # past min_runtime_s

    request = submit(staff, "c")
    assert request["status"] == "waking", request
    gpu = waits_for_room(staff, "c")
    deadline = datetime.fromisoformat(gpu["intents"][0]["deadline"])

    victim = wait_until(
        lambda: Event.objects.filter(kind=Event.Kind.PREEMPTION_VICTIM).first(), 15, "a victim to be chosen"
    )
    # Judged by the books' own clock, not by this test's sleep: a sleep on a busy machine can
    # oversleep the deadline, and then a preemption made on time looked early.
    assert victim.time >= deadline, ("no preemption before max_wait", victim.time, deadline)
    assert victim.deployment == lru, (victim.deployment, victim.reason)
    done = finished(request["id"], LOAD_TIMEOUT)
    assert done.status == "done", (done.status, done.error)
    settles_as(**{lru: "sleeping", used: "serving", "c": "serving"})
    outcome = Event.objects.get(kind=Event.Kind.PREEMPTION_OUTCOME)
    assert outcome.after["status"] == "satisfied" and "preempting" in outcome.reason, outcome.reason


def test_victims_serving_no_request_are_preempted_at_once_and_the_waiting_request_completes(one_gpu, invariant):
    staff, deploy = one_gpu
    deploy("a")
    deploy("b")
    wait_until(serving("a", "b"), LOAD_TIMEOUT, "a and b to serve")
    deploy("c", replicas=0, max_wait_s=60)
    time.sleep(1.1)  # past min_runtime_s

    request = submit(staff, "c")
    assert request["status"] == "waking", request

    victim = wait_until(
        lambda: Event.objects.filter(kind=Event.Kind.PREEMPTION_VICTIM).first(), 15, "a victim to be chosen"
    )
    intent = PreemptionIntent.objects.get()
    assert intent.deadline == intent.created_at
    said = Event.objects.get(kind=Event.Kind.PREEMPTION_INTENT).reason
    assert "its victims serve no request: preempting at once" in said, said
    done = finished(request["id"], LOAD_TIMEOUT)
    assert done.status == "done", (done.status, done.error)
    settles_as(**{victim.deployment: "sleeping", "c": "serving"})


def test_a_waker_killed_while_holding_the_wake_lock_is_taken_over_after_expiry(
    start_agent, control_worker, staff, tmp_path, settings, invariant
):
    ttl = 3
    settings.GPUPORTAL_WAKE_LOCK_TTL_S = ttl  # the lock is taken here, in the API's process
    request_services.queue.cache_clear()
    start_agent("e2e", GPU_SPEC)
    worker = control_worker(GPUPORTAL_WAKE_LOCK_TTL_S=str(ttl))
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=6).path
    for name, replicas in (("a", 1), ("b", 1), ("c", 0)):
        body = {
            "name": name,
            "model": {"source": str(model)},
            "replicas": replicas,
            "memory": {"override_bytes": NEED, "max_tokens": 256},
            "fairness": {"min_runtime_s": 1, "max_wait_s": 3},
            "sleep": {"idle_timeout_s": 0, "drain_timeout_s": 10},
        }
        assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(serving("a", "b"), LOAD_TIMEOUT, "a and b to serve")
    busy("a", "b")  # so that the worker is killed during a fairness wait, not after preempting

    first = submit(staff, "c")
    held = waits_for_room(staff, "c")["wake_lock"]
    holder = held["holder"]
    log = tmp_path / "control-0.log"
    # The task's own line, not the banner's list of tasks (which names it too): killed before it
    # took the task, the worker would leave it queued, and the next worker would run the very
    # wake this test wants dead.
    wait_until(lambda: "Task scheduling.tasks.preempt[" in log.read_text(), 10, "the worker to take the preempt task")
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    assert not Event.objects.filter(kind=Event.Kind.PREEMPTION_VICTIM).exists(), "killed during the fairness wait"
    assert the_gpu(staff)["wake_lock"]["holder"] == holder, "a killed worker releases nothing"

    control_worker(GPUPORTAL_WAKE_LOCK_TTL_S=str(ttl))
    # Before expiry, asking again starts nothing new: the dead waker's lock still stands.
    submit(staff, "c", "Hello again")
    lock = the_gpu(staff)["wake_lock"]
    # Only if that read came before the dead waker's lock expired (its holder renewed it at most
    # up to the kill, so this expiry is the earliest it can have had): on a loaded machine the
    # new worker may start after it, and a request then rightly takes a new lock.
    if timezone.now() + timedelta(seconds=0.5) < datetime.fromisoformat(held["expires_at"]):
        assert lock["holder"] == holder, lock
        assert not Event.objects.filter(kind=Event.Kind.PREEMPTION_OUTCOME).exists()

    wait_until(
        lambda: (
            (lock := the_gpu(staff)["wake_lock"]) is None or datetime.fromisoformat(lock["expires_at"]) < timezone.now()
        ),
        ttl + 5,
        "the dead waker's lock to expire",
    )
    second = submit(staff, "c", "Hello once more")

    abandoned = wait_until(
        lambda: Event.objects.filter(kind=Event.Kind.PREEMPTION_OUTCOME, after__status="cancelled").first(),
        10,
        "the dead wake to be abandoned",
    )
    # Abandoned as its lock lapsed: its task died with the worker, so nothing else can end it.
    assert "lapsed or was taken over" in abandoned.reason, abandoned.reason
    # A new wake took the GPU over: its intent ended satisfied (the lock it held for its fairness
    # wait is released by then, and can come and go between two polls on a loaded machine, so the
    # trail is what shows it).
    wait_until(
        lambda: Event.objects.filter(
            kind=Event.Kind.PREEMPTION_OUTCOME, deployment="c", after__status="satisfied"
        ).exists(),
        LOAD_TIMEOUT,
        "a new wake of c to get its room",
    )
    for request in (first, second):
        done = finished(request["id"], LOAD_TIMEOUT)
        assert done.status == "done", (done.status, done.error)

    # The dead wake's waiter (a new replica that never got a place) failed, saying why; a new one
    # serves. Its answers reach the callers through Redis at once, while its `serving` report reaches
    # the books through the agents' worker on its own time: wait for the books, not the answers.
    def states_of_c() -> dict[str, str] | None:
        states = dict(Replica.objects.filter(deployment__name="c").values_list("id", "state"))
        return states if "serving" in states.values() else None

    c = wait_until(states_of_c, 30, "the new replica of c to be serving in the books")
    assert c.pop(holder) == "failed" and list(c.values()) == ["serving"], c
    assert "abandoned" in Replica.objects.get(pk=holder).failure_reason
    assert Event.objects.filter(kind=Event.Kind.PREEMPTION_VICTIM).count() == 1
