"""The request queue's protocol: its Redis keys, the Lua scripts that move a request between
them atomically, a request as read back, and the fences that refuse a written-off replica's
results. What each side of the queue (web.py, oversight.py, serving.py) builds on."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

TTL_S = 24 * 3600
FINAL = ("done", "failed", "cancelled")
STREAM_END = "\x00end"
# In a stream, before the chunks of a run that starts over (its request was re-queued after some
# of its text went out): the reader skips what it already sent (StreamSplice).
STREAM_RESTART = "\x00restart"
# A streamed piece that carries its tokens' log probabilities (asked for beside `stream`): this
# prefix, then the JSON of [text, entries] (inference.token_logprobs.entries' shape).
STREAM_PICKS = "\x00picks"
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


PROCESSING_PREFIX = "gp:proc:"


def processing_key(replica_id: str) -> str:
    return f"{PROCESSING_PREFIX}{replica_id}"


REQUEST_PREFIX = "gp:req:"


def request_key(request_id: str) -> str:
    return f"{REQUEST_PREFIX}{request_id}"


def done_key(request_id: str) -> str:
    return f"gp:done:{request_id}"


def stream_key(request_id: str) -> str:
    return f"gp:stream:{request_id}"


def stream_bell_key(request_id: str) -> str:
    """Rung (a list pushed to) by every piece and by the end of a stream, so that its reader blocks
    on it (BLPOP) instead of polling the stream; under gp:stream:*, as a node's ACL allows."""
    return f"gp:stream:{request_id}:bell"


def stream_readers_key(request_id: str) -> str:
    """How many of the web's readers follow a request's stream now (a counter, the web's alone):
    a ring of the bell wakes one reader, so where there are several (a client that follows a
    response again while its first stream has not yet seen it gone, two clients of one response)
    each passes on the ring that woke it, and waits in short slices (web.SHARED_READ_WAIT_S)."""
    return f"gp:stream:{request_id}:readers"


# How long a ring nobody took is kept: only a reader blocked at that moment needs it (one that is
# not reads the stream itself before it blocks), and every request's end rings, streamed or not.
BELL_TTL_S = 60


def last_key(replica_id: str) -> str:
    return f"gp:last:{replica_id}"


STOPS_SUFFIX = ":stops"


def stops_key(replica_id: str) -> str:
    """The requests a replica holds that their callers asked to stop (a hash: id → why), which the
    replica reads and clears as it serves (_ASK_STOP). Under gp:proc:*, as the processing list it
    goes with: a node's Redis user reaches it without another rule (gpuportal.wire.node_acl)."""
    return f"{processing_key(replica_id)}{STOPS_SUFFIX}"


# The finish_reason of an answer its caller asked to stop while a replica generated it (vLLM says
# "abort"): its text is what was generated until then, its status `cancelled`.
STOPPED = "cancelled"
# How long an ask to stop is kept for a replica that never reads it (it died: its requests go back
# to the queue, where the ask travels in the request's own `stop_asked`).
STOPS_TTL_S = 3600


def finished_key(status: str) -> str:
    """A portal-wide count of requests that ended with `status` (done, failed, cancelled)."""
    return f"gp:finished:{status}"


# Every ended request's record (see _END), oldest first, until the control plane drains them:
# here those the web ends, and those a node's replicas end in the node's own list (records_key),
# so that a node's Redis user reads no other node's (each holds its request's id, which opens
# the request's key: gpuportal.wire.node_acl).
RECORDS_KEY = "gp:records"
# A request's hash field naming the kind its record is to have where it is not the request's own
# (_END's record reads it by this name): a count (sampling.COUNT_ONLY) is recorded as COUNT_KIND.
RECORD_KIND = "record_kind"
COUNT_KIND = "count"


def records_key(node: str | None = None) -> str:
    """Where the records of the requests `node`'s replicas end go (None: the web's, and those of
    a replica fenced by no node)."""
    return f"{RECORDS_KEY}:node:{node}" if node else RECORDS_KEY


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


class NodeWrittenOff(Fenced):
    """A replica wrote under a node epoch the control plane has raised since (it wrote the node off:
    gpuportal.wire.node_lease): the write was refused, and the replica must stop."""


