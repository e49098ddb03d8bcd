"""The log probabilities of an answer's tokens (OpenAI's `logprobs`), on a real tiny Llama: the
paged engine and transformers' generate() path give the same figures, the model's own (before
temperature or penalties), each with its likeliest alternatives, and nothing for a request that
does not ask."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.requestqueue import Request
from inference.batching import Batcher, Sequence, eos_ids, run_until_idle
from inference.kvpool import BlockPool
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PREFILL_CHUNK_TOKENS, PagedModel, model_shape
from inference.serving import Executor
from inference.token_logprobs import of_rows

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-logprobs"), size_mb=2, seed=5, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def run(model: Any, tokenizer: Any, prompt: str | list[int] = PROMPT, **params: Any) -> Sequence:
    pool = BlockPool.for_shape(model_shape(model, 0), 64, dtype=torch.float32, device="cpu", block_tokens=4)
    batcher = Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))
    request = Request(id="r1", deployment="tiny", kind="generate", input=prompt, params=params)
    seq = Executor(model, tokenizer).sequence(request, None)
    batcher.submit(seq)
    run_until_idle(batcher)
    return seq


def paged(model: Any, tokenizer: Any, prompt: str = PROMPT, **params: Any) -> dict[str, Any]:
    return run(model, tokenizer, prompt, **params).result()


def test_a_greedy_answer_gives_each_tokens_log_probability_the_likeliest_of_its_alternatives(tiny):
    model, tokenizer = tiny

    answer = paged(model, tokenizer, max_tokens=6, logprobs=3)

    picked = answer["logprobs"]
    assert 1 <= len(picked) <= answer["usage"]["completion_tokens"]
    for entry in picked:
        assert entry["logprob"] <= 0 and len(entry["top"]) == 3
        assert [lp for _, lp in entry["top"]] == sorted((lp for _, lp in entry["top"]), reverse=True)
        # Greedy: the token picked is the likeliest, its figure the first alternative's.
        assert entry["top"][0] == [entry["token"], pytest.approx(entry["logprob"])]
    assert "".join(entry["token"] for entry in picked).strip() == answer["text"].strip()


def test_the_generate_path_gives_the_paged_engines_figures(tiny):
    model, tokenizer = tiny

    from_pages = paged(model, tokenizer, max_tokens=6, logprobs=2)["logprobs"]
    request = Request(
        id="r2", deployment="tiny", kind="generate", input=PROMPT, params={"max_tokens": 6, "logprobs": 2}
    )
    from_generate = Executor(model, tokenizer).run(request, None)["logprobs"]

    assert [e["token"] for e in from_generate] == [e["token"] for e in from_pages]
    assert [e["logprob"] for e in from_generate] == pytest.approx([e["logprob"] for e in from_pages], abs=1e-4)


def test_a_sampled_answer_reports_the_models_own_figures_not_the_tempered_ones(tiny):
    model, tokenizer = tiny

    seq = run(model, tokenizer, max_tokens=4, logprobs=0, temperature=1.5, seed=3)

    answer = seq.result()["logprobs"]
    assert all(entry["top"] == [] for entry in answer), "no alternatives asked for"
    # Rebuilt from the model's own logits over the same tokens, untempered: the same figures.
    ids, tokens = tokenizer(PROMPT).input_ids, [token for token, _, _ in seq.picked]
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : len(ids) - 1 + len(tokens)]
    expected = [lp for _, lp, _ in of_rows(logits, tokens, [0] * len(tokens))]
    assert [lp for _, lp, _ in seq.picked] == pytest.approx(expected, abs=1e-4)
    assert [e["logprob"] for e in answer] == pytest.approx(expected[: len(answer)], abs=1e-4)
    tempered = [lp for _, lp, _ in of_rows(logits / 1.5, tokens, [0] * len(tokens))]
    assert [lp for _, lp, _ in seq.picked] != pytest.approx(tempered, abs=1e-4)


def test_a_request_that_does_not_ask_gets_no_log_probabilities(tiny):
    model, tokenizer = tiny

    assert "logprobs" not in paged(model, tokenizer, max_tokens=3)
    request = Request(id="r3", deployment="tiny", kind="generate", input=PROMPT, params={"max_tokens": 3})
    assert "logprobs" not in Executor(model, tokenizer).run(request, None)


# Past PREFILL_CHUNK_TOKENS (and SCORED_ROWS): the paged engine scores it chunk by chunk.
LONG = " ".join(["the cat sat on the mat"] * 20)


def scored_by_one_forward(model: Any, tokenizer: Any, prompt: str, k: int) -> tuple[list[int], list[Any]]:
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return ids, of_rows(logits, ids[1:], [k] * (len(ids) - 1))


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["one-pass", "chunked"])
def test_an_echoed_prompts_tokens_are_scored_as_one_forward_of_the_model_scores_them(tiny, prompt):
    model, tokenizer = tiny
    ids, expected = scored_by_one_forward(model, tokenizer, prompt, 2)
    assert prompt == PROMPT or len(ids) > PREFILL_CHUNK_TOKENS

    plain = paged(model, tokenizer, prompt, max_tokens=2, logprobs=2)
    echoed = paged(model, tokenizer, prompt, max_tokens=2, logprobs=2, echo=True)
    request = Request(
        id="r4", deployment="tiny", kind="generate", input=prompt, params={"max_tokens": 2, "logprobs": 2, "echo": True}
    )
    generated = Executor(model, tokenizer).run(request, None)

    assert "prompt_logprobs" not in plain
    assert echoed["text"] == plain["text"], "scoring the prompt changes nothing of the answer"
    for scored in (echoed["prompt_logprobs"], generated["prompt_logprobs"]):
        assert len(scored) == len(ids)
        assert scored[0] == {"token": tokenizer.decode(ids[:1]), "logprob": None, "top": None}, "nothing before it"
        assert [e["token"] for e in scored[1:]] == [tokenizer.decode([token]) for token in ids[1:]]
        assert [e["logprob"] for e in scored[1:]] == pytest.approx([lp for _, lp, _ in expected], abs=1e-4)
        alternatives = [lp for e in scored[1:] for _, lp in e["top"]]
        assert alternatives == pytest.approx([lp for _, _, top in expected for _, lp in top], abs=1e-4)


def test_a_prompt_is_scored_only_where_echo_and_logprobs_are_both_asked(tiny):
    model, tokenizer = tiny

    assert "prompt_logprobs" not in paged(model, tokenizer, max_tokens=2, echo=True)
    request = Request(id="r5", deployment="tiny", kind="generate", input=PROMPT, params={"max_tokens": 2, "echo": True})
    assert "prompt_logprobs" not in Executor(model, tokenizer).run(request, None)


def test_a_prompt_given_as_token_ids_is_answered_and_scored_as_its_text_is_on_both_paths(tiny):
    model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    asked = {"max_tokens": 3, "logprobs": 1, "echo": True}

    def generated(given: Any) -> dict[str, Any]:
        request = Request(id="r6", deployment="tiny", kind="generate", input=given, params=asked)
        return Executor(model, tokenizer).run(request, None)

    by_text, by_ids = paged(model, tokenizer, PROMPT, **asked), run(model, tokenizer, ids, **asked).result()
    assert (by_ids["text"], by_ids["logprobs"], by_ids["prompt_logprobs"]) == (
        by_text["text"], by_text["logprobs"], by_text["prompt_logprobs"]
    )  # fmt: skip
    assert generated(ids)["prompt_logprobs"] == generated(PROMPT)["prompt_logprobs"]
    assert generated(ids)["text"] == by_text["text"]
    # The web has no tokenizer: the replica decodes the ids the answer's echo begins with.
    assert generated(ids)["prompt_text"] == tokenizer.decode(ids) and "prompt_text" not in generated(PROMPT)
