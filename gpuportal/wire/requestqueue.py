"""Inference requests in Redis: one queue per deployment, taken by replicas as they have room.

Shared by the web process (submit, wait, read, cancel, re-queue) and the replica processes (take,
finish, fail), so it imports nothing of Django. The reliable-queue pattern keeps every accepted
request somewhere at every instant:

    gp:queue:<deployment>   ids waiting, oldest at the right end
    gp:proc:<replica>       ids a replica has taken (BLMOVE from the queue, atomically)
    gp:req:<id>             the request: status, timestamps, input, params, output or error
    gp:done:<id>            a token pushed when the request ends (its final fields), for waiters
    gp:stream:<id>          chunks of a streamed answer, in order, then an end marker
    gp:last:<replica>       when the replica last finished a request (for idle sleep)
    gp:live:<deployment>:<family>  replicas taking requests now, scored by when that claim expires
    gp:deleted:<deployment>        a deployment deleted a moment ago, which no replica may claim
    gp:records              a compact record of every ended request, until the control plane drains it

A replica that dies leaves its ids in gp:proc:<replica>; `requeue_from` puts them back at the
head of the queue (or fails them once they used their attempts).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

TTL_S = 24 * 3600
FINAL = ("done", "failed", "cancelled")
STREAM_END = "\x00end"
# In a stream, before the chunks of a run that starts over (its request was re-queued after some
# of its text went out): the reader skips what it already sent (StreamSplice).
STREAM_RESTART = "\x00restart"
# The longest a blocking read waits in one call; see RequestQueue.wait.
BLOCK_SLICE_S = 2.0
# How long a replica's claim to be taking requests (gp:live) holds unless renewed: its every take
# renews it, an idle take waits at most a second, so only a replica that stopped taking (dead,
# hung, or in a forward pass this long) lets it lapse. Scored with the replica's clock, compared
# with Redis's: a skew far below this is harmless.
LIVE_TTL_S = 5.0
# Long enough for a deleted deployment's stop commands to reach its replicas. A deployment made
# again under the same name meanwhile only serves the long way (each request asks the database)
# until it passes.
DELETED_TTL_S = 60


def now() -> float:
    return time.time()


def queue_key(deployment: str) -> str:
    return f"gp:queue:{deployment}"


def index_keys(owner: str) -> tuple[str, str]:
    """The requests of `owner`, and everyone's, by when each was accepted (sorted sets, trimmed to
    TTL_S as requests are added): what `recent` lists, newest first."""
    return f"gp:requests:owner:{owner}", "gp:requests:all"


def processing_key(replica_id: str) -> str:
    return f"gp:proc:{replica_id}"


REQUEST_PREFIX = "gp:req:"


def request_key(request_id: str) -> str:
    return f"{REQUEST_PREFIX}{request_id}"


def done_key(request_id: str) -> str:
    return f"gp:done:{request_id}"


def stream_key(request_id: str) -> str:
    return f"gp:stream:{request_id}"


def last_key(replica_id: str) -> str:
    return f"gp:last:{replica_id}"


def finished_key(status: str) -> str:
    """A portal-wide count of requests that ended with `status` (done, failed, cancelled)."""
    return f"gp:finished:{status}"


# Every ended request's record (see _END), oldest first, until the control plane drains them.
RECORDS_KEY = "gp:records"
# A week of 10 requests a second drained every minute needs far fewer; only a control plane that
# stopped draining reaches it, and then the oldest records go first.
RECORDS_MAX = 1_000_000


def live_key(deployment: str, family: str) -> str:
    """Replicas taking `family` requests (see family_of_kind) for the deployment now."""
    return f"gp:live:{deployment}:{family}"


# What a replica takes, by its loader, and what a request needs, by its kind: a causal LM takes
# text (generate, chat), a plain module takes tensors (forward), an encoder takes text to embed
# (embed). A live claim is per family, so a request of the wrong kind finds no claim and is
# admitted the long way, which refuses it.
FAMILIES = ("text", "tensor", "embedding")
_KIND_FAMILIES = {"forward": "tensor", "embed": "embedding"}
_LOADER_FAMILIES = {"transformers": "text", "transformers-embedding": "embedding"}


def family_of_kind(kind: str) -> str:
    return _KIND_FAMILIES.get(kind, "text")


def family_of_loader(loader: str) -> str:
    return _LOADER_FAMILIES.get(loader, "tensor")


def deleted_key(deployment: str) -> str:
    """Set for DELETED_TTL_S once the deployment is deleted: no replica may claim it meanwhile."""
    return f"gp:deleted:{deployment}"


def epoch_key(fence: str) -> str:
    return f"gp:epoch:{fence}"


def written_off_key(replica_id: str) -> str:
    """Set once the control plane wrote the replica off: it may take no more requests."""
    return f"gp:off:{replica_id}"


class Fenced(Exception):
    """A replica's result was refused: the request is no longer its to answer."""


