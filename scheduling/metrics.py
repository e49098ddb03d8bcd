"""Prometheus series the control plane counts. Scrape-time gauges of the state live in
gpuportal.metrics; counters here are incremented where the thing happens, in any process
(multiprocess mode aggregates them when PROMETHEUS_MULTIPROC_DIR is set, as `up` does)."""

from prometheus_client import Counter

CAS_CONFLICTS = Counter(
    "gpuportal_cas_conflicts_total",
    "Plans whose GPU versions changed between snapshot and commit (retried from a fresh snapshot).",
)
COMMITS = Counter("gpuportal_commits_total", "Plans committed through the ledger.")
