"""Run every policy on one trace: at the configured cluster, and searching the fewest GPUs that
reach the target attainment. Returns the rows of the report table."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduling.simulation.config import Config
from scheduling.simulation.engine import simulate
from scheduling.simulation.metrics import Summary, fewest_gpus, summarize
from scheduling.simulation.policies import POLICIES
from scheduling.simulation.trace import Trace, generate

HEADERS = [
    "policy",
    "attainment",
    "p50 wait s",
    "p99 wait s",
    "failed",
    "cold loads",
    "wakes",
    "preemptions",
    "mean GPU mem GiB",
    "mem in use",
    "GPUs for 99 %",
]


@dataclass(frozen=True)
class PolicyReport:
    summary: Summary  # at the configured cluster
    fewest_gpus: int | None  # for the target attainment; the oracle's is its working-set bound
    curve: dict[int, float]  # attainment at each GPU count the search tried


def run_all(
    config: Config, trace: Trace | None = None, policies: tuple[str, ...] = tuple(POLICIES)
) -> list[PolicyReport]:
    trace = trace if trace is not None else generate(config)
    slo, target = config.serving.slo_ttft_s, config.search.target_attainment
    reports = []
    for name in policies:
        policy = POLICIES[name]
        curve: dict[int, float] = {}

        def attainment_at(gpus: int, policy=policy, curve=curve) -> float:
            if gpus not in curve:
                curve[gpus] = summarize(simulate(trace, config, policy, gpus=gpus), slo).attainment
            return curve[gpus]

        summary = summarize(simulate(trace, config, policy), slo)
        curve[config.cluster.gpus] = summary.attainment
        if policy.unlimited:
            # Memory is unlimited for its latency; its GPU count is the least that holds the
            # working set (the deployments serving a request at once, at the busiest instant).
            needed = math.ceil(summary.peak_working_set_gib * 1024**3 / config.cluster.gpu_bytes)
            best = needed if summary.attainment >= target else None
        else:
            best = fewest_gpus(attainment_at, target, config.search.max_gpus)
        reports.append(PolicyReport(summary, best, dict(sorted(curve.items()))))
    return reports


def rows(reports: list[PolicyReport], max_gpus: int) -> list[list[object]]:
    out: list[list[object]] = []
    for r in reports:
        s = r.summary
        out.append(
            [
                s.policy,
                f"{100 * s.attainment:.2f} %",
                f"{s.p50_wait_s:.2f}",
                f"{s.p99_wait_s:.2f}",
                s.failed,
                s.cold_loads,
                s.wakes,
                s.preemptions,
                # The oracle has no GPUs to hold memory on: it is a bound, not a cluster.
                "n/a" if POLICIES[s.policy].unlimited else f"{s.mean_memory_gib:.0f}",
                "n/a" if POLICIES[s.policy].unlimited else f"{100 * s.mean_memory_share:.0f} %",
                r.fewest_gpus if r.fewest_gpus is not None else f"> {max_gpus}",
            ]
        )
    return out


def curve_rows(config: Config, trace: Trace, reports: list[PolicyReport], counts: list[int]) -> list[list[object]]:
    """Attainment of every policy at the same GPU counts (the comparison at equal GPUs)."""
    slo = config.serving.slo_ttft_s
    out: list[list[object]] = []
    for r in reports:
        policy = POLICIES[r.summary.policy]
        row: list[object] = [r.summary.policy]
        for gpus in counts:
            if gpus not in r.curve:
                r.curve[gpus] = summarize(simulate(trace, config, policy, gpus=gpus), slo).attainment
            row.append(f"{100 * r.curve[gpus]:.2f} %")
        out.append(row)
    return out
