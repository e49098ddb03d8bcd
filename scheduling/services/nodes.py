"""Node lifecycle: registration by its agent, heartbeats, and expiry when they stop (and its
lease in Redis expired too: scheduling.core.liveness)."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from gpuportal.wire import node_acl, node_labels, node_lease, replies, states
from gpuportal.wire.commands import node_queue
from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor
from gpuportal.wire.requestqueue import records_key
from gpuportal.wire.states import ASLEEP, ENDED
from scheduling import hot_sql, ledger, locks
from scheduling.core import adoption, effects, liveness
from scheduling.core import books as tolerance
from scheduling.models import ACTIVE_INTENT_STATUSES, Event, Node, Occupant, PreemptionIntent, Replica
from scheduling.services import books as book_checks
from scheduling.services import lost_commands, outbox, queue_grants, queueing, rollouts
from scheduling.services import replicas as replica_services
from scheduling.services.errors import InvalidState, TransitionRefused

log = logging.getLogger(__name__)

INVENTORY_EVENT = {
    "added": Event.Kind.GPU_REGISTERED,
    "resized": Event.Kind.GPU_CHANGED,
    "lost": Event.Kind.GPU_CHANGED,
    "found": Event.Kind.GPU_CHANGED,
}
INVENTORY_REASON = {
    "added": "reported by the node agent at registration",
    "resized": "the node agent reports a different memory size",
    "lost": "no longer reported by the node agent",
    "found": "reported again by the node agent",
}


def register_node(
    name: str,
    devices: list[DeviceInfo],
    *,
    hostname: str = "",
    cpu_cache_bytes: int = 0,
    virtual: bool = False,
    survivors: Sequence[Survivor] = (),
    host_ram_bytes: int = 0,
    labels: Mapping[str, str] | None = None,
    taints: Mapping[str, str] | None = None,
) -> Node:
    """Create or refresh a node and its GPUs as its agent reports them; the node is online after.
    `labels`: what its agent declares of the host (gpuportal.wire.node_labels), beside what its
    GPUs say (`node_labels.gpu_labels`: their product, count and memory), replacing those it had:
    a registration without them declares none of its own. `taints`: what it keeps off the node
    (only deployments that tolerate each are placed there), replacing those it had. Those operators
    set (`scheduling.services.node_marks`) stay, over the agent's.

    `survivors` are the replica processes the node's previous agent left running, which the new
    one took over: those whose books agree with what they say are kept (scheduling.core.adoption);
    the others are lost, and the agent's first beat learns to stop them (`written_off`)."""
    now = timezone.now()
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        node, created = locks.lock_or_create_node(
            name, {"queue": node_queue(name), "status": Node.Status.ONLINE, "last_heartbeat": now}
        )
        before = {
            "status": node.status,
            "virtual": node.virtual,
            "gpus": node.gpus.count(),
            "labels": node.labels,
            "taints": node.taints,
        }
        previous_status = node.status
        node.hostname, node.cpu_cache_bytes, node.virtual = hostname, cpu_cache_bytes, virtual
        node.agent_labels = {**node_labels.gpu_labels(devices), **(labels or {})}
        node.agent_taints = dict(taints or {})
        # What operators set (`node_marks.change`) outlives the agent's restarts, over what it says.
        node.labels = node_labels.merged(node.agent_labels, node.operator_labels)
        node.taints = node_labels.merged(node.agent_taints, node.operator_taints)
        node.host_ram_bytes = host_ram_bytes
        node.status, node.last_heartbeat = Node.Status.ONLINE, now
        node.save()
        changes = ledger.sync_inventory(node.pk, node.name, devices)
        summary = ", ".join(f"{d.index}: {d.product} {d.total_bytes} B" for d in devices) or "no GPUs"
        kind = "virtual" if virtual else "NVIDIA"
        after = {"status": node.status, "virtual": virtual, "gpus": len(devices), "labels": node.labels}
        after["taints"] = node.taints
        # Its labels and taints decide which deployments' replicas may go there: said whenever
        # they change.
        labelled = f", labels {node_labels.text(node.labels)}" if node.labels else ""
        labelled += f", taints {node_labels.text(node.taints)}" if node.taints else ""
        if created:
            outbox.note(
                Event.Kind.NODE_REGISTERED,
                f"node {name}",
                f"agent registered with {len(devices)} {kind} GPU(s) ({summary}){labelled}",
                after=after,
                node=name,
            )
        else:
            was = "" if previous_status == Node.Status.ONLINE else f" (was {previous_status})"
            relabelled = ""
            for what in ("labels", "taints"):
                if getattr(node, what) != before[what]:
                    relabelled += f"; {what} {node_labels.diff(before[what], getattr(node, what))}"
            outbox.note(
                Event.Kind.NODE_ONLINE,
                f"node {name}",
                f"agent re-registered with {len(devices)} {kind} GPU(s){was}{relabelled}",
                before=before,
                after=after,
                node=name,
            )
        for change in changes:
            outbox.note(
                INVENTORY_EVENT[change.kind],
                f"gpu {change.label}",
                f"{change.kind}: {INVENTORY_REASON[change.kind]}",
                before=change.before,
                after=change.after,
                node=name,
                gpu=change.label,
            )
    if not created:
        # A registering agent runs only the survivors it took over; the rest of what the books
        # say its predecessor ran died with it.
        kept = keep_survivors(node, survivors)
        replica_services.lose_with_node(name, f"lost: the agent of node {name} started anew", keep=kept)
    reconcile_later(f"node {name} registered")
    return node


