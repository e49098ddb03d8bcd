"""The suite's own plugin (gpuportal/testing/pytest_plugin.py) when `make test` runs the files in
several processes (pytest-xdist): each process's agents and replicas must see only its own queues."""

from __future__ import annotations

from gpuportal.testing.pytest_plugin import redis_url_of_worker


def test_each_worker_gets_a_redis_database_of_its_own_beside_the_sessions():
    base = "redis://:secret@127.0.0.1:6390/0"
    urls = [redis_url_of_worker(base, f"gw{n}") for n in range(4)]

    assert urls == [f"redis://:secret@127.0.0.1:6390/{n}" for n in (1, 2, 3, 4)]


def test_worker_databases_wrap_within_redis_sixteen_and_skip_the_sessions_own():
    assert redis_url_of_worker("redis://127.0.0.1:6379/14", "gw0").endswith("/15")
    assert redis_url_of_worker("redis://127.0.0.1:6379/14", "gw1").endswith("/0")
    assert redis_url_of_worker("redis://127.0.0.1:6379", "gw0").endswith("/1")
