"""Replica processes (inference.replica) and their supervisor (inference.supervisor). No database.

Real subprocesses: each imports torch (seconds on a small machine), so each test starts as few as
it can and the module shares one tiny model. Events arrive through a queue with timeouts, never
through sleeps.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from inference.backends import CommandRejected, CudaBackend, Placement, ReplicaFailure, VirtualBackend, classify_failure
from inference.event_stream import EventWriter
from inference.host import ReplicaHost
from inference.loaders import load_model, tensor_bytes
from inference.supervisor import ReplicaSpec, Supervisor, describe_exit, last_line, last_words, replica_argv
from tests.support.models import tiny_mlp
from tests.support.processes import wait_until
from tests.support.replicas import BIG_MLP, CONTEXT, LOAD_TIMEOUT_S, SERVED_CONTEXT, TINY_MLP, Events, MiB, gone, spec

GiB = 1024**3
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from inference.management.commands.make_tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(path, size_mb=5, seed=0, log=lambda _: None)
    return path


@pytest.fixture(scope="module")
def forking_supervisor(tmp_path_factory):
    """The file's supervisor that forks replicas from its template, as an agent on virtual GPUs
    does: the template's imports (torch, transformers: seconds of CPU) are paid once for the file."""
    sup = Supervisor(tmp_path_factory.mktemp("forked-logs"))
    sup.use_forkserver()
    yield sup
    sup.stop_all(timeout=5)
    sup.close()


@pytest.fixture
def supervisor(tmp_path, request, forking_supervisor):
    """A supervisor that forks each replica from the file's template (the default), starts it in a
    fresh interpreter ("fresh", by indirect parametrization), or forks it from a template of its
    own ("own template": a test that kills it)."""
    way = getattr(request, "param", "forked")
    if way == "forked":
        yield forking_supervisor
        forking_supervisor.stop_all(timeout=5)  # each test's replicas end with it
        return
    sup = Supervisor(tmp_path / "logs")
    if way == "own template":
        sup.use_forkserver()
    yield sup
    sup.stop_all(timeout=5)
    sup.close()


# The tests of a replica's whole life, each way an agent may start one.
BOTH_STARTS = pytest.mark.parametrize("supervisor", ["fresh", "forked"], indirect=True)


# -- whole replica processes, virtual GPUs ---------------------------------------------------------


