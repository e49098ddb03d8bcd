"""The refusal of a name that names nothing, with what there is: read on a miss only, so that a
typo or a forgotten name is answered with the names to use instead."""

from __future__ import annotations

from scheduling.models import Deployment
from scheduling.services.errors import NoDeployment


def deployment(name: str) -> NoDeployment:
    """NoDeployment for `name`, with the names of every deployment there is."""
    return NoDeployment(name, list(Deployment.objects.order_by("name").values_list("name", flat=True)))
