"""The KV-cache block pool (seed 003): one allocation per wake, handed out in blocks.

K and V of every layer live in two tensors shaped [layers, blocks, block_tokens, kv_heads, head_dim],
allocated once after the weights, inside the replica's cap. A sequence holds a list of block ids
(its block table) and takes one more block each time it crosses a block boundary, so it wastes
less than one block. Blocks are reference-counted so sequences can share a prompt prefix: a block
returns to the free list when its last holder lets go.

The prefix cache (vLLM's automatic prefix caching) is one more holder: a full block whose K/V a
sequence wrote is kept, found again by the digest of every token up to its end (`chain`), and a
later sequence whose prompt begins with the same tokens shares it instead of computing it again.
A kept block no sequence holds is idle: counted apart (`blocks_cached`), as good as free to an
allocation, which takes the least recently used of them back where the free list is short. So the
cache holds only memory no sequence wants, and a full pool serves as many sequences as before.

The number of blocks comes from gpuportal.wire.memory (`pool_blocks_for`), the same arithmetic the
scheduler reserved with, so the pool is exactly what the reservation left after the weights, the
activation budget and the CUDA context.

Thread-safe: the serving thread allocates and frees while the event thread reads statistics.
"""

from __future__ import annotations

import array
import collections
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuportal.wire.memory import DEFAULT_BLOCK_TOKENS, ModelShape

if TYPE_CHECKING:
    import torch


class PoolExhausted(Exception):
    """Not enough free blocks for an all-or-nothing allocation; nothing was allocated."""


def root(adapter: int, scope: bytes = b"") -> bytes:
    """Where a chain of digests starts: a LoRA adapter that projects K and V changes every block's
    K/V, so the same tokens under another adapter (or none, -1) are another chain; and the
    sequences of another scope (another user's, gpuportal.wire.prefix_cache) find none of them."""
    return hashlib.blake2b(b"adapter %d;" % adapter + scope, digest_size=16).digest()


def chain(tokens: Sequence[int], block_tokens: int, start: bytes) -> list[bytes]:
    """The digest of each full block of `tokens`, each of its own tokens and the one before it
    (from `start`): equal digests mean equal tokens from the first on, so equal K/V at equal
    positions. 128 bits of BLAKE2b: a collision, which would serve another prompt's K/V, is out of
    reach, where Python's 64-bit hash of a tuple can be made to collide."""
    digests: list[bytes] = []
    last = start
    for begin in range(0, len(tokens) - block_tokens + 1, block_tokens):
        part = array.array("q", tokens[begin : begin + block_tokens]).tobytes()
        last = hashlib.blake2b(last + part, digest_size=16).digest()
        digests.append(last)
    return digests


@dataclass(frozen=True)
class PoolStats:
    block_tokens: int
    blocks_total: int
    blocks_used: int  # held by sequences (a block several share counted once)
    blocks_peak: int
    allocations: int
    frees: int
    # Kept by the prefix cache and held by no sequence: reusable, and free to any allocation.
    blocks_cached: int = 0
    # Prompt tokens looked up in the prefix cache, and those whose K/V it had (vLLM's
    # prefix_cache_queries and prefix_cache_hits).
    prefix_queried: int = 0
    prefix_hits: int = 0

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used - self.blocks_cached

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
            "blocks_cached": self.blocks_cached,
            "prefix_queried": self.prefix_queried,
            "prefix_hits": self.prefix_hits,
        }


