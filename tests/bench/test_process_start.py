"""bench.process_start keeps working: a control worker started with Django's checks and without,
through the command `up` runs, on the session's database and Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.support.processes import database_url_of_this_test

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.django_db
def test_the_benchmark_starts_a_worker_each_way_and_tables_their_cpu():
    run = subprocess.run(
        [sys.executable, "-m", "bench.process_start", "--starts", "1", "--no-record"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url_of_this_test(), "REDIS_URL": settings.REDIS_URL},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in run.stdout.splitlines()[2:]}
    assert set(rows) == {"with the checks", "without (the default)"}, run.stdout
    for way, cells in rows.items():
        starts, cpu = int(cells[0]), float(cells[1])
        assert starts == 1 and cpu > 0, (way, cells)
    assert float(rows["with the checks"][3]) == 1.0, "the ratio is to the start with the checks"
