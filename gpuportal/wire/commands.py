"""What the control plane asks of a node agent: start, sleep, wake or stop a replica,
or let it keep (or make it drop) a host arena while awake.

Each command is a frozen dataclass, sent as a versioned dict on the node's Celery queue
(`node.<name>`) and read back with `decode`, which refuses a version or kind it does not know
instead of guessing. A START carries the whole ReplicaSpec, so the agent acts on what it was
told and never reads the Replica row. Django-free: the agent and the replica import it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

# Raised whenever a field is added, renamed or given a new meaning: an agent of another version
# refuses the command (and the control plane's books show the replica never started) rather
# than act on half of it.
VERSION = 1

BACKENDS = ("virtual", "cuda")
# The id names the replica's log file: keep it to characters that are safe in a path.
_REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class WireError(ValueError):
    """A command this side cannot read: another version, an unknown kind, or a bad field."""


M = TypeVar("M")


def decode_as(kind: type[M], payload: Any, what: str) -> M:
    """A versioned message of this contract (a dataclass encoded as its fields and `v`) read back
    as `kind`; WireError naming `what` (e.g. "an inspection") when it cannot be."""
    if not isinstance(payload, dict):
        raise WireError(f"{what} is a JSON object, not {type(payload).__name__}")
    if payload.get("v") != VERSION:
        raise WireError(f"{what} of version {payload.get('v')!r} is not this agent's ({VERSION}): upgrade one side")
    try:
        return kind(**{k: v for k, v in payload.items() if k != "v"})
    except TypeError as err:
        raise WireError(f"{what} with bad fields: {err}") from None


def node_queue(node: str) -> str:
    """The Celery queue a node's agent consumes."""
    return f"node.{node}"


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its model, where it runs and under which cap. Built by the control plane
    from its books (scheduling.services.replica_specs); the agent adds only what is local to it
    (the Redis URL it reaches)."""

    replica_id: str
    source: str
    loader: str
    dtype: str
    gpus: tuple[int, ...]
    reserved_bytes_by_gpu: dict[str, int]
    fraction: float | None = None
    backend: str = "virtual"
    # The request queue it serves; empty in tests of the process layer alone.
    deployment: str = ""
    redis_url: str = ""
    # A failover pair member (seed 004): its lease, the pair's name (its lock on the node, its
    # result fence), its initial role, and its timeouts.
    failover_lease: int | None = None
    failover_fence: str = ""
    role: str = "primary"
    wake_timeout_s: float = 60.0
    # An active member silent for this long is hung: the agent kills it, which passes the lock.
    liveness_timeout_s: float = 3.0
    # Sizing the KV block pool with the scheduler's formula: the deployment's max_tokens
    # (the activation budget) and the CUDA context the reservation counts; None: the replica's default.
    kv_max_tokens: int | None = None
    context_bytes: int = 0
    # A failover pair's reservation also holds its standby's context: never the pool's.
    standby_context_bytes: int = 0
    # Seconds the replica outlives its agent waiting to be adopted; 0: it dies with the agent.
    adoption_window_s: float = 0.0
    # A wake from deep sleep: the weights come from the host copy its node keeps of them
    # (inference.host_copy), not from `source`, which still gives the model's shape and tokenizer.
    from_host_copy: bool = False
    # The deployment's LoRA adapters, `name=source,...` (gpuportal.wire.adapters); "" none.
    adapters: str = ""
    # Whose requests share its prefix cache (gpuportal.wire.prefix_cache.MODES).
    prefix_cache: str = "user"

    def __post_init__(self) -> None:
        if not _REPLICA_ID.match(self.replica_id):
            raise ValueError(f"replica id {self.replica_id!r} must be letters, digits, '.', '_' or '-'")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} (known: {', '.join(BACKENDS)})")
        # Accept a list from JSON, keep a tuple: the spec is a value, shared between threads.
        object.__setattr__(self, "gpus", tuple(self.gpus))
        if not self.gpus:
            raise ValueError("a replica needs at least one GPU id")

    def record(self) -> dict[str, Any]:
        """The spec as plain data: what is written beside a replica's log for the next agent, and
        what travels on the queue (the agent adds its own Redis URL)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"gpus": list(self.gpus)}


