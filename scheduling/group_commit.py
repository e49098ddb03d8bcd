"""Calls from concurrent threads of one process committed together (group commit): the web serves
the API on threads of one process, and a scale call's fixed cost (a transaction, the deployment
lock and census, a snapshot, the ledger's commit, the Events' insert) is the same for one intent
as for several. The first caller to arrive leads: it takes every call waiting (up to `limit`,
one per key), runs them as one batch and hands the lead to the next caller still waiting, so no
caller waits longer than the batch before its own, and a lone caller waits for nothing.

Callers answered by a batch come back a moment later with their next call, just after the next
leader took whoever was already waiting: batches would alternate between halves of the callers.
So a leader whose last batch held several calls first gathers, for at most `gather_s`, as many
calls as that batch held (bench.placement, 8 clients: 4.8 calls a batch without, 6.7 with 1 ms).

Django-free: what a batch does is the caller's `run`, which returns one outcome per item (a
value, or the exception that item's caller raises).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class _Slot(Generic[T, R]):
    item: T
    key: Hashable
    turn: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to run the next batch, not with an outcome
    value: R | None = None
    error: BaseException | None = None

    def outcome(self) -> R:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class Group(Generic[T, R]):
    """`submit` from any thread; `run(items)` runs on one of the submitting threads at a time
    (two at once were measured no faster for scale calls: they split the calls into smaller
    batches and contend for the interpreter and the GPUs' versions).

    Items of one key never share a batch (a later one waits for the next): a batch's items may
    then each lock their own rows in one global order, and a caller's second call is never
    reordered before its first."""

    def __init__(
        self,
        run: Callable[[list[T]], Sequence[R | BaseException]],
        *,
        key: Callable[[T], Hashable],
        limit: int = 32,
        gather_s: float = 0.0,
    ) -> None:
        self._run = run
        self._key = key
        self._limit = limit
        self._gather_s = gather_s
        self._last = 0  # how many calls the last batch held
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._waiting: list[_Slot[T, R]] = []
        self._leading = False  # a batch runs, or its leader was handed the lead; while not, nobody waits
        self.batches = 0  # how many batches ran, and how many items they held (for benchmarks)
        self.items = 0

    def submit(self, item: T) -> R:
        slot: _Slot[T, R] = _Slot(item, self._key(item))
        with self._lock:
            self._waiting.append(slot)
            if not self._leading:
                self._leading = slot.lead = True
            self._queued.notify_all()
        if not slot.lead:
            slot.turn.wait()
            if not slot.lead:
                return slot.outcome()
        self._lead(slot)
        return slot.outcome()

    def wait_queued(self, count: int, timeout: float) -> bool:
        """Whether `count` calls wait for a batch (not counting one running) within `timeout`
        seconds: how a test or a benchmark knows calls are queued behind a batch."""
        with self._queued:
            return self._queued.wait_for(lambda: len(self._waiting) >= count, timeout)

    def _lead(self, own: _Slot[T, R]) -> None:
        batch: list[_Slot[T, R]] = [own]
        try:
            batch = self._take(own)
            try:
                outcomes = list(self._run([s.item for s in batch]))
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} gave {len(outcomes)} outcomes")
            except BaseException as err:  # every caller of the batch gets it, whatever it is
                outcomes = [err] * len(batch)
            for slot, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    slot.error = outcome
                else:
                    slot.value = outcome
        finally:
            self._hand_over(batch)

    def _take(self, own: _Slot[T, R]) -> list[_Slot[T, R]]:
        """The leader's own call (the first waiting: it led because nobody else did, or was handed
        the lead as the head), and the calls waiting after it, one per key."""
        with self._lock:
            if self._gather_s > 0:
                # The leader's own slot counts among those waiting (so after a batch of one there
                # is nothing to wait for). Waiting releases the lock, so the calls gathered can
                # queue; each one's notify wakes this to count again.
                self._queued.wait_for(lambda: len(self._waiting) >= min(self._last, self._limit), self._gather_s)
            batch, kept, keys = [own], [], {own.key}
            for slot in self._waiting:
                if slot is own:
                    continue
                if len(batch) < self._limit and slot.key not in keys:
                    batch.append(slot)
                    keys.add(slot.key)
                else:
                    kept.append(slot)
            self._waiting = kept
            self.batches += 1
            self.items += len(batch)
            self._last = len(batch)
            return batch

    def _hand_over(self, batch: list[_Slot[T, R]]) -> None:
        with self._lock:
            # The lead passes to the first caller still waiting, or lapses.
            if self._waiting:
                head = self._waiting[0]
                head.lead = True
                head.turn.set()
            else:
                self._leading = False
        # The leader's own slot is in the batch too: its event is never waited on again.
        for slot in batch:
            slot.turn.set()
