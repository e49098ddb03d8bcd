"""Placement (seeds 000 and 002) as a pure function: hand-built snapshots in, plans out. No database."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.placement import (
    MAX_FRACTION,
    MIN_FRACTION,
    POLICIES,
    CachedReplica,
    CandidateLevel,
    CantAccommodate,
    Eviction,
    Mode,
    Placement,
    PlacementRequest,
    _siblings,
    _siblings_by_node,
    _Ticket,
    cached_replicas,
    place,
)
from scheduling.core.planning import MultiPlacement, apply_placement, place_all, room_at, without_releases
from scheduling.core.state import GPUView, OccupantView, Plan, Release, Reservation, Snapshot, SnapshotIndex

GiB = 1024**3
MiB = 1024**2
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
NEW = "9d0e1f2a00000000000000000000beef"


# --- helpers ---------------------------------------------------------------------------------


def occ(
    replica_id: str,
    reserved: int = 1 * GiB,
    deployment: str = "other",
    *,
    state: str = "serving",
    dedicated: bool = False,
    popular: bool = False,
    min_runtime_s: float = 0.0,
    serving_since: datetime | None = None,
) -> OccupantView:
    return OccupantView(
        replica_id=replica_id,
        deployment=deployment,
        state=state,
        reserved_bytes=reserved,
        dedicated=dedicated,
        popular=popular,
        min_runtime_s=min_runtime_s,
        serving_since=serving_since,
    )


def gpu(
    gpu_id: int,
    node: str = "node1",
    index: int | None = None,
    total: int = 24 * GiB,
    occupants: Iterable[OccupantView] = (),
    *,
    node_status: str = "online",
    health: str = "ok",
) -> GPUView:
    occupants = tuple(occupants)
    return GPUView(
        id=gpu_id,
        node=node,
        index=gpu_id if index is None else index,
        total_bytes=total,
        available_bytes=total - sum(o.reserved_bytes for o in occupants),
        version=10 + gpu_id,
        node_status=node_status,
        health=health,
        occupants=occupants,
    )


def snap(*gpus: GPUView) -> Snapshot:
    return Snapshot(gpus={g.id: g for g in gpus}, taken_at=NOW)


def req(need: int, deployment: str = "llama-8b", **fields) -> PlacementRequest:
    fields.setdefault("replica_id", NEW)
    return PlacementRequest(deployment=deployment, need_bytes=need, **fields)


def placed(snapshot: Snapshot, request: PlacementRequest, **kw) -> Placement:
    result = place(snapshot, request, rng=kw.pop("rng", random.Random(0)), **kw)
    assert isinstance(result, Placement), getattr(result, "reason", result)
    return result


def refused(snapshot: Snapshot, request: PlacementRequest, **kw) -> CantAccommodate:
    result = place(snapshot, request, rng=random.Random(0), **kw)
    assert isinstance(result, CantAccommodate), result
    return result


def after(snapshot: Snapshot, plan: Plan) -> dict[int, dict[str, int]]:
    """What the ledger would hold on each GPU the plan writes."""
    held = {
        gpu_id: {o.replica_id: o.reserved_bytes for o in snapshot.gpus[gpu_id].occupants} for gpu_id in plan.gpu_ids
    }
    for release in plan.releases:
        held[release.gpu_id].pop(release.replica_id, None)
    for reservation in plan.reservations:
        held[reservation.gpu_id][reservation.replica_id] = reservation.reserved_bytes
    return held


def chosen_over_seeds(snapshot: Snapshot, request: PlacementRequest, **kw) -> set[tuple[int, ...]]:
    return {placed(snapshot, request, rng=random.Random(seed), **kw).gpu_ids for seed in range(40)}


# --- seed 000: the decision tree per node ------------------------------------------------------


def test_a_small_replica_gets_a_fraction_of_one_gpu():
    p = placed(snap(gpu(0)), req(6 * GiB))

    assert (p.mode, p.gpu_ids, p.bytes_by_gpu) == (Mode.FRACTIONAL, (0,), {0: 6 * GiB})
    assert p.fraction == pytest.approx(0.25)
    assert p.level is CandidateLevel.FREE
    assert p.evictions == () and p.promoted is None and p.replica_id == NEW


def test_ndif_gives_a_need_of_80_percent_or_more_the_whole_gpu():
    whole = placed(snap(gpu(0, total=10 * GiB)), req(8 * GiB), policy="ndif")
    fractional = placed(snap(gpu(0, total=10 * GiB)), req(8 * GiB - 1), policy="ndif")

    assert (whole.mode, whole.bytes_by_gpu, whole.fraction) == (Mode.WHOLE, {0: 10 * GiB}, MAX_FRACTION)
    assert (fractional.mode, fractional.bytes_by_gpu) == (Mode.FRACTIONAL, {0: 8 * GiB - 1})


def test_gpuportal_keeps_a_large_need_fractional_below_99_percent():
    p = placed(snap(gpu(0, total=10 * GiB)), req(9 * GiB))

    assert (p.mode, p.bytes_by_gpu) == (Mode.FRACTIONAL, {0: 9 * GiB})
    assert p.fraction == pytest.approx(0.9)


def test_a_gpu_with_a_tiny_occupant_is_not_whole():
    sleeper = occ("5133700000000000", reserved=0, state="sleeping")
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[sleeper]), gpu(1, total=10 * GiB))

    chosen = {placed(snapshot, req(9 * GiB), policy="ndif", rng=random.Random(s)).gpu_ids for s in range(20)}

    assert chosen == {(1,)}


def test_a_whole_gpu_is_made_by_evicting_every_occupant_even_an_empty_one():
    sleeper = occ("5133700000000000", reserved=0, state="sleeping")
    p = placed(snap(gpu(0, total=10 * GiB, occupants=[sleeper])), req(9 * GiB), policy="ndif")

    assert (p.mode, p.level) == (Mode.WHOLE, CandidateLevel.FULL)
    assert p.evictions == (Eviction("5133700000000000", 0, 0),)


def test_a_whole_gpu_cannot_be_had_past_a_dedicated_occupant():
    pinned = occ("d00d000000000000", reserved=1 * MiB, dedicated=True)
    result = refused(snap(gpu(0, total=10 * GiB, occupants=[pinned])), req(9 * GiB), policy="ndif")

    assert "whole GPU" in result.reasons["node1"]


def test_a_need_larger_than_any_gpu_spans_the_fewest_whole_gpus():
    busy = occ("b0b0000000000000", reserved=1 * GiB)
    snapshot = snap(gpu(0, occupants=[busy]), gpu(1), gpu(2), gpu(3))

    p = placed(snapshot, req(40 * GiB))

    assert p.mode is Mode.MULTI and p.level is CandidateLevel.FREE
    assert len(p.gpu_ids) == 2 and 0 not in p.gpu_ids
    assert p.bytes_by_gpu == {g: 24 * GiB for g in p.gpu_ids}
    assert p.fraction is None


def test_multi_gpu_treats_a_gpu_with_a_tiny_occupant_as_taken():
    tiny = occ("7100000000000000", reserved=1 * MiB)
    pinned = occ("d00d000000000000", reserved=1 * MiB, dedicated=True)

    evicting = placed(snap(gpu(0, occupants=[tiny]), gpu(1)), req(40 * GiB))
    blocked = refused(snap(gpu(0, occupants=[pinned]), gpu(1)), req(40 * GiB))

    assert evicting.level is CandidateLevel.FULL
    assert evicting.evictions == (Eviction("7100000000000000", 0, 1 * MiB),)
    assert evicting.bytes_by_gpu == {0: 24 * GiB, 1: 24 * GiB}
    assert "only 1 of 2" in blocked.reasons["node1"]


def test_a_replica_that_fits_one_gpu_splits_over_whole_gpus_when_no_single_gpu_has_room():
    pinned = occ("d00d000000000000", reserved=5 * GiB, dedicated=True)
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[pinned]), gpu(1, total=6 * GiB), gpu(2, total=6 * GiB))

    p = placed(snapshot, req(8 * GiB))

    assert (p.mode, p.gpu_ids, p.fraction) == (Mode.MULTI, (1, 2), None)


def test_an_explicit_gpu_count_takes_that_many_whole_gpus():
    p = placed(snap(gpu(0), gpu(1), gpu(2)), req(1 * GiB, gpus=2))

    assert p.mode is Mode.MULTI and len(p.gpu_ids) == 2


def test_one_gpu_only_never_splits():
    result = refused(snap(gpu(0, total=6 * GiB), gpu(1, total=6 * GiB)), req(8 * GiB, gpus=1))

    assert "more than any GPU holds" in result.reasons["node1"]


def test_a_need_beyond_the_node_cannot_be_accommodated():
    result = refused(snap(gpu(0), gpu(1)), req(60 * GiB))

    assert "more than the node's 2 GPU(s) hold" in result.reasons["node1"]


# --- the GPU search: room first, else the fewest evictions ---------------------------------------


def test_it_evicts_the_fewest_replicas():
    two = [occ("a1" * 8, 6 * GiB), occ("a2" * 8, 6 * GiB)]
    one = [occ("b1" * 8, 9 * GiB)]
    snapshot = snap(gpu(0, total=12 * GiB, occupants=two), gpu(1, total=12 * GiB, occupants=one))

    for policy in ("gpuportal", "ndif"):
        p = placed(snapshot, req(8 * GiB), policy=policy)
        assert (p.gpu_ids, p.evicted_replicas, p.level) == ((1,), ("b1" * 8,), CandidateLevel.FULL)


def test_of_tenants_that_would_each_do_a_sleeper_is_evicted_before_a_serving_one_even_a_smaller_one():
    # A sleeper serves no one: evicted, it sleeps deeply (its context goes with its process),
    # which costs only its next wake a process's start.
    serving = occ("5e" * 8, 1 * GiB)
    sleeper = occ("51" * 8, 2 * GiB, state="sleeping")
    snapshot = snap(gpu(0, total=4 * GiB, occupants=[serving, sleeper]))

    for policy in ("gpuportal", "ndif"):
        p = placed(snapshot, req(2 * GiB), policy=policy)
        assert p.evicted_replicas == (sleeper.replica_id,)


def test_evicting_a_small_tenant_frees_only_its_bytes():
    big = occ("b16" * 5 + "0", 8 * GiB, dedicated=True)
    small = occ("5a11" * 4, 1 * GiB)
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[big, small]))

    p = placed(snapshot, req(2 * GiB))
    refused(snapshot, req(3 * GiB))

    assert p.evictions == (Eviction("5a11" * 4, 0, 1 * GiB),)
    assert after(snapshot, p.to_plan(snapshot)) == {0: {"b16" * 5 + "0": 8 * GiB, NEW: 2 * GiB}}


def test_it_evicts_a_small_tenant_rather_than_a_big_one_when_either_will_do():
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[occ("b" * 16, 7 * GiB), occ("5" * 16, 2 * GiB)]))

    p = placed(snapshot, req(2 * GiB))

    assert p.evicted_replicas == ("5" * 16,)


def test_ndif_evicts_the_smallest_tenants_first_where_gpuportal_evicts_fewer():
    tenants = [occ(f"{i}" * 16, 1 * GiB) for i in range(3)] + [occ("9" * 16, 5 * GiB)]
    snapshot = snap(gpu(0, total=10 * GiB, occupants=tenants))

    ndif = placed(snapshot, req(5 * GiB), policy="ndif")
    ours = placed(snapshot, req(5 * GiB))

    assert sorted(ndif.evicted_replicas) == ["0" * 16, "1" * 16, "2" * 16]
    assert ours.evicted_replicas == ("9" * 16,)


def test_dedicated_replicas_are_never_evicted():
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[occ("d" * 16, 9 * GiB, dedicated=True)]))

    for policy in ("gpuportal", "ndif"):
        result = refused(snapshot, req(2 * GiB, dedicated=True), policy=policy)
        assert "protected" in result.reasons["node1"]


def test_siblings_of_the_same_deployment_are_not_evicted_to_make_room():
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[occ("5" * 16, 9 * GiB, deployment="llama-8b")]))

    refused(snapshot, req(2 * GiB))


def test_gpuportal_never_evicts_popular_or_young_replicas_but_ndif_lets_a_dedicated_request_evict_young_ones():
    young = occ("y" * 16, 9 * GiB, min_runtime_s=60, serving_since=NOW - timedelta(seconds=5))
    popular = occ("p" * 16, 9 * GiB, popular=True)
    old = occ("o" * 16, 9 * GiB, min_runtime_s=60, serving_since=NOW - timedelta(seconds=600))

    refused(snap(gpu(0, total=10 * GiB, occupants=[young])), req(2 * GiB, dedicated=True))
    refused(snap(gpu(0, total=10 * GiB, occupants=[popular])), req(2 * GiB))
    refused(snap(gpu(0, total=10 * GiB, occupants=[young])), req(2 * GiB), policy="ndif")
    seed_rule = placed(snap(gpu(0, total=10 * GiB, occupants=[young])), req(2 * GiB, dedicated=True), policy="ndif")
    past_min_runtime = placed(snap(gpu(0, total=10 * GiB, occupants=[old])), req(2 * GiB))

    assert seed_rule.evicted_replicas == ("y" * 16,)
    assert past_min_runtime.evicted_replicas == ("o" * 16,)


def test_gpuportal_prefers_the_gpu_left_fullest():
    snapshot = snap(
        gpu(0, total=10 * GiB, occupants=[occ("a" * 16, 1 * GiB)]),
        gpu(1, total=10 * GiB, occupants=[occ("b" * 16, 6 * GiB)]),
        gpu(2, total=10 * GiB),
    )

    assert chosen_over_seeds(snapshot, req(3 * GiB)) == {(1,)}
    assert chosen_over_seeds(snapshot, req(3 * GiB), policy="ndif") == {(0,), (1,), (2,)}


def test_a_spread_deployment_goes_to_the_gpu_without_its_siblings_rather_than_the_fullest():
    snapshot = snap(
        gpu(0, total=10 * GiB, occupants=[occ("a" * 16, 2 * GiB, deployment="llama-8b")]),
        gpu(1, total=10 * GiB, occupants=[occ("b" * 16, 6 * GiB)]),
        gpu(2, total=10 * GiB),
    )

    # Packing (the default) takes the fullest GPU that fits; spreading takes the emptiest GPU
    # that holds none of its own replicas.
    assert chosen_over_seeds(snapshot, req(3 * GiB)) == {(1,)}
    assert chosen_over_seeds(snapshot, req(3 * GiB, spread=True)) == {(2,)}


def test_a_spread_placement_counts_siblings_only_on_usable_gpus_and_never_its_own_replica():
    snapshot = snap(
        # node1: two siblings, one of them on a GPU that is not usable (placement cannot use it).
        gpu(0, node="node1", index=0, occupants=[occ("a" * 16, deployment="llama-8b")]),
        gpu(1, node="node1", index=1, occupants=[occ("b" * 16, deployment="llama-8b")], health="lost"),
        # node2: the replica being placed (a promotion) sits here: not its own sibling.
        gpu(2, node="node2", index=0, occupants=[occ(NEW, deployment="llama-8b", state="sleeping")]),
        gpu(3, node="node3", index=0, occupants=[occ("c" * 16, deployment="llama-8b")]),
        gpu(4, node="node3", index=1, occupants=[occ("d" * 16, deployment="llama-8b")]),
        gpu(5, node="node4", index=0),
    )
    index = snapshot.index
    ticket = _Ticket(NEW, True, {2: 1 * GiB}, req(1 * GiB, spread=True), POLICIES["gpuportal"], NOW)

    counted = _siblings_by_node(index.holdings, ticket, index.usable)

    # As `_siblings` sums it over each node's usable GPUs, without asking every GPU.
    assert (
        {node: counted[node] for node in index.usable}
        == {node: sum(_siblings(g, ticket) for g in gpus) for node, gpus in index.usable.items()}
        == {"node1": 1, "node2": 0, "node3": 2, "node4": 0}
    )


def test_a_spread_deployment_prefers_a_node_without_its_siblings():
    snapshot = snap(
        gpu(0, node="node1", index=0, occupants=[occ("a" * 16, 1 * GiB, deployment="llama-8b")]),
        gpu(1, node="node1", index=1),
        gpu(2, node="node2", index=0, occupants=[occ("b" * 16, 1 * GiB)]),
    )

    assert chosen_over_seeds(snapshot, req(1 * GiB, spread=True)) == {(2,)}
    assert chosen_over_seeds(snapshot, req(1 * GiB)) == {(0,), (2,)}  # packing: either node's fullest


def test_spreading_never_evicts_where_room_is_free():
    snapshot = snap(
        gpu(0, total=10 * GiB, occupants=[occ("a" * 16, 9 * GiB)]),
        gpu(1, total=10 * GiB, occupants=[occ("b" * 16, 2 * GiB, deployment="llama-8b")]),
    )

    chosen = placed(snapshot, req(3 * GiB, spread=True))
    assert chosen.gpu_ids == (1,) and chosen.evictions == ()


def test_ties_are_broken_at_random():
    snapshot = snap(gpu(0), gpu(1), gpu(2, node="node2", index=0))

    assert chosen_over_seeds(snapshot, req(1 * GiB)) == {(0,), (1,), (2,)}


def test_the_same_seed_gives_the_same_placement():
    snapshot = snap(*(gpu(i, node=f"node{i // 4}", index=i % 4) for i in range(16)))

    first = [place(snapshot, req(1 * GiB), rng=random.Random(7)) for _ in range(3)]
    other = place(snapshot, req(1 * GiB), rng=random.Random(8))

    assert first[0] == first[1] == first[2]
    assert isinstance(other, Placement)


# --- which GPUs are candidates -------------------------------------------------------------------


def test_offline_and_draining_nodes_and_lost_gpus_are_skipped():
    snapshot = snap(
        gpu(0, node="down", node_status="offline"),
        gpu(1, node="leaving", node_status="draining"),
        gpu(2, node="node1", index=0, health="lost"),
        gpu(3, node="node1", index=1, total=2 * GiB),
    )

    small = placed(snapshot, req(1 * GiB))
    large = refused(snapshot, req(4 * GiB))

    assert small.gpu_ids == (3,)
    assert large.reasons["down"] == "node is offline"
    assert large.reasons["leaving"] == "node is draining"
    assert "more than the node's 1 GPU(s) hold" in large.reasons["node1"]


def test_a_node_whose_gpus_are_all_lost_says_so():
    result = refused(snap(gpu(0, health="lost"), gpu(1, health="degraded")), req(1 * GiB))

    assert result.reasons == {"node1": "no healthy GPU (node1/0 lost, node1/1 degraded)"}


def test_cant_accommodate_gives_a_reason_per_node():
    pinned = occ("d" * 16, 20 * GiB, dedicated=True)
    snapshot = snap(gpu(0, node="node1", occupants=[pinned]), gpu(1, node="node2", index=0, node_status="offline"))

    result = refused(snapshot, req(8 * GiB))

    assert set(result.reasons) == {"node1", "node2"}
    assert result.level is CandidateLevel.CANT_ACCOMMODATE
    assert result.reason.startswith("cannot place llama-8b (8.0 GiB): node1: no GPU has 8.0 GiB free")


def test_a_refusal_names_who_may_not_be_evicted_and_why_each_replica_once():
    young = occ("a" * 32, 10 * GiB, "chat", min_runtime_s=10, serving_since=NOW - timedelta(seconds=3.5))
    pinned = occ("b" * 32, 10 * GiB, "pinned", dedicated=True)
    loved = occ("c" * 32, 4 * GiB, "loved", popular=True)
    # Over both GPUs of a node (a multi-GPU tenant): named once, on both.
    wide = occ("d" * 32, 24 * GiB, "wide", state="waking")
    snapshot = snap(
        gpu(0, occupants=[young, pinned]),
        gpu(1, occupants=[loved, occ("e" * 32, 4 * GiB, "idle")]),
        gpu(2, node="node2", index=0, occupants=[wide]),
        gpu(3, node="node2", index=1, occupants=[wide]),
    )

    result = refused(snapshot, req(30 * GiB))

    assert result.reasons["node1"].endswith(
        "; not evictable: chat aaaaaaaa on node1/0 "
        "(serving for less than its fairness.min_runtime_s (10 s): 7 s more), "
        "pinned bbbbbbbb on node1/0 (dedicated), loved cccccccc on node1/1 (popular (fairness.popular))"
    ), result.reasons["node1"]
    assert result.reasons["node2"].endswith("; not evictable: wide dddddddd on node2/0+1 (still waking)")
    # Past its min_runtime the young one may go, and is no longer named.
    later = refused(replace(snapshot, taken_at=NOW + timedelta(seconds=7)), req(30 * GiB))
    assert "chat" not in later.reasons["node1"] and "pinned bbbbbbbb" in later.reasons["node1"]


def test_a_refusal_names_a_few_of_those_that_may_not_be_evicted_and_counts_the_rest():
    many = [occ(f"{i}" * 32, 1 * GiB, f"d{i}", dedicated=True) for i in range(5)]

    reason = refused(snap(gpu(0, total=8 * GiB, occupants=many)), req(6 * GiB)).reasons["node1"]

    assert reason.count("(dedicated)") == 3 and reason.endswith(" and 2 more"), reason


def test_a_refusal_names_a_sibling_as_such_even_one_still_starting():
    # A replica the same plan placed a moment ago is a sibling first: not "still pending".
    sibling = occ("s" * 32, 20 * GiB, "llama-8b", state="pending")

    reason = refused(snap(gpu(0, occupants=[sibling])), req(8 * GiB)).reasons["node1"]

    assert reason.endswith("; not evictable: llama-8b ssssssss on node1/0 (of the same deployment)"), reason


def test_a_refusal_names_the_other_deployments_protected_replicas_before_its_own():
    siblings = [occ(f"{i}" * 32, 2 * GiB, "llama-8b") for i in range(3)]
    pinned = occ("p" * 32, 7 * GiB, "pinned", dedicated=True)

    reason = refused(
        snap(gpu(0, total=8 * GiB, occupants=siblings), gpu(1, total=8 * GiB, occupants=[pinned])), req(3 * GiB)
    ).reasons["node1"]

    assert "; not evictable: pinned pppppppp on node1/1 (dedicated), llama-8b 00000000 on node1/0" in reason, reason
    assert reason.endswith(" and 1 more"), reason


def test_a_refusal_with_nothing_protected_names_no_one():
    reason = refused(snap(gpu(0, total=8 * GiB, occupants=[occ("x" * 32, 2 * GiB)])), req(9 * GiB)).reasons["node1"]

    assert "not evictable" not in reason, reason


def _all(snapshot: Snapshot, count: int, need: int, deployment: str = "llama-8b") -> CantAccommodate:
    requests = [req(need, deployment, replica_id=f"{i}" * 32) for i in range(count)]
    result = place_all(
        snapshot,
        requests,
        occupant_for=lambda p: OccupantView(p.replica_id, deployment, "pending", p.bytes_by_gpu[p.gpu_ids[0]]),
        reason="scale",
        rng=random.Random(0),
    )
    assert isinstance(result, CantAccommodate), result
    return result


def test_several_replicas_placed_together_say_where_each_went_once_not_each_ones_reason_in_all():
    # Best fit: the first to the smaller GPU, the second to what is left.
    snapshot = snap(gpu(0, total=10 * GiB), gpu(1, total=7 * GiB, index=1))
    requests = [req(6 * GiB, replica_id=f"{i}" * 32) for i in range(2)]

    result = place_all(
        snapshot,
        requests,
        occupant_for=lambda p: OccupantView(p.replica_id, "llama-8b", "pending", p.bytes_by_gpu[p.gpu_ids[0]]),
        reason="scale",
        rng=random.Random(0),
    )

    assert isinstance(result, MultiPlacement), result
    assert result.plan.reason == (
        "scale: placed 00000000 on node1/1; placed 11111111 on node1/0 (each replica's Event says why there)"
    ), result.plan.reason
    (alone,) = [req(6 * GiB, replica_id="2" * 32)]
    single = place_all(
        snapshot, [alone], occupant_for=lambda p: OccupantView(p.replica_id, "l", "pending", 1), reason="x"
    )
    assert isinstance(single, MultiPlacement) and single.plan.reason == f"x: {single.placements[0].reason}"


def test_a_refusal_of_several_replicas_says_which_one_did_not_fit_and_that_nothing_is_applied():
    # The reasons describe the GPUs as the two placed before it left them, not as they are now.
    snapshot = snap(gpu(0, total=10 * GiB), gpu(1, total=10 * GiB, occupants=[occ("a" * 32, 7 * GiB, dedicated=True)]))

    result = _all(snapshot, 4, 4 * GiB)

    assert result.reason.startswith(
        "cannot place llama-8b (4.0 GiB), replica 3 of 4 placed together (the 2 before it fit, nothing is "
        "applied): node1: "
    ), result.reason
    assert "never fit" not in result.reason, "four fit on these GPUs once the dedicated one is gone"


def test_a_refusal_of_more_replicas_than_the_gpus_could_ever_hold_says_how_many_they_could():
    # 2 + 1 replicas of 4 GiB fit on GPUs of 10 and 6 GiB with nothing else there; one of the
    # deployment serves already, so asking 3 more wants 4. Drained and lost GPUs count for nothing.
    mine = occ("m" * 32, 4 * GiB, "llama-8b", dedicated=True)
    snapshot = snap(
        gpu(0, total=10 * GiB, occupants=[mine]),
        gpu(1, total=6 * GiB, occupants=[occ("s" * 32, 2 * GiB, "llama-8b", state="sleeping")]),
        gpu(2, node="node2", index=0, total=80 * GiB, node_status="draining"),
        gpu(3, total=80 * GiB, health="lost"),
    )

    result = _all(snapshot, 3, 4 * GiB)

    assert "; 4 replicas of 4.0 GiB never fit at once: the 2 GPU(s) placement may use hold at most 3, with " in (
        result.reason
    ), result.reason
    assert "never fit" not in _all(snapshot, 3, 4 * GiB, deployment="other").reason, "3 of another would fit"


def test_a_plan_refused_for_young_replicas_finds_room_once_enough_of_them_leave_their_min_runtime():
    # Two replicas of 14 GiB wanted, one a GPU; each GPU holds a young 20 GiB replica. The one on
    # node1/1 settles first (in 4 s), but room for both needs the other too (in 9 s).
    def young(replica_id: str, settles_in: float) -> OccupantView:
        since = NOW - timedelta(seconds=10 - settles_in)
        return occ(replica_id * 32, 20 * GiB, min_runtime_s=10, serving_since=since)

    snapshot = snap(gpu(0, occupants=[young("a", 9)]), gpu(1, occupants=[young("b", 4)]))
    requests = [req(14 * GiB, replica_id=f"{i}" * 32) for i in range(2)]
    mine = {"occupant_for": lambda p: OccupantView(p.replica_id, "llama-8b", "pending", 14 * GiB)}
    assert isinstance(place_all(snapshot, requests, reason="scale", **mine), CantAccommodate)

    at = room_at(snapshot, requests, **mine)

    assert at is not None and timedelta(seconds=9) < at - NOW < timedelta(seconds=9.01), at
    assert room_at(snapshot, requests[:1], **mine) - NOW < timedelta(seconds=4.01), "one needs b gone alone"
    pinned = snap(gpu(0, occupants=[occ("p" * 32, 20 * GiB, dedicated=True)]))
    assert room_at(pinned, requests[:1], **mine) is None, "no lapse moves a dedicated replica"


def test_a_refusal_of_one_replica_larger_than_any_gpu_states_no_ceiling():
    result = refused(snap(gpu(0, total=8 * GiB), gpu(1, node="node2", index=0, total=8 * GiB)), req(12 * GiB))

    assert result.reason.startswith("cannot place llama-8b (12.0 GiB): node1: "), result.reason


# --- seed 002: candidate levels across nodes -------------------------------------------------------


def test_a_replica_already_serving_is_deployed_and_changes_nothing():
    snapshot = snap(gpu(0, occupants=[occ(NEW, 6 * GiB, deployment="llama-8b")]), gpu(1, node="node2", index=0))

    p = placed(snapshot, req(6 * GiB))
    plan = p.to_plan(snapshot)

    assert (p.level, p.node, p.gpu_ids, p.fraction) == (CandidateLevel.DEPLOYED, "node1", (0,), 0.25)
    assert plan.reservations == () and plan.releases == () and plan.gpu_ids == []


def test_a_sibling_does_not_make_a_node_deployed_on_scale_up():
    sibling = occ("5" * 16, 6 * GiB, deployment="llama-8b")
    snapshot = snap(gpu(0, node="node1", occupants=[sibling]), gpu(1, node="node2", index=0))

    results = [place(snapshot, req(6 * GiB), rng=random.Random(s)) for s in range(40)]

    assert {r.level for r in results} == {CandidateLevel.FREE}
    assert {r.node for r in results} == {"node1", "node2"}


def test_a_cached_replica_is_promoted_before_a_new_one_is_created():
    sleeper = occ("c" * 16, 0, deployment="llama-8b", state="sleeping")
    snapshot = snap(gpu(0, node="node1", occupants=[sleeper]), gpu(1, node="node2", index=0))
    request = req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),))

    results = {placed(snapshot, request, rng=random.Random(s)).node for s in range(20)}
    p = placed(snapshot, request)

    assert results == {"node1"}
    assert (p.level, p.promoted, p.replica_id) == (CandidateLevel.CACHED_AND_FREE, "c" * 16, "c" * 16)
    assert p.to_plan(snapshot).reservations == (Reservation(0, "c" * 16, 6 * GiB),)


def test_room_elsewhere_beats_evicting_for_a_cached_replica():
    sleeper = occ("c" * 16, 0, deployment="llama-8b", state="sleeping")
    full = occ("f" * 16, 20 * GiB)
    snapshot = snap(gpu(0, node="node1", occupants=[sleeper, full]), gpu(1, node="node2", index=0))

    p = placed(snapshot, req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),)))

    assert (p.level, p.node, p.promoted, p.replica_id) == (CandidateLevel.FREE, "node2", None, NEW)


def test_a_cached_replica_that_must_evict_still_beats_a_new_one_that_must_evict():
    sleeper = occ("c" * 16, 0, deployment="llama-8b", state="sleeping")
    snapshot = snap(
        gpu(0, node="node1", occupants=[sleeper, occ("f" * 16, 20 * GiB)]),
        gpu(1, node="node2", index=0, occupants=[occ("e" * 16, 20 * GiB)]),
    )

    p = placed(snapshot, req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),)))

    assert (p.level, p.node, p.promoted) == (CandidateLevel.CACHED_AND_FULL, "node1", "c" * 16)
    assert p.evicted_replicas == ("f" * 16,)


def test_full_when_only_evictions_make_room():
    snapshot = snap(gpu(0, occupants=[occ("f" * 16, 20 * GiB)]))

    assert placed(snapshot, req(6 * GiB)).level is CandidateLevel.FULL


def test_a_promoted_replica_stays_where_its_cuda_context_is_and_replaces_its_residual():
    sleeper = occ("c" * 16, 500 * MiB, deployment="llama-8b", state="sleeping")
    snapshot = snap(gpu(0, occupants=[sleeper]), gpu(1))
    request = req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),))

    chosen = {placed(snapshot, request, rng=random.Random(s)).gpu_ids for s in range(20)}
    plan = placed(snapshot, request).to_plan(snapshot)

    assert chosen == {(0,)}
    assert after(snapshot, plan) == {0: {"c" * 16: 6 * GiB}}


def test_a_promoted_replica_moving_off_an_empty_residual_releases_it():
    sleeper = occ("c" * 16, 0, deployment="llama-8b", state="sleeping")
    snapshot = snap(gpu(0, total=10 * GiB, occupants=[sleeper, occ("f" * 16, 9 * GiB, dedicated=True)]), gpu(1))

    p = placed(snapshot, req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),)))
    plan = p.to_plan(snapshot)

    assert (p.gpu_ids, p.dropped_residuals) == ((1,), (0,))
    assert plan.releases == (Release(0, "c" * 16),)
    assert after(snapshot, plan) == {0: {"f" * 16: 9 * GiB}, 1: {"c" * 16: 6 * GiB}}


def test_a_wake_only_request_never_creates_a_replica():
    sleeper = occ("c" * 16, 0, deployment="llama-8b", state="sleeping")
    snapshot = snap(gpu(0, node="node1", occupants=[sleeper]), gpu(1, node="node2", index=0))

    woken = placed(snapshot, req(6 * GiB, replica_id="c" * 16, cached=(CachedReplica("c" * 16, "node1"),)))
    result = refused(snapshot, req(6 * GiB, allow_new=False))

    assert (woken.node, woken.replica_id) == ("node1", "c" * 16)
    assert "no new one was asked for" in result.reasons["node2"]


def test_a_cached_replica_that_woke_meanwhile_is_not_promoted_again():
    awake = occ("c" * 16, 6 * GiB, deployment="llama-8b", state="serving")
    snapshot = snap(gpu(0, occupants=[awake]))

    p = placed(snapshot, req(6 * GiB, cached=(CachedReplica("c" * 16, "node1"),)))

    assert (p.promoted, p.replica_id) == (None, NEW)


def test_cached_replicas_are_read_from_sleeping_occupants():
    snapshot = snap(
        gpu(0, occupants=[occ("c" * 16, 0, deployment="llama-8b", state="sleeping"), occ("s" * 16, 1, "llama-8b")]),
        gpu(1, node="node2", index=0, occupants=[occ("x" * 16, 0, deployment="other", state="sleeping")]),
    )

    assert cached_replicas(snapshot, "llama-8b") == (CachedReplica("c" * 16, "node1"),)


# --- the plan ----------------------------------------------------------------------------------


def test_a_replica_on_several_gpus_is_evicted_from_all_of_them():
    wide = [occ("w" * 16, 20 * GiB), occ("w" * 16, 20 * GiB)]
    snapshot = snap(gpu(0, occupants=[wide[0]]), gpu(1, occupants=[wide[1]]))

    p = placed(snapshot, req(6 * GiB))
    plan = p.to_plan(snapshot)

    assert p.evictions == (Eviction("w" * 16, 0, 20 * GiB), Eviction("w" * 16, 1, 20 * GiB))
    assert set(plan.releases) == {Release(0, "w" * 16), Release(1, "w" * 16)}
    assert sum(len(held) for held in after(snapshot, plan).values()) == 1


def test_the_plan_releases_each_eviction_reserves_the_replica_and_expects_the_snapshot_versions():
    snapshot = snap(gpu(3, total=10 * GiB, occupants=[occ("3f2a" * 4, 8 * GiB)]))

    p = placed(snapshot, req(6 * GiB))
    plan = p.to_plan(snapshot)

    assert plan.releases == (Release(3, "3f2a" * 4),)
    assert plan.reservations == (Reservation(3, NEW, 6 * GiB),)
    assert plan.expected_versions == {3: 13}
    assert plan.reason == p.reason
    assert p.reason.startswith("evicted 3f2a3f2a to fit llama-8b on gpu node1/3: fewest evictions")


def test_fractions_are_clamped_to_the_cap_range():
    tiny = placed(snap(gpu(0)), req(1))
    whole = placed(snap(gpu(0)), req(24 * GiB))

    assert (tiny.fraction, whole.fraction) == (MIN_FRACTION, MAX_FRACTION)


@pytest.mark.parametrize("fields", [{"need_bytes": 0}, {"need_bytes": -1}, {"need_bytes": 1, "gpus": 0}])
def test_invalid_requests_are_rejected(fields):
    with pytest.raises(ValueError):
        PlacementRequest(deployment="llama-8b", replica_id=NEW, **fields)


def test_a_new_replica_id_that_is_already_asleep_is_a_caller_error():
    snapshot = snap(gpu(0, occupants=[occ(NEW, 0, deployment="llama-8b", state="sleeping")]))

    with pytest.raises(ValueError, match="fresh id"):
        place(snapshot, req(1 * GiB))


# --- properties ----------------------------------------------------------------------------------

DEPLOYMENTS = ["alpha", "beta", "gamma"]
PROPERTY = settings(max_examples=200, deadline=None)


@st.composite
def snapshots(draw) -> Snapshot:
    gpus: list[GPUView] = []
    ids = itertools.count()
    for n in range(draw(st.integers(1, 3))):
        status = draw(st.sampled_from(["online", "online", "online", "draining"]))
        previous: OccupantView | None = None
        for index in range(draw(st.integers(1, 4))):
            total = draw(st.sampled_from([1000, 2000, 4000]))
            occupants: list[OccupantView] = []
            room = total
            # A replica spread over this GPU and the previous one (multi-GPU tenants).
            if previous is not None and draw(st.booleans()):
                reserved = draw(st.integers(0, room))
                room -= reserved
                occupants.append(OccupantView(**{**previous.__dict__, "reserved_bytes": reserved}))
            for _ in range(draw(st.integers(0, 4))):
                reserved = draw(st.integers(0, room))
                room -= reserved
                occupants.append(
                    occ(
                        f"r{next(ids):04d}",
                        reserved,
                        draw(st.sampled_from(DEPLOYMENTS)),
                        state=draw(st.sampled_from(["serving", "serving", "sleeping"])),
                        dedicated=draw(st.sampled_from([False, False, False, True])),
                    )
                )
            previous = occupants[-1] if occupants else None
            health = draw(st.sampled_from(["ok", "ok", "ok", "lost"]))
            gpus.append(gpu(len(gpus), f"node{n}", index, total, occupants, node_status=status, health=health))
    return snap(*gpus)


@st.composite
def cases(draw, *, with_cached: bool = True) -> tuple[Snapshot, PlacementRequest]:
    snapshot = draw(snapshots())
    deployment = draw(st.sampled_from([*DEPLOYMENTS, "fresh"]))
    cached = cached_replicas(snapshot, deployment) if with_cached and draw(st.booleans()) else ()
    request = PlacementRequest(
        deployment=deployment,
        replica_id="new-replica",
        need_bytes=draw(st.one_of(st.integers(1, 4000), st.integers(1, 9000))),
        gpus=draw(st.sampled_from([None, None, None, 1, 2])),
        dedicated=draw(st.booleans()),
        cached=cached,
        spread=draw(st.booleans()),
    )
    return snapshot, request


@st.composite
def crowded_cases(draw) -> tuple[Snapshot, PlacementRequest]:
    """One node whose GPUs are mostly taken, so that most placements must evict."""
    gpus: list[GPUView] = []
    for index in range(draw(st.integers(2, 4))):
        occupants: list[OccupantView] = []
        room = 1000
        sizes = draw(st.lists(st.integers(0, 500), min_size=1, max_size=5))
        if draw(st.booleans()):
            sizes.append(room)  # whatever is left: a GPU with no free byte
        for i, size in enumerate(sizes):
            size = min(size, room)
            room -= size
            dedicated = draw(st.sampled_from([False, False, True]))
            occupants.append(occ(f"g{index}r{i}", size, draw(st.sampled_from(DEPLOYMENTS)), dedicated=dedicated))
        gpus.append(gpu(index, "node1", index, 1000, occupants))
    deployment = draw(st.sampled_from([*DEPLOYMENTS, "fresh"]))
    return snap(*gpus), PlacementRequest(deployment, "new-replica", draw(st.integers(1, 1000)))


def run(snapshot: Snapshot, request: PlacementRequest, policy: str, seed: int) -> Placement | CantAccommodate:
    return place(snapshot, request, policy=policy, rng=random.Random(seed))


@pytest.mark.parametrize("policy", ["gpuportal", "ndif"])
@PROPERTY
@given(case=cases(), seed=st.integers(0, 2**16))
def test_no_plan_over_commits_and_only_healthy_online_gpus_are_reserved(policy, case, seed):
    snapshot, request = case
    result = run(snapshot, request, policy, seed)
    if isinstance(result, CantAccommodate):
        assert set(result.reasons) == {g.node for g in snapshot.gpus.values()}
        return
    plan = result.to_plan(snapshot)
    plan.validate()
    for gpu_id, held in after(snapshot, plan).items():
        assert sum(held.values()) <= snapshot.gpus[gpu_id].total_bytes
    for reservation in plan.reservations:
        target = snapshot.gpus[reservation.gpu_id]
        assert (target.node_status, target.health, target.node) == ("online", "ok", result.node)


@pytest.mark.parametrize("policy", ["gpuportal", "ndif"])
@PROPERTY
@given(case=cases(), seed=st.integers(0, 2**16))
def test_dedicated_replicas_are_never_evicted_whatever_the_snapshot(policy, case, seed):
    snapshot, request = case
    result = run(snapshot, request, policy, seed)
    if isinstance(result, Placement):
        dedicated = {o.replica_id for g in snapshot.gpus.values() for o in g.occupants if o.dedicated}
        assert not dedicated & set(result.evicted_replicas)


@pytest.mark.parametrize("policy", ["gpuportal", "ndif"])
@PROPERTY
@given(case=cases(), seed=st.integers(0, 2**16))
def test_fractions_stay_within_the_cap_range(policy, case, seed):
    snapshot, request = case
    result = run(snapshot, request, policy, seed)
    if isinstance(result, Placement):
        if len(result.gpu_ids) > 1:
            assert result.fraction is None
        else:
            assert MIN_FRACTION <= result.fraction <= MAX_FRACTION


def fewest_evictions_to_host(target: GPUView, request: PlacementRequest) -> int | None:
    """Brute force over subsets, independent of placement's greedy search."""
    need = request.need_bytes
    if need > target.total_bytes:
        return None
    evictable = [o for o in target.occupants if not o.dedicated and o.deployment != request.deployment]
    if need >= MAX_FRACTION * target.total_bytes:
        return len({o.replica_id for o in target.occupants}) if len(evictable) == len(target.occupants) else None
    free = target.total_bytes - target.reserved_bytes
    for count in range(len(evictable) + 1):
        for subset in itertools.combinations(evictable, count):
            if free + sum(o.reserved_bytes for o in subset) >= need:
                return count
    return None


