"""What a node agent says of the replica processes its previous run left behind (issue 16:
restart restores): the agent takes them over and the control plane decides which it keeps.
Shared by both planes; no Django here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Survivor:
    replica_id: str
    pid: int
    # The state the process is in (inference.replica.ReplicaHost.state: loading, serving, ...).
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
