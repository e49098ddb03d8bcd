"""Real-GPU accounting: one formula for the need and the pool, replicas that cannot
serve take nothing, GPU totals CUDA can allocate, books checked against NVML every heartbeat, and
a virtual GPU that accounts like the H100 of ../shared/gpu-2026-11-24 so this suite catches what
broke there."""

from __future__ import annotations

import io
import json
import threading
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connections
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from gpuportal.wire import memory
from gpuportal.wire.memory import (
    H100_CONTEXT_BYTES,
    H100_DRIVER_RESERVE_BYTES,
    H100_KERNEL_GROWTH_BYTES,
    H100_STANDBY_CONTEXT_BYTES,
    MiB,
)
from gpuportal.wire.node_reports import Books, DeviceInfo
from inference.backends import Placement, ReplicaFailure, VirtualBackend
from inference.devices import VirtualProfile, allocatable_bytes, virtual_gpus
from inference.event_stream import EventWriter
from inference.host import ReplicaHost
from inference.loaders import weight_allocation_bytes
from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling import ledger
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, FailoverLease, Occupant, Replica
from scheduling.services import nodes, replica_reports, reports
from scheduling.services import replicas as replica_services
from scheduling.services.deployments import inspect_model
from scheduling.services.placing import need_bytes
from tests.support import factories
from tests.support.processes import wait_until

GiB = 1024**3
MAX_TOKENS = 512


@given(
    weights=st.integers(0, 2**38),
    tokens=st.integers(0, 200_000),
    context=st.integers(0, 2 * GiB),
    standby=st.integers(0, GiB),
    overhead=st.integers(0, GiB),
    device_total=st.integers(GiB, 200 * GiB),
)
def test_the_pool_is_what_the_reservation_leaves_after_every_other_part_and_the_cap_covers_the_allocator_only(
    weights, tokens, context, standby, overhead, device_total
):
    shape = memory.ModelShape(
        weight_bytes=weights, num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, hidden_size=4096
    )
    parts = {"cuda_context_bytes": context, "standby_context_bytes": standby, "overhead_bytes": overhead}
    need = memory.estimate(shape, max_tokens=tokens, **parts)
    assert memory.kv_pool_blocks(shape, cap_bytes=need.total_bytes, max_tokens=tokens, **parts) == need.kv_blocks
    # One byte less and the pool is a block short: nothing beside it is counted twice or forgotten.
    if need.kv_blocks:
        short = memory.kv_pool_blocks(shape, cap_bytes=need.total_bytes - 1, max_tokens=tokens, **parts)
        assert short == need.kv_blocks - 1
    cap = memory.allocator_cap_bytes(
        need.total_bytes, context_bytes=context, standby_context_bytes=standby, overhead_bytes=overhead
    )
    assert cap == need.weights_bytes + need.kv_bytes + need.activation_bytes
    fraction = memory.allocator_fraction(cap, device_total)
    assert 0 < fraction <= 1 and (fraction == 1 or abs(fraction * device_total - cap) < 1)


def host(
    model_dir,
    reserved: int,
    *,
    gpu: int = 0,
    context: int = H100_CONTEXT_BYTES,
    standby_context: int = 0,
    max_tokens: int = MAX_TOKENS,
    over: dict[str, int] | None = None,
) -> tuple[ReplicaHost, io.StringIO]:
    """A replica host in this process on a virtual GPU with the H100's accounting; the spec's
    contexts are what the scheduler counted (tasks.spec_for). `over`: several GPUs instead, their
    reservations by GPU id (whole GPUs, as placement gives them: no fraction)."""
    out = io.StringIO()
    return (
        ReplicaHost(
            replica_id="r1",
            source=str(model_dir),
            loader="transformers",
            dtype="float32",
            placement=(
                Placement.parse(sorted(map(int, over)), over, None)
                if over
                else Placement.parse([gpu], {str(gpu): reserved}, 0.5)
            ),
            backend=VirtualBackend(VirtualProfile()),
            events=EventWriter(out),
            kv_max_tokens=max_tokens,
            context_bytes=context,
            standby_context_bytes=standby_context,
        ),
        out,
    )


def last(out: io.StringIO, kind: str) -> dict:
    return [e for e in map(json.loads, out.getvalue().splitlines()) if e["event"] == kind][-1]


def serves_max_tokens(replica: ReplicaHost) -> bool:
    assert replica.paged is not None
    return replica.paged.pool.capacity_tokens >= MAX_TOKENS


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    """A tiny Llama with a tokenizer, so that its replicas page their KV cache."""
    return write_tiny_model(tmp_path_factory.mktemp("llm") / "m", size_mb=2, seed=7).path


