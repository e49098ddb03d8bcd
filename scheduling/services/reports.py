"""Where every report of a replica process arrives (relayed by its node agent): it goes to the
handler of a plain replica (replica_reports) or of a failover pair member (pair_reports), and a
replica that ended without being asked to sets off a reconcile. The top of the services: this
builds on all of them and none builds on it (services without a cycle)."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from gpuportal.wire.states import ENDED
from scheduling import locks
from scheduling.core import effects
from scheduling.models import Replica
from scheduling.services import outbox, pair_reports, replica_reports, replicas
from scheduling.services.errors import TransitionRefused

log = logging.getLogger(__name__)

# It ended: a replica in neither state counts toward its deployment or is on its way to it.


# -- reports from replica processes, relayed by their node agent -------------------------------


def report(replica_id: str, event: dict[str, Any]) -> None:
    """Apply one event from a replica process. Unknown replicas (deleted meanwhile) are ignored."""
    kind = event.get("event")
    handler = replica_reports.HANDLERS.get(kind) or replica_reports.PAIR_ONLY.get(kind)
    if handler is None:
        log.warning("replica %s reported an unknown event %r", replica_id, kind)
        return
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        replica = _with_its_deployment_locked(replica_id)
        if replica is None:
            log.info("replica %s reported %s after it was deleted; ignoring", replica_id, kind)
            return
        if replica.lease_id is not None:
            # A failover pair member: its reports carry epochs, and its end hands the pair over.
            # The members' agents relay on threads of their own, so the old active's end and its
            # standby's takeover can arrive at once: the deployment row lock makes a pair's
            # reports take turns, and each reads the rows the previous one wrote.
            handler = pair_reports.HANDLERS.get(kind, handler)
        before = replica.state
        try:
            with transaction.atomic():  # a savepoint: a report the state machine refuses leaves nothing
                handler(replica, event)
        except TransitionRefused as refused:
            # A process is not the books: a report that would move its replica where the table
            # allows no way (a sleep said by a replica the books already stop) changes nothing.
            log.warning("replica %s reported %s, which it cannot be now: %s; ignored", replica_id, kind, refused)
            return
        if (
            replica.state in ENDED
            and before not in (*ENDED, Replica.State.STOPPING)
            and replica.role != Replica.Role.STANDBY  # its pair replaces it (pair_reports.on_gone)
            and event.get("kind") not in replica_reports.LOAD_FAILURES  # the backoff puts it back (note_load_failure)
        ):
            # It ended without being asked to: its deployment may be a replica short, and the
            # reconcile puts one back.
            why = f"replica {replica.id[:8]} of {replica.deployment.name} {replica.state}"
            outbox.want(effects.to_control(replicas.RECONCILE_TASK, why))


def _with_its_deployment_locked(replica_id: str) -> Replica | None:
    """The replica, read once its deployment's row is locked (first, as always), or None when
    either is gone: a delete of the deployment then either committed before this (and the replica
    went with it) or waits until the report is recorded. Read before the lock, a replica could be
    deleted under its report: the handler then found no deployment row to lock, or saved a row
    that was no longer there (found by tests/scheduling/test_storm.py: serving racing a delete)."""
    deployment_id = Replica.objects.filter(pk=replica_id).values_list("deployment_id", flat=True).first()
    if deployment_id is None or locks.lock_deployment_if_there(pk=deployment_id) is None:
        return None
    return Replica.objects.select_related("deployment", "node").filter(pk=replica_id).first()
