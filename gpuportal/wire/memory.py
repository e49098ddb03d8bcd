"""How many GPU bytes a replica needs (docs/architecture.md, Memory). Pure: no Django, no torch, no I/O.

In order of trust a replica's need is the operator's override, the bytes measured after its
first load, or an estimate from the model's shape. Measured or estimated, it is one formula,
`estimate` (a `MemoryEstimate`, the footprint of one serving replica):

    weights + KV-cache pool + activation reserve + CUDA context (+ the standby's context in a
    failover pair) + memory outside PyTorch's allocator

The scheduler reserves its total; the replica sizes its block pool with
`kv_pool_blocks`, which inverts the same arithmetic over the same parts, so what is reserved is
what gets allocated, and a replica reserved the footprint at `max_tokens` gets a pool of exactly
`max_tokens`. Weights are counted as PyTorch's caching allocator holds them (`allocation_bytes`,
tensor by tensor), not as their tensors' sizes, since that is what NVML sees. The activation
reserve is the allocator's working room: a forward pass's temporaries, module buffers (rotary
tables: not weights, since the estimate from a checkpoint cannot see them and counting them in the
replica would leave its pool a block short) and the rounding of the pool's two allocations.

Only the allocator is capped (`torch.cuda.set_per_process_memory_fraction`): the CUDA context and
memory outside PyTorch sit beside the cap inside the reservation, so `allocator_cap_bytes` takes
them out before a fraction is computed, against the total the fraction is applied to.

The seed-000 heuristic (model size × 3, fractional only below 0.8 of a GPU) is kept as the named
policy ``ndif`` so benchmarks can compare it with ours (``gpuportal``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# Bytes per element of the dtypes a deployment may ask for (scheduling.models.Deployment.DType).
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# Measured on an H100 80GB (driver 580, CUDA 13, torch 2.11; ../shared/gpu-2026-11-24): what NVML
# shows of a process beyond PyTorch's allocator. Serving (cuBLAS handles and kernels loaded by the
# first forward passes) 712-722 MiB; a standby that never ran a forward 518 MiB. The defaults for
# a GPU whose own context has not been measured yet, and for the virtual GPU's model of one.
H100_CONTEXT_BYTES = 722 * MiB
H100_STANDBY_CONTEXT_BYTES = 518 * MiB
# The same H100 on 2026-11-26 (torch 2.11, this project's paged engine): 610 MiB at the load's
# measurement, before any forward pass; 748-774 MiB once the process had served. Kernels keep
# loading past what the default above counts: this much more, the virtual GPU's model of it.
H100_KERNEL_GROWTH_BYTES = 774 * MiB - H100_CONTEXT_BYTES
# NVML's total minus what CUDA can allocate on that H100: memory the driver keeps on an idle device.
H100_DRIVER_RESERVE_BYTES = 480 * MiB
TYPICAL_CUDA_CONTEXT_BYTES = H100_CONTEXT_BYTES

# PyTorch's CUDA caching allocator rounds every request up to 512 B, and serves requests above
# 1 MiB from segments rounded up to 2 MiB (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize,
# kSmallSize, kRoundLarge). NVML sees the segments, so the books count them.
ALLOCATOR_BLOCK_BYTES = 512
ALLOCATOR_SMALL_BYTES = 1 * MiB
ALLOCATOR_LARGE_ROUND_BYTES = 2 * MiB

# Tokens per KV block: the pool's allocation unit, so a sequence wastes under one block.
DEFAULT_BLOCK_TOKENS = 16

# Activation budget, per token of one forward step. Inference keeps no autograd graph, so only one
# decoder layer's temporaries are alive at a time; the widest is the MLP: residual + normed input +
# down-projection output (3 × hidden) and gate, up and their product (3 × intermediate). Attention
# peaks lower (≈ 7 × hidden) with SDPA's fused kernels, which never materialise the score matrix;
# its math backend does, which the paged engine bounds by prefilling in chunks (see
# activation_reserve_bytes). The ×2 covers the caching allocator's rounding and fragmentation,
# which keeps freed blocks it cannot reuse for a differently sized tensor.
ACTIVATION_HIDDEN_TENSORS = 3
ACTIVATION_INTERMEDIATE_TENSORS = 3
ACTIVATION_SLACK = 2
# Without an intermediate size in the config, assume the classic 4 × hidden MLP.
DEFAULT_INTERMEDIATE_RATIO = 4
# Floor, whatever the model: cuBLAS workspaces, the allocator's 2 MiB segment granularity, the
# sampling step's logits and small temporaries do not shrink with the model.
ACTIVATION_FLOOR_BYTES = 64 * MiB

# The seed's heuristic, verbatim.
NDIF_FACTOR = 3
NDIF_MAX_FRACTION = 0.8

Source = Literal["override", "measured", "estimate", "ndif"]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element for a deployment dtype name ("float16"; "torch.float16" also accepted)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})") from None


def human_bytes(n: int) -> str:
    """For Events and logs: '734 MiB', '13.5 GiB'."""
    if n >= 10 * GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{round(n / MiB)} MiB"
    if n >= KiB:
        return f"{round(n / KiB)} KiB"
    return f"{n} B"


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def allocation_bytes(nbytes: int) -> int:
    """What the caching allocator holds for one tensor of nbytes (see ALLOCATOR_* above)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return 0
    if nbytes <= ALLOCATOR_SMALL_BYTES:
        return _round_up(nbytes, ALLOCATOR_BLOCK_BYTES)
    return _round_up(nbytes, ALLOCATOR_LARGE_ROUND_BYTES)


