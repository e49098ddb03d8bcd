"""A sleeping replica's weights in one host allocation: the arena.

`pack(model)` copies every parameter and buffer of a module into ONE host buffer, each tensor a
view into it at an aligned offset, and points the module's tensors at those views, so what they
held on the GPU is freed. `unpack(model, arena, device_map)` copies the arena back into one
allocation per target device and points the tensors there.

Why one allocation: the H100 findings (../shared/gpu-2026-11-24/FINDINGS.md) measured a wake with
synchronous per-tensor copies at 65-84 % of a pinned host-to-device copy, and a first sleep that
pinned tensor by tensor at 1.4 GB/s. Here the host side is allocated and page-locked once, the
device-to-host copies are queued on a stream of their own with one synchronisation at the end,
and a wake copies each run of tensors bound for one device as ONE block (the arena's layout is
kept on the device), so a single-GPU wake is one host-to-device copy of the whole arena.

A wake overlaps its copies with the rest of the wake: `unpack_async` queues the host-to-device
copies and returns a `PendingCopies` at once, so the replica checks its cap and allocates its KV
pool (sizes only, no weight is read) while the bytes cross the bus, then calls `wait()`: ONE
synchronisation per device, after which the arena is released. `unpack` is the two together.

Policy: the arena is freed by the wake, once its `wait()` has confirmed the copies landed, unless
the replica was allowed to keep it (below): an awake replica holds no host copy of its weights that
nobody accounts for. The control plane counts host memory for sleeping, draining and standby
replicas, and for the arenas it let awake replicas keep (scheduling.services.host_cache). A pinned
arena is freed off the wake's critical path: unpinning and freeing gigabytes of pages took longer
than the copy itself on an H100 (a 4 GiB wake at 0.41 s against 0.085 s for the copy), so `wait()`
hands it to a background releaser, one daemon thread per process, and returns.
`settle_releases()` blocks until every arena handed over so far is freed: for whoever must know
the host memory is back (a benchmark reading its resident memory, a test). A pageable arena (the
CPU, or pinning refused) is freed inline: no unregistration, and the tests see the plain order.

A kept arena (a spare): allocating and page-locking a fresh arena, not the copy, set the first
sleep's speed on the H100 (10-13 GB/s against 54 GB/s for a pinned device-to-host copy). Where the
control plane allows it (gpuportal.wire.commands.KeepArena), an awake replica holds an arena of its
weights' exact layout ready: `spare(model)` allocates and pins one without copying anything (in the
background, right after the replica is told), and `unpack_async(..., keep=True)` keeps the arena a
wake read from instead of freeing it (`PendingCopies.kept`). `pack(model, into=spare)` then copies
into it: no allocation, no pinning, the copy's speed. A spare of another layout is freed and a
fresh arena allocated. An arena a wake kept still holds the bytes it gave the GPU, and serving
never writes a weight: `pack` into it copies only the tensors replaced or written in place since
(`Arena.intact`), so such a sleep frees the GPU without crossing the bus. A spare prepared for a
replica loaded from disk is filled the same way right after its allocation (`fill`, on the same
background thread: the weights cross the bus while the replica serves), so its sleeps are as fast.

On the CPU (VirtualBackend, tests, CI) the same code runs with plain host copies: no stream, no
page-locking. Pure torch, no Django: it runs inside the replica process.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("inference.arena")

# Each tensor starts at a multiple of this: a multiple of every element size (views of any dtype
# are legal) and the caching allocator's own block size, so the one device allocation a wake makes
# is no bigger than the tensor-by-tensor allocations the memory formula counts
# (gpuportal.wire.memory.allocation_bytes). DMA engines want no more than this either.
ALIGNMENT = 512
# cudaHostRegister pins whole pages; the buffer starts on one so no neighbour's page is pinned.
_PAGE = 4096
# cudaHostRegisterPortable: the pages are pinned for every GPU's context, not just the current
# one, so a wake onto other GPUs than the sleep's still copies at full speed.
_HOST_REGISTER_PORTABLE = 1

# Where a module tensor goes on a wake: accelerate's device map ({"": 0}, {"model.layers.0": 1,
# ...}); values as accelerate takes them (GPU index, "cuda:1", "cpu", torch.device).
DeviceMap = Mapping[str, Any]


def align(nbytes: int, to: int = ALIGNMENT) -> int:
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class Slot:
    """One distinct tensor of the module, as it sits in the arena."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Where it was when packed: a wake without a device map puts it back there.
    device: torch.device
    # Its name where it is first held, in module order ("model.embed_tokens.weight"): what a
    # device map names, by a module's prefix or by the tensor's own name.
    name: str


