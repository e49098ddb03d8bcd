"""For tests that run other processes (agents, replicas, `up`): where they find the test
database, and waiting on what they do, whose only trace is rows or HTTP answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def database_url_of_this_test() -> str:
    """The URL of the database this test runs on (pytest-django's test database)."""
    from django.db import connection

    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def wait_until(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    # Another process writes to PostgreSQL or answers HTTP: there is no Event to block on, so poll
    # with a deadline that fails the test with what was awaited.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
