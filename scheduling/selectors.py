"""Read-side queries. Every list a view or page shows comes from here, shaped with
select_related / prefetch_related so a list costs a fixed number of queries however many rows
it holds. Nothing here writes."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Count, Prefetch, QuerySet

from gpuportal.wire import states
from scheduling.models import (
    ACTIVE_INTENT_STATUSES,
    GPU,
    REPLICA_ID_LENGTH,
    Deployment,
    Event,
    Node,
    Occupant,
    PreemptionIntent,
    Replica,
)


def nodes() -> QuerySet[Node]:
    return Node.objects.annotate(gpu_count=Count("gpus")).order_by("name")


def _occupancies_with_gpu() -> Prefetch:
    return Prefetch("occupancies", queryset=Occupant.objects.select_related("gpu"))


def replicas(
    *,
    deployment: str | None = None,
    state: str | None = None,
    exclude_state: str | None = None,
    node: str | None = None,
) -> QuerySet[Replica]:
    qs = Replica.objects.select_related("deployment", "node", "lease").prefetch_related(_occupancies_with_gpu())
    if deployment:
        qs = qs.filter(deployment__name=deployment)
    if state:
        qs = qs.filter(state=state)
    if exclude_state:
        qs = qs.exclude(state=exclude_state)
    if node:
        qs = qs.filter(node__name=node)
    return qs


def state_reasons(replica_ids: Iterable[str]) -> dict[str, str]:
    """Why each replica is in its state: the reason its latest state Event gives, in one query."""
    ids = list(replica_ids)
    if not ids:
        return {}
    latest = (
        Event.objects.filter(kind=Event.Kind.REPLICA_STATE, replica__in=ids)
        .order_by("replica", "-time", "-id")
        .distinct("replica")
        .values_list("replica", "reason")
    )
    return dict(latest)


def deployments() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("observed").prefetch_related(
        Prefetch(
            "replicas",
            queryset=Replica.objects.select_related("node", "lease").prefetch_related(_occupancies_with_gpu()),
        )
    )


def gpus(*, node: str | None = None) -> QuerySet[GPU]:
    """GPUs with occupants, active intents (as `active_intents`) and the wake-lock holder."""
    qs = GPU.objects.select_related("node", "wake_lock_holder__deployment").prefetch_related(
        # With what was measured of each occupant's deployment: the dashboard's bars show it.
        Prefetch("occupants", queryset=Occupant.objects.select_related("replica__deployment__observed")),
        Prefetch(
            "intents",
            queryset=PreemptionIntent.objects.filter(status__in=ACTIVE_INTENT_STATUSES).select_related(
                "waiting_replica__deployment"
            ),
            to_attr="active_intents",
        ),
    )
    if node:
        qs = qs.filter(node__name=node)
    return qs


# The kinds the trail records, and their families (the part before the dot, "replica" for
# replica.state): a filter names one or the other.
EVENT_KINDS: tuple[str, ...] = tuple(Event.Kind.values)
EVENT_FAMILIES: tuple[str, ...] = tuple(sorted({k.split(".")[0] for k in EVENT_KINDS if "." in k}))


# A replica's short id (`gpuportal ls`): its first 8 characters; a start shorter than this is
# not taken for one (it would match too many ids to say which).
SHORT_ID_MIN = 4


def events(
    *,
    kind: str | None = None,
    deployment: str | None = None,
    gpu: str | None = None,
    node: str | None = None,
    replica: str | None = None,
    since: datetime | None = None,
) -> QuerySet[Event]:
    """Newest first (the model's ordering); each filter is an exact match on the stored name, but
    a `kind` that names a family (`replica`) matches each of its kinds, and a `replica` may be the
    start of its id, as `gpuportal ls` and the Events themselves show one (`3f2a1b2c`)."""
    qs = Event.objects.all()
    if kind in EVENT_FAMILIES:
        qs, kind = qs.filter(kind__startswith=kind + "."), None
    if replica and SHORT_ID_MIN <= len(replica) < REPLICA_ID_LENGTH:
        qs, replica = qs.filter(replica__startswith=replica), None
    exact = {"kind": kind, "deployment": deployment, "gpu": gpu, "node": node, "replica": replica}
    qs = qs.filter(**{field: value for field, value in exact.items() if value})
    if since is not None:
        qs = qs.filter(time__gte=since)
    return qs


def kv_figures(replicas: Iterable[Replica]) -> dict[str, dict[str, Any]]:
    """The KV pool figures of those of `replicas` that hold their weights (serving or draining): a
    replica gone to sleep has freed its pool, though what it last published has yet to expire."""
    return kv_stats(r.id for r in replicas if r.state in states.HOLDING_WEIGHTS)


def kv_stats(replica_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Replicas' KV pool figures, published in Redis by the replicas themselves (gpuportal.wire.kvstats);
    {} when Redis cannot be read: a view or a scrape must not fail for want of them."""
    from redis.exceptions import RedisError

    from gpuportal.wire import kvstats
    from scheduling.services import requests as request_services

    try:
        return kvstats.read_many(request_services.queue().redis, replica_ids)
    except RedisError:
        return {}
