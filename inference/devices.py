"""GPU backends: NVML for real NVIDIA GPUs, declared virtual GPUs elsewhere.

Both produce the same DeviceInfo rows, so scheduling never knows which it got; the `virtual`
flag only labels them in the API and admin.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import suppress
from dataclasses import dataclass

from gpuportal.wire import memory
from gpuportal.wire.node_reports import DeviceInfo

log = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1000,
    "KIB": 1024,
    "M": 1024**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1024**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1024**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_VIRTUAL_ITEM = re.compile(r"^\s*(?:(\d+)\s*[xX×]\s*)?(.+?)\s*$")


def parse_size(text: str) -> int:
    """'24GiB' → 25769803776. Binary units for K/M/G/T and *iB, decimal for KB/MB/GB/TB."""
    match = _SIZE.match(text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 1073741824, 512MiB, 24GiB, 80GB)")
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


def parse_virtual_spec(spec: str) -> list[int]:
    """'2x24GiB' or '1x80GiB,2x24GiB' → the memory of each virtual GPU, in index order."""
    if not spec or not spec.strip():
        raise ValueError("empty virtual GPU spec (example: 2x24GiB)")
    sizes: list[int] = []
    for item in spec.split(","):
        match = _VIRTUAL_ITEM.match(item)
        if not match or not match.group(2):
            raise ValueError(f"{item!r} is not COUNTxSIZE (example: 2x24GiB)")
        count = int(match.group(1) or 1)
        if not 1 <= count <= 64:
            raise ValueError(f"{item!r}: count must be between 1 and 64")
        try:
            size = parse_size(match.group(2))
        except ValueError as err:
            raise ValueError(f"{item!r}: {err}") from None
        sizes += [size] * count
    return sizes


@dataclass(frozen=True)
class VirtualProfile:
    """How a virtual GPU accounts, so that the CPU suite catches what breaks on a real one.

    The defaults are the H100 of ../shared/gpu-2026-11-24: each replica process pays a CUDA
    context beside PyTorch's allocator (more once it has served than as a standby), the driver
    keeps a reserve that NVML counts in its total but CUDA cannot allocate, and the allocator
    rounds what it holds (gpuportal.wire.memory.allocation_bytes). A node overrides them with the
    agent's --virtual-context, --virtual-standby-context and --virtual-driver-reserve, which reach
    its replica processes in their environment (ENV).
    """

    context_bytes: int = memory.H100_CONTEXT_BYTES
    standby_context_bytes: int = memory.H100_STANDBY_CONTEXT_BYTES
    driver_reserve_bytes: int = memory.H100_DRIVER_RESERVE_BYTES
    # What serving adds to a context beyond context_bytes (kernels its forward passes load): held
    # from the replica's first sleep on, so a sleep's residual shows it as a real GPU's does.
    kernel_bytes: int = memory.H100_KERNEL_GROWTH_BYTES

    ENV = (
        ("context_bytes", "GPUPORTAL_VIRTUAL_CONTEXT_BYTES"),
        ("standby_context_bytes", "GPUPORTAL_VIRTUAL_STANDBY_CONTEXT_BYTES"),
        ("driver_reserve_bytes", "GPUPORTAL_VIRTUAL_DRIVER_RESERVE_BYTES"),
        ("kernel_bytes", "GPUPORTAL_VIRTUAL_KERNEL_BYTES"),
    )

    def __post_init__(self) -> None:
        for field_name, _ in self.ENV:
            if getattr(self, field_name) < 0:
                raise ValueError(f"virtual GPU {field_name} must be >= 0, got {getattr(self, field_name)}")
        if self.standby_context_bytes > self.context_bytes:
            raise ValueError("a standby's context cannot be larger than a serving replica's")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> VirtualProfile:
        """The profile in `env` (default os.environ); missing values keep the H100 defaults."""
        env = dict(os.environ if env is None else env)
        values = {}
        for field_name, var in cls.ENV:
            if env.get(var, "").strip():
                try:
                    values[field_name] = parse_size(env[var]) if env[var].strip() != "0" else 0
                except ValueError as exc:
                    raise ValueError(f"{var}: {exc}") from None
        return cls(**values)

    def as_env(self) -> dict[str, str]:
        return {var: str(getattr(self, field_name)) for field_name, var in self.ENV}


FOREIGN_ENV = "GPUPORTAL_VIRTUAL_FOREIGN"


def parse_virtual_foreign(spec: str, gpu_count: int | None = None) -> dict[int, int]:
    """'0:1GiB' or '0:1GiB,1:512MiB' → {GPU index: bytes other tenants hold there}: the memory a
    virtual GPU shows used by processes that are not the node's replicas. Empty: none."""
    found: dict[int, int] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        index_text, sep, size_text = item.partition(":")
        if not sep or not index_text.strip().isdigit():
            raise ValueError(f"{item.strip()!r} is not INDEX:SIZE (example: 0:1GiB)")
        index = int(index_text)
        if gpu_count is not None and index >= gpu_count:
            raise ValueError(f"{item.strip()!r}: there is no virtual GPU {index} (the node has {gpu_count})")
        if index in found:
            raise ValueError(f"{item.strip()!r}: GPU {index} is named twice")
        try:
            found[index] = parse_size(size_text) if size_text.strip() != "0" else 0
        except ValueError as err:
            raise ValueError(f"{item.strip()!r}: {err}") from None
    return found