class SubmitTooLate(redis.TimeoutError):
    """Redis ran a submit past the deadline its web gave it (it was frozen meanwhile): nothing
    was queued. A timeout like any other to the caller (a 503, safe to send again)."""


def never_sent(err: redis.RedisError) -> bool:
    """Whether redis-py raised `err` before the command left this process: the connection was
    refused or timed out as it was being made (redis-py says "connecting to" then). Any other
    error may have come after Redis ran the command."""
    return isinstance(err.__context__, ConnectionRefusedError) or "connecting to" in str(err)


class KeyTakenOver(Exception):
    """A submit under an Idempotency-Key that a retry took over before this request was written:
    nothing was queued. `first` is the request the key names now."""

    def __init__(self, first: str):
        self.first = first
        super().__init__(f"the Idempotency-Key names request {first} now")


class LeaseLapsed(Exception):
    """A replica's node holds no lease under the replica's epoch (its agent stopped renewing it): it
    takes nothing until the lease is renewed. Not a fence: the node may only be slow."""


class WrittenOff(Fenced):
    """A replica the control plane wrote off tried to take a request: it may take none. Whatever
    it held was given back when it was written off, so it can end at once and lose nothing."""


# The second half of a take, sent in the same round trip as the (blocking) move that precedes it:
# the id just moved is at the head of the processing list and still `queued` or `waking` (every id
# a take has handled is `dispatched` or later), so a move that found nothing leaves nothing to do.
# The request's key is derived from the id here, not declared: fine on one Redis, not a cluster.
# Stamped with the server's clock: the replica's would be from before the wait for a request.
# A replica written off (KEYS[2] set, or its node's epoch raised past the one it was started under:
# gpuportal.wire.node_lease) takes nothing: an id its move just brought in goes back to the end of
# the queue takes read from, and it is told (-1). Checked here, in the step that makes a request
# the replica's, so that a take racing the write-off either ends before it (and the write-off gives
# the request back) or after it (and is refused): none is left with a replica that nobody will hear
# from again. A replica whose node's lease is not held under its epoch (the agent stopped renewing
# it: frozen, or cut off) gives the id back the same way and is told to wait (-2): it takes again
# once the lease is renewed, and is written off if it is not.
# KEYS: processing list, written-off marker, the deployment's queue, the node's epoch, its lease.
# ARGV: replica id, request key prefix, the replica's node epoch or '' (not fenced by a node).
_MARK_TAKEN = """
local id = redis.call('LINDEX', KEYS[1], 0)
local refused = 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  refused = -1
elseif ARGV[3] ~= '' then
  if tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[3]) then
    refused = -1
  elseif redis.call('GET', KEYS[5]) ~= ARGV[3] then
    refused = -2
  end
end
if refused ~= 0 then
  if id then
    local status = redis.call('HGET', ARGV[2] .. id, 'status')
    if status == 'queued' or status == 'waking' then
      redis.call('LPOP', KEYS[1])
      redis.call('RPUSH', KEYS[3], id)
    end
  end
  return refused
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

# One streamed chunk, under the same fences as the request's end (_END): not from a replica that no
# longer holds the request (-1), nor under a superseded failover epoch (0) or node epoch (-2).
# KEYS: request, stream, the pair's epoch (or any key when unfenced), the node's epoch (or any key),
# the stream's bell. ARGV: replica id or '', pair epoch or '', node epoch or '', the chunk, ttl,
# the bell's ttl.
_CHUNK = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[3]) then return -2 end
if ARGV[1] ~= '' then
  local owner = redis.call('HGET', KEYS[1], 'replica')
  if owner and owner ~= ARGV[1] then return -1 end
end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('RPUSH', KEYS[5], 1)
redis.call('EXPIRE', KEYS[5], ARGV[6])
return 1
"""

