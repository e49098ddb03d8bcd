"""What a run measured: scheduling.simulation.metrics."""

from scheduling.simulation.metrics import Summary, fewest_gpus, percentile, summarize

__all__ = ["Summary", "fewest_gpus", "percentile", "summarize"]
