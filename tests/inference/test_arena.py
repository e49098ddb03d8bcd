"""A sleeping replica's weights in one host allocation (inference.arena).

On the CPU the arena runs the code a GPU's sleep and wake run, with plain host copies; these tests
check what must hold everywhere: bit-exact round trips, tied weights kept tied, one allocation,
freed on wake (or kept for the next sleep where the replica may keep it), generation unchanged.
The `gpu` tests at the end check pinning and device placement on a real GPU; no test times
anything (bench/wake.py measures the bandwidth).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from inference import arena as arenas
from inference.arena import (
    ALIGNMENT,
    Arena,
    PendingCopies,
    fill,
    host_bytes,
    pack,
    settle_releases,
    spare,
    unpack,
    unpack_async,
)
from inference.backends import Placement, VirtualBackend
from tests.support import cuda
from tests.support.cuda import is_page_locked

GiB = 1024**3
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class OddSizes(nn.Module):
    """Tensors whose sizes are no multiple of the alignment, of every kind a model holds."""

    def __init__(self, dtype: torch.dtype, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(31, 7, dtype=dtype)
        self.proj = nn.Linear(7, 13, dtype=dtype)
        self.norm = nn.LayerNorm(13, dtype=dtype)
        self.head = nn.Linear(7, 31, bias=False, dtype=dtype)
        if tied:
            self.head.weight = self.embed.weight  # as embed_tokens / lm_head in a tied LM
        self.register_buffer("positions", torch.arange(5))  # an integer buffer keeps its dtype
        self.register_buffer("scale", torch.tensor(0.125, dtype=dtype))  # a 0-d tensor
        self.register_buffer("table", torch.randn(3, 3, dtype=dtype), persistent=False)
        self.register_buffer("nothing", torch.empty(0, dtype=dtype))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, persistent or not, copied."""
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {name: tensor.detach().clone() for name, tensor in named.items()}


