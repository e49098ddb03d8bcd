"""`gpuportal nodes` and `gpuportal node drain/undrain`: the nodes as an operator reads them, and a
drain that waits until nothing is awake on the node but what never sleeps. Against the real API
(a live server on the test database), with replicas that report as their processes would."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from rich.console import Console

from gpuportal.cli import app, nodes, render
from gpuportal.cli.client import CliError
from scheduling.models import Node, Replica
from scheduling.services import reports
from tests.support.api_shapes import shaped
from tests.support.deployments import body, serve


@pytest.fixture
def operator(live_server) -> dict[str, str]:
    """The command line's environment: the live server's address and a staff user's token."""
    staff = User.objects.create_user("ops", is_staff=True)
    return {"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": Token.objects.create(user=staff).key}


def spread_over_both_nodes(tiny_model_dir) -> dict[str, str]:
    """`tiny-a`, a replica serving on each node: {node: replica id}."""
    staff = APIClient()
    staff.force_authenticate(User.objects.get(username="ops"))
    created = staff.post(
        "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2, placement={"spread": True}), format="json"
    )
    assert created.status_code == 201, created.json()
    on = {}
    for replica in Replica.objects.select_related("node"):
        serve(replica.id)
        on[replica.node.name] = replica.id
    assert set(on) == {"node1", "node2"}
    return on


real_drained = nodes.drained


def rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}


@pytest.mark.django_db(transaction=True)
def test_drain_waits_until_the_nodes_replicas_sleep_and_nodes_shows_where_each_node_stands(
    cluster, dispatched, tiny_model_dir, operator, capsys, monkeypatch
):
    on = spread_over_both_nodes(tiny_model_dir)

    assert app.main(["nodes"], env=operator) == 0
    listed = capsys.readouterr().out
    head = ["NAME", "STATUS", "LAST", "BEAT", "GPUS", "RESERVED", "REPLICAS", "HOST", "CACHE"]
    assert listed.splitlines()[0].split() == head
    assert set(rows(listed)) == {"node1", "node2"}
    assert "online" in rows(listed)["node1"] and "s ago" in rows(listed)["node1"]
    assert "2 virtual" in rows(listed)["node1"] and "1 serving" in rows(listed)["node1"]

    drained: dict[str, Any] = {}
    # The sleep is reported once the command has looked at the node (its state draining then):
    # reported before, the command would see no change of state to print.
    looked = threading.Event()

    def drained_looked_at(replicas: list[dict[str, Any]]) -> nodes.Drained:
        looked.set()
        return real_drained(replicas)

    monkeypatch.setattr(nodes, "drained", drained_looked_at)
    drain = threading.Thread(target=lambda: drained.update(code=app.main(["node", "drain", "node1"], env=operator)))
    drain.start()
    sleeper = on["node1"]
    assert looked.wait(30), "the command's first look at node1"
    assert Replica.objects.get(pk=sleeper).state == "draining", "the replica on node1 told to sleep"
    gpus = Replica.objects.get(pk=sleeper).gpu_mem_bytes_by_id
    reports.report(sleeper, {"event": "sleeping", "residual_bytes_by_id": dict.fromkeys(gpus, 0)})
    drain.join(60)

    said = capsys.readouterr().out
    assert drained == {"code": 0}, said
    assert f"tiny-a: {sleeper[:8]} sleeping node1\n" in said, "each change of state a line"
    assert said.splitlines()[-1].startswith("node node1 drained after ")
    assert said.splitlines()[-1].endswith(" s: nothing awake there")
    assert Replica.objects.get(pk=on["node2"]).state == "serving", "another node's replica serves on"

    assert app.main(["nodes"], env=operator) == 0
    listed = rows(capsys.readouterr().out)
    assert "draining" in listed["node1"] and "1 sleeping" in listed["node1"]
    assert "online" in listed["node2"] and "1 serving" in listed["node2"]

    assert app.main(["node", "undrain", "node1"], env=operator) == 0
    assert capsys.readouterr().out == "node node1 is back in service: placement may use it again\n"
    assert Node.objects.get(name="node1").status == "online"
    assert app.main(["node", "undrain", "node1"], env=operator) == 1
    assert capsys.readouterr().err == "error: node node1 is online, not draining\n"
    assert app.main(["node", "drain", "nope"], env=operator) == 1
    assert capsys.readouterr().err == "error: no node named 'nope'\n"


