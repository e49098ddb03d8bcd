"""The simulator's deployments, requests and synthetic traces: scheduling.simulation.trace."""

from scheduling.simulation.trace import SHAPES, Architecture, Deployment, Request, Trace, estimate_bytes, generate

__all__ = ["SHAPES", "Architecture", "Deployment", "Request", "Trace", "estimate_bytes", "generate"]
