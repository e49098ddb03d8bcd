"""How a replica process ends itself (the replica and its failover member both do)."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    # os._exit, not sys.exit: the stdin thread may be blocked in a read, and interpreter shutdown
    # with a daemon thread inside stdin's buffer lock can abort instead of exiting.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
