"""A replica's own output, read on its node (`gpuportal logs REPLICA`): the control plane
asks the node's agent on the node's own queue and waits on `reply_to` (gpuportal.wire.replies) for
the last lines of the log file the agent's supervisor writes for the replica, or (`since`, for
`gpuportal logs --follow`) the lines written after a byte offset an earlier answer ended at.
Django-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpuportal.wire.commands import VERSION, WireError

LOG_TASK = "inference.tasks.replica_log"
# At most this much of a log is read back, however many lines are asked for: a line a replica
# wrote without end must not make the answer unbounded.
MAX_LOG_BYTES = 256 * 1024


@dataclass(frozen=True)
class ReadLog:
    replica_id: str
    tail: int
    reply_to: str
    # The byte offset to read on from (an earlier answer's `end`): the whole lines written since.
    # Added to version 1 with a default: None reads the last `tail` lines, as before.
    since: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, **asdict(self)}

    @classmethod
    def decode(cls, payload: Any) -> ReadLog:
        if not isinstance(payload, dict) or payload.get("v") != VERSION:
            raise WireError(f"a log read this agent cannot take: {payload!r:.200}")
        try:
            since = payload.get("since")
            read = cls(
                str(payload["replica_id"]),
                int(payload["tail"]),
                str(payload["reply_to"]),
                None if since is None else int(since),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise WireError(f"a log read with bad fields: {err}") from None
        if read.since is not None and read.since < 0:
            raise WireError(f"a log read from a negative offset: {read.since}")
        return read


def last_lines(text: str, tail: int) -> list[str]:
    return text.splitlines()[-tail:] if tail > 0 else []


def whole_lines(chunk: bytes, start: int) -> tuple[list[str], int]:
    """The whole lines of `chunk`, read from byte `start` of a log, and the offset just past the
    last of them: a line still being written waits for the next read. A line ends at a newline,
    or at a carriage return (a progress bar's) that something other than a newline follows in
    the chunk: a return at the chunk's end may be the first half of a CRLF."""
    cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r", 0, len(chunk) - 1))
    if cut < 0:
        return [], start
    return chunk[: cut + 1].decode(errors="replace").splitlines(), start + cut + 1
