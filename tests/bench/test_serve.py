"""bench.serve compares like with like: one seeded workload for every path, the engine and
transformers' generate giving the same requests the same tokens, and the whole run (the stack's
processes too) working on the CPU so that CI keeps it working."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import serve
from bench.report import ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer

    from inference.loaders import TRANSFORMERS, load_model
    from inference.management.commands.make_tiny_model import write_tiny_model

    written = write_tiny_model(tmp_path_factory.mktemp("serve") / "m", size_mb=2, seed=3, log=lambda _: None)
    torch.set_num_threads(1)
    model = load_model(str(written.path), TRANSFORMERS, "float32", device="cpu")
    return model, AutoTokenizer.from_pretrained(written.path)


def test_the_workload_is_the_same_for_the_same_seed_and_keeps_to_its_bounds(tiny):
    _, tokenizer = tiny

    jobs = serve.workload(tokenizer, 12, max_prompt=24, max_output=10, seed=5)

    assert jobs == serve.workload(tokenizer, 12, max_prompt=24, max_output=10, seed=5)
    assert jobs != serve.workload(tokenizer, 12, max_prompt=24, max_output=10, seed=6)
    for job in jobs:
        # What the replica will tokenise is what the engine and generate are given.
        assert list(job.ids) == tokenizer(job.prompt).input_ids
        assert 1 <= len(job.ids) <= 24 and 8 <= job.max_tokens <= 10
    assert len({len(job.ids) for job in jobs}) > 1, "prompt lengths are mixed"


def test_useful_tokens_end_at_the_first_end_of_sequence_or_the_requests_own_limit():
    assert serve.useful_tokens([5, 6, 2, 7, 8], {2}, 10) == 3
    assert serve.useful_tokens([5, 6, 7, 8, 9], {2}, 3) == 3
    # Past a batch-mate's longer limit, generate pads: none of that counts.
    assert serve.useful_tokens([5, 2, 0, 0], {2}, 4) == 2
    assert serve.useful_tokens([5, 6, 7], set(), 10) == 3


def test_the_engine_and_generate_give_each_request_the_same_tokens(tiny):
    model, tokenizer = tiny
    jobs = serve.workload(tokenizer, 4, max_prompt=20, max_output=12, seed=1)
    engine = serve.paged_engine(model, serve.pool_tokens(2, 20, 12))

    # One client: no padding in generate's batches, so greedy decoding must agree token for token.
    paged = serve.run_engine(engine, model, tokenizer, jobs, 1)
    batched = serve.run_generate(model, tokenizer, jobs, 1)

    assert not paged.failures and not batched.failures
    assert [o.tokens for o in paged.outcomes] == [o.tokens for o in batched.outcomes]
    assert all(o.first is not None and o.ended is not None and o.ended >= o.first for o in paged.outcomes)
    assert paged.tokens_per_s() > 0 and batched.tokens_per_s() > 0
    # Two clients share the pool; every request still ends, and the pool is empty again.
    two = serve.run_engine(engine, model, tokenizer, jobs, 2)
    assert not two.failures and len(two.outcomes) == 4
    assert engine.pool.blocks_available == engine.pool.blocks_total


def test_the_json_path_holds_every_answer_to_a_json_object_as_the_replica_does(tiny):
    model, tokenizer = tiny
    jobs = serve.workload(tokenizer, 4, max_prompt=20, max_output=12, seed=1)
    engine = serve.paged_engine(model, serve.pool_tokens(2, 20, 12))

    free = serve.run_engine(engine, model, tokenizer, jobs, 2)
    held = serve.run_engine(engine, model, tokenizer, jobs, 2, held=True)

    assert held.path == "json" and not held.failures and len(held.outcomes) == 4
    assert all(o.text.lstrip().startswith("{") for o in held.outcomes), [o.text for o in held.outcomes]
    assert not all(o.text.lstrip().startswith("{") for o in free.outcomes), "the random model's own text"
    assert engine.pool.blocks_available == engine.pool.blocks_total


def test_requests_for_each_concurrency_grow_with_the_clients_and_stay_short_past_32():
    assert [serve.requests_for(c) for c in (1, 4, 8, 32, 128)] == [8, 8, 16, 64, 160]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--paths", "engine,warp"], "--paths: unknown warp"),
        (["--concurrency", "0"], "must be positive"),
        (["--sizes", "big"], "comma-separated numbers"),
        (["--max-output", "0"], "--max-output must be at least 1"),
        (["--requests", "-1"], "--requests must be at least 0"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        serve.parse_args(argv)

    assert exited.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.slow
def test_the_three_paths_run_through_the_whole_stack_on_the_cpu():
    before = (ROOT / "BENCHMARKS.md").read_bytes()

    # A Redis of its own (the bench starts one without REDIS_URL): on this test process's, the
    # session's agents worker (tests/conftest.py) would take its agent's calls off the shared
    # `agents` queue and register its node in the test database rather than the bench's.
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    result = subprocess.run(
        [
            sys.executable, "-m", "bench.serve", "--no-record", "--sizes", "2", "--concurrency", "1,2",
            "--requests", "3", "--max-prompt", "16", "--max-output", "8",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 2 MiB float32 ")]
    assert {(row.split("|")[2].strip(), row.split("|")[3].strip()) for row in rows} == {
        (path, clients) for path in serve.DEFAULT_PATHS for clients in ("1", "2")
    }
    for row in rows:
        assert float(row.split("|")[5].replace(",", "")) > 0, row
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
