"""The one place the control plane's effects are done (scheduling.core.effects): a service says
what it wants with `want` or `note`, and this module does it. Events are written inside the
transaction they describe, so they commit or roll back with it; orders to node agents and tasks
for the control worker go out only once it has committed (a rolled-back decision reaches no
agent). Inside `captured()` nothing is done: the effects are handed to the caller to read."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from django.db import transaction

from scheduling import events
from scheduling.core.effects import AfterCommit, Effect, Effects, Note, ToControl, ToNode
from scheduling.services import dispatch

_local = threading.local()


class Captured:
    """What the services wanted inside a `captured()` block, in order, none of it done."""

    def __init__(self) -> None:
        self._items: list[Effect] = []

    @property
    def effects(self) -> Effects:
        return Effects.of(self._items)


@contextlib.contextmanager
def captured() -> Iterator[Captured]:
    """Read what the services called inside want, without writing an Event or sending anything:
    how a test sees a decision's orders with no agent or worker to receive them. Inside a
    transaction the caller rolls back, what the services wrote to the books goes too."""
    outer = getattr(_local, "captured", None)
    into = Captured()
    _local.captured = into
    try:
        yield into
    finally:
        _local.captured = outer


def gathered() -> contextlib.AbstractContextManager[None]:
    """The block's Events written together, in one INSERT, as it ends (events.gathered: a scale
    call records a dozen and a round trip each was a good share of its cost)."""
    return events.gathered()


def want(*effects: Effect) -> None:
    into: Captured | None = getattr(_local, "captured", None)
    if into is not None:
        into._items.extend(effects)
        return
    for effect in effects:
        _apply(effect)


def note(kind: str, subject: str, reason: str, **where: Any) -> Note:
    """An Event saying why (the Note, for a caller that shows what it recorded). `where`: the
    Note's other fields (before, after, node, gpu, deployment, replica, console)."""
    wanted = Note(str(kind), subject, reason, **where)
    want(wanted)
    return wanted


def _apply(effect: Effect) -> None:
    # Each is registered as it is wanted, not at the end of a block: Django drops the on-commit
    # work of a savepoint that rolls back, so a refused attempt inside one sends nothing.
    if isinstance(effect, Note):
        events.record(
            effect.kind,
            effect.subject,
            effect.reason,
            before=effect.before,
            after=effect.after,
            node=effect.node,
            gpu=effect.gpu,
            deployment=effect.deployment,
            replica=effect.replica,
            console=effect.console,
        )
    elif isinstance(effect, ToNode):
        dispatch.send(effect)
    elif isinstance(effect, ToControl):
        dispatch.enqueue(effect)
    elif isinstance(effect, AfterCommit):
        transaction.on_commit(effect.call)
    else:  # pragma: no cover - the Effect union is closed
        raise TypeError(f"not an effect: {effect!r}")
