"""What a control worker costs in CPU to start, with Django's system checks and without, side by
side in one run: the command `up` runs (`celery -A gpuportal worker -Q control`), started the
two ways in turn, each timed from its start to its `ready.` line.

    python -m bench.process_start [--starts 4] [--no-record]

Celery's Django fix-up runs the checks as a worker (and beat) imports its tasks unless
CELERY_SKIP_CHECKS is set; gpuportal/celery.py sets it, as the checks read the whole URLconf
(every view, DRF, the schema generator) and `migrate` and `up` run them once per release. `cpu` is
the worker's main process's own user and system time until it was ready (its pool's processes
are forked from it); the two ways alternate, so the machine's other load falls on both alike.
Runs on embedded PostgreSQL and Redis unless DATABASE_URL and REDIS_URL are set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.report import ROOT, record, table

WAYS = {"with the checks": "", "without (the default)": "1"}
TIMEOUT_S = 120.0


def start_cpu(env: dict[str, str], log: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one control worker from its start to `ready.`; then stopped."""
    began = time.monotonic()
    with log.open("w+") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "gpuportal", "worker", "-Q", "control"),
                *("--concurrency", "2", "-l", "info", "--without-gossip", "--without-mingle"),
                *("-n", f"bench-start-{os.getpid()}@%h"),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            while " ready." not in log.read_text():
                if process.poll() is not None or time.monotonic() - began > TIMEOUT_S:
                    raise SystemExit(f"the worker did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.02)
            wall = time.monotonic() - began
            times = psutil.Process(process.pid).cpu_times()
            return times.user + times.system, wall
        finally:
            process.kill()
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=4, help="starts each way (default 4)")
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    args = parser.parse_args()

    from gpuportal.stack import EmbeddedPostgres, EmbeddedRedis

    scratch = Path(tempfile.mkdtemp(prefix="gpuportal-bench-start-"))
    servers: list[EmbeddedPostgres | EmbeddedRedis] = []
    env = dict(os.environ)
    if not env.get("DATABASE_URL"):
        servers.append(EmbeddedPostgres(pgdata=scratch / "pg" / "data", durable=False))
        env["DATABASE_URL"] = servers[-1].start()
    if not env.get("REDIS_URL"):
        servers.append(EmbeddedRedis(data_dir=scratch / "redis", persist=False))
        env["REDIS_URL"] = servers[-1].start()
    try:
        measured: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for n in range(args.starts):
            for way, skip in WAYS.items():
                measured[way].append(start_cpu({**env, "CELERY_SKIP_CHECKS": skip}, scratch / f"{n}.log"))
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # the embedded servers' data and the workers' logs

    median = {way: statistics.median(cpu for cpu, _ in runs) for way, runs in measured.items()}
    rows = [
        [
            way,
            args.starts,
            f"{median[way]:.2f}",
            f"{statistics.median(wall for _, wall in runs):.2f}",
            f"{median[way] / median['with the checks']:.2f}",
        ]
        for way, runs in measured.items()
    ]
    shown = table(["control worker's start", "starts", "cpu s (median)", "wall s (median)", "cpu ratio"], rows)
    print(shown)
    if not args.no_record:
        record(
            "process-start",
            "Process start: a control worker with Django's system checks and without",
            "`python -m bench.process_start`: the worker `up` runs, from its start to `ready.`, the two "
            "ways in turn. A stack starts four such processes (the control and agents workers, beat, "
            "the agent), and the suite starts one or two with most tests that start processes.\n\n" + shown,
        )


if __name__ == "__main__":
    main()
