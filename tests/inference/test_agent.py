"""Node agents: GPU discovery, registration, heartbeats, expiry, and a real agent process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from gpuportal.wire import node_lease, replies
from gpuportal.wire.memory import H100_DRIVER_RESERVE_BYTES, MiB
from inference.devices import discover, parse_size, parse_virtual_spec, virtual_gpus
from scheduling.models import GPU, Event, Node
from scheduling.services import nodes
from scheduling.tasks import expire_heartbeats
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import database_url_of_this_test, wait_until

GiB = 1024**3
RESERVE = H100_DRIVER_RESERVE_BYTES  # what a virtual GPU's NVML total holds beyond what CUDA can allocate
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("2x24GiB", [24 * GiB] * 2),
        ("1x80GiB,2x24GiB", [80 * GiB, 24 * GiB, 24 * GiB]),
        ("512MiB", [512 * 1024**2]),
        ("3 x 1.5GiB", [int(1.5 * GiB)] * 3),
        ("1x80GB", [80 * 1000**3]),
    ],
)
def test_it_parses_virtual_gpu_specs(spec, sizes):
    assert parse_virtual_spec(spec) == sizes


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("", "empty"),
        ("2x", "not a size"),
        ("2x24Gibberish", "not a size"),
        ("0x24GiB", "count must be between 1 and 64"),
        ("2x0GiB", "not a positive size"),
        ("2x24GiB,,", "is not COUNTxSIZE"),
    ],
)
def test_it_rejects_bad_virtual_gpu_specs_saying_why(spec, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse_virtual_spec(spec)


def test_sizes_use_binary_units_for_iec_names_and_decimal_for_si_names():
    assert parse_size("1KiB") == 1024 and parse_size("1KB") == 1000 and parse_size("2G") == 2 * GiB


def test_without_an_nvidia_gpu_auto_discovery_declares_virtual_gpus():
    devices = discover("n1", backend="auto", virtual_spec="2x4GiB")
    # The declared size is NVML's total; the books count what CUDA could allocate.
    assert [(d.index, d.virtual, d.total_bytes, d.nvml_total_bytes, d.uuid) for d in devices] == [
        (0, True, 4 * GiB - RESERVE, 4 * GiB, "virtual-n1-0"),
        (1, True, 4 * GiB - RESERVE, 4 * GiB, "virtual-n1-1"),
    ]
    with pytest.raises(ValueError, match="NVML finds no NVIDIA GPU"):
        discover("n1", backend="nvml")


@pytest.mark.django_db
def test_registration_creates_the_node_and_its_virtual_gpus_with_events():
    node = nodes.register_node("n1", virtual_gpus("n1", "2x24GiB"), hostname="host-a", virtual=True)

    assert (node.status, node.queue, node.virtual) == (Node.Status.ONLINE, "node.n1", True)
    gpus = list(GPU.objects.filter(node=node).order_by("index"))
    assert [(g.index, g.total_bytes, g.available_bytes, g.virtual, g.version) for g in gpus] == [
        (0, 24 * GiB - RESERVE, 24 * GiB - RESERVE, True, 0),
        (1, 24 * GiB - RESERVE, 24 * GiB - RESERVE, True, 0),
    ]
    kinds = list(Event.objects.order_by("id").values_list("kind", "subject"))
    assert kinds == [
        (Event.Kind.NODE_REGISTERED, "node n1"),
        (Event.Kind.GPU_REGISTERED, "gpu n1/0"),
        (Event.Kind.GPU_REGISTERED, "gpu n1/1"),
    ]


@pytest.mark.django_db
def test_re_registration_keeps_the_gpu_rows_and_notes_what_changed():
    nodes.register_node("n1", virtual_gpus("n1", "2x24GiB"), virtual=True)
    first_ids = list(GPU.objects.order_by("index").values_list("pk", flat=True))

    nodes.register_node("n1", virtual_gpus("n1", "1x16GiB"), virtual=True)

    gpu0, gpu1 = GPU.objects.order_by("index")
    assert [gpu0.pk, gpu1.pk] == first_ids
    assert (gpu0.total_bytes, gpu0.available_bytes, gpu0.version) == (16 * GiB - RESERVE, 16 * GiB - RESERVE, 1)
    assert (gpu1.health, gpu1.version) == (GPU.Health.LOST, 1)
    reasons = set(Event.objects.filter(kind=Event.Kind.GPU_CHANGED).values_list("subject", "reason"))
    assert reasons == {
        ("gpu n1/0", "resized: the node agent reports a different memory size"),
        ("gpu n1/1", "lost: no longer reported by the node agent"),
    }
    assert Event.objects.filter(kind=Event.Kind.NODE_ONLINE, subject="node n1").exists()


@pytest.mark.django_db
def test_a_node_silent_past_the_timeout_goes_offline_with_a_reason():
    now = timezone.now()
    nodes.register_node("quiet", virtual_gpus("quiet", "1x1GiB", NO_OVERHEAD), virtual=True)
    nodes.register_node("alive", virtual_gpus("alive", "1x1GiB", NO_OVERHEAD), virtual=True)
    Node.objects.filter(name="quiet").update(last_heartbeat=now - timedelta(seconds=45))
    Node.objects.filter(name="alive").update(last_heartbeat=now - timedelta(seconds=5))

    expired = nodes.expire_heartbeats(now=now, timeout_s=20)

    assert expired == ["quiet"]
    assert Node.objects.get(name="quiet").status == Node.Status.OFFLINE
    assert Node.objects.get(name="alive").status == Node.Status.ONLINE
    event = Event.objects.get(kind=Event.Kind.NODE_OFFLINE)
    assert event.node == "quiet" and event.reason == "no heartbeat for 45 s (timeout 20 s)"
    assert nodes.expire_heartbeats(now=now, timeout_s=20) == [], "an offline node is not expired twice"


@pytest.mark.django_db
def test_a_heartbeat_brings_an_offline_node_back():
    nodes.register_node("n1", virtual_gpus("n1", "1x1GiB", NO_OVERHEAD), virtual=True)
    Node.objects.filter(name="n1").update(status=Node.Status.OFFLINE)

    nodes.heartbeat("n1")

    assert Node.objects.get(name="n1").status == Node.Status.ONLINE
    assert Event.objects.filter(kind=Event.Kind.NODE_ONLINE, reason="heartbeat resumed").exists()


@pytest.mark.django_db
def test_the_beat_task_expires_heartbeats_and_is_scheduled(beat_schedules):
    from django.conf import settings

    nodes.register_node("n1", virtual_gpus("n1", "1x1GiB", NO_OVERHEAD), virtual=True)
    Node.objects.filter(name="n1").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    # Silent with no lease: an agent named n1 in an earlier test of this worker may have left
    # one in its Redis, which (rightly) keeps the node alive for its time to live.
    node_lease.release(replies.client(settings.REDIS_URL), "n1")

    assert expire_heartbeats.apply().get() == ["n1"]

    schedule = PeriodicTask.objects.get(task="scheduling.tasks.expire_heartbeats")
    assert schedule.enabled and schedule.interval.every == 5 and schedule.queue == "control"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_agent_registers_heartbeats_serves_its_queue_and_says_when_it_stops(
    tmp_path, agents_worker, tiny_model_dir
):
    from django.conf import settings

    from inference.inspection import read_model
    from inference.tasks import describe_node
    from scheduling.services import dispatch

    env = {
        **os.environ,
        "DATABASE_URL": database_url_of_this_test(),
        "REDIS_URL": settings.REDIS_URL,
        "GPUPORTAL_HEARTBEAT_S": "0.2",
        "GPUPORTAL_DATA_DIR": str(tmp_path),
    }
    log = open(tmp_path / "agent.log", "w+")  # noqa: SIM115 - read back in the failure message
    agent = subprocess.Popen(
        [sys.executable, "manage.py", "agent", "--node", "edge1", "--virtual-gpus", "2x2GiB"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        node = wait_until(lambda: Node.objects.filter(name="edge1").first(), 60, "the agent to register")
        assert node.virtual and node.queue == "node.edge1"
        assert GPU.objects.filter(node=node, virtual=True).count() == 2
        first_beat = node.last_heartbeat
        wait_until(
            lambda: Node.objects.get(name="edge1").last_heartbeat > first_beat, 30, "a heartbeat after registration"
        )
        # Its lease, renewed by the agent straight in Redis: the second evidence that it lives.
        redis_client = replies.client(settings.REDIS_URL)
        assert node_lease.held(redis_client, ["edge1", "nobody"]) == {"edge1"}

        reply = describe_node.apply_async(args=["edge1"], queue="node.edge1").get(timeout=60)
        assert reply["node"] == "edge1" and [g["index"] for g in reply["gpus"]] == [0, 1]
        # A deploy's question about a model's files: the agent reads them, not the asker.
        reading = dispatch.inspect(str(tiny_model_dir), "transformers", "float32")
        assert reading == read_model(str(tiny_model_dir), "transformers", "float32") and reading.weight_bytes > 0

        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log.seek(0)
        output = log.read()
    assert Node.objects.get(name="edge1").status == Node.Status.OFFLINE, output
    assert node_lease.held(redis_client, ["edge1"]) == set(), "a stopping agent gives its lease back"
    assert f"'read {tiny_model_dir}'" in output, "the agent's worker read the model (its task's result)"
    assert Event.objects.filter(kind=Event.Kind.NODE_STOPPED, node="edge1", reason="agent stopped").exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_agent_rejects_a_bad_node_name_in_one_line():
    result = subprocess.run(
        [sys.executable, "manage.py", "agent", "--node", "bad name!"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DATABASE_URL": database_url_of_this_test()},
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "CommandError: --node 'bad name!' is not a valid node name: use letters, digits, '.', '-' and '_', "
        "starting with a letter or digit, at most 100"
    )


# What `manage.py <command>` loaded once Django set up: the apps, and whether the control plane's
# models and admin were imported. --help runs the setup and stops before the command does anything.
_LOADED = """
import runpy, sys
sys.argv = ["manage.py", sys.argv[1], "--help"]
try:
    runpy.run_path("manage.py", run_name="__main__")
