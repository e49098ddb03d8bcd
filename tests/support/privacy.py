"""What a running stack shows other users of its host: no server password on any process's
command line, and nothing under its data directory that another user may read."""

from __future__ import annotations

import stat
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from gpuportal.stackenv import read_stack_env


def passwords_of(var: Path) -> list[str]:
    urls = read_stack_env(var / "stack.env")
    return [p for p in (urlsplit(url).password for url in urls.values()) if p]


def command_lines_showing(secrets: list[str]) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if any(secret in line for secret in secrets):
            found.append(f"{process.info['pid']}: {line[:200]}")
    return found


def readable_by_others(var: Path) -> list[str]:
    """Files under `var` with any group or other bit, and folders others may write to. A folder may
    be listed and crossed: PostgreSQL, run as its own user when the stack runs as root, reaches its
    data (0700, its own) through them."""
    found = []
    for path in sorted(var.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode) or stat.S_ISSOCK(mode):
            continue
        loose = 0o022 if stat.S_ISDIR(mode) else 0o077
        if stat.S_IMODE(mode) & loose:
            found.append(f"{path.relative_to(var)} {stat.filemode(mode)}")
    return found
