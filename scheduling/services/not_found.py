"""The refusal of a name that names nothing, with what there is: read on a miss only, so that a
typo or a forgotten name is answered with the names to use instead."""

from __future__ import annotations

from scheduling.models import Deployment
from scheduling.services.errors import NoDeployment, NotFound


def deployment(name: str) -> NoDeployment:
    """NoDeployment for `name`, with the names of every deployment there is."""
    return NoDeployment(name, list(Deployment.objects.order_by("name").values_list("name", flat=True)))


def adapter(deployment_name: str, name: str, served: list[str]) -> NotFound:
    """The refusal of `deployment:name` where the deployment serves no adapter of that name."""
    listed = ", ".join(served) if served else "none"
    return NotFound(f"deployment {deployment_name!r} serves no adapter {name!r} (its adapters: {listed})")