@pytest.fixture
def llm(db, llm_dir):
    """A deployment of the tiny Llama with max_tokens 512 on a node of one 8 GiB H100-like GPU."""
    nodes.register_node("n1", virtual_gpus("n1", "2x8GiB"), virtual=True)
    facts = inspect_model(str(llm_dir), "transformers", "float32", MAX_TOKENS)
    return factories.deployment(
        "llm",
        model_source=str(llm_dir),
        max_tokens=MAX_TOKENS,
        weight_bytes=facts.weight_bytes,
        memory_estimate_bytes=facts.estimate_bytes,
    )


def test_the_reservation_and_the_pool_agree_for_a_first_load_a_scale_out_a_wake_a_promotion_and_a_pair(llm, llm_dir):
    tiny_model_dir = llm_dir
    # First load: the scheduler reserves the estimate and a context.
    first_need = need_bytes(llm, ledger.snapshot())
    assert first_need.source == "estimate"
    assert first_need.bytes == llm.observed.memory_estimate_bytes + H100_CONTEXT_BYTES
    first, out = host(tiny_model_dir, first_need.bytes)
    first.load()
    serving = last(out, "serving")
    assert serves_max_tokens(first)
    assert serving["process_bytes"] <= first_need.bytes
    # What it reports is the measured need: the same parts, measured, in the same formula.
    assert serving["need_bytes"] == serving["footprint"]["total_bytes"] == first_need.bytes
    measured = replica_reports._measured_bytes(llm, serving)
    assert measured == serving["need_bytes"]
    DeploymentObserved.objects.filter(pk=llm.pk).update(memory_measured_bytes=measured)
    llm.refresh_from_db()

    # A scale-out is reserved the measured need, and its pool holds max_tokens.
    need = need_bytes(llm, ledger.snapshot())
    assert need.source == "measured" and need.bytes == measured
    added, out = host(tiny_model_dir, need.bytes)
    added.load()
    assert serves_max_tokens(added) and last(out, "serving")["process_bytes"] <= need.bytes
    blocks = added.paged.pool.blocks_total

    # Serving loaded kernels: the context a sleep leaves is larger than the one the need counted
    # (the H100 of 2026-11-26 woke into a 0-block pool on exactly this).
    added.sleep(0)
    grown = H100_CONTEXT_BYTES + H100_KERNEL_GROWTH_BYTES
    assert last(out, "sleeping")["residual_bytes_by_id"] == {"0": grown}
    # The sleep's report raises the GPUs' figure; the wake's need counts the growth.
    GPU.objects.update(context_bytes=grown)
    DeploymentObserved.objects.filter(pk=llm.pk).update(memory_measured_context_bytes=serving["context_bytes"])
    llm.refresh_from_db()
    wake_need = need_bytes(llm, ledger.snapshot())
    assert wake_need.bytes == measured + H100_KERNEL_GROWTH_BYTES

    # A wake on the same GPU, and a promotion from the cache onto another, size the same pool.
    added.wake([0], {"0": wake_need.bytes}, 0.5)
    assert added.paged.pool.blocks_total == blocks and last(out, "woken")["process_bytes"] <= wake_need.bytes
    added.sleep(0)
    added.wake([1], {"1": wake_need.bytes}, 0.5)
    assert added.paged.pool.blocks_total == blocks
    assert last(out, "woken")["process_bytes_by_id"] == {"1": last(out, "woken")["process_bytes"]}

    # A failover pair is reserved the standby's context too, and the active member leaves it out
    # of its pool: the same blocks as a single replica, not the standby's share on top.
    Deployment.objects.filter(pk=llm.pk).update(failover_standby=True)
    llm.refresh_from_db()
    pair_need = need_bytes(llm, ledger.snapshot())
    assert pair_need.bytes == wake_need.bytes + H100_STANDBY_CONTEXT_BYTES
    # Its spec carries the GPUs' figure, grown (scheduling.services.replica_specs).
    active, out = host(tiny_model_dir, pair_need.bytes, context=grown, standby_context=H100_STANDBY_CONTEXT_BYTES)
    active.load()
    assert active.paged.pool.blocks_total == blocks
    assert last(out, "serving")["process_bytes"] + H100_STANDBY_CONTEXT_BYTES <= pair_need.bytes


def test_a_replica_reserved_what_nvml_showed_at_load_fails_naming_bytes_and_never_takes_a_request(llm, llm_dir):
    """The chain that left every woken or added replica of an LLM with 0 blocks on the H100: the
    control plane recorded NVML's figure at load (no activations yet) as the need, and the next
    replica, reserved that, sized its pool below zero and then took requests it could not serve."""
    first, out = host(llm_dir, need_bytes(llm, ledger.snapshot()).bytes)
    first.load()
    serving = last(out, "serving")
    at_load = H100_CONTEXT_BYTES + weight_allocation_bytes(first.model) + first.pool_bytes  # NVML before a forward
    assert replica_reports._measured_bytes(llm, serving) != at_load  # the need is no longer that

    starved, out = host(llm_dir, at_load)
    with pytest.raises(ReplicaFailure) as failure:
        starved.load()
    assert failure.value.kind == "oom"
    reason = failure.value.reason
    assert reason.startswith("cannot serve: the KV pool left by the reservation holds 0 tokens")
    assert f"max_tokens {MAX_TOKENS}" in reason and f"reservation {at_load} bytes" in reason
    assert f"need {serving['need_bytes']} bytes" in reason and "allocator cap" in reason
    # It never served, so its serving loop never claimed the queue or took a request.
    assert starved.state == "failed" and not starved.accepting.is_set() and starved.paged is None
    assert not [line for line in out.getvalue().splitlines() if '"serving"' in line]