# A submit, whole or not at all (a Redis killed mid-way leaves no request half written: its
# hash without its place in the queue would be waited on for ever). With ARGV[5] '1', one that needs
# no database read: queued only if a replica of the deployment claims to be taking requests
# (gp:live, renewed by its takes, withdrawn before it stops taking), so that nothing has to be
# woken. Otherwise nothing is queued, and a refusal token is pushed where the blocking read sent
# in the same round trip waits, so that it returns at once: the web then admits the request the
# long way (the database says what to wake, or why not), and submits it again with '0'.
#
# Under an Idempotency-Key, only while the key still names this request (else -1, nothing
# written): a claim whose request was not written yet is taken over by a retry
# (_CLAIM_IDEMPOTENCY_KEY), and the first submit, only slow (its client gave up while the database
# admitted it), must then not queue a second copy beside the retry's.
#
# Only before its deadline (ARGV[7], on Redis's clock; '' for none), else -3 and nothing written: a
# Redis frozen (SIGSTOP, a stalled disk) runs the commands it received once it resumes, by when
# the web may have given up on the answer and said 503, which must mean "not run".
# KEYS: live set, request, queue, done, count, the owner's index, everyone's index, the
# Idempotency-Key's (or any key). ARGV: request id, ttl, count ttl or '', created at, whether to
# ask gp:live, whether the key must name it, the deadline, then the request's field/value pairs.
_SUBMIT = """
local t = redis.call('TIME')
local at = tonumber(t[1]) + tonumber(t[2]) / 1000000
if ARGV[7] ~= '' and at > tonumber(ARGV[7]) then
  redis.call('RPUSH', KEYS[4], 'refused')
  redis.call('EXPIRE', KEYS[4], 60)
  return -3
end
if ARGV[6] == '1' and redis.call('GET', KEYS[8]) ~= ARGV[1] then
  redis.call('RPUSH', KEYS[4], 'refused')
  redis.call('EXPIRE', KEYS[4], 60)
  return -1
end
if ARGV[5] == '1' then
  if redis.call('ZCOUNT', KEYS[1], at, '+inf') == 0 then
    redis.call('RPUSH', KEYS[4], 'refused')
    redis.call('EXPIRE', KEYS[4], 60)
    return 0
  end
else
  -- An `if_live` submit of the same id that queued nothing left its refusal where the blocking
  -- read waits: it is not this request's end.
  redis.call('DEL', KEYS[4])
end
redis.call('HSET', KEYS[2], unpack(ARGV, 8))
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

# An Idempotency-Key's request: the id of the request first accepted under the key, if it is still
# there; else the key is this request's (`ARGV[1]`) from now on. A key whose request was never
# written (Redis died between the claim and the submit) is taken over, so a retry runs it once.
# KEYS: the key's own. ARGV: the new request's id, ttl, the request key's prefix.
_CLAIM_IDEMPOTENCY_KEY = """
local first = redis.call('GET', KEYS[1])
if first and redis.call('EXISTS', ARGV[3] .. first) == 1 then
  return first
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""


def idempotency_key(owner: str, key: str) -> str:
    """An owner's own keys: another caller's same key is another request. Hashed: a key is the
    caller's text, of any characters."""
    return f"gp:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"


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

# Ask the replica that holds a request to stop generating it (its caller left, or cancelled it):
# the why goes into the request (`stop_asked`, which a replica that takes it again after a requeue
# reads: inference.serving ends it at once) and into the holder's stops (stops_key), which the
# holder reads between its steps. Only a request a replica holds (dispatched or running): a
# waiting one is cancelled where it waits (Submitting.cancel), an ended one has nothing to stop.
# In one step, so that a requeue either comes first (the request is waiting: 0, the caller
# cancels it there) or after (the ask travels with it). The holder's key is derived here from the
# request's `replica`, as _MARK_TAKEN derives the request's: fine on one Redis, not a cluster.
# KEYS: request. ARGV: why, the ask's ttl, the request's id, the stops key's prefix and suffix.
_ASK_STOP = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'dispatched' and status ~= 'running' then return 0 end
local replica = redis.call('HGET', KEYS[1], 'replica')
redis.call('HSET', KEYS[1], 'stop_asked', ARGV[1])
if replica and replica ~= '' then
  local stops = ARGV[4] .. replica .. ARGV[5]
  redis.call('HSET', stops, ARGV[3], ARGV[1])
  redis.call('EXPIRE', stops, ARGV[2])
