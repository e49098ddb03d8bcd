"""A node's host cache kept within its budget: what scheduling.core.host_cache decides,
applied. When replicas go to sleep on a node, `trim` (on the control worker, after the commit that
sent them) first has awake replicas drop the arenas they keep, then parks the least valuable
sleepers, until what the node's host memory holds fits its budget (Node.cpu_cache_bytes,
GPUPORTAL_HOST_CACHE_BYTES on the agent): a parked replica's process stops, its GPU residual is
released, and it stays wanted, to be loaded from disk by the next wake. When replicas come awake,
`grant` lets them keep an arena for their next sleep from the room the budget has spare, and the
books count it there until it is dropped."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import redis
from django.db import transaction
from django.db.models import Q

from gpuportal.wire import memory, states
from scheduling import locks
from scheduling.core import effects, host_cache
from scheduling.models import Event, Node, Replica
from scheduling.services import outbox, queueing, replicas

log = logging.getLogger(__name__)


def host_bytes(replica: Replica) -> int:
    """What a replica's weights take in host memory: the bytes read from its model's files, or a
    deep sleeper's host copy as its process wrote it."""
    if replica.host_copy_bytes > 0:
        return int(replica.host_copy_bytes)
    observed = replica.deployment.observed
    return int(observed.weight_bytes or observed.memory_estimate_bytes or 0)


def holders(node_ids: Iterable[int]) -> dict[int, list[host_cache.HostHolder]]:
    """Per node, the replicas whose weights are in its host memory, and the awake ones that keep
    an arena there: one query for any number."""
    found: dict[int, list[host_cache.HostHolder]] = {n: [] for n in node_ids}
    rows = Replica.objects.filter(
        Q(state__in=states.IN_HOST_CACHE) | Q(state__in=states.AWAKE, arena_kept_bytes__gt=0), node_id__in=list(found)
    ).select_related("deployment__observed")
    for replica in rows:
        kept = replica.state in states.AWAKE
        found[replica.node_id].append(
            _holder(replica, replica.arena_kept_bytes if kept else host_bytes(replica), kept_arena=kept)
        )
    return found


def _holder(replica: Replica, nbytes: int, *, kept_arena: bool) -> host_cache.HostHolder:
    return host_cache.HostHolder(
        replica_id=replica.id,
        deployment=replica.deployment.name,
        state=replica.state,
        host_bytes=nbytes,
        kept_arena=kept_arena,
        # A replica no request has reached yet was last used as it was made: without this every
        # never-used sleeper tied at "unused for ever" and the trim parked whichever the rows
        # listed first, the one put to sleep a moment ago among them (bench.host_cache found it).
        last_accessed=replica.last_accessed or replica.created_at,
        popular=replica.deployment.popular,
    )


def used_bytes(node_ids: Iterable[int]) -> dict[int, int]:
    return {node: used for node, (used, _) in usage(node_ids).items()}