def test_a_virtual_gpu_books_what_cuda_could_allocate_and_models_the_h100s_contexts(db):
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB"), virtual=True)
    gpu = GPU.objects.get()
    assert gpu.total_bytes == 8 * GiB - H100_DRIVER_RESERVE_BYTES == gpu.available_bytes
    assert gpu.nvml_total_bytes == 8 * GiB
    assert (gpu.context_bytes, gpu.standby_context_bytes) == (H100_CONTEXT_BYTES, H100_STANDBY_CONTEXT_BYTES)
    # Per node, a profile of its own.
    small = VirtualProfile(context_bytes=300 * MiB, standby_context_bytes=200 * MiB, driver_reserve_bytes=64 * MiB)
    nodes.register_node("n2", virtual_gpus("n2", "1x8GiB", small), virtual=True)
    assert GPU.objects.get(node__name="n2").total_bytes == 8 * GiB - 64 * MiB
    assert VirtualProfile.from_env(small.as_env()) == small

    with pytest.raises(ValueError, match=r"no room once the driver reserve \(480 MiB\) and one CUDA context"):
        virtual_gpus("n3", "1x1GiB")
    with pytest.raises(CommandError, match=r"--virtual-gpus 1x1GiB: a virtual GPU of 1024 MiB has no room"):
        call_command("agent", "--node", "n4", "--virtual-gpus", "1x1GiB")
    with pytest.raises(CommandError, match=r"--virtual-context: 'lots' is not a size"):
        call_command("agent", "--node", "n4", "--virtual-context", "lots")
    with pytest.raises(CommandError, match="a standby's context cannot be larger"):
        call_command("agent", "--node", "n4", "--virtual-context", "100MiB", "--virtual-standby-context", "200MiB")


def _nvml(total: int, used: int, reserved: int | None, processes: list) -> SimpleNamespace:
    def memory_info(handle, version=None):
        if version is None:
            return SimpleNamespace(total=total, used=used, free=total - used)
        if reserved is None:
            raise RuntimeError("NVML_ERROR_FUNCTION_NOT_FOUND")
        return SimpleNamespace(total=total, reserved=reserved, used=used - reserved, free=total - used)

    return SimpleNamespace(
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlMemory_v2=0x02000028,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: processes,
    )


def test_a_real_gpus_total_is_what_cuda_can_allocate_not_nvmls_total():
    # The H100 of the findings: NVML 85,520,809,984 B, CUDA 85,017,493,504 B.
    nvml_total, cuda_total = 85_520_809_984, 85_017_493_504
    reserve = nvml_total - cuda_total
    assert allocatable_bytes(_nvml(nvml_total, reserve, reserve, []), None) == (cuda_total, nvml_total)
    # A driver without the v2 query: an idle device's "used" is the reserve.
    assert allocatable_bytes(_nvml(nvml_total, reserve, None, []), None) == (cuda_total, nvml_total)
    # ... and a busy one cannot tell: the H100's reserve stands in.
    busy = _nvml(nvml_total, reserve + 5 * GiB, None, [SimpleNamespace(pid=1)])
    assert allocatable_bytes(busy, None) == (nvml_total - H100_DRIVER_RESERVE_BYTES, nvml_total)
    # Busy with the v2 query: its reserve, not what the processes use.
    busy_v2 = _nvml(nvml_total, reserve + 5 * GiB, reserve, [SimpleNamespace(pid=1)])
    assert allocatable_bytes(busy_v2, None) == (cuda_total, nvml_total)
    # Idle, "used" above "reserved" (the H100 of 2026-11-26: 483.2 MiB used, 480 MiB reserved): CUDA
    # cannot allocate the difference either.
    idle = _nvml(nvml_total, 483 * MiB + 209715, 480 * MiB, [])
    assert allocatable_bytes(idle, None) == (nvml_total - 483 * MiB - 209715, nvml_total)


def _serving_replica(dep: Deployment, gpu: GPU, reserved: int, **fields) -> Replica:
    replica = factories.replica(
        dep, gpu.node, state=Replica.State.SERVING, gpu_mem_bytes_by_id={str(gpu.index): reserved}, **fields
    )
    factories.occupy(replica, gpu, reserved)
    return replica


