"""One failover pair member as its own process, for tests/inference/test_failover_lock.py: the lock and
nothing else (no model, no Django, so it starts fast and can be SIGKILLed or SIGSTOPped whole).

    python -m tests.support.failover_member --dsn DSN --lease N --replica-id X --window S [--try-first]

Takes the lock (`--try-first`: try without waiting before blocking like a standby does), keeps it,
and prints what happens as JSON lines on stdout, each with `t` from time.monotonic() (one clock
for every process on Linux, so the harness can order events across members):

    {"event": "ready", "pid": ..., "t": ...}                    started, about to take or wait
    {"event": "grant", "epoch": E, "took_over": bool, ...}      granted (again, after a reconnect)
    {"event": "loss", "epoch": E, "reason": ..., "final": bool} lost the connection, or for good
    {"event": "lost", "reason": ..., "t": ...}                  on_lost: stops serving, exits 1
    {"event": "claim", "claim": "take"|"keep"|"wait"|"stale"}   decide_claim's answer, on each grant
                                                                of the advisory lock

Its lock connections carry application_name `member-<replica id>`, so the harness can see in
pg_locks whether it holds the lock or waits for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import psycopg

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


def application_name(replica_id: str) -> str:
    return f"member-{replica_id}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--lease", type=int, required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--window", type=float, required=True, help="reconnect window, seconds")
    parser.add_argument("--try-first", action="store_true", help="try_acquire before waiting")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)d %(name)s: %(message)s")

    dsn = psycopg.conninfo.make_conninfo(args.dsn, application_name=application_name(args.replica_id))
    config = LeaseConfig(dsn=dsn, lease_id=args.lease, replica_id=args.replica_id, reconnect_window_s=args.window)

    def on_lost(reason: str) -> None:
        emit("lost", reason=reason)
        os._exit(1)  # as a replica does: stop serving at once, the session (and lock) ends with us

    def on_event(kind: str, **fields) -> None:
        emit(kind, **fields)

    # What the member decides each time the server grants it the advisory lock, e.g. WAIT while the
    # holder named in the lease may still reconnect after a restart.
    failover.decide_claim = _telling_decide_claim
    member = FailoverMember(config, on_lost=on_lost, on_event=on_event)
    emit("ready", pid=os.getpid())
    # The grant itself is printed by on_event("grant"), as are later re-grants after a reconnect.
    if not (args.try_first and member.try_acquire() is not None):
        member.acquire()
    member.keep()
    threading.Event().wait()  # serve until killed, or until on_lost exits


if __name__ == "__main__":
    main()