def allocations_bytes(sizes: Iterable[int]) -> int:
    """The allocator's bytes for tensors allocated one by one (a model's parameters)."""
    return sum(allocation_bytes(n) for n in sizes)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model, read without loading its weights.

    weight_bytes is the parameters as the allocator holds them (`allocations_bytes` of each
    tensor), without module buffers. dtype_bytes is the element size of the KV cache and of the
    activations: both are computed in the dtype the model runs in, which is not necessarily the
    one its checkpoint was saved in.
    """

    weight_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    hidden_size: int
    intermediate_size: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.weight_bytes < 0:
            raise ValueError(f"weight_bytes must be >= 0, got {self.weight_bytes}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")


@dataclass(frozen=True)
class MemoryEstimate:
    """The footprint of one serving replica on its GPU(s), part by part (what NVML would show)."""

    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    context_bytes: int
    # The KV part in the pool's own units, so an Event or the pool can show them without recomputing.
    kv_block_bytes: int
    kv_blocks: int
    block_tokens: int
    max_tokens: int
    # A failover pair's reservation also holds its sleeping standby's context.
    standby_context_bytes: int = 0
    # Measured on a real GPU: what the process holds outside both the context and the allocator.
    overhead_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.activation_bytes
            + self.context_bytes
            + self.standby_context_bytes
            + self.overhead_bytes
        )

    def parts(self) -> dict[str, int]:
        """For events and the API: each part and the total, in bytes."""
        return {
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_blocks": self.kv_blocks,
            "activation_bytes": self.activation_bytes,
            "context_bytes": self.context_bytes,
            "standby_context_bytes": self.standby_context_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
        }

    def describe(self) -> str:
        extra = ""
        if self.standby_context_bytes:
            extra += f" + standby context {human_bytes(self.standby_context_bytes)}"
        if self.overhead_bytes:
            extra += f" + outside the allocator {human_bytes(self.overhead_bytes)}"
        return (
            f"weights {human_bytes(self.weights_bytes)} + kv {human_bytes(self.kv_bytes)} "
            f"({self.kv_blocks} blocks for {self.max_tokens} tokens) + activations "
            f"{human_bytes(self.activation_bytes)} + context {human_bytes(self.context_bytes)}{extra} "
            f"= {human_bytes(self.total_bytes)}"
        )


@dataclass(frozen=True)
class Need:
    bytes: int
    source: Source

    def __str__(self) -> str:
        return f"need {human_bytes(self.bytes)} ({self.source})"


def kv_block_bytes(shape: ModelShape, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Bytes of one KV block across all layers: K and V for block_tokens tokens.

    All layers are in one block because a sequence's token needs a slot in every layer at once
    (the seed's formula left the layers out and so undercounted by that factor).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return 2 * block_tokens * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes * shape.num_layers


def kv_blocks(tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return math.ceil(tokens / block_tokens)


def kv_pool_bytes(shape: ModelShape, blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """The bytes of a pool of `blocks`. Counted as its tensors' size, not as the allocator rounds
    its two (K and V) allocations: that rounding, under 2 MiB each, lives in the activation reserve
    with the allocator's other slack, so a pool reserved for max_tokens holds exactly max_tokens."""
    if blocks < 0:
        raise ValueError(f"blocks must be >= 0, got {blocks}")
    return blocks * kv_block_bytes(shape, block_tokens)


