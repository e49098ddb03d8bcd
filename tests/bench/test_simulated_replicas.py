"""The simulator's deployments of several replicas: as many as `replicas` awake where they fit, and
with `autoscale` set, the product's autoscaler (scheduling.core.autoscale) scaling them by load, so
that the capacity planner plans for a busy deployment's scale-out. Pure: simulated time only."""

from __future__ import annotations

from dataclasses import replace
from statistics import mean

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core import autoscale
from scheduling.simulation.config import Config, load
from scheduling.simulation.engine import STOPPED, Simulation, simulate
from scheduling.simulation.policies import ALL
from scheduling.simulation.trace import Deployment, Request, Trace, generate

GiB = 1024**3
NEXT = ALL["gpuportal-next"]


@pytest.fixture(scope="module")
def quick() -> Config:
    return load(quick=True)


def deployment(name: str, gib: float, **fields: object) -> Deployment:
    # A model whose need is `gib`, its weights a third of it (about 2 ms a token at 2 TB/s for 12 GiB).
    return replace(Deployment(name, "hand", "float16", int(gib * GiB / 3), int(gib * GiB), 1.0, False, 2e9), **fields)


def scaled(most: int, *, target: float = 4.0, down_after_s: float = 30.0, least: int = 1) -> autoscale.Policy:
    return autoscale.Policy(min_replicas=least, max_replicas=most, target_in_flight=target, down_after_s=down_after_s)


def burst(name: str, count: int, over_s: float, *, start_s: float = 0.0, output_tokens: int = 1000) -> list[Request]:
    return [Request(i, name, start_s + i * over_s / count, 128, output_tokens) for i in range(count)]


def on_gpus(config: Config, gpus: int, **serving: object) -> Config:
    cluster = replace(config.cluster, nodes=1, gpus_per_node=gpus)
    return replace(config, cluster=cluster, serving=replace(config.serving, **serving))


def test_an_autoscaled_deployment_scales_out_under_a_burst_and_back_in_after_its_window(quick):
    # 320 requests of ~2 s each over 20 s: twice what one replica's batch of 16 serves. The first
    # sweep wants 4 (its max), loads 3 more beside the first; once the burst is over and the window
    # has passed, the newest stop and it wants 1 again.
    config = on_gpus(quick, 8)
    busy = deployment("a", 12, autoscale=scaled(4))
    requests = burst("a", 320, 20.0)
    sim = Simulation(Trace((busy,), tuple(requests), 120.0), config, NEXT)
    result = sim.run()
    alone = simulate(Trace((replace(busy, autoscale=None),), tuple(requests), 120.0), config, NEXT)

    assert (result.counters.scale_ups, result.counters.cold_loads) == (1, 3)
    assert result.counters.scale_downs >= 1 and sim.deployments["a"].replicas == 1
    assert all(o.failed is None for o in result.outcomes)
    waited = mean(o.queue_s for o in result.outcomes)
    assert waited < mean(o.queue_s for o in alone.outcomes) / 2, "the replicas added must serve the queue"
    assert alone.counters.scale_ups == alone.counters.cold_loads == 0


def test_a_wait_behind_busy_replicas_for_the_autoscalers_new_one_is_the_queues_not_room(quick):
    # The burst of the test above: the requests that found the first replica's batch full and
    # were served by a replica the sweep added waited for the autoscaler (a sweep, then a load),
    # on a cluster with room to spare: none of it is a wait for room, which would point an
    # operator at GPUs rather than at replicas.
    config = on_gpus(quick, 8)
    busy = deployment("a", 12, autoscale=scaled(4))
    result = simulate(Trace((busy,), tuple(burst("a", 320, 20.0)), 120.0), config, NEXT)

    by_new = [o for o in result.outcomes if o.loaded_by == "cold load" and o.request.arrival_s > 0]
    assert by_new, "some requests were served by the replicas the sweep added"
    assert all(o.room_s == 0 for o in by_new)
    assert all(o.arrived_behind_busy for o in by_new)
    assert max(o.queue_s for o in by_new) > 0
    first = result.outcomes[0]  # the replica deployed served it at once
    assert not first.arrived_behind_busy and first.queue_s == first.room_s == 0


def test_a_scale_up_short_of_room_for_all_takes_one_more_where_that_fits(quick):
    # One 80 GiB GPU holds two replicas of 30 GiB: the load wants 4, the sweep gets 2.
    config = on_gpus(quick, 1)
    busy = deployment("a", 30, autoscale=scaled(4))
    sim = Simulation(Trace((busy,), tuple(burst("a", 200, 10.0)), 60.0), config, NEXT)
    result = sim.run()

    assert result.counters.cold_loads == 1, "one more, and never a third"
    assert result.counters.scale_ups == 1
    assert all(o.failed is None for o in result.outcomes)


