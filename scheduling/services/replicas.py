"""One replica's state as the control plane changes it: its state and Events, its reservations
through the commit path, sending it to the CPU cache, giving back what it had taken, losing it
with its node. What its process reports is applied by scheduling.services.reports, on top."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import NamedTuple

import redis
from django.db import transaction
from django.utils import timezone

from gpuportal.wire import memory, states
from scheduling import hot_sql, ledger, locks
from scheduling.core import effects
from scheduling.core.state import Plan, Release, Reservation, Snapshot
from scheduling.models import GPU, Deployment, Event, FailoverState, Replica
from scheduling.services import dispatch, outbox, queueing
from scheduling.services.errors import InvalidState, NotFound, TransitionRefused
from scheduling.services.observing import save_observed

log = logging.getLogger(__name__)


def get(replica_id: str) -> Replica:
    try:
        return Replica.objects.select_related("deployment", "node").get(pk=replica_id)
    except Replica.DoesNotExist:
        raise NotFound(f"no replica with id {replica_id!r}") from None


def state_of(replica_id: str) -> str | None:
    """The replica's state in the books (None: it is gone)."""
    return Replica.objects.filter(pk=replica_id).values_list("state", flat=True).first()


def log_of(replica_id: str, tail: int, since: int | None = None) -> dict:
    """The last `tail` lines of the replica process's own log, or those written after byte
    `since`, as its node's agent reads them (gpuportal.wire.replica_logs): {"replica", "node",
    "state", "path", "lines", "missing", "end", "skipped"}. The state is read before the lines:
    a follower that sees it ended has read what the process wrote before it did."""
    replica = get(replica_id)
    if replica.node is None:
        raise InvalidState(f"replica {replica_id} is {replica.state} on no node: it has no process, and no log")
    read = dispatch.replica_log(replica.node.name, replica.id, tail, since)
    return {"replica": replica.id, "node": replica.node.name, "state": replica.state, **read}


def evict(replica_id: str, *, reason: str = "evicted by an operator", deployment: Deployment | None = None) -> Replica:
    """Send a serving replica to the CPU cache and want one replica fewer: an operator's scale-down
    that keeps the weights at hand (a later scale-up promotes it rather than loading anew)."""
    return to_cache(
        replica_id,
        reason=f"evicting to the CPU cache: {reason}",
        deployment=deployment,
        scale_down=True,
        refused="only a serving replica can be evicted",
    )


def to_cache(
    replica_id: str,
    *,
    reason: str,
    deployment: Deployment | None = None,
    scale_down: bool,
    refused: str,
) -> Replica:
    """Move a serving replica's weights to CPU RAM (draining, then the process reports `sleeping`).

    Its reservation is kept until its process says what it still holds (on a real GPU, its CUDA
    context), so the ledger never under-counts. `scale_down` also lowers `replicas_wanted`
    (evict); without it the deployment still wants the replica back (idle sleep). `deployment`,
    when given, is already locked by the caller. `refused` ends the 409 of a replica that is
    not serving.
    """
    with transaction.atomic():
        replica = get(replica_id)
        # Lock order: the deployment row before anything the ledger locks, then the replica row.
        deployment = deployment or locks.lock_deployment_of(replica)
        replica = locks.lock_replica(replica_id)
        if replica.state != Replica.State.SERVING:
            raise TransitionRefused(replica_id, replica.state, Replica.State.DRAINING, refused)
        if replica.lease_id is not None:
            raise InvalidState(
                f"replica {replica_id} is the active member of a failover pair, which never sleeps: "
                f"switch over with POST /api/deployments/{replica.deployment.name}/failover/, or scale down"
            )
        set_state(replica, Replica.State.DRAINING, reason)
        if scale_down and deployment.replicas_wanted > 0:
            before = deployment.replicas_wanted
            deployment.replicas_wanted -= 1
            deployment.save(update_fields=["replicas_wanted", "updated_at"])
            outbox.note(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {deployment.name}",
                f"{reason} (replica {replica_id[:8]}): {before} → {deployment.replicas_wanted} replica(s) wanted",
                before={"replicas": before},
                after={"replicas": deployment.replicas_wanted},
                deployment=deployment.name,
                replica=replica_id,
            )
        outbox.want(effects.sleep(replica.node.name, replica.id))
        # Its weights are on their way to the node's host memory: keep that within its budget
        # (a node that reports none has nothing to keep within).
        if replica.node.cpu_cache_bytes > 0:
            outbox.want(effects.trim_host_cache(replica.node.name))
    return replica


