"""What `manage.py up` did to keep the stack running: each restart of one of its processes."""

from __future__ import annotations

from django.db import transaction

from scheduling.core.effects import Note
from scheduling.models import Event
from scheduling.services import outbox


@transaction.atomic(durable=True)
def record_restart(process: str, reason: str, *, node: str = "") -> Note:
    """An Event for a process of the stack that died and was started again: the
    operator sees in the trail, beside the replicas' own events, why the portal blinked."""
    return outbox.note(Event.Kind.STACK_RESTARTED, f"process {process}", reason, node=node)
