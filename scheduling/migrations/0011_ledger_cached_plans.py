"""The ledger's hot path with plans PostgreSQL keeps: a leaner commit function, and the
snapshot read as a function too.

Profiling the placement benchmark (issue 3) found about a third of the database's CPU in the
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

from django.db import migrations

# One setting list for both functions; see the module docstring for why each is there.
PLAN_SETTINGS = """
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
"""

COMMIT = (
    r"""
CREATE OR REPLACE FUNCTION gpuportal_ledger_commit(
    p_ids bigint[], p_expected bigint[], p_labels text[],
    p_rel_gpu bigint[], p_rel_replica text[],
    p_res_gpu bigint[], p_res_replica text[], p_res_bytes bigint[],
    p_reason text
) RETURNS TABLE (gpu_id bigint, version bigint, available bigint, outcome text)
LANGUAGE plpgsql
"""
    + PLAN_SETTINGS
    + r"""
AS $fn$
DECLARE
    v_n int := cardinality(p_ids);
    v_current bigint[];   -- each GPU's version once locked, NULL if gone (in p_ids order)
    v_avail bigint[];     -- each GPU's available bytes once written (in p_ids order)
    v_version bigint;
    v_res_keys text[] := '{}';
    v_before bigint;
    v_used bigint;
    v_total bigint;
    v_at int;
    -- The Events, written last, once each GPU's new available bytes are known.
    v_ev_kind text[] := '{}';
    v_ev_gpu bigint[] := '{}';
    v_ev_replica text[] := '{}';
    v_ev_reason text[] := '{}';
    v_ev_before bigint[] := '{}';
    v_ev_after bigint[] := '{}';
