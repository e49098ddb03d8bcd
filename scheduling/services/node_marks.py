"""Labels and taints an operator sets on a node (`PATCH /api/nodes/NAME/`, `gpuportal node label`
and `gpuportal node taint`), as `kubectl label` and `kubectl taint` set them on a Kubernetes node:
over what its agent says, and kept across the agent's restarts (gpuportal.wire.node_labels.changed).
A taint keeps new replicas off (NoSchedule): what runs there stays, as a changed label leaves a
replica whose deployment's node selector no longer matches where it is until a restart moves it.
A NoExecute taint also moves off what runs there and does not tolerate it (`evict_untolerated`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django.db import transaction
from django.db.models import TextField
from django.db.models.functions import Cast

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
            layer, refused = node_labels.changed(agent, operator, changes, taints=what == "taints")
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
            + _moves_said(node),
            before={what: before[what] for what in changed},
            after={what: getattr(node, what) for what in changed},
            node=name,
        )
        # A label added or a taint lifted may let a deployment place what it lacks there, and a
        # NoExecute taint added moves off what does not tolerate it (the reconcile's eviction).
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
        why = f"off node {name}, which its placement refuses now (asked by {by})"
        if rollouts.move(deployment, ids, why=why):
            moving[deployment] = len(ids)
        else:
            staying[deployment] = len(ids)
    return moving, staying


def evict_untolerated() -> dict[str, dict[str, int]]:
    """Move off each node with a NoExecute taint what runs there and does not tolerate it, as
    Kubernetes evicts, but each replica replaced where its placement allows before it stops (a
    move of each deployment's, scheduling.services.rollouts.move); with no room anywhere it
    stops all the same (`rollouts._stays`). Returns, by node, {deployment: replicas} whose move
    began now. Every reconcile runs it: the beat's, and those a change of a node's taints, a
    node's registration or a deployment's tolerations asks for; a deployment restarting already
    is moved by a reconcile after its restart is done."""
    # Most fleets have no NoExecute taint: one query, which finds no node, is all they pay.
    tainted = (
        Node.objects.exclude(status=Node.Status.OFFLINE)
        .annotate(taint_text=Cast("taints", TextField()))
        .filter(taint_text__contains=f":{node_labels.NO_EXECUTE}")
        .order_by("name")
    )
    moved: dict[str, dict[str, int]] = {}
    for node in tainted:
        for deployment, (ids, taints) in sorted(_evicted_there(node).items()):
            why = (
                f"off node {node.name}, whose taint {node_labels.text(taints)} it does not tolerate "
                "(NoExecute: what runs there and does not tolerate it is moved off)"
            )
            if rollouts.move(deployment, ids, why=why):
                moved.setdefault(node.name, {})[deployment] = len(ids)
    return moved


Held = list[tuple[str, str, str, str]]


def _held_there(node: Node) -> Held:
    """The replicas on the node holding a process, a host copy or memory: (id, deployment, its
    node selector, its tolerations)."""
    held = node.replicas.exclude(state__in=[*states.GONE, Replica.State.PARKED]).values_list(
        "id", "deployment__name", "deployment__placement_node_selector", "deployment__placement_tolerations"
    )
    return list(held.order_by("pk"))


def _misplaced_there(node: Node, held: Held | None = None, *, left_out: Iterable[str] = ()) -> dict[str, list[str]]:
    """The replicas on the node whose deployments' placement refuses it now, by deployment, but
    those `left_out`. `held`: `_held_there`, read here unless the caller read it."""
    marks = {node.name: (node.labels, node.taints)}
    skipped = set(left_out)
    refused: dict[str, list[str]] = {}
    for replica_id, deployment, *placement in _held_there(node) if held is None else held:
        if replica_id not in skipped and node_labels.refusals(marks, deployment, *placement):
            refused.setdefault(deployment, []).append(replica_id)
    return refused


def _evicted_there(node: Node, held: Held | None = None) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The replicas on the node whose deployments do not tolerate one of its NoExecute taints, by
    deployment, with those taints. `held`: as `_misplaced_there`'s."""
    evicted: dict[str, tuple[list[str], dict[str, str]]] = {}
    for replica_id, deployment, _, tolerations in _held_there(node) if held is None else held:
        if taints := node_labels.evicting(node.taints, node_labels.parse_tolerations(tolerations)):
            evicted.setdefault(deployment, ([], taints))[0].append(replica_id)
    return evicted


def _moves_said(node: Node) -> str:
    """What the Event says of the replicas on the node whose deployments' placement refuses it
    now ("" for none): those NoSchedule leaves there, and how to move them; those its NoExecute
    taints move off. The node's replicas read once for both."""
    held = _held_there(node)
    evicted = _evicted_there(node, held)
    refused = _misplaced_there(node, held, left_out=(i for ids, _ in evicted.values() for i in ids))
    said = ""
    if refused:
        listed = ", ".join(f"{name} ({len(ids)})" for name, ids in sorted(refused.items()))
        said += (
            f"; replicas there their placement now refuses stay until moved: {listed} "
            f"(gpuportal node taint {node.name} --move, or gpuportal restart NAME --misplaced)"
        )
    if evicted:
        listed = ", ".join(f"{name} ({len(ids)})" for name, (ids, _) in sorted(evicted.items()))
        said += (
            f"; replicas there that do not tolerate its NoExecute taints are moved off, each replaced elsewhere "
            f"before it stops (stopped if there is no room): {listed}"
        )
    return said


def _what_changed(what: str, before: Mapping[str, str], node: Node) -> str:
    after = getattr(node, what)
    if after == before:
        mine = node_labels.text(getattr(node, f"operator_{what}")) or "none"
        return f"{what} as they were, set by operators now: {mine}"
    return f"{what} {node_labels.diff(before, after)}"
