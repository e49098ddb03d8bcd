"""What a waiting caller is told about its request: the phase it waits in, how far a
load or a wake is, where it stands in the queue, and an estimate of the wait from how long the
deployment's last load or wake took. Pure: scheduling.services.progress reads the facts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpuportal.wire.states import AWAKE_NEAREST_FIRST, ReplicaState

RUNNING = ("dispatched", "running")
ENDED = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class Progress:
    # queued (a replica serves; the request waits its turn), placing (a replica is being placed
    # or waits for room), loading, waking, running, or how it ended: done, failed, cancelled.
    phase: str
    percent: int | None = None
    queue_position: int | None = None
    estimate_s: float | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def line(self, deployment: str) -> str:
        """One line for a person (the SSE comment a streamed /v1 call sends before its first token)."""
        text = f"{self.phase} {deployment}"
        if self.percent is not None:
            text += f" {self.percent} %"
        if self.queue_position is not None and self.phase in ("queued", "placing", "loading", "waking"):
            text += f", #{self.queue_position} in line"
        if self.estimate_s is not None:
            text += f", about {self.estimate_s:.0f} s"
        return text


@dataclass(frozen=True)
class ReplicaFacts:
    state: str
    progress: int | None


def describe(
    status: str,
    replicas: Sequence[ReplicaFacts],
    *,
    queue_position: int | None,
    load_s: float | None,
    wake_s: float | None,
) -> Progress:
    """The progress of a request in `status`, whose deployment's awake replicas are `replicas`."""
    if status in ENDED:
        return Progress(status)
    if status in RUNNING:
        return Progress("running")
    nearest = min(
        (r for r in replicas if r.state in AWAKE_NEAREST_FIRST),
        key=lambda r: (AWAKE_NEAREST_FIRST.index(r.state), -(r.progress or 0)),
        default=None,
    )
    if nearest is None or nearest.state == ReplicaState.SERVING:
        # Served as soon as its turn comes; or nothing awake yet (a wake asked for, not placed).
        phase = "queued" if nearest is not None or status == "queued" else "placing"
        return Progress(phase, queue_position=queue_position, estimate_s=load_s if phase == "placing" else None)
    if nearest.state == ReplicaState.PENDING:
        return Progress("placing", queue_position=queue_position, estimate_s=load_s)
    percent = max(0, min(100, nearest.progress or 0))
    measured = wake_s if nearest.state == ReplicaState.WAKING else load_s
    left = None if measured is None else round(measured * (100 - percent) / 100, 1)
    return Progress(nearest.state, percent, queue_position, left)
