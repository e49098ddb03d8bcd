"""A replica outlives its node agent for a while, so that an agent restarted (a crash, an upgrade,
`up` bringing its agent back) finds its models still loaded instead of loading them again
(a restart restores what ran; a kubelet restart leaves its pods running the same way).

Both sides use this module: the replica listens on an abstract Unix socket named after its log
directory and id (`address`), and when its agent is gone (EOF on its command stream, or a broken
event stream) it waits `window` seconds for a new agent to connect there (`Orphanage`). Nobody
comes: it stops as a scale-down would (what it had taken goes back to its queue) and exits. The
window is shorter than the heartbeat timeout, so an orphan has ended before the control plane
writes its node off and places its replacements.

No Django here: the replica imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from gpuportal.wire.node_lease import NodeFence

log = logging.getLogger("inference.replica")

ADDRESS_PREFIX = "gpuportal-"
# How long a new agent waits for a survivor's hello before it counts it gone.
HELLO_TIMEOUT_S = 5.0


def address(log_dir: str | Path, replica_id: str) -> str:
    """The replica's adoption address: abstract (no file to leave behind, no 108-byte path limit),
    and unique per node directory, since two portals on one host may both run a node `local`."""
    digest = hashlib.sha256(f"{Path(log_dir).resolve()}\0{replica_id}".encode()).hexdigest()[:40]
    return ADDRESS_PREFIX + digest


def socket_name(name: str) -> str:
    """The kernel's name of an abstract socket: a leading NUL byte."""
    return "\0" + name


def peer_uid(conn: socket.socket) -> int:
    """The user at the other end. An abstract socket has no file permissions to keep others out,
    so the replica takes commands only from its own user."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class Events(Protocol):
    def attach(self, stream: TextIO, hello: dict[str, Any]) -> None: ...
    def detach(self) -> None: ...
    def last_state(self) -> str | None: ...


class Host(Protocol):
    replica_id: str
    node_fence: NodeFence | None

    @property
    def state(self) -> str: ...


class Orphanage:
    """The replica's side: listen from the start; once orphaned, wait for an adopter."""

    def __init__(
        self,
        name: str,
        window_s: float,
        *,
        host: Host,
        events: Events,
        serve_commands: Callable[[Iterable[str]], None],
        give_up: Callable[[], None],
    ):
        self.window_s = window_s
        self.host, self.events = host, events
        self.serve_commands, self.give_up = serve_commands, give_up
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_name(name))
        self.listener.listen(1)
        self._lock = threading.Lock()
        self._orphaned = False

    def orphaned(self) -> None:
        """The agent is gone. Called from the command reader at EOF and from the event writer on a
        broken stream, in either order: only the first starts the wait."""
        with self._lock:
            if self._orphaned:
                return
            self._orphaned = True
        self.events.detach()
        log.warning("%s: the node agent is gone; waiting %.0f s to be adopted", self.host.replica_id, self.window_s)
        threading.Thread(target=self._await_adoption, name="adoption", daemon=True).start()

    def _await_adoption(self) -> None:
        conn = self._accept(time.monotonic() + self.window_s)
        if conn is None:
            log.warning("%s: no agent adopted it within %.0f s; stopping", self.host.replica_id, self.window_s)
            self.give_up()
            return
        reader = conn.makefile("r", encoding="utf-8")
        writer = conn.makefile("w", encoding="utf-8", buffering=1)
        with self._lock:
            self._orphaned = False
        hello: dict[str, Any] = {"replica_id": self.host.replica_id, "pid": os.getpid(), "state": self.host.state}
        if self.host.node_fence is not None:
            # The epoch it serves under: its adopter holds the node's lease under it while it
            # registers (inference.agent), so the node is not written off in between.
            hello["node_epoch"] = self.host.node_fence.epoch
        self.events.attach(writer, {**hello, "last": self.events.last_state()})
        log.info("%s: adopted by a new node agent (state %s)", self.host.replica_id, self.host.state)
        # This thread reads the new agent's commands until it goes too; then the wait starts again.
        self.serve_commands(reader)
        for stream in (reader, writer, conn):
            with contextlib.suppress(OSError):
                stream.close()

    def _accept(self, deadline: float) -> socket.socket | None:
        while (remaining := deadline - time.monotonic()) > 0:
            self.listener.settimeout(remaining)
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                return None
            if peer_uid(conn) == os.getuid():
                conn.settimeout(None)
                return conn
            log.warning("%s: refused an adopter of another user", self.host.replica_id)
            conn.close()
        return None
