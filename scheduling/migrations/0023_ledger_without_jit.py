"""The ledger's read and commit functions run without JIT compilation (ledger_read_v3.sql,
ledger_commit_v3.sql).

Both functions set `enable_seqscan = off` so that PostgreSQL probes indexes at any table size;
that prices every sequential scan (even of the one-row generation table) at 10^10, past
`jit_above_cost`, so a server built with LLVM compiled the read's plan on every call: 7 ms of its
CPU per call (40 ms on a session's first), against 0.2 ms for the read itself. The services' Mirror
refresh was the largest cost of a scale call through them (bench/placement).
"""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql"


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0022_host_cache")]

    operations = [
        migrations.RunSQL((SQL / "ledger_read_v3.sql").read_text(), (SQL / "ledger_read_v2.sql").read_text()),
        migrations.RunSQL((SQL / "ledger_commit_v3.sql").read_text(), (SQL / "ledger_commit_v2.sql").read_text()),
    ]
