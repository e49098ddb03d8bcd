"""A transactional test's flush, tried again when PostgreSQL breaks a deadlock by failing it.

The session's agents worker (tests/conftest.py) outlives each test's agents: a call that an agent
sent just before it was killed at the test's end may still be applied while the test's rows are
truncated. Each holds a lock the other wants, PostgreSQL fails one of them, and when that is the
TRUNCATE the next test would start on the last one's rows. The TRUNCATE is rolled back whole, so
trying it again once the call's transaction is over is safe."""

from __future__ import annotations

from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_fixed

ATTEMPTS = 5


def _deadlock(err: BaseException) -> bool:
    from django.db.utils import OperationalError

    return isinstance(err, OperationalError) and "deadlock detected" in str(err)


def flush_through_deadlocks() -> None:
    from django.db.backends.base.operations import BaseDatabaseOperations

    flush = BaseDatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: Any, sql_list: list[str]) -> None:
        retrying = Retrying(
            retry=retry_if_exception(_deadlock), stop=stop_after_attempt(ATTEMPTS), wait=wait_fixed(0.2), reraise=True
        )
        retrying(flush, self, sql_list)

    BaseDatabaseOperations.execute_sql_flush = execute_sql_flush  # type: ignore[method-assign]
