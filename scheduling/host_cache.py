"""Host memory as a scheduled resource (issue 19): which sleeping replicas leave a node's host
cache when what it holds would pass its budget. Pure: the snapshot of holders is the caller's
(scheduling.services.host_cache), so hypothesis can test the choice and the simulator reuse it.

A replica holds host memory while its weights are parked there: asleep, on its way to sleep
(draining to the cache), or a failover standby (its weights wait in pinned memory for the
takeover). One that leaves the cache is *parked*: its process stops, its weights are gone from the
host, and the deployment still counts it as wanted; the next wake loads it from disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

# States in which a replica's weights are in its node's host memory.
HOLDING = ("sleeping", "draining", "standby")


@dataclass(frozen=True)
class HostHolder:
    replica_id: str
    deployment: str
    state: str
    host_bytes: int
    last_accessed: datetime | None = None
    popular: bool = False


@dataclass(frozen=True)
class Trim:
    """The replicas to park, least valuable first, and what the host still holds beyond its
    budget once they have gone (0 when it fits)."""

    park: tuple[str, ...]
    over_bytes: int


def used_bytes(holders: Sequence[HostHolder]) -> int:
    return sum(h.host_bytes for h in holders if h.state in HOLDING)


def value(holder: HostHolder) -> tuple[bool, float, int]:
    """Lower leaves first: not popular before popular, then the longest unused (never used
    first), then the bigger (it frees more for one reload)."""
    used = holder.last_accessed.timestamp() if holder.last_accessed is not None else float("-inf")
    return (holder.popular, used, -holder.host_bytes)


def trim(holders: Sequence[HostHolder], budget_bytes: int) -> Trim:
    """Who leaves the host so that what it holds fits `budget_bytes`. Only sleepers may leave: a
    replica still draining to the cache is the sleep being made room for, and a standby's weights
    are its pair's takeover (losing them would make a failover a cold load)."""
    over = used_bytes(holders) - budget_bytes
    park: list[str] = []
    for holder in sorted((h for h in holders if h.state == "sleeping"), key=value):
        if over <= 0:
            break
        park.append(holder.replica_id)
        over -= holder.host_bytes
    return Trim(tuple(park), max(0, over))
