"""Readers of one stream: how late each piece of a streamed answer reaches its reader, with one
reader and with two readers of the same stream (a client that follows a response again while its
first stream still reads it, two clients of one background response). The readers read as the
web reads (`RequestQueue.reading` and `read_stream`, openai_compat._follow's loop), while a writer
writes a piece every few milliseconds as a replica's steps do, each piece ringing the stream's bell.

    python -m bench.stream_readers [--pieces 200] [--every-ms 20] [--no-record]

Uses REDIS_URL when set, else an embedded server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from bench.portal import percentile, start_redis_if_needed
from bench.report import record, table

# As the web reads a stream (openai_compat.STREAM_SLICE_S).
READ_SLICE_S = 1.0


def follow(queue, request_id: str, arrived: dict[int, float]) -> None:
    """Read the stream to its end as the web does, noting when each piece arrived."""
    sent = 0
    with queue.reading(request_id):
        while True:
            chunks, ended = queue.read_stream(request_id, sent, READ_SLICE_S)
            now = time.perf_counter()
            for chunk in chunks:
                arrived[int(chunk)] = now
            sent += len(chunks)
            if ended:
                return


def run(url: str, readers: int, pieces: int, every_s: float) -> list[float]:
    """Each reader's delay for each piece, in ms: from its write to its arrival."""
    import redis

    from gpuportal.wire.requestqueue import RequestQueue

    queue = RequestQueue(redis.Redis.from_url(url))
    request_id = queue.submit("bench-stream", kind="generate", input="x", params={"stream": True}, owner="1").id
    queue.take("bench-stream", "bench-replica", timeout=5)
    arrivals: list[dict[int, float]] = [{} for _ in range(readers)]
    threads = [
        threading.Thread(target=follow, args=(RequestQueue(redis.Redis.from_url(url)), request_id, arrived))
        for arrived in arrivals
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # every reader waiting on the stream before its first piece
    written: dict[int, float] = {}
    for i in range(pieces):
        written[i] = time.perf_counter()
        queue.chunk(request_id, str(i), "bench-replica")
        time.sleep(every_s)
    queue.finish(request_id, "bench-replica", {"text": ""})
    for thread in threads:
        thread.join(30)
    return [(arrived[i] - written[i]) * 1000 for arrived in arrivals for i in range(pieces)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=200)
    parser.add_argument("--every-ms", type=float, default=20.0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-readers-"))
    server = start_redis_if_needed(tmp)
    try:
        url = os.environ["REDIS_URL"]
        delays = {readers: run(url, readers, args.pieces, args.every_ms / 1000) for readers in (1, 2)}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        [
            readers,
            args.pieces,
            f"{percentile(d, 0.5):.1f}",
            f"{percentile(d, 0.99):.1f}",
            f"{max(d):.1f}",
            f"{percentile(d, 0.99) / percentile(delays[1], 0.99):.1f}",
        ]
        for readers, d in delays.items()
    ]
    shown = table(["readers", "pieces each", "p50 ms", "p99 ms", "max ms", "p99 ÷ one reader's"], rows)
    print(shown)
    if not args.no_record:
        record(
            "stream_readers",
            "Readers of one stream: one, and two of the same stream",
            f"`python -m bench.stream_readers --pieces {args.pieces} --every-ms {args.every_ms:g}`\n\n{shown}\n\n"
            "The delay from a piece's write (as a replica writes it, ringing the stream's bell) to its arrival at "
            "each reader, which reads as the web does (`RequestQueue.reading`, `read_stream`). A ring wakes one "
            "reader; with two, each reads again every `SHARED_READ_WAIT_S` rather than waiting out a slice for "
            "a ring the other took.",
        )


if __name__ == "__main__":
    main()
