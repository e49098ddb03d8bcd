"""A replica process's own log, read on its node (`gpuportal logs REPLICA`): the control
plane asks the node's agent on the node's queue and waits for the last lines. Here the agent's task
runs on a thread, as its worker would, over the real Redis."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from inference import agent
from scheduling.services import dispatch
from tests.support import factories as f

pytestmark = pytest.mark.django_db


class NodeAgent:
    """Takes what the control plane sends to a node's queue, as the agent's worker would."""

    def __init__(self, log_dir: Path, answer: bool = True):
        self.log_dir, self.answer = log_dir, answer
        self.sent: list[tuple[str, str]] = []

    def log_path(self, replica_id: str) -> Path:  # as inference.supervisor.Supervisor's
        return self.log_dir / f"replica-{replica_id}.log"

    def send_task(self, name: str, *, args: list, queue: str, expires: float) -> None:
        self.sent.append((name, queue))
        if self.answer:
            from inference.tasks import replica_log

            threading.Thread(target=replica_log, args=(args[0],)).start()


@pytest.fixture
def node_agent(monkeypatch, tmp_path) -> NodeAgent:
    stand_in = NodeAgent(tmp_path)
    monkeypatch.setattr(dispatch.app, "send_task", stand_in.send_task)
    monkeypatch.setattr(agent, "supervisor", lambda: stand_in)
    return stand_in


def test_staff_read_the_last_lines_of_a_replicas_log_from_its_node(staff, node_agent):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    node_agent.log_path(replica.id).write_text("".join(f"line {n}\n" for n in range(500)))

    answer = staff.get(f"/api/replicas/{replica.id}/logs/?tail=3")

    assert answer.status_code == 200, answer.json()
    assert answer.json() == {
        "replica": replica.id,
        "node": "node1",
        "path": str(node_agent.log_path(replica.id)),
        "lines": ["line 497", "line 498", "line 499"],
        "missing": False,
    }
    assert node_agent.sent == [("inference.tasks.replica_log", "node.node1")]


def test_a_replica_never_started_there_says_its_log_is_missing(staff, node_agent):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="pending")

    answer = staff.get(f"/api/replicas/{replica.id}/logs/").json()

    assert answer["missing"] is True and answer["lines"] == []


def test_a_replica_on_no_node_is_a_409_and_others_than_staff_get_a_403(staff, node_agent):
    parked = f.replica(f.deployment("tiny-a"), None, state="parked")
    assert staff.get(f"/api/replicas/{parked.id}/logs/").status_code == 409
    viewer = APIClient()
    viewer.force_authenticate(User.objects.create_user("viewer"))
    assert viewer.get(f"/api/replicas/{parked.id}/logs/").status_code == 403
    assert staff.get(f"/api/replicas/{parked.id}/logs/?tail=0").status_code == 400
    assert node_agent.sent == []


def test_an_agent_that_does_not_answer_makes_it_a_503_not_a_hang(staff, node_agent, monkeypatch):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    node_agent.answer = False
    monkeypatch.setattr(dispatch, "LOG_TIMEOUT_S", 0.3)

    answer = staff.get(f"/api/replicas/{replica.id}/logs/")

    assert answer.status_code == 503 and "node node1's agent" in answer.json()["detail"]
