"""bench.stream_readers keeps working: a piece's delay to each reader of one stream, timed on the
session's Redis through the web's reading of the queue."""

from __future__ import annotations

from django.conf import settings

from bench.stream_readers import run


def test_the_benchmark_times_every_piece_for_each_reader_of_the_stream():
    one, two = run(settings.REDIS_URL, 1, 5, 0.005), run(settings.REDIS_URL, 2, 5, 0.005)

    assert len(one) == 5 and len(two) == 10, "a delay for each piece, for each reader"
    assert all(delay >= 0 for delay in [*one, *two])
