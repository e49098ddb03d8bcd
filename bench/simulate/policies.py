"""The policies compared: scheduling.simulation.policies."""

from scheduling.simulation.policies import DEDICATED, GPUPORTAL, LRU_FAIR, NDIF, ORACLE, POLICIES, SimPolicy

__all__ = ["DEDICATED", "GPUPORTAL", "LRU_FAIR", "NDIF", "ORACLE", "POLICIES", "SimPolicy"]
