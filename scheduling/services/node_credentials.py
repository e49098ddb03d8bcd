"""Node credentials: each node's agent shows a token of its own with every call
(gpuportal.wire.node_auth), and the control plane applies a call only when the token is the one
issued to the node the call speaks for. Issued and revoked by an operator (the API, the admin,
`manage.py node_credential`); a revoked node is written off at once, as a node that went silent
is, and nothing it says is heard again.

GPUPORTAL_NODE_AUTH says what a node with no credential may do: `required`, nothing; `open`,
call without one. A node that has a credential must show it either way, and a revoked one is
always refused."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire import node_acl, node_auth
from scheduling import locks
from scheduling.core.effects import AfterCommit
from scheduling.models import Event, NodeCredential, Replica
from scheduling.services import node_users, nodes, outbox
from scheduling.services.errors import InvalidInput, InvalidState, NotFound, Unavailable

# last_used_at is written at most this often: every call of every node carries the token.
USED_EVERY = timedelta(minutes=1)
# A node whose calls keep being refused records it at most this often.
REFUSED_EVERY = timedelta(minutes=1)
REQUIRED, OPEN = "required", "open"


@dataclass(frozen=True)
class Refusal:
    """A call not applied: the node it spoke for (None: a replica the books do not know) and why."""

    node: str | None
    why: str

    def __str__(self) -> str:
        return node_auth.refusal(self.why)


def check_name(name: str) -> str:
    if (problem := node_auth.node_name_problem(name)) is not None:
        raise InvalidInput("node", problem)
    return name


def issue(name: str, by: str) -> str:
    """A new token for the node, which only the caller ever sees: its hash replaces the node's
    previous one (a revoked node is given a credential again this way), so the old token is
    refused from now on."""
    check_name(name)
    token = node_auth.new_token()
    now = timezone.now()
    with transaction.atomic():
        row = locks.lock_node_credential(name)
        before = None if row is None else {"revoked": row.revoked_at is not None, "issued": row.created_at.isoformat()}
        if row is None:
            row = NodeCredential(node=name)
        row.token_hash, row.created_at, row.created_by = node_auth.token_hash(token), now, by
        row.revoked_at = row.last_used_at = None
        row.save()
        outbox.note(
            Event.Kind.NODE_CREDENTIAL,
            f"node {name}",
            f"credential {'issued' if before is None else 'issued anew (the previous token is refused)'} by {by}",
            before=before,
            after={"revoked": False, "issued": now.isoformat()},
            node=name,
        )
    return token


def revoke(name: str, by: str, reason: str = "") -> NodeCredential:
    """The node's credential revoked: nothing its agent sends is applied any more, its own Redis
    user is deleted (nodes.drop_redis_user), and the node is written off now, its replicas lost and
    replaced elsewhere (nodes.mark_stopped, as when an agent stops), fenced first (its epoch raised
    and its lease dropped: nodes.fence_off), so that nothing its replicas still take, stream or
    answer is accepted and no sweep reads it as alive. NotFound when it has none, InvalidState when
    it is revoked already."""
    check_name(name)
    why = f"credential revoked by {by}" + (f": {reason}" if reason else "")
    with transaction.atomic():
        row = locks.lock_node_credential(name)
        if row is None:
            raise NotFound(f"node {name} has no credential")
        if row.revoked_at is not None:
            raise InvalidState(f"node {name}'s credential was revoked already, at {row.revoked_at.isoformat()}")
        row.revoked_at = timezone.now()
        row.save(update_fields=["revoked_at"])
        outbox.note(
            Event.Kind.NODE_REVOKED,
            f"node {name}",
            f"{why}: its calls are refused, its own Redis user (if it has one) deleted, and the node is "
            "written off with its replicas",
            before={"revoked": False},
            after={"revoked": True},
            node=name,
        )
        # Its Redis user first: until it is gone, the node's user could lower the epoch just raised.
        outbox.want(AfterCommit(f"fence node {name}", lambda: (nodes.drop_redis_user(name), nodes.fence_off(name))))
    # After the commit that refuses its calls: a heartbeat applied in between is undone here,
    # and one applied after this is caught by its own second look (node_gateway).
    nodes.mark_stopped(name, why, kind=Event.Kind.NODE_OFFLINE)
    return row


def make_redis_user(name: str, password: str, by: str) -> str:
    """Node `name`'s own Redis user (gpuportal.wire.node_acl), made or remade with these rules and
    password through the control plane's own connection, as revoking deletes it, and kept by the
    control plane from then on: it reaches the queues of the deployments placed on the node alone
    (scheduling.services.node_users). The REDIS_URL its agent is to be given. InvalidState when
    Redis refuses (the rules need Redis 7 or Valkey; making users needs @admin), naming how to do
    it by hand."""
    check_name(name)
    by_hand = f"an administrator of Redis runs the line `manage.py node_credential acl {name}` prints"
    try:
        reaches = node_users.make(name, password)
    except ValueError as err:
        raise InvalidInput("password", str(err)) from None
    except redis.exceptions.NoPermissionError as err:
        raise InvalidState(f"the control plane's Redis user may not make users ({err}): {by_hand}") from None
    except redis.ResponseError as err:
        raise InvalidState(
            f"Redis refused the node's rules ({err}): they need Redis "
            f"{'.'.join(map(str, node_acl.MIN_REDIS))} or later, or Valkey"
        ) from None
    except redis.RedisError as err:
        raise Unavailable(f"Redis cannot be reached to make node {name}'s user ({err})") from None
    with transaction.atomic():
        outbox.note(
            Event.Kind.NODE_CREDENTIAL,
            f"node {name}",
            f"its own Redis user {node_acl.user_name(name)} made by {by} (its previous password, if it had "
            "one, no longer signs in), reaching the queues of the deployments placed on it alone",
            after={"deployments": reaches},
            node=name,
        )
    return node_acl.node_url(settings.REDIS_URL, name, password)


def verify(name: str | None, token: str | None, *, now=None) -> str | None:
    """None when a call with `token` may speak for node `name`, else why not. `name` None: a
    replica the books do not know, for which any node's valid token will do (in `open` mode,
    none)."""
    if name is None:
        if token is None:
            return None if settings.GPUPORTAL_NODE_AUTH == OPEN else "the call carries no token"
        row = NodeCredential.objects.filter(token_hash=node_auth.token_hash(token), revoked_at__isnull=True).first()
        return None if row is not None else "its token is no node's valid credential"
    row = NodeCredential.objects.filter(node=name).first()
    if row is None:
        if settings.GPUPORTAL_NODE_AUTH == OPEN:
            return None
        return f"node {name} has no credential (GPUPORTAL_NODE_AUTH is required)"
    if row.revoked_at is not None:
        return f"node {name}'s credential was revoked at {row.revoked_at.isoformat()}"
    if token is None:
        return f"node {name} has a credential, and the call carries no token"
    if not hmac.compare_digest(row.token_hash, node_auth.token_hash(token)):
        return f"the call's token is not node {name}'s credential (wrong, or replaced by a newer one)"
    now = now or timezone.now()
    if row.last_used_at is None or row.last_used_at < now - USED_EVERY:
        NodeCredential.objects.filter(pk=row.pk).update(last_used_at=now)
    return None


def holds(name: str, token: str) -> bool:
    """Whether `token` is node `name`'s valid credential now (whatever GPUPORTAL_NODE_AUTH says)."""
    row = NodeCredential.objects.filter(node=name, revoked_at__isnull=True).first()
    return row is not None and hmac.compare_digest(row.token_hash, node_auth.token_hash(token))


