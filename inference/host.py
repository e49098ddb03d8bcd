"""A replica's host: the one object in a replica process that holds its model and moves it
between states (load, serve, drain, sleep, wake, stop, a failover standby's takeover) on a
backend (inference.backends), with the serving threads (inference.serving) taking requests while
it serves. The process around it is inference.replica; no Django."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.requestqueue import Fence
from gpuportal.wire.states import PROCESS_STARTING
from gpuportal.wire.states import ReplicaState as S
from inference import load_slots
from inference.backends import (
    Backend,
    CommandRejected,
    Placement,
    ReplicaFailure,
    VirtualBackend,
    check_cap,
    classify_failure,
    mib,
)
from inference.event_stream import EventWriter
from inference.hub import local_model_dir
from inference.lazy_imports import from_transformers
from inference.load_progress import LoadGauge
from inference.loaders import DIRECTORY_LOADERS, EMBEDDING
from inference.process_exit import exit_now as _exit
from inference.serving import Executor

if TYPE_CHECKING:
    from torch import nn

    from gpuportal.wire.memory import MemoryEstimate, ModelShape
    from inference.embedding import Recipe
    from inference.lora import Adapters
    from inference.paged import PagedModel

log = logging.getLogger("inference.replica")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The deployment's default memory.max_tokens: what the activation budget was sized for when the
# agent does not say (scheduling.services.deployments' default).
DEFAULT_KV_MAX_TOKENS = 2048
# Once aborted, a generation stops at its next token; a forward pass runs to its end. Say so in the
# log at this interval while waiting for it.
_ABORT_LOG_EVERY_S = 10.0


class ReplicaHost:
    """One replica's model and its lifecycle: load, sleep (to cache), wake (from cache), stop.

    Transitions run one at a time on the main thread; those that move or drop the weights do it
    under `lock`, which the serving thread holds while it runs a request, so a request never sees
    weights half-way to the CPU. Sleep and stop do not wait for the request on that lock: they
    drain first (see `drain`), with the lock free, and take it once nothing is in flight.
    """

    def __init__(
        self,
        *,
        replica_id: str,
        source: str,
        loader: str,
        dtype: str,
        placement: Placement,
        backend: Backend,
        events: EventWriter,
        kv_max_tokens: int = DEFAULT_KV_MAX_TOKENS,
        context_bytes: int = 0,
        standby_context_bytes: int = 0,
        node_fence: NodeFence | None = None,
        host_copy: Path | None = None,
        adapters: str = "",
        prefix_cache: str = "user",
    ):
        self.replica_id = replica_id
        # Whose requests share its KV cache's kept prompts (gpuportal.wire.prefix_cache.MODES).
        self.prefix_cache = prefix_cache
        # The deployment's LoRA adapters (gpuportal.wire.adapters), read with the model at each load;
        # served by the paged engine (inference.lora), their stacks made again at each wake.
        self.adapter_text = adapters
        self.adapters: Adapters | None = None
        # What their stacks take where the model is (what the scheduler counted for them), once read.
        self.adapter_bytes = 0
        # Woken from deep sleep: the node's copy of its weights (inference.host_copy), read
        # instead of `source`'s; None for a load from disk.
        self.host_copy = host_copy
        # Its node's epoch at its start: what it takes and writes is refused once the control
        # plane writes the node off (gpuportal.wire.node_lease).
        self.node_fence = node_fence
        self.source = source
        self.loader = loader
        self.dtype = dtype
        self.placement = placement
        self.backend = backend
        self.events = events
        self.model: nn.Module | None = None
        self.weights_bytes = 0
        self.residual_bytes_by_id: dict[str, int | None] = {}
        self.tokenizer: Any | None = None
        # An encoder's embedding recipe (a transformers-embedding deployment); None for others.
        self.recipe: Recipe | None = None
        # Set while serving: the serving thread waits on it rather than polling the state.
        self.accepting = threading.Event()
        self._state = PROCESS_STARTING
        self.lock = threading.RLock()
        # The barrier: requests in flight, counted under `_flight` together with the state check,
        # and the flag a drain sets at its deadline to cut the request in flight short.
        self._flight = threading.Condition(threading.Lock())
        self._in_flight = 0
        self.abort = threading.Event()
        # Failover pair members (inference.pairing): the epoch results are written under, and
        # fields added to the `serving` event (the epoch, the liveness state).
        self.fence: Fence | None = None
        self.serving_tags: dict[str, Any] = {}
        # The KV block pool, sized from the cap with gpuportal.wire.memory's formula: the
        # activation budget for kv_max_tokens (the deployment's max_tokens) and the CUDA context
        # are what the scheduler counted in the reservation besides the weights and the pool.
        self.kv_max_tokens = kv_max_tokens
        self.context_bytes = context_bytes
        # In a failover pair the reservation also holds the standby's context: never the pool's.
        self.standby_context_bytes = standby_context_bytes
        if hasattr(backend, "outside_allocator"):
            backend.outside_allocator = context_bytes + standby_context_bytes
        self.paged: PagedModel | None = None
        # What this replica holds serving at max_tokens, composed from measured parts with
        # gpuportal.wire.memory's formula: the need it reports, and what the pool was sized against.
        self.footprint: MemoryEstimate | None = None
        # The allocator's bytes for the pool actually allocated (more than max_tokens' when the
        # reservation is larger, as an override can make it).
        self.pool_bytes = 0
        # Called as the replica stops taking requests, before the change is reported (the
        # serving loop withdraws its claim to take them: inference.serving.Server).
        self.on_stop_taking: Callable[[], None] | None = None
        # The thread allocating a kept arena (`keep_arena`), while it runs: whoever touches the
        # backend's spare next (a sleep, a drop, a stop) joins it first (`_settle_spare`).
        self._preparing: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if value == S.SERVING:
            self.accepting.set()
        else:
            self.accepting.clear()
            if self.on_stop_taking is not None:
                self.on_stop_taking()

    def executor(self) -> Executor:
        embedder = None
        if self.recipe is not None:
            from inference.embedding import Embedder

            # Built per request, around the model as it is now (a wake may have moved it).
            embedder = Embedder(self.model, self.tokenizer, self.recipe)
        return Executor(self.model, self.tokenizer, self.abort, embedder)

    # -- the barrier ---------------------------------------------------------------------------

    def begin_request(self) -> bool:
        """The serving thread, before running a request: False if the replica no longer serves."""
        with self._flight:
            if self.state != S.SERVING or self.model is None:
                return False
            self._in_flight += 1
            return True

    def end_request(self) -> None:
        """The serving thread, once the request's outcome (or its return to the queue) is recorded."""
        with self._flight:
            self._in_flight -= 1
            self._flight.notify_all()

    def drain(self, timeout_s: float, state: str = S.DRAINING) -> bool:
        """Stop taking requests (`state`), let the one in flight finish for up to `timeout_s`, then
        cut it short; returns once nothing is in flight. True if it finished on its own.

        Called without `lock`: the serving thread holds it while the request runs.
        """
        with self._flight:
            self.abort.clear()
            # Under the same mutex as begin_request's check: a request either started before this
            # (and is counted) or sees the new state and goes back to the queue untouched.
            self.state = state
            if self._flight.wait_for(lambda: self._in_flight == 0, timeout_s):
                return True
            log.warning(
                "%s: a request still running after the drain timeout of %.1f s; cutting it short",
                self.replica_id,
                timeout_s,
            )
            self.abort.set()
            try:
                # A generation stops at its next token and gives itself back; a forward pass cannot be
                # interrupted and runs to its end.
                while not self._flight.wait_for(lambda: self._in_flight == 0, _ABORT_LOG_EVERY_S):
                    log.warning("%s: still waiting for the aborted request to return", self.replica_id)
            finally:
                self.abort.clear()
            return False

    # -- transitions -------------------------------------------------------------------------

    def load(self) -> None:
        if self.host_copy is not None and self.host_copy.exists():
            self._load_host_copy(self.host_copy)
            return
        if self.host_copy is not None:
            # Gone (its node restarted, a full /dev/shm): the disk still has the weights.
            log.warning("%s: no host copy at %s; loading from disk", self.replica_id, self.host_copy)
        with self.lock, self._failing_as("load"):
            started = time.monotonic()
            self.state = S.LOADING
            self._progress(0, f"starting on {self.backend.name} GPUs {list(self.placement.gpus)}")
            from inference.loaders import validate_source

            # Before the slow imports and the device: a mistyped directory fails in milliseconds.
            validate_source(self.source, self.loader)
            with self._load_slot():
                self._progress(10, "preparing the device")
                self.backend.attach(self.placement)
                self._progress(25, f"loading weights from {self.source} ({self.loader}, {self.dtype})")
                expected = self._expected_weight_bytes()
                with LoadGauge(
                    self.backend.loaded_bytes,
                    expected,
                    lambda percent, held: self._progress(percent, f"loading weights: {mib(held)} of {mib(expected)}"),
                    low=25,
                    high=85,
                ):
                    model = self.backend.load(self.source, self.loader, self.dtype, self.placement)
                self.tokenizer = load_tokenizer(self.source, self.loader)
                self.recipe = load_recipe(self.source, self.loader)
                self._read_adapters()
                self._progress(85, "checking placement and memory cap")
                self._adopt(model, self.placement)
                self._allocate_pool()
            self._progress(100, f"loaded {mib(self.weights_bytes)} in {time.monotonic() - started:.1f} s")
            self.state = S.SERVING
            self.events.emit("serving", pid=os.getpid(), **self.where(), **self.serving_tags)

    def _load_host_copy(self, path: Path) -> None:
        """A wake from deep sleep: the model's skeleton from its source's configuration, its
        weights from the node's host copy, packed into an arena and copied to the GPU as a wake
        from the first level is (inference.host_copy). The copy is deleted once the weights are
        this process's own: from then on it is an awake replica like any other."""
        from inference import host_copy
        from inference.loaders import empty_model

        with self.lock, self._failing_as("load"):
            started = time.monotonic()
            self.state = S.LOADING
            self._progress(0, f"waking from deep sleep on {self.backend.name} GPUs {list(self.placement.gpus)}")
            model = empty_model(self.source, self.loader, self.dtype)
            try:
                host_copy.assign(model, host_copy.load(path))
            except (OSError, RuntimeError, ValueError) as exc:
                raise ReplicaFailure("load", f"the host copy {path} cannot be read: {exc}") from exc
            self.tokenizer = load_tokenizer(self.source, self.loader)
            self.recipe = load_recipe(self.source, self.loader)
            self._read_adapters()
            self._progress(25, f"copying {mib(path.stat().st_size)} from the host copy")
            self.backend.hold_in_arena(model)
            host_copy.forget(path)
            self.model = model
            self._wake_onto(self.placement)
            self._progress(100, f"woke from deep sleep in {time.monotonic() - started:.1f} s")
            self.state = S.SERVING
            self.events.emit("serving", pid=os.getpid(), **self.where(), **self.serving_tags)

    def load_standby(self) -> None:
        """A failover standby's init: the same weights, loaded and parked in host memory at once."""
        with self.lock, self._failing_as("load"):
            started = time.monotonic()
            self.state = S.LOADING
            self._progress(0, f"starting as a standby on {self.backend.name} GPUs {list(self.placement.gpus)}")
            from inference.loaders import tensor_bytes, validate_source

            validate_source(self.source, self.loader)
            with self._load_slot():
                self._progress(25, f"loading weights from {self.source} into host memory")
                model, residual = self.backend.load_to_cache(self.source, self.loader, self.dtype, self.placement)
                self.tokenizer = load_tokenizer(self.source, self.loader)
                self.recipe = load_recipe(self.source, self.loader)
                self._read_adapters()
            self.weights_bytes = tensor_bytes(model)
            # A standby that could never wake into its reservation is no standby: fail now, not at
            # takeover, when its active is gone. Its KV pool too: its pair's reservation was sized for
            # the max_tokens of its placement, which may have grown since.
            check_cap(self.weights_bytes, self.placement, self._outside_allocator())
            self.model = model
            self._size_pool()
            self.residual_bytes_by_id = residual
            self._progress(100, f"standing by with {mib(self.weights_bytes)} in {time.monotonic() - started:.1f} s")
            self.state = S.STANDBY
            # The warm-up a GPU standby ran (inference.warmup): null where none ran (a virtual GPU).
            warm = getattr(self.backend, "warm_up", None)
            self.events.emit(
                "standby",
                pid=os.getpid(),
                weights_bytes=self.weights_bytes,
                residual_bytes_by_id=residual,
                warm_up=warm.as_event() if warm is not None else None,
            )

    def wake_standby(self) -> None:
        """Onto the memory the dead active member freed (the lock grant proved it is gone)."""
        with self.lock:
            self._require(S.STANDBY, "take over")
            with self._failing_as("load"):
                self.state = S.WAKING
                check_cap(self.weights_bytes, self.placement, self._outside_allocator())
                self._wake_onto(self.placement)
            if self.backend.spare is not None:
                self._emit_arena(self.backend.spare.nbytes)  # the standby's arena, kept by its takeover

    def on_stale(self, reason: str) -> None:
        """Our failover epoch was superseded, or the control plane wrote us off and gave our
        requests back (gpuportal.wire.requestqueue.Fenced): stop serving at once and exit, so two
        never answer one request."""
        self.accepting.clear()
        self._state = "stale"
        log.error("%s: %s; exiting", self.replica_id, reason)
        self.events.emit("failed", reason=f"superseded: {reason}", kind="stale")
        _exit(1)

    def on_queue_lost(self, reason: str) -> None:
        """Redis stayed away longer than the serving loop waits (inference.serving.PatientQueue):
        fail and exit, so the control plane gives back what this replica took and replaces it."""
        self.accepting.clear()
        self._state = S.FAILED
        log.error("%s: %s; exiting", self.replica_id, reason)
        self.events.emit("failed", reason=reason, kind="crash")
        _exit(1)

    def sleep(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        # Transitions all run on the main thread: no other can change the state under this check.
        if self.state == S.SLEEPING:  # a retried sleep: already done
            self._emit_sleeping()
            return
        self._require(S.SERVING, "sleep")
        with self._failing_as("crash"):
            # State first, so nothing new starts; the request in flight finishes or is given back.
            self.drain(drain_timeout_s, S.DRAINING)
            with self.lock:
                assert self.model is not None
                # A kept arena still being allocated is waited for: still faster than a fresh one,
                # and the sleep never packs into one half-made.
                self._settle_spare()
                self._release_pool()  # before to_cache, whose empty_cache then returns its memory
                self.residual_bytes_by_id = self.backend.to_cache(self.model, self.placement)
                self.state = S.SLEEPING
                self._emit_sleeping()

    def wake(self, gpus: Any, reserved_bytes_by_gpu: Any, fraction: Any = None) -> None:
        try:
            target = Placement.parse(gpus, reserved_bytes_by_gpu, fraction)
        except ValueError as exc:
            raise CommandRejected(f"bad wake: {exc}") from None
        with self.lock:
            if self.state == S.SERVING and target == self.placement:
                self.events.emit("woken", **self.where())  # a retried wake: already done
                return
            self._require(S.SLEEPING, "wake")
            with self._failing_as("load"):
                self.state = S.WAKING
                # Before moving anything: a reservation too small for the weights fails like a CUDA OOM would.
                check_cap(self.weights_bytes, target, self._outside_allocator())
                self._wake_onto(target)
                self.state = S.SERVING
                self.events.emit("woken", **self.where())
            if self.backend.keep_arena:
                self._keep_spare()  # the arena the wake kept, or one prepared now

    def deepen(self, path: Any) -> None:
        """Sleep deeply: the weights this sleeper holds in its arena go to the node's host copy at
        `path` (inference.host_copy), then everything this process holds is let go and it says
        `deep_sleeping`; the process exits after (inference.replica.run)."""
        from inference import host_copy

        if not isinstance(path, str) or not path:
            raise CommandRejected(f"bad deepen: path must be a file's path, got {path!r}")
        with self.lock:
            self._require(S.SLEEPING, "sleep deeply")
            assert self.model is not None
            started = time.monotonic()
            try:
                written = host_copy.save(self.model, Path(path))
            except (OSError, RuntimeError) as exc:
                # /dev/shm full, say (OSError; RuntimeError should torch's archive writer fail on
                # its own): it stays asleep as it was, and the control plane hears why.
                raise CommandRejected(f"cannot write the host copy {path}: {exc}") from None
            self.model = None
            self.backend.release()
            self.state = S.DEEP_SLEEPING
            log.info(
                "%s: %s written to the host copy in %.2f s", self.replica_id, mib(written), time.monotonic() - started
            )
            self.events.emit("deep_sleeping", host_copy_bytes=written)

    def stop(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        # A scale-down loses nothing: the request in flight finishes or goes back to its queue.
        self.drain(drain_timeout_s, S.STOPPING)
        with self.lock:
            self.state = S.STOPPING
            self._settle_spare()  # then released with the rest: nothing is left allocating one
            self._release_pool()
            self.model = None
            self.backend.release()
            self.state = S.STOPPED
            self.events.emit("stopped")

    # -- commands ------------------------------------------------------------------------------

    def handle(self, command: Mapping[str, Any]) -> None:
        """Run one command; a refused one is answered with an `error` event and changes nothing."""
        name = command.get("cmd")
        try:
            if name == "ping":
                self.ping()
            elif name == "sleep":
                self.sleep(drain_timeout(command))
            elif name == "wake":
                self.wake(command.get("gpus"), command.get("reserved_bytes_by_gpu"), command.get("fraction"))
            elif name == "stop":
                try:
                    drain = drain_timeout(command)
                except CommandRejected as exc:  # a stop is never refused: drain for the default instead
                    log.warning("stop: %s; draining for %.0f s", exc, DEFAULT_DRAIN_TIMEOUT_S)
                    drain = DEFAULT_DRAIN_TIMEOUT_S
                self.stop(drain)
            elif name == "arena":
                self.keep_arena(command.get("keep"))
            elif name == "deepen":
                self.deepen(command.get("path"))
            else:
                raise CommandRejected(f"unknown command {name!r} (known: sleep, wake, stop, ping, arena, deepen)")
        except CommandRejected as exc:
            log.warning("refused %s: %s", name, exc)
            self.events.emit("error", cmd=name, reason=str(exc))

    def keep_arena(self, keep: Any) -> None:
        """The control plane's word on a kept arena (gpuportal.wire.commands.KeepArena): with
        `keep`, a serving replica prepares one in the background and a sleeping one keeps the
        arena it wakes from; without, the one held is freed. The control plane counts it in the
        node's host cache from its grant (before this replica has allocated anything) until it
        takes it back; the `arena` event only tells it the size allocated."""
        if not isinstance(keep, bool):
            raise CommandRejected(f"bad arena: keep must be true or false, got {keep!r}")
        self.backend.keep_arena = keep
        if not keep:
            self._settle_spare()  # one being allocated is freed once it is whole
            if dropped := self.backend.drop_spare():
                log.info("%s: dropped its kept arena of %s", self.replica_id, mib(dropped))
                self._emit_arena(0)
        elif self.state == S.SERVING:
            self._keep_spare()
        # Asleep, standing by: the wake keeps the arena it reads. Elsewhere (stopping, failed):
        # nothing to keep.

    def ping(self) -> None:
        # No lock: a ping must be answered even while a load holds it for minutes.
        spare = self.backend.spare  # read once: a sleep may take it meanwhile
        self.events.emit(
            "pong",
            state=self.state,
            pid=os.getpid(),
            kv=self.kv_stats(),
            process_bytes_by_id=self.process_bytes_by_id(),
            # The arena it keeps for its next sleep (0: none): the heartbeat shows the control plane
            # a grant or a drop that never arrived (scheduling.services.lost_commands).
            arena_bytes=spare.nbytes if spare is not None else 0,
        )

    def kv_stats(self) -> dict[str, Any] | None:
        """The pool's statistics for events (the replica's `kv` in docs/api.md); None without a pool."""
        paged = self.paged  # read once: the main thread may drop it meanwhile
        return paged.pool.stats().as_event() if paged is not None else None

    # -- helpers -------------------------------------------------------------------------------

    def _wake_onto(self, placement: Placement) -> None:
        """The weights out of the arena onto `placement`'s GPUs, the KV pool allocated while they copy.

        from_cache only queues the host-to-device copies (inference.arena.unpack_async). What runs
        before the wait needs the weights' devices, shapes and sizes, never their values: the cap
        check, the pool's sizing and allocation (NVML and allocator figures, an empty tensor). So
        on a GPU it overlaps the copies. Whatever reads a weight (a forward pass, the serving
        thread, whose requests wait for the `serving` state the caller sets) comes after it.
        """
        assert self.model is not None
        model, copies = self.backend.from_cache(self.model, placement)
        try:
            self._adopt(model, placement)
            self._allocate_pool()
        finally:
            # ONE synchronisation, and only then is the arena's pinned host buffer freed (or kept, for
            # a replica allowed to): even when the cap or the pool fails, the copies may still be
            # reading it (PendingCopies).
            copies.wait()
            self.backend.collect_kept(copies)

    def _adopt(self, model: nn.Module, placement: Placement) -> None:
        from inference.loaders import tensor_bytes

        self.backend.verify(model, placement)
        self.weights_bytes = tensor_bytes(model)
        check_cap(self.weights_bytes, placement, self._outside_allocator())
        self.model = model
        self.placement = placement

    def where(self) -> dict[str, Any]:
        from inference.loaders import parameter_devices

        by_id = self.process_bytes_by_id()
        footprint = self.footprint
        return {
            "weights_bytes": self.weights_bytes,
            "process_bytes": sum(by_id.values()) if by_id is not None else None,
            "process_bytes_by_id": by_id,
            # The measured need: what one replica of this deployment holds serving at
            # max_tokens, part by part; the control plane reserves exactly this for the next.
            "need_bytes": footprint.total_bytes if footprint is not None else None,
            "footprint": footprint.parts() if footprint is not None else None,
            "context_bytes": footprint.context_bytes if footprint is not None else None,
            "context_measured_bytes": self.backend.context_bytes_measured(self.placement) or None,
            "gpu_mem_bytes_by_id": dict(self.placement.reserved_bytes_by_gpu),
            "gpus": list(self.placement.gpus),
            # The fraction the allocator was given (a real GPU's backend computes it against the
            # device's own total; elsewhere the placement's).
            "fraction": getattr(self.backend, "fraction", None) or self.placement.fraction,
            "param_devices": sorted(parameter_devices(self.model)) if self.model is not None else [],
            "kv": self.kv_stats(),
        }

    def _outside_allocator(self) -> int:
        return self.context_bytes + self.standby_context_bytes

    def process_bytes_by_id(self) -> dict[str, int] | None:
        """What NVML shows of this process per GPU; on a virtual GPU, what it would show: the
        context, and while the weights are on the GPU the allocator's segments for them, the
        pool and the activation reserve (the working set a forward pass leaves cached).

        The pool's two allocations are rounded up by the allocator, but that rounding is part of
        the activation reserve in the formula both planes size by (gpuportal.wire.memory): the
        working set is the reserve less it. Counting it on top of a whole reserve, as this model
        once did, showed a replica up to 4 MiB over a reservation the scheduler had sized right,
        whenever the cap below did not clip it (after a wake, the context has grown past the one
        the cap was computed with)."""
        measured = self.backend.process_bytes_by_id()
        if measured is not None or not isinstance(self.backend, VirtualBackend):
            return measured
        held = self.backend.residual(self.placement)
        if self.model is not None and self.state in {S.SERVING, S.DRAINING, S.STOPPING, S.WAKING}:
            from gpuportal.wire import memory
            from inference.loaders import weight_allocation_bytes

            activation = self.footprint.activation_bytes if self.footprint is not None else 0
            pool = 2 * memory.allocation_bytes(self.pool_bytes // 2)  # K and V, one allocation each
            working = max(0, activation - (pool - self.pool_bytes))
            wanted = weight_allocation_bytes(self.model) + self.adapter_bytes + pool + working
            for gpu, nbytes in self._spread_over_gpus(wanted).items():
                held[gpu] += nbytes
        return held

    def _spread_over_gpus(self, nbytes: int) -> dict[str, int]:
        """What the allocator holds of `nbytes` on each GPU of a virtual placement: on one GPU, all
        of it; over several, as accelerate's balanced device map lays a model over them (in
        proportion to each GPU's room). Never past a GPU's room: its reservation, less what sits
        beside the allocator (the context(s), on the first GPU), which a real allocator never takes
        (set_per_process_memory_fraction, max_memory). Counting a two-GPU replica's every byte on
        its first GPU, as this model once did, showed that GPU twice over-committed."""
        first = str(self.placement.gpus[0])
        rooms = {
            gpu: max(0, reserved - (self._outside_allocator() if gpu == first else 0))
            for gpu, reserved in self.placement.reserved_bytes_by_gpu.items()
        }
        room = sum(rooms.values())
        nbytes = max(0, min(nbytes, room))
        spread = {gpu: nbytes * share // room if room else 0 for gpu, share in rooms.items()}
        # What the integer shares leave (a few bytes) goes where the first GPU's room allows.
        spread[first] += min(nbytes - sum(spread.values()), rooms[first] - spread[first])
        return spread

    def _allocate_pool(self) -> None:
        """The KV pool sized inside the reservation (`_size_pool`) and allocated. A model that
        cannot be paged (not Llama-style, spread over GPUs) keeps generate()."""
        from gpuportal.wire import memory
        from inference.paged import engine_for

        self.paged = None
        self.pool_bytes = 0
        sized = self._size_pool()
        if sized is None:
            return
        shape, weights, context, overhead = sized
        block_tokens = memory.DEFAULT_BLOCK_TOKENS
        self.paged = engine_for(
            self.model,
            weights_bytes=weights,
            cap_bytes=self.placement.reserved_total,
            max_tokens=self.kv_max_tokens,
            context_bytes=context,
            standby_context_bytes=self.standby_context_bytes,
            overhead_bytes=overhead,
            block_tokens=block_tokens,
            adapters=self.adapters,
        )
        pool = self.paged.pool
        self.pool_bytes = memory.kv_pool_bytes(shape, pool.blocks_total, block_tokens)
        log.info(
            "%s: KV pool of %d blocks x %d tokens (%s) for %d tokens; footprint %s",
            self.replica_id,
            pool.blocks_total,
            pool.block_tokens,
            mib(pool.tensor_bytes),
            pool.capacity_tokens,
            self.footprint.describe() if self.footprint else "",
        )

    def _size_pool(self) -> tuple[ModelShape, int, int, int] | None:
        """Compose the footprint from measured parts, then size the KV pool inside the reservation
        with the scheduler's own formula (gpuportal.wire.memory): what the reservation leaves after the
        weights as allocated, the activation budget for max_tokens, the CUDA context(s) and what
        the process holds outside the allocator. A pool that cannot hold one request of max_tokens
        fails the load or wake, naming the bytes, before the replica takes anything. The model's
        shape, weights, context and overhead for the pool; None where no pool is made."""
        from gpuportal.wire import memory
        from inference.loaders import weight_allocation_bytes
        from inference.paged import model_shape, unsupported_reason

        if self.model is None:
            return None
        # The adapters' stacks live beside the weights, and are counted with them, as the deploy's estimate counts them.
        weights = weight_allocation_bytes(self.model) + self.adapter_bytes
        # The larger of what the reservation counted and what this process holds now (a real
        # context grows as the first forward passes load kernels; the GPU row has the grown one).
        context = max(self.context_bytes, self.backend.context_bytes_measured(self.placement))
        overhead = self.backend.outside_allocator_bytes(self.placement, context)
        shape = None
        # An encoder keeps no KV cache: its footprint is its weights and the activation floor, as
        # its deploy-time estimate (inference.inspection), and its passes are sized to fit it.
        if self.tokenizer is not None and self.recipe is None:
            try:
                shape = model_shape(self.model, weights)
            except (AttributeError, TypeError, ValueError) as exc:  # a config without the usual fields
                log.warning("%s: no model shape for the memory formula (%s)", self.replica_id, exc)
        self.footprint = self._compose_footprint(shape, weights, context, overhead)
        reason = "it has no shape to page" if shape is None else unsupported_reason(self.model) or self._spread_reason()
        if reason is not None and self.adapters is not None:
            raise ReplicaFailure(
                "load",
                f"cannot serve adapters {', '.join(self.adapters.names)}: adapters are served by the paged engine, "
                f"and this model cannot be paged ({reason})",
            )
        if shape is None:
            return None
        if reason is not None:
            log.warning("%s: no KV block pool (%s); generating with transformers' own cache", self.replica_id, reason)
            return None
        blocks = memory.kv_pool_blocks(
            shape,
            cap_bytes=self.placement.reserved_total,
            max_tokens=self.kv_max_tokens,
            cuda_context_bytes=context,
            standby_context_bytes=self.standby_context_bytes,
            overhead_bytes=overhead,
        )
        if blocks * memory.DEFAULT_BLOCK_TOKENS < max(1, self.kv_max_tokens):
            raise self._pool_too_small(shape, blocks, context, overhead)
        return shape, weights, context, overhead

    def _spread_reason(self) -> str | None:
        """Why a model on virtual GPUs is not paged though its parameters are all on one device:
        over several GPUs, a real one's device map spreads it (CudaBackend.load), and the paged
        engine serves a model on one device only (inference.paged.unsupported_reason). The CPU
        suite then serves it as a GPU would, with transformers' own cache and no pool."""
        if isinstance(self.backend, VirtualBackend) and len(self.placement.gpus) > 1:
            return f"the model is spread over GPUs {list(self.placement.gpus)}"
        return None

    def _compose_footprint(self, shape: ModelShape | None, weights: int, context: int, overhead: int) -> MemoryEstimate:
        """What this replica holds serving at max_tokens, from its measured parts."""
        from gpuportal.wire import memory

        if shape is not None:
            return memory.estimate(
                shape, max_tokens=self.kv_max_tokens, cuda_context_bytes=context, overhead_bytes=overhead
            )
        # A torch-module deployment (or a model without a shape): weights and the floor of the
        # activation reserve, as the estimate at deploy time (scheduling.services).
        return memory.MemoryEstimate(
            weights_bytes=weights,
            kv_bytes=0,
            activation_bytes=memory.ACTIVATION_FLOOR_BYTES,
            context_bytes=context,
            kv_block_bytes=0,
            kv_blocks=0,
            block_tokens=memory.DEFAULT_BLOCK_TOKENS,
            max_tokens=0,
            overhead_bytes=overhead,
        )

    def _pool_too_small(self, shape: ModelShape, blocks: int, context: int, overhead: int) -> ReplicaFailure:
        """The load or wake's failure when the pool cannot hold one request of max_tokens, naming the bytes."""
        from gpuportal.wire import memory

        assert self.footprint is not None
        reserved = self.placement.reserved_total
        pool = memory.kv_pool_bytes(shape, blocks)
        need = self.footprint.total_bytes + self.standby_context_bytes
        cap = memory.allocator_cap_bytes(
            reserved, context_bytes=context, standby_context_bytes=self.standby_context_bytes, overhead_bytes=overhead
        )
        return ReplicaFailure(
            "oom",
            f"cannot serve: the KV pool left by the reservation holds {blocks * memory.DEFAULT_BLOCK_TOKENS} tokens "
            f"({blocks} blocks, {pool} bytes), fewer than max_tokens {self.kv_max_tokens}; need {need} bytes "
            f"({self.footprint.describe()}), reservation {reserved} bytes, allocator cap {cap} bytes",
        )

    def _keep_spare(self) -> None:
        """A serving replica allowed to keep an arena: say it holds one, or prepare one on a daemon
        thread (allocating, pinning and filling gigabytes takes seconds: never on the command loop,
        nor in the way of requests, which only read the weights the spare copies). A sleep waits
        for it (`_settle_spare`), and then copies nothing the fill already did."""
        if self._preparing is not None and self._preparing.is_alive():
            return  # its `arena` event comes when it is ready
        if self.backend.spare is not None:
            self._emit_arena(self.backend.spare.nbytes)  # kept by the wake, or a retried keep
            return
        assert self.model is not None
        self._preparing = threading.Thread(
            target=self._prepare_spare, args=(self.model,), name="arena-spare", daemon=True
        )
        self._preparing.start()

    def _prepare_spare(self, model: nn.Module) -> None:
        try:
            spare = self.backend.prepare_spare(model)
        except Exception as exc:  # the host out of memory, say: the next sleep allocates its own, as before
            log.exception("%s: preparing a kept arena failed; the next sleep allocates its own", self.replica_id)
            # Said, so that the books stop counting an arena it does not hold (and the grant is not
            # sent again and again by the heartbeat's check for a lost one).
            self.events.emit("arena", kept_bytes=0, failed=f"{type(exc).__name__}: {exc}"[:300])
            return
        log.info("%s: keeps an arena of %s ready for its next sleep", self.replica_id, mib(spare.nbytes))
        self._emit_arena(spare.nbytes)

    def _settle_spare(self) -> None:
        """Wait for a kept arena being prepared: the backend's spare is then whole or absent."""
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.join()

    def _emit_arena(self, kept_bytes: int) -> None:
        self.events.emit("arena", kept_bytes=kept_bytes)

    def _read_adapters(self) -> None:
        """The deployment's adapters, read from their files onto the host (ValueError naming one
        that cannot be served fails the load)."""
        from gpuportal.wire import adapters

        named = adapters.parse(self.adapter_text)
        if named:
            from inference.lora import Adapters

            self.adapters = Adapters.read(named)
            self.adapter_bytes = self.adapters.nbytes(self.dtype)
            log.info("%s: serves adapters %s beside its model", self.replica_id, ", ".join(self.adapters.names))

    def _release_pool(self) -> None:
        if self.paged is not None:
            self.paged.pool.release()
            self.paged = None
        self.pool_bytes = 0

    def _emit_sleeping(self) -> None:
        # cpu_bytes: what the parked weights take of the node's CPU cache.
        self.events.emit("sleeping", residual_bytes_by_id=self.residual_bytes_by_id, cpu_bytes=self.weights_bytes)

    def _load_slot(self) -> contextlib.AbstractContextManager[int | None]:
        """One of the node's load slots (inference.load_slots), waited for with progress saying so."""
        directory, most = load_slots.from_environment()
        return load_slots.load_slot(
            directory,
            most,
            on_wait=lambda: self._progress(5, f"waiting for a load slot: this node loads at most {most} at once"),
        )

    def _require(self, state: str, action: str) -> None:
        if self.state != state:
            raise CommandRejected(f"cannot {action} while {self.state}")

    def _expected_weight_bytes(self) -> int | None:
        """The weights' size, read from the model's files without loading them (None where it
        cannot be: a torch module's factory, a model whose files say too little)."""
        if self.loader not in DIRECTORY_LOADERS:
            return None
        from inference.model_size import shape_from_model_dir

        try:
            return shape_from_model_dir(
                local_model_dir(self.source), self.dtype, encoder=self.loader == EMBEDDING
            ).weight_bytes
        except Exception:  # files the loader reads its own way: only the progress bar goes without
            return None

    def _progress(self, percent: int, detail: str) -> None:
        log.info("%s %d%%: %s", self.replica_id, percent, detail)
        self.events.emit("progress", state=S.LOADING, percent=percent, detail=detail)

    def _failing_as(self, kind: str) -> _FailingAs:
        return _FailingAs(self, kind)


def drain_timeout(command: Mapping[str, Any]) -> float:
    """A command's optional drain_timeout_s: seconds >= 0, the default when absent or null."""
    value = command.get("drain_timeout_s")
    if value is None:
        return DEFAULT_DRAIN_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise CommandRejected(f"drain_timeout_s must be a number of seconds >= 0, got {value!r}")
    return float(value)


class _FailingAs:
    """Turn any exception inside a transition into a ReplicaFailure of the right kind."""

    def __init__(self, host: ReplicaHost, kind: str):
        self.host = host
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, CommandRejected):
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: let them through
        failure = classify_failure(exc, self.kind)
        self.host.state = S.FAILED
        if failure is not exc:
            log.error("%s failed (%s)", self.host.replica_id, failure.kind, exc_info=(exc_type, exc, tb))
            raise failure from exc
        return False


def load_tokenizer(source: str, loader: str) -> Any | None:
    """The model directory's tokenizer, if it has one (a torch-module deployment takes tensors).
    An encoder takes nothing but text: without its tokenizer the load fails."""
    if loader not in DIRECTORY_LOADERS:
        return None
    (AutoTokenizer,) = from_transformers("AutoTokenizer")

    try:
        return AutoTokenizer.from_pretrained(local_model_dir(source), local_files_only=True)
    except (OSError, ValueError) as exc:
        if loader == EMBEDDING:
            raise ValueError(f"{source} has no tokenizer a replica can load: {exc}") from exc
        log.warning("no tokenizer in %s (%s): only tensor requests can be served", source, exc)
        return None


def load_recipe(source: str, loader: str) -> Recipe | None:
    """How an encoder's token states become embeddings (inference.embedding); None for other loaders."""
    if loader != EMBEDDING:
        return None
    from inference.embedding import read_recipe

    return read_recipe(local_model_dir(source))
