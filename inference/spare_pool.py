"""The node agent's warm spares: one replica process per GPU, started ahead of need, its CUDA
context made there (inference.warm_spare), for the next replica started on that GPU to run in.

The supervisor asks the pool for a spare as it starts a replica (`take`), and the pool starts
the next one for that GPU at once. A spare that dies before it is warm (a GPU it cannot use, a
broken driver) is started again after a pause; one that cannot be warmed three times in a row is
given up on that GPU, saying why, and the replicas started there start the plain way.

What a spare holds on its GPU is memory placement must not use. The agent counts it in what
its beat says other processes hold on each GPU (inference.agent.NodeAgent.foreign), as a slot of
one context per GPU it keeps a spare on, whether that spare is warm, starting, or was just
taken by a replica (whose own reservation counts its context from then on), so that a spare's
coming and going moves no figure of the books: `slots`.

Django-free, like the supervisor that holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.forkserver import ForkedProcess
from inference.warm_spare import FLAG

log = logging.getLogger(__name__)

Process = subprocess.Popen | ForkedProcess
# Starts a process of the replica program: (its arguments, the GPU's backend, its log, its name).
Spawn = Callable[[list[str], str, Path, str], Process]
# A spare that cannot be warmed this many times in a row is given up on its GPU.
GIVE_UP_AFTER = 3
# The pause before a spare that died is started again.
RETRY_S = 2.0
# How long a spare that is told to go may take before it is killed.
STOP_TIMEOUT_S = 5.0


@dataclass
class Spare:
    gpu: int
    backend: str
    process: Process
    log_path: Path
    # Set once it said it is warm.
    ready: threading.Event = field(default_factory=threading.Event)
    # What it holds on its GPU, as it said once warm.
    context_bytes: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class _Slot:
    """A GPU the pool keeps a spare on."""

    backend: str
    # The memory its spare holds: the estimate until one says what it holds.
    context_bytes: int
    spare: Spare | None = None
    failures: int = 0
    given_up: str = ""


class SparePool:
    """Thread-safe: the supervisor takes from it on Celery task threads; its own threads start
    and watch the spares."""

    def __init__(self, log_dir: Path, spawn: Spawn, submit: Callable[[Callable[[], Any]], Any]):
        self.log_dir = log_dir
        # Starts a spare's process; called through `submit`, on the supervisor's spawner thread,
        # which its PR_SET_PDEATHSIG ties it to.
        self._spawn = spawn
        self._submit = submit
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._closed = threading.Event()

    def keep(self, backend: str, gpus: list[int], context_bytes: int) -> None:
        """A spare on each of `gpus` from now on, each held to hold `context_bytes` until it says."""
        with self._lock:
            for gpu in gpus:
                if gpu not in self._slots:
                    self._slots[gpu] = _Slot(backend, context_bytes)
        for gpu in gpus:
            self._refill(gpu)

    def take(self, gpu: int, backend: str) -> Spare | None:
        """The warm spare of `gpu`, for a replica of `backend` to run in; None where there is none
        warm. The next one starts at once."""
        with self._lock:
            slot = self._slots.get(gpu)
            if slot is None or slot.backend != backend or slot.spare is None or not slot.spare.ready.is_set():
                return None
            spare, slot.spare = slot.spare, None
        self._refill(gpu)
        if spare.process.poll() is not None:  # it died waiting: this start goes the plain way
            _release(spare)
            return None
        return spare

    def slots(self) -> dict[str, int]:
        """{GPU index: bytes} the node's spares hold or are held to, per GPU it keeps one on."""
        with self._lock:
            return {str(gpu): slot.context_bytes for gpu, slot in self._slots.items() if not slot.given_up}

    def pids(self) -> set[int]:
        with self._lock:
            return {slot.spare.pid for slot in self._slots.values() if slot.spare is not None}

    def warm(self) -> dict[int, int]:
        """{GPU index: pid} of the spares warm now."""
        with self._lock:
            return {
                gpu: slot.spare.pid
                for gpu, slot in self._slots.items()
                if slot.spare is not None and slot.spare.ready.is_set()
            }

    def given_up(self) -> dict[int, str]:
        with self._lock:
            return {gpu: slot.given_up for gpu, slot in self._slots.items() if slot.given_up}

    def close(self) -> None:
        """Stop every spare: their stdin closed, which they take as their agent gone."""
        self._closed.set()
        with self._lock:
            spares = [slot.spare for slot in self._slots.values() if slot.spare is not None]
            for slot in self._slots.values():
                slot.spare = None
        for spare in spares:
            with contextlib.suppress(OSError, ValueError):
                assert spare.process.stdin is not None
                spare.process.stdin.close()
        for spare in spares:
            try:
                spare.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                spare.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spare.process.wait(STOP_TIMEOUT_S)
            _release(spare)

    # -- the spares' lives ---------------------------------------------------------------------

    def _refill(self, gpu: int) -> None:
        if self._closed.is_set():
            return
        self._submit(lambda: self._start(gpu))

    def _start(self, gpu: int) -> None:
        with self._lock:
            slot = self._slots.get(gpu)
            if slot is None or slot.spare is not None or slot.given_up or self._closed.is_set():
                return
            backend, context_bytes = slot.backend, slot.context_bytes
        log_path = self.log_dir / f"spare-gpu{gpu}.log"
        argv = [FLAG, "--gpu", str(gpu), "--backend", backend, "--context-bytes", str(context_bytes)]
        try:
            process = self._spawn(argv, backend, log_path, f"spare-gpu{gpu}")
        except OSError as exc:
            self._failed(gpu, f"cannot start it: {exc}")
            return
        spare = Spare(gpu, backend, process, log_path)
        with self._lock:
            slot.spare = spare
        threading.Thread(target=self._watch, args=(spare,), name=f"spare-gpu{gpu}", daemon=True).start()

    def _watch(self, spare: Spare) -> None:
        """Read the spare's one line (warm, or failed): what follows on its stdout is the replica's
        it becomes, read by that replica's reader."""
        assert spare.process.stdout is not None
        try:
            line = spare.process.stdout.readline()
            said = json.loads(line) if line.strip() else {}
        except (OSError, ValueError):
            said = {}
        if said.get("event") == "spare":
            spare.context_bytes = int(said.get("context_bytes") or 0)
            with self._lock:
                slot = self._slots.get(spare.gpu)
                if slot is not None:
                    slot.failures = 0
                    slot.context_bytes = max(slot.context_bytes, spare.context_bytes)
            spare.ready.set()
            log.info(
                "warm spare on GPU %d: pid %d, %d bytes there, warm in %s s",
                spare.gpu,
                spare.pid,
                spare.context_bytes,
                said.get("seconds"),
            )
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            spare.process.wait(STOP_TIMEOUT_S)
        _release(spare)
        if self._closed.is_set():
            return
        reason = str(said.get("reason") or f"it exited before it was warm (see {spare.log_path})")
        with self._lock:
            slot = self._slots.get(spare.gpu)
            if slot is not None and slot.spare is spare:
                slot.spare = None
        self._failed(spare.gpu, reason)

    def _failed(self, gpu: int, reason: str) -> None:
        with self._lock:
            slot = self._slots.get(gpu)
            if slot is None:
                return
            slot.failures += 1
            if slot.failures >= GIVE_UP_AFTER:
                slot.given_up = reason
        if slot.given_up:
            log.warning(
                "no warm spare on GPU %d after %d tries (%s): replicas start there the plain way",
                gpu,
                GIVE_UP_AFTER,
                reason,
            )
            return
        log.warning("the warm spare on GPU %d did not start (%s); again in %.0f s", gpu, reason, RETRY_S)
        # On a timer of its own: this may run on the spawner thread, which replicas' starts wait for.
        retry = threading.Timer(RETRY_S, self._refill, args=(gpu,))
        retry.daemon = True
        retry.start()


def _release(spare: Spare) -> None:
    """Its pipes, and the pidfd a forked one is watched through: a spare that ended is nobody's."""
    for stream in (spare.process.stdin, spare.process.stdout):
        with contextlib.suppress(OSError, ValueError):
            if stream is not None:
                stream.close()
    if isinstance(spare.process, ForkedProcess):
        spare.process.close()
