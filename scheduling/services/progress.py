"""Reads what scheduling.core.progress describes: the deployment's awake replicas and measured times
(PostgreSQL) and the request's place in its queue (Redis). A finished or running request reads
nothing, so the hot path's answers cost no query."""

from __future__ import annotations

import logging

import redis
from django.db import DatabaseError, InterfaceError

from gpuportal.wire.requestqueue import Request
from gpuportal.wire.states import AWAKE
from scheduling.core.progress import ENDED, RUNNING, Progress, ReplicaFacts, describe
from scheduling.models import DeploymentObserved, Replica
from scheduling.services.queueing import glance

log = logging.getLogger(__name__)

_Facts = tuple[tuple[ReplicaFacts, ...], float | None, float | None]


class Reader:
    """Progress of requests, reading each deployment once: one per answer (a list of requests)."""

    def __init__(self) -> None:
        self._facts: dict[str, _Facts] = {}

    def of(self, request: Request) -> Progress:
        if request.status in ENDED or request.status in RUNNING:
            return describe(request.status, (), queue_position=None, load_s=None, wake_s=None)
        try:
            replicas, load_s, wake_s = self._deployment(request.deployment)
            position = glance().position(request.deployment, request.id)
        except (DatabaseError, InterfaceError, redis.RedisError) as err:
            # Said without what it waits for: the answer to a request just accepted must not fail
            # for want of its progress, since an outage's 503 would tell its client it did not run.
            log.info("progress of request %s left out: %s", request.id, err)
            return describe(request.status, (), queue_position=None, load_s=None, wake_s=None)
        return describe(request.status, replicas, queue_position=position, load_s=load_s, wake_s=wake_s)

    def _deployment(self, name: str) -> _Facts:
        if name not in self._facts:
            times = (
                DeploymentObserved.objects.filter(deployment__name=name)
                .values_list("measured_load_s", "measured_wake_s")
                .first()
            )
            rows = Replica.objects.filter(deployment__name=name, state__in=AWAKE)
            replicas = tuple(ReplicaFacts(state, progress) for state, progress in rows.values_list("state", "progress"))
            self._facts[name] = (replicas, *(times or (None, None)))
        return self._facts[name]
