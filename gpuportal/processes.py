"""A child process tied to its parent: it gets a signal when the process that started it dies,
even by SIGKILL, so that nothing `up`, an agent or a replica started outlives it unseen. Used by
the stack, the node agent's supervisor and the replica process alike; Django-free."""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def tie_to_parent(sig: int = signal.SIGTERM) -> None:
    """This process gets `sig` when its parent dies. OSError where prctl is not to be had (not Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)


def untie_from_parent() -> None:
    """This process no longer gets a signal when its parent dies. OSError where prctl is not to be had."""
    tie_to_parent(0)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the process that started it dies, even by SIGKILL."""

    def _preexec() -> None:
        tie_to_parent(sig)

    return _preexec


def name_this_process(name: str) -> None:
    """What `ps -o comm`, `top` and `pgrep` show for this process (15 bytes at most): a process
    forked rather than started keeps its parent's command line, and this tells it apart."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
