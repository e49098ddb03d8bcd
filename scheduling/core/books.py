"""What the books make of what a node's agent saw on its GPUs (scheduling.services.books acts on
it): when a replica over its reservation, or a change of other tenants' use, is worth acting on,
and how far other tenants' use reaches into reserved memory. Pure: no database, no clock.

Figures read from NVML wobble by a few MiB from beat to beat (the allocator's rounding, a
library's workspace), and so does the virtual GPU's model of them within its rounding. The books
tolerate the larger of a floor (GPUPORTAL_BOOKS_TOLERANCE_BYTES, 16 MiB) and 1 % of the figure at
stake: below it the gauges still show every byte, but nothing is recorded or changed, so that
the Events say what matters rather than drown in it.
"""

from __future__ import annotations

# 1 % of the figure at stake: a share past which a difference is never noise.
TOLERANCE_SHARE = 100


def tolerance(reference_bytes: int, floor_bytes: int) -> int:
    """The difference the books let pass on a figure of `reference_bytes`."""
    return max(floor_bytes, max(0, reference_bytes) // TOLERANCE_SHARE)


def overcommit_matters(excess_bytes: int, reserved_bytes: int, floor_bytes: int) -> bool:
    """Whether a replica's processes holding `excess_bytes` more than their reservation of
    `reserved_bytes` is an over-commit to act on (an Event, a raised need, a grown reservation)."""
    return excess_bytes > tolerance(reserved_bytes, floor_bytes)


def foreign_to_record(recorded_bytes: int, seen_bytes: int, floor_bytes: int) -> int | None:
    """The figure of other tenants' use to record, when the agent saw `seen_bytes` and the books
    hold `recorded_bytes`; None to keep the books as they are. A change within the tolerance of
    the larger figure is noise; use that is gone is always recorded, so all of it comes back."""
    seen_bytes = max(0, seen_bytes)
    if seen_bytes == recorded_bytes:
        return None
    if seen_bytes == 0:
        return 0
    if abs(seen_bytes - recorded_bytes) > tolerance(max(seen_bytes, recorded_bytes), floor_bytes):
        return seen_bytes
    return None


def intrusion(total_bytes: int, foreign_bytes: int, reserved_bytes: int) -> int:
    """How far other tenants' use reaches into memory the portal's occupants reserve: bytes the
    books promised that NVML no longer has (0 when it fits beside them)."""
    return max(0, foreign_bytes + reserved_bytes - total_bytes)