@pytest.mark.slow
@BOTH_STARTS
def test_a_virtual_replica_loads_sleeps_wakes_on_another_gpu_and_stops(supervisor, tiny_model_dir):
    events = Events()
    supervisor.start(spec(str(tiny_model_dir), reserved=CONTEXT + 96 * MiB, fraction=0.03), events)

    progress, serving = events.until("serving")
    percents = [e["percent"] for e in progress if e["event"] == "progress"]
    assert len(percents) >= 3 and percents == sorted(percents) and percents[-1] == 100
    assert {e["state"] for e in progress} == {"loading"}
    assert serving["weights_bytes"] == tensor_bytes(load_model(str(tiny_model_dir), "transformers", "float32"))
    assert serving["pid"] == supervisor.pid("r1")
    # No NVML on a virtual GPU: what it would show, modelled like the H100's: the
    # context, the weights, the pool and the activation reserve, within the reservation.
    footprint = serving["footprint"]
    assert footprint["context_bytes"] == CONTEXT
    # The reservation is above the need: the pool takes the rest, so the process holds more than
    # the need (a pool for more than max_tokens) but never more than it reserved.
    assert serving["need_bytes"] == footprint["total_bytes"] < serving["process_bytes"]
    assert serving["process_bytes"] == serving["process_bytes_by_id"]["0"] <= CONTEXT + 96 * MiB
    assert serving["gpu_mem_bytes_by_id"] == {"0": CONTEXT + 96 * MiB}
    assert serving["param_devices"] == ["cpu"]
    with pytest.raises(ValueError, match="already running"):
        supervisor.start(spec(str(tiny_model_dir)), events)
    assert supervisor.arenas() == {}, "it has said nothing of an arena yet: no beat reads that as none"

    # Allowed to keep a host arena: it says so once one is ready, sized as the arena.
    supervisor.send("r1", {"cmd": "arena", "keep": True})
    _, arena = events.until("arena")
    assert arena["kept_bytes"] >= serving["weights_bytes"]
    # What the heartbeat tells the control plane it keeps (a grant that never arrived shows as none).
    assert supervisor.arenas() == {"r1": arena["kept_bytes"]}

    # A waker on its GPU waits for it to let go (inference.tasks.wait_released): serving, it holds.
    assert supervisor.released(["r1", "not-here"], timeout=0) == ["r1"]
    waiter = ThreadPoolExecutor(1).submit(supervisor.released, ["r1"], 60)
    supervisor.send("r1", {"cmd": "sleep"})
    _, sleeping = events.until("sleeping")
    # The context stays, as on a real GPU, grown by the kernels serving loaded.
    assert sleeping["residual_bytes_by_id"] == {"0": SERVED_CONTEXT}
    assert waiter.result(timeout=60) == [], "its sleep wakes the waiter"
    # What the heartbeat tells the control plane of it (scheduling.services.lost_commands).
    assert supervisor.states() == {"r1": "sleeping"}
    assert supervisor.arenas() == {"r1": 0}, "the sleep packed its weights into the arena it kept"
    assert supervisor.sleepers(["r1", "not-here"]) == {"r1": (serving["pid"], {"0": SERVED_CONTEXT})}
    assert sleeping["cpu_bytes"] == serving["weights_bytes"]

    supervisor.send(
        "r1", {"cmd": "wake", "gpus": [1], "reserved_bytes_by_gpu": {"1": SERVED_CONTEXT + 80 * MiB}, "fraction": 0.05}
    )
    _, woken = events.until("woken")
    assert woken["gpu_mem_bytes_by_id"] == {"1": SERVED_CONTEXT + 80 * MiB}
    assert woken["gpus"] == [1] and woken["fraction"] == 0.05
    assert woken["weights_bytes"] == serving["weights_bytes"]
    assert events.until("arena")[1]["kept_bytes"] == arena["kept_bytes"]  # the wake kept the one it read

    assert supervisor.arenas() == {"r1": arena["kept_bytes"]}

    supervisor.send("r1", {"cmd": "ping"})
    _, pong = events.until("pong")
    assert pong["state"] == "serving" and pong["arena_bytes"] == arena["kept_bytes"]
    assert supervisor.states() == {"r1": "serving"}
    supervisor.send("r1", {"cmd": "arena", "keep": False})
    assert events.until("arena")[1]["kept_bytes"] == 0
    assert supervisor.arenas() == {"r1": 0}

    pid = serving["pid"]
    assert supervisor.stop("r1") == 0
    stopped = events.final()
    assert stopped["event"] == "stopped" and stopped["exit_code"] == 0 and "forced" not in stopped
    assert supervisor.running() == [] and supervisor.pid("r1") is None
    assert gone(pid)
    with pytest.raises(KeyError, match="no running replica 'r1'"):
        supervisor.send("r1", {"cmd": "ping"})


@pytest.mark.slow
def test_a_reservation_smaller_than_the_weights_fails_like_an_out_of_memory(supervisor, tiny_model_dir):
    events = Events()
    supervisor.start(spec(str(tiny_model_dir), reserved=2 * MiB), events)

    failed = events.final()
    assert failed["event"] == "failed" and failed["kind"] == "oom", failed
    assert re.search(
        r"^out of memory: weights need 5\.0 MiB \(\d+ bytes\), reservation is 2\.0 MiB \(2097152 bytes\)",
        failed["reason"],
    ), failed["reason"]
    assert failed["exit_code"] == 1
    assert supervisor.running() == []


@pytest.mark.slow
def test_a_source_that_is_not_a_model_fails_the_load_saying_why(supervisor, tmp_path):
    events = Events()
    supervisor.start(spec(str(tmp_path / "missing")), events)

    failed = events.final()
    assert failed["event"] == "failed" and failed["kind"] == "load"
    assert failed["reason"] == f"not a model directory: {tmp_path / 'missing'} does not exist"
    assert failed["exit_code"] == 1


@pytest.mark.slow
@BOTH_STARTS
def test_a_torch_module_replica_serves_and_a_killed_one_is_reported_as_a_crash(supervisor):
    events = Events()
    # Started from a thread that ends at once: PR_SET_PDEATHSIG follows the thread that forked, not
    # the process, and Celery task threads come and go. The replica must outlive this thread.
    starter = threading.Thread(target=supervisor.start, args=(spec(TINY_MLP, loader="torch-module"), events))
    starter.start()
    starter.join()

    _, serving = events.until("serving")
    assert serving["weights_bytes"] == tensor_bytes(tiny_mlp())
    os.kill(serving["pid"], signal.SIGKILL)

    failed = events.final()
    assert failed["event"] == "failed" and failed["kind"] == "crash"
    assert "loaded" in last_line(supervisor.log_path("r1")), "its log ends with a routine record, not an error"
    assert failed["reason"] == (
        "replica process exited with code -9 (signal SIGKILL), with no error in its log: SIGKILL comes from "
        "outside it (the kernel's OOM killer, or a kill -9)"
    )
    assert supervisor.running() == []


