"""The preemption barrier in real replica processes: a sleep or stop stops taking
requests at once, lets the one in flight finish for up to drain_timeout_s, then cuts it short and
gives it back to the head of its queue (never dropped, not counted as an attempt).

Real replica processes on a virtual GPU, a real Redis (only gp:* keys are touched) and the
RequestQueue used directly; no database. Events arrive through queues with timeouts.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from torch import nn

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_KERNEL_GROWTH_BYTES
from gpuportal.wire.requestqueue import Request, RequestQueue, processing_key, queue_key
from inference.backends import Placement, VirtualBackend
from inference.event_stream import EventWriter
from inference.host import ReplicaHost
from inference.supervisor import ReplicaSpec, Supervisor
from tests.support.processes import wait_until
from tests.support.replicas import Events

pytestmark = pytest.mark.slow

MiB = 1024**2
RESERVED = H100_CONTEXT_BYTES + 64 * MiB  # a CUDA context beside the allocator, as the scheduler reserves
SLOW_FORWARD_S = 2.0
LONG_TOKENS = 2000  # the tiny model's context is 2048 tokens: seconds of generation on a CPU
SHORT_TOKENS = 150
# Room in the KV block pool for the prompt: one long request fills the pool, so a later one waits.
PROMPT_ROOM = 16


def wake(reserved: int) -> dict:
    """The wake the control plane sends a replica loaded into `reserved`: the need plus what its
    context grew by serving (the sleep's residual raised the GPU's figure: placing.need_bytes)."""
    grown = reserved + H100_KERNEL_GROWTH_BYTES
    return {"cmd": "wake", "gpus": [0], "reserved_bytes_by_gpu": {"0": grown}, "fraction": 0.03}


class _SlowForward(nn.Module):
    """A forward pass that takes SLOW_FORWARD_S: it cannot be interrupted by a drain."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(SLOW_FORWARD_S)
        return self.linear(x)


def slow_module() -> nn.Module:
    """A factory for the torch-module loader (the replica process imports this module)."""
    return _SlowForward()


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory) -> Path:
    """The tiny causal LM without an end-of-sequence token: it always generates max_tokens."""
    from inference.management.commands.make_tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("endless-model")
    write_tiny_model(path, size_mb=5, seed=0, log=lambda _: None)
    for name in ("config.json", "generation_config.json"):
        config_path = path / name
        if config_path.exists():
            config = json.loads(config_path.read_text())
            config["eos_token_id"] = None
            config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def kv_reserved(endless_model_dir) -> int:
    """The scheduler's estimate for one long request (gpuportal.wire.memory), with the CUDA context the
    virtual GPU models: the replica's KV pool then holds one, as one request at a time did before
    the pool."""
    from gpuportal.wire.memory import estimate
    from inference.model_size import shape_from_model_dir

    shape = shape_from_model_dir(endless_model_dir, "float32")
    return estimate(shape, max_tokens=LONG_TOKENS + PROMPT_ROOM, cuda_context_bytes=H100_CONTEXT_BYTES).total_bytes


@pytest.fixture
def rq():
    client = redis.Redis.from_url(settings.REDIS_URL)

    def clean() -> None:
        # Only the queue's own keys: REDIS_URL may point at a developer's Redis.
        for key in client.scan_iter("gp:*"):
            client.delete(key)

    clean()
    yield RequestQueue(client)
    clean()


@pytest.fixture(scope="module")
def forking_supervisor(tmp_path_factory):
    """One supervisor for the file, forking each replica from its template as an agent on virtual
    GPUs does: the template's imports (torch, transformers: seconds of CPU) are paid once, not by
    every test's replica."""
    sup = Supervisor(tmp_path_factory.mktemp("barrier-logs"))
    sup.use_forkserver()
    yield sup
    sup.stop_all(timeout=5)
    sup.close()


@pytest.fixture
def supervisor(forking_supervisor):
    yield forking_supervisor
    forking_supervisor.stop_all(timeout=5)  # each test's replica ends with it, whatever it asserted


def replica(source: str, deployment: str, *, loader: str = "transformers", reserved: int = RESERVED) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="b1",
        source=source,
        loader=loader,
        dtype="float32",
        gpus=(0,),
        reserved_bytes_by_gpu={"0": reserved},
        fraction=0.03,
        backend="virtual",
        deployment=deployment,
        redis_url=settings.REDIS_URL,
        # The deployment's max_tokens: what the pool must hold one request of.
        kv_max_tokens=LONG_TOKENS + PROMPT_ROOM,
        context_bytes=H100_CONTEXT_BYTES,  # what the scheduler counts beside the allocator (tasks.spec_for)
    )


