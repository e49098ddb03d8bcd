"""Where a replica's weights live and how they move: the placement a replica is given and the cap
it is held to, the two backends (virtual, on the CPU, accounting like a GPU; CUDA), the failures a
load or a move can end in, and NVML's view of a process. Used by the replica's host
(inference.host); no Django."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from inference.allocator import give_back_cached
from inference.loaders import EMBEDDING, TRANSFORMERS

if TYPE_CHECKING:
    from torch import nn

    from inference.arena import Arena, PendingCopies
    from inference.warmup import WarmUp

log = logging.getLogger("inference.replica")

BACKENDS = ("virtual", "cuda")
FAILURE_KINDS = ("oom", "load", "cuda_assert", "crash")
MiB = 1024**2
_MAX_REASON = 500


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
    def loaded_bytes(self) -> int: ...
    def context_bytes_measured(self, placement: Placement) -> int: ...
    def outside_allocator_bytes(self, placement: Placement, context_bytes: int) -> int: ...
    def release(self) -> None: ...
    def prepare_spare(self, model: nn.Module) -> Arena: ...
    def drop_spare(self) -> int: ...
    def collect_kept(self, copies: PendingCopies) -> None: ...
    def hold_in_arena(self, model: nn.Module) -> None: ...


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
        # The weights while asleep or standing by (inference.arena); None while awake.
        self.arena: Arena | None = None

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

    def hold_in_arena(self, model: nn.Module) -> None:
        """Take weights read from outside (a host copy, inference.host_copy) into an arena, pinned
        where the spare would be, as if this replica had gone to sleep: `from_cache` then wakes
        it at the copy's speed."""
        from inference.arena import pack

        self.arena = pack(model, pin=self.pin_spare)

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

    def attach(self, placement: Placement) -> None:
        self.context_bytes = max(self.context_bytes, self.profile.context_bytes)
        self._limit_threads()

    def loaded_bytes(self) -> int:
        """What the process holds of the host's memory: a virtual GPU's weights load there
        (inference.load_progress reads it from another thread while they load)."""
        import psutil

        return psutil.Process().memory_info().rss

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
        # The GPUs it attached to (its placement's).
        self._gpus: tuple[int, ...] = ()

    def loaded_bytes(self) -> int:
        """What the allocator holds on this replica's GPUs (inference.load_progress reads it from
        another thread while the weights load)."""
        import torch

        return sum(torch.cuda.memory_allocated(index) for index in self._gpus)

    def attach(self, placement: Placement) -> None:
        import torch

        self._gpus = tuple(placement.gpus)
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
    seen = nvml_memory(set())
    return None if seen is None else seen[1]


def nvml_memory(pids: set[int]) -> tuple[dict[int, dict[str, int]], dict[str, int]] | None:
    """What a heartbeat reads of NVML, in one pass over the devices: {pid: {GPU index: bytes}}
    for each of `pids` NVML lists, and {GPU index: bytes} free. Each device's processes and its
    free memory are read back to back, so that what other tenants hold (the used memory no pid of
    ours explains) is not mistaken for a replica that grew between two reads. None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver: nothing to measure with
        log.warning("NVML unavailable: %s", exc)
        return None
    try:
        found: dict[int, dict[str, int]] = {}
        free: dict[str, int] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in pids:
                    by_gpu = found.setdefault(process.pid, {})
                    by_gpu[str(index)] = by_gpu.get(str(index), 0) + int(process.usedGpuMemory or 0)
            free[str(index)] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        return found, free
    finally:
        with contextlib.suppress(Exception):  # shutdown failing changes nothing we measured
            pynvml.nvmlShutdown()
