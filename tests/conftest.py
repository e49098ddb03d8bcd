"""Fixtures shared across feature files."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

# No deadline on an example: a property's example that takes 200 ms on a loaded 2-core machine (three
# test processes and the servers they start) is no failure of the property, and a time limit is
# no behaviour of the code.
hypothesis_settings.register_profile("gpuportal", deadline=None)
hypothesis_settings.load_profile("gpuportal")

NODE_AUTH = "open"

# One thread for torch in each test process (read when torch is imported, below this): `make test`
# runs three processes on two cores, and each one's torch took both, the threads of one process
# waiting on the other processes' for every small operation of the tiny models (13 % of the CPU of
# the paged-generation tests). The replicas that tests start take one already
# (GPUPORTAL_VIRTUAL_CPU_THREADS).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    from tests.support import durations

    durations.add_option(parser)


def pytest_configure(config):
    # Django's default hasher spends about half a second of CPU per password on this machine, by
    # design; the suite creates and checks hundreds. Only this process's users: the stacks that
    # tests start (`up`) hash with the portal's own settings, and their tests check those.
    from django.conf import settings

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # WhiteNoise reads every static file's metadata (the admin's, DRF's, the dashboard's: about 170)
    # each time a middleware chain is built, which every test client does once: 28 ms of each
    # API test. Finding a file when one is asked for serves the same files; no test asks the
    # test client for one, and the stacks that tests start serve them the portal's own way.
    settings.WHITENOISE_AUTOREFRESH = True
    # The suite's agents and calls speak for nodes that were never issued a credential; a node that
    # has one must still show it, and tests/scheduling/test_node_credentials.py runs `required`.
    # The stacks that tests start (`up`) run the portal's own default, `required`.
    settings.GPUPORTAL_NODE_AUTH = NODE_AUTH

    from tests.support import durations, process_watch, rewrite_share
    from tests.support.flush import flush_through_deadlocks

    config.pluginmanager.register(process_watch, "process_watch")
    config.pluginmanager.register(rewrite_share, "rewrite_share")
    durations.configure(config)
    # A killed agent's last call, applied by the session's agents worker while a test's rows are
    # flushed, can deadlock with the flush (tests/support/flush.py).
    flush_through_deadlocks()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` hands each process whole files (--dist loadfile) in this order: files that
        # start processes (the `slow` ones) first, the longest of each kind first
        # (tests/support/durations.py), so that the last minutes are many short files spread over
        # every process rather than one long file on its own.
        from tests.support import durations

        durations.order(items, durations.recorded())


@pytest.fixture(autouse=True)
def _fresh_token_cache():
    """Each test starts with no remembered token (gpuportal.auth): one test's tokens, or a revoked
    one, must not outlive it."""
    from gpuportal import throttle
    from gpuportal.auth import forget_tokens

    forget_tokens()
    throttle.forget()  # and no failed sign-in of an earlier test counts against this one


@pytest.fixture(autouse=True)
def _models_read_here(request, monkeypatch):
    """A deploy asks a node agent to read the model's files (gpuportal.wire.inspection). A test
    with real agents takes that path; in the others the nodes are rows with no agent behind them,
    so the files are read in this process, by the function the agent runs."""
    if "agents_worker" in request.fixturenames or request.node.get_closest_marker("nodes_read_models"):
        return
    from inference.inspection import read_model
    from scheduling.services import dispatch

    monkeypatch.setattr(dispatch, "inspect", read_model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A small causal LM on disk (random weights, seeded: safetensors) with its tokenizer (a
    deploy refuses a text model without one), written once per session."""
    import torch
    from transformers import LlamaForCausalLM

    from inference.management.commands.make_tiny_model import VOCAB_SIZE, build_tokenizer
    from tests.support.serving import tiny_llama_config

    path = tmp_path_factory.mktemp("tiny-llama")
    config = tiny_llama_config()
    # The same weights in every session and worker, so the same answers: a random model's greedy
    # answer held to a JSON Schema may loop on whitespace until max_tokens for some weights.
    with torch.random.fork_rng():
        torch.manual_seed(7)
        LlamaForCausalLM(config).save_pretrained(path)
    assert config.vocab_size >= VOCAB_SIZE  # every token id the tokenizer gives has an embedding
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def beat_schedules(db) -> None:
    """The beat schedules the migrations write (`create_schedules` in scheduling/migrations), as a
    fresh database has them. A transactional test's flush empties every table, these rows too, and
    with the suite's files spread over processes (pytest-xdist) a test that reads them may run after
    one on the same database; so they are written again, by the migrations' own functions."""
    import importlib
    import pkgutil

    from django.apps import apps

    import scheduling.migrations

    for module in pkgutil.iter_modules(scheduling.migrations.__path__):
        migration = importlib.import_module(f"scheduling.migrations.{module.name}")
        if hasattr(migration, "create_schedules"):
            migration.create_schedules(apps, None)


