"""`gpuportal pull MODEL`: a Hugging Face model fetched into the nodes' caches ahead of a deploy
(`POST /api/models/pull/`), a progress bar per node while it downloads, then where each node keeps
it, or why it could not."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from gpuportal.cli.client import Client, CliError
from gpuportal.wire.pulls import DONE, FAILED

POLL_S = 0.5


def pull_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model}
    if args.node:
        body["node"] = args.node
    return body


def wait_for_pull(
    client: Client,
    answer: dict[str, Any],
    *,
    console: Console,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the pull until every node has ended (its last answer returned). A bar per node on a
    terminal, its bytes against the model's; elsewhere a line per node and state."""
    began = clock()
    progress = None
    if console.is_terminal:
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(), console=console
        )
    tasks: dict[str, TaskID] = {}
    seen: dict[str, str] = {}
    with progress if progress is not None else contextlib.nullcontext():
        while True:
            for node, said in sorted(answer["nodes"].items()):
                if progress is not None:
                    if node not in tasks:
                        tasks[node] = progress.add_task(f"{answer['model']} → {node}", total=None)
                    total = said.get("total_bytes") or None
                    progress.update(tasks[node], completed=said.get("done_bytes", 0), total=total)
                elif seen.get(node) != said["state"]:
                    console.print(f"{answer['model']} → {node}: {said['state']} {said.get('percent', 0)} %")
                seen[node] = said["state"]
            if answer["state"] in (DONE, FAILED):
                return answer
            if clock() - began >= timeout_s:
                raise CliError(
                    f"the pull of {answer['model']} is {answer['state']} after {timeout_s:.0f} s; it goes on on the "
                    f"nodes (gpuportal pull shows it again, GET {answer['url']} too)"
                )
            pause(POLL_S)
            answer = client.get(answer["url"])


def show_pull(answer: dict[str, Any], out: Console, err: Console) -> int:
    """Where each node keeps the model, or why it has not: 1 when a node failed."""
    failed = 0
    for node, said in sorted(answer["nodes"].items()):
        if said["state"] == DONE:
            out.print(f"{node}: {answer['model']} in {said['path']} ({said['files']} files)", markup=False)
        else:
            failed += 1
            err.print(f"{node}: {answer['model']} not pulled: {said.get('error') or said['state']}", markup=False)
    if not failed:
        out.print(f"deploy it with: gpuportal deploy NAME hf:{answer['model']}", markup=False)
    return 1 if failed else 0
