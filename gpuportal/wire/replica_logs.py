"""A replica's own output, read on its node (`gpuportal logs REPLICA`): the control plane
asks the node's agent on the node's own queue and waits on `reply_to` (gpuportal.wire.replies) for
the last lines of the log file the agent's supervisor writes for the replica. Django-free."""

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

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, **asdict(self)}

    @classmethod
    def decode(cls, payload: Any) -> ReadLog:
        if not isinstance(payload, dict) or payload.get("v") != VERSION:
            raise WireError(f"a log read this agent cannot take: {payload!r:.200}")
        try:
            return cls(str(payload["replica_id"]), int(payload["tail"]), str(payload["reply_to"]))
        except (KeyError, TypeError, ValueError) as err:
            raise WireError(f"a log read with bad fields: {err}") from None


def last_lines(text: str, tail: int) -> list[str]:
    return text.splitlines()[-tail:] if tail > 0 else []