@dataclass
class Arena:
    """The host allocation and where each tensor lies in it; the module's tensors are views into it."""

    host: torch.Tensor | None  # uint8, one allocation; None once released
    pinned: bool
    slots: list[Slot]
    # Per slot, every tensor object of the module that shares it (tied weights: several), so a
    # wake re-points them all at one device tensor and they stay tied.
    tensors: list[list[torch.Tensor]] = field(repr=False)
    _unpin: weakref.finalize | None = field(default=None, repr=False)
    # Kept after a wake (`PendingCopies.kept`), or a spare `fill` filled: per slot, the module
    # tensor its bytes are a copy of and that tensor's version counter then. While both still hold,
    # the slot's bytes here are the tensor's, and the next `pack` into this arena need not copy
    # them again. Empty otherwise.
    intact: list[tuple[weakref.ref, int]] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the host allocation (the tensors, their alignment padding)."""
        return 0 if self.host is None else self.host.numel()

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors themselves, tied weights once."""
        return sum(slot.nbytes for slot in self.slots)

    @property
    def released(self) -> bool:
        return self.host is None

    def view(self, index: int) -> torch.Tensor:
        """Slot `index` as a tensor of its own dtype and shape, sharing the arena's memory."""
        assert self.host is not None, "the arena was released"
        return _typed(self.host, self.slots[index])

    def release(self) -> None:
        """Give the host memory back: unpinned, then freed once no view of it is left. Safe to
        call twice, and from the releaser's thread (the finalizer unpins exactly once)."""
        if self._unpin is not None:
            self._unpin()
        self.host = None
        self.tensors = []
        self.intact = []


def pack(model: nn.Module, *, pin: bool | None = None, into: Arena | None = None) -> Arena:
    """Move every parameter and buffer of `model` into one host allocation; the module's tensors
    become views into it, and what they held (on a GPU, on the CPU) is freed.

    `pin`: page-lock the arena (default: when a tensor is on a GPU). Where the system refuses
    (ulimit -l, a container's limit), the arena stays pageable: slower wakes, still correct.
    `into`: a kept arena (`spare`, `PendingCopies.kept`): when it has the module's layout its host
    buffer is filled instead of a fresh one allocated and pinned, and passes to the arena returned
    (`into` is left released, owning nothing); otherwise it is released and a fresh one allocated.
    """
    groups, slots, end = _layout(model)
    wanted = _wants_pin(slots, pin)
    intact = list(into.intact) if into is not None else []
    taken = _take(into, slots, end, wanted)
    host, unpin = taken or _host_buffer(end, pin=wanted, slots=slots)
    arena = Arena(host, unpin is not None, slots, [tensors for _, tensors in groups], unpin)

    sources = [tensors[0] for _, tensors in groups]
    # A kept arena that a wake read from, or that `fill` filled, still holds the bytes of every
    # tensor nothing wrote since (serving reads the weights, never writes them): those are not
    # copied again, so the sleep frees the GPU at once rather than at the bus's speed.
    unchanged = _unchanged(intact, sources) if taken is not None else [False] * len(slots)
    _copy_in(host, slots, sources, skip=unchanged, pinned=arena.pinned)
    _repoint(arena, [arena.view(i) for i in range(len(slots))])
    return arena


