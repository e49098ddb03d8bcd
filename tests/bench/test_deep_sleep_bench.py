"""bench.deep_sleep runs the replica host's own path (load, wake, deepen, deep wake) and reports it:
checked on a small model so CI keeps it working; its figures are BENCHMARKS.md's, never asserted."""

from __future__ import annotations

from bench import deep_sleep


def test_the_benchmark_measures_each_step_and_a_deep_sleeper_holds_no_gpu_memory(tmp_path):
    figures = deep_sleep.measure(8, "cpu", 1, tmp_path)

    assert figures.weights > 0 and 0.9 * figures.weights <= figures.copy_bytes <= 1.2 * figures.weights + 2**20
    assert min(figures.load_s, figures.wake_s, figures.deepen_s, figures.deep_wake_s) > 0
    assert figures.gpu_asleep > 0, "asleep, its process keeps its context on the GPU"
    assert not list((tmp_path / "copies").glob("*.pt")), "each deep wake deleted the copy it read"
    headers, rows = deep_sleep.rows([figures])
    assert len(rows) == 1 and len(rows[0]) == len(headers)
    assert dict(zip(headers, rows[0], strict=True))["GPU deep"] == "0 MiB"