@pytest.fixture
def dispatched(monkeypatch) -> list[tuple[str, str, list]]:
    """Tasks the control plane sends, recorded instead of sent: (queue, task, args). A command to
    a node agent is read back as the agent would (gpuportal.wire.commands.decode) and recorded as
    its replica and, for a start or a wake, whom it waits for."""
    from gpuportal.celery import app
    from gpuportal.wire import commands

    sent: list[tuple[str, str, list]] = []

    def record(name, args=None, queue=None, **kw):
        if name in commands.TASKS.values():
            args = commands.brief(commands.decode(args[0]))
        sent.append((queue, name, args))

    monkeypatch.setattr(app, "send_task", record)
    return sent


@pytest.fixture
def report(django_capture_on_commit_callbacks, dispatched):
    """`report(replica, "event", **fields)`: one report relayed by the member's node agent, with
    what the control plane dispatches once it has committed (recorded in `dispatched`)."""

    from scheduling.services import reports

    def send(replica, event: str, **fields) -> None:
        replica_id = replica if isinstance(replica, str) else replica.id
        with django_capture_on_commit_callbacks(execute=True):
            reports.report(replica_id, {"event": event, **fields})

    return send


@pytest.fixture
def cluster(db) -> None:
    """Two virtual nodes of two 1 GiB GPUs each."""
    from inference.devices import virtual_gpus
    from scheduling.services.nodes import register_node
    from tests.support.factories import NO_OVERHEAD

    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB", NO_OVERHEAD), virtual=True)


@pytest.fixture
def staff(db):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(User.objects.create_user("ops", is_staff=True))
    return client


@pytest.fixture
def api(staff, django_capture_on_commit_callbacks, dispatched):
    """POST/PATCH/DELETE as staff, running what would run after commit (the dispatches)."""

    def call(method: str, path: str, body: dict | None = None):
        with django_capture_on_commit_callbacks(execute=True):
            return getattr(staff, method)(path, body, format="json")

    return call


def _stop(process, log, grace: float = 60) -> None:
    """SIGTERM, then SIGKILL after `grace`; print the process's log (pytest shows it on failure)."""
    import subprocess

    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    log.seek(0)
    print(log.read()[-5000:])  # shown by pytest only when the test failed


def _process_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    from django.conf import settings

    from tests.support.processes import database_url_of_this_test

    return {
        **os.environ,
        "DATABASE_URL": database_url_of_this_test(),
        "REDIS_URL": settings.REDIS_URL,
        "GPUPORTAL_DATA_DIR": str(tmp_path),
        "GPUPORTAL_NODE_AUTH": NODE_AUTH,
        **extra,
    }


