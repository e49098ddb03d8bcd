"""The request queues as the control plane uses them (gpuportal.wire.requestqueue, in Redis): read,
cancel or stop, re-queue what a gone replica had taken, end what waits for nothing. Below every other
service: replicas, deployments, sleep and preemption all need it, and it needs none of them;
admission (which wakes what must serve) is scheduling.services.requests, on top."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache

import redis
from django.conf import settings

from gpuportal.wire.requestqueue import Request, RequestQueue
from gpuportal.wire.states import AWAKE
from scheduling.models import Replica
from scheduling.services.errors import InvalidState, NotFound

log = logging.getLogger(__name__)


# No call on the control plane's queue waits longer for Redis: a frozen Redis holds up no web
# thread past it, so a request's timeout_s is kept whatever Redis does. Longer than a blocking
# read's slice (BLOCK_SLICE_S), which is cut to fit within it.
REDIS_TIMEOUT_S = 5.0


# What an answer only glances at (where a request stands, to show it) waits no longer than this:
# an answer must not wait out a frozen Redis for what it can answer without.
GLANCE_TIMEOUT_S = 0.5


@cache
def queue() -> RequestQueue:
    return RequestQueue.from_url(
        settings.REDIS_URL, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )


def glance() -> RequestQueue:
    """The queue on a client of its own with a short timeout, for reads an answer can do without."""
    return _glance(settings.REDIS_URL)


@cache
def _glance(url: str) -> RequestQueue:
    return RequestQueue.from_url(url, socket_timeout=GLANCE_TIMEOUT_S, socket_connect_timeout=GLANCE_TIMEOUT_S)


def wait(request_id: str, timeout: float) -> Request | None:
    return queue().wait(request_id, timeout)


def latest(request: Request) -> Request:
    """The request as it stands now (a waiter's timeout passed): its status may have moved on. As
    it was accepted, when Redis cannot say now: the caller polls it once Redis is back."""
    try:
        return glance().get(request.id) or request
    except redis.RedisError:
        return request


def get(request_id: str, *, user_id: str, staff: bool) -> Request:
    """A user sees only their own requests; staff see all. Others' are answered as not found."""
    request = queue().get(request_id)
    if request is None or (not staff and request.owner != user_id):
        raise NotFound(f"no request with id {request_id!r}")
    return request


def recent(
    *, user_id: str, staff: bool, deployment: str | None, status: str | None, offset: int, limit: int
) -> tuple[list[Request], bool]:
    """The caller's requests (staff: everyone's), newest first: a page of them and whether more follow."""
    return queue().recent(None if staff else user_id, deployment=deployment, status=status, offset=offset, limit=limit)


# How long a cancel of a request a replica holds waits for the replica to end it (it reads the
# asks to stop every inference.serving.STOPS_EVERY_S): most cancels answer with the request ended.
STOP_WAIT_S = 3.0


def cancel(request_id: str, *, user_id: str, staff: bool) -> Request:
    """Cancel a request wherever it is: where it waits, at once; where a replica generates it, the
    replica is asked to stop, and ends it `cancelled` with what it generated until then (waited
    for up to STOP_WAIT_S: the request as it stands then, perhaps still running). InvalidState for
    one that has ended."""
    request = get(request_id, user_id=user_id, staff=staff)
    reason = "cancelled by its owner" if request.owner == user_id else "cancelled by staff"
    outcome = queue().stop(request_id, reason)
    if not outcome:
        ended = get(request_id, user_id=user_id, staff=staff)
        raise InvalidState(f"request {request_id} is {ended.status}: it has ended, and there is nothing to cancel")
    if outcome == "stopping":
        return queue().wait(request_id, STOP_WAIT_S) or get(request_id, user_id=user_id, staff=staff)
    return get(request_id, user_id=user_id, staff=staff)


def forget(request_id: str, *, user_id: str, staff: bool) -> Request:
    """Delete a request that has ended, and what it was asked and answered (the request as it
    was). InvalidState for one still waiting or running: cancel it first."""
    request = get(request_id, user_id=user_id, staff=staff)
    if not queue().forget(request_id):
        now = get(request_id, user_id=user_id, staff=staff)
        raise InvalidState(
            f"request {request_id} is {now.status}: it can be deleted once it has ended (cancel it first)"
        )
    return request


def cancel_unstarted(request_id: str, *, reason: str) -> bool:
    """Cancel the request if no replica has taken it yet (its caller stopped waiting); whether it was."""
    try:
        return queue().cancel(request_id, reason)
    except redis.RedisError as err:  # it then runs for nobody, and its answer is kept for polling
        log.warning("cannot cancel request %s (Redis: %s)", request_id, err)
        return False


def stop_abandoned(request_ids: Iterable[str], *, reason: str) -> None:
    """Stop requests nobody waits for any more (a stream's client left): cancelled where they wait,
    asked stopped where a replica generates them, so that no replica spends its steps and its KV
    blocks on an answer nobody reads."""
    for request_id in request_ids:
        try:
            queue().stop(request_id, reason)
        except redis.RedisError as err:  # it then runs for nobody, and its answer is kept for polling
            log.warning("cannot stop request %s (Redis: %s)", request_id, err)


def withdraw_live(deployment_name: str, replica_id: str) -> None:
    """The replica takes no more requests: withdraw its claim that it does (a replica withdraws
    it itself as it stops taking; one that died could not), so that requests from now on are
    admitted by the database, which wakes what must serve them."""
    queue().withdraw(deployment_name, replica_id)


def write_off(replica_id: str) -> None:
    """The replica, perhaps still running where the control plane cannot reach it, may take no
    more requests (gpuportal.wire.requestqueue.WrittenOff): before what it took goes back."""
    queue().write_off(replica_id)


def requeue_from(replica_id: str, reason: str) -> dict[str, str]:
    """What a stopped or failed replica had taken goes back to its queue (never dropped)."""
    outcomes = queue().requeue_from(replica_id, max_attempts=settings.GPUPORTAL_REQUEST_ATTEMPTS, reason=reason)
    if outcomes:
        log.info("replica %s gone (%s): %s", replica_id, reason, outcomes)
    return outcomes


def fail_waiting(
    deployment_name: str,
    reason: str,
    *,
    deleted: bool = False,
    kind: str = "placement",
    retry_after_s: int | None = None,
) -> list[str]:
    """End the waiting requests of a deployment that cannot be woken, saying why. `deleted`: it
    is gone, so its replicas' claims to take requests go first; a request queued on the strength
    of one before that is then in the queue, and ends here too. `kind` is the error's (a failed
    load is `load`, answered 503; what cannot be placed, 409). `retry_after_s`: when asking
    again may succeed, where that is known (answered as Retry-After)."""
    if deleted:
        queue().forget_live(deployment_name)
    return queue().fail_queued(deployment_name, reason=reason, kind=kind, retry_after_s=retry_after_s)


def last_requests(replica_ids: Iterable[str]) -> dict[str, datetime]:
    """When each replica last took a request, as Redis has it now: PostgreSQL's copy is made on
    the beat's schedule and only while the replica is awake (sync_last_accessed), so a replica put
    to sleep a moment after its last request keeps an older time there."""
    return {
        replica_id: datetime.fromtimestamp(last, tz=UTC)
        for replica_id, (_, last) in queue().activity(replica_ids).items()
        if last is not None
    }


def sync_last_accessed() -> int:
    """Copy replicas' last request times from Redis into PostgreSQL (for idle sleep and the API)."""
    replicas = list(Replica.objects.filter(state__in=AWAKE).values_list("id", "last_accessed"))
    if not replicas:
        return 0
    stamps = last_requests(replica_id for replica_id, _ in replicas)
    changed = 0
    for replica_id, known in replicas:
        seen = stamps.get(replica_id)
        if seen is None:
            continue
        if known is None or seen > known:
            Replica.objects.filter(pk=replica_id).update(last_accessed=seen)
            changed += 1
    return changed


def queue_depth(deployment_name: str) -> int:
    return queue().depth(deployment_name)
