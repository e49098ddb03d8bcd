"""Pulling a Hugging Face model into the nodes' caches ahead of a deploy (`gpuportal pull`,
`POST /api/models/pull/`, scheduling.services.pulls, inference.pull): asked of each running node,
done by the node's own task (inference.tasks.pull_model, called here as its agent would), and
followed through the progress each node writes to the real Redis. No network: the cache is laid out
on disk as the hub's downloads leave it (tests/support/hub.py), and the hub's address is a port
nothing listens on, so a model missing from the cache meets a hub that cannot be reached."""

from __future__ import annotations

import io
import threading

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rich.console import Console

from gpuportal.cli import app, pulling
from gpuportal.wire.pulls import PULL_TASK, PullProgress, parse_model
from inference import pull as node_pull
from inference import tasks
from scheduling.models import Node
from tests.support.hub import REVISION, cache_model, use_cache

pytestmark = pytest.mark.django_db


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_model_dir):
    """This process's Hugging Face cache, holding acme/tiny, and a hub that cannot be reached."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    use_cache(monkeypatch, cache)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache_model(cache, "acme/tiny", tiny_model_dir, link=True)


def asks(dispatched) -> dict[str, dict]:
    """{node queue: the PullModel payload} of what was sent."""
    return {queue: args[0] for queue, task, args in dispatched if task == PULL_TASK}


def test_a_pull_is_asked_of_every_running_node_and_each_says_where_it_keeps_the_model(
    cluster, api, staff, dispatched, hub
):
    answer = api("post", "/api/models/pull/", {"model": "hf:acme/tiny"})

    assert answer.status_code == 202, answer.json()
    body = answer.json()
    assert (body["model"], body["revision"], body["state"]) == ("acme/tiny", None, "queued")
    assert {node: said["state"] for node, said in body["nodes"].items()} == {"node1": "queued", "node2": "queued"}
    assert set(asks(dispatched)) == {"node.node1", "node.node2"}, "one ask on each node's own queue"

    for payload in asks(dispatched).values():  # each node's agent runs its task
        assert tasks.pull_model(payload) == f"done: {hub}"

    done = staff.get(body["url"]).json()
    assert done["state"] == "done"
    files = sum(1 for p in hub.rglob("*") if p.is_file())
    for said in done["nodes"].values():
        assert (said["state"], said["percent"], said["path"], said["files"]) == ("done", 100, str(hub), files)


def test_a_model_the_hub_cannot_send_fails_saying_how_to_copy_it_in_by_hand(cluster, api, staff, dispatched, hub):
    body = api("post", "/api/models/pull/", {"model": "acme/absent@v2", "node": "node1"}).json()
    assert body["revision"] == "v2" and list(body["nodes"]) == ["node1"]

    (payload,) = asks(dispatched).values()
    assert tasks.pull_model(payload).startswith("failed: cannot reach the Hugging Face hub")

    failed = staff.get(body["url"]).json()
    assert failed["state"] == "failed"
    error = failed["nodes"]["node1"]["error"]
    assert error.startswith(
        "cannot reach the Hugging Face hub (http://127.0.0.1:1) from this node to fetch acme/absent@v2"
    )
    assert "`hf download acme/absent --revision v2 --cache-dir DIR`" in error
    assert f"into this node's cache ({hub.parents[2]})" in error


def test_a_pull_goes_to_a_drained_node_but_not_to_one_whose_agent_is_gone(cluster, api, dispatched, hub):
    Node.objects.filter(name="node1").update(status=Node.Status.DRAINING)
    Node.objects.filter(name="node2").update(status=Node.Status.OFFLINE)

    body = api("post", "/api/models/pull/", {"model": "acme/tiny"}).json()
    assert list(body["nodes"]) == ["node1"]

    refused = api("post", "/api/models/pull/", {"model": "acme/tiny", "node": "node2"})
    assert refused.status_code == 409 and refused.json()["detail"] == (
        "node node2 is offline: its agent is not running to pull"
    )
    Node.objects.filter(name="node1").update(status=Node.Status.OFFLINE)
    none = api("post", "/api/models/pull/", {"model": "acme/tiny"})
    assert none.status_code == 409 and "no node is online to pull to" in none.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "not a name"}, 400, {"model": ["'not a name' is not a Hugging Face model name: write org/name"]}),
        ({"model": "acme/tiny@bad rev"}, 400, {"model": ["'acme/tiny@bad rev': the revision after @ must be"]}),
        ({"model": "acme/tiny", "node": "gpu-9"}, 404, {"detail": "no node named 'gpu-9' (nodes: node1, node2)"}),
        ({"model": "acme/tiny", "nodes": ["node1"]}, 400, {"nodes": ["unknown field"]}),
        ({}, 400, {"model": ["This field is required."]}),
    ],
)
def test_a_pull_it_cannot_ask_is_refused_naming_what_is_wrong_and_asks_nothing(
    cluster, api, dispatched, body, status, says
):
    answer = api("post", "/api/models/pull/", body)

    assert answer.status_code == status
    for field, expected in says.items():
        got = answer.json()[field]
        if isinstance(expected, list):
            assert got[0].startswith(expected[0]), got
        else:
            assert got == expected
    assert asks(dispatched) == {}


def test_a_pull_that_is_not_there_is_a_404_and_staff_alone_may_pull(cluster, staff, client):
    missing = staff.get("/api/models/pulls/0123abcd/")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("no pull '0123abcd'")
    user = User.objects.create_user("alice")
    token = Token.objects.create(user=user)
    refused = client.post(
        "/api/models/pull/",
        {"model": "acme/tiny"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {token}",
    )
    assert refused.status_code == 403


def test_model_names_read_as_the_hub_writes_them():
    assert parse_model("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_model(" hf:acme/tiny@" + REVISION) == ("acme/tiny", REVISION)
    assert parse_model("acme/tiny@refs/pr/1") == ("acme/tiny", "refs/pr/1")
    # The hub's oldest models have no org, and it serves them by those names still.
    assert parse_model("gpt2") == ("gpt2", None)
    assert parse_model("hf:distilgpt2@main") == ("distilgpt2", "main")
    bad_names = ("/acme/tiny", "-acme", "acme/-tiny", "acme tiny", "../tiny", "pkg.mod:factory", "acme/tiny/extra")
    for bad in (*bad_names, "acme/tiny@", "hf:"):
        with pytest.raises(ValueError):
            parse_model(bad)


def test_the_progress_counts_the_bytes_of_the_hubs_byte_bars_only(monkeypatch):
    # As huggingface_hub draws them: a file-count bar, and a byte bar whose total grows as each
    # file's download starts (then a refresh), updated with every chunk written.
    monkeypatch.setattr(node_pull, "REPORT_EVERY_S", 0)
    said: list[PullProgress] = []
    counted = node_pull._Bytes(said.append)
    gauge = node_pull._gauge(counted)
    files = gauge(total=2, desc="Fetching 2 files")
    written = gauge(desc="Reconstructing (incomplete total...)", total=0, initial=0, unit="B", unit_scale=True)
    for size in (300, 700):
        written.total += size
        written.refresh()
    written.update(250)
    files.update(1)
    written.update(750)

    assert [(p.state, p.done_bytes, p.total_bytes) for p in said][-1] == ("downloading", 1000, 1000)
    assert [p.percent for p in said if p.done_bytes] == [25, 99], "never 100 % before the pull is done"


@pytest.mark.django_db(transaction=True)
def test_gpuportal_pull_shows_each_nodes_progress_then_where_it_keeps_the_model(
    live_server, cluster, dispatched, hub, monkeypatch, capsys
):
    from gpuportal.celery import app as celery_app

    asked = threading.Event()
    record = celery_app.send_task

    def send_task(*args, **kwargs):
        record(*args, **kwargs)
        if len(asks(dispatched)) == 2:  # both nodes asked
            asked.set()

    monkeypatch.setattr(celery_app, "send_task", send_task)
    monkeypatch.setattr(pulling, "POLL_S", 0.05)
    token = Token.objects.create(user=User.objects.create_user("ops", is_staff=True)).key

    def node_agents() -> None:  # each node's agent takes its ask and pulls
        asked.wait(30)
        for payload in asks(dispatched).values():
            tasks.pull_model(payload)

    agents = threading.Thread(target=node_agents, daemon=True)
    agents.start()
    code = app.main(
        ["pull", "acme/tiny", "--timeout", "60"], env={"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": token}
    )
    agents.join(30)

    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines() == [
        f"node1: acme/tiny in {hub} ({sum(1 for p in hub.rglob('*') if p.is_file())} files)",
        f"node2: acme/tiny in {hub} ({sum(1 for p in hub.rglob('*') if p.is_file())} files)",
        "deploy it with: gpuportal deploy NAME hf:acme/tiny",
    ]
    # Away from a terminal, a line per node and state it passed through.
    assert "acme/tiny → node1: queued 0 %" in err and "acme/tiny → node1: done 100 %" in err


def test_a_pull_that_failed_on_a_node_is_its_error_and_exit_1():
    out, err = Console(file=io.StringIO()), Console(file=io.StringIO())
    answer = {
        "model": "acme/absent",
        "nodes": {
            "node1": {"state": "failed", "error": "cannot reach the Hugging Face hub"},
            "node2": {"state": "done", "path": "/cache/snap", "files": 3},
        },
    }

    assert pulling.show_pull(answer, out, err) == 1
    assert out.file.getvalue() == "node2: acme/absent in /cache/snap (3 files)\n"
    assert err.file.getvalue() == "node1: acme/absent not pulled: cannot reach the Hugging Face hub\n"
