"""The simulator's deployments and requests, and synthetic traces reproducible from a seed:
deployments of spread sizes, Zipf popularity, and bursty arrivals (Gamma inter-arrival times with
a chosen coefficient of variation). Traces read from files are scheduling.simulation.traces'."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpuportal.wire import memory
from gpuportal.wire.memory import ModelShape
from scheduling.core import autoscale, costs
from scheduling.core.costs import HardwareConfig
from scheduling.simulation.config import Config, Placement, ServingConfig


@dataclass(frozen=True)
class Architecture:
    """The shape of a public model of that size (Qwen2.5 and Llama 3.x), for KV and activation sizing."""

    params_b: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    intermediate: int


SHAPES: Mapping[str, Architecture] = {
    "0.5B": Architecture(0.5, 24, 896, 2, 64, 4864),
    "1.5B": Architecture(1.5, 28, 1536, 2, 128, 8960),
    "3B": Architecture(3.1, 36, 2048, 2, 128, 11008),
    "7B": Architecture(7.6, 28, 3584, 4, 128, 18944),
    "8B": Architecture(8.0, 32, 4096, 8, 128, 14336),
    "14B": Architecture(14.8, 48, 5120, 8, 128, 13824),
    "32B": Architecture(32.8, 64, 5120, 8, 128, 27648),
    "70B": Architecture(70.6, 80, 8192, 8, 128, 28672),
}


@dataclass(frozen=True)
class Deployment:
    name: str
    size: str
    dtype: str
    weight_bytes: int
    # What memory.estimate says a replica needs (weights + KV pool + activations + CUDA context):
    # the `gpuportal` need, and the "measured" need of seed 001 (the simulator measures exactly it).
    estimate_bytes: int
    rate_per_s: float
    popular: bool
    flops_per_token: float  # 2 × parameters: prefill cost
    # A catalogue's own settings (scheduling.simulation.traces): None follows the config's
    # [serving] table, as the generator's deployments all do.
    dedicated: bool = False
    min_runtime_s: float | None = None
    max_wait_s: float | None = None
    idle_timeout_s: float | None = None  # 0: never sleeps when idle
    slo_ttft_s: float | None = None
    # Measured on the live portal (DeploymentObserved.measured_load_s / measured_wake_s): a cold load from
    # disk and a wake from CPU RAM; None derives them from the bytes and the [hardware] speeds.
    load_s: float | None = None
    wake_s: float | None = None
    # How many replicas it keeps awake where it can (the product's `replicas`), and, where set,
    # how the autoscaler scales that by load (the deployment's `autoscale` settings).
    replicas: int = 1
    autoscale: autoscale.Policy | None = None
    # Where its replicas may run, as a deployment stores its `placement.node_selector` and
    # `placement.tolerations` ("" is none), against the nodes' marks ([cluster] pools).
    node_selector: str = ""
    tolerations: str = ""

    def disk_load_s(self, hardware: HardwareConfig) -> float:
        return costs.disk_load_s(self.weight_bytes, hardware, self.load_s)

    def ram_wake_s(self, hardware: HardwareConfig) -> float:
        return costs.ram_wake_s(self.weight_bytes, hardware, self.wake_s)

    def need_bytes(self, policy: str) -> int:
        inputs = memory.NeedInputs(weight_bytes=self.weight_bytes, estimate_bytes=self.estimate_bytes)
        return memory.need_for(policy, inputs).bytes


@dataclass(frozen=True)
class Request:
    id: int
    deployment: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    deployments: tuple[Deployment, ...]
    requests: tuple[Request, ...]  # by arrival time
    duration_s: float


def estimate_bytes(arch: Architecture, dtype: str, serving: ServingConfig, hardware: HardwareConfig) -> int:
    element = memory.dtype_bytes(dtype)
    shape = ModelShape(
        weight_bytes=int(arch.params_b * 1e9) * element,
        num_layers=arch.layers,
        num_kv_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        dtype_bytes=element,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
    )
    est = memory.estimate(
        shape,
        max_tokens=serving.max_batch * serving.context_tokens,
        cuda_context_bytes=hardware.cuda_context_mib * memory.MiB,
    )
    return est.total_bytes


def generate(config: Config) -> Trace:
    """The trace for `config`, drawn from `config.seed` alone."""
    tc = config.trace
    rng = random.Random(config.seed)
    # Every size of the catalogue at least once (when there are enough deployments), so that the
    # spread from the smallest to the largest model is in every trace; the rest by weight.
    sizes = list(tc.sizes[: tc.deployments])
    sizes += rng.choices(tc.sizes, weights=tc.size_weights, k=tc.deployments - len(sizes))
    rng.shuffle(sizes)
    # Popularity rank is independent of size: a big model can be the popular one.
    ranks = list(range(1, tc.deployments + 1))
    rng.shuffle(ranks)
    weights = [1 / r**tc.zipf_s for r in ranks]
    scale = tc.total_rate_per_s / sum(weights)
    deployments = []
    for n, (size, rank, weight) in enumerate(zip(sizes, ranks, weights, strict=True)):
        arch = SHAPES[size]
        dtype = rng.choice(tc.dtypes)
        deployments.append(
            Deployment(
                name=f"m{n:02d}-{size.lower()}",
                size=size,
                dtype=dtype,
                weight_bytes=int(arch.params_b * 1e9) * memory.dtype_bytes(dtype),
                estimate_bytes=estimate_bytes(arch, dtype, config.serving, config.hardware),
                rate_per_s=weight * scale,
                popular=rank <= tc.popular,
                flops_per_token=2 * arch.params_b * 1e9,
            )
        )
    deployments = _placed(deployments, tc.placements, config.seed)
    requests = []
    for d in deployments:
        requests += _arrivals(d, tc.duration_s, tc.arrival_cv, tc.prompt_tokens, tc.output_tokens, rng)
    requests.sort(key=lambda r: (r.arrival_s, r.deployment))
    numbered = tuple(
        Request(i, r.deployment, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)
    )
    return Trace(tuple(deployments), numbered, tc.duration_s)


def _placed(deployments: list[Deployment], placements: Sequence[Placement], seed: int) -> list[Deployment]:
    """`deployments` with each placement's share of them given its selector and tolerations, drawn
    with a generator of their own: the rest of the trace is the one the same seed draws without."""
    if not placements:
        return deployments
    rng = random.Random(f"placements-{seed}")
    unplaced = list(range(len(deployments)))
    rng.shuffle(unplaced)
    out = list(deployments)
    for placement in placements:
        chosen, unplaced = unplaced[: round(placement.share * len(out))], unplaced[round(placement.share * len(out)) :]
        for i in chosen:
            out[i] = replace(out[i], node_selector=placement.node_selector, tolerations=placement.tolerations)
    return out


def _arrivals(
    d: Deployment,
    duration_s: float,
    cv: float,
    prompt: tuple[int, int],
    output: tuple[int, int],
    rng: random.Random,
) -> list[Request]:
    # Gamma with shape k = 1/cv² and mean 1/rate: cv > 1 gives bursts separated by long silences.
    shape = 1 / cv**2
    scale = 1 / (d.rate_per_s * shape)
    t, out = rng.gammavariate(shape, scale), []
    while t < duration_s:
        out.append(Request(-1, d.name, t, rng.randint(*prompt), rng.randint(*output)))
        t += rng.gammavariate(shape, scale)
    return out


def production_like(
    config: Config, *, seed: int, deployments: int = 48, duration_s: float = 600.0, rate_per_s: float = 6.0
) -> tuple[tuple[Deployment, ...], list[tuple[float, str, int, int]]]:
    """A trace of the shape public LLM serving traces show (Azure's 2023 LLM inference traces, the
    BurstGPT study): arrivals in bursts (a Markov-modulated Poisson process, on at 4× the mean
    rate, off at a fifth of it, each state lasting an exponential time of mean 20 s), log-normal
    prompt and output lengths with long tails (medians 600 and 150 tokens, σ = 1, clipped to 8192
    and 2048), split across `deployments` by a Zipf popularity (s = 1.1), sizes drawn as
    config.trace's. Returns the deployments (the catalogue) and the rows (arrival s, deployment,
    prompt tokens, output tokens), for a test or the benchmark to write as files."""
    rng = random.Random(seed)
    tc = config.trace
    sizes = list(tc.sizes[:deployments]) + rng.choices(
        tc.sizes, weights=tc.size_weights, k=max(0, deployments - len(tc.sizes))
    )
    rng.shuffle(sizes)
    weights = [1 / rank**1.1 for rank in range(1, deployments + 1)]
    total = sum(weights)
    catalogue = []
    for n, (size, weight) in enumerate(zip(sizes, weights, strict=True)):
        arch, dtype = SHAPES[size], rng.choice(tc.dtypes)
        catalogue.append(
            Deployment(
                name=f"p{n:02d}-{size.lower()}",
                size=size,
                dtype=dtype,
                weight_bytes=int(arch.params_b * 1e9) * memory.dtype_bytes(dtype),
                estimate_bytes=estimate_bytes(arch, dtype, config.serving, config.hardware),
                rate_per_s=rate_per_s * weight / total,
                popular=n < tc.popular,
                flops_per_token=2 * arch.params_b * 1e9,
            )
        )
    names = [d.name for d in catalogue]
    rows: list[tuple[float, str, int, int]] = []
    t, on = 0.0, True
    switch = rng.expovariate(1 / 20.0)
    while True:
        rate = rate_per_s * (1.8 if on else 0.2)
        t += rng.expovariate(rate)
        while t >= switch:  # the state changed before this arrival: draw it again at the new rate
            t, on = switch, not on
            switch += rng.expovariate(1 / 20.0)
            t += rng.expovariate(rate_per_s * (1.8 if on else 0.2))
        if t >= duration_s:
            break
        prompt = min(8192, max(8, round(rng.lognormvariate(math.log(600), 1.0))))
        output = min(2048, max(1, round(rng.lognormvariate(math.log(150), 1.0))))
        rows.append((t, rng.choices(names, weights=weights)[0], prompt, output))
    return tuple(catalogue), rows