except SystemExit:
    pass
from django.apps import apps
names = sorted(c.name for c in apps.get_app_configs())
print(names, "scheduling.models" in sys.modules, "django.contrib.admin" in sys.modules)
"""


@pytest.mark.slow
def test_an_agents_process_loads_the_nodes_apps_and_not_the_control_planes_models_or_admin():
    def loaded(command: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", _LOADED, command], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return result.stdout.strip().splitlines()[-1]

    assert loaded("agent") == "['gpuportal', 'inference'] False False"
    assert loaded("migrate").endswith("True True"), "the control plane's commands load them all"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_agent_stopped_while_it_starts_still_exits_cleanly_and_says_so(tmp_path, agents_worker):
    from django.conf import settings

    agent = subprocess.Popen(
        [sys.executable, "manage.py", "agent", "--node", "brief", "--virtual-gpus", "1x2GiB"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url_of_this_test(), "REDIS_URL": settings.REDIS_URL},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Registration comes before the Celery worker installs its signal handlers: stop it right then.
        wait_until(lambda: Node.objects.filter(name="brief").exists(), 60, "the agent to register")
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert code == 0, agent.stderr.read()
    assert Node.objects.get(name="brief").status == Node.Status.OFFLINE
    assert Event.objects.filter(kind=Event.Kind.NODE_STOPPED, node="brief").exists()


@pytest.mark.gpu
def test_on_a_gpu_host_auto_discovery_reports_the_real_gpus_from_nvml():
    import torch

    devices = discover("gpuhost", backend="auto")

    assert devices and not any(d.virtual for d in devices)
    assert len(devices) == torch.cuda.device_count()
    for device in devices:
        _free, total = torch.cuda.mem_get_info(device.index)
        # CUDA's total less what an idle device shows used beyond the driver's reserve (3.2 MiB on
        # the H100 and H200 of 2026-11-26; none once a process holds a context there): never more.
        assert total - 16 * MiB <= device.total_bytes <= total
        assert device.uuid.startswith("GPU-")


class _Sleeper:
    """What wait_released reads of the supervisor: one victim that says it sleeps, keeping its
    context (500 MiB) on GPU 0."""

    def released(self, replica_ids: list[str], timeout: float) -> list[str]:
        return []

    def sleepers(self, replica_ids: list[str]) -> dict[str, tuple[int, dict[str, int]]]:
        return {"victim": (4242, {"0": 500 * MiB})}


@pytest.mark.parametrize("virtual", [False, True])
def test_on_a_real_gpu_the_waker_also_waits_for_nvml_to_show_the_victims_memory_freed(monkeypatch, virtual):
    from inference import agent, tasks

    monkeypatch.setattr(agent, "_current", SimpleNamespace(supervisor=_Sleeper()))
    # It said it sleeps, but the driver frees the weights a moment later.
    readings = iter([{"0": 30 * 1024 * MiB}, {"0": 30 * 1024 * MiB}, {"0": 510 * MiB, "1": 9 * 1024 * MiB}])
    asked: list[int] = []

    def nvml(pid: int) -> dict[str, int]:
        asked.append(pid)
        return next(readings)

    monkeypatch.setattr("inference.backends.nvml_process_bytes", nvml)

    assert tasks.wait_released(["victim"], [0], virtual=virtual, timeout=30) == []
    # Only what it holds on the waker's GPUs counts (GPU 1 is someone else's business).
    assert asked == ([] if virtual else [4242, 4242, 4242])


def test_a_victim_nvml_still_shows_holding_its_weights_is_reported_late(monkeypatch):
    from inference import agent, tasks

    monkeypatch.setattr(agent, "_current", SimpleNamespace(supervisor=_Sleeper()))
    monkeypatch.setattr("inference.backends.nvml_process_bytes", lambda pid: {"0": 30 * 1024 * MiB})

    assert tasks.wait_released(["victim"], [0], virtual=False, timeout=0.3) == ["victim"]


class _DeepSleeper(_Sleeper):
    """The victim that sleeps with its context on GPU 0, and exits once `gone` is set (its deep
    sleep's end)."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self.waited: list[list[str]] = []

    def exited(self, replica_ids: list[str], timeout: float) -> list[str]:
        self.waited.append(list(replica_ids))
        return [] if self.gone.wait(timeout) else list(replica_ids)


@pytest.mark.parametrize("whole", [True, False], ids=["whole GPU", "a fraction"])
def test_a_waker_taking_its_gpu_whole_waits_for_a_sleeping_victims_exit(monkeypatch, whole):
    from inference import agent, tasks

    supervisor = _DeepSleeper()
    monkeypatch.setattr(agent, "_current", SimpleNamespace(supervisor=supervisor))

    # Its context stays where the waker takes the GPU whole: its deep sleep must end first.
    assert tasks.wait_released(["victim"], [0], virtual=True, whole=whole, timeout=0.2) == (["victim"] if whole else [])
    assert supervisor.waited == ([["victim"]] if whole else [])
    supervisor.gone.set()
    assert tasks.wait_released(["victim"], [0], virtual=True, whole=whole, timeout=30) == []
    # A waker that takes another GPU whole does not wait for it.
    monkeypatch.setattr(agent, "_current", SimpleNamespace(supervisor=_DeepSleeper()))
    assert tasks.wait_released(["victim"], [1], virtual=True, whole=True, timeout=0.2) == []


# -- a command sent twice (scheduling.services.lost_commands) --------------------------------------


class _Processes:
    """What the node tasks and the heartbeat read of the supervisor: the processes it runs, the
    state each last said it is in and the host arenas they keep; the commands written to them are
    recorded."""

    def __init__(self, states: dict[str, str], arenas: dict[str, int] | None = None) -> None:
        self._states = states
        self._arenas = arenas or {}
        self.sent: list[tuple[str, dict]] = []
        self.stopped: list[str] = []
        # Host copies of deep sleepers (inference.host_copy) it was told to delete.
        self.forgotten: list[str] = []

    def running(self) -> list[str]:
        return sorted(self._states)

    def states(self) -> dict[str, str]:
        return dict(self._states)

    def arenas(self) -> dict[str, int]:
        return dict(self._arenas)

    def host_bytes(self) -> dict[str, int]:
        return {rid: 300 * MiB for rid in self._states}

    def usage(self) -> dict:
        return {rid: (4242, {"0": MiB}, state) for rid, state in self._states.items()}

    def ping_all(self) -> None:
        pass

    def spare_slots(self) -> dict[str, int]:
        return {}  # no warm spares (tests/inference/test_warm_spares.py has them)

    def spare_pids(self) -> set[int]:
        return set()

    def backend_of(self, replica_id: str) -> str | None:
        return "virtual" if replica_id in self._states else None

    def released(self, replica_ids: list[str], timeout: float) -> list[str]:
        return []

    def send(self, replica_id: str, command: dict) -> None:
        if replica_id not in self._states:
            raise KeyError(replica_id)
        self.sent.append((replica_id, command))

    def stop(self, replica_id: str, timeout: float = 10.0, drain_timeout_s: float | None = None) -> int:
        self.stopped.append(replica_id)
        return 0

    def host_copy_path(self, replica_id: str) -> Path:
        return Path("/dev/shm/copies") / f"{replica_id}.pt"

    def forget_host_copy(self, replica_id: str) -> bool:
        self.forgotten.append(replica_id)
        return True

    def deep_sleepers(self) -> dict[str, dict]:
        return {"d1": {"replica_id": "d1", "pid": 0, "state": "deep_sleeping", "last": "deep_sleeping"}}


def _agent_with(monkeypatch, processes: _Processes, books_state: str | None) -> list[tuple[str, dict]]:
    """The node tasks' agent, its books holding each replica in `books_state`; returns what it relays."""
    from inference import agent

    relayed: list[tuple[str, dict]] = []
    control = SimpleNamespace(replica_state=lambda replica_id: books_state)
    current = SimpleNamespace(
        supervisor=processes, name="n1", control=control, relay=lambda rid, event: relayed.append((rid, event))
    )
    monkeypatch.setattr(agent, "_current", current)
    return relayed


def test_a_wake_sent_twice_is_carried_out_only_while_the_books_wait_for_it(monkeypatch):
    from gpuportal.wire.commands import WakeReplica, encode
    from inference import tasks

    wake = encode(WakeReplica("r1", gpus=(0,), reserved_bytes_by_gpu={"0": 64 * MiB}, fraction=0.1))
    processes = _Processes({"r1": "serving"})

    relayed = _agent_with(monkeypatch, processes, "serving")  # the first copy woke it
    assert tasks.replica_from_cache(wake) == "skipped: replica is serving"
    assert processes.sent == [] and relayed == []

    _agent_with(monkeypatch, processes, "waking")  # its woken report lost: the process says it again
    assert tasks.replica_from_cache(wake) == "sent"
    assert [command["cmd"] for _, command in processes.sent] == ["wake"]


def test_a_sleep_sent_twice_is_carried_out_only_while_the_books_wait_for_it(monkeypatch):
    from gpuportal.wire.commands import SleepReplica, encode
    from inference import tasks

    sleep = encode(SleepReplica("r1", drain_timeout_s=5.0))
    processes = _Processes({})  # parked since: its process stopped

    for moved_on in ("sleeping", "parked", None):
        relayed = _agent_with(monkeypatch, processes, moved_on)
        assert tasks.replica_to_cache(sleep) == f"skipped: replica is {moved_on or 'gone'}"
        assert relayed == [], "no crash reported for a process the books no longer count on"

    # Still draining with no process: that one did die unnoticed, and the agent says so.
    relayed = _agent_with(monkeypatch, processes, "draining")
    assert tasks.replica_to_cache(sleep) == "no process"
    assert [(rid, event["event"]) for rid, event in relayed] == [("r1", "failed")]


def test_a_stop_of_a_replica_the_agent_no_longer_runs_is_answered_stopped_again(monkeypatch):
    from gpuportal.wire.commands import StopReplica, encode
    from inference import tasks

    processes = _Processes({})
    relayed = _agent_with(monkeypatch, processes, "stopped")

    assert tasks.stop_replica(encode(StopReplica("r1", drain_timeout_s=5.0))) == "not running here"
    assert relayed == [("r1", {"event": "stopped"})] and processes.stopped == []
    assert processes.forgotten == ["r1"], "a deep sleeper has no process: its host copy is what goes"


def test_a_deepen_is_forwarded_with_the_path_of_the_nodes_host_copy_and_a_gone_sleeper_is_no_crash(monkeypatch):
    from gpuportal.wire.commands import DeepenReplica, encode
    from inference import tasks

    processes = _Processes({"r1": "sleeping"})
    relayed = _agent_with(monkeypatch, processes, "sleeping")

    assert tasks.replica_deepen(encode(DeepenReplica("r1"))) == "sent"
    assert processes.sent == [("r1", {"cmd": "deepen", "path": "/dev/shm/copies/r1.pt"})]
    assert relayed == []
    # Sent again after its process wrote the copy and exited: the books already say so, or soon will.
    processes._states.clear()
    assert tasks.replica_deepen(encode(DeepenReplica("r1"))) == "no process"
    assert relayed == [], "a deep sleeper's process is meant to be gone"


def test_an_arena_command_is_forwarded_to_the_replica_process(monkeypatch):
    from gpuportal.wire.commands import KeepArena, encode
    from inference import tasks

    processes = _Processes({"r1": "serving"})
    relayed = _agent_with(monkeypatch, processes, "serving")

    assert tasks.replica_arena(encode(KeepArena("r1", keep=True))) == "sent"
    assert tasks.replica_arena(encode(KeepArena("r1", keep=False))) == "sent"
    assert processes.sent == [("r1", {"cmd": "arena", "keep": True}), ("r1", {"cmd": "arena", "keep": False})]
    assert relayed == []


def test_an_arena_command_for_a_replica_whose_process_is_gone_reports_no_failure(monkeypatch):
    from gpuportal.wire.commands import KeepArena, encode
    from inference import tasks

    processes = _Processes({})  # stopped, or died: whatever waits on it says so, not this command
    relayed = _agent_with(monkeypatch, processes, "serving")

    assert tasks.replica_arena(encode(KeepArena("r1", keep=True))) == "no process"
    assert relayed == [] and processes.sent == []


def test_each_beat_tells_the_state_each_replica_process_last_said_it_is_in(monkeypatch):
    from inference.agent import NodeAgent

    beats: list[dict] = []

    class Control:
        def heartbeat(self, node: str, **kwargs) -> list[str]:
            beats.append({"node": node, **kwargs})
            return []

    agent = NodeAgent("n1", control=Control(), backend="virtual", cpu_cache_bytes=0)
    agent.supervisor = _Processes({"r1": "sleeping", "r2": "serving", "r3": ""}, {"r2": MiB})  # type: ignore[assignment]

    assert agent.beat_once() == []
    (beat,) = beats
    assert beat["running"] == ["r1", "r2", "r3"]
    assert beat["processes"] == {"r1": "sleeping", "r2": "serving", "r3": ""}
    assert beat["arenas"] == {"r2": MiB}, "the host arenas they keep (a lost grant or drop shows there)"
    assert beat["host_bytes"] == {"r1": 300 * MiB, "r2": 300 * MiB, "r3": 300 * MiB}, "their host RAM"
    assert beat["host_copies"] == ["d1"], "the deep sleepers' copies it holds (which the answer may name to delete)"
    assert beat["books"].states == {"r1": "sleeping", "r2": "serving", "r3": ""}


def test_a_registration_the_control_plane_cannot_answer_yet_is_tried_again_and_a_refusal_is_not(tmp_path, settings):
    from gpuportal.wire.control import ControlError, Refused
    from inference.agent import NodeAgent

    settings.GPUPORTAL_DATA_DIR = str(tmp_path)
    tries: list[str] = []

    class Control:
        def __init__(self, failures: list[Exception]):
            self.failures = failures

        def register_node(self, node: str, devices, **details) -> int:
            tries.append(node)
            if self.failures:
                raise self.failures.pop(0)
            return 3

    agent = NodeAgent("n1", control=Control([ControlError("the database system is starting up")]), backend="virtual")
    agent.register()
    assert tries == ["n1", "n1"] and agent.epoch == 3, "registered on the second try, under its epoch"

    refused = NodeAgent("n2", control=Control([Refused("node credential refused: revoked")]), backend="virtual")
    with pytest.raises(Refused):
        refused.register()
    assert tries.count("n2") == 1, "a refusal is not tried again"


class _Survivors(_Processes):
    """A supervisor that has just found the replicas the node's previous agent left, each serving
    under the node epoch its hello names."""

    def __init__(self, epochs: dict[str, int | None]) -> None:
        super().__init__({rid: "serving" for rid in epochs})
        self.epochs = epochs

    def adopt_survivors(self, on_event) -> dict[str, dict]:
        hellos = {rid: {"replica_id": rid, "pid": 4242, "state": "serving", "last": "serving"} for rid in self.epochs}
        for rid, epoch in self.epochs.items():
            if epoch is not None:
                hellos[rid]["node_epoch"] = epoch
        return hellos

    def deep_sleepers(self) -> dict[str, dict]:
        return {}

    def resume(self) -> None:
        pass


class _SlowToRegister:
    """A control plane that answers a registration only when the test lets it (its worker busy,
    PostgreSQL starting up): `asked` is set once the agent waits on it."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.asked, self.answer = threading.Event(), threading.Event()

    def register_node(self, node: str, devices, **details) -> int:
        self.asked.set()
        assert self.answer.wait(30), "the test never let the registration through"
        return self.epoch

    def heartbeat(self, node: str, **kwargs) -> list[str]:
        return []


def _registering(name: str, adopted: dict[str, int | None], epoch: int) -> tuple[_SlowToRegister, threading.Thread]:
    """An agent of node `name`, started again, that adopted `adopted` ({replica: its node epoch})
    and now waits for its registration's answer, on a thread of its own."""
    from inference.agent import NodeAgent

    control = _SlowToRegister(epoch)
    agent = NodeAgent(name, control=control, backend="virtual", cpu_cache_bytes=0, heartbeat_s=0.05)
    agent.supervisor = _Survivors(adopted)  # type: ignore[assignment]
    thread = threading.Thread(target=agent.register, daemon=True)
    thread.start()
    assert control.asked.wait(30), "the agent never asked to register"
    return control, thread


@pytest.mark.parametrize(
    ("adopted", "kept"),
    [
        pytest.param("current", True, id="under-the-node's-epoch"),
        pytest.param("before", False, id="under-an-epoch-written-off"),
        pytest.param(None, False, id="nothing-adopted"),
    ],
)
@pytest.mark.django_db
def test_a_restarted_agent_keeps_its_node_alive_while_it_registers_only_for_replicas_of_the_nodes_epoch(
    settings, tmp_path, adopted, kept
):
    # The previous agent's lease has lapsed and its last beat is past the timeout: the new agent
    # adopted its replicas near the end of their window, and the control plane is slow to answer.
    settings.GPUPORTAL_DATA_DIR = str(tmp_path)
    name = f"restarted-{uuid.uuid4().hex[:8]}"
    client = replies.client(settings.REDIS_URL)
    nodes.register_node(name, virtual_gpus(name, "1x1GiB", NO_OVERHEAD), virtual=True)
    epoch = node_lease.write_off(client, name)  # the node wrote off once before: epoch 1
    Node.objects.filter(name=name).update(last_heartbeat=timezone.now() - timedelta(seconds=45))
    epochs = {"current": {"r1": epoch}, "before": {"r1": epoch - 1}, None: {}}[adopted]

    control, thread = _registering(name, epochs, epoch)
    try:
        written_off = nodes.expire_heartbeats(timeout_s=20)
    finally:
        control.answer.set()
        thread.join(30)
        node_lease.release(client, name)

    assert (written_off == []) is kept
    assert Node.objects.get(name=name).status == (Node.Status.ONLINE if kept else Node.Status.OFFLINE)
    assert node_lease.current_epoch(client, name) == (epoch if kept else epoch + 1)
