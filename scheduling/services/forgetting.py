"""A deployment's rows gone in one statement: what Django's cascade does for `Deployment.delete()`,
as PostgreSQL runs it.

Django's collector reads every related row into Python before it deletes anything: about ten
statements and 11 ms of a client's CPU for a deployment of one replica, where a scale call costs
about 2 (bench.placement's mix: one call in twenty a delete, a quarter of the calls' CPU). The relations
follow the models' `on_delete`, which a test holds this to:

- the deployment's replicas, failover leases, observed record and revisions go with it (CASCADE);
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

from scheduling.hot_sql import cursor, statement


def forget_deployment(deployment_id: int) -> list[tuple[int, str]]:
    """Delete the deployment and what hangs on it, inside the caller's transaction, which holds
    the deployment's row lock (`locks.lock_deployment`) so that no replica joins it meanwhile.
    Returns the wake locks its replicas held, which it cleared: (GPU id, the holder), by GPU."""
    with cursor() as cur:
        cur.execute(statement("forget_deployment"), {"deployment": deployment_id})
        return [(gpu_id, holder) for gpu_id, holder in cur.fetchall()]