@pytest.fixture(scope="session")
def agents_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """The worker that answers node agents' calls (the `agents` queue: their reports, heartbeats
    and registrations, gpuportal.wire.control), as `up` runs it, on the test database and Redis.
    One for the session: tests that start agents share it, as a portal's nodes do."""
    import subprocess
    import sys

    import redis
    from django.conf import settings

    from tests.support.processes import wait_until

    with django_db_blocker.unblock():
        env = _process_env(tmp_path_factory.mktemp("agents-worker"))
    redis.Redis.from_url(settings.REDIS_URL).delete("agents")  # no call of an earlier session
    path = Path(env["GPUPORTAL_DATA_DIR"]) / "agents.log"
    log = open(path, "w+")  # noqa: SIM115 - printed when the session ends
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "celery", "-A", "gpuportal", "worker"),
            *("-Q", "agents", "--concurrency", "8", "--pool", "threads", "-l", "info"),
            *("-n", f"agents-{os.getpid()}@%h", "--without-gossip", "--without-mingle"),
        ],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: process.poll() is not None or " ready." in path.read_text(), 60, "the agents worker")
        assert process.poll() is None, path.read_text()[-3000:]
        process.log_path = path  # type: ignore[attr-defined]  # what a test may read of it
        yield process
    finally:
        _stop(process, log, grace=30)


class TemplateService:
    """The templates' service this process's agents share (inference.forkserver --listen)."""

    def __init__(self, address: Path, log: Path):
        self.address, self.log = address, log

    def templates_since(self, offset: int) -> list[int]:
        """The templates it forked since its log was `offset` bytes long: `template PID` lines."""
        with self.log.open() as log:
            log.seek(offset)
            return [int(line.split()[1]) for line in log if line.startswith("template ")]

    def log_size(self) -> int:
        return self.log.stat().st_size


@pytest.fixture(scope="session")
def template_service(tmp_path_factory):
    """One templates' service for this process's agents, as a node may run one: each test's agent
    gets a template already imported from it rather than import torch and transformers for a
    template of its own (5 CPU-seconds here, more than the rest of what a test's agent costs).
    The live stacks of test_cli.py and test_trace_round_trip.py point `up`'s agent at it too; `up`
    as a user runs it (test_up.py, test_readme.py, bench.recovery's) starts its agent without it,
    and so does a test that passes GPUPORTAL_REPLICA_TEMPLATE_SOCKET itself."""
    import subprocess
    import sys

    from tests.support.processes import wait_until

    directory = tmp_path_factory.mktemp("templates")
    service = TemplateService(directory / "templates.sock", directory / "service.log")
    log = service.log.open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "inference.forkserver", "--listen", str(service.address)],
        cwd=Path(__file__).resolve().parent.parent,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def listening() -> bool:
            return process.poll() is not None or "listening on" in service.log.read_text()

        wait_until(listening, 120, "the templates' service")
        assert process.poll() is None, service.log.read_text()[-3000:]
        yield service
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        _stop(process, log)


