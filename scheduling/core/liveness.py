"""When a silent node is lost, and when its silence is the control plane's own deafness.

A heartbeat reaches the books through Redis, the agents' worker and PostgreSQL. When any of them
stalls (PostgreSQL frozen, Redis down, a worker restarting), no node's heartbeat is recorded,
and a sweep that then counts the silence would write off every healthy node and kill what serves
on it. Two things tell a stall from a loss:

- The sweep's own rhythm. It runs every few seconds through the same broker and database; a gap
  between two sweeps longer than `stall_s` means the control plane could not have heard anyone
  meanwhile. Silence counts only from when it can hear again (`heard_since`).
- The node's lease in Redis (gpuportal.wire.node_lease), which the agent renews itself. A node
  whose lease is held is alive though its heartbeats go unrecorded.

Pure: the heartbeat sweep (scheduling.services.nodes.expire_heartbeats) applies the verdicts."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Hearing:
    """The sweep's own record: when it last ran, and since when the control plane has heard
    (None: since the books began)."""

    last_sweep: datetime | None
    heard_since: datetime | None


@dataclass(frozen=True)
class Heard:
    """A sweep's reading of its own rhythm: the record to keep, and the gap that made it deaf."""

    hearing: Hearing
    deaf_for_s: float | None


def hear(previous: Hearing, now: datetime, stall_s: float) -> Heard:
    """This sweep's hearing. A gap since the last sweep longer than `stall_s` starts it afresh:
    nothing could be heard in the gap, so no silence from before now counts."""
    if previous.last_sweep is not None:
        gap = (now - previous.last_sweep).total_seconds()
        if gap > stall_s:
            return Heard(Hearing(now, now), gap)
    last = now if previous.last_sweep is None else max(previous.last_sweep, now)
    return Heard(Hearing(last, previous.heard_since), None)


@dataclass(frozen=True)
class Beat:
    """A node as the books last heard it."""

    name: str
    last_heartbeat: datetime


@dataclass(frozen=True)
class Verdict:
    name: str
    # How long it has been silent while the control plane could hear it.
    silent_s: float
    # Silent past the timeout, but its lease in Redis is held: alive, its beats unrecorded.
    leased: bool

    @property
    def lost(self) -> bool:
        return not self.leased


def silent_s(beat: Beat, hearing: Hearing, now: datetime) -> float:
    """How long the node has been silent while the control plane could have heard it."""
    since = beat.last_heartbeat if hearing.heard_since is None else max(beat.last_heartbeat, hearing.heard_since)
    return max(0.0, (now - since).total_seconds())


def judge(
    beats: Iterable[Beat], hearing: Hearing, now: datetime, timeout_s: float, leased: Collection[str]
) -> list[Verdict]:
    """The nodes silent past the timeout while the control plane listened, each lost unless its
    lease is held."""
    verdicts = []
    for beat in beats:
        silent = silent_s(beat, hearing, now)
        if silent > timeout_s:
            verdicts.append(Verdict(beat.name, silent, beat.name in leased))
    return verdicts
