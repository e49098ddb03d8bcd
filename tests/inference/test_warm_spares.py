"""Warm spares: a replica process per GPU started ahead of need, its context made there, that the
next replica started on that GPU runs in (inference.warm_spare, inference.spare_pool); the agent
counts each GPU's spare as memory placement leaves alone."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from inference.agent import NodeAgent
from inference.devices import virtual_gpus
from inference.spare_pool import GIVE_UP_AFTER
from inference.supervisor import Supervisor
from tests.support.processes import wait_until
from tests.support.replicas import CONTEXT, Events, MiB, gone, spec

GiB = 1024**3


def _warm(supervisor: Supervisor, gpu: int, *, not_pid: int | None = None) -> int:
    return wait_until(
        lambda: (pid := supervisor.warm_spares().get(gpu)) is not None and pid != not_pid and pid,
        60,
        f"a warm spare on GPU {gpu}",
    )


@pytest.mark.slow
def test_a_replica_started_on_a_gpu_with_a_warm_spare_runs_in_it_and_the_next_one_warms(tiny_model_dir, tmp_path):
    supervisor = Supervisor(tmp_path / "logs", host_copies=tmp_path / "copies")
    supervisor.use_forkserver()  # as an agent on virtual GPUs does
    supervisor.keep_spares("virtual", [0], CONTEXT)
    events = Events()
    try:
        first = _warm(supervisor, 0)
        assert supervisor.spare_slots() == {"0": CONTEXT}

        supervisor.start(spec(str(tiny_model_dir)), events)

        _, serving = events.until("serving")
        assert serving["pid"] == first and supervisor.pid("r1") == first, "it runs in the spare's process"
        log = (tmp_path / "logs" / "replica-r1.log").read_text()
        assert f"replica r1 pid {first}: r1 100%: loaded" in log, "its log is the replica's own"
        assert "warm on virtual GPU 0" in (tmp_path / "logs" / "spare-gpu0.log").read_text()
        second = _warm(supervisor, 0, not_pid=first)
        # One context placement leaves alone before, while and after a spare is taken.
        assert supervisor.spare_slots() == {"0": CONTEXT}

        # A deep sleeper's wake, the spare's reason to be: its new process is the spare.
        supervisor.send("r1", {"cmd": "sleep"})
        events.until("sleeping")
        supervisor.send("r1", {"cmd": "deepen", "path": str(supervisor.host_copy_path("r1"))})
        events.until("deep_sleeping")
        woken = dataclasses.replace(spec(str(tiny_model_dir)), from_host_copy=True)
        supervisor.start(woken, events)
        progress, again = events.until("serving")
        assert again["pid"] == second and progress[0]["detail"].startswith("waking from deep sleep")
        assert again["weights_bytes"] == serving["weights_bytes"]
        third = _warm(supervisor, 0, not_pid=second)
    finally:
        supervisor.stop_all(timeout=5)
        supervisor.close()
    assert wait_until(lambda: gone(third), 10, "the last spare to exit with its supervisor")


@pytest.mark.slow
def test_a_replica_of_another_backend_or_gpu_starts_the_plain_way(tiny_model_dir, tmp_path):
    supervisor = Supervisor(tmp_path / "logs")
    supervisor.keep_spares("virtual", [1], CONTEXT)
    events = Events()
    try:
        spare = _warm(supervisor, 1)

        supervisor.start(spec(str(tiny_model_dir), gpus=(0,)), events)

        _, serving = events.until("serving")
        assert serving["pid"] != spare and supervisor.warm_spares() == {1: spare}
    finally:
        supervisor.stop_all(timeout=5)
        supervisor.close()


@pytest.mark.slow
def test_a_spare_that_never_warms_is_given_up_on_its_gpu_and_holds_no_slot(tmp_path):
    # An interpreter that exits at once: the spare says nothing, as one whose GPU will not do.
    broken = tmp_path / "python"
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'raise SystemExit(3)'\n")
    broken.chmod(0o755)
    supervisor = Supervisor(tmp_path / "logs", python=str(broken))
    try:
        supervisor.keep_spares("virtual", [0], CONTEXT)
        assert supervisor.spare_slots() == {"0": CONTEXT}, "held from the start, while the first one warms"

        reason = wait_until(lambda: supervisor._spares.given_up().get(0), 60, f"{GIVE_UP_AFTER} tries")

        assert "exited before it was warm" in reason and "spare-gpu0.log" in reason
        assert supervisor.spare_slots() == {} and supervisor.warm_spares() == {}
    finally:
        supervisor.close()


def test_the_agent_counts_each_gpus_spare_as_memory_placement_leaves_alone(tmp_path):
    agent = NodeAgent("n1", control=SimpleNamespace(), backend="virtual", virtual_foreign={1: GiB})
    agent.devices = virtual_gpus("n1", "2x8GiB")
    agent.virtual = True
    agent.supervisor = SimpleNamespace(spare_slots=lambda: {"0": CONTEXT, "1": CONTEXT})

    assert agent.foreign(set(), None, None) == {"0": CONTEXT, "1": GiB + CONTEXT}

    # On NVML the spare's own process is counted once: in its slot, not again as another tenant.
    agent.virtual = False
    agent.devices = [SimpleNamespace(index=0, total_bytes=80 * GiB), SimpleNamespace(index=1, total_bytes=80 * GiB)]
    replica, spare = {"0": 10 * GiB}, {"0": 600 * MiB}
    by_pid = {101: replica, 202: spare}
    free = {"0": 80 * GiB - 10 * GiB - 600 * MiB, "1": 80 * GiB}
    assert agent.foreign({101}, by_pid, free) == {"0": CONTEXT, "1": CONTEXT}


def test_warm_spares_are_off_unless_the_operator_turns_them_on(settings):
    assert NodeAgent("n1", control=SimpleNamespace()).warm_spares is False
    settings.GPUPORTAL_WARM_SPARES = True
    assert NodeAgent("n1", control=SimpleNamespace()).warm_spares is True


def _spare_pids(log: Path) -> set[int]:
    """The pids of every spare a node's agent started on GPU 0, from their log's lines."""
    return {int(pid) for pid in re.findall(r"spare gpu 0 pid (\d+): warm on", log.read_text())}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_through_the_portal_a_deep_sleepers_wake_runs_in_its_gpus_warm_spare_within_the_books(
    start_agent, staff, tmp_path
):
    from inference.management.commands.make_tiny_model import write_tiny_model
    from scheduling.models import GPU, Event, Replica
    from scheduling.services import requests as request_services

    request_services.queue.cache_clear()
    start_agent("warm", "1x4GiB", GPUPORTAL_WARM_SPARES="1")
    spares = tmp_path / "replicas" / "warm" / "spare-gpu0.log"
    # The node's beat books its spare's context as memory placement leaves alone.
    wait_until(lambda: GPU.objects.get(node__name="warm").foreign_bytes == CONTEXT, 60, "the spare's slot booked")
    wait_until(lambda: spares.exists() and _spare_pids(spares), 60, "the spare to be warm")
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3).path
    body = {"name": "tiny", "model": {"source": str(model)}, "memory": {"max_tokens": 256}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    replica = wait_until(lambda: Replica.objects.filter(state="serving").first(), 120, "the replica to serve")
    assert replica.pid in _spare_pids(spares), "it runs in the spare that warmed first"

    assert staff.post("/api/deployments/tiny/sleep/").status_code in (200, 202)
    wait_until(lambda: Replica.objects.get(pk=replica.pk).state == "sleeping", 60, "the replica to sleep")
    assert staff.post("/api/deployments/tiny/deep-sleep/").status_code in (200, 202)
    wait_until(lambda: Replica.objects.get(pk=replica.pk).state == "deep_sleeping", 60, "the replica to sleep deeply")

    wait_until(lambda: len(_spare_pids(spares)) == 2, 60, "the next spare to be warm")

    answer = staff.post("/api/deployments/tiny/infer/", {"input": "Hello", "timeout_s": 120}, format="json")

    assert answer.status_code == 200, answer.content
    # Its `serving` report reaches the books through the agents' worker, maybe after the answer.
    woken = wait_until(
        lambda: (row := Replica.objects.get(pk=replica.pk)).state == "serving" and row, 30, "the woken replica's report"
    )
    assert woken.pid != replica.pid
    assert woken.pid in _spare_pids(spares), "the deep sleeper's new process is the spare that warmed next"
    gpu = GPU.objects.get(node__name="warm")
    assert gpu.foreign_bytes == CONTEXT, "one slot all along: a spare's coming and going moved no figure"
    assert gpu.spare_bytes == CONTEXT, "and it is the node's warm spare, not another tenant"
    shown = staff.get(f"/api/gpus/{gpu.pk}/").json()
    assert (shown["foreign_bytes"], shown["spare_bytes"]) == (CONTEXT, CONTEXT)
    assert Event.objects.filter(kind=Event.Kind.GPU_FOREIGN).count() == 1, "the slot's booking, once"
    assert not Event.objects.filter(kind=Event.Kind.GPU_OVERCOMMIT).exists()


@pytest.mark.slow
@pytest.mark.gpu
def test_on_a_real_gpu_a_warm_spare_holds_its_context_and_a_deep_sleepers_wake_runs_in_it(tmp_path):
    from gpuportal.wire.commands import ReplicaSpec
    from inference.backends import nvml_process_bytes
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m", size_mb=64, seed=7).path
    supervisor = Supervisor(tmp_path / "logs", host_copies=tmp_path / "copies")
    supervisor.keep_spares("cuda", [0], CONTEXT)
    events = Events()
    cuda = ReplicaSpec(
        replica_id="r1", source=str(model), loader="transformers", dtype="float32", gpus=(0,),
        reserved_bytes_by_gpu={"0": 2 * GiB}, fraction=0.1, backend="cuda", kv_max_tokens=512,
    )  # fmt: skip
    try:
        first = _warm(supervisor, 0)
        held = (nvml_process_bytes(first) or {}).get("0", 0)
        if not held:
            pytest.skip("NVML does not list the spare's process (a container without the host PID namespace)")
        # Its context, and no more than a slot of the books: what it warmed with was given back.
        assert 0 < held <= supervisor.spare_slots()["0"], (held, supervisor.spare_slots())

        supervisor.start(cuda, events)
        _, serving = events.until("serving", timeout=180)
        assert serving["pid"] == first
        second = _warm(supervisor, 0, not_pid=first)
        supervisor.send("r1", {"cmd": "sleep"})
        events.until("sleeping")
        supervisor.send("r1", {"cmd": "deepen", "path": str(supervisor.host_copy_path("r1"))})
        events.until("deep_sleeping")
        assert wait_until(lambda: gone(first), 30, "the deep sleeper's process to exit")

        supervisor.start(dataclasses.replace(cuda, from_host_copy=True), events)

        progress, again = events.until("serving", timeout=180)
        assert again["pid"] == second and progress[0]["detail"].startswith("waking from deep sleep")
    finally:
        supervisor.stop_all(timeout=10)
        supervisor.close()


@pytest.mark.django_db
def test_the_books_api_cli_and_dashboard_show_a_gpus_warm_spare_apart_from_other_tenants(staff, admin_client):
    from django.urls import reverse

    from gpuportal.cli import render
    from gpuportal.wire.node_reports import Books
    from scheduling.models import GPU, Event
    from scheduling.services import nodes
    from tests.support.factories import NO_OVERHEAD

    nodes.register_node("n1", virtual_gpus("n1", "1x8GiB", NO_OVERHEAD), virtual=True)

    nodes.heartbeat("n1", books=Books(foreign_by_index={"0": GiB + CONTEXT}, spare_by_index={"0": CONTEXT}))

    gpu = GPU.objects.get()
    assert (gpu.foreign_bytes, gpu.spare_bytes) == (GiB + CONTEXT, CONTEXT)
    assert gpu.available_bytes == 8 * GiB - GiB - CONTEXT, "placement keeps out of both"
    (event,) = Event.objects.filter(kind=Event.Kind.GPU_FOREIGN)
    assert "722 MiB of it is the node's warm spare" in event.reason
    row = staff.get(f"/api/gpus/{gpu.pk}/").json()
    assert (row["foreign_bytes"], row["spare_bytes"]) == (GiB + CONTEXT, CONTEXT)
    shown = render.gpu_block(row, width=8).plain
    assert "other tenants 1.0 GiB" in shown and "warm spare 722.0 MiB" in shown
    page = admin_client.get(reverse("admin:scheduling_dashboard")).content.decode()
    assert "1.00 GiB held by other tenants" in page and "722.00 MiB held by the node's warm spare" in page
    assert 'data-kind="spare" title="warm spare 722.00 MiB"' in page

    # An agent that keeps no spare says so with an empty figure: the GPU's spare is gone.
    nodes.heartbeat("n1", books=Books(foreign_by_index={"0": GiB}, spare_by_index={}))
    gpu.refresh_from_db()
    assert (gpu.foreign_bytes, gpu.spare_bytes) == (GiB, 0)
