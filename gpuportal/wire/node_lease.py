"""A node's lease in Redis: the agent renews it on every beat, straight to Redis, and it expires
on its own when the agent stops renewing it. It is the control plane's second piece of evidence
that a node is alive, beside the heartbeats its database records: those pass through the agents'
worker and PostgreSQL, and when either stalls they stop being recorded although the node serves
on. A node is written off only when both say it is silent (scheduling.core.liveness).

Django-free: the agent writes, the control plane's heartbeat sweep reads."""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis


def lease_key(node: str) -> str:
    return f"gp:node:{node}:lease"


def ttl_s(heartbeat_s: float, timeout_s: float) -> float:
    """How long one renewal holds: three beats and a second, so a lease outlives a couple of slow
    renewals, and never longer than the heartbeat timeout, so a dead node is written off no
    later than its heartbeats alone would have it."""
    return min(timeout_s, 3 * heartbeat_s + 1)


def renew(client: redis.Redis, node: str, ttl_s: float) -> None:
    """The lease held for `ttl_s` more seconds. Its value is when it was renewed, for an operator
    reading Redis."""
    client.set(lease_key(node), f"{time.time():.3f}", px=max(1, int(ttl_s * 1000)))


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
