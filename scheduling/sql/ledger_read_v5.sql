-- The ledger's snapshot read (migration 0020): GPUs whose view changed since the caller's previous
-- read, with their node, contexts, occupants, intents and wake lock. A view changes when a row it
-- is built from does: the GPU's, its node's, an occupant's replica or deployment (each stamped by
-- gpuportal_ledger_stamp), an occupant (only the commit writes those, stamping the GPU) or an
-- intent. A GPU deleted leaves nothing to stamp: the read returns the generation that deletions
-- bump (gpuportal_ledger_gpus_gone). STABLE: every statement reads the caller's one snapshot, the
-- one it returns.
-- v3 (migration 0023): the node's id beside its name (a placement's replica row points at it, so
-- the services need not look the GPUs up again), and `SET jit = off`. The SET lines below price
-- any sequential scan out of reach, which also lifts even a one-row lookup past jit_above_cost: on
-- a server built with LLVM, every call compiled its plan anew (7-40 ms of CPU for a 0.2 ms read).
-- v4 (migration 0024): whether a row was built from the caller's own writes is computed beside its
-- occupants, in the same lateral subquery. As a separate EXISTS in the select list, PostgreSQL ran
-- it as a hashed subplan over every occupant of every GPU whenever the caller's transaction had an
-- id (a scale call's, which has locked its deployment): 0.4 ms of server CPU for a read of two
-- GPUs, the largest single cost of a scale call.
-- v5 (migration 0033): each GPU's foreign bytes (other tenants' use) after its node's id.
CREATE OR REPLACE FUNCTION gpuportal_ledger_read(p_seen text, p_ids bigint[], p_again bigint[])
RETURNS TABLE (
    id bigint, node text, node_status text, idx integer, total_bytes bigint, available_bytes bigint,
    version bigint, virtual boolean, health text, wake_lock_holder text, wake_lock_expires_at timestamptz,
    context_bytes bigint, standby_context_bytes bigint, occupants text, intents text, node_id bigint,
    foreign_bytes bigint, mine boolean,
    generation bigint, seen text
)
LANGUAGE plpgsql STABLE

SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off

AS $fn$
DECLARE
    v_seen pg_snapshot := pg_current_snapshot();
    v_own xid8 := pg_current_xact_id_if_assigned();
    v_own_id bigint := v_own::text::bigint;
    v_prev pg_snapshot := p_seen::pg_snapshot;
    v_xmin bigint := pg_snapshot_xmin(p_seen::pg_snapshot)::text::bigint;
    v_ids bigint[];
    v_generation bigint := (SELECT x.generation FROM gpuportal_ledger_generation x);
