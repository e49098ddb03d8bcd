"""The replica host program: one OS process per replica (docs/architecture.md), started by the node agent.

    python -m inference.replica --replica-id ID --source S --loader L --dtype D --gpus 0 \\
        --reserved-bytes-by-gpu '{"0": 734003200}' --fraction 0.03 --backend virtual|cuda

It speaks JSON lines: commands on stdin, events on stdout (one object a line, flushed), logs on
stderr. Only the protocol may reach stdout, so whatever else writes to file descriptor 1 (a
library's print, a C extension) is sent to stderr instead.

Events:   progress {state, percent, detail} · serving {pid, weights_bytes, process_bytes,
          gpu_mem_bytes_by_id, ...} · sleeping {residual_bytes_by_id, ...} · woken {gpu_mem_bytes_by_id, ...}
          · pong {state, pid, arena_bytes} · error {cmd, reason} (a command refused; the replica carries on)
          · failed {reason, kind: oom|load|cuda_assert|crash}, then exit 1 · stopped, then exit 0
          · hello {replica_id, pid, state, last} (first to an agent that adopted it)
          · arena {kept_bytes, failed?} (the host arena an awake replica keeps for its next sleep:
          ready, or 0 once dropped, or 0 with `failed` when it could not be allocated; a sleep
          consumes it into the arena its `sleeping` counts as cpu_bytes).
Commands: sleep {drain_timeout_s} · wake {gpus, reserved_bytes_by_gpu, fraction} · stop {drain_timeout_s}
          · arena {keep} (whether it may keep a host arena while awake)
          · ping · resync (emit the last state event again). EOF on stdin: the agent is gone: exit, or
          with --adoption-window, wait that long for a new agent on --adopt-address (inference.adoption).

Sleep and stop pass the preemption barrier: no new request starts, the one in flight
has `drain_timeout_s` (default 30) to finish, then it is cut short and given back to the head of
its queue, and only then are the weights moved or released.

`--backend cuda` follows seed 000: target the first GPU, cap the process with
set_per_process_memory_fraction, place weights with accelerate under max_memory (0 on GPUs it does
not own) and check where they landed; sleep packs them into one pinned host allocation (an
arena, inference.arena) and lifts the cap; wake targets the possibly new GPUs, queues the
arena's copies there, allocates the KV pool while they run, synchronises once and frees the
arena. `--backend virtual` runs the same host on CPU (sleep and wake through the
same arena, with plain host copies) and enforces the reservation in software: weights bigger than
it fail exactly like an out-of-memory.

No Django here: the process must start fast and must not hold database connections.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TextIO

from gpuportal.wire.requestqueue import Fence, RequestQueue
from gpuportal.wire.states import PROCESS_STARTING, Role
from gpuportal.wire.states import ReplicaState as S
from inference import load_slots
from inference.allocator import give_back_cached
from inference.event_stream import EventWriter
from inference.hub import local_model_dir
from inference.loaders import DIRECTORY_LOADERS, EMBEDDING, LOADERS, TRANSFORMERS
from inference.process_exit import exit_now as _exit
from inference.serving import Executor, Server

if TYPE_CHECKING:
    from torch import nn

    from gpuportal.wire.memory import MemoryEstimate, ModelShape
    from inference.arena import Arena, PendingCopies
    from inference.embedding import Recipe
    from inference.paged import PagedModel
    from inference.pairing import PairMember
    from inference.warmup import WarmUp

log = logging.getLogger("inference.replica")

PR_SET_PDEATHSIG = 1
BACKENDS = ("virtual", "cuda")
FAILURE_KINDS = ("oom", "load", "cuda_assert", "crash")
MiB = 1024**2
_MAX_REASON = 500
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The deployment's default memory.max_tokens: what the activation budget was sized for when the
# agent does not say (scheduling.services.deployments' default).
DEFAULT_KV_MAX_TOKENS = 2048
# Once aborted, a generation stops at its next token; a forward pass runs to its end. Say so in the
# log at this interval while waiting for it.
_ABORT_LOG_EVERY_S = 10.0


class ReplicaFailure(Exception):
    """Ends the replica: reported as a `failed` event of this kind, then the process exits non-zero."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class CommandRejected(Exception):
    """A command that makes no sense now (sleep while loading, bad fields): answered with `error`."""


def mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.1f} MiB"


def classify_failure(exc: BaseException, default_kind: str) -> ReplicaFailure:
    """Name what went wrong the way the agent acts on it (a device-side assert is restarted)."""
    if isinstance(exc, ReplicaFailure):
        return exc
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "device-side assert" in text:
        kind = "cuda_assert"
    elif type(exc).__name__ in {"OutOfMemoryError", "MemoryError"} or "out of memory" in text.lower():
        kind = "oom"
        text = text if text.lower().startswith("out of memory") else f"out of memory: {text}"
    else:
        kind = default_kind
        # ValueError is how the loaders say what is wrong with a source; other types name a bug.
        text = text if isinstance(exc, ValueError) else f"{type(exc).__name__}: {text}"
    return ReplicaFailure(kind, text[:_MAX_REASON])


@dataclass(frozen=True)
class Placement:
    """Where the replica runs and what it may use there: GPU ids, reserved bytes per GPU, fraction cap."""

    gpus: tuple[int, ...]
    reserved_bytes_by_gpu: dict[str, int]
    # Only a single-GPU replica is capped by fraction; a multi-GPU replica owns whole GPUs.
    fraction: float | None

    @classmethod
    def parse(cls, gpus: Any, reserved: Any, fraction: Any) -> Placement:
        """From a command or the command line; ValueError naming the bad field."""
        if not isinstance(gpus, list | tuple) or not gpus:
            raise ValueError(f"gpus must be a non-empty list of GPU ids, got {gpus!r}")
        if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            raise ValueError(f"gpus must be non-negative integers, got {gpus!r}")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus lists a GPU twice: {gpus!r}")
        if not isinstance(reserved, dict) or set(reserved) != {str(g) for g in gpus}:
            raise ValueError(f"reserved_bytes_by_gpu must have one entry per GPU in {list(gpus)}, got {reserved!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in reserved.values()):
            raise ValueError(f"reserved_bytes_by_gpu values must be positive byte counts, got {reserved!r}")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float)):
            raise ValueError(f"fraction must be a number or null, got {fraction!r}")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        return cls(tuple(gpus), dict(reserved), float(fraction) if fraction is not None and len(gpus) == 1 else None)

    @property
    def reserved_total(self) -> int:
        return sum(self.reserved_bytes_by_gpu.values())

    def max_memory(self, device_count: int) -> dict[int | str, int]:
        """accelerate's max_memory: the reservation on each own GPU, 0 on every other one.

        No "cpu" entry: weights that do not fit must fail, not run from host memory. accelerate still
        sends overflow to "disk", so CudaBackend checks the size first and verify() catches any spill.
        """
        limits: dict[int | str, int] = dict.fromkeys(range(device_count), 0)
        for gpu in self.gpus:
            limits[gpu] = self.reserved_bytes_by_gpu[str(gpu)]
        return limits


def check_cap(weights: int, placement: Placement, outside_allocator: int = 0) -> None:
    """The reservation as a hard limit on weights: what a virtual GPU enforces, and a real one checks first.

    `outside_allocator` is what the reservation holds beside the allocator (the CUDA contexts):
    the weights must fit in what is left, as they would have to under a real GPU's cap.
    """
    room = placement.reserved_total - outside_allocator
    if weights > room:
        beside = f" less {mib(outside_allocator)} of CUDA context" if outside_allocator else ""
        raise ReplicaFailure(
            "oom",
            f"out of memory: weights need {mib(weights)} ({weights} bytes), reservation is "
            f"{mib(placement.reserved_total)} ({placement.reserved_total} bytes){beside} "
            f"on GPUs {list(placement.gpus)}",
        )


