"""A replica process's own log, read on its node (`gpuportal logs REPLICA`): the control
plane asks the node's agent on the node's queue and waits for the last lines, or for those written
since an offset (`gpuportal logs --follow`). Here the agent's task runs on a thread, as its worker
would, over the real Redis."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from rich.console import Console

from gpuportal.cli import app
from gpuportal.wire.commands import WireError
from gpuportal.wire.replica_logs import MAX_LOG_BYTES, ReadLog, whole_lines
from inference import agent
from scheduling.models import Replica
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
        "state": "serving",
        "path": str(node_agent.log_path(replica.id)),
        "lines": ["line 497", "line 498", "line 499"],
        "missing": False,
        "end": node_agent.log_path(replica.id).stat().st_size,
        "skipped": 0,
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


# -- following ----------------------------------------------------------------------------------


def test_a_follower_reads_the_whole_lines_written_since_its_offset_and_waits_for_a_half_written_one(staff, node_agent):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    log = node_agent.log_path(replica.id)
    log.write_bytes(b"loaded\n")
    url = f"/api/replicas/{replica.id}/logs/"
    end = staff.get(url).json()["end"]

    assert staff.get(url, {"since": end}).json()["lines"] == []
    with log.open("ab") as out:
        out.write(b"serving\nhalf a li")
    read = staff.get(url, {"since": end}).json()
    assert (read["lines"], read["end"]) == (["serving"], len(b"loaded\nserving\n"))
    with log.open("ab") as out:
        out.write(b"ne\r\n")
    assert staff.get(url, {"since": read["end"]}).json()["lines"] == ["half a line"]

    log.write_bytes(b"a new process\n")  # the replica started anew: a shorter file
    assert staff.get(url, {"since": read["end"]}).json()["lines"] == ["a new process"]
    assert staff.get(url, {"since": -1}).status_code == 400


def test_a_follower_far_behind_is_told_what_it_skipped(staff, node_agent):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    line = b"x" * 99 + b"\n"
    node_agent.log_path(replica.id).write_bytes(line * (3 * MAX_LOG_BYTES // len(line)))

    read = staff.get(f"/api/replicas/{replica.id}/logs/", {"since": 0}).json()

    size = node_agent.log_path(replica.id).stat().st_size
    assert read["skipped"] == size - MAX_LOG_BYTES and read["end"] == size
    assert 0 < len(read["lines"]) <= MAX_LOG_BYTES // len(line) + 1


def test_a_read_from_an_offset_survives_the_wire_and_one_without_reads_as_before():
    follower = ReadLog("r1", 200, "gp:reply:log:1", since=4096)
    assert ReadLog.decode(follower.encode()) == follower
    earlier = {"v": follower.encode()["v"], "replica_id": "r1", "tail": 200, "reply_to": "gp:reply:log:1"}
    assert ReadLog.decode(earlier).since is None, "a control plane of an earlier release asks for the tail"
    with pytest.raises(WireError, match="negative offset"):
        ReadLog.decode({**earlier, "since": -5})


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=8))
def test_reads_as_a_log_grows_give_its_lines_once_each_as_one_read_would(content, sizes):
    end, lines = 0, []
    for size in [*sorted(sizes), len(content)]:
        size = max(end, min(size, len(content)))
        got, end = whole_lines(content[end:size], end)
        lines += got

    assert lines == content[:end].decode(errors="replace").splitlines()
    assert content[end:].count(b"\n") == 0, "nothing but a half-written line is left"


def operator_at(live_server) -> tuple[app.Context, io.StringIO]:
    """The command line of a staff user against the live server, and what it prints."""
    staff = User.objects.create_user("ops", is_staff=True)
    env = {"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": Token.objects.create(user=staff).key}
    out = io.StringIO()
    return app.Context(env, Console(file=out, highlight=False, soft_wrap=True), Console(file=io.StringIO())), out


@pytest.mark.django_db(transaction=True)
def test_logs_follow_prints_each_line_the_process_writes_until_it_ends(live_server, node_agent):
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    log = node_agent.log_path(replica.id)
    log.write_text("loading\nserving\n")
    ctx, out = operator_at(live_server)
    args = app.build_parser().parse_args(["logs", replica.id, "--follow", "--tail", "5"])
    written = iter(
        [
            lambda: log.open("a").write("request 1 done\nrequest 2 ha"),
            lambda: log.open("a").write("lf done\nstopping\n"),
            lambda: Replica.objects.filter(pk=replica.id).update(state="stopped"),
        ]
    )

    def pause(seconds: float) -> None:  # what the process does while the follower waits
        next(written)()

    assert app.cmd_logs(ctx, args, pause=pause, polls=10) == 0

    shown = out.getvalue().splitlines()
    assert shown[-6:] == [
        "loading",
        "serving",
        "request 1 done",
        "request 2 half done",
        "stopping",
        f"(replica {replica.id} has ended)",
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("portal", ["this release", "an earlier release"])
def test_logs_follow_asks_once_a_round_and_reads_the_lines_written_before_the_end(
    live_server, node_agent, monkeypatch, portal
):
    from scheduling.services import replicas as replica_services

    if portal == "an earlier release":  # its log answer has no state: the follower asks for it
        log_of = replica_services.log_of
        monkeypatch.setattr(
            replica_services, "log_of", lambda *a: {k: v for k, v in log_of(*a).items() if k != "state"}
        )
    replica = f.replica(f.deployment("tiny-a"), f.node("node1"), state="serving")
    log = node_agent.log_path(replica.id)
    log.write_text("loading\n")
    ctx, out = operator_at(live_server)
    asked: list[str] = []
    get = ctx.client.get
    monkeypatch.setattr(ctx.client, "get", lambda path, params=None: (asked.append(path), get(path, params))[1])

    rounds = iter(
        [
            # What the process writes as it stops, then its end: in one round, between two reads.
            lambda: (log.open("a").write("stopping\n"), Replica.objects.filter(pk=replica.id).update(state="stopped")),
            lambda: None,
        ]
    )

    assert app.follow_log(ctx, replica.id, len("loading\n"), 1.0, lambda s: next(rounds)(), polls=5) == 0

    assert out.getvalue().splitlines() == ["stopping", f"(replica {replica.id} has ended)"]
    logs, states = f"/api/replicas/{replica.id}/logs/", f"/api/replicas/{replica.id}/"
    assert asked == ([logs] if portal == "this release" else [logs, states, logs])


@pytest.mark.django_db(transaction=True)
def test_logs_follow_waits_for_a_replica_on_no_node_to_be_placed_then_follows_it(live_server, node_agent):
    replica = f.replica(f.deployment("tiny-a"), None, state="pending")
    node = f.node("node1")
    ctx, out = operator_at(live_server)
    args = app.build_parser().parse_args(["logs", replica.id, "-f"])
    log = node_agent.log_path(replica.id)
    happens = iter(
        [
            lambda: None,  # still waiting for a GPU
            lambda: Replica.objects.filter(pk=replica.id).update(node=node, state="loading"),
            lambda: log.write_text("loading weights\n"),
            lambda: Replica.objects.filter(pk=replica.id).update(state="failed"),
        ]
    )

    assert app.cmd_logs(ctx, args, pause=lambda s: next(happens)(), polls=10) == 0

    shown = out.getvalue().splitlines()
    assert "(on no node yet: waiting for it to be placed)" in shown
    assert shown[-2:] == ["loading weights", f"(replica {replica.id} has ended)"]


@pytest.mark.django_db(transaction=True)
def test_logs_of_a_deployments_name_shows_its_serving_replica_and_says_which_of_several(live_server, node_agent):
    node = f.node("node1")
    alone = f.replica(f.deployment("tiny-a"), node, state="serving")
    busy = f.deployment("tiny-b")
    loading = f.replica(busy, node, state="loading")
    serving = f.replica(busy, node, state="serving")
    node_agent.log_path(serving.id).write_text("serving\n")
    ctx, out = operator_at(live_server)
    err = ctx.err.file

    assert app.cmd_logs(ctx, app.build_parser().parse_args(["logs", "tiny-a", "--tail", "1"])) == 0
    assert out.getvalue().startswith(f"replica {alone.id} of tiny-a: serving on node1\n")
    assert err.getvalue() == "", "one replica: nothing to say about which"

    out.truncate(0), out.seek(0)
    assert app.cmd_logs(ctx, app.build_parser().parse_args(["logs", "tiny-b", "--tail", "1"])) == 0
    assert out.getvalue().startswith(f"replica {serving.id} of tiny-b: serving on node1\n")
    assert out.getvalue().splitlines()[-1] == "serving", "then its process's own log"
    assert err.getvalue() == (f"tiny-b has 2 replicas: showing {serving.id[:8]} (the others: {loading.id[:8]})\n"), (
        "the serving one first, and which it is on stderr (stdout stays the log)"
    )

    with pytest.raises(app.CliError, match=r"^no replica or deployment named 'tiny-c' \(`gpuportal ls` lists both\)$"):
        app.cmd_logs(ctx, app.build_parser().parse_args(["logs", "tiny-c"]))
