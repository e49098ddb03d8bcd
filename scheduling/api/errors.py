"""DRF's exception handler, plus the services' errors: each carries its status and a JSON body
that names the field or the reason."""

from __future__ import annotations

from typing import Any

from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from scheduling.services.errors import ServiceError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ServiceError):
        return Response(exc.body(), status=exc.status, headers=exc.headers())
    return drf_exception_handler(exc, context)
