"""`manage.py export_trace --since 7d > trace.csv`: the portal's recorded traffic as a trace file
(scheduling.simulation.traces documents the format), for `manage.py plan` or another portal."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from scheduling.services import traffic
from scheduling.simulation.traces import parse_since, write_trace


class Command(BaseCommand):
    help = "Write the requests the portal served as a trace file (CSV or JSON lines) on stdout."

    def add_arguments(self, parser):
        parser.add_argument("--since", default="7d", help="How far back: 7d, 12h, 30m, or an ISO 8601 time (7d).")
        parser.add_argument("--until", default=None, help="Up to (not including) this time; now by default.")
        parser.add_argument("--format", choices=("csv", "jsonl"), default="csv")
        parser.add_argument(
            "--catalogue", type=Path, default=None, help="Also write the deployments as a catalogue (JSON) here."
        )

    def handle(self, *args, since: str, until: str | None, format: str, catalogue: Path | None, **options):
        now = timezone.now()
        try:
            start = parse_since(since, now)
            end = parse_since(until, now) if until else None
        except ValueError as err:
            raise CommandError(str(err)) from None
        traffic.drain()  # requests that ended a moment ago are in the file too
        count = write_trace(traffic.trace_rows(start, end), self.stdout, fmt=format)
        left_out = traffic.skipped_count(start, end)
        if catalogue is not None:
            entries = [e.to_record() for e in traffic.live_catalogue()]
            catalogue.write_text(json.dumps({"deployments": entries}, indent=2) + "\n")
        note = f"{count} requests since {start.isoformat()}"
        if left_out:
            note += f"; {left_out} that ended without an answer (failed, cancelled) left out"
        self.stderr.write(note)
