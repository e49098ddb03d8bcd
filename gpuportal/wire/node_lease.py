"""A node's lease in Redis, and the epoch it is held under.

The agent renews the lease on every beat, straight to Redis, and it expires on its own when the
agent stops renewing it. It is the control plane's second piece of evidence that a node is alive,
beside the heartbeats its database records: those pass through the agents' worker and
PostgreSQL, and when either stalls they stop being recorded although the node serves on. A node is
written off only when both say it is silent (scheduling.core.liveness).

The epoch fences a node the control plane wrote off. Writing a node off raises its epoch; from
then on the lease cannot be renewed under the old one, and every replica process started under
the old one is refused by the request queue (gpuportal.wire.requestqueue): no request taken, no
chunk streamed, no result written. A replica takes requests only while its node's lease is held
under its own epoch, so a node cut off from Redis or frozen (its agent stopped) stops claiming work
within one lease, before the control plane has even decided anything. The agent learns of a raised
epoch at its next renewal, stops every replica of the old one, and only then renews under the new
one: no GPU is held twice.

Django-free: the agent renews, the control plane raises and reads, the replicas' scripts check."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis


def lease_key(node: str) -> str:
    return f"gp:node:{node}:lease"


def epoch_key(node: str) -> str:
    return f"gp:node:{node}:epoch"


@dataclass(frozen=True)
class NodeFence:
    """A replica process's right to take and answer requests: its node and the epoch it was
    started under."""

    node: str
    epoch: int


def ttl_s(heartbeat_s: float, timeout_s: float, stall_s: float) -> float:
    """How long one renewal holds: three beats and a second, so a lease outlives a couple of slow
    renewals, and never longer than the heartbeat timeout, so a dead node is written off no
    later than its heartbeats alone would have it.

    And at least the control plane's stall threshold, a beat and a second: the sweep runs over
    Redis, so a Redis outage is a gap between sweeps at least as long. An outage short of a stall
    (`stall_s`) must leave every lease held when Redis is back, even one restored from a file
    that lost the last second's renewal; a longer one is read as a stall, and silence counts
    afresh. With 1 s beats a 4 s lease lapsed in a 6 s Redis restart that the sweep, 9 s after
    its last, did not read as a stall, and a node heard 13 s before was written off."""
    return min(timeout_s, max(3 * heartbeat_s + 1, stall_s + heartbeat_s + 1))


# The lease renewed under ARGV[1], unless the node's epoch has passed it: then the current epoch is
# returned and nothing renewed. An epoch below the agent's (Redis lost it: a restart without its
# file) is raised to it: the agent had it from the control plane. KEYS: epoch, lease. ARGV: the
# agent's epoch, ttl in ms.
_RENEW = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[1])
if current > mine then return current end
if current < mine then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return mine
"""

# The epoch raised by one and the lease dropped, in one step: the node is written off. KEYS: epoch,
# lease.
_WRITE_OFF = """
local epoch = redis.call('INCR', KEYS[1])
redis.call('DEL', KEYS[2])
return epoch
"""


def renew(client: redis.Redis, node: str, ttl_s: float, epoch: int = 0) -> int:
    """The lease held for `ttl_s` more seconds under `epoch`; returns the node's epoch. One above
    `epoch` means the node was written off: nothing was renewed, and the agent must stop what it
    runs under the old epoch before it renews under the new one."""
    keys = [epoch_key(node), lease_key(node)]
    return int(client.eval(_RENEW, len(keys), *keys, epoch, max(1, int(ttl_s * 1000))))


def current_epoch(client: redis.Redis, node: str) -> int:
    """The epoch a registering agent starts its replicas under."""
    return int(client.get(epoch_key(node)) or 0)


def write_off(client: redis.Redis, node: str) -> int:
    """Fence the node: its epoch raised by one, its lease gone. Returns the new epoch."""
    keys = [epoch_key(node), lease_key(node)]
    return int(client.eval(_WRITE_OFF, len(keys), *keys))


def release(client: redis.Redis, node: str) -> None:
    """The agent is leaving on purpose: its lease is no evidence of anything any more."""
    client.delete(lease_key(node))


def held(client: redis.Redis, nodes: Iterable[str]) -> set[str]:
    """Of `nodes`, those whose lease has not expired, in one round trip."""
    names = list(nodes)
    if not names:
        return set()
    values = client.mget([lease_key(n) for n in names])
    return {name for name, value in zip(names, values, strict=True) if value is not None}
