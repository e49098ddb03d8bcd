"""The node agent: registers its node and GPUs, heartbeats, and runs a Celery worker on the
node's own queue (where the control plane sends replica work for this host)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import concurrency
from celery.signals import worker_ready
from celery.utils.log import mlevel
from celery.utils.nodenames import default_nodename, host_format
from django.conf import settings
from tenacity import Retrying, retry_if_exception, stop_after_delay, stop_when_event_set, wait_exponential

from gpuportal import orphans
from gpuportal.celery import app
from gpuportal.wire import memory, node_acl, node_labels, node_lease, replies
from gpuportal.wire.commands import ReplicaSpec, node_queue
from gpuportal.wire.control import ControlError, ControlPlane, Refused, unknown_node
from gpuportal.wire.node_auth import TOKEN_ENV, TOKEN_FILE_ENV
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor
from inference.devices import FOREIGN_ENV, VirtualProfile, discover, foreign_use, parse_virtual_foreign
from inference.gateway import RedisRefused, redis_refusal
from inference.supervisor import Supervisor

log = logging.getLogger(__name__)

# What the host is, and what it keeps off, key=value,... (gpuportal.wire.node_labels), where
# --labels and --taints do not say.
LABELS_ENV, TAINTS_ENV = "GPUPORTAL_NODE_LABELS", "GPUPORTAL_NODE_TAINTS"
# How long a registering agent waits for a control plane that cannot answer yet before it exits
# (and `up`, or its supervisor, starts it again): longer than a PostgreSQL restart or a worker's.
REGISTER_PATIENCE_S = 120.0

# The agent of this process, if it is one: node tasks run in its worker threads and use its
# supervisor, which owns this host's replica processes.
_current: NodeAgent | None = None


def current() -> NodeAgent:
    if _current is None:
        raise RuntimeError("this process is not a node agent: node tasks must run on `manage.py agent`")
    return _current


def supervisor() -> Supervisor:
    return current().supervisor


def node_name() -> str:
    return current().name


class CredentialRefused(ValueError):
    """The control plane refused this node's credential: the agent stops, with its replicas."""


class NodeRemoved(ControlError):
    """The control plane has no node of this agent's name any more: an operator removed it while
    this agent ran, cut off (scheduling.services.nodes.remove)."""


def refused_message(node: str, err: Exception) -> str:
    if isinstance(err, NodeRemoved):
        return (
            f"node {node}: the portal has no node of this name any more: it was removed while this agent ran "
            "(`gpuportal node rm`). Start the agent again to register the node anew"
        )
    if isinstance(err, RedisRefused):
        return (
            f"node {node}: {err}. A revoked node's own Redis user is deleted: issue the node a "
            f"credential again, make its user anew and give the agent the REDIS_URL that "
            f"`manage.py node_credential acl {node} --apply` prints"
        )
    return (
        f"node {node}: {err}. Issue it a credential (`gpuportal node add {node}`, or "
        f"`manage.py node_credential issue {node}`) and pass it to the agent in {TOKEN_FILE_ENV} "
        f"(or {TOKEN_ENV})"
    )