def register_and_fence(name: str, devices: list[DeviceInfo], **details: Any) -> int:
    """`register_node`, answering the agent with the epoch it starts its replicas under."""
    register_node(name, devices, **details)
    return node_lease.current_epoch(replies.client(settings.REDIS_URL), name)


def fence_off(name: str) -> int | None:
    """Raise the node's epoch (gpuportal.wire.node_lease): every replica process it runs is refused
    by the request queue from now on, whether or not its agent hears of it, and the agent stops them
    all before it renews its lease again. None when Redis cannot be reached: the per-replica marks
    that lose_with_node sets, and the heartbeat's list of what was written off, still fence it."""
    try:
        epoch = node_lease.write_off(replies.client(settings.REDIS_URL), name)
    except redis.RedisError as err:
        log.warning("cannot raise node %s's epoch (Redis: %s): its replicas are fenced one by one", name, err)
        return None
    log.info("node %s fenced: its epoch is %d", name, epoch)
    return epoch


def drop_redis_user(name: str) -> bool | None:
    """Delete node `name`'s own Redis user (gpuportal.wire.node_acl), which Redis follows by closing
    every connection it has: a revoked node keeps no way into Redis, not even to lower its own
    epoch (which its user may write, as its replicas' scripts read it). True when one was deleted,
    False when it had none (an operator who gives nodes no users of their own), None when Redis
    cannot be reached or refuses the control plane's user the command: the operator then runs
    `ACL DELUSER` (the warning says so)."""
    user = node_acl.user_name(name)
    try:
        client = replies.client(settings.REDIS_URL)
        deleted = int(client.execute_command("ACL", "DELUSER", user))
        client.delete(queue_grants.until_key(name))
    except redis.RedisError as err:
        log.warning(
            "cannot delete node %s's Redis user %s (%s): run ACL DELUSER %s in redis-cli", name, user, err, user
        )
        return None
    if deleted:
        log.info("node %s's Redis user %s deleted, its connections closed", name, user)
    return bool(deleted)


