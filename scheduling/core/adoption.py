"""Which replica processes a restarted node agent found still running the control plane keeps
(a restart restores what ran). Pure: the books' state of each replica and what its process says.

The books lead: the control plane records a transition (draining, waking, stopping) before it
sends the command, and the process's report completes it. So a process may be behind its row by
a command the old agent never delivered, or its row behind the process by a report the old agent
never relayed. The second is caught up by the resync the agent asks for (the process emits its
last state event again); the first cannot be, and such a process is stopped and replaced."""

from __future__ import annotations

from gpuportal.wire.node_reports import Survivor
from gpuportal.wire.states import PROCESS_STARTING
from gpuportal.wire.states import ReplicaState as S

PENDING, LOADING, SERVING, DRAINING = S.PENDING, S.LOADING, S.SERVING, S.DRAINING
SLEEPING, WAKING, STOPPING = S.SLEEPING, S.WAKING, S.STOPPING

# (what the process says it is in, the last state event it emitted) -> the books' states it
# agrees with. A process's states are the books' names, and `starting` before its load begins.
AGREES: dict[tuple[str, str | None], frozenset[str]] = {
    (PROCESS_STARTING, None): frozenset({PENDING, LOADING}),
    (LOADING, None): frozenset({PENDING, LOADING}),
    # Loaded: its `serving` report may be the one lost.
    (SERVING, "serving"): frozenset({PENDING, LOADING, SERVING}),
    # Woken: its `woken` report may be the one lost.
    (SERVING, "woken"): frozenset({WAKING, SERVING}),
    # A drain to sleep, or a stop, under way: its report comes when it is done.
    (DRAINING, "serving"): frozenset({DRAINING}),
    (DRAINING, "woken"): frozenset({DRAINING}),
    (STOPPING, "serving"): frozenset({STOPPING}),
    (STOPPING, "woken"): frozenset({STOPPING}),
    (STOPPING, "sleeping"): frozenset({STOPPING}),
    # Asleep: its `sleeping` report may be the one lost.
    (SLEEPING, "sleeping"): frozenset({DRAINING, SLEEPING}),
    (WAKING, "sleeping"): frozenset({WAKING}),
    # No process: a deep sleeper's host copy, found in the node's host memory (inference.host_copy).
    (S.DEEP_SLEEPING, S.DEEP_SLEEPING): frozenset({S.DEEP_SLEEPING}),
}


def keeps(row_state: str, survivor: Survivor) -> bool:
    """Whether a surviving process and its books agree closely enough to take it over."""
    return row_state in AGREES.get((survivor.state, survivor.last), frozenset())


def why_not(row_state: str, survivor: Survivor) -> str:
    return (
        f"its process says {survivor.state} (last reported {survivor.last or 'nothing'}) but its books say "
        f"{row_state}: a command or report was lost with the old agent"
    )
