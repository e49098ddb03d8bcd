"""When a refusal that young replicas cause will lift: the moments their `min_runtime` lapses,
and the first of them at which a decision succeeds. Pure.

A decision taken at a later moment finds more replicas past their min_runtime and nothing else
changed, so once it succeeds it succeeds at every later moment: the first moment is found by
bisection, a few decisions rather than one per young replica. What a refusal's `Retry-After`
says (fairness.room_at for a wake, planning.room_at for a placement)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta

from gpuportal.wire.states import ReplicaState
from scheduling.core.state import OccupantView


def lapses(occupants: Iterable[OccupantView], after: datetime) -> list[datetime]:
    """When each serving occupant's min_runtime lapses, after `after`, sorted and once each. A
    millisecond over the exact moment, so that rounding cannot leave it a hair inside."""
    return sorted(
        {
            at
            for o in occupants
            if o.state == ReplicaState.SERVING
            and o.serving_since is not None
            and o.min_runtime_s > 0
            and (at := o.serving_since + timedelta(seconds=o.min_runtime_s, milliseconds=1)) > after
        }
    )


def soonest(moments: Sequence[datetime], works: Callable[[datetime], bool]) -> datetime | None:
    """The first of `moments` (sorted) at which `works`, which once true stays true; None when it
    is true at none of them."""
    if not moments or not works(moments[-1]):
        return None
    low, high = 0, len(moments) - 1
    while low < high:
        middle = (low + high) // 2
        if works(moments[middle]):
            high = middle
        else:
            low = middle + 1
    return moments[low]


def seconds_until(now: datetime, at: datetime) -> int:
    """Whole seconds from `now` to `at`, at least 1: what a Retry-After header holds."""
    return max(1, math.ceil((at - now).total_seconds()))
