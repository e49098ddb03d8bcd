"""The ledger's read computes whether a row was built from the caller's own writes beside its
occupants (ledger_read_v4.sql): as a separate EXISTS, PostgreSQL hashed every occupant of every
GPU for it whenever the caller's transaction had an id, as a scale call's has once it locks its
deployment (0.4 ms of server CPU per read, the largest single cost of a scale call). Same rows."""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql"


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0023_ledger_v3")]

    operations = [
        migrations.RunSQL((SQL / "ledger_read_v4.sql").read_text(), (SQL / "ledger_read_v3.sql").read_text()),
    ]
