"""One failover pair member as its own process, for tests/inference/test_failover_lock.py: the lock and
nothing else (no model, no Django, so it starts fast and can be SIGKILLed or SIGSTOPped whole).

    python -m tests.support.failover_member --dir DIR --fence F --replica-id X [--try-first]

Takes the lock (`--try-first`: try without waiting before blocking like a standby does), holds it
until killed, and prints what happens as JSON lines on stdout, each with `t` from time.monotonic()
(one clock for every process on Linux, so the harness can order events across members):

    {"event": "ready", "pid": ..., "t": ...}                    started, about to take or wait
    {"event": "claim", "claim": "take"|"closed", "t": ...}     decide_claim's answer, on each grant
                                                                of the file lock
    {"event": "grant", "epoch": E, "previous_holder": ..., "t": ...}   the lock is ours
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from inference import failover
from inference.failover import FailoverMember, LeaseConfig

_out = threading.Lock()


def emit(event: str, **fields) -> None:
    line = json.dumps({"event": event, **fields, "t": time.monotonic()}, default=str)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


_decide_claim = failover.decide_claim


def _telling_decide_claim(*args, **kwargs) -> failover.Claim:
    claim = _decide_claim(*args, **kwargs)
    emit("claim", claim=claim.value)
    return claim


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the node's folder of pair locks")
    parser.add_argument("--fence", required=True, help="the pair's name")
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--try-first", action="store_true", help="try_acquire before waiting")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)d %(name)s: %(message)s")

    config = LeaseConfig(Path(args.dir), args.fence, args.replica_id)
    # What the member decides each time the kernel grants it the file lock, e.g. CLOSED while its
    # pair is being stopped whole.
    failover.decide_claim = _telling_decide_claim
    member = FailoverMember(config, on_event=lambda kind, **fields: emit(kind, **fields))
    emit("ready", pid=os.getpid())
    # The grant itself is printed by on_event("grant").
    if not (args.try_first and member.try_acquire() is not None):
        member.acquire()
    threading.Event().wait()  # serve until killed


if __name__ == "__main__":
    main()
