"""Change stamps on every row a snapshot reads, and a read that uses them.

The services decided on a full snapshot of every GPU, since a ledger Mirror, which reads only the
GPUs written since its last read, missed changes that write no GPU row: a node going offline or
draining, a replica's state, a deployment's fairness settings. Now the database stamps each of
those rows with the id of the transaction that changed what a snapshot reads of it (trigger
`gpuportal_ledger_stamp`, scheduling/sql/ledger_stamp_v1.sql; GPU rows on any write, a wake lock
or a measured context too), and the read (ledger_read_v2.sql) returns the GPUs built from a row
stamped since the caller's previous read, the GPUs with active preemption intents, the GPUs the
caller asks for again, whether a view was built from the caller's own uncommitted writes, and the
GPU generation, which deleting GPUs bumps (ledger_gone_v1.sql: a deleted GPU leaves no stamp).
"""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql"
STAMP = (SQL / "ledger_stamp_v1.sql").read_text()
GONE = (SQL / "ledger_gone_v1.sql").read_text()
READ = (SQL / "ledger_read_v2.sql").read_text()
PREVIOUS_READ = (SQL / "ledger_read_v1.sql").read_text()

TABLES = ("scheduling_gpu", "scheduling_node", "scheduling_replica", "scheduling_deployment")
UNSTAMP = [
    *(f"DROP TRIGGER IF EXISTS gpuportal_ledger_stamp ON {table}" for table in TABLES),
    "DROP FUNCTION IF EXISTS gpuportal_ledger_stamp()",
    # The GPU's column stays: it is a model field, stamped by the commit before this migration.
    *(f"ALTER TABLE {table} DROP COLUMN IF EXISTS changed_txid" for table in TABLES[1:]),
]
UNGONE = [
    "DROP TRIGGER IF EXISTS gpuportal_ledger_gpus_deleted ON scheduling_gpu",
    "DROP TRIGGER IF EXISTS gpuportal_ledger_gpus_truncated ON scheduling_gpu",
    "DROP FUNCTION IF EXISTS gpuportal_ledger_gpus_gone()",
    "DROP TABLE IF EXISTS gpuportal_ledger_generation",
]


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0019_embedding_loader")]

    operations = [
        migrations.RunSQL(STAMP, UNSTAMP),
        migrations.RunSQL(GONE, UNGONE),
        migrations.RunSQL(
            ["DROP FUNCTION IF EXISTS gpuportal_ledger_read(text, bigint[])", READ],
            ["DROP FUNCTION IF EXISTS gpuportal_ledger_read(text, bigint[], bigint[])", PREVIOUS_READ],
        ),
    ]