BEGIN
    IF COALESCE(v_n, 0) = 0 THEN
        RETURN;
    END IF;

    -- One global lock order: primary key. Two commits may wait on each other, never in a cycle.
    -- p_ids are in ascending order (the ledger sorts them): one small statement per GPU, no cursor.
    v_current := array_fill(NULL::bigint, ARRAY[v_n]);
    FOR i IN 1 .. v_n LOOP
        SELECT g.version INTO v_version FROM scheduling_gpu g WHERE g.id = p_ids[i] FOR UPDATE;
        v_current[i] := v_version;
    END LOOP;

    -- Compare-and-swap: every GPU written must still have the version the plan was made on.
    IF v_current IS DISTINCT FROM p_expected THEN
        RETURN QUERY
            SELECT e.id, e.cur, NULL::bigint, 'conflict'::text
            FROM unnest(p_ids, p_expected, v_current) AS e(id, expected, cur)
            WHERE e.cur IS DISTINCT FROM e.expected
            ORDER BY e.id;
        RETURN;
    END IF;

    -- Row by row, in plain statements: a plan writes a GPU or two, and small statements cost
    -- PostgreSQL less to start than set-based ones over unnested arrays.
    FOR j IN 1 .. COALESCE(cardinality(p_res_gpu), 0) LOOP
        v_res_keys := v_res_keys || (p_res_gpu[j] || '/' || p_res_replica[j]);
    END LOOP;
    FOR j IN 1 .. COALESCE(cardinality(p_rel_gpu), 0) LOOP
        -- A release and a reservation of the same occupant come to the reservation (kept `since`).
        CONTINUE WHEN (p_rel_gpu[j] || '/' || p_rel_replica[j]) = ANY(v_res_keys);
        DELETE FROM scheduling_occupant o WHERE o.gpu_id = p_rel_gpu[j] AND o.replica_id = p_rel_replica[j]
        RETURNING o.reserved_bytes INTO v_before;
        IF FOUND THEN
            v_ev_kind := v_ev_kind || 'gpu.released'::text;
            v_ev_gpu := v_ev_gpu || p_rel_gpu[j];
            v_ev_replica := v_ev_replica || p_rel_replica[j];
            v_ev_reason := v_ev_reason
                || format('released %s B of replica %s: %s', v_before, left(p_rel_replica[j], 8), p_reason);
            v_ev_before := v_ev_before || v_before;
            v_ev_after := v_ev_after || 0::bigint;
        END IF;
    END LOOP;
    FOR j IN 1 .. COALESCE(cardinality(p_res_gpu), 0) LOOP
        SELECT o.reserved_bytes INTO v_before FROM scheduling_occupant o
        WHERE o.gpu_id = p_res_gpu[j] AND o.replica_id = p_res_replica[j];
        IF FOUND THEN
            UPDATE scheduling_occupant o SET reserved_bytes = p_res_bytes[j]
            WHERE o.gpu_id = p_res_gpu[j] AND o.replica_id = p_res_replica[j];
        ELSE
            -- A plain insert is safe: whoever else would insert this occupant must hold this
            -- GPU's row lock, which we hold (the unique constraint stays as the backstop).
            v_before := 0;
            INSERT INTO scheduling_occupant (gpu_id, replica_id, reserved_bytes, since)
            VALUES (p_res_gpu[j], p_res_replica[j], p_res_bytes[j], now());
        END IF;
        v_ev_kind := v_ev_kind || 'gpu.reserved'::text;
        v_ev_gpu := v_ev_gpu || p_res_gpu[j];
        v_ev_replica := v_ev_replica || p_res_replica[j];
        v_ev_reason := v_ev_reason
            || format('reserved %s B for replica %s: %s', p_res_bytes[j], left(p_res_replica[j], 8), p_reason);
        v_ev_before := v_ev_before || v_before;
        v_ev_after := v_ev_after || p_res_bytes[j];
    END LOOP;

    -- Totals come from the rows themselves: nobody else writes them while we hold the locks.
    -- LEAST keeps the row within its CHECK so that the over-commit is reported as ours, with
    -- its numbers; the exception then aborts the statement and nothing of the plan stays.
    -- The ledger passes p_ids in ascending order, so the lowest over-committed GPU is named.
    v_avail := array_fill(NULL::bigint, ARRAY[v_n]);
    FOR i IN 1 .. v_n LOOP
        UPDATE scheduling_gpu g
        SET available_bytes = g.total_bytes - LEAST(s.used, g.total_bytes),
            version = g.version + 1,
            changed_txid = txid_current(),
            updated_at = now()
        FROM (SELECT COALESCE(SUM(o.reserved_bytes), 0) AS used FROM scheduling_occupant o
              WHERE o.gpu_id = p_ids[i]) s
        WHERE g.id = p_ids[i]
        RETURNING g.version, g.available_bytes, s.used, g.total_bytes INTO version, available, v_used, v_total;
        IF v_used > v_total THEN
            RAISE EXCEPTION 'gpuportal over-commit %/%/%', p_ids[i], v_total, v_used USING ERRCODE = 'GP001';
        END IF;
        v_avail[i] := available;
        gpu_id := p_ids[i];
        outcome := 'ok';
        RETURN NEXT;
    END LOOP;

    FOR k IN 1 .. cardinality(v_ev_kind) LOOP
        v_at := array_position(p_ids, v_ev_gpu[k]);
        INSERT INTO scheduling_event (time, kind, subject, reason, before, after, node, gpu, deployment, replica)
        VALUES (now(), v_ev_kind[k], 'gpu ' || p_labels[v_at], v_ev_reason[k],
                jsonb_build_object('reserved_bytes', v_ev_before[k]),
                jsonb_build_object('reserved_bytes', v_ev_after[k], 'available_bytes', v_avail[v_at]),
                '', p_labels[v_at], '', v_ev_replica[k]);
    END LOOP;
END
$fn$;
"""
)

# STABLE: every statement of the function reads the caller's one snapshot, the one it returns.
READ = (
    r"""
