"""Every policy on one trace: scheduling.simulation.run."""

from scheduling.simulation.run import HEADERS, PolicyReport, curve_rows, rows, run_all

__all__ = ["HEADERS", "PolicyReport", "curve_rows", "rows", "run_all"]
