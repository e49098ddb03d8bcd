"""Host memory as a scheduled resource: which replicas give host memory back when what a
node's host cache holds would pass its budget, and which awake replicas may keep an arena for
their next sleep while it has room. Pure: the snapshot of holders is the caller's
(scheduling.services.host_cache), so hypothesis can test the choice and the simulator reuse it.

A replica holds host memory while its weights are parked there: asleep, on its way to sleep
(draining to the cache), or a failover standby (its weights wait in pinned memory for the
takeover). One that leaves the cache is *parked*: its process stops, its weights are gone from the
host, and the deployment still counts it as wanted; the next wake loads it from disk.

An awake replica may also hold a *kept arena*: host memory of its weights' size, pinned in
advance, that its next sleep copies into (a sleep that must first allocate and page-lock gigabytes
ran at a fifth of the copy's speed on an H100). It is the cheapest holding to give back (the sleep
is only slower), so a trim drops kept arenas before it parks any sleeper, and arenas are granted
only from room the budget has spare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from gpuportal.wire import states


@dataclass(frozen=True)
class HostHolder:
    replica_id: str
    deployment: str
    state: str
    host_bytes: int
    last_accessed: datetime | None = None
    popular: bool = False
    # An awake replica's kept arena (host_bytes its size), rather than weights parked in the cache.
    kept_arena: bool = False


@dataclass(frozen=True)
class Trim:
    """What gives host memory back, least valuable first: kept arenas to drop, then replicas to
    park; and what the host still holds beyond its budget once they have gone (0 when it fits)."""

    park: tuple[str, ...]
    over_bytes: int
    drop: tuple[str, ...] = ()


def holds(holder: HostHolder) -> bool:
    """Whether the holder's bytes are in the host cache now."""
    # A replica that keeps an arena holds it awake too, as well as serving (or about to).
    return holder.state in states.AWAKE if holder.kept_arena else holder.state in states.IN_HOST_CACHE


def used_bytes(holders: Sequence[HostHolder]) -> int:
    return sum(h.host_bytes for h in holders if holds(h))


def value(holder: HostHolder) -> tuple[bool, float, int]:
    """Lower leaves first: not popular before popular, then the longest unused (never used
    first), then the bigger (it frees more for one reload)."""
    used = holder.last_accessed.timestamp() if holder.last_accessed is not None else float("-inf")
    return (holder.popular, used, -holder.host_bytes)


def trim(holders: Sequence[HostHolder], budget_bytes: int) -> Trim:
    """What leaves the host so that what it holds fits `budget_bytes`. Kept arenas go first: they
    cost only a slower sleep; of them, those of the replicas least likely to sleep soon (see
    `grants`). Then only sleepers may leave: a replica still draining to the cache is the sleep
    being made room for, and a standby's weights are its pair's takeover (losing them would make a
    failover a cold load)."""
    over = used_bytes(holders) - budget_bytes
    drop: list[str] = []
    for holder in sorted((h for h in holders if h.kept_arena and holds(h)), key=value, reverse=True):
        if over <= 0:
            break
        drop.append(holder.replica_id)
        over -= holder.host_bytes
    park: list[str] = []
    for holder in sorted((h for h in holders if not h.kept_arena and h.state in states.ASLEEP), key=value):
        if over <= 0:
            break
        park.append(holder.replica_id)
        over -= holder.host_bytes
    return Trim(tuple(park), max(0, over), tuple(drop))


def grants(holders: Sequence[HostHolder], candidates: Sequence[HostHolder], budget_bytes: int) -> tuple[str, ...]:
    """Which of the awake `candidates` (each with the bytes its arena would take) may keep one,
    while what the host holds stays within `budget_bytes`: first the replicas likeliest to sleep
    soon, whose sleeps a wake is likeliest to wait for, by the order fairness picks victims in
    (not popular before popular, the longest unused first). A candidate too big is passed over
    for a smaller one that fits."""
    room = budget_bytes - used_bytes(holders)
    granted: list[str] = []
    for candidate in sorted(candidates, key=value):
        if 0 < candidate.host_bytes <= room:
            granted.append(candidate.replica_id)
            room -= candidate.host_bytes
    return tuple(granted)