def fill(model: nn.Module, arena: Arena) -> None:
    """Copy `model`'s tensors into `arena`, a `spare` of its layout, and leave the module as it
    is (serving goes on reading its weights where they are). The arena then holds a copy of each,
    marked intact as after a kept wake, so the next `pack` into it copies only what was written or
    replaced since: a replica loaded from disk, once its spare is filled, sleeps as fast as one
    woken from its copy. Each tensor's version is read before the copies start, so one written
    while they run is copied again by that `pack`. The copies run on side streams ordered after
    the work already queued (a load's), and are synchronised before this returns.

    ValueError, and the arena left as it was, when it is released or not of the module's layout."""
    groups, slots, end = _layout(model)
    if arena.host is None:
        raise ValueError("the arena was released")
    why = _misfit(arena, slots, end, pin=False)
    if why is not None:
        raise ValueError(f"cannot fill the arena: {why}")
    sources = [tensors[0] for _, tensors in groups]
    seen = [(weakref.ref(tensor), tensor._version) for tensor in sources]
    arena.intact = []  # a copy half made is not a copy: marked only once the copies have landed
    _copy_in(arena.host, slots, sources, skip=[False] * len(slots), pinned=arena.pinned)
    arena.intact = seen


def _copy_in(
    host: torch.Tensor, slots: list[Slot], sources: list[torch.Tensor], *, skip: list[bool], pinned: bool
) -> None:
    """Copy each slot's tensor into `host` at its offset, but those `skip` marks: a run that came
    as one block (a module woken from an arena) as one copy. On side streams, synchronised on return."""
    with _CopyStreams({slot.device for slot in slots}) as streams:
        for run in _runs(slots, [slot.device for slot in slots]):
            if all(skip[index] for index in run):
                continue
            device = slots[run.start].device
            with _on(streams.get(device)):
                block = _same_block(sources, slots, run) if not any(skip[i] for i in run) else None
                if block is not None:
                    host[slots[run.start].offset : _run_end(slots, run)].copy_(block, non_blocking=pinned)
                    continue
                for index in run:
                    if not skip[index]:
                        _typed(host, slots[index]).copy_(sources[index], non_blocking=pinned)


def _unchanged(intact: list[tuple[weakref.ref, int]], sources: list[torch.Tensor]) -> list[bool]:
    """Per slot, whether the module's tensor is the very one a wake copied this arena's bytes to,
    not written in place since (its version counter, which every in-place operation on it bumps).
    A tensor replaced (a buffer reassigned) or written is copied as any other; so is everything
    when the arena was not kept from a wake. Writes through `.data` escape the counter: nothing
    here makes them (a replica only runs forward passes, under no_grad or inference_mode: no optimizer, no adapters)."""
    if len(intact) != len(sources):
        return [False] * len(sources)
    return [
        ref() is tensor and tensor._version == version for (ref, version), tensor in zip(intact, sources, strict=True)
    ]


def spare(model: nn.Module, *, pin: bool | None = None) -> Arena:
    """An arena of `model`'s exact layout, allocated (and page-locked: `pin` as in `pack`) now,
    holding nothing yet: what `pack(model, into=...)` later fills at the copy's speed, the
    allocation and the pinning paid in advance. The module is untouched.

    A pageable spare (the CPU, or pinning refused) has its pages faulted in here too: touching
    them is what a fresh arena's copy pays on the CPU, and a spare exists to pay it in advance."""
    _, slots, end = _layout(model)
    host, unpin = _host_buffer(end, pin=_wants_pin(slots, pin), slots=slots)
    if unpin is None:
        host.zero_()
    return Arena(host, unpin is not None, slots, [], unpin)


def _layout(model: nn.Module) -> tuple[list[tuple[str, list[torch.Tensor]]], list[Slot], int]:
    """The module's distinct tensors, their slots in an arena and the arena's size: one
    computation for `pack`, which fills it, `spare`, which allocates it, and `host_bytes`."""
    groups = _distinct_tensors(model)
    slots: list[Slot] = []
    end = 0
    for name, tensors in groups:
        first = tensors[0]
        if first.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: there is nothing to pack")
        nbytes = first.numel() * first.element_size()
        slots.append(Slot(end, nbytes, tuple(first.shape), first.dtype, first.device, name))
        end = align(end + nbytes)
    return groups, slots, end


