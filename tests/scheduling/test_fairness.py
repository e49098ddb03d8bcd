"""Fair preemption (seed 001) as pure functions: hand-built GPU views in, victims out. No database."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.fairness import (
    AsleepCopy,
    Cause,
    NoVictim,
    VictimChoice,
    choose_target,
    choose_victim,
    choose_whole_gpus,
    eligible,
    preempt_at_once,
    room_at,
    short_of_room,
    should_preempt,
    sleep_early,
    sleep_when_idle,
    wait_deadline,
)
from scheduling.core.state import GPUView, OccupantView
from tests.support.views import gpu

GiB = 1024**3
MiB = 1024**2
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
LONG_AGO = NOW - timedelta(hours=1)
WAITER = "ffff0000waiting0000000000000000"
PROPERTY = settings(max_examples=200, deadline=None)


# --- helpers ---------------------------------------------------------------------------------


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def occ(
    replica_id: str,
    reserved: int = 1 * GiB,
    *,
    deployment: str | None = None,
    state: str = "serving",
    popular: bool = False,
    dedicated: bool = False,
    min_runtime_s: float = 10.0,
    serving_since: datetime | None = LONG_AGO,
    last_accessed: datetime | None = LONG_AGO,
) -> OccupantView:
    """A serving occupant well past its min_runtime unless told otherwise."""
    return OccupantView(
        replica_id=replica_id,
        deployment=deployment or f"tiny-{replica_id}",
        state=state,
        reserved_bytes=reserved,
        popular=popular,
        dedicated=dedicated,
        min_runtime_s=min_runtime_s,
        serving_since=serving_since,
        last_accessed=last_accessed,
    )


def choose(
    gpus: Iterable[GPUView], needed: Mapping[int, int], *, waiting: str = WAITER, now: datetime = NOW, **kw
) -> VictimChoice | NoVictim:
    return choose_victim(list(gpus), waiting_replica_id=waiting, needed_bytes_by_gpu=needed, now=now, **kw)


def victims(gpus: Iterable[GPUView], needed: Mapping[int, int], **kw) -> tuple[str, ...]:
    result = choose(gpus, needed, **kw)
    assert isinstance(result, VictimChoice), result.reason
    return result.victim_ids


def refusal(gpus: Iterable[GPUView], needed: Mapping[int, int], **kw) -> NoVictim:
    result = choose(gpus, needed, **kw)
    assert isinstance(result, NoVictim), result
    return result


# --- reload cost against recency, and where to make room -------------------------------------


def costly(replica_id: str, reserved: int = 1 * GiB, *, reload_s: float, idle_s: float, in_flight: int = 0, **kw):
    return replace(occ(replica_id, reserved, last_accessed=ago(idle_s), **kw), reload_s=reload_s, in_flight=in_flight)


def test_it_prefers_the_victim_that_is_cheapest_to_wake_again():
    # Equally idle: the 0.05 s reload goes, not the 3 s one, whatever the ids say.
    g = gpu(1, [costly("aaaa", reload_s=3.0, idle_s=30), costly("bbbb", reload_s=0.05, idle_s=30)])
    assert victims([g], {1: 2 * GiB + 1}) == ("bbbb",)
    # Under seed 001's LRU order the tie goes by replica id instead.
    assert victims([g], {1: 2 * GiB + 1}, order="lru") == ("aaaa",)


def test_a_large_model_idle_long_enough_goes_before_a_small_one_just_used():
    # Reload seconds per second of idleness: 3 s / 600 s is cheaper than 0.05 s / 1 s.
    g = gpu(1, [costly("big", reload_s=3.0, idle_s=600), costly("small", reload_s=0.05, idle_s=1)])
    assert victims([g], {1: 3 * GiB}) == ("big",)


def test_a_busy_replica_is_the_last_victim_and_one_idle_past_its_timeout_the_first():
    busy = costly("aaaa", reload_s=0.01, idle_s=600, in_flight=2)
    recent = costly("bbbb", reload_s=0.01, idle_s=5)
    expired = replace(costly("cccc", reload_s=5.0, idle_s=120), idle_timeout_s=60.0)
    g = gpu(1, [busy, recent, expired], total=3 * GiB)
    assert choose([g], {1: 1 * GiB}).victim_ids == ("cccc",)
    assert choose([g], {1: 2 * GiB}).victim_ids == ("cccc", "bbbb")


@given(st.lists(st.integers(min_value=0, max_value=3600), min_size=1, max_size=6))
@PROPERTY
def test_without_reload_costs_or_activity_the_cost_order_is_the_lru_order(idles):
    g = gpu(1, [occ(f"r{i}", 1 * GiB, last_accessed=ago(s)) for i, s in enumerate(idles)], total=8 * GiB)
    need = {1: 8 * GiB - (8 - len(idles)) * GiB + len(idles) // 2 * GiB}
    cost, lru = choose([g], need), choose([g], need, order="lru")
    assert type(cost) is type(lru)
    if isinstance(cost, VictimChoice):
        assert cost.victim_ids == lru.victim_ids  # only the wording of the reasons differs


def test_victims_are_preempted_at_once_only_when_none_of_them_serves_a_request():
    idle = gpu(1, [costly("aaaa", reload_s=1.0, idle_s=5), costly("bbbb", reload_s=1.0, idle_s=9)])
    mixed = gpu(1, [costly("aaaa", reload_s=1.0, idle_s=5), costly("bbbb", reload_s=1.0, idle_s=9, in_flight=1)])
    unknown = gpu(1, [occ("aaaa", last_accessed=ago(5)), occ("bbbb", last_accessed=ago(9))])
    need = {1: 4 * GiB}
    assert preempt_at_once(choose([idle], need))
    assert not preempt_at_once(choose([mixed], need))
    assert not preempt_at_once(choose([unknown], need))
    assert not preempt_at_once(choose([gpu(1)], {1: 1 * GiB}))  # nothing to preempt at all


def test_the_target_is_a_gpu_whose_occupants_may_go_not_one_held_by_a_popular_replica():
    # GPU 1 would need one eviction (the popular replica), GPU 2 two: fewest evictions points at
    # GPU 1, where choose_victim can never succeed.
    held = gpu(1, [occ("pop", 3 * GiB, popular=True)])
    free_to_go = gpu(
        2, [costly("aaaa", 2 * GiB, reload_s=1.0, idle_s=50), costly("bbbb", 2 * GiB, reload_s=1, idle_s=60)]
    )
    target = choose_target([held, free_to_go], waiting_replica_id=WAITER, need_bytes=3 * GiB, now=NOW)
    assert target is not None and target.ready
    assert (target.gpu_id, target.choice.victim_ids) == (2, ("bbbb", "aaaa"))


def test_the_target_prefers_victims_whose_weights_leave_fastest():
    slow = gpu(1, [costly("big", 3 * GiB, reload_s=3.0, idle_s=600)])
    fast = gpu(2, [costly("small", 3 * GiB, reload_s=0.1, idle_s=5)])
    target = choose_target([slow, fast], waiting_replica_id=WAITER, need_bytes=3 * GiB, now=NOW)
    assert target is not None and target.gpu_id == 2


def test_a_target_blocked_only_by_young_replicas_is_returned_not_ready():
    young = gpu(1, [occ("aaaa", 3 * GiB, serving_since=ago(2))])
    target = choose_target([young], waiting_replica_id=WAITER, need_bytes=3 * GiB, now=NOW)
    assert target is not None and not target.ready and target.gpu_id == 1
    assert (
        choose_target(
            [gpu(1, [occ("pop", 3 * GiB, popular=True)])], waiting_replica_id=WAITER, need_bytes=3 * GiB, now=NOW
        )
        is None
    )


# --- whole GPUs for a large model, and who sleeps on the idle timer ---------------------------


def test_a_whole_gpu_wake_takes_the_gpus_fairness_can_empty_not_those_of_popular_or_young_replicas():
    # node1: GPU 1 holds a popular replica, GPU 2 a young one; node2's GPUs hold idle replicas
    # that may go. The two GPUs the 70B-like waker needs (8 GiB over GPUs of 4) are node2's.
    node1 = [
        gpu(1, [occ("pop", 1 * GiB, popular=True)]),
        gpu(2, [occ("young", 1 * GiB, serving_since=ago(2))]),
        gpu(3),
    ]
    node2 = [
        gpu(4, [costly("aaaa", 3 * GiB, reload_s=0.5, idle_s=30)], node="node2"),
        gpu(5, [costly("bbbb", 2 * GiB, reload_s=0.5, idle_s=30)], node="node2"),
        gpu(6, [costly("busy", 1 * GiB, reload_s=0.5, idle_s=1, in_flight=2)], node="node2"),
    ]
    target = choose_whole_gpus([*node1, *node2], waiting_replica_id=WAITER, need_bytes=7 * GiB, now=NOW)
    assert target is not None and target.ready
    assert target.gpu_ids == (4, 5) and dict(target.needed_bytes_by_gpu) == {4: 4 * GiB, 5: 4 * GiB}
    assert sorted(target.choice.victim_ids) == ["aaaa", "bbbb"]  # not the busy one on GPU 6
    assert preempt_at_once(target.choice)


def test_a_victim_spanning_two_gpus_empties_both_and_is_counted_once():
    # An idle 70B-like replica on GPUs 1 and 2 empties both at the cost of one victim; GPU 3 is the
    # cheapest GPU to empty alone (it wastes nothing), but with GPU 1 or 2 it would make two victims.
    big = costly("big0", 4 * GiB, reload_s=2.0, idle_s=60)
    gpus = [
        gpu(1, [big]),
        gpu(2, [big]),
        gpu(3, [costly("cccc", 2 * GiB, reload_s=2.0, idle_s=60)]),
        gpu(4, [costly("dddd", 2 * GiB, reload_s=0.1, idle_s=60, in_flight=1)]),
    ]
    target = choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW)
    assert target is not None and target.gpu_ids == (1, 2) and target.choice.victim_ids == ("big0",)


def test_a_whole_gpu_wake_evicts_a_replica_whose_wake_misses_the_slo_last():
    # An idle 70B-like replica (wakes in 7 s) fills GPUs 1 and 2: one victim. GPUs 3 and 4 hold
    # one small replica each (wakes in 0.1 s): two victims. By the number of victims alone the
    # 70B-like one goes, and its next request misses for certain; against a 5 s SLO the two small
    # ones go instead, since each comes back within it.
    big = costly("big0", 4 * GiB, reload_s=7.0, idle_s=60)
    gpus = [
        gpu(1, [big]),
        gpu(2, [big]),
        gpu(3, [costly("cccc", 3 * GiB, reload_s=0.1, idle_s=60)]),
        gpu(4, [costly("dddd", 3 * GiB, reload_s=0.1, idle_s=60)]),
    ]
    plain = choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW)
    assert plain is not None and plain.choice.victim_ids == ("big0",)
    slo = choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW, slo_ttft_s=5.0)
    assert slo is not None and slo.gpu_ids == (3, 4) and sorted(slo.choice.victim_ids) == ["cccc", "dddd"]


def test_a_whole_gpu_target_with_more_victims_than_requests_waiting_is_refused():
    # Emptying any two GPUs evicts four small replicas: for one waiting request that trades four
    # replicas' next requests for one, so the caller is told to fall back (None); with four
    # waiting it is allowed. A single victim is always allowed, one wake for one.
    gpus = [
        gpu(i, [costly(f"s{i}a", 2 * GiB, reload_s=0.1, idle_s=60), costly(f"s{i}b", 2 * GiB, reload_s=0.1, idle_s=60)])
        for i in (1, 2, 3)
    ]
    ask = {"waiting_replica_id": WAITER, "need_bytes": 8 * GiB, "now": NOW}
    assert choose_whole_gpus(gpus, **ask, waiting_requests=1) is None
    assert choose_whole_gpus(gpus, **ask, waiting_requests=3) is None
    target = choose_whole_gpus(gpus, **ask, waiting_requests=4)
    assert target is not None and len(target.choice.victims) == 4
    one = [gpu(1), gpu(2, [costly("aaaa", 3 * GiB, reload_s=0.1, idle_s=60)])]
    target = choose_whole_gpus(one, **ask, waiting_requests=0)
    assert target is not None and target.choice.victim_ids == ("aaaa",)


def test_a_gpu_with_an_occupant_that_may_not_go_is_never_a_whole_gpu():
    # GPU 2 has room for the bytes once "aaaa" goes, but the popular replica would still be on it.
    gpus = [gpu(1), gpu(2, [occ("aaaa", 2 * GiB), occ("pop", 1, popular=True)])]
    assert choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW) is None
    young = [gpu(1), gpu(2, [occ("aaaa", 2 * GiB, serving_since=ago(2))])]
    target = choose_whole_gpus(young, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW)
    assert target is not None and not target.ready and target.gpu_ids == (1, 2)


def test_whole_gpus_are_taken_on_one_node_only():
    gpus = [gpu(1), gpu(2, node="node2")]
    assert choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=8 * GiB, now=NOW) is None
    target = choose_whole_gpus(gpus, waiting_replica_id=WAITER, need_bytes=4 * GiB, now=NOW)
    assert target is not None and target.choice.victims == () and len(target.gpu_ids) == 1


def test_a_single_gpu_target_lists_its_one_gpu():
    target = choose_target([gpu(1, [occ("aaaa", 3 * GiB)])], waiting_replica_id=WAITER, need_bytes=2 * GiB, now=NOW)
    assert target is not None and target.gpu_ids == (1,) and dict(target.needed_bytes_by_gpu) == {1: 2 * GiB}


def test_only_a_replica_whose_wake_meets_its_slo_is_slept_on_the_idle_timer():
    assert sleep_when_idle(wake_s=0.8, slo_ttft_s=5.0)  # an 8B model from CPU RAM
    assert sleep_when_idle(wake_s=5.0, slo_ttft_s=5.0)
    assert not sleep_when_idle(wake_s=7.1, slo_ttft_s=5.0)  # a 70B model: its next request would miss


def copy(name: str, need: int, *, wake_s: float = 1.0, whole_gpu_from: float = 0.99) -> AsleepCopy:
    return AsleepCopy(name, need, wake_s, whole_gpu_from)


def test_a_node_is_short_of_room_for_the_largest_copy_asleep_there_that_no_gpu_of_it_holds():
    gpus = [gpu(1, [occ("a", 3 * GiB)]), gpu(2, [occ("b", 2 * GiB)])]  # 1 and 2 GiB free
    assert short_of_room(gpus, [copy("fits", 2 * GiB)], slo_ttft_s=5.0) is None
    found = short_of_room(
        gpus, [copy("fits", 2 * GiB), copy("big", 3 * GiB), copy("bigger", 4 * GiB - 1)], slo_ttft_s=5.0
    )
    assert found is not None and found.deployment == "bigger"


def test_a_copy_whose_wake_misses_the_slo_never_makes_its_node_short_of_room():
    gpus = [gpu(1, [occ("a", 3 * GiB)])]
    assert short_of_room(gpus, [copy("slow", 2 * GiB, wake_s=7.1)], slo_ttft_s=5.0) is None


def test_a_copy_that_needs_whole_gpus_counts_only_gpus_that_nobody_holds():
    # 5 GiB free in bytes, but only one GPU of 4 is free as a whole: a 6 GiB need takes two.
    gpus = [gpu(1), gpu(2, [occ("a", 3 * GiB)])]
    assert short_of_room(gpus, [copy("whole", 6 * GiB)], slo_ttft_s=5.0) is not None
    assert short_of_room([gpu(1), gpu(2)], [copy("whole", 6 * GiB)], slo_ttft_s=5.0) is None


def test_an_idle_replica_sleeps_early_only_when_its_node_is_short_it_wakes_within_the_slo_and_max_wait_has_passed():
    short = copy("big", 3 * GiB)
    assert sleep_early(wake_s=0.8, slo_ttft_s=5.0, idle_s=5.0, max_wait_s=5.0, short=short)
    assert not sleep_early(wake_s=0.8, slo_ttft_s=5.0, idle_s=5.0, max_wait_s=5.0, short=None)  # room to spare
    assert not sleep_early(wake_s=0.8, slo_ttft_s=5.0, idle_s=4.9, max_wait_s=5.0, short=short)  # inside a burst
    assert not sleep_early(wake_s=7.1, slo_ttft_s=5.0, idle_s=60.0, max_wait_s=5.0, short=short)  # would miss


# --- the seed's rules, one at a time ---------------------------------------------------------


def test_it_never_chooses_a_popular_replica():
    g = gpu(0, [occ("a", 2 * GiB, popular=True, last_accessed=ago(7200)), occ("b", 2 * GiB, last_accessed=ago(5))])

    assert victims([g], {0: 2 * GiB}) == ("b",)
    assert refusal([gpu(0, [occ("a", 4 * GiB, popular=True)])], {0: 1 * GiB}).causes == {Cause.POPULAR}


def test_it_never_chooses_a_replica_inside_its_min_runtime():
    young = occ("a", 2 * GiB, min_runtime_s=60, serving_since=ago(59.9), last_accessed=None)
    old = occ("b", 2 * GiB, min_runtime_s=60, serving_since=ago(600), last_accessed=ago(1))

    assert victims([gpu(0, [young, old])], {0: 2 * GiB}) == ("b",)


def test_a_replica_becomes_eligible_the_moment_its_min_runtime_has_passed():
    o = occ("a", 4 * GiB, min_runtime_s=10, serving_since=ago(10))

    assert victims([gpu(0, [o])], {0: 1 * GiB}) == ("a",)
    assert isinstance(choose([gpu(0, [o])], {0: 1 * GiB}, now=NOW - timedelta(microseconds=1)), NoVictim)


def test_a_replica_without_serving_since_is_never_chosen():
    o = occ("a", 4 * GiB, min_runtime_s=0, serving_since=None)

    result = refusal([gpu(0, [o])], {0: 1 * GiB})

    assert result.causes == {Cause.MIN_RUNTIME}
    assert "no serving_since" in result.skipped["a"]


@pytest.mark.parametrize("state", ["sleeping", "draining", "loading", "waking", "pending", "standby", "stopping"])
def test_it_only_chooses_serving_replicas(state):
    g = gpu(0, [occ("a", 2 * GiB, state=state, last_accessed=None), occ("b", 2 * GiB, last_accessed=NOW)])

    assert victims([g], {0: 2 * GiB}) == ("b",)
    assert f"is {state}, not serving" in choose([g], {0: 2 * GiB}).skipped["a"]


def test_it_never_chooses_a_dedicated_replica():
    g = gpu(0, [occ("a", 2 * GiB, dedicated=True, last_accessed=None), occ("b", 2 * GiB, last_accessed=NOW)])

    assert victims([g], {0: 2 * GiB}) == ("b",)


def test_it_chooses_the_least_recently_accessed_eligible_occupant():
    g = gpu(0, [occ("a", 1 * GiB, last_accessed=ago(30)), occ("b", 1 * GiB, last_accessed=ago(300))], total=2 * GiB)

    assert victims([g], {0: 1 * GiB}) == ("b",)


def test_a_replica_never_accessed_counts_as_least_recently_used():
    g = gpu(0, [occ("a", 1 * GiB, last_accessed=ago(86400)), occ("b", 1 * GiB, last_accessed=None)], total=2 * GiB)

    result = choose([g], {0: 1 * GiB})

    assert isinstance(result, VictimChoice) and result.victim_ids == ("b",)
    assert "never accessed" in result.reason


def test_equally_idle_occupants_are_chosen_by_replica_id():
    same = ago(60)
    occupants = [occ(rid, 1 * GiB, last_accessed=same) for rid in ("c", "a", "b")]

    assert victims([gpu(0, occupants, total=3 * GiB)], {0: 1 * GiB}) == ("a",)
    assert victims([gpu(0, occupants[::-1], total=3 * GiB)], {0: 2 * GiB}) == ("a", "b")


def test_it_only_considers_occupants_of_the_gpus_the_waiting_replica_needs():
    needed = gpu(0, [occ("a", 2 * GiB, last_accessed=ago(10))])
    elsewhere = gpu(1, [occ("b", 4 * GiB, last_accessed=None)])

    assert victims([needed, elsewhere], {0: 4 * GiB}) == ("a",)
    assert refusal([needed, elsewhere], {0: 5 * GiB}).shortfalls[0].gpu_id == 0


def test_it_never_chooses_the_waiting_replica_itself():
    # The waiter's own sleeping residual, even marked serving by a torn snapshot, is not a victim.
    me = occ(WAITER, 2 * GiB, last_accessed=None)
    other = occ("b", 1 * GiB, last_accessed=NOW)

    assert victims([gpu(0, [me, other])], {0: 2 * GiB}) == ("b",)
    assert eligible(me, waiting_replica_id=WAITER, now=NOW) == (
        False,
        f"tiny-{WAITER} (ffff0000) is the waiting replica itself",
    )


# --- how much is preempted -------------------------------------------------------------------


def test_nothing_is_preempted_when_the_replica_already_fits():
    result = choose([gpu(0, [occ("a", 1 * GiB)])], {0: 3 * GiB})

    assert isinstance(result, VictimChoice) and result.victims == ()
    assert result.reason.startswith("no preemption needed")


def test_it_preempts_in_lru_order_until_enough_is_free():
    occupants = [occ(rid, 1 * GiB, last_accessed=ago(age)) for rid, age in (("a", 10), ("b", 30), ("c", 20), ("d", 40))]

    assert victims([gpu(0, occupants)], {0: 3 * GiB}) == ("d", "b", "c")


def test_an_older_victim_made_redundant_by_a_later_one_is_spared():
    # LRU order takes the small, oldest one first; it alone is not enough, the next one alone is.
    small_old = occ("a", 1 * GiB, last_accessed=ago(300))
    big = occ("b", 3 * GiB, last_accessed=ago(10))

    result = choose([gpu(0, [small_old, big])], {0: 3 * GiB})

    assert isinstance(result, VictimChoice) and result.victim_ids == ("b",)
    assert result.reason.endswith("; spares 1 older eligible occupant (a), not needed once this one sleeps")


def test_the_reason_names_the_gpu_the_victim_and_how_long_it_was_idle():
    result = choose([gpu(0, [occ("b", 2 * GiB, deployment="tiny-b", last_accessed=ago(120))])], {0: 4 * GiB})

    assert isinstance(result, VictimChoice)
    assert result.reason.startswith("least recently used eligible occupant of gpu node1/0: tiny-b (b), idle since ")
    assert "(120 s ago)" in result.reason and "frees 2.0 GiB on node1/0" in result.reason


def test_a_multi_gpu_need_gets_room_on_every_needed_gpu():
    g0 = gpu(0, [occ("a", 2 * GiB, last_accessed=ago(50)), occ("b", 2 * GiB, last_accessed=ago(40))])
    g1 = gpu(1, [occ("c", 2 * GiB, last_accessed=ago(10)), occ("d", 2 * GiB, last_accessed=ago(5))])

    assert victims([g0, g1], {0: 2 * GiB, 1: 4 * GiB}) == ("a", "c", "d")


def test_a_candidate_that_frees_nothing_where_memory_is_short_is_passed_over():
    # gpu 0 already has room; its old occupant would free memory only where none is needed.
    g0 = gpu(0, [occ("a", 2 * GiB, last_accessed=None)])
    g1 = gpu(1, [occ("b", 4 * GiB, last_accessed=ago(5))])

    assert victims([g0, g1], {0: 2 * GiB, 1: 2 * GiB}) == ("b",)


def test_a_victim_spanning_two_gpus_frees_memory_on_both():
    wide = [occ("w", 3 * GiB, deployment="big", last_accessed=ago(100))]
    g0, g1 = gpu(0, wide), gpu(1, [*wide, occ("x", 1 * GiB, last_accessed=ago(200))])

    result = choose([g0, g1], {0: 2 * GiB, 1: 3 * GiB})

    assert isinstance(result, VictimChoice)
    assert result.victim_ids == ("w",)  # x is older but w alone frees both GPUs
    assert result.victims[0].freed_bytes_by_gpu == {0: 3 * GiB, 1: 3 * GiB}
    assert "of gpus node1/0, node1/1: big (w)" in result.reason


def test_a_victim_reports_what_it_frees_on_a_gpu_that_is_not_needed():
    wide = occ("w", 3 * GiB, last_accessed=ago(100))

    result = choose([gpu(0, [wide]), gpu(1, [wide])], {0: 2 * GiB})

    assert isinstance(result, VictimChoice) and result.victims[0].freed_bytes_by_gpu == {0: 3 * GiB, 1: 3 * GiB}


def test_a_replica_that_is_ineligible_on_any_of_its_gpus_is_not_chosen():
    # A torn snapshot shows one replica popular on one GPU and not on the other: protect it.
    g0 = gpu(0, [occ("w", 2 * GiB, popular=True)])
    g1 = gpu(1, [occ("w", 2 * GiB)])

    assert refusal([g0, g1], {1: 4 * GiB}).causes == {Cause.POPULAR}


def test_the_memory_a_sleeping_replica_keeps_is_not_counted_as_freed():
    g = gpu(0, [occ("a", 2 * GiB, last_accessed=ago(60)), occ("b", 2 * GiB, last_accessed=ago(30))])

    assert victims([g], {0: 2 * GiB}) == ("a",)
    assert victims([g], {0: 2 * GiB}, kept_bytes_by_gpu={0: 512 * MiB}) == ("a", "b")


# --- why nobody can be preempted ------------------------------------------------------------


def test_no_victim_when_the_gpu_has_no_other_occupant():
    result = refusal([gpu(0, [occ(WAITER, 0, state="sleeping")], total=1 * GiB)], {0: 2 * GiB})

    assert result.causes == {Cause.NO_OCCUPANTS}
    assert result.reason == "gpu node1/0 has no other occupant to preempt (needs 2.0 GiB, 1.0 GiB available)"


def test_no_victim_when_all_occupants_are_popular_or_within_min_runtime():
    g = gpu(0, [occ("a", 2 * GiB, popular=True), occ("b", 2 * GiB, serving_since=ago(3))])

    result = refusal([g], {0: 1 * GiB})

    assert result.reason.startswith("all occupants of gpu node1/0 are popular or within min_runtime (")
    assert "has served 3 s, less than its min_runtime of 10 s" in result.reason
    assert result.causes == {Cause.POPULAR, Cause.MIN_RUNTIME}
    assert set(result.skipped) == {"a", "b"}


def test_no_victim_when_all_occupants_are_popular():
    result = refusal([gpu(0, [occ("a", 4 * GiB, popular=True)])], {0: 1 * GiB})

    assert result.reason.startswith("all occupants of gpu node1/0 are popular (")


def test_no_victim_when_all_occupants_are_within_min_runtime():
    result = refusal([gpu(0, [occ("a", 4 * GiB, serving_since=ago(1))])], {0: 1 * GiB})

    assert result.reason.startswith("all occupants of gpu node1/0 are within min_runtime (")


def _room_at(gpus: Iterable[GPUView], needed: Mapping[int, int]) -> datetime | None:
    return room_at(list(gpus), waiting_replica_id=WAITER, needed_bytes_by_gpu=needed, now=NOW, kept_bytes_by_gpu={})


def test_a_wake_refused_for_young_replicas_finds_room_once_enough_of_their_min_runtimes_lapse():
    # 3 GiB short: a (1 GiB) settles in 2 s, b (2 GiB) in 5 s, c (2 GiB) in 8 s. a and b free 3.
    young = [occ("a", 1 * GiB, serving_since=ago(8)), occ("b", 2 * GiB, serving_since=ago(5))]
    g = gpu(0, [*young, occ("c", 2 * GiB, serving_since=ago(2))], total=6 * GiB)
    needed = {0: 4 * GiB}
    refusal([g], needed)

    at = _room_at([g], needed)

    assert at is not None and timedelta(seconds=5) < at - NOW < timedelta(seconds=5.01), at
    assert isinstance(choose([g], needed, now=at), VictimChoice)


def test_no_room_is_foreseen_where_no_lapse_helps():
    popular = gpu(0, [occ("a", 4 * GiB, popular=True), occ("b", 1 * GiB, serving_since=ago(1))], total=5 * GiB)
    assert _room_at([popular], {0: 3 * GiB}) is None, "b alone, once settled, frees too little"
    assert _room_at([gpu(0, [occ("a", 4 * GiB, state="waking")])], {0: 1 * GiB}) is None, "no one serving"


@PROPERTY
@given(
    settle_in=st.lists(st.floats(min_value=-5, max_value=60), min_size=1, max_size=6),
    popular=st.lists(st.booleans(), min_size=6, max_size=6),
    needed_gib=st.integers(min_value=1, max_value=7),
)
def test_the_room_foreseen_is_the_first_moment_a_victim_is_found(settle_in, popular, needed_gib):
    occupants = [
        occ(f"r{i}", 1 * GiB, popular=popular[i], serving_since=NOW - timedelta(seconds=10 - s))
        for i, s in enumerate(settle_in)
    ]
    g = gpu(0, occupants, total=8 * GiB)
    needed = {0: needed_gib * GiB}
    if isinstance(choose([g], needed), VictimChoice):
        return  # no refusal now: nothing to foresee

    at = _room_at([g], needed)

    # Every moment a victim could first be found is a lapse: one before `at` finds none, `at` does.
    moments = sorted({o.serving_since + timedelta(seconds=10, milliseconds=1) for o in occupants})
    found = [m for m in moments if m > NOW and isinstance(choose([g], needed, now=m), VictimChoice)]
    assert at == (found[0] if found else None)


def test_no_victim_when_no_occupant_is_serving():
    result = refusal([gpu(0, [occ("a", 4 * GiB, state="waking")])], {0: 1 * GiB})

    assert result.reason.startswith("all occupants of gpu node1/0 are not serving (")
    assert result.causes == {Cause.NOT_SERVING}


def test_no_victim_when_even_every_eligible_occupant_would_not_free_enough():
    g = gpu(0, [occ("a", 1 * GiB), occ("b", 2 * GiB, popular=True)], total=4 * GiB)

    result = refusal([g], {0: 3 * GiB})

    assert result.causes == {Cause.NOT_ENOUGH_MEMORY, Cause.POPULAR}
    assert result.reason.startswith(
        "not enough memory on gpu node1/0 even after preempting every eligible occupant: "
        "needs 3.0 GiB, 1.0 GiB available + 1.0 GiB from 1 eligible occupant"
    )
    shortfall = result.shortfalls[0]
    assert (shortfall.needed_bytes, shortfall.available_bytes, shortfall.freeable_bytes) == (3 * GiB, 1 * GiB, 1 * GiB)


def test_no_victim_lists_only_the_gpus_that_stay_short():
    g0 = gpu(0, [occ("a", 2 * GiB)])
    g1 = gpu(1, [occ("b", 4 * GiB, popular=True)], node="node2")

    result = refusal([g0, g1], {0: 4 * GiB, 1: 1 * GiB})

    assert [s.label for s in result.shortfalls] == ["node2/1"]
    assert result.reason.startswith("all occupants of gpu node2/1 are popular")


# --- eligibility, waiting, and bad input -----------------------------------------------------


def test_eligible_says_why_an_occupant_may_be_preempted():
    ok, why = eligible(occ("a", serving_since=ago(30)), waiting_replica_id=WAITER, now=NOW)

    assert ok and why == "tiny-a (a) is eligible: serving for 30 s, at least its min_runtime of 10 s"


def test_eligible_says_when_a_young_replica_becomes_eligible():
    ok, why = eligible(occ("a", serving_since=ago(4), min_runtime_s=10), waiting_replica_id=WAITER, now=NOW)

    assert not ok and why.endswith(f"(eligible from {(NOW + timedelta(seconds=6)).isoformat()})")


def test_popular_outranks_min_runtime_in_the_reason():
    ok, why = eligible(occ("a", popular=True, serving_since=ago(1)), waiting_replica_id=WAITER, now=NOW)

    assert not ok and why == "tiny-a (a) is popular (never preempted)"


def test_the_fairness_wait_ends_max_wait_after_the_intent_was_written():
    deadline = wait_deadline(NOW, 5)

    assert deadline == NOW + timedelta(seconds=5)
    assert not should_preempt(NOW + timedelta(seconds=4.999), deadline, freed_voluntarily=False)
    assert should_preempt(deadline, deadline, freed_voluntarily=False)
    assert not should_preempt(deadline + timedelta(hours=1), deadline, freed_voluntarily=True)
    assert should_preempt(NOW, wait_deadline(NOW, 0), freed_voluntarily=False)


@pytest.mark.parametrize("max_wait_s", [-1, float("nan"), float("inf")])
def test_a_max_wait_that_is_not_a_finite_duration_is_refused(max_wait_s):
    with pytest.raises(ValueError, match="max_wait_s"):
        wait_deadline(NOW, max_wait_s)


@pytest.mark.parametrize(
    ("needed", "message"),
    [({}, "at least one GPU"), ({7: GiB}, "not among the given GPUs"), ({0: -1}, "negative need")],
)
def test_a_caller_bug_is_refused(needed, message):
    with pytest.raises(ValueError, match=message):
        choose([gpu(0)], needed)


def test_the_same_gpu_twice_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        choose([gpu(0), gpu(0)], {0: GiB})


# --- properties ------------------------------------------------------------------------------

# Values come from short lists: one draw each keeps generation fast (the file stays under 10 s).
# The lists lean towards eligible occupants and GPUs a little short of room, so that choosing
# among several candidates is the common case; hypothesis favours (and shrinks towards) each
# list's first element, hence the order. Ages straddle the min_runtimes drawn below, and few
# distinct access times make ties (broken by replica id) common.
STATES = ("serving",) * 10 + ("sleeping", "draining", "loading", "waking")
RARELY = (False,) * 7 + (True,)
SHORT_BY = (1, 2, 3, 4, 0, -1, 1, 2)  # GiB a needed GPU lacks; <= 0: it already has room
SIZES = tuple(k * GiB for k in (1, 2, 3, 4, 1, 2, 0))
SERVING_SINCE = (*(ago(s) for s in (3600, 600, 0, 3, 5, 9.5, 10, 30, 60, 120, 600, 3600)), None)
LAST_ACCESSED = (None, *(ago(60 * k) for k in range(6)))


@dataclass(frozen=True)
class Scenario:
    gpus: tuple[GPUView, ...]
    waiting: str
    needed: dict[int, int]
    kept: dict[int, int]
    replicas: dict[str, OccupantView]  # one view per replica, for the oracle


@st.composite
def scenarios(draw) -> Scenario:
    gpu_ids = list(range(draw(st.integers(1, 3))))
    replicas: dict[str, OccupantView] = {}
    on_gpu: dict[int, list[OccupantView]] = {g: [] for g in gpu_ids}
    spans = [*itertools.combinations(gpu_ids, 1), *itertools.combinations(gpu_ids, 2)]
    for i in range(draw(st.integers(1, 8))):
        view = OccupantView(
            replica_id=f"r{i}",
            deployment=f"dep{i}",
            state=draw(st.sampled_from(STATES)),
            reserved_bytes=0,
            popular=draw(st.sampled_from(RARELY)),
            dedicated=draw(st.sampled_from(RARELY)),
            min_runtime_s=draw(st.sampled_from([0.0, 5.0, 10.0, 60.0])),
            serving_since=draw(st.sampled_from(SERVING_SINCE)),
            last_accessed=draw(st.sampled_from(LAST_ACCESSED)),
        )
        replicas[view.replica_id] = view
        for g in draw(st.sampled_from(spans)):
            on_gpu[g].append(replace(view, reserved_bytes=draw(st.sampled_from(SIZES))))
    gpus = tuple(
        GPUView(
            id=g,
            node="node1",
            index=g,
            total_bytes=(free := draw(st.integers(0, 4)) * GiB) + sum(o.reserved_bytes for o in on_gpu[g]),
            available_bytes=free,
            version=1,
            occupants=tuple(on_gpu[g]),
        )
        for g in gpu_ids
    )
    needed_ids = draw(st.lists(st.sampled_from(gpu_ids), min_size=1, unique=True))
    by_id = {g.id: g for g in gpus}
    needed = {g: max(0, by_id[g].available_bytes + draw(st.sampled_from(SHORT_BY)) * GiB) for g in needed_ids}
    kept = draw(st.sampled_from([{}, {g: 512 * MiB for g in gpu_ids}]))
    waiting = draw(st.sampled_from(["waiting", *replicas]))
    return Scenario(gpus, waiting, needed, kept, replicas)


def run(s: Scenario) -> VictimChoice | NoVictim:
    return choose(s.gpus, s.needed, waiting=s.waiting, kept_bytes_by_gpu=s.kept)


def oracle_eligible(s: Scenario, replica_id: str) -> bool:
    o = s.replicas[replica_id]
    return (
        replica_id != s.waiting
        and o.state == "serving"
        and not o.popular
        and not o.dedicated
        and o.serving_since is not None
        and (NOW - o.serving_since).total_seconds() >= o.min_runtime_s
    )


def freed(s: Scenario, replica_ids: Iterable[str]) -> dict[int, int]:
    ids = set(replica_ids)
    return {
        g.id: sum(max(0, o.reserved_bytes - s.kept.get(g.id, 0)) for o in g.occupants if o.replica_id in ids)
        for g in s.gpus
    }


def fits(s: Scenario, replica_ids: Iterable[str]) -> bool:
    extra = freed(s, replica_ids)
    by_id = {g.id: g for g in s.gpus}
    return all(by_id[g].available_bytes + extra[g] >= need for g, need in s.needed.items())


def on_needed_gpus(s: Scenario) -> set[str]:
    return {o.replica_id for g in s.gpus if g.id in s.needed for o in g.occupants}


@PROPERTY
@given(scenarios())
def test_it_never_chooses_a_popular_dedicated_too_young_non_serving_or_waiting_replica(s):
    result = run(s)

    if isinstance(result, VictimChoice):
        assert all(oracle_eligible(s, rid) for rid in result.victim_ids)
        assert all(not s.replicas[rid].popular for rid in result.victim_ids)


@PROPERTY
@given(scenarios())
def test_victims_are_only_occupants_of_the_needed_gpus(s):
    result = run(s)

    if isinstance(result, VictimChoice):
        assert set(result.victim_ids) <= on_needed_gpus(s)
        assert len(set(result.victim_ids)) == len(result.victim_ids)


@PROPERTY
@given(scenarios())
def test_the_victims_free_enough_and_none_of_them_is_superfluous(s):
    result = run(s)

    if isinstance(result, VictimChoice):
        chosen = result.victim_ids
        assert fits(s, chosen)
        for i in range(len(chosen)):
            assert not fits(s, chosen[:i] + chosen[i + 1 :]), f"{chosen[i]} was not needed"
        if chosen:
            assert not fits(s, chosen[:-1])  # in particular, the last one in LRU order was needed


@PROPERTY
@given(scenarios())
def test_no_victim_exactly_when_preempting_every_eligible_occupant_is_not_enough(s):
    everyone = {rid for rid in on_needed_gpus(s) if oracle_eligible(s, rid)}

    assert isinstance(run(s), NoVictim) == (not fits(s, everyone))


@PROPERTY
@given(scenarios())
def test_victims_come_in_lru_order_from_the_shortest_sufficient_lru_prefix(s):
    result = run(s)
    if not isinstance(result, VictimChoice) or len(s.needed) != 1:
        return
    (gpu_id,) = s.needed
    helpful = [rid for rid in on_needed_gpus(s) if oracle_eligible(s, rid) and freed(s, [rid])[gpu_id] > 0]
    lru = sorted(
        helpful, key=lambda r: (s.replicas[r].last_accessed is not None, s.replicas[r].last_accessed or NOW, r)
    )
    prefix = next((lru[:n] for n in range(len(lru) + 1) if fits(s, lru[:n])), None)

    assert prefix is not None
    assert list(result.victim_ids) == [r for r in prefix if r in result.victim_ids]
    assert not prefix or result.victim_ids[-1] == prefix[-1]


@PROPERTY
@given(scenarios(), st.randoms(use_true_random=False))
def test_the_answer_depends_only_on_the_views_not_on_their_order(s, rnd: random.Random):
    shuffled = [replace(g, occupants=tuple(rnd.sample(g.occupants, len(g.occupants)))) for g in s.gpus]
    rnd.shuffle(shuffled)

    first = run(s)
    assert run(s) == first
    assert choose(shuffled, s.needed, waiting=s.waiting, kept_bytes_by_gpu=s.kept) == first


# --- thrashing: min_runtime bounds how often replicas swap -----------------------------------


@dataclass
class Sim:
    """One GPU shared by several deployments, one replica each, woken on request."""

    size: dict[str, int]
    min_runtime_s: dict[str, float]
    max_wait_s: float
    total: int
    serving: dict[str, tuple[datetime, datetime]]  # replica -> (serving_since, last_accessed)
    swaps: list[tuple[datetime, str, str]]  # (when, woken, preempted)

    def view(self) -> GPUView:
        occupants = tuple(
            occ(r, self.size[r], min_runtime_s=self.min_runtime_s[r], serving_since=since, last_accessed=used)
            for r, (since, used) in sorted(self.serving.items())
        )
        return gpu(0, occupants, total=self.total)

    def request(self, replica: str, at: datetime) -> None:
        if replica in self.serving:
            self.serving[replica] = (self.serving[replica][0], at)
            return
        # Nobody sleeps voluntarily in this stream, so the waiter preempts once max_wait is over.
        deadline = wait_deadline(at, self.max_wait_s)
        assert should_preempt(deadline, deadline, freed_voluntarily=False)
        result = choose([self.view()], {0: self.size[replica]}, waiting=replica, now=deadline)
        if isinstance(result, NoVictim):
            return  # the wake fails with the reason; the next request tries again
        for victim in result.victim_ids:
            del self.serving[victim]
            self.swaps.append((deadline, replica, victim))
        self.serving[replica] = (deadline, deadline)  # serving_since restarts at every wake


def test_two_deployments_requested_every_second_swap_only_once_per_min_runtime():
    sim = Sim({"a": 3 * GiB, "b": 3 * GiB}, {"a": 10.0, "b": 10.0}, 0.0, 4 * GiB, {"a": (NOW, NOW)}, [])

    for second in range(1, 61):
        sim.request("ab"[second % 2], NOW + timedelta(seconds=second))

    times = [t for t, _, _ in sim.swaps]
    assert 1 <= len(times) <= 6
    assert all((b - a).total_seconds() >= 10 for a, b in itertools.pairwise(times))


@PROPERTY
@given(
    min_runtime_s=st.integers(1, 30),
    max_wait_s=st.sampled_from([0.0, 0.5, 5.0]),
    gaps_ms=st.lists(st.integers(0, 40_000), min_size=2, max_size=60),
)
def test_two_deployments_requested_alternately_swap_at_most_once_per_min_runtime(min_runtime_s, max_wait_s, gaps_ms):
    sim = Sim(
        {"a": 3 * GiB, "b": 3 * GiB},
        {"a": min_runtime_s, "b": min_runtime_s},
        max_wait_s,
        4 * GiB,
        {"a": (NOW, NOW)},
        [],
    )
    at = NOW
    for i, gap in enumerate(gaps_ms):
        at += timedelta(milliseconds=gap)
        sim.request("ba"[i % 2], at)

    times = [t for t, _, _ in sim.swaps]
    assert all((b - a).total_seconds() >= min_runtime_s for a, b in itertools.pairwise(times))


@PROPERTY
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    runtimes=st.lists(st.sampled_from([0.0, 1.0, 10.0, 30.0]), min_size=4, max_size=4),
    requests=st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 3)), min_size=1, max_size=40),
)
def test_a_woken_replica_always_serves_its_min_runtime_before_it_is_preempted(sizes, runtimes, requests):
    names = [f"d{i}" for i in range(len(sizes))]
    sim = Sim(
        {n: s * GiB for n, s in zip(names, sizes, strict=True)},
        dict(zip(names, runtimes, strict=False)),
        0.0,
        4 * GiB,
        {},
        [],
    )
    at = NOW
    for gap, who in requests:
        at += timedelta(milliseconds=gap)
        woken_at = {r: since for r, (since, _) in sim.serving.items()}
        before = len(sim.swaps)
        sim.request(names[who % len(names)], at)
        for when, _, victim in sim.swaps[before:]:
            assert (when - woken_at[victim]).total_seconds() >= sim.min_runtime_s[victim]
        assert sum(sim.size[r] for r in sim.serving) <= sim.total