def assert_same(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name


def storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_and_buffers_round_trip_bit_exactly(dtype):
    torch.manual_seed(0)
    model = OddSizes(dtype)
    before = snapshot(model)

    arena = pack(model)
    assert_same(model, before)  # asleep: the same values, read from the arena
    unpack(model, arena)
    assert_same(model, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeated_sleeps_and_wakes_change_nothing(dtype):
    torch.manual_seed(1)
    model = OddSizes(dtype, tied=True)
    before = snapshot(model)
    for _ in range(3):  # after the first wake the weights lie in one block: the copy path differs
        unpack(model, pack(model), {"": "cpu"})
    assert_same(model, before)


def test_every_tensor_starts_at_an_aligned_offset_and_the_padding_is_counted():
    model = OddSizes(torch.float16)
    arena = pack(model)
    assert arena.slots and all(slot.offset % ALIGNMENT == 0 for slot in arena.slots)
    assert (
        arena.nbytes
        >= arena.tensor_bytes
        == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    )
    assert arena.nbytes == host_bytes(model)  # what a budget can ask before packing
    unpack(model, arena)


def test_tied_weights_stay_tied_through_sleep_and_wake():
    model = OddSizes(torch.bfloat16, tied=True)
    arena = pack(model)
    assert len(arena.slots) == len(list(model.parameters())) + len(list(model.buffers()))  # stored once
    assert model.head.weight is model.embed.weight
    unpack(model, arena)
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        model.embed.weight[0, 0] = 42.0
    assert model.head.weight[0, 0].item() == 42.0


def test_tensors_sharing_memory_under_two_names_stay_shared():
    # Two Parameter objects over the same bytes (a tie made by hand, not by assignment).
    model = OddSizes(torch.float32)
    model.head.weight = nn.Parameter(model.embed.weight.data)
    assert model.head.weight is not model.embed.weight
    arena = pack(model)
    unpack(model, arena)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_while_asleep_every_tensor_lives_in_the_one_arena_allocation():
    model = OddSizes(torch.float32, tied=True)
    arena = pack(model)
    assert arena.host is not None and arena.host.dim() == 1 and arena.host.dtype == torch.uint8
    assert storages(model) == {arena.host.untyped_storage().data_ptr()}
    assert not arena.pinned  # the CPU has nothing to pin for
    unpack(model, arena)


def test_a_wake_frees_the_arena():
    model = OddSizes(torch.float32)
    arena = pack(model)
    assert arena.host is not None
    host = weakref.ref(arena.host)
    arena_storage = arena.host.untyped_storage().data_ptr()

    unpack(model, arena)
    gc.collect()
    assert arena.released and arena.nbytes == 0
    assert host() is None  # no view of it is left anywhere
    assert arena_storage not in storages(model)
    with pytest.raises(ValueError, match="already unpacked"):
        unpack(model, arena)


def test_a_wake_lands_the_weights_in_one_allocation_per_device():
    model = OddSizes(torch.float32, tied=True)
    unpack(model, pack(model), {"": "cpu"})
    assert len(storages(model)) == 1


def test_a_device_map_is_read_by_module_prefix_and_by_tensor_name():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    before = snapshot(model)
    unpack(model, pack(model), {"0": "cpu", "1.weight": "cpu", "1": "cpu"})
    assert_same(model, before)

    arena = pack(model)
    with pytest.raises(ValueError, match=r"names no device for '1\.bias'"):
        unpack(model, arena, {"0": "cpu", "1.weight": "cpu"})
    arena.release()


def test_a_module_without_parameters_packs_to_an_empty_arena():
    model = nn.Sequential(nn.ReLU(), nn.Dropout()).eval()
    arena = pack(model)
    assert arena.slots == [] and arena.nbytes == 0
    unpack(model, arena)
    assert arena.released
    assert model(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_module_on_the_meta_device_cannot_be_packed():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        pack(model)


# -- the wake's pending copies (PendingCopies) ------------------------------------------------------


class Stream:
    """Stands in for a CUDA copy stream: says when it was synchronised and what the arena was then."""

    def __init__(self, arena: Arena, fails: bool = False):
        self.arena = arena
        self.fails = fails
        self.released_when_synchronised: list[bool] = []

    def synchronize(self) -> None:
        self.released_when_synchronised.append(self.arena.released)
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_pages_a_pinned_arena_registers_are_huge_page_aligned_zeroed_and_live_while_viewed():
    from inference.arena import _HUGE_PAGE, _populated_pages

    host = _populated_pages(3 * _HUGE_PAGE + 123)
    assert host.numel() == 3 * _HUGE_PAGE + 123 and host.dtype == torch.uint8
    assert host.data_ptr() % _HUGE_PAGE == 0  # huge pages can back it from its first byte
    assert int(host.count_nonzero()) == 0  # every page faulted in before the registration
    view = host[-10:]
    view.fill_(7)
    del host
    gc.collect()
    assert view.tolist() == [7] * 10, "the mapping lives as long as a view of it"


def test_it_holds_the_arenas_host_buffer_until_the_wait_and_releases_it_then():
    model = OddSizes(torch.float32, tied=True)
    before = snapshot(model)
    arena = pack(model)
    host = weakref.ref(arena.host)

    copies = unpack_async(model, arena)
    del arena  # the caller's reference gone: the handle is the last holder of the host buffer
    gc.collect()
    assert host() is not None and not copies.done
    assert_same(model, before)  # on the CPU the copies were done when they were issued

    copies.wait()
    gc.collect()
    assert copies.done and host() is None
    assert_same(model, before)


def test_it_ignores_a_second_wait():
    model = OddSizes(torch.bfloat16)
    arena = pack(model)
    copies = unpack_async(model, arena)
    copies.wait()
    copies.wait()
    assert copies.done and arena.released
    assert PendingCopies.complete().done  # a wake with nothing parked


def test_it_synchronises_the_copy_streams_before_it_releases_the_arena_and_only_once():
    arena = pack(OddSizes(torch.float32))
    streams = [Stream(arena), Stream(arena)]
    copies = PendingCopies(arena, streams)
    assert not arena.released and all(s.released_when_synchronised == [] for s in streams)
    copies.wait()
    copies.wait()
    assert [s.released_when_synchronised for s in streams] == [[False], [False]]
    assert arena.released


def test_it_synchronises_before_releasing_when_the_handle_is_dropped_unwaited():
    arena = pack(OddSizes(torch.float32))
    stream = Stream(arena)
    copies = PendingCopies(arena, [stream])
    del copies
    gc.collect()
    assert stream.released_when_synchronised == [False] and arena.released


def test_it_never_frees_an_arena_whose_copies_could_not_be_confirmed_finished():
    from inference import arena as arenas

    arena = pack(OddSizes(torch.float32))
    copies = PendingCopies(arena, [Stream(arena, fails=True)])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copies.wait()
    assert not arena.released and arena in arenas._UNCONFIRMED
    copies.wait()  # nothing left to do: the failure was the answer
    arenas._UNCONFIRMED.remove(arena)
    arena.release()


def test_it_leaves_the_arena_intact_when_the_wake_fails_before_anything_is_queued():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    before = snapshot(model)
    arena = pack(model)
    with pytest.raises(ValueError, match="names no device"):
        unpack_async(model, arena, {"0": "cpu"})
    assert not arena.released
    assert storages(model) == {arena.host.untyped_storage().data_ptr()}  # still asleep in it
    unpack(model, arena)
    assert_same(model, before)


class PinnedStandIn:
    """Stands in for a pinned arena (the CPU pins nothing): its release blocks until `let_go` is
    set, as unpinning and freeing gigabytes does on a GPU, and says which thread ran it."""

    pinned = True

    def __init__(self) -> None:
        self.releasing = threading.Event()
        self.let_go = threading.Event()
        self.released = False
        self.released_on: threading.Thread | None = None

    def release(self) -> None:
        self.releasing.set()
        assert self.let_go.wait(timeout=60), "the test never let the release finish"
        self.released_on = threading.current_thread()
        self.released = True


def test_a_wake_returns_before_its_pinned_arena_is_released_and_settling_waits_for_it():
    arena = PinnedStandIn()
    stream = Stream(arena)
    copies = PendingCopies(arena, [stream])

    try:
        copies.wait()  # returns although the release cannot finish until let_go is set
        assert copies.done and stream.released_when_synchronised == [False]  # synchronised first
        assert arena.releasing.wait(timeout=60)  # handed to the releaser, which is now inside release()
        assert not arena.released
        assert not settle_releases(timeout=0)  # still pending: settling says so instead of lying
    finally:
        arena.let_go.set()  # never leave the releaser blocked for the tests after this one
    assert settle_releases(timeout=60)
    assert arena.released and arena.released_on is not threading.current_thread()


def test_settling_waits_for_every_arena_handed_over_in_order():
    arenas = [PinnedStandIn() for _ in range(3)]
    for arena in arenas:
        PendingCopies(arena, []).wait()
    assert arenas[0].releasing.wait(timeout=60)
    for arena in arenas:
        arena.let_go.set()
    assert settle_releases(timeout=60)
    assert all(arena.released for arena in arenas)
    assert settle_releases(timeout=0)  # nothing pending: at once


def test_a_pinned_arena_whose_copies_could_not_be_confirmed_is_never_handed_to_the_releaser():
    from inference import arena as arenas

    arena = PinnedStandIn()
    arena.let_go.set()  # were it released, it would be at once
    copies = PendingCopies(arena, [Stream(arena, fails=True)])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copies.wait()
    assert settle_releases(timeout=60)
    assert not arena.releasing.is_set() and arena in arenas._UNCONFIRMED
    arenas._UNCONFIRMED.remove(arena)


def test_a_pageable_arena_is_released_by_the_wait_itself():
    arena = pack(OddSizes(torch.float32))
    assert not arena.pinned
    PendingCopies(arena, [Stream(arena)]).wait()
    assert arena.released  # no settling needed: released inline, on this thread


def test_on_the_cpu_nothing_is_reported_page_locked():
    # No CUDA runtime loaded (None), or one that does not know this memory (False).
    assert is_page_locked(torch.empty(4096, dtype=torch.uint8)) is not True


class Driver:
    """Stands in for libcuda: answers cuPointerGetAttribute with a memory type or an error."""

    def __init__(self, memory_type: int, error: int = 0):
        self.memory_type, self.error = memory_type, error
        self.asked: list[int] = []

    def cuPointerGetAttribute(self, value, attribute, pointer) -> int:
        self.asked.append(attribute)
        value._obj.value = self.memory_type
        return self.error


@pytest.mark.parametrize(
    ("memory_type", "locked"), [(1, True), (2, False), (3, False)], ids=["host", "device", "array"]
)
def test_page_locking_is_the_drivers_memory_type(monkeypatch, memory_type, locked):
    driver = Driver(memory_type)
    monkeypatch.setattr(cuda, "_cuda_driver", lambda: driver)
    assert is_page_locked(torch.empty(8)) is locked
    assert driver.asked == [2]  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE: one unsigned int, no struct to outgrow


def test_memory_the_driver_never_registered_is_not_page_locked_and_other_errors_are_unknown(monkeypatch):
    monkeypatch.setattr(cuda, "_cuda_driver", lambda: Driver(0, error=1))  # CUDA_ERROR_INVALID_VALUE
    assert is_page_locked(torch.empty(8)) is False
    monkeypatch.setattr(cuda, "_cuda_driver", lambda: Driver(1, error=201))  # CUDA_ERROR_INVALID_CONTEXT
    assert is_page_locked(torch.empty(8)) is None
    monkeypatch.setattr(cuda, "_cuda_driver", lambda: None)
    assert is_page_locked(torch.empty(8)) is None


def _greedy(model: nn.Module, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def test_generation_is_unchanged_token_for_token_after_sleep_and_wake(tiny_model_dir):
    from inference.loaders import load_model

    model = load_model(str(tiny_model_dir), "transformers", "float32", device="cpu")
    prompt = torch.tensor([[3, 17, 42, 7, 99]])
    before = _greedy(model, prompt)
    weights = snapshot(model)

    backend = VirtualBackend()
    placement = Placement.parse([0], {"0": GiB}, None)
    backend.to_cache(model, placement)
    assert isinstance(backend.arena, Arena)
    assert storages(model) == {backend.arena.host.untyped_storage().data_ptr()}  # asleep: in the arena
    arena = backend.arena
    woken, copies = backend.from_cache(model, placement)
    assert backend.arena is None and not arena.released  # the handle holds it until the copies land
    copies.wait()
    assert arena.released  # an awake replica holds no host copy

    assert_same(woken, weights)
    assert _greedy(woken, prompt) == before


def test_a_standby_holds_its_arena_until_it_takes_over(tiny_model_dir):
    backend = VirtualBackend()
    placement = Placement.parse([0], {"0": GiB}, None)
    model, _ = backend.load_to_cache(str(tiny_model_dir), "transformers", "bfloat16", placement)
    assert backend.arena is not None and backend.arena.tensor_bytes > 0
    weights = snapshot(model)
    _, copies = backend.from_cache(model, placement)
    copies.wait()
    assert backend.arena is None
    assert_same(model, weights)


def test_stopping_a_sleeping_replica_frees_its_arena():
    backend = VirtualBackend()
    model = OddSizes(torch.float32)
    backend.to_cache(model, Placement.parse([0], {"0": GiB}, None))
    arena = backend.arena
    assert arena is not None
    backend.release()
    assert backend.arena is None and arena.released


# -- a kept arena: a spare prepared in advance, the arena a wake read kept for the next sleep -------


def test_a_spare_has_the_layout_pack_gives_the_module_and_leaves_the_module_untouched():
    model = OddSizes(torch.float32, tied=True)
    before, held = snapshot(model), storages(model)

    kept = spare(model)

    assert kept.nbytes == host_bytes(model) and kept.tensors == [] and not kept.released
    assert storages(model) == held  # nothing moved, nothing copied
    assert_same(model, before)
    assert kept.slots == pack(model).slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sleep_into_a_spare_reuses_its_memory_and_round_trips_bit_exactly(dtype):
    torch.manual_seed(0)
    model = OddSizes(dtype, tied=True)
    before = snapshot(model)
    kept = spare(model)
    buffer = kept.host.data_ptr()

    arena = pack(model, into=kept)

    assert arena.host.data_ptr() == buffer  # no allocation: the spare's memory, now the arena's
    assert kept.released and kept.nbytes == 0  # it owns nothing any more...
    kept.release()  # ...so releasing it again frees nothing of the arena's
    assert storages(model) == {arena.host.untyped_storage().data_ptr()}
    assert_same(model, before)
    assert model.head.weight is model.embed.weight
    unpack(model, arena)
    assert_same(model, before)


def test_a_spare_of_another_layout_is_released_and_a_fresh_arena_allocated():
    other = spare(OddSizes(torch.float32))
    old_memory = other.host  # held here so the fresh arena cannot land at the same address
    model = OddSizes(torch.bfloat16)
    before = snapshot(model)

    arena = pack(model, into=other)

    assert other.released
    assert arena.host.data_ptr() != old_memory.data_ptr() and arena.nbytes == host_bytes(model)
    assert_same(model, before)


def test_a_wake_that_keeps_its_arena_hands_the_same_buffer_to_the_next_sleep():
    model = OddSizes(torch.float32, tied=True)
    before = snapshot(model)
    arena = pack(model)
    buffer = arena.host.data_ptr()

    copies = unpack_async(model, arena, {"": "cpu"}, keep=True)
    assert copies.kept is None  # nothing handed back before the copies are confirmed
    copies.wait()

    kept = copies.kept
    assert kept is arena and not kept.released and kept.host.data_ptr() == buffer
    assert kept.tensors == []  # the module points at its own allocation now, not into it
    assert kept.host.untyped_storage().data_ptr() not in storages(model)
    assert_same(model, before)
    with pytest.raises(ValueError, match="holds no module's weights"):
        unpack_async(model, kept)

    again = pack(model, into=kept)
    assert again.host.data_ptr() == buffer
    unpack(model, again)
    assert again.released  # a wake without keep frees it, as always
    assert_same(model, before)


def kept_after_a_wake(model: nn.Module) -> Arena:
    copies = unpack_async(model, pack(model), {"": "cpu"}, keep=True)
    copies.wait()
    assert copies.kept is not None
    return copies.kept


def test_a_sleep_after_a_kept_wake_copies_nothing_the_wake_left_untouched():
    model = OddSizes(torch.float32, tied=True)
    before = snapshot(model)
    kept = kept_after_a_wake(model)
    # The kept bytes of one weight overwritten behind the module's back: were the sleep to copy
    # it, the arena would hold the module's value again; it does not, so nothing was copied.
    planted = torch.full_like(model.proj.weight, 7.0)
    kept.view(next(i for i, s in enumerate(kept.slots) if s.name == "proj.weight")).copy_(planted)

    again = pack(model, into=kept)

    assert torch.equal(model.proj.weight, planted), "the arena's bytes, not copied over"
    model.proj.weight.data.copy_(before["proj.weight"])
    assert_same(model, before)
    unpack(model, again)


def filled_spare(model: nn.Module) -> Arena:
    kept = spare(model)
    fill(model, kept)
    return kept


@pytest.mark.parametrize("keep", [kept_after_a_wake, filled_spare], ids=["kept by a wake", "a filled spare"])
def test_a_sleep_into_a_kept_copy_copies_what_was_written_or_replaced_since(keep):
    model = OddSizes(torch.float32, tied=True)
    kept = keep(model)
    with torch.no_grad():
        model.norm.weight.mul_(3.0)  # written in place: its version counter moves
    model.table = torch.randn(3, 3)  # a buffer replaced by another tensor
    after = snapshot(model)

    again = pack(model, into=kept)

    assert_same(model, after)
    unpack(model, again)
    assert_same(model, after)


def test_a_sleep_into_a_spare_or_a_fresh_arena_copies_everything():
    model = OddSizes(torch.float32)
    before = snapshot(model)
    held = spare(model)  # allocated ahead, holding nothing yet
    assert held.intact == []
    arena = pack(model, into=held)
    assert arena.intact == [], "an arena filled by a sleep records nothing: only a kept wake does"
    unpack(model, arena)
    assert_same(model, before)


def test_a_filled_spare_holds_the_weights_and_the_sleep_into_it_copies_nothing_left_unwritten():
    model = OddSizes(torch.float32, tied=True)
    before, held = snapshot(model), storages(model)
    kept = spare(model)

    fill(model, kept)

    assert storages(model) == held, "the module still serves from where it was"
    assert all(torch.equal(kept.view(i), before[slot.name]) for i, slot in enumerate(kept.slots))
    # Bytes planted in the filled copy of one weight survive the sleep: it copied nothing there.
    planted = torch.full_like(model.proj.weight, 7.0)
    kept.view(next(i for i, s in enumerate(kept.slots) if s.name == "proj.weight")).copy_(planted)
    arena = pack(model, into=kept)
    assert torch.equal(model.proj.weight, planted)
    model.proj.weight.data.copy_(before["proj.weight"])
    assert_same(model, before)
    unpack(model, arena)
    assert_same(model, before)


def test_a_spare_of_another_layout_or_released_is_not_filled():
    model = OddSizes(torch.float32)
    other = spare(OddSizes(torch.bfloat16))
    with pytest.raises(ValueError, match="cannot fill the arena: its layout"):
        fill(model, other)
    assert other.intact == [] and not other.released
    other.release()
    with pytest.raises(ValueError, match="released"):
        fill(model, other)


def test_a_wake_without_keep_hands_nothing_back():
    model = OddSizes(torch.float32)
    arena = pack(model)
    copies = unpack_async(model, arena)
    copies.wait()
    assert copies.kept is None and arena.released


def test_a_kept_arena_is_released_when_its_handle_is_dropped_unwaited():
    model = OddSizes(torch.float32)
    arena = pack(model)
    copies = unpack_async(model, arena, keep=True)
    del copies  # nobody is left to take it: it goes, as an arena without keep would
    gc.collect()
    assert arena.released


def test_an_arena_whose_copies_could_not_be_confirmed_is_never_handed_back_to_keep():
    from inference import arena as arenas

    arena = pack(OddSizes(torch.float32))
    copies = PendingCopies(arena, [Stream(arena, fails=True)], keep=True)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copies.wait()
    assert copies.kept is None and not arena.released and arena in arenas._UNCONFIRMED
    arenas._UNCONFIRMED.remove(arena)
    arena.release()


def test_a_backend_keeping_its_arena_sleeps_into_the_same_memory_each_time_and_generates_unchanged(
    tiny_model_dir,
):
    from inference.loaders import load_model

    model = load_model(str(tiny_model_dir), "transformers", "float32", device="cpu")
    prompt = torch.tensor([[3, 17, 42, 7, 99]])
    before, weights = _greedy(model, prompt), snapshot(model)
    backend = VirtualBackend()
    placement = Placement.parse([0], {"0": GiB}, None)
    backend.keep_arena = True
    buffer = backend.prepare_spare(model).host.data_ptr()
    assert not backend.spare.pinned  # plain host memory on the CPU
    assert len(backend.spare.intact) == len(backend.spare.slots), "filled: a copy of every weight"

    for _ in range(2):
        backend.to_cache(model, placement)
        assert backend.spare is None and backend.arena.host.data_ptr() == buffer  # packed into it
        model, copies = backend.from_cache(model, placement)
        copies.wait()
        backend.collect_kept(copies)
        assert backend.spare is not None and backend.spare.host.data_ptr() == buffer  # kept by the wake
        assert_same(model, weights)
        assert _greedy(model, prompt) == before

    kept = backend.spare
    held = kept.nbytes
    assert backend.drop_spare() == held and kept.released and backend.spare is None
    backend.keep_arena = False
    backend.to_cache(model, placement)
    model, copies = backend.from_cache(model, placement)
    copies.wait()
    backend.collect_kept(copies)
    assert backend.spare is None  # not allowed to keep one: the wake freed it


def test_releasing_a_backend_frees_its_spare():
    backend = VirtualBackend()
    kept = backend.prepare_spare(OddSizes(torch.float32))
    backend.release()
    assert kept.released and backend.spare is None


# -- on a real GPU (unverified where none was lent) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_a_gpu_sleep_pins_one_arena_and_frees_the_gpu_memory(dtype):
    torch.manual_seed(2)
    model = OddSizes(dtype, tied=True).to("cuda:0")
    before = {name: t.cpu() for name, t in snapshot(model).items()}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(0)

    arena = pack(model)
    # Asked of the CUDA runtime, not Tensor.is_pinned(): torch only recognises its own caching host
    # allocator's blocks there, and says False for the pages the arena registered itself.
    assert arena.pinned and arena.host is not None and is_page_locked(arena.host) is True
    assert {str(t.device) for t in (*model.parameters(), *model.buffers())} == {"cpu"}
    assert storages(model) == {arena.host.untyped_storage().data_ptr()}
    assert torch.cuda.memory_allocated(0) <= held - arena.tensor_bytes
    assert_same(model, before)

    probe = arena.host[:1]  # a view: keeps the pages allocated, not registered
    unpack(model, arena, {"": 0})
    assert settle_releases(timeout=60)  # a pinned arena is released in the background
    assert arena.released and is_page_locked(probe) is False  # unregistered
    assert {str(t.device) for t in (*model.parameters(), *model.buffers())} == {"cuda:0"}
    assert len(storages(model)) == 1  # one device allocation
    assert model.head.weight is model.embed.weight
    assert_same(model.cpu(), before)


@pytest.mark.gpu
def test_on_a_gpu_the_backend_sleeps_and_wakes_without_changing_generation(tiny_model_dir):
    from inference.backends import CudaBackend
    from inference.loaders import load_model

    placement = Placement.parse([0], {"0": 2 * GiB}, None)
    backend = CudaBackend()
    backend.attach(placement)
    model = load_model(str(tiny_model_dir), "transformers", "float32", device="cuda:0")
    prompt = torch.tensor([[3, 17, 42, 7, 99]])  # moved to the GPU per call: asleep, nothing of ours is there
    before = _greedy(model, prompt.to("cuda:0"))

    backend.to_cache(model, placement)
    assert backend.arena is not None and backend.arena.pinned
    # The generation made cuBLAS a workspace (32 MiB on a Hopper GPU), which empty_cache alone keeps.
    assert torch.cuda.memory_reserved(0) == 0
    arena = backend.arena
    woken, copies = backend.from_cache(model, placement)
    assert backend.arena is None
    copies.wait()
    assert settle_releases(timeout=60) and arena.released
    assert {str(p.device) for p in woken.parameters()} == {"cuda:0"}
    assert _greedy(woken, prompt.to("cuda:0")) == before


@pytest.mark.gpu
def test_on_a_gpu_it_returns_with_the_copies_queued_and_releases_the_pinned_arena_only_after_the_wait():
    torch.manual_seed(3)
    model = OddSizes(torch.float32, tied=True).to("cuda:0")
    before = {name: t.cpu() for name, t in snapshot(model).items()}
    arena = pack(model)
    assert arena.pinned

    copies = unpack_async(model, arena, {"": 0})
    # Allocated while the copies may run, as a wake allocates its KV pool: no weight is read.
    pool = torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda:0")
    assert not arena.released and {str(t.device) for t in model.parameters()} == {"cuda:0"}
    copies.wait()
    assert copies.done
    assert settle_releases(timeout=60) and arena.released
    copies.wait()
    assert_same(model.cpu(), before)
    del pool


@pytest.mark.gpu
def test_on_a_gpu_the_backend_keeps_a_pinned_arena_and_sleeps_into_it_without_changing_generation(tiny_model_dir):
    from inference.backends import CudaBackend
    from inference.loaders import load_model

    placement = Placement.parse([0], {"0": 2 * GiB}, None)
    backend = CudaBackend()
    backend.attach(placement)
    backend.keep_arena = True
    model = load_model(str(tiny_model_dir), "transformers", "float32", device="cuda:0")
    prompt = torch.tensor([[3, 17, 42, 7, 99]], device="cuda:0")
    before = _greedy(model, prompt)
    kept = backend.prepare_spare(model)
    assert kept.pinned and is_page_locked(kept.host) is True  # pinned in advance, not by the sleep
    assert len(kept.intact) == len(kept.slots), "filled from the GPU: the first sleep copies nothing"
    buffer = kept.host.data_ptr()

    for _ in range(2):
        backend.to_cache(model, placement)
        assert backend.arena.pinned and backend.arena.host.data_ptr() == buffer
        assert {str(t.device) for t in model.parameters()} == {"cpu"}
        model, copies = backend.from_cache(model, placement)
        copies.wait()
        backend.collect_kept(copies)
        assert backend.spare.host.data_ptr() == buffer and is_page_locked(backend.spare.host) is True
        assert _greedy(model, prompt) == before

    probe = backend.spare.host[:1]
    backend.drop_spare()
    assert settle_releases(timeout=60) and is_page_locked(probe) is False  # unregistered in the background


class RecordingCuda:
    """Stands in for torch.cuda where a test has no GPU: a current device per thread (0 in a new
    thread, as CUDA's), and the device current at each page-locking call."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.calls: list[tuple[str, int]] = []

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    @contextlib.contextmanager
    def device(self, index: int):
        before = self.current_device()
        self.local.device = index
        try:
            yield
        finally:
            self.local.device = before

    def cudart(self):
        cuda = self

        class Runtime:
            def cudaHostRegister(self, pointer, nbytes, flags):
                cuda.calls.append(("register", cuda.current_device()))
                return 0

            def cudaHostUnregister(self, pointer):
                cuda.calls.append(("unregister", cuda.current_device()))
                return 0

        return Runtime()


def test_a_pinned_arena_is_registered_and_unregistered_on_its_gpu_whichever_thread_does_it(monkeypatch):
    # A thread starts on device 0, where a page-locking call would create a CUDA context (hundreds
    # of MiB outside every book) in a replica of another GPU: a spare prepared in the background
    # and the releaser's unpinning must run on the arena's GPU.
    fake = RecordingCuda()
    for name in ("current_device", "device", "cudart"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu_3 = [arenas.Slot(0, 4096, (1024,), torch.float32, torch.device("cuda", 3), "w")]
    made: list = []

    prepare = threading.Thread(target=lambda: made.append(arenas._host_buffer(4096, pin=True, slots=on_gpu_3)))
    prepare.start()
    prepare.join()
    host, unpin = made.pop()
    release = threading.Thread(target=unpin)
    release.start()
    release.join()

    assert fake.calls == [("register", 3), ("unregister", 3)]
    assert fake.current_device() == 0  # and the caller's device is left as it was
    assert host.numel() == 4096  # held until here: its unpinning ran on the thread above, not at collection
