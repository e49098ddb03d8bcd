"""The web side of the queue: submit a request, wait for it, read it, its stream and recent ones,
cancel it or stop it."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis

from gpuportal.wire.requestqueue._base import QueueBase
from gpuportal.wire.requestqueue.protocol import (
    _ASK_STOP,
    _CLAIM_IDEMPOTENCY_KEY,
    _SUBMIT,
    BELL_TTL_S,
    BLOCK_SLICE_S,
    COUNT_KIND,
    PROCESSING_PREFIX,
    RECORD_KIND,
    REQUEST_PREFIX,
    STOPS_SUFFIX,
    STOPS_TTL_S,
    STREAM_END,
    TTL_S,
    KeyTakenOver,
    Request,
    SubmitTooLate,
    done_key,
    family_of_kind,
    idempotency_key,
    index_keys,
    live_key,
    now,
    queue_key,
    request_key,
    stream_bell_key,
    stream_key,
    stream_readers_key,
)
from gpuportal.wire.sampling import COUNT_ONLY

# Redis reads a BLPOP timeout of 0 as for ever: a deadline all but reached still waits this long
# (and a wait is sliced as RequestQueue.wait's is: within the client's socket timeout).
BELL_MIN_WAIT_S = 0.01
# How long a reader of a stream that others read too waits before it reads again: a ring wakes
# one of them, and each of the others would otherwise read only at the end of its wait's slice.
SHARED_READ_WAIT_S = 0.05
# How often the web measures again how far Redis's clock is from its own (a submit's deadline is
# given on Redis's clock, so that a skew between hosts cannot refuse every submit).
CLOCK_CHECK_S = 300.0
# Where a submit's arguments hold its deadline until its connection is had (_submit_round_trip).
_DEADLINE = object()


class Submitting(QueueBase):
    # -- the web side --------------------------------------------------------------------------

    # Redis's clock less this process's, and when that was measured (time.monotonic()).
    _clock: tuple[float, float] | None = None

    def submit_deadline(self) -> str:
        """When Redis must have run a submit sent now, on Redis's clock, or '' for none: half the
        client's socket timeout from now (the web waits a second longer for its reply:
        `_submit_round_trip`), so that a submit Redis runs late (it was frozen) is refused before
        the web can have given up on it and said 503. A client with no socket timeout waits for
        the answer however late, and needs none."""
        timeout = self.redis.connection_pool.connection_kwargs.get("socket_timeout")
        if not timeout:
            return ""
        # The offset first: measuring it is a round trip, which must not age the time it is added to.
        offset = self._clock_offset()
        return repr(time.time() + offset + timeout / 2)

    def _clock_offset(self) -> float:
        measured = self._clock
        if measured is None or time.monotonic() - measured[1] > CLOCK_CHECK_S:
            before = time.time()
            seconds, micros = self.redis.time()
            # The middle of the round trip: off by half of it at most, far below the deadline.
            offset = seconds + micros / 1e6 - (before + time.time()) / 2
            self._clock = measured = (offset, time.monotonic())
        return measured[0]

    def claim_idempotency_key(self, owner: str, key: str, request_id: str) -> str:
        """The id of the request `owner` first sent under `key` while it is kept (TTL_S), or
        `request_id`, which the key names from now on: the caller then submits under that id."""
        first = self.redis.eval(
            _CLAIM_IDEMPOTENCY_KEY, 1, idempotency_key(owner, key), request_id, TTL_S, REQUEST_PREFIX
        )
        return first.decode() if isinstance(first, bytes) else str(first)

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
        under_key: tuple[str, str] | None = None,
    ) -> Request | None:
        """Queue a request. `count_in` (key, ttl): a counter incremented in the same round trip
        (the control plane's requests per minute). `if_live`: only if a replica of the deployment
        takes requests now (gp:live), else queue nothing and return None. `request_id`: its id,
        when the caller needs it first (a submit again after an `if_live` one queued nothing
        takes the same id); a new one by default. `under_key` (owner, Idempotency-Key): queued
        only while that key names `request_id`, else KeyTakenOver and nothing queued."""
        submitted = self._submit(
            deployment, kind, input, params, owner, status, count_in, wait_s=0.0, if_live=if_live,
            request_id=request_id, under_key=under_key,
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
        under_key: tuple[str, str] | None = None,
    ) -> tuple[Request, Request | None] | None:
        """Queue a request and wait up to `timeout` for its end: (as submitted, final or None);
        None if `if_live` and no replica takes requests now (nothing queued, as in `submit`).

        The submit and the first blocking read travel together, so a request answered within one
        blocking slice costs the web process a single round trip to Redis.
        """
        deadline = time.monotonic() + timeout
        submitted = self._submit(
            deployment, kind, input, params, owner, status, count_in, wait_s=min(timeout, BLOCK_SLICE_S),
            if_live=if_live, request_id=request_id, under_key=under_key,
        )  # fmt: skip
        if submitted is None:
            return None
        request, final = submitted
        if final is None and (left := deadline - time.monotonic()) > 0:
            try:
                final = self._wait_final(request.id, left)
            except redis.RedisError:
                # Accepted already: the caller answers with its id, to be polled once Redis is
                # back, rather than with an outage that would say it was not run.
                return request, None
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
        under_key: tuple[str, str] | None = None,
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
        # One script writes it whole (its hash, then its place in the queue, so a replica that takes
        # the id finds it); the blocking read travels in the same round trip, after it.
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
        if params.get(COUNT_ONLY):
            # Recorded as a kind of its own: a count generates nothing, and its few milliseconds
            # are no generation's latency (scheduling.services.traffic_stats leaves it out).
            fields[RECORD_KIND] = COUNT_KIND
        keys = [
            live_key(deployment, family_of_kind(kind)), key, queue_key(deployment), done_key(request.id),
            count_in[0] if count_in is not None else key, *index_keys(owner),
            idempotency_key(*under_key) if under_key is not None else key,
        ]  # fmt: skip
        count_ttl = count_in[1] if count_in is not None else ""
        args = [
            request.id, TTL_S, count_ttl, request.created_at, "1" if if_live else "0",
            "1" if under_key is not None else "0", _DEADLINE,
            *(x for kv in fields.items() for x in kv),
        ]  # fmt: skip
        # EVAL, not EVALSHA: a Redis that lost its scripts would refuse an EVALSHA while the
        # read behind it blocked for nothing. Redis caches the script by its digest anyway.
        replies = self._submit_round_trip(
            ("EVAL", _SUBMIT, len(keys), *keys, *args),
            done_key(request.id),
            max(0.01, min(wait_s, BLOCK_SLICE_S)) if wait_s > 0 else None,
        )
        if replies[0] == -3:
            raise SubmitTooLate(f"Redis ran the submit of request {request.id} after its deadline: nothing was queued")
        if replies[0] == -1:
            first = self.redis.get(keys[-1]) or b""
            raise KeyTakenOver(first.decode() if isinstance(first, bytes) else str(first))
        if if_live and not replies[0]:
            return None
        final = self._final(request.id, replies[1]) if wait_s > 0 else None
        return request, final

    def _submit_round_trip(self, submit: tuple[Any, ...], end: str, block_s: float | None) -> tuple[Any, Any]:
        """The submit's reply, and that of the blocking read of `end` behind it for `block_s` (None:
        no read, and None for its reply), in one round trip, each read on its own: a Redis that
        stops answering (killed, frozen) after the submit's reply leaves the read's None, since the
        request is accepted and its end can be waited for again; one that stops before it raises,
        so the caller knows which it was. A pipeline would lose the submit's reply with the read's.

        With a socket timeout (the web's), neither read waits longer than it must: the submit's a
        second past its deadline (Redis refuses it after that; a submit run just before it has its
        reply here well within that second, so a give-up never meets a written request), the
        blocking read its own block and a second: a frozen Redis holds a caller past its
        timeout_s by a few seconds at most."""
        pool = self.redis.connection_pool
        socket_s = pool.connection_kwargs.get("socket_timeout")
        bounded = bool(socket_s)
        submit_s = min(socket_s, socket_s / 2 + 1.0) if bounded else None
        connection = pool.get_connection()
        # The deadline from the moment the submit goes, not from before its connection was had: a
        # web process whose threads all submit at once (a burst) can wait seconds for a connection
        # and the interpreter's lock on a loaded host, and its submits were refused as late then
        # though Redis ran them at once.
        submit = tuple(self.submit_deadline() if arg is _DEADLINE else arg for arg in submit)
        try:
            commands = [submit] if block_s is None else [submit, ("BLMOVE", end, end, block_s, "RIGHT", "LEFT")]
            connection.send_packed_command(connection.pack_commands(commands))
            submitted = _read(connection, submit_s)
            if block_s is None:
                return submitted, None
            try:
                return submitted, _read(connection, block_s + 1.0 if bounded else None)
            except redis.RedisError:
                connection.disconnect()
                return submitted, None
        except BaseException:
            # A reply may still be on its way on this connection: it is never used again.
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

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

    def forget(self, request_id: str) -> bool:
        """Deletes a request that has ended, and what it was asked and answered: its hash, the
        token that carries its end, its stream, its places in the lists of requests. False for one
        unknown or not ended (a replica may still write to it). Its record in the traffic figures,
        which holds no text, stays."""
        request = self.get(request_id)
        if request is None or not request.final:
            return False
        mine, everyones = index_keys(request.owner)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(
                request_key(request_id),
                done_key(request_id),
                stream_key(request_id),
                stream_bell_key(request_id),
                stream_readers_key(request_id),
            )
            pipe.zrem(mine, request_id)
            pipe.zrem(everyones, request_id)
            pipe.execute()
        return True

    def stop(self, request_id: str, reason: str) -> str:
        """Stop a request wherever it is (its caller left, or cancelled it): "cancelled" where it
        still waited (as `cancel`); "stopping" where a replica holds it, which ends it `cancelled`
        between two of its steps, with what it generated until then; "" once it has ended."""
        # Looked at again when it moved between the look and the act: taken from the queue just
        # before the cancel, or given back to it just before the ask (its replica drained or died).
        for _ in range(3):
            request = self.get(request_id)
            if request is None or request.final:
                return ""
            if request.status in ("queued", "waking"):
                if self.cancel(request_id, reason):
                    return "cancelled"
                continue
            args = [reason, STOPS_TTL_S, request_id, PROCESSING_PREFIX, STOPS_SUFFIX]
            if self.redis.eval(_ASK_STOP, 1, request_key(request_id), *args):
                return "stopping"
        return ""

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

    @contextlib.contextmanager
    def reading(self, request_id: str) -> Iterator[None]:
        """Counted among the readers of a request's stream while in it: while there are others,
        read_stream passes on each ring of the bell that wakes it, and its waits are short. A
        reader that dies uncounted leaves the count one too high until the stream expires: its
        readers then pass rings nobody takes and poll, as correct as before."""
        readers = stream_readers_key(request_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.incr(readers)
            pipe.expire(readers, TTL_S)
            pipe.execute()
        try:
            yield
        finally:
            with contextlib.suppress(redis.RedisError):
                self.redis.decr(readers)

    def read_stream(self, request_id: str, start: int, timeout: float) -> tuple[list[str], bool]:
        """Chunks from index `start` on, waiting up to `timeout` for the first; and whether the
        stream has ended."""
        deadline = time.monotonic() + timeout
        bell = stream_bell_key(request_id)
        while True:
            with self.redis.pipeline(transaction=False) as pipe:
                # Silenced before the stream is read, in this order: a piece written after the read
                # rings it again, and one written before it is in the read.
                pipe.delete(bell)
                pipe.lrange(stream_key(request_id), start, -1)
                pipe.get(stream_readers_key(request_id))
                _, raw, readers = pipe.execute()
            shared = int(readers or 0) > 1
            if raw and shared:
                # The ring that woke this reader woke it alone: passed on, it wakes the next reader
                # waiting (which passes it on in turn while it finds something new: the last one
                # finds nothing, and the passing stops).
                with self.redis.pipeline(transaction=False) as pipe:
                    pipe.rpush(bell, 1)
                    pipe.expire(bell, BELL_TTL_S)
                    pipe.execute()
            chunks = [c.decode() for c in raw]
            ended = bool(chunks) and chunks[-1] == STREAM_END
            if ended:
                chunks = chunks[:-1]
            left = deadline - time.monotonic()
            if chunks or ended or left <= 0:
                if not ended and not chunks:
                    request = self.get(request_id)
                    ended = request is None or request.final
                return chunks, ended
            # A list has no blocking read from an offset: block on the bell its writers ring instead.
            # Where others read the stream too, each also reads it again soon: a ring passed on
            # may be deleted unheard by a reader that reads the stream itself meanwhile.
            slice_s = SHARED_READ_WAIT_S if shared else BLOCK_SLICE_S
            self.redis.blpop([bell], timeout=max(BELL_MIN_WAIT_S, min(left, slice_s)))


def _read(connection: Any, timeout: float | None) -> Any:
    """One reply, waited for `timeout` seconds at most (None: the connection's socket timeout)."""
    return connection.read_response() if timeout is None else connection.read_response(timeout=timeout)
