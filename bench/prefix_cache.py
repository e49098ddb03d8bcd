"""Prefix caching: time to first token of prompts that begin alike, with the cache and without.

Two workloads a portal's users send all day, each through the replica's own continuous batcher
(inference.batching) on its KV pool, once with the prefix cache and once without, alternating:

- a shared system prompt: requests one after another (a chat service's users), each the same
  long system prompt and a question of its own; then the same requests all at once (a burst, a
  request's n choices), where the first computes the system prompt and the others share it;
- a conversation: each turn's prompt is the one before, the answer it got and a new message
  (what every chat client and agent sends), so each turn begins with all of the last;
- nothing shared: prompts of their own, one after another, for what the cache costs where it
  finds nothing.

Reported: the median time to first token (from a request's submission to its first token, both in
the batcher: its prefill), the prompt tokens computed, and how many the cache held. The answers
with the cache are checked token for token against those without.

    python -m bench.prefix_cache [--device cpu|cuda] [--size-mb 20] [--system 1024] [--no-record]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import record, table

BLOCK_TOKENS = 16


@dataclass
class Run:
    ttft_s: list[float]
    computed: int  # prompt tokens whose K/V the prefill computed
    reused: int  # prompt tokens whose K/V came from the cache
    answers: list[list[int]]

    def add(self, ttft_s: float, seq: Any) -> None:
        """One request's figures (`seq`, an ended inference.batching.Sequence)."""
        self.ttft_s.append(ttft_s)
        self.computed += len(seq.prompt) - seq.reused
        self.reused += seq.reused
        self.answers.append(seq.generated)


class _NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def load(size_mb: float, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from inference.management.commands.make_tiny_model import write_tiny_model

    path = write_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench-prefix-")), size_mb=size_mb, seed=0, log=lambda _: None
    ).path
    return AutoModelForCausalLM.from_pretrained(path).eval().to(device)


def batcher(model: Any, blocks: int, device: str, *, prefix_cache: bool) -> Any:
    from inference.batching import Batcher
    from inference.kvpool import BlockPool
    from inference.paged import PagedModel, model_shape

    dtype = next(model.parameters()).dtype
    pool = BlockPool.for_shape(model_shape(model, 0), blocks, dtype=dtype, device=device, block_tokens=BLOCK_TOKENS)
    # No end of text: every answer is its max_tokens long, alike with the cache and without.
    return Batcher(PagedModel(model, pool), _NoText(), set(), prefix_cache=prefix_cache)


def ask(b: Any, prompt: list[int], max_tokens: int, device: str) -> tuple[float, Any]:
    """One request through the batcher to its end; (its time to first token, the sequence)."""
    from inference.batching import Sequence, run_until_idle

    seq = Sequence(prompt, max_tokens)
    _sync(device)
    submitted = time.time()
    b.submit(seq)
    while seq.first_token_at is None:
        b.step()
    _sync(device)
    first = time.time() - submitted
    run_until_idle(b)
    assert seq.error is None, seq.error
    return first, seq


def system_prompt(model: Any, device: str, prompts: list[list[int]], max_tokens: int, *, cached: bool) -> Run:
    b = batcher(model, _blocks(prompts, max_tokens), device, prefix_cache=cached)
    run = Run([], 0, 0, [])
    for prompt in prompts:
        run.add(*ask(b, prompt, max_tokens, device))
    return run


def burst(model: Any, device: str, prompts: list[list[int]], max_tokens: int, *, cached: bool) -> Run:
    """The requests all queued before one step (a burst of users, a request's n choices)."""
    from inference.batching import Sequence, run_until_idle

    b = batcher(model, sum(_blocks([p], max_tokens) for p in prompts), device, prefix_cache=cached)
    seqs = [Sequence(prompt, max_tokens) for prompt in prompts]
    _sync(device)
    submitted = time.time()
    for seq in seqs:
        b.submit(seq)
    run_until_idle(b)
    run = Run([], 0, 0, [])
    for seq in seqs:
        assert seq.error is None and seq.first_token_at is not None, seq.error
        run.add(seq.first_token_at - submitted, seq)
    return run


