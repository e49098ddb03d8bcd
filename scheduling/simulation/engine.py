"""A discrete-event simulator of the cluster, on a simulated clock, that makes every decision with
the project's own pure modules: placement.place (where a replica goes, whom ndif evicts),
fairness.choose_target, choose_whole_gpus, choose_victim, preempt_at_once and wait_deadline (where
a fair wake goes, whom it preempts, and when), fairness.sleep_when_idle (who the idle timer may
sleep) and sleep_early (who the idle sweep sleeps before its timer), planning's
withhold_locked and memory.need_for (what a replica reserves).

State is plain Python; each decision is asked of a `Snapshot` built from it, exactly as the
services build one from the ledger. Simulated replicas:
- a cold load (new replica) takes weight bytes / disk bandwidth; a wake (cached replica promoted on
  its node) weight bytes / host-to-device bandwidth; a sleep weight bytes / device-to-host bandwidth,
  and the GPU memory is held until it ends, except for a replica that keeps a copy of its weights
  in host memory (`sleep_from_kept_copy`, the product's kept arena): woken from its copy, it still
  holds the weights there, and loaded from disk it copies them there in the background while it
  serves (a device-to-host copy's time), so a sleep frees at once, or once that copy is done;
- a request takes a batch slot for prefill (2 × params × prompt tokens / FLOPS) plus one HBM pass over
  the weights per output token (decoding is memory bound); time to first token = wait + prefill;
- a sleeping replica keeps its weights in its node's CPU RAM (assumed large enough), and sleeps at
  two levels, as the product's do. Asleep in its process (`sleeping`) it keeps its CUDA context
  (`cuda_context_mib`) on each of its GPUs, an occupant there; its wake costs the weights at
  host-to-device speed. Deeply asleep (`deep_sleeping`: past `deep_after_s`, evicted by a
  placement, or told to by a fair wake that needs the room its context holds, the longest unused
  first: fairness.as_if_deep_asleep and sleepers_to_deepen) it holds nothing on any GPU, and its
  wake starts a process first (`process_start_s`). A serving replica evicted by a placement sleeps
  deeply at once: its room went to the replica placed. Either way it is a `CachedReplica` of its
  node to placement. With `[cluster] warm_spares` every GPU keeps a warm spare, as the product's
  agents do with GPUPORTAL_WARM_SPARES: a context of each GPU is the spare's, and a deep wake runs
  in its first GPU's spare (`spare_start_s`) where that is sooner than a process start, waiting
  for the one warming if need be; the next spare is warm a process start after it is taken;
- a deployment keeps `replicas` awake where it can, as the product's do: a wake of one with
  nothing awake brings back as many (the first by the wake path below, the rest with free memory
  only, all or none, as sleep.wake_deployment does; an autoscaled one, as many as its waiting
  requests want), and with `autoscale` set the autoscaler's sweep (scheduling.core.autoscale,
  every AUTOSCALE_S) scales it by its requests in flight, waking more where fewer are awake:
  a scale-up places the replicas it adds as an operator's scale does (sleepers promoted first,
  evictions as the policy's placement allows; short of room for all, one more if that fits),
  a scale-down stops the most recently started of those awake, each finishing what it took
  first, and wakes none (sleepers stay, as they do in the portal). Requests go to the serving
  replica with the fewest in flight;

A deployment's node selector and tolerations keep its replicas where the nodes' labels and taints
([cluster] pools) allow, as the product's placement and fair wakes read them
(gpuportal.wire.node_labels.refusals and avoidances): no replica, and no copy asleep, on a node
they refuse; a node whose PreferNoSchedule taint they do not name, last.

Every change of reservations is checked against every GPU's total (invariant 1 of docs/architecture.md): an
over-commit raises `OverCommit` at the simulated instant it would happen.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuportal.wire import node_labels
from gpuportal.wire.states import ReplicaState as S
from scheduling.core import autoscale, costs, fairness, planning
from scheduling.core.placement import CachedReplica, CantAccommodate, Placement, PlacementRequest, place
from scheduling.core.state import GPUView, OccupantView, Snapshot
from scheduling.simulation.config import Config
from scheduling.simulation.policies import SimPolicy
from scheduling.simulation.trace import Deployment, Request, Trace

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
MiB = 1024**2
LOADING, SERVING, DRAINING, SLEEPING, STOPPED = S.LOADING, S.SERVING, S.DRAINING, S.SLEEPING, S.STOPPED
MAX_BACKOFF_DOUBLINGS = 4
# Far more events at one simulated instant than any real burst makes: two policies' decisions undoing each other.
LIVELOCK_EVENTS = 100_000
# After a preemption's drain timeout, time for the victims' weights to leave the GPU.
GIVE_UP_AFTER_DRAIN_S = 60.0
# The live idle sweep's period (its beat schedule, migration 0006): how often an idle replica is
# judged again for fairness.sleep_early.
SWEEP_S = 5.0
# The autoscaler's period (its beat schedule, migration 0039).
AUTOSCALE_S = 5.0


class OverCommit(AssertionError):
    """A GPU's reservations exceeded its memory: the simulator (or a policy) is wrong."""


@dataclass
class SimGPU:
    id: int
    node: str
    index: int
    total_bytes: int
    occupants: dict[str, int] = field(default_factory=dict)  # replica id -> reserved bytes
    lock_holder: str | None = None

    @property
    def reserved_bytes(self) -> int:
        return sum(self.occupants.values())


@dataclass
class SimReplica:
    id: str
    deployment: str
    node: str
    bytes_by_gpu: dict[int, int]
    state: str
    serving_since: float | None = None
    last_accessed: float | None = None
    in_flight: dict[int, Request] = field(default_factory=dict)
    idle_token: int = 0
    # True until a cold load completes: such a replica has no complete copy in CPU RAM yet.
    loading_from_disk: bool = False
    # GPUs it decodes across when it holds none (the oracle): as many as its need would take.
    spread: int = 0
    # When its current load or wake was placed, and which it was (what a waiting request blames).
    placed_s: float = 0.0
    loaded_by: str | None = None
    # When its host memory holds a whole copy of its weights (SimPolicy.sleep_from_kept_copy): the
    # end of the wake that kept it, or a copy's time after a load from disk; None: never.
    kept_copy_s: float | None = None
    # Asleep with no process (deep sleep): nothing on any GPU, and its wake starts a process first.
    deep: bool = False
    # Told to sleep deeply and not there yet (its process writing its host copy, then exiting).
    deepening: bool = False
    asleep_token: int = 0
    # Stopped by a scale-down: it finishes what it took (draining), then leaves for good.
    stopping: bool = False
    # Its current load or wake was an autoscaler's scale-up (`_scale`), not a wake for requests
    # that found nothing awake: what a request waited before it was placed is the autoscaler's lag.
    scaled_up: bool = False


@dataclass
class Waiter:
    """A fair wake in progress (our PreemptionIntent): holds the wake lock of its target GPUs."""

    replica_id: str
    promoted: bool
    needed_bytes_by_gpu: dict[int, int]
    deadline_s: float
    preempted: bool = False