def _wants_pin(slots: list[Slot], pin: bool | None) -> bool:
    return any(slot.device.type == "cuda" for slot in slots) if pin is None else pin


def _take(
    kept: Arena | None, slots: list[Slot], nbytes: int, pin: bool
) -> tuple[torch.Tensor, weakref.finalize | None] | None:
    """The host buffer of `kept` and its unpinning, taken from it (it is left released, owning
    nothing), when it can hold `slots`; None when there is none, or when it cannot (then it is
    released: a spare of another model's layout is memory nobody will use)."""
    if kept is None or kept.host is None:
        return None
    why = _misfit(kept, slots, nbytes, pin)
    if why is not None:
        log.info("not packing into the kept arena (%s): allocating a fresh one", why)
        kept.release()
        return None
    taken = kept.host, kept._unpin
    kept.host, kept._unpin, kept.tensors, kept.intact = None, None, [], []
    return taken


def _misfit(kept: Arena, slots: list[Slot], nbytes: int, pin: bool) -> str | None:
    """Why `kept` cannot take tensors laid out as `slots` (None: it can). Where they were is no
    matter (a wake may have moved them), only where each lies in the buffer and what it is."""
    import torch

    def placed(slot: Slot) -> tuple[Any, ...]:
        return slot.offset, slot.nbytes, slot.shape, slot.dtype, slot.name

    if kept.nbytes != nbytes or [placed(s) for s in kept.slots] != [placed(s) for s in slots]:
        return f"its layout of {len(kept.slots)} tensors in {kept.nbytes} bytes is not this module's"
    if pin and not kept.pinned and torch.cuda.is_available():
        return "it is pageable and a page-locked arena is wanted"
    return None


class PendingCopies:
    """A wake's host-to-device copies, queued and perhaps still running, and the arena they read.

    The race it closes: a copy queued with non_blocking from page-locked memory returns before the
    DMA engine has read the pages, and nothing in torch keeps them alive for it. Its caching host
    allocator records an event for the blocks it handed out, but the arena's pages are our own
    (cudaHostRegister, see _host_buffer): no event, no reference. Once the module's tensors point
    at the device, this handle's arena is the last holder of the host buffer, so releasing it
    (cudaHostUnregister, then the pages go back to malloc) before the copy streams are
    synchronised would let the DMA read unpinned or reused memory: torn weights, silently.
    So the arena is released by `wait()` only, after the synchronisation, and never before: not by
    a failure between the enqueue and the wait (the caller waits in a `finally`), nor by dropping
    the handle unwaited (a finalizer then synchronises before it releases).

    After a successful synchronisation a pinned arena is handed to the background releaser
    (`_Releaser`) rather than released inline, so the wake does not wait for the unpinning and the
    freeing: by then no copy reads its pages, so when they go back no longer matters to the
    weights, only to whoever counts host memory (`settle_releases`). An arena whose
    synchronisation failed is never handed over: it is kept (`_UNCONFIRMED`).

    On the CPU, and for pageable memory, the copies were done when they were issued: `wait()` only
    releases the arena, inline, so the same code runs everywhere.

    With `keep` (a replica allowed to keep its arena, see the module's Policy) `wait()` releases
    nothing: after the same synchronisation the arena becomes `kept`, for the next sleep to pack
    into. Only a confirmed wait hands it over: dropped unwaited, the handle releases it as without
    keep (nobody is left to take it), and an unconfirmed one is kept from everyone (`_UNCONFIRMED`).
    """

    def __init__(self, arena: Arena | None, streams: list[Any], *, keep: bool = False):
        # Strong references held by the finalizer, not by the handle alone: whichever comes first,
        # wait() or the handle's collection, runs _finish exactly once.
        self._finish = weakref.finalize(self, _finish, arena, streams)
        self._keep = keep
        self._kept: Arena | None = None

    @classmethod
    def complete(cls) -> PendingCopies:
        """Nothing in flight, no arena to release (a wake with nothing parked)."""
        handle = cls(None, [])
        handle.wait()
        return handle

    @property
    def done(self) -> bool:
        """True once waited for: the copies have landed. A pageable arena is released by then; a
        pinned one may still be being released in the background (`settle_releases`)."""
        return not self._finish.alive

    @property
    def kept(self) -> Arena | None:
        """With keep, once `wait()` has confirmed the copies landed: the arena they read, its host
        buffer intact and its `tensors` emptied (the module points at the devices now); the
        caller owns it from then on. None before the wait, and without keep."""
        return self._kept

    def wait(self) -> None:
        """Block until every copy has landed (one synchronisation per device), then release the
        arena: inline when pageable, in the background when pinned (the call does not wait for
        it), or, with keep, hand it to `kept`. Only the first call does anything: a second one
        returns at once."""
        # Detached, then run here: the same single run as calling the finalizer, with keep, which
        # its collection must not have (an arena handed to a dropped handle would leak unaccounted).
        finish = self._finish.detach()
        if finish is None:
            return
        _, function, args, _ = finish
        self._kept = function(*args, keep=self._keep)


