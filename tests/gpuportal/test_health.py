"""Liveness and readiness probes."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import Client

from gpuportal.stack import EmbeddedRedis
from gpuportal.stackenv import write_status


def test_healthz_answers_ok_without_auth_or_database() -> None:
    # No django_db mark: pytest-django would fail this test if the view touched the database.
    response = Client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.slow
@pytest.mark.django_db
def test_readyz_is_ready_while_database_and_redis_answer_and_503_naming_redis_once_it_stops(
    tmp_path: Path, settings
) -> None:
    redis_server = EmbeddedRedis(data_dir=tmp_path / "redis", persist=False)
    settings.REDIS_URL = redis_server.start()
    try:
        response = Client().get("/readyz")
        assert response.status_code == 200
        assert response.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}, "down": {}}
    finally:
        redis_server.stop()

    response = Client().get("/readyz")

    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"].startswith("unreachable: ")
    assert list(body["checks"]) == ["database", "redis"]


@pytest.mark.django_db
def test_readyz_names_the_database_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuportal import health

    def broken() -> None:
        raise RuntimeError("connection refused")

    monkeypatch.setitem(health.CHECKS, "database", broken)
    monkeypatch.setitem(health.CHECKS, "redis", lambda: None)

    response = Client().get("/readyz")

    assert response.status_code == 503
    assert response.json()["checks"] == {"database": "unreachable: connection refused", "redis": "ok"}


@pytest.mark.django_db
def test_readyz_names_the_processes_up_says_are_down_and_stays_ready(tmp_path: Path, settings, monkeypatch) -> None:
    from gpuportal import health

    monkeypatch.setitem(health.CHECKS, "redis", lambda: None)
    settings.GPUPORTAL_DATA_DIR = str(tmp_path)
    write_status(tmp_path, {"beat": "was killed by SIGKILL; starting it again"})

    response = Client().get("/readyz")

    # The web serves while beat crash-loops: a load balancer must keep sending it requests.
    assert response.status_code == 200
    assert response.json()["status"] == "degraded"
    assert response.json()["down"] == {"beat": "was killed by SIGKILL; starting it again"}
    write_status(tmp_path, {})
    assert Client().get("/readyz").json()["status"] == "ready"


def test_probes_refuse_other_methods() -> None:
    assert Client().post("/healthz").status_code == 405
