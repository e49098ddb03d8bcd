"""`gpuportal plan`: a capacity plan made on the portal's control worker (`POST /api/plan/`), its
progress while it runs, then its table and, if asked, its plot. What `manage.py plan` prints, from
any machine that reaches the portal."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from gpuportal.cli.client import Client, CliError
from gpuportal.wire.states import PlanState

POLL_S = 1.0


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise CliError(f"cannot read the {what} {path}: {err.strerror or err}") from None


def catalogue_of(path: Path) -> Any:
    """A catalogue file as the API takes it: JSON, or TOML by its suffix."""
    text = _read(path, "catalogue")
    try:
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise CliError(f"the catalogue {path} is not {'TOML' if path.suffix == '.toml' else 'JSON'}: {err}") from None


def plan_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request's body: only what was given, so the portal's defaults apply to the rest."""
    if args.trace is not None and args.since is not None:
        raise CliError("plan a trace file or the traffic recorded --since, not both")
    body: dict[str, Any] = {"skip_bad": args.skip_bad}
    if args.trace is not None:
        body["trace"] = _read(args.trace, "trace")
    elif args.since is not None:
        body["since"] = args.since
    if args.catalogue is not None:
        body["catalogue"] = catalogue_of(args.catalogue)
    given = {"target": args.target, "slo_ttft_s": args.slo, "gpu_memory_gib": args.gpu_memory_gib}
    given["current_gpus"] = args.gpus
    given["warm_spares"] = args.warm_spares
    body.update({key: value for key, value in given.items() if value is not None})
    return body


def wait_for_plan(
    client: Client,
    answer: dict[str, Any],
    *,
    console: Console,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the plan until it is done (its last answer returned); CliError when it failed or the
    wait ran out (the plan goes on there). A bar on a terminal; elsewhere a line per state."""
    plan_id, began = answer["id"], clock()
    progress = None
    if console.is_terminal:
        progress = Progress(
            TextColumn(f"plan {plan_id}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(), console=console
        )
    seen = ""
    with progress if progress is not None else contextlib.nullcontext():
        task = progress.add_task("plan", total=100) if progress is not None else None
        while True:
            state, percent = answer["state"], answer.get("percent", 0)
            if progress is not None and task is not None:
                progress.update(task, completed=percent)
            elif state != seen:
                console.print(f"plan {plan_id}: {state} {percent} %")
            seen = state
            if state == PlanState.DONE:
                return answer
            if state == PlanState.FAILED:
                raise CliError(f"plan {plan_id} failed: {answer.get('error') or 'no reason given'}")
            if clock() - began >= timeout_s:
                raise CliError(
                    f"plan {plan_id} is {state} at {percent} % after {timeout_s:.0f} s; it goes on on the portal "
                    f"(GET /api/plan/{plan_id}/ shows it when done)"
                )
            pause(POLL_S)
            answer = client.get(f"/api/plan/{plan_id}/")


def show_plan(answer: dict[str, Any], out: Console, err: Console, plot: Path | None) -> None:
    """The plan's table as the portal wrote it (Markdown), the rows it skipped, and the plot."""
    for row in answer.get("skipped_rows") or ():
        err.print(f"skipped: {row}", markup=False)
    out.print(answer.get("table", ""), markup=False)
    if plot is not None:
        if not answer.get("plot_png"):
            raise CliError(f"plan {answer['id']} has no plot")
        try:
            plot.write_bytes(base64.b64decode(answer["plot_png"]))
        except OSError as error:
            raise CliError(f"cannot write the plot to {plot}: {error.strerror or error}") from None
        out.print(f"Plot: {plot}", markup=False)
