"""KV block pool: batched generation with the pool against transformers' default cache,
and how many sequences one cap serves at once against reserving max-length memory per request.

Throughput: the same requests (a spread of prompt lengths and max_tokens, no EOS so every request
runs to its max_tokens) generated greedily (a) by the continuous batcher on the pool, (b) by
model.generate on the whole batch at once, left-padded, with its default dynamic cache, running to
the longest max_tokens. Useful tokens (what the requests asked for) per second of wall time.

Concurrency: one cap, the pool sized from it with gpuportal.wire.memory's formula; requests with a
realistic spread of lengths go through the batcher, which admits each on prompt + max_tokens;
the peak of sequences running at once against cap-blocks // blocks-of-the-model's-context (what
reserving max-length memory per request admits).

    python -m bench.kvpool [--device cpu|cuda] [--requests 16] [--no-record]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import record, table


def spread(rng: random.Random, count: int, *, prompt_max: int, new_choices: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) pairs: prompts log-uniform up to prompt_max, max_tokens from a menu."""
    out = []
    for _ in range(count):
        prompt = round(2 ** rng.uniform(3, prompt_max.bit_length() - 1))
        out.append((max(1, prompt), rng.choice(new_choices)))
    return out


def load(size_mb: float, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from inference.management.commands.make_tiny_model import write_tiny_model

    path = write_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench-kv-")), size_mb=size_mb, seed=0, log=lambda _: None
    ).path
    model = AutoModelForCausalLM.from_pretrained(path).eval().to(device)
    model.generation_config.eos_token_id = None  # every request runs to its max_tokens
    return model


class _NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def pool_throughput(model: Any, requests: list[list[int]], new: list[int], blocks: int, device: str) -> float:
    import torch

    from inference.batching import Batcher, Sequence, run_until_idle
    from inference.kvpool import BlockPool
    from inference.paged import PagedModel, model_shape

    pool = BlockPool.for_shape(model_shape(model, 0), blocks, dtype=torch.float32, device=device, block_tokens=16)
    batcher = Batcher(PagedModel(model, pool), _NoText(), set())
    for prompt, n in zip(requests, new, strict=True):
        batcher.submit(Sequence(prompt, n))
    _sync(device)
    began = time.perf_counter()
    ended = run_until_idle(batcher)
    _sync(device)
    took = time.perf_counter() - began
    assert sum(len(s.generated) for s in ended) == sum(new)
    return sum(new) / took


def default_cache_throughput(model: Any, requests: list[list[int]], new: list[int], device: str) -> float:
    import torch

    width = max(len(p) for p in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(requests):  # left padding, as generate() wants for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    _sync(device)
    began = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(new), do_sample=False, pad_token_id=0
        )
    _sync(device)
    return sum(new) / (time.perf_counter() - began)


def concurrency(model: Any, cap_bytes: int, lengths: list[tuple[int, int]], device: str) -> tuple[int, int, int]:
    """(pool blocks, peak sequences running at once, sequences that max-length reservations admit)."""
    from gpuportal.wire.memory import kv_blocks
    from inference.batching import Batcher, Sequence
    from inference.loaders import tensor_bytes
    from inference.paged import engine_for

    engine = engine_for(model, weights_bytes=tensor_bytes(model), cap_bytes=cap_bytes, max_tokens=2048, context_bytes=0)
    batcher = Batcher(engine, _NoText(), set())
    rng = random.Random(1)
    for prompt, n in lengths:
        batcher.submit(Sequence([rng.randrange(4, 500) for _ in range(prompt)], n))
    peak = 0
    # Only the admissions matter here: step until the first sequence ends (the batch at its fullest).
    while not batcher.idle and not batcher.step():
        peak = max(peak, len(batcher.running))
    context = engine.context or 2048
    naive = engine.pool.blocks_total // kv_blocks(context, engine.pool.block_tokens)
    engine.pool.release()
    return engine.pool.blocks_total, peak, naive


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--size-mb", type=float, default=5.0)
    parser.add_argument("--trials", type=int, default=5, help="alternating runs of each, medians compared")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    import torch

    from gpuportal.wire.memory import activation_reserve_bytes, kv_block_bytes, kv_blocks
    from inference.loaders import tensor_bytes
    from inference.paged import model_shape

    torch.manual_seed(0)
    model = load(args.size_mb, args.device)
    rng = random.Random(0)
    rows = []
    for name, lengths in (
        ("uniform (prompt 64, max_tokens 64)", [(64, 64)] * args.requests),
        (
            "spread (prompt 8–256, max_tokens 16–128)",
            spread(rng, args.requests, prompt_max=256, new_choices=[16, 32, 64, 128]),
        ),
    ):
        prompts = [[rng.randrange(4, 500) for _ in range(p)] for p, _ in lengths]
        new = [n for _, n in lengths]
        blocks = sum(kv_blocks(p + n) for p, n in lengths)
        pool_throughput(model, prompts[:2], new[:2], blocks, args.device)  # warm-up
        default_cache_throughput(model, prompts[:2], new[:2], args.device)
        # Alternating trials, medians of each: a shared machine's speed drifts within seconds,
        # and a single run of each would measure the drift as much as the caches.
        paged_runs, default_runs = [], []
        for _ in range(args.trials):
            paged_runs.append(pool_throughput(model, prompts, new, blocks, args.device))
            default_runs.append(default_cache_throughput(model, prompts, new, args.device))
        paged, default = statistics.median(paged_runs), statistics.median(default_runs)
        rows.append([name, args.requests, f"{paged:.0f}", f"{default:.0f}", f"{paged / default:.2f}×"])
    throughput = table(["requests", "count", "pool tok/s", "default cache tok/s", "pool / default"], rows)

    # One cap: the weights, the activation budget and KV room for 8 max-length (2048-token) requests.
    shape = model_shape(model, tensor_bytes(model))
    cap = shape.weight_bytes + activation_reserve_bytes(shape, 2048) + 8 * kv_blocks(2048) * kv_block_bytes(shape)
    realistic = spread(random.Random(2), 400, prompt_max=1024, new_choices=[64, 128, 256, 512])
    total, peak, naive = concurrency(model, cap, realistic, args.device)
    mean = sum(p + n for p, n in realistic) / len(realistic)
    conc = table(
        ["cap", "pool blocks", "mean prompt + max_tokens", "max-length reservations", "pool (peak running)", "ratio"],
        [[f"{cap / 1024**2:.0f} MiB", total, f"{mean:.0f}", naive, peak, f"{peak / naive:.1f}×"]],
    )
    print(throughput, "\n\n" + conc)
    if not args.no_record:
        body = (
            f"Tiny Llama ({args.size_mb:g} MiB float32, {shape.num_layers} layers) on {args.device}; greedy, no EOS. "
            "Throughput: useful tokens/s, the continuous batcher on the pool against one left-padded "
            f"model.generate() batch with transformers' default cache; medians of {args.trials} alternating "
            "trials of each.\n\n"
            f"{throughput}\n\n"
            "Concurrency within one cap (weights + activation budget + KV room for 8 requests of the model's "
            "2048-token context): the peak of sequences the batcher runs at once, each admitted on "
            "prompt + max_tokens (prompts log-uniform 8–1024 tokens, max_tokens from 64/128/256/512), against "
            "reserving max-length KV per request.\n\n"
            f"{conc}"
        )
        record(f"kvpool-{args.device}", f"KV block pool ({args.device})", body)


if __name__ == "__main__":
    main()
