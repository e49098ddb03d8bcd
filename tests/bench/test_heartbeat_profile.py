"""bench.heartbeat_profile keeps working: a small fleet set up through the real path, each kind
of beat applied as the agents' worker applies it and queued at a real agents' worker, and the
figures that say what a beat costs. Run as a user runs it, in a process of its own, on a
database and a Redis database of its own (it deletes the `agents` queue and runs a worker on it,
which must not meet the session's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from django.conf import settings

from tests.support.processes import database_url_of_this_test

ROOT = Path(__file__).resolve().parents[2]


def a_redis_database_of_its_own() -> str:
    """One of the server's 16 that no test process of this run uses (gpuportal.testing gives each
    the one after the session's, then one a worker)."""
    parts = urlsplit(settings.REDIS_URL)
    return urlunsplit(parts._replace(path=f"/{(int(parts.path.lstrip('/') or 0) + 8) % 16}"))


@pytest.mark.slow
@pytest.mark.django_db
def test_the_profile_measures_each_kind_of_beat_in_process_and_at_a_real_worker(tmp_path):
    url = a_redis_database_of_its_own()
    redis.Redis.from_url(url).flushdb()
    figures = tmp_path / "figures.json"
    database = f"hb_profile_{os.getpid()}"
    try:
        run = subprocess.run(
            [
                *(sys.executable, "-m", "bench.heartbeat_profile", "--nodes", "3", "--replicas", "1"),
                *("--beats", "20", "--profile-beats", "10", "--rounds", "1", "--worker-beats", "20"),
                *("--no-record", "--database", database, "--json", str(figures)),
            ],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": database_url_of_this_test(), "REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        redis.Redis.from_url(url).flushdb()
        base = database_url_of_this_test().rpartition("/")[0]
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")

    assert run.returncode == 0, run.stderr[-3000:]
    measured = {m["kind"]: m for m in json.loads(figures.read_text())["measured"]}
    assert set(measured) == {"idle", "hosting (simulated)", "hosting (agent)"}
    idle, simulated, agent = measured["idle"], measured["hosting (simulated)"], measured["hosting (agent)"]
    # A node that runs nothing beats in few statements, fewer than one that serves a replica, and
    # an agent's beat, which carries its processes' host RAM, reads at least what a simulated one does.
    assert 0 < idle["statements"] < simulated["statements"] <= agent["statements"]
    assert all(m["redis_round_trips"] >= 1 and m["cpu_ms"] > 0 and m["worker_per_s"] > 0 for m in measured.values())
    assert "the whole call (node_gateway.answer)" in idle["phases"]
    assert "| CPU ms per beat, agent_call in one process" in run.stdout