class StaleEpoch(Fenced):
    """A failover pair member wrote with an epoch that has been superseded: the write was refused."""


class NotTaken(Fenced):
    """A replica answered a request it no longer holds: the control plane wrote the replica off
    (its node went silent, say) and gave the request back to the queue, perhaps to another."""


class WrittenOff(Fenced):
    """A replica the control plane wrote off tried to take a request: it may take none. Whatever
    it held was given back when it was written off, so it can end at once and lose nothing."""


# The second half of a take, sent in the same round trip as the (blocking) move that precedes it:
# the id just moved is at the head of the processing list and still `queued` or `waking` (every id
# a take has handled is `dispatched` or later), so a move that found nothing leaves nothing to do.
# The request's key is derived from the id here, not declared: fine on one Redis, not a cluster.
# Stamped with the server's clock: the replica's would be from before the wait for a request.
# A replica written off (KEYS[2] set) takes nothing: an id its move just brought in goes back to
# the end of the queue takes read from, and it is told (-1). Checked here, in the step that makes
# a request the replica's, so that a take racing the write-off either ends before it (and the
# write-off gives the request back) or after it (and is refused): none is left with a replica
# that nobody will hear from again.
# KEYS: processing list, written-off marker, the deployment's queue. ARGV: replica id, request key prefix.
_MARK_TAKEN = """
local id = redis.call('LINDEX', KEYS[1], 0)
if redis.call('EXISTS', KEYS[2]) == 1 then
  if id then
    local status = redis.call('HGET', ARGV[2] .. id, 'status')
    if status == 'queued' or status == 'waking' then
      redis.call('LPOP', KEYS[1])
      redis.call('RPUSH', KEYS[3], id)
    end
  end
  return -1
end
if not id then return false end
local key = ARGV[2] .. id
local status = redis.call('HGET', key, 'status')
if not status then
  redis.call('LREM', KEYS[1], 1, id)
  return false
end
if status ~= 'queued' and status ~= 'waking' then return false end
local t = redis.call('TIME')
local at = string.format('%s.%06d', t[1], tonumber(t[2]))
redis.call('HSET', key, 'status', 'dispatched', 'replica', ARGV[1], 'dispatched_at', at)
redis.call('HINCRBY', key, 'attempts', 1)
return {id, redis.call('HGETALL', key)}
"""

# A submit that needs no database read: queued only if a replica of the deployment claims to be
# taking requests (gp:live, renewed by its takes, withdrawn before it stops taking), so that
# nothing has to be woken. Otherwise nothing is queued, and a refusal token is pushed where the
# blocking read sent in the same round trip waits, so that it returns at once: the web then
# admits the request the long way (the database says what to wake, or why not).
# KEYS: live set, request, queue, done, count, the owner's index, everyone's index. ARGV: request
# id, ttl, count ttl or '', created at, then the request's field/value pairs.
_SUBMIT_IF_LIVE = """
local t = redis.call('TIME')
if redis.call('ZCOUNT', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000, '+inf') == 0 then
  redis.call('RPUSH', KEYS[4], 'refused')
  redis.call('EXPIRE', KEYS[4], 60)
  return 0
end
redis.call('HSET', KEYS[2], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[2], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('INCR', KEYS[5])
  redis.call('EXPIRE', KEYS[5], ARGV[3])
end
for i = 6, 7 do
  redis.call('ZADD', KEYS[i], ARGV[4], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[2]))
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""

# A replica's claim to take requests, refused for a deployment deleted a moment ago. Also clears
# the claims of replicas long gone. KEYS: live set, deleted marker. ARGV: replica id, now, claim
# ttl, key ttl.
_ANNOUNCE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
redis.call('ZADD', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# A request starts running only while it is the starting replica's: one written off may have had
# it given back (status `queued`, owner '') an instant before, and a `running` written over that
# would make every take pass it by, so that it ran nowhere. KEYS: request. ARGV: replica id, time.
_START = """
if redis.call('HGET', KEYS[1], 'status') ~= 'dispatched' or redis.call('HGET', KEYS[1], 'replica') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[2])
return 1
"""

# A request taken but not started goes back first in line, only if it is still the replica's
# (in its processing list): one given back for it already (it was written off) may be another's
# by now. KEYS: processing list, request, queue, stream. ARGV: request id, restart marker or '', ttl.
_GIVE_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 'status', 'queued', 'replica', '')
redis.call('HINCRBY', KEYS[2], 'attempts', -1)
if ARGV[2] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[2])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
end
redis.call('RPUSH', KEYS[3], ARGV[1])
return 1
"""

