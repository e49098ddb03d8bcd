"""`python -m bench.simulate.seeds [--seeds 1-10] [--policies gpuportal-next,...] [--no-files] [--no-record]`:
the capacity planner on traces it was not tuned on: the standard config's synthetic trace
on every seed, and a production-like trace (scheduling.simulation.trace.production_like) written as
files and planned from them as `manage.py plan` does. Per run: the fewest GPUs of each policy for
99 %, the three bounds, the best of the project's policies over the tightest one, the deployments
that keep it short, and the planner's time per simulated hour. Records both tables in BENCHMARKS.md
(only a run of every policy; a subset, for iterating, needs --no-record)."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

from bench.report import record, table
from scheduling.simulation.config import DEFAULT_CONFIG, load
from scheduling.simulation.planner import Plan, plan
from scheduling.simulation.trace import generate, production_like
from scheduling.simulation.traces import (
    CatalogueEntry,
    TraceRow,
    build_trace,
    parse_catalogue,
    parse_trace,
    write_trace,
)

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "bench" / "results"
POLICIES = ("gpuportal", "gpuportal-wake", "gpuportal-next", "gpuportal-whole", "lru-fair", "dedicated", "oracle")
# The project's own policies: the ratio to the bound is the best of them.
OURS = ("gpuportal", "gpuportal-wake", "gpuportal-next", "gpuportal-whole")
# Whose misses at the bound's GPU count the table names: the newest of ours that was planned.
EXPLAIN = ("gpuportal-next", "gpuportal-wake", "gpuportal")
ADVISED = "advised: held ones popular"
BOUND_HEADERS = [
    "oracle bound",
    "bound with wakes",
    "bound in whole GPUs",
    "best gpuportal / bound",
    "held by the bound",
]


def headers(policies: tuple[str, ...]) -> list[str]:
    explained = next((p for p in EXPLAIN if p in policies), "-")
    return [
        "trace",
        "requests",
        *(p for p in policies if p != "oracle"),
        f"{explained}, {ADVISED}",
        f"{explained} holds from",
        *BOUND_HEADERS,
        f"short of the bound ({explained}'s misses at it)",
        "planner s per simulated h",
    ]


def _holds_from(p: Plan, policy: str | None) -> object:
    """Where the target holds from for `policy` (planner.PolicyPlan.holds_from)."""
    found = next((pp for pp in p.policies if pp.policy == policy), None)
    if found is None:
        return "-"
    return found.holds_from if found.holds_from is not None else f"> {p.max_gpus}"


def row(name: str, p: Plan, elapsed: float, policies: tuple[str, ...]) -> list[object]:
    fewest = {pp.policy: pp.fewest_gpus for pp in p.policies}
    advised = p.advice.plan.fewest_gpus if p.advice is not None else None
    # The advice is the portal too, with a setting its operator can make (planner.Advice).
    candidates = [fewest[k] for k in OURS if fewest.get(k) is not None] + ([advised] if advised is not None else [])
    ours = min(candidates, default=None)  # type: ignore[type-var]
    ratio = f"{ours / p.bound_gpus:.2f}" if ours is not None else "-"
    held = ", ".join(h.deployment for h in p.bound.held) or "-"
    short = ", ".join(f"{m.deployment} {m.missed} ({m.cause})" for m in p.misses_at_bound[:3]) or "-"
    return [
        name,
        p.requests,
        *(fewest[k] if fewest[k] is not None else f"> {p.max_gpus}" for k in policies if k != "oracle"),
        "-" if p.advice is None else advised if advised is not None else f"> {p.max_gpus}",
        _holds_from(p, next((k for k in EXPLAIN if k in policies), None)),
        p.bound.oracle_gpus,
        p.bound.load_aware_gpus,
        p.bound.packed_gpus,
        ratio,
        held,
        short,
        f"{elapsed / (p.duration_s / 3600):.1f}",
    ]


def production_files(seed: int) -> tuple[Path, Path]:
    """A production-like trace and its catalogue, as files (the planner reads them back)."""
    config = load()
    deployments, rows = production_like(config, seed=seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    trace, catalogue = RESULTS / f"production-like-{seed}.csv", RESULTS / f"production-like-{seed}.catalogue.json"
    out = io.StringIO()
    write_trace([TraceRow(0, 1.8e9 + t, d, p, o) for t, d, p, o in rows], out)
    trace.write_text(out.getvalue())
    entries = [CatalogueEntry(d.name, d.dtype, size=d.size, popular=d.popular).to_record() for d in deployments]
    catalogue.write_text(json.dumps({"deployments": entries}, indent=1) + "\n")
    return trace, catalogue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-10", help="a range (1-10) or a list (1,4,9)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"a comma-separated subset of {','.join(POLICIES)} (the oracle is always planned: it gives the bounds)",
    )
    parser.add_argument("--no-files", action="store_true", help="only the synthetic seeds, not the trace files")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    chosen = {p.strip() for p in args.policies.split(",") if p.strip()} | {"oracle"}
    unknown = sorted(chosen - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}: expected some of {list(POLICIES)}")
    policies = tuple(p for p in POLICIES if p in chosen)
    explain = next((p for p in EXPLAIN if p in policies), None)
    if args.no_record is False and (policies != POLICIES or args.no_files):
        parser.error("only a run of every policy on every trace is recorded: add --no-record")
    if "-" in args.seeds:
        first, last = map(int, args.seeds.split("-"))
        seeds = list(range(first, last + 1))
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[list[object]] = []
    for seed in seeds:
        config = load(seed=seed)
        began = time.perf_counter()
        p = plan(generate(config), config, policies=policies, explain=explain)
        rows.append(row(f"synthetic, seed {seed}", p, time.perf_counter() - began, policies))
        print(rows[-1], flush=True)
    file_rows: list[list[object]] = []
    for seed in () if args.no_files else (1, 2):
        trace, catalogue = production_files(seed)
        config = load()
        began = time.perf_counter()
        entries = parse_catalogue(catalogue.read_text(), name=catalogue.name)
        parsed = parse_trace(trace.read_text(), known={e.name for e in entries})
        for target in (0.99, 0.95):
            p = plan(
                build_trace(parsed.rows, entries, config), config, target=target, policies=policies, explain=explain
            )
            name = f"{trace.relative_to(ROOT)} at {100 * target:g} %"
            file_rows.append(row(name, p, time.perf_counter() - began, policies))
            began = time.perf_counter()
            print(file_rows[-1], flush=True)
    body = (
        f"`python -m bench.simulate.seeds`: the standard trace of `{DEFAULT_CONFIG.relative_to(ROOT)}` (64 "
        "deployments, 600 s, 8 nodes × 8 GPUs of 80 GiB, SLO 5 s to the first token, target 99 %) on every seed, "
        "then a production-like trace (48 deployments by Zipf s = 1.1, bursty Markov-modulated arrivals, "
        "log-normal prompt and output lengths; `scheduling.simulation.trace.production_like`) written as a CSV "
        "trace and a JSON catalogue and planned from those files. Fewest GPUs for the target per policy "
        "(`gpuportal-wake`: with `fairness.prefer_wake`; `gpuportal-next`: it with `fairness.sleep_when_idle`, "
        "no idle sleep on the timer for a replica whose wake misses its SLO, and `fairness.choose_whole_gpus` for "
        "the wakes that need whole GPUs, with its guards (victims whose wake misses the SLO last, no more victims "
        "than requests waiting), and `fairness.sleep_early`, idle replicas that wake within the SLO put to sleep "
        "once idle for max_wait, before their idle timeout, when their node has no room for a copy asleep there "
        "that would wake within it: what the live portal runs; `gpuportal-whole`: it with the first proposal of "
        "`choose_whole_gpus`, without the guards). Copies that fit nowhere at the start sleep on the nodes by "
        "their room, where they can wake (`engine.Simulation._park_on`); the oracle's bound, the tighter one "
        "counting the wakes (`planner.load_aware_bound`: the misses of those slower than the SLO, and the memory "
        "each burst's wake holds as its weights cross the bus, its requests served from the wake's end) and that "
        "working set counted in whole GPUs as placement packs it "
        "(`planner.packed_bound`); the planner's advice (`planner.Advice`): the explained policy searched again "
        "with the deployments the bound holds marked popular, a setting an operator can make ('-': the bound holds "
        f"none that is not popular already); where the target holds from for `{explain}`: from its fewest on, the "
        f"first count at which it holds at {load().search.steady_window} counts in a row (`metrics.holds_from`: "
        "attainment does not always grow with the count, so the fewest that reaches it can be followed by "
        "counts that do not); the best of ours (the advice included, the fewest that reach the target) over "
        "the tightest bound, "
        "which is a reference, not a floor (a policy may serve a request up to the SLO late and let the 1 % the "
        "target allows miss, which the bounds do not, so ours can come in under it); the deployments the bound "
        "holds in memory; the three deployments with the most misses when "
        f"`{explain}` runs on the bound's GPU count, and why; the planner's wall time (every policy's search) "
        "per simulated hour.\n\n" + table(headers(policies), rows)
    )
    if file_rows:
        body += "\n\nFrom trace files:\n\n" + table(headers(policies), file_rows)
    print(body)
    if not args.no_record:
        record("simulate-seeds", "Capacity planner: every seed, and a trace file", body)


if __name__ == "__main__":
    main()
