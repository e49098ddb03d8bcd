"""Progress while the weights load (inference.load_progress): between 25 and 85 the bar follows
the share of the weights the process holds, read from another thread, rather than sitting at 25
until the load is over and jumping to 100."""

from __future__ import annotations

import itertools
import threading

from hypothesis import given
from hypothesis import strategies as st

from inference.load_progress import STEP, LoadGauge, percent

MiB = 1024**2


def test_the_bar_follows_the_share_of_the_weights_held_and_stops_a_point_short_of_the_top():
    assert percent(25, 85, 0, 100 * MiB) == 25
    assert percent(25, 85, 50 * MiB, 100 * MiB) == 55
    assert percent(25, 85, 100 * MiB, 100 * MiB) == 84, "only the load's end says it is done"
    assert percent(25, 85, 300 * MiB, 100 * MiB) == 84, "more held than the files said (buffers, imports)"
    assert percent(25, 85, 10, 0) == 25


@given(held=st.lists(st.integers(min_value=0, max_value=10**10), min_size=2), expected=st.integers(1, 10**10))
def test_the_bar_never_leaves_its_range_and_never_goes_back_as_more_is_held(held, expected):
    said = [percent(25, 85, h, expected) for h in sorted(held)]
    assert all(25 <= p <= 84 for p in said) and said == sorted(said)


def test_a_load_says_where_it_is_as_it_goes_from_a_thread_of_its_own():
    held = iter(range(0, 10**9, 10 * MiB))  # the first read is the start: 10 MiB more each read after
    said: list[tuple[int, int]] = []
    reached = threading.Event()

    def say(at: int, bytes_held: int) -> None:
        said.append((at, bytes_held))
        if at >= 80:
            reached.set()

    with LoadGauge(lambda: next(held), 100 * MiB, say, low=25, high=85, every_s=0.001):
        assert reached.wait(10), said

    percents = [at for at, _ in said]
    assert percents == sorted(percents) and all(b - a >= STEP for a, b in itertools.pairwise(percents))
    assert percents[-1] == 84 and percents[0] > 25
    assert said[0][1] > 0 and said[-1][1] >= 100 * MiB


def test_without_the_weights_size_nothing_is_measured_or_said():
    reads: list[int] = []

    with LoadGauge(lambda: reads.append(1) or 0, None, lambda *_: reads.append(2), low=25, high=85, every_s=0.001):
        pass

    assert reads == []


def test_the_size_a_load_measures_against_is_the_weights_as_read_from_the_files(tiny_model_dir):
    from inference.host import ReplicaHost
    from inference.loaders import load_model, tensor_bytes

    host = ReplicaHost.__new__(ReplicaHost)
    host.source, host.loader, host.dtype = str(tiny_model_dir), "transformers", "float32"
    expected = host._expected_weight_bytes()

    weights = tensor_bytes(load_model(str(tiny_model_dir), "transformers", "float32"))
    assert expected is not None and abs(expected - weights) <= 0.05 * weights
    host.loader = "torch-module"
    assert host._expected_weight_bytes() is None
