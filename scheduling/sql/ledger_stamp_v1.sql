-- Change stamps (migration 0020): every row a snapshot reads carries the id of the transaction that
-- last changed what the snapshot reads of it, so that an incremental read (gpuportal_ledger_read
-- v2, a ledger Mirror's) can tell which GPUs to read again. Set here, by the database, rather than
-- by each writer: a writer that forgot (an ORM update, the admin, a bulk change) would leave every
-- Mirror deciding on a stale view. Only the row being written is touched, so a stamp takes no lock
-- beyond the writer's own.
CREATE OR REPLACE FUNCTION gpuportal_ledger_stamp() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    -- The top-level transaction's id even inside a savepoint: the id a snapshot lists as running.
    NEW.changed_txid := txid_current();
    RETURN NEW;
END
$fn$;

-- GPU rows already carry the stamp (the ledger's commit set it); now any write does: a wake lock,
-- a measured context, an inventory change. Always, since Django writes every column on save().
DROP TRIGGER IF EXISTS gpuportal_ledger_stamp ON scheduling_gpu;
CREATE TRIGGER gpuportal_ledger_stamp BEFORE INSERT OR UPDATE ON scheduling_gpu
    FOR EACH ROW EXECUTE FUNCTION gpuportal_ledger_stamp();

-- Nodes, replicas and deployments: only when a column the snapshot reads changes, so a heartbeat
-- or a loading replica's progress does not send every Mirror to read its GPUs again. The stamp is
-- no model field, so no save() writes it back stale. Not on insert: a new row is read by nothing
-- until a stamped row points at it (a node's GPUs are inserted after it; a replica and its
-- deployment are read only through an occupant, which a commit writes, stamping its GPU).
ALTER TABLE scheduling_node ADD COLUMN IF NOT EXISTS changed_txid bigint NOT NULL DEFAULT 0;
ALTER TABLE scheduling_replica ADD COLUMN IF NOT EXISTS changed_txid bigint NOT NULL DEFAULT 0;
ALTER TABLE scheduling_deployment ADD COLUMN IF NOT EXISTS changed_txid bigint NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS scheduling_node_changed_txid ON scheduling_node (changed_txid);
CREATE INDEX IF NOT EXISTS scheduling_replica_changed_txid ON scheduling_replica (changed_txid);
CREATE INDEX IF NOT EXISTS scheduling_deployment_changed_txid ON scheduling_deployment (changed_txid);

DROP TRIGGER IF EXISTS gpuportal_ledger_stamp ON scheduling_node;
CREATE TRIGGER gpuportal_ledger_stamp BEFORE UPDATE ON scheduling_node
    FOR EACH ROW WHEN ((OLD.name, OLD.status) IS DISTINCT FROM (NEW.name, NEW.status))
    EXECUTE FUNCTION gpuportal_ledger_stamp();

DROP TRIGGER IF EXISTS gpuportal_ledger_stamp ON scheduling_replica;
CREATE TRIGGER gpuportal_ledger_stamp BEFORE UPDATE ON scheduling_replica
    FOR EACH ROW WHEN (
        (OLD.deployment_id, OLD.state, OLD.last_accessed, OLD.serving_since)
        IS DISTINCT FROM (NEW.deployment_id, NEW.state, NEW.last_accessed, NEW.serving_since)
    )
    EXECUTE FUNCTION gpuportal_ledger_stamp();

DROP TRIGGER IF EXISTS gpuportal_ledger_stamp ON scheduling_deployment;
CREATE TRIGGER gpuportal_ledger_stamp BEFORE UPDATE ON scheduling_deployment
    FOR EACH ROW WHEN (
        (OLD.name, OLD.dedicated, OLD.popular, OLD.failover_standby, OLD.min_runtime_s)
        IS DISTINCT FROM (NEW.name, NEW.dedicated, NEW.popular, NEW.failover_standby, NEW.min_runtime_s)
    )
    EXECUTE FUNCTION gpuportal_ledger_stamp();