@PROPERTY
@given(case=st.one_of(cases(with_cached=False), crowded_cases()), seed=st.integers(0, 2**16))
def test_the_chosen_gpu_needs_the_fewest_evictions_among_gpus_that_could_host_it(case, seed):
    snapshot, request = case
    result = run(snapshot, request, "gpuportal", seed)
    if not isinstance(result, Placement) or result.mode is Mode.MULTI or result.level is CandidateLevel.DEPLOYED:
        return
    hosts = [g for g in snapshot.on_node(result.node) if g.health == "ok"]
    counts = [c for g in hosts if (c := fewest_evictions_to_host(g, request)) is not None]
    assert len(result.evicted_replicas) == min(counts)


# --- the snapshot index a ledger Mirror patches rather than rebuilds -----------------------------


@st.composite
def changed_snapshots(draw) -> tuple[Snapshot, Snapshot]:
    """A snapshot, and the same cluster after some GPUs changed: occupants come, go and move,
    health changes, a node changes status (on all its GPUs at once, as the ledger stamps it)."""
    before = draw(snapshots())
    gpus = dict(before.gpus)
    replicas = [o for g in gpus.values() for o in g.occupants]
    for gpu_id in draw(st.lists(st.sampled_from(sorted(gpus)), unique=True)):
        old = gpus[gpu_id]
        kept = [o for o in old.occupants if draw(st.booleans())]
        arriving = draw(st.lists(st.sampled_from(replicas), max_size=2)) if replicas else []
        fresh = [occ(f"n{gpu_id}-{i}", draw(st.integers(0, 100))) for i in range(draw(st.integers(0, 2)))]
        occupants: dict[str, OccupantView] = {}
        room = old.total_bytes
        for o in [*kept, *arriving, *fresh]:  # as the ledger keeps it: never over-committed
            if o.replica_id not in occupants and o.reserved_bytes <= room:
                occupants[o.replica_id] = o
                room -= o.reserved_bytes
        health = draw(st.sampled_from(["ok", "ok", "lost"]))
        # A measured context (rare), which the index's largest contexts follow.
        context = draw(st.sampled_from([old.context_bytes, old.context_bytes, 0, 2 * old.context_bytes]))
        gpus[gpu_id] = GPUView(
            **{
                **old.__dict__,
                "occupants": tuple(occupants.values()),
                "available_bytes": room,
                "health": health,
                "version": old.version + 1,
                "context_bytes": context,
            }
        )
    if draw(st.booleans()):
        node = draw(st.sampled_from(sorted({g.node for g in gpus.values()})))
        status = draw(st.sampled_from(["online", "draining", "offline"]))
        for gpu_id, g in gpus.items():
            if g.node == node:
                gpus[gpu_id] = GPUView(**{**g.__dict__, "node_status": status})
    return before, Snapshot(gpus=gpus, taken_at=NOW)


