"""Garbage collection of ended replicas: stopped and failed replicas stay in the API and
the dashboard for a while, for what they say about how they ended, and then go.

A replica that stopped or failed longer ago than the retention is removed, except the newest few
ended replicas of each deployment, which are kept for their errors however old they are. Their
Events stay: an Event names its replica by id, not by a foreign key, so the audit trail outlives
the row. One Event per deployment says what was removed and why.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire.states import ENDED
from scheduling import locks
from scheduling.models import Event, Replica
from scheduling.services import outbox


def collect_ended_replicas(
    *, now: datetime | None = None, retention_s: float | None = None, keep: int | None = None
) -> list[str]:
    """Remove the ended replicas past their retention; returns the ids removed."""
    now = now or timezone.now()
    retention_s = settings.GPUPORTAL_REPLICA_RETENTION_S if retention_s is None else retention_s
    keep = settings.GPUPORTAL_REPLICA_KEEP_ENDED if keep is None else keep
    cutoff = now - timedelta(seconds=retention_s)
    removed: dict[str, list[str]] = defaultdict(list)
    with transaction.atomic():
        # skip_locked: a replica whose report is being recorded right now is not one to remove.
        # Only rows with no reservation left: an ended replica's occupants were released through
        # the ledger when it ended, and one that still has any is a question, not garbage.
        # Locked in the one order (primary key), then read newest first per deployment.
        ended = sorted(
            locks.lock_replicas(
                Replica.objects.filter(state__in=ENDED, occupancies__isnull=True).select_related("deployment"),
                skip_locked=True,
            ),
            key=lambda r: (r.deployment_id, -r.updated_at.timestamp(), r.pk),
        )
        seen: dict[int, int] = defaultdict(int)
        doomed: list[Replica] = []
        for replica in ended:
            seen[replica.deployment_id] += 1
            if seen[replica.deployment_id] > keep and replica.updated_at < cutoff:
                doomed.append(replica)
        for replica in doomed:
            removed[replica.deployment.name].append(replica.id)
        Replica.objects.filter(pk__in=[r.id for r in doomed]).delete()
        for name, ids in sorted(removed.items()):
            outbox.note(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                f"removed {len(ids)} replica(s) that ended over {_age(retention_s)} ago "
                f"({', '.join(i[:8] for i in ids)}); the last {keep} ended are kept for their errors, "
                "and every replica's Events stay",
                before={"ended_replicas": ids},
                deployment=name,
            )
    return [i for ids in removed.values() for i in ids]


def _age(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds / 60:g} min"
