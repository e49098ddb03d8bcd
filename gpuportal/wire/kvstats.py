"""A replica's KV block pool statistics, published in Redis for the control plane to show.

The replica writes its pool's figures every few seconds and whenever a sequence comes or
goes, under a key that expires: a replica that stops publishing (asleep, stopped, dead) stops
being shown with stale figures. The API, the admin and `/metrics` read them in one round trip.
No Django here: the replica process writes, the web process reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import redis

# Long enough to outlive a few missed publications, short enough that a dead replica's pool
# disappears from the dashboard within a scrape or two.
TTL_S = 15
FIELDS = (
    "block_tokens",
    "blocks_total",
    "blocks_used",
    "blocks_peak",
    "allocations",
    "frees",
    "utilisation",
    # The prefix cache's (inference.kvpool): its idle blocks, the prompt tokens looked up and found.
    "blocks_cached",
    "prefix_queried",
    "prefix_hits",
)


def kv_key(replica_id: str) -> str:
    return f"gp:kv:{replica_id}"


def publish(client: redis.Redis, replica_id: str, stats: Mapping[str, Any]) -> None:
    client.set(kv_key(replica_id), json.dumps({k: stats[k] for k in FIELDS if k in stats}), ex=TTL_S)


def read_many(client: redis.Redis, replica_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{replica id: its latest figures} for those that published recently."""
    ids = list(replica_ids)
    if not ids:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for replica_id, raw in zip(ids, client.mget([kv_key(i) for i in ids]), strict=True):
        if raw:
            try:
                found[replica_id] = json.loads(raw)
            except ValueError:  # not ours, or half-written by something else: not shown
                continue
    return found