class Backend(Protocol):
    name: str
    keep_arena: bool
    spare: Arena | None

    def attach(self, placement: Placement) -> None: ...
    def load(self, source: str, loader: str, dtype: str, placement: Placement) -> nn.Module: ...
    def verify(self, model: nn.Module, placement: Placement) -> None: ...
    def to_cache(self, model: nn.Module, placement: Placement) -> dict[str, int | None]: ...
    def from_cache(self, model: nn.Module, placement: Placement) -> tuple[nn.Module, PendingCopies]: ...
    def load_to_cache(
        self, source: str, loader: str, dtype: str, placement: Placement
    ) -> tuple[nn.Module, dict[str, int | None]]: ...
    def process_bytes_by_id(self) -> dict[str, int] | None: ...
    def context_bytes_measured(self, placement: Placement) -> int: ...
    def outside_allocator_bytes(self, placement: Placement, context_bytes: int) -> int: ...
    def release(self) -> None: ...
    def prepare_spare(self, model: nn.Module) -> Arena: ...
    def drop_spare(self) -> int: ...
    def collect_kept(self, copies: PendingCopies) -> None: ...


class ArenaKeeper:
    """A backend's kept arena (inference.arena, its Policy). Where the control plane
    allows it (`keep_arena`, set by the `arena` command), an awake replica holds `spare`: a host
    arena of its weights' layout allocated, and on a GPU page-locked, in advance, holding a copy of
    its weights; a wake keeps the arena it read as the spare instead of freeing it. The next sleep
    packs into the spare: no allocation, no pinning, and no copy of what serving left unwritten
    (every weight) on its path. Both backends run this one logic; only whether the spare is pinned
    differs (`pin_spare`)."""

    # Page-lock the spare: a GPU's sleep copies into it with the DMA engine, the CPU's does not.
    pin_spare: ClassVar[bool] = False

    def __init__(self) -> None:
        # May this replica keep an arena while awake: the control plane counts it in the node's
        # host cache (scheduling.services.host_cache) only when it said so.
        self.keep_arena = False
        # The arena held ready for the next sleep; None when there is none (consumed by a sleep).
        self.spare: Arena | None = None

    def prepare_spare(self, model: nn.Module) -> Arena:
        """The spare for `model` as it is now: the one held, else one allocated (and pinned) now
        and filled with a copy of the weights (`arena.fill`), so that the next sleep copies nothing
        it left unwritten, as after a wake that kept its arena. Gigabytes take seconds to pin and
        to copy: ReplicaHost runs this off its command loop, while the replica serves."""
        from inference.arena import fill, spare

        if self.spare is None or self.spare.released:
            prepared = spare(model, pin=self.pin_spare)
            fill(model, prepared)
            self.spare = prepared
        return self.spare

    def drop_spare(self) -> int:
        """Free the spare (a pinned one in the background, off the command loop); returns its
        bytes, 0 when none was held."""
        from inference.arena import release_later

        held, self.spare = self.spare, None
        if held is None:
            return 0
        nbytes = held.nbytes
        release_later(held)
        return nbytes

    def collect_kept(self, copies: PendingCopies) -> None:
        """After a wake's `wait()`: the arena it kept (with `keep_arena`) is the next sleep's spare."""
        kept = copies.kept
        if kept is not None:
            self.drop_spare()  # none expected: the sleep before this wake consumed it
            self.spare = kept

    def _pack(self, model: nn.Module, *, pin: bool | None = None) -> Arena:
        """`pack`, into the spare when one is held: it is consumed either way (taken, or freed
        for another layout's fresh arena)."""
        from inference.arena import pack

        held, self.spare = self.spare, None
        return pack(model, pin=pin, into=held)

    def _release_spare(self) -> None:
        if self.spare is not None:
            self.spare.release()
            self.spare = None


class VirtualBackend(ArenaKeeper):
    """CPU stands in for the GPUs; the reservation is enforced by ReplicaHost's software cap.

    It accounts like the real GPU of its profile (inference.devices.VirtualProfile): the process
    holds a CUDA context from its first attach (a standby's smaller one until it serves), keeps
    it while asleep, and the allocator holds what gpuportal.wire.memory.allocation_bytes says. The
    figures NVML would show are ReplicaHost.process_bytes_by_id's model of them.
    """

    name = "virtual"

    def __init__(self, profile: Any | None = None):
        from inference.devices import VirtualProfile

        super().__init__()
        self.profile = profile or VirtualProfile.from_env()
        # The context this process would hold on its first GPU: none until it attaches.
        self.context_bytes = 0
        # The weights while asleep or standing by (inference.arena); None while awake.
        self.arena: Arena | None = None

    def attach(self, placement: Placement) -> None:
        self.context_bytes = max(self.context_bytes, self.profile.context_bytes)
        self._limit_threads()

    @staticmethod
    def _limit_threads() -> None:
        import torch

        # Replicas on virtual GPUs share the host's few cores. One intra-op thread each avoids
        # oversubscribing them, and spares every request the wake-up of pool threads that went
        # to sleep while the replica waited for work (measured: several ms per request).
        torch.set_num_threads(int(os.environ.get("GPUPORTAL_VIRTUAL_CPU_THREADS", "1")))

    def load(self, source: str, loader: str, dtype: str, placement: Placement) -> nn.Module:
        from inference.loaders import load_model

        return load_model(source, loader, dtype, device="cpu")

    def verify(self, model: nn.Module, placement: Placement) -> None:
        pass  # everything is on the CPU by construction

    def to_cache(self, model: nn.Module, placement: Placement) -> dict[str, int | None]:
        # The weights already live in host memory, but they go through the arena as a GPU's do
        # (plain host copies, into the spare when one is kept): CI runs the code a real sleep runs.
        # The context stays behind, as serving grew it: the kernels its forward passes loaded (a
        # real context measured at the load is smaller than the one a sleep leaves).
        self.arena = self._pack(model)
        self.context_bytes = max(self.context_bytes, self.profile.context_bytes + self.profile.kernel_bytes)
        return dict(self.residual(placement))

    def residual(self, placement: Placement) -> dict[str, int]:
        """What the process holds on its GPUs with no tensor there: its context, on the first."""
        held = {str(g): 0 for g in placement.gpus}
        held[str(placement.gpus[0])] = self.context_bytes
        return held

    def from_cache(self, model: nn.Module, placement: Placement) -> tuple[nn.Module, PendingCopies]:
        from inference.arena import PendingCopies, unpack_async

        self.attach(placement)
        if self.arena is None:
            return model, PendingCopies.complete()
        arena, self.arena = self.arena, None
        # Host copies are done when they return; the handle's wait frees the arena (an awake
        # replica holds no host copy unless allowed to keep it), where a GPU's wake synchronises.
        return model, unpack_async(model, arena, {"": "cpu"}, keep=self.keep_arena)

    def load_to_cache(
        self, source: str, loader: str, dtype: str, placement: Placement
    ) -> tuple[nn.Module, dict[str, int | None]]:
        from inference.arena import pack

        self._limit_threads()
        # A standby creates its context but never runs a forward pass: the smaller figure.
        self.context_bytes = max(self.context_bytes, self.profile.standby_context_bytes)
        model = self.load(source, loader, dtype, placement)
        self.arena = pack(model)  # held ready, as a GPU standby holds its pinned arena
        return model, dict(self.residual(placement))

    def process_bytes_by_id(self) -> dict[str, int] | None:
        return None  # no NVML: ReplicaHost models the figures

    def context_bytes_measured(self, placement: Placement) -> int:
        return self.context_bytes

    def outside_allocator_bytes(self, placement: Placement, context_bytes: int) -> int:
        return 0  # nothing but the context sits beside a virtual allocator

    def release(self) -> None:
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        self._release_spare()
        gc.collect()


