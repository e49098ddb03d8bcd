"""The simulator's parameters: scheduling.simulation.config (the planner's, in the product)."""

from scheduling.simulation.config import (
    DEFAULT_CONFIG,
    ClusterConfig,
    Config,
    HardwareConfig,
    SearchConfig,
    ServingConfig,
    TraceConfig,
    load,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ClusterConfig",
    "Config",
    "HardwareConfig",
    "SearchConfig",
    "ServingConfig",
    "TraceConfig",
    "load",
]