@PROPERTY
@given(case=changed_snapshots())
def test_an_index_patched_with_the_changed_gpus_is_the_index_built_anew(case):
    before, after_change = case
    changed = [g for gpu_id, g in after_change.gpus.items() if g != before.gpus[gpu_id]]

    patched = before.index.updated(changed)
    built = after_change.index

    assert patched == built
    # Dict equality ignores order; placement's node order must not depend on how it was built.
    assert list(patched.usable) == list(built.usable) and list(patched.on_node) == list(built.on_node)


@PROPERTY
@given(case=changed_snapshots(), seed=st.integers(0, 2**16), need=st.integers(1, 5000))
def test_placement_on_a_patched_index_decides_as_on_a_fresh_snapshot(case, seed, need):
    before, after_change = case
    changed = [g for gpu_id, g in after_change.gpus.items() if g != before.gpus[gpu_id]]
    mirrored = Snapshot.indexed(after_change.gpus, NOW, before.index.updated(changed))
    request = PlacementRequest("alpha", "new-replica", need)

    assert run(mirrored, request, "gpuportal", seed) == run(after_change, request, "gpuportal", seed)


def test_a_new_gpu_is_not_patched_in_but_makes_the_index_rebuild():
    before = snap(gpu(0), gpu(1))
    assert before.index.updated([gpu(2, "node2")]) is None
    assert before.index.updated([]) is before.index


