"""What a node agent reports to the control plane besides its replicas' own events: its GPUs
(DeviceInfo, at registration), what its replica processes hold (Books, every heartbeat), and the
processes its previous run left that it took over (Survivor). Shared by both planes; no
Django here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU as a node agent reports it: from NVML, or declared virtual.

    total_bytes is what CUDA can allocate, not NVML's total, which also counts what the driver
    keeps on an idle device: nvml_total_bytes records that one for the books' check.
    context_bytes and standby_context_bytes are the per-process CUDA context of a serving replica
    and of a standby on this GPU model; None where the agent has not measured one (a registration
    then keeps what the GPU row already holds, measured by its replicas, or the default).
    """

    index: int
    uuid: str
    product: str
    total_bytes: int
    virtual: bool
    nvml_total_bytes: int | None = None
    context_bytes: int | None = None
    standby_context_bytes: int | None = None


@dataclass(frozen=True)
class Books:
    """What a node agent saw of its GPUs at a heartbeat, to check the books against.

    usage: {replica id: {GPU index: bytes}}, NVML's per-process figures (or, on a virtual GPU,
    the replica's model of them); states: the state each replica was in as it last reported (a
    figure is compared only with the books of that state: a serving figure read just before a
    sleep is no over-commit of the sleeper); free_by_index: NVML's free bytes per GPU index, None
    where there is no NVML (a virtual GPU's free memory is derived from the usage instead).
    foreign_by_index: what other tenants hold per GPU index, processes that are not the node's
    replicas (NVML's used memory less the driver's reserve and what its replicas hold, or what a
    virtual GPU declares); a GPU missing from it, or None (an agent that does not say), keeps
    the figure the books hold. spare_by_index: of foreign_by_index, what the node's own warm
    spares hold or are held to per GPU index (inference.spare_pool): the portal's processes, but
    no replica's, shown apart from other tenants.
    """

    usage: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    states: Mapping[str, str] = field(default_factory=dict)
    free_by_index: Mapping[str, int] | None = None
    foreign_by_index: Mapping[str, int] | None = None
    spare_by_index: Mapping[str, int] | None = None


@dataclass(frozen=True)
class Survivor:
    replica_id: str
    pid: int
    # The state the process is in (inference.host.ReplicaHost.state: loading, serving, ...).
    state: str
    # The last state event it emitted (serving, woken or sleeping; None before any): which
    # transition its books may still be waiting for.
    last: str | None = None

    @classmethod
    def from_hello(cls, hello: dict[str, Any]) -> Survivor:
        last = hello.get("last")
        return cls(
            replica_id=str(hello["replica_id"]),
            pid=int(hello["pid"]),
            state=str(hello["state"]),
            last=str(last) if last else None,
        )
