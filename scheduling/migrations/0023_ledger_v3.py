"""The ledger's read and commit functions run without JIT compilation (ledger_read_v3.sql,
ledger_commit_v3.sql), the read returns each GPU's node id (a placement's replica row points at
it; the services looked the GPUs up again for it), and a commit that conflicts lets go of the GPU
rows it locked (the ledger calls it without a savepoint now).

Both functions set `enable_seqscan = off` so that PostgreSQL probes indexes at any table size;
that prices every sequential scan (even of the one-row generation table) at 10^10, past
`jit_above_cost`, so a server built with LLVM compiled the read's plan on every call: 7 ms of its
CPU per call (40 ms on a session's first), against 0.2 ms for the read itself. The services' Mirror
refresh was the largest cost of a scale call through them (bench/placement).
"""

from pathlib import Path

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "sql"
DROP_READ = "DROP FUNCTION IF EXISTS gpuportal_ledger_read(text, bigint[], bigint[])"


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0022_host_cache")]

    operations = [
        # Its rows gain a column (the node's id): a new return type, so dropped and created again.
        migrations.RunSQL(
            [DROP_READ, (SQL / "ledger_read_v3.sql").read_text()],
            [DROP_READ, (SQL / "ledger_read_v2.sql").read_text()],
        ),
        migrations.RunSQL((SQL / "ledger_commit_v3.sql").read_text(), (SQL / "ledger_commit_v2.sql").read_text()),
    ]