class CudaBackend(ArenaKeeper):
    """Real NVIDIA GPUs: torch.cuda for targeting and the cap, accelerate for placement, NVML to measure."""

    name = "cuda"
    pin_spare = True

    def __init__(self) -> None:
        super().__init__()
        # What the reservation holds beside the allocator (contexts): set by ReplicaHost.
        self.outside_allocator = 0
        self.fraction: float | None = None
        # The weights while asleep or standing by: one pinned host allocation (inference.arena).
        # None while awake: the arena is freed by the wake, so an awake replica holds no host copy
        # (the control plane counts host memory for sleeping, draining and standby replicas), unless
        # it may keep one: then the wake keeps it as the spare (ArenaKeeper), which it counts too.
        self.arena: Arena | None = None
        # A standby's warm-up on its GPU (inference.warmup), reported in its `standby` event.
        self.warm_up: WarmUp | None = None

    def attach(self, placement: Placement) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ReplicaFailure("load", f"--backend cuda, but this torch {torch.__version__} cannot use a GPU here")
        count = torch.cuda.device_count()
        missing = [g for g in placement.gpus if g >= count]
        if missing:
            raise ReplicaFailure("load", f"GPU {missing} not visible to this process (torch sees {count})")
        # The CUDA context (~700 MiB) lands on the current device: make it ours, not GPU 0.
        torch.cuda.set_device(placement.gpus[0])
        if placement.fraction is not None:
            from gpuportal.wire.memory import allocator_fraction

            # Only the allocator is capped: the context and what sits outside it are in the
            # reservation beside it. The fraction is computed against the total torch applies it
            # to (what CUDA can allocate), not NVML's, which also counts the driver's reserve.
            cap = max(1, placement.reserved_total - self.outside_allocator)
            total = torch.cuda.mem_get_info(placement.gpus[0])[1]
            self.fraction = allocator_fraction(cap, total)
            torch.cuda.set_per_process_memory_fraction(self.fraction, placement.gpus[0])

    def load(self, source: str, loader: str, dtype: str, placement: Placement) -> nn.Module:
        import torch

        from inference.loaders import load_model, place_on_gpus, tensor_bytes

        limits = placement.max_memory(torch.cuda.device_count())
        # Check the size before any weight reaches a GPU: accelerate would otherwise put what does not
        # fit on "disk", and the failure would read as a disk-offload error instead of out-of-memory.
        if loader == "torch-module":
            model = load_model(source, loader, dtype)  # built on the CPU, where its size is known
            check_cap(tensor_bytes(model), placement, self.outside_allocator)
            return place_on_gpus(model, limits)
        from inference.model_size import shape_from_model_dir

        try:
            expected = shape_from_model_dir(source, dtype, encoder=loader == EMBEDDING).weight_bytes
        except ValueError as exc:  # a config model_size cannot read: verify() still catches a spill
            log.warning("weights not sized before loading: %s", exc)
        else:
            check_cap(expected, placement, self.outside_allocator)
        return load_model(source, loader, dtype, device_map="auto", max_memory=limits)

    def verify(self, model: nn.Module, placement: Placement) -> None:
        """Fail loudly if any parameter is outside this replica's GPUs (seed 000 only warned)."""
        allowed = {f"cuda:{g}" for g in placement.gpus}
        stray: dict[str, int] = {}
        for param in model.parameters():
            device = str(param.device)
            if device not in allowed:
                stray[device] = stray.get(device, 0) + param.numel() * param.element_size()
        if not stray:
            return
        where = ", ".join(f"{mib(n)} on {d}" for d, n in sorted(stray.items()))
        if any(d.startswith("cuda") for d in stray):
            raise ReplicaFailure("load", f"parameters landed outside GPUs {list(placement.gpus)}: {where}")
        # accelerate puts on cpu/disk/meta what max_memory has no room for: the reservation is too small.
        raise ReplicaFailure(
            "oom",
            f"out of memory: weights do not fit the reservation of {mib(placement.reserved_total)} "
            f"on GPUs {list(placement.gpus)}: {where}",
        )

    def to_cache(self, model: nn.Module, placement: Placement) -> dict[str, int | None]:
        import torch
        from accelerate.hooks import remove_hook_from_module

        # The hooks would move activations back to the old GPUs on the next forward; drop them.
        remove_hook_from_module(model, recurse=True)
        # One pinned allocation (the spare when one is kept: allocated and pinned in advance), the
        # copies queued on a side stream per GPU, one synchronisation.
        self.arena = self._pack(model)
        give_back_cached(torch)  # the weights' segments and cuBLAS's workspace: a sleeper keeps its context alone
        for gpu in placement.gpus:
            torch.cuda.set_per_process_memory_fraction(1.0, gpu)
        return self._residual(placement)

    def from_cache(self, model: nn.Module, placement: Placement) -> tuple[nn.Module, PendingCopies]:
        import torch

        from inference.arena import PendingCopies
        from inference.loaders import place_on_gpus, wake_on_gpus

        self.attach(placement)
        max_memory = placement.max_memory(torch.cuda.device_count())
        arena, self.arena = self.arena, None
        if arena is None:
            return place_on_gpus(model, max_memory), PendingCopies.complete()
        # Out of the arena, one block copy per device, queued on a side stream; the handle's wait
        # synchronises once and frees the arena, or keeps it (see __init__).
        return wake_on_gpus(model, max_memory, arena, keep=self.keep_arena)

    def load_to_cache(
        self, source: str, loader: str, dtype: str, placement: Placement
    ) -> tuple[nn.Module, dict[str, int | None]]:
        """A failover standby: weights straight into pinned host memory, never onto the GPU its
        active partner fills; only the CUDA context is created there, so the wake is a copy."""
        import torch

        from inference.arena import pack
        from inference.loaders import load_model
        from inference.warmup import warm_up

        self.attach(placement)  # the CUDA context, on its GPU: all a sleeping replica holds there
        model = load_model(source, loader, dtype, device="cpu")
        # Into one pinned arena now, so the takeover is one host-to-device copy.
        self.arena = pack(model, pin=True)
        # The first forward's kernel loading and cuBLAS set-up, paid now over a one-layer skeleton
        # (never these weights: the GPU is the partner's), still under the cap; never fails the
        # standby. Before the residual is measured: the context it reports has grown by the kernels.
        if loader == TRANSFORMERS:
            gpu = torch.device("cuda", placement.gpus[0])
            # Spread over several GPUs at the wake, the model keeps generate() (inference.paged).
            self.warm_up = warm_up(model, gpu, paged=None if len(placement.gpus) == 1 else False)
        torch.cuda.set_per_process_memory_fraction(1.0, placement.gpus[0])  # a sleeper is not capped
        return model, self._residual(placement)

    def process_bytes_by_id(self) -> dict[str, int] | None:
        # Empty means NVML cannot see this process (it surely holds a context): unknown, not 0.
        return nvml_process_bytes(os.getpid()) or None

    def context_bytes_measured(self, placement: Placement) -> int:
        """NVML's figure for this process on its first GPU less what the allocator holds there:
        the context as it is now (it grows as the first forward passes load kernels)."""
        import torch

        measured = (nvml_process_bytes(os.getpid()) or {}).get(str(placement.gpus[0]))
        if measured is None:
            return 0
        return max(0, measured - torch.cuda.memory_reserved(placement.gpus[0]))

    def outside_allocator_bytes(self, placement: Placement, context_bytes: int) -> int:
        """What NVML shows beyond the allocator's segments and the context (libraries' own
        allocations, NCCL, cuDNN workspaces): in the reservation, never under the cap."""
        import torch

        measured = nvml_process_bytes(os.getpid()) or {}
        extra = 0
        for gpu in placement.gpus:
            if (seen := measured.get(str(gpu))) is not None:
                context = context_bytes if gpu == placement.gpus[0] else 0
                extra += max(0, seen - context - torch.cuda.memory_reserved(gpu))
        return extra

    def release(self) -> None:
        import torch

        if self.arena is not None:
            self.arena.release()
            self.arena = None
        self._release_spare()
        gc.collect()
        torch.cuda.empty_cache()

    def _residual(self, placement: Placement) -> dict[str, int | None]:
        """What NVML says this process still holds: its CUDA context, on each GPU it ever touched."""
        measured = nvml_process_bytes(os.getpid())
        if not measured:
            # NVML lists host PIDs; in a container without the host PID namespace it never finds us.
            # null tells the control plane to keep its own context estimate instead of trusting 0.
            log.warning("NVML does not list this process; residual GPU memory unknown")
            return {str(g): None for g in placement.gpus}
        residual: dict[str, int | None] = {str(g): 0 for g in placement.gpus}
        residual.update(measured)
        return residual


