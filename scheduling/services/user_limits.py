"""Each user's limits on inference requests: at most so many accepted and not yet ended
at once, and so many accepted per minute. Past either, a request gets a 429 with Retry-After
(errors.TooManyRequests), nothing is queued, and `gpuportal_requests_limited_total` counts it.

The limits are GPUPORTAL_USER_MAX_CONCURRENT and GPUPORTAL_USER_MAX_PER_MINUTE, or what the user's
row of models.UserLimits (edited in the admin) says instead; 0 is no limit, and with none a request
costs no Redis round trip more. The counts live in Redis (gpuportal.wire.ownerlimits), shared by every web
process. A row is read at most once every CACHE_S per process and user: a request queued on a
replica's live claim reads nothing else from the database. An edit holds at once in the process
that made it, and in the others within CACHE_S (and one request more, answered while the row is
read again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis
from django.conf import settings
from django.db import DatabaseError

from gpuportal.remembered import Remembered
from gpuportal.wire.ownerlimits import CONCURRENT, OwnerLimits, Refusal
from gpuportal.wire.requestqueue import RequestQueue
from scheduling.metrics import REQUESTS_LIMITED
from scheduling.models import UserLimits
from scheduling.services.errors import TooManyRequests
from scheduling.services.queueing import queue

log = logging.getLogger(__name__)

# A user's row is read again after CACHE_S, at once while a thread reads it for up to STALE_S
# more (gpuportal.remembered): a frozen database does not hold up their requests.
CACHE_S = 5.0
STALE_S = 60.0

# A user's own (max_concurrent, max_per_minute); None where the setting applies.
Override = tuple[int | None, int | None]
NO_OVERRIDE: Override = (None, None)

_overrides: Remembered[Override] = Remembered("user-limits", lambda: CACHE_S, lambda: STALE_S)


@dataclass(frozen=True)
class Limits:
    max_concurrent: int
    max_per_minute: int

    @property
    def any(self) -> bool:
        return self.max_concurrent > 0 or self.max_per_minute > 0


def limits_of(owner: str) -> Limits:
    """The limits that hold for the requests of `owner` (a user's id, as requests record it)."""
    max_concurrent, max_per_minute = _override(owner)
    # The settings are read here, not cached: a user without a row follows them as they are.
    return Limits(
        settings.GPUPORTAL_USER_MAX_CONCURRENT if max_concurrent is None else max_concurrent,
        settings.GPUPORTAL_USER_MAX_PER_MINUTE if max_per_minute is None else max_per_minute,
    )


def admit(owner: str, request_id: str) -> bool:
    """Count the request `request_id` against its owner's limits, or raise TooManyRequests having
    counted nothing. True when it now holds a place in flight: the caller must queue it under
    that id, or `release` it."""
    limits = limits_of(owner)
    if not limits.any:
        return False
    refusal = _counts(queue()).admit(
        owner, request_id, max_in_flight=limits.max_concurrent, max_per_minute=limits.max_per_minute
    )
    if refusal is None:
        return limits.max_concurrent > 0
    REQUESTS_LIMITED.labels(reason=refusal.limit).inc()
    raise too_many(refusal)


def release(owner: str, request_id: str) -> None:
    """A request admitted but not queued after all (its deployment does not exist, say): its
    place in flight is free at once, rather than when a later admission finds it never was."""
    try:
        _counts(queue()).release(owner, request_id)
    except redis.RedisError as err:
        # The error the caller is answering is the one to tell; the place frees itself anyway
        # (gpuportal.wire.ownerlimits.ADMITTED_GRACE_S).
        log.warning("place in flight of request %s not released: %s", request_id, err)


def too_many(refusal: Refusal) -> TooManyRequests:
    if refusal.limit == CONCURRENT:
        message = (
            f"too many requests in flight: at most {refusal.allowed} at once may be accepted and "
            f"not yet ended; retry when one has ended"
        )
    else:
        message = (
            f"too many requests: at most {refusal.allowed} a minute; "
            f"retry in {refusal.retry_after_s} s, when this minute is over"
        )
    return TooManyRequests(message, limit=refusal.limit, retry_after_s=refusal.retry_after_s)


def forget(owner: str | None = None) -> None:
    """Read the user's row (every user's, with no owner) again on their next request."""
    _overrides.forget(owner)


def on_row_changed(sender: type, instance: UserLimits, **kwargs: Any) -> None:
    """post_save and post_delete of a UserLimits row: this process follows the edit at once."""
    forget(str(instance.user_id))


@cache
def _counts(requests: RequestQueue) -> OwnerLimits:
    # Per request queue, whose Redis client it shares (tests make the queue again).
    return OwnerLimits(requests.redis)


def _override(owner: str) -> Override:
    try:
        return _overrides.get(owner, lambda: _read(owner))
    except DatabaseError as err:
        # A database that blinks must not stop what a replica's claim lets through without it:
        # the row last read (or the settings) until it is back.
        log.warning("user limits of %s not read, the last known apply: %s", owner, err)
        return _overrides.last(owner) or NO_OVERRIDE


def _read(owner: str) -> Override:
    if not owner.isdigit():  # not a user's request (a test's, a tool's): the settings apply
        return NO_OVERRIDE
    row = UserLimits.objects.filter(user_id=int(owner)).values_list("max_concurrent", "max_per_minute").first()
    return row if row is not None else NO_OVERRIDE
