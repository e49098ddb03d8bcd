"""Liveness and readiness probes, unauthenticated so orchestrators can call them.

/healthz says the process answers (no I/O, so a slow database never gets a healthy web
process restarted); /readyz says it can do its work: the database and Redis both answer. Under
`up`, it also names the portal's processes that are down (a helper crash-looping, started again
and again): the web still serves then, so it stays ready, `"status": "degraded"`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from gpuportal.stackenv import read_status

# A probe must answer well inside an orchestrator's own timeout, even when a dependency hangs.
PROBE_TIMEOUT_S = 1.0


def check_database() -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


def check_redis() -> None:
    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S
    )
    try:
        client.ping()
    finally:
        client.close()


CHECKS: dict[str, Callable[[], None]] = {"database": check_database, "redis": check_redis}


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    results: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            check()
        except Exception as exc:  # any failure means not ready; the message says which and why
            results[name] = f"unreachable: {exc}"
        else:
            results[name] = "ok"
    ready = all(result == "ok" for result in results.values())
    down = read_status(Path(settings.GPUPORTAL_DATA_DIR))
    status = "unavailable" if not ready else "degraded" if down else "ready"
    return JsonResponse({"status": status, "checks": results, "down": down}, status=200 if ready else 503)
