"""`python -m bench.simulate [--config path] [--seed N] [--quick] [--no-record]`: every policy on
the same synthetic trace; prints the table and records it in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.report import record, table
from bench.simulate.config import DEFAULT_CONFIG, Config, load
from bench.simulate.run import HEADERS, PolicyReport, curve_rows, rows, run_all
from bench.simulate.trace import Trace, generate

ROOT = Path(__file__).resolve().parent.parent.parent
PLOT = ROOT / "bench" / "results" / "attainment.png"
# GPU counts of the equal-GPU comparison, as shares of the configured cluster.
CURVE_SHARES = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 1)


def curve_counts(config: Config) -> list[int]:
    return sorted({max(1, round(share * config.cluster.gpus)) for share in CURVE_SHARES})


def report(config: Config, config_path: Path, trace: Trace, plot_path: Path) -> str:
    reports = run_all(config, trace)
    counts = curve_counts(config)
    main = table(HEADERS, rows(reports, config.search.max_gpus))
    curve = table(["policy", *(f"{g} GPUs" for g in counts)], curve_rows(config, trace, reports, counts))
    tc, cc, sv = config.trace, config.cluster, config.serving
    summary = (
        f"`python -m bench.simulate --config {config_path.name} --seed {config.seed}`: {tc.deployments} deployments "
        f"({', '.join(tc.sizes)}; fp16/bf16), {len(trace.requests)} requests over {tc.duration_s:g} s "
        f"({tc.total_rate_per_s:g}/s, Zipf s={tc.zipf_s:g}, Gamma inter-arrivals with CV {tc.arrival_cv:g}, "
        f"{tc.popular} popular); {cc.nodes} nodes × {cc.gpus_per_node} GPUs of {cc.gpu_memory_gib:g} GiB; "
        f"SLO: first token within {sv.slo_ttft_s:g} s; min_runtime {sv.min_runtime_s:g} s, max_wait "
        f"{sv.max_wait_s:g} s, idle timeout {sv.idle_timeout_s:g} s."
    )
    plot = plot_attainment(reports, plot_path)
    return (
        f"{summary}\n\nAt {cc.gpus} GPUs; last column: the fewest GPUs reaching "
        f"{100 * config.search.target_attainment:g} % attainment (bisection up to {config.search.max_gpus}; the "
        "oracle's is ⌈peak working set / GPU memory⌉).\n\n"
        f"{main}\n\nAttainment at equal GPU counts:\n\n{curve}\n\n"
        f"![Attainment against GPU count per policy]({plot.relative_to(ROOT) if plot.is_relative_to(ROOT) else plot})\n"
    )


def plot_attainment(reports: list[PolicyReport], path: Path) -> Path:
    """Attainment against GPU count, a line per policy, from every count the search tried."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r in reports:
        counts = sorted(r.curve)
        axes.plot(counts, [100 * r.curve[g] for g in counts], marker="o", markersize=3, label=r.summary.policy)
    axes.set_xlabel("GPUs")
    axes.set_ylabel("SLO attainment (%)")
    axes.set_xscale("log", base=2)
    axes.axhline(99, color="grey", linewidth=0.8, linestyle="--")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    parser.add_argument("--quick", action="store_true", help="the small trace of the config's [quick] table")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    config = load(args.config, quick=args.quick, seed=args.seed)
    began = time.perf_counter()
    trace = generate(config)
    recording = not args.no_record and not args.quick
    # Only a recorded run replaces the plot BENCHMARKS.md shows; others draw theirs in /tmp.
    plot_path = PLOT if recording else Path(tempfile.gettempdir()) / "gpuportal-attainment.png"
    body = report(config, args.config, trace, plot_path)
    elapsed = time.perf_counter() - began
    body += f"\nWhole run (trace, every policy, every search): {elapsed:.1f} s.\n"
    print(body)
    if recording:
        record("simulate", "Simulator: every policy on the same trace", body)


if __name__ == "__main__":
    main()
