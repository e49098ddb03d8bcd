"""Writing the audit trail. Every change of state or placement records one Event saying why."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from django.db import transaction
from django.utils import timezone

from gpuportal.wire import console as wire_console
from scheduling import hot_sql
from scheduling.models import Event

_local = threading.local()
log = logging.getLogger("scheduling.lifecycle")


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
    _write(pending)


# The block's Events as one JSON document, each row's columns read from it by the server: one
# short statement whatever their number, which the server prepares once. Built as model
# instances and prepared field by field (`hot_sql.insert`), a scale batch's dozen Events cost
# 0.9 ms of client CPU; this way 0.25 (tests/scheduling/test_events.py holds the rows equal).
_COLUMNS = ("time", "kind", "subject", "reason", "before", "after", "node", "gpu", "deployment", "replica")
_TYPES = {"time": "timestamptz", "before": "jsonb", "after": "jsonb"}


@functools.cache
def _insert_sql() -> str:
    # Built once: every block of Events runs it.
    return hot_sql.statement(
        "insert_events",
        columns=", ".join(_COLUMNS),
        selected=", ".join("x." + c for c in _COLUMNS),
        typed=", ".join(c + " " + _TYPES.get(c, "text") for c in _COLUMNS),
    )


def _write(pending: list[dict[str, Any]]) -> None:
    if not pending:
        return
    with hot_sql.cursor() as cursor:
        # Plain json, as the JSONFields (no encoder of their own) would encode `before` and `after`;
        # a JSON null reaches those columns as SQL NULL, as Django writes None.
        cursor.execute(_insert_sql(), [json.dumps(pending)])


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
    console: bool = False,
) -> Event | None:
    """The Event, written now; or, inside `gathered()`, written when the block ends (None here).
    With `console`, also one line for the operator watching `up` (gpuportal.wire.console)."""
    if console:
        _tell_console(subject, reason, after, deployment)
    pending = getattr(_local, "pending", None)
    if pending is not None:
        pending.append(
            {
                "time": timezone.now().isoformat(),
                "kind": str(kind),
                "subject": subject,
                "reason": reason,
                "before": before,
                "after": after,
                "node": node,
                "gpu": gpu,
                "deployment": deployment,
                "replica": replica,
            }
        )
        return None
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
    event.save(force_insert=True)
    return event


def console_line(subject: str, reason: str, after: Any, deployment: str) -> str:
    """The Event as one line for the operator's console: whose, what it became, and why."""
    became = f" {after['state']}" if isinstance(after, dict) and isinstance(after.get("state"), str) else ""
    return f"{deployment + ': ' if deployment else ''}{subject}{became}: {reason}"


def _tell_console(subject: str, reason: str, after: Any, deployment: str) -> None:
    line = console_line(subject, reason, after, deployment)
    # Once it is so: an Event that rolls back with its transaction never happened.
    transaction.on_commit(lambda: log.info("%s %s", wire_console.MARK, line))
