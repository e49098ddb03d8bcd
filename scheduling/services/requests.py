"""Inference requests: accept, wake what must serve them, wait, read, cancel or stop, re-queue.

Requests live in Redis (gpuportal.wire.requestqueue): the hot path writes no database row, so a
request costs a few Redis round trips on top of the model. What the scheduler needs from them
(a replica's last access, for idle sleep) is copied into PostgreSQL by `sync_last_accessed`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import psycopg
import redis
from django.db import InterfaceError, OperationalError, connection
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from gpuportal.wire import adapters, states
from gpuportal.wire.requestqueue import (
    KeyTakenOver,
    Request,
    family_of_kind,
    family_of_loader,
    never_sent,
)
from scheduling import hot_sql, ledger, requeststats
from scheduling.models import GPU, Deployment, Replica
from scheduling.services import not_found, placing, sleep, user_limits
from scheduling.services.errors import CannotPlace, InvalidInput, KeyReused, OutcomeUnknown, Unavailable
from scheduling.services.queueing import (
    cancel,
    cancel_unstarted,
    fail_waiting,
    get,
    latest,
    queue,
    queue_depth,
    recent,
    requeue_from,
    stop_abandoned,
    sync_last_accessed,
    wait,
    withdraw_live,
)

# What the request queue offers (scheduling.services.queueing) is re-exported: the API, the tasks
# and the tests reach requests through this module.
__all__ = [
    "cancel",
    "cancel_unstarted",
    "fail_waiting",
    "get",
    "latest",
    "queue",
    "queue_depth",
    "recent",
    "requeue_from",
    "run",
    "stop_abandoned",
    "submit",
    "sync_last_accessed",
    "wait",
    "withdraw_live",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a deployment is and takes, by its loader's family (gpuportal.wire.requestqueue), for the
# refusal of a request of another kind.
_TAKES = {
    "text": "a causal LM: send text or chat messages",
    "tensor": "a plain PyTorch module: send a tensor as JSON lists",
    "embedding": "an embedding model: send its text to POST /v1/embeddings",
}

# A failover standby counts as awake: it takes over on its own the moment its active member dies.
# Plain strings: a driver may adapt an enum member by its name rather than its value.
_AWAKE_OR_STANDBY = states.names(sorted(states.AWAKE | {Replica.State.STANDBY}))
# A fair wake's waiter without a place yet is not awake (node_id null): asking again is what lets
# a wake whose preempt task died start over (sleep.awake_count).


def submit(
    deployment_name: str,
    *,
    kind: str,
    input: Any,
    params: dict[str, Any],
    owner: str,
    idempotency_key: str | None = None,
) -> Request:
    """Accept a request: it waits in its deployment's queue until an awake replica takes it.

    A deployment with no awake replica is woken first (a cached replica promoted, or a new one
    placed); the request then shows `waking` until a replica takes it. One that can never be
    placed anywhere is refused with 409, and nothing is queued. One past its owner's limits
    (user_limits) is refused with 429, before anything is read or woken for it. Sent again under
    the `idempotency_key` of one accepted before, it is that one, and nothing is queued.
    `deployment_name` may name one of its LoRA adapters (`llama-8b:sql`, gpuportal.wire.adapters).
    """
    deployment_name, params = addressed(deployment_name, params)
    request_id, first = _first_under(owner, idempotency_key, (deployment_name, kind, input, params))
    if first is not None:
        return first
    # Counted for the dashboard's requests per minute in the same round trip, and in /metrics
    # once accepted.
    try:
        queued = _queued(
            deployment_name, kind, owner, partial(
                queue().submit, deployment_name, kind=kind, input=input, params=params, owner=owner,
                count_in=requeststats.bucket(deployment_name), under_key=_under(owner, idempotency_key),
            ),
            request_id,
        )  # fmt: skip
    except KeyTakenOver as taken:
        return _taken_over(taken)
    except redis.RedisError as err:
        queued = _accepted_after_all(request_id, err, keyed=idempotency_key is not None)
    requeststats.accepted(deployment_name)
    return queued


def run(
    deployment_name: str,
    *,
    kind: str,
    input: Any,
    params: dict[str, Any],
    owner: str,
    timeout: float,
    idempotency_key: str | None = None,
) -> tuple[Request, Request | None]:
    """`submit`, then wait up to `timeout` for the end: (as accepted, final or None)."""
    deployment_name, params = addressed(deployment_name, params)
    request_id, first = _first_under(owner, idempotency_key, (deployment_name, kind, input, params))
    if first is not None:
        return first, first if first.final else queue().wait(first.id, timeout)
    # Counted in /metrics once it has ended or its wait is over (accepted either way).
    try:
        outcome = _queued(
            deployment_name, kind, owner, partial(
                queue().submit_and_wait, deployment_name, kind=kind, input=input, params=params, owner=owner,
                timeout=timeout, count_in=requeststats.bucket(deployment_name),
                under_key=_under(owner, idempotency_key),
            ),
            request_id,
        )  # fmt: skip
    except KeyTakenOver as taken:
        first = _taken_over(taken)
        return first, first if first.final else queue().wait(first.id, timeout)
    except redis.RedisError as err:
        accepted = _accepted_after_all(request_id, err, keyed=idempotency_key is not None)
        outcome = (accepted, accepted if accepted.final else None)
    requeststats.accepted(deployment_name)
    return outcome


# How long a submit that lost Redis tries to learn what became of its request: about what `up`
# takes to start Redis again.
WITHDRAW_FOR_S = 3.0


def _accepted_after_all(request_id: str, err: redis.RedisError, *, keyed: bool) -> Request:
    """Redis failed under a submit: the request may have been written with only the answer lost.
    A 503 must mean it will not run, so `err` (a 503) is raised again only where that is known:
    - the submit was never sent (no connection);
    - Redis did not answer it in time (a timeout; one while waiting for its end, after the submit
      was answered, is no error). Redis was frozen before it ran the submit, and runs it once it
      resumes, past its deadline, writing nothing (SubmitTooLate where that answer came in time).
      Only a freeze that fell between running it and answering, microseconds, escapes this;
    - Redis killed and back within WITHDRAW_FOR_S: the request was never written, or was
      withdrawn while it still waited. One a replica has taken already was accepted after all,
      and is returned (the caller answers with its id).
    Where it cannot be known (Redis killed and not back in time; at once under an
    Idempotency-Key, whose retry is safe anyway): OutcomeUnknown, a 504 naming the request."""
    if isinstance(err, redis.TimeoutError) or never_sent(err):
        raise err
    if keyed:
        raise OutcomeUnknown(request_id, keyed) from err
    refused = retry_if_exception_type(redis.ConnectionError)
    try:
        for attempt in Retrying(
            stop=stop_after_delay(WITHDRAW_FOR_S), wait=wait_fixed(0.2), retry=refused, reraise=True
        ):
            with attempt:
                # cancel() is False for one never written too: then `taken` is None as well.
                withdrawn = queue().cancel(request_id, reason=WITHDRAWN)
                taken = None if withdrawn else queue().get(request_id)
    except redis.RedisError:
        raise OutcomeUnknown(request_id, keyed) from err
    if taken is None or taken.status == "cancelled":
        raise err
    log.info("request %s was accepted after all (Redis: %s): answered with its id", request_id, err)
    return taken


WITHDRAWN = "withdrawn: the web lost Redis before it could say the request was accepted, and answered 503"


def _first_under(
    owner: str, key: str | None, asked: tuple[str, str, Any, dict[str, Any]]
) -> tuple[str, Request | None]:
    """The id a new request takes, and the request first accepted under `key` if there is one.
    KeyReused (422) when that one is not `asked` (deployment, kind, input, params): a retry that
    got another's answer would never learn its own was not run."""
    request_id = uuid.uuid4().hex
    if key is None:
        return request_id, None
    first_id = queue().claim_idempotency_key(owner, key, request_id)
    first = None if first_id == request_id else queue().get(first_id)
    if first is not None and _canonical(first.deployment, first.kind, first.input, first.params) != _canonical(*asked):
        raise KeyReused(
            f"Idempotency-Key {key!r} was first sent with another request (to {first.deployment}, "
            f"{first.kind}, request {first.id}): a retry must send the same request; a new request needs a new key"
        )
    return request_id, first