@dataclass
class DeploymentState:
    spec: Deployment
    need_bytes: int
    queue: deque[Request] = field(default_factory=deque)
    # Loading, serving or draining, oldest first: a draining one still finishes what it took.
    awake: list[SimReplica] = field(default_factory=list)
    # Sleeping replicas by id, and how many sleep on each node (what the idle sweep asks of
    # every deployment); written through keep_asleep and take_asleep only.
    cached: dict[str, SimReplica] = field(default_factory=dict)
    asleep_on: dict[str, int] = field(default_factory=dict)
    # How many it wants awake (the product's replicas_wanted): its own, then the autoscaler's.
    replicas: int = 1
    # What the autoscaler's earlier sweeps wanted, (when, replicas): its scale-down window.
    recent: list[tuple[float, int]] = field(default_factory=list)
    waiter: Waiter | None = None
    retry_pending: bool = False
    retry_token: int = 0
    # Consecutive failed wakes: retries back off so that a deployment that cannot be placed
    # (dedicated on too few GPUs) does not ask placement every retry_s for the whole trace.
    failed_wakes: int = 0
    home: tuple[int, ...] | None = None  # lru-fair: the GPUs of the first load
    # {node: why} of the nodes its replicas may not run on, and of those they go to last (its node
    # selector and tolerations against the nodes' labels and taints: gpuportal.wire.node_labels).
    refused_nodes: dict[str, str] = field(default_factory=dict)
    avoided_nodes: dict[str, str] = field(default_factory=dict)

    def keep_asleep(self, replica: SimReplica) -> None:
        if replica.id not in self.cached:  # kept once, counted once
            self.cached[replica.id] = replica
            self.asleep_on[replica.node] = self.asleep_on.get(replica.node, 0) + 1

    def take_asleep(self, replica: SimReplica) -> None:
        del self.cached[replica.id]
        self.asleep_on[replica.node] -= 1
        if not self.asleep_on[replica.node]:
            del self.asleep_on[replica.node]


@dataclass
class RequestOutcome:
    request: Request
    start_s: float | None = None
    ttft_s: float | None = None
    end_s: float | None = None
    failed: str | None = None
    # Where its wait went: waiting for room (a fair wait, victims leaving, a retry), the load or
    # wake of the replica that served it (`loaded_by` says which), and in the queue of a busy one.
    room_s: float = 0.0
    load_s: float = 0.0
    queue_s: float = 0.0
    loaded_by: str | None = None  # "cold load" or "wake": the request waited for that replica to load
    # A replica of its deployment served when it arrived, every one's batch full: it queued.
    arrived_behind_busy: bool = False


@dataclass
class Counters:
    cold_loads: int = 0
    wakes: int = 0
    cold_loads_by_deployment: dict[str, int] = field(default_factory=dict)
    wakes_by_deployment: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    idle_sleeps: int = 0
    deep_sleeps: int = 0
    deep_wakes: int = 0
    placements: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    overcommit_checks: int = 0
    memory_byte_s: float = 0.0
    working_set_bytes: int = 0
    peak_working_set_bytes: int = 0


@dataclass(frozen=True)
class SimResult:
    policy: str
    gpus: int
    gpu_bytes: int
    outcomes: tuple[RequestOutcome, ...]
    counters: Counters
    duration_s: float
    # The deployments whose catalogue sets an SLO of their own; the others use the caller's.
    slos: Mapping[str, float] = field(default_factory=dict)


def layout(gpus: int, gpus_per_node: int, gpu_bytes: int) -> dict[int, SimGPU]:
    """`gpus` GPUs on full nodes of `gpus_per_node`, the remainder on one last node."""
    out = {}
    for n in range(gpus):
        out[n + 1] = SimGPU(n + 1, f"node{n // gpus_per_node:02d}", n % gpus_per_node, gpu_bytes)
    return out


