"""A deployment's rows gone in one statement: what Django's cascade does for `Deployment.delete()`,
as PostgreSQL runs it.

Django's collector reads every related row into Python before it deletes anything: about ten
statements and 11 ms of a client's CPU for a deployment of one replica, where a scale call costs
about 2 (bench.placement's mix: one call in twenty a delete, a quarter of the calls' CPU). The relations
follow the models' `on_delete`, which a test holds this to:

- the deployment's replicas and failover leases go with it (CASCADE);
- preemption intents its replicas wait in go with them (CASCADE); those where one of them was
  the victim lose the victim (SET_NULL), and so do another deployment's leases held by one of
  them, GPUs one of them held the wake lock of, and another deployment's replicas in one of its
  leases (SET_NULL);
- a replica still holding a reservation (an Occupant, PROTECT) stops the whole transaction at its
  commit, the foreign key being deferred: the caller releases every reservation first through
  the ledger, the books' only writer.

Each row is changed by one part of the statement alone: PostgreSQL leaves undefined which of two
changes to one row in one statement wins, so an intent that one of the replicas waits in is deleted
and not also updated, and so on.
"""

from __future__ import annotations

from scheduling.hot_sql import cursor

_FORGET = """
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
)
DELETE FROM scheduling_deployment WHERE id = %(deployment)s
"""


def forget_deployment(deployment_id: int) -> None:
    """Delete the deployment and what hangs on it, inside the caller's transaction, which holds
    the deployment's row lock (`locks.lock_deployment`) so that no replica joins it meanwhile."""
    with cursor() as cur:
        cur.execute(_FORGET, {"deployment": deployment_id})
