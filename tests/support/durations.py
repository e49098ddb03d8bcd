"""How long each test file took in a whole run, kept in tests/durations.json, so that `make test`
hands the longest files out first (tests/conftest.py calls it).

Three processes take whole files (--dist loadfile) as each finishes one: a long file handed out
last runs alone at the end while the others sit idle, so the longest go first, and the many
short ones fill in behind. Recorded with `make durations` (a whole run with --record-durations);
a file it has not seen yet goes first, as if it were the longest, until the next recording.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DURATIONS_FILE = ROOT / "tests" / "durations.json"


def recorded() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS_FILE.read_text()).items()}
    except (FileNotFoundError, ValueError):
        return {}


def order(items: list[pytest.Item], durations: dict[str, float]) -> None:
    """Slow files (those starting processes) first, then the rest; longest first within each."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    unseen = max(durations.values(), default=0.0) + 1

    def key(item: pytest.Item) -> tuple[bool, float, str]:
        name = _relative(item.path)
        return (item.path not in slow, -durations.get(name, unseen), name)

    items.sort(key=key)  # stable: a file's own tests keep their order


def _relative(path: Path) -> str:
    return str(Path(path).resolve().relative_to(ROOT))


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each test file's total time in this run to tests/durations.json",
    )


class Recorder:
    """Sums every phase's time per file, as the reports reach the controlling process."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.seconds:
            durations = {name: round(s, 1) for name, s in sorted(self.seconds.items())}
            DURATIONS_FILE.write_text(json.dumps(durations, indent=1) + "\n")


def configure(config: pytest.Config) -> None:
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(), "durations_recorder")
