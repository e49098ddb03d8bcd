"""Everything the control plane sends to the other side goes through here (issue 17): the
commands to node agents (gpuportal.wire.commands) and the tasks on the control queue, each sent
only once the decision that caused it has committed. By task name: the control plane never
imports the GPU side."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction

from gpuportal.celery import app
from gpuportal.wire import commands
from gpuportal.wire.commands import node_queue
from scheduling.services import replica_specs

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"


def _to_node(node: str, build: Callable[[], commands.Command | None]) -> None:
    # on_commit: a rolled-back decision must not reach an agent. The command is built then, from
    # the committed rows, as the agent once read them itself.
    def send() -> None:
        command = build()
        if command is None:
            log.info("no command for node %s: its replica is no longer waiting for it", node)
            return
        app.send_task(commands.TASKS[command.kind], args=[commands.encode(command)], queue=node_queue(node))

    transaction.on_commit(send)


def start(node: str, replica_id: str, wait_for: list[str]) -> None:
    """Start the replica's process, once `wait_for` (replicas evicted for it) let go of its GPUs."""
    _to_node(node, lambda: replica_specs.start(replica_id, wait_for))


def wake(node: str, replica_id: str, wait_for: list[str]) -> None:
    _to_node(node, lambda: replica_specs.wake(replica_id, wait_for))


def sleep(node: str, replica_id: str) -> None:
    _to_node(node, lambda: replica_specs.sleep(replica_id))


def stop(node: str, replica_id: str) -> None:
    _to_node(node, lambda: replica_specs.stop(replica_id))


def to_control(task: str, *args: object, countdown: float | None = None) -> None:
    """A control-plane task, after the commit, optionally not before `countdown` seconds."""
    transaction.on_commit(lambda: app.send_task(task, args=list(args), queue=CONTROL_QUEUE, countdown=countdown))
