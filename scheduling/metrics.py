"""Prometheus series the control plane counts. Scrape-time gauges of the state live in
scheduling.gauges; counters here are incremented where the thing happens, in any process
(multiprocess mode aggregates them when PROMETHEUS_MULTIPROC_DIR is set, as `up` does)."""

from prometheus_client import Counter, Histogram

from gpuportal.wire.ownerlimits import CONCURRENT, PER_MINUTE

CAS_CONFLICTS = Counter(
    "gpuportal_cas_conflicts_total",
    "Plans whose GPU versions changed between snapshot and commit (retried from a fresh snapshot).",
)
COMMITS = Counter("gpuportal_commits_total", "Plans committed through the ledger.")

# The fair wake path (seed 001). Buckets reach minutes: a wake may wait out max_wait, then a
# victim's drain_timeout, then a load.
_WAIT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)

PREEMPTIONS = Counter(
    "gpuportal_preemptions_total",
    "Replicas put to sleep by the fair wake path to make room for a waking one.",
)
PREEMPTION_WAIT_SECONDS = Histogram(
    "gpuportal_preemption_wait_seconds",
    "From a preemption intent's creation to its outcome (placed, or failed).",
    buckets=_WAIT_BUCKETS,
)
WAKE_SECONDS = Histogram(
    "gpuportal_wake_seconds",
    "From a replica entering `waking` to its process reporting it serves again.",
    buckets=_WAIT_BUCKETS,
)
SLEEP_SECONDS = Histogram(
    "gpuportal_sleep_seconds",
    "From a replica entering `draining` to its process reporting it sleeps.",
    buckets=_WAIT_BUCKETS,
)

# Failover pairs (seed 004). Takeovers are fast (the target is 200 ms), so buckets start small.
FAILOVERS = Counter(
    "gpuportal_failovers_total",
    "Takeovers: a standby took its pair's lock and serves in place of the active member.",
    ["deployment"],
)
FAILOVER_SECONDS = Histogram(
    "gpuportal_failover_seconds",
    "From a standby's lock grant (its active member's session ended) to taking requests.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
)

# Requests. Per process: the web processes accept requests, so under `up`'s
# multiprocess mode the sum over processes is the portal's; completions happen in replica
# processes and are not counted here.
REQUESTS_ACCEPTED = Counter(
    "gpuportal_requests_accepted_total",
    "Requests accepted (queued, or waiting for a wake) by this portal's web processes.",
    ["deployment"],
)

# Per-user limits: requests refused with a 429, by the limit they would have passed.
# Never by user: labels must stay few.
REQUESTS_LIMITED = Counter(
    "gpuportal_requests_limited_total",
    "Requests refused with a 429 for passing their user's limit: requests in flight at once "
    "(concurrent) or accepted per minute (per_minute).",
    ["reason"],
)
for _reason in (CONCURRENT, PER_MINUTE):
    REQUESTS_LIMITED.labels(reason=_reason)  # shown at 0 before the first refusal
