"""The KV-cache block pool (seed 003): one allocation per wake, handed out in blocks.

K and V of every layer live in two tensors shaped [layers, blocks, block_tokens, kv_heads, head_dim],
allocated once after the weights, inside the replica's cap. A sequence holds a list of block ids
(its block table) and takes one more block each time it crosses a block boundary, so it wastes
less than one block. Blocks are reference-counted so sequences can share a prompt prefix: a block
returns to the free list when its last holder lets go.

The number of blocks comes from gpuportal.wire.memory (`pool_blocks_for`), the same arithmetic the
scheduler reserved with, so the pool is exactly what the reservation left after the weights, the
activation budget and the CUDA context.

Thread-safe: the serving thread allocates and frees while the event thread reads statistics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuportal.wire.memory import DEFAULT_BLOCK_TOKENS, ModelShape

if TYPE_CHECKING:
    import torch


class PoolExhausted(Exception):
    """Not enough free blocks for an all-or-nothing allocation; nothing was allocated."""


@dataclass(frozen=True)
class PoolStats:
    block_tokens: int
    blocks_total: int
    blocks_used: int
    blocks_peak: int
    allocations: int
    frees: int

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used

    @property
    def utilisation(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    def as_event(self) -> dict[str, Any]:
        """The `kv` object of the replica's events (the replica's `kv` in docs/api.md)."""
        return {
            "block_tokens": self.block_tokens,
            "blocks_total": self.blocks_total,
            "blocks_used": self.blocks_used,
            "blocks_peak": self.blocks_peak,
            "allocations": self.allocations,
            "frees": self.frees,
            "utilisation": round(self.utilisation, 4),
        }


class BlockAccounting:
    """The free list, reference counts and statistics, without tensors (so they are testable alone).

    allocations and frees count blocks leaving and returning to the free list; sharing a block
    (`share`) and dropping a shared reference are neither, because no memory changes hands.
    """

    def __init__(self, blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.blocks_total = blocks
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        # A stack: the most recently freed block is reused first, while it is still warm in cache.
        self._free: list[int] = list(range(blocks - 1, -1, -1))
        self._refs: list[int] = [0] * blocks
        self._peak = 0
        self._allocations = 0
        self._frees = 0

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each, or PoolExhausted and nothing taken. O(n)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(f"need {n} KV blocks, {len(self._free)} of {self.blocks_total} free")
            taken = [self._free.pop() for _ in range(n)]
            for block in taken:
                self._refs[block] = 1
            self._allocations += n
            self._peak = max(self._peak, self.blocks_total - len(self._free))
            return taken

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (a sequence reusing another's prefix)."""
        with self._lock:
            for block in blocks:
                self._check_held(block)
            for block in blocks:
                self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose last reference goes is free again."""
        with self._lock:
            for block in blocks:
                self._check_held(block)
            for block in blocks:
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free.append(block)
                    self._frees += 1

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                block_tokens=self.block_tokens,
                blocks_total=self.blocks_total,
                blocks_used=self.blocks_total - len(self._free),
                blocks_peak=self._peak,
                allocations=self._allocations,
                frees=self._frees,
            )

    def _check_held(self, block: int) -> None:
        # A double free would put a block on the free list twice and hand it to two sequences.
        if not 0 <= block < self.blocks_total or self._refs[block] == 0:
            raise ValueError(f"KV block {block} is not allocated")


class BlockPool(BlockAccounting):
    """The accounting plus the K and V tensors, on the replica's device and in its dtype."""

    def __init__(
        self,
        blocks: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ):
        import torch

        super().__init__(blocks, block_tokens)
        shape = (num_layers, blocks, block_tokens, num_kv_heads, head_dim)
        # Empty, not zeros: filling the whole pool would cost every wake time proportional to the
        # cap (hundreds of ms on a CPU); each block is zeroed as it is handed out instead (allocate).
        self.k: torch.Tensor | None = torch.empty(shape, dtype=dtype, device=device)
        self.v: torch.Tensor | None = torch.empty(shape, dtype=dtype, device=device)

    def allocate(self, n: int) -> list[int]:
        """As BlockAccounting.allocate, the blocks zeroed: attention reads whole blocks and masks
        the slots past a sequence's end, but a masked weight of 0 times a NaN left in
        uninitialised memory is still NaN."""
        import torch

        taken = super().allocate(n)
        if taken and self.k is not None and self.v is not None:
            index = torch.tensor(taken, device=self.k.device)
            self.k.index_fill_(1, index, 0)
            self.v.index_fill_(1, index, 0)
        return taken

    @classmethod
    def for_shape(
        cls, shape: ModelShape, blocks: int, *, dtype: torch.dtype, device: torch.device | str, block_tokens: int
    ) -> BlockPool:
        return cls(
            blocks,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            device=device,
            block_tokens=block_tokens,
        )

    @property
    def capacity_tokens(self) -> int:
        return self.blocks_total * self.block_tokens

    @property
    def tensor_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def release(self) -> None:
        """Drop the tensors (sleep, stop): the caller empties the device cache after."""
        self.k = None
        self.v = None