def conversation(
    model: Any, device: str, opening: list[int], turns: list[list[int]], max_tokens: int, *, cached: bool
) -> Run:
    longest = len(opening) + sum(len(t) + max_tokens for t in turns) + max_tokens
    b = batcher(model, 2 * _blocks([list(range(longest))], max_tokens), device, prefix_cache=cached)
    run = Run([], 0, 0, [])
    prompt = list(opening)
    for message in turns:
        first, seq = ask(b, prompt, max_tokens, device)
        run.add(first, seq)
        prompt = [*prompt, *seq.generated, *message]
    return run


def _blocks(prompts: list[list[int]], max_tokens: int) -> int:
    return max(-(-(len(p) + max_tokens) // BLOCK_TOKENS) for p in prompts) * 4


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _row(name: str, requests: int, without: Run, with_cache: Run) -> list[object]:
    off, on = statistics.median(without.ttft_s), statistics.median(with_cache.ttft_s)
    total = with_cache.computed + with_cache.reused
    return [
        name,
        requests,
        f"{off * 1000:.1f}",
        f"{on * 1000:.1f}",
        f"{off / on:.1f}×",
        without.computed,
        with_cache.computed,
        f"{with_cache.reused / total:.0%}",
    ]


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size-mb", type=float, default=20.0)
    parser.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--question", type=int, default=32, help="tokens of each request's own question")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6, help="turns of the conversation")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--trials", type=int, default=3, help="alternating runs of each, medians compared")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.manual_seed(0)
    model = load(args.size_mb, args.device)
    rng = random.Random(0)
    words = lambda n: [rng.randrange(4, 500) for _ in range(n)]  # noqa: E731
    system = words(args.system)
    prompts = [[*system, *words(args.question)] for _ in range(args.requests)]
    opening, turns = words(args.system // 2), [words(args.question) for _ in range(args.turns)]
    unshared = [words(args.system + args.question) for _ in range(args.requests)]

    workloads = {
        f"shared system prompt ({args.system} + {args.question} tokens)": lambda cached: system_prompt(
            model, args.device, prompts, args.max_tokens, cached=cached
        ),
        f"a burst: {args.requests} at once, one system prompt": lambda cached: burst(
            model, args.device, prompts, args.max_tokens, cached=cached
        ),
        f"conversation ({args.turns} turns from {args.system // 2} tokens)": lambda cached: conversation(
            model, args.device, opening, turns, args.max_tokens, cached=cached
        ),
        # What the cache costs where nothing is shared: its digests, lookups and keeping, for nothing.
        f"nothing shared ({args.system + args.question} tokens each)": lambda cached: system_prompt(
            model, args.device, unshared, args.max_tokens, cached=cached
        ),
    }
    rows = []
    for name, run in workloads.items():
        run(True)  # warm-up
        # Alternating trials, each run's times its own: a shared machine's speed drifts.
        offs, ons = [], []
        for _ in range(args.trials):
            offs.append(run(False))
            ons.append(run(True))
        for off, on in zip(offs, ons, strict=True):
            assert on.answers == off.answers, f"{name}: the cache changed an answer"
        without = Run([statistics.median(r.ttft_s) for r in offs], offs[0].computed, offs[0].reused, [])
        with_cache = Run([statistics.median(r.ttft_s) for r in ons], ons[0].computed, ons[0].reused, [])
        rows.append(_row(name, len(offs[0].ttft_s), without, with_cache))
    result = table(
        [
            "workload",
            "requests",
            "TTFT p50 without (ms)",
            "TTFT p50 with (ms)",
            "without / with",
            "prompt tokens computed without",
            "with",
            "held by the cache",
        ],
        rows,
    )
    print(result)
    if not args.no_record:
        body = (
            f"Tiny Llama ({args.size_mb:g} MiB float32) on {args.device}, through the replica's continuous batcher "
            f"(blocks of {BLOCK_TOKENS} tokens), one request at a time but the burst's, each to its {args.max_tokens} "
            "tokens. "
            "Time to first token: a request's prefill, from its submission to its first token; the median "
            f"of each run's, then of {args.trials} alternating runs of each. Every answer with the cache equals "
            "its answer without, token for token. The first request of each workload finds nothing kept.\n\n"
            f"{result}"
        )
        record(f"prefix-cache-{args.device}", f"Prefix caching ({args.device})", body)
    return rows


if __name__ == "__main__":
    main()