def generate(rq: RequestQueue, deployment: str, max_tokens: int) -> Request:
    return rq.submit(
        deployment, kind="generate", input="Once upon a time", params={"max_tokens": max_tokens}, owner="1"
    )


def running(rq: RequestQueue, request_id: str) -> Request:
    return wait_until(lambda: (r := rq.get(request_id)).status == "running" and r, 60, "the request to run", every=0.01)


def head_of(rq: RequestQueue, deployment: str) -> str | None:
    """The id a replica takes next (the right end of the list)."""
    raw = rq.redis.lindex(queue_key(deployment), -1)
    return raw.decode() if raw is not None else None


def test_a_sleep_past_its_drain_timeout_gives_the_request_back_and_the_wake_serves_it(
    supervisor, rq, endless_model_dir, kv_reserved
):
    events = Events()
    supervisor.start(replica(str(endless_model_dir), "endless", reserved=kv_reserved), events)
    _, serving = events.until("serving")
    assert serving["kv"]["blocks_total"] * serving["kv"]["block_tokens"] < LONG_TOKENS + PROMPT_ROOM + 4
    long = generate(rq, "endless", LONG_TOKENS)
    later = generate(rq, "endless", 4)  # waits behind it: the KV pool holds one long request
    running(rq, long.id)

    sent = time.monotonic()
    supervisor.send("b1", {"cmd": "sleep", "drain_timeout_s": 0.5})
    _, sleeping = events.until("sleeping", timeout=30)
    took = time.monotonic() - sent

    assert took >= 0.4, f"slept {took:.2f} s after the sleep, before its drain timeout of 0.5 s"
    back = rq.get(long.id)
    assert back.status == "queued" and back.attempts == 0 and back.replica == "", back
    assert head_of(rq, "endless") == long.id, "given back to the head of its queue, before the later one"
    assert rq.depth("endless") == 2 and rq.get(later.id).status == "queued"
    assert rq.redis.llen(processing_key("b1")) == 0
    assert sleeping["residual_bytes_by_id"] == {"0": H100_CONTEXT_BYTES + H100_KERNEL_GROWTH_BYTES}

    supervisor.send("b1", wake(kv_reserved))
    events.until("woken", timeout=30)
    done = rq.wait(long.id, timeout=120)
    assert done.status == "done" and done.attempts == 1 and done.replica == "b1", done
    assert done.output["usage"]["completion_tokens"] == LONG_TOKENS and done.output["finish_reason"] == "length"
    assert rq.wait(later.id, timeout=60).status == "done"
    assert supervisor.stop("b1", drain_timeout_s=5) == 0


def test_a_generous_drain_lets_the_request_finish_and_stop_drains_the_same_way(
    supervisor, rq, endless_model_dir, kv_reserved
):
    events = Events()
    supervisor.start(replica(str(endless_model_dir), "endless", reserved=kv_reserved), events)
    events.until("serving")
    # Long enough to be in flight when the sleep comes (seconds on a CPU), short enough to finish.
    short = generate(rq, "endless", SHORT_TOKENS)
    running(rq, short.id)

    sent_at = time.time()
    supervisor.send("b1", {"cmd": "sleep", "drain_timeout_s": 60})
    newcomer = generate(rq, "endless", LONG_TOKENS)  # arrives while the replica drains
    events.until("sleeping", timeout=60)

    done = rq.get(short.id)
    assert done.status == "done" and done.attempts == 1, done
    assert done.finished_at >= sent_at, "it was still in flight when the sleep came"
    assert done.output["usage"]["completion_tokens"] == SHORT_TOKENS
    waiting = rq.get(newcomer.id)
    assert waiting.status == "queued" and waiting.attempts == 0, "nothing new starts once draining"

    # Awake again, it takes the newcomer; a stop with a short drain gives it back and exits cleanly.
    supervisor.send("b1", wake(kv_reserved))
    events.until("woken", timeout=30)
    running(rq, newcomer.id)
    code = supervisor.stop("b1", timeout=10, drain_timeout_s=0.5)

    assert code == 0
    stopped = events.final(timeout=10)
    assert stopped["event"] == "stopped" and "forced" not in stopped, stopped
    back = rq.get(newcomer.id)
    assert back.status == "queued" and back.attempts == 0 and back.replica == "", back
    assert head_of(rq, "endless") == newcomer.id
    assert rq.redis.llen(processing_key("b1")) == 0


