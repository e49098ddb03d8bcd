"""The one gateway from a node agent to the control plane (issue 17): everything an agent tells
the control plane, and the one thing it asks. The agent holds an implementation it is given at
start-up (scheduling.services.node_gateway, put together by `manage.py agent` in gpuportal), so
the data plane never imports the control plane. Django-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor


class ControlPlane(Protocol):
    def register_node(
        self,
        node: str,
        devices: Sequence[DeviceInfo],
        *,
        hostname: str,
        cpu_cache_bytes: int,
        virtual: bool,
        survivors: Sequence[Survivor],
    ) -> None:
        """The node is up with these GPUs; of the survivors, the control plane keeps those whose
        books agree (issue 16) and loses the rest, which the next heartbeat names."""

    def heartbeat(self, node: str, *, books: Books | None, running: Sequence[str]) -> list[str]:
        """The node is alive; returns the running replicas the control plane has written off,
        for the agent to stop."""

    def node_stopping(self, node: str, reason: str) -> None:
        """Out of placement: the agent is leaving and stops its replicas next."""

    def node_stopped(self, node: str, reason: str) -> None: ...

    def report(self, replica_id: str, event: dict[str, Any]) -> None:
        """One event of a replica process, in the order it emitted them (one caller per replica)."""

    def replica_state(self, replica_id: str) -> str | None:
        """The replica's state in the books (None: it is gone): a command that waited in the queue
        is carried out only if the replica still waits for it."""