def sleep_replica(replica_id: str, *, reason: str, deployment: Deployment | None = None) -> Replica:
    """Put one serving replica to sleep (weights to the CPU cache); `reason` is the Event's.
    InvalidState (409) when it is not serving."""
    return to_cache(
        replica_id,
        reason=reason,
        deployment=deployment,
        scale_down=False,
        refused="only a serving replica can be put to sleep",
    )


RECONCILE_TASK = "scheduling.tasks.reconcile"


def fail_waiting_if_none_may_serve(replica: Replica, reason: str) -> None:
    """A deployment gave up after failed loads (a broken checkpoint, a reservation too small to
    serve): if no other replica of it serves or is on its way, the requests that wait would wait
    for nothing. They end now, saying why (they used to wait until they expired)."""
    deployment = replica.deployment
    if deployment.replicas.exclude(pk=replica.pk).filter(state__in=states.ACTIVE).exists():
        return
    why = f"no replica of {deployment.name} can serve: replica {replica.id[:8]} failed to load: {reason}"
    name = deployment.name

    def fail_them() -> None:

        try:
            failed = queueing.fail_waiting(name, why, kind="load")
        except redis.RedisError as err:
            log.warning("cannot end the requests waiting for %s (Redis: %s)", name, err)
            return
        if failed:
            outbox.note(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                f"ended {len(failed)} waiting request(s): {why}",
                after={"failed_requests": failed},
                deployment=name,
                replica=replica.id,
            )

    # After the commit: the failure is recorded first, so a request that arrives meanwhile and
    # finds nothing to serve it is admitted against the failed replica's state, not a stale one.
    outbox.want(effects.AfterCommit(f"end the requests waiting for {name}", fail_them))


def lose_with_node(node_name: str, reason: str, *, keep: Collection[str] = ()) -> list[str]:
    """The node's replica processes are gone with it (its agent stopped, went silent, or started
    anew: replica processes die with their agent). Each is stopped as if it had said so: what it
    had taken goes back to the queue, its claim to take requests and its reservations are
    released through the commit path. Returns the deployments that lost one.

    Failover pairs go whole: a standby stands beside its active member on the same node
    (failover.start_standby), so no member is left to take the pair's lock over. A member that
    still runs on a node that was only cut off is fenced all the same: the requests it had are
    given back, so its late answers are refused (gpuportal.wire.requestqueue.NotTaken), and its agent
    stops it when it is heard again (nodes.heartbeat).

    `keep`: replicas whose processes a new agent of the node took over (nodes.register_node).
    """
    lost = (
        Replica.objects.filter(node__name=node_name)
        .exclude(state__in=(Replica.State.STOPPED, Replica.State.FAILED))
        .exclude(pk__in=list(keep))
    )
    deployments: set[str] = set()
    for replica_id in lost.order_by("pk").values_list("pk", flat=True):
        # One replica at a time, as its own report would be: the deployment row (a pair's reports
        # take turns on it), then the GPU rows the ledger locks, then the replica row set_state
        # writes (the global lock order).
        with transaction.atomic():
            replica = Replica.objects.select_related("deployment", "node").filter(pk=replica_id).first()
            if replica is None or replica.state in (Replica.State.STOPPED, Replica.State.FAILED):
                continue
            if replica.lease_id is not None:
                locks.lock_deployment_of(replica)
            # It may still run (a node only cut off, an agent gone but not its replicas): it
            # takes nothing more, and what it took goes back.
            queueing.write_off(replica.id)
            requeue_taken(replica, f"replica {replica.id[:8]} {reason}")
            reserve_exactly(replica, {}, reason=f"replica {reason}")
            replica.pid = None
            replica.serving_since = None
            extra = ["pid", "serving_since"]
            if replica.lease_id is not None:
                set_failover_state_of(replica, FailoverState.DEAD)
                extra.append("failover_state")
            elif replica.state in states.ASLEEP:
                # Its deployment was asleep, and stays so: still wanted, loaded by the next wake.
                if replica.state == Replica.State.DEEP_SLEEPING:
                    # Its host copy, should the node still hold it, goes: its agent deletes it.
                    outbox.want(effects.stop(node_name, replica.id))
                park(replica, f"{reason}: parked, so that its deployment stays asleep", extra=extra)
                continue
            set_state(replica, Replica.State.STOPPED, reason, extra=extra)
            deployments.add(replica.deployment.name)
    return sorted(deployments)


