"""Other tenants count: memory on a GPU held by processes that are not the portal's replicas
(`foreign_bytes`) is out of placement's reach, shows in the API, CLI, dashboard and metrics, and
growing into reserved memory is an Event and an over-commit. On virtual GPUs an agent declares
it (`--virtual-foreign`); on a real one it is read from NVML (the `gpu` test at the end)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from gpuportal.cli import render
from gpuportal.wire.node_reports import Books
from inference.agent import NodeAgent
from inference.devices import foreign_use, parse_virtual_foreign, virtual_gpus
from scheduling import ledger
from scheduling.core import books as tolerance
from scheduling.core.state import Plan, Release, Reservation
from scheduling.models import GPU, Event, Occupant, Replica
from scheduling.services import nodes, scaling
from scheduling.services.errors import CannotPlace
from tests.support import factories
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
GiB = 1024**3


@pytest.fixture
def gpu(db) -> GPU:
    """One node, n1, with one virtual GPU of 8 GiB that CUDA can allocate whole."""
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB", NO_OVERHEAD), virtual=True)
    return GPU.objects.get()


def beat(foreign: int, usage: dict | None = None) -> None:
    nodes.heartbeat("n1", books=Books(usage=usage or {}, foreign_by_index={"0": foreign}))


def foreign_events() -> list[Event]:
    return list(Event.objects.filter(kind=Event.Kind.GPU_FOREIGN).order_by("pk"))


def test_other_tenants_lower_available_bytes_by_what_they_hold_and_give_it_back_when_they_go(gpu):
    beat(3 * GiB)
    gpu.refresh_from_db()
    assert gpu.foreign_bytes == 3 * GiB
    assert gpu.available_bytes == 5 * GiB
    assert gpu.overcommit_bytes == 0
    [event] = foreign_events()
    assert event.gpu == "n1/0"
    assert "processes that are not the portal's replicas hold 3072 MiB on n1/0 (was 0 B)" in event.reason
    assert event.after["available_bytes"] == 5 * GiB
    # The virtual GPU's free memory counts them too.
    assert gpu.nvml_free_bytes == 5 * GiB

    beat(0)
    gpu.refresh_from_db()
    assert (gpu.foreign_bytes, gpu.available_bytes) == (0, 8 * GiB)
    assert len(foreign_events()) == 2


def test_a_gpu_with_other_tenants_refuses_a_replica_that_would_have_fit_without_them(gpu, dispatched):
    factories.deployment("llm", memory_override_bytes=6 * GiB)
    beat(3 * GiB)

    with pytest.raises(CannotPlace, match=r"needs 6.0 GiB, more than the node's 1 GPU\(s\) hold \(5.0 GiB\)"):
        scaling.scale("llm", 1)

    assert not Occupant.objects.exists(), "nothing may be placed into other tenants' memory"
    gpu.refresh_from_db()
    assert gpu.available_bytes == 5 * GiB

    # Once they are gone, the same replica fits.
    beat(0)
    factories.deployment("again", memory_override_bytes=6 * GiB)
    scaling.scale("again", 1)
    assert Occupant.objects.get().reserved_bytes == 6 * GiB


def test_a_whole_gpu_is_what_other_tenants_leave_of_it(gpu, dispatched):
    beat(1 * GiB)
    factories.deployment("big", memory_override_bytes=7 * GiB)
    scaling.scale("big", 1)
    occupant = Occupant.objects.get()
    assert occupant.reserved_bytes == 7 * GiB
    gpu.refresh_from_db()
    assert gpu.available_bytes == 0
    # The fraction handed to the allocator is of the whole GPU, other tenants' share included.
    assert occupant.replica.gpu_memory_fraction == pytest.approx(7 / 8)


def test_other_tenants_growing_into_reserved_memory_is_an_event_and_an_over_commit(gpu):
    replica = factories.replica(
        factories.deployment("llm"), gpu.node, state=Replica.State.SERVING, gpu_mem_bytes_by_id={"0": 6 * GiB}
    )
    factories.occupy(replica, gpu, 6 * GiB)
    usage = {replica.id: {"0": 6 * GiB}}
    beat(1 * GiB, usage)
    gpu.refresh_from_db()
    assert (gpu.available_bytes, gpu.overcommit_bytes) == (1 * GiB, 0)

    beat(3 * GiB, usage)
    gpu.refresh_from_db()
    assert gpu.available_bytes == 0
    assert gpu.overcommit_bytes == 1 * GiB
    event = foreign_events()[-1]
    assert "1024 MiB of it is memory reserved for the portal's replicas" in event.reason
    assert event.after["intrusion_bytes"] == 1 * GiB
    metrics = APIClient().get("/metrics").content.decode()
    assert 'gpuportal_gpu_overcommit_bytes{gpu="0",node="n1"} 1.073741824e+09' in metrics
    assert 'gpuportal_gpu_foreign_bytes{gpu="0",node="n1"} 3.221225472e+09' in metrics
    # The invariant the database holds: available within the total, never below 0.
    assert 0 <= gpu.available_bytes <= gpu.total_bytes

    beat(0, usage)
    gpu.refresh_from_db()
    assert (gpu.available_bytes, gpu.overcommit_bytes) == (2 * GiB, 0)


def test_where_other_tenants_reach_into_reserved_memory_a_release_commits_and_a_reservation_is_refused(gpu):
    first = factories.replica(factories.deployment("a"), gpu.node)
    second = factories.replica(factories.deployment("b"), gpu.node)
    factories.occupy(first, gpu, 4 * GiB)
    factories.occupy(second, gpu, 3 * GiB)
    ledger.record_foreign(gpu.pk, 2 * GiB)  # 1 GiB into what the two reserve

    snap = ledger.read([gpu.pk])
    assert snap.gpus[gpu.pk].total_bytes == 6 * GiB and snap.gpus[gpu.pk].foreign_bytes == 2 * GiB
    with pytest.raises(ledger.OverCommit) as refused:
        ledger.commit(Plan.against(snap, "grow", reservations=[Reservation(gpu.pk, first.id, 4 * GiB + MiB)]))
    assert refused.value.total == 6 * GiB
    # Letting go is never refused, even while the GPU is still over what other tenants leave.
    ledger.commit(Plan.against(snap, "shrink", reservations=[Reservation(gpu.pk, first.id, 3 * GiB + 512 * MiB)]))
    gpu.refresh_from_db()
    assert gpu.available_bytes == 0
    ledger.commit(Plan.against(ledger.read([gpu.pk]), "stop", releases=[Release(gpu.pk, second.id)]))
    gpu.refresh_from_db()
    assert gpu.available_bytes == 8 * GiB - 2 * GiB - (3 * GiB + 512 * MiB)


def test_a_change_of_other_tenants_use_within_the_tolerance_records_nothing(gpu):
    beat(1 * GiB)
    version = GPU.objects.get().version
    beat(1 * GiB + 10 * MiB)  # within 16 MiB: no Event, no new version for placements to conflict on
    gpu.refresh_from_db()
    assert (gpu.foreign_bytes, gpu.version, len(foreign_events())) == (1 * GiB, version, 1)
    beat(1 * GiB + 40 * MiB)
    gpu.refresh_from_db()
    assert gpu.foreign_bytes == 1 * GiB + 40 * MiB and len(foreign_events()) == 2
    # An agent that cannot tell (no NVML figure for one of its replicas) changes nothing.
    nodes.heartbeat("n1", books=Books(foreign_by_index=None))
    nodes.heartbeat("n1", books=Books(foreign_by_index={}))
    gpu.refresh_from_db()
    assert gpu.foreign_bytes == 1 * GiB + 40 * MiB


@given(recorded=st.integers(0, 200 * GiB), seen=st.integers(0, 200 * GiB))
def test_the_books_record_a_change_of_other_tenants_use_only_past_the_tolerance(recorded, seen):
    wanted = tolerance.foreign_to_record(recorded, seen, 16 * MiB)
    if wanted is None:
        assert seen != 0 or recorded == 0
        assert abs(seen - recorded) <= max(16 * MiB, max(seen, recorded) // 100)
    else:
        assert wanted == seen != recorded


def test_the_api_cli_and_dashboard_show_other_tenants_use(gpu, staff, admin_client):
    beat(3 * GiB)
    data = staff.get("/api/gpus/").json()
    row = data[0] if isinstance(data, list) else data["results"][0]
    assert row["foreign_bytes"] == 3 * GiB and row["available_bytes"] == 5 * GiB
    assert row["reserved_bytes"] == 0
    shown = render.gpu_block(row, width=8).plain
    assert "other tenants 3.0 GiB" in shown
    assert "░░░░░▓▓▓" in shown, "other tenants' memory at the end of the bar"
    page = admin_client.get(reverse("admin:scheduling_dashboard")).content.decode()
    assert "gp-seg-foreign" in page and "held by other tenants" in page


# -- the node agent ---------------------------------------------------------------------------


def test_a_virtual_agent_reports_what_its_operator_declared():
    assert parse_virtual_foreign("0:1GiB, 1:512MiB") == {0: GiB, 1: 512 * MiB}
    assert parse_virtual_foreign("") == {}
    for bad, says in [
        ("1GiB", "is not INDEX:SIZE"),
        ("0:lots", "is not a size"),
        ("0:1GiB,0:2GiB", "GPU 0 is named twice"),
        ("2:1GiB", "there is no virtual GPU 2"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_virtual_foreign(bad, gpu_count=2)
    agent = NodeAgent("n1", control=SimpleNamespace(), backend="virtual", virtual_foreign={1: GiB})
    agent.devices = virtual_gpus("n1", "2x8GiB")
    agent.virtual = True
    assert agent.foreign(set(), None, None) == {"0": 0, "1": GiB}


def test_the_agents_virtual_foreign_option_is_checked_before_anything_starts():
    with pytest.raises(CommandError, match=r"--virtual-foreign 3:1GiB: .*there is no virtual GPU 3"):
        call_command("agent", "--node", "n4", "--virtual-gpus", "2x8GiB", "--virtual-foreign", "3:1GiB")
    with pytest.raises(CommandError, match=r"other tenants cannot hold .* of virtual GPU 0"):
        call_command("agent", "--node", "n4", "--virtual-gpus", "1x8GiB", "--virtual-foreign", "0:9GiB")


def test_on_nvml_other_tenants_are_what_is_used_beyond_the_replicas_and_the_drivers_reserve():
    agent = NodeAgent("n1", control=SimpleNamespace(), backend="nvml", virtual_foreign={})
    agent.devices = [SimpleNamespace(index=0, total_bytes=80 * GiB), SimpleNamespace(index=1, total_bytes=80 * GiB)]
    # GPU 0: a replica of ours holds 10 GiB, 30 GiB are free: 40 GiB are someone else's.
    by_pid = {101: {"0": 10 * GiB}}
    free = {"0": 30 * GiB, "1": 80 * GiB}
    assert agent.foreign({101}, by_pid, free) == {"0": 40 * GiB, "1": 0}
    # A replica process NVML does not list: its memory would pass for another tenant's.
    assert agent.foreign({101, 102}, by_pid, free) is None
    assert agent.foreign({101}, None, None) is None
    assert foreign_use(10, 12, 0) == 0  # read a moment apart: never negative


# -- on a real GPU --------------------------------------------------------------------------------

# What NVML's used memory may hold beyond its processes' figures (allocations of the driver's own
# that no process is charged with), and what moves between two reads a moment apart.
NVML_SLACK = 256 * 1024**2


def non_replica_bytes(index: int, replicas: set[int]) -> int:
    """NVML's bytes of every process on GPU `index` that is not one of `replicas`."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return sum(
            int(p.usedGpuMemory or 0)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid not in replicas
        )
    finally:
        pynvml.nvmlShutdown()