@PROPERTY
@given(case=cases(), seed=st.integers(0, 2**16), releasing=st.sets(st.integers(0, 20), max_size=4))
def test_a_snapshot_after_placements_and_releases_keeps_its_index_true(case, seed, releasing):
    """A batch of scale calls places each on the snapshot the ones before it left
    (planning.apply_placement, planning.without_releases), on an index patched rather than built:
    it must be the index those GPUs build, or the next placement decides on a wrong one."""
    snapshot, request = case
    assert snapshot.index.ordered  # built now: what the patching starts from
    ids = [f"r{n:04d}" for n in releasing]
    releases = [Release(g.id, o.replica_id) for g in snapshot.gpus.values() for o in g.occupants if o.replica_id in ids]
    current = without_releases(snapshot, releases)
    assert not any(o.replica_id in ids for g in current.gpus.values() for o in g.occupants)
    result = run(current, request, "gpuportal", seed)
    if isinstance(result, Placement):
        current = apply_placement(current, result, occ(result.replica_id, 0, request.deployment))
        assert current.index.holdings.get(result.replica_id), "the placed replica holds memory"

    assert current.index == SnapshotIndex.build(current.gpus)
    assert all(g.available_bytes == g.total_bytes - g.reserved_bytes for g in current.gpus.values())
