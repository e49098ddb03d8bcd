"""Token authentication that remembers a good token for a few seconds.

Every API request authenticates, and on the inference hot path that look-up is one of its few
database round trips (within the request path's overhead budget). A token seen valid within the last
GPUPORTAL_TOKEN_CACHE_S seconds is trusted again without asking; the price is that a revoked
token, or a deactivated user, is refused that much later. 0 turns the cache off.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from django.conf import settings
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed, Throttled

from gpuportal import throttle

# Enough for every live client of a portal; beyond it the cache starts over rather than grow.
MAX_ENTRIES = 10_000

_lock = threading.Lock()
_seen: dict[str, tuple[float, Any, Any]] = {}


class CachedTokenAuthentication(TokenAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        try:
            return super().authenticate(request)
        except AuthenticationFailed:
            # Counted only when a token fails: a good token costs no Redis round trip here.
            names = throttle.keys(throttle.address_of(request))
            wait = throttle.wait_s(names)
            if wait is not None:
                raise Throttled(wait=wait, detail=throttle.too_many(wait)) from None
            throttle.failed(names)
            raise

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        ttl = settings.GPUPORTAL_TOKEN_CACHE_S
        if ttl <= 0:
            return super().authenticate_credentials(key)
        now = time.monotonic()
        hit = _seen.get(key)
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        user, token = super().authenticate_credentials(key)  # raises for a bad or inactive one
        with _lock:
            if len(_seen) >= MAX_ENTRIES:
                _seen.clear()
            _seen[key] = (now + ttl, user, token)
        return user, token


def forget_tokens() -> None:
    """Drop every remembered token (tests; or an operator who just revoked one)."""
    with _lock:
        _seen.clear()


_authenticator = CachedTokenAuthentication()


def user_from_header(request: Any, keywords: tuple[str, ...] = ("Token",)) -> Any | None:
    """The user of a valid `Authorization: <keyword> <key>` header, or None for anything else
    (no header, another scheme, a bad or inactive token): a caller's fast path then hands the
    request to DRF, whose authentication says what is wrong."""
    keyword, _, key = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if keyword not in keywords or not key or " " in key.strip():
        return None
    try:
        user, _ = _authenticator.authenticate_credentials(key.strip())
    except AuthenticationFailed:
        return None
    return user
