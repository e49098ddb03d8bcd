"""Progress while the weights load: between the load's start and its checks, the share of the
model's weights the process holds so far, so that a caller's progress bar moves with the load
rather than sitting at its start and jumping to the end.

The gauge is what the backend can read of its own memory while another thread loads (the CUDA
allocator's bytes on its GPUs; on a virtual GPU, the process's resident memory), against the
weights' size read from the model's files before the load. It says at most one point below the
top of its range: only the load's end says it is done."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

# How often the gauge is read, and the least change worth a progress event (each one is a report
# that reaches the books).
EVERY_S = 0.5
STEP = 2


def percent(low: int, high: int, held_bytes: int, expected_bytes: int) -> int:
    """Where a load that holds `held_bytes` of `expected_bytes` is, in [low, high - 1]."""
    if expected_bytes <= 0:
        return low
    share = min(1.0, max(0.0, held_bytes / expected_bytes))
    return min(high - 1, low + int((high - low) * share))


class LoadGauge:
    """While the block runs, `say(percent, held_bytes)` each time the load moved by STEP points
    or more, from a thread of its own (the block's thread is inside the load)."""

    def __init__(
        self,
        gauge: Callable[[], int],
        expected_bytes: int | None,
        say: Callable[[int, int], None],
        *,
        low: int,
        high: int,
        every_s: float = EVERY_S,
    ):
        self.gauge, self.expected, self.say = gauge, expected_bytes, say
        self.low, self.high, self.every_s = low, high, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadGauge:
        if self.expected:  # a size unknown (a torch module's factory): nothing to measure against
            start = self.gauge()
            self._thread = threading.Thread(target=self._watch, args=(start,), name="load-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, start: int) -> None:
        assert self.expected
        said = self.low
        while not self._done.wait(self.every_s):
            try:
                held = max(0, self.gauge() - start)
            except Exception:  # a gauge that cannot be read only stops the progress, never the load
                return
            now = percent(self.low, self.high, held, self.expected)
            if now >= said + STEP:
                said = now
                self.say(now, held)
