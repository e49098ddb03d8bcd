"""The one lock order of the control plane's writes, in one place (like Saleor's
lock_objects): a deployment row first, then the heartbeat sweep's hearing row (only the sweep
takes it, before the nodes it judges), then node rows, then GPU rows in primary-key order (the
ledger's commit takes those itself), then replica rows in primary-key order. Every
`select_for_update` of a service goes through here, and a writer that needs several takes them in
that order, so two writers never wait on each other in a circle.

A deployment's observed record (DeploymentObserved: what the portal measured or decided about it)
has no place of its own in the order: its deployment's row lock covers it. Every writer of the
record holds that lock first (the locks below read the record with the row, unlocked), so two of
them never meet on the record's row alone, and no writer takes the record's row before its
deployment's.

Rows a writer reaches through a foreign key (an Occupant's cascade, a row PostgreSQL locks for
a reference check) can still close a circle now and then: `retry_deadlocks` runs a top-level
command again when PostgreSQL aborted it for that."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ParamSpec, TypeVar

import psycopg
from django.db import OperationalError, connection, transaction
from django.db.models import QuerySet

from gpuportal.wire import control
from scheduling import hot_sql
from scheduling.models import GPU, Deployment, DeploymentObserved, Hearing, Node, NodeCredential, Replica
from scheduling.services import not_found
from scheduling.services.errors import NotFound

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

# What PostgreSQL asks a client to run again (SQLSTATE 40P01 and 40001).
RETRYABLE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
DEADLOCK_ATTEMPTS = 4


def retry_deadlocks(command: Callable[P, R]) -> Callable[P, R]:
    """Runs a top-level command again, from the start, when PostgreSQL aborted its transaction
    for a deadlock or a serialization failure: the whole transaction rolled back (its on-commit
    effects with it), so running it again applies it once. Inside a caller's transaction it runs
    once: only the caller can start that transaction again."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if transaction.get_connection().in_atomic_block:
            return command(*args, **kwargs)
        for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
            try:
                return command(*args, **kwargs)
            except OperationalError as err:
                if not isinstance(err.__cause__, RETRYABLE) or attempt == DEADLOCK_ATTEMPTS:
                    raise
                log.warning("%s: %s; running it again (attempt %d)", command.__name__, err.__cause__, attempt + 1)
                # Jittered: the two sides of a deadlock must not meet again in step.
                time.sleep(random.uniform(0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")

    return run


def _deployments_locking(*, skip_locked: bool = False) -> QuerySet[Deployment]:
    """Deployments read with their observed record, so that its readers and writers under the lock
    need no query of their own. The record's row is locked with the deployment's (after it, in the
    one statement; every writer of the record holds the deployment's lock, so no one else waits
    for it): in READ COMMITTED, a statement that waited for a lock reads again only the rows it
    locks, and the record read beside an unlocked row was the one from before the wait, not what
    the lock's previous holder committed."""
    locking = Deployment.objects.select_for_update(of=("self", "observed"), skip_locked=skip_locked)
    # An inner join (every deployment has its record from its start): FOR UPDATE locks no row of
    # the nullable side of the outer join select_related would make.
    return locking.filter(observed__isnull=False).select_related("observed")


def lock_deployment(name: str) -> Deployment:
    """The deployment's row, locked until the transaction ends (NotFound, a 404, if there is none)."""
    try:
        return _deployments_locking().get(name=name)
    except Deployment.DoesNotExist:
        raise not_found.deployment(name) from None


def lock_deployments_reading(names: Sequence[str], *queries: str) -> tuple[list[Deployment], list[list[tuple]]]:
    """The deployments' rows locked in primary-key order (those that exist: no error for a name
    that does not) and the rows of each query read after them (a batch of scale calls' census),
    statements the server prepares once rather than ones Django compiles each time, to
    spare the client CPU. Each query is a statement of its own, run once the locks are granted, so it sees
    what their previous holders committed; its one parameter is the locked deployments' ids.

    Why ids and not the names: a query's snapshot is newer than the lock's. A deployment of one
    of these names created (and committed, with its replicas) while the lock waited for a
    delete of the old one is not locked here, yet a query by name would read its rows."""
    with hot_sql.cursor() as cursor:
        cursor.execute(_lock_by_names(), [list(names)])
        deployments = [_with_observed(row) for row in cursor.fetchall()]
        ids = [d.pk for d in deployments]
        rows = []
        for query in queries:
            cursor.execute(query, [ids])
            rows.append(cursor.fetchall())
    return deployments, rows


@functools.cache
def _lock_by_names() -> str:
    # FOR UPDATE locks rows as the sorted result is read: in primary-key order. OF d, o: the
    # observed record is read beside its deployment and locked with it, so that a statement that
    # waited for the lock reads what the previous holder committed (_deployments_locking).
    return (
        f"SELECT {hot_sql.columns(Deployment, 'd')}, {hot_sql.columns(DeploymentObserved, 'o')} "
        "FROM scheduling_deployment d JOIN scheduling_deploymentobserved o ON o.deployment_id = d.id "
        "WHERE d.name = ANY(%s) ORDER BY d.id FOR UPDATE OF d, o"
    )


def _with_observed(row: Sequence) -> Deployment:
    """A deployment and its observed record from a row of `_lock_by_names`, the record cached on
    it as select_related("observed") leaves it."""
    split = len(Deployment._meta.concrete_fields)
    deployment = hot_sql.instance(Deployment, row[:split])
    observed = hot_sql.instance(DeploymentObserved, row[split:])
    Deployment._meta.get_field("observed").set_cached_value(deployment, observed)
    DeploymentObserved._meta.get_field("deployment").set_cached_value(observed, deployment)
    return deployment


def lock_deployment_of(replica: Replica) -> Deployment:
    """The row of the replica's deployment (a replica never outlives its deployment's row)."""
    return _deployments_locking().get(pk=replica.deployment_id)


def lock_deployment_if_there(
    *, name: str | None = None, pk: int | None = None, skip_locked: bool = False
) -> Deployment | None:
    """The deployment's row locked, or None if it is gone (deleted meanwhile) or, with
    `skip_locked`, if another transaction holds it (a sweep that comes back later)."""
    query = _deployments_locking(skip_locked=skip_locked)
    return query.filter(name=name).first() if name is not None else query.filter(pk=pk).first()


def lock_node(name: str) -> Node:
    """The node's row (NotFound if there is none)."""
    try:
        return Node.objects.select_for_update().get(name=name)
    except Node.DoesNotExist:
        raise NotFound(control.unknown_node(name)) from None


def lock_node_if_there(name: str) -> Node | None:
    return Node.objects.select_for_update().filter(name=name).first()


def lock_or_create_node(name: str, defaults: dict) -> tuple[Node, bool]:
    return Node.objects.select_for_update().get_or_create(name=name, defaults=defaults)


def lock_node_credential(name: str) -> NodeCredential | None:
    """A node's credential row, if it has one. Its own transaction, before the node's row is
    taken: revoking writes the credential off first, then the node (nodes.mark_stopped)."""
    return NodeCredential.objects.select_for_update().filter(node=name).first()


def lock_hearing() -> Hearing | None:
    """The sweep's hearing row, made if the books have none yet; None while another sweep holds
    it (two sweeps at once would each read the other's gap as a stall)."""
    rows = Hearing.objects.filter(pk=1)
    if (held := rows.select_for_update(skip_locked=True).first()) is not None:
        return held
    if rows.exists():
        return None  # there, and locked by another sweep
    # The first sweep of these books (or the first after a test's flush): made once, and a
    # sweep making it at the same moment waits here for the other's insert, then skips.
    Hearing.objects.bulk_create([Hearing(pk=1)], ignore_conflicts=True)
    return rows.select_for_update(skip_locked=True).first()


def lock_silent_nodes(nodes: QuerySet[Node]) -> list[Node]:
    """These nodes, in primary-key order, skipping any locked now (a node registering or
    heartbeating this moment is alive by definition)."""
    return list(nodes.select_for_update(skip_locked=True).order_by("pk"))


@contextlib.contextmanager
def _session_lock(keys: str, params: list) -> Iterator[None]:
    """A session-level advisory lock on `keys` (SQL of PostgreSQL's two-key form), held until the
    block ends, whatever transactions it runs."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_advisory_lock({keys})", params)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT pg_advisory_unlock({keys})", params)


# The first key of the host cache's advisory locks (PostgreSQL's two-key form, the second the
# node's id): a number of its own, so no other advisory lock of the project's can share one.
HOST_CACHE_LOCK = 19


def host_cache_balance(node_id: int) -> contextlib.AbstractContextManager[None]:
    """One balance of the node's host cache at a time (trim, then grant: each decision reads the
    node's whole cache and applies in transactions of its own, so two at once could each lend the
    same spare room). A session-level advisory lock, held across those transactions, outside the
    row lock order: only a balance takes it, and takes it before any row, so no writer that holds a
    row ever waits for it and no circle can close through it."""
    return _session_lock("%s, %s", [HOST_CACHE_LOCK, node_id])


# The first key of the node users' advisory locks, the second the hash of the node's name (a
# node's user may be made before the node registers, so there may be no row to take an id from).
NODE_USER_LOCK = 20


def node_user(name: str) -> contextlib.AbstractContextManager[None]:
    """One change at a time to node `name`'s Redis user (scheduling.services.node_users): a sweep
    reads the books and then sets the user's keys anew, and a grant made between the two would be
    dropped. Session-level and outside the row lock order, as host_cache_balance is: whoever takes
    it holds no row, and takes none while holding it other than by plain reads."""
    return _session_lock("%s, hashtext(%s)", [NODE_USER_LOCK, name])


def lock_gpus(ids: Iterable[int]) -> list[GPU]:
    """These GPUs' rows (with their node), in primary-key order."""
    return list(
        GPU.objects.select_for_update(of=("self",)).select_related("node").filter(pk__in=list(ids)).order_by("pk")
    )


def lock_node_gpus(node_id: int) -> list[GPU]:
    """Every GPU row of a node, in primary-key order."""
    return list(GPU.objects.select_for_update().filter(node_id=node_id).order_by("pk"))


def lock_replica(replica_id: str) -> Replica:
    """The replica's row, read with its node and its deployment (unlocked: a caller that needs the
    deployment's row took its lock first) and that deployment's observed record."""
    return (
        Replica.objects.select_for_update(of=("self",))
        .select_related("node", "deployment__observed")
        .get(pk=replica_id)
    )


def lock_replica_ids(ids: Iterable[str]) -> None:
    """These replicas' rows, in primary-key order, without reading them."""
    with hot_sql.cursor() as cursor:
        cursor.execute("SELECT id FROM scheduling_replica WHERE id = ANY(%s) ORDER BY id FOR UPDATE", [sorted(ids)])


def lock_replicas(replicas: QuerySet[Replica], *, skip_locked: bool = False) -> list[Replica]:
    """These replicas' rows (not their related rows), in primary-key order; with `skip_locked`,
    those another transaction holds are left out."""
    return list(replicas.select_for_update(of=("self",), skip_locked=skip_locked).order_by("pk"))
