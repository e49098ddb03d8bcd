"""Labels and taints an operator sets on a node (`PATCH /api/nodes/NAME/`, `gpuportal node label`
and `gpuportal node taint`), as `kubectl label` and `kubectl taint` set them on a Kubernetes node:
over what its agent says, and kept across the agent's restarts (gpuportal.wire.node_labels.changed).
A taint keeps new replicas off (NoSchedule): what runs there stays, as a changed label leaves a
replica whose deployment's node selector no longer matches where it is until a restart moves it."""

from __future__ import annotations

from collections.abc import Mapping

from django.db import transaction

from gpuportal.wire import control, node_labels, states
from scheduling import locks
from scheduling.models import Event, Node, Replica
from scheduling.services import outbox, rollouts
from scheduling.services.errors import InvalidInput, NotFound
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


def move_misplaced(name: str, *, by: str) -> tuple[dict[str, int], dict[str, int]]:
    """Move off the node the replicas whose deployments' placement refuses it now (Kubernetes'
    NoExecute, gracefully): each deployment's a move of its own (scheduling.services.rollouts.move),
    each replica replaced where its placement allows before it stops. Returns (moving, staying),
    each {deployment: replicas}: one restarting already stays until it is done. NotFound for no
    such node."""
    node = Node.objects.filter(name=name).first()
    if node is None:
        raise NotFound(control.unknown_node(name))
    moving: dict[str, int] = {}
    staying: dict[str, int] = {}
    for deployment, ids in sorted(_misplaced_there(node).items()):
        why = f"moving off node {name}, which its placement refuses now (asked by {by})"
        if rollouts.move(deployment, ids, why=why):
            moving[deployment] = len(ids)
        else:
            staying[deployment] = len(ids)
    return moving, staying


def _misplaced_there(node: Node) -> dict[str, list[str]]:
    """The replicas on the node (holding a process, a host copy or memory) whose deployments'
    placement refuses it now, by deployment."""
    held = node.replicas.exclude(state__in=[*states.GONE, Replica.State.PARKED]).values_list(
        "id", "deployment__name", "deployment__placement_node_selector", "deployment__placement_tolerations"
    )
    marks = {node.name: (node.labels, node.taints)}
    refused: dict[str, list[str]] = {}
    for replica_id, deployment, *placement in held.order_by("pk"):
        if node_labels.refusals(marks, deployment, *placement):
            refused.setdefault(deployment, []).append(replica_id)
    return refused


def _misplaced_on(node: Node) -> str:
    """What the Event says of the replicas on the node whose deployments' placement refuses it
    now, and how to move them ("" for none): NoSchedule leaves them there."""
    refused = _misplaced_there(node)
    if not refused:
        return ""
    listed = ", ".join(f"{name} ({len(ids)})" for name, ids in sorted(refused.items()))
    return (
        f"; replicas there their placement now refuses stay until moved: {listed} "
        f"(gpuportal node taint {node.name} --move, or gpuportal restart NAME --misplaced)"
    )


def _what_changed(what: str, before: Mapping[str, str], node: Node) -> str:
    after = getattr(node, what)
    if after == before:
        mine = node_labels.text(getattr(node, f"operator_{what}")) or "none"
        return f"{what} as they were, set by operators now: {mine}"
    return f"{what} {node_labels.diff(before, after)}"
