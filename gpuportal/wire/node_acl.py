"""A node's Redis ACL user: the rules that confine an agent (and the replica processes it starts,
which inherit its REDIS_URL) to what a node does in Redis, for an operator to load with
`ACL SETUSER` (`manage.py node_credential acl NAME` prints the line). Django-free.

What a node does there: it consumes its own Celery queue, sends calls to the `agents` queue
(whose worker runs nothing else: gpuportal.broker), blocks on its own answer lists and answers
the control plane's questions (a model's files, a replica's log), renews its lease, and its
replicas serve the request queues. What the rules cannot tell apart, since the keys are not per node:

- Celery's and kombu's shared keys: `_kombu.binding.*` (read by every sender), task results
  (`celery-task-meta-*`) and Pub/Sub channels. No worker takes remote control
  (CELERY_WORKER_ENABLE_REMOTE_CONTROL), so what a node publishes there reaches no one. A node's
  worker keeps its unacknowledged messages in keys of its own (unacked_keys), not kombu's shared
  `unacked`: the control plane's workers put what is there back on the queue it names, any queue.
- The answers a node pushes (`gp:reply:*`): it may write to any asker's list, so a hostile node
  could answer a question put to another.
- The request keys: every replica of a deployment, on whichever node, writes the same request
  keys, so a node may read and answer any request whose id it learns. It learns ids only from
  the keys a deployment's name opens (its queue, its live claims: served_keys), and those a
  node's user reaches only for the deployments placed on it, when the control plane keeps its
  user (scheduling.services.node_users: granted before a replica's start is sent, swept back to
  the books). The indexes of the requests by owner and the records of those the web ends, which
  hold their ids, are the web's alone, and each node's replicas write the records of theirs to a
  list of the node's own. What a replica's or a failover pair's id names (its processing list
  and the asks to stop what it holds, its fence) is reached by any node's user, but those ids
  are random and held by the keys above.

The rules are the confinement of an honest node's mistakes and a hostile node's reach into the
control plane's own keys (other nodes' queues and leases, the admission and idempotency keys, the
server's configuration); the credential (gpuportal.wire.node_auth) is what the control plane
believes."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import quote, urlsplit, urlunsplit

from gpuportal.wire.commands import node_queue
from gpuportal.wire.control import AGENT_QUEUE
from gpuportal.wire.node_auth import node_name_problem
from gpuportal.wire.node_lease import epoch_key, lease_key
from gpuportal.wire.requestqueue.protocol import deleted_key, live_key, queue_key, records_key

# What follows a queue's name in kombu's keys for its priorities (a separator that is no node
# name's character, then the priority): the queue's own keys, not a longer-named queue's. The
# '-' comes first: Redis's glob reads "_-]" as a range from '_' to ']', which left the class
# unclosed and the priorities' keys refused.
_QUEUE_SUFFIX = "[^-A-Za-z0-9_]*"
# The keys a replica process reads and writes as it serves (gpuportal.wire.requestqueue,
# gpuportal.wire.kvstats), shared by every replica of a deployment: those named by a request's,
# a replica's or a pair's random id, and the portal's counts.
REPLICA_KEYS = (
    "gp:proc:*",
    "gp:req:*",
    "gp:done:*",
    "gp:stream:*",
    "gp:last:*",
    "gp:finished:*",
    "gp:epoch:*",
    "gp:off:*",
    "gp:kv:*",
)
# Not the web's: the indexes of every owner's requests (`gp:requests:*`, whose ids would open
# every request's key) and the owners' limits (`gp:user:*`). No replica reads or writes them.
# Commands: everything a client of kombu, Celery's result backend and the request-queue scripts
# uses, none of the server's administration (CONFIG, DEBUG, SHUTDOWN, ...) nor what reads or
# drops every key (KEYS, FLUSHALL, FLUSHDB, SCAN would list others' keys).
COMMANDS = ("+@all", "-@admin", "-@dangerous", "-scan", "-swapdb", "-move")


# Read-only and write-only key patterns (%R~, %W~) came with Redis 7: an older server refuses the
# rules whole (docs/operating.md says so).
MIN_REDIS = (7, 0)


def served_keys(deployment: str) -> tuple[str, ...]:
    """The key patterns a deployment's name opens, which its replicas read and write as they serve:
    its queue (every waiting request's id), its live claims and its deleted mark. "*": every
    deployment's. Deployment names are slugs, so no name is a pattern of its own."""
    return queue_key(deployment), live_key(deployment, "*"), deleted_key(deployment)


# A user that reaches every deployment's keys: one loaded by hand from `setuser_line`, which
# nothing keeps in step with placement. A user the control plane keeps reaches those of the
# deployments it names alone (scheduling.services.node_users).
EVERY_DEPLOYMENT = "*"


def user_name(node: str) -> str:
    return f"node-{node}"


def unacked_keys(node: str) -> dict[str, str]:
    """Kombu's transport options for node `node`'s worker: where it keeps the messages it took
    and has not acknowledged, and the lock of putting them back (kombu's default is one `unacked`
    hash that every consumer shares, and that its consumers put back on whichever queue an entry
    names)."""
    return {
        "unacked_key": f"unacked.node.{node}",
        "unacked_index_key": f"unacked_index.node.{node}",
        "unacked_mutex_key": f"unacked_mutex.node.{node}",
    }


def rules(node: str, serves: Iterable[str] = (EVERY_DEPLOYMENT,)) -> list[str]:
    """The ACL rules of node `node`'s user, less its password, one rule per item, reaching the keys
    of the deployments `serves` names (every deployment's by default)."""
    return ["reset", "on", *key_rules(node, serves), "&*", *COMMANDS]


def key_rules(node: str, serves: Iterable[str] = (EVERY_DEPLOYMENT,)) -> list[str]:
    """The key patterns of node `node`'s user (`~` rules, `%R~`/`%W~` for one way), those of the
    deployments it serves last, in the order of `serves`."""
    if (problem := node_name_problem(node)) is not None:
        raise ValueError(problem)
    own = node_queue(node)
    keys = [
        # Its own queue, the only one it consumes (read and written by kombu's moves). None that
        # another node may write to: a node's worker runs what the control plane sends it.
        f"~{own}",
        f"~{own}{_QUEUE_SUFFIX}",
        f"~_kombu.binding.{own}",
        # Kombu's mark (5.7 on) that its binding never expires, written with the binding.
        f"~_kombu.binding_permanent.{own}",
        # Its worker's unacknowledged messages (unacked_keys), not the control plane's.
        *(f"~{key}" for key in unacked_keys(node).values()),
        "~celery-task-meta-*",
        # Calls to the control plane: pushed, never read.
        f"%W~{AGENT_QUEUE}",
        f"%W~{AGENT_QUEUE}{_QUEUE_SUFFIX}",
        "%R~_kombu.binding.*",
        # Its answers (inference.gateway names them after the node), and those it gives.
        f"~gp:reply:agent:{node}:*",
        "%W~gp:reply:*",
        f"~{lease_key(node)}",
        # Its epoch, which its renewals and its replicas' scripts read. Whole, not read-only: Redis
        # checks a script's keys for both. So a node's own user could lower it and lift its own
        # fence: a node written off for good (revoked) loses its user too (ACL DELUSER, done by
        # scheduling.services.nodes.drop_redis_user before the epoch is raised).
        f"~{epoch_key(node)}",
        *(f"~{pattern}" for pattern in REPLICA_KEYS),
        # The records of the requests its replicas end: its own list, not every node's (a record
        # holds its request's id, which opens the request's key).
        f"~{records_key(node)}",
    ]
    return keys + [f"~{pattern}" for deployment in serves for pattern in served_keys(deployment)]


def reaches_every_deployment(key_patterns: Iterable[str]) -> bool:
    """Whether a user with these key patterns (as ACL GETUSER lists them) reaches every
    deployment's queue: one loaded from the line for every node, not one the control plane keeps."""
    return f"~{queue_key(EVERY_DEPLOYMENT)}" in key_patterns


def setuser_line(node: str, password: str, serves: Iterable[str] = (EVERY_DEPLOYMENT,)) -> str:
    """The `ACL SETUSER` command for redis-cli, with the user's password."""
    if not password or any(c.isspace() for c in password):
        raise ValueError("the password must be a non-empty word")
    reset, on, *rest = rules(node, serves)
    return " ".join(["ACL", "SETUSER", user_name(node), reset, on, f">{password}", *rest])


def node_url(control_url: str, node: str, password: str) -> str:
    """The REDIS_URL of node `node`'s agent: the control plane's server, database and options
    (TLS's among them), signed in as the node's own user."""
    parts = urlsplit(control_url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, bracketed again
    where = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=f"{quote(user_name(node), safe='')}:{quote(password, safe='')}@{where}"))
