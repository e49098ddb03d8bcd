"""The Redis broker as every portal process reads it: kombu's Redis transport, less what lets a
node that writes to a queue stop or steer the worker reading it. Celery names it
(CELERY_BROKER_TRANSPORT). Django-free.

A node's Redis user may push onto the `agents` queue (gpuportal.wire.node_acl): that is how it
calls the control plane. Kombu trusts whatever is on a queue to be one of its own messages, so
one push of something else used to stop the control plane's agents worker ("Unrecoverable
error" out of a JSON decode), and a push of a well-made message naming any other task had the
agents worker run it (a reconcile, a deepening of any sleeper) with no credential checked. Here a
message is read as kombu reads it only once it has the shape kombu's own producer gives it, and
a queue that carries one task (QUEUE_TASKS) runs no other. What is dropped is logged, never run."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kombu.exceptions import KombuError
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Empty
from prometheus_client import Counter

from gpuportal.wire.control import AGENT_CALL_TASK, AGENT_QUEUE

log = logging.getLogger(__name__)

# The queues a node may write to that a control-plane worker reads, and the tasks each carries.
QUEUE_TASKS: Mapping[str, frozenset[str]] = {AGENT_QUEUE: frozenset({AGENT_CALL_TASK})}
# How much of a dropped message the log keeps.
SHOWN_CHARS = 200
# Summed over the portal's processes as its other counters are (PROMETHEUS_MULTIPROC_DIR): a rise
# on `agents` is a node that pushes what it should not, or one of an incompatible release.
DROPPED = Counter(
    "gpuportal_broker_messages_dropped_total",
    "Messages read off a queue and dropped: not a kombu message, or a task the queue does not carry.",
    ["queue"],
)
# The label of a message whose queue is not known: it did not decode.
NOT_JSON = "(not JSON)"


def envelope_problem(message: Any, queue: str) -> str | None:
    """Why `message`, read off `queue`, is not a message kombu's producer would have written, or
    a task that queue does not carry; None when it is fit to deliver. Only what kombu and Celery
    index before they would refuse a message themselves is checked: a body that does not decode,
    a content type not accepted, a task's arguments that do not fit it, stay theirs to refuse."""
    if not isinstance(message, dict):
        return f"not a message but a JSON {type(message).__name__}"
    properties = message.get("properties")
    if not isinstance(properties, dict):
        return "no properties"
    if not isinstance(properties.get("delivery_tag"), str):
        return "no delivery tag"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or not all(isinstance(info.get(key), str) for key in ("exchange", "routing_key")):
        return "no delivery info (exchange, routing key)"
    for key, types in (("headers", dict), ("body", str), ("content-type", str), ("content-encoding", str)):
        if message.get(key) is not None and not isinstance(message[key], types):
            return f"{key} is a {type(message[key]).__name__}"
    if properties.get("body_encoding") is not None and not isinstance(properties["body_encoding"], str):
        return "body_encoding is not a string"
    carried = QUEUE_TASKS.get(queue)
    if carried is not None:
        task = (message.get("headers") or {}).get("task")
        if task not in carried:
            return f"task {task!r}: the {queue!r} queue carries only {', '.join(sorted(carried))}"
    return None


def _shown(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> bool:
        delivered = self.connection.delivered
        try:
            return super()._brpop_read(**options)
        except (Empty, KombuError, *self.connection.connection_errors, *self.connection.channel_errors):
            raise
        except Exception as err:
            # Raised after the message left the list and before it was delivered: kombu's JSON
            # decode of it (a ValueError, or what its type hooks raise). Raised out of here, it
            # would end the worker, and the message is gone from the list either way. What a
            # delivered message raised is not ours to hide.
            if self.connection.delivered != delivered:
                raise
            log.error("dropped a message on the broker that is not JSON: %s: %s", type(err).__name__, err)
            DROPPED.labels(NOT_JSON).inc()
            return True


class Transport(kombu_redis.Transport):
    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Messages handed to _deliver (kept or dropped): tells Channel what was raised before it.
        self.delivered = 0

    def _deliver(self, message: Any, queue: str) -> None:
        self.delivered += 1
        if (problem := envelope_problem(message, queue)) is not None:
            log.error("dropped a message on the %r queue: %s: %s", queue, problem, _shown(message))
            DROPPED.labels(queue).inc()
            return
        super()._deliver(message, queue)
