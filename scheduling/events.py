"""Writing the audit trail. Every change of state or placement records one Event saying why."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from scheduling import hot_sql
from scheduling.models import Event

_local = threading.local()


@contextlib.contextmanager
def gathered() -> Iterator[None]:
    """Events recorded inside the block are written together, in one INSERT, as it ends (inside
    the caller's transaction, so they commit or roll back with what they describe). A scale call
    records several, and a round trip each was a good share of its cost. A block inside another
    writes with the outer one; a block left by an exception writes nothing (its transaction is
    rolling back). Not for a block that catches a savepoint's error inside it and goes on: the
    Events recorded in the rolled-back savepoint would still be written."""
    if getattr(_local, "pending", None) is not None:
        yield
        return
    _local.pending = []
    try:
        yield
        pending = _local.pending
    finally:
        _local.pending = None
    # Written without reading their ids back (nothing here uses them), and without Django
    # compiling the INSERT anew on every call.
    hot_sql.insert(pending)


def record(
    kind: str,
    subject: str,
    reason: str,
    *,
    before: Any = None,
    after: Any = None,
    node: str = "",
    gpu: str = "",
    deployment: str = "",
    replica: str = "",
) -> Event:
    """The Event, written now; or, inside `gathered()`, when the block ends (unsaved until then)."""
    event = Event(
        kind=kind,
        subject=subject,
        reason=reason,
        before=before,
        after=after,
        node=node,
        gpu=gpu,
        deployment=deployment,
        replica=replica,
    )
    pending = getattr(_local, "pending", None)
    if pending is None:
        event.save(force_insert=True)
    else:
        pending.append(event)
    return event
