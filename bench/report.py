"""Shared by the benchmarks: print a table, and replace the benchmark's own section of BENCHMARKS.md."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def record(name: str, title: str, body: str) -> None:
    """Write `body` under `## title` in BENCHMARKS.md, replacing what the last run of `name` wrote."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n## {title}\n\n_Run {dt.date.today().isoformat()} on {machine()}._\n\n{body.strip()}\n{end}"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n\nRecorded by the scripts in `bench/`.\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    BENCHMARKS.write_text(text)