end
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
# - behind its node's epoch when ARGV[10] is not empty: a replica of a node written off since it
#   started has nothing more accepted (gpuportal.wire.node_lease);
# - the token pushed to gp:done:<id> carries the final fields (all but input and params), so a
#   waiter has the answer in the same round trip as its wake-up, with no read of the hash after.
# - a compact record of it (times, token counts from the answer's `usage`, status) goes onto
#   gp:records, which the control plane drains into PostgreSQL (scheduling.services.traffic): the
#   capacity planner's recorded traffic, kept past the request's own TTL. Capped at ARGV[7]
#   entries, oldest dropped, should nothing drain it. The token counts come as arguments, read
#   from the answer by the caller: decoding the answer here (an embedding call's can be megabytes)
#   would hold Redis, which runs one script at a time, for every request's end.
# KEYS: epoch (or any key when unfenced), request, stream, done, processing, last, finished count,
# records, the node's epoch (or any key), the stream's bell. ARGV: epoch or '', request id, ttl,
# now, stream end marker, replica id or '', the records' cap, prompt tokens or '', output tokens or
# '', node epoch or '', the bell's ttl, then the request's field/value pairs.
_END = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[10] ~= '' and tonumber(redis.call('GET', KEYS[9]) or '0') > tonumber(ARGV[10]) then return -2 end
if ARGV[6] ~= '' then
  local owner = redis.call('HGET', KEYS[2], 'replica')
  if owner and owner ~= ARGV[6] then return -1 end
end
redis.call('HSET', KEYS[2], unpack(ARGV, 12))
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('RPUSH', KEYS[10], 1)
redis.call('EXPIRE', KEYS[10], ARGV[11])
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
  id = ARGV[2], deployment = final['deployment'], kind = final['record_kind'] or final['kind'],
  status = final['status'],
  created_at = final['created_at'], started_at = final['started_at'], finished_at = final['finished_at'],
  first_token_at = final['first_token_at'],
  prompt_tokens = tonumber(ARGV[8]), output_tokens = tonumber(ARGV[9])}))
redis.call('LTRIM', KEYS[8], -tonumber(ARGV[7]), -1)
return 1
"""


# How a request failed that its caller is to fix (its `error_kind`), each a 400: input the model
# cannot take, and of that a prompt plus max_tokens past the model's context or the replica's KV
# cache (OpenAI's `context_length_exceeded`, on which its clients' users trim a conversation).
BAD_INPUT = "bad_input"
TOO_LONG = "too_long"
CALLERS_INPUT = frozenset({BAD_INPUT, TOO_LONG})


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
    # Of a failed request: in how many seconds asking again may succeed, where that is known
    # (a wake that failed only for replicas inside their min_runtime).
    retry_after_s: int | None = None
    created_at: float | None = None
    dispatched_at: float | None = None
    started_at: float | None = None
    # Of a generation done by a batching replica: when its first token was sampled.
    first_token_at: float | None = None
    finished_at: float | None = None
    # Why its caller asked it stopped while a replica held it ('' if never): see _ASK_STOP.
    stop_asked: str = ""

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
            retry_after_s=int(data["retry_after_s"]) if data.get("retry_after_s") else None,
            created_at=stamp("created_at"),
            dispatched_at=stamp("dispatched_at"),
            started_at=stamp("started_at"),
            first_token_at=stamp("first_token_at"),
            finished_at=stamp("finished_at"),
            stop_asked=data.get("stop_asked", ""),
        )


def picked_piece(text: str, entries: list[dict[str, Any]]) -> str:
    """A streamed piece of text with the log probabilities of the tokens it brings."""
    return STREAM_PICKS + json.dumps([text, entries])


def read_piece(chunk: str) -> tuple[str, list[dict[str, Any]] | None]:
    """A stream entry's text, and the log probabilities it carries (None: none)."""
    if chunk.startswith(STREAM_PICKS):
        text, entries = json.loads(chunk[len(STREAM_PICKS) :])
        return text, entries
    return chunk, None


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

    def feed_piece(self, chunk: str) -> tuple[str, list[dict[str, Any]] | None]:
        """`feed`, for an entry that may carry its tokens' log probabilities: the text to send,
        and those log probabilities where the whole piece is sent (a re-run's piece that repeats
        what was sent already carries none, its tokens' having gone out with the first run's)."""
        if chunk == STREAM_RESTART:
            return self.feed(chunk), None
        piece, entries = read_piece(chunk)
        text = self.feed(piece)
        return text, entries if text and text == piece else None
