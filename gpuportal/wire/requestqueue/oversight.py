"""The control plane's side of the queue: figures for metrics and the dashboard, each one round
trip; and what it does to requests for replicas it wrote off, deployments it deleted or cannot
place."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from gpuportal.wire.requestqueue._base import QueueBase
from gpuportal.wire.requestqueue.protocol import (
    FINAL,
    RECORDS_KEY,
    TTL_S,
    Request,
    finished_key,
    last_key,
    processing_key,
    queue_key,
    request_key,
    written_off_key,
)


class Overseeing(QueueBase):
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

    def live_requests(
        self, replica_ids: Iterable[str], deployments: Iterable[str], limit: int
    ) -> tuple[list[Request], int]:
        """What the replicas hold (dispatched or running), then what waits in the deployments'
        queues, oldest first, at most `limit` of them; and how many there are in all. Two round
        trips whatever the number of replicas and deployments: the lists, then the requests."""
        replicas, names = list(replica_ids), list(deployments)
        with self.redis.pipeline(transaction=False) as pipe:
            for replica_id in replicas:
                pipe.lrange(processing_key(replica_id), 0, limit - 1)
                pipe.llen(processing_key(replica_id))
            for name in names:
                pipe.lrange(queue_key(name), -limit, -1)  # the oldest are at the right
                pipe.llen(queue_key(name))
            replies = pipe.execute()
        held = [raw.decode() for ids in replies[0 : 2 * len(replicas) : 2] for raw in ids]
        waiting = [raw.decode() for ids in replies[2 * len(replicas) :: 2] for raw in reversed(ids)]
        total = sum(int(n) for n in replies[1::2])
        ids = (held + waiting)[:limit]
        with self.redis.pipeline(transaction=False) as pipe:
            for request_id in ids:
                pipe.hgetall(request_key(request_id))
            hashes = pipe.execute() if ids else []
        found = [Request.from_hash(i, raw) for i, raw in zip(ids, hashes, strict=True) if raw]
        return [r for r in found if not r.final], total

    def finished_counts(self) -> dict[str, int]:
        """Requests that ended, by final status, counted by whoever ended them."""
        counts = self.redis.mget([finished_key(status) for status in FINAL])
        return {status: int(count or 0) for status, count in zip(FINAL, counts, strict=True)}

    def record_counts(self, keys: Iterable[str]) -> dict[str, int]:
        """How many records each list (records_key) holds, in one round trip."""
        return dict(zip(*self._lengths(str, keys), strict=True))

    def hand_over_records(self, key: str) -> int:
        """Move the records in `key` (a node's list) onto the end of the web's, oldest first, for
        the drain to find once the node is no longer in the books: how many."""
        moved = 0
        while self.redis.lmove(key, RECORDS_KEY, "LEFT", "RIGHT") is not None:
            moved += 1
        return moved

    def records(self, count: int, key: str = RECORDS_KEY) -> list[dict[str, Any]]:
        """The oldest `count` records of ended requests (see _END) in `key` (records_key), read."""
        return [json.loads(raw) for raw in self.raw_records(count, key)]

    def raw_records(self, count: int, key: str = RECORDS_KEY) -> list[bytes]:
        """The oldest `count` records of ended requests in `key` as stored, left in place:
        `drop_raw_records` removes them once they are stored, so a drain that dies in between
        loses none."""
        return self.redis.lrange(key, 0, count - 1)

    def drop_raw_records(self, raw: list[bytes], key: str = RECORDS_KEY) -> None:
        """Exactly these records, wherever they are now. Not by count from the head: a drain
        running beside this one, or the cap's trim in _END, may have moved the head since they
        were read, and a trim by count would then drop records nobody stored. Each record holds
        its request's id, so no two are alike."""
        pipe = self.redis.pipeline(transaction=False)
        for item in raw:
            pipe.lrem(key, 1, item)
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

    def fail_queued(
        self, deployment: str, *, reason: str, kind: str = "placement", retry_after_s: int | None = None
    ) -> list[str]:
        """End every request waiting for `deployment`: it cannot be served (e.g. cannot wake);
        `retry_after_s`, when asking again may succeed, where that is known."""
        failed = []
        fields = {"error": reason, "error_kind": kind}
        if retry_after_s is not None:
            fields["retry_after_s"] = str(retry_after_s)
        while (raw := self.redis.rpop(queue_key(deployment))) is not None:
            request_id = raw.decode()
            self._end(request_id, "failed", fields)
            failed.append(request_id)
        return failed
