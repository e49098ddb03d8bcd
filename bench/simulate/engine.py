"""The simulator's engine: scheduling.simulation.engine (the planner runs it in the product)."""

from scheduling.simulation.engine import (
    DRAINING,
    LOADING,
    SERVING,
    SLEEPING,
    STOPPED,
    OverCommit,
    RequestOutcome,
    SimReplica,
    SimResult,
    Simulation,
    simulate,
)

__all__ = [
    "DRAINING",
    "LOADING",
    "SERVING",
    "SLEEPING",
    "STOPPED",
    "OverCommit",
    "RequestOutcome",
    "SimReplica",
    "SimResult",
    "Simulation",
    "simulate",
]