def park(replica: Replica, reason: str, *, extra: list[str] | None = None) -> None:
    """A sleeper whose weights are gone from its node's host (its process ended, or its node did):
    wanted still, on no node and holding nothing, so that no reconcile loads it anew and its
    deployment stays asleep until a wake loads it from disk. The caller released its reservation."""
    replica.node = None
    replica.gpu_mem_bytes_by_id = {}
    replica.arena_kept_bytes = 0  # its next process starts with none
    replica.host_copy_bytes = 0  # a deep sleeper's copy goes with its node's word on it
    fields = ["node", "gpu_mem_bytes_by_id", "arena_kept_bytes", "host_copy_bytes", *(extra or [])]
    set_state(replica, Replica.State.PARKED, reason, extra=fields)


def requeue_taken(replica: Replica, reason: str) -> None:
    """Requests the replica had taken go back to its deployment's queue: nothing accepted is lost.

    Right away rather than on commit: if this transaction rolled back, the requests would merely
    have been re-queued early, whereas deferring could lose them to a crash in between.
    """
    # Imported here: the request service builds on this module's neighbours (wake, placement).

    # The claim to take requests before the check for what waits (wake_for_waiting): a request
    # queued on its strength is then in the queue when the check looks.
    withdraw(replica)
    queueing.requeue_from(replica.id, reason)


def withdraw(replica: Replica) -> None:

    try:
        queueing.withdraw_live(replica.deployment.name, replica.id)
    except redis.RedisError as err:  # the claim lapses on its own (LIVE_TTL_S) if it is still there
        log.warning("cannot withdraw replica %s's claim to take requests (Redis: %s)", replica.id, err)


def set_measured_need(
    deployment: Deployment, measured: int, replica: Replica, reason: str, *, context: int | None
) -> None:
    """Record the deployment's measured need and the CUDA context it counts (None: unknown), with
    an Event saying why (the caller holds its row)."""
    record = deployment.observed
    before = record.memory_measured_bytes
    record.memory_measured_bytes = measured
    record.memory_measured_context_bytes = context
    save_observed(deployment, ["memory_measured_bytes", "memory_measured_context_bytes"])
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        reason,
        before={"measured_bytes": before},
        after={"measured_bytes": measured, "context_bytes": context},
        deployment=deployment.name,
        replica=replica.id,
    )


def record_context(replica: Replica, context: int, *, standby: bool = False) -> None:
    """A real replica's measured CUDA context becomes its node's figure for that GPU model: the
    next need and pool count it instead of the default; a standby's, that of the
    standbys. Only ever raised, since a context grows as forward passes load kernels, and a lower
    reading is an earlier moment (a GPU whose context is below the default keeps the default:
    safe rather than tight). Virtual GPUs too: their profile grows a context as a real GPU does
    (inference.devices.VirtualProfile.kernel_bytes), and the CPU suite must see what that does."""
    if replica.node_id is None or context <= 0:
        return
    field = "standby_context_bytes" if standby else "context_bytes"
    indices = [int(i) for i in replica.gpu_mem_bytes_by_id]
    products = list(
        GPU.objects.filter(node_id=replica.node_id, index__in=indices).values_list("product", flat=True).distinct()
    )
    updated = GPU.objects.filter(node_id=replica.node_id, product__in=products, **{f"{field}__lt": context})
    if updated.update(**{field: context, "context_measured": True}):
        what = "a standby's CUDA context" if standby else "CUDA context"
        outbox.note(
            Event.Kind.GPU_CHANGED,
            f"node {replica.node.name}",
            f"{what} measured at {memory.human_bytes(context)} per process by replica {replica.id[:8]} "
            f"({', '.join(sorted(products))}); needs and KV pools count it from now on",
            after={field: context},
            node=replica.node.name,
            replica=replica.id,
        )


