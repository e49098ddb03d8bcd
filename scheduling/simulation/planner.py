"""The capacity planner: how many GPUs a trace needs for a target share of its requests
to get their first token within the SLO. Pure: a trace and a config in, a `Plan` out; the callers
(`manage.py plan`, the control worker's plan task, `python -m bench.simulate`) read the files or
the portal and show the answer.

Per policy: the fewest GPUs of the configured kind reaching the target (bisection, as run.py), the
first count from that one on at which the target holds at a few counts in a row
(`metrics.holds_from`: attainment does not always grow with the count), the
attainment at the GPU count the portal has now, and the attainment curve the searches drew. Three
bounds, each the GPUs that hold a working set read from the oracle's run (every request served the
moment it arrives, or, for the tighter two, once the wake its burst opens with is done); they are
references, not floors: a policy may serve a request up to its SLO late, once another replica has
left, and let the requests the target allows miss, so it can come in under them (seed 4 in
BENCHMARKS.md's table "Capacity planner: every seed, and a trace file"):

- the oracle's: memory unlimited, every deployment always loaded, so its GPU count is the least
  that holds the working set (the deployments serving a request at once) at its busiest instant.
  It charges no wake and no load at all;
- a tighter one that counts the wakes (`load_aware_bound`): a deployment whose wake from CPU RAM
  alone takes longer than its SLO misses the requests that find it asleep. Such a deployment is
  either held in memory for the whole trace (its bytes counted throughout), or it sleeps between
  its bursts and the requests at the head of each burst miss. The misses the target allows
  (1 − target of the requests) go to the deployments cheapest to let miss (fewest misses per byte
  held); the others are held. That working set is what a policy that sleeps the rest between
  bursts holds, so it is the bound the policies are judged against when it is higher than the
  oracle's, and each held deployment is named with why. And every deployment not held wakes at
  the head of each burst, fast or slow: a burst (requests arriving within a wake of the last one's
  end, since through a shorter gap staying loaded holds no more) holds its memory from its first
  request, as the wake's weights cross the bus, and its requests are served from the wake's end,
  so it ends up to a wake later than the oracle's. The oracle loads nothing, so its bound charged
  the misses of those wakes but not the memory they hold (on the second production-like trace
  the misses at the bound that did not count it were wakes waiting for room, BENCHMARKS.md);
- both count bytes as a fluid: 1.8 GPUs of a 70B model, or two 32B models at 0.9 of a GPU each,
  as if the bytes could be poured across GPUs. The portal's placement cannot: a need of a GPU or
  more (at or above `whole_gpu_from` of one) takes whole GPUs that no one else shares, and two
  replicas larger than half a GPU never share one. `packed_bound` counts the same working set
  (the held deployments throughout, the others from their wakes on) in whole GPUs: the whole GPUs
  of the large needs, plus Martello and Toth's L2 lower bound for bin packing the rest (a true
  floor for packing that set: every policy but the oracle places with `placement.place`), so it
  is the bound the policies are judged against when it is higher.

And per deployment, the requests a policy's run missed and why: waiting for room (a fair wait, the
victims' weights leaving), a cold load from disk, a wake from CPU RAM, or the queue of a busy
replica, as `DeploymentMisses`.

And advice (`Advice`): the deployments the tighter bound holds in memory are what it takes for
granted that no wake ever evicts, while the policy, which cannot know the trace ahead, may evict
one to wake another and then miss the head of its next burst. An operator can promise the same
with a setting the portal has, `popular` (never preempted, never slept on the idle timer); the
planner searches the explained policy once more with them marked so and says whether that lowers
its GPU count. It is advice for this trace, tried on it, not a rule: on some traces the memory
they then hold for good costs the others more than their misses did.

And advice to scale out (`ScaleAdvice`): a deployment whose misses were mostly the queue of a busy
replica wants more replicas than it has at its busiest. The planner counts how many
(`replicas_at_peak`: the most of its requests in flight at once had each been served from its
arrival, over the batch one replica serves, `[serving] max_batch`, or over its own
`target_in_flight` where it autoscales), searches the explained policy once more with those
deployments given that many (`replicas`; raised `autoscale.max_replicas` for one that
autoscales), and says whether that lowers its GPU count, naming the commands. An autoscaled one
whose max_replicas covers its busiest moment queued while its autoscaler caught up with a burst
(a sweep, then a load, behind it): it is given instead the fewest `autoscale.min_replicas` with
which its own requests meet the target where GPUs are plenty (`_floor`, bisected on runs of the
explained policy). The simulator counts what a request waited for that scale-up as the queue's.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from gpuportal.wire import deployment_spec
from scheduling.core import autoscale
from scheduling.simulation.config import Config, Pool
from scheduling.simulation.engine import RequestOutcome, SimResult, request_times, simulate
from scheduling.simulation.metrics import fewest_gpus, holds_from, met_slo, summarize
from scheduling.simulation.policies import ALL as POLICIES
from scheduling.simulation.trace import Deployment, Trace

DEFAULT_POLICIES = ("gpuportal", "gpuportal-next", "dedicated", "oracle")
# Each search is a bisection over 1..max_gpus after one run at max_gpus and one at the current count.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PolicyPlan:
    policy: str
    fewest_gpus: int | None  # None: even max_gpus falls short; the oracle's is its working-set bound
    attainment_now: float  # at the current GPU count
    failed_now: int
    cold_loads_now: int
    wakes_now: int
    p99_wait_s_now: float
    curve: dict[int, float]  # attainment at every GPU count the search tried
    # From the fewest on, the first count at which the target holds for the search's window of
    # counts in a row (metrics.holds_from), and the last count of that window (it stops at the most
    # GPUs searched). None where fewest_gpus is.
    holds_from: int | None = None
    holds_to: int | None = None
    short_after: tuple[int, ...] = ()  # the counts past the fewest the searches ran that fall short

    @property
    def unsteady(self) -> str:
        """The counts past the fewest that fall short, and where the target holds ('' where none does)."""
        if self.fewest_gpus is None or not self.short_after:
            return ""
        start, end = self.holds_from, self.holds_to
        below = [g for g in self.short_after if start is None or g < start]
        above = [g for g in self.short_after if end is not None and g > end]
        text = f"{self.policy} reaches the target at {gpus(self.fewest_gpus)}"
        if below:
            text += f" but not at {', '.join(map(str, below))}"
        if start is not None:
            text += f"; it holds at every count from {start} to {end}"
        if above:
            text += f", and falls short again at {', '.join(map(str, above))}"
        return text


@dataclass(frozen=True)
class DeploymentMisses:
    deployment: str
    requests: int
    missed: int
    failed: int
    cold_loads: int
    wakes: int
    # Seconds the missed requests waited, summed, by where the wait went.
    room_s: float
    cold_load_s: float
    wake_s: float
    queue_s: float
    # What its first failed request ended with, where one failed.
    failure: str = ""

    @property
    def cause(self) -> str:
        if self.failed == self.missed and self.missed:
            return "failed"
        parts = {
            "waiting for room": self.room_s,
            "cold loads": self.cold_load_s,
            "wakes": self.wake_s,
            "queued behind a busy replica": self.queue_s,
        }
        return max(parts, key=lambda k: parts[k])

    @property
    def why(self) -> str:
        n = max(1, self.missed - self.failed)
        waits = [
            f"{label} {seconds / n:.1f} s"
            for label, seconds in (
                ("room", self.room_s),
                ("cold load", self.cold_load_s),
                ("wake", self.wake_s),
                ("queue", self.queue_s),
            )
            if seconds > 0
        ]
        text = f"{self.cause}: mean wait of a miss " + (", ".join(waits) or "0 s")
        text += f"; {self.cold_loads} cold loads, {self.wakes} wakes"
        if self.failed:
            text += f"; {self.failed} failed" + (f" ({self.failure})" if self.failure else "")
        return text


@dataclass(frozen=True)
class HeldDeployment:
    """A deployment whose wake alone is longer than its SLO, and what the tighter bound did with it."""

    deployment: str
    wake_s: float
    need_bytes: int
    requests: int
    misses_if_asleep: int  # requests at the head of its bursts, which a wake cannot serve in time
    held: bool  # True: counted in memory for the whole trace; False: its misses fit the budget


@dataclass(frozen=True)
class Bound:
    oracle_gpus: int
    load_aware_gpus: int
    miss_budget: int  # requests the target lets miss
    slow_wakes: tuple[HeldDeployment, ...] = ()
    # The load-aware working set counted in whole GPUs as placement packs it (`packed_bound`);
    # 0: not computed.
    packed_gpus: int = 0

    @property
    def gpus(self) -> int:
        """The tightest of the bounds."""
        return max(self.oracle_gpus, self.load_aware_gpus, self.packed_gpus)

    @property
    def held(self) -> tuple[HeldDeployment, ...]:
        return tuple(h for h in self.slow_wakes if h.held)

    @property
    def explanation(self) -> str:
        if not self.slow_wakes:
            return "every deployment wakes within its SLO, so none is held; a burst holds its memory from its wake on"
        held = self.held
        if not held:
            return (
                f"{len(self.slow_wakes)} deployments wake slower than their SLO, but the misses at the head of their "
                f"bursts fit the {self.miss_budget} the target allows"
            )
        names = ", ".join(f"{h.deployment} (wake {h.wake_s:.1f} s, {h.misses_if_asleep} misses asleep)" for h in held)
        return (
            f"held in memory throughout, since a wake cannot meet their SLO and their misses would exceed the "
            f"{self.miss_budget} the target allows: {names}"
        )


@dataclass(frozen=True)
class Advice:
    """The explained policy searched again with the deployments the bound holds marked `popular`
    (an operator's setting: never preempted, never slept on the idle timer). It compares the
    fewest GPUs reaching the target, with the setting and without; `plan.holds_from` is there too."""

    popular: tuple[str, ...]
    plan: PolicyPlan  # the explained policy with them popular
    without: int | None  # its fewest GPUs with the deployments as they are
    max_gpus: int

    @property
    def helps(self) -> bool:
        return _helps(self.plan, self.without)

    @property
    def text(self) -> str:
        names = ", ".join(self.popular)
        return _compared(
            self.plan,
            self.without,
            self.max_gpus,
            f"mark {names} popular (never preempted, as the bound holds them)",
            f"marking {names} popular, as the bound holds them,",
        )


def _helps(plan: PolicyPlan, without: int | None) -> bool:
    """Whether an advice's search needs fewer GPUs, or reaches a target the policy did not."""
    return plan.fewest_gpus is not None and (without is None or plan.fewest_gpus < without)


def _compared(plan: PolicyPlan, without: int | None, max_gpus: int, do: str, doing: str) -> str:
    """An advice's sentence: what it says to do, and the GPUs that takes against those without it."""
    with_, before = (n if n is not None else f"> {max_gpus}" for n in (plan.fewest_gpus, without))
    if _helps(plan, without):
        return f"{do}: {plan.policy} then needs {gpus(with_)} instead of {before}"
    return f"{doing} would not lower {plan.policy}'s {gpus(before)} ({with_} with it)"


@dataclass(frozen=True)
class Scaled:
    """A deployment's replicas as an advice tries them: `replicas`, and its autoscale settings.
    `floor`: the advice raises its autoscale.min_replicas (its autoscaler reacts too late to
    its bursts) rather than its max_replicas."""

    deployment: str
    replicas: int
    autoscale: autoscale.Policy | None
    floor: bool = False

    @property
    def command(self) -> str:
        """The change, as `gpuportal set` takes it: a higher autoscale.max_replicas (or
        min_replicas) for one that autoscales, else more replicas."""
        if self.autoscale is not None and self.floor:
            return f"gpuportal set {self.deployment} {_MIN_REPLICAS}={self.autoscale.min_replicas}"
        if self.autoscale is not None:
            return f"gpuportal set {self.deployment} {_MAX_REPLICAS}={self.autoscale.max_replicas}"
        return f"gpuportal set {self.deployment} {_REPLICAS}={self.replicas}"


_REPLICAS = deployment_spec.BY_NAME["replicas"].path
_MAX_REPLICAS = deployment_spec.BY_NAME["autoscale_max_replicas"].path
_MIN_REPLICAS = deployment_spec.BY_NAME["autoscale_min_replicas"].path


@dataclass(frozen=True)
class ScaleAdvice:
    """The explained policy searched again with the deployments that queued behind a busy replica
    given the replicas their load wants at its busiest (`replicas_at_peak`); it compares the
    fewest GPUs reaching the target, so and as they are."""

    scaled: tuple[Scaled, ...]
    plan: PolicyPlan  # the explained policy with them scaled
    without: int | None
    max_gpus: int

    @property
    def helps(self) -> bool:
        return _helps(self.plan, self.without)

    @property
    def text(self) -> str:
        commands = "; ".join(s.command for s in self.scaled)
        what = f"what queues behind a busy replica the replicas its load wants ({commands})"
        return _compared(self.plan, self.without, self.max_gpus, f"give {what}", f"giving {what}")


@dataclass(frozen=True)
class Variant:
    """What an advice's runs change of the trace's deployments, as an operator would set them."""

    popular: tuple[str, ...] = ()
    scaled: tuple[Scaled, ...] = ()

    def apply(self, trace: Trace) -> Trace:
        marked, scaled = set(self.popular), {s.deployment: s for s in self.scaled}

        def changed(d: Deployment) -> Deployment:
            if d.name in marked:
                d = replace(d, popular=True)
            if d.name in scaled:
                d = replace(d, replicas=scaled[d.name].replicas, autoscale=scaled[d.name].autoscale)
            return d

        return replace(trace, deployments=tuple(changed(d) for d in trace.deployments))


@dataclass(frozen=True)
class Plan:
    requests: int
    deployments: int
    duration_s: float
    gpu_memory_gib: float
    current_gpus: int
    max_gpus: int
    target: float
    slo_ttft_s: float
    policies: tuple[PolicyPlan, ...]
    bound: Bound
    # Of the explained policy (`plan`'s `explain`): at the current GPU count, and at the bound's.
    misses_now: tuple[DeploymentMisses, ...] = ()
    misses_at_bound: tuple[DeploymentMisses, ...] = ()
    simulations: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    advice: Advice | None = None  # None: nothing explained, or no deployment the bound holds to mark
    scale_advice: ScaleAdvice | None = None  # None: nothing explained, or none queued for want of replicas
    # The nodes' pools the runs placed by ([cluster] pools, or the portal's nodes), of how many nodes.
    pools: tuple[Pool, ...] = ()
    pooled_of: int = 0
    window: int = 1  # the counts in a row at which the target must hold (`PolicyPlan.holds_from`)

    def policy(self, name: str) -> PolicyPlan:
        return next(p for p in self.policies if p.policy == name)

    @property
    def bound_gpus(self) -> int:
        return self.bound.gpus


class _Runs:
    """The simulations a plan runs, each once (a policy at a GPU count), counted for its progress."""

    def __init__(self, trace: Trace, config: Config, *, total: int) -> None:
        self.trace, self.config, self.total = trace, config, total
        self.results: dict[tuple[str, int, Variant], SimResult] = {}
        self.progress: Progress | None = None

    def run(self, name: str, gpus: int, variant: Variant = Variant()) -> SimResult:
        """`variant`: what an advice changes of the deployments for this run."""
        if (name, gpus, variant) not in self.results:
            trace = variant.apply(self.trace) if variant != Variant() else self.trace
            self.results[(name, gpus, variant)] = simulate(trace, self.config, POLICIES[name], gpus=gpus)
            if self.progress is not None:
                self.progress(min(len(self.results), self.total), self.total)
        return self.results[(name, gpus, variant)]


def _policy_plan(
    runs: _Runs,
    name: str,
    *,
    current: int,
    max_gpus: int,
    target: float,
    slo: float,
    variant: Variant = Variant(),
) -> PolicyPlan:
    """One policy's row: its fewest GPUs for the target (the oracle's: its peak working set in
    GPUs), from it on the first count at which the target holds over a window, its attainment at
    today's count, and the curve the searches walked."""
    policy = POLICIES[name]
    summary = summarize(runs.run(name, current, variant), slo)
    curve = {current: summary.attainment}
    if policy.unlimited:
        needed = max(1, math.ceil(summary.peak_working_set_gib * 1024**3 / runs.config.cluster.gpu_bytes))
        best = steady = end = needed if summary.attainment >= target else None
    else:

        def attainment_at(gpus: int) -> float:
            curve[gpus] = summarize(runs.run(name, gpus, variant), slo).attainment
            return curve[gpus]

        best = fewest_gpus(attainment_at, target, max_gpus)
        steady = (
            None
            if best is None
            else holds_from(attainment_at, target, best, max_gpus, runs.config.search.steady_window)
        )
        end = None if steady is None else min(steady + runs.config.search.steady_window - 1, max_gpus)
    short = tuple(g for g, a in sorted(curve.items()) if best is not None and g > best and a < target)
    return PolicyPlan(
        policy=name,
        fewest_gpus=best,
        attainment_now=summary.attainment,
        failed_now=summary.failed,
        cold_loads_now=summary.cold_loads,
        wakes_now=summary.wakes,
        p99_wait_s_now=summary.p99_wait_s,
        curve=dict(sorted(curve.items())),
        holds_from=steady,
        holds_to=end,
        short_after=short,
    )


def plan(
    trace: Trace,
    config: Config,
    *,
    current_gpus: int | None = None,
    target: float | None = None,
    slo_ttft_s: float | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    progress: Progress | None = None,
    explain: str | None = None,
) -> Plan:
    """Every policy's fewest GPUs, attainment now, the bounds, and who misses and why: the misses
    of `explain` (one of `policies`; by default `gpuportal`, else the first that is not the oracle)."""
    if not trace.requests:
        raise ValueError("the trace has no requests")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: expected some of {sorted(POLICIES)}")
    target = config.search.target_attainment if target is None else target
    slo = config.serving.slo_ttft_s if slo_ttft_s is None else slo_ttft_s
    if not 0 < target <= 1 or slo <= 0:
        raise ValueError(f"target must be in (0, 1] and the SLO above 0, got {target} and {slo}")
    if explain is not None and explain not in policies:
        raise ValueError(f"cannot explain {explain!r}: it is not among the policies planned {list(policies)}")
    explained = explain or (
        "gpuportal" if "gpuportal" in policies else next((p for p in policies if not POLICIES[p].unlimited), None)
    )
    current = config.cluster.gpus if current_gpus is None else current_gpus
    max_gpus = max(config.search.max_gpus, current)
    # The advices' searches counted too (each runs only where it has something to advise).
    searches = sum(1 for p in policies if not POLICIES[p].unlimited) + (2 if explained else 0)
    # Each search: a bisection, then the rest of the window from its answer (more where a count there
    # falls short).
    steps = 2 + math.ceil(math.log2(max(2, max_gpus))) + config.search.steady_window - 1
    runs = _Runs(trace, config, total=len(policies) + searches * steps)
    runs.progress = progress
    plans = [_policy_plan(runs, name, current=current, max_gpus=max_gpus, target=target, slo=slo) for name in policies]
    # The oracle's run (already made if it is among the policies) is what the bounds are read from.
    bound = load_aware_bound(trace, config, runs.run("oracle", current), target=target, slo_ttft_s=slo)
    misses_now = misses_by_deployment(trace, runs.run(explained, current), slo) if explained else ()
    misses_at_bound = misses_by_deployment(trace, runs.run(explained, bound.gpus), slo) if explained else ()
    advice, scale_advice = None, None
    without = next((pp.fewest_gpus for pp in plans if pp.policy == explained), None)
    marked = tuple(h.deployment for h in bound.held if not _popular(trace, h.deployment))
    if explained and marked:
        advised = _policy_plan(
            runs, explained, current=current, max_gpus=max_gpus, target=target, slo=slo, variant=Variant(marked)
        )
        advice = Advice(marked, advised, without, max_gpus)
    scaled = ()
    if explained:

        def meets(variant: Variant, name: str) -> bool:
            return _own_attainment(runs.run(explained, max_gpus, variant), name, slo) >= target

        scaled = _scale_out(trace, config, (*misses_now, *misses_at_bound), meets)
    if explained and scaled:
        advised = _policy_plan(
            runs,
            explained,
            current=current,
            max_gpus=max_gpus,
            target=target,
            slo=slo,
            variant=Variant(scaled=scaled),
        )
        scale_advice = ScaleAdvice(scaled, advised, without, max_gpus)
    return Plan(
        requests=len(trace.requests),
        deployments=len(trace.deployments),
        duration_s=trace.duration_s,
        gpu_memory_gib=config.cluster.gpu_memory_gib,
        current_gpus=current,
        max_gpus=max_gpus,
        pools=config.cluster.pools,
        pooled_of=config.cluster.pooled_of or config.cluster.nodes,
        target=target,
        slo_ttft_s=slo,
        policies=tuple(plans),
        bound=bound,
        misses_now=misses_now,
        misses_at_bound=misses_at_bound,
        simulations=len(runs.results),
        advice=advice,
        scale_advice=scale_advice,
        window=config.search.steady_window,
    )


def _popular(trace: Trace, name: str) -> bool:
    return any(d.popular for d in trace.deployments if d.name == name)


def _scale_out(
    trace: Trace,
    config: Config,
    misses: Iterable[DeploymentMisses],
    meets: Callable[[Variant, str], bool],
) -> tuple[Scaled, ...]:
    """The deployments whose misses were mostly the queue of a busy replica and whose load wants
    more replicas at its busiest than they may have: an autoscaled one with its max_replicas
    raised to that many (at its own target in flight), another with that many replicas (a batch
    to each). An autoscaled one whose max_replicas covers its busiest moment queued while its
    autoscaler caught up with a burst (a sweep, then a load, behind it): it is given the fewest
    min_replicas with which its own requests meet the target (`_floor`), where some do."""
    queued = {m.deployment for m in misses if m.cause == "queued behind a busy replica"}
    out = []
    for d in trace.deployments:
        if d.name not in queued:
            continue
        own = d.autoscale
        per_replica = own.target_in_flight if own is not None else float(config.serving.max_batch)
        wanted = replicas_at_peak(trace, config, d.name, per_replica)
        if own is not None and wanted > own.max_replicas:
            out.append(Scaled(d.name, d.replicas, replace(own, max_replicas=wanted)))
        elif own is not None and wanted > own.min_replicas:
            floor = _floor(d, own, wanted, meets)
            if floor is not None:
                out.append(floor)
        elif own is None and wanted > d.replicas:
            out.append(Scaled(d.name, wanted, None))
    return tuple(out)


def _floor(d: Deployment, own: autoscale.Policy, most: int, meets: Callable[[Variant, str], bool]) -> Scaled | None:
    """The fewest min_replicas, above its own and up to `most` (its busiest moment's), with which
    the deployment's own requests meet the target where GPUs are plenty; bisected, as more kept
    ready never queues its bursts longer. None when not even `most` does (its misses are then
    not the autoscaler's lag alone)."""

    def raised(floor: int) -> Scaled:
        return Scaled(d.name, max(d.replicas, floor), replace(own, min_replicas=floor), floor=True)

    if not meets(Variant(scaled=(raised(most),)), d.name):
        return None
    low, high = own.min_replicas, most  # low misses (its misses said so), high meets
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(Variant(scaled=(raised(middle),)), d.name) else (middle, high)
    return raised(high)


def _own_attainment(result: SimResult, name: str, slo_ttft_s: float) -> float:
    """The share of a deployment's requests whose first token came within its SLO."""
    outcomes = [o for o in result.outcomes if o.request.deployment == name]
    slo = result.slos.get(name, slo_ttft_s)
    return sum(1 for o in outcomes if met_slo(o, slo)) / max(1, len(outcomes))


def replicas_at_peak(trace: Trace, config: Config, name: str, per_replica: float) -> int:
    """The replicas a deployment's requests want at their busiest, `per_replica` in flight each:
    the most in flight at once had each been served from its arrival (its prefill and decode on
    as many GPUs as its need takes, `engine.request_times`), as the autoscaler counts them."""
    spec = next(d for d in trace.deployments if d.name == name)
    spread = max(1, -(-spec.need_bytes("gpuportal") // config.cluster.gpu_bytes))
    edges: list[tuple[float, int]] = []
    for r in trace.requests:
        if r.deployment == name:
            prefill, per_token = request_times(spec, r, config.hardware, spread)
            edges += [(r.arrival_s, 1), (r.arrival_s + prefill + r.output_tokens * per_token, -1)]
    most = running = 0
    for _, step in sorted(edges):  # an end before a start at the same instant
        running += step
        most = max(most, running)
    unbounded = autoscale.Policy(min_replicas=1, max_replicas=most + 1, target_in_flight=per_replica, down_after_s=0.0)
    return autoscale.wanted(most, unbounded)


def misses_by_deployment(trace: Trace, result: SimResult, slo_ttft_s: float) -> tuple[DeploymentMisses, ...]:
    """The deployments with a missed request, most misses first, and where their waits went."""
    requests: dict[str, int] = {}
    missed: dict[str, list[RequestOutcome]] = {}
    for o in result.outcomes:
        name = o.request.deployment
        requests[name] = requests.get(name, 0) + 1
        if not met_slo(o, result.slos.get(name, slo_ttft_s)):
            missed.setdefault(name, []).append(o)
    out = []
    for name, outcomes in missed.items():
        served = [o for o in outcomes if o.failed is None]
        out.append(
            DeploymentMisses(
                deployment=name,
                requests=requests[name],
                missed=len(outcomes),
                failed=len(outcomes) - len(served),
                cold_loads=result.counters.cold_loads_by_deployment.get(name, 0),
                wakes=result.counters.wakes_by_deployment.get(name, 0),
                room_s=sum(o.room_s for o in served),
                cold_load_s=sum(o.load_s for o in served if o.loaded_by == "cold load"),
                wake_s=sum(o.load_s for o in served if o.loaded_by == "wake"),
                queue_s=sum(o.queue_s for o in served),
                failure=next((o.failed for o in outcomes if o.failed is not None), ""),
            )
        )
    return tuple(sorted(out, key=lambda m: (-m.missed, m.deployment)))


def load_aware_bound(trace: Trace, config: Config, oracle: SimResult, *, target: float, slo_ttft_s: float) -> Bound:
    """The oracle's working-set bound, and the tighter one that counts wakes slower than the SLO
    (the module docstring). `oracle` is the unlimited policy's run: its requests never wait, so
    each one's time to first token is its prefill, and its busy periods are the deployment's."""
    gpu_bytes = config.cluster.gpu_bytes
    specs = {d.name: d for d in trace.deployments}
    need = {d.name: d.need_bytes("gpuportal") for d in trace.deployments}
    by_deployment: dict[str, list[RequestOutcome]] = {}
    for o in oracle.outcomes:
        by_deployment.setdefault(o.request.deployment, []).append(o)
    served: dict[str, list[tuple[float, float]]] = {}  # as the oracle served them: its working set
    woken: dict[str, list[tuple[float, float]]] = {}  # each burst from the start of its wake
    slow: list[HeldDeployment] = []
    for name, outcomes in by_deployment.items():
        outcomes.sort(key=lambda o: o.request.arrival_s)
        wake = specs[name].ram_wake_s(config.hardware)
        slo = oracle.slos.get(name, slo_ttft_s)
        served[name] = _busy(outcomes)
        woken[name], misses = [], 0
        for burst in _bursts(outcomes, wake):
            opened = burst[0].request.arrival_s
            woken[name].append((opened, max(max(o.request.arrival_s, opened + wake) + _service(o) for o in burst)))
            # Asleep when its burst opened, it serves from `opened + wake` on.
            misses += sum(1 for o in burst if opened + wake - o.request.arrival_s + (o.ttft_s or 0.0) > slo)
        if misses:
            slow.append(HeldDeployment(name, wake, need[name], len(outcomes), misses, held=False))
    budget = math.floor((1 - target) * len(oracle.outcomes) + 1e-9)
    # Let the cheapest miss (fewest misses per byte held) until the budget is spent; hold the rest.
    letting = sorted(slow, key=lambda h: (h.misses_if_asleep / h.need_bytes, h.deployment))
    spent, decided = 0, []
    for h in letting:
        if spent + h.misses_if_asleep <= budget:
            spent += h.misses_if_asleep
            decided.append(h)
        else:
            decided.append(HeldDeployment(h.deployment, h.wake_s, h.need_bytes, h.requests, h.misses_if_asleep, True))
    held = {h.deployment for h in decided if h.held}
    oracle_gpus = _gpus_for(_peak(served, need, set()), gpu_bytes)
    load_aware = max(oracle_gpus, _gpus_for(_peak(woken, need, held), gpu_bytes))
    whole_from = POLICIES["gpuportal"].placement.whole_gpu_from
    packed = max(
        load_aware,
        packed_bound(served, need, set(), gpu_bytes, whole_from),
        packed_bound(woken, need, held, gpu_bytes, whole_from),
    )
    ordered = tuple(sorted(decided, key=lambda h: (not h.held, -h.misses_if_asleep, h.deployment)))
    return Bound(oracle_gpus, load_aware, budget, ordered, packed_gpus=packed)


def _busy(outcomes: Sequence[RequestOutcome]) -> list[tuple[float, float]]:
    """The spans in which the deployment served a request (outcomes by arrival)."""
    merged: list[tuple[float, float]] = []
    for o in outcomes:
        arrival = o.request.arrival_s
        end = o.end_s if o.end_s is not None else arrival
        if not merged or arrival > merged[-1][1]:
            merged.append((arrival, end))
        else:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    return merged


def _bursts(outcomes: Sequence[RequestOutcome], wake_s: float) -> list[list[RequestOutcome]]:
    """The requests (by arrival) in the bursts a wake opens: a request opens one when it arrives
    more than a wake after every earlier request ended. Through a shorter gap staying loaded
    holds the memory no longer than sleeping and waking again would, and misses nothing."""
    bursts: list[list[RequestOutcome]] = []
    ended = -math.inf
    for o in outcomes:
        if o.request.arrival_s > ended + wake_s:
            bursts.append([])
        bursts[-1].append(o)
        ended = max(ended, o.end_s if o.end_s is not None else o.request.arrival_s)
    return bursts


def _service(o: RequestOutcome) -> float:
    """How long the oracle took to serve the request from its arrival (it never waits there)."""
    return (o.end_s if o.end_s is not None else o.request.arrival_s) - o.request.arrival_s


def _sweep(intervals: dict[str, list[tuple[float, float]]], held: set[str]) -> list[list[str]]:
    """The sets of deployments in memory, one per instant the set grows: the held ones
    throughout, the others during their spans (an end before a start at the same instant)."""
    events: list[tuple[float, int, str]] = []
    for name, spans in intervals.items():
        if name in held:
            continue
        for start, end in spans:
            events.append((start, 1, name))
            events.append((end, 0, name))
    present: dict[str, int] = dict.fromkeys(held, 1)
    out = [sorted(present)]
    for _, kind, name in sorted(events):
        if kind:
            present[name] = present.get(name, 0) + 1
            out.append(sorted(present))
        else:
            present[name] -= 1
            if not present[name]:
                del present[name]
    return out


def _peak(intervals: dict[str, list[tuple[float, float]]], need: dict[str, int], held: set[str]) -> int:
    return max(sum(need[name] for name in names) for names in _sweep(intervals, held))


def packed_bound(
    intervals: dict[str, list[tuple[float, float]]],
    need: dict[str, int],
    held: set[str],
    gpu_bytes: int,
    whole_gpu_from: float,
) -> int:
    """The fewest GPUs that can hold the working set at its busiest instant as placement packs
    replicas (the module docstring): at every instant, the whole GPUs of the needs at or above
    `whole_gpu_from` of a GPU, plus `bins_lower_bound` of the others."""
    best = 1
    for names in _sweep(intervals, held):
        whole = sum(-(-need[n] // gpu_bytes) for n in names if need[n] >= whole_gpu_from * gpu_bytes)
        shared = [need[n] for n in names if need[n] < whole_gpu_from * gpu_bytes]
        best = max(best, whole + bins_lower_bound(shared, gpu_bytes))
    return best


def bins_lower_bound(sizes: Sequence[int], capacity: int) -> int:
    """Martello and Toth's L2 lower bound on the bins of `capacity` that hold items of `sizes`
    (each at most `capacity`): for every threshold k up to half a bin, the items above
    capacity − k each need a bin of their own, so do the items above half a bin (no two share),
    and the items from k to half a bin need at least the bins their bytes fill beyond the room
    those larger items leave. k = 0 gives the fluid bound, ⌈Σ sizes / capacity⌉, so this is never
    below it."""
    items = sorted((s for s in sizes if s > 0), reverse=True)
    if not items:
        return 0
    half = capacity / 2
    best = 0
    for k in {0, *(s for s in items if s <= half)}:
        big = [s for s in items if s > capacity - k]
        mid = [s for s in items if capacity - k >= s > half]
        small = sum(s for s in items if half >= s >= k)
        room = len(mid) * capacity - sum(mid)
        best = max(best, len(big) + len(mid) + max(0, -(-(small - room) // capacity)))
    return best


def _gpus_for(peak_bytes: int, gpu_bytes: int) -> int:
    return max(1, math.ceil(peak_bytes / gpu_bytes))


# --- showing a plan --------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (what the command prints, the API returns and the admin shows)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def policy_rows(p: Plan) -> list[list[object]]:
    rows: list[list[object]] = []
    for pp in p.policies:
        fewest: object = pp.fewest_gpus if pp.fewest_gpus is not None else f"> {p.max_gpus}"
        steady: object = pp.holds_from if pp.holds_from is not None else f"> {p.max_gpus}"
        if POLICIES[pp.policy].unlimited:
            fewest = steady = f"{fewest} (bound)"
        rows.append(
            [
                pp.policy,
                fewest,
                steady,
                f"{100 * pp.attainment_now:.2f} %",
                pp.failed_now,
                pp.cold_loads_now,
                pp.wakes_now,
                "-" if math.isnan(pp.p99_wait_s_now) else f"{pp.p99_wait_s_now:.2f}",  # none served
            ]
        )
    return rows


POLICY_HEADERS = (
    "policy",
    "fewest GPUs",
    "holds from",
    "attainment now",
    "failed",
    "cold loads",
    "wakes",
    "p99 wait s",
)
MISS_HEADERS = ("deployment", "requests", "missed", "why")


def miss_rows(misses: Sequence[DeploymentMisses], limit: int = 15) -> list[list[object]]:
    return [[m.deployment, m.requests, m.missed, m.why] for m in misses[:limit]]


def gpus(count: int | str) -> str:
    """A count of GPUs as a plan's prose says it: "1 GPU", "3 GPUs", "> 64 GPUs"."""
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def gib(size: float) -> str:
    """A GPU's size as a plan names it: 80, 3.53 (a virtual GPU's usable 3.53125 GiB), 139.8."""
    return f"{round(size, 2):g}"


def render(p: Plan) -> str:
    """The plan as Markdown: the policies, the bounds, who misses now and at the bound."""
    target = f"{100 * p.target:g} %"
    out = [
        f"{p.requests} requests to {p.deployments} deployment{'' if p.deployments == 1 else 's'} over "
        f"{p.duration_s:.0f} s; GPUs of {gib(p.gpu_memory_gib)} GiB; {p.current_gpus} now; target {target} of "
        f"first tokens within {p.slo_ttft_s:g} s.",
        "",
        table(POLICY_HEADERS, policy_rows(p)),
        "",
        f"Holds from: from the fewest GPUs on, the first count at which the target holds for {p.window} counts "
        "in a row (attainment does not always grow with the count)."
        + "".join(f" {pp.unsteady}." for pp in p.policies if pp.unsteady),
        "",
        f"Bounds: the oracle's {gpus(p.bound.oracle_gpus)} (every deployment always loaded); counting the wakes "
        f"(the memory each holds, the misses of those slower than the SLO), {p.bound.load_aware_gpus} "
        f"({p.bound.explanation}); that working set in whole GPUs as "
        f"placement packs it, {p.bound.packed_gpus}.",
    ]
    if p.pools:
        out += ["", pools_text(p.pools, p.pooled_of)]
    if p.advice is not None:
        out += ["", f"Advice: {p.advice.text}."]
    if p.scale_advice is not None:
        out += ["", f"Advice: {p.scale_advice.text}."]
    for title, misses in (
        (f"Missed at {gpus(p.current_gpus)} (now)", p.misses_now),
        (f"Missed at {gpus(p.bound_gpus)} (the bound)", p.misses_at_bound),
    ):
        out += ["", f"{title}:", ""]
        out.append(table(MISS_HEADERS, miss_rows(misses)) if misses else "none")
    return "\n".join(out) + "\n"


def pools_text(pools: Sequence[Pool], of: int) -> str:
    """What a plan says of the nodes' pools it placed by."""
    each = []
    for pool in pools:
        marks = [f"labelled {pool.labels}" if pool.labels else "", f"tainted {pool.taints}" if pool.taints else ""]
        each.append(f"{pool.nodes} of {of} " + " and ".join(mark for mark in marks if mark))
    if rest := of - sum(pool.nodes for pool in pools):
        each.append(f"{rest} of {of} unmarked")
    return (
        f"Nodes: {'; '.join(each)}. Each keeps that share of the nodes at every count; deployments go only where "
        "their node selector and tolerations allow (the bounds do not count them)."
    )


def record(p: Plan) -> dict[str, object]:
    """The plan as JSON-ready data (the API's answer)."""
    return {
        "requests": p.requests,
        "deployments": p.deployments,
        "duration_s": p.duration_s,
        "gpu_memory_gib": p.gpu_memory_gib,
        "current_gpus": p.current_gpus,
        "target": p.target,
        "slo_ttft_s": p.slo_ttft_s,
        "window": p.window,
        "policies": [
            {
                "policy": pp.policy,
                "fewest_gpus": pp.fewest_gpus,
                "holds_from": pp.holds_from,
                "holds_to": pp.holds_to,
                "short_after": list(pp.short_after),
                "attainment_now": pp.attainment_now,
                "failed_now": pp.failed_now,
                "cold_loads_now": pp.cold_loads_now,
                "wakes_now": pp.wakes_now,
                "curve": {str(g): a for g, a in pp.curve.items()},
            }
            for pp in p.policies
        ],
        "pools": [{"nodes": pool.nodes, "labels": pool.labels, "taints": pool.taints} for pool in p.pools],
        "pooled_of": p.pooled_of,
        "bound": {
            "oracle_gpus": p.bound.oracle_gpus,
            "load_aware_gpus": p.bound.load_aware_gpus,
            "packed_gpus": p.bound.packed_gpus,
            "miss_budget": p.bound.miss_budget,
            "explanation": p.bound.explanation,
            "held": [h.deployment for h in p.bound.held],
        },
        "advice": None
        if p.advice is None
        else {
            "popular": list(p.advice.popular),
            "policy": p.advice.plan.policy,
            "fewest_gpus": p.advice.plan.fewest_gpus,
            "holds_from": p.advice.plan.holds_from,
            "fewest_gpus_without": p.advice.without,
            "helps": p.advice.helps,
            "text": p.advice.text,
        },
        "scale_advice": None
        if p.scale_advice is None
        else {
            "replicas": {
                s.deployment: {
                    "replicas": s.replicas,
                    "autoscale": None if s.autoscale is None else asdict(s.autoscale),
                    "command": s.command,
                }
                for s in p.scale_advice.scaled
            },
            "policy": p.scale_advice.plan.policy,
            "fewest_gpus": p.scale_advice.plan.fewest_gpus,
            "holds_from": p.scale_advice.plan.holds_from,
            "fewest_gpus_without": p.scale_advice.without,
            "helps": p.scale_advice.helps,
            "text": p.scale_advice.text,
        },
        "misses_now": [
            {"deployment": m.deployment, "requests": m.requests, "missed": m.missed, "why": m.why} for m in p.misses_now
        ],
        "misses_at_bound": [
            {"deployment": m.deployment, "requests": m.requests, "missed": m.missed, "why": m.why}
            for m in p.misses_at_bound
        ],
    }


def plot(p: Plan) -> bytes:
    """Attainment against GPU count per policy, with the target, the bounds and today's count (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=100)
    for pp in p.policies:
        if POLICIES[pp.policy].unlimited:
            continue
        counts = sorted(pp.curve)
        axes.plot(counts, [100 * pp.curve[g] for g in counts], marker="o", markersize=3, label=pp.policy)
    axes.axhline(100 * p.target, color="grey", linewidth=0.8, linestyle="--", label=f"target {100 * p.target:g} %")
    axes.axvline(p.bound.oracle_gpus, color="black", linewidth=0.8, linestyle=":", label="oracle bound")
    if p.bound.load_aware_gpus > p.bound.oracle_gpus:
        axes.axvline(p.bound.load_aware_gpus, color="purple", linewidth=0.8, linestyle=":", label="bound with wakes")
    if p.bound.packed_gpus > max(p.bound.oracle_gpus, p.bound.load_aware_gpus):
        axes.axvline(p.bound.packed_gpus, color="brown", linewidth=0.8, linestyle=":", label="bound in whole GPUs")
    axes.axvline(p.current_gpus, color="green", linewidth=0.8, label="now")
    axes.set_xlabel(f"GPUs of {gib(p.gpu_memory_gib)} GiB")
    axes.set_ylabel("SLO attainment (%)")
    axes.set_xscale("log", base=2)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
