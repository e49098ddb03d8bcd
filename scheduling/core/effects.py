"""What a decision wants done, as values: the Events that say why, the orders to node agents and
the tasks for the control worker. A service adds them to its transaction's outbox
(scheduling.services.outbox) instead of doing them, and the outbox alone does them: the Events
inside the transaction they describe, everything else once it has committed. So a test can run a
service and read what it wanted, with no agent, broker or process to watch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class Note:
    """An Event: a change of state or placement and why."""

    kind: str
    subject: str
    reason: str
    before: Any = None
    after: Any = None
    node: str = ""
    gpu: str = ""
    deployment: str = ""
    replica: str = ""
    # Whether the operator's console (up's) tells of it too: a deploy, a delete, a replica
    # serving, asleep or failed (gpuportal.wire.console). The rest is the audit trail's alone.
    console: bool = False


class Order(StrEnum):
    """What a node agent is told to do with one replica (gpuportal.wire.commands)."""

    START = "start"
    # A START built inside the transaction that placed its replica, sent as built.
    START_PLACED = "start_placed"
    WAKE = "wake"
    SLEEP = "sleep"
    STOP = "stop"
    KEEP_ARENA = "keep_arena"
    DEEPEN = "deepen"


@dataclass(frozen=True)
class ToNode:
    """An order for `node`'s agent. Built into its wire command only after the commit, from the
    committed rows (START_PLACED excepted), so a rolled-back decision reaches no agent."""

    order: Order
    node: str
    replica_id: str
    # START and WAKE: replicas evicted for this one, whose GPUs it waits for.
    wait_for: tuple[str, ...] = ()
    # STOP: the deployment's drain timeout when the caller holds its row (else read at commit), and
    # whether the replica's failover pair stops whole (its partner must not take over).
    drain_timeout_s: float | None = None
    close_pair: bool = False
    # KEEP_ARENA: whether the awake replica may keep a host arena for its next sleep.
    keep: bool = False
    # START_PLACED: the wire command itself.
    command: Any = None


@dataclass(frozen=True)
class ToControl:
    """A task for the control worker (scheduling.tasks, by name), not before `countdown` s."""

    task: str
    args: tuple[Any, ...] = ()
    countdown: float | None = None


@dataclass(frozen=True)
class AfterCommit:
    """Work outside the database that must see the commit first (ending requests in Redis that
    waited for what was just given up); `what` names it in the logs and in a test's reading."""

    what: str
    call: Callable[[], None] = field(compare=False)


Effect = Note | ToNode | ToControl | AfterCommit


@dataclass(frozen=True)
class Effects:
    """Effects in the order they were wanted."""

    items: tuple[Effect, ...] = ()

    @classmethod
    def of(cls, effects: Iterable[Effect]) -> Effects:
        return cls(tuple(effects))

    @property
    def notes(self) -> list[Note]:
        return [e for e in self.items if isinstance(e, Note)]

    @property
    def orders(self) -> list[ToNode]:
        return [e for e in self.items if isinstance(e, ToNode)]

    def orders_for(self, replica_id: str) -> list[Order]:
        return [e.order for e in self.orders if e.replica_id == replica_id]


# The constructors the services use, one per order and per kind of task.


def start(node: str, replica_id: str, wait_for: Iterable[str] = ()) -> ToNode:
    """Start the replica's process, once `wait_for` (replicas evicted for it) let go of its GPUs."""
    return ToNode(Order.START, node, replica_id, wait_for=tuple(wait_for))


def start_placed(node: str, command: Any) -> ToNode:
    """A START built inside the transaction that placed its replica: what the committed rows
    would give, without reading them again."""
    return ToNode(Order.START_PLACED, node, command.replica_id, command=command)


def wake(node: str, replica_id: str, wait_for: Iterable[str] = ()) -> ToNode:
    return ToNode(Order.WAKE, node, replica_id, wait_for=tuple(wait_for))


def sleep(node: str, replica_id: str) -> ToNode:
    return ToNode(Order.SLEEP, node, replica_id)


def stop(node: str, replica_id: str, *, drain_timeout_s: float | None = None, close_pair: bool = False) -> ToNode:
    return ToNode(Order.STOP, node, replica_id, drain_timeout_s=drain_timeout_s, close_pair=close_pair)


def keep_arena(node: str, replica_id: str, *, keep: bool) -> ToNode:
    return ToNode(Order.KEEP_ARENA, node, replica_id, keep=keep)


def deepen(node: str, replica_id: str) -> ToNode:
    """The sleeper writes its weights to the node's host copy and its process exits (deep sleep)."""
    return ToNode(Order.DEEPEN, node, replica_id)


# scheduling.tasks.trim_host_cache, by name: no service imports the tasks.
TRIM_HOST_CACHE_TASK = "scheduling.tasks.trim_host_cache"


def trim_host_cache(node: str) -> ToControl:
    """After the commit that sends replicas to sleep on `node`, or wakes one there: its host
    cache within its budget, then its spare room lent as kept arenas."""
    return ToControl(TRIM_HOST_CACHE_TASK, (node,))


# scheduling.tasks.advance_restarts, by name.
ADVANCE_RESTARTS_TASK = "scheduling.tasks.advance_restarts"


def advance_restarts() -> ToControl:
    """After the commit in which a replacement of a rolling restart serves: the restart's next
    step now, rather than at the beat's next sweep."""
    return ToControl(ADVANCE_RESTARTS_TASK, ())


def to_control(task: str, *args: Any, countdown: float | None = None) -> ToControl:
    return ToControl(task, tuple(args), countdown)
