"""The pure decisions' views built by hand, for the tests of placement, fairness and host RAM."""

from __future__ import annotations

from collections.abc import Iterable

from scheduling.core.state import GPUView, OccupantView

GiB = 1024**3


def gpu(gpu_id: int, occupants: Iterable[OccupantView] = (), *, total: int = 4 * GiB, node: str = "node1") -> GPUView:
    """A healthy GPU of an online node whose free memory is what its occupants leave."""
    occupants = tuple(occupants)
    return GPUView(
        id=gpu_id,
        node=node,
        index=gpu_id,
        total_bytes=total,
        available_bytes=total - sum(o.reserved_bytes for o in occupants),
        version=1,
        occupants=occupants,
    )