def test_a_process_over_its_reservation_is_an_event_a_metric_a_raised_need_and_a_grown_reservation(db):
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB"), virtual=True)
    gpu = GPU.objects.get()
    dep = factories.deployment("llm", memory_measured_bytes=900 * MiB)
    replica = _serving_replica(dep, gpu, 900 * MiB)
    honest = _serving_replica(factories.deployment("other"), gpu, 800 * MiB)

    used = 900 * MiB + 100 * MiB
    nodes.heartbeat("n1", books=Books(usage={replica.id: {"0": used}, honest.id: {"0": 790 * MiB}}))

    event = Event.objects.get(kind=Event.Kind.GPU_OVERCOMMIT)
    assert event.replica == replica.id and event.gpu == "n1/0"
    assert "holds 1000 MiB on n1/0, 100 MiB more than its reservation of 900 MiB" in event.reason
    dep.refresh_from_db()
    assert dep.observed.memory_measured_bytes == used  # the next replica is reserved what this one holds
    assert Occupant.objects.get(replica=replica).reserved_bytes == used
    replica.refresh_from_db()
    assert replica.gpu_mem_bytes_by_id == {"0": used}
    gpu.refresh_from_db()
    assert gpu.overcommit_bytes == 100 * MiB
    assert gpu.nvml_free_bytes == gpu.total_bytes - used - 790 * MiB
    client = APIClient()
    metrics = client.get("/metrics").content.decode()
    assert 'gpuportal_gpu_overcommit_bytes{gpu="0",node="n1"} 1.048576e+08' in metrics

    # The books are honest again: the next beat finds nothing and records nothing more, and
    # available_bytes promises no more than NVML has free.
    nodes.heartbeat("n1", books=Books(usage={replica.id: {"0": used}, honest.id: {"0": 790 * MiB}}))
    gpu.refresh_from_db()
    assert gpu.overcommit_bytes == 0 and Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).count() == 1
    assert gpu.available_bytes <= gpu.nvml_free_bytes


def test_an_excess_within_the_books_tolerance_shows_in_the_metric_and_changes_nothing(db, settings):
    """NVML's figures wobble by a few MiB: the larger of GPUPORTAL_BOOKS_TOLERANCE_BYTES (16 MiB)
    and 1 % of the reservation is no Event, no raised need and no grown reservation, but the
    gauge shows every byte."""
    nodes.register_node("n1", virtual_gpus("n1", "1x16GiB"), virtual=True)
    gpu = GPU.objects.get()
    small = _serving_replica(factories.deployment("small", memory_measured_bytes=800 * MiB), gpu, 800 * MiB)
    large = _serving_replica(factories.deployment("large", memory_measured_bytes=4 * GiB), gpu, 4 * GiB)
    # 9 MiB over 800 MiB (under 16 MiB), 30 MiB over 4 GiB (under 1 %: 41 MiB).
    usage = {small.id: {"0": 809 * MiB}, large.id: {"0": 4 * GiB + 30 * MiB}}
    nodes.heartbeat("n1", books=Books(usage=usage))

    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    assert Occupant.objects.get(replica=small).reserved_bytes == 800 * MiB
    assert DeploymentObserved.objects.get(deployment__name="small").memory_measured_bytes == 800 * MiB
    gpu.refresh_from_db()
    assert gpu.overcommit_bytes == 39 * MiB
    metrics = APIClient().get("/metrics").content.decode().splitlines()
    [line] = [m for m in metrics if m.startswith('gpuportal_gpu_overcommit_bytes{gpu="0",node="n1"}')]
    assert float(line.split()[-1]) == 39 * MiB

    # A tighter tolerance makes the same 9 MiB an over-commit to act on.
    settings.GPUPORTAL_BOOKS_TOLERANCE_BYTES = 1 * MiB
    nodes.heartbeat("n1", books=Books(usage=usage))
    assert Event.objects.get(kind=Event.Kind.GPU_OVERCOMMIT).replica == small.id


@pytest.fixture(scope="module")
def llm20_dir(tmp_path_factory):
    """A tiny Llama of 20 MB: its KV pool's allocations round up by whole MiB, where the 2 MB
    model's pool is too small to show it."""
    return write_tiny_model(tmp_path_factory.mktemp("llm20") / "m", size_mb=20, seed=7).path


