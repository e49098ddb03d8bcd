"""`manage.py up`: the whole portal on embedded servers, started and stopped for real."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
import redis

from gpuportal.stack import free_port
from gpuportal.stackenv import read_stack_env
from gpuportal.wire import memory
from tests.support.processes import wait_until
from tests.support.up import ROOT, Up, env_without_servers, processes_of

pytestmark = pytest.mark.slow


def test_up_boots_the_portal_stops_cleanly_on_sigterm_and_reuses_its_data(tmp_path):
    from inference.management.commands.make_tiny_model import write_tiny_model

    data_dir = tmp_path / "var"
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3, log=lambda _: None).path
    up = Up(data_dir, "--virtual-gpus", "2x2GiB", "--node", "box")
    try:
        up.wait_up()
        assert up.get("/healthz") == (200, {"status": "ok"})
        assert up.get("/readyz")[0] == 200
        stack = read_stack_env(data_dir / "stack.env")
        assert stack["DATABASE_URL"].startswith("postgres://") and stack["REDIS_URL"].startswith("redis://")
        # The embedded servers ask for passwords of their own: any local user can reach
        # a loopback port. Only the stack's owner reads them; the banner does not show them.
        assert (data_dir / "stack.env").stat().st_mode & 0o777 == 0o600
        postgres, redis_server = urlsplit(stack["DATABASE_URL"]), urlsplit(stack["REDIS_URL"])
        assert postgres.password and redis_server.password
        assert not any(postgres.password in line or redis_server.password in line for line in up.lines)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(f"postgres://postgres@127.0.0.1:{postgres.port}/gpuportal", connect_timeout=5)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError), match=r"(?i)auth"):
            redis.Redis(host="127.0.0.1", port=redis_server.port).ping()
        assert any("created (password from GPUPORTAL_ADMIN_PASSWORD)" in line for line in up.lines)
        assert (data_dir / "secret-key").stat().st_mode & 0o777 == 0o600, "a key of its own, not the public one"
        assert not any("SECRET_KEY is the public default" in line for line in up.lines)

        token = up.token()
        gpus = wait_until(
            lambda: up.get("/api/gpus/", token)[1].get("results"), 60, "the node agent to register its GPUs"
        )
        # Each declared 2 GiB is NVML's total; the books count what CUDA could allocate.
        reserve = memory.H100_DRIVER_RESERVE_BYTES
        assert [(g["node"], g["index"], g["virtual"], g["total_bytes"], g["nvml_total_bytes"]) for g in gpus] == [
            ("box", 0, True, 2 * 1024**3 - reserve, 2 * 1024**3),
            ("box", 1, True, 2 * 1024**3 - reserve, 2 * 1024**3),
        ]
        # `up` issued its own node's credential, in a file only its owner reads.
        assert (data_dir / "node-tokens" / "box").stat().st_mode & 0o777 == 0o600
        # An agent started beside `up` with no URLs set finds the stack through stack.env; it
        # needs a credential of its own (`up` runs them `required`).
        code, issued = up.post("/api/nodes/second/credential/", {}, token)
        assert code == 201, issued
        second = subprocess.Popen(
            [sys.executable, "manage.py", "agent", "--node", "second", "--virtual-gpus", "1x3GiB"],
            cwd=ROOT,
            env=env_without_servers(GPUPORTAL_DATA_DIR=str(data_dir), GPUPORTAL_NODE_TOKEN=issued["token"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            names = wait_until(
                lambda: {n["name"] for n in up.get("/api/nodes/", token)[1].get("results", [])} >= {"box", "second"},
                60,
                "the second agent to join the same stack",
            )
            assert names
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        # Popular: never slept early to make room for the wake of the deployment slept below.
        deployed = {"name": "tiny", "model": {"source": str(model)}, "replicas": 1, "fairness": {"popular": True}}
        code, answer = up.post("/api/deployments/", deployed, token)
        assert code == 201, answer
        (first,) = wait_until(lambda: up.serving(token, "tiny"), 120, "the deployment to serve")
        # A second deployment, put to sleep: it is to be asleep after the restart too.
        code, answer = up.post("/api/deployments/", {**deployed, "name": "nap", "fairness": {"popular": False}}, token)
        assert code == 201, answer
        wait_until(lambda: up.serving(token, "nap"), 120, "the second deployment to serve")
        assert up.post("/api/deployments/nap/sleep/", {}, token)[0] == 200

        def states_of(stack: Up, name: str) -> list[str]:
            return sorted(r["state"] for r in stack.get(f"/api/replicas/?deployment={name}", token)[1]["results"])

        wait_until(lambda: states_of(up, "nap") == ["sleeping"], 120, "the second deployment to sleep")
        running = processes_of(data_dir)
        # web, control worker (+ its pool), beat, agent, PostgreSQL (+ its workers), Redis
        assert len(running) >= 7, running

        # A second `up` on the same data refuses in one line, and leaves the running one alone:
        # its servers, and the stack.env through which agents find them.
        refused = Up(data_dir, "--virtual-gpus", "2x2GiB", "--node", "box")
        assert refused.process.wait(120) != 0
        refused.reader.join(10)
        assert "already running" in refused.process.stderr.read()
        assert read_stack_env(data_dir / "stack.env") == stack
        assert up.get("/healthz") == (200, {"status": "ok"})
    finally:
        code = up.stop()

    assert code == 0, up.process.stderr.read()
    assert processes_of(data_dir) == [], "nothing of the stack is left running"
    assert not (data_dir / "stack.env").exists(), "stack.env no longer points at stopped servers"

    again = Up(data_dir, "--virtual-gpus", "2x2GiB", "--node", "box")
    try:
        again.wait_up()
        assert any("exists (password unchanged)" in line for line in again.lines)
        token = again.token()  # the same admin, from the same database
        events = wait_until(
            lambda: again.get("/api/events/?node=box&kind=node.online", token)[1].get("results"),
            60,
            "the agent to re-register the known node",
        )
        assert events[0]["reason"].startswith("agent re-registered with 2 virtual GPU(s)")
        status, registered = again.get("/api/events/?node=box&kind=node.registered", token)
        assert status == 200 and registered["count"] == 1, "the node from the first run was kept"
        # What the operator asked for is restored without a request (this test sends
        # none): the replica of the first run (its process ended with its agent) is replaced once.
        (restored,) = wait_until(lambda: again.serving(token, "tiny"), 120, "the deployment to serve again")
        assert restored["id"] != first["id"]
        replicas = again.get("/api/replicas/?deployment=tiny", token)[1]["results"]
        assert sorted(r["state"] for r in replicas) == ["serving", "stopped"]
        # Asleep before the stop, asleep after the start: its sleeper parked, nothing loaded anew.
        assert states_of(again, "nap") == ["parked"]

        # The agent dies: `up` starts it again, and the new agent takes over the replica process
        # the old one left (it waits for its adoption window) instead of loading the model again.
        (agent,) = [c for c in psutil.Process(again.process.pid).children() if "agent" in c.cmdline()]
        agent.kill()
        adopted = wait_until(
            lambda: again.get("/api/events/?kind=replica.adopted", token)[1].get("results"),
            60,
            "the restarted agent to take the replica over",
        )
        assert adopted[0]["replica"] == restored["id"]
        assert any(line.startswith("agent was killed by SIGKILL; starting it again") for line in again.lines)
        (still,) = again.serving(token, "tiny")
        assert (still["id"], still["pid"]) == (restored["id"], restored["pid"]), "the same process, not a new one"
        code, answer = again.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3}, token)
        assert code == 200 and answer["choices"][0]["text"], answer
        replicas = again.get("/api/replicas/?deployment=tiny", token)[1]["results"]
        assert sorted(r["state"] for r in replicas) == ["serving", "stopped"], "adopted, not duplicated"

        # The adopted process killed: the agent that watches it is not its parent, but `up` reaped
        # it and recorded how it ended (gpuportal.orphans), so its failure names the signal.
        os.kill(still["pid"], signal.SIGKILL)

        def failed() -> dict | None:
            found = again.get(f"/api/replicas/{still['id']}/", token)[1]
            return found if found.get("state") == "failed" else None

        # A report waits up to 120 s for the control plane's answer (a loaded machine's agents worker).
        try:
            killed = wait_until(failed, 120, "the killed replica to be failed")
        except AssertionError as err:
            raise AssertionError(f"{err}\n{again.diagnosis(token, still['id'])}") from None
        assert "exited with code -9 (signal SIGKILL)" in killed["failure_reason"], killed

        # Every other process of `up` killed under load: tests/gpuportal/test_recovery.py.
        code, answer = again.post("/api/deployments/tiny/scale/", {"replicas": 1}, token)
        assert code == 200, answer
    finally:
        assert again.stop() == 0
    assert processes_of(data_dir) == [], "the adopted replica stopped with the portal"


def test_a_port_in_use_is_a_one_line_error_and_starts_nothing(tmp_path):
    data_dir = tmp_path / "var"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "manage.py", "up", "--port", str(port)],
            cwd=ROOT,
            env=env_without_servers(GPUPORTAL_DATA_DIR=str(data_dir)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"CommandError: port {port} on 127.0.0.1 is already in use (another `up`? try --port)"
    ]
    assert not (data_dir / "postgres").exists()
    assert processes_of(data_dir) == []


def test_an_unusable_data_directory_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = subprocess.run(
        [sys.executable, "manage.py", "up", "--port", str(free_port()), "--data-dir", str(blocker / "var")],
        cwd=ROOT,
        env=env_without_servers(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"CommandError: cannot use data directory {blocker / 'var'}: Not a directory"
    ]


def test_a_failed_initdb_is_told_by_its_cause_and_not_only_by_its_clean_up():
    from gpuportal.stack import _why_initdb_failed

    said = (
        'The files belonging to this database system will be owned by user "embedded_pg".\n'
        "creating subdirectories ... ok\n"
        'initdb: error: could not create directory "/v/data/pg_wal": No space left on device\n'
        'initdb: removing contents of data directory "/v/data"\n'
        "initdb: error: failed to remove contents of data directory\n"
    )
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=said)

    assert _why_initdb_failed(failed) == (
        'initdb: error: could not create directory "/v/data/pg_wal": No space left on device'
        " / initdb: error: failed to remove contents of data directory"
    )
    assert _why_initdb_failed(subprocess.CompletedProcess([], 1, stdout="", stderr="Killed\n")) == "Killed"
    assert _why_initdb_failed(subprocess.CompletedProcess([], -9, stdout="", stderr="")) == "exit code -9"


def test_a_child_that_fails_stops_the_whole_stack_with_a_one_line_error(tmp_path):
    data_dir = tmp_path / "var"
    up = Up(data_dir, "--node", "not a valid name")
    code = up.process.wait(180)
    up.reader.join(10)
    stderr = up.process.stderr.read()

    assert code == 1
    assert stderr.strip().splitlines() == [
        "CommandError: agent exited with code 1: CommandError: --node 'not a valid name' is not a valid node "
        "name: use letters, digits, '.', '-' and '_', starting with a letter or digit, at most 100"
    ]
    assert processes_of(data_dir) == [], "the servers and the other children were stopped"


def test_the_stack_keeps_a_secret_key_of_its_own_that_only_its_owner_reads(tmp_path):
    from django.conf import settings

    from gpuportal.up import kept_secret_key

    key = kept_secret_key(tmp_path / "secret-key")

    assert len(key) >= 50 and key != settings.PUBLIC_SECRET_KEY
    assert (tmp_path / "secret-key").stat().st_mode & 0o777 == 0o600
    assert kept_secret_key(tmp_path / "secret-key") == key, "the same key on the next start: sessions survive"


@pytest.mark.django_db
def test_a_generated_admin_password_is_kept_in_a_file_only_its_owner_reads_and_never_printed(tmp_path, monkeypatch):
    import io

    from django.contrib.auth.models import User
    from django.core.management import call_command

    monkeypatch.delenv("GPUPORTAL_ADMIN_PASSWORD", raising=False)
    monkeypatch.setenv("GPUPORTAL_ADMIN_PASSWORD_FILE", str(tmp_path / "admin-password"))
    said = io.StringIO()
    call_command("ensure_admin", stdout=said)

    password = (tmp_path / "admin-password").read_text().strip()
    assert (tmp_path / "admin-password").stat().st_mode & 0o777 == 0o600
    assert User.objects.get(username="admin").check_password(password)
    assert said.getvalue().strip() == f"admin user 'admin' created; its password is in {tmp_path / 'admin-password'}"
    assert password not in said.getvalue()

    again = io.StringIO()
    call_command("ensure_admin", stdout=again)
    assert again.getvalue().strip() == "admin user 'admin' exists (password unchanged)"
    assert (tmp_path / "admin-password").read_text().strip() == password


@pytest.mark.django_db
def test_up_prepares_its_database_in_one_command_that_says_only_the_admins_line_and_names_a_step_that_fails(
    tmp_path, monkeypatch
):
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    from scheduling.services import node_credentials

    monkeypatch.setenv("GPUPORTAL_ADMIN_PASSWORD", "s3cret")
    said = io.StringIO()
    call_command("prepare_database", "--node", "box", "--token-file", str(tmp_path / "box"), stdout=said)

    assert said.getvalue().strip() == "admin user 'admin' created (password from GPUPORTAL_ADMIN_PASSWORD)"
    token = (tmp_path / "box").read_text().strip()
    assert (tmp_path / "box").stat().st_mode & 0o777 == 0o600
    assert node_credentials.holds(node_credentials.check_name("box"), token)
    call_command("prepare_database", "--node", "box", "--token-file", str(tmp_path / "box"), stdout=io.StringIO())
    assert (tmp_path / "box").read_text().strip() == token, "a token still valid is kept"

    # A name that is no node's gets no credential: the agent refuses it, in its own words.
    call_command("prepare_database", "--node", "not a name", "--token-file", str(tmp_path / "bad"), stdout=said)
    assert not (tmp_path / "bad").exists()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CommandError) as failed:
        call_command("prepare_database", "--node", "box", "--token-file", str(blocker / "box"), stdout=said)
    assert str(failed.value) == (
        f"could not issue node box's credential: FileExistsError: [Errno 17] File exists: '{blocker}'"
    )


def test_the_banner_says_how_to_sign_in_and_the_console_shows_only_warnings_and_errors(tmp_path, monkeypatch):
    import io

    from gpuportal.up import Options, Portal

    monkeypatch.delenv("GPUPORTAL_ADMIN_PASSWORD", raising=False)
    (tmp_path / "admin-password").write_text("s3cret\n")
    out = io.StringIO()
    portal = Portal(Options(data_dir=tmp_path, port=8123), out=out)
    portal.banner({"DATABASE_URL": "postgres://postgres:pw@127.0.0.1:5/db", "REDIS_URL": "redis://:pw@h:6/0"}, [])

    banner = out.getvalue()
    assert f"sign in:    admin, password in {tmp_path / 'admin-password'}" in banner
    token_command = (
        "curl -s -X POST http://127.0.0.1:8123/api/auth/token/ -d username=admin "
        f'-d password="$(cat {tmp_path / "admin-password"})"'
    )
    assert token_command in banner
    assert "s3cret" not in banner and ":pw@" not in banner

    assert not portal.on_console("[2026-11-25 17:15:03,092: INFO/MainProcess] Sending due task sweep")
    assert not portal.on_console("2026-11-25 17:15:02,699 INFO inference.agent: node local registered")
    assert portal.on_console("[2026-11-25 17:15:03,092: WARNING/MainProcess] consumer: Connection to broker lost")
    assert portal.on_console("2026-11-25 17:15:02,699 ERROR scheduling.tasks: reconcile failed")
    assert portal.on_console("[ERROR] granian worker died")
    # A deploy, load, sleep, wake or failure: one line each, though logged at INFO.
    assert portal.on_console(
        "[2026-11-25 17:15:03,092: INFO/MainProcess] [gpuportal] tiny-a: replica 3f2a1b2c serving: loaded"
    )
    verbose = Portal(Options(data_dir=tmp_path, verbose=True), out=out)
    assert verbose.on_console("[2026-11-25 17:15:03,092: INFO/MainProcess] Sending due task sweep")


def test_the_web_runs_as_many_processes_as_asked(tmp_path):
    from gpuportal.up import Options, Portal

    def workers(**given: object) -> str:
        (web,) = [c for c in Portal(Options(data_dir=tmp_path, **given)).plan_children() if c.name == "web"]
        return web.argv[web.argv.index("--workers") + 1]

    assert workers() == "1"
    assert workers(web_workers=4) == "4"


@pytest.mark.parametrize(
    ("argv", "environment", "error"),
    [
        (["--web-workers", "0"], {}, "--web-workers 0 is not between 1 and 32"),
        (["--web-workers", "33"], {}, "--web-workers 33 is not between 1 and 32"),
        ([], {"GPUPORTAL_WEB_WORKERS": "four"}, "GPUPORTAL_WEB_WORKERS='four' is not a whole number between 1 and 32"),
    ],
)
def test_a_web_worker_count_out_of_range_is_a_one_line_error_and_starts_nothing(tmp_path, argv, environment, error):
    data_dir = tmp_path / "var"
    result = subprocess.run(
        [sys.executable, "manage.py", "up", "--port", str(free_port()), *argv],
        cwd=ROOT,
        env=env_without_servers(GPUPORTAL_DATA_DIR=str(data_dir), **environment),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"CommandError: {error}"]
    assert not data_dir.exists()
