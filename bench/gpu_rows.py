"""The table bench.gpu prints and its parts (bench.gpu_stack) add rows to: a row, its checks, and
figures written for people."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bench.report import table

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class Row:
    """One line of the table. `check` is "ok", "FAIL: why", "unverified: why", "not run: why", or ""
    for a figure that is reported, not judged."""

    part: str
    what: str
    figure: str = ""
    check: str = ""

    @property
    def failed(self) -> bool:
        return self.check.startswith("FAIL")


def ok_or_fail(condition: bool, why: str) -> str:
    return "ok" if condition else f"FAIL: {why}"


def fmt_size(n: int | float | None) -> str:
    """Bytes for people: GiB above one, MiB below, three significant decimals for GiB (the findings
    compare figures a few MiB apart). Exact bytes are in the raw JSON."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.3f} GiB"
    return f"{sign}{n / MiB:.1f} MiB"


def gbps(nbytes: int | float, seconds: float | None) -> float | None:
    """Decimal GB/s (as the findings and NVIDIA's bandwidth figures), None for no or zero time."""
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def fmt_gbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} GB/s"


def percent(part: float | None, whole: float | None) -> str:
    if part is None or not whole:
        return "n/a"
    return f"{100 * part / whole:.0f} %"


def _cell(text: object) -> str:
    # A "|" would split the cell and a newline would end the row.
    return " ".join(str(text).split()).replace("|", "\\|")


def render(rows: Iterable[Row]) -> str:
    """The markdown table: part, measure, figure, check."""
    return table(
        ["part", "measure", "figure", "check"],
        [[_cell(r.part), _cell(r.what), _cell(r.figure), _cell(r.check)] for r in rows],
    )


def nvml_vs(measured: int | None, reserved: int | None, what: str) -> tuple[str, str]:
    """(figure, check) for an NVML figure against a reservation."""
    if measured is None:
        return "NVML does not list the process", "unverified: no NVML figure for the process"
    if not reserved:
        return fmt_size(measured), ""
    diff = measured - reserved
    figure = f"{fmt_size(measured)} of {fmt_size(reserved)} reserved ({percent(measured, reserved)})"
    return figure, ok_or_fail(diff <= 0, f"{what} {fmt_size(diff)} above the reservation")
