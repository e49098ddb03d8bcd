"""Labels and taints an operator sets on a node (`PATCH /api/nodes/NAME/`, `gpuportal node label`
and `gpuportal node taint`), as `kubectl label` and `kubectl taint` set them on a Kubernetes node:
over what its agent says, and kept across the agent's restarts (gpuportal.wire.node_labels.changed).
A taint keeps new replicas off (NoSchedule): what runs there stays, as a changed label leaves a
replica whose deployment's node selector no longer matches where it is until a restart moves it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from django.db import transaction

from gpuportal.wire import node_labels, states
from scheduling import locks
from scheduling.models import Event, Node, Replica
from scheduling.services import outbox
from scheduling.services.errors import InvalidInput
from scheduling.services.nodes import reconcile_later

MARKS = ("labels", "taints")


def change(
    name: str,
    *,
    labels: Mapping[str, str | None] | None = None,
    taints: Mapping[str, str | None] | None = None,
    by: str,
    whole: bool = False,
) -> Node:
    """Set (a value) or remove (None) the operators' labels and taints of a node, all or none:
    InvalidInput naming the first refused (`labels.zone`: a bad key or value, one its agent says,
    one it does not have) and nothing changed; NotFound for no such node. With `whole`, what is
    given is all the operators' labels (or taints): those it leaves out are removed. An Event
    says what changed, and the reconciler places what may now go there."""
    asked = {"labels": labels, "taints": taints}
    with transaction.atomic():
        # Under the node's row lock, which its agent's registration takes to write its own layer:
        # neither write loses the other's.
        node = locks.lock_node(name)
        before = {what: getattr(node, what) for what in MARKS}
        changed: list[str] = []
        for what in MARKS:
            if asked[what] is None:
                continue
            agent, operator = getattr(node, f"agent_{what}"), getattr(node, f"operator_{what}")
            changes: Mapping[str, str | None] = asked[what]  # type: ignore[assignment]
            if whole:
                # Read under the lock: what another operator set meanwhile is removed only if the
                # form that leaves it out is the later write.
                changes = {**dict.fromkeys(set(operator) - set(changes)), **changes}
            layer, refused = node_labels.changed(agent, operator, changes)
            if refused:
                key, why = next(iter(refused.items()))
                raise InvalidInput(f"{what}.{key}", f"node {name}: {why}")
            if layer != operator:
                setattr(node, f"operator_{what}", layer)
                setattr(node, what, node_labels.merged(agent, layer))
                changed.append(what)
        if not changed:
            return node
        node.save(update_fields=[field for what in changed for field in (what, f"operator_{what}")])
        outbox.note(
            Event.Kind.NODE_CHANGED,
            f"node {name}",
            f"{by} set its {' and '.join(changed)}: "
            + "; ".join(_what_changed(what, before[what], node) for what in changed)
            + _misplaced_on(node),
            before={what: before[what] for what in changed},
            after={what: getattr(node, what) for what in changed},
            node=name,
        )
        # A label added or a taint lifted may let a deployment place what it lacks there.
        reconcile_later(f"node {name}'s {' and '.join(changed)} changed")
    return node


def _misplaced_on(node: Node) -> str:
    """What the Event says of the replicas on the node whose deployments' placement refuses it
    now, and how to move them ("" for none): NoSchedule leaves them there."""
    held = node.replicas.exclude(state__in=[*states.GONE, Replica.State.PARKED]).values_list(
        "deployment__name", "deployment__placement_node_selector", "deployment__placement_tolerations"
    )
    marks = {node.name: (node.labels, node.taints)}
    refused = Counter(name for name, *placement in held if node_labels.refusals(marks, name, *placement))
    if not refused:
        return ""
    listed = ", ".join(f"{name} ({count})" for name, count in sorted(refused.items()))
    return (
        f"; replicas there their placement now refuses stay until moved: {listed} (gpuportal restart NAME --misplaced)"
    )


def _what_changed(what: str, before: Mapping[str, str], node: Node) -> str:
    after = getattr(node, what)
    if after == before:
        mine = node_labels.text(getattr(node, f"operator_{what}")) or "none"
        return f"{what} as they were, set by operators now: {mine}"
    return f"{what} {node_labels.diff(before, after)}"