@pytest.mark.django_db(transaction=True)
def test_drain_without_waiting_returns_at_once_saying_what_happens(
    cluster, dispatched, tiny_model_dir, operator, capsys
):
    on = spread_over_both_nodes(tiny_model_dir)

    assert app.main(["node", "drain", "node2", "--no-wait"], env=operator) == 0

    assert capsys.readouterr().out == (
        "node node2 draining: nothing new lands there, and what serves there goes to sleep\n"
    )
    assert Replica.objects.get(pk=on["node2"]).state == "draining"


@pytest.mark.django_db(transaction=True)
def test_drain_move_without_waiting_asks_for_a_move_and_says_so(cluster, dispatched, tiny_model_dir, operator, capsys):
    on = spread_over_both_nodes(tiny_model_dir)

    assert app.main(["node", "drain", "node2", "--move", "--no-wait"], env=operator) == 0

    assert capsys.readouterr().out == (
        "node node2 draining: nothing new lands there, and what serves there moves to other nodes\n"
    )
    assert Replica.objects.get(pk=on["node2"]).state == "serving", "it serves until its replacement does"
    assert Replica.objects.filter(node__name="node1", state="pending").count() == 1, "its replacement"


# -- where a draining node stands, from its replicas -------------------------------------------


def replica(id_: str, state: str, **more: Any) -> dict[str, Any]:
    return shaped(
        "Replica", {"id": id_, "deployment": "tiny", "state": state, "node": "box", "gpu_indexes": [0], **more}
    )


def test_a_node_is_drained_when_nothing_is_awake_there_but_a_failover_pairs_active_member():
    assert nodes.drained([replica("a", "sleeping"), replica("b", "deep_sleeping"), replica("c", "stopped")]).done
    waiting = nodes.drained([replica("a", "draining"), replica("b", "sleeping")])
    assert not waiting.done and waiting.moving
    stuck = nodes.drained([replica("a", "serving")])
    assert not stuck.done and not stuck.moving
    pair = {"pair": 1, "lease_epoch": 1}
    paired = nodes.drained(
        [
            replica("a", "serving", failover_state={**pair, "state": "active", "holder": True}),
            replica("b", "standby", failover_state={**pair, "state": "standby", "holder": False}),
        ]
    )
    assert paired.done and [r["id"] for r in paired.kept] == ["a"]


@pytest.mark.django_db
def test_a_failover_pair_as_the_api_shows_it_is_kept_serving_by_a_drain():
    from scheduling.api.serializers import ReplicaSerializer
    from scheduling.models import FailoverLease
    from tests.support import factories as f

    node = f.node("box")
    dep = f.deployment("duo", failover_standby=True)
    active = f.replica(dep, node, state="serving", failover_state="active")
    lease = FailoverLease.objects.create(deployment=dep, holder=active, epoch=1)
    standby = f.replica(dep, node, state="standby", failover_state="standby", lease=lease, role="standby")
    Replica.objects.filter(pk=active.pk).update(lease=lease)
    shown = ReplicaSerializer(Replica.objects.filter(pk__in=[active.pk, standby.pk]), many=True).data

    where = nodes.drained([dict(r) for r in shown])

    assert where.done and [r["id"] for r in where.kept] == [active.id]


class Replay:
    """Answers each list with the next of a list of answers (the last one for ever)."""

    def __init__(self, answers: list[list[dict[str, Any]]]):
        self.answers = answers

    def pages(self, path: str, params: Any = None) -> Iterator[dict[str, Any]]:
        assert (path, params) == ("/api/replicas/", {"node": "box"})
        yield from self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def wait_on_box(replicas: list[dict[str, Any]], *, timeout_s: float, tick_s: int) -> nodes.Drained:
    """A drain of node `box` whose replicas stand so for ever, its clock moving `tick_s` a poll."""
    clock = iter(range(0, 100_000, tick_s))
    return nodes.wait_until_drained(
        Replay([replicas]),  # type: ignore[arg-type]
        "box",
        console=Console(file=io.StringIO()),
        timeout_s=timeout_s,
        clock=lambda: next(clock),
        pause=lambda s: None,
    )


def test_a_drain_whose_replicas_stay_serving_with_nothing_on_its_way_says_so():
    with pytest.raises(CliError, match=r"node box: 1 serving that do not go to sleep: see `gpuportal events -n box`"):
        wait_on_box([replica("a", "serving")], timeout_s=600, tick_s=5)


