"""`up` under a stall and a crash loop: its PostgreSQL and its Redis each frozen longer than the
heartbeat timeout, then beat killed ten times in a row, under two clients.

The scenario is bench/recovery.py's (which records its figures in BENCHMARKS.md); here only what
must hold is asserted, never a time (but the one each request asks for itself: its timeout_s).
"""

from __future__ import annotations

import pytest

from bench.recovery import CRASH_LOOP, STALLS, run

pytestmark = pytest.mark.slow


def test_a_frozen_server_writes_off_no_node_and_a_crash_looping_beat_stops_nothing(tmp_path):
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=6, log=lambda _: None).path

    outcome = run([], model, tmp_path / "var", stalls=STALLS, crash_loops=True)

    said = "\n".join(outcome.said[-40:])
    assert outcome.exit_code == 0, said
    assert outcome.lost == [] and outcome.run_twice == [], (outcome.lost, outcome.run_twice)
    # A Redis frozen mid-submit runs it once it resumes: past its deadline, so a 503 ran nothing.
    # The keyless client (it never sends again) met 503s while Redis was frozen, and none ran.
    assert outcome.keyless_503s > 0 and outcome.ran_after_503 == [], outcome.ran_after_503
    assert outcome.pids_before and outcome.pids_after == outcome.pids_before, "the replica lived through it all"
    # A stall of the control plane's own servers is not the death of its node.
    assert [s.process for s in outcome.stalls] == list(STALLS)
    assert all(s.first_answer_s is not None and s.seen.server_errors == [] for s in outcome.stalls)
    assert outcome.written_off == [], f"a stall was read as a death: {outcome.written_off}"
    assert outcome.stalls_seen > 0, "the heartbeat sweep says it stalled (control.stalled Events)"
    # Each /infer/ asks timeout_s 2: it comes back within that and a margin, whatever the servers do.
    assert {s.process: s.slowest_post_s <= 2 + 5 for s in outcome.stalls} == dict.fromkeys(STALLS, True), [
        (s.process, round(s.slowest_post_s, 1)) for s in outcome.stalls
    ]
    # A helper that crash-loops degrades the portal and stops nothing: /readyz names it each time,
    # requests are answered throughout, and it is whole again afterwards (up exits 0 when asked, above).
    loop = outcome.crash_loop
    assert loop is not None and (loop.kills, loop.named_down) == (CRASH_LOOP, CRASH_LOOP), loop
    assert loop.whole_after and loop.seen.server_errors == [], loop
