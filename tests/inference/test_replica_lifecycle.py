"""End to end on virtual GPUs: a real node agent, real replica processes loading a tiny model,
driven through the REST API: deploy, scale, evict to the CPU cache, promote, delete."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_KERNEL_GROWTH_BYTES
from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.models import GPU, Event, Occupant, Replica
from tests.support.deployments import LOAD_TIMEOUT, all_in, states
from tests.support.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2


def test_deploy_scale_evict_promote_and_delete_with_real_replica_processes(agent, staff, tmp_path):
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=1).path
    deploy = {
        "name": "tiny-a",
        "model": {"source": str(model), "loader": "transformers", "dtype": "float32"},
        "replicas": 1,
        "memory": {"override_bytes": 200 * MiB, "max_tokens": 128},
    }

    assert staff.post("/api/deployments/", deploy, format="json").status_code == 201
    wait_until(all_in("tiny-a", "serving", 1), LOAD_TIMEOUT, "the first replica to serve")
    first = Replica.objects.get()
    assert first.pid and psutil.pid_exists(first.pid)
    assert Event.objects.filter(replica=first.id, reason__startswith="loading weights").exists()

    assert staff.post("/api/deployments/tiny-a/scale/", {"replicas": 3}, format="json").status_code == 200
    wait_until(all_in("tiny-a", "serving", 3), LOAD_TIMEOUT, "three replicas to serve")
    pids = dict(Replica.objects.values_list("id", "pid"))
    assert len(set(pids.values())) == 3, "one OS process per replica"

    victim = first.id
    assert staff.post(f"/api/replicas/{victim}/evict/").status_code == 200
    wait_until(lambda: states("tiny-a")[victim] == "sleeping", 60, "the evicted replica to sleep")
    # Asleep it keeps its CUDA context as serving grew it, on a virtual GPU as on the H100.
    assert Occupant.objects.get(replica_id=victim).reserved_bytes == H100_CONTEXT_BYTES + H100_KERNEL_GROWTH_BYTES
    assert psutil.pid_exists(pids[victim]), "its process lives on, weights in CPU RAM"

    assert staff.post("/api/deployments/tiny-a/scale/", {"replicas": 3}, format="json").status_code == 200
    wait_until(all_in("tiny-a", "serving", 3), LOAD_TIMEOUT, "the cached replica to be promoted")
    assert set(states("tiny-a")) == set(pids), "promoted from the cache, not created anew"
    assert Replica.objects.get(pk=victim).pid == pids[victim]
    assert Event.objects.filter(replica=victim, reason="woken from the CPU cache").exists()

    assert staff.delete("/api/deployments/tiny-a/").status_code == 204
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids.values()), 60, "the processes to exit")
    assert all(g.available_bytes == g.total_bytes for g in GPU.objects.all())


def test_a_model_bigger_than_its_reservation_fails_like_an_out_of_memory(agent, staff, tmp_path):
    model = write_tiny_model(tmp_path / "tiny", size_mb=4, seed=2).path
    deploy = {
        "name": "cramped",
        "model": {"source": str(model)},
        "memory": {"override_bytes": 1 * MiB},
    }

    assert staff.post("/api/deployments/", deploy, format="json").status_code == 201

    wait_until(lambda: set(states("cramped").values()) == {"failed"}, LOAD_TIMEOUT, "the replica to fail")
    replica = Replica.objects.get()
    assert replica.failure_reason.startswith("out of memory: weights need")
    assert not Occupant.objects.filter(replica_id=replica.id).exists(), "its reservation was released"
    assert Event.objects.filter(replica=replica.id, reason=replica.failure_reason).exists()
