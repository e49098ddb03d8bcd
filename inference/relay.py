"""What a replica process reports, relayed by its node agent to the services (on the supervisor's
reader threads: one database connection per replica thread)."""

from __future__ import annotations

import logging

from django.db import InterfaceError, OperationalError, close_old_connections, connection
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from scheduling.services import reports

log = logging.getLogger(__name__)

TERMINAL_EVENTS = {"stopped", "failed"}


def _reconnect(retry_state: RetryCallState) -> None:
    log.warning("database unavailable while recording a replica's report; retrying (%s)", retry_state.outcome)
    connection.close()  # a restarted server left this connection dead: the next try opens another


# A PostgreSQL restart must not lose what a replica reports (a failover takeover above all): retry
# for as long as a restart takes. Only on connection errors, which leave nothing half-applied.
RELAY_RETRY = Retrying(
    retry=retry_if_exception_type((OperationalError, InterfaceError)),
    stop=stop_after_delay(60),
    wait=wait_exponential(multiplier=0.1, max=2),
    before_sleep=_reconnect,
    reraise=True,
)


def relay(replica_id: str, event: dict) -> None:
    """Called on the supervisor's reader threads: one database connection per replica thread."""
    if event.get("event") == "pong":
        return  # answers the agent's ping_all: the heartbeat reads its figures from the supervisor
    try:
        close_old_connections()
        RELAY_RETRY.copy()(reports.report, replica_id, event)  # a copy: no state shared between threads
    except Exception:
        log.exception("could not record %s of replica %s", event.get("event"), replica_id)
    finally:
        if event.get("event") in TERMINAL_EVENTS:
            connection.close()  # the thread ends with the process; its connection must not linger
