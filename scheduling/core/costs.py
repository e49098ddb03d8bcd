"""One hardware cost model, for the live wake path and the capacity planner's simulator alike:
how long a replica takes to load from disk and to wake from host memory. What the portal has
measured of a deployment where it has, else its weights over the hardware's speeds (the
[hardware] table of scheduling/simulation/config.toml, which the simulator reads too). Pure."""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

HARDWARE_FILE = Path(__file__).resolve().parents[1] / "simulation" / "config.toml"


@dataclass(frozen=True)
class HardwareConfig:
    disk_gb_per_s: float
    h2d_gb_per_s: float
    d2h_gb_per_s: float
    hbm_tb_per_s: float
    prefill_tflops: float
    cuda_context_mib: int
    # What a wake from deep sleep adds to a wake from the first level: a new process, its imports
    # and its CUDA context, before the weights cross the bus.
    process_start_s: float = 0.0
    # A wake from deep sleep that runs in its GPU's warm spare (GPUPORTAL_WARM_SPARES): the process
    # and its CUDA context were made before the wake; what is left is the replica program's start.
    spare_start_s: float = 0.0


@functools.cache
def hardware(path: Path = HARDWARE_FILE) -> HardwareConfig:
    """The speeds the file gives; read once (it does not change while a process runs)."""
    return HardwareConfig(**tomllib.loads(path.read_text())["hardware"])


def disk_load_s(weight_bytes: int, hardware: HardwareConfig, measured: float | None = None) -> float:
    """A cold load: the measured figure where there is one, else the weights at disk speed."""
    return measured if measured is not None else weight_bytes / (hardware.disk_gb_per_s * 1e9)


def ram_wake_s(weight_bytes: int, hardware: HardwareConfig, measured: float | None = None) -> float:
    """A wake from host memory: measured where known, else the weights at host-to-device speed."""
    return measured if measured is not None else weight_bytes / (hardware.h2d_gb_per_s * 1e9)


def deep_wake_s(weight_bytes: int, hardware: HardwareConfig, measured: float | None = None) -> float:
    """A wake from deep sleep: a process started, then the weights from the node's host copy as a
    first-level wake copies them."""
    return hardware.process_start_s + ram_wake_s(weight_bytes, hardware, measured)
