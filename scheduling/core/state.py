"""Plain data the decision modules work on: a snapshot of GPUs in, a plan out.

No ORM here, on purpose: placement, fairness and memory are pure functions over these
dataclasses so hypothesis can test them and the simulator can run them on a simulated clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from gpuportal.wire.memory import H100_CONTEXT_BYTES, H100_STANDBY_CONTEXT_BYTES
from gpuportal.wire.states import NodeStatus


@dataclass(frozen=True)
class OccupantView:
    replica_id: str
    deployment: str
    state: str
    reserved_bytes: int
    since: datetime | None = None
    last_accessed: datetime | None = None
    serving_since: datetime | None = None
    dedicated: bool = False
    popular: bool = False
    min_runtime_s: float = 0.0
    # What fairness.choose_victim weighs against recency. The defaults mean "unknown"
    # and leave the victim order plain LRU, so a caller that does not know them loses nothing.
    # Seconds to bring the replica back onto a GPU once it has slept: its weights over the
    # host-to-device link. A cheap reload makes a cheap victim.
    reload_s: float | None = None
    # Requests it is serving at this instant (None: unknown, counted as possibly busy).
    in_flight: int | None = None
    # Its deployment's idle timeout: idle for longer, it is one the idle sweep may sleep anyway,
    # so preempting it costs no one anything and need not wait out max_wait (None: no timeout).
    idle_timeout_s: float | None = None


@dataclass(frozen=True)
class IntentView:
    id: int
    replica_id: str
    deployment: str
    needed_bytes: int
    deadline: datetime
    status: str


@dataclass(frozen=True)
class GPUView:
    """A GPU as decisions see it. `total_bytes` is what the portal may reserve there: what CUDA
    can allocate less what other tenants hold (`foreign_bytes`), so that no decision places into
    their memory; `available_bytes` is what of it no occupant reserves (0 when other tenants have
    reached into reserved memory)."""

    id: int
    node: str
    index: int
    total_bytes: int
    available_bytes: int
    version: int
    node_status: str = NodeStatus.ONLINE
    virtual: bool = False
    health: str = "ok"
    occupants: tuple[OccupantView, ...] = ()
    intents: tuple[IntentView, ...] = ()
    wake_lock_holder: str | None = None
    wake_lock_expires_at: datetime | None = None
    # What a CUDA context takes on this GPU, serving and standing by (measured per node and GPU
    # model); the H100's until measured.
    context_bytes: int = H100_CONTEXT_BYTES
    standby_context_bytes: int = H100_STANDBY_CONTEXT_BYTES
    # The node's row, for the services that write a placement (None in views built without one:
    # the simulator's, the tests').
    node_id: int | None = None
    # Other tenants' use (scheduling.models.GPU.foreign_bytes), already out of total_bytes.
    foreign_bytes: int = 0

    @property
    def label(self) -> str:
        return f"{self.node}/{self.index}"

    @property
    def reserved_bytes(self) -> int:
        return sum(o.reserved_bytes for o in self.occupants)


# Where a replica holds memory: (GPU, its occupant entry there), in GPU id order.
Holdings = tuple[tuple[GPUView, OccupantView], ...]


@dataclass(frozen=True)
class SnapshotIndex:
    """Lookups derived from a snapshot's GPUs, which every placement needs: the GPUs in id order,
    the usable ones by node, and where each replica holds memory.

    Built in one pass over the GPUs; or, by a ledger Mirror whose snapshot changed in a few GPUs
    only, from the previous index (`updated`), so that a placement over hundreds of nodes does
    not first walk all their GPUs again.
    """

    ordered: tuple[GPUView, ...]
    # Every GPU by node (id order), and the usable ones: healthy GPUs of online nodes.
    on_node: Mapping[str, tuple[GPUView, ...]]
    usable: Mapping[str, tuple[GPUView, ...]]
    # Nodes with no usable GPU, and why: the node's status, or its GPUs' health.
    unusable: Mapping[str, str]
    holdings: Mapping[str, Holdings]
    position: Mapping[int, int]  # GPU id -> its place in `ordered`
    # The largest serving and standby contexts among the GPUs, which a replica's need counts so
    # that it fits wherever it goes; the H100's when there is no GPU.
    contexts: tuple[int, int] = (H100_CONTEXT_BYTES, H100_STANDBY_CONTEXT_BYTES)
    # GPUs a wake holds the lock of (expired or not): what a placement may have to withhold,
    # without a walk of every GPU for each placement.
    wake_locked: frozenset[int] = frozenset()

    @classmethod
    def build(cls, gpus: Mapping[int, GPUView]) -> SnapshotIndex:
        # Sorted so that iteration order, and so a placement's random draws, depend only on the
        # snapshot's content.
        ids = sorted(gpus)
        ordered = [gpus[k] for k in ids]
        on_node: dict[str, list[GPUView]] = {}
        holdings: dict[str, list[tuple[GPUView, OccupantView]]] = {}
        for gpu in ordered:
            group = on_node.get(gpu.node)
            if group is None:
                on_node[gpu.node] = group = []
            group.append(gpu)
            if gpu.occupants:
                for o in gpu.occupants:
                    holdings.setdefault(o.replica_id, []).append((gpu, o))
        frozen_nodes = {node: tuple(group) for node, group in on_node.items()}
        usable, unusable = _usable(frozen_nodes)
        return cls(
            ordered=tuple(ordered),
            on_node=frozen_nodes,
            usable=usable,
            unusable=unusable,
            holdings={r: tuple(h) for r, h in holdings.items()},
            position=dict(zip(ids, range(len(ids)), strict=True)),
            contexts=_largest_contexts(ordered),
            wake_locked=frozenset(g.id for g in ordered if g.wake_lock_holder is not None),
        )

    def updated(self, changed: Iterable[GPUView]) -> SnapshotIndex | None:
        """This index with `changed` GPUs replaced (same ids, new views); None if one of them is
        new, which needs a full `build`. Costs what the changed GPUs hold, not the snapshot."""
        changed = list(changed)
        if not changed:
            return self
        if any(g.id not in self.position for g in changed):
            return None
        ordered = list(self.ordered)
        on_node = dict(self.on_node)
        holdings = dict(self.holdings)
        touched_nodes: dict[str, dict[int, GPUView]] = {}
        contexts: tuple[int, int] | None = self.contexts
        for gpu in changed:
            old = ordered[self.position[gpu.id]]
            if old.node != gpu.node:
                return None  # a GPU moved between nodes: not something to patch
            if (old.context_bytes, old.standby_context_bytes) != (gpu.context_bytes, gpu.standby_context_bytes):
                contexts = None  # rare (a context measured): found again over all GPUs below
            ordered[self.position[gpu.id]] = gpu
            touched_nodes.setdefault(gpu.node, {})[gpu.id] = gpu
            for o in old.occupants:
                kept = tuple(h for h in holdings.get(o.replica_id, ()) if h[0].id != gpu.id)
                if kept:
                    holdings[o.replica_id] = kept
                else:
                    holdings.pop(o.replica_id, None)
            for o in gpu.occupants:
                held = (*(h for h in holdings.get(o.replica_id, ()) if h[0].id != gpu.id), (gpu, o))
                holdings[o.replica_id] = tuple(sorted(held, key=lambda h: h[0].id))
        for node, replaced in touched_nodes.items():
            on_node[node] = tuple(replaced.get(g.id, g) for g in on_node[node])
        fresh_usable, fresh_unusable = _usable({n: on_node[n] for n in touched_nodes})
        if fresh_unusable or any(n not in self.usable for n in touched_nodes):
            # A node became usable or stopped being so (rare): rebuilt in on_node's order, as
            # `build` gives it, whichever nodes changed.
            usable = {
                n: fresh_usable[n] if n in touched_nodes else self.usable[n]
                for n in on_node
                if n in fresh_usable or (n not in touched_nodes and n in self.usable)
            }
            unusable = {n: why for n, why in self.unusable.items() if n not in touched_nodes} | fresh_unusable
        else:
            # The usual patch: usable nodes that stay usable keep their places (a dict keeps a
            # key's position when its value is replaced), so the walk over every node is spared.
            usable = dict(self.usable)
            usable.update(fresh_usable)
            unusable = self.unusable
        return SnapshotIndex(
            ordered=tuple(ordered),
            on_node=on_node,
            usable=usable,
            unusable=unusable,
            holdings=holdings,
            position=self.position,
            contexts=contexts if contexts is not None else _largest_contexts(ordered),
            wake_locked=(self.wake_locked - {g.id for g in changed})
            | {g.id for g in changed if g.wake_lock_holder is not None},
        )


def _largest_contexts(gpus: Iterable[GPUView]) -> tuple[int, int]:
    views = list(gpus)
    if not views:
        return H100_CONTEXT_BYTES, H100_STANDBY_CONTEXT_BYTES
    return max(g.context_bytes for g in views), max(g.standby_context_bytes for g in views)


def _usable(nodes: Mapping[str, tuple[GPUView, ...]]) -> tuple[dict[str, tuple[GPUView, ...]], dict[str, str]]:
    """The usable GPUs of each node (healthy, on an online node); and why a node has none."""
    usable: dict[str, tuple[GPUView, ...]] = {}
    unusable: dict[str, str] = {}
    for node, gpus in nodes.items():
        fit = [g for g in gpus if g.node_status == NodeStatus.ONLINE and g.health == "ok"]
        if fit:
            usable[node] = gpus if len(fit) == len(gpus) else tuple(fit)
        elif gpus[0].node_status != NodeStatus.ONLINE:
            unusable[node] = f"node is {gpus[0].node_status}"
        else:
            unusable[node] = "no healthy GPU (" + ", ".join(f"{g.label} {g.health}" for g in gpus) + ")"
    return usable, unusable


@dataclass(frozen=True)
class Snapshot:
    gpus: Mapping[int, GPUView]
    taken_at: datetime

    @cached_property
    def index(self) -> SnapshotIndex:
        """Built on first use (placement), kept with the snapshot; a `replace()` of the snapshot
        gets a fresh one, since a cached_property is not a field."""
        return SnapshotIndex.build(self.gpus)

    @classmethod
    def indexed(cls, gpus: Mapping[int, GPUView], taken_at: datetime, index: SnapshotIndex) -> Snapshot:
        """A snapshot with an index its caller kept up to date (a ledger Mirror): what
        `index` would build from these GPUs, without building it."""
        snapshot = cls(gpus=gpus, taken_at=taken_at)
        snapshot.__dict__["index"] = index  # where cached_property keeps its value
        return snapshot

    def on_node(self, node: str) -> list[GPUView]:
        return sorted((g for g in self.gpus.values() if g.node == node), key=lambda g: g.index)


@dataclass(frozen=True)
class Reservation:
    """Set `replica_id`'s reservation on `gpu_id` to `reserved_bytes` (creating the occupant)."""

    gpu_id: int
    replica_id: str
    reserved_bytes: int


