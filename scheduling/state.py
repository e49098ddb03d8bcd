"""Plain data the decision modules work on: a snapshot of GPUs in, a plan out.

No ORM here, on purpose: placement, fairness and memory are pure functions over these
dataclasses so hypothesis can test them and the simulator can run them on a simulated clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime


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
    # What fairness.choose_victim weighs against recency (issue 9). The defaults mean "unknown"
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
    id: int
    node: str
    index: int
    total_bytes: int
    available_bytes: int
    version: int
    node_status: str = "online"
    virtual: bool = False
    health: str = "ok"
    occupants: tuple[OccupantView, ...] = ()
    intents: tuple[IntentView, ...] = ()
    wake_lock_holder: str | None = None
    wake_lock_expires_at: datetime | None = None

    @property
    def label(self) -> str:
        return f"{self.node}/{self.index}"

    @property
    def reserved_bytes(self) -> int:
        return sum(o.reserved_bytes for o in self.occupants)


@dataclass(frozen=True)
class Snapshot:
    gpus: Mapping[int, GPUView]
    taken_at: datetime

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


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU as a node agent reports it: from NVML, or declared virtual."""

    index: int
    uuid: str
    product: str
    total_bytes: int
    virtual: bool
