"""The ledger's hot path with plans PostgreSQL keeps: a leaner commit function, and the
snapshot read as a function too.

Profiling the placement benchmark found about a third of the database's CPU in the
planner: with array parameters PostgreSQL's plan cache judged a generic plan costlier than a
custom one, so it planned every statement of `gpuportal_ledger_commit` and the snapshot read
anew on every call. Both functions now set `plan_cache_mode = force_generic_plan` and keep one
plan per session. Because a cached plan must stay right as tables grow from empty (a fresh
cluster, a truncated ledger) and before any ANALYZE, they also rule out sequential scans and
hash and merge joins: every statement here looks rows up by key, so nested loops over index
probes are the right plan at any size, and a seq scan chosen while a table was empty would
otherwise be kept while it grows.

The commit does the same work as migration 0005's, row by row in small statements: a plan
writes a GPU or two, and PostgreSQL starts a small statement for less than a set-based one
over unnested arrays (starting plans was the largest cost left once planning was gone).

The read returns only GPUs written by transactions the caller's previous read did not see
(`p_seen`, that read's snapshot), instead of everything since that snapshot's xmin.

And indexes that every commit maintains but no query uses are dropped (see UNUSED_INDEXES).
"""

import importlib
from pathlib import Path

from django.db import migrations

# The functions as they were at this migration, in files of their own (SQL that can be
# read); a later change of either is a new file and a new migration.
SQL = Path(__file__).resolve().parent.parent / "sql"
COMMIT = (SQL / "ledger_commit_v2.sql").read_text()
READ = (SQL / "ledger_read_v1.sql").read_text()

DROP_READ = "DROP FUNCTION IF EXISTS gpuportal_ledger_read(text, bigint[])"

# Indexes every commit maintains but no query uses, dropped (each commit writes GPU rows, none
# of them a HOT update since changed_txid is indexed, an Occupant row and Events; every index
# on those tables is one more insert, and one more to open when the statement starts).
# - The `_like` (varchar_pattern_ops) indexes Django adds beside each indexed CharField serve
#   only LIKE 'prefix%'; nothing filters these columns by prefix (the admin's search is
#   icontains, '%term%', which no btree serves). The plain indexes stay.
# - The single-column foreign-key indexes on scheduling_gpu.node_id and
#   scheduling_occupant.gpu_id duplicate the leading column of a unique index
#   (gpu_unique_node_index, occupant_unique_gpu_replica), which serves the same lookups.
# Django's schema editor drops indexes with IF EXISTS, so later migrations of these fields work.
UNUSED_INDEXES = {
    "scheduling_event_kind_d8a2f68b_like": "scheduling_event (kind varchar_pattern_ops)",
    "scheduling_event_node_f98ffc80_like": "scheduling_event (node varchar_pattern_ops)",
    "scheduling_event_gpu_1222bc53_like": "scheduling_event (gpu varchar_pattern_ops)",
    "scheduling_event_deployment_a73d1436_like": "scheduling_event (deployment varchar_pattern_ops)",
    "scheduling_event_replica_5a983b9c_like": "scheduling_event (replica varchar_pattern_ops)",
    "scheduling_gpu_uuid_76be231c_like": "scheduling_gpu (uuid varchar_pattern_ops)",
    "scheduling_gpu_wake_lock_holder_id_c5adb90c_like": "scheduling_gpu (wake_lock_holder_id varchar_pattern_ops)",
    "scheduling_gpu_node_id_875d5730": "scheduling_gpu (node_id)",
    "scheduling_occupant_replica_id_48c1793e_like": "scheduling_occupant (replica_id varchar_pattern_ops)",
    "scheduling_occupant_gpu_id_105406f7": "scheduling_occupant (gpu_id)",
}
DROP_UNUSED = [f"DROP INDEX IF EXISTS {name}" for name in UNUSED_INDEXES]
CREATE_UNUSED = [f"CREATE INDEX IF NOT EXISTS {name} ON {target}" for name, target in UNUSED_INDEXES.items()]


def previous_commit() -> str:
    # The function as migration 0005 made it, to go back to.
    return importlib.import_module("scheduling.migrations.0005_ledger_commit_function").CREATE


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0010_failover_pairs")]

    operations = [
        migrations.RunSQL(COMMIT, previous_commit()),
        migrations.RunSQL(READ, DROP_READ),
        migrations.RunSQL(DROP_UNUSED, CREATE_UNUSED),
    ]