FOREIGN_PROCESS = textwrap.dedent(
    """
    import sys, time, torch
    held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
    print("holding", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
@pytest.mark.gpu
def test_on_a_real_gpu_a_foreign_cuda_process_beside_a_replica_is_counted_and_the_replica_is_not(tmp_path):
    """A CUDA process that is not a replica holds 2 GiB beside a replica the node's agent runs:
    the agent's books say other tenants hold what NVML lists for every process that is not a
    replica (that one, its context, and whatever else holds a context there, this test's own
    process when an earlier test made one in it), and nothing of the replica. On an H200 on
    2026-11-28 the other tenants came to 3.26 GiB with the 2 GiB tensor: two contexts beside it."""
    from inference.backends import nvml_memory
    from inference.devices import nvidia_gpus
    from inference.management.commands.make_tiny_model import write_tiny_model
    from inference.supervisor import ReplicaSpec, Supervisor
    from tests.support.replicas import Events

    devices = nvidia_gpus()
    if not devices:
        pytest.skip("no NVIDIA GPU")
    model = write_tiny_model(tmp_path / "m", size_mb=2, seed=7).path
    held = 2 * GiB
    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN_PROCESS, str(held)], stdout=subprocess.PIPE, text=True)
    supervisor = Supervisor(tmp_path / "logs")
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == "holding"
        events = Events()
        supervisor.start(
            ReplicaSpec(
                replica_id="beside",
                source=str(model),
                loader="transformers",
                dtype="float32",
                gpus=(0,),
                reserved_bytes_by_gpu={"0": 2 * GiB},
                fraction=0.1,
                backend="cuda",
                kv_max_tokens=512,
            ),
            events,
        )
        events.until("serving", timeout=180)
        agent = NodeAgent("real", control=SimpleNamespace(), backend="nvml", virtual_foreign={})
        agent.devices = devices
        pids = {pid for pid, _, _ in supervisor.usage().values() if pid is not None}
        seen = nvml_memory(pids)
        assert seen is not None
        by_pid, free = seen
        if not by_pid:
            pytest.skip("NVML does not list the replica's process (a container without the host PID namespace)")
        found = agent.foreign(pids, by_pid, free)
        others = non_replica_bytes(0, pids)
        assert found is not None
        # Every byte NVML gives to a process that is not ours (the driver's own share of a
        # context aside, which no process is given), and nothing of the replica's.
        assert held <= others and abs(found["0"] - others) <= NVML_SLACK, (found, others, by_pid)
    finally:
        supervisor.stop_all(timeout=10)
        foreign.kill()
        foreign.wait()