@pytest.mark.parametrize("max_tokens", [512, 1000])
def test_a_replica_slept_and_woken_on_a_virtual_gpu_holds_no_more_than_the_scheduler_reserved(
    db, llm20_dir, max_tokens
):
    """The books on virtual GPUs after a wake: the context has grown by the kernels serving
    loaded, the wake is reserved the measured need and that growth, and the process the virtual
    GPU models holds no more. (It once counted the pool's rounding on top of the activation
    reserve that already holds it: 1-3 MiB over after every wake, a `gpu.overcommit` each.)"""
    nodes.register_node("n1", virtual_gpus("n1", "2x8GiB"), virtual=True)
    facts = inspect_model(str(llm20_dir), "transformers", "float32", max_tokens)
    dep = factories.deployment(
        "llm20",
        model_source=str(llm20_dir),
        max_tokens=max_tokens,
        weight_bytes=facts.weight_bytes,
        memory_estimate_bytes=facts.estimate_bytes,
    )
    first_need = need_bytes(dep, ledger.snapshot()).bytes
    replica, out = host(llm20_dir, first_need, max_tokens=max_tokens)
    replica.load()
    serving = last(out, "serving")
    assert serving["process_bytes"] <= first_need
    measured = replica_reports._measured_bytes(dep, serving)
    DeploymentObserved.objects.filter(pk=dep.pk).update(
        memory_measured_bytes=measured, memory_measured_context_bytes=serving["context_bytes"]
    )
    replica.sleep(0)
    grown = last(out, "sleeping")["residual_bytes_by_id"]["0"]
    GPU.objects.update(context_bytes=grown)  # what the sleep's report does
    dep.refresh_from_db()
    wake_need = need_bytes(dep, ledger.snapshot()).bytes

    gpu = GPU.objects.get(index=0)
    row = _serving_replica(dep, gpu, wake_need)
    for _ in range(2):
        replica.wake([0], {"0": wake_need}, 0.5)
        woken = last(out, "woken")
        assert woken["process_bytes"] <= wake_need, woken["footprint"]
        nodes.heartbeat("n1", books=Books(usage={row.id: woken["process_bytes_by_id"]}))
        gpu.refresh_from_db()
        assert gpu.overcommit_bytes == 0
        replica.sleep(0)
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()


def test_a_replica_over_two_whole_virtual_gpus_holds_its_share_within_each_and_raises_no_overcommit(db, llm_dir):
    """A model too big for one GPU gets whole GPUs (scheduling.core.placement). On real ones the
    device map spreads it over them, so it is not paged and each GPU holds a share. The virtual
    GPU once counted the whole process on the first: that GPU twice over its reservation, a
    `gpu.overcommit` every beat, and the deployment's need raised to both GPUs' total."""
    nodes.register_node("n1", virtual_gpus("n1", "2x2GiB"), virtual=True)
    gpus = list(GPU.objects.order_by("index"))
    whole = {str(gpu.index): gpu.total_bytes for gpu in gpus}
    replica, out = host(llm_dir, 0, over=whole)
    replica.load()

    serving = last(out, "serving")
    assert replica.paged is None and serving["kv"] is None, "served as a spread model is: no pool"
    held = serving["process_bytes_by_id"]
    assert held.keys() == whole.keys() and all(0 < held[g] <= whole[g] for g in held), held
    # Every byte counted once: the context on the first GPU, the weights and the working set shared
    # in proportion to each GPU's room beside it.
    allocator = weight_allocation_bytes(replica.model) + replica.footprint.activation_bytes
    assert sum(held.values()) == H100_CONTEXT_BYTES + allocator
    rooms = {"0": whole["0"] - H100_CONTEXT_BYTES, "1": whole["1"]}
    assert held["1"] == allocator * rooms["1"] // sum(rooms.values())

    dep = factories.deployment("wide", memory_measured_bytes=serving["need_bytes"])
    row = factories.replica(dep, gpus[0].node, state=Replica.State.SERVING, gpu_mem_bytes_by_id=whole)
    for gpu in gpus:
        factories.occupy(row, gpu, gpu.total_bytes)
    nodes.heartbeat("n1", books=Books(usage={row.id: held}))
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    assert [gpu.overcommit_bytes for gpu in GPU.objects.order_by("index")] == [0, 0]
    dep.refresh_from_db()
    assert dep.observed.memory_measured_bytes == serving["need_bytes"], "the need is not raised"


def test_a_virtual_replica_over_two_gpus_never_holds_more_than_either_reservation_leaves_it(llm_dir):
    # Reservations too small for the working set: each GPU's allocator stops at its room, as a
    # real one's cap and max_memory stop it; the context alone sits beside it on the first GPU.
    reserved = {"0": H100_CONTEXT_BYTES + 8 * MiB, "1": 8 * MiB}
    replica, out = host(llm_dir, 0, over=reserved)
    replica.load()
    assert last(out, "serving")["process_bytes_by_id"] == reserved


