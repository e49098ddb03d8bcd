"""The replica side of the queue: claim a deployment's requests, take them, stream and finish
them under the replica's fence, give back what a drain cut short, stop what its caller asked
stopped."""

from __future__ import annotations

from typing import Any

import redis

from gpuportal.wire.node_lease import NodeFence, epoch_key, lease_key
from gpuportal.wire.requestqueue._base import QueueBase
from gpuportal.wire.requestqueue.protocol import (
    DELETED_TTL_S,
    FAMILIES,
    LIVE_TTL_S,
    REQUEST_PREFIX,
    STREAM_RESTART,
    TTL_S,
    Fence,
    LeaseLapsed,
    Request,
    WrittenOff,
    deleted_key,
    live_key,
    now,
    processing_key,
    queue_key,
    request_key,
    stops_key,
    stream_key,
    written_off_key,
)


class Serving(QueueBase):
    # -- the replica side ----------------------------------------------------------------------

    def take(self, deployment: str, replica_id: str, timeout: float, node: NodeFence | None = None) -> Request | None:
        """The oldest waiting request, moved atomically into this replica's processing list.

        Waits up to `timeout` seconds for one; timeout <= 0 only looks (a batch that must keep stepping).
        Under `node`'s fence (gpuportal.wire.node_lease): WrittenOff once its epoch was raised,
        LeaseLapsed while its lease is not held under that epoch.
        """
        return self._take(deployment, replica_id, timeout, None, node)[0]

    def take_renewing(
        self, deployment: str, replica_id: str, timeout: float, family: str, node: NodeFence | None = None
    ) -> tuple[Request | None, bool]:
        """`take`, renewing in the same round trip the replica's claim to take `family` requests
        (see `announce`); and whether the claim was still there to renew."""
        return self._take(deployment, replica_id, timeout, family, node)

    def _take(
        self, deployment: str, replica_id: str, timeout: float, renew: str | None, node: NodeFence | None
    ) -> tuple[Request | None, bool]:
        source, target = queue_key(deployment), processing_key(replica_id)
        keys = [target, written_off_key(replica_id), source]
        # Unfenced by a node, the node keys are any keys: the script never reads them then.
        keys += [epoch_key(node.node), lease_key(node.node)] if node is not None else [target, target]
        args = [replica_id, REQUEST_PREFIX, str(node.epoch) if node is not None else ""]
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
        if marked == -2:
            assert node is not None
            raise LeaseLapsed(f"node {node.node} holds no lease under epoch {node.epoch}: taking nothing until it does")
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

    def asked_stops(self, replica_id: str) -> dict[str, str]:
        """The requests this replica holds that their callers asked to stop since it last looked
        (id → why), cleared as they are read (an id it no longer holds is the caller's too-late ask)."""
        key = stops_key(replica_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.delete(key)
            asked, _ = pipe.execute()
        return {k.decode(): v.decode() for k, v in asked.items()}

    def stopped(
        self,
        request_id: str,
        replica_id: str,
        why: str,
        output: Any = None,
        fence: Fence | None = None,
        node: NodeFence | None = None,
        started_at: float | None = None,
        first_token_at: float | None = None,
    ) -> None:
        """End a request its caller asked to stop: `cancelled`, saying why, with what was
        generated until then (`output`; None for one stopped before it ran here), under the
        fences a `finish` is."""
        fields = {"error": why, **self._answered(output, started_at, first_token_at)}
        usage = output.get("usage") if isinstance(output, dict) else None
        self._end(request_id, "cancelled", fields, replica_id=replica_id, fence=fence, usage=usage, node=node)
