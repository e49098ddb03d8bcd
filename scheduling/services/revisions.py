"""A deployment's revisions: its settings as each deploy, change or rollback left them, and a
rollback to one of them (`gpuportal history`, `gpuportal rollback`), as Kubernetes keeps a
Deployment's rollout history and `kubectl rollout undo` returns to it.

A revision holds the settings a PATCH stores (deployment_spec.Setting.stored), not the replica
count: scaling, by hand or by the autoscaler, is not a revision, and a rollback leaves the scale
as it is (as a Kubernetes rollback leaves `replicas`). A rollback is a change like any other,
through deployments.update: the same checks, the same Events, a rolling restart where the model
changes back, and a revision of its own on top (the history only grows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from gpuportal.wire import deployment_spec
from scheduling.models import Deployment, DeploymentRevision
from scheduling.services.errors import InvalidInput

STORED = tuple(setting for setting in deployment_spec.SETTINGS if setting.stored)
DEPLOYED = "deployed"
CHANGED = "settings changed"
# The first revision of a deployment made before revisions were kept (migration 0046 says the same).
UNRECORDED = "as it stood when revisions began"


def settings_of(deployment: Deployment) -> dict[str, Any]:
    """What a revision keeps of the deployment as it stands: every stored setting by spec name."""
    return {setting.name: getattr(deployment, setting.column) for setting in STORED}


def record(
    deployment: Deployment, cause: str, *, by: str = "", before: Mapping[str, Any] | None = None
) -> DeploymentRevision:
    """A revision of the deployment's settings as they stand now, and the oldest beyond
    GPUPORTAL_REVISIONS_KEPT forgotten. The caller holds the deployment's row lock (or made the
    row in its own transaction): two writers never take the same number. `before`: its settings
    before the change, kept first where it has no revision at all (a row written by plain SQL, a
    tool's or a test's), so that the change has one to roll back to."""
    number = newest(deployment)
    if not number and before is not None:
        DeploymentRevision.objects.create(deployment=deployment, number=1, settings=dict(before), cause=UNRECORDED)
        number = 1
    revision = DeploymentRevision.objects.create(
        deployment=deployment, number=number + 1, settings=settings_of(deployment), cause=cause[:200], by=by
    )
    deployment.revisions.filter(number__lte=revision.number - settings.GPUPORTAL_REVISIONS_KEPT).delete()
    return revision


def changes_between(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What differs from `older` to `newer` (settings by spec name), as (before, after) by the
    setting's path in the REST body (model.source), in the spec's order. A setting one of them
    lacks (added to the spec after the older was written) is not a difference."""
    return {
        setting.path: (older[setting.name], newer[setting.name])
        for setting in STORED
        if setting.name in older and setting.name in newer and older[setting.name] != newer[setting.name]
    }


def described(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """Changes by path as the admin says them: `sleep.idle_timeout_s 60.0 → 300.0; …` ("-": none)."""
    return "; ".join(f"{path} {before!r} → {after!r}" for path, (before, after) in changes.items()) or "-"


@dataclass(frozen=True)
class Entry:
    """A revision as the history shows it: what changed from the revision kept before it (None
    for the oldest kept, whose predecessor is forgotten or never was)."""

    revision: DeploymentRevision
    current: bool
    changes: dict[str, tuple[Any, Any]] | None


def history(deployment: Deployment) -> list[Entry]:
    """The deployment's kept revisions, newest first."""
    kept = list(deployment.revisions.order_by("-number"))
    return [
        Entry(
            revision,
            current=index == 0,
            changes=changes_between(kept[index + 1].settings, revision.settings) if index + 1 < len(kept) else None,
        )
        for index, revision in enumerate(kept)
    ]


@dataclass(frozen=True)
class Target:
    """The revision a rollback returns to, and the deployment's newest revision as it was read:
    the rollback commits only while that is still the newest (a change committed meanwhile moves
    what "the one before the current" is)."""

    revision: DeploymentRevision
    newest: int


def target(deployment: Deployment, number: int | None) -> Target:
    """The revision a rollback returns to: `number`, or the one before the current. InvalidInput
    naming `revision` where there is none such."""
    kept = list(deployment.revisions.order_by("-number"))
    latest = kept[0].number if kept else 0
    if number is None:
        if len(kept) < 2:
            raise InvalidInput(
                "revision",
                f"deployment {deployment.name!r} has no earlier revision to roll back to (it has {len(kept)})",
            )
        return Target(kept[1], latest)
    for revision in kept:
        if revision.number == number:
            return Target(revision, latest)
    listed = ", ".join(str(revision.number) for revision in reversed(kept)) or "none"
    raise InvalidInput("revision", f"deployment {deployment.name!r} has no revision {number} (kept: {listed})")


def newest(deployment: Deployment) -> int:
    """The number of the deployment's newest revision (0: none kept)."""
    return deployment.revisions.order_by("-number").values_list("number", flat=True).first() or 0


def restored(revision: DeploymentRevision) -> dict[str, Any]:
    """The changes a rollback to `revision` asks for: every setting it kept that the spec still
    stores (a setting the spec dropped since is not asked for; one added since is left as it is)."""
    return {setting.name: revision.settings[setting.name] for setting in STORED if setting.name in revision.settings}
