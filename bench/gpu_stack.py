"""The stack part of bench.gpu: the whole portal under `manage.py up`, two deployments driven through
the REST API, and after each step the books compared with the hardware.

The books are /api/gpus/: each GPU's occupants with their reserved_bytes, and its available_bytes.
The hardware is NVML: each process's bytes on each GPU, and each GPU's free memory. For every GPU,
after every step:
- the occupants' reserved bytes, summed, must cover NVML's bytes of their processes, summed
  (a replica over its own reservation is named too);
- available_bytes must not exceed NVML's free memory plus what sleeping and absent occupants have
  reserved: memory the books call free must be free on the device.

Steps: up → agent registers the GPUs (their total against what CUDA can allocate) → deploy a and b
→ two requests each → sleep a → a request wakes a → scale a to 2 → concurrent requests to a, NVML
sampled meanwhile. Adapted from ../shared/gpu-2026-11-24/stack.py and stack2.py.

`up` gets a data directory of its own in the work directory, embedded PostgreSQL and Redis (the
server URLs of the calling environment are dropped), a free port and a random admin password.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_rows import Row, fmt_size, nvml_vs, ok_or_fail
from bench.report import ROOT
from gpuportal.wire.states import ReplicaState as S

PART = "stack"
ADMIN_USER = "admin"
# Enough for two small deployments and a scale-out; the virtual stack only checks the driver.
VIRTUAL_GPUS = "1x80GiB"
# Dropped from up's environment: it must start its own servers and register real GPUs (or the
# virtual ones asked for), whatever the calling shell points at.
DROPPED_ENV = ("DATABASE_URL", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "GPUPORTAL_VIRTUAL_GPUS", "GPUPORTAL_DATA_DIR")
READY_TIMEOUT_S = 180.0
GPUS_TIMEOUT_S = 120.0
SERVING_TIMEOUT_S = 300.0
SLEEP_TIMEOUT_S = 120.0
INFER_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
KV_TIMEOUT_S = 30.0
POLL_S = 0.5
REQUESTS_EACH = 2
SCALE_TO = 2
CONCURRENT_REQUESTS = 8
CONCURRENT_MAX_TOKENS = 64
NVML_SAMPLE_S = 0.05
SLEEPING_STATES = (S.SLEEPING,)


class StackFailed(Exception):
    """A step the later ones depend on failed; its row is already in the table."""


class ApiError(Exception):
    """The API answered a read with something other than a page of rows (it gets a row as a driver failure)."""


# -- the books against NVML (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class NvmlGpu:
    total: int
    free: int
    used: int
    procs: dict[int, int]  # pid → bytes on this GPU


@dataclass(frozen=True)
class Books:
    node: str
    gpu: int
    occupants: int
    reserved_bytes: int  # Σ occupants' reserved_bytes
    available_bytes: int
    nvml_bytes: int | None = None  # Σ NVML bytes, on this GPU, of every replica process of the portal
    free_bytes: int | None = None  # NVML's free memory of this GPU
    # Reserved by occupants whose memory is not on the device: asleep, or with no process NVML lists.
    slack_bytes: int = 0
    unseen: list[str] = field(default_factory=list)  # occupants with a pid NVML does not list here
    over_by_replica: dict[str, int] = field(default_factory=dict)  # occupant → NVML bytes above its reservation
    unreserved: dict[str, int] = field(default_factory=dict)  # replica on this GPU, not an occupant → bytes
    strangers: dict[int, int] = field(default_factory=dict)  # processes that are no replica → bytes

    def check(self) -> str:
        if self.nvml_bytes is None or self.free_bytes is None:
            return "unverified: no NVML figures (virtual GPUs)"
        if self.occupants and len(self.unseen) == self.occupants and not self.nvml_bytes:
            return "unverified: NVML lists none of the replicas' processes (a container's own PID namespace?)"
        problems = []
        if self.nvml_bytes > self.reserved_bytes:
            problems.append(f"NVML {fmt_size(self.nvml_bytes - self.reserved_bytes)} above the reservations")
        if self.available_bytes > self.free_bytes + self.slack_bytes:
            excess = self.available_bytes - self.free_bytes - self.slack_bytes
            problems.append(f"available {fmt_size(excess)} above NVML free + sleeping/absent reservations")
        return ok_or_fail(not problems, "; ".join(problems))

    def figure(self) -> str:
        reserve = f"{self.occupants} occupant(s) reserve {fmt_size(self.reserved_bytes)}"
        if self.nvml_bytes is None or self.free_bytes is None:
            return f"{reserve}; available {fmt_size(self.available_bytes)}"
        text = (
            f"{reserve}, NVML {fmt_size(self.nvml_bytes)}; "
            f"available {fmt_size(self.available_bytes)}, NVML free {fmt_size(self.free_bytes)}"
        )
        if self.slack_bytes:
            text += f" (+{fmt_size(self.slack_bytes)} asleep/absent)"
        if self.over_by_replica:
            overs = ", ".join(f"{r[:8]} by {fmt_size(b)}" for r, b in sorted(self.over_by_replica.items()))
            text += f"; over its reservation: {overs}"
        if self.unreserved:
            held = ", ".join(f"{r[:8]} {fmt_size(b)}" for r, b in sorted(self.unreserved.items()))
            text += f"; replicas here without a reservation: {held}"
        if self.strangers:
            text += f"; {len(self.strangers)} other process(es), {fmt_size(sum(self.strangers.values()))}"
        return text


def compare_books(
    gpus: Iterable[Mapping[str, Any]], pids: Mapping[str, int | None], nvml: Mapping[int, NvmlGpu] | None, node: str
) -> list[Books]:
    """For each GPU of `node` in /api/gpus/ rows: its books against NVML's figures of the same moment.

    `pids` maps every replica's id to its pid (/api/replicas/), so that a replica holding memory on a
    GPU where it has no reservation (a sleeper's context, say) is counted against the books too.
    `nvml` maps NVML index → figures; None where there is no NVML (virtual GPUs). The GPU's `index`
    is NVML's: the agent registers NVML's indices and replicas run with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    by_pid = {pid: replica for replica, pid in pids.items() if pid is not None}
    out = []
    for gpu in gpus:
        if gpu.get("node") != node:
            continue
        index = int(gpu["index"])
        occupants = list(gpu.get("occupants") or [])
        reserved = sum(int(o.get("reserved_bytes") or 0) for o in occupants)
        available = int(gpu.get("available_bytes") or 0)
        device = nvml.get(index) if nvml is not None else None
        if device is None:
            out.append(Books(node, index, len(occupants), reserved, available))
            continue
        slack, unseen, over = 0, [], {}
        for occupant in occupants:
            replica = str(occupant.get("replica"))
            own = int(occupant.get("reserved_bytes") or 0)
            pid = pids.get(replica)
            used = device.procs.get(pid) if pid is not None else None
            if used is None:
                if pid is not None:
                    unseen.append(replica)
                slack += own  # none of it is on the device
                continue
            if occupant.get("state") in SLEEPING_STATES:
                slack += max(0, own - used)
            if used > own:
                over[replica] = used - own
        occupying = {str(o.get("replica")) for o in occupants}
        ours = {pid: used for pid, used in device.procs.items() if pid in by_pid}
        out.append(
            Books(
                node=node,
                gpu=index,
                occupants=len(occupants),
                reserved_bytes=reserved,
                available_bytes=available,
                nvml_bytes=sum(ours.values()),
                free_bytes=device.free,
                slack_bytes=slack,
                unseen=unseen,
                over_by_replica=over,
                unreserved={by_pid[pid]: used for pid, used in ours.items() if by_pid[pid] not in occupying},
                strangers={pid: used for pid, used in device.procs.items() if pid not in by_pid},
            )
        )
    return out


def registration(total_bytes: int, device: NvmlGpu | None) -> tuple[str, str]:
    """(figure, check): a GPU's registered total against what CUDA can allocate on it, which is
    NVML's total less what NVML shows used while no process holds memory (the driver's reserve)."""
    if device is None:
        return f"registered {fmt_size(total_bytes)}", "unverified: no NVML figures (virtual GPUs)"
    allocatable = device.total - device.used
    figure = (
        f"registered {fmt_size(total_bytes)}; NVML total {fmt_size(device.total)}, "
        f"used while idle {fmt_size(device.used)}"
    )
    if device.procs:
        return figure, f"unverified: {len(device.procs)} process(es) already on the GPU"
    excess = total_bytes - allocatable
    return figure, ok_or_fail(excess <= 0, f"{fmt_size(excess)} above what CUDA can allocate")


def books_row(label: str, books: Books) -> Row:
    return Row(PART, f"books vs NVML, {label}, GPU {books.gpu}", books.figure(), books.check())


def kv_row(label: str, replica: Mapping[str, Any], max_tokens: int) -> Row:
    kv = replica.get("kv") or {}
    what = f"{label}: KV pool of {str(replica.get('id'))[:8]}"
    if kv.get("blocks_total") is None or kv.get("block_tokens") is None:
        return Row(PART, what, "no KV pool reported", "FAIL: no KV pool")
    capacity = int(kv["blocks_total"]) * int(kv["block_tokens"])
    figure = f"{kv['blocks_total']} blocks × {kv['block_tokens']} tokens = {capacity} tokens"
    return Row(PART, what, figure, ok_or_fail(capacity >= max_tokens, f"below max_tokens {max_tokens}"))


def stack_rows(result: Mapping[str, Any]) -> list[Row]:
    """The rows run_stack collected, in order."""
    return [Row(**row) for row in result.get("rows") or []]


# -- NVML --------------------------------------------------------------------------------------


def nvml_snapshot() -> dict[int, NvmlGpu] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            procs: dict[int, int] = {}
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
            out[index] = NvmlGpu(total=int(memory.total), free=int(memory.free), used=int(memory.used), procs=procs)
        return out
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class PeakSampler:
    """NVML per process, sampled while requests run: the largest figure each pid reached on each GPU."""

    def __init__(self) -> None:
        self.peaks: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for index, device in (nvml_snapshot() or {}).items():
                for pid, used in device.procs.items():
                    self.peaks[(index, pid)] = max(self.peaks.get((index, pid), 0), used)
            self._stop.wait(NVML_SAMPLE_S)


# -- the REST API ------------------------------------------------------------------------------


class Api:
    def __init__(self, base: str):
        self.base = base
        self.token: str | None = None

    def call(
        self, method: str, path: str, body: Any = None, form: Mapping[str, str] | None = None, timeout: float = 60
    ) -> tuple[int, Any]:
        """(HTTP status, JSON body or text); status 0 with the error's repr when nothing answered."""
        headers = {"Authorization": f"Token {self.token}"} if self.token else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif form is not None:
            data = urllib.parse.urlencode(form).encode()
        url = path if path.startswith("http") else self.base + path
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                code, raw = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            code, raw = exc.code, exc.read().decode(errors="replace")
        except (OSError, ValueError) as exc:
            return 0, repr(exc)
        try:
            return code, json.loads(raw)
        except ValueError:
            # An error page is cut for the table; an answer is whole (/metrics runs to many kB, and
            # its GPU gauges come after the first 2000 characters: cut, they read as "not exported").
            return code, raw if 200 <= code < 300 else raw[:2000]

    def rows(self, path: str) -> list[dict[str, Any]]:
        """Every row of a paginated list (following `next`)."""
        out: list[dict[str, Any]] = []
        url: str | None = path
        while url:
            code, body = self.call("GET", url)
            if code != 200 or not isinstance(body, dict):
                raise ApiError(f"GET {path}: {code} {str(body)[:200]}")
            out += body.get("results") or []
            url = body.get("next")
        return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _error_of(body: Any) -> str:
    if isinstance(body, dict):
        for key in ("error", "detail", "failure_reason", "message"):
            if body.get(key):
                return str(body[key])[:300]
    return str(body)[:300]


# -- the run -----------------------------------------------------------------------------------


class Driver:
    def __init__(
        self,
        api: Api,
        up: subprocess.Popen,
        log_path: Path,
        result: dict[str, Any],
        *,
        password: str,
        virtual: bool,
        max_tokens: int,
    ):
        self.api = api
        self.password = password
        self.up = up
        self.log_path = log_path
        self.result = result
        self.virtual = virtual
        self.max_tokens = max_tokens
        self.node = "local"  # up's default node name

    # -- recording

    def row(self, what: str, figure: str = "", check: str = "") -> None:
        self.result["rows"].append(asdict(Row(PART, what, figure, check)))

    def fail(self, what: str, why: str) -> StackFailed:
        self.row(what, "", f"FAIL: {why}")
        return StackFailed(why)

    def snapshot(self, label: str) -> list[Books]:
        gpus = self.api.rows("/api/gpus/")
        replicas = self.api.rows("/api/replicas/")
        nvml = None if self.virtual else nvml_snapshot()
        books = compare_books(gpus, {r["id"]: r.get("pid") for r in replicas}, nvml, self.node)
        self.result["snapshots"].append(
            {
                "label": label,
                "gpus": gpus,
                "replicas": replicas,
                "nvml": {i: asdict(d) for i, d in (nvml or {}).items()},
                "books": [asdict(b) for b in books],
            }
        )
        for b in books:
            self.result["rows"].append(asdict(books_row(label, b)))
        return books

    # -- waiting

    def up_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [line.strip() for line in self.log_path.read_text().splitlines() if line.strip()]
            return lines[-1][:300] if lines else "no output"
        return "no output"

    def wait(self, what: str, timeout: float, probe: Callable[[], Any]) -> Any:
        """Poll `probe` until it returns something true; StackFailed (with a row) past the timeout
        or when `up` died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.up.poll() is not None:
                raise self.fail(what, f"manage.py up exited with {self.up.returncode}: {self.up_tail()}")
            found = probe()
            if found:
                return found
            time.sleep(POLL_S)
        raise self.fail(what, f"not within {timeout:.0f} s")

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        return [r for r in self.api.rows("/api/replicas/") if r.get("deployment") == deployment]

    def wait_replicas(self, what: str, deployment: str, states: set[str], count: int, timeout: float) -> list[dict]:
        def settled() -> list[dict] | None:
            mine = self.replicas(deployment)
            failed = [r for r in mine if r.get("state") == S.FAILED]
            if failed:
                raise self.fail(what, f"replica {failed[0]['id'][:8]} failed: {failed[0].get('failure_reason')}")
            if len(mine) >= count and all(r.get("state") in states for r in mine):
                return mine
            return None

        return self.wait(what, timeout, settled)

    def with_kv(self, deployment: str, replicas: list[dict]) -> list[dict]:
        """The replicas again once each reports its KV pool: the serving loop publishes the figures
        (gpuportal.wire.kvstats) a moment after the state changes. Whatever they say at the deadline."""
        wanted = {r["id"] for r in replicas}
        deadline = time.monotonic() + KV_TIMEOUT_S
        while True:
            mine = [r for r in self.replicas(deployment) if r["id"] in wanted]
            if all(r.get("kv") for r in mine) or time.monotonic() > deadline:
                return mine
            time.sleep(POLL_S)

    def infer(self, deployment: str, max_tokens: int = 16) -> tuple[bool, str, float]:
        """One request through /infer/, following a 202 to its end: (answered, why not, seconds)."""
        began = time.monotonic()
        body = {"input": "Hello", "params": {"max_tokens": max_tokens}, "timeout_s": INFER_TIMEOUT_S}
        code, answer = self.api.call(
            "POST", f"/api/deployments/{deployment}/infer/", body=body, timeout=INFER_TIMEOUT_S + 30
        )
        deadline = began + INFER_TIMEOUT_S * 2
        while code == 202 and isinstance(answer, dict) and answer.get("id") and time.monotonic() < deadline:
            time.sleep(POLL_S)
            _, polled = self.api.call("GET", f"/api/requests/{answer['id']}/")
            if isinstance(polled, dict) and polled.get("status") in ("done", "failed", "cancelled"):
                code = 200 if polled["status"] == "done" else 500
                answer = polled
        seconds = time.monotonic() - began
        return code == 200, "" if code == 200 else f"{code}: {_error_of(answer)}", seconds

    # -- the steps

    def run(self, model_dir: Path, deployments: list[tuple[str, str]]) -> None:
        began = time.monotonic()
        self.wait("manage.py up", READY_TIMEOUT_S, lambda: self.api.call("GET", "/readyz", timeout=5)[0] == 200)
        self.row("manage.py up", f"ready in {time.monotonic() - began:.1f} s", "ok")
        form = {"username": ADMIN_USER, "password": self.password}
        code, body = self.api.call("POST", "/api/auth/token/", form=form)
        if code != 200 or not isinstance(body, dict) or not body.get("token"):
            raise self.fail("API token", f"{code}: {_error_of(body)}")
        self.api.token = body["token"]

        gpus = self.wait("agent registers its GPUs", GPUS_TIMEOUT_S, lambda: self.api.rows("/api/gpus/"))
        mine = [g for g in gpus if g.get("node") == self.node]
        virtual = [g for g in mine if g.get("virtual")]
        names = ", ".join(sorted({str(g.get("product")) for g in mine}))
        if virtual and not self.virtual:
            raise self.fail("agent registers its GPUs", f"registered virtual GPUs ({names}): NVML found none")
        self.row("agent registers its GPUs", f"{len(mine)}: {names}", "ok")
        nvml = None if self.virtual else nvml_snapshot()
        for gpu in mine:
            device = nvml.get(int(gpu["index"])) if nvml is not None else None
            figure, check = registration(int(gpu["total_bytes"]), device)
            self.row(f"GPU {gpu['index']} total_bytes vs CUDA's", figure, check)
        self.snapshot("idle")

        for name, dtype in deployments:
            self.deploy(name, dtype, model_dir)
        for name, _ in deployments:
            results = [self.infer(name) for _ in range(REQUESTS_EACH)]
            self.requests_row(f"{name}: {REQUESTS_EACH} requests", results)
        self.snapshot("serving, after requests")

        first = deployments[0][0]
        code, body = self.api.call("POST", f"/api/deployments/{first}/sleep/", body={})
        if code >= 300:
            raise self.fail(f"{first}: sleep", f"{code}: {_error_of(body)}")
        began = time.monotonic()
        self.wait_replicas(f"{first}: sleep", first, set(SLEEPING_STATES), 1, SLEEP_TIMEOUT_S)
        self.row(f"{first}: sleep", f"asleep in {time.monotonic() - began:.1f} s", "ok")
        self.snapshot(f"{first} asleep")

        self.requests_row(f"{first}: a request wakes it", [self.infer(first)])
        woken = self.wait_replicas(f"{first}: woken", first, {"serving"}, 1, SERVING_TIMEOUT_S)
        for replica in self.with_kv(first, woken):
            self.result["rows"].append(asdict(kv_row(f"{first} woken", replica, self.max_tokens)))
        self.snapshot(f"{first} woken")

        code, body = self.api.call("POST", f"/api/deployments/{first}/scale/", body={"replicas": SCALE_TO})
        if code >= 300:
            raise self.fail(f"{first}: scale to {SCALE_TO}", f"{code}: {_error_of(body)}")
        began = time.monotonic()
        scaled = self.wait_replicas(f"{first}: scale to {SCALE_TO}", first, {"serving"}, SCALE_TO, SERVING_TIMEOUT_S)
        self.row(f"{first}: scale to {SCALE_TO}", f"serving in {time.monotonic() - began:.1f} s", "ok")
        for replica in self.with_kv(first, scaled):
            self.result["rows"].append(asdict(kv_row(f"{first} ×{SCALE_TO}", replica, self.max_tokens)))
        self.concurrent(first, scaled)
        self.snapshot(f"{first} ×{SCALE_TO}, after concurrent requests")
        self.overcommit_metric()

    def deploy(self, name: str, dtype: str, model_dir: Path) -> None:
        began = time.monotonic()
        body = {
            "name": name,
            "model": {"source": str(model_dir), "loader": "transformers", "dtype": dtype},
            "replicas": 1,
            "memory": {"max_tokens": self.max_tokens},
            # Nothing may fall asleep on its own between the steps that look at it.
            "sleep": {"idle_timeout_s": 3600},
        }
        code, answer = self.api.call("POST", "/api/deployments/", body=body)
        if code != 201:
            raise self.fail(f"deploy {name} ({dtype})", f"{code}: {_error_of(answer)}")
        memory = (answer.get("memory") or {}) if isinstance(answer, dict) else {}
        serving = self.wait_replicas(f"deploy {name} ({dtype})", name, {"serving"}, 1, SERVING_TIMEOUT_S)
        need = memory.get("need_bytes")
        self.row(
            f"deploy {name} ({dtype})",
            f"serving in {time.monotonic() - began:.1f} s; need at deploy {fmt_size(need)}",
            "ok",
        )
        for replica in self.with_kv(name, serving):
            self.result["rows"].append(asdict(kv_row(f"{name} loaded", replica, self.max_tokens)))

    def requests_row(self, what: str, results: list[tuple[bool, str, float]]) -> None:
        answered = sum(ok for ok, _, _ in results)
        slowest = max(s for _, _, s in results)
        errors = sorted({why for ok, why, _ in results if not ok})
        figure = f"{answered} of {len(results)} answered 200 (slowest {slowest:.2f} s)"
        self.row(what, figure, ok_or_fail(answered == len(results), "; ".join(errors)))

    def concurrent(self, deployment: str, replicas: list[dict[str, Any]]) -> None:
        results: list[tuple[bool, str, float]] = []
        lock = threading.Lock()

        def one() -> None:
            outcome = self.infer(deployment, CONCURRENT_MAX_TOKENS)
            with lock:
                results.append(outcome)

        with PeakSampler() as sampler:
            threads = [threading.Thread(target=one) for _ in range(CONCURRENT_REQUESTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        self.requests_row(
            f"{deployment}: {CONCURRENT_REQUESTS} concurrent requests (max_tokens {CONCURRENT_MAX_TOKENS})", results
        )
        if self.virtual:
            return
        for replica in replicas:
            for index, reserved in (replica.get("gpu_mem_bytes_by_id") or {}).items():
                peak = sampler.peaks.get((int(index), int(replica.get("pid") or -1)))
                figure, check = nvml_vs(peak, int(reserved), "peak NVML")
                self.row(f"{deployment}: peak NVML of {str(replica['id'])[:8]} during them, GPU {index}", figure, check)

    def overcommit_metric(self) -> None:
        code, text = self.api.call("GET", "/metrics")
        if code != 200 or not isinstance(text, str):
            self.row("gpuportal_gpu_overcommit_bytes", f"/metrics: {code}", "")
            return
        samples = [line for line in text.splitlines() if line.startswith("gpuportal_gpu_overcommit_bytes")]
        if not samples:
            self.row("gpuportal_gpu_overcommit_bytes", "not exported", "")
            return
        values = [float(line.rsplit(" ", 1)[-1]) for line in samples]
        figure = ", ".join(f"{fmt_size(v)}" for v in values)
        self.row("gpuportal_gpu_overcommit_bytes", figure, ok_or_fail(max(values) <= 0, "the agent saw an overcommit"))


def stop_up(up: subprocess.Popen) -> int | None:
    """Ctrl-C, as a person would: up stops its processes, then its servers. Killed past the timeout."""
    if up.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            up.send_signal(signal.SIGINT)
        try:
            up.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # Its own session (start_new_session): the group is up and what it did not detach.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
    return up.returncode


def run_stack(
    *, model_dir: Path, deployments: list[tuple[str, str]], max_tokens: int, work: Path, virtual: bool = False
) -> dict[str, Any]:
    result: dict[str, Any] = {"rows": [], "snapshots": []}
    data = work / "stack"
    password = secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(GPUPORTAL_ADMIN_USER=ADMIN_USER, GPUPORTAL_ADMIN_PASSWORD=password, PYTHONUNBUFFERED="1")
    port = free_port()
    argv = [sys.executable, "manage.py", "up", "--port", str(port), "--data-dir", str(data), "--quiet"]
    if virtual:
        argv += ["--virtual-gpus", VIRTUAL_GPUS]
    log_path = work / "up.log"
    api = Api(f"http://127.0.0.1:{port}")
    with open(log_path, "w") as log:
        up = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        driver = Driver(api, up, log_path, result, password=password, virtual=virtual, max_tokens=max_tokens)
        try:
            driver.run(model_dir, deployments)
        except StackFailed:
            pass  # its row says why; the steps after it depend on it
        except Exception as exc:  # a bug here, or an answer shaped unlike the API's: still stop up
            result["rows"].append(asdict(Row(PART, "driver", "", f"FAIL: {type(exc).__name__}: {exc}"[:400])))
        finally:
            result["up_exit"] = stop_up(up)
    # The logs stay in the work directory; the servers' data would only fill it.
    for server in ("postgres", "redis"):
        shutil.rmtree(data / server, ignore_errors=True)
    return result