class Simulation:
    def __init__(self, trace: Trace, config: Config, policy: SimPolicy, *, gpus: int | None = None) -> None:
        self.trace, self.config, self.policy = trace, config, policy
        self.serving, self.hw = config.serving, config.hardware
        self.gpu_count = config.cluster.gpus if gpus is None else gpus
        # Warm spares (the product's inference.spare_pool) where the policy sleeps at two levels:
        # each GPU's spare holds a context there, and `spare_warm_at` says when it is next warm.
        self.spares = config.cluster.warm_spares and policy.two_level_sleep
        spare = config.hardware.cuda_context_mib * MiB if self.spares else 0
        self.gpus = layout(self.gpu_count, config.cluster.gpus_per_node, config.cluster.gpu_bytes - spare)
        self.spare_warm_at: dict[int, float] = {}
        self.node_gpus: dict[str, list[SimGPU]] = {}
        for gpu in self.gpus.values():
            self.node_gpus.setdefault(gpu.node, []).append(gpu)
        self.node_marks = config.cluster.marks(self.node_gpus)
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self.closed = False  # past the grace period: no new wakes, queued requests fail
        self.counters = Counters()
        self.reserved_total = 0
        self.replicas: dict[str, SimReplica] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        # An autoscaled deployment starts within its bounds, as the autoscaler keeps it.
        self.deployments = {
            d.name: DeploymentState(
                d, d.need_bytes(policy.memory), replicas=max(d.replicas, d.autoscale.min_replicas if d.autoscale else 0)
            )
            for d in trace.deployments
        }
        for ds in self.deployments.values():
            spec = ds.spec
            ds.refused_nodes = node_labels.refusals(self.node_marks, spec.name, spec.node_selector, spec.tolerations)
            ds.avoided_nodes = node_labels.avoidances(self.node_marks, spec.name, spec.tolerations)
        self.outcomes = {r.id: RequestOutcome(r) for r in trace.requests}
        self._in_flight_of: dict[str, int] = dict.fromkeys(self.deployments, 0)

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> SimResult:
        if self.policy.unlimited:
            gpu_bytes = self.config.cluster.gpu_bytes
            for ds in self.deployments.values():
                # Always loaded, as many as it could ever want.
                most = ds.spec.autoscale.max_replicas if ds.spec.autoscale else 0
                for _ in range(max(ds.replicas, most)):
                    replica = SimReplica(self._new_id(ds), ds.spec.name, "unlimited", {}, SERVING, serving_since=0.0)
                    replica.spread = -(-ds.need_bytes // gpu_bytes)
                    ds.awake.append(replica)
        else:
            self._provision()
            if any(ds.spec.autoscale for ds in self.deployments.values()):
                self._at(AUTOSCALE_S, self._autoscale)
        for r in self.trace.requests:
            self._at(r.arrival_s, self._arrive, r)
        self._at(self.trace.duration_s + self.serving.grace_s, self._close)
        same_instant = 0
        while self._events:
            t, _, handler, args = heapq.heappop(self._events)
            same_instant = same_instant + 1 if t == self.now else 0
            if same_instant > LIVELOCK_EVENTS:
                raise RuntimeError(f"t={t:.3f}s: {same_instant} events without the clock moving (a livelock)")
            self._advance(t)
            handler(*args)
        return SimResult(
            self.policy.name,
            self.gpu_count,
            self.config.cluster.gpu_bytes,
            tuple(self.outcomes.values()),
            self.counters,
            self.trace.duration_s,
            {d.name: d.slo_ttft_s for d in self.trace.deployments if d.slo_ttft_s is not None},
        )

    def _at(self, t: float, handler: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), handler, args))

    def _advance(self, t: float) -> None:
        # Memory in use is averaged over the trace itself, not the grace period after it.
        end = self.trace.duration_s
        if self.now < end:
            self.counters.memory_byte_s += self.reserved_total * (min(t, end) - self.now)
        self.now = t

    def _close(self) -> None:
        self.closed = True
        for ds in self.deployments.values():
            while ds.queue:
                self._fail(ds.queue.popleft(), "not served within the grace period")

    # --- requests --------------------------------------------------------------------------

    def _arrive(self, request: Request) -> None:
        ds = self.deployments[request.deployment]
        if ds.refused_nodes and len(ds.refused_nodes) == len(self.node_gpus) and not self.policy.unlimited:
            # As the portal refuses a wake no node may take: at once, saying why.
            self._fail(request, f"no node may run {ds.spec.name}: {next(iter(ds.refused_nodes.values()))}")
            return
        ds.queue.append(request)
        serving = [r for r in ds.awake if r.state == SERVING]
        self.outcomes[request.id].arrived_behind_busy = bool(serving) and all(
            len(r.in_flight) >= self.serving.max_batch for r in serving
        )
        if self.policy.wake_on_arrival and ds.retry_pending and not ds.awake:
            # services.requests._admit: a request for a deployment with nothing awake asks for a
            # wake itself (sleep.wake_deployment), whatever backoff an earlier failed wake is in.
            ds.retry_pending = False
        self._dispatch(ds)

    def _dispatch(self, ds: DeploymentState) -> None:
        if ds.awake:
            while ds.queue:
                free = [r for r in ds.awake if r.state == SERVING and len(r.in_flight) < self.serving.max_batch]
                if not free:
                    break
                self._start(min(free, key=lambda r: len(r.in_flight)), ds.queue.popleft())
            return
        if ds.queue and ds.waiter is None and not ds.retry_pending and not self.closed:
            self._wake(ds)

    def _start(self, replica: SimReplica, request: Request) -> None:
        ds = self.deployments[replica.deployment]
        prefill, per_token = request_times(ds.spec, request, self.hw, max(1, len(replica.bytes_by_gpu), replica.spread))
        outcome = self.outcomes[request.id]
        outcome.start_s, outcome.ttft_s = self.now, self.now - request.arrival_s + prefill
        since = replica.serving_since
        if since is not None and since >= request.arrival_s and replica.loaded_by is not None:
            placed = max(request.arrival_s, replica.placed_s)
            outcome.room_s, outcome.load_s = placed - request.arrival_s, since - placed
            outcome.queue_s, outcome.loaded_by = self.now - since, replica.loaded_by
            if replica.scaled_up and outcome.arrived_behind_busy:
                # It queued behind busy replicas until the autoscaler's sweep placed this one: no
                # room was wanting, so that wait is the queue's (what the scale advice reads).
                outcome.queue_s, outcome.room_s = outcome.queue_s + outcome.room_s, 0.0
        else:
            outcome.queue_s = self.now - request.arrival_s
        replica.in_flight[request.id] = request
        replica.last_accessed = self.now
        self._working_set(ds, +1)
        self._at(self.now + prefill + request.output_tokens * per_token, self._finish, replica, request)

    def _finish(self, replica: SimReplica, request: Request) -> None:
        if replica.in_flight.pop(request.id, None) is None:
            return  # cancelled by an eviction meanwhile
        ds = self.deployments[replica.deployment]
        self.outcomes[request.id].end_s = self.now
        self._working_set(ds, -1)
        if replica.state == DRAINING and not replica.in_flight:
            self._begin_sleep(replica)  # or its stop, for one a scale-down stops
        elif replica.state == SERVING:
            self._dispatch(ds)
            self._maybe_idle(replica, ds)

    def _fail(self, request: Request, why: str) -> None:
        outcome = self.outcomes[request.id]
        outcome.failed, outcome.end_s = why, self.now

    def _working_set(self, ds: DeploymentState, delta: int) -> None:
        # The oracle's GPU count: the bytes of the replicas serving a request at this instant, as
        # few as hold them (a batch each): one replica of each deployment that serves any, more
        # only for a deployment of several replicas serving more than one batch.
        before = self._in_flight_of[ds.spec.name]
        self._in_flight_of[ds.spec.name] = before + delta
        batch = self.serving.max_batch
        replicas = -(-(before + delta) // batch) - -(-before // batch)
        self.counters.working_set_bytes += replicas * ds.need_bytes
        self.counters.peak_working_set_bytes = max(
            self.counters.peak_working_set_bytes, self.counters.working_set_bytes
        )

    # --- sleep -----------------------------------------------------------------------------

    def _maybe_idle(self, replica: SimReplica, ds: DeploymentState) -> None:
        if not self.policy.idle_sleep or ds.spec.popular or replica.in_flight or ds.queue:
            return
        timeout = self._setting(ds.spec.idle_timeout_s, self.serving.idle_timeout_s)
        if timeout <= 0:
            return  # the deployment never sleeps when idle (Deployment.idle_timeout_s = 0)
        slo = self._setting(ds.spec.slo_ttft_s, self.serving.slo_ttft_s)
        if self.policy.keep_slow_wakes and not fairness.sleep_when_idle(wake_s=self.wake_s(ds.spec), slo_ttft_s=slo):
            return  # it leaves when its memory is wanted (a preemption), not on a timer
        replica.idle_token += 1
        self._at(self.now + timeout, self._idle_check, replica, replica.idle_token)
        if self.policy.sleep_early:
            max_wait = self._setting(ds.spec.max_wait_s, self.serving.max_wait_s)
            self._at(self.now + max_wait, self._early_check, replica, replica.idle_token, self.now + timeout)

    def _early_check(self, replica: SimReplica, token: int, timeout_at: float) -> None:
        """fairness.sleep_early, as the idle sweep judges it: idle for max_wait, then again every
        SWEEP_S until the idle timeout sleeps it anyway."""
        ds = self.deployments[replica.deployment]
        if replica.state != SERVING or replica.idle_token != token or replica.in_flight or ds.queue:
            return
        gpus = [self._room_view(g) for g in self.node_gpus[replica.node]]
        asleep = [
            fairness.AsleepCopy(
                other.spec.name, other.need_bytes, self.wake_s(other.spec), self.policy.placement.whole_gpu_from
            )
            for other in self.deployments.values()
            if not other.awake and replica.node in other.asleep_on
        ]
        slo = self._setting(ds.spec.slo_ttft_s, self.serving.slo_ttft_s)
        short = fairness.short_of_room(gpus, asleep, slo_ttft_s=slo)
        max_wait = self._setting(ds.spec.max_wait_s, self.serving.max_wait_s)
        # Idle since its last request or its start of serving, the later, as the sweep reads it.
        since = max((t for t in (replica.last_accessed, replica.serving_since) if t is not None), default=self.now)
        idle_s = self.now - since
        if fairness.sleep_early(
            wake_s=self.wake_s(ds.spec), slo_ttft_s=slo, idle_s=idle_s, max_wait_s=max_wait, short=short
        ):
            self.counters.idle_sleeps += 1
            replica.state = DRAINING
            self._begin_sleep(replica)
        elif not self.closed and self.now + SWEEP_S < timeout_at:
            # Past the trace's end the idle timer sleeps it, if anything does: the one sleep it
            # counts either way, and a check every SWEEP_S until a long idle timeout (a day, say)
            # was hundreds of thousands of events that measured nothing.
            self._at(self.now + SWEEP_S, self._early_check, replica, token, timeout_at)

    def _idle_check(self, replica: SimReplica, token: int) -> None:
        ds = self.deployments[replica.deployment]
        if replica.state == SERVING and replica.idle_token == token and not replica.in_flight and not ds.queue:
            self.counters.idle_sleeps += 1
            replica.state = DRAINING
            self._begin_sleep(replica)

    def _begin_sleep(self, replica: SimReplica) -> None:
        # The weights go to CPU RAM; the GPU memory is held until they are all out. A replica that
        # keeps a copy there has nothing to copy out once the copy is whole (inference.arena's
        # kept arena, filled by a wake or in the background after a load: the sleep waits for it).
        ds = self.deployments[replica.deployment]
        if replica.stopping:
            self._stopped(replica)
            return
        if self.policy.sleep_from_kept_copy and replica.kept_copy_s is not None:
            self._at(max(self.now, replica.kept_copy_s), self._slept, replica)
            return
        self._at(self.now + self._copy_out_s(ds.spec), self._slept, replica)

    def _copy_out_s(self, spec: Deployment) -> float:
        return spec.weight_bytes / (self.hw.d2h_gb_per_s * 1e9)

    def _keep_copy(self, replica: SimReplica, ds: DeploymentState) -> None:
        """A replica starting to serve: when its host copy will be whole (`kept_copy_s`)."""
        assert replica.serving_since is not None
        woken = replica.loaded_by == "wake"
        replica.kept_copy_s = replica.serving_since + (0.0 if woken else self._copy_out_s(ds.spec))

    def _slept(self, replica: SimReplica) -> None:
        if replica.state != DRAINING:
            return  # evicted meanwhile (ndif)
        ds = self.deployments[replica.deployment]
        held = dict(replica.bytes_by_gpu)
        gpus = list(held)
        self._release(replica)
        replica.state, replica.serving_since = SLEEPING, None
        # Asleep in its process: what stays on each of its GPUs is its CUDA context (no more than
        # it held there: a need measured on a small device may count a smaller one).
        context = self.hw.cuda_context_mib * MiB if self.policy.two_level_sleep else 0
        replica.deep, replica.deepening = self.policy.two_level_sleep and not (context and gpus), False
        if context and gpus:
            replica.bytes_by_gpu = {g: min(context, held[g]) for g in gpus}
            self._reserve(replica)
            replica.asleep_token += 1
            if self._short_beside(replica, gpus):
                # Preempted for a wake its context leaves short (replica_reports._why_deeply).
                self._deepen(replica)
            elif self.serving.deep_after_s > 0:
                self._at(self.now + self.serving.deep_after_s, self._deep_check, replica, replica.asleep_token)
        self._leave(ds, replica)
        ds.keep_asleep(replica)
        self._memory_freed()
        self._dispatch(ds)

    def _short_beside(self, replica: SimReplica, gpus: Iterable[int]) -> bool:
        """Whether a wake waits on one of these GPUs for more room than is left beside `replica`."""
        waiters = [ds.waiter for ds in self.deployments.values() if ds.waiter and ds.waiter.replica_id != replica.id]
        return any(
            w.needed_bytes_by_gpu.get(g, 0) > self.gpus[g].total_bytes - self.gpus[g].reserved_bytes
            for w in waiters
            for g in gpus
        )

    def _deep_check(self, replica: SimReplica, token: int) -> None:
        if replica.state == SLEEPING and replica.asleep_token == token:
            self._deepen(replica)

    def _deepen(self, replica: SimReplica) -> None:
        """Told to sleep deeply: its process writes its weights to its node's host copy (a host
        memory copy, counted at the device-to-host rate) and exits, giving back its context."""
        if replica.state != SLEEPING or replica.deep or replica.deepening:
            return
        replica.deepening = True
        self._at(self.now + self._copy_out_s(self.deployments[replica.deployment].spec), self._deepened, replica)

    def _deepened(self, replica: SimReplica) -> None:
        if replica.state != SLEEPING or not replica.deepening:
            return  # woken meanwhile
        self._fall_deep(replica)
        self._memory_freed()

    def _fall_deep(self, replica: SimReplica) -> None:
        self._release(replica)
        replica.deep, replica.deepening = True, False
        self.counters.deep_sleeps += 1

    # --- wake ------------------------------------------------------------------------------

    def _wake(self, ds: DeploymentState) -> None:
        """Our wake path: place with free memory only; failing that, a fair wait (fair policies),
        an immediate eviction (ndif's placement evicts), or a retry."""
        fair = self.policy.fair_wait
        policy = replace(self.policy.placement, evictions=False) if fair else self.policy.placement
        request = self._request(ds)
        result = place(self._snapshot(ds), request, policy=policy, rng=self.rng)
        if isinstance(result, Placement) and result.promoted is None and self._wake_instead(ds, request):
            return
        if isinstance(result, Placement):
            self._commit(ds, result)
            self._top_up(ds)
            return
        if fair:
            if self.policy.target_by_cost and self._begin_costed_wait(ds, request):
                return
            # Targeting only (as services.preemption.start): where it would go if every
            # non-dedicated occupant could leave; who really leaves is choose_victim's call.
            targeting = replace(self.policy.placement, protect_fairness=False, evictions=True)
            target = place(self._snapshot(ds), replace(request, dedicated=True), policy=targeting, rng=self.rng)
            if isinstance(target, Placement):
                self._begin_fair_wait(ds, target)
                return
        self._retry_later(ds)

    def _wake_instead(self, ds: DeploymentState, request: PlacementRequest) -> bool:
        """fairness.prefer_wake: a sleeping replica wakes on its own node, by a fair wait if need
        be, rather than a new one loading from disk elsewhere. False: load from disk after all."""
        if not (self.policy.prefer_wake and request.cached):
            return False
        max_wait = self._setting(ds.spec.max_wait_s, self.serving.max_wait_s)
        if not fairness.prefer_wake(load_s=self.load_s(ds.spec), wake_s=self.wake_s(ds.spec), max_wait_s=max_wait):
            return False
        return self._begin_costed_wait(ds, replace(request, allow_new=False))

    def _request(self, ds: DeploymentState, *, only: str | None = None) -> PlacementRequest:
        cached = tuple(CachedReplica(r.id, r.node) for r in sorted(ds.cached.values(), key=lambda r: (r.node, r.id)))
        if only is not None:
            cached = tuple(c for c in cached if c.replica_id == only)
        return PlacementRequest(
            deployment=ds.spec.name,
            replica_id=only or self._new_id(ds),
            need_bytes=ds.need_bytes,
            cached=cached,
            allow_new=only is None or not cached,
            refused_nodes=ds.refused_nodes,
            avoided_nodes=ds.avoided_nodes,
        )

    def _retry_later(self, ds: DeploymentState) -> None:
        ds.retry_pending = True
        ds.retry_token += 1
        backoff = self.serving.retry_s * 2 ** min(ds.failed_wakes, MAX_BACKOFF_DOUBLINGS)
        ds.failed_wakes += 1
        self._at(self.now + backoff, self._retry, ds, ds.retry_token)

    def _retry(self, ds: DeploymentState, token: int) -> None:
        if ds.retry_pending and ds.retry_token == token:
            ds.retry_pending = False
            self._dispatch(ds)

    def _begin_fair_wait(self, ds: DeploymentState, target: Placement) -> None:
        waker = target.promoted or target.replica_id
        self._wait_for(ds, waker, target.promoted is not None, dict(target.bytes_by_gpu), at_once=False)

    def _begin_costed_wait(self, ds: DeploymentState, request: PlacementRequest) -> bool:
        """fairness.choose_target over the GPUs the waker may use: those of the nodes holding a
        sleeping replica of it (a wake from CPU RAM), else every node (a new replica); never a node
        its selector or tolerations refuse."""
        refused = request.refused_nodes
        tickets = [(c.replica_id, True, c.node) for c in request.cached if c.node not in refused] or [
            (request.replica_id, False, None)
        ]
        # Chosen on the GPUs as they will be once their sleepers sleep deeply (they are told to
        # as the wait begins): a GPU whose sleepers hold the room costs no one's preemption.
        snapshot = fairness.as_if_deep_asleep(self._snapshot(ds), keep={t[0] for t in tickets})
        best: tuple[fairness.Target, str, bool] | None = None
        for replica_id, promoted, node in tickets:
            gpus = [g for g in snapshot.gpus.values() if (node is None or g.node == node) and g.node not in refused]
            if not gpus:
                continue
            if self.policy.whole_gpus_by_cost and self._whole_gpus(request.need_bytes):
                target = fairness.choose_whole_gpus(
                    gpus,
                    waiting_replica_id=replica_id,
                    need_bytes=request.need_bytes,
                    now=snapshot.taken_at,
                    slo_ttft_s=None if self.policy.whole_gpus_unguarded else self.serving.slo_ttft_s,
                    waiting_requests=None if self.policy.whole_gpus_unguarded else len(ds.queue),
                )
            else:
                target = fairness.choose_target(
                    gpus,
                    waiting_replica_id=replica_id,
                    need_bytes=request.need_bytes,
                    now=snapshot.taken_at,
                    whole_gpu_from=self.policy.placement.whole_gpu_from,
                )
            if target is not None and (best is None or target.cost < best[0].cost):
                best = (target, replica_id, promoted)
        if best is None:
            return False
        target, replica_id, promoted = best
        at_once = self.policy.preempt_idle_at_once and target.ready and fairness.preempt_at_once(target.choice)
        needed = dict(target.needed_bytes_by_gpu) or {target.gpu_id: request.need_bytes}
        self._wait_for(ds, replica_id, promoted, needed, at_once=at_once)
        return True

    def _whole_gpus(self, need_bytes: int) -> bool:
        """Whether placement gives a need this large whole GPUs (every GPU is the same size here)."""
        return need_bytes >= self.policy.placement.whole_gpu_from * self.config.cluster.gpu_bytes

    def _wait_for(
        self, ds: DeploymentState, waker: str, promoted: bool, bytes_by_gpu: dict[int, int], *, at_once: bool
    ) -> None:
        for gpu_id in bytes_by_gpu:
            self.gpus[gpu_id].lock_holder = waker
        # The sleepers whose contexts stand in its way sleep deeply at once, before anyone serving
        # is preempted (services.preemption, as fairness.sleepers_to_deepen chooses them).
        views = [self._view(self.gpus[gpu_id]) for gpu_id in sorted(bytes_by_gpu)]
        for replica_id in fairness.sleepers_to_deepen(views, bytes_by_gpu, waiting_replica_id=waker):
            self._deepen(self.replicas[replica_id])
        max_wait = self._setting(ds.spec.max_wait_s, self.serving.max_wait_s)
        deadline = fairness.wait_deadline(self._dt(self.now), max_wait)
        ds.waiter = Waiter(waker, promoted, bytes_by_gpu, (deadline - EPOCH).total_seconds())
        self._at(self.now if at_once else ds.waiter.deadline_s, self._wait_over, ds, ds.waiter)

    def _memory_freed(self) -> None:
        """Memory came back: every fair wake in progress re-checks whether it fits now (seed 001
        re-checks every second; here at the instant, which only makes the wait shorter)."""
        for ds in list(self.deployments.values()):
            if ds.waiter is not None:
                self._try_waiter(ds)
        # Then the wakes that found no room at all try again now rather than at their backoff.
        for ds in list(self.deployments.values()):
            if ds.retry_pending and ds.queue:
                ds.retry_pending = False
                self._dispatch(ds)

    def _try_waiter(self, ds: DeploymentState) -> bool:
        waiter = ds.waiter
        assert waiter is not None
        if waiter.promoted and waiter.replica_id not in ds.cached:
            # Woken some other way meanwhile (a scale promoted it): the wake has nothing left to do,
            # as preemption._try_place finds.
            self._end_wait(ds)
            return True
        request = self._request(ds, only=waiter.replica_id)
        policy = replace(self.policy.placement, evictions=False)
        result = place(self._snapshot(ds, holder=waiter.replica_id), request, policy=policy, rng=self.rng)
        if not isinstance(result, Placement):
            return False
        self._end_wait(ds)
        self._commit(ds, result)
        return True

    def _end_wait(self, ds: DeploymentState) -> None:
        waiter = ds.waiter
        ds.waiter = None
        for gpu in self.gpus.values():
            if waiter is not None and gpu.lock_holder == waiter.replica_id:
                gpu.lock_holder = None

    def _wait_over(self, ds: DeploymentState, waiter: Waiter) -> None:
        if ds.waiter is not waiter or waiter.preempted:
            return
        if self._try_waiter(ds):
            return
        ids = sorted(waiter.needed_bytes_by_gpu)
        snapshot = self._snapshot(ds, holder=waiter.replica_id, only=ids, withhold=False)
        # Its GPUs' sleepers were told to sleep deeply as it began to wait: leaving, not victims.
        views = list(fairness.as_if_deep_asleep(snapshot, keep={waiter.replica_id}).gpus.values())
        choice = fairness.choose_victim(
            views,
            waiting_replica_id=waiter.replica_id,
            needed_bytes_by_gpu=waiter.needed_bytes_by_gpu,
            now=self._dt(self.now),
            order=self.policy.victim_order,  # type: ignore[arg-type]
        )
        if isinstance(choice, fairness.NoVictim):
            self._end_wait(ds)
            self._retry_later(ds)
            return
        waiter.preempted = True
        for victim in choice.victims:
            self._preempt(self.replicas[victim.replica_id])
        # The victims' sleeps end in _slept, which lets the waiter in. Should the room still be
        # missing then (the targeting counted on someone who is now loading), give up and retry.
        self._at(self.now + self.serving.drain_timeout_s + GIVE_UP_AFTER_DRAIN_S, self._give_up, ds, waiter)

    def _give_up(self, ds: DeploymentState, waiter: Waiter) -> None:
        if ds.waiter is waiter:
            self._end_wait(ds)
            self._retry_later(ds)

    def _preempt(self, victim: SimReplica) -> None:
        """The preemption barrier: no new requests, in-flight ones drain (up to drain_timeout), sleep."""
        self.counters.preemptions += 1
        victim.state = DRAINING
        if not victim.in_flight:
            self._begin_sleep(victim)
        else:
            self._at(self.now + self.serving.drain_timeout_s, self._drain_over, victim)

    def _drain_over(self, victim: SimReplica) -> None:
        if victim.state != DRAINING or not victim.in_flight:
            return
        cause = "a scale-down's" if victim.stopping else "a preemption's"
        for request in list(victim.in_flight.values()):
            self._cancel(victim, request, f"cut off by {cause} drain timeout")
        self._begin_sleep(victim)

    def _cancel(self, replica: SimReplica, request: Request, why: str) -> None:
        replica.in_flight.pop(request.id)
        self._working_set(self.deployments[replica.deployment], -1)
        self._fail(request, why)

    # --- replicas by load ------------------------------------------------------------------

    def _top_up(self, ds: DeploymentState) -> None:
        """After a wake placed its first replica: the rest it wants, with free memory only and all
        or none (sleep.wake_deployment); short of room, the one woken serves alone."""
        wanted, policy = ds.replicas, ds.spec.autoscale
        if policy is not None:
            # An autoscaled one wakes what its waiting requests want (sleep._wanted_awake).
            wanted = min(wanted, autoscale.wanted(max(1, len(ds.queue)), policy))
        missing = wanted - len(self._running(ds))
        if missing > 0:
            self._place_more(ds, missing, evictions=False)

    def _autoscale(self) -> None:
        """The autoscaler's sweep (services.autoscaling.sweep): each autoscaled deployment's
        requests in flight, queued or taken, decide how many replicas it wants."""
        if self.closed:
            return
        for ds in self.deployments.values():
            policy = ds.spec.autoscale
            if policy is None:
                continue
            in_flight = len(ds.queue) + sum(len(r.in_flight) for r in ds.awake)
            # The sweeps of the window and the one before it: what tells the window is covered.
            ds.recent = [(t, n) for t, n in ds.recent if t >= self.now - policy.down_after_s - AUTOSCALE_S]
            awake = len(self._running(ds))
            decision = autoscale.decide(ds.replicas, in_flight, ds.recent, self.now, policy, awake=awake)
            ds.recent.append((self.now, autoscale.wanted(in_flight, policy)))
            if decision is not None:
                self._scale(ds, decision.replicas, wake=decision.wake)
        self._at(self.now + AUTOSCALE_S, self._autoscale)

    def _scale(self, ds: DeploymentState, replicas: int, *, wake: bool) -> None:
        """scaling.scale as the autoscaler calls it (services.autoscaling._scale): with `wake`, the
        replicas it adds placed as an operator's scale places them (evictions as the policy
        allows), all or none, else one more than it wanted if that fits; down, the most recently
        started of those awake stop, and none wakes (its replicas may have slept, idle, before the
        window ended)."""
        running = self._running(ds)
        if wake and replicas > len(running):
            if not self._place_more(ds, replicas - len(running), evictions=True, scaled_up=True):
                one_more = ds.replicas + 1
                short = one_more - len(running)
                fits = replicas > one_more and short > 0 and self._place_more(ds, short, evictions=True, scaled_up=True)
                if not fits:
                    return  # no room even for one more: the next sweep asks again
                replicas = one_more
            self.counters.scale_ups += 1
        elif replicas < len(running):
            for replica in running[replicas:]:
                self._stop(replica)
            self.counters.scale_downs += 1
        ds.replicas = replicas

    def _running(self, ds: DeploymentState) -> list[SimReplica]:
        """What a scale counts awake: loading or serving, oldest first (a draining one is leaving)."""
        return [r for r in ds.awake if r.state in (LOADING, SERVING)]

    def _place_more(self, ds: DeploymentState, count: int, *, evictions: bool, scaled_up: bool = False) -> bool:
        """`count` more replicas, sleepers promoted first, all or none (planning.place_all);
        `scaled_up`: by the autoscaler's scale-up (`SimReplica.scaled_up`)."""
        policy = self.policy.placement if evictions else replace(self.policy.placement, evictions=False)
        first = self._request(ds)
        requests = [first, *(replace(first, replica_id=self._new_id(ds)) for _ in range(count - 1))]
        result = planning.place_all(
            self._snapshot(ds),
            requests,
            occupant_for=lambda placement: self._placed_occupant(ds, placement),
            reason="scaled",
            policy=policy,
            rng=self.rng,
        )
        if isinstance(result, CantAccommodate):
            return False
        for placement in result.placements:
            self._commit(ds, placement)
            self.replicas[placement.replica_id].scaled_up = scaled_up
        return True

    def _placed_occupant(self, ds: DeploymentState, placement: Placement) -> OccupantView:
        return OccupantView(
            replica_id=placement.replica_id,
            deployment=ds.spec.name,
            state=LOADING,
            reserved_bytes=0,
            dedicated=self.policy.name == "dedicated" or ds.spec.dedicated,
            popular=ds.spec.popular,
            min_runtime_s=self._setting(ds.spec.min_runtime_s, self.serving.min_runtime_s),
        )

    def _stop(self, replica: SimReplica) -> None:
        """A scale-down's stop: no new requests; those it took finish (up to drain_timeout)."""
        replica.stopping = True
        if replica.state == LOADING or not replica.in_flight:
            self._stopped(replica)
            return
        replica.state = DRAINING
        self._at(self.now + self.serving.drain_timeout_s, self._drain_over, replica)

    def _stopped(self, replica: SimReplica) -> None:
        ds = self.deployments[replica.deployment]
        self._release(replica)
        replica.state, replica.serving_since = STOPPED, None
        self._leave(ds, replica)
        self._memory_freed()
        self._dispatch(ds)

    @staticmethod
    def _leave(ds: DeploymentState, replica: SimReplica) -> None:
        if replica in ds.awake:
            ds.awake.remove(replica)

    # --- committing a placement ------------------------------------------------------------

    def _deep_wake_s(self, ds: DeploymentState, placement: Placement) -> float:
        """A deep sleeper's wake: a process started, then its weights copied from the host copy.
        With warm spares it runs in its first GPU's spare where that is sooner, even waiting for
        the one warming (a process start after the last was taken), and the next one starts."""
        plain = costs.deep_wake_s(ds.spec.weight_bytes, self.hw, ds.spec.wake_s)
        if not self.spares:
            return plain
        gpu = placement.gpu_ids[0]
        wait = max(0.0, self.spare_warm_at.get(gpu, 0.0) - self.now)
        if wait + self.hw.spare_start_s >= self.hw.process_start_s:
            return plain
        self.spare_warm_at[gpu] = self.now + wait + self.hw.process_start_s
        return wait + self.hw.spare_start_s + costs.ram_wake_s(ds.spec.weight_bytes, self.hw, ds.spec.wake_s)

    def _commit(self, ds: DeploymentState, placement: Placement) -> None:
        """Apply a placement as the ledger would: evictions (ndif: at once, in-flight work is
        cancelled, the replica goes to its node's CPU RAM), then the reservation; then load."""
        delay = 0.0
        for replica_id in placement.evicted_replicas:
            delay = max(delay, self._evict(self.replicas[replica_id]))
        self.counters.placements += 1
        ds.failed_wakes = 0
        name = ds.spec.name
        if placement.promoted:
            replica = self.replicas[placement.promoted]
            ds.take_asleep(replica)
            # Its context, where it kept one, is the residual placement counted: replaced by its need.
            self._release(replica)
            load, replica.loaded_by = self.wake_s(ds.spec), "wake"
            if replica.deep:
                load = self._deep_wake_s(ds, placement)
                self.counters.deep_wakes += 1
            replica.deep = replica.deepening = False
            replica.asleep_token += 1
            self.counters.wakes += 1
            self.counters.wakes_by_deployment[name] = self.counters.wakes_by_deployment.get(name, 0) + 1
        else:
            replica = SimReplica(placement.replica_id, ds.spec.name, placement.node, {}, LOADING)
            replica.loading_from_disk = True
            self.replicas[replica.id] = replica
            load, replica.loaded_by = self.load_s(ds.spec), "cold load"
            self.counters.cold_loads += 1
            self.counters.cold_loads_by_deployment[name] = self.counters.cold_loads_by_deployment.get(name, 0) + 1
        replica.placed_s = self.now
        replica.state, replica.bytes_by_gpu = LOADING, dict(placement.bytes_by_gpu)
        self._reserve(replica)
        ds.awake.append(replica)
        if ds.home is None:
            ds.home = tuple(placement.gpu_ids)
        self._at(self.now + delay + load, self._loaded, replica)

    def _evict(self, victim: SimReplica) -> float:
        """Seed 000's eviction (to_cache): returns how long moving its weights out takes. A sleeper
        evicted sleeps deeply (only its process's exit gives its context back); a serving one
        sleeps deeply too, its room given to the replica placed."""
        ds = self.deployments[victim.deployment]
        if victim.state == SLEEPING:  # only a two-level sleeper is an occupant asleep
            self._fall_deep(victim)
            return 0.0
        self.counters.preemptions += 1
        for request in list(victim.in_flight.values()):
            self._cancel(victim, request, "cancelled by an eviction")
        self._release(victim)
        self._leave(ds, victim)
        # A replica evicted before it finished loading has nothing complete to keep in CPU RAM.
        victim.serving_since = None
        if victim.loading_from_disk or victim.stopping:
            victim.state = STOPPED
        else:
            victim.state, victim.deep = SLEEPING, self.policy.two_level_sleep
            self.counters.deep_sleeps += victim.deep
            ds.keep_asleep(victim)
        self._at(self.now, self._dispatch, ds)
        return self._copy_out_s(ds.spec)

    def _loaded(self, replica: SimReplica) -> None:
        if replica.state != LOADING:
            return  # evicted while loading (ndif)
        replica.state, replica.serving_since, replica.loading_from_disk = SERVING, self.now, False
        ds = self.deployments[replica.deployment]
        self._keep_copy(replica, ds)
        self._dispatch(ds)
        self._maybe_idle(replica, ds)

    def _reserve(self, replica: SimReplica) -> None:
        for gpu_id, reserved in replica.bytes_by_gpu.items():
            gpu = self.gpus[gpu_id]
            gpu.occupants[replica.id] = reserved
            self.reserved_total += reserved
        self._check(replica.bytes_by_gpu)

    def _release(self, replica: SimReplica) -> None:
        for gpu_id in replica.bytes_by_gpu:
            self.reserved_total -= self.gpus[gpu_id].occupants.pop(replica.id)
        replica.bytes_by_gpu = {}
        self._check(())

    def _check(self, gpu_ids: Iterable[int]) -> None:
        # Invariant 1 of docs/architecture.md, at every simulated instant the reservations change.
        self.counters.overcommit_checks += 1
        for gpu_id in gpu_ids:
            gpu = self.gpus[gpu_id]
            if gpu.reserved_bytes > gpu.total_bytes:
                raise OverCommit(
                    f"t={self.now:.3f}s: gpu {gpu.node}/{gpu.index} holds {gpu.reserved_bytes} B of {gpu.total_bytes} B"
                )
        if self.reserved_total > self.gpu_count * self.config.cluster.gpu_bytes:
            raise OverCommit(f"t={self.now:.3f}s: the cluster holds more than its memory")

    # --- provisioning and snapshots ----------------------------------------------------------

    def _provision(self) -> None:
        """At t=0, at no cost, the steady state a running portal would be in: each deployment,
        most requested first, is loaded where it fits without evicting anyone, and has served
        for its min_runtime already; one that does not fit was loaded once when it was deployed
        and has slept since, so its weights are in a node's CPU RAM (`_park_on`) and its first
        request wakes it rather than reading it from disk. A portal is not restarted cold for
        every trace: starting everyone young, or never loaded, would measure a cold start."""
        parked: dict[str, int] = dict.fromkeys(sorted(self.node_gpus), 0)
        for ds in sorted(self.deployments.values(), key=lambda d: (-d.spec.rate_per_s, d.spec.name)):
            # Its replicas as far as they fit; with none, one copy asleep in a node's CPU RAM.
            for _ in range(max(1, ds.replicas)):
                if not self._provision_one(ds):
                    break
            if not ds.awake:
                node = self._park_on(ds, parked)
                if node is None:
                    continue  # no node may hold it: never loaded, its requests wait and fail
                parked[node] += ds.need_bytes
                deep = self.policy.two_level_sleep
                asleep = SimReplica(self._new_id(ds), ds.spec.name, node, {}, SLEEPING, deep=deep)
                self.replicas[asleep.id] = asleep
                ds.keep_asleep(asleep)

    def _provision_one(self, ds: DeploymentState) -> bool:
        policy = replace(self.policy.placement, evictions=False)
        result = place(self._snapshot(ds), self._request(ds), policy=policy, rng=self.rng)
        if isinstance(result, CantAccommodate):
            return False
        replica = SimReplica(result.replica_id, ds.spec.name, result.node, dict(result.bytes_by_gpu), SERVING)
        replica.serving_since = -self._setting(ds.spec.min_runtime_s, self.serving.min_runtime_s)
        # Last asked when it started serving, as the live portal stamps a replica that starts
        # serving (services.replica_reports): never asked (None) is the cost order's cheapest
        # victim, so every replica of the start, a 70B model the first, was the first victim
        # of the first wake.
        replica.last_accessed = replica.serving_since
        self._keep_copy(replica, ds)  # loaded from disk when deployed: its copy made since
        self.replicas[replica.id] = replica
        self._reserve(replica)
        ds.awake.append(replica)
        ds.home = ds.home or tuple(result.gpu_ids)
        self._maybe_idle(replica, ds)
        return True

    def _park_on(self, ds: DeploymentState, parked: Mapping[str, int]) -> str | None:
        """The node whose CPU RAM holds the copy of a deployment that did not fit at the start.
        In the portal that copy sleeps where placement loaded it, so only on a node that can hold
        its need (a need of whole GPUs, enough of them), and loads spread over the nodes by their
        room: the node with the fewest bytes parked per byte of its GPU memory, ties by name. Nodes
        in turn, whatever their size, parked half the copies on a cluster of 8 + 1 GPUs on the one
        GPU, where a 70B copy can never wake and the others contend for 80 GiB. Never a node its
        node selector or tolerations refuse (None where they refuse every node)."""
        gpu_bytes = self.config.cluster.gpu_bytes
        room = {node: len(gpus) * gpu_bytes for node, gpus in self.node_gpus.items()}
        whole = self._whole_gpus(ds.need_bytes)
        allowed = [node for node in parked if node not in ds.refused_nodes]
        if not allowed:
            return None
        fits = [node for node in allowed if (room[node] if whole else gpu_bytes) >= ds.need_bytes] or allowed
        return min(fits, key=lambda node: (parked[node] / room[node], node))

    def _snapshot(
        self,
        ds: DeploymentState,
        *,
        holder: str | None = None,
        only: Iterable[int] | None = None,
        withhold: bool = True,
    ) -> Snapshot:
        """What the ledger would show: occupants with their fairness settings; without the GPUs
        another wake holds the lock of; for a pinned policy, only the deployment's home GPUs."""
        now = self._dt(self.now)
        if only is None and self.policy.pinned_home and ds.home is not None:
            only = ds.home
        ids = sorted(self.gpus) if only is None else sorted(only)
        views = {gpu_id: self._view(self.gpus[gpu_id]) for gpu_id in ids}
        snapshot = Snapshot(gpus=views, taken_at=now)
        if withhold:
            snapshot, _ = planning.withhold_locked(snapshot, [holder] if holder else [], now)
        return snapshot

    def _view(self, gpu: SimGPU) -> GPUView:
        occupants = tuple(self._occupant(self.replicas[rid], reserved) for rid, reserved in gpu.occupants.items())
        return self._gpu_view(gpu, occupants)

    def _room_view(self, gpu: SimGPU) -> GPUView:
        """`_view` with only who holds how much: all that fairness.short_of_room reads, at a
        fraction of the cost (the sweep's rounds ask it every few simulated seconds)."""
        occupants = tuple(
            OccupantView(replica_id=rid, deployment=self.replicas[rid].deployment, state="", reserved_bytes=reserved)
            for rid, reserved in gpu.occupants.items()
        )
        return self._gpu_view(gpu, occupants)

    @staticmethod
    def _gpu_view(gpu: SimGPU, occupants: tuple[OccupantView, ...]) -> GPUView:
        return GPUView(
            id=gpu.id,
            node=gpu.node,
            index=gpu.index,
            total_bytes=gpu.total_bytes,
            available_bytes=gpu.total_bytes - gpu.reserved_bytes,
            version=0,
            virtual=True,
            occupants=occupants,
            wake_lock_holder=gpu.lock_holder,
        )

    def _occupant(self, replica: SimReplica, reserved: int) -> OccupantView:
        spec = self.deployments[replica.deployment].spec
        return OccupantView(
            replica_id=replica.id,
            deployment=replica.deployment,
            state=replica.state,
            reserved_bytes=reserved,
            last_accessed=None if replica.last_accessed is None else self._dt(replica.last_accessed),
            serving_since=None if replica.serving_since is None else self._dt(replica.serving_since),
            dedicated=self.policy.name == "dedicated" or spec.dedicated,
            # Placement's ndif policy ignores `popular` and lets only dedicated requests evict a
            # replica inside min_runtime (the seed's rule); loading replicas count as inside it,
            # which is what stops two deployments evicting each other at the same instant.
            popular=spec.popular,
            min_runtime_s=self._setting(spec.min_runtime_s, self.serving.min_runtime_s),
            # What a sleep and a wake would cost it, and whether anyone is using it now: what the
            # "cost" victim order weighs (the "lru" order ignores them).
            reload_s=self.wake_s(spec),
            in_flight=len(replica.in_flight),
            idle_timeout_s=None
            if spec.popular or not self.policy.idle_timeout
            else self._setting(spec.idle_timeout_s, self.serving.idle_timeout_s),
        )

    def load_s(self, spec: Deployment) -> float:
        return spec.disk_load_s(self.hw)

    def wake_s(self, spec: Deployment) -> float:
        return spec.ram_wake_s(self.hw)

    @staticmethod
    def _setting(own: float | None, default: float) -> float:
        return default if own is None else own

    def _new_id(self, ds: DeploymentState) -> str:
        return f"{ds.spec.name}.{next(self._ids):05d}"

    @staticmethod
    def _dt(t: float) -> datetime:
        return EPOCH + timedelta(seconds=t)


def request_times(
    spec: Deployment, request: Request, hardware: costs.HardwareConfig, spread: int = 1
) -> tuple[float, float]:
    """A request's prefill and its time per output token on a replica spread over `spread` GPUs:
    2 × params × prompt tokens of compute, then one HBM pass over the weights per token."""
    prefill = spec.flops_per_token * request.prompt_tokens / (hardware.prefill_tflops * 1e12 * spread)
    return prefill, spec.weight_bytes / (hardware.hbm_tb_per_s * 1e12 * spread)


def simulate(trace: Trace, config: Config, policy: SimPolicy, *, gpus: int | None = None) -> SimResult:
    return Simulation(trace, config, policy, gpus=gpus).run()
