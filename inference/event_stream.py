"""The replica process's side of its event stream: one JSON object a line on stdout, which its
node agent reads and relays to the control plane."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from gpuportal.wire.states import ReplicaState as S
from inference.process_exit import exit_now as _exit

log = logging.getLogger("inference.replica")


def protocol_stream() -> TextIO:
    """Keep the real stdout for events and point fd 1 at stderr, so stray prints cannot corrupt the protocol."""
    sys.stdout.flush()
    events_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(events_fd, "w", buffering=1, encoding="utf-8")


class EventWriter:
    """One JSON object per line on the protocol stream; thread-safe (the serving threads write too).

    A replica that may outlive its agent (inference.adoption) keeps running with no stream while
    orphaned, and tells the next agent its state again (`resync`): the last state event it
    emitted, which may have been lost with the old agent."""

    # Events that say which state the replica is in, with the figures the books need for it.
    STATE_EVENTS = (S.SERVING, "woken", S.SLEEPING)

    def __init__(self, stream: TextIO | None):
        self._stream = stream
        self._lock = threading.Lock()
        self._last_state: tuple[str, str] | None = None
        # Set when the replica may outlive its agent: called once the stream breaks.
        self.on_broken: Callable[[], None] | None = None

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, separators=(",", ":"))
        with self._lock:
            if event in self.STATE_EVENTS:
                self._last_state = (event, line)
            broken = self._stream is not None and not self._write(line)
            if broken:
                self._stream = None
        if not broken:
            return
        if self.on_broken is None:
            # Nobody reads our events any more: the agent is gone, and so is our reason to run.
            log.error("event stream closed while writing %s; exiting", event)
            _exit(1)
        log.warning("event stream closed while writing %s", event)
        self.on_broken()

    def _write(self, line: str) -> bool:
        assert self._stream is not None
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def attach(self, stream: TextIO, hello: dict[str, Any]) -> None:
        """A new agent adopted this replica: `hello` first, then the events from now on."""
        with self._lock:
            self._stream = stream
            self._write(json.dumps({"event": "hello", **hello}, separators=(",", ":")))

    def detach(self) -> None:
        with self._lock:
            self._stream = None

    def last_state(self) -> str | None:
        with self._lock:
            return self._last_state[0] if self._last_state else None

    def resync(self) -> None:
        """Emit the last state event again, for an agent that adopted this replica: handlers on
        the control plane apply a state they already hold as nothing."""
        with self._lock:
            if self._last_state is not None and self._stream is not None:
                self._write(self._last_state[1])
