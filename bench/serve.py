"""Serving throughput: the portal's paged continuous batching, through the whole stack and called
directly, beside transformers' `generate` batched statically, on the same requests in one run.

For each model size, a random bf16 Llama written by `make_tiny_model` (on a GPU; float32 on the
CPU) serves one seeded workload of mixed prompt and output lengths at each concurrency, three ways:

- `engine`: the replica's own engine in this process: a `PagedModel` over a KV block pool of the
  deployment's size, stepped by a `Batcher` (inference.batching), as the replica's `Server` does.
  Each request is a streamed one (its chunks decoded as they come), as the stack's are.
- `stack`: the same requests as OpenAI clients send them: `POST /v1/completions` with
  `stream: true`, each client on its own kept-alive connection, through the web server, the Redis
  queue and a replica placed by the control plane on the node agent's GPU (the deployment's
  `memory.max_tokens` is the engine's pool).
- `generate`: the requests in fixed batches of the concurrency, each batch one `generate()` call
  (left-padded, greedy, until every member ended): a batch's requests wait for its longest.
- `json` (named only, not by default): the engine with every answer held to a JSON object as
  `response_format: {"type": "json_object"}` holds it (the replica's own `format_allowed`, the
  parser's view of the tokenizer built before the timing): what a format costs a step. Its
  answers are other tokens than the free ones (JSON), so its tokens/s is the step's cost, not a
  like-for-like throughput.

Closed loop: `concurrency` clients, each sending its next request when its last one ended.
Greedy decoding and the model's own end-of-sequence token everywhere, so the three produce the
same tokens; "tokens/s" counts the completion tokens each request got (up to its end of sequence
or its max_tokens), over the time from the first request sent to the last one answered. TTFT is
from a request's sending to its first text; "per token" is a request's time after its first text
over its further tokens. The bound is what memory bandwidth allows a decode step (every weight
read once per step, the KV cache not counted): concurrency × copy rate ÷ weight bytes, the copy
rate measured on the same device in the same run; past a few dozen requests a step is bound by
compute, not bytes, so the fraction falls there by design.

    python -m bench.serve [--device cpu|cuda] [--sizes 1024,8192] [--concurrency 1,8,32,128]
                          [--paths engine,stack,generate,json] [--max-prompt 256] [--max-output 128]
                          [--requests N] [--no-record]

Sizes are MiB of weights (1 and 8 GiB of bf16 on CUDA by default; 16 MiB of float32 on the CPU,
each path on one intra-op thread, as a replica on a virtual GPU runs). `--requests`: per
concurrency (default twice the concurrency, at least 8, at most the concurrency and 32). Uses
DATABASE_URL / REDIS_URL when set, else embedded servers; the stack's processes log into the
working directory it prints first.
"""

from __future__ import annotations

import argparse
import collections
import gc
import http.client
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import record, table
from gpuportal.wire.sampling import ANY_JSON_OBJECT, JSON_SCHEMA

MiB = 1024**2
MS = 1000.0
DEFAULT_SIZES = {"cuda": "1024,8192", "cpu": "16"}
DEFAULT_CONCURRENCY = {"cuda": "1,8,32,128", "cpu": "1,4,8"}
DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
PATHS = ("engine", "json", "stack", "generate")
# What runs unless --paths names others: `json` is asked for by name (a GPU run's minutes are few).
DEFAULT_PATHS = ("engine", "stack", "generate")
# The format the `json` path holds every answer to: response_format's json_object, as the queue keeps it.
JSON_OBJECT = {JSON_SCHEMA: dict(ANY_JSON_OBJECT)}
# A stack's request may wait behind a whole closed loop's worth of others on a slow CPU.
STACK_TIMEOUT_S = 300.0  # GPUPORTAL_INFER_MAX_TIMEOUT_S, the most a call may wait
SERVING_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Job:
    """One request: its text, that text's token ids (the replica's own tokenisation), its limit."""

    prompt: str
    ids: tuple[int, ...]
    max_tokens: int