def test_a_wake_brings_back_as_many_replicas_as_the_deployment_wants_where_they_fit(quick):
    # Two replicas, idle past their 5 s timeout, both asleep; one request wakes both (the first by
    # the wake path, the second with free memory, as sleep.wake_deployment tops it up).
    config = on_gpus(quick, 2)
    pair = deployment("a", 12, replicas=2, idle_timeout_s=5.0)
    requests = (Request(0, "a", 1.0, 128, 32), Request(1, "a", 100.0, 128, 32))
    sim = Simulation(Trace((pair,), requests, 120.0), config, NEXT)
    result = sim.run()

    assert result.counters.idle_sleeps >= 2
    assert result.counters.wakes_by_deployment["a"] == 2, "both woken by the one request"
    assert result.counters.cold_loads == 0


def test_requests_go_to_the_serving_replica_with_the_fewest_in_flight(quick):
    # A batch of one each: two replicas take two requests at once; one replica queues the second.
    config = on_gpus(quick, 2, max_batch=1)
    requests = (Request(0, "a", 1.0, 128, 500), Request(1, "a", 1.0, 128, 500))
    two = simulate(Trace((deployment("a", 12, replicas=2),), requests, 30.0), config, NEXT)
    one = simulate(Trace((deployment("a", 12),), requests, 30.0), config, NEXT)

    assert [o.start_s for o in two.outcomes] == [1.0, 1.0]
    assert one.outcomes[1].start_s > 1.0


def test_a_replica_a_scale_down_stops_finishes_what_it_took_first(quick):
    # Two replicas busy with one long request each; at 2 per replica the load wants 1, and with no
    # window the first sweep stops the newer. Its request ends as it would have; then it is gone.
    config = on_gpus(quick, 2, max_batch=1)
    d = deployment("a", 12, replicas=2, autoscale=scaled(2, target=2.0, down_after_s=0.0))
    requests = (Request(0, "a", 1.0, 128, 4000), Request(1, "a", 1.0, 128, 4000))
    sim = Simulation(Trace((d,), requests, 60.0), config, NEXT)
    result = sim.run()

    assert all(o.failed is None for o in result.outcomes)
    assert result.outcomes[0].end_s == result.outcomes[1].end_s > 5.0, "the sweep at 5 s cut neither"
    assert result.counters.scale_downs == 1 and sim.deployments["a"].replicas == 1
    stopped = [r for r in sim.replicas.values() if r.state == STOPPED]
    assert len(stopped) == 1 and not stopped[0].bytes_by_gpu
    assert not any(stopped[0].id in g.occupants for g in sim.gpus.values()), "its reservation went with it"


def test_the_oracle_keeps_as_many_replicas_as_the_deployment_could_ever_want(quick):
    sim = Simulation(Trace((deployment("a", 12, autoscale=scaled(3)),), (), 10.0), quick, ALL["oracle"])
    sim.run()
    assert len(sim.deployments["a"].awake) == 3


def test_the_oracles_working_set_counts_a_replica_per_batch_in_flight(quick):
    # 40 requests at once, 16 to a batch: three replicas' bytes, where one replica would queue them.
    d = deployment("a", 12, autoscale=scaled(4))
    requests = tuple(Request(i, "a", 1.0, 128, 100) for i in range(40))
    result = simulate(Trace((d,), requests, 10.0), quick, ALL["oracle"])
    assert result.counters.peak_working_set_bytes == 3 * d.estimate_bytes
    assert all(o.start_s == 1.0 for o in result.outcomes), "four replicas: none of the 40 waits"


def test_a_scale_down_after_its_replicas_fell_asleep_wakes_none(quick):
    # Scaled to 4 by a burst, idle 5 s after it and asleep, then the window (60 s) lets it scale
    # down: 4 → 1 wanted, and nothing wakes (scaling.scale with wake=False, as the product does).
    config = on_gpus(quick, 8)
    busy = deployment("a", 12, idle_timeout_s=5.0, autoscale=scaled(4, down_after_s=60.0))
    sim = Simulation(Trace((busy,), tuple(burst("a", 320, 20.0)), 120.0), config, NEXT)
    result = sim.run()

    assert result.counters.scale_ups == 1 and result.counters.idle_sleeps == 4
    assert sim.deployments["a"].replicas == 1 and result.counters.scale_downs == 0, "none awake to stop"
    assert result.counters.wakes == 0


