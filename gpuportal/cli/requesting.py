"""`gpuportal requests` (the requests of the last day, newest first: `GET /api/requests/`) and
`gpuportal cancel` (`DELETE /api/requests/{id}/`: a waiting request is cancelled, a running one
stopped where its replica generates it). A request is named by its id or by the start of it, as
`requests` shows it (docker's short ids): one start that names two requests is refused."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuportal.cli.client import Client, CliError
from gpuportal.cli.options import JSON, add_output_option, print_json

# How much of an id `requests` shows: enough to tell a day's requests apart, as docker shows 12.
SHORT_ID = 12
# Where a start of an id is looked for: the most recent requests a page holds (the API's most).
SEARCHED = 1000
STATUSES = ("queued", "waking", "dispatched", "running", "done", "failed", "cancelled")
# A failed request in red, a cancelled one in yellow, one a replica holds in bold.
_STYLE = {"failed": "red", "cancelled": "yellow", "running": "bold", "dispatched": "bold"}


class Requester(Protocol):
    out: Console
    err: Console

    @property
    def client(self) -> Client: ...


def cmd_requests(ctx: Requester, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"page_size": args.limit}
    if args.name:
        params["deployment"] = args.name
    if args.status:
        params["status"] = args.status
    page = ctx.client.get("/api/requests/", params=params)
    found = page.get("results", [])
    if args.output == JSON:
        print_json(ctx.out, found)
        return 0
    if not found:
        ctx.out.print(f"no request{' to ' + args.name if args.name else ''} in the last day")
        return 0
    ctx.out.print(requests_table(found, datetime.now(UTC)))
    if page.get("next"):
        ctx.err.print(Text(f"(the newest {len(found)}: --limit for more)", style="bright_black"))
    return 0


def requests_table(found: list[dict[str, Any]], now: datetime) -> Table:
    rows = []
    for request in found:
        usage = _usage(request)
        tokens = f"{usage.get('prompt_tokens', 0)}+{usage.get('completion_tokens', 0)}" if usage else "-"
        rows.append(
            [
                request["id"][:SHORT_ID],
                request["deployment"],
                request["kind"],
                request["status"],
                _age(request.get("created_at"), now),
                tokens,
                (request.get("replica") or "-")[:8],
            ]
        )
    table = Table(box=None, pad_edge=False, header_style="bold")
    for index, column in enumerate(("ID", "DEPLOYMENT", "KIND", "STATUS", "AGE", "TOKENS", "REPLICA")):
        # Whole on a narrow terminal (an id is what `cancel` is given): the error gives way.
        widest = max(len(column), *(len(row[index]) for row in rows))
        justify = "right" if column in ("AGE", "TOKENS") else "left"
        table.add_column(column, justify=justify, no_wrap=True, min_width=widest)
    # Wrapped, it is what gives way on a narrow terminal (not the columns before it).
    table.add_column("ERROR", overflow="fold")
    for row, request in zip(rows, found, strict=True):
        status = Text(row[3], style=_STYLE.get(row[3], ""))
        error = Text(" ".join((request.get("error") or "").split())[:120])  # `-o json` has it whole
        table.add_row(row[0], Text(row[1]), row[2], status, *row[4:], error)
    return table


def _usage(request: dict[str, Any]) -> dict[str, Any] | None:
    """The tokens a request's answer counted (as much as was generated, for a stopped one)."""
    output = request.get("output")
    usage = output.get("usage") if isinstance(output, dict) else None
    return usage if isinstance(usage, dict) else None


def _age(stamp: str | None, now: datetime) -> str:
    if not stamp:
        return "-"
    seconds = max(0, int((now - datetime.fromisoformat(stamp)).total_seconds()))
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def cmd_cancel(ctx: Requester, args: argparse.Namespace) -> int:
    failed = 0
    for given in args.ids:
        try:
            request_id = resolve(ctx.client, given)
            ended = ctx.client.request("DELETE", f"/api/requests/{request_id}/")
        except CliError as error:
            ctx.err.print(Text(f"{given}: {error}", style="red"))
            failed += 1
            continue
        ctx.out.print(_cancelled(ended))
    return 1 if failed else 0


def _cancelled(request: dict[str, Any]) -> str:
    """What a cancel did, in one line."""
    short = request["id"][:SHORT_ID]
    if request["status"] != "cancelled":
        return f"{short}: asked to stop; still {request['status']} (`gpuportal requests` shows when it ends)"
    if usage := _usage(request):
        return f"{short}: stopped after {usage.get('completion_tokens', 0)} token(s)"
    return f"{short}: cancelled before it ran"


def resolve(client: Client, given: str) -> str:
    """The id `given` names: itself when whole, else the one recent request whose id starts so."""
    given = given.strip().lower()
    if not given or any(c not in "0123456789abcdef" for c in given):
        raise CliError("not a request id: an id is hexadecimal (`gpuportal requests` lists them)")
    if len(given) >= 32:
        return given
    found = client.get("/api/requests/", params={"page_size": SEARCHED}).get("results", [])
    matches = [r["id"] for r in found if r["id"].startswith(given)]
    if not matches:
        raise CliError(f"no request of the last {SEARCHED} starts with {given} (`gpuportal requests` lists them)")
    if len(matches) > 1:
        named = ", ".join(m[:SHORT_ID] for m in matches[:3])
        raise CliError(f"{given} starts {len(matches)} requests' ids ({named}{', ...' if len(matches) > 3 else ''})")
    return matches[0]


def add_looking(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listed = commands.add_parser(
        "requests", help="the requests of the last day, newest first: status, age, tokens, replica (yours; staff: all)"
    )
    listed.add_argument("name", nargs="?", help="only this deployment's")
    listed.add_argument("--status", choices=STATUSES, help="only those with this status")
    listed.add_argument(
        "--limit", type=_limit, default=20, help=f"at most this many, newest first (default 20, most {SEARCHED})"
    )
    add_output_option(listed, "the requests")
    listed.set_defaults(run=cmd_requests)


def add_steering(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cancel = commands.add_parser(
        "cancel",
        help="cancel requests: a waiting one at once, a running one stopped where it is generated (its "
        "text so far kept)",
    )
    cancel.add_argument("ids", nargs="+", metavar="ID", help="a request's id, or its start as `requests` shows it")
    cancel.set_defaults(run=cmd_cancel)


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= SEARCHED:
        raise argparse.ArgumentTypeError(f"from 1 to {SEARCHED}")
    return value