@dataclass
class Outcome:
    """When one request was sent, got its first text and ended, and how many tokens it got."""

    sent: float
    first: float | None = None
    ended: float | None = None
    tokens: int = 0
    failed: str | None = None
    text: str = ""  # the engine's answer as streamed (the others' are not kept)


@dataclass
class Cell:
    """One path at one concurrency: every request's outcome."""

    path: str
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    # The engine's own steps (one prefill and one decode forward each at most), and their time.
    steps: int = 0
    step_s: float = 0.0

    @property
    def failures(self) -> list[str]:
        return [o.failed for o in self.outcomes if o.failed is not None]

    def tokens_per_s(self) -> float:
        done = [o for o in self.outcomes if o.failed is None and o.ended is not None]
        if not done:
            return 0.0
        span = max(o.ended for o in done if o.ended is not None) - min(o.sent for o in self.outcomes)
        return sum(o.tokens for o in done) / span if span > 0 else 0.0

    def ttft_ms(self) -> list[float]:
        return [MS * (o.first - o.sent) for o in self.outcomes if o.first is not None and o.failed is None]

    def per_token_ms(self) -> list[float]:
        return [
            MS * (o.ended - o.first) / (o.tokens - 1)
            for o in self.outcomes
            if o.failed is None and o.first is not None and o.ended is not None and o.tokens > 1
        ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the workload ---------------------------------------------------------------------------------


def workload(tokenizer: Any, count: int, *, max_prompt: int, max_output: int, seed: int) -> list[Job]:
    """`count` requests, prompts of 8..max_prompt tokens of plain words and outputs of
    8..max_output tokens, drawn from `seed`: the same list for every path."""
    from inference.management.commands.make_tiny_model import _CORPUS

    words = _CORPUS.split()
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        want = rng.randint(min(8, max_prompt), max_prompt)
        text = rng.choice(words)  # one word at least, however long: a prompt is never empty
        ids = tokenizer(text).input_ids
        while True:
            longer = f"{text} {rng.choice(words)}"
            longer_ids = tokenizer(longer).input_ids
            if len(longer_ids) > want:
                break
            text, ids = longer, longer_ids
        jobs.append(Job(text, tuple(int(i) for i in ids), rng.randint(min(8, max_output), max_output)))
    return jobs


def requests_for(concurrency: int) -> int:
    """Requests per concurrency by default: twice the clients (each sends a second when its first
    ends), at least 8, and past 32 clients the clients and 32 more, which keeps 128 clients' run short."""
    return max(8, min(2 * concurrency, concurrency + 32))


def pool_tokens(concurrency: int, max_prompt: int, max_output: int) -> int:
    """A KV pool for `concurrency` requests of the longest kind at once: the deployment's
    `memory.max_tokens`, and the engine's pool."""
    return concurrency * (max_prompt + max_output)


# -- engine: the replica's batcher, called directly --------------------------------------------------


def run_engine(
    engine: Any, model: Any, tokenizer: Any, jobs: list[Job], concurrency: int, *, held: bool = False
) -> Cell:
    """The closed loop over a Batcher on `engine` (a PagedModel whose pool is empty); `held`:
    every answer held to a JSON object, as the replica holds one (the `json` path)."""
    from inference.batching import Batcher, Sequence, eos_ids
    from inference.serving import Executor

    batcher = Batcher(engine, tokenizer, eos_ids(model))
    executor = Executor(model, tokenizer) if held else None
    cell = Cell("json" if held else "engine", concurrency)
    pending = collections.deque(jobs)
    owners: dict[int, Outcome] = {}

    def send() -> None:
        job = pending.popleft()
        outcome = Outcome(sent=time.perf_counter())

        def streamed(text: str, outcome: Outcome = outcome) -> None:
            if outcome.first is None:
                outcome.first = time.perf_counter()
            outcome.text += text

        allowed = executor.format_allowed(JSON_OBJECT) if executor is not None else None
        seq = Sequence(list(job.ids), job.max_tokens, on_chunk=streamed, allowed=allowed)
        owners[id(seq)] = outcome
        cell.outcomes.append(outcome)
        batcher.submit(seq)

    for _ in range(min(concurrency, len(pending))):
        send()
    while not batcher.idle:
        batcher.wait_for_formats()  # the first held answer's parser view, built on a thread (untimed warm-up)
        began = time.perf_counter()
        ended = batcher.step()
        cell.steps += 1
        cell.step_s += time.perf_counter() - began
        for seq in ended:
            outcome = owners.pop(id(seq))
            outcome.ended = time.perf_counter()
            outcome.tokens = len(seq.generated)
            if seq.error is not None:
                outcome.failed = f"{type(seq.error).__name__}: {seq.error}"
            if pending:
                send()
    return cell


def paged_engine(model: Any, tokens: int) -> Any:
    """A PagedModel over a pool of `tokens` (whole blocks), in the model's dtype and on its device."""
    from gpuportal.wire.memory import DEFAULT_BLOCK_TOKENS, kv_blocks
    from inference.kvpool import BlockPool
    from inference.loaders import weight_allocation_bytes
    from inference.paged import PagedModel, model_shape

    param = next(model.parameters())
    shape = model_shape(model, weight_allocation_bytes(model))
    blocks = kv_blocks(tokens, DEFAULT_BLOCK_TOKENS)
    pool = BlockPool.for_shape(shape, blocks, dtype=param.dtype, device=param.device, block_tokens=DEFAULT_BLOCK_TOKENS)
    return PagedModel(model, pool)


# -- generate: transformers, batched statically ------------------------------------------------------


def run_generate(model: Any, tokenizer: Any, jobs: list[Job], concurrency: int) -> Cell:
    """Batches of `concurrency` requests in order, each one generate() call to its longest limit;
    each request counts its tokens up to its own end of sequence or max_tokens."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from inference.batching import eos_ids

    eos = eos_ids(model)
    device = next(model.parameters()).device
    cell = Cell("generate", concurrency)
    tokenizer.padding_side = "left"

    class Clock(StoppingCriteria):
        """Stops nothing: notes when each step's token is there (the step synchronised first)."""

        def __init__(self) -> None:
            self.steps: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.steps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    for start in range(0, len(jobs), concurrency):
        batch = jobs[start : start + concurrency]
        sent = time.perf_counter()
        clock = Clock()
        width = max(len(job.ids) for job in batch)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(job.ids)) + list(job.ids) for job in batch], device=device)
        mask = torch.tensor([[0] * (width - len(job.ids)) + [1] * len(job.ids) for job in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(job.max_tokens for job in batch),
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        new = out[:, width:].tolist()
        for job, row in zip(batch, new, strict=True):
            tokens = useful_tokens(row, eos, job.max_tokens)
            outcome = Outcome(sent=sent, tokens=tokens)
            if tokens:
                outcome.first = clock.steps[0]
                outcome.ended = clock.steps[tokens - 1]
            else:
                outcome.failed = "no token generated"
            cell.outcomes.append(outcome)
    return cell


def useful_tokens(row: list[int], eos: set[int], max_tokens: int) -> int:
    """The tokens of a generated row that its request wanted: up to its first end of sequence
    (counted, as the engine counts it) and no more than its max_tokens."""
    for index, token in enumerate(row[:max_tokens]):
        if token in eos:
            return index + 1
    return min(len(row), max_tokens)


# -- stack: HTTP → queue → replica -------------------------------------------------------------------


def stream_completion(conn: http.client.HTTPConnection, headers: dict[str, str], body: dict[str, Any]) -> Outcome:
    """One streamed /v1/completions call: when it was sent, its first text, its end and usage."""
    outcome = Outcome(sent=time.perf_counter())
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    if response.status != 200:
        outcome.failed = f"HTTP {response.status}: {response.read()[:300]!r}"
        return outcome
    while line := response.readline():
        if not line.startswith(b"data: "):
            continue  # a comment (what it waits for) or the blank line between events
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            outcome.failed = str(event["error"].get("message"))
            continue
        if event["choices"][0].get("text") and outcome.first is None:
            outcome.first = time.perf_counter()
        if event.get("usage"):
            outcome.tokens = int(event["usage"]["completion_tokens"])
    outcome.ended = time.perf_counter()
    response.read()
    return outcome


def run_stack(port: int, key: str, model_name: str, jobs: list[Job], concurrency: int) -> Cell:
    """`concurrency` client threads, each on its own connection, taking the next job when its
    last one ended."""
    cell = Cell("stack", concurrency)
    pending = collections.deque(jobs)
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=STACK_TIMEOUT_S)
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    job = pending.popleft()
                body = {
                    "model": model_name,
                    "prompt": job.prompt,
                    "max_tokens": job.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "timeout": STACK_TIMEOUT_S,
                }
                try:
                    outcome = stream_completion(conn, headers, body)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    outcome = Outcome(sent=time.perf_counter(), failed=f"{type(exc).__name__}: {exc}")
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=STACK_TIMEOUT_S)
                with lock:
                    cell.outcomes.append(outcome)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return cell