class NodeAgent:
    def __init__(
        self,
        name: str,
        *,
        control: ControlPlane,
        backend: str = "auto",
        virtual_spec: str | None = None,
        cpu_cache_bytes: int | None = None,
        host_ram_bytes: int | None = None,
        heartbeat_s: float | None = None,
        concurrency: int = 4,
        profile: VirtualProfile | None = None,
        virtual_foreign: dict[int, int] | None = None,
        warm_spares: bool | None = None,
        labels: Mapping[str, str] | None = None,
        taints: Mapping[str, str] | None = None,
    ):
        self.name = name
        # What the host is and what it keeps off (gpuportal.wire.node_labels), declared at every
        # registration.
        self.labels = dict(labels) if labels is not None else node_labels.parse(os.environ.get(LABELS_ENV, ""))
        self.taints = (
            dict(taints) if taints is not None else node_labels.parse(os.environ.get(TAINTS_ENV, ""), taints=True)
        )
        # The one way to the control plane (gpuportal.wire.control): this package never imports it.
        self.control = control
        # Its GPUs as discovered at registration.
        self.devices: list[DeviceInfo] = []
        self.profile = profile or VirtualProfile.from_env()
        # What other tenants hold on each virtual GPU, as the operator declared it (--virtual-foreign):
        # a real GPU's is read from NVML at every beat.
        self.virtual_foreign = (
            dict(virtual_foreign)
            if virtual_foreign is not None
            else parse_virtual_foreign(os.environ.get(FOREIGN_ENV, ""))
        )
        self.backend = backend
        self.virtual_spec = virtual_spec or settings.GPUPORTAL_VIRTUAL_GPUS
        # Default room for sleeping weights: half the host's RAM.
        self.cpu_cache_bytes = cpu_cache_bytes if cpu_cache_bytes is not None else psutil.virtual_memory().total // 2
        # What its host cache and replica processes may use together (scheduling.core.host_memory).
        self.host_ram_bytes = host_ram_bytes if host_ram_bytes is not None else psutil.virtual_memory().total
        self.heartbeat_s = heartbeat_s or settings.GPUPORTAL_HEARTBEAT_S
        self.concurrency = concurrency
        # One warm spare per GPU (inference.spare_pool), each holding a CUDA context there.
        self.warm_spares = settings.GPUPORTAL_WARM_SPARES if warm_spares is None else warm_spares
        self._stop = threading.Event()
        self._stop_requested = threading.Event()
        self.supervisor = Supervisor(
            Path(settings.GPUPORTAL_DATA_DIR) / "replicas" / name, exits=orphans.exits_dir(settings.GPUPORTAL_DATA_DIR)
        )
        self._heartbeat_thread: threading.Thread | None = None
        self._lease_thread: threading.Thread | None = None
        # The node's epoch (gpuportal.wire.node_lease): from the control plane at registration,
        # moved on only after every replica process of the old one has stopped.
        self.epoch = 0
        # Whether its GPUs are virtual (no NVML to ask): known for sure once it has registered.
        self.virtual = backend == "virtual"
        # Why the control plane refused this node's credential, once it has: the agent stops.
        self.refused: str | None = None
        # The lease's thread, the heartbeat's and every replica's reader may each be refused at
        # once: one of them stops the agent.
        self._fencing = threading.Lock()
        # Held while the lease is renewed and, when the node was written off, while the old
        # epoch's replicas stop: a replica starting meanwhile waits for the new epoch (start).
        self._epoch_lock = threading.Lock()

    @property
    def queue(self) -> str:
        return node_queue(self.name)

    def register(self) -> None:
        """Register the node with the replicas its previous agent left running (restart
        restores): the control plane keeps those whose books agree with what they say, and the
        first beat stops the others before the node takes new work."""
        devices = discover(self.name, backend=self.backend, virtual_spec=self.virtual_spec, profile=self.profile)
        virtual = all(d.virtual for d in devices)
        self.virtual = virtual
        self.devices = list(devices)
        adopted = self.supervisor.adopt_survivors(on_event=self.relay)
        survivors = [Survivor.from_hello(h) for h in [*adopted.values(), *self.supervisor.deep_sleepers().values()]]
        # A control plane that cannot answer yet (its worker restarting, PostgreSQL starting up) is
        # waited for rather than given up on: an agent that exited here would leave the replicas it
        # has just adopted to wait out another adoption window. Registering again is harmless (it
        # is how an agent rejoins), even after a try that was applied and lost its answer. A
        # refusal is final.
        retrying = Retrying(
            retry=retry_if_exception(lambda err: isinstance(err, ControlError) and not isinstance(err, Refused)),
            stop=stop_after_delay(REGISTER_PATIENCE_S) | stop_when_event_set(self._stop_requested),
            wait=wait_exponential(multiplier=0.2, max=5),
            before_sleep=lambda state: log.warning(
                "node %s could not register yet; retrying (%s)", self.name, state.outcome.exception()
            ),
            reraise=True,
        )
        registered = self._hold_lease_for_adopted(adopted)
        try:
            epoch = retrying(
                self.control.register_node,
                self.name,
                devices,
                hostname=socket.gethostname(),
                cpu_cache_bytes=self.cpu_cache_bytes,
                host_ram_bytes=self.host_ram_bytes,
                virtual=virtual,
                survivors=survivors,
                # None: not sent (gpuportal.wire.control.OPTIONAL).
                labels=self.labels or None,
                taints=self.taints or None,
            )
        finally:
            registered.set()
        self._hold_epoch(int(epoch or 0))
        log.info(
            "node %s registered: %d %s GPU(s), queue %s, epoch %d",
            self.name,
            len(devices),
            "virtual" if virtual else "NVIDIA",
            self.queue,
            self.epoch,
        )
        if survivors:
            self.supervisor.resume()
            refused = set(self.beat_once())
            for survivor in survivors:
                if survivor.replica_id in refused:
                    continue
                # Its last state event may have died with the old agent: the books catch up. One
                # that exited meanwhile is reported by its reader.
                with contextlib.suppress(KeyError, ProcessLookupError):
                    self.supervisor.send(survivor.replica_id, {"cmd": "resync"})

    def relay(self, replica_id: str, event: dict) -> None:
        """What a replica process said, to the control plane: the supervisor calls this on the
        replica's reader thread, so one replica's events arrive in the order it emitted them."""
        if event.get("event") == "pong":
            return  # answers ping_all: the heartbeat reads its figures from the supervisor
        try:
            self.control.report(replica_id, event)
        except Refused as err:
            self.fence(err)

    def fence(self, err: Exception) -> None:
        """The control plane no longer takes this node's word (its credential was revoked or
        replaced, or the node was removed), or Redis no longer takes its user: what its replicas
        serve is written off there, so the agent stops them and itself rather than serve on
        unheard."""
        with self._fencing:
            if self.refused is not None:
                return
            self.refused = refused_message(self.name, err)
        log.error("%s; stopping the agent and its replicas", self.refused)
        self._stop.set()  # no more beats: each would be refused too
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's warm shutdown, then stop()

    def start_heartbeat(self) -> None:
        self.renew_lease()  # held from registration on, not a beat later
        # The lease on a thread of its own: a beat waits up to 30 s for its answer (an agents'
        # worker far behind, a stalled database), three beats' lease would lapse meanwhile, and an
        # alive node would be written off for the control plane's slowness.
        self._lease_thread = threading.Thread(target=self._renew, name=f"lease-{self.name}", daemon=True)
        self._lease_thread.start()
        self._heartbeat_thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.name}", daemon=True)
        self._heartbeat_thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.renew_lease()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat_once()
            except Refused as err:
                self.fence(err)
            except Exception as err:
                if isinstance(err, ControlError) and unknown_node(self.name) in str(err):
                    # Removed while this agent ran: its replicas were written off with the node,
                    # and a beat brings back no node. It stops; started again, it registers anew.
                    self.fence(NodeRemoved(str(err)))
                else:
                    log.exception("heartbeat of node %s failed; retrying in %.0f s", self.name, self.heartbeat_s)

    def _hold_lease_for_adopted(self, adopted: dict[str, dict[str, Any]]) -> threading.Event:
        """The node's lease held, while the agent registers, under the epoch the replicas it has
        just adopted serve under; set the Event returned once it has registered.

        Why: the previous agent's last renewal lapses a lease after the heartbeat timeout, and
        the adoption window is shorter than that by two beats only. An agent that adopted its
        replicas near the window's end and then waited on a busy control plane for its
        registration left the node with neither a lease nor a recorded heartbeat: a sweep in
        between wrote off a node whose replicas served on and had just been adopted. Under their
        own epoch, the renewal is refused once the node has been written off (the epoch moved
        on): nothing the control plane gave up is revived. No adopted replica: nothing on the node
        is known to be alive, and nothing is held."""
        registered = threading.Event()
        epochs = [int(h["node_epoch"]) for h in adopted.values() if h.get("node_epoch") is not None]
        if not epochs:
            return registered
        epoch = max(epochs)
        if not self._renew_unregistered(epoch):
            return registered

        def hold() -> None:
            # Until registered, or written off: a lease refused once is refused at every beat after.
            while not registered.wait(self.heartbeat_s) and not self._stop.is_set():
                if not self._renew_unregistered(epoch):
                    return

        threading.Thread(target=hold, name=f"lease-{self.name}-registering", daemon=True).start()
        return registered

    def _renew_unregistered(self, epoch: int) -> bool:
        """One renewal before registration, under `epoch`; False once the node has been written off
        (its epoch moved on), which is only told: the registration that follows says what the
        control plane keeps of it. Redis unreachable is not that: the next beat tries again."""
        try:
            current = node_lease.renew(replies.client(settings.REDIS_URL), self.name, self._lease_ttl_s(), epoch)
        except redis.RedisError as err:
            log.warning("cannot hold node %s's lease while it registers (Redis: %s)", self.name, err)
            return True
        if current > epoch:
            log.info(
                "node %s was written off while its agent was away (epoch %d, its replicas' %d): not holding its lease",
                self.name,
                current,
                epoch,
            )
            return False
        return True

    def _lease_ttl_s(self) -> float:
        return node_lease.ttl_s(
            self.heartbeat_s, settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S, settings.GPUPORTAL_CONTROL_STALL_S
        )

    def renew_lease(self) -> None:
        """The node's lease in Redis, renewed straight there (gpuportal.wire.node_lease): when its
        heartbeats stop reaching the books (the agents' worker or PostgreSQL stalled), the lease
        still says the node is alive, and the control plane does not write it off; while it
        holds, the node's replicas take requests.

        A renewal that finds the epoch raised learns that the control plane wrote the node off
        (this agent was frozen or cut off): everything it runs was given up, and their work given
        to others. They are stopped before the lease is renewed under the new epoch, so that the
        node offers its GPUs again only once nothing of the old epoch holds them."""
        try:
            ttl = self._lease_ttl_s()
            client = replies.client(settings.REDIS_URL)
            with self._epoch_lock:
                current = node_lease.renew(client, self.name, ttl, self.epoch)
                if current > self.epoch:
                    self._fenced(current)
                    node_lease.renew(client, self.name, ttl, self.epoch)
        except redis.RedisError as err:
            refused = redis_refusal(err)
            if refused is not None:
                # Its lease cannot be renewed any more: the control plane will write it off, if
                # it has not already (a revocation deletes the node's Redis user first).
                self.fence(refused)
                return
            log.warning(
                "cannot renew node %s's lease (Redis: %s); retrying in %.0f s", self.name, err, self.heartbeat_s
            )

    def start(self, spec: ReplicaSpec) -> None:
        """Start a replica process under the node's epoch as Redis has it now.

        Why not the epoch the agent holds: a node written off while its agent was cut off comes
        back online once a beat of its is heard, and the lease's thread may not have seen the
        raised epoch by then, or may still be stopping the old epoch's replicas (seconds). A
        replica placed there meanwhile and started under the old epoch was refused at its first
        take and failed as superseded. The renewal here catches up first, or waits for the
        catch-up under way (_epoch_lock)."""
        self.renew_lease()
        self.supervisor.start(spec, on_event=self.relay)

    def _fenced(self, epoch: int) -> None:
        running = sorted(self.supervisor.states())
        log.warning(
            "node %s was written off by the control plane (its epoch went from %d to %d): stopping its %d "
            "replica process(es) before it takes new work",
            self.name,
            self.epoch,
            epoch,
            len(running),
        )
        self.supervisor.stop_written_off(running)
        self._hold_epoch(epoch)

    def _hold_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.supervisor.node_fence = NodeFence(self.name, epoch)

    def beat_once(self) -> list[str]:
        """One heartbeat. Replicas the control plane wrote off while this node was silent (a
        partition: the agent lived on) are stopped at once, and the beat is sent again so that
        the node comes back only once they are gone (nodes.heartbeat). Returns those stopped."""
        books = self.books()
        stale = self.control.heartbeat(self.name, books=books, **self.processes())
        if not stale:
            return []
        stopped = self.supervisor.stop_written_off(stale)
        self.control.heartbeat(self.name, books=None, **self.processes())
        return stopped

    def processes(self) -> dict[str, Any]:
        """What a beat says of the replica processes: those it runs, the state each last said it
        is in (from which the control plane sees a wake or a sleep that never arrived), and the
        host arenas they keep (a grant or a drop of one that never arrived), and the host RAM
        each holds beside its arena (placement counts the host's RAM)."""
        states = self.supervisor.states()
        return {
            "running": sorted(states),
            "processes": states,
            "arenas": self.supervisor.arenas(),
            "host_bytes": self.supervisor.host_bytes(),
            # The deep sleepers' copies it holds: the beat answers which are no longer wanted.
            "host_copies": sorted(self.supervisor.deep_sleepers()),
        }

    def books(self) -> Books:
        """What each replica process holds per GPU, for the control plane to check the books
        against: NVML's per-process figures on a real GPU, the replicas' own model of
        them on a virtual one (refreshed by a ping; the answers arrive for the next beat), and
        what other tenants hold on each GPU."""
        from inference.backends import nvml_memory

        running = self.supervisor.usage()
        self.supervisor.ping_all()
        # Read once: the foreign figures and the slots they name must agree within a beat.
        spares = self.supervisor.spare_slots()
        pids = {pid for pid, _, _ in running.values() if pid is not None}
        # The warm spares' too: what they hold is the node's, counted in their slots.
        seen = None if self.virtual else nvml_memory(pids | self.supervisor.spare_pids())
        by_pid, free = seen if seen is not None else (None, None)
        usage: dict[str, dict[str, int]] = {}
        states: dict[str, str] = {}
        for replica_id, (pid, reported, state) in running.items():
            measured = by_pid.get(pid) if by_pid is not None else None
            # Empty: NVML does not list the pid (a container without the host's PID namespace).
            figures = measured or reported
            if figures is not None:
                usage[replica_id] = figures
                states[replica_id] = state
        return Books(
            usage=usage,
            states=states,
            free_by_index=free,
            foreign_by_index=self.foreign(pids, by_pid, free, spares),
            spare_by_index=spares,
        )

    def foreign(
        self,
        pids: set[int],
        by_pid: dict[int, dict[str, int]] | None,
        free: dict[str, int] | None,
        spares: dict[str, int] | None = None,
    ) -> dict[str, int] | None:
        """What other processes than the node's replicas hold per GPU index: on a virtual GPU
        what the operator declared; on a real one NVML's used memory less the driver's reserve
        and what this node's replica processes and warm spares hold, read in the same pass. None
        where that cannot be told: no NVML, or a replica process NVML does not list (a container
        without the host's PID namespace, or one that has not made its context yet), whose
        memory would pass for another tenant's.

        Each GPU the node keeps a warm spare on adds its slot (inference.spare_pool): a context
        placement must leave alone, whether its spare is warm, starting, or just became a replica."""
        spares = self.supervisor.spare_slots() if spares is None else spares
        if self.virtual:
            return {
                str(d.index): self.virtual_foreign.get(d.index, 0) + spares.get(str(d.index), 0) for d in self.devices
            }
        if by_pid is None or free is None or any(pid not in by_pid for pid in pids):
            return None
        own: dict[str, int] = {}
        for figures in by_pid.values():
            for index, bytes_ in figures.items():
                own[index] = own.get(index, 0) + bytes_
        return {
            str(d.index): foreign_use(d.total_bytes, free[str(d.index)], own.get(str(d.index), 0))
            + spares.get(str(d.index), 0)
            for d in self.devices
            if str(d.index) in free
        }

    def stop(self, reason: str = "agent stopped") -> None:
        # The heartbeat first: a beat would bring the node back online while it leaves.
        self._stop.set()
        for thread in (self._heartbeat_thread, self._lease_thread):
            if thread is not None:
                thread.join(timeout=self.heartbeat_s + 5)
        try:
            node_lease.release(replies.client(settings.REDIS_URL), self.name)
        except redis.RedisError as err:
            log.warning("cannot release node %s's lease (Redis: %s); it expires by itself", self.name, err)
        if self.refused is not None:
            # Refused, its word counts for nothing: the control plane wrote the node off itself.
            self.supervisor.stop_all()
            return
        try:
            # Then out of placement, so that the replacements of its replicas go elsewhere.
            self.control.node_stopping(self.name, reason)
        except Exception:
            log.exception("could not mark node %s stopping", self.name)
        # Then the replicas: each reports `stopped` (releasing its reservation) while we can still write.
        self.supervisor.stop_all()
        try:
            self.control.node_stopped(self.name, reason)
        except Exception:
            log.exception("could not mark node %s stopped; the heartbeat timeout will", self.name)

    def run_worker(self, loglevel: str = "INFO") -> None:
        """Blocks until the worker shuts down (SIGTERM or SIGINT: a warm shutdown)."""
        # Its unacknowledged messages where its Redis user may keep them (gpuportal.wire.node_acl).
        app.conf.broker_transport_options = {**app.conf.broker_transport_options, **node_acl.unacked_keys(self.name)}
        # The worker itself, as `celery worker` builds it, without Celery's command line: importing
        # that (click, its REPL, every installed package's entry points) was a third of a second of
        # CPU at each agent's start on a 2-core machine, for options known here.
        worker = app.Worker(
            hostname=host_format(default_nodename(f"agent.{self.name}@%h")),
            queues=[self.queue],
            pool_cls=concurrency.get_implementation("threads"),
            concurrency=self.concurrency,
            loglevel=mlevel(loglevel.upper()),
            without_gossip=True,
            without_mingle=True,
        )
        worker.start()

    def run(self, loglevel: str = "INFO") -> None:
        global _current
        _current = self
        # A stop can be asked for while the agent registers, before Celery installs its own
        # signal handlers; without these the default action would kill the agent mid-way and
        # the node would wait out the heartbeat timeout instead of saying it stopped.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._early_stop)
        try:
            self.register()
        except Refused as err:
            # Its survivors, if any, were taken over and must not serve on unheard.
            self.supervisor.stop_all()
            raise CredentialRefused(refused_message(self.name, err)) from None
        # Once registered, when the agent knows whether its GPUs are virtual.
        if settings.GPUPORTAL_REPLICA_FORKSERVER == "all" or (
            settings.GPUPORTAL_REPLICA_FORKSERVER == "virtual" and self.virtual
        ):
            self.supervisor.use_forkserver(service=settings.GPUPORTAL_REPLICA_TEMPLATE_SOCKET)
        if self.warm_spares:
            self.keep_spares()
        self.start_heartbeat()
        try:
            if not self._stop_requested.is_set():
                worker_ready.connect(self._pass_on_early_stop, weak=False)
                self.run_worker(loglevel)
        finally:
            self.stop()
            self.supervisor.close()
        if self.refused is not None:
            raise CredentialRefused(self.refused)

    def keep_spares(self) -> None:
        """A warm spare on each of the node's GPUs, each held to hold a context there until it
        says what it does: the virtual profile's on a virtual GPU, an H100's on a real one."""
        backend = "virtual" if self.virtual else "cuda"
        context = self.profile.context_bytes if self.virtual else memory.H100_CONTEXT_BYTES
        self.supervisor.keep_spares(backend, [d.index for d in self.devices], context)
        log.info("node %s keeps a warm spare on each of its %d GPU(s)", self.name, len(self.devices))

    def _early_stop(self, signum: int, frame: object) -> None:
        self._stop_requested.set()

    def _pass_on_early_stop(self, **kwargs: object) -> None:
        # Celery has replaced our handlers by now: hand it the stop that arrived while it started.
        if self._stop_requested.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
