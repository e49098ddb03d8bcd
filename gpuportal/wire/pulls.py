"""Pulling a Hugging Face model into a node's cache: asked of a node by the control plane (or
`gpuportal pull`), done by its agent with huggingface_hub, and followed through the progress the
node writes to Redis. A long-running request: the API answers at once with the pull's id, and each
node's progress is read from its key until it is done or failed. Django-free.

The control plane sends a PullModel to the node's own queue; the node SETs its PullProgress on
`progress_key` (a `gp:reply:` key, which its Redis user may write) as bytes arrive, and once more
when it is done or failed. The pull itself (its model and nodes) is kept beside them under
`pull_key`, so a pull is read whole from Redis, and forgotten after PULL_TTL_S."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from gpuportal.wire.commands import VERSION, WireError, decode_as

PULL_TASK = "inference.tasks.pull_model"
# How long a pull's record and progress stay readable after their last change.
PULL_TTL_S = 24 * 3600

# A Hugging Face model name (org/name), as users of vLLM and Ollama type one, with an optional
# revision (a branch, a tag or a commit): `org/name@rev`, `hf:org/name`. The hub's oldest models
# have no org (`gpt2`, `distilgpt2`, `t5-small`) and it still serves them by those names, so a
# name alone is one too.
HUB_PREFIX = "hf:"
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_REVISION = re.compile(r"^[\w./-]{1,100}$")

# A node's progress states, in order; the last two end it.
QUEUED, DOWNLOADING, DONE, FAILED = "queued", "downloading", "done", "failed"
STATES = (QUEUED, DOWNLOADING, DONE, FAILED)
ENDED = (DONE, FAILED)


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a Hugging Face model name, org/name or a name alone."""
    return bool(_REPO_ID.match(text))


def parse_model(text: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `[org/]name[@revision]` or `hf:[org/]name[@revision]`;
    ValueError naming what is wrong."""
    name = text.strip().removeprefix(HUB_PREFIX)
    repo, _, revision = name.partition("@")
    if not _REPO_ID.match(repo):
        raise ValueError(
            f"{text!r} is not a Hugging Face model name: write org/name (e.g. Qwen/Qwen2.5-0.5B-Instruct, "
            "or a name alone as gpt2), optionally @revision"
        )
    if "@" in name and not _REVISION.match(revision):
        raise ValueError(f"{text!r}: the revision after @ must be a branch, tag or commit (letters, digits, ._/-)")
    return repo, revision or None


def pull_key(pull_id: str) -> str:
    return f"gp:pull:{pull_id}"


def progress_key(pull_id: str, node: str) -> str:
    return f"gp:reply:pull:{pull_id}:{node}"


@dataclass(frozen=True)
class PullModel:
    pull_id: str
    repo: str
    revision: str | None
    progress_key: str

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, **asdict(self)}

    @classmethod
    def decode(cls, payload: Any) -> PullModel:
        return decode_as(cls, payload, "a pull")


@dataclass(frozen=True)
class PullProgress:
    """One node's pull as it last said: `done_bytes` of `total_bytes` written to its cache (the
    total is 0 until the hub has said it), where the snapshot is once done, why it failed."""

    state: str = QUEUED
    done_bytes: int = 0
    total_bytes: int = 0
    path: str = ""
    error: str = ""
    files: int = 0

    @property
    def percent(self) -> int:
        if self.state == DONE:
            return 100
        if self.total_bytes <= 0:
            return 0
        return min(99, self.done_bytes * 100 // self.total_bytes)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "percent": self.percent}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PullProgress:
        # Its fields, without what record() derives from them (percent).
        known = {f.name: record[f.name] for f in fields(cls) if f.name in record}
        try:
            return cls(**known)
        except TypeError as err:
            raise WireError(f"a pull's progress with bad fields: {err}") from None


@dataclass(frozen=True)
class Pull:
    """What was asked: the model, the nodes it goes to, who asked and when (seconds since the epoch)."""

    id: str
    repo: str
    revision: str | None
    nodes: tuple[str, ...]
    by: str = ""
    at: float = 0.0

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Pull:
        return cls(**{**record, "nodes": tuple(record.get("nodes") or ())})
