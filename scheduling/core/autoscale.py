"""The autoscaler's decision: how many replicas a deployment's load wants, and when a change of
that is acted on. Pure (no ORM, no Redis), so hypothesis can test it and the simulator could reuse it.

The load is the deployment's requests in flight: waiting in its queue, or taken by a replica and
not ended. It wants ceil(in flight / target) replicas, within the deployment's bounds. More
replicas are asked for at once: a queue that grows is felt by every request in it. Fewer only once
every sweep of the last `down_after_s` wanted fewer, and by the most any of them wanted: a
burst's lull must not stop the replicas the next burst needs, and a stopped replica costs a load
from disk (or a wake) to get back. Kubernetes' HPA calls this the scale-down stabilization window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A ratio this close above a whole number is that number: 7 in flight at 0.7 each is 10 replicas,
# though 7 / 0.7 is 10.000000000000002 in floating point.
_SLACK = 1e-9


@dataclass(frozen=True)
class Policy:
    """A deployment's autoscale settings (gpuportal.wire.deployment_spec, group `autoscale`)."""

    min_replicas: int
    max_replicas: int
    target_in_flight: float
    down_after_s: float


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    # Whether replicas may be woken or placed for it; a scale-down only stops what is awake
    # beyond its count (its replicas may have slept, idle, before its window ended).
    wake: bool = True


def wanted(in_flight: int, policy: Policy) -> int:
    """The replicas `in_flight` requests want, within the policy's bounds."""
    need = math.ceil(in_flight / policy.target_in_flight - _SLACK) if in_flight > 0 else 0
    return min(policy.max_replicas, max(policy.min_replicas, need))


def decide(
    current: int,
    in_flight: int,
    recent: Sequence[tuple[float, int]],
    now: float,
    policy: Policy,
    *,
    awake: int | None = None,
) -> Decision | None:
    """The replica count to set, and why; None to keep `current`. `recent`: (when, wanted) of the
    earlier sweeps, oldest first or not; only those of the last `down_after_s` count, and a
    scale-down waits until they reach back that far (after a restart of the sweeps, say). A
    deployment scaled to 0 is left there, as Kubernetes' HPA leaves a Deployment scaled to zero:
    that is how an operator stops one without forgetting its settings. `awake`: how many of its
    replicas are awake; where some are, and fewer than its requests in flight want (the others
    asleep, or short of room when it was woken), it is scaled to what they want, waking that
    many. With none awake it is left to the wake its requests started: a fair wake waits its
    max_wait for room, where a scale would evict at once."""
    if current == 0:
        return None
    now_wanted = wanted(in_flight, policy)
    load = f"{in_flight} request(s) in flight, {policy.target_in_flight:g} per replica wanted"
    if current < policy.min_replicas:
        return Decision(now_wanted, f"below autoscale.min_replicas ({load})")
    if current > policy.max_replicas:
        return Decision(policy.max_replicas, f"above autoscale.max_replicas ({load})", wake=False)
    if now_wanted > current:
        return Decision(now_wanted, load)
    if awake is not None and 0 < awake < now_wanted and in_flight:
        return Decision(now_wanted, f"{load}; {awake} of {current} awake")
    if now_wanted == current:
        return None
    since = now - policy.down_after_s
    if not any(when <= since for when, _ in recent) and policy.down_after_s > 0:
        return None  # the sweeps seen do not yet cover the window: it may have wanted more
    peak = max([now_wanted, *(count for when, count in recent if when > since)])
    if peak >= current:
        return None
    return Decision(peak, f"{load}; at most {peak} wanted for {policy.down_after_s:g} s", wake=False)
