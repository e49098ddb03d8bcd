"""What a request body may hold before any view reads it: JSON nested no deeper than a limit, and
no string PostgreSQL cannot store (a NUL character). Refused with a 400 that names the limit or
the field, where Python's parser would have recursed to a 500 or a NUL reached the database as
one. The REST API's parser (DEFAULT_PARSER_CLASSES) and the inference fast path both read
bodies through `loads`; `PathGuard` does the same for a path."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import JSONParser

# Deeper than any body the API takes (a chat's messages sit four levels down), far below where
# Python's recursive parser gives up.
MAX_DEPTH = 32
NUL = "\x00"


def loads(text: str | bytes) -> Any:
    """The body's JSON: ParseError (400) if it does not parse or nests past MAX_DEPTH, a
    ValidationError (400, naming the field) for a string holding a NUL character."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ParseError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise ParseError(f"JSON parse error - {exc}") from None
    check(value)
    return value


def _refuse_constant(name: str) -> Any:
    # Strict JSON, as DRF's own parser reads it (STRICT_JSON): Python's would take NaN and Infinity.
    raise ValueError(f"Out of range float values are not JSON compliant: {name!r}")


def check(value: Any) -> None:
    """Depth and NUL checks over a parsed value, walked without recursion."""
    todo: list[tuple[Any, str, int]] = [(value, "", 1)]
    while todo:
        item, path, depth = todo.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise ParseError(f"JSON nested deeper than {MAX_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str) and NUL in key:
                    raise ValidationError({_join(path, "key"): ["holds a NUL character, which cannot be stored"]})
                todo.append((child, _join(path, str(key)), depth + 1))
        elif isinstance(item, str) and NUL in item:
            raise ValidationError({path or "body": ["holds a NUL character, which cannot be stored"]})


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class GuardedJSONParser(JSONParser):
    """DRF's JSON parser, reading through `loads`."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        return loads(stream.read() if stream is not None else b"")


class PathGuard:
    """A path holding a NUL character (`%00`) names nothing the portal stores: a 400 before any
    view queries the database with it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if NUL in request.path:
            return JsonResponse({"detail": "the path holds a NUL character (%00), which no name can"}, status=400)
        return self.get_response(request)
