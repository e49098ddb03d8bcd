"""What every side of the queue shares: its Redis client and the registered scripts."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Self

import redis

from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.node_lease import epoch_key as node_epoch_key
from gpuportal.wire.requestqueue.protocol import (
    _ANNOUNCE,
    _CHUNK,
    _END,
    _GIVE_BACK,
    _MARK_TAKEN,
    _RAISE_EPOCH,
    _START,
    BELL_TTL_S,
    RECORDS_KEY,
    RECORDS_MAX,
    STREAM_END,
    STREAM_RESTART,
    TTL_S,
    Fence,
    Fenced,
    NodeWrittenOff,
    NotTaken,
    Request,
    StaleEpoch,
    done_key,
    epoch_key,
    finished_key,
    last_key,
    now,
    processing_key,
    records_key,
    request_key,
    stream_bell_key,
    stream_key,
)

log = logging.getLogger(__name__)


class QueueBase:
    """The client and scripts, and the end of a request, which every side may write."""

    def __init__(self, client: redis.Redis):
        self.redis = client
        self._raise_epoch = client.register_script(_RAISE_EPOCH)
        self._end_script = client.register_script(_END)
        self._chunk = client.register_script(_CHUNK)
        self._mark_taken = client.register_script(_MARK_TAKEN)
        self._start = client.register_script(_START)
        self._give_back = client.register_script(_GIVE_BACK)
        self._announce = client.register_script(_ANNOUNCE)
        # A node's Redis user of an earlier release may write the shared records, not its own
        # (found at its first end, and then kept to).
        self._shared_records = False

    @classmethod
    def from_url(cls, url: str, **client: Any) -> Self:
        """A queue on its own client; `client`: redis-py's options (a socket timeout, say)."""
        return cls(redis.Redis.from_url(url, health_check_interval=30, **client))

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

    def chunk(
        self,
        request_id: str,
        text: str,
        replica_id: str = "",
        fence: Fence | None = None,
        node: NodeFence | None = None,
    ) -> None:
        """One piece of a streamed answer, refused (Fenced) where the request's end would be."""
        keys, args = _chunk_call(request_id, text, replica_id, fence, node)
        _refusal(self._chunk(keys=keys, args=args), request_id, replica_id, fence, node)

    def chunks(
        self,
        pieces: Sequence[tuple[str, str]],
        replica_id: str = "",
        fence: Fence | None = None,
        node: NodeFence | None = None,
    ) -> None:
        """Pieces of several streamed answers, (request id, text) in order, in one round trip: a
        batch step's tokens, one per streaming request. Each is refused where `chunk` would refuse
        it and the others still land; then the refusal is raised, a fence's (every piece's) before
        a request's that was given back (NotTaken, that request's alone)."""
        pipe = self.redis.pipeline(transaction=False)
        for request_id, text in pieces:
            keys, args = _chunk_call(request_id, text, replica_id, fence, node)
            self._chunk(keys=keys, args=args, client=pipe)
        refusals = []
        for (request_id, _), written in zip(pieces, pipe.execute(), strict=True):
            try:
                _refusal(written, request_id, replica_id, fence, node)
            except Fenced as refused:
                refusals.append(refused)
        if refusals:
            raise next((r for r in refusals if not isinstance(r, NotTaken)), refusals[0])

    def finish(
        self,
        request_id: str,
        replica_id: str,
        output: Any,
        fence: Fence | None = None,
        started_at: float | None = None,
        node: NodeFence | None = None,
        first_token_at: float | None = None,
    ) -> None:
        """The request's answer. `started_at`: when it started, if that was not written yet (a
        request that starts and ends within one batch step has both in one round trip).
        `first_token_at`: when its first token was sampled, where the replica's batcher knows."""
        fields = self._answered(output, started_at, first_token_at)
        usage = output.get("usage") if isinstance(output, dict) else None
        self._end(request_id, "done", fields, replica_id=replica_id, fence=fence, usage=usage, node=node)

    @staticmethod
    def _answered(output: Any, started_at: float | None, first_token_at: float | None) -> dict[str, Any]:
        """The fields a replica's answer (whole, or stopped as asked) writes beside its status;
        an output of None writes none."""
        fields: dict[str, Any] = {} if output is None else {"output": json.dumps(output)}
        if started_at is not None:
            fields["started_at"] = started_at
        if first_token_at is not None:
            fields["first_token_at"] = first_token_at
        return fields

    def fail(
        self,
        request_id: str,
        replica_id: str,
        error: str,
        kind: str,
        fence: Fence | None = None,
        node: NodeFence | None = None,
    ) -> None:
        fields = {"error": error, "error_kind": kind}
        self._end(request_id, "failed", fields, replica_id=replica_id, fence=fence, node=node)

    def raise_epoch(self, fence: str, epoch: int) -> int:
        """Make `epoch` the pair's current one (unless a later one already is); returns the current."""
        return int(self._raise_epoch(keys=[epoch_key(fence)], args=[epoch]))

    def _end(
        self,
        request_id: str,
        status: str,
        fields: dict[str, Any],
        replica_id: str = "",
        fence: Fence | None = None,
        usage: Any = None,
        node: NodeFence | None = None,
    ) -> None:
        values = {"status": status, "finished_at": now(), **fields}
        records = records_key(None if node is None or self._shared_records else node.node)
        keys = [
            epoch_key(fence.name) if fence is not None else request_key(request_id),
            request_key(request_id),
            stream_key(request_id),
            done_key(request_id),
            processing_key(replica_id),
            last_key(replica_id),
            finished_key(status),
            records,
            node_epoch_key(node.node) if node is not None else request_key(request_id),
            stream_bell_key(request_id),
        ]
        counts = usage if isinstance(usage, dict) else {}
        tokens = [counts.get(k, "") for k in ("prompt_tokens", "completion_tokens")]
        tokens = [n if isinstance(n, int) else "" for n in tokens]
        args = [_epoch(fence), request_id, TTL_S, now(), STREAM_END, replica_id, RECORDS_MAX, *tokens, _epoch(node)]
        args.append(BELL_TTL_S)
        args += [x for kv in values.items() for x in kv]
        try:
            answer = self._end_script(keys=keys, args=args)
        except redis.exceptions.NoPermissionError:
            if node is None or self._shared_records:
                raise
            # Perhaps its user's rules are an earlier release's, which grant the shared records
            # alone (Redis does not say which key it refused): tried there once.
            keys[keys.index(records)] = RECORDS_KEY
            answer = self._end_script(keys=keys, args=args)
            self._shared_records = True
            log.warning(
                "node %s's Redis user may not write %s: its requests' records go to %s, which every node's "
                "user may read; load the user anew (manage.py node_credential acl %s --apply)",
                node.node, records, RECORDS_KEY, node.node,
            )  # fmt: skip
        _refusal(answer, request_id, replica_id, fence, node)


def _epoch(fence: Fence | NodeFence | None) -> str:
    return str(fence.epoch) if fence is not None else ""


def _chunk_call(
    request_id: str, text: str, replica_id: str, fence: Fence | None, node: NodeFence | None
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of _CHUNK for one piece (an absent fence names the request's key)."""
    keys = [
        request_key(request_id),
        stream_key(request_id),
        epoch_key(fence.name) if fence is not None else request_key(request_id),
        node_epoch_key(node.node) if node is not None else request_key(request_id),
        stream_bell_key(request_id),
    ]
    return keys, [replica_id, _epoch(fence), _epoch(node), text, TTL_S, BELL_TTL_S]


def _refusal(written: int, request_id: str, replica_id: str, fence: Fence | None, node: NodeFence | None) -> None:
    """Raise what a write's script refused: 1 was written."""
    if written == 0:
        assert fence is not None
        raise StaleEpoch(f"epoch {fence.epoch} of failover pair {fence.name} is no longer current")
    if written == -1:
        raise NotTaken(f"request {request_id} is no longer held by replica {replica_id}: it was given back")
    if written == -2:
        assert node is not None
        raise NodeWrittenOff(
            f"node {node.node} was written off after replica {replica_id} started under its epoch {node.epoch}"
        )
