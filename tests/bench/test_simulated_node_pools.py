"""The simulator's node pools: labels and taints on its nodes, node selectors and tolerations on
its deployments, read by the product's own rules (gpuportal.wire.node_labels) and placement.
Pure: no database, simulated time only."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.simulate.engine import SimResult, Simulation
from bench.simulate.policies import POLICIES
from bench.simulate.trace import Deployment, Request, Trace, generate
from scheduling.simulation.config import DEFAULT_CONFIG, Config, Placement, Pool, load
from scheduling.simulation.planner import Plan, misses_by_deployment, plan, record, render
from scheduling.simulation.traces import CatalogueEntry, TraceFileError, parse_catalogue

GiB = 1024**3


@pytest.fixture(scope="module")
def quick() -> Config:
    return load(quick=True)


def deployment(name: str, gib: float, **placement: str) -> Deployment:
    return Deployment(name, "hand", "float16", int(gib * GiB / 3), int(gib * GiB), 1.0, False, 2e9, **placement)


def pooled(config: Config, *pools: Pool, nodes: int = 2) -> Config:
    """One GPU a node, `nodes` of them, the pools' counts of those nodes."""
    cluster = replace(config.cluster, nodes=nodes, gpus_per_node=1, pools=pools, pooled_of=nodes)
    return replace(config, cluster=cluster)


def run(
    config: Config, deployments: list[Deployment], every_s: float = 7.0
) -> tuple[Simulation, SimResult, dict[str, set[str]]]:
    names = [d.name for d in deployments]
    arrivals = sorted((t, name) for t in range(1, 200, int(every_s)) for name in names)
    trace = Trace(tuple(deployments), tuple(Request(i, n, t, 128, 32) for i, (t, n) in enumerate(arrivals)), 300.0)
    sim = Simulation(trace, config, POLICIES["gpuportal"])
    result = sim.run()
    assert all(o.end_s is not None for o in result.outcomes)
    nodes = {name: {r.node for r in sim.replicas.values() if r.deployment == name} for name in names}
    return sim, result, {**nodes, "failed": {o.request.deployment for o in result.outcomes if o.failed is not None}}


def test_a_deployment_runs_only_where_its_selector_matches_and_the_others_stay_off_a_taint_they_do_not_tolerate(
    quick,
):
    config = pooled(quick, Pool(1, labels="team=a", taints="team=a:NoSchedule"))

    _, _, where = run(
        config,
        [deployment("a", 20, node_selector="team=a", tolerations="team"), deployment("b", 20), deployment("c", 20)],
    )

    assert where["a"] == {"node00"}
    assert where["b"] == where["c"] == {"node01"}, "node00's taint keeps them off, though it has room"
    assert where["failed"] == set()


def test_a_prefer_no_schedule_taint_is_used_last_rather_than_not_at_all(quick):
    config = pooled(quick, Pool(1, taints="spot=yes:PreferNoSchedule"))

    sim, _, where = run(config, [deployment("b", 50), deployment("c", 50)])

    # Both fit on no one GPU: the second goes to the avoided node rather than take turns.
    assert where["b"] ^ where["c"] == {"node00", "node01"} and where["failed"] == set()
    assert sim.counters.preemptions == 0 and sim.counters.wakes == 0


def test_a_deployment_whose_selector_no_node_matches_fails_its_requests_and_the_others_are_served(quick):
    config = pooled(quick, Pool(1, labels="gpu=h100"))

    sim, result, where = run(config, [deployment("a", 20, node_selector="gpu=b200"), deployment("b", 20)])

    assert where["a"] == set() and where["failed"] == {"a"}
    assert where["b"]
    missed = {m.deployment: m for m in misses_by_deployment(sim.trace, result, quick.serving.slo_ttft_s)}
    assert missed["a"].cause == "failed" and "no node may run a: its labels do not match" in missed["a"].why


def test_pools_keep_their_share_of_the_nodes_when_the_cluster_is_another_size(quick):
    cluster = replace(quick.cluster, nodes=2, pools=(Pool(2, labels="team=a"), Pool(4, labels="team=b")), pooled_of=8)
    names = [f"node{i:02d}" for i in range(16)]

    marks = cluster.marks(names)

    teams = [marks[name][0].get("team") for name in names]
    assert teams == ["a"] * 4 + ["b"] * 8 + [None] * 4, "a quarter, a half, and the rest unmarked"
    assert [m[0].get("team") for m in cluster.marks(names[:2]).values()] == ["a", "b"]