def _canonical(*parts: Any) -> str:
    # As stored: Redis keeps the input and params as JSON, so tuples come back as lists.
    return json.dumps(parts, sort_keys=True, default=str)


def _under(owner: str, key: str | None) -> tuple[str, str] | None:
    return None if key is None else (owner, key)


def _taken_over(taken: KeyTakenOver) -> Request:
    """The request a retry under the same key queued while this submit was on its way (its client
    gave up on it and sent it again): that one is the answer, and this one was never queued."""
    first = queue().get(taken.first) if taken.first else None
    if first is None:  # the retry has claimed the key but not yet written its request
        raise Unavailable("a request under the same Idempotency-Key is being accepted now: send it again")
    log.info("request under a key taken over by its retry: answered with %s", first.id)
    return first


def addressed(model: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(deployment, params) of a request to `model`: a deployment's name, or `deployment:adapter`,
    whose adapter the params name for its replica. An adapter the deployment does not serve is
    refused here, before anything is queued or woken: one indexed read, on requests to an
    adapter only (the replica refuses one it lacks too, where the deployment's adapters changed
    since)."""
    deployment_name, adapter = adapters.split_model(model)
    if adapter is None:
        return model, params
    text = Deployment.objects.filter(name=deployment_name).values_list("model_adapters", flat=True).first()
    if text is None:
        raise not_found.deployment(deployment_name)
    if adapter not in (served := adapters.parse(text)):
        raise not_found.adapter(deployment_name, adapter, list(served))
    return deployment_name, {**params, adapters.PARAM: adapter}


def _queued(deployment_name: str, kind: str, owner: str, put: Callable[..., T | None], request_id: str) -> T:
    """`put` (a queue's submit) first with no database read, which queues the request only if a
    replica claims to take such requests now (gpuportal.wire.requestqueue's gp:live): there is then
    nothing to wake. Else `put` again once the database has admitted it (`_admit`).

    Before either, the request is counted against its owner's limits under the id both puts give
    it, or refused (TooManyRequests)."""
    holds_place = user_limits.admit(owner, request_id)
    try:
        queued = put(if_live=True, request_id=request_id)
        if queued is None:
            queued = put(status=_admit(deployment_name, kind), request_id=request_id)
    except Exception:
        if holds_place:
            user_limits.release(owner, request_id)
        raise
    assert queued is not None  # only a submit `if_live` queues nothing
    return queued


def _admit(deployment_name: str, kind: str) -> str:
    """Check that `deployment_name` can take `kind`, wake it if nothing is awake; the status a
    request for it starts in."""
    # One statement for all a request needs to know when no replica claims to take it (with a
    # claim, a request reads nothing from the database). Raw SQL, so no ORM compiles it each
    # time, and psycopg prepares it on the server after a few runs.
    row = _read_deployment(deployment_name)
    if row is None:
        raise not_found.deployment(deployment_name)
    loader, awake, serving = row
    takes = family_of_loader(loader)
    if family_of_kind(kind) != takes:
        raise InvalidInput("input", f"{deployment_name} is {_TAKES[takes]}")
    if not awake:
        deployment = Deployment.objects.select_related("observed").get(name=deployment_name)
        observed = deployment.observed
        # A sleeping replica loaded once and wakes as usual; with none, a request would only
        # start one more load after failed ones (the crash loop the backoff stops).
        loads = (observed.failed_reason or observed.retry_at) and not deployment.replicas.filter(
            state__in=states.ASLEEP
        ).exists()
        if loads and observed.failed_reason:
            raise Unavailable(
                f"deployment {deployment_name} failed: {observed.failed_reason} "
                f"(retry with POST /api/deployments/{deployment_name}/retry/ or change its settings)"
            )
        if loads:
            return "waking"  # a replacement for a failed load starts after its backoff: wait for it
        _refuse_if_never_placeable(deployment)
        sleep.wake_deployment(deployment_name, reason="woken by a request", for_requests=True)
    return "queued" if serving else "waking"


def _read_deployment(deployment_name: str) -> tuple[str, bool, bool] | None:
    """(loader, awake, serving) of the deployment, or None if there is none."""
    params = [_AWAKE_OR_STANDBY, str(Replica.State.SERVING), deployment_name]
    if connection.in_atomic_block:  # a caller's transaction: its connection is the one to use
        return _fetch(params)
    # Django's CONN_HEALTH_CHECKS would first send a `SELECT 1` on a kept connection, a round trip
    # on every request. Here the query is its own check: a connection the server dropped (a
    # restarted database) fails it, and the statement runs again on a new one. Safe to repeat:
    # it only reads, and outside a transaction.
    connection.health_check_done = True
    try:
        return _fetch(params)
    except (OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError):
        log.info("database connection lost; reading %s again on a new one", deployment_name)
        connection.close()
    return _fetch(params)


def _fetch(params: list) -> tuple[str, bool, bool] | None:
    # A server-binding cursor, as the ledger's (Django's own bind on the client): psycopg prepares
    # the statement after a few runs (GPUPORTAL_DB_PREPARE_THRESHOLD), so PostgreSQL stops
    # planning it on every request (about 0.15 ms of each, out of the portal's small overhead budget).
    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(hot_sql.statement("submit_facts"), params)
        return cursor.fetchone()


def _refuse_if_never_placeable(deployment: Deployment) -> None:
    """409 when no node could host a replica even empty: waiting would never end."""
    snapshot = ledger.snapshot()
    need = placing.need_bytes(deployment, snapshot).bytes
    per_node: dict[str, int] = {}
    for gpu in snapshot.gpus.values():
        if gpu.node_status == states.NodeStatus.ONLINE and gpu.health == GPU.Health.OK:
            per_node[gpu.node] = per_node.get(gpu.node, 0) + gpu.total_bytes
    if not per_node:
        drained = sorted({g.node for g in snapshot.gpus.values() if g.node_status == states.NodeStatus.DRAINING})
        if drained:
            # The operator's own drain is why: say which nodes and how to undo it, as a deploy does.
            raise CannotPlace(
                f"cannot serve {deployment.name}: every node with a GPU is drained ({', '.join(drained)}), and "
                f"nothing is placed on a drained node: return one to service (`gpuportal node undrain {drained[0]}`, "
                f"POST /api/nodes/{drained[0]}/undrain/)",
                {node: "drained" for node in drained},
            )
        raise CannotPlace(f"cannot serve {deployment.name}: no online node with a healthy GPU", {})
    if need > max(per_node.values()):
        reasons = {node: f"all its GPUs hold {total} B, the replica needs {need} B" for node, total in per_node.items()}
        raise CannotPlace(f"cannot serve {deployment.name}: no node can ever hold its {need} B", reasons)
