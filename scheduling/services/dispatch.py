"""Everything the control plane sends to the other side goes through here: the
commands to node agents (gpuportal.wire.commands), each sent only once the decision that caused
it has committed; the tasks on the control queue; and the one question it asks the nodes, what a
model's files hold (gpuportal.wire.inspection). By task name: the control plane never imports the
GPU side."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import transaction

from gpuportal.celery import app
from gpuportal.wire import commands, replies
from gpuportal.wire.commands import node_queue
from gpuportal.wire.inspection import INSPECT_QUEUE, INSPECT_TASK, InspectModel, ModelReading
from gpuportal.wire.replica_logs import LOG_TASK, ReadLog
from scheduling.models import Node
from scheduling.services import replica_specs
from scheduling.services.errors import InvalidState, Unavailable

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"


# How long a log read waits for the node's agent: an operator at a prompt, not a deploy.
LOG_TIMEOUT_S = 10.0
# scheduling.tasks.trim_host_cache: named here, as the node tasks are, so no service imports the tasks.
TRIM_HOST_CACHE_TASK = "scheduling.tasks.trim_host_cache"


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


def start_placed(node: str, command: commands.StartReplica) -> None:
    """Send a START built inside the transaction that placed its replica (replica_specs.start_placed),
    once that transaction commits: what the committed rows would give, without reading them."""
    _to_node(node, lambda: command)


def wake(node: str, replica_id: str, wait_for: list[str]) -> None:
    _to_node(node, lambda: replica_specs.wake(replica_id, wait_for))


def sleep(node: str, replica_id: str) -> None:
    _to_node(node, lambda: replica_specs.sleep(replica_id))


def trim_host_cache(node: str) -> None:
    """After the commit that sends replicas to sleep on `node`, or wakes one there: its host cache
    within its budget, then its spare room lent as kept arenas (scheduling.services.host_cache.balance,
    on the control worker)."""
    to_control(TRIM_HOST_CACHE_TASK, node)


def keep_arena(node: str, replica_id: str, *, keep: bool) -> None:
    """Whether the awake replica may keep a host arena for its next sleep."""
    _to_node(node, lambda: commands.KeepArena(replica_id, keep))


def stop(node: str, replica_id: str, *, drain_timeout_s: float | None = None) -> None:
    """`drain_timeout_s`: the deployment's, when the caller holds its row (else read at commit)."""
    _to_node(node, lambda: replica_specs.stop(replica_id, drain_timeout_s))


def _answers() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def inspect(source: str, loader: str, dtype: str) -> ModelReading:
    """What a node agent reads of the model's files, waited for. Not on commit: nothing is
    decided yet, and this is what the decision needs. Whichever agent is free first answers."""
    if not Node.objects.filter(status=Node.Status.ONLINE).exists():
        drained = sorted(Node.objects.filter(status=Node.Status.DRAINING).values_list("name", flat=True))
        if drained:
            # Waiting would not help, and the operator's own drain is why: say so, not "start one".
            raise InvalidState(
                f"every online node is drained ({', '.join(drained)}): nothing new is placed on a drained node; "
                f"return one to service (POST /api/nodes/{drained[0]}/undrain/) to deploy"
            )
        raise Unavailable("no node is online to read the model's files: start a node agent (manage.py agent)")
    ask = InspectModel(source, loader, dtype, replies.new_list("inspect"))
    timeout = settings.GPUPORTAL_INSPECT_TIMEOUT_S
    # Expires with the wait: an agent that comes to it later does not read for nobody.
    app.send_task(INSPECT_TASK, args=[ask.encode()], queue=INSPECT_QUEUE, expires=timeout)
    try:
        return ModelReading.from_record(replies.wait(_answers(), ask.reply_to, timeout, "reading the model's files"))
    except replies.NoAnswer as err:
        raise Unavailable(f"{err}: are the node agents up and their `{INSPECT_QUEUE}` queue consumed?") from None


def replica_log(node: str, replica_id: str, tail: int) -> dict:
    """The last `tail` lines of the replica's log, read by its node's agent: {"path", "lines",
    "missing"}. Unavailable (503) when the agent does not answer in a few seconds."""
    ask = ReadLog(replica_id, tail, replies.new_list("log"))
    # Expires with the wait, as an inspection does: an agent that comes to it later reads for nobody.
    app.send_task(LOG_TASK, args=[ask.encode()], queue=node_queue(node), expires=LOG_TIMEOUT_S)
    try:
        return replies.wait(_answers(), ask.reply_to, LOG_TIMEOUT_S, f"node {node}'s agent to read the log")
    except replies.NoAnswer as err:
        raise Unavailable(f"{err}: is node {node}'s agent up?") from None


def to_control(task: str, *args: object, countdown: float | None = None) -> None:
    """A control-plane task, after the commit, optionally not before `countdown` seconds."""
    transaction.on_commit(lambda: app.send_task(task, args=list(args), queue=CONTROL_QUEUE, countdown=countdown))