def kv_cache_bytes(shape: ModelShape, tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Whole blocks, because the pool hands out nothing smaller."""
    return kv_pool_bytes(shape, kv_blocks(tokens, block_tokens), block_tokens)


def activation_reserve_bytes(shape: ModelShape, max_tokens: int) -> int:
    """A budget, not an allocation: PyTorch's allocator serves activations from whatever the cap leaves.

    Sized for one forward step over max_tokens tokens, which a prefill of prompts totalling
    max_tokens would be in one pass; see the ACTIVATION_* constants for the reasoning. The paged
    engine (inference.paged) runs a prefill in chunks of at most PREFILL_CHUNK_TOKENS (C) new tokens
    per slice, so its linear temporaries stay within this term, and the attention scores SDPA's math
    backend can materialise (a boolean mask; float32), which no term here counts, are bounded by
    C x keys per head and slice rather than prompt x keys: small next to the slack for one or a few
    long prompts, but not covered. Not covered either: eager attention over a whole prompt (tokens²
    scores, e.g. transformers' generate() outside the paged engine) and forward passes that keep
    logits for every position instead of the last.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return max(ACTIVATION_FLOOR_BYTES, activation_bytes_per_token(shape) * max_tokens)


def activation_bytes_per_token(shape: ModelShape) -> int:
    """The activation budget of one token of a forward step, slack included (see above); an
    embedding replica sizes its forward passes by it (inference.embedding)."""
    intermediate = shape.intermediate_size or DEFAULT_INTERMEDIATE_RATIO * shape.hidden_size
    per_token = (
        ACTIVATION_HIDDEN_TENSORS * shape.hidden_size + ACTIVATION_INTERMEDIATE_TENSORS * intermediate
    ) * shape.dtype_bytes
    return ACTIVATION_SLACK * per_token


def _check_bytes(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def estimate(
    shape: ModelShape,
    *,
    max_tokens: int,
    cuda_context_bytes: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    standby_context_bytes: int = 0,
    overhead_bytes: int = 0,
) -> MemoryEstimate:
    """The bytes a replica serving up to max_tokens tokens of KV cache at once will hold on its GPU.

    Before a load, from the checkpoint's shape; after one, from the parts the replica measured
    (its parameters as allocated, its context, what it holds outside the allocator): the same sum.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    _check_bytes(
        cuda_context_bytes=cuda_context_bytes,
        standby_context_bytes=standby_context_bytes,
        overhead_bytes=overhead_bytes,
    )
    blocks = kv_blocks(max_tokens, block_tokens)
    return MemoryEstimate(
        weights_bytes=shape.weight_bytes,
        kv_bytes=kv_pool_bytes(shape, blocks, block_tokens),
        activation_bytes=activation_reserve_bytes(shape, max_tokens),
        context_bytes=cuda_context_bytes,
        kv_block_bytes=kv_block_bytes(shape, block_tokens),
        kv_blocks=blocks,
        block_tokens=block_tokens,
        max_tokens=max_tokens,
        standby_context_bytes=standby_context_bytes,
        overhead_bytes=overhead_bytes,
    )


def kv_pool_blocks(
    shape: ModelShape,
    *,
    cap_bytes: int,
    max_tokens: int,
    cuda_context_bytes: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    standby_context_bytes: int = 0,
    overhead_bytes: int = 0,
) -> int:
    """Blocks a replica's KV pool gets inside its reservation: what is left after every other part.

    The inverse of `estimate` over the same parts: a cap of exactly estimate(...).total_bytes
    yields exactly its kv_blocks, and a larger cap (an overridden need) yields more, never fewer.
    """
    rest = estimate(
        shape,
        max_tokens=max_tokens,
        cuda_context_bytes=cuda_context_bytes,
        block_tokens=block_tokens,
        standby_context_bytes=standby_context_bytes,
        overhead_bytes=overhead_bytes,
    )
    left = cap_bytes - (rest.total_bytes - rest.kv_bytes)
    return max(0, left // rest.kv_block_bytes)


def allocator_cap_bytes(
    reserved_bytes: int, *, context_bytes: int, standby_context_bytes: int = 0, overhead_bytes: int = 0
) -> int:
    """The part of a reservation PyTorch's allocator may use: the context (and a pair's standby's
    context) and memory outside PyTorch are in the reservation too, but not under the cap."""
    _check_bytes(
        reserved_bytes=reserved_bytes,
        context_bytes=context_bytes,
        standby_context_bytes=standby_context_bytes,
        overhead_bytes=overhead_bytes,
    )
    return max(0, reserved_bytes - context_bytes - standby_context_bytes - overhead_bytes)


def allocator_fraction(cap_bytes: int, device_total_bytes: int) -> float:
    """`set_per_process_memory_fraction`'s argument: the cap over the total *it is applied to*
    (torch's view of the device, which is what CUDA can allocate), clamped to torch's (0, 1]."""
    if device_total_bytes <= 0:
        raise ValueError(f"device_total_bytes must be > 0, got {device_total_bytes}")
    return min(1.0, max(cap_bytes / device_total_bytes, 1e-6))


def need_bytes(
    *,
    override: int | None,
    measured: int | None,
    estimate: int | MemoryEstimate | None,
) -> Need:
    """The most trusted need available: the operator knows best, then what the process really used."""
    # A zero or negative value can only be a placeholder (nothing runs in no memory), so it is skipped
    # rather than trusted.
    if override is not None and override > 0:
        return Need(override, "override")
    if measured is not None and measured > 0:
        return Need(measured, "measured")
    if isinstance(estimate, MemoryEstimate):
        estimate = estimate.total_bytes
    if estimate is not None and estimate > 0:
        return Need(estimate, "estimate")
    raise ValueError("no memory need: no override, no measurement and no estimate")


def with_grown_context(need: int, counted_context_bytes: int | None, context_bytes: int) -> int:
    """A measured need, for a GPU whose serving context is now `context_bytes`, when the need
    counted `counted_context_bytes` of it (None: not known, the need as it is).

    A real context grows as forward passes load kernels (H100, 2026-11-26: 610 MiB at the load's
    measurement, 748-774 MiB once it had served), so a need measured at the first load falls short
    of the next replica's process by the growth; that replica would size its KV pool below zero.
    Never less than the need: a context measured smaller is an earlier moment, not a shrink."""
    if counted_context_bytes is None:
        return need
    return need + max(0, context_bytes - counted_context_bytes)


def ndif_need(weight_bytes: int) -> Need:
    """Seed 000: model size × 3 covers 'CUDA context, KV cache, etc.'; blind to the KV cache's size."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes must be > 0, got {weight_bytes}")
    return Need(weight_bytes * NDIF_FACTOR, "ndif")


def fraction_for(need: int, gpu_total: int, max_fraction: float) -> float:
    """Fraction of one GPU to reserve: need / total when below max_fraction of it, else the whole GPU (1.0).

    Not clamped to [0.01, 0.99]: that is for the cap handed to torch, which placement computes.
    """
    if gpu_total <= 0:
        raise ValueError(f"gpu_total must be > 0, got {gpu_total}")
    if need < 0:
        raise ValueError(f"need must be >= 0, got {need}")
    return need / gpu_total if need < max_fraction * gpu_total else 1.0


def ndif_fraction(need: int, gpu_total: int) -> float:
    """Seed 000: share a GPU only when the need is under 0.8 of it; otherwise take it whole."""
    return fraction_for(need, gpu_total, NDIF_MAX_FRACTION)


@dataclass(frozen=True)
class NeedInputs:
    """Everything either policy may look at; each takes what it trusts."""

    weight_bytes: int | None = None
    estimate_bytes: int | None = None
    override_bytes: int | None = None
    measured_bytes: int | None = None


@dataclass(frozen=True)
class Policy:
    name: str
    need: Callable[[NeedInputs], Need]
    # Below this fraction of a GPU a replica shares it; at or above, it takes the GPU whole.
    max_fraction: float

    def fraction(self, need: int, gpu_total: int) -> float:
        return fraction_for(need, gpu_total, self.max_fraction)


def _gpuportal_need(inputs: NeedInputs) -> Need:
    return need_bytes(override=inputs.override_bytes, measured=inputs.measured_bytes, estimate=inputs.estimate_bytes)


def _ndif_need(inputs: NeedInputs) -> Need:
    # The seed had no override or measurement; ignoring them keeps the comparison with it honest.
    if inputs.weight_bytes is None:
        raise ValueError("the ndif policy needs the model's weight bytes")
    return ndif_need(inputs.weight_bytes)


POLICIES: Mapping[str, Policy] = {
    # Our need already counts the KV cache and the context, so any need that fits may share a GPU.
    "gpuportal": Policy("gpuportal", _gpuportal_need, max_fraction=1.0),
    "ndif": Policy("ndif", _ndif_need, max_fraction=NDIF_MAX_FRACTION),
}


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown memory policy {name!r} (known: {', '.join(POLICIES)})") from None


def need_for(name: str, inputs: NeedInputs) -> Need:
    return policy(name).need(inputs)
