"""Test rows made straight with the ORM. Placing a replica here writes the Occupant and the
GPU's available_bytes together, keeping invariant 1 of docs/architecture.md as the ledger would."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

from django.db.models import F
from django.utils import timezone

from inference.devices import VirtualProfile
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, Node, Occupant, PreemptionIntent, Replica

GIB = 1024**3
# A GPU with no CUDA context, driver reserve or standby context: for tests of placement, fairness
# and the commit path, whose sizes are about those decisions. The accounting of a real GPU (the
# H100 profile, the default everywhere else) has its own tests (test_gpu_accounting.py), and the
# tests that run real agents and replica processes use it.
NO_OVERHEAD = VirtualProfile(context_bytes=0, standby_context_bytes=0, driver_reserve_bytes=0)
_seq = itertools.count(1)


def node(name: str | None = None, **fields: Any) -> Node:
    name = name or f"node{next(_seq)}"
    fields.setdefault("queue", f"node.{name}")
    fields.setdefault("last_heartbeat", timezone.now())
    return Node.objects.create(name=name, **fields)


def gpu(on: Node, index: int = 0, total_bytes: int = 24 * GIB, **fields: Any) -> GPU:
    fields.setdefault("uuid", f"GPU-{on.name}-{index}-{next(_seq)}")
    fields.setdefault("product", "Virtual GPU")
    fields.setdefault("virtual", True)
    fields.setdefault("context_bytes", NO_OVERHEAD.context_bytes)
    fields.setdefault("standby_context_bytes", NO_OVERHEAD.standby_context_bytes)
    return GPU.objects.create(node=on, index=index, total_bytes=total_bytes, available_bytes=total_bytes, **fields)


# What a test may give a deployment of its observed record's (measured or decided), by name.
OBSERVED = frozenset(f.name for f in DeploymentObserved._meta.concrete_fields) - {"deployment"}


def deployment(name: str | None = None, **fields: Any) -> Deployment:
    """A deployment and its observed record, as the services create them: `fields` names settings
    and, to start from, what was measured or decided (`load_failures=2`)."""
    fields.setdefault("model_source", "/srv/models/tiny")
    observed = {key: fields.pop(key) for key in OBSERVED & set(fields)}
    made = Deployment.objects.create(name=name or f"dep{next(_seq)}", **fields)
    DeploymentObserved.objects.create(deployment=made, **observed)
    return made


def serving(name: str, **fields: Any) -> Replica:
    """A deployment (`fields` as `deployment` takes them) with one replica row serving, for a
    stand-in or an in-process serving loop to answer its queue; what an earlier test left queued
    under its name on this worker's Redis database is failed first, so that no one takes it."""
    from scheduling.services import requests as request_services

    made = deployment(name=name, **fields)
    request_services.queue().fail_queued(name, reason="left over from another test")
    return Replica.objects.create(deployment=made, state=Replica.State.SERVING)


def replica(of: Deployment, on: Node | None = None, **fields: Any) -> Replica:
    return Replica.objects.create(deployment=of, node=on, **fields)


def occupy(rep: Replica, on: GPU, reserved_bytes: int) -> Occupant:
    occupant = Occupant.objects.create(gpu=on, replica=rep, reserved_bytes=reserved_bytes)
    GPU.objects.filter(pk=on.pk).update(available_bytes=F("available_bytes") - reserved_bytes, version=F("version") + 1)
    on.refresh_from_db()
    return occupant


def intent(waiting: Replica, on: GPU, needed_bytes: int, **fields: Any) -> PreemptionIntent:
    fields.setdefault("deadline", timezone.now() + timedelta(seconds=5))
    return PreemptionIntent.objects.create(gpu=on, waiting_replica=waiting, needed_bytes=needed_bytes, **fields)


def event(kind: str = Event.Kind.REPLICA_STATE, **fields: Any) -> Event:
    fields.setdefault("subject", "replica x")
    fields.setdefault("reason", "test")
    return Event.objects.create(kind=kind, **fields)
