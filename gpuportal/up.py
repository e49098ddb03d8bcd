"""`manage.py up`: the whole portal on one machine.

Order matters both ways. Start: servers (embedded unless URLs are given) → stack.env →
migrate → admin user → web, control worker, beat, node agent. Stop: the app processes first
(so they can still record that they stop), then Redis, then PostgreSQL.

While it runs, `up` supervises: any of them that dies, the embedded servers too, is started
again after a backoff, with a log line and an Event. Only Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from django.conf import settings

from gpuportal import orphans
from gpuportal.processes import die_with_parent
from gpuportal.stack import (
    EmbeddedPostgres,
    EmbeddedRedis,
    StackError,
    kept_secret,
    port_in_use,
)
from gpuportal.stackenv import CLI_URL_KEY, STATUS_FILE, redact, write_stack_env, write_status
from gpuportal.wire import console, node_auth

ROOT = Path(__file__).resolve().parent.parent
# A process that dies once the portal is up is started again (one that fails while the portal
# starts stops it, with its error), the n-th time in RESTART_PERIOD_S after RESTART_BACKOFF_S *
# 2**(n-1) seconds, at most GPUPORTAL_RESTART_BACKOFF_MAX_S: one that cannot run must not spin.
# A child (web, workers, beat, agent) is started again for as long as `up` runs: while it
# crash-loops the rest serves on, and /readyz names it. A server (PostgreSQL, Redis) that dies
# RESTART_LIMIT times in RESTART_PERIOD_S stops the portal: nothing works without it.
RESTART_LIMIT = 5
RESTART_PERIOD_S = 600.0
RESTART_BACKOFF_S = 0.5
# The lines of a child's output the console shows without --verbose: its warnings and errors,
# in the formats of Django's logging, Celery's and granian's.
CONSOLE_LEVELS = re.compile(r"(^|[\s\[:])(WARNING|ERROR|CRITICAL)\b")
# Known and meant: granian's warning about its 16 blocking threads on a small machine. A WSGI
# thread waits out each inference call it serves, so the web needs more threads than cores.
CONSOLE_NOISE = ("Configuration allows spawning up to",)
# How often `up` looks for a process that died: the lower bound of every recovery.
POLL_S = 0.2
# Tries to write a restart's Event (about a minute of backoff): the database may be down too.
RECORD_ATTEMPTS = 10


def kept_secret_key(path: Path) -> str:
    """The stack's own secret key: made once, then read back, so sessions survive a restart and
    nobody shares the public default."""
    return kept_secret(path, lambda: secrets.token_urlsafe(50))


@dataclass
class Restarts:
    """When a process that died may start again: its restarts in the last RESTART_PERIOD_S, and
    the moment its backoff ends."""

    times: deque[float] = field(default_factory=deque)
    # When the next start is due (time.monotonic()), while it waits out its backoff.
    due: float | None = None

    # Whether it stops the portal after RESTART_LIMIT restarts in RESTART_PERIOD_S (a server).
    limited: bool = False

    def may_restart(self, now: float) -> bool:
        while self.times and now - self.times[0] > RESTART_PERIOD_S:
            self.times.popleft()
        return not self.limited or len(self.times) < RESTART_LIMIT

    def backoff(self) -> float:
        return min(settings.GPUPORTAL_RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** len(self.times))


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    # Started again when it dies, rather than the whole portal stopping: every child
    # is; the agent's next run takes over the replica processes it left.
    restarts: Restarts = field(default_factory=Restarts)
    # The process groups of its earlier runs: what they left running (replicas waiting to be
    # adopted, in an agent's) is stopped with the portal.
    old_groups: list[int] = field(default_factory=list)
    # Stopped, and waited for, before the others: the agent, which reports its replicas' ends
    # through the `agents` worker while it stops them.
    stops_first: bool = False
    # Whether what its dead run left in its process group lives on until the portal stops: the
    # agent's replicas do (its next run adopts them). Anything else's leftovers (a web worker
    # still holding the port, a worker's pool) are killed before it starts again.
    keeps_group: bool = False
    # How its last run ended, for the restart's Event.
    ended: str = ""
    # A line its output shows once it is ready (the web: its health check instead).
    ready_marker: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def last_error(self) -> str:
        for line in reversed(self.tail):
            text = line.strip()
            if text and not text.startswith(("Traceback", "File ", "^")):
                return text
        return "no output"


@dataclass
class Server:
    """An embedded PostgreSQL or Redis that `up` started, and starts again if it dies."""

    name: str
    embedded: EmbeddedPostgres | EmbeddedRedis
    restarts: Restarts = field(default_factory=lambda: Restarts(limited=True))
    ended: str = ""


@dataclass
class Options:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    node: str = "local"
    virtual_gpus: str | None = None
    web_workers: int = 1
    quiet: bool = False
    verbose: bool = False
    database_url: str | None = None
    redis_url: str | None = None


class Portal:
    def __init__(self, options: Options, out: TextIO = sys.stdout):
        self.options = options
        self.out = out
        self.children: list[Child] = []
        self.servers: list[Server] = []
        self.postgres: EmbeddedPostgres | None = None
        self.redis: EmbeddedRedis | None = None
        self.stopping = threading.Event()
        # The threads writing a restart's Event (record_restart), joined before the servers stop.
        self.recorders: list[threading.Thread] = []
        self.env: dict[str, str] = {}
        self.log_lock = threading.Lock()
        # Set once this `up` has written stack.env: only then is it this `up`'s to remove. A
        # second `up` refused because one is running must leave that one's file alone.
        self.wrote_stack_env = False
        # What write_status last wrote (None: nothing yet).
        self.status_written: dict[str, str] | None = None
        # When the exit records no agent read were last swept (monotonic).
        self.swept_exits = 0.0

    @property
    def admin_password_file(self) -> Path:
        return self.options.data_dir / "admin-password"

    @property
    def node_token_file(self) -> Path:
        """Its agent's credential (0600), which `up` issues itself (prepare_database)."""
        return self.options.data_dir / "node-tokens" / self.options.node

    # -- start -------------------------------------------------------------------------------

    def check(self) -> None:
        """Fail before starting anything: nothing is left running on these errors."""
        opts = self.options
        if port_in_use(opts.port, opts.host):
            raise StackError(f"port {opts.port} on {opts.host} is already in use (another `up`? try --port)")
        try:
            opts.data_dir.mkdir(parents=True, exist_ok=True)
            probe = opts.data_dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise StackError(f"cannot use data directory {opts.data_dir}: {err.strerror or err}") from None

    def start_servers(self) -> dict[str, str]:
        opts = self.options
        urls = {}
        if opts.database_url:
            urls["DATABASE_URL"] = opts.database_url
        else:
            # Passwords of their own, kept beside their data: any local user can reach a loopback
            # port. The other processes read them from stack.env (0600).
            self.postgres = EmbeddedPostgres(
                pgdata=opts.data_dir / "postgres" / "data",
                password=kept_secret(opts.data_dir / "postgres" / "password"),
            )
            urls["DATABASE_URL"] = self.postgres.start()
            self.servers.append(Server("postgresql", self.postgres))
        # From here on everything the stack writes (Redis's append-only file of every prompt and
        # answer, the logs, the replicas' records) is its owner's alone, and every child started
        # from here inherits that. Not before: an embedded PostgreSQL run as its own user (up
        # started as root) reads its password file and the folders above its data as that user.
        os.umask(0o077)
        if opts.redis_url:
            urls["REDIS_URL"] = opts.redis_url
        else:
            self.redis = EmbeddedRedis(
                data_dir=opts.data_dir / "redis", password=kept_secret(opts.data_dir / "redis" / "password")
            )
            urls["REDIS_URL"] = self.redis.start()
            self.servers.append(Server("redis", self.redis))
        return urls

    def child_env(self, urls: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        metrics_dir = self.options.data_dir / "prometheus"
        # Counters of the previous run's processes would be summed with this run's.
        if metrics_dir.exists():
            for stale in metrics_dir.glob("*.db"):
                stale.unlink()
        metrics_dir.mkdir(exist_ok=True)
        env.update(urls)
        env.pop(node_auth.TOKEN_ENV, None)  # another node's, or an old one: the file below is this node's
        if not env.get("GPUPORTAL_SECRET_KEY"):
            env["GPUPORTAL_SECRET_KEY"] = kept_secret_key(self.options.data_dir / "secret-key")
        env.update(
            {
                "GPUPORTAL_DATA_DIR": str(self.options.data_dir),
                # Where ensure_admin writes the password it generates (0600): see the banner.
                "GPUPORTAL_ADMIN_PASSWORD_FILE": str(self.admin_password_file),
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
                # Only the agent reads it: the token its node's credential holds.
                node_auth.TOKEN_FILE_ENV: str(self.node_token_file),
                "PYTHONUNBUFFERED": "1",
                "DJANGO_SETTINGS_MODULE": "gpuportal.settings",
            }
        )
        if self.options.host not in {"127.0.0.1", "localhost"} and "GPUPORTAL_ALLOWED_HOSTS" not in env:
            env["GPUPORTAL_ALLOWED_HOSTS"] = "*"
        return env

    def manage(self, *args: str, capture: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=capture,
            text=True,
        )

    def prepare_database(self) -> None:
        """Migrations, the admin user and its own node's credential (a token kept from the last run
        while it is still valid): one `manage.py prepare_database`, whose steps name themselves."""
        result = self.manage("prepare_database", "--node", self.options.node, "--token-file", str(self.node_token_file))
        if result.returncode != 0:
            said = _last_line(result.stderr or result.stdout)
            # Failed before its first step (Django's settings, the database's URL): the migration's.
            raise StackError(said.removeprefix("CommandError: ") if said.startswith("CommandError: ")
                             else f"migrate failed: {said}")  # fmt: skip
        self.say(result.stdout.rstrip())

    def plan_children(self) -> list[Child]:
        opts = self.options
        python = sys.executable
        manage = str(ROOT / "manage.py")
        celery = [python, "-m", "celery", "-A", "gpuportal"]
        agent = [python, manage, "agent", "--node", opts.node]
        agents = ["worker", "-Q", "agents", "-n", "agents@%h", "--pool", "threads", "--concurrency", "8"]
        # No mingle (nor gossip), as the agents' worker: the portal revokes no task, so a worker has
        # nothing to learn from the others at its start, and its second of waiting for their answers
        # made the control worker the last of the processes to be ready, at every start of `up` and of it.
        control = ["worker", "-Q", "control", "-n", "control@%h", "--concurrency", "2", "--without-gossip",
                   "--without-mingle"]  # fmt: skip
        if opts.virtual_gpus:
            agent += ["--virtual-gpus", opts.virtual_gpus]
        # granian, as docker/compose.yaml and the benchmarks serve it (WhiteNoise serves the
        # admin's static files), not Django's development server.
        web = [python, "-m", "granian", "--interface", "wsgi", "--host", opts.host, "--port", str(opts.port),
               "--workers", str(opts.web_workers), "--blocking-threads", "16", "--no-ws",
               "gpuportal.wsgi:application"]  # fmt: skip
        # Every child logs at INFO to var/logs; the console shows only its warnings and errors
        # unless --verbose (CONSOLE_LEVELS), and the markers tell the banner when each is ready.
        return [
            Child("web", web),
            Child("control", [*celery, *control, "-l", "INFO"], ready_marker=" ready."),
            Child(
                "beat",
                [
                    *celery,
                    "beat",
                    "-l",
                    "INFO",
                    "--scheduler",
                    settings.CELERY_BEAT_SCHEDULER,
                    "--pidfile",
                    str(opts.data_dir / "beat.pid"),
                ],
                ready_marker="beat: Starting",
            ),
            # Answers the agents' calls (gpuportal.wire.control): their reports, heartbeats and
            # registrations, on threads of their own so none waits behind a placement.
            Child(
                "agents",
                [*celery, *agents, "-l", "INFO", "--without-gossip", "--without-mingle"],
                ready_marker=" ready.",
            ),
            Child("agent", agent, stops_first=True, keeps_group=True, ready_marker=f"node {opts.node} registered"),
        ]

    def spawn(self, child: Child) -> None:
        log_dir = self.options.data_dir / "logs"
        log_dir.mkdir(exist_ok=True)
        child.ready.clear()  # a run started again is starting until it says it is ready
        child.process = subprocess.Popen(
            child.argv,
            env=self.env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # Own session: a terminal's Ctrl-C reaches only `up`, which then stops children in order;
            # and a whole group (a worker and its pool) can be killed at once if it hangs.
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        threading.Thread(target=self._pump, args=(child, log_dir / f"{child.name}.log"), daemon=True).start()

    def _pump(self, child: Child, log_path: Path) -> None:
        assert child.process is not None and child.process.stdout is not None
        with open(log_path, "a") as log:
            for line in child.process.stdout:
                child.tail.append(line)
                log.write(line)
                log.flush()
                if child.ready_marker and child.ready_marker in line:
                    child.ready.set()
                if self.on_console(line):
                    with self.log_lock:
                        self.out.write(f"{child.name:<8}| {line}")
                        self.out.flush()

    def on_console(self, line: str) -> bool:
        if self.options.quiet:
            return False
        if self.options.verbose:
            return True
        if console.MARK in line:
            return True  # a deploy, load, sleep, wake or failure (gpuportal.wire.console)
        return CONSOLE_LEVELS.search(line[:80]) is not None and not any(noise in line for noise in CONSOLE_NOISE)

    def wait_all_ready(self, timeout: float = 120.0) -> list[str]:
        """Wait for every child's ready line (the web's health check came first); the names of
        those still starting when `timeout` is over."""
        deadline = time.monotonic() + timeout
        for child in self.children:
            while child.ready_marker and not child.ready.wait(0.2):
                self.raise_if_child_died()
                if self.stopping.is_set() or time.monotonic() > deadline:
                    break
        return [c.name for c in self.children if c.ready_marker and not c.ready.is_set()]

    def client_url(self) -> str:
        """Where a client on this host reaches the web: its own address, or the loopback when it
        listens on every address."""
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "::", "") else self.options.host
        return f"http://{host}:{self.options.port}"

    def wait_web_ready(self, timeout: float = 120.0) -> None:
        url = f"http://{self.options.host}:{self.options.port}/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            self.raise_if_child_died()
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
            time.sleep(0.2)
        if not self.stopping.is_set():
            raise StackError(f"web server did not answer {url} within {timeout:.0f} s")

    def raise_if_child_died(self) -> None:
        for child in self.children:
            code = child.process.poll() if child.process else None
            if code is not None:
                time.sleep(0.2)  # let the pump thread read the last lines it printed
                raise StackError(f"{child.name} exited with code {code}: {child.last_error()}")

    def restart_or_raise(self) -> None:
        """A process that died is started again after its backoff (an agent's replicas wait to
        be taken over meanwhile); one that keeps dying stops the portal. The servers first: the
        others need them."""
        for server in self.servers:
            self.restart_server(server)
        now = time.monotonic()
        for child in self.children:
            code = child.process.poll() if child.process else None
            if code is None:
                continue
            restarts = child.restarts
            if restarts.due is None:
                time.sleep(0.2)  # let the pump thread read the last lines it printed
                ended = _how_it_ended(code, child.last_error())
                self.schedule(child.name, restarts, ended, now)
                child.ended = ended
            if now < restarts.due:
                continue
            restarts.due = None
            restarts.times.append(now)
            assert child.process is not None
            if child.keeps_group:
                child.old_groups.append(child.process.pid)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.process.pid, signal.SIGKILL)
            self.spawn(child)
            self.record_restart(child.name, child.ended)

    def restart_server(self, server: Server) -> None:
        now = time.monotonic()
        process = server.embedded.process
        if process is not None:
            code = process.poll()
            if code is None:
                return
            server.ended = _how_it_ended(code, None)
            server.embedded.process = None
        restarts = server.restarts
        if restarts.due is None:
            self.schedule(server.name, restarts, server.ended, now)
        if now < restarts.due:
            return
        restarts.due = None
        restarts.times.append(now)
        try:
            # The same port, data and password: every process keeps its URL and reconnects.
            server.embedded.start()
        except StackError as err:
            # Counted as a restart: tried again after a longer backoff, until the limit.
            self.say(f"{server.name} did not start again: {err}")
            return
        self.say(f"{server.name} is back on port {server.embedded.port}")
        self.record_restart(server.name, server.ended)

    def down(self) -> dict[str, str]:
        """The children not serving now, and why: dead and waiting out their backoff, or started
        again and not ready yet."""
        found = {}
        for child in self.children:
            if child.process is None or child.process.poll() is not None or child.restarts.due is not None:
                found[child.name] = f"{child.ended or 'exited'}; starting it again"
            elif child.ready_marker and not child.ready.is_set():
                found[child.name] = f"{child.ended}; started again, not ready yet" if child.ended else "starting"
        return found

    def write_status(self) -> None:
        """What /readyz names (gpuportal.health): written when it changes, read by the web."""
        down = self.down()
        if down != self.status_written:
            write_status(self.options.data_dir, down)
            self.status_written = down

    def schedule(self, name: str, restarts: Restarts, ended: str, now: float) -> None:
        if not restarts.may_restart(now):
            raise StackError(f"{name} {ended}")
        wait = restarts.backoff()
        restarts.due = now + wait
        self.say(f"{name} {ended}; starting it again in {wait:.1f} s")

    def record_restart(self, name: str, ended: str) -> None:
        """The Event, written by a short-lived `manage.py` on a thread of its own: `up` holds no
        database connection, and its loop must not wait for the database it may be restarting.
        Tried again for a minute: the database may be the next thing to blink."""
        reason = f"{ended}; started again by up"

        def record() -> None:
            for attempt in range(RECORD_ATTEMPTS):
                if self.stopping.wait(min(8.0, 0.5 * 2**attempt) if attempt else 0):
                    return
                result = self.manage("record_restart", name, "--reason", reason, "--node", self.options.node)
                if result.returncode == 0:
                    return
            self.say(f"could not record the restart of {name}: {_last_line(result.stderr or result.stdout)}")

        recorder = threading.Thread(target=record, name=f"record-restart-{name}", daemon=True)
        self.recorders.append(recorder)
        recorder.start()

    # -- run and stop ------------------------------------------------------------------------

    def run(self) -> int:
        self.check()
        self._install_signal_handlers()
        try:
            # Replicas whose agent died become our children, and we learn how they end.
            orphans.become_subreaper(self.exits)
            urls = self.start_servers()
            self.env = self.child_env(urls)
            # Its web's address too: the command line run beside it finds the port up chose.
            write_stack_env(self.options.data_dir / "stack.env", {**urls, CLI_URL_KEY: self.client_url()})
            self.wrote_stack_env = True
            self.prepare_database()
            for child in self.plan_children():
                if self.stopping.is_set():
                    break
                self.children.append(child)
                self.spawn(child)
            self.wait_web_ready()
            starting = self.wait_all_ready()
            if not self.stopping.is_set():
                self.banner(urls, starting)
            while not self.stopping.wait(POLL_S):
                self.restart_or_raise()
                self.reap_orphans()
                self.write_status()
            self.say("stopping: the portal's processes, then its servers")
            return 0
        finally:
            self.shutdown()

    @property
    def exits(self) -> Path:
        return orphans.exits_dir(self.options.data_dir)

    def reap_orphans(self) -> None:
        """The orphans of what it started, once they end: reaped (as init would have), and how the
        replicas of an agent that died ended recorded for the agent that took them over
        (gpuportal.orphans)."""
        own = {c.process.pid for c in self.children if c.process}
        own |= {s.embedded.process.pid for s in self.servers if s.embedded.process is not None}
        agents = {g for c in self.children if c.keeps_group and c.process for g in (*c.old_groups, c.process.pid)}
        orphans.reap(own, agents, self.exits)
        now = time.monotonic()
        if now - self.swept_exits > 60:
            self.swept_exits = now
            orphans.sweep(self.exits)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stopping.set()

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    def shutdown(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.options.data_dir / STATUS_FILE).unlink()  # no `up`, nothing down to name
        orphans.stop_reaping(self.exits)
        # A restart's Event still being written: its `manage.py` ends on its own within seconds
        # (no next attempt once stopping is set), before the servers it writes to are stopped.
        for recorder in self.recorders:
            recorder.join(30)
        running = [c for c in self.children if c.process and c.process.poll() is None]
        first = [c for c in running if c.stops_first]
        # The agent, then all the rest at once: each warm shutdown overlaps the others'.
        for wave in (first, [c for c in running if c not in first]):
            for child in reversed(wave):
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for child in wave:
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} did not stop in time; killing it")
        for child in self.children:
            if child.process is None:
                continue
            # Kill what is left of each child's sessions: a stuck child, a pool process it left
            # behind, a replica an earlier run of the agent left that no later one took over.
            for group in (*child.old_groups, child.process.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(5)
        if self.redis is not None:
            self.redis.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.wrote_stack_env and (self.redis is not None or self.postgres is not None):
            # The servers it names are gone: an agent started now must not try to join them.
            with contextlib.suppress(FileNotFoundError):
                (self.options.data_dir / "stack.env").unlink()

    def say(self, text: str) -> None:
        with self.log_lock:
            self.out.write(text + "\n")
            self.out.flush()

    def banner(self, urls: dict[str, str], starting: list[str]) -> None:
        base = f"http://{self.options.host}:{self.options.port}"
        pg = "embedded, " + str(self.postgres.pgdata) if self.postgres else "external"
        rd = "embedded, " + str(self.redis.data_dir) if self.redis else "external"
        user = os.environ.get("GPUPORTAL_ADMIN_USER") or "admin"
        password_file = self.admin_password_file
        if os.environ.get("GPUPORTAL_ADMIN_PASSWORD"):
            password, password_arg = "GPUPORTAL_ADMIN_PASSWORD", '"$GPUPORTAL_ADMIN_PASSWORD"'
        elif password_file.exists():
            password, password_arg = f"in {password_file}", f'"$(cat {password_file})"'
        else:
            password, password_arg = "as you set it", "YOUR-PASSWORD"
        token = f"curl -s -X POST {base}/api/auth/token/ -d username={user} -d password={password_arg}"
        self.say(
            "\n".join(
                [
                    "",
                    f"gpuportal is up on {socket.gethostname()} (node agent: {self.options.node})"
                    + (f"; still starting: {', '.join(starting)}" if starting else ""),
                    f"  sign in:    {user}, password {password}",
                    f"  a token:    {token}",
                    f"  admin:      {base}/admin/",
                    f"  API docs:   {base}/api/docs/",
                    f"  health:     {base}/healthz  (ready: {base}/readyz, metrics: {base}/metrics)",
                    f"  PostgreSQL: {redact(urls['DATABASE_URL'])}  ({pg})",
                    f"  Redis:      {redact(urls['REDIS_URL'])}  ({rd})",
                    f"  stack.env:  {self.options.data_dir / 'stack.env'}  (agents and shells started here join it)",
                    f"  logs:       {self.options.data_dir / 'logs'}"
                    + ("" if self.options.verbose else "  (the console shows warnings and errors: --verbose for all)"),
                    "Press Ctrl-C to stop everything.",
                    "",
                ]
            )
        )


def _how_it_ended(code: int, last_error: str | None) -> str:
    if code < 0:  # its last line says nothing about a signal from outside
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}" + (f": {last_error}" if last_error else "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
