"""What a replica process holds of its host's RAM, for the heartbeat (scheduling.core.host_memory)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil


def proportional_bytes(pid: int) -> int | None:
    """The process's proportional set size: its private pages plus its share of those it shares
    (a replica forked from the agent's template shares torch's pages with its siblings, and RSS
    would count them once per replica). RSS where the kernel keeps no rollup; None: it is gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None