def test_a_figure_reported_before_a_state_change_is_not_held_against_the_new_state(db):
    """The agent reads a replica's figure, then the replica falls asleep and its reservation
    shrinks to its context before the heartbeat is checked: the awake figure is of another time."""
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB"), virtual=True)
    gpu = GPU.objects.get()
    dep = factories.deployment("llm", memory_measured_bytes=900 * MiB)
    asleep = factories.replica(
        dep, gpu.node, state=Replica.State.SLEEPING, gpu_mem_bytes_by_id={"0": H100_CONTEXT_BYTES}
    )
    factories.occupy(asleep, gpu, H100_CONTEXT_BYTES)

    awake_figure = Books(usage={asleep.id: {"0": 900 * MiB}}, states={asleep.id: "serving"})
    nodes.heartbeat("n1", books=awake_figure)
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    assert Occupant.objects.get(replica=asleep).reserved_bytes == H100_CONTEXT_BYTES
    # Reported asleep and holding more than its context: that is an over-commit.
    nodes.heartbeat("n1", books=Books(usage={asleep.id: {"0": 900 * MiB}}, states={asleep.id: "sleeping"}))
    assert Event.objects.get(kind=Event.Kind.GPU_OVERCOMMIT).replica == asleep.id
    dep.refresh_from_db()
    assert dep.observed.memory_measured_bytes == 900 * MiB  # a sleeper's figure says nothing of the serving need


def test_an_evicted_replica_draining_after_its_reservation_went_to_another_is_no_overcommit(db):
    """A placement evicts it and gives its room to a new replica at once; it drains meanwhile,
    its weights still on the GPU, and the new replica's node waits for it to let go."""
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB"), virtual=True)
    gpu = GPU.objects.get()
    dep = factories.deployment("llm", memory_measured_bytes=900 * MiB)
    evicted = factories.replica(dep, gpu.node, state=Replica.State.DRAINING, gpu_mem_bytes_by_id={})
    drained = _serving_replica(factories.deployment("other"), gpu, 800 * MiB)
    Replica.objects.filter(pk=drained.pk).update(state=Replica.State.DRAINING)

    nodes.heartbeat(
        "n1",
        books=Books(
            usage={evicted.id: {"0": 900 * MiB}, drained.id: {"0": 900 * MiB}},
            states={evicted.id: "serving", drained.id: "serving"},
        ),
    )

    # The one that drains with its reservation (an operator's sleep) still answers for it.
    (event,) = Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT)
    assert event.replica == drained.id, event.reason
    assert not Occupant.objects.filter(replica=evicted).exists(), "no reservation grown for one leaving"
    dep.refresh_from_db()
    assert dep.observed.memory_measured_bytes == 900 * MiB


def test_a_standbys_context_counts_against_its_pairs_reservation(db):
    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB"), virtual=True)
    gpu = GPU.objects.get()
    dep = factories.deployment("pair", failover_standby=True, memory_measured_bytes=900 * MiB)
    lease = FailoverLease.objects.create(deployment=dep, slot=1)
    reserved = 900 * MiB + H100_STANDBY_CONTEXT_BYTES
    active = _serving_replica(dep, gpu, reserved, lease=lease)
    standby = factories.replica(dep, gpu.node, state=Replica.State.STANDBY, role=Replica.Role.STANDBY, lease=lease)

    # Each member alone is within the pair's reservation; together they are exactly it.
    books = Books(usage={active.id: {"0": 900 * MiB}, standby.id: {"0": H100_STANDBY_CONTEXT_BYTES}})
    nodes.heartbeat("n1", books=books)
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()
    # A standby holding more than its context puts the pair over, and the pair's need is raised
    # by what the active member holds (need_bytes adds the standby's context itself).
    books = Books(usage={active.id: {"0": 950 * MiB}, standby.id: {"0": H100_STANDBY_CONTEXT_BYTES}})
    nodes.heartbeat("n1", books=books)
    assert Event.objects.get(kind=Event.Kind.GPU_OVERCOMMIT).replica == active.id
    dep.refresh_from_db()
    assert dep.observed.memory_measured_bytes == 950 * MiB


@pytest.mark.slow
@pytest.mark.gpu
def test_on_a_real_gpu_a_replica_reserved_its_estimate_serves_max_tokens_within_it_per_nvml(llm_dir, tmp_path):
    """The first load on CUDA: reserved the estimate and a context, as the scheduler reserves it,
    its pool holds max_tokens, NVML sees the process within the reservation, and what it reports
    as its need is what the next replica is reserved. (Not yet run on a GPU: see BENCHMARKS.md.)"""
    from inference.model_size import shape_from_model_dir
    from inference.supervisor import ReplicaSpec, Supervisor
    from tests.support.replicas import Events

    shape = shape_from_model_dir(llm_dir, "float32")
    reserved = memory.estimate(shape, max_tokens=MAX_TOKENS, cuda_context_bytes=H100_CONTEXT_BYTES).total_bytes
    supervisor = Supervisor(tmp_path / "logs")
    events = Events()
    try:
        # Its own process: the allocator cap is per process and must not reach this one.
        supervisor.start(
            ReplicaSpec(
                replica_id="real",
                source=str(llm_dir),
                loader="transformers",
                dtype="float32",
                gpus=(0,),
                reserved_bytes_by_gpu={"0": reserved},
                fraction=0.5,
                backend="cuda",
                kv_max_tokens=MAX_TOKENS,
                context_bytes=H100_CONTEXT_BYTES,
            ),
            events,
        )
        _, serving = events.until("serving", timeout=180)
    finally:
        supervisor.stop_all(timeout=10)
    assert serving["kv"]["blocks_total"] * serving["kv"]["block_tokens"] >= MAX_TOKENS
    if serving["process_bytes"] is None:
        pytest.skip("NVML does not list this process (a container without the host PID namespace)")
    assert serving["process_bytes"] <= reserved, serving["footprint"]
    # The need it reports covers what it holds now and the activations still to come: not NVML's
    # figure at load, which a replica reserved would size its pool below zero with.
    assert serving["need_bytes"] > serving["process_bytes"], serving["footprint"]