def deploy(name: str, source: Path, dtype: str, max_tokens: int) -> None:
    """One replica of `source`, never put to sleep, serving once this returns."""
    from bench.portal import wait
    from gpuportal.wire.states import ReplicaState as S
    from scheduling.models import Replica
    from scheduling.services import deployments
    from scheduling.services.deployments import DeploymentSpec

    deployments.create(DeploymentSpec(name=name, source=str(source), dtype=dtype, max_tokens=max_tokens, popular=True))
    wait(
        lambda: Replica.objects.filter(deployment__name=name, state=S.SERVING).exists(),
        SERVING_TIMEOUT_S,
        f"a serving replica of {name}",
    )


# -- the bound ---------------------------------------------------------------------------------------


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes per second a device-local copy moves (read and written): the memory's bandwidth."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch, and the copy kernel loaded
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    rounds = 5
    began = time.perf_counter()
    for _ in range(rounds):
        dst.copy_(src)
    sync()
    return 2 * nbytes * rounds / (time.perf_counter() - began)


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class ModelRun:
    label: str
    weights_bytes: int
    cells: list[Cell]


def in_process(
    paths: list[str], source: Path, dtype: str, device: str, jobs_by_level: dict[int, list[Job]], pool: int
) -> Iterator[Cell]:
    """The engine and generate paths, over one load of the model by the product's loader."""
    import torch

    from inference.loaders import TRANSFORMERS, load_model

    model = load_model(str(source), TRANSFORMERS, dtype, device=device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    try:
        engine = paged_engine(model, pool) if {"engine", "json"} & set(paths) else None
        warm = next(iter(jobs_by_level.values()))[:2]
        if engine is not None:
            run_engine(engine, model, tokenizer, warm, 2)  # kernels loaded, not timed
            if "engine" in paths:
                for level, jobs in jobs_by_level.items():
                    yield run_engine(engine, model, tokenizer, jobs, level)
            if "json" in paths:
                run_engine(engine, model, tokenizer, warm, 2, held=True)  # the parser's tokenizer view, not timed
                for level, jobs in jobs_by_level.items():
                    yield run_engine(engine, model, tokenizer, jobs, level, held=True)
            engine.pool.release()
        if "generate" in paths:
            run_generate(model, tokenizer, warm, 2)
            for level, jobs in jobs_by_level.items():
                yield run_generate(model, tokenizer, jobs, level)
    finally:
        # The engine holds the model too: both go before the cache is emptied, so the stack's
        # replica that follows on the same GPU has the memory back.
        del model
        engine = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def measure(args: argparse.Namespace, tmp: Path, log: Callable[[str], None]) -> tuple[list[ModelRun], float]:
    import torch

    from bench.portal import Portal, staff_key
    from inference.management.commands.make_tiny_model import write_tiny_model
    from scheduling.services import deployments

    levels = [int(c) for c in args.concurrency.split(",")]
    pool = pool_tokens(max(levels), args.max_prompt, args.max_output)
    log(f"working directory (models, the stack's logs): {tmp}")
    rate = copy_rate(args.device, 512 * MiB if args.device == "cuda" else 128 * MiB)
    log(f"device copy rate {rate / 1e9:.1f} GB/s; KV pool of {pool} tokens")
    portal = None
    if "stack" in args.paths:
        agents: dict[str, str | None] = {"serve": None} if args.device == "cuda" else {"serve": "1x32GiB"}
        portal = Portal(tmp, web_threads=max(levels) + 4, control=True, agents=agents)
    runs = []
    try:
        key = staff_key() if portal is not None else ""
        if portal is not None:
            portal.ready(key)
        for size in [float(s) for s in args.sizes.split(",")]:
            written = write_tiny_model(
                tmp / f"model-{size:g}", size_mb=size, seed=7, dtype=args.dtype, device=args.device, log=lambda _: None
            )
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(written.path)
            jobs_by_level = {
                level: workload(
                    tokenizer,
                    args.requests or requests_for(level),
                    max_prompt=args.max_prompt,
                    max_output=args.max_output,
                    seed=level,
                )
                for level in levels
            }
            label = f"{written.weights_bytes / MiB:,.0f} MiB {args.dtype}"
            run = ModelRun(label, written.weights_bytes, [])
            runs.append(run)
            for cell in in_process(args.paths, written.path, args.dtype, args.device, jobs_by_level, pool):
                log(f"{label} {cell_line(cell)}")
                run.cells.append(cell)
            if portal is not None:
                name = f"serve-{len(runs)}"
                deploy(name, written.path, args.dtype, pool)
                warm = next(iter(jobs_by_level.values()))[:2]
                run_stack(portal.port, key, name, warm, 2)
                for level, jobs in jobs_by_level.items():
                    cell = run_stack(portal.port, key, name, jobs, level)
                    log(f"{label} {cell_line(cell)}")
                    run.cells.append(cell)
                deployments.delete(name)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        if portal is not None:
            portal.stop()
    return runs, rate


def cell_line(cell: Cell) -> str:
    """One cell as it ends, for the log: a run cut short still says what it measured."""
    line = f"{cell.path} ×{cell.concurrency}: {cell.tokens_per_s():.0f} tokens/s"
    line += f", TTFT p50 {percentile(cell.ttft_ms(), 0.5):.0f} ms"
    line += f", per token p50 {percentile(cell.per_token_ms(), 0.5):.1f} ms"
    if cell.steps:
        line += f", {MS * cell.step_s / cell.steps:.1f} ms a step over {cell.steps} steps"
    return line + (f", {len(cell.failures)} failed" if cell.failures else "")


def report(runs: list[ModelRun], rate: float) -> tuple[str, list[str]]:
    headers = [
        "model", "path", "clients", "requests", "tokens/s", "× generate", "÷ engine",
        "TTFT p50 / p99 ms", "per token p50 / p99 ms", "ms a step", "bound tokens/s", "of bound",
    ]  # fmt: skip
    rows: list[list[object]] = []
    problems: list[str] = []
    for run in runs:
        by = {(c.path, c.concurrency): c for c in run.cells}
        for cell in sorted(run.cells, key=lambda c: (PATHS.index(c.path), c.concurrency)):
            rate_here = cell.tokens_per_s()
            generate = by.get(("generate", cell.concurrency))
            engine = by.get(("engine", cell.concurrency))
            bound = cell.concurrency * rate / run.weights_bytes
            ttft, per_token = cell.ttft_ms(), cell.per_token_ms()
            rows.append([
                run.label, cell.path, cell.concurrency, len(cell.outcomes), f"{rate_here:,.0f}",
                f"{rate_here / generate.tokens_per_s():.2f}" if generate and cell.path in ("engine", "stack") else "",
                f"{rate_here / engine.tokens_per_s():.2f}" if engine and cell.path in ("stack", "json") else "",
                f"{percentile(ttft, 0.5):,.0f} / {percentile(ttft, 0.99):,.0f}",
                f"{percentile(per_token, 0.5):.1f} / {percentile(per_token, 0.99):.1f}",
                f"{MS * cell.step_s / cell.steps:.1f}" if cell.steps else "",
                f"{bound:,.0f}", f"{rate_here / bound:.0%}",
            ])  # fmt: skip
            for failure in cell.failures[:3]:
                problems.append(f"{run.label} {cell.path} ×{cell.concurrency}: {failure}")
    return table(headers, rows), problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, defaults for the device filled in; exits 2 naming what is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", help="MiB of weights per model (default: 1024,8192 on cuda, 16 on the cpu)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--concurrency", help="clients at once (default: 1,8,32,128 on cuda, 1,4,8 on the cpu)")
    parser.add_argument(
        "--paths", default=",".join(DEFAULT_PATHS), help=f"which of {', '.join(PATHS)} (default: all but json)"
    )
    parser.add_argument("--max-prompt", type=int, default=256, help="longest prompt in tokens (default 256)")
    parser.add_argument("--max-output", type=int, default=128, help="longest output in tokens (default 128)")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (default: requests_for)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    args.sizes = args.sizes or DEFAULT_SIZES[args.device]
    args.concurrency = args.concurrency or DEFAULT_CONCURRENCY[args.device]
    args.dtype = args.dtype or DEFAULT_DTYPE[args.device]
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        parser.error(f"--paths: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(PATHS)}")
    args.paths = paths
    for name, value, least in (("--max-prompt", args.max_prompt, 1), ("--max-output", args.max_output, 1),
                               ("--requests", args.requests, 0)):  # fmt: skip
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        sizes = [float(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(f"--concurrency and --sizes take comma-separated numbers: {exc}")
    if any(level < 1 for level in levels) or any(size <= 0 for size in sizes):
        parser.error("--concurrency and --sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.serve: --device cuda: torch finds no CUDA device on this machine")
    if args.device == "cpu":
        # As a replica on a virtual GPU runs (inference.backends.VirtualBackend), so the three
        # paths compare on equal threads.
        torch.set_num_threads(int(os.environ.get("GPUPORTAL_VIRTUAL_CPU_THREADS", "1")))

    from bench.portal import servers

    with servers("gpuportal-bench-serve-", "gpuportal_bench_serve") as tmp:
        runs, rate = measure(args, tmp, lambda line: print(line, flush=True))
        text, problems = report(runs, rate)
    print("\n" + text)
    for problem in problems:
        print("failed:", problem)
    if not args.no_record:
        section = "serve-gpu" if args.device == "cuda" else "serve"
        title = "Serving throughput" + (", on a GPU" if args.device == "cuda" else ", on the CPU")
        record(section, title, described(args, rate, text, runs))
    return 1 if problems else 0


def described(args: argparse.Namespace, rate: float, text: str, runs: list[ModelRun]) -> str:
    lines = [
        f"`python -m bench.serve --device {args.device} --sizes {args.sizes} --concurrency {args.concurrency} "
        f"--paths {','.join(args.paths)} --max-prompt {args.max_prompt} --max-output {args.max_output}"
        + (f" --requests {args.requests}" if args.requests else "")
        + "`",
        "",
        text,
        "",
        f"The same seeded requests on each path (prompts of 8-{args.max_prompt} tokens, outputs of "
        f"8-{args.max_output}; greedy; the model's end of sequence counted). The device's copy rate, "
        f"measured in the run: {rate / 1e9:.1f} GB/s; the bound is clients × that ÷ the weights' bytes "
        "(a decode step reads every weight once; the KV cache is not counted, so at many clients, where a "
        "step is bound by compute, the fraction falls by design). `engine`: the replica's Batcher over its "
        "PagedModel in the benchmark's process; `stack`: streamed `POST /v1/completions` through the web, "
        "the queue and a replica on the node agent's device; `generate`: transformers' `generate()` over "
        "fixed batches of the clients' number; `json`: the engine with every answer held to a JSON object "
        "(other tokens than the free answers': its figures are what a format costs a step). `ms a step`: the "
        "engine's mean step (a prefill forward for the requests that joined, a decode forward for the others, "
        "the sampling and the text).",
    ]
    if args.device == "cpu":
        lines.append(
            "\nOn the CPU every path runs on one intra-op thread (a replica on a virtual GPU's setting): this "
            "keeps the benchmark working in CI; the figures that matter are the GPU's."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
