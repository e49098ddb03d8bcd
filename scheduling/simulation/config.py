"""The simulator's parameters, read from one TOML file (config.toml beside this module: the standard
trace the policies are compared on, and the planner's defaults)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduling.core.costs import HardwareConfig

DEFAULT_CONFIG = Path(__file__).with_name("config.toml")
GiB = 1024**3


@dataclass(frozen=True)
class TraceConfig:
    deployments: int
    duration_s: float
    total_rate_per_s: float
    zipf_s: float
    arrival_cv: float
    popular: int
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    sizes: tuple[str, ...]
    size_weights: tuple[float, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    # A warm spare on every GPU (GPUPORTAL_WARM_SPARES): one CUDA context less of each GPU to place
    # into, and a deep wake that finds its GPU's spare warm starts in `spare_start_s`.
    warm_spares: bool = False

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GiB)


@dataclass(frozen=True)
class ServingConfig:
    max_batch: int
    context_tokens: int
    slo_ttft_s: float
    idle_timeout_s: float
    min_runtime_s: float
    max_wait_s: float
    drain_timeout_s: float
    retry_s: float
    grace_s: float
    deep_after_s: float = 0.0


@dataclass(frozen=True)
class SearchConfig:
    target_attainment: float
    max_gpus: int
    # The counts in a row that must reach the target for the planner to say it holds from the first.
    steady_window: int = 3

    def __post_init__(self) -> None:
        if self.steady_window < 1:
            raise ValueError(f"search.steady_window must be 1 or more, got {self.steady_window}")


@dataclass(frozen=True)
class Config:
    seed: int
    trace: TraceConfig
    cluster: ClusterConfig
    hardware: HardwareConfig
    serving: ServingConfig
    search: SearchConfig


def load(path: Path | str = DEFAULT_CONFIG, *, quick: bool = False, seed: int | None = None) -> Config:
    raw = tomllib.loads(Path(path).read_text())
    trace, cluster, search = dict(raw["trace"]), dict(raw["cluster"]), dict(raw["search"])
    if quick:
        small: dict[str, Any] = raw.get("quick", {})
        for key in ("deployments", "duration_s", "total_rate_per_s"):
            trace[key] = small.get(key, trace[key])
        for key in ("nodes", "gpus_per_node"):
            cluster[key] = small.get(key, cluster[key])
        search["max_gpus"] = small.get("max_gpus", search["max_gpus"])
    for key in ("prompt_tokens", "output_tokens", "sizes", "size_weights", "dtypes"):
        trace[key] = tuple(trace[key])
    return Config(
        seed=raw.get("seed", 0) if seed is None else seed,
        trace=TraceConfig(**trace),
        cluster=ClusterConfig(**cluster),
        hardware=HardwareConfig(**raw["hardware"]),
        serving=ServingConfig(**raw["serving"]),
        search=SearchConfig(**search),
    )