def keep_survivors(node: Node, survivors: Sequence[Survivor]) -> list[str]:
    """Of the survivors, those the books agree with; an Event says of each why it is kept or not."""
    if not survivors:
        return []
    kept: list[str] = []
    with transaction.atomic():
        rows = {
            r.pk: r
            for r in locks.lock_replicas(
                Replica.objects.select_related("deployment").filter(pk__in=[s.replica_id for s in survivors])
            )
        }
        for survivor in survivors:
            replica = rows.get(survivor.replica_id)
            if replica is None or replica.node_id != node.pk or replica.state in ENDED:
                continue  # written off already (or deleted): the first beat stops it
            agrees = adoption.keeps(replica.state, survivor)
            if agrees and survivor.state == Replica.State.DEEP_SLEEPING:
                kept.append(replica.pk)
                reason = f"its host copy outlived the agent of node {node.name}: it sleeps on deeply"
            elif agrees:
                kept.append(replica.pk)
                reason = (
                    f"its process (pid {survivor.pid}) outlived the agent of node {node.name} and was taken "
                    f"over by the new one ({survivor.state})"
                )
            else:
                reason = f"not taken over by the new agent of node {node.name}: "
                reason += adoption.why_not(replica.state, survivor)
            outbox.note(
                Event.Kind.REPLICA_ADOPTED if agrees else Event.Kind.REPLICA_STATE,
                f"replica {replica.pk[:8]}",
                reason,
                before={"state": replica.state},
                after={"process_state": survivor.state, "pid": survivor.pid, "kept": agrees},
                node=node.name,
                deployment=replica.deployment.name,
                replica=replica.pk,
            )
    return kept


def reconcile_later(reason: str) -> None:
    """Ask the control queue to bring every deployment back to its replicas (after the commit)."""
    outbox.want(effects.to_control(replica_services.RECONCILE_TASK, reason))


def heartbeat(
    name: str,
    *,
    now: datetime | None = None,
    books: Books | None = None,
    running: Collection[str] | None = None,
    processes: Mapping[str, str] | None = None,
    arenas: Mapping[str, int] | None = None,
    host_bytes: Mapping[str, int] | None = None,
    host_copies: Collection[str] | None = None,
) -> list[str]:
    """Record that the node's agent is alive; a node that had been marked offline comes back.
    With `books`, what the agent saw its replica processes hold is checked against the ledger.

    `running` names the replica processes the agent runs. Those the control plane wrote off while
    the node was silent (its heartbeats lost, its agent alive: a partition) are returned: the
    agent stops them, and the node comes back only once it runs none, so it takes no new work
    while they still hold GPU memory the books gave to others.

    `processes`, the state each of those processes last said it is in, and `running` show which
    commands to them were lost (the broker blinked as they were sent): those are sent again
    (scheduling.services.lost_commands); `arenas`, the host arenas they keep, which grants and
    drops of one were; `host_bytes`, the host RAM each holds beside its arena, what placement
    counts of the node's RAM for it (`record_host_bytes`). `host_copies`, the deep sleepers' copies
    it holds: those no longer wanted are returned too (`copies_to_forget`), for it to delete."""
    now = now or timezone.now()
    if not running and not host_copies and (books is None or not books.usage) and _quiet_beat(name, now, books):
        return []
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        node = locks.lock_node(name)
        node.last_heartbeat = now
        fields = ["last_heartbeat"]
        stale = written_off(node, running) if running is not None else []
        if node.status == Node.Status.OFFLINE and stale:
            outbox.note(
                Event.Kind.NODE_OFFLINE,
                f"node {name}",
                f"heartbeat resumed, but its agent still runs {len(stale)} replica process(es) written off while "
                f"it was silent ({', '.join(r[:8] for r in stale)}): stopping them before the node takes new work",
                after={"status": Node.Status.OFFLINE, "stale_replicas": stale},
                node=name,
            )
        elif node.status == Node.Status.OFFLINE:
            node.status = Node.Status.ONLINE
            fields.append("status")
            outbox.note(
                Event.Kind.NODE_ONLINE,
                f"node {name}",
                "heartbeat resumed",
                before={"status": Node.Status.OFFLINE},
                after={"status": Node.Status.ONLINE},
                node=name,
            )
            # Back, its GPUs are candidates again: deployments left short meanwhile may use them.
            reconcile_later(f"node {name} is back")
        node.save(update_fields=fields)
    if books is not None:
        book_checks.check(name, books)
    if running is not None:
        lost_commands.resend(name, running, processes, now, arenas=arenas)
    if host_bytes:
        record_host_bytes(name, host_bytes)
    return stale + copies_to_forget(name, host_copies) if host_copies else stale


