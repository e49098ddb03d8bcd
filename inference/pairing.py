"""A replica process as a member of a failover pair (seed 004): the linear life of an engine,

    init → standby (weights loaded, parked in host memory) → lock granted → waking → active → dead

or, for the primary that finds the lock free at start, init → lock → load → active. Only the
lock holder ever puts weights on the GPU, so the pair needs the active's memory once.

Liveness by state: the member reports each state as it enters it (`failover` events), and an
`alive` event every `liveness_every_s` on its own thread; the node agent kills an active member
that goes silent (hung, e.g. SIGSTOP), which ends its process and so passes the lock. A wake that
runs past `wake_timeout_s` ends the process here, for the same reason. The lock is the node's own
(inference.failover): a pair member needs Redis for its queue and fence, and no database. No Django here.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import redis

from gpuportal.wire.requestqueue import Fence, RequestQueue
from gpuportal.wire.states import FailoverState, ReplicaState
from inference.failover import FailoverMember, Grant, LeaseConfig, Stale
from inference.process_exit import exit_now as _exit

if TYPE_CHECKING:
    from inference.event_stream import EventWriter


class PairedHost(Protocol):
    """What a pair member drives of its replica's host (inference.host.ReplicaHost is one):
    declared here, so that this module need not import the host's."""

    replica_id: str
    state: str
    events: EventWriter
    fence: Fence | None
    serving_tags: dict[str, Any]

    def load(self) -> None: ...
    def load_standby(self) -> None: ...
    def wake_standby(self) -> None: ...
    def on_stale(self, reason: str) -> None: ...
    def where(self) -> dict[str, Any]: ...


log = logging.getLogger("inference.pairing")


def request_attempts() -> int:
    """How many times a request may be taken before it fails: the control plane's setting of the
    same name, which reaches the replica through its environment (the agent passes its own on).
    Read when used, not at import: a replica forked from a template (inference.forkserver) was
    imported under the template's environment, not its own."""
    return int(os.environ.get("GPUPORTAL_REQUEST_ATTEMPTS", "3"))


def give_back_from(requests: RequestQueue, deployment: str, grant: Grant, me: str) -> dict[str, str]:
    """What the dead active member had taken, back to the head of the queue at the lock grant
    itself, rather than when the control plane hears of the death: the request a caller has
    waited for longest is the first this member takes once awake. The same steps the control plane
    takes for a dead replica (write off, withdraw its claim, give back), so doing them first is
    harmless: the control plane then finds nothing left. {request id: "requeued" | "failed"}."""
    old = grant.previous_holder
    if not old or old == me:
        return {}
    try:
        requests.write_off(old)  # its takes from now on are refused: the grant proved it gone
        if deployment:
            requests.withdraw(deployment, old)
        reason = f"its failover partner {old[:8]} died; taken over at epoch {grant.epoch}"
        return requests.requeue_from(old, max_attempts=request_attempts(), reason=reason)
    except redis.RedisError as exc:  # the control plane gives them back when it hears of the death
        log.warning("could not give back what %s had taken: %s", old, exc)
        return {}