def nvml_process_bytes(pid: int) -> dict[str, int] | None:
    """{GPU index: bytes} that NVML attributes to `pid`, on every GPU where it has memory; None without NVML."""
    found = nvml_bytes_by_pid({pid})
    return None if found is None else found.get(pid, {})


def nvml_bytes_by_pid(pids: set[int]) -> dict[int, dict[str, int]] | None:
    """{pid: {GPU index: bytes}} for each of `pids` NVML lists, in one pass over the devices
    (the agent's heartbeat asks for all its replicas at once); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver: nothing to measure with
        log.warning("NVML unavailable: %s", exc)
        return None
    try:
        found: dict[int, dict[str, int]] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in pids:
                    by_gpu = found.setdefault(process.pid, {})
                    by_gpu[str(index)] = by_gpu.get(str(index), 0) + int(process.usedGpuMemory or 0)
        return found
    finally:
        with contextlib.suppress(Exception):  # shutdown failing changes nothing we measured
            pynvml.nvmlShutdown()


def nvml_device_free() -> dict[str, int] | None:
    """{GPU index: bytes} NVML reports free on each device; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: nothing to measure with
        return None
    try:
        return {
            str(index): int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
            for index in range(pynvml.nvmlDeviceGetCount())
        }
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class ReplicaHost:
    """One replica's model and its lifecycle: load, sleep (to cache), wake (from cache), stop.

    Transitions run one at a time on the main thread; those that move or drop the weights do it
    under `lock`, which the serving thread holds while it runs a request, so a request never sees
    weights half-way to the CPU. Sleep and stop do not wait for the request on that lock: they
    drain first (see `drain`), with the lock free, and take it once nothing is in flight.
    """

    def __init__(
        self,
        *,
        replica_id: str,
        source: str,
        loader: str,
        dtype: str,
        placement: Placement,
        backend: Backend,
        events: EventWriter,
        kv_max_tokens: int = DEFAULT_KV_MAX_TOKENS,
        context_bytes: int = 0,
        standby_context_bytes: int = 0,
    ):
        self.replica_id = replica_id
        self.source = source
        self.loader = loader
        self.dtype = dtype
        self.placement = placement
        self.backend = backend
        self.events = events
        self.model: nn.Module | None = None
        self.weights_bytes = 0
        self.residual_bytes_by_id: dict[str, int | None] = {}
        self.tokenizer: Any | None = None
        # An encoder's embedding recipe (a transformers-embedding deployment); None for others.
        self.recipe: Recipe | None = None
        # Set while serving: the serving thread waits on it rather than polling the state.
        self.accepting = threading.Event()
        self._state = PROCESS_STARTING
        self.lock = threading.RLock()
        # The barrier: requests in flight, counted under `_flight` together with the state check,
        # and the flag a drain sets at its deadline to cut the request in flight short.
        self._flight = threading.Condition(threading.Lock())
        self._in_flight = 0
        self.abort = threading.Event()
        # Failover pair members (inference.pairing): the epoch results are written under, and
        # fields added to the `serving` event (the epoch, the liveness state).
        self.fence: Fence | None = None
        self.serving_tags: dict[str, Any] = {}
        # The KV block pool, sized from the cap with gpuportal.wire.memory's formula: the
        # activation budget for kv_max_tokens (the deployment's max_tokens) and the CUDA context
        # are what the scheduler counted in the reservation besides the weights and the pool.
        self.kv_max_tokens = kv_max_tokens
        self.context_bytes = context_bytes
        # In a failover pair the reservation also holds the standby's context: never the pool's.
        self.standby_context_bytes = standby_context_bytes
        if hasattr(backend, "outside_allocator"):
            backend.outside_allocator = context_bytes + standby_context_bytes
        self.paged: PagedModel | None = None
        # What this replica holds serving at max_tokens, composed from measured parts with
        # gpuportal.wire.memory's formula: the need it reports, and what the pool was sized against.
        self.footprint: MemoryEstimate | None = None
        # The allocator's bytes for the pool actually allocated (more than max_tokens' when the
        # reservation is larger, as an override can make it).
        self.pool_bytes = 0
        # Called as the replica stops taking requests, before the change is reported (the
        # serving loop withdraws its claim to take them: inference.serving.Server).
        self.on_stop_taking: Callable[[], None] | None = None
        # The thread allocating a kept arena (`keep_arena`), while it runs: whoever touches the
        # backend's spare next (a sleep, a drop, a stop) joins it first (`_settle_spare`).
        self._preparing: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if value == S.SERVING:
            self.accepting.set()
        else:
            self.accepting.clear()
            if self.on_stop_taking is not None:
                self.on_stop_taking()

    def executor(self) -> Executor:
        embedder = None
        if self.recipe is not None:
            from inference.embedding import Embedder

            # Built per request, around the model as it is now (a wake may have moved it).
            embedder = Embedder(self.model, self.tokenizer, self.recipe)
        return Executor(self.model, self.tokenizer, self.abort, embedder)

    # -- the barrier ---------------------------------------------------------------------------

    def begin_request(self) -> bool:
        """The serving thread, before running a request: False if the replica no longer serves."""
        with self._flight:
            if self.state != S.SERVING or self.model is None:
                return False
            self._in_flight += 1
            return True

    def end_request(self) -> None:
        """The serving thread, once the request's outcome (or its return to the queue) is recorded."""
        with self._flight:
            self._in_flight -= 1
            self._flight.notify_all()

    def drain(self, timeout_s: float, state: str = S.DRAINING) -> bool:
        """Stop taking requests (`state`), let the one in flight finish for up to `timeout_s`, then
        cut it short; returns once nothing is in flight. True if it finished on its own.

        Called without `lock`: the serving thread holds it while the request runs.
        """
        with self._flight:
            self.abort.clear()
            # Under the same mutex as begin_request's check: a request either started before this
            # (and is counted) or sees the new state and goes back to the queue untouched.
            self.state = state
            if self._flight.wait_for(lambda: self._in_flight == 0, timeout_s):
                return True
            log.warning(
                "%s: a request still running after the drain timeout of %.1f s; cutting it short",
                self.replica_id,
                timeout_s,
            )
            self.abort.set()
            try:
                # A generation stops at its next token and gives itself back; a forward pass cannot be
                # interrupted and runs to its end.
                while not self._flight.wait_for(lambda: self._in_flight == 0, _ABORT_LOG_EVERY_S):
                    log.warning("%s: still waiting for the aborted request to return", self.replica_id)
            finally:
                self.abort.clear()
            return False

    # -- transitions -------------------------------------------------------------------------

    def load(self) -> None:
        with self.lock, self._failing_as("load"):
            started = time.monotonic()
            self.state = S.LOADING
            self._progress(0, f"starting on {self.backend.name} GPUs {list(self.placement.gpus)}")
            from inference.loaders import validate_source

            # Before the slow imports and the device: a mistyped directory fails in milliseconds.
            validate_source(self.source, self.loader)
            with self._load_slot():
                self._progress(10, "preparing the device")
                self.backend.attach(self.placement)
                self._progress(25, f"loading weights from {self.source} ({self.loader}, {self.dtype})")
                model = self.backend.load(self.source, self.loader, self.dtype, self.placement)
                self.tokenizer = load_tokenizer(self.source, self.loader)
                self.recipe = load_recipe(self.source, self.loader)
                self._progress(85, "checking placement and memory cap")
                self._adopt(model, self.placement)
                self._allocate_pool()
            self._progress(100, f"loaded {mib(self.weights_bytes)} in {time.monotonic() - started:.1f} s")
            self.state = S.SERVING
            self.events.emit("serving", pid=os.getpid(), **self.where(), **self.serving_tags)

    def load_standby(self) -> None:
        """A failover standby's init: the same weights, loaded and parked in host memory at once."""
        with self.lock, self._failing_as("load"):
            started = time.monotonic()
            self.state = S.LOADING
            self._progress(0, f"starting as a standby on {self.backend.name} GPUs {list(self.placement.gpus)}")
            from inference.loaders import tensor_bytes, validate_source

            validate_source(self.source, self.loader)
            with self._load_slot():
                self._progress(25, f"loading weights from {self.source} into host memory")
                model, residual = self.backend.load_to_cache(self.source, self.loader, self.dtype, self.placement)
                self.tokenizer = load_tokenizer(self.source, self.loader)
                self.recipe = load_recipe(self.source, self.loader)
            self.weights_bytes = tensor_bytes(model)
            # A standby that could never wake into its reservation is no standby: fail now, not at takeover.
            check_cap(self.weights_bytes, self.placement, self._outside_allocator())
            self.model = model
            self.residual_bytes_by_id = residual
            self._progress(100, f"standing by with {mib(self.weights_bytes)} in {time.monotonic() - started:.1f} s")
            self.state = S.STANDBY
            # The warm-up a GPU standby ran (inference.warmup): null where none ran (a virtual GPU).
            warm = getattr(self.backend, "warm_up", None)
            self.events.emit(
                "standby",
                pid=os.getpid(),
                weights_bytes=self.weights_bytes,
                residual_bytes_by_id=residual,
                warm_up=warm.as_event() if warm is not None else None,
            )

    def wake_standby(self) -> None:
        """Onto the memory the dead active member freed (the lock grant proved it is gone)."""
        with self.lock:
            self._require(S.STANDBY, "take over")
            with self._failing_as("load"):
                self.state = S.WAKING
                check_cap(self.weights_bytes, self.placement, self._outside_allocator())
                self._wake_onto(self.placement)
            if self.backend.spare is not None:
                self._emit_arena(self.backend.spare.nbytes)  # the standby's arena, kept by its takeover

    def on_stale(self, reason: str) -> None:
        """Our failover epoch was superseded, or the control plane wrote us off and gave our
        requests back (gpuportal.wire.requestqueue.Fenced): stop serving at once and exit, so two
        never answer one request."""
        self.accepting.clear()
        self._state = "stale"
        log.error("%s: %s; exiting", self.replica_id, reason)
        self.events.emit("failed", reason=f"superseded: {reason}", kind="stale")
        _exit(1)

    def on_queue_lost(self, reason: str) -> None:
        """Redis stayed away longer than the serving loop waits (inference.serving.PatientQueue):
        fail and exit, so the control plane gives back what this replica took and replaces it."""
        self.accepting.clear()
        self._state = S.FAILED
        log.error("%s: %s; exiting", self.replica_id, reason)
        self.events.emit("failed", reason=reason, kind="crash")
        _exit(1)

    def sleep(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        # Transitions all run on the main thread: no other can change the state under this check.
        if self.state == S.SLEEPING:  # a retried sleep: already done
            self._emit_sleeping()
            return
        self._require(S.SERVING, "sleep")
        with self._failing_as("crash"):
            # State first, so nothing new starts; the request in flight finishes or is given back.
            self.drain(drain_timeout_s, S.DRAINING)
            with self.lock:
                assert self.model is not None
                # A kept arena still being allocated is waited for: still faster than a fresh one,
                # and the sleep never packs into one half-made.
                self._settle_spare()
                self._release_pool()  # before to_cache, whose empty_cache then returns its memory
                self.residual_bytes_by_id = self.backend.to_cache(self.model, self.placement)
                self.state = S.SLEEPING
                self._emit_sleeping()

    def wake(self, gpus: Any, reserved_bytes_by_gpu: Any, fraction: Any = None) -> None:
        try:
            target = Placement.parse(gpus, reserved_bytes_by_gpu, fraction)
        except ValueError as exc:
            raise CommandRejected(f"bad wake: {exc}") from None
        with self.lock:
            if self.state == S.SERVING and target == self.placement:
                self.events.emit("woken", **self.where())  # a retried wake: already done
                return
            self._require(S.SLEEPING, "wake")
            with self._failing_as("load"):
                self.state = S.WAKING
                # Before moving anything: a reservation too small for the weights fails like a CUDA OOM would.
                check_cap(self.weights_bytes, target, self._outside_allocator())
                self._wake_onto(target)
                self.state = S.SERVING
                self.events.emit("woken", **self.where())
            if self.backend.keep_arena:
                self._keep_spare()  # the arena the wake kept, or one prepared now

    def stop(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        # A scale-down loses nothing: the request in flight finishes or goes back to its queue.
        self.drain(drain_timeout_s, S.STOPPING)
        with self.lock:
            self.state = S.STOPPING
            self._settle_spare()  # then released with the rest: nothing is left allocating one
            self._release_pool()
            self.model = None
            self.backend.release()
            self.state = S.STOPPED
            self.events.emit("stopped")

    # -- commands ------------------------------------------------------------------------------

    def handle(self, command: Mapping[str, Any]) -> None:
        """Run one command; a refused one is answered with an `error` event and changes nothing."""
        name = command.get("cmd")
        try:
            if name == "ping":
                self.ping()
            elif name == "sleep":
                self.sleep(drain_timeout(command))
            elif name == "wake":
                self.wake(command.get("gpus"), command.get("reserved_bytes_by_gpu"), command.get("fraction"))
            elif name == "stop":
                try:
                    drain = drain_timeout(command)
                except CommandRejected as exc:  # a stop is never refused: drain for the default instead
                    log.warning("stop: %s; draining for %.0f s", exc, DEFAULT_DRAIN_TIMEOUT_S)
                    drain = DEFAULT_DRAIN_TIMEOUT_S
                self.stop(drain)
            elif name == "arena":
                self.keep_arena(command.get("keep"))
            else:
                raise CommandRejected(f"unknown command {name!r} (known: sleep, wake, stop, ping, arena)")
        except CommandRejected as exc:
            log.warning("refused %s: %s", name, exc)
            self.events.emit("error", cmd=name, reason=str(exc))

    def keep_arena(self, keep: Any) -> None:
        """The control plane's word on a kept arena (gpuportal.wire.commands.KeepArena): with
        `keep`, a serving replica prepares one in the background and a sleeping one keeps the
        arena it wakes from; without, the one held is freed. The control plane counts it in the
        node's host cache from its grant (before this replica has allocated anything) until it
        takes it back; the `arena` event only tells it the size allocated."""
        if not isinstance(keep, bool):
            raise CommandRejected(f"bad arena: keep must be true or false, got {keep!r}")
        self.backend.keep_arena = keep
        if not keep:
            self._settle_spare()  # one being allocated is freed once it is whole
            if dropped := self.backend.drop_spare():
                log.info("%s: dropped its kept arena of %s", self.replica_id, mib(dropped))
                self._emit_arena(0)
        elif self.state == S.SERVING:
            self._keep_spare()
        # Asleep, standing by: the wake keeps the arena it reads. Elsewhere (stopping, failed):
        # nothing to keep.

    def ping(self) -> None:
        # No lock: a ping must be answered even while a load holds it for minutes.
        spare = self.backend.spare  # read once: a sleep may take it meanwhile
        self.events.emit(
            "pong",
            state=self.state,
            pid=os.getpid(),
            kv=self.kv_stats(),
            process_bytes_by_id=self.process_bytes_by_id(),
            # The arena it keeps for its next sleep (0: none): the heartbeat shows the control plane
            # a grant or a drop that never arrived (scheduling.services.lost_commands).
            arena_bytes=spare.nbytes if spare is not None else 0,
        )

    def kv_stats(self) -> dict[str, Any] | None:
        """The pool's statistics for events (the replica's `kv` in docs/api.md); None without a pool."""
        paged = self.paged  # read once: the main thread may drop it meanwhile
        return paged.pool.stats().as_event() if paged is not None else None

    # -- helpers -------------------------------------------------------------------------------

    def _wake_onto(self, placement: Placement) -> None:
        """The weights out of the arena onto `placement`'s GPUs, the KV pool allocated while they copy.

        from_cache only queues the host-to-device copies (inference.arena.unpack_async). What runs
        before the wait needs the weights' devices, shapes and sizes, never their values: the cap
        check, the pool's sizing and allocation (NVML and allocator figures, an empty tensor). So
        on a GPU it overlaps the copies. Whatever reads a weight (a forward pass, the serving
        thread, whose requests wait for the `serving` state the caller sets) comes after it.
        """
        assert self.model is not None
        model, copies = self.backend.from_cache(self.model, placement)
        try:
            self._adopt(model, placement)
            self._allocate_pool()
        finally:
            # ONE synchronisation, and only then is the arena's pinned host buffer freed (or kept, for
            # a replica allowed to): even when the cap or the pool fails, the copies may still be
            # reading it (PendingCopies).
            copies.wait()
            self.backend.collect_kept(copies)

    def _adopt(self, model: nn.Module, placement: Placement) -> None:
        from inference.loaders import tensor_bytes

        self.backend.verify(model, placement)
        self.weights_bytes = tensor_bytes(model)
        check_cap(self.weights_bytes, placement, self._outside_allocator())
        self.model = model
        self.placement = placement

    def where(self) -> dict[str, Any]:
        from inference.loaders import parameter_devices

        by_id = self.process_bytes_by_id()
        footprint = self.footprint
        return {
            "weights_bytes": self.weights_bytes,
            "process_bytes": sum(by_id.values()) if by_id is not None else None,
            "process_bytes_by_id": by_id,
            # The measured need: what one replica of this deployment holds serving at
            # max_tokens, part by part; the control plane reserves exactly this for the next.
            "need_bytes": footprint.total_bytes if footprint is not None else None,
            "footprint": footprint.parts() if footprint is not None else None,
            "context_bytes": footprint.context_bytes if footprint is not None else None,
            "context_measured_bytes": self.backend.context_bytes_measured(self.placement) or None,
            "gpu_mem_bytes_by_id": dict(self.placement.reserved_bytes_by_gpu),
            "gpus": list(self.placement.gpus),
            # The fraction the allocator was given (a real GPU's backend computes it against the
            # device's own total; elsewhere the placement's).
            "fraction": getattr(self.backend, "fraction", None) or self.placement.fraction,
            "param_devices": sorted(parameter_devices(self.model)) if self.model is not None else [],
            "kv": self.kv_stats(),
        }

    def _outside_allocator(self) -> int:
        return self.context_bytes + self.standby_context_bytes

    def process_bytes_by_id(self) -> dict[str, int] | None:
        """What NVML shows of this process per GPU; on a virtual GPU, what it would show: the
        context, and while the weights are on the GPU the allocator's segments for them, the
        pool and the activation reserve (the working set a forward pass leaves cached)."""
        measured = self.backend.process_bytes_by_id()
        if measured is not None or not isinstance(self.backend, VirtualBackend):
            return measured
        held = self.backend.residual(self.placement)
        if self.model is not None and self.state in {S.SERVING, S.DRAINING, S.STOPPING, S.WAKING}:
            from gpuportal.wire import memory
            from inference.loaders import weight_allocation_bytes

            first = str(self.placement.gpus[0])
            activation = self.footprint.activation_bytes if self.footprint is not None else 0
            pool = 2 * memory.allocation_bytes(self.pool_bytes // 2)  # K and V, one allocation each
            wanted = weight_allocation_bytes(self.model) + pool + activation
            # The allocator never holds more than its cap (set_per_process_memory_fraction): what it
            # may take is the reservation less what sits beside it, the context(s) above all.
            cap = self.placement.reserved_total - self._outside_allocator()
            held[first] += max(0, min(wanted, cap))
        return held

    def _allocate_pool(self) -> None:
        """Compose the footprint from measured parts, then size the KV pool inside the reservation
        with the scheduler's own formula (gpuportal.wire.memory): what the reservation leaves after the
        weights as allocated, the activation budget for max_tokens, the CUDA context(s) and what
        the process holds outside the allocator. A pool that cannot hold one request of max_tokens
        fails the load or wake, naming the bytes, before the replica takes anything.
        A model that cannot be paged (not Llama-style, spread over GPUs) keeps generate()."""
        from gpuportal.wire import memory
        from inference.loaders import weight_allocation_bytes
        from inference.paged import engine_for, model_shape, unsupported_reason

        self.paged = None
        self.pool_bytes = 0
        if self.model is None:
            return
        weights = weight_allocation_bytes(self.model)
        # The larger of what the reservation counted and what this process holds now (a real
        # context grows as the first forward passes load kernels; the GPU row has the grown one).
        context = max(self.context_bytes, self.backend.context_bytes_measured(self.placement))
        overhead = self.backend.outside_allocator_bytes(self.placement, context)
        shape = None
        # An encoder keeps no KV cache: its footprint is its weights and the activation floor, as
        # its deploy-time estimate (inference.inspection), and its passes are sized to fit it.
        if self.tokenizer is not None and self.recipe is None:
            try:
                shape = model_shape(self.model, weights)
            except (AttributeError, TypeError, ValueError) as exc:  # a config without the usual fields
                log.warning("%s: no model shape for the memory formula (%s)", self.replica_id, exc)
        self.footprint = self._compose_footprint(shape, weights, context, overhead)
        if shape is None:
            return
        reason = unsupported_reason(self.model)
        if reason is not None:
            log.warning("%s: no KV block pool (%s); generating with transformers' own cache", self.replica_id, reason)
            return
        reserved = self.placement.reserved_total
        blocks = memory.kv_pool_blocks(
            shape,
            cap_bytes=reserved,
            max_tokens=self.kv_max_tokens,
            cuda_context_bytes=context,
            standby_context_bytes=self.standby_context_bytes,
            overhead_bytes=overhead,
        )
        block_tokens = memory.DEFAULT_BLOCK_TOKENS
        if blocks * block_tokens < max(1, self.kv_max_tokens):
            raise self._pool_too_small(shape, blocks, context, overhead)
        self.paged = engine_for(
            self.model,
            weights_bytes=weights,
            cap_bytes=reserved,
            max_tokens=self.kv_max_tokens,
            context_bytes=context,
            standby_context_bytes=self.standby_context_bytes,
            overhead_bytes=overhead,
            block_tokens=block_tokens,
        )
        pool = self.paged.pool
        self.pool_bytes = memory.kv_pool_bytes(shape, pool.blocks_total, block_tokens)
        log.info(
            "%s: KV pool of %d blocks x %d tokens (%s) for %d tokens; footprint %s",
            self.replica_id,
            pool.blocks_total,
            pool.block_tokens,
            mib(pool.tensor_bytes),
            pool.capacity_tokens,
            self.footprint.describe(),
        )

    def _compose_footprint(self, shape: ModelShape | None, weights: int, context: int, overhead: int) -> MemoryEstimate:
        """What this replica holds serving at max_tokens, from its measured parts."""
        from gpuportal.wire import memory

        if shape is not None:
            return memory.estimate(
                shape, max_tokens=self.kv_max_tokens, cuda_context_bytes=context, overhead_bytes=overhead
            )
        # A torch-module deployment (or a model without a shape): weights and the floor of the
        # activation reserve, as the estimate at deploy time (scheduling.services).
        return memory.MemoryEstimate(
            weights_bytes=weights,
            kv_bytes=0,
            activation_bytes=memory.ACTIVATION_FLOOR_BYTES,
            context_bytes=context,
            kv_block_bytes=0,
            kv_blocks=0,
            block_tokens=memory.DEFAULT_BLOCK_TOKENS,
            max_tokens=0,
            overhead_bytes=overhead,
        )

    def _pool_too_small(self, shape: ModelShape, blocks: int, context: int, overhead: int) -> ReplicaFailure:
        """The load or wake's failure when the pool cannot hold one request of max_tokens, naming the bytes."""
        from gpuportal.wire import memory

        assert self.footprint is not None
        reserved = self.placement.reserved_total
        pool = memory.kv_pool_bytes(shape, blocks)
        need = self.footprint.total_bytes + self.standby_context_bytes
        cap = memory.allocator_cap_bytes(
            reserved, context_bytes=context, standby_context_bytes=self.standby_context_bytes, overhead_bytes=overhead
        )
        return ReplicaFailure(
            "oom",
            f"cannot serve: the KV pool left by the reservation holds {blocks * memory.DEFAULT_BLOCK_TOKENS} tokens "
            f"({blocks} blocks, {pool} bytes), fewer than max_tokens {self.kv_max_tokens}; need {need} bytes "
            f"({self.footprint.describe()}), reservation {reserved} bytes, allocator cap {cap} bytes",
        )

    def _keep_spare(self) -> None:
        """A serving replica allowed to keep an arena: say it holds one, or prepare one on a daemon
        thread (allocating, pinning and filling gigabytes takes seconds: never on the command loop,
        nor in the way of requests, which only read the weights the spare copies). A sleep waits
        for it (`_settle_spare`), and then copies nothing the fill already did."""
        if self._preparing is not None and self._preparing.is_alive():
            return  # its `arena` event comes when it is ready
        if self.backend.spare is not None:
            self._emit_arena(self.backend.spare.nbytes)  # kept by the wake, or a retried keep
            return
        assert self.model is not None
        self._preparing = threading.Thread(
            target=self._prepare_spare, args=(self.model,), name="arena-spare", daemon=True
        )
        self._preparing.start()

    def _prepare_spare(self, model: nn.Module) -> None:
        try:
            spare = self.backend.prepare_spare(model)
        except Exception as exc:  # the host out of memory, say: the next sleep allocates its own, as before
            log.exception("%s: preparing a kept arena failed; the next sleep allocates its own", self.replica_id)
            # Said, so that the books stop counting an arena it does not hold (and the grant is not
            # sent again and again by the heartbeat's check for a lost one).
            self.events.emit("arena", kept_bytes=0, failed=f"{type(exc).__name__}: {exc}"[:300])
            return
        log.info("%s: keeps an arena of %s ready for its next sleep", self.replica_id, mib(spare.nbytes))
        self._emit_arena(spare.nbytes)

    def _settle_spare(self) -> None:
        """Wait for a kept arena being prepared: the backend's spare is then whole or absent."""
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.join()

    def _emit_arena(self, kept_bytes: int) -> None:
        self.events.emit("arena", kept_bytes=kept_bytes)

    def _release_pool(self) -> None:
        if self.paged is not None:
            self.paged.pool.release()
            self.paged = None
        self.pool_bytes = 0

    def _emit_sleeping(self) -> None:
        # cpu_bytes: what the parked weights take of the node's CPU cache.
        self.events.emit("sleeping", residual_bytes_by_id=self.residual_bytes_by_id, cpu_bytes=self.weights_bytes)

    def _load_slot(self) -> contextlib.AbstractContextManager[int | None]:
        """One of the node's load slots (inference.load_slots), waited for with progress saying so."""
        directory, most = load_slots.from_environment()
        return load_slots.load_slot(
            directory,
            most,
            on_wait=lambda: self._progress(5, f"waiting for a load slot: this node loads at most {most} at once"),
        )

    def _require(self, state: str, action: str) -> None:
        if self.state != state:
            raise CommandRejected(f"cannot {action} while {self.state}")

    def _progress(self, percent: int, detail: str) -> None:
        log.info("%s %d%%: %s", self.replica_id, percent, detail)
        self.events.emit("progress", state=S.LOADING, percent=percent, detail=detail)

    def _failing_as(self, kind: str) -> _FailingAs:
        return _FailingAs(self, kind)


def drain_timeout(command: Mapping[str, Any]) -> float:
    """A command's optional drain_timeout_s: seconds >= 0, the default when absent or null."""
    value = command.get("drain_timeout_s")
    if value is None:
        return DEFAULT_DRAIN_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise CommandRejected(f"drain_timeout_s must be a number of seconds >= 0, got {value!r}")
    return float(value)


class _FailingAs:
    """Turn any exception inside a transition into a ReplicaFailure of the right kind."""

    def __init__(self, host: ReplicaHost, kind: str):
        self.host = host
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, CommandRejected):
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: let them through
        failure = classify_failure(exc, self.kind)
        self.host.state = S.FAILED
        if failure is not exc:
            log.error("%s failed (%s)", self.host.replica_id, failure.kind, exc_info=(exc_type, exc, tb))
            raise failure from exc
        return False


# -- the process ---------------------------------------------------------------------------------


def load_tokenizer(source: str, loader: str) -> Any | None:
    """The model directory's tokenizer, if it has one (a torch-module deployment takes tensors).
    An encoder takes nothing but text: without its tokenizer the load fails."""
    if loader not in DIRECTORY_LOADERS:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(local_model_dir(source), local_files_only=True)
    except (OSError, ValueError) as exc:
        if loader == EMBEDDING:
            raise ValueError(f"{source} has no tokenizer a replica can load: {exc}") from exc
        log.warning("no tokenizer in %s (%s): only tensor requests can be served", source, exc)
        return None


def load_recipe(source: str, loader: str) -> Recipe | None:
    """How an encoder's token states become embeddings (inference.embedding); None for other loaders."""
    if loader != EMBEDDING:
        return None
    from inference.embedding import read_recipe

    return read_recipe(local_model_dir(source))


def die_with_parent() -> None:
    """SIGKILL when the agent dies, however it dies (the supervisor also sets this before exec)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError as exc:  # not Linux: the agent's stdin EOF still ends us
        log.warning("cannot set PR_SET_PDEATHSIG: %s", exc)


def protocol_stream() -> TextIO:
    """Keep the real stdout for events and point fd 1 at stderr, so stray prints cannot corrupt the protocol."""
    sys.stdout.flush()
    events_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(events_fd, "w", buffering=1, encoding="utf-8")


def read_commands(
    stream: Iterable[str], host: ReplicaHost, commands: queue.Queue[Any], on_eof: Callable[[], None] | None = None
) -> None:
    """The command thread: answer pings at once, queue the rest for the main thread. At EOF the
    agent is gone: exit, or, for a replica that may outlive it, `on_eof` (inference.adoption)."""
    for line in stream:
        text = line.strip()
        if not text:
            continue
        try:
            command = json.loads(text)
        except json.JSONDecodeError:
            command = None
        if not isinstance(command, dict) or not isinstance(command.get("cmd"), str):
            host.events.emit("error", cmd=None, reason=f"not a JSON command object: {text[:200]!r}")
            continue
        if command["cmd"] == "ping":
            host.ping()
        elif command["cmd"] == "resync":
            host.events.resync()
        elif command["cmd"] == "stop" and host.state in {PROCESS_STARTING, S.LOADING}:
            # A load can take minutes and cannot be interrupted; nothing is worth saving yet.
            log.info("stop while loading: exiting now")
            host.events.emit("stopped")
            _exit(0)
        else:
            commands.put(command)
    if on_eof is not None:
        on_eof()
        return
    log.info("stdin closed: the agent is gone; exiting")
    _exit(0)


def give_up(host: ReplicaHost, commands: queue.Queue[Any]) -> None:
    """No agent adopted this orphan: stop as a scale-down would, giving back what it had taken
    (a load cannot be interrupted and holds nothing worth saving: exit at once)."""
    if host.state in {PROCESS_STARTING, S.LOADING}:
        _exit(0)
    commands.put({"cmd": "stop", "drain_timeout_s": 0})


def run(host: ReplicaHost, commands: queue.Queue[Any], pair: PairMember | None = None) -> int:
    """The main thread: load, then run queued commands until stopped. Returns the exit code."""
    try:
        if pair is None:
            host.load()
        else:
            pair.start(commands)
        while host.state != S.STOPPED:
            command = commands.get()
            # Callables come from this process's own threads (a failover lock grant): they run
            # here so that every transition stays on the main thread.
            command() if callable(command) else host.handle(command)
        return 0
    except ReplicaFailure as failure:
        log.error("%s failed (%s): %s", host.replica_id, failure.kind, failure.reason)
        host.events.emit("failed", reason=failure.reason, kind=failure.kind)
        return 1
    except Exception as exc:  # a bug in this program: still tell the agent why before dying
        failure = classify_failure(exc, "crash")
        log.exception("%s crashed", host.replica_id)
        host.events.emit("failed", reason=failure.reason, kind=failure.kind)
        return 1


def adopt_later(host: ReplicaHost, commands: queue.Queue[Any], args: argparse.Namespace) -> Callable[[], None]:
    """Let this replica outlive its agent (inference.adoption); returns what the command reader
    calls at EOF."""
    from inference.adoption import Orphanage

    orphanage = Orphanage(
        args.adopt_address,
        args.adoption_window,
        host=host,
        events=host.events,
        serve_commands=lambda stream: read_commands(stream, host, commands, orphanage.orphaned),
        give_up=lambda: give_up(host, commands),
    )
    host.events.on_broken = orphanage.orphaned
    return orphanage.orphaned


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference.replica", description=__doc__.split("\n")[0])
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--source", required=True, help="Model directory, hf:org/name, or package.module:factory.")
    parser.add_argument("--loader", required=True, choices=LOADERS)
    parser.add_argument("--dtype", required=True, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--gpus", required=True, help="GPU ids, comma-separated: 0 or 0,1.")
    parser.add_argument("--reserved-bytes-by-gpu", required=True, help='JSON: {"0": 734003200}')
    parser.add_argument("--fraction", default=None, help="Memory fraction cap of a single-GPU replica.")
    parser.add_argument("--backend", choices=BACKENDS, default="virtual")
    parser.add_argument("--deployment", default="", help="Serve this deployment's request queue.")
    parser.add_argument("--redis-url", default=os.environ.get("GPUPORTAL_REDIS_URL", ""), help="The request queue.")
    parser.add_argument("--failover-lease", type=int, default=None, help="Member of this failover pair's lease.")
    parser.add_argument("--failover-fence", default="", help="Names the pair's result fence in Redis.")
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.PRIMARY.value)
    parser.add_argument("--reconnect-window", type=float, default=10.0, help="Seconds (seed 004).")
    parser.add_argument("--wake-timeout", type=float, default=60.0, help="A takeover's wake past this exits.")
    parser.add_argument("--liveness-every", type=float, default=0.5, help="Seconds between `alive` events.")
    parser.add_argument(
        "--kv-max-tokens",
        type=int,
        default=DEFAULT_KV_MAX_TOKENS,
        help="The deployment's memory.max_tokens: sizes the activation budget left out of the KV pool.",
    )
    parser.add_argument(
        "--context-bytes", type=int, default=0, help="CUDA context of a serving replica the reservation counts."
    )
    parser.add_argument(
        "--standby-context-bytes",
        type=int,
        default=0,
        help="A failover pair's standby's context, also in the reservation (never in the KV pool).",
    )
    parser.add_argument(
        "--adoption-window",
        type=float,
        default=0.0,
        help="Seconds to outlive the agent, waiting for a new one to adopt it (0: die with the agent).",
    )
    parser.add_argument("--adopt-address", default="", help="Abstract socket name an adopter connects to.")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def placement_from_args(args: argparse.Namespace) -> Placement:
    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gpus must be comma-separated GPU ids, got {args.gpus!r}") from None
    try:
        reserved = json.loads(args.reserved_bytes_by_gpu)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--reserved-bytes-by-gpu is not JSON: {exc}") from None
    fraction = None if args.fraction in (None, "", "none", "null") else float(args.fraction)
    return Placement.parse(gpus, reserved, fraction)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    adoptable = args.adoption_window > 0 and bool(args.adopt_address)
    if not adoptable:
        die_with_parent()
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s replica {args.replica_id} pid {os.getpid()}: %(message)s",
    )
    # Never the hub, whatever the environment says: a node has no network and a download would
    # blow the memory plan. PCI bus order makes torch's GPU indices NVML's, which the agent reports.
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Progress bars redraw with carriage returns: noise in a log file, and progress goes out as events.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    events = EventWriter(protocol_stream())
    try:
        placement = placement_from_args(args)
    except ValueError as exc:
        events.emit("failed", reason=f"bad arguments: {exc}", kind="load")
        _exit(2)
    backend: Backend = CudaBackend() if args.backend == "cuda" else VirtualBackend()
    host = ReplicaHost(
        replica_id=args.replica_id,
        source=args.source,
        loader=args.loader,
        dtype=args.dtype,
        placement=placement,
        backend=backend,
        events=events,
        kv_max_tokens=args.kv_max_tokens,
        context_bytes=args.context_bytes,
        standby_context_bytes=args.standby_context_bytes,
    )
    commands: queue.Queue[Any] = queue.Queue()
    on_eof = adopt_later(host, commands, args) if adoptable else None
    threading.Thread(target=read_commands, args=(sys.stdin, host, commands, on_eof), name="stdin", daemon=True).start()
    requests = RequestQueue.from_url(args.redis_url) if args.redis_url else None
    if args.deployment and requests is not None:
        Server(host, requests, args.deployment).start()
    pair = None
    if args.failover_lease is not None:
        from inference.pairing import PairMember

        dsn = os.environ.get("GPUPORTAL_FAILOVER_DSN", "")
        if not dsn or requests is None:
            events.emit("failed", reason="a failover member needs GPUPORTAL_FAILOVER_DSN and --redis-url", kind="load")
            _exit(2)
        pair = PairMember.from_args(host, requests, dsn, args)
    _exit(run(host, commands, pair))


if __name__ == "__main__":
    main()