def copies_to_forget(name: str, host_copies: Collection[str]) -> list[str]:
    """Of the host copies a node holds, those of replicas its books no longer hold asleep there:
    parked out of a full cache or written off with the node while its agent was away (the stop
    that deletes the copy may not have reached it), stopped, deleted, or elsewhere. One that is
    sleeping (its deepen's report on its way) or waking (its new process reading the copy) is
    wanted still."""
    wanted = Replica.objects.filter(
        pk__in=list(host_copies), node__name=name, state__in=(*ASLEEP, Replica.State.WAKING)
    ).values_list("pk", flat=True)
    return sorted(set(host_copies) - set(wanted))


# A process's host RAM moves a little at every beat: written again only when it moved by this
# much, or by a tenth, so that a beat does not rewrite every replica's row.
HOST_BYTES_STEP = 32 * 1024 * 1024


def record_host_bytes(node: str, measured: Mapping[str, int]) -> None:
    """Keep each replica's host RAM (Replica.host_bytes) as its node's agent measured it."""
    known = dict(Replica.objects.filter(pk__in=list(measured), node__name=node).values_list("pk", "host_bytes"))
    for replica_id, held in sorted(measured.items()):
        if replica_id not in known or abs(held - known[replica_id]) < max(HOST_BYTES_STEP, known[replica_id] // 10):
            continue
        # One row per statement, outside any transaction: a single row lock held at a time
        # cannot close a cycle with a writer that locks replicas in primary-key order.
        Replica.objects.filter(pk=replica_id).update(host_bytes=held)


def _quiet_beat(name: str, now: datetime, books: Books | None) -> bool:
    """The beat of a node whose agent runs nothing, recorded in one statement where it has nothing
    else to do (sql/statements/quiet_beat.sql says when): what the full beat would write, without
    its dozen statements. Most nodes of a large fleet host nothing, and the agents' worker answers
    each of their beats. False: the full beat runs."""

    def by_index(figures: Mapping[str, int] | None, at_least: int | None = None) -> str | None:
        if figures is None:
            return None
        return json.dumps({str(k): int(v) if at_least is None else max(at_least, int(v)) for k, v in figures.items()})

    with hot_sql.cursor() as cursor:
        cursor.execute(
            hot_sql.statement("quiet_beat"),
            {
                "now": now,
                "name": name,
                "offline": Node.Status.OFFLINE,
                "ended": list(ENDED),
                "free": by_index(books.free_by_index if books is not None else None),
                # Never below 0, as the full beat takes it (scheduling.core.books.foreign_to_record).
                "foreign": by_index(books.foreign_by_index if books is not None else None, at_least=0),
                "spare": by_index(books.spare_by_index if books is not None else None),
                "floor": settings.GPUPORTAL_BOOKS_TOLERANCE_BYTES,
                "share": tolerance.TOLERANCE_SHARE,
            },
        )
        return cursor.fetchone() is not None


def written_off(node: Node, running: Collection[str]) -> list[str]:
    """Of the replica processes the node's agent runs, those the control plane no longer counts on
    this node: stopped or failed in its books (lost with the node), deleted, or elsewhere."""
    if not running:
        return []
    kept = set(
        Replica.objects.filter(pk__in=list(running), node=node).exclude(state__in=ENDED).values_list("pk", flat=True)
    )
    return sorted(set(running) - kept)


def expire_heartbeats(
    *, now: datetime | None = None, timeout_s: float | None = None, stall_s: float | None = None
) -> list[str]:
    """Mark offline every node silent longer than the timeout while the control plane could hear
    it, and whose lease in Redis has expired too (scheduling.core.liveness): a stall of the
    control plane's own database, broker or worker is not read as the death of its nodes."""
    timeout_s = settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S if timeout_s is None else timeout_s
    stall_s = stall_threshold_s() if stall_s is None else stall_s
    expired: list[str] = []
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        record = locks.lock_hearing()
        if record is None:
            return []  # another sweep is judging the same nodes right now
        # The clock read once the books answer: a sweep that waited out a frozen database is as
        # late as its wait, and its gap since the last sweep shows the stall.
        now = now or timezone.now()
        heard = liveness.hear(liveness.Hearing(record.last_sweep, record.heard_since), now, stall_s)
        record.last_sweep, record.heard_since = heard.hearing.last_sweep, heard.hearing.heard_since
        record.save()
        if heard.deaf_for_s is not None:
            outbox.note(
                Event.Kind.CONTROL_STALLED,
                "control plane",
                f"no heartbeat sweep for {heard.deaf_for_s:.0f} s (PostgreSQL, Redis or the control worker "
                "stalled): no heartbeat could be recorded meanwhile, so node silence counts from now",
                after={"deaf_for_s": round(heard.deaf_for_s, 1)},
            )
        # skip_locked: a node being registered or heartbeating right now is, by definition, alive.
        cutoff = now - timedelta(seconds=timeout_s)
        stale = locks.lock_silent_nodes(
            Node.objects.exclude(status=Node.Status.OFFLINE).filter(last_heartbeat__lt=cutoff)
        )
        beats = [liveness.Beat(node.name, node.last_heartbeat) for node in stale]
        verdicts = liveness.judge(beats, heard.hearing, now, timeout_s, _leases_held(beats))
        by_name = {node.name: node for node in stale}
        for verdict in verdicts:
            node = by_name[verdict.name]
            if verdict.leased:
                log.warning(
                    "node %s: no heartbeat recorded for %.0f s, but its agent renews its lease in Redis: it is "
                    "alive and its heartbeats are not reaching the books (is the agents' worker running?)",
                    node.name,
                    verdict.silent_s,
                )
                continue
            before = node.status
            node.status = Node.Status.OFFLINE
            node.save(update_fields=["status"])
            outbox.note(
                Event.Kind.NODE_OFFLINE,
                f"node {node.name}",
                f"no heartbeat for {verdict.silent_s:.0f} s (timeout {timeout_s:.0f} s)",
                before={"status": before, "last_heartbeat": node.last_heartbeat.isoformat()},
                # Both pieces of evidence: the books' silence, and the lease the agent renews itself.
                after={"status": Node.Status.OFFLINE, "lease": "expired"},
                node=node.name,
            )
            expired.append(node.name)
    for name in expired:
        # Fenced first: by the time its requests are given back to the queue, nothing its
        # replicas still write under the old epoch is accepted.
        fence_off(name)
        replica_services.lose_with_node(name, f"lost with node {name} (no heartbeat for {timeout_s:.0f} s)")
    if expired:
        reconcile_later(f"node(s) {', '.join(expired)} went offline")
    return expired


EXPIRE_TASK = "scheduling.tasks.expire_heartbeats"
_PERIOD_S = {"microseconds": 1e-6, "seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


def stall_threshold_s() -> float:
    """How long a gap between two sweeps must be to be a stall: GPUPORTAL_CONTROL_STALL_S, or two
    of the sweep's own intervals where an operator set them longer in the admin (else every sweep
    would look like a stall, and no node would ever be written off)."""
    schedule = (
        PeriodicTask.objects.filter(task=EXPIRE_TASK, enabled=True, interval__isnull=False)
        .values_list("interval__every", "interval__period")
        .first()
    )
    every_s = schedule[0] * _PERIOD_S.get(schedule[1], 1.0) if schedule else 0.0
    return max(settings.GPUPORTAL_CONTROL_STALL_S, 2 * every_s)


def _leases_held(beats: list[liveness.Beat]) -> set[str]:
    """The silent nodes whose agents still renew their leases. All of them when Redis cannot be
    read: no node is written off on evidence the sweep could not gather."""
    names = [beat.name for beat in beats]
    try:
        return node_lease.held(replies.client(settings.REDIS_URL), names)
    except redis.RedisError as err:
        log.warning("cannot read the nodes' leases (Redis: %s): no node is written off this sweep", err)
        return set(names)


def mark_stopping(name: str, reason: str, *, kind: str = Event.Kind.NODE_STOPPED) -> None:
    """The agent is shutting down on purpose: say so now rather than after the heartbeat timeout.
    Offline, the node is no candidate for placement: the reconciles its replicas' `stopped`
    reports set off place their replacements elsewhere, not back on a node that is leaving.
    `kind`: the Event's, where the node is taken offline for another cause (a revocation)."""
    with transaction.atomic():
        node = locks.lock_node_if_there(name)
        if node is None or node.status == Node.Status.OFFLINE:
            return
        before = node.status
        node.status = Node.Status.OFFLINE
        node.save(update_fields=["status"])
        outbox.note(
            kind,
            f"node {name}",
            reason,
            before={"status": before},
            after={"status": Node.Status.OFFLINE},
            node=name,
        )


def mark_stopped(name: str, reason: str, *, kind: str = Event.Kind.NODE_STOPPED) -> None:
    """The agent has stopped its replicas (or is gone, or no longer heard: its credential was
    revoked): the node is offline, and what the books still say runs on it is lost with it."""
    mark_stopping(name, reason, kind=kind)
    # Its replicas stopped with it (they said so, or they are lost now): elsewhere, others take
    # their place.
    if replica_services.lose_with_node(name, f"lost with node {name} ({reason})"):
        reconcile_later(f"node {name} stopped")


class Drained(NamedTuple):
    """What a drain did with what served on its node: put to sleep there, or moving elsewhere."""

    asleep: list[str]
    moving: list[str]


def drain(name: str, *, reason: str = "drained by an operator", move: bool = False) -> Drained:
    """Take a node out of service: nothing new is placed on it (placement skips nodes that are
    not online) and its serving replicas go to sleep; one loading or waking there goes to sleep
    once it serves (replica_reports, under this node's row lock). With `move`, as Kubernetes'
    drain: each serving replica is replaced elsewhere first and stops once its replacement serves
    (scheduling.services.rollouts.move), serving throughout, a failover pair by a new pair; one
    that cannot move (its deployment restarting already) is left as without it."""

    with transaction.atomic():
        node = locks.lock_node(name)
        if node.status == Node.Status.OFFLINE:
            raise InvalidState(f"node {name} is offline: there is nothing to drain")
        if node.status != Node.Status.DRAINING:
            node.status = Node.Status.DRAINING
            node.save(update_fields=["status"])
            outbox.note(
                Event.Kind.NODE_DRAINING,
                f"node {name}",
                f"{reason}: no new placements; its serving replicas "
                + ("move to other nodes" if move else "go to sleep"),
                before={"status": Node.Status.ONLINE},
                after={"status": Node.Status.DRAINING},
                node=name,
            )
        awake = list(
            node.replicas.filter(state__in=states.AWAKE)
            .order_by("pk")
            .values_list("id", "state", "lease_id", "deployment__name")
        )
        serving = [(replica_id, lease, dep) for replica_id, state, lease, dep in awake if state == states.S.SERVING]
        plain = [(replica_id, deployment) for replica_id, lease, deployment in serving if lease is None]
        # Loading or waking there: a move takes them too (they serve, then are replaced), where a
        # drain without one puts them to sleep once they serve (replica_reports).
        starting = [(replica_id, dep) for replica_id, state, _, dep in awake if state != states.S.SERVING]
    # Each deployment's move in a transaction of its own, after the node's: the one lock order
    # takes a deployment's row before a node's.
    moving: list[str] = []
    if move:
        by_deployment: dict[str, list[str]] = {}
        for replica_id, deployment in [(replica_id, dep) for replica_id, _, dep in serving] + starting:
            by_deployment.setdefault(deployment, []).append(replica_id)
        for deployment, ids in sorted(by_deployment.items()):
            if rollouts.move(deployment, ids, why=f"off node {name} ({reason})"):
                moving += ids
    # A failover pair's active member never sleeps (replicas.to_cache refuses it): one not moved
    # keeps serving, said here, rather than the drain failing half-way with a 409 for it.
    kept = [replica_id for replica_id, lease, _ in serving if lease is not None and replica_id not in moving]
    with transaction.atomic():
        for replica_id in kept:
            outbox.note(
                Event.Kind.NODE_DRAINING,
                f"node {name}",
                f"{reason}: replica {replica_id[:8]} keeps serving there: it is the active member of a failover "
                f"pair, which never sleeps ({'its deployment restarts already' if move else 'drain with a move'})",
                node=name,
                replica=replica_id,
            )
    put_to_sleep = []
    for replica_id in (replica_id for replica_id, _ in plain if replica_id not in moving):
        try:
            replica_services.sleep_replica(replica_id, reason=f"node {name} {reason}")
        except TransitionRefused:
            continue  # it stopped serving since it was read (a sleep, a stop): nothing to put to sleep
        put_to_sleep.append(replica_id)
    return Drained(put_to_sleep, moving)


def undrain(name: str, *, reason: str = "returned to service by an operator") -> Node:
    """Return a draining node to service; what a drain's move has still to move off it stays
    (rollouts.stay_on), but for what its placement refuses there."""
    with transaction.atomic():
        node = locks.lock_node(name)
        if node.status != Node.Status.DRAINING:
            raise InvalidState(f"node {name} is {node.status}, not draining")
        node.status = Node.Status.ONLINE
        node.save(update_fields=["status"])
        outbox.note(
            Event.Kind.NODE_ONLINE,
            f"node {name}",
            reason,
            before={"status": Node.Status.DRAINING},
            after={"status": Node.Status.ONLINE},
            node=name,
        )
    # Each deployment's in a transaction of its own, after the node's: the one lock order takes a
    # deployment's row before a node's.
    rollouts.stay_on(name, why=f"node {name} {reason}")
    return node


def remove(name: str, *, by: str) -> int:
    """Forget a node that is gone for good (a retired host): its row and its GPUs' leave the books,
    and its ended replicas keep their history on no node. Only an offline node that the books
    place nothing on: an online or draining node's agent may beat again, and a replica the books
    still count there must end first (its node's write-off, or its deployment's delete). Should
    its agent start again, it registers the node anew. Returns how many GPUs went with it."""
    with transaction.atomic():
        node = locks.lock_node(name)
        if node.status != Node.Status.OFFLINE:
            raise InvalidState(
                f"node {name} is {node.status}: stop its agent, or revoke its credential "
                f"(`gpuportal node revoke {name}`), before removing it"
            )
        held = list(
            node.replicas.exclude(state__in=ENDED).order_by("pk").values_list("deployment__name", "id", "state")
        )
        if held:
            named = ", ".join(f"{deployment} {replica_id[:8]} {state}" for deployment, replica_id, state in held)
            raise InvalidState(
                f"node {name} still has {len(held)} replica{'s' if len(held) > 1 else ''} in the books ({named}): "
                "they end with the node's write-off, or with their deployment"
            )
        # Its GPUs' rows in the lock order (the ledger's), and nothing reserved on them: the books
        # change only through the ledger, never by a cascade.
        gpus = locks.lock_node_gpus(node.pk)
        if Occupant.objects.filter(gpu__in=gpus).exists():
            raise InvalidState(f"node {name}'s GPUs still hold reservations: they go with its write-off")
        if PreemptionIntent.objects.filter(gpu__in=gpus, status__in=ACTIVE_INTENT_STATUSES).exists():
            raise InvalidState(f"a wake still waits for memory on node {name}'s GPUs: it ends within its max_wait")
        outbox.note(
            Event.Kind.NODE_REMOVED,
            f"node {name}",
            f"removed by {by}: its {len(gpus)} GPU(s) leave the books",
            before={"status": node.status, "gpus": len(gpus)},
            node=name,
        )
        node.delete()
        # The drain reads the lists of the nodes in the books: what its replicas ended last goes to
        # the web's list, or it would never be stored.
        outbox.want(
            effects.AfterCommit(
                f"keep node {name}'s request records", lambda: queueing.queue().hand_over_records(records_key(name))
            )
        )
    return len(gpus)
