"""Errors in another API's shape: the portal's views answer OpenAI's (`{"error": {"message",
"type", "param", "code"}}`), and a view that speaks Anthropic's or Ollama's API gives each error
in that API's own, which its clients raise as their own exceptions. One place turns the one into
the other, the status and headers (Retry-After, x-should-retry) kept."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from django.http import JsonResponse
from django.http.response import HttpResponseBase
from rest_framework.response import Response


def message_of(body: Any) -> str:
    """What an OpenAI-shaped error says (or DRF's `detail`, or a check's errors by field:
    `{"messages.0.content": ["holds a NUL character ..."]}`)."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if "detail" in body:
            return str(body["detail"])
        return "; ".join(
            f"{field}: {' '.join(map(str, why)) if isinstance(why, list) else why}" for field, why in body.items()
        )
    return json.dumps(body)


class ReshapedErrors(ABC):
    """A view mixin (before the view it reshapes, in the bases): its errors as `shape` makes them."""

    @staticmethod
    @abstractmethod
    def shape(status: int, message: str) -> dict[str, Any]:
        """An error of `status` saying `message`, in the view's API's shape."""

    def handle_exception(self, exc: Exception) -> Response:
        answered = super().handle_exception(exc)  # type: ignore[misc]
        return Response(
            self.shape(answered.status_code, message_of(answered.data)),
            status=answered.status_code,
            headers={name: value for name, value in answered.items() if name.lower() != "content-type"},
        )

    def _answer_with_key(self, request: Any, body: Any, owner: str) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        code, answer = super()._answer_with_key(request, body, owner)  # type: ignore[misc]
        return (code, self.reshaped(code, answer)) if code >= 400 else (code, answer)

    def reshaped(self, status: int, answer: dict[str, Any] | HttpResponseBase) -> dict[str, Any] | HttpResponseBase:
        """An error answer (a body, or a response with headers) in this view's shape."""
        if isinstance(answer, dict):
            return self.shape(status, message_of(answer))
        if not isinstance(answer, JsonResponse):
            return answer
        return reshaped_response(self.shape, answer)


def reshaped_response(shape: Callable[[int, str], dict[str, Any]], answer: JsonResponse) -> JsonResponse:
    """`answer`, an error, in the shape `shape` makes, its status and headers kept."""
    converted = JsonResponse(
        shape(answer.status_code, message_of(json.loads(answer.content))), status=answer.status_code
    )
    for name, value in answer.items():
        if name.lower() not in ("content-type", "content-length"):
            converted[name] = value
    return converted


def shape_of(request: Any) -> Callable[[int, str], dict[str, Any]] | None:
    """The error shape of the view a request was routed to, where it speaks another API's (for
    what fails outside the view: an outage the middleware answers); None for the portal's own."""
    match = getattr(request, "resolver_match", None)
    view = getattr(getattr(match, "func", None), "view_class", None)
    return view.shape if isinstance(view, type) and issubclass(view, ReshapedErrors) else None
