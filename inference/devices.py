"""GPU backends (DESIGN §6): NVML for real NVIDIA GPUs, declared virtual GPUs elsewhere.

Both produce the same DeviceInfo rows, so scheduling never knows which it got; the `virtual`
flag only labels them in the API and admin.
"""

from __future__ import annotations

import logging
import re
from contextlib import suppress

from scheduling.state import DeviceInfo

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


def virtual_gpus(node: str, spec: str) -> list[DeviceInfo]:
    return [
        DeviceInfo(
            index=i,
            # Stable across restarts, so a re-registering agent finds its rows again.
            uuid=f"virtual-{node}-{i}",
            product=f"Virtual GPU ({size / 1024**3:.3g} GiB)",
            total_bytes=size,
            virtual=True,
        )
        for i, size in enumerate(parse_virtual_spec(spec))
    ]


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
            devices.append(
                DeviceInfo(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    product=name.decode() if isinstance(name, bytes) else name,
                    total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    virtual=False,
                )
            )
        return devices
    finally:
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def discover(node: str, *, backend: str = "auto", virtual_spec: str = "2x24GiB") -> list[DeviceInfo]:
    """`auto`: NVML when it finds a GPU, else the virtual GPUs of `virtual_spec`."""
    if backend not in {"auto", "nvml", "virtual"}:
        raise ValueError(f"unknown GPU backend {backend!r} (auto, nvml or virtual)")
    if backend in {"auto", "nvml"}:
        found = nvidia_gpus()
        if found:
            return found
        if backend == "nvml":
            raise ValueError("--backend nvml, but NVML finds no NVIDIA GPU on this host")
    return virtual_gpus(node, virtual_spec)
