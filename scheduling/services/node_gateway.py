"""The control plane's side of gpuportal.wire.control (issue 17): what a node agent tells the
control plane arrives here and goes to the services. Given to the agent by `manage.py agent`.

It runs in the agent's process, on the agent's threads (its heartbeat, and one reader thread per
replica), each with its own database connection: a PostgreSQL restart must lose none of it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.db import InterfaceError, OperationalError, close_old_connections, connection
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor
from scheduling.models import Replica
from scheduling.services import nodes, reports

log = logging.getLogger(__name__)

# The final events of a replica: its reader thread ends with them.
TERMINAL_EVENTS = {"stopped", "failed"}


def _reconnect(retry_state: RetryCallState) -> None:
    log.warning("database unavailable while recording a replica's report; retrying (%s)", retry_state.outcome)
    connection.close()  # a restarted server left this connection dead: the next try opens another


# A PostgreSQL restart must not lose what a replica reports (a failover takeover above all): retry
# for as long as a restart takes. Only on connection errors, which leave nothing half-applied.
REPORT_RETRY = Retrying(
    retry=retry_if_exception_type((OperationalError, InterfaceError)),
    stop=stop_after_delay(60),
    wait=wait_exponential(multiplier=0.1, max=2),
    before_sleep=_reconnect,
    reraise=True,
)


class ServicesGateway:
    """gpuportal.wire.control.ControlPlane, applied by the services in this process."""

    def register_node(
        self,
        node: str,
        devices: Sequence[DeviceInfo],
        *,
        hostname: str,
        cpu_cache_bytes: int,
        virtual: bool,
        survivors: Sequence[Survivor],
    ) -> None:
        close_old_connections()
        nodes.register_node(
            node,
            list(devices),
            hostname=hostname,
            cpu_cache_bytes=cpu_cache_bytes,
            virtual=virtual,
            survivors=survivors,
        )

    def heartbeat(self, node: str, *, books: Books | None, running: Sequence[str]) -> list[str]:
        # Why close_old_connections: a database restart leaves this thread's connection dead;
        # Django drops it here so the next query reconnects instead of failing forever.
        close_old_connections()
        return nodes.heartbeat(node, books=books, running=running)

    def node_stopping(self, node: str, reason: str) -> None:
        close_old_connections()
        nodes.mark_stopping(node, reason)

    def node_stopped(self, node: str, reason: str) -> None:
        close_old_connections()
        nodes.mark_stopped(node, reason)

    def report(self, replica_id: str, event: dict[str, Any]) -> None:
        try:
            close_old_connections()
            REPORT_RETRY.copy()(reports.report, replica_id, event)  # a copy: no state shared between threads
        except Exception:
            log.exception("could not record %s of replica %s", event.get("event"), replica_id)
        finally:
            if event.get("event") in TERMINAL_EVENTS:
                connection.close()  # the thread ends with the process; its connection must not linger

    def replica_state(self, replica_id: str) -> str | None:
        close_old_connections()
        return Replica.objects.filter(pk=replica_id).values_list("state", flat=True).first()