@pytest.mark.slow
@BOTH_STARTS
def test_a_replica_that_does_not_answer_stop_is_killed_and_reported_stopped(supervisor):
    events = Events()
    supervisor.start(spec(TINY_MLP, loader="torch-module"), events)
    os.kill(supervisor.pid("r1"), signal.SIGSTOP)

    # No drain to wait for: the kill comes `timeout` after the stop.
    assert supervisor.stop("r1", timeout=0.5, drain_timeout_s=0) == -signal.SIGKILL
    stopped = events.final(timeout=10)
    assert stopped["event"] == "stopped" and stopped["forced"] is True
    assert "signal SIGKILL" in stopped["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("supervisor", ["own template"], indirect=True)
def test_once_its_template_is_gone_replicas_start_in_a_fresh_interpreter(supervisor):
    assert supervisor.forkserver_ready(LOAD_TIMEOUT_S)
    events = Events()
    supervisor.start(spec(TINY_MLP, loader="torch-module"), events)
    forked = events.until("serving")[1]["pid"]
    assert psutil.Process(forked).ppid() != os.getpid(), "forked: the template's child"
    assert psutil.Process(forked).name() == "replica-r1", "named, its command line being the template's"

    template = psutil.Process(forked).parent()
    template.kill()
    template.wait(10)
    # Tied to the template, as a replica without an adoption window is tied to its agent.
    wait_until(lambda: gone(forked), timeout=10, what="the forked replica to die with its template")
    assert events.final()["event"] == "failed"

    supervisor.start(spec(TINY_MLP, loader="torch-module", replica_id="r2"), events)
    fresh = events.until("serving")[1]["pid"]
    assert psutil.Process(fresh).ppid() == os.getpid(), "the plain way: the supervisor's own child"


HELPER = textwrap.dedent(
    """
    import sys, threading
    from inference.supervisor import ReplicaSpec, Supervisor

    def on_event(replica_id, event):
        print(event["event"], event.get("pid", ""), flush=True)

    supervisor = Supervisor(sys.argv[1])
    if sys.argv[3] == "forked":
        supervisor.use_forkserver()
    supervisor.start(
        ReplicaSpec(replica_id="orphan", source=sys.argv[2], loader="torch-module", dtype="float32",
                    gpus=(0,), reserved_bytes_by_gpu={"0": 64 << 20}),
        on_event,
    )
    threading.Event().wait()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fresh", "forked"])
def test_replicas_die_with_the_agent_that_started_them(tmp_path, start):
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(tmp_path / "logs"), TINY_MLP, start],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in helper.stdout], daemon=True).start()
    try:
        line = ""
        while not line.startswith(("serving", "failed", "stopped")):
            line = lines.get(timeout=LOAD_TIMEOUT_S)
        assert line.startswith("serving"), line
        replica_pid = int(line.split()[1])
        parent = psutil.Process(psutil.Process(replica_pid).ppid())
        # A forked replica is its template's child, the template the agent's (and tied to it).
        assert (parent.pid if start == "fresh" else parent.ppid()) == helper.pid

        helper.kill()
        helper.wait(10)
        wait_until(lambda: gone(replica_pid), timeout=10, what=f"replica pid {replica_pid} to die with its agent")
    finally:
        if helper.poll() is None:
            helper.kill()
        helper.wait(10)
        helper.stdout.close()


@pytest.mark.slow
def test_the_supervisor_refuses_unknown_replicas_and_bad_specs(supervisor):
    with pytest.raises(KeyError):
        supervisor.send("nobody", {"cmd": "ping"})
    with pytest.raises(KeyError):
        supervisor.stop("nobody")
    assert supervisor.pid("nobody") is None
    with pytest.raises(ValueError, match="replica id"):
        spec(TINY_MLP, replica_id="../etc/passwd")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        spec(TINY_MLP, backend="tpu")


def test_a_spec_becomes_the_documented_command_line():
    argv = replica_argv(spec("/srv/m", gpus=(0, 1), reserved=1000, fraction=None, backend="cuda"), "python")
    assert argv == [
        "python",
        "-m",
        "inference.replica",
        "--replica-id",
        "r1",
        "--source",
        "/srv/m",
        "--loader",
        "transformers",
        "--dtype",
        "float32",
        "--gpus",
        "0,1",
        "--reserved-bytes-by-gpu",
        '{"0": 1000, "1": 1000}',
        "--backend",
        "cuda",
    ]
    assert replica_argv(spec("/srv/m", fraction=0.25), "python")[-4:-2] == ["--fraction", "0.25"]
    assert replica_argv(spec("/srv/m"), "python")[-2:] == ["--context-bytes", str(CONTEXT)]


@pytest.mark.parametrize(
    ("code", "text"),
    [(-9, "exited with code -9 (signal SIGKILL)"), (1, "exited with code 1"), (-6, "(signal SIGABRT)")],
)
def test_exits_are_described_with_their_signal(code, text):
    assert text in describe_exit(code)


RECORD = "2026-11-30 08:50:29,750 {} replica r1 pid 7: {}"
ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    ("tail", "words"),
    [
        pytest.param([RECORD.format("INFO", "r1 100%: loaded 200 MiB in 0.4 s")], "", id="a routine record"),
        pytest.param([RECORD.format("DEBUG", "pong")], "", id="a debug record"),
        pytest.param(
            [RECORD.format("INFO", "serving"), "Traceback (most recent call last):", f"RuntimeError: {ILLEGAL}"],
            f"RuntimeError: {ILLEGAL}",
            id="a traceback",
        ),
        pytest.param(
            [RECORD.format("ERROR", "r1: the engine stopped: out of blocks")],
            RECORD.format("ERROR", "r1: the engine stopped: out of blocks"),
            id="an error record",
        ),
        pytest.param([], "", id="nothing"),
    ],
)
def test_a_dead_replicas_last_words_are_its_logs_last_line_unless_that_is_routine(tmp_path, tail, words):
    log = tmp_path / "replica-r1.log"
    log.write_text("\n".join([RECORD.format("INFO", "r1 0%: starting"), *tail, ""]) if tail else "")

    assert last_words(log) == words


# -- the host in this process: commands and failures, without a process per case -----------------


def _host(
    reserved: int = 64 * MiB, source: str = TINY_MLP, loader: str = "torch-module"
) -> tuple[ReplicaHost, io.StringIO]:
    out = io.StringIO()
    host = ReplicaHost(
        replica_id="r1",
        source=source,
        loader=loader,
        dtype="float32",
        placement=Placement.parse([0], {"0": reserved}, 0.1),
        backend=VirtualBackend(),
        events=EventWriter(out),
    )
    return host, out


def _events(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_the_host_refuses_commands_that_make_no_sense_now_and_carries_on():
    host, out = _host()
    host.load()
    host.handle({"cmd": "wake", "gpus": [1], "reserved_bytes_by_gpu": {"1": MiB}})
    host.handle({"cmd": "wake", "gpus": "0", "reserved_bytes_by_gpu": {"0": MiB}})
    host.handle({"cmd": "launch"})
    host.handle({"cmd": "ping"})

    errors = [e for e in _events(out) if e["event"] == "error"]
    assert [e["reason"] for e in errors] == [
        "cannot wake while serving",
        "bad wake: gpus must be a non-empty list of GPU ids, got '0'",
        "unknown command 'launch' (known: sleep, wake, stop, ping, arena, deepen)",
    ]
    # kv: the KV pool's statistics; a torch-module replica has none.
    # process_bytes_by_id: what NVML would show; a virtual GPU models it (the context and weights).
    # arena_bytes: the host arena it keeps for its next sleep (none: it was never allowed one).
    pong = _events(out)[-1]
    assert pong == {"event": "pong", "state": "serving", "pid": os.getpid(), "kv": None, "arena_bytes": 0} | {
        "process_bytes_by_id": {"0": pong["process_bytes_by_id"]["0"]}
    }
    assert pong["process_bytes_by_id"]["0"] > CONTEXT


def test_sleep_and_wake_are_idempotent_for_retries():
    host, out = _host()
    host.load()
    host.sleep()
    host.sleep()
    host.wake([0], {"0": 64 * MiB}, 0.1)
    host.wake([0], {"0": 64 * MiB}, 0.1)
    names = [e["event"] for e in _events(out) if e["event"] != "progress"]
    assert names == ["serving", "sleeping", "sleeping", "woken", "woken"]


def test_waking_into_a_reservation_too_small_fails_like_an_out_of_memory():
    host, _ = _host()
    host.load()
    host.sleep()
    with pytest.raises(ReplicaFailure, match=r"out of memory: weights need 0\.3 MiB .* reservation is 0\.1 MiB") as err:
        host.wake([2], {"2": 100_000}, 0.01)
    assert err.value.kind == "oom" and host.state == "failed"


def _llm_host(model_dir: Path, reserved: int = GiB) -> tuple[ReplicaHost, io.StringIO]:
    """A replica host in this process serving a tiny Llama: it pages its KV cache, so a wake allocates a
    pool. The reservation holds the virtual GPU's CUDA context (an H100's) beside the weights and the pool."""
    return _host(reserved, source=str(model_dir), loader="transformers")


class WakeSpy:
    """Records, in order, the wake's steps: the copies queued, the pool allocated, the wait, the
    `woken` event; with whether the copies were waited for at each."""

    def __init__(self, host: ReplicaHost, monkeypatch: pytest.MonkeyPatch):
        self.steps: list[tuple[str, bool]] = []
        self.copies: Any = None
        self.arena = host.backend.arena
        from_cache, allocate_pool, emit = host.backend.from_cache, host._allocate_pool, host.events.emit

        def spy_from_cache(model, placement):
            model, self.copies = from_cache(model, placement)
            wait = self.copies.wait
            self.copies.wait = lambda: (self.steps.append(("wait", self.copies.done)), wait())
            self.steps.append(("queued", self.copies.done))
            return model, self.copies

        def spy_allocate_pool():
            self.steps.append(("pool", self.copies.done))
            allocate_pool()

        def spy_emit(event, **fields):
            if event in {"woken", "failed"}:
                self.steps.append((event, self.copies.done))
            emit(event, **fields)

        monkeypatch.setattr(host.backend, "from_cache", spy_from_cache)
        monkeypatch.setattr(host, "_allocate_pool", spy_allocate_pool)
        monkeypatch.setattr(host.events, "emit", spy_emit)


def _logits(host: ReplicaHost) -> torch.Tensor:
    with torch.no_grad():
        return host.model(torch.tensor([[3, 17, 42, 7, 99]])).logits


def test_it_allocates_the_kv_pool_while_the_copies_are_pending_and_waits_once_before_it_reports_woken(
    tiny_model_dir, monkeypatch
):
    host, out = _llm_host(tiny_model_dir)
    host.load()
    assert host.paged is not None  # a Llama pages its KV cache: the wake has a pool to allocate
    weights = {name: t.clone() for name, t in host.model.state_dict().items()}
    before = _logits(host)
    host.sleep()
    spy = WakeSpy(host, monkeypatch)

    host.wake([1], {"1": GiB}, 0.1)

    # The pool is sized and allocated before the wait (on a GPU, while the copies run); the wait
    # comes once, and `woken` (from which requests are served) only after it.
    assert spy.steps == [("queued", False), ("pool", False), ("wait", False), ("woken", True)]
    assert spy.arena.released and host.backend.arena is None
    assert host.state == "serving" and host.paged is not None and host.placement.gpus == (1,)
    after = host.model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in weights.items())
    assert torch.equal(_logits(host), before)
    assert [e["event"] for e in _events(out) if e["event"] != "progress"] == ["serving", "sleeping", "woken"]


def test_it_allocates_a_standbys_kv_pool_while_its_takeover_copies_are_pending(tiny_model_dir, monkeypatch):
    host, _ = _llm_host(tiny_model_dir)
    host.load_standby()
    assert host.state == "standby" and host.backend.arena is not None
    weights = {name: t.clone() for name, t in host.model.state_dict().items()}
    spy = WakeSpy(host, monkeypatch)

    host.wake_standby()  # the failover lock's grant (inference.pairing) then sets `serving`

    assert spy.steps == [("queued", False), ("pool", False), ("wait", False)]
    assert spy.copies.done and spy.arena.released and host.paged is not None
    after = host.model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in weights.items())


def test_a_standby_whose_kv_pool_would_not_fit_its_pairs_reservation_fails_before_it_stands_by(tiny_model_dir):
    roomy, _ = _llm_host(tiny_model_dir)
    roomy.load_standby()
    assert roomy.state == "standby"

    # Room for the weights, none for a pool of max_tokens (its pair was placed for fewer tokens):
    # at takeover its active would be gone already, so it fails now, naming the bytes.
    tight, out = _llm_host(tiny_model_dir, reserved=roomy.weights_bytes + MiB)
    with pytest.raises(ReplicaFailure, match="cannot serve: the KV pool left by the reservation") as err:
        tight.load_standby()

    assert err.value.kind == "oom" and tight.state == "failed"
    assert "standby" not in [e["event"] for e in _events(out)]


def test_it_waits_for_the_copies_and_frees_the_arena_when_the_pool_fails_after_they_were_queued(
    tiny_model_dir, monkeypatch
):
    host, out = _llm_host(tiny_model_dir)
    host.load()
    host.sleep()
    spy = WakeSpy(host, monkeypatch)

    # Room for the weights (the check before anything is copied passes), none for a pool of max_tokens.
    with pytest.raises(ReplicaFailure, match="cannot serve: the KV pool left by the reservation") as err:
        host.wake([0], {"0": host.weights_bytes + MiB}, 0.1)

    assert err.value.kind == "oom" and host.state == "failed"
    assert spy.steps == [("queued", False), ("pool", False), ("wait", False)]
    assert spy.copies.done and spy.arena.released  # nothing in flight, no arena left behind
    assert "woken" not in [e["event"] for e in _events(out)]


# -- a kept arena: the `arena` command -------------------------------------------------------------


class ArenaEvents:
    """The host's `arena` events as they come, from whichever thread emits them."""

    def __init__(self, host: ReplicaHost):
        self.kept: list[int] = []
        self._came = threading.Condition()
        emit = host.events.emit

        def spy(event: str, **fields: Any) -> None:
            emit(event, **fields)
            if event == "arena":
                with self._came:
                    self.kept.append(fields["kept_bytes"])
                    self._came.notify_all()

        host.events.emit = spy  # type: ignore[method-assign]

    def wait_for(self, count: int) -> list[int]:
        with self._came:
            assert self._came.wait_for(lambda: len(self.kept) >= count, LOAD_TIMEOUT_S), self.kept
            return list(self.kept)


def keeping_a_spare() -> tuple[ReplicaHost, ArenaEvents, Any]:
    """A loaded replica told it may keep an arena, once its spare is ready: (host, its arena
    events, the spare)."""
    host, _ = _host()
    host.load()
    arenas = ArenaEvents(host)
    host.handle({"cmd": "arena", "keep": True})
    arenas.wait_for(1)
    return host, arenas, host.backend.spare


def test_a_serving_replica_allowed_to_keep_an_arena_prepares_one_and_its_next_sleep_packs_into_it():
    from inference.arena import host_bytes

    host, out = _host()
    host.load()
    arenas = ArenaEvents(host)
    expected = host_bytes(host.model)

    host.handle({"cmd": "arena", "keep": True})

    assert arenas.wait_for(1) == [expected]
    spare = host.backend.spare
    assert spare is not None and spare.nbytes == expected and not spare.released
    buffer = spare.host.data_ptr()
    host.sleep()
    assert host.backend.arena.host.data_ptr() == buffer and host.backend.spare is None  # consumed
    assert [e["event"] for e in _events(out) if e["event"] != "progress"] == ["serving", "arena", "sleeping"]


def test_a_sleep_waits_for_the_arena_being_prepared_and_packs_into_it(monkeypatch):
    host, _ = _host()
    host.load()
    steps: list[str] = []
    let_go = threading.Event()
    prepare, to_cache, drain = host.backend.prepare_spare, host.backend.to_cache, host.drain

    def slow_prepare(model):
        let_go.wait()  # pinning gigabytes, still running when the sleep comes
        spare = prepare(model)
        steps.append("prepared")
        return spare

    def spy_to_cache(model, placement):
        steps.append("packed")
        return to_cache(model, placement)

    def spy_drain(*args, **kwargs):
        drained = drain(*args, **kwargs)
        let_go.set()  # only once the sleep has begun
        return drained

    monkeypatch.setattr(host.backend, "prepare_spare", slow_prepare)
    monkeypatch.setattr(host.backend, "to_cache", spy_to_cache)
    monkeypatch.setattr(host, "drain", spy_drain)
    host.handle({"cmd": "arena", "keep": True})  # returns at once: the command loop is not held
    assert steps == [] and host.backend.spare is None

    host.sleep()

    assert steps == ["prepared", "packed"]
    assert host.state == "sleeping" and host.backend.spare is None and host.backend.arena is not None


def test_a_replica_told_it_may_no_longer_keep_its_arena_frees_it():
    host, arenas, spare = keeping_a_spare()

    host.handle({"cmd": "arena", "keep": False})

    assert arenas.wait_for(2)[-1] == 0
    assert spare is not None and spare.released and host.backend.spare is None
    assert host.backend.keep_arena is False
    host.sleep()
    host.wake([0], {"0": 64 * MiB}, 0.1)
    assert host.backend.spare is None and arenas.kept == [arenas.kept[0], 0]  # the wake freed its arena


def test_a_sleeping_replica_allowed_to_keep_an_arena_keeps_the_one_it_wakes_from():
    host, out = _host()
    host.load()
    host.sleep()
    asleep = host.backend.arena
    buffer, nbytes = asleep.host.data_ptr(), asleep.nbytes

    host.handle({"cmd": "arena", "keep": True})
    assert host.backend.spare is None  # asleep: nothing to prepare, the wake will keep its arena
    host.wake([1], {"1": 64 * MiB}, 0.1)

    assert host.backend.spare is asleep and not asleep.released and asleep.host.data_ptr() == buffer
    names = [(e["event"], e.get("kept_bytes")) for e in _events(out) if e["event"] != "progress"]
    assert names == [("serving", None), ("sleeping", None), ("woken", None), ("arena", nbytes)]
    host.sleep()
    assert host.backend.arena.host.data_ptr() == buffer  # the next sleep packs into it


def test_a_bad_keep_is_refused_and_changes_nothing():
    host, out = _host()
    host.load()

    host.handle({"cmd": "arena", "keep": "yes"})
    host.handle({"cmd": "arena"})
    host.handle({"cmd": "arena", "keep": 1})

    errors = [e for e in _events(out) if e["event"] == "error"]
    assert [(e["cmd"], e["reason"]) for e in errors] == [
        ("arena", "bad arena: keep must be true or false, got 'yes'"),
        ("arena", "bad arena: keep must be true or false, got None"),
        ("arena", "bad arena: keep must be true or false, got 1"),
    ]
    assert host.backend.keep_arena is False and host.backend.spare is None and host.state == "serving"


def test_stopping_a_replica_releases_the_arena_it_keeps():
    host, _, spare = keeping_a_spare()

    host.stop(0)

    assert spare.released and host.backend.spare is None and host.state == "stopped"


@pytest.mark.parametrize(
    ("gpus", "reserved", "fraction", "complaint"),
    [
        ([], {}, None, "non-empty list"),
        ([0, 0], {"0": 1}, None, "twice"),
        ([-1], {"-1": 1}, None, "non-negative"),
        ([0, 1], {"0": 1}, None, "one entry per GPU"),
        ([0], {"0": 0}, None, "positive byte counts"),
        ([0], {"0": 1}, 1.5, r"fraction must be in \(0, 1\]"),
        ([0], {"0": 1}, "half", "fraction must be a number"),
    ],
)
def test_a_bad_placement_is_refused_naming_the_field(gpus, reserved, fraction, complaint):
    with pytest.raises(ValueError, match=complaint):
        Placement.parse(gpus, reserved, fraction)


def test_a_multi_gpu_placement_has_no_fraction_and_forbids_other_gpus():
    placement = Placement.parse([1, 2], {"1": 10, "2": 20}, 0.5)
    assert placement.fraction is None
    assert placement.max_memory(4) == {0: 0, 1: 10, 2: 20, 3: 0}


@pytest.mark.parametrize(
    ("exc", "kind", "reason"),
    [
        (RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"), "cuda_assert", ""),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom", "out of memory: CUDA"),
        (MemoryError(), "oom", "out of memory: MemoryError"),
        (ValueError("not a model directory: /x does not exist"), "load", "not a model directory"),
        (KeyError("lm_head.weight"), "load", "KeyError: 'lm_head.weight'"),
    ],
)
def test_failures_are_classified_the_way_the_agent_acts_on_them(exc, kind, reason):
    failure = classify_failure(exc, "load")
    assert failure.kind == kind and failure.reason.startswith(reason)
    assert "\n" not in failure.reason


def test_the_cuda_backend_fails_loudly_where_weights_are_not_on_its_gpus():
    with pytest.raises(
        ReplicaFailure, match=r"out of memory: weights do not fit .* on GPUs \[0\]: 0\.3 MiB on cpu"
    ) as err:
        CudaBackend().verify(tiny_mlp(), Placement.parse([0], {"0": MiB}, 0.1))
    assert err.value.kind == "oom"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_cuda_backend_says_so_where_torch_cannot_use_a_gpu():
    with pytest.raises(ReplicaFailure, match=r"--backend cuda, but this torch .* cannot use a GPU here") as err:
        CudaBackend().attach(Placement.parse([0], {"0": MiB}, 0.1))
    assert err.value.kind == "load"


def test_a_rejected_command_is_not_a_failure():
    host, _ = _host()
    with pytest.raises(CommandRejected, match="cannot sleep while starting"):
        host.sleep()
    assert host.state == "starting"


# -- real GPUs (skipped, with the reason, where there is no CUDA) ----------------------------------


def _gpu_total(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    finally:
        pynvml.nvmlShutdown()


def _gpu_count() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


CAP_PROBE = textwrap.dedent(
    """
    import torch
    from inference.backends import CudaBackend, Placement

    total = torch.cuda.get_device_properties(0).total_memory
    CudaBackend().attach(Placement.parse([0], {"0": total // 20}, 0.05))
    under = torch.empty(total * 3 // 100, dtype=torch.uint8, device="cuda:0")
    try:
        over = torch.empty(total * 6 // 100, dtype=torch.uint8, device="cuda:0")
        print("allocated above the cap")
    except torch.cuda.OutOfMemoryError:
        print("out of memory above the cap")
    """
)


@pytest.mark.slow
@pytest.mark.gpu
def test_the_fraction_cap_raises_out_of_memory_above_it():
    # Its own process: the cap is per process and must not leak into the test session.
    result = subprocess.run(
        [sys.executable, "-c", CAP_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "out of memory above the cap"


def _serve_big_on_gpu(supervisor: Supervisor, events: Events, gpu: int) -> dict[str, Any]:
    reserved = 1 * GiB
    supervisor.start(
        ReplicaSpec(
            replica_id="big",
            source=BIG_MLP,
            loader="torch-module",
            dtype="float32",
            gpus=(gpu,),
            reserved_bytes_by_gpu={str(gpu): reserved},
            fraction=reserved / _gpu_total(gpu),
            backend="cuda",
        ),
        events,
    )
    _, serving = events.until("serving", timeout=180)
    assert serving["param_devices"] == [f"cuda:{gpu}"]
    if not serving["process_bytes_by_id"]:
        pytest.skip("NVML does not list this process (a container without the host PID namespace)")
    return serving


@pytest.mark.slow
@pytest.mark.gpu
@BOTH_STARTS
def test_sleep_frees_the_gpu_memory_per_nvml(supervisor):
    events = Events()
    serving = _serve_big_on_gpu(supervisor, events, 0)
    weights = serving["weights_bytes"]
    assert weights == 256 * MiB
    awake = serving["process_bytes_by_id"]["0"]
    assert awake >= weights

    supervisor.send("big", {"cmd": "sleep"})
    _, sleeping = events.until("sleeping")
    residual = sleeping["residual_bytes_by_id"]["0"]
    # What is left is the CUDA context: the weights (and the allocator's cache) are gone. The
    # context itself grows meanwhile as the sleep's copies load kernels (H100, 2026-11-26: 774 MiB
    # awake with 256 MiB of weights, 588 MiB asleep), so half the weights is what must be seen gone.
    assert residual is not None and residual <= awake - weights // 2, (awake, residual)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("supervisor", ["fresh"], indirect=True)  # agents fork only on virtual GPUs by default
def test_wake_lands_on_the_new_gpu(supervisor):
    if _gpu_count() < 2:
        pytest.skip("needs two GPUs to wake a replica on another one")
    events = Events()
    _serve_big_on_gpu(supervisor, events, 0)
    supervisor.send("big", {"cmd": "sleep"})
    events.until("sleeping")

    fraction = GiB / _gpu_total(1)
    supervisor.send("big", {"cmd": "wake", "gpus": [1], "reserved_bytes_by_gpu": {"1": GiB}, "fraction": fraction})
    _, woken = events.until("woken", timeout=120)
    assert woken["param_devices"] == ["cuda:1"]
    assert woken["gpu_mem_bytes_by_id"] == {"1": GiB}
    assert woken["process_bytes_by_id"]["1"] >= woken["weights_bytes"]


def test_a_replica_that_cannot_allocate_the_arena_it_was_granted_says_so(monkeypatch):
    host, out = _host()
    host.load()
    arenas = ArenaEvents(host)

    def no_memory(model):
        raise MemoryError("cannot pin 4 GiB")

    monkeypatch.setattr(host.backend, "prepare_spare", no_memory)
    host.handle({"cmd": "arena", "keep": True})

    assert arenas.wait_for(1) == [0]
    (said,) = [e for e in _events(out) if e["event"] == "arena"]
    assert said["failed"] == "MemoryError: cannot pin 4 GiB"
    assert host.backend.spare is None and host.state == "serving", "it serves on; its next sleep allocates its own"
