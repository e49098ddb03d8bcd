"""A warm spare: a replica process started ahead of need on one GPU, its CUDA context made and its
first kernels loaded, waiting to become the next replica started there.

A replica process pays, before it can copy a single weight, for its interpreter and imports (the
replica template saves those: inference.forkserver) and for its CUDA context and the first
kernels it runs (hundreds of milliseconds on an H100 or H200, which no fork can save: a context
does not survive one). For a wake from deep sleep, whose copy of a 1 GiB model from the node's
host memory takes tens of milliseconds at bus speed, that start is most of the wake. So where
GPUPORTAL_WARM_SPARES is on, the node's agent keeps one spare per GPU (inference.spare_pool): it
has made its context on its GPU, initialised cuBLAS with a small matmul and given the
allocator's memory back, and it waits. A replica started on that GPU (a deep sleeper's wake
above all, a scale-up or a replacement too) is handed to it: the spare is told the replica's
command line and environment, points its log at the replica's, and runs the replica program
from there, in the same process, on the same pipes.

Protocol, JSON lines on the same pipes a replica uses (inference.replica):
    spare → agent  {"event": "spare", "pid", "gpu", "backend", "context_bytes", "seconds"} once warm,
                   or {"event": "failed", "reason", "kind"} and exit 1 when it cannot be
    agent → spare  {"cmd": "become", "argv": [...], "env": {...}, "log": path, "name": str}:
                   from here on it is that replica, and speaks the replica's protocol
    EOF on stdin (its agent is gone) or anything else: it exits.

Django-free, like the replica it becomes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, TextIO

from inference.backends import BACKENDS, classify_failure, nvml_process_bytes
from inference.event_stream import EventWriter, protocol_stream
from inference.process_exit import exit_now

log = logging.getLogger("inference.warm_spare")

# The flag by which `python -m inference.replica` (and the replica template) runs a spare.
FLAG = "--spare"
# The matmul that initialises cuBLAS and loads the first kernels: small, so that what the
# allocator took for it is nothing beside the context, and given back before the spare waits.
WARM_SIDE = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m inference.replica {FLAG}", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", type=int, required=True, help="The GPU it warms, by NVML index.")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument(
        "--context-bytes",
        type=int,
        default=0,
        help="The context a virtual GPU's process holds (what a virtual spare reports holding).",
    )
    return parser.parse_args(argv)


def warm(backend: str, gpu: int, context_bytes: int) -> int:
    """Make this process's CUDA context on `gpu` and load the first kernels; returns what it then
    holds there (NVML's figure; `context_bytes` on a virtual GPU, whose context is a figure)."""
    if backend != "cuda":
        return context_bytes
    import torch

    from inference.allocator import give_back_cached

    if not torch.cuda.is_available() or gpu >= torch.cuda.device_count():
        raise RuntimeError(f"GPU {gpu} is not visible to this torch {torch.__version__}")
    torch.cuda.set_device(gpu)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        square = torch.ones(WARM_SIDE, WARM_SIDE, device=f"cuda:{gpu}", dtype=dtype)
        (square @ square).sum().item()
        del square
    torch.cuda.synchronize(gpu)
    give_back_cached(torch)
    held = nvml_process_bytes(os.getpid()) or {}
    return held.get(str(gpu)) or context_bytes


def become(command: dict[str, Any]) -> list[str]:
    """Take on the replica `command` describes: its log, environment and name; returns its command
    line (the replica program's arguments)."""
    from gpuportal.processes import name_this_process

    argv, env, log_path = command.get("argv"), command.get("env"), command.get("log")
    if not isinstance(argv, list) or not isinstance(env, dict) or not isinstance(log_path, str):
        log.error("not a become command: %s", json.dumps(command)[:300])
        exit_now(2)
    # From here on what this process writes to its stderr (and to fd 1, pointed there when it
    # kept its real stdout for events) goes to the replica's log, as a started replica's does.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.dup2(2, 1)
    os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    with contextlib.suppress(OSError):  # not Linux: `ps` shows the spare's name, nothing else changes
        name_this_process(f"replica-{command.get('name', '')}")
    return [str(a) for a in argv]


def wait_to_become(argv: list[str]) -> tuple[list[str], TextIO]:
    """The spare's life: warm its GPU, say so, and wait to be told which replica to become.
    Returns that replica's command line and the protocol's stream, for the replica program to go
    on with; exits where there is none to become, or the GPU cannot be warmed."""
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s spare gpu {args.gpu} pid {os.getpid()}: %(message)s",
    )
    stream = protocol_stream()
    events = EventWriter(stream)
    began = time.monotonic()
    try:
        held = warm(args.backend, args.gpu, args.context_bytes)
    except Exception as exc:
        failure = classify_failure(exc, "load")
        log.exception("cannot warm GPU %d", args.gpu)
        events.emit("failed", reason=f"a warm spare on GPU {args.gpu}: {failure.reason}", kind=failure.kind)
        exit_now(1)
    seconds = time.monotonic() - began
    log.info("warm on %s GPU %d in %.2f s, holding %d bytes there", args.backend, args.gpu, seconds, held)
    events.emit(
        "spare", pid=os.getpid(), gpu=args.gpu, backend=args.backend, context_bytes=held, seconds=round(seconds, 4)
    )
    # The same text stream the replica's command reader goes on with: what it buffered past this
    # line is the replica's.
    line = sys.stdin.readline()
    try:
        command = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        command = None
    if not isinstance(command, dict) or command.get("cmd") != "become":
        log.info("no replica to become (%s): exiting", "the agent is gone" if not line else line.strip()[:200])
        exit_now(0)
    return become(command), stream
