"""The ledger's compare-and-swap commit as one server-side function.

One call does what scheduling.ledger.commit describes: lock the plan's GPU rows in primary-key
order, check each version, apply releases and reservations, refuse an over-commit, recompute
available bytes, bump versions, record an Event per change. As one statement it needs no
BEGIN/COMMIT round trips of its own and holds the row locks only while the server runs it,
never while a client process waits for a CPU.
"""

from pathlib import Path

from django.db import migrations

# The function as it was at this migration, kept in a file of its own (SQL that can be read).
CREATE = (Path(__file__).resolve().parent.parent / "sql" / "ledger_commit_v1.sql").read_text()

DROP = (
    "DROP FUNCTION IF EXISTS gpuportal_ledger_commit("
    "bigint[], bigint[], text[], bigint[], text[], bigint[], text[], bigint[], text)"
)


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0004_gpu_changed_txid")]

    operations = [migrations.RunSQL(CREATE, DROP)]
