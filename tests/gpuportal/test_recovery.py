"""`up` outlives its own parts: each of its processes SIGKILLed under two clients, then its
PostgreSQL and its Redis each frozen longer than the heartbeat timeout, then beat killed ten times
in a row.

The scenario is bench/recovery.py's (which records the recovery times in BENCHMARKS.md); here
only what must hold is asserted, never a time.
"""

from __future__ import annotations

import pytest

from bench.recovery import CRASH_LOOP, PROCESSES, STALLS, run

pytestmark = pytest.mark.slow


def test_every_process_of_up_killed_under_load_is_started_again_and_no_accepted_request_is_lost(tmp_path):
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=5, log=lambda _: None).path

    # run() waits, after each kill, for up to start the process again (a new pid) and for an
    # answer to a request sent after that: it raises if the stack does not recover by itself.
    outcome = run(list(PROCESSES), model, tmp_path / "var", STALLS)

    said = "\n".join(outcome.said[-40:])
    assert outcome.exit_code == 0, said
    assert [r.process for r in outcome.recoveries] == list(PROCESSES)
    assert outcome.lost == [], f"accepted requests that never ended done: {outcome.lost}"
    # Each request not accepted (a 503, a cut) was sent again under its Idempotency-Key until it
    # was: across the kills of Redis and the web, none ran twice.
    assert outcome.run_twice == [], outcome.run_twice
    assert {r.process: r.seen.server_errors for r in outcome.recoveries} == {name: [] for name in PROCESSES}
    assert all(r.first_answer_s is not None for r in outcome.recoveries)
    # While a server was down, the API said so with a 503 (never a 500); after it, 200s again.
    by_process = {r.process: r.seen for r in outcome.recoveries}
    assert by_process["postgresql"].unavailable > 0 and by_process["redis"].unavailable > 0
    assert outcome.restarted >= set(PROCESSES), "every restart is in the trail (stack.restarted Events)"
    for name in PROCESSES:
        assert any(line.startswith(f"{name} was killed by SIGKILL; starting it again") for line in outcome.said), said
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
