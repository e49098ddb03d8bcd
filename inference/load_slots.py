"""At most N replicas of a node load at once (a scale to 256 started ~74 loads on two
cores). A load holds one of N slot files under an exclusive flock; the rest wait for a slot, with
progress saying so. The kernel drops a dead process's lock, so a load that crashed frees its slot
at once, with no one to clean up after it. The agent sets the directory and N for its replicas."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SLOTS_DIR_ENV = "GPUPORTAL_LOAD_SLOTS_DIR"
MAX_LOADS_ENV = "GPUPORTAL_MAX_LOADS"
# flock has no "wait for any one of these": a waiting load looks again this often.
LOOK_EVERY_S = 0.1


def from_environment(environ: dict[str, str] | None = None) -> tuple[Path | None, int]:
    env = os.environ if environ is None else environ
    directory = env.get(SLOTS_DIR_ENV)
    return (Path(directory) if directory else None), int(env.get(MAX_LOADS_ENV) or 0)


@contextlib.contextmanager
def load_slot(directory: Path | None, slots: int, on_wait: Callable[[], None] = lambda: None) -> Iterator[int | None]:
    """Holds a slot for the body; yields its number (None: no limit). `on_wait` is called once,
    when the first look finds every slot taken."""
    if directory is None or slots < 1:
        yield None
        return
    directory.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        for number in range(slots):
            held = _take(directory / f"slot-{number}")
            if held is None:
                continue
            try:
                yield number
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)
                os.close(held)
            return
        if not told:
            on_wait()
            told = True
        time.sleep(LOOK_EVERY_S)


def _take(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