def test_a_replica_claims_to_take_requests_while_it_serves_and_withdraws_the_claim_before_it_says_so(
    supervisor, rq, endless_model_dir, kv_reserved
):
    events = Events()
    supervisor.start(replica(str(endless_model_dir), "endless", reserved=kv_reserved), events)
    events.until("serving")
    wait_until(lambda: rq.live("endless", "text") == ["b1"], 30, "the claim")

    supervisor.send("b1", {"cmd": "sleep", "drain_timeout_s": 5})
    events.until("sleeping", timeout=30)
    # Withdrawn before the report: the control plane's look for requests left waiting, which
    # follows the report, sees every request queued on the strength of the claim.
    assert rq.live("endless", "text") == []

    supervisor.send("b1", wake(kv_reserved))
    events.until("woken", timeout=30)
    wait_until(lambda: rq.live("endless", "text") == ["b1"], 30, "the claim after the wake")
    assert supervisor.stop("b1", drain_timeout_s=5) == 0
    assert rq.live("endless", "text") == []


def test_a_forward_pass_cannot_be_cut_short_so_it_finishes_before_the_sleep(supervisor, rq):
    events = Events()
    supervisor.start(replica("tests.inference.test_barrier:slow_module", "slow", loader="torch-module"), events)
    events.until("serving")
    request = rq.submit("slow", kind="forward", input=[[1.0, 2.0, 3.0, 4.0]], params={}, owner="1")
    running(rq, request.id)

    supervisor.send("b1", {"cmd": "sleep", "drain_timeout_s": 0.2})
    events.until("sleeping", timeout=30)

    done = rq.get(request.id)
    assert done.status == "done" and done.attempts == 1, done
    assert done.output["shape"] == [1, 4]
    assert supervisor.stop("b1", drain_timeout_s=1) == 0


def test_a_drain_timeout_that_is_not_seconds_is_refused_and_changes_nothing():
    out = io.StringIO()
    host = ReplicaHost(
        replica_id="b1",
        source="unused",
        loader="transformers",
        dtype="float32",
        placement=Placement.parse([0], {"0": RESERVED}, 0.03),
        backend=VirtualBackend(),
        events=EventWriter(out),
    )
    host.state = "serving"

    for bad in (-1, "soon", True, float("nan")):
        host.handle({"cmd": "sleep", "drain_timeout_s": bad})

    errors = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in errors] == ["error"] * 4
    assert all("drain_timeout_s must be a number of seconds >= 0" in e["reason"] for e in errors)
    assert host.state == "serving" and host.accepting.is_set()


class _FakeSupervisor:
    """What the node agent's tasks call, recorded: (method, replica id, what was passed)."""

    def __init__(self, running: list[str]) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self._running = running

    def running(self) -> list[str]:
        return self._running

    def send(self, replica_id: str, command: dict) -> None:
        self.calls.append(("send", replica_id, command))

    def stop(
        self, replica_id: str, timeout: float = 10.0, drain_timeout_s: float | None = None, *, close_pair: bool = False
    ) -> int:
        self.calls.append(("stop", replica_id, drain_timeout_s))
        return 0


@pytest.mark.django_db
def test_the_node_tasks_pass_the_deployments_drain_timeout(monkeypatch):
    from types import SimpleNamespace

    from gpuportal.wire import commands
    from inference import agent, tasks
    from scheduling.services import replica_specs
    from tests.support import factories

    rep = factories.replica(factories.deployment(drain_timeout_s=7.5), factories.node())
    fake = _FakeSupervisor([rep.id])
    # The books wait for each command: the agent carries it out (a second copy finds them moved on).
    control = SimpleNamespace(replica_state=lambda replica_id: "draining")
    monkeypatch.setattr(agent, "_current", SimpleNamespace(supervisor=fake, name="n1", control=control))
    # The control plane puts the deployment's drain into the command; the agent passes it on.
    to_sleep, to_stop = replica_specs.sleep(rep.id), replica_specs.stop(rep.id)

    assert tasks.replica_to_cache(commands.encode(to_sleep)) == "sent"
    assert tasks.stop_replica(commands.encode(to_stop)) == "stopped"

    assert fake.calls == [("send", rep.id, {"cmd": "sleep", "drain_timeout_s": 7.5}), ("stop", rep.id, 7.5)]
