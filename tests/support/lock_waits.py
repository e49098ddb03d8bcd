"""How many backends wait for a lock, as concurrency tests ask before they let go of the one they
hold. Counted in this database only: pg_locks lists the whole server's, and the suite's other
processes (pytest-xdist) run their own tests in their own databases on the same server, so a
wait of theirs would read as the one a test waits for, and let it go on too soon."""

from __future__ import annotations

_WAITING_HERE = """
    SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE NOT l.granted AND l.locktype = %s AND a.datname = current_database()
"""


def waiting(cursor, locktype: str) -> int:
    """Backends of this database waiting for a lock of `locktype` ('transactionid' for a row
    lock held by another transaction, 'advisory' for pg_advisory_xact_lock's)."""
    # pg_stat_activity is read once a transaction and kept (the tests ask inside theirs): the
    # backends that came since would not be seen without a fresh read.
    cursor.execute("SELECT pg_stat_clear_snapshot()")
    cursor.execute(_WAITING_HERE, [locktype])
    return int(cursor.fetchone()[0])
