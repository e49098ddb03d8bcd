"""The trace simulator: its accounting, its reproducibility, and small traces whose
decisions are known in advance. Pure: no database, no Django, simulated time only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.simulate import engine
from bench.simulate.__main__ import report
from bench.simulate.config import DEFAULT_CONFIG, Config, load
from bench.simulate.engine import OverCommit, SimReplica, Simulation, simulate
from bench.simulate.metrics import fewest_gpus, summarize
from bench.simulate.policies import POLICIES
from bench.simulate.trace import Deployment, Request, Trace, generate
from scheduling.simulation.policies import ALL

GiB = 1024**3
SHARING = ("ndif", "lru-fair", "gpuportal")


@pytest.fixture(scope="module")
def quick() -> Config:
    return load(quick=True)


@pytest.fixture(scope="module")
def quick_trace(quick: Config) -> Trace:
    return generate(quick)


def deployment(name: str, gib: float, rate: float = 1.0, *, popular: bool = False) -> Deployment:
    # A model whose estimate is `gib`: weights are a third of it, so ndif's size × 3 equals it too.
    weights = int(gib * GiB / 3)
    return Deployment(name, "hand", "float16", weights, int(gib * GiB), rate, popular, 2e9)


def hand_trace(deployments: list[Deployment], arrivals: list[tuple[float, str]], duration_s: float = 300.0) -> Trace:
    requests = tuple(Request(i, name, t, 128, 32) for i, (t, name) in enumerate(sorted(arrivals)))
    return Trace(tuple(deployments), requests, duration_s)


def one_gpu_node(config: Config) -> Config:
    return replace(config, cluster=replace(config.cluster, nodes=1, gpus_per_node=1))


# --- accounting ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [*SHARING, "dedicated"])
def test_no_gpu_is_over_committed_and_every_request_ends_on_a_crowded_cluster(quick, quick_trace, policy):
    # Two GPUs for a trace that wants several: placements, evictions and fair waits all happen,
    # and the engine checks every GPU's total at every instant a reservation changes.
    result = simulate(quick_trace, quick, POLICIES[policy], gpus=2)
    assert result.counters.overcommit_checks > 0
    assert all(o.end_s is not None for o in result.outcomes)
    assert all(o.ttft_s is not None for o in result.outcomes if o.failed is None)
    assert len(result.outcomes) == len(quick_trace.requests)


def test_a_reservation_beyond_the_gpu_raises_at_that_instant(quick):
    trace = hand_trace([deployment("big", 10)], [])
    sim = Simulation(trace, one_gpu_node(quick), POLICIES["gpuportal"])
    replica = SimReplica("r1", "big", "node00", {1: sim.config.cluster.gpu_bytes + 1}, engine.SERVING)
    sim.replicas[replica.id] = replica
    with pytest.raises(OverCommit, match="node00/0"):
        sim._reserve(replica)


def test_the_same_seed_gives_the_same_table_and_another_seed_another(quick, tmp_path):
    plot = tmp_path / "attainment.png"
    first = report(quick, DEFAULT_CONFIG, generate(quick), plot)
    assert report(quick, DEFAULT_CONFIG, generate(quick), plot) == first
    other = replace(quick, seed=quick.seed + 1)
    assert report(other, DEFAULT_CONFIG, generate(other), plot) != first
    assert plot.stat().st_size > 0


def test_the_trace_spreads_sizes_and_marks_the_most_requested_popular():
    config = load()
    trace = generate(config)
    assert len(trace.deployments) == config.trace.deployments
    sizes = {d.size for d in trace.deployments}
    assert {"0.5B", "70B"} <= sizes
    popular = sorted(trace.deployments, key=lambda d: -d.rate_per_s)[: config.trace.popular]
    assert all(d.popular for d in popular)
    assert sum(d.popular for d in trace.deployments) == config.trace.popular
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < config.trace.duration_s


# --- hand-checked traces -----------------------------------------------------------------------


def test_two_small_deployments_need_two_dedicated_gpus_but_share_one_under_gpuportal(quick):
    a, b = deployment("a", 20), deployment("b", 20)
    trace = hand_trace([a, b], [(t, name) for t in range(1, 200, 10) for name in ("a", "b")])
    quick = replace(quick, serving=replace(quick.serving, idle_timeout_s=1e6))

    def attainment(policy: str, gpus: int) -> float:
        return summarize(simulate(trace, quick, POLICIES[policy], gpus=gpus), quick.serving.slo_ttft_s).attainment

    assert fewest_gpus(lambda g: attainment("dedicated", g), 0.99, 4) == 2
    assert fewest_gpus(lambda g: attainment("gpuportal", g), 0.99, 4) == 1
    shared = Simulation(trace, one_gpu_node(quick), POLICIES["gpuportal"])
    shared._provision()
    assert sorted(shared.gpus[1].occupants.values()) == [a.estimate_bytes, b.estimate_bytes]
    counters = simulate(trace, one_gpu_node(quick), POLICIES["gpuportal"]).counters
    assert (counters.cold_loads, counters.wakes, counters.preemptions) == (0, 0, 0)


def test_ndif_reserves_three_times_the_weights(quick):
    d = deployment("small", 12)
    sim = Simulation(hand_trace([d], [(1.0, "small")]), one_gpu_node(quick), POLICIES["ndif"])
    sim.run()
    assert sim.gpus[1].occupants == {sim.deployments["small"].awake[0].id: 3 * d.weight_bytes}


def test_a_popular_deployment_is_never_preempted_while_the_others_take_turns(quick):
    # One GPU of 80 GiB: the popular one holds 40 GiB, a and b 30 GiB each, so a and b can only
    # take turns beside it; they alternate every 20 s, past min_runtime and max_wait.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6))
    hot, a, b = deployment("hot", 40, popular=True), deployment("a", 30), deployment("b", 30)
    arrivals = [(float(t), "hot") for t in range(0, 300, 5)]
    arrivals += [(float(t), "a" if (t // 20) % 2 == 0 else "b") for t in range(20, 280, 20)]
    victims: list[str] = []

    class Recording(Simulation):
        def _preempt(self, victim: SimReplica) -> None:
            victims.append(victim.deployment)
            super()._preempt(victim)

    sim = Recording(hand_trace([hot, a, b], arrivals), config, POLICIES["gpuportal"])
    result = sim.run()
    assert victims and set(victims) <= {"a", "b"}
    assert all(o.failed is None for o in result.outcomes)
    assert result.counters.preemptions == len(victims)


def test_ndif_evicts_at_once_and_gpuportal_preempts_an_idle_victim_at_once_too(quick):
    # a serves nothing when b arrives: sleeping it cuts no one off, so gpuportal does not wait
    # out max_wait (fairness.preempt_at_once); lru-fair, seed 001, does.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6, max_wait_s=3.0))
    a, b = deployment("a", 50), deployment("b", 50)
    trace = hand_trace([a, b], [(20.0, "b")])
    waits = {}
    # gpuportal without its kept copies (their own test below), which would let a leave at once.
    uncopied = {**POLICIES, "gpuportal": replace(POLICIES["gpuportal"], sleep_from_kept_copy=False)}
    for policy in ("ndif", "gpuportal", "lru-fair"):
        result = simulate(trace, config, uncopied[policy])
        (outcome,) = result.outcomes
        waits[policy] = outcome.start_s - outcome.request.arrival_s
        assert result.counters.preemptions == 1
    # b wakes from CPU RAM once a's weights are out: only the waits before preempting differ, and
    # gpuportal's process start (b, which did not fit at the start, sleeps deeply under its two
    # levels of sleep; the baselines count no process).
    start = config.hardware.process_start_s
    assert waits["gpuportal"] == pytest.approx(waits["ndif"] + start, abs=1e-6)
    assert waits["lru-fair"] - (waits["gpuportal"] - start) == pytest.approx(3.0, abs=1e-6)


def test_a_victim_that_keeps_a_copy_of_its_weights_frees_the_gpu_at_once(quick):
    # a was loaded from disk when deployed and has filled its kept arena since; b was woken from
    # its copy and kept it: each leaves at once when the other wants the GPU (inference.arena: a
    # sleep into a filled or kept arena copies nothing), so each wake waits only for itself.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6))
    a, b = deployment("a", 50), deployment("b", 50)
    trace = hand_trace([a, b], [(20.0, "b"), (40.0, "a")])
    copy_out = a.weight_bytes / (config.hardware.d2h_gb_per_s * 1e9)
    wake = a.weight_bytes / (config.hardware.h2d_gb_per_s * 1e9)

    def waits(policy) -> list[float]:
        result = simulate(trace, config, policy)
        assert result.counters.preemptions == 2 and result.counters.cold_loads == 0
        return [o.start_s - o.request.arrival_s for o in sorted(result.outcomes, key=lambda o: o.request.arrival_s)]

    # b, which did not fit at the start, sleeps deeply there (no process): its wake starts one
    # first. a, preempted, sleeps in its process (its context stays beside b): its wake does not.
    start = config.hardware.process_start_s
    kept = POLICIES["gpuportal"]
    assert kept.sleep_from_kept_copy
    assert waits(kept) == [pytest.approx(start + wake), pytest.approx(wake)]
    uncopied = waits(replace(kept, sleep_from_kept_copy=False))
    assert uncopied == [pytest.approx(copy_out + start + wake), pytest.approx(copy_out + wake)]


def test_with_warm_spares_a_deep_wake_runs_in_its_gpus_spare_which_costs_a_context_of_room(quick):
    # As above, b does not fit at the start and sleeps deeply; a, preempted for it, sleeps in its
    # process. With warm spares b's wake starts in its GPU's spare, and the GPU has a context less.
    plain = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6))
    spared = replace(plain, cluster=replace(plain.cluster, warm_spares=True))
    a, b = deployment("a", 50), deployment("b", 50)
    trace = hand_trace([a, b], [(20.0, "b"), (40.0, "a")])
    wake = a.weight_bytes / (plain.hardware.h2d_gb_per_s * 1e9)
    hw = plain.hardware
    assert 0 < hw.spare_start_s < hw.process_start_s

    def waits(config: Config) -> list[float]:
        result = simulate(trace, config, POLICIES["gpuportal"])
        return [o.start_s - o.request.arrival_s for o in sorted(result.outcomes, key=lambda o: o.request.arrival_s)]

    assert waits(plain) == [pytest.approx(hw.process_start_s + wake), pytest.approx(wake)]
    assert waits(spared) == [pytest.approx(hw.spare_start_s + wake), pytest.approx(wake)]
    context = hw.cuda_context_mib * 1024**2
    assert Simulation(trace, spared, POLICIES["gpuportal"]).gpus[1].total_bytes == plain.cluster.gpu_bytes - context
    # The baselines count no process, and so no spare.
    assert Simulation(trace, spared, POLICIES["ndif"]).gpus[1].total_bytes == plain.cluster.gpu_bytes


def test_a_deep_wake_soon_after_another_on_its_gpu_waits_for_the_next_spare_or_starts_the_plain_way(quick):
    config = one_gpu_node(quick)
    config = replace(config, cluster=replace(config.cluster, warm_spares=True))
    sim = Simulation(hand_trace([deployment("a", 1)], []), config, POLICIES["gpuportal"])
    ds = sim.deployments["a"]
    placement = SimpleNamespace(gpu_ids=(1,))
    hw = config.hardware
    wake = ds.spec.weight_bytes / (hw.h2d_gb_per_s * 1e9)

    first = sim._deep_wake_s(ds, placement)
    sim.now = hw.process_start_s - 1.0  # the next spare is a second from warm
    second = sim._deep_wake_s(ds, placement)
    third = sim._deep_wake_s(ds, placement)  # the one after that has only begun

    assert first == pytest.approx(hw.spare_start_s + wake)
    assert second == pytest.approx(1.0 + hw.spare_start_s + wake)
    assert third == pytest.approx(hw.process_start_s + wake)


def test_a_replica_loaded_from_disk_leaves_once_the_copy_it_fills_while_serving_is_whole(quick):
    # a started serving at 0 (no min_runtime: preemptible at once) and copies its weights to its
    # kept arena in the background for `copy_out`; b asks for the GPU halfway through that copy, so
    # a's sleep waits for the other half, then b wakes.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6, min_runtime_s=0.0))
    a, b = deployment("a", 50), deployment("b", 50)
    copy_out = a.weight_bytes / (config.hardware.d2h_gb_per_s * 1e9)
    wake = a.weight_bytes / (config.hardware.h2d_gb_per_s * 1e9)
    trace = hand_trace([a, b], [(copy_out / 2, "b")])

    (outcome,) = simulate(trace, config, POLICIES["gpuportal"]).outcomes

    # b did not fit at the start: asleep deeply (no process), its wake starts one first.
    start = config.hardware.process_start_s
    assert outcome.start_s - outcome.request.arrival_s == pytest.approx(copy_out / 2 + start + wake)


def test_a_sleeper_keeps_its_context_on_its_gpu_until_deep_after_then_its_wake_starts_a_process(quick):
    # a serves at the start, sleeps after its idle timeout (10 s), and is asked for again at 100 s.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=10.0, min_runtime_s=0.0))
    a = deployment("a", 50)
    trace = hand_trace([a], [(100.0, "a")])
    wake, start = a.weight_bytes / (config.hardware.h2d_gb_per_s * 1e9), config.hardware.process_start_s
    held: dict[float, int] = {}

    class Watching(Simulation):
        def _advance(self, t: float) -> None:
            held[self.now] = self.reserved_total
            super()._advance(t)

    def wait(deep_after_s: float) -> float:
        held.clear()
        sim = Watching(
            trace, replace(config, serving=replace(config.serving, deep_after_s=deep_after_s)), ALL["gpuportal"]
        )
        (outcome,) = sim.run().outcomes
        return outcome.start_s - outcome.request.arrival_s

    context = config.hardware.cuda_context_mib * 1024**2
    # Never deeply (the default): asleep it holds its context until asked, and wakes from it.
    assert wait(0.0) == pytest.approx(wake)
    assert held[max(t for t in held if t < 100.0)] == context
    # Deeply after 30 s asleep: it holds nothing from then on, and its wake starts a process first.
    assert wait(30.0) == pytest.approx(start + wake)
    asleep_since = min(t for t, reserved in held.items() if reserved == context)
    assert {reserved for t, reserved in held.items() if asleep_since + 30.0 < t < 100.0} == {0}


def test_a_sleeper_a_placement_evicts_sleeps_deeply_and_frees_its_context_at_once(quick):
    # b (asleep in its process on the one GPU, holding its context) is in the way of c's new
    # replica, which needs the whole GPU: ndif's placement evicts it, and it sleeps deeply.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, min_runtime_s=0.0))
    b, c = deployment("b", 50), deployment("c", 79.5)
    sim = Simulation(hand_trace([b, c], []), config, POLICIES["ndif"])
    asleep = SimReplica("b.1", "b", "node00", {1: config.hardware.cuda_context_mib * 1024**2}, engine.SLEEPING)
    sim.replicas[asleep.id] = asleep
    sim.deployments["b"].keep_asleep(asleep)
    sim._reserve(asleep)

    assert sim._evict(asleep) == 0.0, "nothing to copy out: its weights are in host memory already"
    assert asleep.deep and sim.gpus[1].reserved_bytes == 0 and sim.counters.deep_sleeps == 1


def test_gpuportal_waits_max_wait_before_preempting_a_busy_victim(quick):
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6, max_wait_s=3.0))
    a, b = deployment("a", 50), deployment("b", 50)
    trace = hand_trace([a, b], [(19.9, "a"), (20.0, "b")])
    preempted_at: list[float] = []

    class Recording(Simulation):
        def _preempt(self, victim: SimReplica) -> None:
            preempted_at.append(self.now)
            super()._preempt(victim)

    Recording(trace, config, POLICIES["gpuportal"]).run()
    assert preempted_at == [pytest.approx(23.0)]


def test_a_deployment_that_does_not_fit_at_the_start_wakes_from_cpu_ram_not_disk(quick):
    # Three 50 GiB deployments, one 80 GiB GPU: one is loaded, the others were deployed earlier
    # and sleep in CPU RAM (the steady state), so no request reads weights from disk.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=1e6))
    ds = [deployment(n, 50) for n in "abc"]
    trace = hand_trace(ds, [(10.0 * i, n) for i, n in enumerate("abcabc", start=1)])
    for policy in SHARING:
        counters = simulate(trace, config, POLICIES[policy]).counters
        assert counters.cold_loads == 0 and counters.wakes > 0, policy


def test_lru_fair_places_only_on_its_home_gpus_while_gpuportal_sees_the_whole_cluster(quick):
    config = replace(quick, cluster=replace(quick.cluster, nodes=1, gpus_per_node=4))
    trace = hand_trace([deployment("a", 20)], [])
    seen = {}
    for policy in ("lru-fair", "gpuportal"):
        sim = Simulation(trace, config, POLICIES[policy])
        ds = sim.deployments["a"]
        ds.home = (3,)
        seen[policy] = sorted(sim._snapshot(ds).gpus)
    assert seen == {"lru-fair": [3], "gpuportal": [1, 2, 3, 4]}


def test_the_standard_config_parses_and_describes_the_issues_cluster():
    config = load(Path(DEFAULT_CONFIG))
    assert (config.trace.deployments, config.cluster.nodes, config.cluster.gpus_per_node) == (64, 8, 8)
    assert config.cluster.gpu_memory_gib == 80


# --- the rules for the large models (gpuportal-next) -----------------------------------------


def test_a_replica_whose_wake_misses_the_slo_is_not_slept_on_the_idle_timer_but_still_preempted(quick):
    # `slow` wakes in 9 s, past the 5 s SLO: gpuportal-wake sleeps it after 5 s idle and its second
    # request waits for the wake; gpuportal-next keeps it (fairness.sleep_when_idle) until `b`
    # needs the GPU, and then preempts it at once, as it is idle.
    config = replace(one_gpu_node(quick), serving=replace(quick.serving, idle_timeout_s=5.0))
    slow, b = replace(deployment("slow", 50, rate=2.0), wake_s=9.0), deployment("b", 50, rate=1.0)
    trace = hand_trace([slow, b], [(1.0, "slow"), (40.0, "slow"), (100.0, "b")])
    now = simulate(trace, config, ALL["gpuportal-wake"])
    nxt = simulate(trace, config, ALL["gpuportal-next"])
    ttft = {o.request.arrival_s: o.ttft_s for o in nxt.outcomes}
    assert [o.ttft_s > 5.0 for o in sorted(now.outcomes, key=lambda o: o.request.arrival_s)][:2] == [False, True]
    assert ttft[40.0] < 5.0 and nxt.counters.wakes_by_deployment.get("slow", 0) == 0
    assert nxt.counters.preemptions == 1 and all(o.failed is None for o in nxt.outcomes)


def _three_idle_and_a_sleeping_big(quick: Config) -> tuple[Config, Trace]:
    """One node of four 80 GiB GPUs, three holding an idle 50 GiB replica each, and `big` (150
    GiB, asleep in CPU RAM) asked for once at 20 s."""
    config = replace(
        quick,
        cluster=replace(quick.cluster, nodes=1, gpus_per_node=4),
        serving=replace(quick.serving, idle_timeout_s=1e6, max_wait_s=3.0),
    )
    smalls = [deployment(f"s{i}", 50, rate=1.0) for i in range(3)]
    big = deployment("big", 150, rate=0.1)
    return config, hand_trace([*smalls, big], [(20.0, "big")])


def test_a_model_needing_two_whole_gpus_preempts_idle_victims_at_once(quick):
    # One node of four 80 GiB GPUs, three holding an idle 50 GiB replica each; `big` (150 GiB,
    # asleep in CPU RAM) needs two whole GPUs: the empty one and one other. gpuportal-next asks
    # fairness.choose_whole_gpus for the cheapest to empty and preempts its idle replica at once
    # (one victim for its one waiting request); gpuportal-wake targets by placement and waits out
    # max_wait first. (Without fairness.sleep_early, which would have slept the idle replicas
    # before `big` came: the next test.)
    config, trace = _three_idle_and_a_sleeping_big(quick)
    waits = {}
    for name in ("gpuportal-wake", "gpuportal-next"):
        result = simulate(trace, config, replace(ALL[name], sleep_early=False))
        (outcome,) = result.outcomes
        waits[name] = outcome.start_s - outcome.request.arrival_s
        assert result.counters.preemptions == 1 and result.counters.wakes == 1, name
    assert waits["gpuportal-wake"] - waits["gpuportal-next"] == pytest.approx(3.0, abs=1e-6)


def test_idle_replicas_sleep_before_their_timeout_when_their_node_has_no_room_for_a_copy_asleep_there(quick):
    # The same node: `big` asleep in its CPU RAM wakes within the SLO but fits on no GPU as things
    # are, so fairness.sleep_early sleeps the idle replicas once idle for max_wait (the sweep's
    # rounds) rather than after their idle timeout; when `big` comes, its room is free already:
    # no preemption, and no wait for a victim's weights to leave.
    # The victims hold no copy of their weights in host memory (a host cache with no room for kept
    # arenas): with one, they leave at once and the rule saves that wait only while a copy is filling.
    # Asleep in their processes they keep their CUDA contexts, which `big`'s whole GPUs must not
    # hold: those sleep deeply once it asks, its only wait for room.
    config, trace = _three_idle_and_a_sleeping_big(quick)
    uncopied = replace(ALL["gpuportal-next"], sleep_from_kept_copy=False)
    early = simulate(trace, config, uncopied)
    late = simulate(trace, config, replace(uncopied, sleep_early=False))
    assert (early.counters.preemptions, late.counters.preemptions) == (0, 1)
    assert early.counters.deep_sleeps == 1, "one sleeper's context stood on the GPUs big took"
    (first,), (then,) = early.outcomes, late.outcomes
    assert first.room_s < then.room_s
    assert first.ttft_s is not None and then.ttft_s is not None and first.ttft_s < then.ttft_s


def test_copies_that_fit_nowhere_at_the_start_sleep_on_the_nodes_by_their_room_and_only_where_they_can_wake(quick):
    # Nine GPUs: a node of eight and one of one. Nodes in turn put every other copy on the one-GPU
    # node, where a 150 GiB copy (two whole GPUs) could never wake; by room, the large copies all
    # sleep on the node of eight, and the small ones about eight to one.
    config = replace(quick, cluster=replace(quick.cluster, nodes=2, gpus_per_node=8))
    big = [deployment(f"big{i}", 150, rate=1.0) for i in range(6)]
    small = [deployment(f"s{i:02d}", 70, rate=0.5) for i in range(18)]
    sim = Simulation(hand_trace([*big, *small], []), config, ALL["gpuportal-next"], gpus=9)
    sim._provision()
    asleep = {name: next(iter(ds.cached.values())).node for name, ds in sim.deployments.items() if ds.cached}
    assert {asleep[d.name] for d in big if d.name in asleep} == {"node00"}
    on_small_node = sum(1 for node in asleep.values() if node == "node01")
    assert 0 < on_small_node <= len(asleep) // 8 + 1


def test_the_replicas_loaded_at_the_start_were_last_asked_when_they_began_serving(quick):
    sim = Simulation(
        hand_trace([deployment("a", 30, rate=1.0), deployment("b", 30, rate=0.5)], []), quick, ALL["gpuportal-next"]
    )
    sim._provision()
    awake = [r for r in sim.replicas.values() if r.serving_since is not None]
    assert awake and all(r.last_accessed == r.serving_since for r in awake)
