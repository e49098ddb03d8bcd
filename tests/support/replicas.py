"""Driving replica processes through a supervisor: specs, their events, and whether a pid is gone."""

from __future__ import annotations

import queue
import time
from typing import Any

import psutil

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_KERNEL_GROWTH_BYTES
from inference.supervisor import ReplicaSpec

MiB = 1024**2


CONTEXT = H100_CONTEXT_BYTES  # what a virtual GPU models per replica process by default
# What a virtual replica's context has grown to once it has served (kernels loaded), as a sleep leaves it.
SERVED_CONTEXT = CONTEXT + H100_KERNEL_GROWTH_BYTES


TINY_MLP = "tests.support.models:tiny_mlp"


BIG_MLP = "tests.support.models:big_mlp"


LOAD_TIMEOUT_S = 90.0


class Events:
    """An on_event callback that queues what the supervisor delivers, for tests to wait on."""

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()

    def __call__(self, replica_id: str, event: dict[str, Any]) -> None:
        self._queue.put({**event, "replica": replica_id})

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event within {timeout:.0f} s") from None

    def until(self, name: str, timeout: float = LOAD_TIMEOUT_S) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the events before it, the first `name` event); fails if the replica ends first."""
        deadline = time.monotonic() + timeout
        before: list[dict[str, Any]] = []
        while True:
            event = self.next(max(0.01, deadline - time.monotonic()))
            if event["event"] == name:
                return before, event
            if event["event"] in {"stopped", "failed"}:
                raise AssertionError(f"waited for {name}, but the replica ended: {event}")
            before.append(event)

    def final(self, timeout: float = LOAD_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.next(max(0.01, deadline - time.monotonic()))
            if event["event"] in {"stopped", "failed"}:
                return event


def spec(
    source: str,
    *,
    loader: str = "transformers",
    replica_id: str = "r1",
    gpus: tuple[int, ...] = (0,),
    reserved: int = CONTEXT + 96 * MiB,
    fraction: float | None = 0.03,
    backend: str = "virtual",
) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id,
        source=source,
        loader=loader,
        dtype="float32",
        gpus=gpus,
        reserved_bytes_by_gpu={str(g): reserved for g in gpus},
        fraction=fraction,
        backend=backend,
        # What the scheduler counts in every reservation beside the allocator (tasks.spec_for).
        context_bytes=CONTEXT if backend == "virtual" else 0,
    )


def gone(pid: int) -> bool:
    """True once `pid` no longer runs; a zombie counts as gone (PID 1 in a container may never reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
