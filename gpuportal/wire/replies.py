"""Answers between the planes: a caller names a Redis list in what it sends, the other
side pushes one answer there, and the caller blocks on it. Not Celery's result backend: its Redis
consumer is not safe to share between a process's threads (a web server's, an agent's), and every
caller here waits on a thread of its own. Django-free."""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Any

import redis

# How long an unclaimed answer stays: a caller that gave up does not leave it for ever.
ANSWER_TTL_S = 300
# The longest one BLPOP blocks. redis-py 8 gives every client a 5 s socket timeout, and a BLPOP
# that blocks longer reads nothing for as long and fails with "Timeout reading from socket": a
# deploy whose agent took 7 s to read the model's files (its first inspection imports
# transformers) got a 503 "Redis unreachable". So a wait blocks in slices, each well inside the
# client's socket timeout.
BLOCK_SLICE_S = 2.0


class NoAnswer(RuntimeError):
    """The other side refused (its message), or did not answer in time."""


class TimedOut(NoAnswer):
    """No answer came in time (the other side may still give one, to nobody)."""


@lru_cache(maxsize=4)
def client(url: str) -> redis.Redis:
    """One client (and its connection pool) per Redis URL for a process's answers, on every side."""
    return redis.Redis.from_url(url)


def new_list(kind: str) -> str:
    return f"gp:reply:{kind}:{uuid.uuid4().hex}"


def answer(client: redis.Redis, reply_to: str, *, result: Any = None, error: str | None = None) -> None:
    body = {"ok": True, "answer": result} if error is None else {"ok": False, "error": error}
    with client.pipeline() as pipe:
        pipe.rpush(reply_to, json.dumps(body))
        pipe.expire(reply_to, ANSWER_TTL_S)
        pipe.execute()


def wait(client: redis.Redis, reply_to: str, timeout_s: float, what: str) -> Any:
    """The answer pushed to `reply_to`; NoAnswer with the other side's message, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    block_s = _slice_s(client)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimedOut(f"no answer to {what} within {timeout_s:g} s")
        got = client.blpop([reply_to], timeout=max(0.01, min(left, block_s)))
        if got is not None:
            break
    body = json.loads(got[1])
    if not body.get("ok"):
        raise NoAnswer(f"{what}: {body.get('error')}")
    return body.get("answer")


def _slice_s(client: redis.Redis) -> float:
    socket_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    if not socket_timeout:
        return BLOCK_SLICE_S
    return min(BLOCK_SLICE_S, socket_timeout / 2)
