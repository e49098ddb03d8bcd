"""Failed sign-ins are limited: after GPUPORTAL_AUTH_FAILURES_PER_MINUTE failures from
one address, or for one user name, within a minute, that address or name gets a 429 with
Retry-After until the minute is over: the token endpoint, the admin's login and API tokens alike.

The counts live in Redis, so every web process sees the same ones. A Redis that is down does not
lock anyone out: the limit is then not enforced (a warning says so), and the request goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

log = logging.getLogger(__name__)

WINDOW_S = 60


@cache
def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)


def keys(address: str | None, username: str | None = None) -> list[str]:
    found = [f"gp:authfail:addr:{address}"] if address else []
    if username:
        found.append(f"gp:authfail:user:{username.lower()[:150]}")
    return found


def wait_s(names: list[str]) -> int | None:
    """Seconds until these may try again; None when none of them is over the limit."""
    if not names:
        return None
    try:
        with _client().pipeline() as pipe:
            for name in names:
                pipe.get(name)
                pipe.ttl(name)
            answers = pipe.execute()
    except redis.RedisError as err:
        log.warning("sign-in failures not limited: Redis unavailable (%s)", err)
        return None
    limit = settings.GPUPORTAL_AUTH_FAILURES_PER_MINUTE
    waits = [
        max(1, int(ttl))
        for count, ttl in zip(answers[::2], answers[1::2], strict=True)
        if count and int(count) >= limit
    ]
    return max(waits) if waits else None


def failed(names: list[str]) -> None:
    """Count one failure against each of these; the first one of a window starts its minute."""
    try:
        with _client().pipeline() as pipe:
            for name in names:
                # SET NX starts the window: EXPIRE's NX would need Redis 7, and Redis 6 still serves
                # all but the nodes' own users (docs/operating.md).
                pipe.set(name, 0, ex=WINDOW_S, nx=True)
                pipe.incr(name)
            pipe.execute()
    except redis.RedisError as err:
        log.warning("sign-in failure not counted: Redis unavailable (%s)", err)


def address_of(request: object) -> str | None:
    meta = getattr(request, "META", {})
    return meta.get("REMOTE_ADDR") or None


def forget() -> None:
    """Every count dropped (tests: one test's failures must not lock the next one out)."""
    client = _client()
    names = list(client.scan_iter("gp:authfail:*", count=10_000))
    if names:
        client.delete(*names)


def too_many(wait: int) -> str:
    return f"too many failed sign-ins from this address or for this user; retry in {wait} s"


def on_login_failed(sender: object, credentials: dict, request: object = None, **kwargs: object) -> None:
    """django.contrib.auth's user_login_failed: the admin's login form counts like the API's."""
    if request is not None:
        failed(keys(address_of(request), credentials.get("username")))


class AdminLoginThrottle:
    """A POST to the admin's login page from an address (or for a name) over the limit: 429."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method == "POST" and request.path == reverse("admin:login"):
            wait = wait_s(keys(address_of(request), request.POST.get("username")))
            if wait is not None:
                response = HttpResponse(too_many(wait), status=429, content_type="text/plain")
                response["Retry-After"] = str(wait)
                return response
        return self.get_response(request)
