"""How an adopted replica ended, which its adopter cannot learn by itself: only a process's parent
reaps it, and an adopted replica's parent (the agent that started it) is gone.

`up` makes itself the child subreaper of what it starts, so a replica whose agent died becomes
`up`'s child rather than init's. `up` reaps those orphans of its agents' process groups as they end
and writes each one's exit status in an exit record (`exits/<pid>.json` under the data folder); the
agent that adopted the replica reads it when its pidfd says the process ended, so the failure
reason names the exit code or signal (inference.supervisor). Outside `up` (an agent started by
hand, a container) there is no reaper, no record, and the reason says only that it exited.
Django-free: `up` and the agent both use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from collections.abc import Collection
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
# The reaper's pid, in the exits folder: an agent waits for a record only while it names a live process.
REAPER_FILE = "reaper.pid"
# An agent waits this long for the record after the process ended: the reaper looks every 0.2 s.
RECORD_WAIT_S = 2.0
# Records older than this are not the process's (its pid was reused), and are swept.
RECORD_MAX_AGE_S = 300.0


def exits_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / "exits"


def become_subreaper(folder: Path) -> None:
    """Orphans among this process's descendants become its children (not init's), and it says so
    in `folder` for the agents that read the records it writes there. From then on it must reap
    them (`reap`), as init would have: a zombie left among its children would look alive to
    anyone who lists them."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    _write_private(folder, REAPER_FILE, str(os.getpid()))


def stop_reaping(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folder / REAPER_FILE).unlink()


def reap(own: Collection[int], recorded: Collection[int], folder: Path) -> dict[int, int]:
    """Reap the orphans among this process's children that have ended: every child not in `own`
    (the processes it started and waits for itself) and not in its own process group (where a
    child it runs and waits for at once, a `manage.py` run, lives; an orphan never does, since
    each process it starts leads a session of its own). How each ended is recorded for those of
    the `recorded` process groups (its agents': their replicas). {pid: exit code, negative for
    the signal that ended it} of those recorded."""
    reaped = {}
    ours = os.getpgrp()
    for pid in _children():
        stat = _stat(pid)
        if pid in own or stat is None or stat[0] != "Z" or stat[1] == ours:
            continue
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            continue
        if ended is None or stat[1] not in recorded:
            continue
        killed = ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        reaped[pid] = code = -ended.si_status if killed else ended.si_status
        _write_private(folder, f"{pid}.json", json.dumps({"pid": pid, "code": code, "at": time.time()}))
    return reaped


def exit_code(folder: Path | None, pid: int, wait_s: float = RECORD_WAIT_S) -> int | None:
    """The exit code `up` recorded for `pid` (negative: a signal), waiting up to `wait_s` for it
    while a reaper is there to write it; None without one, or when none came. The record is
    removed once read."""
    if folder is None or not _reaper_alive(folder):
        return None
    path = folder / f"{pid}.json"
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            path.unlink(missing_ok=True)
            if time.time() - float(record["at"]) <= RECORD_MAX_AGE_S:
                return int(record["code"])
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def sweep(folder: Path, now: float | None = None) -> None:
    """Remove records no agent read (their replica was not adopted): older than RECORD_MAX_AGE_S."""
    now = time.time() if now is None else now
    for path in folder.glob("*.json"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > RECORD_MAX_AGE_S:
                path.unlink()


def _write_private(folder: Path, name: str, text: str) -> None:
    """Only its owner may read it, like everything `up` keeps under its data folder."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / name
    temporary = path.with_suffix(".tmp")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(text)
    temporary.replace(path)  # a reader sees all of it or nothing


def _reaper_alive(folder: Path) -> bool:
    try:
        pid = int((folder / REAPER_FILE).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _children() -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found.extend(int(p) for p in (task / "children").read_text().split())
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, a zombie included."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return after_name[0], int(after_name[2])
    except (OSError, IndexError, ValueError):
        return None
