"""The policies compared on one trace. Each is a set of choices fed to the project's own pure
modules (scheduling.core.placement / fairness / memory); the engine applies them on a simulated clock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from scheduling.core.placement import POLICIES as PLACEMENT
from scheduling.core.placement import Policy


@dataclass(frozen=True)
class SimPolicy:
    name: str
    # memory.POLICIES key: how many bytes a replica reserves.
    memory: str
    placement: Policy
    # Replicas idle for idle_timeout sleep on their own (seed 001); popular ones never do.
    idle_sleep: bool
    # True: a wake that does not fit waits max_wait for a voluntary sleep, then preempts the
    # victims fairness.choose_victim names (seed 001, our wake path). False: placement evicts at
    # once (seed 000) when `placement.evictions`, else the wake is retried later.
    fair_wait: bool
    # Seed 001's same-GPU constraint: a deployment wakes only on the GPUs it first loaded on.
    pinned_home: bool = False
    # fairness.VictimOrder: "lru" (seed 001) or "cost" (reload cost against recency, idle first).
    victim_order: str = "lru"
    # A fair wake targets the GPU where fairness.choose_target says making room costs least,
    # rather than where placement's fewest-evictions search points (which ignores who may go).
    target_by_cost: bool = False
    # The deployments' idle timeout is known to fairness (OccupantView.idle_timeout_s): past it, a
    # replica serving nothing is "expired", the first victim. With idle_sleep off, that is how
    # idle replicas leave: when someone needs their memory, not when a timer fires.
    idle_timeout: bool = False
    # Victims that serve no request now are preempted at once, without the max_wait
    # (fairness.preempt_at_once); a busy victim still gets the whole wait.
    preempt_idle_at_once: bool = False
    # fairness.prefer_wake: a deployment with a copy in CPU RAM wakes it on its node (a fair wait
    # if need be) rather than load a new replica from disk elsewhere, when the load is the slower.
    prefer_wake: bool = False
    # fairness.choose_whole_gpus: a wake that needs whole GPUs (a 70B model) targets the GPUs of
    # one node that fairness can empty at least cost, rather than placement's fewest-evictions
    # search, which counts popular and young replicas as movable; victims whose wake misses the
    # SLO last, and never more victims than the requests waiting for the waker (else placement's
    # targeting after all), so that emptying GPUs does not start a cascade of wakes.
    whole_gpus_by_cost: bool = False
    # The first proposal of that rule, without those two guards (the victims fewest first).
    whole_gpus_unguarded: bool = False
    # fairness.sleep_when_idle: a replica whose wake is slower than its SLO is not slept on the
    # idle timer; it leaves when a wake needs its memory (a preemption, at once when idle).
    keep_slow_wakes: bool = False
    # fairness.sleep_early: an idle replica that wakes within its SLO sleeps once idle for
    # max_wait, before its idle timeout, when its node has no room for a copy asleep there that
    # would wake within its SLO (the idle sweep's rounds, every SWEEP_S), so that copy's wake
    # does not wait for the replica's weights to leave.
    sleep_early: bool = False
    # A request arriving while a failed wake backs off asks for a wake at once, as the product's
    # request path does (services.requests._admit calls sleep.wake_deployment on every request
    # that finds nothing awake); the backoff then only spaces the retries nobody asks for.
    wake_on_arrival: bool = False
    # A replica keeps a copy of its weights in host memory (the product's kept arena,
    # inference.arena: where the node's host cache has room, which the simulator assumes it always
    # has): woken from its copy, it keeps that one; loaded from disk, it fills one in the
    # background while it serves (`arena.fill`, a device-to-host copy's time). A sleep then copies
    # nothing and frees the GPU at once, or once that copy is whole.
    sleep_from_kept_copy: bool = False
    # Two levels of sleep, as the product's: asleep in its process a replica keeps its CUDA context
    # on its GPUs; deeply asleep (past deep_after_s, evicted, or told to by a wake that needs that
    # room) it holds nothing and its wake starts a process first. Off, a sleeper holds nothing and
    # wakes without one (the baselines: their systems keep a process they do not count).
    two_level_sleep: bool = False
    # The oracle: memory is unlimited, every deployment is always loaded.
    unlimited: bool = False


# Whole GPUs per deployment, never shared, never evicted: every need reserves whole GPUs.
DEDICATED = SimPolicy(
    "dedicated",
    memory="gpuportal",
    placement=Policy(
        "dedicated", whole_gpu_from=0.0, best_fit=True, victims="fewest", protect_fairness=True, evictions=False
    ),
    idle_sleep=False,
    fair_wait=False,
)
# Seed 000: size × 3, random fit, smallest tenants evicted first, at once; no fairness, no idle sleep.
NDIF = SimPolicy("ndif", memory="ndif", placement=PLACEMENT["ndif"], idle_sleep=False, fair_wait=False)
# Seed 001: measured memory, min runtime, max wait, popular, LRU victims on the deployment's own GPUs.
LRU_FAIR = SimPolicy(
    "lru-fair",
    memory="gpuportal",
    placement=Policy("lru-fair", whole_gpu_from=0.99, best_fit=False, victims="fewest", protect_fairness=True),
    idle_sleep=True,
    fair_wait=True,
    pinned_home=True,
)
# The project's policy, as the live product runs it: placement POLICIES["gpuportal"] (best fit),
# memory.need_for("gpuportal"); a woken replica may move to any GPU with room. When it fits
# nowhere, services.preemption.start asks fairness.choose_target for the GPU whose victims are
# cheapest (no busy ones, fastest to sleep, cheapest to reload per second idle); victims serving
# nothing are preempted at once, a busy one still gets the whole max_wait. Idle replicas sleep
# after idle_timeout (the product's idle sweep, a Celery beat task); the product does
# not pass idle_timeout_s to fairness (the sweep already acts on it), so neither does this.
GPUPORTAL = SimPolicy(
    "gpuportal",
    memory="gpuportal",
    placement=PLACEMENT["gpuportal"],
    idle_sleep=True,
    fair_wait=True,
    victim_order="cost",
    idle_timeout=False,
    target_by_cost=True,
    preempt_idle_at_once=True,
    sleep_from_kept_copy=True,
    two_level_sleep=True,
)
# gpuportal with fairness.prefer_wake: a deployment with a copy in CPU RAM wakes it on
# its node, by a fair wait if need be, rather than load a new replica from disk on another node
# whenever the disk load is slower than the wake after max_wait. The live wake path
# (services.sleep.wake_deployment) applies the same rule when a request finds no replica awake.
# Requests arriving while a failed wake backs off ask for a wake at once, as the live request
# path does (`wake_on_arrival`).
GPUPORTAL_WAKE = replace(GPUPORTAL, name="gpuportal-wake", prefer_wake=True, wake_on_arrival=True)
# gpuportal-wake with the rules for the large models, what the live portal runs: a replica
# whose wake misses its SLO is not slept on the idle timer, only preempted when a wake needs its
# memory (fairness.sleep_when_idle; the idle sweep, services.sleep.sweep_idle, applies it against
# GPUPORTAL_TTFT_SLO_S); and a wake that needs whole GPUs (a 70B model) targets the node and GPUs
# that fairness can empty at least cost (fairness.choose_whole_gpus, with its guards against a
# cascade of wakes) rather than placement's targeting, which counts popular and young replicas as
# movable; services.preemption.start does the same with GPUPORTAL_TTFT_SLO_S and the deployment's
# queue depth. And an idle replica sleeps early when its node has no room for a copy asleep there
# (fairness.sleep_early; the idle sweep, services.sleep.sweep_idle, does the same).
GPUPORTAL_NEXT = replace(
    GPUPORTAL_WAKE, name="gpuportal-next", keep_slow_wakes=True, whole_gpus_by_cost=True, sleep_early=True
)
# gpuportal-next with the first proposal of fairness.choose_whole_gpus: no guards, the fewest
# victims first. It needed fewer GPUs on most synthetic seeds but more on a production-like trace,
# where emptying two GPUs of many small replicas made each of them wake and preempt in turn
# (BENCHMARKS.md); kept beside gpuportal-next to show what the guards cost and save.
GPUPORTAL_WHOLE = replace(GPUPORTAL_NEXT, name="gpuportal-whole", whole_gpus_unguarded=True)
ORACLE = SimPolicy(
    "oracle", memory="gpuportal", placement=PLACEMENT["gpuportal"], idle_sleep=False, fair_wait=False, unlimited=True
)

POLICIES: Mapping[str, SimPolicy] = {p.name: p for p in (DEDICATED, NDIF, LRU_FAIR, GPUPORTAL, ORACLE)}
# Beside the compared policies, not in the benchmark's table of policies: the planner's proposals.
PROPOSALS: Mapping[str, SimPolicy] = {p.name: p for p in (GPUPORTAL_WAKE, GPUPORTAL_NEXT, GPUPORTAL_WHOLE)}
ALL: Mapping[str, SimPolicy] = {**POLICIES, **PROPOSALS}
