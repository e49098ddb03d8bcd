"""Everything the control plane sends to the other side goes through here: the
commands to node agents (gpuportal.wire.commands), each sent only once the decision that caused
it has committed, and the tasks on the control queue, both as the outbox hands them over
(scheduling.services.outbox); and the two questions it asks the nodes and waits for, what a
model's files hold (gpuportal.wire.inspection) and a replica's log. By task name: the control plane never imports the
GPU side."""

from __future__ import annotations

import logging
import time

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F

from gpuportal.celery import app
from gpuportal.wire import commands, replies
from gpuportal.wire.commands import node_queue
from gpuportal.wire.inspection import INSPECT_TASK, InspectModel, ModelReading
from gpuportal.wire.pulls import PULL_TASK, PullModel
from gpuportal.wire.replica_logs import LOG_TASK, ReadLog
from scheduling.core.effects import Order, ToControl, ToNode
from scheduling.models import Node
from scheduling.services import queue_grants, replica_specs
from scheduling.services.errors import InvalidState, Unavailable

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"


# How long a log read waits for the node's agent: an operator at a prompt, not a deploy.
LOG_TIMEOUT_S = 10.0


def _command(order: ToNode) -> commands.Command | None:
    """The wire command for an order, from the committed rows, as the agent once read them itself
    (None when its replica no longer waits for it)."""
    match order.order:
        case Order.START:
            return replica_specs.start(order.replica_id, list(order.wait_for))
        case Order.START_PLACED:
            return order.command
        case Order.WAKE:
            return replica_specs.wake(order.replica_id, list(order.wait_for))
        case Order.SLEEP:
            return replica_specs.sleep(order.replica_id)
        case Order.STOP:
            return replica_specs.stop(order.replica_id, order.drain_timeout_s, close_pair=order.close_pair)
        case Order.KEEP_ARENA:
            return commands.KeepArena(order.replica_id, order.keep)
        case Order.DEEPEN:
            return replica_specs.deepen(order.replica_id)


def send(order: ToNode) -> None:
    """The order to its node's agent once the transaction commits (scheduling.services.outbox)."""

    # on_commit: a rolled-back decision must not reach an agent.
    def send_now() -> None:
        command = _command(order)
        if command is None:
            log.info("no command for node %s: its replica is no longer waiting for it", order.node)
            return
        if isinstance(command, commands.StartReplica) and command.spec.deployment:
            # Before the start: its process takes from the deployment's queue as soon as it loads.
            try:
                queue_grants.grant(order.node, command.spec.deployment)
            except redis.RedisError as err:
                log.warning(
                    "node %s's Redis user could not be given deployment %s's queue (%s): replica %s's start "
                    "is not sent, and its node's heartbeat finds it lost",
                    order.node,
                    command.spec.deployment,
                    err,
                    command.replica_id,
                )
                return
        app.send_task(commands.TASKS[command.kind], args=[commands.encode(command)], queue=node_queue(order.node))

    transaction.on_commit(send_now)


def pull(node: str, pull_id: str, repo: str, revision: str | None, progress: str) -> None:
    """Ask `node`'s agent to fetch a model into its cache (scheduling.services.pulls). At once:
    nothing is decided in the database for it."""
    ask = PullModel(pull_id, repo, revision, progress)
    app.send_task(PULL_TASK, args=[ask.encode()], queue=node_queue(node))


def _answers() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def inspect(source: str, loader: str, dtype: str, adapters: str = "") -> ModelReading:
    """What a node agent reads of the model's files, waited for. Not on commit: nothing is
    decided yet, and this is what the decision needs.

    Asked of the online node heard from last, on its own queue (no queue is shared by the nodes:
    gpuportal.wire.node_acl). While none has answered, the next online node is asked as well every
    GPUPORTAL_INSPECT_HEDGE_S: a node's worker may be busy (a pull), or stuck while its beat goes
    on. They all answer on one list, and the first answer counts."""
    online = list(
        Node.objects.filter(status=Node.Status.ONLINE)
        .order_by(F("last_heartbeat").desc(nulls_last=True), "name")
        .values_list("name", flat=True)
    )
    if not online:
        drained = sorted(Node.objects.filter(status=Node.Status.DRAINING).values_list("name", flat=True))
        if drained:
            # Waiting would not help, and the operator's own drain is why: say so, not "start one".
            raise InvalidState(
                f"every online node is drained ({', '.join(drained)}): nothing new is placed on a drained node; "
                f"return one to service (POST /api/nodes/{drained[0]}/undrain/) to deploy"
            )
        raise Unavailable("no node is online to read the model's files: start a node agent (manage.py agent)")
    ask = InspectModel(source, loader, dtype, replies.new_list("inspect"), adapters)
    timeout = settings.GPUPORTAL_INSPECT_TIMEOUT_S
    deadline = time.monotonic() + timeout
    asked: list[str] = []
    for name in online:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # Expires with the wait: an agent that comes to it later does not read for nobody.
        app.send_task(INSPECT_TASK, args=[ask.encode()], queue=node_queue(name), expires=left)
        asked.append(name)
        wait_s = left if name == online[-1] else min(left, settings.GPUPORTAL_INSPECT_HEDGE_S)
        try:
            return ModelReading.from_record(replies.wait(_answers(), ask.reply_to, wait_s, "reading the model's files"))
        except replies.TimedOut:
            continue
        except replies.NoAnswer as err:
            raise Unavailable(str(err)) from None
    raise Unavailable(
        f"no answer to reading the model's files within {timeout:g} s from node(s) {', '.join(asked)}: "
        "are their agents up?"
    )


def replica_log(node: str, replica_id: str, tail: int, since: int | None = None) -> dict:
    """The last `tail` lines of the replica's log, or its whole lines after byte `since`, read by
    its node's agent: {"path", "lines", "missing", "end", "skipped"} ("end" and "skipped" where
    the agent is of this release). Unavailable (503) when the agent does not answer in a few
    seconds."""
    ask = ReadLog(replica_id, tail, replies.new_list("log"), since)
    # Expires with the wait, as an inspection does: an agent that comes to it later reads for nobody.
    app.send_task(LOG_TASK, args=[ask.encode()], queue=node_queue(node), expires=LOG_TIMEOUT_S)
    try:
        return replies.wait(_answers(), ask.reply_to, LOG_TIMEOUT_S, f"node {node}'s agent to read the log")
    except replies.NoAnswer as err:
        raise Unavailable(f"{err}: is node {node}'s agent up?") from None


def enqueue(task: ToControl) -> None:
    """A control-plane task, after the commit, not before its countdown."""
    transaction.on_commit(
        lambda: app.send_task(task.task, args=list(task.args), queue=CONTROL_QUEUE, countdown=task.countdown)
    )
