-- The ledger's compare-and-swap commit (migration 0011): one call locks the plan's GPU rows in
-- primary-key order, checks each version, applies releases and reservations, refuses an
-- over-commit, bumps versions and records an Event per change. Why the SET lines: generic plans
-- kept per session, and index probes at any table size (see migration 0011's docstring).
-- v3 (migration 0023): a refusal (a conflict, an over-commit) undoes what the call did, its row
-- locks included, and says so in its rows instead of aborting the caller's transaction: the ledger
-- no longer wraps the call in a savepoint (two round trips of a commit's ten). And `SET jit = off`:
-- the SET lines below price any sequential scan out of reach, which also lifts even a one-row
-- lookup past jit_above_cost, so on a server built with LLVM every call compiled its plan anew.
-- v4 (migration 0033): other tenants' use (scheduling_gpu.foreign_bytes) is out of reach like an
-- occupant the portal does not own: available bytes are what is left after it and the occupants
-- (never below 0), and a plan that reserves more on a GPU than that leaves is an over-commit. A
-- plan that grows nothing there (a release, a sleep's shrink) still commits where other tenants
-- have reached into reserved memory: letting go must never be refused.
CREATE OR REPLACE FUNCTION gpuportal_ledger_commit(
    p_ids bigint[], p_expected bigint[], p_labels text[],
    p_rel_gpu bigint[], p_rel_replica text[],
    p_res_gpu bigint[], p_res_replica text[], p_res_bytes bigint[],
    p_reason text
) RETURNS TABLE (gpu_id bigint, version bigint, available bigint, outcome text)
LANGUAGE plpgsql

SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off

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
    v_over bigint;
    v_foreign bigint;
    v_grown bigint[];     -- what the plan adds to each GPU's reservations, net (in p_ids order)
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
    -- In a block of its own (a subtransaction): a conflict leaves it by an error, which lets go
    -- of the rows it locked. The caller plans again within its transaction (the ledger takes no
    -- savepoint), maybe on other GPUs; holding these meanwhile could close a circle of waits.
    v_current := array_fill(NULL::bigint, ARRAY[v_n]);
    v_grown := array_fill(0::bigint, ARRAY[v_n]);
    BEGIN  -- a block of its own, ended by the refusals below
    FOR i IN 1 .. v_n LOOP
        SELECT g.version INTO v_version FROM scheduling_gpu g WHERE g.id = p_ids[i] FOR UPDATE;
        v_current[i] := v_version;
    END LOOP;

    -- Compare-and-swap: every GPU written must still have the version the plan was made on.
    IF v_current IS DISTINCT FROM p_expected THEN
        RAISE EXCEPTION 'gpuportal conflict' USING ERRCODE = 'GP002';
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
            v_at := array_position(p_ids, p_rel_gpu[j]);
            v_grown[v_at] := v_grown[v_at] - v_before;
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
        v_at := array_position(p_ids, p_res_gpu[j]);
        v_grown[v_at] := v_grown[v_at] + p_res_bytes[j] - v_before;
        v_ev_kind := v_ev_kind || 'gpu.reserved'::text;
        v_ev_gpu := v_ev_gpu || p_res_gpu[j];
        v_ev_replica := v_ev_replica || p_res_replica[j];
        v_ev_reason := v_ev_reason
            || format('reserved %s B for replica %s: %s', p_res_bytes[j], left(p_res_replica[j], 8), p_reason);
        v_ev_before := v_ev_before || v_before;
        v_ev_after := v_ev_after || p_res_bytes[j];
    END LOOP;

    -- Totals come from the rows themselves: nobody else writes them while we hold the locks.
    -- GREATEST keeps the row within its CHECK so that the over-commit is reported as ours, with
    -- its numbers; the error then undoes the block, and nothing of the plan stays. What is
    -- reported as the total is what the portal may reserve: the GPU's less other tenants' use.
    -- The ledger passes p_ids in ascending order, so the lowest over-committed GPU is named.
    v_avail := array_fill(NULL::bigint, ARRAY[v_n]);
    FOR i IN 1 .. v_n LOOP
        UPDATE scheduling_gpu g
        SET available_bytes = GREATEST(0, g.total_bytes - g.foreign_bytes - s.used),
            version = g.version + 1,
            changed_txid = txid_current(),
            updated_at = now()
        FROM (SELECT COALESCE(SUM(o.reserved_bytes), 0) AS used FROM scheduling_occupant o
              WHERE o.gpu_id = p_ids[i]) s
        WHERE g.id = p_ids[i]
        RETURNING g.version, g.available_bytes, s.used, g.total_bytes, g.foreign_bytes
            INTO version, available, v_used, v_total, v_foreign;
        IF v_used > v_total OR (v_used > v_total - v_foreign AND v_grown[i] > 0) THEN
            v_over := p_ids[i];
            v_total := GREATEST(0, v_total - v_foreign);
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

    -- Refusals leave the block by an error, which undoes all it did, the row locks included;
    -- the caller's transaction goes on (the ledger calls this without a savepoint) to plan again,
    -- maybe on other GPUs, and holding these meanwhile could close a circle of waits. Variables
    -- keep what the block assigned. Rows returned before the error stay in the result.
    EXCEPTION
        WHEN SQLSTATE 'GP002' THEN
            RETURN QUERY
                SELECT e.id, e.cur, NULL::bigint, 'conflict'::text
                FROM unnest(p_ids, p_expected, v_current) AS e(id, expected, cur)
                WHERE e.cur IS DISTINCT FROM e.expected
                ORDER BY e.id;
        WHEN SQLSTATE 'GP001' THEN
            -- The over-committed GPU, its total and what the plan would have reserved there.
            RETURN QUERY SELECT v_over, v_total, v_used, 'over-commit'::text;
    END;
END
$fn$;
