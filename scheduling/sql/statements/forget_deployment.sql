-- A deployment and what hangs on it deleted in one statement, Django's cascade row for row.
-- Parameter: %(deployment)s, the deployment's id (its row locked by the caller).
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
    UPDATE scheduling_gpu SET wake_lock_holder_id = NULL WHERE wake_lock_holder_id IN (SELECT id FROM doomed)
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
)
DELETE FROM scheduling_deployment WHERE id = %(deployment)s
