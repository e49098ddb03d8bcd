"""`manage.py plan trace.csv [--catalogue file] [--target 0.99] [--slo 5]`: how many GPUs the
trace needs (scheduling.simulation.planner), as a table, and a plot with --plot."""

from __future__ import annotations

import argparse
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from scheduling.services import capacity
from scheduling.simulation.planner import DEFAULT_POLICIES, render
from scheduling.simulation.policies import ALL as POLICIES
from scheduling.simulation.traces import TraceFileError, parse_catalogue, sniff_format


class Command(BaseCommand):
    help = (
        "Plan capacity for a trace file: per policy, the fewest GPUs reaching the target attainment, the "
        "attainment with the GPUs the portal has now, the bounds, and who misses the SLO and why."
    )

    def add_arguments(self, parser):
        parser.add_argument("trace", type=Path, help="A trace file (CSV or JSON lines), e.g. from export_trace.")
        parser.add_argument(
            "--catalogue", type=Path, default=None, help="Deployments (JSON or TOML); the portal's own by default."
        )
        parser.add_argument("--target", type=float, default=None, help="Share of requests within the SLO (0.99).")
        parser.add_argument("--slo", type=float, default=None, help="Seconds to the first token (5).")
        parser.add_argument("--gpus", type=int, default=None, help="GPUs now; the portal's count by default.")
        parser.add_argument("--gpu-memory-gib", type=float, default=None, help="The GPU kind to plan for.")
        parser.add_argument(
            "--warm-spares",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Plan with (or without) a warm spare on every GPU; by default as the portal's GPUs run.",
        )
        parser.add_argument(
            "--policy", action="append", choices=sorted(POLICIES), help=f"Repeatable; {', '.join(DEFAULT_POLICIES)}."
        )
        parser.add_argument("--skip-bad", action="store_true", help="Skip rows that are not requests, listing them.")
        parser.add_argument("--plot", type=Path, default=None, help="Write the attainment plot (PNG) here.")

    def handle(self, *args, **o):
        try:
            text = o["trace"].read_text()
            catalogue = None
            if o["catalogue"] is not None:
                catalogue = parse_catalogue(o["catalogue"].read_text(), name=o["catalogue"].name)
            inputs = capacity.prepare(
                trace_text=text,
                fmt=sniff_format(text, o["trace"].name),
                catalogue=catalogue,
                skip_bad=o["skip_bad"],
                gpu_memory_gib=o["gpu_memory_gib"],
                current_gpus=o["gpus"],
                warm_spares=o["warm_spares"],
            )
            plan, elapsed = capacity.compute(
                inputs, target=o["target"], slo_ttft_s=o["slo"], policies=tuple(o["policy"] or DEFAULT_POLICIES)
            )
        except (OSError, TraceFileError, ValueError) as err:
            raise CommandError(str(err)) from None
        for error in inputs.skipped:
            self.stderr.write(f"skipped {error}")
        self.stdout.write(render(plan))
        hours = plan.duration_s / 3600
        self.stdout.write(
            f"Planned in {elapsed:.1f} s ({plan.simulations} simulations; {elapsed / hours:.1f} s per simulated hour)."
        )
        if o["plot"] is not None:
            from scheduling.simulation.planner import plot

            o["plot"].write_bytes(plot(plan))
            self.stdout.write(f"Plot: {o['plot']}")