def usage(node_ids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Per node, what its host cache holds and, of that, the arenas awake replicas keep: one query."""
    return {
        node: (host_cache.used_bytes(held), host_cache.used_bytes([h for h in held if h.kept_arena]))
        for node, held in holders(node_ids).items()
    }


def balance(node_name: str) -> dict[str, list[str]]:
    """The node's host cache within its budget (`trim`), then its spare room lent to awake
    replicas as kept arenas (`grant`): what the control worker runs after a sleep or a wake there,
    one balance of a node at a time (the control worker runs several tasks at once)."""
    node_id = Node.objects.filter(name=node_name).values_list("pk", flat=True).first()
    if node_id is None:
        return {"parked": [], "granted": []}
    with locks.host_cache_balance(node_id):
        return {"parked": trim(node_name), "granted": grant(node_name)}


def trim(node_name: str) -> list[str]:
    """Drop kept arenas, then park sleepers, on the node until its host cache fits its budget;
    the ids parked."""
    node = Node.objects.filter(name=node_name).first()
    if node is None or node.cpu_cache_bytes <= 0:
        return []  # gone, or a node that says nothing of its host memory: nothing to keep within
    decided = host_cache.trim(_with_last_requests(holders([node.pk])[node.pk]), node.cpu_cache_bytes)
    for replica_id in decided.drop:
        _set_kept(replica_id, node, keep=False)
    parked = [replica_id for replica_id in decided.park if _park(replica_id, node)]
    if decided.over_bytes > 0:
        # What is left is on its way to sleep or a standby: nothing more may leave. Said once per trim.
        outbox.note(
            Event.Kind.HOST_CACHE,
            f"node {node.name}",
            f"host cache over its budget of {memory.human_bytes(node.cpu_cache_bytes)} by "
            f"{memory.human_bytes(decided.over_bytes)}: the rest are draining to it or failover standbys",
            after={"over_bytes": decided.over_bytes, "budget_bytes": node.cpu_cache_bytes},
            node=node.name,
        )
    return parked


def _with_last_requests(held: list[host_cache.HostHolder]) -> list[host_cache.HostHolder]:
    """The holders with their last requests as Redis has them: the rows' times lag, and a sleep
    that comes right after a replica's last request (the one this trim follows, often) would
    otherwise count it as unused since it started serving, the first to leave."""
    try:
        seen = queueing.last_requests(h.replica_id for h in held)
    except redis.RedisError as err:
        log.warning("host cache trimmed on the database's last-request times: Redis unavailable (%s)", err)
        return held
    return [
        replace(h, last_accessed=seen[h.replica_id])
        if h.replica_id in seen and (h.last_accessed is None or seen[h.replica_id] > h.last_accessed)
        else h
        for h in held
    ]


def _locked(replica_id: str) -> Replica | None:
    """The replica's row, locked after its deployment's (the one lock order); None if it is gone."""
    replica = Replica.objects.filter(pk=replica_id).first()
    if replica is None:
        return None
    locks.lock_deployment_of(replica)
    return locks.lock_replica(replica_id)


def _park(replica_id: str, node: Node) -> bool:
    """One sleeper out of the host cache, in a transaction of its own: its deployment's row first,
    then the GPU rows the ledger locks, then its own (the one lock order). False if it woke, or
    went, in the meantime."""
    with transaction.atomic():
        replica = _locked(replica_id)
        # Re-read under the lock: a wake may have promoted it since the trim looked.
        if replica is None or replica.state not in states.ASLEEP or replica.node_id != node.pk:
            return False
        freed = park_sleeper(
            replica,
            f"parked out of node {node.name}'s host cache (budget {memory.human_bytes(node.cpu_cache_bytes)}) "
            "to make room",
        )
        outbox.note(
            Event.Kind.HOST_CACHE,
            f"node {node.name}",
            f"replica {replica_id[:8]} of {replica.deployment.name} left the host cache ({memory.human_bytes(freed)})",
            after={"parked": replica_id, "freed_bytes": freed},
            node=node.name,
            deployment=replica.deployment.name,
            replica=replica_id,
        )
    return True


def park_sleeper(replica: Replica, why: str) -> int:
    """A sleeper (either level, on its node) parked: its reservation released, its process stopped
    or, deep asleep, its host copy deleted by its agent; its deployment's next wake loads a new
    replica from disk. `why` reads after "replica <id>" ("parked out of ..."). The bytes of weights
    its node's host memory no longer holds. The caller holds its deployment's row, then its own
    (the one lock order)."""
    node = replica.node
    freed = host_bytes(replica)
    replicas.reserve_exactly(replica, {}, reason=f"replica {replica.id[:8]} {why}")
    outbox.want(effects.stop(node.name, replica.id))
    replica.node = None
    replica.pid = None
    replica.gpu_mem_bytes_by_id = {}
    replica.arena_kept_bytes = 0  # its next process starts with none
    replica.host_copy_bytes = 0  # deep asleep, its copy is deleted by its agent
    replicas.set_state(
        replica,
        Replica.State.PARKED,
        f"{why}: its {memory.human_bytes(freed)} of weights are freed, and its next wake loads them from disk",
        extra=["node", "pid", "gpu_mem_bytes_by_id", "arena_kept_bytes", "host_copy_bytes"],
    )
    return freed


def grant(node_name: str) -> list[str]:
    """Let the node's serving replicas keep an arena for their next sleep while its host cache has
    room (scheduling.core.host_cache.grants); the ids granted. Each is counted from the commit that
    grants it, before its replica has allocated anything: the books never lag the memory."""
    node = Node.objects.filter(name=node_name, status=Node.Status.ONLINE).first()
    if node is None or node.cpu_cache_bytes <= 0:
        return []
    held = holders([node.pk])[node.pk]
    candidates = [
        _holder(replica, host_bytes(replica), kept_arena=True)
        for replica in Replica.objects.filter(
            node=node, state=Replica.State.SERVING, arena_kept_bytes=0, lease__isnull=True
        ).select_related("deployment__observed")
    ]
    # One read of Redis's last-request times for both.
    seen = _with_last_requests([*held, *candidates])
    chosen = host_cache.grants(seen[: len(held)], seen[len(held) :], node.cpu_cache_bytes)
    return [replica_id for replica_id in chosen if _set_kept(replica_id, node, keep=True)]


def _set_kept(replica_id: str, node: Node, *, keep: bool) -> bool:
    """Grant a kept arena to an awake replica, or take it back, in a transaction of its own (the
    one lock order: its deployment's row, then its own); the replica is told once it commits.
    False if it changed meanwhile (asleep, gone, elsewhere, or already so)."""
    with transaction.atomic():
        replica = _locked(replica_id)
        # Re-read under the lock: it may have gone to sleep, or been granted by another balance.
        if replica is None or replica.node_id != node.pk or (replica.arena_kept_bytes > 0) == keep:
            return False
        if keep and replica.state != Replica.State.SERVING:
            return False
        size = host_bytes(replica) if keep else replica.arena_kept_bytes
        replica.arena_kept_bytes = size if keep else 0
        replica.save(update_fields=["arena_kept_bytes", "updated_at"])
        outbox.note(
            Event.Kind.HOST_CACHE,
            f"node {node.name}",
            (
                f"replica {replica_id[:8]} of {replica.deployment.name} keeps a {memory.human_bytes(size)} arena "
                "for its next sleep (pinned in advance, so the sleep is a copy): room spare in the host cache"
                if keep
                else f"replica {replica_id[:8]} of {replica.deployment.name} drops the "
                f"{memory.human_bytes(size)} arena it kept for its next sleep: the host cache needs the room"
            ),
            before={"arena_kept_bytes": 0 if keep else size},
            after={"arena_kept_bytes": size if keep else 0},
            node=node.name,
            deployment=replica.deployment.name,
            replica=replica_id,
        )
        outbox.want(effects.keep_arena(node.name, replica_id, keep=keep))
    return True


def note_unkept(replica: Replica, why: str) -> None:
    """The replica could not allocate the arena it was granted (the host out of memory, say): the
    books stop counting it, with an Event. Only a failure says so: a plain `arena 0` may be an
    earlier drop's answer arriving after a new grant committed."""
    if replica.arena_kept_bytes == 0:
        return
    size, replica.arena_kept_bytes = replica.arena_kept_bytes, 0
    replica.save(update_fields=["arena_kept_bytes", "updated_at"])
    outbox.note(
        Event.Kind.HOST_CACHE,
        f"node {replica.node.name if replica.node else '?'}",
        f"replica {replica.id[:8]} of {replica.deployment.name} could not allocate the "
        f"{memory.human_bytes(size)} arena it was granted ({why}): no longer counted; its next sleep allocates its own",
        before={"arena_kept_bytes": size},
        after={"arena_kept_bytes": 0},
        node=replica.node.name if replica.node else "",
        deployment=replica.deployment.name,
        replica=replica.id,
    )


def note_kept(replica: Replica, kept_bytes: int) -> None:
    """The replica's own word on the arena it keeps (its `arena` report): the size it allocated
    (its alignment makes it a little more than its weights) replaces the grant's figure. A report
    of an arena the books do not lend it (one that crossed the command taking it back, or whose
    drop was lost with a down agent) lends nothing back: only the control plane grants, and the
    replica is told again to drop it, since memory it holds unaccounted is the unsafe side."""
    if kept_bytes <= 0:
        return
    if replica.arena_kept_bytes == 0:
        if replica.node is not None:
            outbox.want(effects.keep_arena(replica.node.name, replica.id, keep=False))
        return
    if kept_bytes != replica.arena_kept_bytes:
        replica.arena_kept_bytes = kept_bytes
        replica.save(update_fields=["arena_kept_bytes", "updated_at"])
