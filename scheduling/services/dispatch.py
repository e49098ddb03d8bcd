"""Effects on node agents, sent only once the decision that caused them has committed."""

from __future__ import annotations

from django.db import transaction

from gpuportal.celery import app

START = "inference.tasks.start_replica"
TO_CACHE = "inference.tasks.replica_to_cache"
FROM_CACHE = "inference.tasks.replica_from_cache"
STOP = "inference.tasks.stop_replica"


def to_node(queue: str, task: str, *args: object) -> None:
    # on_commit: a rolled-back decision must not reach an agent, and an agent must not read rows
    # that are not committed yet. By name, so the control plane never imports the GPU side.
    transaction.on_commit(lambda: app.send_task(task, args=list(args), queue=queue))


CONTROL_QUEUE = "control"


def to_control(task: str, *args: object, countdown: float | None = None) -> None:
    """A control-plane task, after the commit, optionally not before `countdown` seconds."""
    transaction.on_commit(lambda: app.send_task(task, args=list(args), queue=CONTROL_QUEUE, countdown=countdown))
