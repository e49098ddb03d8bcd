"""Each of `make test`'s processes rewrites the asserts of a third of the test files, and reads
the rest as the others wrote them.

pytest rewrites a test file's asserts as it imports it, and caches the result beside it only where
bytecode may be written: where PYTHONDONTWRITEBYTECODE is set (as on the machines this suite runs on
here) each of the three processes rewrote all 139 files, 13 s of CPU each on a 2-core machine, a
third of collecting the suite. Here the workers write the cache, and each imports the files in its
own turn, starting a third of the way further than the last, so that the others find most of them
rewritten. Collection itself, and what it collects, is unchanged: it finds the modules imported."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.dont_write_bytecode = False


def pytest_collection(session: pytest.Session) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count:
        return
    for path in turn(files_under(session.config.args), int(worker.removeprefix("gw")), int(count)):
        # One that fails to import, or skips itself whole, does so again where collection imports
        # it, and is reported there.
        with contextlib.suppress(Exception, pytest.skip.Exception, pytest.fail.Exception):
            importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))


def turn(files: list[Path], worker: int, count: int) -> list[Path]:
    """Every file, in the order worker `worker` of `count` imports them: from its own share on."""
    start = len(files) * worker // count
    return files[start:] + files[:start]


def files_under(args: list[str]) -> list[Path]:
    """The test files under what the session was asked to run, in one order for every worker."""
    found: set[Path] = set()
    for arg in args:
        path = (ROOT / arg.split("::", 1)[0]).resolve()
        if path.is_dir():
            found.update(path.rglob("test_*.py"))
        elif path.name.startswith("test_") and path.suffix == ".py":
            found.add(path)
    return sorted(p for p in found if p.is_relative_to(ROOT) and "__pycache__" not in p.parts)