def _finish(arena: Arena | None, streams: list[Any], *, keep: bool = False) -> Arena | None:
    """Synchronise the copies, then release the arena, or with `keep` return it for reuse."""
    try:
        for stream in streams:
            stream.synchronize()
    except BaseException:
        # Unknown whether the DMA engine is done with the pages (a CUDA error is sticky and the
        # replica fails on it): never free them under it. They go back when the process exits.
        if arena is not None:
            _UNCONFIRMED.append(arena)
        raise
    if arena is None:
        return None
    if keep:
        arena.tensors = []  # the module's tensors point at the devices now, not into it
        return arena
    release_later(arena)  # the copies are confirmed done: the pages may go, off the wake's path
    return None


# Arenas whose copies could not be confirmed finished (see _finish): kept, never freed.
_UNCONFIRMED: list[Arena] = []


class _Releaser:
    """Releases the arenas handed to it, in order, on one daemon thread started on first use.

    Unpinning (cudaHostUnregister, which torch calls without the GIL) and freeing the pages of a
    multi-gigabyte arena cost more than the wake's copy itself; here they overlap whatever the
    process does next. Freeing the pages drops the last tensor reference, which holds the GIL while
    the pages are unmapped: a short pause for the other threads' Python, not for their CUDA work.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()  # an RLock: a finalizer run by the GC may submit
        self._queue: list[Any] = []
        self._submitted = 0  # arenas handed over since the process started
        self._settled = 0  # of them, those released (or whose release failed, logged)
        self._thread: threading.Thread | None = None

    def submit(self, arena: Any) -> None:
        with self._changed:
            # Not alive: never started, or gone with a fork (only the forking thread survives one).
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="arena-releaser", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no new thread at interpreter shutdown: release it here
                    arena.release()
                    return
                self._thread = thread
            self._queue.append(arena)
            self._submitted += 1
            self._changed.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every arena submitted before this call is released; False if `timeout`
        (seconds) ran out first."""
        with self._changed:
            target = self._submitted
            return self._changed.wait_for(lambda: self._settled >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue))
                arena = self._queue.pop(0)
            try:
                arena.release()
            except Exception:
                log.exception("releasing an arena failed: its host memory may stay held")
            finally:
                arena = None  # the pages go back here, not when the next one comes
                with self._changed:
                    self._settled += 1
                    self._changed.notify_all()


_RELEASER = _Releaser()


def release_later(arena: Arena) -> None:
    """Release an arena nothing reads any more: a pinned one by the background releaser (its
    unpinning and freeing cost more than a copy of it; `settle_releases` waits for it), a pageable
    one here and now."""
    if arena.pinned:
        _RELEASER.submit(arena)
    else:
        arena.release()


def settle_releases(timeout: float | None = None) -> bool:
    """Block until every arena handed to the background releaser so far is released (unpinned, and
    freed unless something else still views it): the host memory of every wake waited for before
    this call is back. True when so, False if `timeout` (seconds) ran out first. Pageable arenas
    are released inline by `PendingCopies.wait()`, so they never wait here."""
    return _RELEASER.settle(timeout)


