"""Token authentication that remembers a good token for a few seconds.

Every API request authenticates, and on the inference hot path that look-up is one of its few
database round trips (within the request path's overhead budget). A token seen valid within the last
GPUPORTAL_TOKEN_CACHE_S seconds is trusted again without asking; the price is that a revoked
token, or a deactivated user, is refused that much later. 0 turns the cache off.

Past that, for GPUPORTAL_TOKEN_STALE_S more, it is still trusted at once while a thread looks it
up again (gpuportal.remembered), so a frozen database does not hold up the request; the look-up
that finds it revoked forgets it, and the next request is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed, Throttled

from gpuportal import throttle
from gpuportal.remembered import Remembered

_tokens: Remembered[tuple[Any, Any]] = Remembered(
    "token",
    lambda: settings.GPUPORTAL_TOKEN_CACHE_S,
    lambda: settings.GPUPORTAL_TOKEN_STALE_S,
    forget_on=(AuthenticationFailed,),
)


class CachedTokenAuthentication(TokenAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        return self.counted(request, lambda: super(CachedTokenAuthentication, self).authenticate(request))

    @staticmethod
    def counted(request: Any, attempt: Callable[[], tuple[Any, Any] | None]) -> tuple[Any, Any] | None:
        """`attempt`'s user and token; a failure counted against the caller's address, which is
        refused for a while once it has failed too often (gpuportal.throttle)."""
        try:
            return attempt()
        except AuthenticationFailed:
            # Counted only when a token fails: a good token costs no Redis round trip here.
            names = throttle.keys(throttle.address_of(request))
            wait = throttle.wait_s(names)
            if wait is not None:
                raise Throttled(wait=wait, detail=throttle.too_many(wait)) from None
            throttle.failed(names)
            raise

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        look_up = super().authenticate_credentials  # raises for a bad or inactive token
        if settings.GPUPORTAL_TOKEN_CACHE_S <= 0:
            return look_up(key)
        return _tokens.get(key, lambda: look_up(key))


class BearerTokenAuthentication(CachedTokenAuthentication):
    """The same tokens sent the way OpenAI clients, and most HTTP tools, send keys:
    `Authorization: Bearer <key>`. Taken on every path, /api as /v1: a valid token is not refused
    for its keyword."""

    keyword = "Bearer"


# Where Anthropic's clients send a key (`x-api-key: <key>`: Claude Code, the Messages API's own
# examples), as Django's request.META names the header.
API_KEY_HEADER = "HTTP_X_API_KEY"


class ApiKeyAuthentication(CachedTokenAuthentication):
    """The same tokens sent as Anthropic's clients send keys, in an `x-api-key` header: taken on
    the /v1 endpoints (scheduling.api.openai_compat.OpenAIView), where such clients call."""

    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        key = request.META.get(API_KEY_HEADER, "").strip()
        if not key:
            return None  # another authentication's to read
        return self.counted(request, lambda: self.authenticate_credentials(key))


def user_from_api_key(request: Any) -> Any | None:
    """The user of a valid `x-api-key` header, or None (as user_from_header)."""
    key = request.META.get(API_KEY_HEADER, "").strip()
    if not key or " " in key:
        return None
    try:
        user, _ = _authenticator.authenticate_credentials(key)
    except AuthenticationFailed:
        return None
    return user


# The header's keywords a token may come under, on every path.
KEYWORDS = ("Token", BearerTokenAuthentication.keyword)


def forget_tokens() -> None:
    """Drop every remembered token (tests; or an operator who just revoked one)."""
    _tokens.forget()


_authenticator = CachedTokenAuthentication()


def user_from_header(request: Any, keywords: tuple[str, ...] = KEYWORDS) -> Any | None:
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
