"""Writes of a deployment's observed record (scheduling.models.DeploymentObserved): what the portal
measured or decided about it, apart from the operator's settings on its row."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.models import Deployment


def save_observed(deployment: Deployment, fields: Sequence[str]) -> None:
    """Write these fields of `deployment.observed` as the caller set them. The caller holds the
    deployment's row lock, which covers the record (scheduling.locks). The deployment's updated_at
    moves with them: the API's answer has always shown it moving when the deployment's status or
    measured need changed, as when its settings do."""
    deployment.observed.save(update_fields=list(fields))
    deployment.save(update_fields=["updated_at"])
