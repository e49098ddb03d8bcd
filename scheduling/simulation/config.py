"""The simulator's parameters, read from one TOML file (config.toml beside this module: the standard
trace the policies are compared on, and the planner's defaults)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuportal.wire import node_labels
from scheduling.core.costs import HardwareConfig

DEFAULT_CONFIG = Path(__file__).with_name("config.toml")
GiB = 1024**3


@dataclass(frozen=True)
class Placement:
    """Deployments of a generated trace placed by node selector and tolerations, as a deployment's
    `placement.node_selector` and `placement.tolerations` are: `share` of them (0 to 1, drawn with
    the seed), each with this selector (`key=value,...`: nodes whose labels hold every pair) and
    these tolerations (`key=value` or a bare `key`: the taints its replicas may run beside)."""

    share: float
    node_selector: str = ""
    tolerations: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"trace.placements: share must be 0 to 1, got {self.share}")
        try:
            object.__setattr__(self, "node_selector", node_labels.canonical(self.node_selector))
            object.__setattr__(self, "tolerations", node_labels.canonical_tolerations(self.tolerations))
        except ValueError as exc:
            raise ValueError(f"trace.placements: {exc}") from None


@dataclass(frozen=True)
class Pool:
    """Nodes an operator marked alike (`gpuportal label` and `taint`): `nodes` of the cluster's,
    with these labels (`key=value,...`) and taints (`key=value:Effect,...`, NoSchedule where no
    effect is named). The cluster's other nodes have neither. A simulation of more or fewer
    nodes than [cluster] names (the planner's search, --quick) keeps each pool's share of them
    (ClusterConfig.marks)."""

    nodes: int
    labels: str = ""
    taints: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"cluster.pools: nodes must be a whole number of 1 or more, got {self.nodes!r}")
        for what, text, taints in (("labels", self.labels, False), ("taints", self.taints, True)):
            try:
                node_labels.parse(text, taints=taints)
            except ValueError as exc:
                raise ValueError(f"cluster.pools: {what}: {exc}") from None

    def marks(self) -> node_labels.Marks:
        return node_labels.parse(self.labels), node_labels.parse(self.taints, taints=True)


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
    placements: tuple[Placement, ...] = ()

    def __post_init__(self) -> None:
        if sum(p.share for p in self.placements) > 1:
            raise ValueError("trace.placements: their shares add up to more than 1")


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    # A warm spare on every GPU (GPUPORTAL_WARM_SPARES): one CUDA context less of each GPU to place
    # into, and a deep wake that finds its GPU's spare warm starts in `spare_start_s`.
    warm_spares: bool = False
    pools: tuple[Pool, ...] = ()
    # The count of nodes the pools' counts are of: [cluster] nodes as the file gives them.
    pooled_of: int = 0

    def __post_init__(self) -> None:
        pooled, of = sum(pool.nodes for pool in self.pools), self.pooled_of or self.nodes
        if pooled > of:
            raise ValueError(f"cluster.pools: {pooled} nodes in pools, more than the cluster's {of}")

    def marks(self, nodes: Iterable[str]) -> dict[str, node_labels.Marks]:
        """Each of `nodes`' labels and taints, in name order: the pools' in turn, each over its
        share of them (its count of the cluster's nodes, in proportion: largest remainders),
        and none on those past the pools."""
        names = sorted(nodes)
        of = self.pooled_of or self.nodes
        counts = apportioned([pool.nodes for pool in self.pools] + [of - sum(p.nodes for p in self.pools)], len(names))
        marks: dict[str, node_labels.Marks] = dict.fromkeys(names, ({}, {}))
        start = 0
        for pool, count in zip(self.pools, counts, strict=False):
            marks.update(dict.fromkeys(names[start : start + count], pool.marks()))
            start += count
        return marks

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GiB)


def apportioned(weights: list[int], total: int) -> list[int]:
    """`total` split in proportion to `weights` (whole numbers summing to it: the largest
    remainders get the leftover, the earlier first on a tie)."""
    whole = sum(weights)
    if whole <= 0:
        return [0] * len(weights)
    shares = [w * total / whole for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


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
    trace["placements"] = tuple(Placement(**dict(p)) for p in trace.get("placements", ()))
    cluster["pools"] = tuple(Pool(**dict(p)) for p in cluster.get("pools", ()))
    cluster["pooled_of"] = raw["cluster"]["nodes"]
    return Config(
        seed=raw.get("seed", 0) if seed is None else seed,
        trace=TraceConfig(**trace),
        cluster=ClusterConfig(**cluster),
        hardware=HardwareConfig(**raw["hardware"]),
        serving=ServingConfig(**raw["serving"]),
        search=SearchConfig(**search),
    )
