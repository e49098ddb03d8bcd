"""A deployment's keys granted to a node's own Redis user before a replica of it starts there
(scheduling.services.dispatch calls grant before it sends the start), when the control plane keeps
that user (scheduling.services.node_users, which also sweeps what was granted back to the books).

What a grant lasts is kept in Redis (until_key): a deployment's keys stay granted for its drain and
a minute past the last time a grant or a sweep saw a replica of it on the node. A grant and a sweep
of the same node take the node's lock (scheduling.locks.node_user). Nothing here writes to the
database, so the outbox, which sends starts through dispatch, is not needed here."""

from __future__ import annotations

import time

import redis
from django.conf import settings

from gpuportal.wire import deployment_spec, node_acl, replies
from scheduling import locks
from scheduling.models import Deployment

# A deployment's keys stay granted this long past the drain of its last replica on the node.
MARGIN_S = 60.0


def until_key(node: str) -> str:
    """By deployment, until when (unix seconds) node `node`'s user keeps its keys: the control
    plane's alone (no node's user reaches gp:acl:*)."""
    return f"gp:acl:{node}"


def client() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def kept_rules(redis_client: redis.Redis, node: str) -> list[str] | None:
    """The key rules of node `node`'s user when the control plane keeps it; None when the node has
    no user of its own, or one that reaches every deployment. Raises NoPermissionError when the
    control plane's user may not read users."""
    info = redis_client.acl_getuser(node_acl.user_name(node))
    if info is None or node_acl.reaches_every_deployment(info["keys"]):
        return None
    return list(info["keys"])


def lasting(redis_client: redis.Redis, node: str, serving: dict[str, float], now: float) -> list[str]:
    """The deployments node `node`'s user is to reach: those it serves (by their drains), and those
    whose time has not run out. Renews the time of those it serves, and forgets the rest."""
    until = {name.decode(): float(when) for name, when in redis_client.hgetall(until_key(node)).items()}
    for deployment, drain_s in serving.items():
        until[deployment] = max(until.get(deployment, 0.0), now + drain_s + MARGIN_S)
    kept = sorted(name for name, when in until.items() if when >= now)
    with redis_client.pipeline(transaction=False) as pipe:
        if kept:
            pipe.hset(until_key(node), mapping={name: until[name] for name in kept})
        if lapsed := [name for name in until if name not in kept]:
            pipe.hdel(until_key(node), *lapsed)
        pipe.execute()
    return kept


def _drain_s(deployment: str) -> float:
    drain = Deployment.objects.filter(name=deployment).values_list("drain_timeout_s", flat=True).first()
    return drain if drain is not None else deployment_spec.BY_NAME["drain_timeout_s"].max


def grant(node: str, deployment: str) -> bool:
    """Before a replica of `deployment` is started on `node`: the node's user reaches the
    deployment's keys. True when the control plane keeps the node's user (it reaches them now),
    False when it keeps none. Raises redis.RedisError when Redis refuses it or cannot be reached:
    the start is then not sent, and the node's heartbeat finds it lost (lost_commands)."""
    server = client()
    with locks.node_user(node):
        try:
            rules = kept_rules(server, node)
        except redis.exceptions.NoPermissionError:
            return False  # it may not read users, so it made none to keep
        if rules is None:
            return False
        lasting(server, node, {deployment: _drain_s(deployment)}, time.time())
        if missing := [rule for rule in (f"~{p}" for p in node_acl.served_keys(deployment)) if rule not in rules]:
            server.execute_command("ACL", "SETUSER", node_acl.user_name(node), *missing)
    return True
