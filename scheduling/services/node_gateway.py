"""The control plane's side of gpuportal.wire.control: what a node agent tells the
control plane arrives here as a call on the `agents` queue (scheduling.tasks.agent_call), goes
to the services, and the answer goes back on the Redis list the caller waits on.

It runs on the `agents` worker's threads, each with its own database connection: a PostgreSQL
restart must lose none of what a replica reports."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpuportal.wire import replies
from gpuportal.wire.control import ControlError, WireError, decode_call, speaks_for
from scheduling.services import node_credentials, nodes, replicas, reports
from scheduling.services.errors import ServiceError

log = logging.getLogger(__name__)


def _reconnect(retry_state: RetryCallState) -> None:
    log.warning("database unavailable while applying an agent's call; retrying (%s)", retry_state.outcome)
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


def _applied(service: Callable[..., Any], *, retried: bool = False, answers: bool = True) -> Callable[..., Any]:
    """A call of the contract (its signature is gpuportal.wire.control.ControlPlane's), applied by
    `service` on this worker thread's own connection (`answer` has dropped a dead one first).
    `retried`: through a restart too (REPORT_RETRY). `answers`: what the service returns is the
    call's answer (else None, as the contract says)."""

    def apply(self: ServicesGateway, *args: Any, **kwargs: Any) -> Any:
        # A copy of the retry: no state shared between threads.
        run = REPORT_RETRY.copy() if retried else (lambda f, *a, **k: f(*a, **k))
        result = run(service, *args, **kwargs)
        return result if answers else None

    apply.__name__ = service.__name__
    return apply


class ServicesGateway:
    """gpuportal.wire.control.ControlPlane, applied by the services in this process: each call of
    the contract, and the service that carries it out."""

    # Retried through a database restart like a report: an agent that `up` just started again
    # must not give up (and stop the replicas it is taking over) because the database blinked
    # while it registered. Registering again is harmless: it is how an agent rejoins.
    register_node = _applied(nodes.register_and_fence, retried=True)
    heartbeat = _applied(nodes.heartbeat)
    node_stopping = _applied(nodes.mark_stopping, answers=False)
    node_stopped = _applied(nodes.mark_stopped, answers=False)
    replica_state = _applied(replicas.state_of)
    _report = _applied(reports.report, retried=True, answers=False)

    def report(self, replica_id: str, event: dict[str, Any]) -> None:
        try:
            self._report(replica_id, event)
        except Exception as err:
            log.exception("could not record %s of replica %s", event.get("event"), replica_id)
            raise ControlError(f"could not record {event.get('event')} of replica {replica_id}: {err}") from err


# The calls that bring a node online: checked again once applied, in case its revocation committed
# meanwhile (node_credentials.revoke writes the node off only after it has).
ONLINE_CALLS = ("register_node", "heartbeat")


def _answers() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


def answer(payload: Any, control: ServicesGateway | None = None) -> str:
    """Applies one call of an agent (gpuportal.wire.control.Call) and pushes the answer to the
    list its caller blocks on. Returns the call's name. A call that cannot be read, or that the
    services refuse, is answered with the error: the agent logs it instead of waiting it out. A
    call whose token is not the credential of the node it speaks for is not applied, and its
    answer says so (scheduling.services.node_credentials): "refused"."""
    try:
        call = decode_call(payload)
    except WireError as err:
        reply_to = payload.get("reply_to") if isinstance(payload, dict) else None
        log.error("an agent's call that cannot be read: %s", err)
        if isinstance(reply_to, str) and reply_to:
            replies.answer(_answers(), reply_to, error=str(err))
        return "unreadable"
    try:
        kind, subject = speaks_for(call)
        # Once a call, before its first query: a database restart leaves this worker thread's
        # connection dead, and Django drops it here so the query reconnects instead of failing
        # for ever. Once only: each drop costs the next query a health check's round trip.
        close_old_connections()
        # The check reads the database, so it waits out a restart as a registration and a report
        # do (REPORT_RETRY): an agent `up` started again while PostgreSQL was starting up would
        # otherwise give up, and the replicas it had just taken over would wait for yet another.
        refusal = REPORT_RETRY.copy()(node_credentials.check_call, kind, subject, call.token)
        if refusal is not None:
            log.warning("refused an agent's %s for %s %s: %s", call.name, kind, subject, refusal.why)
            replies.answer(_answers(), call.reply_to, error=str(refusal))
            return "refused"
        result = call.apply(control or ServicesGateway())
        if call.name in ONLINE_CALLS and node_credentials.revoked(subject):
            node_credentials.write_off_again(subject)
    except Exception as err:
        if not isinstance(err, ControlError | ServiceError):  # those say all there is to say
            log.exception("an agent's %s failed", call.name)
        replies.answer(_answers(), call.reply_to, error=f"{type(err).__name__}: {err}")
    else:
        replies.answer(_answers(), call.reply_to, result=result)
    return call.name
