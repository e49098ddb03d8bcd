"""What a request gets when a dependency blinks or its body is too big: a JSON answer
naming what is wrong, never Django's HTML 500 or 400.

- PostgreSQL or Redis unreachable: 503 naming the dependency, with Retry-After. A client (the
  OpenAI SDK among them) retries a 503 by itself; a 500 says the portal is broken.
- A deadlock or serialization failure that escaped the commit path's retries: 503 too, since
  the same call made again succeeds.
- A body over DATA_UPLOAD_MAX_MEMORY_SIZE: 413.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import kombu.exceptions
import redis
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

from scheduling.api.error_shapes import reshaped_response, shape_of
from scheduling.locks import RETRYABLE

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2


def outage_response(exc: BaseException, *, openai: bool = False) -> JsonResponse | None:
    """The JSON answer for an outage or an oversized body; None for any other error. `openai`:
    in the shape of OpenAI's errors, for /v1 (its clients read `error.message`)."""
    if isinstance(exc, RequestDataTooBig):
        return _answer(413, f"request body too large: {exc}", "request_too_large", openai)
    if isinstance(exc, OperationalError) and isinstance(exc.__cause__, RETRYABLE):
        detail = "the database asked to retry (a deadlock or a serialization failure)"
        return _answer(503, detail, "postgresql", openai)
    if isinstance(exc, OperationalError | InterfaceError):
        return _answer(503, "the database is unreachable", "postgresql", openai)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | kombu.exceptions.OperationalError):
        return _answer(503, "Redis (the request queues and the task broker) is unreachable", "redis", openai)
    return None


def _answer(status: int, detail: str, code: str, openai: bool) -> JsonResponse:
    if status == 503:
        detail = f"{detail}; retry shortly"
    if openai:
        body = {"error": {"message": detail, "type": "server_error" if status == 503 else "invalid_request_error"}}
        body["error"]["code"] = code
    else:
        body = {"detail": detail, "dependency": code} if status == 503 else {"detail": detail}
    response = JsonResponse(body, status=status)
    if status == 503:
        response["Retry-After"] = str(RETRY_AFTER_S)
    return response


class OutageMiddleware:
    """Turns what a view raised for an outage into its JSON answer (see outage_response)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        shape = shape_of(request)  # Anthropic's or Ollama's, where the view speaks their API
        response = outage_response(exception, openai=shape is not None or request.path.startswith("/v1/"))
        if response is not None and response.status_code == 503:
            log.warning("%s %s answered 503: %s", request.method, request.path, exception)
        return reshaped_response(shape, response) if response is not None and shape is not None else response