@dataclass(frozen=True)
class Release:
    """Remove `replica_id`'s occupant from `gpu_id`."""

    gpu_id: int
    replica_id: str


@dataclass(frozen=True)
class Plan:
    """What to change, and the GPU versions the decision was made against.

    Only GPUs the plan writes are version-checked: another GPU changing meanwhile cannot make
    this plan over-commit, so it need not conflict.
    """

    reason: str
    expected_versions: Mapping[int, int]
    reservations: tuple[Reservation, ...] = ()
    releases: tuple[Release, ...] = ()
    labels: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def against(
        cls,
        snapshot: Snapshot,
        reason: str,
        reservations: Iterable[Reservation] = (),
        releases: Iterable[Release] = (),
    ) -> Plan:
        reservations, releases = tuple(reservations), tuple(releases)
        touched = {r.gpu_id for r in reservations} | {r.gpu_id for r in releases}
        unknown = touched - set(snapshot.gpus)
        if unknown:
            raise ValueError(f"plan touches GPUs not in the snapshot: {sorted(unknown)}")
        return cls(
            reason=reason,
            expected_versions={gpu_id: snapshot.gpus[gpu_id].version for gpu_id in touched},
            reservations=reservations,
            releases=releases,
            labels={gpu_id: snapshot.gpus[gpu_id].label for gpu_id in touched},
        )

    @property
    def gpu_ids(self) -> list[int]:
        return sorted(self.expected_versions)

    def validate(self) -> None:
        touched = {r.gpu_id for r in self.reservations} | {r.gpu_id for r in self.releases}
        if not touched <= set(self.expected_versions):
            missing = sorted(touched - set(self.expected_versions))
            raise ValueError(f"plan writes GPUs without an expected version: {missing}")
        for r in self.reservations:
            if r.reserved_bytes < 0:
                raise ValueError(f"negative reservation for replica {r.replica_id} on GPU {r.gpu_id}")
