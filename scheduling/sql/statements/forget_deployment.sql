-- A deployment and what hangs on it deleted in one statement, Django's cascade row for row.
-- Parameter: %(deployment)s, the deployment's id (its row locked by the caller). Answers the wake
-- locks it cleared: (GPU id, the replica that held it), one row each.
WITH doomed AS (
    SELECT id FROM scheduling_replica WHERE deployment_id = %(deployment)s
), leases AS (
    SELECT id FROM scheduling_failoverlease WHERE deployment_id = %(deployment)s
), waiting AS (
    DELETE FROM scheduling_preemptionintent WHERE waiting_replica_id IN (SELECT id FROM doomed)
), victims AS (
    UPDATE scheduling_preemptionintent SET victim_id = NULL
    WHERE victim_id IN (SELECT id FROM doomed) AND waiting_replica_id NOT IN (SELECT id FROM doomed)
), wake_locks AS (
    -- The holders read from a snapshot of the rows: RETURNING alone gives the new value (NULL).
    -- The holder compared on the row itself too: a lock another wake took over since the snapshot
    -- (its commit waited for) is rechecked against the row as that wake left it, and kept.
    UPDATE scheduling_gpu AS gpu SET wake_lock_holder_id = NULL
    FROM (SELECT id, wake_lock_holder_id FROM scheduling_gpu WHERE wake_lock_holder_id IN (SELECT id FROM doomed)) AS held
    WHERE gpu.id = held.id AND gpu.wake_lock_holder_id = held.wake_lock_holder_id
    RETURNING gpu.id, held.wake_lock_holder_id
), holders AS (
    UPDATE scheduling_failoverlease SET holder_id = NULL
    WHERE holder_id IN (SELECT id FROM doomed) AND deployment_id <> %(deployment)s
), members AS (
    UPDATE scheduling_replica SET lease_id = NULL
    WHERE lease_id IN (SELECT id FROM leases) AND deployment_id <> %(deployment)s
), replicas AS (
    DELETE FROM scheduling_replica WHERE deployment_id = %(deployment)s
), own_leases AS (
    DELETE FROM scheduling_failoverlease WHERE deployment_id = %(deployment)s
), observed AS (
    DELETE FROM scheduling_deploymentobserved WHERE deployment_id = %(deployment)s
), revisions AS (
    DELETE FROM scheduling_deploymentrevision WHERE deployment_id = %(deployment)s
), deployment AS (
    DELETE FROM scheduling_deployment WHERE id = %(deployment)s
)
-- What it answers: the GPUs whose wake lock one of the replicas held, and which replica.
SELECT id, wake_lock_holder_id FROM wake_locks ORDER BY id
