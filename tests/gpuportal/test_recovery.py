"""`up` outlives its own parts: each of its processes SIGKILLed under two clients. Its servers
frozen, and beat crash-looping: tests/gpuportal/test_stalls.py.

The scenario is bench/recovery.py's (which records the recovery times in BENCHMARKS.md); here
only what must hold is asserted, never a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.recovery import PROCESSES, run

pytestmark = pytest.mark.slow


def test_every_process_of_up_killed_under_load_is_started_again_and_no_accepted_request_is_lost(tmp_path):
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=5, log=lambda _: None).path

    # run() waits, after each kill, for up to start the process again (a new pid) and for an
    # answer to a request sent after that: it raises if the stack does not recover by itself.
    outcome = run(list(PROCESSES), model, tmp_path / "var", stalls=(), crash_loops=False)

    said = "\n".join(outcome.said[-40:])
    assert outcome.exit_code == 0, said
    assert [r.process for r in outcome.recoveries] == list(PROCESSES)
    assert outcome.lost == [], f"accepted requests that never ended done: {outcome.lost}"
    # Each request not accepted (a 503, a cut) was sent again under its Idempotency-Key until it
    # was: across the kills of Redis and the web, none ran twice.
    assert outcome.run_twice == [], outcome.run_twice
    # A client that sends no key and does not send again: what was answered 503 did not run.
    # (Whether it met a 503 at all depends on where each outage fell; a frozen Redis makes sure of
    # it in tests/gpuportal/test_stalls.py.)
    assert outcome.ran_after_503 == [], outcome.ran_after_503
    assert {r.process: r.seen.server_errors for r in outcome.recoveries} == {name: [] for name in PROCESSES}
    assert all(r.first_answer_s is not None for r in outcome.recoveries)
    # While a server was down, the API said so with a 503 (never a 500); after it, 200s again.
    by_process = {r.process: r.seen for r in outcome.recoveries}
    assert by_process["postgresql"].unavailable > 0 and by_process["redis"].unavailable > 0
    assert outcome.restarted >= set(PROCESSES), "every restart is in the trail (stack.restarted Events)"
    for name in PROCESSES:
        assert any(line.startswith(f"{name} was killed by SIGKILL; starting it again") for line in outcome.said), said
    assert outcome.pids_before and outcome.pids_after == outcome.pids_before, replaced(outcome.said, tmp_path / "var")


def replaced(said: list[str], data_dir: Path) -> str:
    """Why the replica was not the same at the end: what up said of replicas and adoption, the
    last lines of each replica's own log (where it says whether an agent adopted it in time) and
    of the agent's."""
    lines = [line for line in said if "replica" in line.lower() or "adopt" in line.lower()]
    for log in sorted(data_dir.glob("replicas/*/replica-*.log")):
        lines += [f"== {log.name}", *log.read_text(errors="replace").splitlines()[-15:]]
    # The agent's own log: when it started again, and whether and when it adopted the replica.
    for log in sorted(data_dir.glob("logs/agent*.log")):
        lines += [f"== {log.name}", *log.read_text(errors="replace").splitlines()[-40:]]
    return "the replica did not live through it all:\n" + "\n".join(lines)
