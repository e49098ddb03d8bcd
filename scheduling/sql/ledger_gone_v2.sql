-- The GPU generation (migration 0020), v2 (migration 0028): bumped when GPU rows are deleted (a
-- node deleted with its GPUs, a test database flushed). A deleted row leaves nothing to stamp, so
-- an incremental read (gpuportal_ledger_read) returns the generation, and a Mirror that finds it
-- changed reads everything again. Not bumped by inserts: a new GPU is stamped like any write. A
-- deleting transaction holds the one row until it ends: nothing but a GPU deletion locks it, and
-- GPUs are deleted rarely (with their node), so it only makes deletions take turns.
-- v2: each new generation is drawn from a sequence, where v1 counted up from the row's value. A
-- deleting transaction that rolls back puts the row's old value back, so a count handed the next
-- deletion the very value that the rolled-back one had shown a Mirror reading inside it: the
-- later deletion then passed as seen, and its GPUs stayed in the Mirror. A sequence never hands
-- out a value twice, whatever rolls back; the Mirror only asks whether the value changed.
CREATE SEQUENCE IF NOT EXISTS gpuportal_ledger_generation_seq;
SELECT setval('gpuportal_ledger_generation_seq',
              greatest(1, (SELECT max(generation) FROM gpuportal_ledger_generation)));

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
    INSERT INTO gpuportal_ledger_generation AS g (one, generation)
    VALUES (true, nextval('gpuportal_ledger_generation_seq'))
    ON CONFLICT (one) DO UPDATE SET generation = EXCLUDED.generation;
    RETURN NULL;
END
$fn$;
