"""The `Idempotency-Key` header of `/infer/`, `POST /api/requests/` and `/v1/*`: a retry with the
same key returns the request first accepted under it (its id, or its answer) and runs nothing
twice. A client that met a 503 or a cut connection cannot know whether its request was accepted;
with a key, sending it again is safe. Keys are each caller's own and kept as long as requests are
(gpuportal.wire.requestqueue.protocol)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter

HEADER = "Idempotency-Key"
MAX_LENGTH = 255

PARAMETER = OpenApiParameter(
    HEADER,
    str,
    OpenApiParameter.HEADER,
    required=False,
    description=(
        "Any text of up to 255 printable ASCII characters, new for each request the caller means. "
        "Sent again with the same key, the request is not run again: the answer is the first one's."
    ),
)


class BadKey(ValueError):
    """The header's value cannot be a key; the message says why."""


def key_of(request: Any) -> str | None:
    """The request's key, None without one; BadKey for a value that cannot be one."""
    raw = request.META.get("HTTP_IDEMPOTENCY_KEY")
    if raw is None:
        return None
    if not 1 <= len(raw) <= MAX_LENGTH or not raw.isascii() or not raw.isprintable():
        raise BadKey(f"{HEADER} must be 1 to {MAX_LENGTH} printable ASCII characters")
    return raw
