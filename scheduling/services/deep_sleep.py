"""Deep sleep: the second level of sleep, in which a replica holds no GPU memory at all.

A sleeping replica keeps its process, and with it its CUDA context and kernels on its GPU (750 MiB
measured on an H200): cheap to wake, but a hundred sleepers hold 75 GB and serve nothing. Asleep
longer than its deployment's `sleep.deep_after_s`, the sweep (`sweep_deep`, beside the idle sweep)
tells it to sleep deeply: its process writes its weights to its node's host copy
(inference.host_copy) and exits, and its report (scheduling.services.replica_reports) releases
all it reserved. Its node's host memory still holds the weights, counted in the node's host cache
(it may be parked out of it, like any sleeper, when the cache is full).

A wake promotes a deep sleeper as it does a sleeper, on its own node (scheduling.core.placement:
its copy is there), reserving its whole need; the command it is sent starts a process that reads
the host copy (scheduling.services.replica_specs.wake), never the disk.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F
from django.utils import timezone

from scheduling import locks
from scheduling.core import effects
from scheduling.models import Event, Node, Replica
from scheduling.services import outbox, replicas
from scheduling.services.errors import ServiceError, TransitionRefused

log = logging.getLogger(__name__)

# How the Event of a deep sleep asked for begins: the sweep asks again only past RESEND_S (the
# command was lost, or the process could not write the copy), not on every pass while it writes.
DEEPENING = "told to sleep deeply"
RESEND_S = 60.0


def sweep_deep(now: datetime | None = None) -> list[str]:
    """Tell every replica asleep longer than its deployment's deep_sleep_after_s (0: never) to
    sleep deeply; returns their ids. Those on a node that is not online wait for it."""
    now = now or timezone.now()
    after = ExpressionWrapper(F("deployment__deep_sleep_after_s") * timedelta(seconds=1), output_field=DurationField())
    due = (
        Replica.objects.filter(
            state=Replica.State.SLEEPING,
            node__status=Node.Status.ONLINE,
            deployment__deep_sleep_after_s__gt=0,
            asleep_since__isnull=False,
        )
        .filter(asleep_since__lte=now - after)
        .order_by("pk")
        .values_list("pk", "deployment__deep_sleep_after_s")
    )
    return _deepen_each(
        [(replica_id, f"asleep longer than sleep.deep_after_s ({after_s:g} s)") for replica_id, after_s in due], now
    )


def deepen_all(replica_ids: list[str], *, reason: str) -> list[str]:
    """`deepen_replica` for each (those told)."""
    return _deepen_each([(replica_id, reason) for replica_id in sorted(replica_ids)], timezone.now())


def _deepen_each(asks: list[tuple[str, str]], now: datetime) -> list[str]:
    """(replica id, reason) each in a transaction of its own; the ids told. One replica's trouble
    must not keep the others from their sleep."""
    told = []
    for replica_id, reason in asks:
        try:
            if deepen_replica(replica_id, reason=reason, now=now):
                told.append(replica_id)
        except ServiceError as err:
            log.warning("deep sleep of replica %s: %s", replica_id, err)
    return told


def deepen_replica(replica_id: str, *, reason: str, now: datetime | None = None) -> bool:
    """Tell one sleeping replica to sleep deeply, once its commit is in; False when it is not
    asleep (woken, gone, deep already) or was told less than RESEND_S ago."""
    now = now or timezone.now()
    with transaction.atomic():
        replica = Replica.objects.filter(pk=replica_id).first()
        if replica is None:
            return False
        # The one lock order: its deployment's row, then its own. Re-read under them: a wake may
        # have promoted it since the sweep looked.
        locks.lock_deployment_of(replica)
        replica = locks.lock_replica(replica_id)
        if replica.state != Replica.State.SLEEPING or replica.node is None:
            return False
        since = max(replica.asleep_since or now, now - timedelta(seconds=RESEND_S))
        asked = Event.objects.filter(
            replica=replica_id, kind=Event.Kind.REPLICA_STATE, time__gte=since, reason__startswith=DEEPENING
        )
        if asked.exists():
            return False
        tell(replica, reason)
    return True


def deepen_now(replica_id: str, *, reason: str) -> Replica:
    """An operator's deep sleep of one sleeping replica, whatever its deployment's setting;
    NotFound (404), TransitionRefused (409) when it is not asleep in its process."""
    replica = replicas.get(replica_id)
    with transaction.atomic():
        locks.lock_deployment_of(replica)
        replica = locks.lock_replica(replica_id)
        if replica.state != Replica.State.SLEEPING or replica.node is None:
            why = "only a replica asleep in its process can sleep deeply (put it to sleep first)"
            raise TransitionRefused(replica_id, replica.state, Replica.State.DEEP_SLEEPING, why)
        tell(replica, reason)
    return replica


def deepen_deployment(name: str, *, reason: str) -> list[str]:
    """An operator's deep sleep of every replica of the deployment asleep in its process; the ids
    told (none when none sleeps: its serving replicas are put to sleep first, by `sleep`)."""
    with transaction.atomic():
        deployment = locks.lock_deployment(name)
        asleep = list(
            Replica.objects.filter(deployment=deployment, state=Replica.State.SLEEPING, node__isnull=False)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        for replica_id in asleep:
            tell(locks.lock_replica(replica_id), reason)
    return asleep


def tell(replica: Replica, reason: str) -> None:
    """Send a sleeper (on a node, its row locked by the caller) the deepen command once the
    caller's transaction commits, with an Event saying why."""
    assert replica.node is not None
    outbox.want(effects.deepen(replica.node.name, replica.id))
    outbox.note(
        Event.Kind.REPLICA_STATE,
        f"replica {replica.id[:8]}",
        f"{DEEPENING}: {reason}; its process writes its weights to node {replica.node.name}'s host "
        "memory and exits, giving back its GPU memory",
        before={"state": Replica.State.SLEEPING},
        after={"state": Replica.State.SLEEPING, "deepening": True},
        node=replica.node.name,
        deployment=replica.deployment.name,
        replica=replica.id,
    )