def node_of_replica(replica_id: str) -> str | None:
    return Replica.objects.filter(pk=replica_id).values_list("node__name", flat=True).first()


def check_call(kind: str, subject: str, token: str | None) -> Refusal | None:
    """Whether a call (gpuportal.wire.control.speaks_for: a node or a replica) may be applied:
    None, or the Refusal, recorded as an Event when the node has replicas the books count on."""
    node = subject if kind == "node" else node_of_replica(subject)
    why = verify(node, token)
    if why is None:
        return None
    refusal = Refusal(node, why)
    if node is not None:
        note_refused(node, why)
    return refusal


def note_refused(node: str, why: str) -> None:
    """An Event, at most one per node a minute, when the refused node has replicas the books count
    on: an operator sees which node is no longer heard, and why, before its replicas are lost."""
    now = timezone.now()
    live = Replica.objects.filter(node__name=node).exclude(state__in=(Replica.State.STOPPED, Replica.State.FAILED))
    if not live.exists():
        return
    if Event.objects.filter(kind=Event.Kind.NODE_REFUSED, node=node, time__gte=now - REFUSED_EVERY).exists():
        return
    with transaction.atomic():
        outbox.note(
            Event.Kind.NODE_REFUSED,
            f"node {node}",
            f"a call of its agent was refused: {why}",
            after={"replicas": live.count()},
            node=node,
        )


def revoked(name: str) -> bool:
    return NodeCredential.objects.filter(node=name, revoked_at__isnull=False).exists()


def write_off_again(name: str) -> None:
    """A call that brings a node online (a registration, a heartbeat) was applied while its
    revocation committed: the node goes back offline, with whatever the call brought back."""
    reason = "its credential was revoked while its agent's call was applied"
    nodes.mark_stopped(name, reason, kind=Event.Kind.NODE_OFFLINE)