@pytest.fixture
def start_agent(tmp_path, agents_worker, template_service):
    """Starts real node agents on this test's database and Redis: `start_agent(node, gpus)`, e.g.
    `start_agent("e2e", "1x2GiB")`, with settings of its own as keywords
    (`GPUPORTAL_WARM_SPARES="1"`); each is killed with its replicas at the end of the test. Their
    virtual GPUs account like the H100's: a CUDA context per replica process, the
    driver's reserve, the allocator's rounding."""
    import subprocess
    import sys

    from scheduling.models import Node
    from tests.support.processes import wait_until

    started = []
    templates_from = template_service.log_size()
    # An earlier test's replicas, killed as it ended, still claim to take their deployments'
    # requests for a few seconds (gpuportal.wire.requestqueue's LIVE_TTL_S), and a request of this
    # test's deployment of the same name would wait for them rather than wake its own; its queued
    # requests would go to this test's replicas.
    _forget_earlier_deployments()

    def start(node: str = "e2e", virtual_gpus: str = "2x4GiB", **env: str):
        log = open(tmp_path / f"agent-{node}.log", "w+")  # noqa: SIM115 - read back when the test fails
        process = subprocess.Popen(
            [sys.executable, "manage.py", "agent", "--node", node, "--virtual-gpus", virtual_gpus],
            cwd=Path(__file__).resolve().parent.parent,
            # A short stall threshold keeps the node's lease at 4 s (gpuportal.wire.node_lease.ttl_s):
            # the tests that cut an agent off wait for it to lapse, and they freeze no Redis.
            env=_process_env(
                tmp_path,
                **{
                    "GPUPORTAL_HEARTBEAT_S": "1",
                    "GPUPORTAL_CONTROL_STALL_S": "2",
                    "GPUPORTAL_REPLICA_TEMPLATE_SOCKET": str(template_service.address),
                    **env,
                },
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            # A group of its own, with its replicas: those a killed agent left waiting to be
            # adopted must not serve the next test's queues.
            start_new_session=True,
        )
        started.append((process, log))
        wait_until(lambda: Node.objects.filter(name=node, status="online").exists(), 60, f"agent {node} to register")
        return process

    try:
        yield start
    finally:
        for process, log in reversed(started):
            # Killed whole, with its replicas (its process group), not stopped: an agent's orderly
            # stop drains every replica and can take seconds, and no test checks it here (those
            # that stop an agent on purpose, and check how, do so themselves). Killed, it leaves
            # no replica behind to serve the next test's queues, and its unacknowledged commands
            # stay with the broker far longer than a session (the visibility timeout).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            _stop(process, log)
        # The templates the service forked for this test's agents lead groups of their own, with
        # the replicas they forked: those an agent left to be adopted would outlive the test.
        for template in template_service.templates_since(templates_from):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(template, signal.SIGKILL)


def _forget_earlier_deployments() -> None:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    for pattern in ("gp:live:*", "gp:queue:*"):
        if keys := list(client.scan_iter(match=pattern, count=1000)):
            client.delete(*keys)


@pytest.fixture
def agent(start_agent):
    """A real node agent, `e2e` with 2x4GiB virtual GPUs, on this test's database and Redis
    (tests using it need `django_db(transaction=True)` so the agent sees their rows)."""
    return start_agent("e2e", "2x4GiB")


@pytest.fixture
def control_worker(tmp_path):
    """Starts real control-plane Celery workers (`-Q control`, 2 threads) on this test's database
    and Redis: `control_worker(**env)` returns the process once it is ready; extra env such as
    GPUPORTAL_WAKE_LOCK_TTL_S="3" is passed to it. Each is killed (SIGKILL) at the end of the
    test, and its log printed (shown when the test failed)."""
    import subprocess
    import sys

    import redis
    from django.conf import settings

    from tests.support.processes import wait_until

    # Leftovers of earlier tests in the shared Redis (retries with a countdown, tasks of killed
    # workers) must not run against this test's rows.
    redis.Redis.from_url(settings.REDIS_URL).delete("control")
    started = []

    def start(**env: str):
        n = len(started)
        path = tmp_path / f"control-{n}.log"
        log = open(path, "w+")  # noqa: SIM115 - read back when the test fails
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "gpuportal", "worker"),
                *("-Q", "control", "--concurrency", "2", "--pool", "threads", "-l", "info"),
                *("-n", f"control{n}-{tmp_path.name}@%h", "--without-gossip", "--without-mingle"),
            ],
            cwd=Path(__file__).resolve().parent.parent,
            env=_process_env(tmp_path, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started.append((process, log))
        wait_until(
            lambda: process.poll() is not None or " ready." in path.read_text(), 60, "the control worker to be ready"
        )
        assert process.poll() is None, path.read_text()[-3000:]
        return process

    try:
        yield start
    finally:
        for process, log in reversed(started):
            # Killed, not stopped: a warm shutdown waits for the tasks it runs, which would then
            # write to the next test's rows; unacknowledged, they stay with the broker far longer
            # than a session (the visibility timeout), and the next test empties the queue.
            process.kill()
            _stop(process, log, grace=30)