BEGIN
    -- A snapshot does not list its own transaction as running, so it would pass as seen; but
    -- what the caller's transaction writes after this read commits under that id, and the next
    -- read must fetch it. So the snapshot handed back lists it as running.
    IF v_own IS NOT NULL AND v_own < pg_snapshot_xmax(v_seen) THEN
        v_seen := (least(pg_snapshot_xmin(v_seen), v_own)::text || ':' || pg_snapshot_xmax(v_seen)::text || ':'
                   || array_to_string(ARRAY(SELECT u.x FROM (SELECT pg_snapshot_xip(v_seen) AS x UNION SELECT v_own) u
                                            ORDER BY u.x), ','))::pg_snapshot;
    END IF;
    -- A previous read from ahead of this one is another server's (a database created anew): read all.
    IF p_seen IS NOT NULL AND pg_snapshot_xmax(v_prev) > pg_snapshot_xmax(v_seen) THEN
        v_prev := NULL;
    END IF;
    IF p_ids IS NOT NULL THEN
        v_ids := p_ids;
    ELSIF v_prev IS NULL THEN
        v_ids := ARRAY(SELECT g.id FROM scheduling_gpu g);
    ELSE
        -- Only what the previous read could not see: a transaction it saw had committed by then,
        -- and what it wrote was read then (or rewritten since, by a transaction it did not see,
        -- whose id the row now carries). Those it did not see are at or above its xmin (the
        -- indexed bound), and at or above its xmax or in its list of then-running ones.
        -- Intents are not stamped (a deleted one leaves no row to stamp): GPUs with active ones
        -- are read every time, and the caller passes in p_again those that had some.
        v_ids := ARRAY(
            SELECT g.id FROM scheduling_gpu g
            WHERE g.changed_txid >= v_xmin AND NOT pg_visible_in_snapshot(g.changed_txid::text::xid8, v_prev)
            UNION
            SELECT g.id FROM scheduling_node n JOIN scheduling_gpu g ON g.node_id = n.id
            WHERE n.changed_txid >= v_xmin AND NOT pg_visible_in_snapshot(n.changed_txid::text::xid8, v_prev)
            UNION
            SELECT o.gpu_id FROM scheduling_replica r JOIN scheduling_occupant o ON o.replica_id = r.id
            WHERE r.changed_txid >= v_xmin AND NOT pg_visible_in_snapshot(r.changed_txid::text::xid8, v_prev)
            UNION
            SELECT o.gpu_id FROM scheduling_deployment d
            JOIN scheduling_replica r ON r.deployment_id = d.id
            JOIN scheduling_occupant o ON o.replica_id = r.id
            WHERE d.changed_txid >= v_xmin AND NOT pg_visible_in_snapshot(d.changed_txid::text::xid8, v_prev)
            UNION
            SELECT i.gpu_id FROM scheduling_preemptionintent i WHERE i.status IN ('waiting', 'victim_chosen')
            UNION
            SELECT unnest(p_again)
        );
    END IF;

    RETURN QUERY
    SELECT g.id, n.name::text, n.status::text, g.index, g.total_bytes, g.available_bytes, g.version, g.virtual,
           g.health::text, g.wake_lock_holder_id::text, g.wake_lock_expires_at,
           g.context_bytes, g.standby_context_bytes,
           COALESCE(occ.entries, '[]'),
           COALESCE((SELECT json_agg(json_build_array(i.id, i.waiting_replica_id, d.name, i.needed_bytes,
                                                      i.deadline, i.status) ORDER BY i.created_at, i.id)
                     FROM scheduling_preemptionintent i
                     JOIN scheduling_replica r ON r.id = i.waiting_replica_id
                     JOIN scheduling_deployment d ON d.id = r.deployment_id
                     WHERE i.gpu_id = g.id AND i.status IN ('waiting', 'victim_chosen'))::text, '[]'),
           n.id,
           g.foreign_bytes,
           -- Built from what the caller's own transaction wrote: it may yet roll back, so the
           -- caller must not keep this view as the committed one.
           v_own_id IS NOT NULL AND (
               g.changed_txid = v_own_id OR n.changed_txid = v_own_id OR COALESCE(occ.mine, false)
           ),
           v_generation,
           v_seen::text
    FROM scheduling_gpu g JOIN scheduling_node n ON n.id = g.node_id
    -- One row per GPU even without occupants (an aggregate without GROUP BY): entries and mine NULL.
    CROSS JOIN LATERAL (
        SELECT json_agg(json_build_array(o.replica_id, d.name, r.state, o.reserved_bytes, o.since,
                                         r.last_accessed, r.serving_since,
                                         d.dedicated OR d.failover_standby,
                                         d.popular OR d.failover_standby,
                                         d.min_runtime_s) ORDER BY o.since, o.id)::text AS entries,
               bool_or(r.changed_txid = v_own_id OR d.changed_txid = v_own_id) AS mine
        FROM scheduling_occupant o
        JOIN scheduling_replica r ON r.id = o.replica_id
        JOIN scheduling_deployment d ON d.id = r.deployment_id
        WHERE o.gpu_id = g.id
    ) occ
    WHERE g.id = ANY(v_ids)
    ORDER BY g.id;
    IF NOT FOUND THEN
        -- The caller needs the snapshot (and the generation) even when nothing changed.
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::integer, NULL::bigint, NULL::bigint,
                            NULL::bigint, NULL::boolean, NULL::text, NULL::text, NULL::timestamptz,
                            NULL::bigint, NULL::bigint, NULL::text, NULL::text, NULL::bigint, NULL::bigint,
                            NULL::boolean,
                            v_generation, v_seen::text;
    END IF;
END
$fn$;
