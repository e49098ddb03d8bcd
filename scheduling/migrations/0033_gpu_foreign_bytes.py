"""Other tenants count: each GPU records what processes that are not the portal's replicas hold
on it (`foreign_bytes`), and the ledger keeps it out of `available_bytes` (ledger_commit_v4.sql),
its read returning it with each GPU (ledger_read_v5.sql). The `gpu.foreign` Event kind."""

from pathlib import Path

from django.db import migrations, models

SQL = Path(__file__).resolve().parent.parent / "sql"
DROP_READ = "DROP FUNCTION IF EXISTS gpuportal_ledger_read(text, bigint[], bigint[])"


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0032_node_credential")]

    operations = [
        migrations.AddField(
            model_name="gpu",
            name="foreign_bytes",
            field=models.BigIntegerField(db_default=0, default=0),
        ),
        migrations.AddConstraint(
            model_name="gpu",
            constraint=models.CheckConstraint(
                condition=models.Q(foreign_bytes__gte=0), name="gpu_foreign_not_negative"
            ),
        ),
        # Its rows gain a column: a new return type, so dropped and created again.
        migrations.RunSQL(
            [DROP_READ, (SQL / "ledger_read_v5.sql").read_text()],
            [DROP_READ, (SQL / "ledger_read_v4.sql").read_text()],
        ),
        migrations.RunSQL((SQL / "ledger_commit_v4.sql").read_text(), (SQL / "ledger_commit_v3.sql").read_text()),
    ]