def reserve_exactly(replica: Replica, bytes_by_index: dict[int, int], *, reason: str) -> None:
    """Make the replica's reservations exactly `bytes_by_index` on its node's GPUs."""
    if replica.node_id is None:
        return
    replica_id = replica.id

    def decide(snap: Snapshot) -> Plan | None:
        on_node = {g.index: g for g in snap.index.on_node.get(replica.node.name, ())}  # not a walk of every GPU
        releases = [
            Release(g.id, replica_id)
            for g in on_node.values()
            if g.index not in bytes_by_index and any(o.replica_id == replica_id for o in g.occupants)
        ]
        reservations = []
        for index, wanted in bytes_by_index.items():
            gpu = on_node.get(index)
            if gpu is None:
                continue
            held = next((o.reserved_bytes for o in gpu.occupants if o.replica_id == replica_id), 0)
            if held != wanted:
                # What the process still holds is real memory: record it even if the GPU is full,
                # by taking no more than is free, and say so, rather than failing the report.
                reservations.append(Reservation(gpu.id, replica_id, min(wanted, held + gpu.available_bytes)))
        if not releases and not reservations:
            return None
        return Plan.against(snap, reason, reservations=reservations, releases=releases)

    ledger.commit_with_retry(decide)


def set_state(
    replica: Replica,
    state: str,
    reason: str,
    *,
    extra: list[str] | None = None,
    kind: str = Event.Kind.REPLICA_STATE,
) -> None:
    before = replica.state
    check_transition(replica.id, before, state)
    replica.state = state
    # A request's wait for this drain (Replica.wake_when_asleep) ends with it.
    replica.wake_when_asleep = replica.wake_when_asleep and state == Replica.State.DRAINING
    replica.save(update_fields=["state", "wake_when_asleep", "updated_at", *(extra or [])])
    if before == state and kind == Event.Kind.REPLICA_STATE:
        return
    _state_event(kind, replica.id, before, state, reason, replica.node.name if replica.node else "", replica.deployment)


# The states the operator's console tells of (up's): a load or a wake done, a sleep, a failure.
CONSOLE_STATES = frozenset(
    {Replica.State.SERVING, Replica.State.SLEEPING, Replica.State.DEEP_SLEEPING, Replica.State.FAILED}
)


class KnownReplica(NamedTuple):
    """A replica as its caller read it under its deployment's lock, and why its state changes."""

    id: str
    state: str
    node: str | None
    deployment: Deployment
    reason: str


def set_state_of(
    replica_id: str, before: str, state: str, reason: str, *, node: str | None, deployment: Deployment
) -> None:
    """`set_state` for a replica the caller knows (its state and node, read under its deployment's
    lock) without its row: one UPDATE, no read."""
    set_states_of([KnownReplica(replica_id, before, node, deployment, reason)], state)


def set_states_of(replicas: Sequence[KnownReplica], state: str) -> None:
    """`set_state_of` for several replicas: one UPDATE for them all, an Event for each that changes."""
    if not replicas:
        return
    for r in replicas:
        check_transition(r.id, r.state, state)
    with hot_sql.cursor() as cursor:
        draining = str(Replica.State.DRAINING)
        cursor.execute(
            hot_sql.statement("set_states"),
            [state, timezone.now(), draining, state, draining, [r.id for r in replicas]],
        )
    for r in replicas:
        if r.state != state:
            _state_event(Event.Kind.REPLICA_STATE, r.id, r.state, state, r.reason, r.node or "", r.deployment)


def set_failover_state_of(replica: Replica, state: str) -> None:
    """The pair member's failover state, once the table allows it (TransitionRefused, 409, if
    not); the caller saves the row."""
    if not states.failover_allowed(replica.failover_state, state):
        raise TransitionRefused(replica.id, f"failover {replica.failover_state}", f"failover {state}")
    replica.failover_state = state


def check_transition(replica_id: str, before: str, after: str, why: str = "") -> None:
    """TransitionRefused (409) unless the state machine allows `before` → `after`: checked before
    anything is written, so a refused change leaves the row and the books as they were."""
    try:
        states.check(before, after)
    except states.IllegalTransition:
        raise TransitionRefused(replica_id, before, after, why) from None


def _state_event(
    kind: str, replica_id: str, before: str, state: str, reason: str, node: str, deployment: Deployment
) -> None:
    outbox.note(
        kind,
        f"replica {replica_id[:8]}",
        reason,
        before={"state": before},
        after={"state": state},
        node=node,
        deployment=deployment.name,
        replica=replica_id,
        console=state in CONSOLE_STATES,
    )
