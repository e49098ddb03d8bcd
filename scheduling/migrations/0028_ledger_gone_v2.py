"""The GPU generation drawn from a sequence (ledger_gone_v2.sql): counted up from the row's value,
a deletion that rolled back after a Mirror read inside it left that value to be handed to the next
deletion, which the Mirror then took for one it had seen (its GPUs stayed in the snapshot)."""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql"


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0027_replica_arena_kept")]

    operations = [
        migrations.RunSQL(
            (SQL / "ledger_gone_v2.sql").read_text(),
            [
                # v1's function, without its table and triggers (there already): the body alone.
                "CREATE OR REPLACE FUNCTION gpuportal_ledger_gpus_gone() RETURNS trigger LANGUAGE plpgsql AS $fn$"
                + (SQL / "ledger_gone_v1.sql").read_text().split("$fn$")[1]
                + "$fn$",
                "DROP SEQUENCE IF EXISTS gpuportal_ledger_generation_seq",
            ],
        ),
    ]