def unpack(model: nn.Module, arena: Arena, device_map: DeviceMap | None = None) -> None:
    """`unpack_async` and its wait: the weights are on their devices on return, and the arena freed
    (a pinned one handed to the background releaser: `settle_releases` waits for it)."""
    unpack_async(model, arena, device_map).wait()


def unpack_async(
    model: nn.Module, arena: Arena, device_map: DeviceMap | None = None, *, keep: bool = False
) -> PendingCopies:
    """Queue the copies of the arena onto the devices `device_map` names (default: where each
    tensor was when packed), one allocation per device, and point the module's tensors there.
    With `keep` the handle's `wait()` keeps the arena instead of freeing it (`PendingCopies.kept`).

    Returns with the copies perhaps still running. The module's tensors already have their devices,
    shapes and dtypes (what a cap check or a pool's sizing reads); their VALUES are only certain
    after the handle's `wait()`, which also frees the arena (a pinned one in the background). Work
    queued on a device's current stream after this returns is ordered after the copies, but the
    host must still wait before it reads a weight or reports the wake done. On failure nothing is
    left in flight, the arena is intact and the module still points into it.
    """
    import torch

    if arena.host is None:
        raise ValueError("the arena was already unpacked or released")
    if len(arena.tensors) != len(arena.slots):
        raise ValueError("the arena holds no module's weights (a spare, or kept after a wake)")
    host, slots = arena.host, arena.slots
    targets = [_target(slot, device_map) for slot in slots]
    runs = list(_runs(slots, targets))
    # Each device gets one allocation holding its runs, each run at the arena's own layout, so a
    # run is one copy and its tensors are views at the offsets they had in the arena.
    placed: dict[torch.device, int] = {}
    run_at: list[int] = []
    for run in runs:
        device = targets[run.start]
        run_at.append(placed.get(device, 0))
        placed[device] = align(run_at[-1] + _run_end(slots, run) - slots[run.start].offset)
    # Allocated before any copy is queued: an out-of-memory here leaves nothing in flight.
    buffers = {device: torch.empty(size, dtype=torch.uint8, device=device) for device, size in placed.items()}

    views: list[torch.Tensor] = [host] * len(slots)  # placeholders, all replaced below
    streams = _side_streams(set(buffers))
    try:
        for run, at in zip(runs, run_at, strict=True):
            device = targets[run.start]
            start = slots[run.start].offset
            span = _run_end(slots, run) - start
            with _on(streams.get(device)):
                buffers[device][at : at + span].copy_(host[start : start + span], non_blocking=arena.pinned)
            for index in run:
                views[index] = _typed(buffers[device], slots[index], shift=at - start)
        for device, stream in streams.items():
            # GPU-side order: whatever is queued on the device's own stream from now on (a forward,
            # a dispatch's moves) runs after the copies. Not the host side: see PendingCopies.
            torch.cuda.current_stream(device).wait_stream(stream)
    except BaseException:
        _synchronize(streams)  # the arena goes back to the caller with nothing reading it
        raise
    _repoint(arena, views)
    if keep:
        # What the arena's bytes are a copy of, once the copies are confirmed (only a confirmed
        # `wait()` hands the arena on as `kept`): the next sleep packs into it without copying those.
        arena.intact = [(weakref.ref(tensors[0]), tensors[0]._version) for tensors in arena.tensors]
    # From here the module no longer references the host buffer: the handle's arena holds it.
    return PendingCopies(arena, list(streams.values()), keep=keep)


def host_bytes(model: nn.Module) -> int:
    """What `pack` would allocate for `model`: its distinct tensors, each aligned."""
    return _layout(model)[2]


# -- helpers -----------------------------------------------------------------------------------


