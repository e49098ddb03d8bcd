"""Which deployments' keys each node's own Redis user reaches (gpuportal.wire.node_acl). A user
the control plane keeps (made by `manage.py node_credential acl NAME --apply`) reaches the keys a
deployment's name opens (its queue, its live claims: node_acl.served_keys) only for the
deployments placed on its node: a node cannot read the ids, and so the requests, waiting for a
deployment it does not serve.

- A grant: before a replica's start is sent to its node (scheduling.services.dispatch), its
  deployment's keys are added to the node's user (ACL SETUSER with no reset: its password and
  other rules stay).
- A sweep (beat's `keep node users`, every minute): each kept user's keys set anew from the books
  (resetkeys and the whole list in one command): the deployments with a replica on the node that
  has not ended, and each for its drain and a minute past the last such replica, so that a
  process finishing what it took after its deployment was deleted (its rows forgotten at once)
  is not cut off. When it lasts until is kept in Redis (until_key), since sweeps run on whichever
  control worker takes them.

Both under one lock per node (scheduling.locks.node_user): without it a sweep that read the
books before a placement committed would drop the grant made after the commit.

A user loaded by hand from the line for every node (node_acl.setuser_line) reaches every
deployment's keys, and is left alone; so is every user when the control plane's own Redis user may
not administer the server."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis
from django.conf import settings

from gpuportal.wire import deployment_spec, node_acl, replies
from gpuportal.wire.requestqueue.protocol import queue_key
from gpuportal.wire.states import ENDED
from scheduling import events, locks
from scheduling.models import Deployment, Event, Node, Replica

log = logging.getLogger(__name__)

# A deployment's keys stay granted this long past the drain of its last replica on the node.
MARGIN_S = 60.0
_QUEUE_RULE = f"~{queue_key('')}"


def until_key(node: str) -> str:
    """By deployment, until when (unix seconds) node `node`'s user keeps its keys: the control
    plane's alone (no node's user reaches gp:acl:*)."""
    return f"gp:acl:{node}"


def _client() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def kept_rules(client: redis.Redis, node: str) -> list[str] | None:
    """The key rules of node `node`'s user when the control plane keeps it; None when the node has
    no user of its own, or one that reaches every deployment. Raises NoPermissionError when the
    control plane's user may not read users."""
    info = client.acl_getuser(node_acl.user_name(node))
    if info is None or node_acl.reaches_every_deployment(info["keys"]):
        return None
    return list(info["keys"])


def _reached(rules: Iterable[str]) -> set[str]:
    """The deployments whose keys these rules reach, by their queue's rule."""
    return {rule.removeprefix(_QUEUE_RULE) for rule in rules if rule.startswith(_QUEUE_RULE)}


def _drain_s(deployment: str) -> float:
    drain = Deployment.objects.filter(name=deployment).values_list("drain_timeout_s", flat=True).first()
    return drain if drain is not None else deployment_spec.BY_NAME["drain_timeout_s"].max


def _serving(node: str) -> dict[str, float]:
    """From the books: the deployments with a replica on the node that has not ended, and the
    drain of each."""
    rows = Replica.objects.filter(node__name=node).exclude(state__in=ENDED)
    return dict(rows.values_list("deployment__name", "deployment__drain_timeout_s").distinct())


def _lasting(client: redis.Redis, node: str, serving: dict[str, float], now: float) -> list[str]:
    """The deployments node `node`'s user is to reach: those it serves, and those whose time has
    not run out, which is renewed for those it serves (and the rest forgotten)."""
    until = {name.decode(): float(when) for name, when in client.hgetall(until_key(node)).items()}
    for deployment, drain_s in serving.items():
        until[deployment] = max(until.get(deployment, 0.0), now + drain_s + MARGIN_S)
    lasting = sorted(name for name, when in until.items() if when >= now)
    with client.pipeline(transaction=False) as pipe:
        if lasting:
            pipe.hset(until_key(node), mapping={name: until[name] for name in lasting})
        if lapsed := [name for name in until if name not in lasting]:
            pipe.hdel(until_key(node), *lapsed)
        pipe.execute()
    return lasting


def grant(node: str, deployment: str) -> bool:
    """Before a replica of `deployment` is started on `node`: the node's user reaches the
    deployment's keys. True when the control plane keeps the node's user (it reaches them now),
    False when it keeps none. Raises redis.RedisError when Redis refuses it or cannot be reached:
    the start is then not sent, and the node's heartbeat finds it lost (lost_commands)."""
    client = _client()
    with locks.node_user(node):
        try:
            rules = kept_rules(client, node)
        except redis.exceptions.NoPermissionError:
            return False  # it may not read users, so it made none to keep
        if rules is None:
            return False
        _lasting(client, node, {deployment: _drain_s(deployment)}, time.time())
        if missing := [rule for rule in (f"~{p}" for p in node_acl.served_keys(deployment)) if rule not in rules]:
            client.execute_command("ACL", "SETUSER", node_acl.user_name(node), *missing)
    return True


def make(node: str, password: str) -> list[str]:
    """Node `node`'s user made or made anew (its password replaced), kept by the control plane:
    reaching the keys of the deployments the books place on the node. Those deployments. Raises
    ValueError for a bad password, redis.RedisError when Redis refuses or cannot be reached."""
    line = node_acl.setuser_line(node, password, ())  # the password checked before anything is done
    client = _client()
    with locks.node_user(node):
        reaches = _lasting(client, node, _serving(node), time.time())
        line = node_acl.setuser_line(node, password, reaches)
        client.execute_command(*line.split())
    return reaches


def sweep(nodes: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Each kept user of the books' nodes (or of `nodes`) set to the deployments its node serves:
    by node, the deployments whose keys its user reached and no longer does, with an Event each."""
    client = _client()
    dropped: dict[str, list[str]] = {}
    for node in Node.objects.values_list("name", flat=True) if nodes is None else nodes:
        try:
            if gone := _sweep_one(client, node):
                dropped[node] = gone
        except redis.exceptions.NoPermissionError:
            log.debug("the control plane's Redis user may not read users: it keeps none")
            break
        except redis.RedisError as err:
            log.warning("node %s's Redis user not swept (%s): the next sweep tries again", node, err)
            break
    return dropped


def _sweep_one(client: redis.Redis, node: str) -> list[str]:
    with locks.node_user(node):
        rules = kept_rules(client, node)
        if rules is None:
            return []
        lasting = _lasting(client, node, _serving(node), time.time())
        wanted = node_acl.key_rules(node, lasting)
        if set(wanted) != set(rules):
            client.execute_command("ACL", "SETUSER", node_acl.user_name(node), "resetkeys", *wanted)
    gone = sorted(_reached(rules) - set(lasting))
    if gone:
        # Written now, not through the outbox (which sends starts through dispatch, which grants
        # through here): there is no other write for it to commit with.
        events.record(
            Event.Kind.NODE_CREDENTIAL,
            f"node {node}",
            f"its Redis user no longer reaches the queue of {', '.join(gone)}: no replica of "
            f"{'it' if len(gone) == 1 else 'them'} has been on the node for its drain and a minute",
            before={"deployments": sorted(_reached(rules))},
            after={"deployments": lasting},
            node=node,
        )
    return gone