class Moving(Replay):
    """A node whose serving replica its deployment moves (a rollout under way) for `polls` polls."""

    def __init__(self, answers: list[list[dict[str, Any]]], *, rollout: dict[str, Any] | None):
        super().__init__(answers)
        self.rollout = rollout
        self.asked: list[str] = []

    def get(self, path: str, params: Any = None) -> dict[str, Any]:
        self.asked.append(path)
        return {"name": "tiny", "rollout": self.rollout}


def wait_moving(client: Moving) -> nodes.Drained:
    """A drain of node `box` with --move, its clock moving 5 s a poll."""
    clock = iter(range(0, 100_000, 5))
    return nodes.wait_until_drained(
        client,  # type: ignore[arg-type]
        "box",
        console=Console(file=io.StringIO()),
        timeout_s=600,
        moving=True,
        clock=lambda: next(clock),
        pause=lambda s: None,
    )


def test_a_drain_that_moves_waits_while_the_replicas_deployment_moves_them_however_long_they_serve():
    serving = [replica("a", "serving")]
    polls = [serving] * 40 + [[replica("a", "stopped")]]  # 200 s serving on the node, then stopped
    client = Moving(polls, rollout={"since": "2026-11-30T12:00:00Z", "replaced": 1, "left": 1, "move": True})

    assert wait_moving(client).done and set(client.asked) == {"/api/deployments/tiny/"}
    with pytest.raises(CliError, match="1 serving that do not move or go to sleep"):
        wait_moving(Moving([serving], rollout=None))  # its move ended, and the replica still serves there


def test_a_drain_that_moves_waits_for_a_failover_pair_moving_as_a_new_pair_elsewhere():
    pair = {"pair": 1, "lease_epoch": 1}
    active = replica("a", "serving", failover_state={**pair, "state": "active", "holder": True})
    polls = [[active]] * 5 + [[replica("a", "stopped")]]
    client = Moving(polls, rollout={"since": "2026-11-30T12:00:00Z", "replaced": 2, "left": 2, "move": True})

    where = wait_moving(client)

    assert where.done and not where.kept, "waited until the pair stopped, not done at once as a kept pair"
    assert wait_moving(Moving([[active]], rollout=None)).kept == [active], "a pair not moving is kept"


def test_a_drain_that_runs_out_of_time_says_where_the_node_stands():
    with pytest.raises(CliError, match=r"node box: still 1 draining after 150 s; the portal goes on"):
        wait_on_box([replica("a", "draining")], timeout_s=150, tick_s=100)


def test_a_nodes_row_names_other_tenants_apart_from_its_warm_spare():
    node = {"name": "box", "status": "online", "heartbeat_age_s": 125.0, "gpu_count": 1, "virtual": False}
    node = shaped("Node", node | {"host_cache_used_bytes": 0, "host_cache_budget_bytes": 8 << 30})
    gpu = {"node": "box", "total_bytes": 80 << 30, "reserved_bytes": 10 << 30}
    gpu = shaped("GPU", gpu | {"foreign_bytes": 3 << 30, "spare_bytes": 1 << 30})
    out = io.StringIO()
    Console(file=out, width=200).print(render.nodes_table([node], [gpu], [replica("a", "serving")]))

    (row,) = out.getvalue().splitlines()[1:]
    assert row.split() == [
        *("box", "online", "2", "min", "ago", "1"),
        *("10.0", "/", "80.0", "GiB,", "other", "tenants", "2.0", "GiB"),
        *("1", "serving", "0", "B", "/", "8.0", "GiB"),
    ]


@pytest.mark.django_db(transaction=True)
def test_node_rm_removes_an_offline_node_and_prints_why_an_online_one_stays(cluster, operator, capsys):
    from scheduling.services import nodes as node_services

    node_services.mark_stopped("node1", "host retired")

    assert app.main(["node", "rm", "node1"], env=operator) == 0
    assert capsys.readouterr().out == (
        "removed node node1: its GPUs left the books (its agent, started again, registers it anew)\n"
    )
    assert list(Node.objects.values_list("name", flat=True)) == ["node2"]
    assert app.main(["node", "rm", "node2"], env=operator) == 1
    assert capsys.readouterr().err == (
        "error: node node2 is online: stop its agent, or revoke its credential (`gpuportal node revoke node2`), "
        "before removing it\n"
    )
