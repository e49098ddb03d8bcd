"""`manage.py up` run by a test: on embedded servers of its own, whatever servers the test
session itself uses, with a known admin password; and the processes it leaves, if any."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from gpuportal.stack import free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "test-admin-password"


def env_without_servers(**extra: str) -> dict[str, str]:
    """This session's environment less the server URLs, so `up` starts embedded ones."""
    dropped = {"DATABASE_URL", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"}
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


class Up:
    """One `manage.py up` process, its output collected by a thread."""

    def __init__(
        self, data_dir: Path, *args: str, admin_password: str | None = PASSWORD, settings: dict[str, str] | None = None
    ):
        """`admin_password` None: as a user runs it, with no GPUPORTAL_ADMIN_PASSWORD (`up` then
        keeps the one it makes in <data dir>/admin-password). `settings`: environment variables
        for the stack (GPUPORTAL_*)."""
        self.data_dir = data_dir
        env = env_without_servers(GPUPORTAL_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", **(settings or {}))
        env.pop("GPUPORTAL_ADMIN_PASSWORD", None)
        if admin_password is not None:
            env["GPUPORTAL_ADMIN_PASSWORD"] = admin_password
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--port", str(self.port), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("gpuportal is up"):
                self.ready.set()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 180) -> None:
        if not self.ready.wait(timeout):
            self.process.kill()
            raise AssertionError("up did not come up:\n" + "".join(self.lines[-40:]) + self.process.stderr.read())

    def stop(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self.reader.join(10)
        return code

    def get(self, path: str, token: str | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.base + path)
        if token:
            request.add_header("Authorization", f"Token {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def post(self, path: str, body: dict, token: str) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Token {token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def serving(self, token: str, deployment: str) -> list[dict]:
        return self.get(f"/api/replicas/?deployment={deployment}&state=serving", token)[1].get("results", [])

    def diagnosis(self, token: str, replica_id: str) -> str:
        """What a failed wait on a replica of this stack needs to be read: its row, its Events, and
        the last lines of `up` and of its processes' logs (the agent's, the workers')."""
        row = self.get(f"/api/replicas/{replica_id}/", token)[1]
        events = self.get(f"/api/events/?replica={replica_id}", token)[1].get("results", [])
        parts = [f"replica: {json.dumps(row)}", *(f"event: {e.get('kind')} {e.get('reason')}" for e in events[:20])]
        parts.append("up:\n" + "".join(self.lines[-30:]))
        for log in sorted((self.data_dir / "logs").glob("*.log")):
            with open(log, errors="replace") as text:
                parts.append(f"{log.name}:\n" + "".join(text.readlines()[-30:]))
        return "\n".join(parts)

    def token(self) -> str:
        body = json.dumps({"username": "admin", "password": PASSWORD}).encode()
        request = urllib.request.Request(
            self.base + "/api/auth/token/", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())["token"]


def processes_of(data_dir: Path) -> list[str]:
    """Every live process tied to this stack: by its command line or its environment."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            env_dir = proc.environ().get("GPUPORTAL_DATA_DIR")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid != os.getpid() and (str(data_dir) in cmdline or env_dir == str(data_dir)):
            found.append(f"{proc.pid}: {cmdline}")
    return found