def foreign_use(total_bytes: int, free_bytes: int, own_bytes: int) -> int:
    """What other tenants hold on a GPU, from NVML: what CUDA could allocate on it idle (its
    total, the driver's reserve already out) less what is free and what the node's own replica
    processes hold; never negative (the figures are read a moment apart)."""
    return max(0, total_bytes - free_bytes - own_bytes)


def virtual_gpus(node: str, spec: str, profile: VirtualProfile | None = None) -> list[DeviceInfo]:
    """The GPUs of `spec`, each declared size being NVML's total: CUDA can allocate that less the
    profile's driver reserve, which is what the books count."""
    profile = profile or VirtualProfile()
    devices = []
    for i, size in enumerate(parse_virtual_spec(spec)):
        if size <= profile.driver_reserve_bytes + profile.context_bytes:
            raise ValueError(
                f"a virtual GPU of {memory.human_bytes(size)} has no room once the driver reserve "
                f"({memory.human_bytes(profile.driver_reserve_bytes)}) and one CUDA context "
                f"({memory.human_bytes(profile.context_bytes)}) are taken; declare a larger one"
            )
        devices.append(
            DeviceInfo(
                index=i,
                # Stable across restarts, so a re-registering agent finds its rows again.
                uuid=f"virtual-{node}-{i}",
                product=f"Virtual GPU ({size / 1024**3:.3g} GiB)",
                total_bytes=size - profile.driver_reserve_bytes,
                virtual=True,
                nvml_total_bytes=size,
                context_bytes=profile.context_bytes,
                standby_context_bytes=profile.standby_context_bytes,
            )
        )
    return devices


def allocatable_bytes(pynvml: object, handle: object) -> tuple[int, int]:
    """(what CUDA can allocate, NVML's total) of one device.

    NVML's total counts memory the driver keeps for itself; version 2 of the memory query names
    it (`reserved`). On an idle device everything "used" is out of CUDA's reach, and that can be
    more than `reserved` (the H100 of 2026-11-26: 480 MiB reserved, 483.2 MiB used with no process
    on it): the larger of the two. A busy device (the agent restarted beside running replicas)
    tells only `reserved`; drivers without it, the H100's figure stands in.
    """
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)  # type: ignore[attr-defined]
    total = int(info.total)
    reserved = 0
    with suppress(Exception):  # NVMLError_FunctionNotFound on old drivers, AttributeError on old bindings
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)  # type: ignore[attr-defined]
        if 0 < int(v2.reserved) < total:
            reserved = int(v2.reserved)
    with suppress(Exception):
        if not pynvml.nvmlDeviceGetComputeRunningProcesses(handle):  # type: ignore[attr-defined]
            return total - max(reserved, int(info.used)), total
    return total - (reserved or memory.H100_DRIVER_RESERVE_BYTES), total


def nvidia_gpus() -> list[DeviceInfo]:
    """The NVIDIA GPUs NVML sees; empty where there is no driver or no GPU."""
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but a broken install should not crash the agent
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        log.info("no NVIDIA GPU: %s", err)
        return []
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            allocatable, nvml_total = allocatable_bytes(pynvml, handle)
            devices.append(
                DeviceInfo(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    product=name.decode() if isinstance(name, bytes) else name,
                    total_bytes=allocatable,
                    virtual=False,
                    nvml_total_bytes=nvml_total,
                    # Measured by the replicas that run here (scheduling.services.replicas).
                    context_bytes=None,
                )
            )
        return devices
    finally:
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def discover(
    node: str, *, backend: str = "auto", virtual_spec: str = "2x24GiB", profile: VirtualProfile | None = None
) -> list[DeviceInfo]:
    """`auto`: NVML when it finds a GPU, else the virtual GPUs of `virtual_spec`."""
    if backend not in {"auto", "nvml", "virtual"}:
        raise ValueError(f"unknown GPU backend {backend!r} (auto, nvml or virtual)")
    if backend in {"auto", "nvml"}:
        found = nvidia_gpus()
        if found:
            return found
        if backend == "nvml":
            raise ValueError("--backend nvml, but NVML finds no NVIDIA GPU on this host")
    return virtual_gpus(node, virtual_spec, profile)
