"""The one lock order of the control plane's writes, in one place: a deployment row first, then
GPU rows in primary-key order (the ledger's commit takes those), then replica rows. A writer that
needs several takes them through here in that order, so two writers never wait on each other in
a circle."""

from __future__ import annotations

from scheduling.models import Deployment
from scheduling.services.errors import NotFound


def lock_deployment(name: str) -> Deployment:
    """The deployment's row, locked until the transaction ends (NotFound, a 404, if there is none)."""
    try:
        return Deployment.objects.select_for_update().get(name=name)
    except Deployment.DoesNotExist:
        raise NotFound(f"no deployment named {name!r}") from None