class PairMember:
    def __init__(
        self,
        host: PairedHost,
        requests: RequestQueue,
        config: LeaseConfig,
        *,
        role: str,
        fence_name: str,
        wake_timeout_s: float,
        liveness_every_s: float,
        deployment: str = "",
    ):
        self.host = host
        self.deployment = deployment
        self.requests = requests
        self.config = config
        self.role = role
        self.fence_name = fence_name
        self.wake_timeout_s = wake_timeout_s
        self.liveness_every_s = liveness_every_s
        self.state = FailoverState.INIT
        self.member = FailoverMember(config, on_event=self._lease_event)
        self._stop = threading.Event()

    @classmethod
    def from_args(cls, host: PairedHost, requests: RequestQueue, args: argparse.Namespace) -> PairMember:
        config = LeaseConfig(Path(args.failover_dir), args.failover_fence, host.replica_id)
        return cls(
            host,
            requests,
            config,
            role=args.role,
            fence_name=args.failover_fence,
            wake_timeout_s=args.wake_timeout,
            liveness_every_s=args.liveness_every,
            deployment=getattr(args, "deployment", "") or "",
        )

    def start(self, commands: queue.Queue[Any]) -> None:
        """On the main thread, in place of a plain replica's load."""
        self._report("init")
        threading.Thread(target=self._beat, name="failover-alive", daemon=True).start()
        grant = self.member.try_acquire() if self.role == "primary" else None
        if grant is not None:
            self._hold(grant)
            self.host.serving_tags = {"epoch": grant.epoch, "failover_state": FailoverState.ACTIVE}
            self.state = FailoverState.ACTIVE
            self.host.load()  # reports `serving` with the epoch: the services make it the active member
            return
        self.host.load_standby()
        self.state = FailoverState.STANDBY
        threading.Thread(target=self._wait_for_lock, args=(commands,), name="failover-wait", daemon=True).start()

    def _wait_for_lock(self, commands: queue.Queue[Any]) -> None:
        try:
            grant = self.member.acquire(self._stop)
        except InterruptedError:
            return
        except Stale as exc:
            reason = str(exc)
            commands.put(lambda: self._lost(reason))
            return
        except Exception as exc:  # the lock's folder cannot be used: nothing here can take over
            reason = f"cannot wait for the failover lock: {exc}"
            commands.put(lambda: self._fail(reason))
            return
        commands.put(lambda: self.take_over(grant))

    def take_over(self, grant: Grant) -> None:
        """The lock is ours, so the old active member is dead and its memory free: wake and serve."""
        if self.host.state != ReplicaState.STANDBY:  # stopping: the lock goes with the process
            return
        self.state = FailoverState.WAKING
        self._report("waking", epoch=grant.epoch)
        timer = threading.Timer(self.wake_timeout_s, self._wake_timed_out)
        timer.daemon = True
        timer.start()
        granted = grant.granted_monotonic
        try:
            self._hold(grant)
            fenced = time.monotonic()
            given_back = give_back_from(self.requests, self.deployment, grant, self.host.replica_id)
            requeued = time.monotonic()
            # A failure here (ReplicaFailure) ends the process through run(): the lock goes with it.
            self.host.wake_standby()
            woken = time.monotonic()
        finally:
            timer.cancel()
        self.state = FailoverState.ACTIVE
        self.host.serving_tags = {"epoch": grant.epoch, "failover_state": FailoverState.ACTIVE}
        self.host.state = ReplicaState.SERVING  # from here the serving thread takes requests
        self.host.events.emit(
            "active",
            epoch=grant.epoch,
            previous_holder=grant.previous_holder,
            previous_epoch=grant.previous_epoch,
            # From the grant (the old holder's process ended) to taking requests, and where that
            # time went: fencing the old holder's results, giving back what it had
            # taken, the wake (weights onto the GPU, the KV pool).
            takeover_s=time.monotonic() - granted,
            steps={
                "fenced_s": round(fenced - granted, 6),
                "given_back_s": round(requeued - granted, 6),
                "woken_s": round(woken - granted, 6),
            },
            given_back=len(given_back),
            pid=os.getpid(),
            **self.host.where(),
        )

    def _hold(self, grant: Grant) -> None:
        # The epoch goes to Redis before any request is taken, so the old holder's late results
        # are refused from the first one on.
        current = self.requests.raise_epoch(self.fence_name, grant.epoch)
        if current != grant.epoch:
            self._lost(f"granted epoch {grant.epoch}, but results are already fenced at epoch {current}")
        self.host.fence = Fence(self.fence_name, grant.epoch)

    def _beat(self) -> None:
        while not self._stop.wait(self.liveness_every_s):
            self.host.events.emit("alive", failover_state=self.state)

    def _report(self, state: str, **fields: Any) -> None:
        self.host.events.emit("failover", state=state, **fields)

    def _lease_event(self, what: str, **fields: Any) -> None:
        self.host.events.emit("lease", what=what, **fields)

    def _lost(self, reason: str) -> None:
        self.host.on_stale(reason)

    def _fail(self, reason: str) -> None:
        self.host.events.emit("failed", reason=reason, kind="crash")
        _exit(1)

    def _wake_timed_out(self) -> None:
        # Seed 004: a hung wake must not go unnoticed; dying frees the lock.
        self._fail(f"the takeover's wake ran past its timeout of {self.wake_timeout_s:.0f} s")