def _distinct_tensors(model: nn.Module) -> list[tuple[str, list[torch.Tensor]]]:
    """(name where first held, the tensor objects sharing it) for each distinct tensor, in module order.

    Tied weights are found by identity (one Parameter in two modules) and by memory (two objects
    viewing the same bytes as the same tensor): either way they get one slot, so they stay tied.
    """
    groups: dict[tuple[Any, ...], tuple[str, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    for owner, module in model.named_modules(remove_duplicate=False):
        for attr, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            key: tuple[Any, ...]
            if tensor.numel() == 0 or tensor.device.type == "meta":
                key = ("alone", id(tensor))  # no bytes to share: every empty tensor stands alone
            else:
                key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            groups.setdefault(key, (f"{owner}.{attr}" if owner else attr, []))[1].append(tensor)
    return list(groups.values())  # dicts keep insertion order: module order


@dataclass(frozen=True)
class _Run:
    """Consecutive slots [start, stop) bound for one device: copied as one block when possible."""

    start: int
    stop: int

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))


def _runs(slots: list[Slot], devices: list[torch.device]) -> Iterator[_Run]:
    start = 0
    for index in range(1, len(slots) + 1):
        if index == len(slots) or devices[index] != devices[start]:
            if index > start:
                yield _Run(start, index)
            start = index


def _run_end(slots: list[Slot], run: _Run) -> int:
    last = slots[run.stop - 1]
    return last.offset + last.nbytes


def _typed(buffer: torch.Tensor, slot: Slot, shift: int = 0) -> torch.Tensor:
    """The bytes of `slot` in `buffer` (at the slot's offset plus `shift`) as its dtype and shape."""
    start = slot.offset + shift
    return buffer[start : start + slot.nbytes].view(slot.dtype).view(slot.shape)


def _same_block(sources: list[torch.Tensor], slots: list[Slot], run: _Run) -> torch.Tensor | None:
    """The run's bytes as one tensor when its sources lie in one allocation at the arena's own
    layout (a model woken from an arena sleeps again): one copy instead of one per tensor."""
    import torch

    first = sources[run.start]
    storage = first.untyped_storage()
    base = first.data_ptr() - slots[run.start].offset
    for index in run:
        source = sources[index]
        if slots[index].nbytes == 0:
            continue
        if (
            not source.is_contiguous()
            or source.untyped_storage().data_ptr() != storage.data_ptr()
            or source.data_ptr() - slots[index].offset != base
        ):
            return None
    start = first.data_ptr() - storage.data_ptr()
    span = _run_end(slots, run) - slots[run.start].offset
    if start < 0 or start + span > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (span,))


def _repoint(arena: Arena, views: list[torch.Tensor]) -> None:
    # .data keeps each object (a Parameter stays the module's, tied twins stay one object, any
    # other reference to a buffer follows it) and drops its old memory.
    for tensors, view in zip(arena.tensors, views, strict=True):
        for tensor in tensors:
            tensor.data = view


def _target(slot: Slot, device_map: DeviceMap | None) -> torch.device:
    """The device `device_map` gives the slot: the longest key naming it or a module above it."""
    import torch

    if device_map is None:
        return slot.device
    best: str | None = None
    for prefix in device_map:
        names_it = prefix == "" or slot.name == prefix or slot.name.startswith(prefix + ".")
        if names_it and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        raise ValueError(f"the device map names no device for {slot.name!r}")
    where = device_map[best]
    if isinstance(where, int):
        return torch.device("cuda", where)
    device = torch.device(where)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _host_buffer(nbytes: int, *, pin: bool, slots: Sequence[Slot] = ()) -> tuple[torch.Tensor, weakref.finalize | None]:
    """One host allocation of `nbytes`, page-locked when asked and allowed.

    Not torch's pin_memory: its caching host allocator rounds every block up to a power of two
    and keeps freed blocks for reuse, so a 4.1 GB arena would pin 8 GB and outlive the sleep.
    Registering our own pages pins exactly the arena and gives them back on release.

    Registered, and unregistered, with the GPU of the first of `slots` on one (else the calling
    thread's) as the thread's current device: the registration needs a CUDA context, and a thread
    of our own (a spare prepared in the background, the releaser) starts on device 0, where the
    runtime would create one (hundreds of MiB nobody's books count) on a replica of another GPU.
    """
    import torch

    if not pin or nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8), None
    device = _registering_device(slots)
    try:
        host = _populated_pages(nbytes)
    except (OSError, ValueError) as exc:  # no mapping of that size: torch's own allocation, faulted by the pin
        log.warning("cannot map %d bytes for the arena (%s); allocating them plainly", nbytes, exc)
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        host = raw[skip : skip + nbytes]
    with torch.cuda.device(device):  # on leaving, torch sets device 0 back only if it has a context
        error = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    if error != 0:
        # Pinned memory is a limited resource (ulimit -l, container limits): pageable still works.
        _clear_cuda_error()
        log.warning("cannot pin %d bytes (cudaError %d); parking the weights in pageable memory", nbytes, error)
        return host, None
    # Unpinned before its pages are freed, even if the arena is dropped without release().
    return host, weakref.finalize(host, _unregister, host.data_ptr(), device)