# Raise the pair's epoch, never lower it: a slow writer of an old epoch cannot undo a takeover.
_RAISE_EPOCH = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return math.max(current, tonumber(ARGV[1]))
"""

# How a request ends, in one step (one round trip on the replica's hot path):
# - behind an epoch check when ARGV[1] is not empty: a superseded failover member's result never
#   lands (seed 004 fencing);
# - behind an owner check when a replica writes (ARGV[6]): a request given back to the queue when
#   its replica was written off (its node went silent) has an owner of '' or of the
#   replica that took it since, so the written-off replica's late answer never lands beside the
#   new one. A request whose record has expired has no owner to check, and is written as before;
# - the token pushed to gp:done:<id> carries the final fields (all but input and params), so a
#   waiter has the answer in the same round trip as its wake-up, with no read of the hash after.
# - a compact record of it (times, token counts from the answer's `usage`, status) goes onto
#   gp:records, which the control plane drains into PostgreSQL (scheduling.services.traffic): the
#   capacity planner's recorded traffic, kept past the request's own TTL. Capped at ARGV[7]
#   entries, oldest dropped, should nothing drain it. The token counts come as arguments, read
#   from the answer by the caller: decoding the answer here (an embedding call's can be megabytes)
#   would hold Redis, which runs one script at a time, for every request's end.
# KEYS: epoch (or any key when unfenced), request, stream, done, processing, last, finished count,
# records. ARGV: epoch or '', request id, ttl, now, stream end marker, replica id or '', the records'
# cap, prompt tokens or '', output tokens or '', then the request's field/value pairs.
_END = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[6] ~= '' then
  local owner = redis.call('HGET', KEYS[2], 'replica')
  if owner and owner ~= ARGV[6] then return -1 end
end
redis.call('HSET', KEYS[2], unpack(ARGV, 10))
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[3])
local fields = redis.call('HGETALL', KEYS[2])
local final = {}
for i = 1, #fields, 2 do
  if fields[i] ~= 'input' and fields[i] ~= 'params' then final[fields[i]] = fields[i + 1] end
end
redis.call('RPUSH', KEYS[4], cjson.encode(final))
redis.call('EXPIRE', KEYS[4], ARGV[3])
if ARGV[6] ~= '' then
  redis.call('LREM', KEYS[5], 1, ARGV[2])
  redis.call('SET', KEYS[6], ARGV[4], 'EX', ARGV[3])
end
redis.call('INCR', KEYS[7])
redis.call('RPUSH', KEYS[8], cjson.encode({
  id = ARGV[2], deployment = final['deployment'], kind = final['kind'], status = final['status'],
  created_at = final['created_at'], started_at = final['started_at'], finished_at = final['finished_at'],
  prompt_tokens = tonumber(ARGV[8]), output_tokens = tonumber(ARGV[9])}))
redis.call('LTRIM', KEYS[8], -tonumber(ARGV[7]), -1)
return 1
"""


@dataclass(frozen=True)
class Fence:
    """A failover pair member's right to write results: its pair's fence name and the epoch it holds."""

    name: str
    epoch: int


@dataclass
class Request:
    id: str
    deployment: str
    kind: str  # "generate", "chat", "forward" or "embed"
    input: Any
    params: dict[str, Any] = field(default_factory=dict)
    status: str = "queued"
    owner: str = ""
    attempts: int = 0
    replica: str = ""
    output: Any = None
    error: str = ""
    error_kind: str = ""
    created_at: float | None = None
    dispatched_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL

    @classmethod
    def from_hash(cls, request_id: str, raw: dict[bytes, bytes]) -> Request:
        return cls.from_fields(request_id, {k.decode(): v.decode() for k, v in raw.items()})

    @classmethod
    def from_fields(cls, request_id: str, data: dict[str, str]) -> Request:

        def stamp(name: str) -> float | None:
            return float(data[name]) if data.get(name) else None

        return cls(
            id=request_id,
            deployment=data.get("deployment", ""),
            kind=data.get("kind", "generate"),
            input=json.loads(data.get("input", "null")),
            params=json.loads(data.get("params", "{}")),
            status=data.get("status", "queued"),
            owner=data.get("owner", ""),
            attempts=int(data.get("attempts", "0")),
            replica=data.get("replica", ""),
            output=json.loads(data["output"]) if data.get("output") else None,
            error=data.get("error", ""),
            error_kind=data.get("error_kind", ""),
            created_at=stamp("created_at"),
            dispatched_at=stamp("dispatched_at"),
            started_at=stamp("started_at"),
            finished_at=stamp("finished_at"),
        )


