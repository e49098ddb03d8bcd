"""The agent's side of gpuportal.wire.control: each call to the control plane goes out
as one task on the `agents` queue, and the answer comes back on a Redis list that this side
blocks on. The control plane applies it in its own process (scheduling.services.node_gateway);
the agent never runs the control plane's services nor touches its database.

Thread-safe: the heartbeat, each replica's reader thread and the node tasks call it at once,
each waiting for its own answer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from gpuportal.wire import node_auth, replies
from gpuportal.wire.control import (
    AGENT_CALL_TASK,
    AGENT_QUEUE,
    OPTIONAL,
    TIMEOUTS_S,
    Call,
    ControlError,
    Refused,
    encode_call,
)

log = logging.getLogger(__name__)


class RedisRefused(Refused):
    """Redis refused the user or password of the agent's REDIS_URL: no call can be sent nor
    answered until the agent is given one it takes. A revoked node's own Redis user is deleted
    (scheduling.services.nodes.drop_redis_user), so this is how such a node hears of it."""


def redis_refusal(err: BaseException) -> RedisRefused | None:
    """`err` as a RedisRefused when Redis refused the connection's credential, found along its
    causes: kombu reports a refused broker connection as an error of its own, caused by redis-py's."""
    chain: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and seen not in chain:
        if isinstance(seen, redis.AuthenticationError):
            return RedisRefused(f"Redis refused the node's user: {str(seen).rstrip('.')}")
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return None


def _sent(name: str) -> Callable[..., Any]:
    """The contract's call `name` (its signature is gpuportal.wire.control.ControlPlane's), sent."""

    def send(self: RemoteControl, *args: Any, **kwargs: Any) -> Any:
        for key in OPTIONAL.get(name, ()):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        return self.call(name, *args, timeout_s=TIMEOUTS_S.get(name), **kwargs)

    send.__name__ = name
    return send


def _outage(err: BaseException) -> bool:
    return isinstance(err, redis.ConnectionError | redis.TimeoutError | OSError)


class RemoteControl:
    """gpuportal.wire.control.ControlPlane over Celery and Redis: every call of the contract,
    sent as written there."""

    def __init__(
        self,
        app: Celery,
        redis_url: str,
        *,
        token: str | None = None,
        node: str = "",
        timeout_s: float = 120.0,
        outage_s: float = 60.0,
    ):
        self.app = app
        # The node's credential (gpuportal.wire.node_auth), sent with every call.
        self.token = token
        # Its answers' lists are named after the node: its Redis user reads only its own
        # (gpuportal.wire.node_acl).
        self.replies_kind = f"agent:{node}" if node else "agent"
        self.redis = redis.Redis.from_url(redis_url)
        # How long a call waits for the control plane (its worker busy, restarting, or not up yet).
        self.timeout_s = timeout_s
        # A Redis that blinks (a restart) is waited out this long before the call fails.
        self.outage_s = outage_s

    def call(self, name: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        call = Call(name, replies.new_list(self.replies_kind), args, kwargs, token=self.token)
        payload = encode_call(call)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            for attempt in self._on_outage():
                with attempt:
                    # Expires with the wait: a call its caller gave up on is never applied late.
                    # Not declared: kombu declares a queue by reading its length, and a node's
                    # Redis user may only push onto this one (gpuportal.wire.node_acl); a push
                    # needs no declaring.
                    self.app.send_task(AGENT_CALL_TASK, args=[payload], queue=AGENT_QUEUE, expires=timeout, declare=[])
            for attempt in self._on_outage():
                with attempt:
                    return replies.wait(self.redis, call.reply_to, timeout, name)
        except replies.NoAnswer as err:
            if node_auth.is_refusal(str(err)):
                raise Refused(str(err)) from None
            raise ControlError(str(err)) from None
        except Exception as err:
            refused = redis_refusal(err)
            if refused is None:
                raise
            raise refused from None

    def _on_outage(self) -> Retrying:
        return Retrying(
            # A refused credential is no outage: it lasts until the agent is given another.
            retry=retry_if_exception(lambda err: _outage(err) and redis_refusal(err) is None),
            stop=stop_after_delay(self.outage_s),
            wait=wait_exponential(multiplier=0.1, max=2),
            before_sleep=lambda state: log.warning("Redis unavailable; retrying (%s)", state.outcome),
            reraise=True,
        )

    # -- the calls of gpuportal.wire.control.ControlPlane, with their signatures there ------

    register_node = _sent("register_node")
    node_stopping = _sent("node_stopping")
    node_stopped = _sent("node_stopped")
    replica_state = _sent("replica_state")
    _heartbeat = _sent("heartbeat")
    _report = _sent("report")

    def heartbeat(self, node: str, **kwargs: Any) -> list[str]:
        return list(self._heartbeat(node, **kwargs) or [])

    def report(self, replica_id: str, event: dict[str, Any]) -> None:
        try:
            self._report(replica_id, event)
        except Refused:
            raise  # the agent stops: no report of this node will be taken any more
        except Exception:
            # The reader thread must go on to the next event; the heartbeat's books let the
            # control plane catch up with what a lost report said.
            log.exception("could not report %s of replica %s", event.get("event"), replica_id)
