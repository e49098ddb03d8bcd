"""The KV block pool: free list, all-or-nothing allocation, reference counts, true statistics."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from gpuportal.wire.memory import ModelShape, kv_block_bytes
from inference.kvpool import BlockAccounting, BlockPool, PoolExhausted

SHAPE = ModelShape(weight_bytes=0, num_layers=3, num_kv_heads=2, head_dim=8, dtype_bytes=4, hidden_size=32)


def test_allocation_is_all_or_nothing_and_freeing_returns_blocks():
    pool = BlockAccounting(4, block_tokens=16)
    first = pool.allocate(3)
    assert len(set(first)) == 3 and pool.blocks_used == 3

    with pytest.raises(PoolExhausted, match="need 2 KV blocks, 1 of 4 free"):
        pool.allocate(2)
    assert pool.blocks_free == 1, "a failed allocation takes nothing"

    pool.free(first)
    stats = pool.stats()
    assert (stats.blocks_used, stats.blocks_peak, stats.allocations, stats.frees) == (0, 3, 3, 3)
    assert pool.allocate(0) == []


def test_shared_blocks_return_to_the_free_list_with_their_last_holder():
    pool = BlockAccounting(2)
    prefix = pool.allocate(1)
    pool.share(prefix)
    assert pool.refcount(prefix[0]) == 2

    pool.free(prefix)
    assert pool.blocks_used == 1 and pool.stats().frees == 0
    pool.free(prefix)
    assert pool.blocks_used == 0 and pool.stats().frees == 1


def test_double_free_and_sharing_a_free_block_are_refused():
    pool = BlockAccounting(2)
    block = pool.allocate(1)
    pool.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([7])
    assert pool.blocks_used == 0


def test_stats_for_events():
    pool = BlockAccounting(8, block_tokens=16)
    pool.allocate(2)
    assert pool.stats().as_event() == {
        "block_tokens": 16,
        "blocks_total": 8,
        "blocks_used": 2,
        "blocks_peak": 2,
        "allocations": 2,
        "frees": 0,
        "utilisation": 0.25,
        "blocks_cached": 0,
        "prefix_queried": 0,
        "prefix_hits": 0,
    }
    assert BlockAccounting(0).stats().utilisation == 0.0


def test_tensors_hold_exactly_the_formulas_bytes_and_release_drops_them():
    pool = BlockPool.for_shape(SHAPE, 5, dtype=torch.float32, device="cpu", block_tokens=16)
    assert pool.k is not None and pool.k.shape == (3, 5, 16, 2, 8)
    assert pool.tensor_bytes == 5 * kv_block_bytes(SHAPE, 16)
    assert pool.capacity_tokens == 80
    pool.release()
    assert pool.k is None and pool.v is None and pool.tensor_bytes == 0


def test_concurrent_allocations_never_hand_out_a_block_twice():
    pool = BlockAccounting(400)
    start = threading.Barrier(4)
    taken: list[list[int]] = [[] for _ in range(4)]

    def worker(index: int) -> None:
        start.wait()
        for _ in range(100):
            taken[index].extend(pool.allocate(1))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [b for blocks in taken for b in blocks]
    assert sorted(everything) == list(range(400)) and pool.blocks_free == 0


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free / exhaust sequences against a model of the pool."""

    TOTAL = 12
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockAccounting(self.TOTAL)
        self.refs: dict[int, int] = {}
        self.peak = 0
        self.allocations = 0
        self.frees = 0

    @rule(target=held, n=st.integers(min_value=1, max_value=5))
    def allocate(self, n: int):
        free = self.TOTAL - len(self.refs)
        if n > free:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
            return []  # an empty holding: nothing was taken
        blocks = self.pool.allocate(n)
        assert not set(blocks) & set(self.refs), "a held block handed out again"
        for b in blocks:
            self.refs[b] = 1
        self.allocations += n
        self.peak = max(self.peak, len(self.refs))
        return blocks

    @rule(target=held, blocks=held)
    def share(self, blocks: list[int]):
        live = [b for b in blocks if self.refs.get(b, 0) > 0]
        if len(live) != len(blocks):
            return []  # some were freed meanwhile: sharing them would be refused
        self.pool.share(blocks)
        for b in blocks:
            self.refs[b] += 1
        return list(blocks)

    @rule(blocks=consumes(held))
    def free(self, blocks: list[int]):
        if not all(self.refs.get(b, 0) > 0 for b in blocks):
            return
        self.pool.free(blocks)
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.frees += 1

    @precondition(lambda self: len(self.refs) < self.TOTAL)
    @rule()
    def exhaust(self):
        free = self.TOTAL - len(self.refs)
        with pytest.raises(PoolExhausted):
            self.pool.allocate(free + 1)

    @invariant()
    def counts_are_true(self):
        stats = self.pool.stats()
        assert stats.blocks_used + stats.blocks_free == stats.blocks_total == self.TOTAL
        assert stats.blocks_used == len(self.refs)
        assert stats.blocks_peak == self.peak, "peak is the true maximum of blocks in use"
        assert (stats.allocations, stats.frees) == (self.allocations, self.frees)
        for block, count in self.refs.items():
            assert self.pool.refcount(block) == count


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