def test_the_config_reads_pools_and_placements_and_refuses_bad_ones_naming_them(tmp_path, quick):
    text = DEFAULT_CONFIG.read_text()
    good = tmp_path / "good.toml"
    good.write_text(
        _with(
            text,
            cluster='[[cluster.pools]]\nnodes = 2\nlabels = "team=a"\ntaints = "team=a"\n',
            trace='[[trace.placements]]\nshare = 0.25\nnode_selector = "team=a"\ntolerations = "team"\n',
        )
    )

    config = load(good)

    assert config.cluster.pools == (Pool(2, "team=a", "team=a"),)
    assert config.trace.placements == (Placement(0.25, "team=a", "team"),)
    placed = [d for d in generate(config).deployments if d.node_selector]
    assert len(placed) == round(0.25 * config.trace.deployments)
    assert {(d.node_selector, d.tolerations) for d in placed} == {("team=a", "team")}
    plain = load()
    assert generate(config).requests == generate(plain).requests, "the same seed draws the same requests"
    for bad, named in (
        (_with(text, cluster='[[cluster.pools]]\nnodes = 2\nlabels = "team"\n'), "cluster.pools: labels"),
        (_with(text, cluster='[[cluster.pools]]\nnodes = 99\n'), "cluster.pools: 99 nodes in pools"),
        (_with(text, trace='[[trace.placements]]\nshare = 0.5\nnode_selector = "a=:b"\n'), "trace.placements"),
        (_with(text, trace='[[trace.placements]]\nshare = 0.75\n[[trace.placements]]\nshare = 0.5\n'), "more than 1"),
    ):  # fmt: skip
        path = tmp_path / "bad.toml"
        path.write_text(bad)
        with pytest.raises(ValueError, match=named):
            load(path)


def _with(text: str, *, cluster: str = "", trace: str = "") -> str:
    """The standard config with arrays of tables added at the end of [trace] and [cluster]."""
    return text.replace("\n[cluster]", f"\n{trace}\n[cluster]", 1).replace(
        "\n[hardware]", f"\n{cluster}\n[hardware]", 1
    )


def test_a_catalogue_entry_carries_its_selector_and_tolerations_and_a_bad_one_is_named():
    (entry,) = parse_catalogue('[{"name": "a", "size": "7B", "node_selector": "team = a", "tolerations": "b,a=x"}]')

    assert (entry.node_selector, entry.tolerations) == ("team=a", "a=x,b")
    assert parse_catalogue(json.dumps([entry.to_record()])) == (entry,)
    assert "node_selector" not in CatalogueEntry("b", size="7B").to_record()
    with pytest.raises(TraceFileError) as refused:
        parse_catalogue('[{"name": "a", "size": "7B", "node_selector": "team"}]')
    assert "node_selector" in str(refused.value.errors)


def test_a_plan_needs_the_gpus_its_pools_leave_a_selector_and_says_which_nodes_it_placed_on(quick):
    def trace(**placement: str) -> Trace:
        arrivals = sorted((t + 0.5 * (name == "b"), name) for t in range(1, 120, 2) for name in ("a", "b"))
        return Trace(
            (deployment("a", 50, **placement), deployment("b", 50, **placement)),
            tuple(Request(i, n, t, 128, 16) for i, (t, n) in enumerate(arrivals)),
            120.0,
        )

    def fewest(trace: Trace, *pools: Pool) -> tuple[int | None, Plan]:
        config = pooled(quick, *pools)
        p = plan(trace, config, current_gpus=2, policies=("gpuportal-next",), explain="gpuportal-next")
        return p.policy("gpuportal-next").fewest_gpus, p

    anywhere, _ = fewest(trace())
    on_the_teams, p = fewest(trace(node_selector="team=a", tolerations="team"), Pool(1, "team=a", "team=a"))

    # Two 50 GiB models on 80 GiB GPUs: two GPUs anywhere; two of the team's, which half the nodes
    # are: of three, 1.5 rounded to the pool's 2 (the earlier on a tie of remainders).
    assert anywhere == 2 and on_the_teams == 3
    assert "Nodes: 1 of 2 labelled team=a and tainted team=a; 1 of 2 unmarked." in render(p)
    assert record(p)["pools"] == [{"nodes": 1, "labels": "team=a", "taints": "team=a"}]
