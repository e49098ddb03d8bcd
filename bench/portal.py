"""A portal on this machine for the benchmarks that go through HTTP: a node agent on virtual GPUs,
the web server (granian, as docker/compose.yaml runs it), optionally a control-plane worker; and
a kept-alive HTTP client for it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import setup_database, stop

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Http:
    """One kept-alive HTTP connection: what a real client reuses between requests."""

    def __init__(self, port: int, key: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"Authorization": f"Token {key}", "Content-Type": "application/json"}

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        self.conn.request("POST", path, body=json.dumps(body), headers=self.headers)
        response = self.conn.getresponse()
        return response.status, json.loads(response.read())

    def ready(self) -> bool:
        try:
            self.conn.request("GET", "/healthz")
            self.conn.getresponse().read()
            return True
        except OSError:
            self.conn.close()
            return False

    def close(self) -> None:
        self.conn.close()


def start_redis_if_needed(tmp: Path):
    if os.environ.get("REDIS_URL"):
        return None
    from gpuportal.stack import EmbeddedRedis

    server = EmbeddedRedis(data_dir=tmp / "redis", persist=False)
    os.environ["REDIS_URL"] = server.start()
    return server


@contextmanager
def servers(prefix: str, database: str) -> Iterator[Path]:
    """A temporary directory, Redis (embedded unless REDIS_URL is set) and a fresh database
    (bench.common.setup_database) for one benchmark run; stopped on the way out, whatever happened."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    redis_server = start_redis_if_needed(tmp)
    db_server = setup_database(database)
    try:
        yield tmp
    finally:
        stop(db_server)
        if redis_server is not None:
            redis_server.stop()


def staff_key() -> str:
    """The API token of a staff user for the benchmark's clients."""
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    return Token.objects.create(user=User.objects.create_user("bench", is_staff=True)).key


def wait(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll another process's effect (a row, an answer) until it shows, or stop the benchmark."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


class Portal:
    """The processes, started in `tmp` (their logs land there) and stopped by `stop()`.

    `agents`: node name → virtual GPUs of each node agent (default one node, `bench`, 1x4GiB), or
    None for the machine's own GPUs (NVML's);
    `control`: a control-plane worker, on `control_pool` (threads; `prefork` as `manage.py up` and
    docker/compose.yaml run it); `beat`: celery beat on the product's schedule (the heartbeat
    expiry, the reconcile sweep), as `manage.py up` runs it. `agents={}`: no node agent (the
    nodes are simulated: bench.fleet). `processes`: each process by its name (its log's)."""

    def __init__(
        self,
        tmp: Path,
        *,
        web_threads: int = 4,
        control: bool = False,
        agents: dict[str, str | None] | None = None,
        beat: bool = False,
        control_pool: str = "threads",
    ):
        from gpuportal.stack import free_port

        self.tmp = tmp
        self.port = free_port()
        self.children: list[subprocess.Popen] = []
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "GPUPORTAL_DATA_DIR": str(tmp),
            "PYTHONUNBUFFERED": "1",
            "GPUPORTAL_ALLOWED_HOSTS": "*",
        }
        celery = [sys.executable, "-m", "celery", "-A", "gpuportal"]
        # The agents' calls (their reports, heartbeats and registrations) go to this worker.
        self._spawn(
            [*celery, "worker", "-Q", "agents", "-n", "agents@%h",
             "--pool", "threads", "--concurrency", "8", "--without-gossip", "--without-mingle"],
            "agents",
        )  # fmt: skip
        self.agent_gpus: dict[str, str | None] = {"bench": "1x4GiB"} if agents is None else agents
        self.agents: dict[str, subprocess.Popen] = {}
        for name in self.agent_gpus:
            self.start_agent(name)
        if control:
            self._spawn(
                [*celery, "worker", "-Q", "control", "-n", "control@%h",
                 "--pool", control_pool, "--concurrency", "2", "--without-gossip", "--without-mingle"],
                "control",
            )  # fmt: skip
        if beat:
            self._spawn(
                [*celery, "beat", "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler",
                 "--pidfile", str(tmp / "beat.pid")],
                "beat",
            )  # fmt: skip
        self._spawn(
            [sys.executable, "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--blocking-threads", str(web_threads), "--no-ws", "gpuportal.wsgi:application"],
            "web",
        )  # fmt: skip

    def start_agent(self, name: str) -> subprocess.Popen:
        """Start (or start anew) the node agent `name`."""
        from gpuportal.wire import node_auth
        from scheduling.services import node_credentials

        gpus = self.agent_gpus[name]
        argv = [sys.executable, "manage.py", "agent", "--node", name]
        argv += ["--virtual-gpus", gpus] if gpus is not None else []
        # A credential of its own, as an operator issues one (the portal runs them `required`).
        token = node_credentials.issue(name, "bench")
        self.agents[name] = self._spawn(argv, f"agent-{name}", {node_auth.TOKEN_ENV: token})
        return self.agents[name]

    def ready(self, key: str) -> None:
        from scheduling.models import Node

        names = list(self.agent_gpus)
        wait(
            lambda: Node.objects.filter(name__in=names, status="online").count() == len(names),
            120,
            f"the agents {', '.join(names)} ({self.tmp})",
        )
        wait(Http(self.port, key).ready, 60, f"the web server ({self.tmp / 'web.log'})")

    def __enter__(self) -> Portal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        agents = list(self.agents.values())
        # The agents first: they report their replicas' ends through the agents worker.
        for wave in (agents, [c for c in self.children if c not in agents]):
            for child in reversed(wave):
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in wave:
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "a") as log:  # the child keeps its own copy of the descriptor
            child = subprocess.Popen(
                argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
            )
        self.children.append(child)
        self.processes[name] = child
        return child