# -- end to end: real agent and replica processes on H100-like virtual GPUs ---------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_llm_scaled_slept_and_woken_by_requests_serves_every_request_within_its_books(start_agent, staff, tmp_path):
    from scheduling.services import host_cache, sleep
    from scheduling.services import requests as request_services

    request_services.queue.cache_clear()
    start_agent("e2e", "2x4GiB")
    model = write_tiny_model(tmp_path / "llm", size_mb=2, seed=5).path
    body = {"name": "llm", "model": {"source": str(model)}, "memory": {"max_tokens": MAX_TOKENS}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(serving(1), 180, "the first replica to serve")
    assert staff.post("/api/deployments/llm/scale/", {"replicas": 3}, format="json").status_code == 200
    wait_until(serving(3), 180, "three replicas to serve")

    # The node's host cache lends its spare room as kept arenas (what the control worker
    # runs after a replica comes to serve, run here). Each replica allocates its arena and reports
    # its size, which the books take in place of the grant's figure (its weights as the model's
    # files hold them; the arena aligns each tensor, so this tiny model's differs).
    granted = host_cache.balance("e2e")["granted"]
    assert len(granted) == 3
    weights = DeploymentObserved.objects.get(deployment__name="llm").weight_bytes
    wait_until(
        lambda: all(r.arena_kept_bytes not in (0, weights) for r in Replica.objects.filter(pk__in=granted)),
        60,
        "each replica's report of the arena it keeps",
    )
    kept = sum(Replica.objects.filter(pk__in=granted).values_list("arena_kept_bytes", flat=True))
    node = Replica.objects.get(pk=granted[0]).node
    assert host_cache.used_bytes([node.pk]) == {node.pk: kept}

    # The sleeps pack into those arenas, and the wakes below keep them again.
    for replica_id in Replica.objects.filter(state="serving").values_list("id", flat=True):
        sleep.sleep_replica(replica_id, reason="test: sleep all")
    wait_until(lambda: Replica.objects.filter(state="sleeping").count() == 3, 120, "all three to sleep")

    # 32 requests at once wake the deployment and are all answered.
    answers: list[int] = [0] * 32
    start = threading.Barrier(32)

    def ask(i: int) -> None:
        try:
            client = APIClient()
            client.force_authenticate(User.objects.get(username="ops"))
            start.wait()
            response = client.post(
                "/api/deployments/llm/infer/",
                {"input": f"Request {i}", "params": {"max_tokens": 200}, "timeout_s": 240},
                format="json",
            )
            answers[i] = response.status_code
        finally:
            # This thread's own database connection: left open, the test database cannot be
            # dropped at the session's end ("accessed by 32 other sessions").
            connections.close_all()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [200] * 32

    awake = list(Replica.objects.filter(state="serving").values_list("id", flat=True))
    assert awake
    # Those woken kept the arena they woke from (still counted), beside the sleepers' weights.
    assert all(Replica.objects.get(pk=r).arena_kept_bytes > 0 for r in awake if r in granted)
    asleep = Replica.objects.filter(state="sleeping").count()
    assert (
        host_cache.used_bytes([node.pk])[node.pk]
        == sum(Replica.objects.filter(state="serving", pk__in=granted).values_list("arena_kept_bytes", flat=True))
        + asleep * weights
    )
    for replica_id in awake:
        kv = wait_until(lambda r=replica_id: staff.get(f"/api/replicas/{r}/").json()["kv"], 30, "KV figures")
        assert kv["blocks_total"] * kv["block_tokens"] >= MAX_TOKENS, kv
    # The agent's heartbeat carries what each process would show NVML: once it has seen every
    # replica, no GPU is over its books, and none promises more than it has free.
    wait_until(lambda: reported_everything(), 60, "a heartbeat with every replica's figures")
    for gpu in GPU.objects.all():
        assert gpu.overcommit_bytes == 0, (gpu.index, gpu.overcommit_bytes)
        assert gpu.available_bytes <= gpu.nvml_free_bytes, (gpu.index, gpu.available_bytes, gpu.nvml_free_bytes)
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()


def serving(count: int):
    def check() -> bool:
        states = list(Replica.objects.values_list("state", flat=True))
        assert "failed" not in states, list(Replica.objects.values_list("failure_reason", flat=True))
        return states.count("serving") == count

    return check


def reported_everything() -> bool:
    """Every replica process has a context on some GPU: the GPUs' free figures account for them all."""
    held = sum(g.total_bytes - g.nvml_free_bytes for g in GPU.objects.all() if g.nvml_free_bytes is not None)
    return held >= Replica.objects.exclude(state__in=["stopped", "failed"]).count() * memory.H100_CONTEXT_BYTES


def test_a_sleep_the_agent_could_not_measure_keeps_the_gpus_context_reserved_and_a_measured_one_raises_it(db):
    h100 = DeviceInfo(index=0, uuid="GPU-h100-0", product="NVIDIA H100 80GB HBM3", total_bytes=80 * GiB, virtual=False)
    nodes.register_node("gpu1", [h100], virtual=False)
    gpu = GPU.objects.get()
    dep = factories.deployment("llm")
    blind = factories.replica(dep, gpu.node, state=Replica.State.SERVING, gpu_mem_bytes_by_id={"0": GiB})
    factories.occupy(blind, gpu, GiB)

    # NVML did not list the process (a container without the host's PIDs): null, not 0.
    reports.report(blind.id, {"event": "sleeping", "residual_bytes_by_id": {"0": None}})
    blind.refresh_from_db()
    assert blind.state == Replica.State.SLEEPING
    assert Occupant.objects.get(replica=blind).reserved_bytes == H100_CONTEXT_BYTES
    gpu.refresh_from_db()
    assert gpu.context_bytes == H100_CONTEXT_BYTES and not gpu.context_measured

    # Measured, what serving grew the context to is the GPU's figure from now on.
    seen = factories.replica(dep, gpu.node, state=Replica.State.SERVING, gpu_mem_bytes_by_id={"0": GiB})
    factories.occupy(seen, gpu, GiB)
    reports.report(seen.id, {"event": "sleeping", "residual_bytes_by_id": {"0": 780 * MiB}})
    gpu.refresh_from_db()
    assert (gpu.context_bytes, gpu.context_measured) == (780 * MiB, True)
    assert Occupant.objects.get(replica=seen).reserved_bytes == 780 * MiB


def test_a_real_gpus_context_is_what_its_replicas_measured_and_only_grows(db):

    h100 = DeviceInfo(index=0, uuid="GPU-h100-0", product="NVIDIA H100 80GB HBM3", total_bytes=80 * GiB, virtual=False)
    twin = DeviceInfo(index=1, uuid="GPU-h100-1", product="NVIDIA H100 80GB HBM3", total_bytes=80 * GiB, virtual=False)
    nodes.register_node("gpu1", [h100, twin], virtual=False)
    gpu0, gpu1 = GPU.objects.order_by("index")
    assert gpu0.context_bytes == H100_CONTEXT_BYTES and not gpu0.context_measured  # the default until measured
    dep = factories.deployment("llm")
    loading = factories.replica(dep, gpu0.node, state=Replica.State.LOADING, gpu_mem_bytes_by_id={"0": GiB})

    reports.report(loading.id, {"event": "serving", "pid": 1, "context_measured_bytes": 800 * MiB})
    # Measured on one GPU, it is the figure of every GPU of that model on the node.
    assert list(GPU.objects.order_by("index").values_list("context_bytes", "context_measured")) == [
        (800 * MiB, True),
        (800 * MiB, True),
    ]
    assert Event.objects.filter(kind=Event.Kind.GPU_CHANGED, reason__contains="CUDA context measured at 800 MiB")
    # An earlier moment's lower reading changes nothing; a standby's context is its own figure.
    replica_services.record_context(loading, 600 * MiB)
    replica_services.record_context(loading, 600 * MiB, standby=True)
    gpu1.refresh_from_db()
    assert (gpu1.context_bytes, gpu1.standby_context_bytes) == (800 * MiB, 600 * MiB)
    # A new registration (the agent restarted) keeps what was measured.
    nodes.register_node("gpu1", [h100, twin], virtual=False)
    gpu1.refresh_from_db()
    assert gpu1.context_bytes == 800 * MiB

    # A virtual GPU's too: its profile grows a context as serving loads kernels, as a real one does.
    nodes.register_node("v1", virtual_gpus("v1", "1x8GiB"), virtual=True)
    on_virtual = factories.replica(dep, GPU.objects.get(node__name="v1").node, gpu_mem_bytes_by_id={"0": GiB})
    replica_services.record_context(on_virtual, 900 * MiB)
    assert GPU.objects.get(node__name="v1").context_bytes == 900 * MiB
