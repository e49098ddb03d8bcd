"""Failover pairs end to end on virtual GPUs (seed 004): a real agent runs an active replica and a
standby of a tiny model; the active is SIGKILLed under load, SIGSTOPped (hung), or switched over,
and the standby takes over with no request failed; a rolling restart replaces both members under
load. The lock itself is tested in tests/inference/test_failover_lock.py, and the control plane's
side of pairs, report by report, in tests/scheduling/test_failover_services.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_STANDBY_CONTEXT_BYTES
from inference import failover
from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.models import Event, FailoverLease, Occupant, Replica
from scheduling.services import requests as request_services
from scheduling.services import rollouts
from tests.support.load import SteadyLoad
from tests.support.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 1024**2
LOAD_TIMEOUT = 180


def pair_of(deployment: str = "tiny") -> tuple[Replica, Replica] | None:
    """(active, standby) once the pair is whole: one serving member and one standing by."""
    members = list(Replica.objects.filter(deployment__name=deployment, lease__isnull=False).order_by("created_at"))
    failed = [m for m in members if m.state == "failed" and not m.failure_reason.startswith("killed by its node")]
    assert not [m for m in failed if "superseded" not in m.failure_reason and "SIGKILL" not in m.failure_reason], [
        (m.id, m.failure_reason) for m in failed
    ]
    active = [m for m in members if m.state == "serving" and m.failover_state == "active"]
    standby = [m for m in members if m.state == "standby" and m.failover_state == "standby"]
    if len(active) == 1 and len(standby) == 1:
        return active[0], standby[0]
    return None


@pytest.fixture
def paired(agent, staff, tmp_path) -> tuple[Replica, Replica]:
    request_services.queue.cache_clear()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=5).path
    body = {
        "name": "tiny",
        "model": {"source": str(model)},
        "memory": {"override_bytes": 200 * MiB, "max_tokens": 256},
        "failover": {"standby": True},
    }
    response = staff.post("/api/deployments/", body, format="json")
    assert response.status_code == 201, response.json()
    return wait_until(pair_of, LOAD_TIMEOUT, "an active replica and its standby")


def a_failover_deployment_runs_an_active_and_a_standby_that_share_one_reservation(paired, staff, pairs) -> None:
    active, standby = paired

    assert active.node_id == standby.node_id
    assert active.gpu_mem_bytes_by_id == standby.gpu_mem_bytes_by_id
    # The pair's memory is reserved once, by the active member: its need and context, and the
    # context its standby keeps beside it (on the H100-like virtual GPU as on a real one).
    pair = 200 * MiB + H100_CONTEXT_BYTES + H100_STANDBY_CONTEXT_BYTES
    assert list(Occupant.objects.values_list("replica_id", "reserved_bytes")) == [(active.id, pair)]
    lease = FailoverLease.objects.get()
    assert lease.holder_id == active.id and lease.epoch == 1 and active.epoch == 1
    # The lock is the node's: a file in its agent's folder, which the active member holds, and a
    # lease file beside it that says so. The agent was given no database.
    assert json.loads((pairs / f"{lease.fence}.lease").read_text()) == {"holder": active.id, "epoch": 1}
    assert not (pairs / f"{lease.fence}.closed").exists()
    shown = {r["id"]: r for r in staff.get("/api/replicas/").json()["results"]}
    assert shown[active.id]["failover_state"]["state"] == "active" and shown[active.id]["failover_state"]["holder"]
    assert shown[standby.id]["failover_state"]["state"] == "standby"
    assert not shown[standby.id]["failover_state"]["holder"]
    assert shown[standby.id]["role"] == "standby"
    metrics = staff.get("/metrics").content.decode()
    assert 'gpuportal_failover_active{deployment="tiny"} 1.0' in metrics
    assert f'gpuportal_failover_state{{deployment="tiny",replica="{standby.id}",state="standby"}} 1.0' in metrics
    # A pair member never sleeps: evicting it would leave the pair without its active member.
    refused = staff.post(f"/api/replicas/{active.id}/sleep/")
    assert refused.status_code == 409 and "failover pair" in refused.json()["detail"]


def test_sigkill_of_the_active_under_steady_load_fails_no_request(paired):
    active, standby = paired
    with SteadyLoad(clients=2) as load:
        load.wait_for(6)
        os.kill(active.pid, signal.SIGKILL)
        taken_over = wait_until(
            lambda: (r := Replica.objects.get(pk=standby.id)).state == "serving" and r, 60, "the standby to take over"
        )
        before = len(load.results)
        load.wait_for(before + 6)

    assert load.results and all(status == 200 for status, _ in load.results), [
        body for status, body in load.results if status != 200
    ]
    assert {body["status"] for _, body in load.results} == {"done"}
    assert taken_over.role == "primary" and taken_over.epoch == 2
    killed = Replica.objects.get(pk=active.id)
    assert killed.state == "failed" and killed.failover_state == "dead"
    # The reservation passed to the new active, and a fresh standby makes the pair whole again.
    assert list(Occupant.objects.values_list("replica_id", flat=True)) == [standby.id]
    new_active, new_standby = wait_until(pair_of, LOAD_TIMEOUT, "a fresh standby")
    assert new_active.id == standby.id and new_standby.id not in (active.id, standby.id)
    takeover = Event.objects.get(kind="failover.takeover", replica=standby.id)
    # Where the takeover's time went, from the grant: each step after the one before.
    steps = takeover.after["steps"]
    assert 0 <= steps["fenced_s"] <= steps["given_back_s"] <= steps["woken_s"] <= takeover.after["takeover_s"]
    assert takeover.after["given_back"] is not None
    assert FailoverLease.objects.get().epoch == 2


def test_a_hung_active_is_killed_by_its_agent_and_the_standby_takes_over(paired, staff):
    active, standby = paired
    os.kill(active.pid, signal.SIGSTOP)
    try:
        taken_over = wait_until(
            lambda: (r := Replica.objects.get(pk=standby.id)).state == "serving" and r, 60, "the standby to take over"
        )
    finally:
        # SIGKILL reaches a stopped process; this is only in case the agent did not kill it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(active.pid, signal.SIGKILL)
    hung = wait_until(lambda: (r := Replica.objects.get(pk=active.id)).state == "failed" and r, 30, "the hung one")
    assert "killed by its node agent" in hung.failure_reason and "hung" in hung.failure_reason
    assert taken_over.epoch == 2
    response = staff.post("/api/deployments/tiny/infer/", {"input": "still there?", "timeout_s": 60}, format="json")
    assert response.status_code == 200 and response.json()["replica"] == standby.id


def a_rolling_restart_replaces_both_members_under_load_with_no_request_failed(staff) -> None:
    before = set(Replica.objects.filter(deployment__name="tiny").values_list("id", flat=True))
    with SteadyLoad(clients=2) as load:
        load.wait_for(4)
        response = staff.post("/api/deployments/tiny/restart/")
        assert response.status_code == 202, response.json()
        # The beat's sweep, here by hand: the restart taken as far as it goes until it has ended.
        wait_until(lambda: rollouts.advance("tiny") is None and pair_of(), 2 * LOAD_TIMEOUT, "the restart to end")
        load.wait_for(len(load.results) + 4)

    assert load.results and all(status == 200 for status, _ in load.results), [
        body for status, body in load.results if status != 200
    ]
    active, standby = wait_until(pair_of, LOAD_TIMEOUT, "the new pair")
    assert not {active.id, standby.id} & before, "both members started since"
    assert list(Occupant.objects.values_list("replica_id", flat=True)) == [active.id]
    assert Event.objects.filter(
        kind="failover.switchover", replica__in=before, reason__contains="rolling restart"
    ).exists(), "its active stepped down to the new standby"


# One pair for a planned switchover and, once its pair is whole again, a rolling restart: each
# of its replica processes takes seconds to load.
def test_a_planned_switchover_and_a_rolling_restart_move_the_pair_to_new_members_serving_throughout(paired, staff):
    active, standby = paired
    response = staff.post("/api/deployments/tiny/failover/")
    assert response.status_code == 200, response.json()

    taken_over = wait_until(
        lambda: (r := Replica.objects.get(pk=standby.id)).state == "serving" and r, 60, "the standby to take over"
    )
    stepped_down = wait_until(lambda: (r := Replica.objects.get(pk=active.id)).state == "stopped" and r, 60, "exit")
    assert stepped_down.failover_state == "dead" and taken_over.epoch == 2
    assert Event.objects.filter(kind="failover.switchover", replica=active.id).exists()
    new_active, _ = wait_until(pair_of, LOAD_TIMEOUT, "a fresh standby")
    assert new_active.id == standby.id
    assert list(Occupant.objects.values_list("replica_id", flat=True)) == [standby.id]
    a_rolling_restart_replaces_both_members_under_load_with_no_request_failed(staff)


def scaling_a_pair_down_stops_both_members_and_releases_the_memory(paired, staff, pairs) -> None:
    active, standby = paired
    assert staff.post("/api/deployments/tiny/scale/", {"replicas": 0}, format="json").status_code == 200

    wait_until(lambda: set(Replica.objects.values_list("state", flat=True)) == {"stopped"}, 60, "both members to stop")
    assert not Occupant.objects.exists()
    # The standby stopped with its active member: it never took over.
    assert FailoverLease.objects.get().epoch == 1 and FailoverLease.objects.get().holder_id == active.id
    assert Replica.objects.get(pk=standby.id).failover_state == "dead"
    # The agent closed the pair before the stops, and forgets its files once both have exited
    # (after their reports, which the books above followed).
    wait_until(lambda: list(pairs.iterdir()) == [], 30, "the agent to forget the pair's files")


# One pair for the look at a fresh pair, which changes nothing of it, and the scale-down that ends
# it: its two replica processes take most of a test's time to load.
def test_a_pair_shares_one_reservation_and_scaling_it_down_stops_both_members_and_releases_the_memory(
    paired, staff, tmp_path
):
    pairs = tmp_path / "replicas" / "e2e" / failover.LOCKS_FOLDER  # the agent's folder of pair locks
    a_failover_deployment_runs_an_active_and_a_standby_that_share_one_reservation(paired, staff, pairs)
    scaling_a_pair_down_stops_both_members_and_releases_the_memory(paired, staff, pairs)
