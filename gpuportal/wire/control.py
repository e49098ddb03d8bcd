"""The one gateway from a node agent to the control plane: everything an agent tells
the control plane, and the one thing it asks, as a Protocol, and how each call travels (Call,
encode_call, decode_call). The agent's side sends (inference.gateway.RemoteControl); the control
plane's applies (scheduling.services.node_gateway); neither imports the other. Django-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Protocol

from gpuportal.wire import node_labels
from gpuportal.wire.commands import VERSION, WireError
from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor
from gpuportal.wire.replies import NoAnswer


class ControlPlane(Protocol):
    def register_node(
        self,
        node: str,
        devices: Sequence[DeviceInfo],
        *,
        hostname: str,
        cpu_cache_bytes: int,
        virtual: bool,
        survivors: Sequence[Survivor],
        host_ram_bytes: int = 0,
        labels: Mapping[str, str] | None = None,
        taints: Mapping[str, str] | None = None,
    ) -> int:
        """The node is up with these GPUs; of the survivors, the control plane keeps those whose
        books agree and loses the rest, which the next heartbeat names. Returns the node's epoch,
        which the agent starts its replicas under and renews its lease with
        (gpuportal.wire.node_lease); an older control plane answered None, read as 0.

        `labels`: what the host is (gpuportal.wire.node_labels), which deployments' node selectors
        match; `taints`: what it keeps off the node, which deployments' tolerations must name.
        None, not sent. Added to version 1 with defaults (OPTIONAL): an agent without either
        registers with a control plane older than them as before."""

    def heartbeat(
        self,
        node: str,
        *,
        books: Books | None,
        running: Sequence[str],
        processes: Mapping[str, str] | None = None,
        arenas: Mapping[str, int] | None = None,
        host_bytes: Mapping[str, int] | None = None,
        host_copies: Sequence[str] | None = None,
    ) -> list[str]:
        """The node is alive; returns the running replicas the control plane has written off,
        for the agent to stop.

        `processes`: {replica id: the state its process last said it is in (inference.host's
        ReplicaHost.state: loading, serving, draining, sleeping, waking, ...; "" before it said
        any)} of the running replicas, from which the control plane sees that a wake or a sleep it
        sent never arrived (scheduling.services.lost_commands). Added to version 1 with a default:
        an agent that does not send it (an older one) gets no lost wake or sleep sent again.

        `arenas`: {replica id: bytes, 0 for none} of the host arenas the running replicas keep for
        their next sleep (a replica that has not said yet left out), from which the
        control plane sees that a grant or a drop of one never arrived. Added to version 1 with a
        default, like `processes`.

        `host_bytes`: {replica id: bytes} of host RAM each running replica's process holds outside
        its host arena (its proportional set size), for placement to count host RAM as a resource
        (scheduling.core.host_memory). Added to version 1 with a default, like `processes`.

        `host_copies`: the replica ids whose deep sleep copies (inference.host_copy) the node holds
        with no process reading them. Those the books no longer hold asleep on this node (parked,
        stopped, deleted, elsewhere) are returned with the written-off replicas, for the agent to
        delete. Added to version 1 with a default, like `processes`."""

    def node_stopping(self, node: str, reason: str) -> None:
        """Out of placement: the agent is leaving and stops its replicas next."""

    def node_stopped(self, node: str, reason: str) -> None: ...

    def report(self, replica_id: str, event: dict[str, Any]) -> None:
        """One event of a replica process, in the order it emitted them (one caller per replica)."""

    def replica_state(self, replica_id: str) -> str | None:
        """The replica's state in the books (None: it is gone): a command that waited in the queue
        is carried out only if the replica still waits for it."""


# -- the calls on the wire -------------------------------------------------------------------
# An agent's call travels as one Celery task on its own queue (`agents`), not the control queue:
# a report must not wait behind a placement or a preemption that holds the control worker's
# threads. The answer comes back on a Redis list named in the call, which the caller blocks on
# (not Celery's result backend: its Redis consumer is not safe to share between the agent's
# threads). One reader thread per replica waits for each answer before it sends the next
# report, so a replica's events are applied in the order it emitted them.

AGENT_QUEUE = "agents"
AGENT_CALL_TASK = "scheduling.tasks.agent_call"
CALLS = ("register_node", "heartbeat", "node_stopping", "node_stopped", "report", "replica_state")
# How long the agent waits for each call's answer where it is not the default: a beat that waits
# past the next one is stale, and a leaving agent does not wait long to say so.
TIMEOUTS_S: Mapping[str, float] = {"heartbeat": 30, "node_stopping": 10, "node_stopped": 10, "replica_state": 30}
# Arguments added to version 1 with a default: sent only when known, so that a call without them
# reads as it did before them.
OPTIONAL: Mapping[str, tuple[str, ...]] = {
    "heartbeat": ("processes", "arenas", "host_bytes"),
    "register_node": ("labels", "taints"),
}
# The calls whose first argument is the node they speak for; the others name a replica, which
# speaks for the node the books place it on.
NODE_CALLS = ("register_node", "heartbeat", "node_stopping", "node_stopped")


@dataclass(frozen=True)
class Call:
    name: str
    # The Redis list the answer is pushed to (gpuportal.wire.replies).
    reply_to: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The node's credential (gpuportal.wire.node_auth), checked before the call is applied. Added
    # to version 1 with a default: a call without one reads as it did before, and is refused
    # unless the control plane lets that node call without a credential.
    token: str | None = field(default=None, repr=False)

    def apply(self, control: ControlPlane) -> Any:
        return getattr(control, self.name)(*self.args, **self.kwargs)


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def encode_call(call: Call) -> dict[str, Any]:
    if call.name not in CALLS:
        raise WireError(f"unknown call {call.name!r} (known: {', '.join(CALLS)})")
    payload = {
        "v": VERSION,
        "call": call.name,
        "reply_to": call.reply_to,
        "args": _plain(list(call.args)),
        "kwargs": {k: _plain(v) for k, v in call.kwargs.items()},
    }
    if call.token is not None:
        payload["token"] = call.token
    return payload


def decode_call(payload: Any) -> Call:
    """The call as the control plane applies it, the report dataclasses rebuilt; a WireError for
    another version, an unknown call or bad fields."""
    if not isinstance(payload, dict):
        raise WireError(f"a call is a JSON object, not {type(payload).__name__}")
    if payload.get("v") != VERSION:
        raise WireError(f"call version {payload.get('v')!r} is not the control plane's ({VERSION}): upgrade one side")
    name, reply_to = payload.get("call"), payload.get("reply_to")
    if name not in CALLS:
        raise WireError(f"unknown call {name!r} (known: {', '.join(CALLS)})")
    if not isinstance(reply_to, str) or not reply_to:
        raise WireError(f"a {name} call names no reply_to list")
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise WireError(f"a {name} call with bad arguments")
    token = payload.get("token")
    if token is not None and not isinstance(token, str):
        raise WireError(f"a {name} call whose token is not a string")
    if not args or not isinstance(args[0], str):
        raise WireError(f"a {name} call names no {'node' if name in NODE_CALLS else 'replica'}")
    try:
        if name == "register_node":
            args = [args[0], [DeviceInfo(**d) for d in args[1]]]
            kwargs = {**kwargs, "survivors": [Survivor(**s) for s in kwargs.get("survivors", [])]}
            for pairs in ("labels", "taints"):
                if kwargs.get(pairs) is not None:
                    kwargs = {**kwargs, pairs: node_labels.checked(kwargs[pairs], pairs)}
        elif name == "heartbeat":
            if kwargs.get("books") is not None:
                kwargs = {**kwargs, "books": Books(**kwargs["books"])}
            if kwargs.get("processes") is not None:
                kwargs = {**kwargs, "processes": _process_states(kwargs["processes"])}
            for counted in ("arenas", "host_bytes"):
                if kwargs.get(counted) is not None:
                    kwargs = {**kwargs, counted: _byte_counts(counted, kwargs[counted])}
    except (IndexError, TypeError, ValueError) as err:
        raise WireError(f"a {name} call with bad fields: {err}") from None
    return Call(name, reply_to, tuple(args), kwargs, token=token)


def speaks_for(call: Call) -> tuple[str, str]:
    """What the call speaks for: ("node", its name) or ("replica", its id), whose node the books
    know (a token of one node cannot report for another's replica)."""
    return ("node" if call.name in NODE_CALLS else "replica", call.args[0])


def _process_states(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TypeError(f"processes must map replica ids to states, not {value!r:.200}")
    return {str(k): v for k, v in value.items()}


def _byte_counts(name: str, value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()
    ):
        raise TypeError(f"{name} must map replica ids to byte counts, not {value!r:.200}")
    return {str(k): v for k, v in value.items()}


class ControlError(NoAnswer):
    """The control plane could not carry out a call (its message), or did not answer in time."""


def unknown_node(name: str) -> str:
    """How the control plane says it has no node `name` (never registered, or removed since:
    scheduling.services.nodes.remove); an agent whose beat is answered so stops."""
    return f"no node named {name!r}"


class Refused(ControlError):
    """The control plane refused the node's credential (gpuportal.wire.node_auth): the call was
    not applied, and no call of this node will be until it has a valid one."""
