"""Pulling a Hugging Face model into nodes' caches ahead of a deploy (`gpuportal pull`,
`POST /api/models/pull/`): asked of each node's agent, which downloads it (inference.pull), and
followed through the progress each writes to Redis (gpuportal.wire.pulls). Nothing of it is in the
database: a pull is a long-running request, read back by its id until it ends and forgotten a day
after."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from gpuportal.wire import replies
from gpuportal.wire.pulls import (
    DONE,
    ENDED,
    FAILED,
    PULL_TTL_S,
    QUEUED,
    Pull,
    PullProgress,
    parse_model,
    progress_key,
    pull_key,
)
from scheduling.models import Node
from scheduling.services import dispatch
from scheduling.services.errors import InvalidInput, InvalidState, NotFound


@dataclass(frozen=True)
class PullState:
    pull: Pull
    nodes: dict[str, PullProgress]

    @property
    def state(self) -> str:
        """Done once every node is; failed once every node has ended and one failed; else the
        furthest a node got (queued, downloading)."""
        states = {p.state for p in self.nodes.values()}
        if states <= set(ENDED):
            return FAILED if FAILED in states else DONE
        return QUEUED if states == {QUEUED} else "downloading"


def start(model: str, *, node: str | None = None, by: str = "") -> PullState:
    """Ask `node` (else every online node) to fetch `model` (`org/name[@revision]`); InvalidInput
    for a name that is not a model's, NotFound for an unknown node, InvalidState when none is
    online to ask."""
    try:
        repo, revision = parse_model(model)
    except ValueError as err:
        raise InvalidInput("model", str(err)) from None
    nodes = _nodes(node)
    pull = Pull(uuid.uuid4().hex, repo, revision, tuple(nodes), by=by, at=time.time())
    queued = PullProgress(QUEUED)
    client = _client()
    with client.pipeline() as pipe:
        pipe.set(pull_key(pull.id), json.dumps(pull.record()), ex=PULL_TTL_S)
        for name in nodes:
            pipe.set(progress_key(pull.id, name), json.dumps(queued.record()), ex=PULL_TTL_S)
        pipe.execute()
    for name in nodes:
        dispatch.pull(name, pull.id, repo, revision, progress_key(pull.id, name))
    return PullState(pull, dict.fromkeys(nodes, queued))


def read(pull_id: str) -> PullState:
    client = _client()
    raw = client.get(pull_key(pull_id))
    if raw is None:
        raise NotFound(f"no pull {pull_id!r} (pulls are kept for {PULL_TTL_S // 3600} h)")
    pull = Pull.from_record(json.loads(raw))
    said = client.mget([progress_key(pull.id, name) for name in pull.nodes]) if pull.nodes else []
    nodes = {
        name: PullProgress.from_record(json.loads(raw)) if raw is not None else PullProgress(QUEUED)
        for name, raw in zip(pull.nodes, said, strict=True)
    }
    return PullState(pull, nodes)


# The nodes whose agent runs: a drained node takes no new replica, but its cache may be filled.
_UP = (Node.Status.ONLINE, Node.Status.DRAINING)


def _nodes(node: str | None) -> list[str]:
    if node is not None:
        status = Node.objects.filter(name=node).values_list("status", flat=True).first()
        if status is None:
            known = sorted(Node.objects.values_list("name", flat=True))
            raise NotFound(f"no node named {node!r} (nodes: {', '.join(known) or 'none registered'})")
        if status not in _UP:
            raise InvalidState(f"node {node} is {status}: its agent is not running to pull")
        return [node]
    up = sorted(Node.objects.filter(status__in=_UP).values_list("name", flat=True))
    if not up:
        raise InvalidState("no node is online to pull to: start a node agent")
    return up


def _client():
    return replies.client(settings.REDIS_URL)