@pytest.mark.parametrize("policy", ["ndif", "gpuportal-next", "dedicated"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_replicas_and_autoscaling_never_over_commit_and_every_request_ends_on_a_crowded_cluster(quick, policy, data):
    # The quick trace's deployments, some given several replicas, some autoscaled, on two or four
    # GPUs: placements, evictions, fair waits, scale-ups and stops all interleave, and the engine
    # checks every GPU's total at every instant a reservation changes.
    trace = generate(quick)
    policies = st.builds(
        autoscale.Policy,
        min_replicas=st.integers(1, 2),
        max_replicas=st.integers(2, 5),
        target_in_flight=st.sampled_from([0.5, 1.0, 4.0]),
        down_after_s=st.sampled_from([0.0, 10.0, 60.0]),
    )
    settings_of = st.tuples(st.integers(1, 3), st.none() | policies)
    chosen = data.draw(st.lists(settings_of, min_size=len(trace.deployments), max_size=len(trace.deployments)))
    deployments = tuple(
        replace(d, replicas=replicas, autoscale=scaling)
        for d, (replicas, scaling) in zip(trace.deployments, chosen, strict=True)
    )
    gpus = data.draw(st.sampled_from([2, 4]))
    sim = Simulation(replace(trace, deployments=deployments), quick, ALL[policy], gpus=gpus)

    result = sim.run()

    assert all(o.end_s is not None for o in result.outcomes)
    assert all(o.ttft_s is not None for o in result.outcomes if o.failed is None)
    for ds in sim.deployments.values():
        assert all(r.state in ("loading", "serving", "draining") for r in ds.awake)
        assert all(r.state == "sleeping" for r in ds.cached.values())
        bounds = ds.spec.autoscale
        if bounds is not None:
            assert bounds.min_replicas <= ds.replicas <= max(bounds.max_replicas, ds.spec.replicas)
    held = {rid for g in sim.gpus.values() for rid in g.occupants}
    assert all(sim.replicas[rid].state != STOPPED for rid in held), "a stopped replica holds nothing"


def test_a_fair_wake_whose_sleeper_a_scale_up_promoted_meanwhile_ends_without_placing_it_twice(quick):
    # What the property above found: on two GPUs, m01's fair wake waits for its sleeper's room; the
    # autoscaler's sweep promotes that sleeper meanwhile (a scale may, as in the portal), and the
    # wait's end placed it again, reserving its room twice (OverCommit). It now ends, as
    # preemption._try_place ends a wake whose replica was woken some other way.
    trace = generate(quick)
    chosen = [(2, None), (1, scaled(2, target=0.5, down_after_s=0.0)), (1, None), (1, None), (3, None), (3, None)]
    chosen += [(1, None)] * (len(trace.deployments) - len(chosen))
    deployments = tuple(
        replace(d, replicas=replicas, autoscale=policy)
        for d, (replicas, policy) in zip(trace.deployments, chosen, strict=True)
    )
    result = simulate(replace(trace, deployments=deployments), quick, NEXT, gpus=2)
    assert result.counters.scale_ups >= 1 and all(o.end_s is not None for o in result.outcomes)


def test_a_request_wakes_what_the_waiting_requests_want_and_the_sweep_wakes_more_as_they_grow(quick):
    # Scaled to 4 by a burst, idle and asleep 5 s after it, still wanting 4 (a 600 s window): one
    # request later wakes one replica, not four (sleep._wanted_awake), asleep again 5 s on. A
    # second burst's first request wakes one, and the sweep the other three (autoscale.decide's
    # `awake`), without a load from disk.
    config = on_gpus(quick, 8)
    busy = deployment("a", 12, idle_timeout_s=5.0, autoscale=scaled(4, down_after_s=600.0))
    first = burst("a", 320, 20.0)
    one = Request(len(first), "a", 100.0, 128, 32)
    second = [replace(r, id=r.id + len(first) + 1) for r in burst("a", 320, 20.0, start_s=200.0)]

    quiet = simulate(Trace((busy,), (*first, one), 150.0), config, NEXT)
    assert quiet.counters.cold_loads == 3 and quiet.counters.wakes == 1, "one woken for the one request"

    busier = simulate(Trace((busy,), (*first, one, *second), 300.0), config, NEXT)
    assert busier.counters.cold_loads == 3 and busier.counters.wakes == 1 + 1 + 3
    assert all(o.failed is None for o in busier.outcomes)
