"""bench.formats runs on the CPU, so that CI keeps it working (a small run; BENCHMARKS.md has the
figures): its own checks hold every timed held answer inside its JSON string, and the first
format's answer to an object."""

from __future__ import annotations

from bench import formats


def test_a_small_run_prints_both_tables_and_the_held_answers_are_json(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's own setting stays

    assert formats.main(["--held", "1,2", "--steps", "3", "--rounds", "1", "--no-record"]) == 0

    out = capsys.readouterr().out
    assert "A step, a vocabulary of 32,000 tokens" in out and "The first format on a replica" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 3, out  # two counts of held answers, one arrival
