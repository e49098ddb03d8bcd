"""bench.prefix_cache measures what the replica runs, with its prefix cache and without, and keeps
working on the CPU: the same answers both ways (the benchmark checks them itself), fewer prompt
tokens computed with the cache, and what it held said."""

from __future__ import annotations

from bench import prefix_cache


def test_the_benchmark_computes_fewer_prompt_tokens_with_the_cache_and_answers_the_same():
    small = ["--size-mb", "2", "--system", "64", "--question", "8", "--max-tokens", "4"]
    rows = prefix_cache.main(["--no-record", *small, "--requests", "3", "--turns", "3", "--trials", "1"])

    shared, burst, talk, unshared = rows
    # requests, then: TTFT without, with, their ratio, tokens computed without, with, share held.
    assert shared[1] == burst[1] == talk[1] == unshared[1] == 3
    assert unshared[5] == unshared[6] and unshared[7] == "0%", "prompts of their own: nothing to hold"
    for row in (shared, burst, talk):
        computed_without, computed_with = row[5], row[6]
        assert computed_with < computed_without and row[7] != "0%"
    # The system prompt's 64 tokens (4 blocks) computed once, not three times.
    assert shared[5] - shared[6] == burst[5] - burst[6] == 2 * 64
