"""Answers between the planes (issue 17): a caller names a Redis list in what it sends, the other
side pushes one answer there, and the caller blocks on it. Not Celery's result backend: its Redis
consumer is not safe to share between a process's threads (a web server's, an agent's), and every
caller here waits on a thread of its own. Django-free."""

from __future__ import annotations

import json
import uuid
from functools import lru_cache
from typing import Any

import redis

# How long an unclaimed answer stays: a caller that gave up does not leave it for ever.
ANSWER_TTL_S = 300


class NoAnswer(RuntimeError):
    """The other side refused (its message), or did not answer in time."""


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
    got = client.blpop([reply_to], timeout=timeout_s)
    if got is None:
        raise NoAnswer(f"no answer to {what} within {timeout_s:.0f} s")
    body = json.loads(got[1])
    if not body.get("ok"):
        raise NoAnswer(f"{what}: {body.get('error')}")
    return body.get("answer")
