"""Requests accepted per deployment and minute, for the dashboard's "requests per minute".

What it counts: requests *accepted* by `services.requests.submit` (queued or waking), not
completions: completions happen inside replica processes (inference/*), which the control plane
does not instrument. Each acceptance increments a per-minute bucket in Redis, in the same round
trip that queues the request (shared by every web process, so the figure is portal-wide), and
this process's Prometheus counter
`gpuportal_requests_accepted_total` (summed over processes under `up`'s multiprocess mode).
Buckets expire after a few minutes, so the keys never pile up and reading them needs no SCAN."""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis.exceptions import RedisError

from scheduling.metrics import REQUESTS_ACCEPTED
from scheduling.services.queueing import queue

BUCKET_TTL_S = 180


def bucket_key(deployment: str, minute: int) -> str:
    return f"gp:rpm:{deployment}:{minute}"


def bucket(deployment: str, *, now: float | None = None) -> tuple[str, int]:
    """The Redis bucket (key, ttl) of this minute, for the caller to increment in the round trip
    that queues the request (a request refused there counts in no bucket)."""
    minute = int((time.time() if now is None else now) // 60)
    return bucket_key(deployment, minute), BUCKET_TTL_S


def accepted(deployment: str) -> None:
    """Count one accepted request in this process's counter: only once it is queued, so that a
    request for a deployment that does not exist adds no label (labels stay bounded)."""
    REQUESTS_ACCEPTED.labels(deployment=deployment).inc()


def per_minute(deployments: Iterable[str], *, now: float | None = None) -> dict[str, float]:
    """Requests accepted over the last 60 s per deployment, in one Redis round trip: the current
    minute's bucket plus the previous one weighted by the share of it still inside the window
    (the usual sliding-window estimate). {} when Redis cannot be read."""
    names = list(deployments)
    if not names:
        return {}
    now = time.time() if now is None else now
    minute = int(now // 60)
    previous_share = 1.0 - (now % 60) / 60
    keys = [key for name in names for key in (bucket_key(name, minute), bucket_key(name, minute - 1))]
    try:
        raw = queue().redis.mget(keys)
    except RedisError:
        return {}
    rates = {}
    for i, name in enumerate(names):
        current, previous = (int(v) if v is not None else 0 for v in raw[2 * i : 2 * i + 2])
        rates[name] = round(current + previous * previous_share, 1)
    return rates