class BlockAccounting:
    """The free list, reference counts, the prefix cache and statistics, without tensors (so they
    are testable alone).

    allocations and frees count blocks leaving and returning to the free list; sharing a block
    (`share`) and dropping a shared reference are neither, because no memory changes hands; nor is
    keeping one (`keep`). A kept block taken back for an allocation is a free, then an allocation.
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
        # The prefix cache: digest -> block, least recently used first; and each kept block's digest.
        self._kept: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._digest_of: dict[int, bytes] = {}
        self._idle = 0  # kept blocks whose only holder is the cache (reference count 1)
        self._peak = 0
        self._allocations = 0
        self._frees = 0
        self._queried = 0
        self._hits = 0

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    @property
    def blocks_cached(self) -> int:
        return self._idle

    @property
    def blocks_available(self) -> int:
        """What an allocation may take: the free blocks and the idle kept ones."""
        return len(self._free) + self._idle

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - len(self._free) - self._idle

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each, or PoolExhausted and nothing taken. Short of free
        blocks, it takes back the least recently used idle kept ones first. O(n)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            if n > len(self._free) + self._idle:
                raise PoolExhausted(
                    f"need {n} KV blocks, {len(self._free)} of {self.blocks_total} free"
                    + (f" and {self._idle} cached" if self._idle else "")
                )
            self._evict(n - len(self._free))
            taken = [self._free.pop() for _ in range(n)]
            for block in taken:
                self._refs[block] = 1
            self._allocations += n
            self._peak = max(self._peak, self.blocks_total - len(self._free) - self._idle)
            return taken

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (a sequence reusing another's prefix)."""
        with self._lock:
            for block in blocks:
                self._check_held(block)
            for block in blocks:
                if block in self._digest_of and self._refs[block] == 1:
                    self._idle -= 1
                self._refs[block] += 1
            self._touch(blocks)
            self._peak = max(self._peak, self.blocks_total - len(self._free) - self._idle)

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
                elif self._refs[block] == 1 and block in self._digest_of:
                    self._idle += 1

    def keep(self, digests: Sequence[bytes], blocks: Sequence[int]) -> None:
        """The prefix cache holds each of `blocks` (full, their K/V written by their holder) under
        its digest (`chain`), the first of them the most recently used. A digest already kept (a
        sequence that computed the same tokens beside another) keeps its first block."""
        with self._lock:
            for block in blocks:
                self._check_held(block)
            fresh = [
                (digest, block)
                for digest, block in zip(digests, blocks, strict=False)
                if digest not in self._kept and block not in self._digest_of
            ]
            for digest, block in fresh:
                self._kept[digest] = block
                self._digest_of[block] = digest
                self._refs[block] += 1  # held by a sequence too: not idle until it lets go
            self._touch([self._kept[d] for d in digests[: len(blocks)] if d in self._kept])

    def cached(self, digests: Sequence[bytes]) -> list[int]:
        """The kept blocks of the longest run of `digests` from the first (none taken: `share` them)."""
        with self._lock:
            found: list[int] = []
            for digest in digests:
                block = self._kept.get(digest)
                if block is None:
                    break
                found.append(block)
            return found

    def looked_up(self, tokens: int, hits: int) -> None:
        """Count a prompt of `tokens` admitted, `hits` of them found in the prefix cache."""
        with self._lock:
            self._queried += tokens
            self._hits += hits

    def available_besides(self, blocks: Sequence[int]) -> int:
        """blocks_available once `blocks` (kept ones about to be shared) are held: those of them
        idle now would no longer be there to take."""
        with self._lock:
            idle = sum(1 for b in blocks if b in self._digest_of and self._refs[b] == 1)
            return len(self._free) + self._idle - idle

    def forget(self) -> None:
        """Empty the prefix cache: its idle blocks are free again, those sequences hold stay theirs."""
        with self._lock:
            for block in self._kept.values():
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free.append(block)
                    self._frees += 1
            self._kept.clear()
            self._digest_of.clear()
            self._idle = 0

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                block_tokens=self.block_tokens,
                blocks_total=self.blocks_total,
                blocks_used=self.blocks_total - len(self._free) - self._idle,
                blocks_peak=self._peak,
                allocations=self._allocations,
                frees=self._frees,
                blocks_cached=self._idle,
                prefix_queried=self._queried,
                prefix_hits=self._hits,
            )

    def _touch(self, blocks: Sequence[int]) -> None:
        """Mark kept `blocks` (a run from a prompt's start) the most recently used, the first last:
        a run's tail goes before its head, which other prompts are likelier to share, and a block
        is never left kept without the blocks before it for long. Under the lock."""
        for block in reversed(blocks):
            digest = self._digest_of.get(block)
            if digest is not None:
                self._kept.move_to_end(digest)

    def _evict(self, n: int) -> None:
        """Take back `n` idle kept blocks to the free list, the least recently used first. Under
        the lock; the caller checked there are that many."""
        if n <= 0:
            return
        gone: list[bytes] = []
        for digest, block in self._kept.items():
            if len(gone) == n:
                break
            if self._refs[block] == 1:
                gone.append(digest)
        for digest in gone:
            block = self._kept.pop(digest)
            del self._digest_of[block]
            self._refs[block] = 0
            self._free.append(block)
            self._frees += 1
        self._idle -= len(gone)

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
        """Drop the tensors (sleep, stop), and the prefix cache with them: the caller empties the
        device cache after."""
        self.forget()
        self.k = None
        self.v = None
