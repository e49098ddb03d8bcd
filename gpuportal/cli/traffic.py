"""`gpuportal stats`: how each deployment's requests fared over a recent window (`GET
/api/traffic/`): how many ended and failed, latency percentiles, the wait for a replica, and the
tokens generated, a row a deployment."""

from __future__ import annotations

import argparse
import re
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuportal.cli.client import Client
from gpuportal.cli.options import JSON, add_output_option, print_json

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_WINDOW = "5m"
# P50, P95, P99: the latency, from acceptance to the answer; TTFT95 and WAIT95: the 95th
# percentiles of the time to the first token and of the wait for a replica. Narrow enough for 80
# columns.
COLUMNS = ("DEPLOYMENT", "ENDED", "FAILED", "P50", "P95", "P99", "TTFT95", "WAIT95", "TOK/S", "MS/TOK")


class Looker(Protocol):
    out: Console

    @property
    def client(self) -> Client: ...


def window(text: str) -> float:
    """An argparse type: seconds, or a number with s, m, h or d (`90`, `10m`, `1h`)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a length of time: {text!r} (e.g. 300, 10m, 1h, 7d)")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def cmd_stats(ctx: Looker, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"window_s": f"{args.window:g}"}
    if args.name:
        params["deployment"] = args.name
    found = ctx.client.get("/api/traffic/", params=params).get("results", [])
    if args.output == JSON:
        print_json(ctx.out, found)
        return 0
    if not found:
        ctx.out.print(
            f"no request to {args.name or 'any deployment'} ended in the last {args.window:g} s "
            "(or not recorded yet: records reach the portal's books within a minute)"
        )
        return 0
    ctx.out.print(stats_table(found))
    return 0


def stats_table(found: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "DEPLOYMENT" else "right")
    for row in found:
        latency, ttft, wait, per_token = (
            row.get(k) or {} for k in ("latency_s", "ttft_s", "queue_s", "per_output_token_s")
        )
        failed = row.get("failed", 0)
        table.add_row(
            Text(row["deployment"]),
            str(row.get("ended", 0)),
            Text(str(failed), style="red" if failed else ""),
            _seconds(latency.get("p50")),
            _seconds(latency.get("p95")),
            _seconds(latency.get("p99")),
            _seconds(ttft.get("p95")),
            _seconds(wait.get("p95")),
            f"{row.get('output_tokens_per_s', 0):.2f}",
            "-" if per_token.get("p50") is None else f"{1000 * per_token['p50']:.1f}",
        )
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def add_stats(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    stats = commands.add_parser(
        "stats",
        help="how each deployment's requests fared lately: ended, failed, latency p50/p95/p99, time to first "
        "token and wait for a replica (p95), tokens/s, ms per token",
    )
    stats.add_argument("name", nargs="?", help="only this deployment")
    stats.add_argument(
        "--window",
        type=window,
        default=window(DEFAULT_WINDOW),
        help=f"the requests accepted in the last this long: 300, 10m, 1h, 7d (default {DEFAULT_WINDOW})",
    )
    add_output_option(stats, "each deployment's figures")
    stats.set_defaults(run=cmd_stats)