@dataclass(frozen=True)
class StartReplica:
    kind: ClassVar[str] = "start"
    spec: ReplicaSpec
    # Replicas evicted to make room: the agent waits until their processes have let go of the
    # memory (they run on the same node, since they share its GPUs).
    wait_for: tuple[str, ...] = ()

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id


@dataclass(frozen=True)
class SleepReplica:
    kind: ClassVar[str] = "sleep"
    replica_id: str
    # The deployment's drain; None: the replica's own default.
    drain_timeout_s: float | None = None


@dataclass(frozen=True)
class WakeReplica:
    kind: ClassVar[str] = "wake"
    replica_id: str
    gpus: tuple[int, ...]
    reserved_bytes_by_gpu: dict[str, int]
    fraction: float | None = None
    wait_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopReplica:
    kind: ClassVar[str] = "stop"
    replica_id: str
    drain_timeout_s: float | None = None
    # A failover member whose pair stops whole: the agent closes the pair's lock before the stop,
    # so its partner never takes over (inference.failover). Added to version 1 with a default.
    close_pair: bool = False


@dataclass(frozen=True)
class DeepenReplica:
    """Sleep deeply: the sleeping replica writes its weights to its node's host copy
    (inference.host_copy), says `deep_sleeping` and exits, leaving no GPU memory held."""

    kind: ClassVar[str] = "deepen"
    replica_id: str


@dataclass(frozen=True)
class KeepArena:
    """Whether the replica may keep a host arena of its weights while awake: with
    `keep`, an awake replica holds one ready (page-locked in advance on a GPU) and a wake keeps
    the one it woke from, so its next sleep copies into memory already pinned instead of
    allocating and pinning gigabytes first; without, it frees the one it holds. The control
    plane grants it only within the node's host cache budget, and counts it there."""

    kind: ClassVar[str] = "arena"
    replica_id: str
    keep: bool


Command = StartReplica | SleepReplica | WakeReplica | StopReplica | KeepArena | DeepenReplica
KINDS: dict[str, type[Command]] = {
    c.kind: c for c in (StartReplica, SleepReplica, WakeReplica, StopReplica, KeepArena, DeepenReplica)
}
# The node task that runs each kind, by name: the control plane never imports the agent's tasks.
TASKS = {
    "start": "inference.tasks.start_replica",
    "sleep": "inference.tasks.replica_to_cache",
    "wake": "inference.tasks.replica_from_cache",
    "stop": "inference.tasks.stop_replica",
    "arena": "inference.tasks.replica_arena",
    "deepen": "inference.tasks.replica_deepen",
}


def encode(command: Command) -> dict[str, Any]:
    body = asdict(command)
    if isinstance(command, StartReplica):
        body["spec"] = command.spec.record()
    for key in ("wait_for", "gpus"):
        if key in body:
            body[key] = list(body[key])
    return {"v": VERSION, "kind": command.kind, **body}


def decode(payload: Any) -> Command:
    if not isinstance(payload, dict):
        raise WireError(f"a command is a JSON object, not {type(payload).__name__}")
    if payload.get("v") != VERSION:
        raise WireError(f"command version {payload.get('v')!r} is not this agent's ({VERSION}): upgrade one side")
    kind = KINDS.get(payload.get("kind"))  # type: ignore[arg-type]
    if kind is None:
        raise WireError(f"unknown command kind {payload.get('kind')!r} (known: {', '.join(KINDS)})")
    body = {k: v for k, v in payload.items() if k not in ("v", "kind")}
    try:
        if kind is StartReplica:
            body["spec"] = ReplicaSpec(**body["spec"])
        for key in ("wait_for", "gpus"):
            if key in body:
                body[key] = tuple(body[key])
        return kind(**body)
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"a {kind.kind} command with bad fields: {err}") from None


def brief(command: Command) -> list[Any]:
    """The replica a command is for and, for a start or a wake, whom it waits for, for an arena,
    whether it may keep one, for a stop, whether it closes its pair: how tests and logs name a command."""
    if isinstance(command, StartReplica | WakeReplica):
        return [command.replica_id, list(command.wait_for)]
    if isinstance(command, KeepArena):
        return [command.replica_id, command.keep]
    if isinstance(command, StopReplica) and command.close_pair:
        return [command.replica_id, "close pair"]
    return [command.replica_id]