def _registering_device(slots: Iterable[Slot]) -> int:
    """The GPU an arena's pages are registered with: its first tensor's on one, else the caller's."""
    import torch

    for slot in slots:
        if slot.device.type == "cuda":
            return slot.device.index if slot.device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device()


# Transparent huge pages come in 2 MiB pages on x86-64: the buffer starts on one.
_HUGE_PAGE = 2 * 1024 * 1024


def _populated_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory, every page already faulted in, for cudaHostRegister to pin.

    Registering fresh pages faults them in one by one on the calling thread, 4 KiB at a time, and
    that, not the copy, set a sleep's speed on the H100 (2.4-2.8 GB/s for the first sleep against
    54 GB/s for a pinned device-to-host copy). So: private anonymous memory advised to huge pages
    (512 times fewer faults and page records to pin, where the kernel allows them: `madvise` or
    `always` in /sys/kernel/mm/transparent_hugepage/enabled), faulted in by one zero_() that torch
    spreads over its intra-op threads; the registration then only pins what is there.
    Not torch.empty: its allocator gives no say over huge pages."""
    import contextlib
    import mmap

    import torch

    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, nbytes + _HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # A kernel without transparent huge pages refuses: 4 KiB pages, still correct.
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping: it is unmapped when the last view of the arena is gone.
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HUGE_PAGE
    host = raw[skip : skip + nbytes]
    host.zero_()
    return host


def _cudart_libraries() -> list[Any]:
    """The CUDA runtime libraries this process loaded, opened through ctypes (best effort: a
    runtime linked in statically is missed). torch binds few runtime calls of its own."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return []
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a refused registration: torch checks it after each kernel
    launch and would blame the next forward pass. torch binds no cudaGetLastError, so ask the
    runtime library this process loaded."""
    for library in _cudart_libraries():
        try:
            library.cudaGetLastError()
        except AttributeError:
            continue


def _unregister(pointer: int, device: int) -> None:
    import torch

    # Usually on the releaser's thread, whose current device is 0: see _host_buffer.
    with torch.cuda.device(device):
        error = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if error != 0:
        log.warning("cudaHostUnregister failed (cudaError %d): the arena's pages stay pinned until exit", error)


def _side_streams(devices: set[torch.device]) -> dict[torch.device, Any]:
    """A side stream per GPU in `devices`, ordered after the work already queued there. Empty for
    the CPU: its copies are done when they return."""
    import torch

    streams: dict[torch.device, Any] = {}
    for device in sorted((d for d in devices if d.type == "cuda"), key=str):
        stream = torch.cuda.Stream(device=device)
        # The source (a sleep) may still be being written by work queued on the current stream;
        # a wake's destination may be memory the allocator recycled from work still queued there.
        stream.wait_stream(torch.cuda.current_stream(device))
        streams[device] = stream
    return streams


def _synchronize(streams: Mapping[torch.device, Any]) -> None:
    for stream in streams.values():
        stream.synchronize()


class _CopyStreams:
    """`_side_streams` for a block of copies; on exit, ONE synchronisation per stream."""

    def __init__(self, devices: set[torch.device]):
        self.devices = devices
        self.streams: dict[torch.device, Any] = {}

    def __enter__(self) -> dict[torch.device, Any]:
        self.streams = _side_streams(self.devices)
        return self.streams

    def __exit__(self, *exc: object) -> None:
        _synchronize(self.streams)


def _on(stream: Any | None) -> Any:
    import contextlib

    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
