-- The GPU generation (migration 0020): bumped when GPU rows are deleted (a node deleted with its
-- GPUs, a test database flushed). A deleted row leaves nothing to stamp, so an incremental read
-- (gpuportal_ledger_read v2) returns the generation, and a Mirror that finds it changed reads
-- everything again. Not bumped by inserts: a new GPU is stamped like any write. A deleting
-- transaction holds the one row until it ends: nothing but a GPU deletion locks it, and GPUs are
-- deleted rarely (with their node), so it only makes deletions take turns.
CREATE OR REPLACE FUNCTION gpuportal_ledger_gpus_gone() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    IF TG_OP = 'DELETE' THEN
        -- A statement trigger fires for a DELETE that matched nothing too (Django's cascades).
        IF NOT EXISTS (SELECT 1 FROM gone) THEN
            RETURN NULL;
        END IF;
    END IF;
    INSERT INTO gpuportal_ledger_generation AS g (one, generation) VALUES (true, 1)
    ON CONFLICT (one) DO UPDATE SET generation = g.generation + 1;
    RETURN NULL;
END
$fn$;

-- No Django model: its flush (TRUNCATE of the models' tables) leaves it, and bumps it through the
-- trigger on scheduling_gpu.
CREATE TABLE IF NOT EXISTS gpuportal_ledger_generation (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    generation bigint NOT NULL
);
INSERT INTO gpuportal_ledger_generation (one, generation) VALUES (true, 0) ON CONFLICT (one) DO NOTHING;

DROP TRIGGER IF EXISTS gpuportal_ledger_gpus_deleted ON scheduling_gpu;
CREATE TRIGGER gpuportal_ledger_gpus_deleted AFTER DELETE ON scheduling_gpu
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION gpuportal_ledger_gpus_gone();
DROP TRIGGER IF EXISTS gpuportal_ledger_gpus_truncated ON scheduling_gpu;
CREATE TRIGGER gpuportal_ledger_gpus_truncated AFTER TRUNCATE ON scheduling_gpu
    FOR EACH STATEMENT EXECUTE FUNCTION gpuportal_ledger_gpus_gone();
