-- The ledger's compare-and-swap commit as one server-side function (migration 0005).
-- Superseded by ledger_commit_v2.sql; kept as the state migration 0011 goes back to.
CREATE OR REPLACE FUNCTION gpuportal_ledger_commit(
    p_ids bigint[], p_expected bigint[], p_labels text[],
    p_rel_gpu bigint[], p_rel_replica text[],
    p_res_gpu bigint[], p_res_replica text[], p_res_bytes bigint[],
    p_reason text
) RETURNS TABLE (gpu_id bigint, version bigint, available bigint, outcome text)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_before jsonb;
    v_over record;
BEGIN
    -- One global lock order: primary key. Two commits may wait on each other, never in a cycle.
    PERFORM 1 FROM scheduling_gpu g WHERE g.id = ANY(p_ids) ORDER BY g.id FOR UPDATE;

    -- Compare-and-swap: every GPU written must still have the version the plan was made on.
    RETURN QUERY
        SELECT e.id, g.version, NULL::bigint, 'conflict'::text
        FROM unnest(p_ids, p_expected) AS e(id, expected)
        LEFT JOIN scheduling_gpu g ON g.id = e.id
        WHERE g.id IS NULL OR g.version <> e.expected
        ORDER BY e.id;
    IF FOUND THEN
        RETURN;
    END IF;

    SELECT COALESCE(jsonb_object_agg(o.gpu_id || '/' || o.replica_id, o.reserved_bytes), '{}'::jsonb)
    INTO v_before FROM scheduling_occupant o WHERE o.gpu_id = ANY(p_ids);

    -- A release and a reservation of the same occupant come to the reservation (kept `since`).
    DELETE FROM scheduling_occupant o
    USING unnest(p_rel_gpu, p_rel_replica) AS r(gid, rid)
    WHERE o.gpu_id = r.gid AND o.replica_id = r.rid
      AND NOT EXISTS (SELECT 1 FROM unnest(p_res_gpu, p_res_replica) AS x(gid, rid)
                      WHERE x.gid = r.gid AND x.rid = r.rid);

    INSERT INTO scheduling_occupant (gpu_id, replica_id, reserved_bytes, since)
    SELECT r.gid, r.rid, r.bytes, now() FROM unnest(p_res_gpu, p_res_replica, p_res_bytes) AS r(gid, rid, bytes)
    ON CONFLICT ON CONSTRAINT occupant_unique_gpu_replica DO UPDATE SET reserved_bytes = EXCLUDED.reserved_bytes;

    -- Totals come from the rows themselves: nobody else writes them while we hold the locks.
    SELECT g.id, g.total_bytes, s.used INTO v_over
    FROM scheduling_gpu g
    JOIN (SELECT o.gpu_id AS gid, SUM(o.reserved_bytes) AS used FROM scheduling_occupant o
          WHERE o.gpu_id = ANY(p_ids) GROUP BY o.gpu_id) s ON s.gid = g.id
    WHERE s.used > g.total_bytes
    ORDER BY g.id LIMIT 1;
    IF FOUND THEN
        -- Aborts the statement: nothing of the plan stays applied.
        RAISE EXCEPTION 'gpuportal over-commit %/%/%', v_over.id, v_over.total_bytes, v_over.used
            USING ERRCODE = 'GP001';
    END IF;

    RETURN QUERY
        WITH bumped AS (
            UPDATE scheduling_gpu g
            SET available_bytes = g.total_bytes - COALESCE(
                    (SELECT SUM(o.reserved_bytes) FROM scheduling_occupant o WHERE o.gpu_id = g.id), 0),
                version = g.version + 1,
                changed_txid = txid_current(),
                updated_at = now()
            WHERE g.id = ANY(p_ids)
            RETURNING g.id, g.version, g.available_bytes
        ), labels AS (
            SELECT * FROM unnest(p_ids, p_labels) AS l(id, label)
        ), logged AS (
            INSERT INTO scheduling_event (time, kind, subject, reason, before, after, node, gpu, deployment, replica)
            SELECT now(), 'gpu.released', 'gpu ' || l.label,
                   format('released %s B of replica %s: %s', (v_before ->> (r.gid || '/' || r.rid)), left(r.rid, 8), p_reason),
                   jsonb_build_object('reserved_bytes', (v_before ->> (r.gid || '/' || r.rid))::bigint),
                   jsonb_build_object('reserved_bytes', 0, 'available_bytes', b.available_bytes),
                   '', l.label, '', r.rid
            FROM unnest(p_rel_gpu, p_rel_replica) AS r(gid, rid)
            JOIN labels l ON l.id = r.gid JOIN bumped b ON b.id = r.gid
            WHERE v_before ? (r.gid || '/' || r.rid)
              AND NOT EXISTS (SELECT 1 FROM unnest(p_res_gpu, p_res_replica) AS x(gid, rid)
                              WHERE x.gid = r.gid AND x.rid = r.rid)
            UNION ALL
            SELECT now(), 'gpu.reserved', 'gpu ' || l.label,
                   format('reserved %s B for replica %s: %s', r.bytes, left(r.rid, 8), p_reason),
                   jsonb_build_object('reserved_bytes', COALESCE((v_before ->> (r.gid || '/' || r.rid))::bigint, 0)),
                   jsonb_build_object('reserved_bytes', r.bytes, 'available_bytes', b.available_bytes),
                   '', l.label, '', r.rid
            FROM unnest(p_res_gpu, p_res_replica, p_res_bytes) AS r(gid, rid, bytes)
            JOIN labels l ON l.id = r.gid JOIN bumped b ON b.id = r.gid
        )
        SELECT b.id, b.version, b.available_bytes, 'ok'::text FROM bumped b ORDER BY b.id;
END
$fn$;
