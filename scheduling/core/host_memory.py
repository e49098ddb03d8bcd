"""Host RAM as a resource (pure): a node's RAM holds its host cache and its replicas' processes,
and a new replica's process must fit beside them.

The host cache's budget is counted whole, used or not: it is promised to sleeping weights, and
a process that took it would leave the next sleep with nowhere to go. A process counts what
it holds outside its host arena (the arena is the cache's), measured by its agent; one not yet
measured counts its deployment's figure, or the default, and so does each warm spare (a replica
process waiting to become the next one, which another replaces at once). A node whose agent
reported no RAM is not judged. Waking a sleeping replica starts no process, so only new replicas
are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from scheduling.core.placement import fmt_bytes


@dataclass(frozen=True)
class HostView:
    node: str
    ram_bytes: int  # what the node may use of its RAM, as its agent reported it; 0: unknown
    cache_budget_bytes: int  # the host cache's budget
    process_bytes: int  # its replicas' processes, outside their arenas
    processes: int
    # Its warm spares' processes: each the next replica's process, and another started in its place.
    spare_bytes: int = 0
    spares: int = 0

    @property
    def free_bytes(self) -> int:
        return self.ram_bytes - self.cache_budget_bytes - self.process_bytes - self.spare_bytes

    def with_process(self, need_bytes: int) -> HostView:
        """The host once a new replica's process of `need_bytes` runs there."""
        return replace(self, process_bytes=self.process_bytes + need_bytes, processes=self.processes + 1)


def refusal(host: HostView, need_bytes: int) -> str | None:
    """Why a new replica's process of `need_bytes` may not start on this host, naming the
    figures; None when it fits (or the host's RAM is unknown)."""
    if host.ram_bytes <= 0 or need_bytes <= host.free_bytes:
        return None
    return (
        f"host RAM: a new replica's process needs {fmt_bytes(need_bytes)}, and the host has "
        f"{fmt_bytes(max(0, host.free_bytes))} of its {fmt_bytes(host.ram_bytes)} left "
        f"(host cache budget {fmt_bytes(host.cache_budget_bytes)} + {host.processes} replica "
        f"process(es) {fmt_bytes(host.process_bytes)}"
        + (f" + {host.spares} warm spare(s) {fmt_bytes(host.spare_bytes)}" if host.spares else "")
        + ")"
    )


def refusals(hosts: Mapping[str, HostView], need_bytes: int) -> dict[str, str]:
    """{node: why} of the hosts a new replica's process of `need_bytes` may not start on."""
    return {node: why for node, host in hosts.items() if (why := refusal(host, need_bytes)) is not None}