class StreamSplice:
    """A streamed answer as its reader should send it, across re-runs of the request.

    A re-run starts its text over (after STREAM_RESTART): what the reader already sent is not sent
    again, only what the new run adds beyond it. A greedy re-run repeats its text exactly, so the
    client sees one seamless answer; a sampled one may differ in what was already sent, and the
    client keeps the first run's beginning with the second run's continuation.
    """

    def __init__(self) -> None:
        self.sent = 0  # characters sent
        self.run = ""  # text of the current run

    def feed(self, chunk: str) -> str:
        """The text to send for this raw stream entry ("" for none)."""
        if chunk == STREAM_RESTART:
            self.run = ""
            return ""
        self.run += chunk
        if len(self.run) <= self.sent:
            return ""
        text = self.run[self.sent :]
        self.sent = len(self.run)
        return text


class RequestQueue:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._raise_epoch = client.register_script(_RAISE_EPOCH)
        self._end_script = client.register_script(_END)
        self._mark_taken = client.register_script(_MARK_TAKEN)
        self._start = client.register_script(_START)
        self._give_back = client.register_script(_GIVE_BACK)
        self._announce = client.register_script(_ANNOUNCE)

    @classmethod
    def from_url(cls, url: str) -> RequestQueue:
        return cls(redis.Redis.from_url(url, health_check_interval=30))

    # -- the web side --------------------------------------------------------------------------

    def submit(
        self,
        deployment: str,
        *,
        kind: str,
        input: Any,
        params: dict[str, Any],
        owner: str,
        status: str = "queued",
        count_in: tuple[str, int] | None = None,
        if_live: bool = False,
        request_id: str | None = None,
    ) -> Request | None:
        """Queue a request. `count_in` (key, ttl): a counter incremented in the same round trip
        (the control plane's requests per minute). `if_live`: only if a replica of the deployment
        takes requests now (gp:live), else queue nothing and return None. `request_id`: its id,
        when the caller needs it first (a submit again after an `if_live` one queued nothing
        takes the same id); a new one by default."""
        submitted = self._submit(
            deployment, kind, input, params, owner, status, count_in, wait_s=0.0, if_live=if_live,
            request_id=request_id,
        )  # fmt: skip
        return None if submitted is None else submitted[0]

    def submit_and_wait(
        self,
        deployment: str,
        *,
        kind: str,
        input: Any,
        params: dict[str, Any],
        owner: str,
        timeout: float,
        status: str = "queued",
        count_in: tuple[str, int] | None = None,
        if_live: bool = False,
        request_id: str | None = None,
    ) -> tuple[Request, Request | None] | None:
        """Queue a request and wait up to `timeout` for its end: (as submitted, final or None);
        None if `if_live` and no replica takes requests now (nothing queued, as in `submit`).

        The submit and the first blocking read travel together, so a request answered within one
        blocking slice costs the web process a single round trip to Redis.
        """
        deadline = time.monotonic() + timeout
        submitted = self._submit(
            deployment, kind, input, params, owner, status, count_in, wait_s=min(timeout, BLOCK_SLICE_S),
            if_live=if_live, request_id=request_id,
        )  # fmt: skip
        if submitted is None:
            return None
        request, final = submitted
        if final is None and (left := deadline - time.monotonic()) > 0:
            final = self._wait_final(request.id, left)
        return request, final

    def _submit(
        self,
        deployment: str,
        kind: str,
        input: Any,
        params: dict[str, Any],
        owner: str,
        status: str,
        count_in: tuple[str, int] | None,
        *,
        wait_s: float,
        if_live: bool = False,
        request_id: str | None = None,
    ) -> tuple[Request, Request | None] | None:
        request = Request(
            id=request_id or uuid.uuid4().hex,
            deployment=deployment,
            kind=kind,
            input=input,
            params=params,
            owner=owner,
            status=status,
            created_at=now(),
        )
        key = request_key(request.id)
        # No MULTI: Redis runs one connection's commands in the order sent, so the request exists
        # in full before its id reaches the queue (LPUSH last), and a replica that takes the id
        # finds it. A transaction could not hold the blocking read that follows anyway.
        fields = {
            "deployment": deployment,
            "kind": kind,
            "input": json.dumps(input),
            "params": json.dumps(params),
            "owner": owner,
            "status": status,
            "attempts": 0,
            "created_at": request.created_at,
        }
        with self.redis.pipeline(transaction=False) as pipe:
            if if_live:
                keys = [
                    live_key(deployment, family_of_kind(kind)), key, queue_key(deployment), done_key(request.id),
                    count_in[0] if count_in is not None else key, *index_keys(owner),
                ]  # fmt: skip
                count_ttl = count_in[1] if count_in is not None else ""
                args = [request.id, TTL_S, count_ttl, request.created_at, *(x for kv in fields.items() for x in kv)]
                # EVAL, not EVALSHA: a Redis that lost its scripts would refuse an EVALSHA while the
                # read behind it blocked for nothing. Redis caches the script by its digest anyway.
                pipe.eval(_SUBMIT_IF_LIVE, len(keys), *keys, *args)
            else:
                if request_id is not None:
                    # An `if_live` submit of the same id that queued nothing left its refusal
                    # where the blocking read below waits: it is not this request's end.
                    pipe.delete(done_key(request.id))
                pipe.hset(key, mapping=fields)
                pipe.expire(key, TTL_S)
                if count_in is not None:
                    pipe.incr(count_in[0])
                    pipe.expire(count_in[0], count_in[1])
                for index in index_keys(owner):
                    pipe.zadd(index, {request.id: request.created_at})
                    pipe.zremrangebyscore(index, "-inf", request.created_at - TTL_S)
                    pipe.expire(index, TTL_S)
                pipe.lpush(queue_key(deployment), request.id)
            if wait_s > 0:
                self._block_for_end(pipe, request.id, wait_s)
            replies = pipe.execute()
        if if_live and not replies[0]:
            return None
        final = self._final(request.id, replies[-1]) if wait_s > 0 else None
        return request, final

    def get(self, request_id: str) -> Request | None:
        raw = self.redis.hgetall(request_key(request_id))
        return Request.from_hash(request_id, raw) if raw else None

    def recent(
        self,
        owner: str | None,
        *,
        deployment: str | None = None,
        status: str | None = None,
        offset: int = 0,
        limit: int = 100,
        scan: int = 200,
    ) -> tuple[list[Request], bool]:
        """The requests of `owner` (everyone's with None), newest first, that match the filters:
        `limit` of them after skipping `offset`, and whether there are more. Reads the index
        `scan` ids at a time, so a page of an unfiltered list costs a round trip or two."""
        index = index_keys(owner or "")[1 if owner is None else 0]
        wanted = offset + limit + 1
        found: list[Request] = []
        start = 0
        while len(found) < wanted:
            ids = [raw.decode() for raw in self.redis.zrevrange(index, start, start + scan - 1)]
            if not ids:
                break
            with self.redis.pipeline(transaction=False) as pipe:
                for request_id in ids:
                    pipe.hgetall(request_key(request_id))
                hashes = pipe.execute()
            for request_id, raw in zip(ids, hashes, strict=True):
                if not raw:  # expired before the index was trimmed past it
                    continue
                request = Request.from_hash(request_id, raw)
                if (deployment is None or request.deployment == deployment) and (
                    status is None or request.status == status
                ):
                    found.append(request)
            start += scan
        return found[offset : offset + limit], len(found) > offset + limit

    def wait(self, request_id: str, timeout: float) -> Request | None:
        """The request once final, or as it stands when the timeout passes (None if unknown)."""
        return self._wait_final(request_id, timeout) or self.get(request_id)

    def _wait_final(self, request_id: str, timeout: float) -> Request | None:
        """The request once final within `timeout`, else None.

        Straight to the blocking read: a request that has ended has its token waiting, so this
        returns at once for it too, and the hot path saves a round trip.
        """
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            # In slices shorter than the client's socket timeout (redis-py's default is 5 s): a
            # blocking call longer than that would end in a socket timeout, not in our answer.
            final = self._final(request_id, self._block_for_end(self.redis, request_id, left))
            if final is not None:
                return final
        return None

    @staticmethod
    def _block_for_end(client: Any, request_id: str, timeout: float) -> Any:
        # BLMOVE from the token list onto itself: the read leaves the token where it was, for any
        # other waiter of the same request, without a second command to put it back.
        key = done_key(request_id)
        return client.blmove(key, key, max(0.01, min(timeout, BLOCK_SLICE_S)), "RIGHT", "LEFT")

    def _final(self, request_id: str, token: bytes | None) -> Request | None:
        if token is None:
            return None
        if token == b"1":  # pushed by a portal from before tokens carried the answer
            return self.get(request_id)
        return Request.from_fields(request_id, json.loads(token))

    def cancel(self, request_id: str, reason: str = "cancelled by its owner") -> bool:
        """Cancel a request still waiting in its queue; one already taken runs to its end."""
        request = self.get(request_id)
        if request is None or request.final:
            return False
        if not self.redis.lrem(queue_key(request.deployment), 1, request_id):
            return False
        self._end(request_id, "cancelled", {"error": reason})
        return True

    def depth(self, deployment: str) -> int:
        return int(self.redis.llen(queue_key(deployment)))

    def position(self, deployment: str, request_id: str) -> int | None:
        """Where the request stands in its deployment's queue, 1 for the next to be taken; None
        once a replica has taken it (or it ended). Replicas take from the right, the oldest."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpos(queue_key(deployment), request_id)
            pipe.llen(queue_key(deployment))
            index, length = pipe.execute()
        return None if index is None else int(length) - int(index)

    # -- figures for metrics and the dashboard, each one round trip ------------------------------

    def depths(self, deployments: Iterable[str]) -> dict[str, int]:
        """Requests waiting per deployment."""
        return dict(zip(*self._lengths(queue_key, deployments), strict=True))

    def in_flight(self, replica_ids: Iterable[str]) -> dict[str, int]:
        """Requests each replica has taken and not ended (dispatched or running)."""
        return dict(zip(*self._lengths(processing_key, replica_ids), strict=True))

    def activity(self, replica_ids: Iterable[str]) -> dict[str, tuple[int, float | None]]:
        """{replica id: (requests in flight, when it last ended one, or None)}."""
        ids = list(replica_ids)
        if not ids:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.llen(processing_key(replica_id))
                pipe.get(last_key(replica_id))
            replies = pipe.execute()
        return {
            replica_id: (int(replies[2 * i]), None if replies[2 * i + 1] is None else float(replies[2 * i + 1]))
            for i, replica_id in enumerate(ids)
        }

    def finished_counts(self) -> dict[str, int]:
        """Requests that ended, by final status, counted by whoever ended them."""
        counts = self.redis.mget([finished_key(status) for status in FINAL])
        return {status: int(count or 0) for status, count in zip(FINAL, counts, strict=True)}

    def records(self, count: int) -> list[dict[str, Any]]:
        """The oldest `count` records of ended requests (see _END), read."""
        return [json.loads(raw) for raw in self.raw_records(count)]

    def raw_records(self, count: int) -> list[bytes]:
        """The oldest `count` records of ended requests as stored, left in place: `drop_raw_records`
        removes them once they are stored, so a drain that dies in between loses none."""
        return self.redis.lrange(RECORDS_KEY, 0, count - 1)

    def drop_raw_records(self, raw: list[bytes]) -> None:
        """Exactly these records, wherever they are now. Not by count from the head: a drain
        running beside this one, or the cap's trim in _END, may have moved the head since they
        were read, and a trim by count would then drop records nobody stored. Each record holds
        its request's id, so no two are alike."""
        pipe = self.redis.pipeline(transaction=False)
        for item in raw:
            pipe.lrem(RECORDS_KEY, 1, item)
        pipe.execute()

    def _lengths(self, key: Callable[[str], str], names: Iterable[str]) -> tuple[list[str], list[int]]:
        names = list(names)
        if not names:
            return [], []
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.llen(key(name))
            return names, [int(n) for n in pipe.execute()]

    def write_off(self, replica_id: str) -> None:
        """The replica may take no more requests (its next take raises WrittenOff). Before
        `requeue_from`: what it takes from then on is refused, what it took before is given back."""
        self.redis.set(written_off_key(replica_id), 1, ex=TTL_S)

    def requeue_from(self, replica_id: str, *, max_attempts: int, reason: str) -> dict[str, str]:
        """Give back what a gone replica had taken: to the head of its queue, or failed once it
        used its attempts. Returns {request id: "requeued" | "failed"}."""
        outcomes: dict[str, str] = {}
        proc = processing_key(replica_id)
        while (raw := self.redis.rpop(proc)) is not None:
            request_id = raw.decode()
            request = self.get(request_id)
            if request is None or request.final:
                continue
            if request.attempts >= max_attempts:
                self._end(
                    request_id,
                    "failed",
                    {"error": f"{reason}; gave up after {request.attempts} attempt(s)", "error_kind": "replica"},
                )
                outcomes[request_id] = "failed"
                continue
            with self.redis.pipeline() as pipe:
                pipe.hset(request_key(request_id), mapping={"status": "queued", "replica": ""})
                self._mark_restart(pipe, request)
                # The right end is taken next: a request that lost its replica goes first.
                pipe.rpush(queue_key(request.deployment), request_id)
                pipe.execute()
            outcomes[request_id] = "requeued"
        return outcomes

    def fail_queued(self, deployment: str, *, reason: str, kind: str = "placement") -> list[str]:
        """End every request waiting for `deployment`: it cannot be served (e.g. cannot wake)."""
        failed = []
        while (raw := self.redis.rpop(queue_key(deployment))) is not None:
            request_id = raw.decode()
            self._end(request_id, "failed", {"error": reason, "error_kind": kind})
            failed.append(request_id)
        return failed

    # -- the replica side ----------------------------------------------------------------------

    def take(self, deployment: str, replica_id: str, timeout: float) -> Request | None:
        """The oldest waiting request, moved atomically into this replica's processing list.

        Waits up to `timeout` seconds for one; timeout <= 0 only looks (a batch that must keep stepping).
        """
        return self._take(deployment, replica_id, timeout, None)[0]

    def take_renewing(
        self, deployment: str, replica_id: str, timeout: float, family: str
    ) -> tuple[Request | None, bool]:
        """`take`, renewing in the same round trip the replica's claim to take `family` requests
        (see `announce`); and whether the claim was still there to renew."""
        return self._take(deployment, replica_id, timeout, family)

    def _take(self, deployment: str, replica_id: str, timeout: float, renew: str | None) -> tuple[Request | None, bool]:
        source, target = queue_key(deployment), processing_key(replica_id)
        keys = [target, written_off_key(replica_id), source]
        args = [replica_id, REQUEST_PREFIX]
        # The move and the marking in one round trip: Redis runs the script the moment the move
        # returns. By its SHA, so the pipeline sends no SCRIPT EXISTS first; a Redis that lost
        # its scripts (a restart) answers NOSCRIPT, and the marking runs again on its own.
        with self.redis.pipeline(transaction=False) as pipe:
            if renew:
                # XX: a renewal never re-creates a claim that was withdrawn (by the replica as it
                # stopped taking, or by the control plane for a replica it saw die); CH: it
                # answers 1 only if the claim was there.
                pipe.zadd(live_key(deployment, renew), {replica_id: now() + LIVE_TTL_S}, xx=True, ch=True)
            if timeout <= 0:
                pipe.lmove(source, target, "RIGHT", "LEFT")
            else:
                pipe.blmove(source, target, timeout, "RIGHT", "LEFT")
            pipe.evalsha(self._mark_taken.sha, len(keys), *keys, *args)
            replies = pipe.execute(raise_on_error=False)
        renewed = bool(renew) and replies[0] == 1  # an error reply counts as no claim found
        moved, marked = replies[-2:]
        if isinstance(moved, Exception):
            raise moved
        if isinstance(marked, redis.exceptions.NoScriptError):
            marked = self._mark_taken(keys=keys, args=args)
        elif isinstance(marked, Exception):
            raise marked
        if marked == -1:
            raise WrittenOff(f"replica {replica_id} was written off by the control plane: it takes no more requests")
        if not marked:
            return None, renewed
        # Marked even if this move found nothing: an earlier move whose marking never ran (its
        # connection broke in between) left its id at the head, and it is served now, not lost.
        request_id, fields = marked
        raw_hash = dict(zip(fields[::2], fields[1::2], strict=True))
        request_id = request_id.decode()
        return Request.from_hash(request_id, raw_hash), renewed

    def announce(self, deployment: str, family: str, replica_id: str) -> bool:
        """Claim that this replica takes the deployment's `family` requests now: until the claim
        lapses (LIVE_TTL_S, renewed by `take_renewing`) or is withdrawn, the web queues them
        without asking the database whether anything must be woken. False, and no claim, for a
        deployment deleted within the last DELETED_TTL_S."""
        keys = [live_key(deployment, family), deleted_key(deployment)]
        return bool(self._announce(keys=keys, args=[replica_id, now(), LIVE_TTL_S, TTL_S]))

    def withdraw(self, deployment: str, replica_id: str) -> None:
        """The replica no longer takes requests (it drains, sleeps, stopped or died)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for family in FAMILIES:
                pipe.zrem(live_key(deployment, family), replica_id)
            pipe.execute()

    def forget_live(self, deployment: str) -> None:
        """No replica of the deployment takes requests any more (it was deleted); and for a
        while none may claim to (a replica the stop has not reached yet would claim again)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(*(live_key(deployment, family) for family in FAMILIES))
            pipe.set(deleted_key(deployment), 1, ex=DELETED_TTL_S)
            pipe.execute()

    def live(self, deployment: str, family: str) -> list[str]:
        """Replicas whose claim to take the deployment's `family` requests holds now."""
        return [m.decode() for m in self.redis.zrangebyscore(live_key(deployment, family), now(), "+inf")]

    def give_back(self, request: Request, replica_id: str) -> None:
        """Return a request taken but not started (the replica began to sleep): first in line
        again, its attempt not counted (it never ran). Nothing if it is no longer the replica's."""
        keys = [processing_key(replica_id), request_key(request.id), queue_key(request.deployment)]
        marker = STREAM_RESTART if request.params.get("stream") else ""
        self._give_back(keys=[*keys, stream_key(request.id)], args=[request.id, marker, TTL_S])

    @staticmethod
    def _mark_restart(pipe: redis.client.Pipeline, request: Request) -> None:
        if request.params.get("stream"):
            pipe.rpush(stream_key(request.id), STREAM_RESTART)
            pipe.expire(stream_key(request.id), TTL_S)

    def start(self, request_id: str, replica_id: str) -> None:
        self.started({request_id: now()}, replica_id)

    def started(self, stamps: dict[str, float], replica_id: str) -> None:
        """Mark the replica's requests running since the given times, in one round trip; one no
        longer its (given back meanwhile) is left as it is."""
        ids = list(stamps)
        with self.redis.pipeline(transaction=False) as pipe:
            for request_id in ids:
                pipe.evalsha(self._start.sha, 1, request_key(request_id), replica_id, stamps[request_id])
            replies = pipe.execute(raise_on_error=False)
        for request_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):  # a restarted Redis lost its scripts
                self._start(keys=[request_key(request_id)], args=[replica_id, stamps[request_id]])
            elif isinstance(reply, Exception):
                raise reply

    def chunk(self, request_id: str, text: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.rpush(stream_key(request_id), text)
            pipe.expire(stream_key(request_id), TTL_S)
            pipe.execute()

    def finish(
        self, request_id: str, replica_id: str, output: Any, fence: Fence | None = None, started_at: float | None = None
    ) -> None:
        """The request's answer. `started_at`: when it started, if that was not written yet (a
        request that starts and ends within one batch step has both in one round trip)."""
        fields: dict[str, Any] = {"output": json.dumps(output)}
        if started_at is not None:
            fields["started_at"] = started_at
        usage = output.get("usage") if isinstance(output, dict) else None
        self._end(request_id, "done", fields, replica_id=replica_id, fence=fence, usage=usage)

    def fail(self, request_id: str, replica_id: str, error: str, kind: str, fence: Fence | None = None) -> None:
        self._end(request_id, "failed", {"error": error, "error_kind": kind}, replica_id=replica_id, fence=fence)

    def raise_epoch(self, fence: str, epoch: int) -> int:
        """Make `epoch` the pair's current one (unless a later one already is); returns the current."""
        return int(self._raise_epoch(keys=[epoch_key(fence)], args=[epoch]))

    def read_stream(self, request_id: str, start: int, timeout: float) -> tuple[list[str], bool]:
        """Chunks from index `start` on, waiting up to `timeout` for the first; and whether the
        stream has ended."""
        deadline = time.monotonic() + timeout
        while True:
            chunks = [c.decode() for c in self.redis.lrange(stream_key(request_id), start, -1)]
            ended = bool(chunks) and chunks[-1] == STREAM_END
            if ended:
                chunks = chunks[:-1]
            if chunks or ended or time.monotonic() >= deadline:
                if not ended and not chunks:
                    request = self.get(request_id)
                    ended = request is None or request.final
                return chunks, ended
            # A list has no blocking read from an offset; the stream is short-lived, so poll it.
            time.sleep(0.005)

    def _end(
        self,
        request_id: str,
        status: str,
        fields: dict[str, Any],
        replica_id: str = "",
        fence: Fence | None = None,
        usage: Any = None,
    ) -> None:
        values = {"status": status, "finished_at": now(), **fields}
        keys = [
            epoch_key(fence.name) if fence is not None else request_key(request_id),
            request_key(request_id),
            stream_key(request_id),
            done_key(request_id),
            processing_key(replica_id),
            last_key(replica_id),
            finished_key(status),
            RECORDS_KEY,
        ]
        epoch = str(fence.epoch) if fence is not None else ""
        counts = usage if isinstance(usage, dict) else {}
        tokens = [counts.get(k, "") for k in ("prompt_tokens", "completion_tokens")]
        tokens = [n if isinstance(n, int) else "" for n in tokens]
        args = [epoch, request_id, TTL_S, now(), STREAM_END, replica_id, RECORDS_MAX, *tokens]
        args += [x for kv in values.items() for x in kv]
        written = self._end_script(keys=keys, args=args)
        if written == 0:
            assert fence is not None
            raise StaleEpoch(f"epoch {fence.epoch} of failover pair {fence.name} is no longer current")
        if written == -1:
            raise NotTaken(f"request {request_id} is no longer held by replica {replica_id}: it was given back")
