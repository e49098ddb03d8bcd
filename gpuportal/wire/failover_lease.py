"""The failover lease as a pair member's process reads and writes it: the control plane's
`scheduling_failoverlease` table, reached over the member's own PostgreSQL connection (the lock
is a session-level advisory lock, which only a connection of its own can hold). The table, the
columns and the statements are written here once; a test holds them to the model
(scheduling.models.FailoverLease), so a migration that renames a column fails there first, not
in a standby at takeover."""

from __future__ import annotations

# The first key of the two-key advisory lock form: keeps our locks apart from anyone else's.
LOCK_NAMESPACE = 0x6770  # "gp"

# The pair's session lock, on (LOCK_NAMESPACE, lease id): taken if free, waited for, given back.
TRY_LOCK = "SELECT pg_try_advisory_lock(%s, %s)"
LOCK = "SELECT pg_advisory_lock(%s, %s)"
UNLOCK = "SELECT pg_advisory_unlock(%s, %s)"

TABLE = "scheduling_failoverlease"
# Every column a member touches.
COLUMNS = ("id", "holder_id", "epoch", "granted_at", "reconnect_deadline", "server_started_at", "closed_at")

# NO KEY UPDATE: enough to serialise claims, and it does not wait for transactions that merely
# reference the lease (a Replica row written with this lease_id). The row, then the server's
# clock and start time, read under the same lock.
READ_FOR_CLAIM = (
    f"SELECT holder_id, epoch, reconnect_deadline, server_started_at, closed_at IS NOT NULL, now(), "
    f"pg_postmaster_start_time() FROM {TABLE} WHERE id = %s FOR NO KEY UPDATE"
)
# Compare-and-swap on the epoch read above: (holder, new epoch, took over?, reconnect window s,
# server start, lease id, epoch read).
CLAIM = (
    f"UPDATE {TABLE} SET holder_id = %s, epoch = %s, "
    f"granted_at = CASE WHEN %s THEN now() ELSE granted_at END, "
    f"reconnect_deadline = now() + make_interval(secs => %s), server_started_at = %s "
    f"WHERE id = %s AND epoch = %s"
)
# Compare-and-swap on (holder, epoch): (reconnect window s, lease id, holder, epoch).
RENEW = (
    f"UPDATE {TABLE} SET reconnect_deadline = now() + make_interval(secs => %s), "
    f"server_started_at = pg_postmaster_start_time() WHERE id = %s AND holder_id = %s AND epoch = %s"
)
