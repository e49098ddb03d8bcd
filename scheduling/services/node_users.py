"""Which deployments' keys each node's own Redis user reaches (gpuportal.wire.node_acl). A user
the control plane keeps (made by `manage.py node_credential acl NAME --apply`) reaches the keys a
deployment's name opens (its queue, its live claims: node_acl.served_keys) only for the
deployments placed on its node: a node cannot read the ids, and so the requests, waiting for a
deployment it does not serve.

- A grant (scheduling.services.queue_grants): before a replica's start is sent to its node
  (scheduling.services.dispatch), its deployment's keys are added to the node's user (ACL
  SETUSER with no reset: its password and other rules stay).
- A sweep (beat's `keep node users`, every minute): each kept user's keys set anew from the books
  (resetkeys and the whole list in one command): the deployments with a replica on the node that
  has not ended, and each for its drain and a minute past the last such replica, so that a
  process finishing what it took after its deployment was deleted (its rows forgotten at once)
  is not cut off. When it lasts until is kept in Redis (queue_grants.until_key), since sweeps run
  on whichever control worker takes them.

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
from django.db import transaction

from gpuportal.wire import node_acl
from gpuportal.wire.requestqueue.protocol import queue_key
from gpuportal.wire.states import ENDED
from scheduling import locks
from scheduling.models import Event, Node, Replica
from scheduling.services import outbox, queue_grants

log = logging.getLogger(__name__)

_QUEUE_RULE = f"~{queue_key('')}"


def _reached(rules: Iterable[str]) -> set[str]:
    """The deployments whose keys these rules reach, by their queue's rule."""
    return {rule.removeprefix(_QUEUE_RULE) for rule in rules if rule.startswith(_QUEUE_RULE)}


def _serving(node: str) -> dict[str, float]:
    """From the books: the deployments with a replica on the node that has not ended, and the
    drain of each."""
    rows = Replica.objects.filter(node__name=node).exclude(state__in=ENDED)
    return dict(rows.values_list("deployment__name", "deployment__drain_timeout_s").distinct())


def make(node: str, password: str) -> list[str]:
    """Node `node`'s user made or made anew (its password replaced), kept by the control plane:
    reaching the keys of the deployments the books place on the node. Those deployments. Raises
    ValueError for a bad password, redis.RedisError when Redis refuses or cannot be reached."""
    node_acl.setuser_line(node, password, ())  # the password checked before anything is done
    server = queue_grants.client()
    with locks.node_user(node):
        reaches = queue_grants.lasting(server, node, _serving(node), time.time())
        server.execute_command(*node_acl.setuser_line(node, password, reaches).split())
    return reaches


def sweep(nodes: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Each kept user of the books' nodes (or of `nodes`) set to the deployments its node serves:
    by node, the deployments whose keys its user reached and no longer does, with an Event each."""
    server = queue_grants.client()
    dropped: dict[str, list[str]] = {}
    try:
        users = {user.decode() if isinstance(user, bytes) else user for user in server.acl_users()}
    except redis.exceptions.NoPermissionError:
        log.debug("the control plane's Redis user may not read users: it keeps none")
        return dropped
    except redis.RedisError as err:
        log.warning("node users not swept (%s): the next sweep tries again", err)
        return dropped
    for node in Node.objects.values_list("name", flat=True) if nodes is None else nodes:
        if node_acl.user_name(node) not in users:
            continue  # no user of its own: nothing to keep (and no lock to take, in a fleet of many)
        try:
            if gone := _sweep_one(server, node):
                dropped[node] = gone
        except redis.exceptions.NoPermissionError:
            log.debug("the control plane's Redis user may not read users: it keeps none")
            break
        except redis.RedisError as err:
            log.warning("node %s's Redis user not swept (%s): the next sweep tries again", node, err)
            break
    return dropped


def _sweep_one(server: redis.Redis, node: str) -> list[str]:
    with locks.node_user(node):
        rules = queue_grants.kept_rules(server, node)
        if rules is None:
            return []
        lasting = queue_grants.lasting(server, node, _serving(node), time.time())
        wanted = node_acl.key_rules(node, lasting)
        if set(wanted) != set(rules):
            # resetkeys and the whole list in one command: the user is never without its own keys.
            server.execute_command("ACL", "SETUSER", node_acl.user_name(node), "resetkeys", *wanted)
    gone = sorted(_reached(rules) - set(lasting))
    if gone:
        with transaction.atomic():
            outbox.note(
                Event.Kind.NODE_CREDENTIAL,
                f"node {node}",
                f"its Redis user no longer reaches the queue of {', '.join(gone)}: no replica of "
                f"{'it' if len(gone) == 1 else 'them'} has been on the node for its drain and a minute",
                before={"deployments": sorted(_reached(rules))},
                after={"deployments": lasting},
                node=node,
            )
    return gone
