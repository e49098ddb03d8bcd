"""Every benchmark in bench/, one after the other, each replacing its own section of BENCHMARKS.md
(with its machine, parameters and date: bench.report.record).

    python -m bench.run_all [--only name,name] [--quick]

One at a time on purpose: they measure speed, and two at once on a 2-core machine would measure
each other. A benchmark that fails is reported and the others still run; the exit status says
whether all of them passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.report import ROOT

# name → arguments; --quick trims the long ones (fewer seconds or trials), not what they measure.
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "commit_path": ([], ["--seconds", "1"]),
    "placement": ([], ["--seconds", "2"]),
    "request_overhead": ([], ["--requests", "100", "--wakes", "2"]),
    "failover": ([], ["--trials", "5", "--baseline-trials", "2"]),
    "self_healing": ([], ["--trials", "1"]),
    "recovery": (["--trials", "2"], ["--trials", "1"]),
    "kvpool": ([], []),
    "prefix_cache": ([], ["--trials", "1"]),
    "replica_start": ([], ["--starts", "3"]),
    "process_start": ([], ["--starts", "2"]),
    "serve": ([], ["--concurrency", "1,4", "--requests", "8"]),
    # The copies, then the host cache under pressure, in one run.
    "wake": (["--host-cache"], ["--repeats", "2", "--host-cache"]),
    "simulate": ([], []),
    "fleet": ([], ["--nodes", "10,100", "--duration", "20"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    parser.add_argument("--quick", action="store_true", help="shorter runs of the long benchmarks")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    failed = []
    for n, name in enumerate(names, 1):
        full, quick = BENCHMARKS[name]
        argv = [sys.executable, "-m", f"bench.{name}", *(quick if args.quick else full)]
        print(f"[{n}/{len(names)}] {' '.join(argv[1:])}", flush=True)
        began = time.monotonic()
        code = subprocess.run(argv, cwd=ROOT).returncode
        outcome = "ok" if code == 0 else f"FAILED ({code})"
        print(f"[{n}/{len(names)}] {name}: {outcome} in {time.monotonic() - began:.0f} s")
        if code != 0:
            failed.append(name)
    print(f"BENCHMARKS.md updated by {len(names) - len(failed)} of {len(names)} benchmark(s)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
