"""Writing the audit trail. Every change of state or placement records one Event saying why."""

from __future__ import annotations

from typing import Any

from scheduling.models import Event


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
    return Event.objects.create(
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
