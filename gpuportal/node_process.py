"""Whether this process is a node agent's: `manage.py agent` says so before Django starts, and the
settings then load only the apps a node runs (gpuportal.settings)."""

from __future__ import annotations

import os
from collections.abc import Sequence

ENV = "GPUPORTAL_NODE_PROCESS"
COMMAND = "agent"
# The agent's command lives in gpuportal, the tasks its worker runs in inference. The control
# plane's models, admin and API are not loaded: a node serves no page and opens no database, and
# they were half of an agent's start (0.45 of 0.9 s of CPU on a 2-core machine), paid by every
# node at every start.
APPS = ("gpuportal", "inference")


def mark(argv: Sequence[str]) -> None:
    """Marks this process (and what it starts) a node's when `manage.py` runs the agent."""
    if argv[1:2] == [COMMAND]:
        os.environ[ENV] = "1"


def marked() -> bool:
    return os.environ.get(ENV) == "1"
