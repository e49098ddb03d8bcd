"""The autoscaler: every few seconds (beat's `autoscale deployments`), each deployment with
autoscale.max_replicas set is scaled to what its requests in flight want (scheduling.core.autoscale
decides). It writes `replicas` through the scaling service, as an operator's scale does, with an
Event saying why; an operator's scale of an autoscaled deployment holds until the next sweep.

What each sweep wanted is kept in Redis (`gp:autoscale:NAME`, a sorted set by time) for the
scale-down window: sweeps run on whichever control worker takes them, and a restarted one must
not forget a burst a minute old.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

import redis
from django.db.models import F

from gpuportal.wire.states import AWAKE, ENDED
from scheduling.core import autoscale
from scheduling.models import Deployment, Replica
from scheduling.services import queueing, scaling
from scheduling.services.errors import CannotPlace, ServiceError

log = logging.getLogger(__name__)

# What each sweep wanted is kept this much past the window, so that the sweep just before it is
# still there to show that the window is covered (sweeps come every 5 s; beat may lag).
_KEPT_PAST_WINDOW_S = 60.0


def history_key(deployment: str) -> str:
    return f"gp:autoscale:{deployment}"


# What the last sweep measured of each autoscaled deployment (a hash by name, of Load as JSON):
# what the API shows as a deployment's `autoscale.load`. Written whole by each sweep.
LAST_KEY = "gp:autoscale:last"


@dataclass(frozen=True)
class Load:
    """A deployment's load as a sweep measured it: its requests in flight, the replicas they want
    within its bounds, and when (unix seconds)."""

    in_flight: int
    wanted: int
    at: float


def last_loads() -> dict[str, Load]:
    """What the last sweep measured, by deployment (empty when Redis cannot say)."""
    try:
        raw = queueing.queue().redis.hgetall(LAST_KEY)
    except redis.RedisError as err:
        log.warning("autoscaler: cannot read the last sweep's loads (%s)", err)
        return {}
    return {name.decode(): Load(**json.loads(value)) for name, value in raw.items()}


def sweep(now: float | None = None) -> dict[str, int]:
    """Scale each autoscaled deployment to what its load wants: {name: the replicas set}, for
    those changed. One whose loads fail (failed, or retrying after its backoff) is left alone:
    more replicas would be more failed loads."""
    now = time.time() if now is None else now
    deployments = list(
        Deployment.objects.filter(
            autoscale_max_replicas__gt=0, observed__failed_reason="", observed__retry_at__isnull=True
        ).order_by("pk")
    )
    if not deployments:
        _forget_loads()
        return {}
    try:
        in_flight, awake = _load([d.name for d in deployments])
    except redis.RedisError as err:
        log.warning("autoscaler: cannot read the requests in flight (%s): no change this sweep", err)
        return {}
    policies = {d.name: policy for d in deployments if (policy := d.autoscale_policy) is not None}
    try:
        recent = _remember(queueing.queue().redis, now, in_flight, policies)
    except redis.RedisError as err:
        log.warning("autoscaler: cannot keep what the deployments wanted (%s): no change this sweep", err)
        return {}
    changed: dict[str, int] = {}
    for deployment in deployments:
        policy, load = policies[deployment.name], in_flight[deployment.name]
        decision = autoscale.decide(
            deployment.replicas_wanted, load, recent[deployment.name], now, policy, awake=awake[deployment.name]
        )
        if decision is None:
            continue
        try:
            changed[deployment.name] = _scale(deployment, decision)
        except ServiceError as err:
            # Deleted or scaled meanwhile, or no room even for one more: the next sweep asks again.
            log.warning("autoscaler: %s: %s", deployment.name, err)
    return changed


def _load(names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Per deployment, its requests waiting in its queue and those its replicas took and have not
    ended (two round trips to Redis for them all), and its replicas awake as a scale counts them
    (a failover pair's standby left out)."""
    replicas = list(
        Replica.objects.filter(deployment__name__in=names)
        .exclude(state__in=ENDED)
        .annotate(name=F("deployment__name"))
        .values_list("id", "name", "state", "role")
    )
    queue = queueing.queue()
    counts = dict(queue.depths(names))
    taken = queue.in_flight(replica_id for replica_id, *_ in replicas)
    awake = dict.fromkeys(names, 0)
    for replica_id, name, state, role in replicas:
        counts[name] += taken[replica_id]
        awake[name] += state in AWAKE and role != Replica.Role.STANDBY
    return counts, awake


def _remember(
    client: redis.Redis, now: float, in_flight: dict[str, int], policies: dict[str, autoscale.Policy]
) -> dict[str, list[tuple[float, int]]]:
    """For each deployment: keep what this sweep wanted, drop what is too old to matter, and read
    what earlier sweeps wanted; one round trip for them all."""
    wants = {name: autoscale.wanted(in_flight[name], policy) for name, policy in policies.items()}
    with client.pipeline(transaction=True) as pipe:
        for name, policy in policies.items():
            key, kept_s = history_key(name), policy.down_after_s + _KEPT_PAST_WINDOW_S
            pipe.zrangebyscore(key, now - kept_s, "+inf", withscores=True)
            pipe.zadd(key, {f"{now:.6f}:{wants[name]}": now})
            pipe.zremrangebyscore(key, "-inf", f"({now - kept_s}")
            pipe.expire(key, int(kept_s) + 1)
        # After the four replies of each deployment: what the API shows, the last sweep's alone.
        pipe.delete(LAST_KEY)
        loads = {name: Load(in_flight[name], wanted, now) for name, wanted in wants.items()}
        pipe.hset(LAST_KEY, mapping={name: json.dumps(asdict(load)) for name, load in loads.items()})
        replies = pipe.execute()
    # Four replies per deployment, the first of them the earlier sweeps' figures.
    return {
        name: [(when, int(member.decode().rpartition(":")[2])) for member, when in replies[4 * i]]
        for i, name in enumerate(policies)
    }


def _forget_loads() -> None:
    try:
        queueing.queue().redis.delete(LAST_KEY)
    except redis.RedisError as err:
        log.warning("autoscaler: cannot forget the last sweep's loads (%s)", err)


def _scale(deployment: Deployment, decision: autoscale.Decision) -> int:
    """Scale to the decision; a scale-up with no room for all it wants takes one more replica if
    that fits (the next sweep asks for the rest again)."""
    reason, current = f"autoscaled: {decision.reason}", deployment.replicas_wanted
    # `expected`: an operator's scale committed since the count was read is left as it is. A
    # scale-down stops what is awake beyond the count and wakes nothing (decision.wake): its
    # replicas may have fallen asleep, idle, before the window let it scale down.
    try:
        scaling.scale(deployment.name, decision.replicas, reason=reason, expected=current, wake=decision.wake)
        return decision.replicas
    except CannotPlace:
        one_more = current + 1
        if decision.replicas <= one_more:
            raise
    scaling.scale(deployment.name, one_more, reason=f"{reason}; room for one more only", expected=current)
    return one_more
