"""Each owner's requests in flight and per minute, counted in Redis, so that every web process
(and each of its threads) sees the same counts and a limit holds however many submit at once.

    gp:user:<owner>:in_flight   ids of the owner's requests accepted under a concurrency limit,
                                scored by when each was admitted
    gp:user:<owner>:minute      requests admitted in the owner's current minute; the key expires
                                when that minute is over

The in-flight set is not kept up to date as requests end (that would put a write on every
replica's hot path): each admission first drops the ids whose request has ended or is gone, then
counts what is left. Imports nothing of Django, like the request queue it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis

from gpuportal.wire.requestqueue import FINAL, REQUEST_PREFIX, TTL_S

# An id is admitted before its request is written (the request may first have to be admitted by
# the database, which can wake a deployment): until then it has no hash and still counts. One
# whose web process died in between, leaving no request, stops counting after this long.
ADMITTED_GRACE_S = 60
WINDOW_S = 60
# A refusal for requests in flight cannot know when one will end: ask again soon.
IN_FLIGHT_RETRY_S = 1

# The limits a refusal names (the script below answers with these names).
CONCURRENT = "concurrent"
PER_MINUTE = "per_minute"


def in_flight_key(owner: str) -> str:
    return f"gp:user:{owner}:in_flight"


def minute_key(owner: str) -> str:
    return f"gp:user:{owner}:minute"


# One step, so that two submits of the same owner never both take the last place. The minute is
# checked first: if it is used up, its end is when to ask again, even with no place in flight
# either. A refused request adds nothing to either count. Request keys are derived from the ids
# here, not declared (as the queue's take does): fine on one Redis, not a cluster.
# KEYS: in-flight set, minute count. ARGV: request id, max in flight (0: none), max per minute
# (0: none), request key prefix, grace s, window s, set ttl s.
# Returns nil when admitted, else {limit refused by, its value, ms until the minute is over (or 0)}.
_FINAL_SET = "{" + ", ".join(f"['{status}'] = true" for status in FINAL) + "}"
_ADMIT = (
    f"local final = {_FINAL_SET}"
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local max_in_flight, max_per_minute = tonumber(ARGV[2]), tonumber(ARGV[3])
local window_ms = tonumber(ARGV[6]) * 1000
if max_per_minute > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= max_per_minute then
  local left = redis.call('PTTL', KEYS[2])
  if left < 0 then
    redis.call('PEXPIRE', KEYS[2], window_ms)
    left = window_ms
  end
  return {'per_minute', max_per_minute, left}
end
if max_in_flight > 0 then
  local held = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local count = 0
  for i = 1, #held, 2 do
    local status = redis.call('HGET', ARGV[4] .. held[i], 'status')
    if (status and final[status]) or (not status and tonumber(held[i + 1]) < now - tonumber(ARGV[5])) then
      redis.call('ZREM', KEYS[1], held[i])
    else
      count = count + 1
    end
  end
  if count >= max_in_flight then return {'concurrent', max_in_flight, 0} end
  redis.call('ZADD', KEYS[1], now, ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
end
if max_per_minute > 0 and (redis.call('INCR', KEYS[2]) == 1 or redis.call('PTTL', KEYS[2]) < 0) then
  redis.call('PEXPIRE', KEYS[2], window_ms)
end
return nil
"""
)


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: the limit it would pass (CONCURRENT or PER_MINUTE), that
    limit's value, and the seconds after which asking again may succeed."""

    limit: str
    allowed: int
    retry_after_s: int


class OwnerLimits:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._admit = client.register_script(_ADMIT)

    def admit(self, owner: str, request_id: str, *, max_in_flight: int, max_per_minute: int) -> Refusal | None:
        """Count `request_id` against the owner's limits (0: none), or refuse it and count nothing.
        An admitted request must then be queued under `request_id`, or `release`d."""
        keys = [in_flight_key(owner), minute_key(owner)]
        args = [request_id, max_in_flight, max_per_minute, REQUEST_PREFIX, ADMITTED_GRACE_S, WINDOW_S, TTL_S]
        refused = self._admit(keys=keys, args=args)
        if refused is None:
            return None
        limit, allowed, left_ms = refused
        retry_after_s = max(1, math.ceil(int(left_ms) / 1000)) if left_ms else IN_FLIGHT_RETRY_S
        return Refusal(limit.decode(), int(allowed), retry_after_s)

    def release(self, owner: str, request_id: str) -> None:
        """An admitted id whose request was not queued after all (the deployment does not exist,
        say) holds no place in flight. Its minute's count stays: the portal did answer it."""
        self.redis.zrem(in_flight_key(owner), request_id)