CREATE OR REPLACE FUNCTION gpuportal_ledger_read(p_seen text, p_ids bigint[])
RETURNS TABLE (
    id bigint, node text, node_status text, idx integer, total_bytes bigint, available_bytes bigint,
    version bigint, virtual boolean, health text, wake_lock_holder text, wake_lock_expires_at timestamptz,
    occupants text, intents text, seen text
)
LANGUAGE plpgsql STABLE
"""
    + PLAN_SETTINGS
    + r"""
AS $fn$
DECLARE
    v_seen pg_snapshot := pg_current_snapshot();
    v_own xid8 := pg_current_xact_id_if_assigned();
    v_ids bigint[];
BEGIN
    -- A snapshot does not list its own transaction as running, so it would pass as seen; but
    -- what the caller's transaction writes after this read commits under that id, and the next
    -- read must fetch it. So the snapshot handed back lists it as running.
    IF v_own IS NOT NULL AND v_own < pg_snapshot_xmax(v_seen) THEN
        v_seen := (least(pg_snapshot_xmin(v_seen), v_own)::text || ':' || pg_snapshot_xmax(v_seen)::text || ':'
                   || array_to_string(ARRAY(SELECT u.x FROM (SELECT pg_snapshot_xip(v_seen) AS x UNION SELECT v_own) u
                                            ORDER BY u.x), ','))::pg_snapshot;
    END IF;
    IF p_ids IS NOT NULL THEN
        v_ids := p_ids;
    ELSIF p_seen IS NULL THEN
        v_ids := ARRAY(SELECT g.id FROM scheduling_gpu g);
    ELSE
        -- Only what the previous read could not see: a transaction it saw had committed by then,
        -- and what it wrote was read then (or rewritten since, by a transaction it did not see,
        -- whose id the row now carries). Those it did not see are at or above its xmax, or in
        -- its list of then-running ones; all are at or above its xmin, the indexed bound.
        v_ids := ARRAY(
            SELECT g.id FROM scheduling_gpu g
            WHERE g.changed_txid >= pg_snapshot_xmin(p_seen::pg_snapshot)::text::bigint
              AND NOT pg_visible_in_snapshot(g.changed_txid::text::xid8, p_seen::pg_snapshot)
        );
    END IF;

    RETURN QUERY
    SELECT g.id, n.name::text, n.status::text, g.index, g.total_bytes, g.available_bytes, g.version, g.virtual,
           g.health::text, g.wake_lock_holder_id::text, g.wake_lock_expires_at,
           COALESCE((SELECT json_agg(json_build_array(o.replica_id, d.name, r.state, o.reserved_bytes, o.since,
                                                      r.last_accessed, r.serving_since,
                                                      d.dedicated OR d.failover_standby,
                                                      d.popular OR d.failover_standby,
                                                      d.min_runtime_s) ORDER BY o.since, o.id)
                     FROM scheduling_occupant o
                     JOIN scheduling_replica r ON r.id = o.replica_id
                     JOIN scheduling_deployment d ON d.id = r.deployment_id
                     WHERE o.gpu_id = g.id)::text, '[]'),
           COALESCE((SELECT json_agg(json_build_array(i.id, i.waiting_replica_id, d.name, i.needed_bytes,
                                                      i.deadline, i.status) ORDER BY i.created_at, i.id)
                     FROM scheduling_preemptionintent i
                     JOIN scheduling_replica r ON r.id = i.waiting_replica_id
                     JOIN scheduling_deployment d ON d.id = r.deployment_id
                     WHERE i.gpu_id = g.id AND i.status IN ('waiting', 'victim_chosen'))::text, '[]'),
           v_seen::text
    FROM scheduling_gpu g JOIN scheduling_node n ON n.id = g.node_id
    WHERE g.id = ANY(v_ids)
    ORDER BY g.id;
    IF NOT FOUND THEN
        -- The caller needs the snapshot even when nothing changed.
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::integer, NULL::bigint, NULL::bigint,
                            NULL::bigint, NULL::boolean, NULL::text, NULL::text, NULL::timestamptz,
                            NULL::text, NULL::text, v_seen::text;
    END IF;
END
$fn$;
"""
)

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
