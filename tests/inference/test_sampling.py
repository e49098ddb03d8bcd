"""The sampling parameters a text request may give, as OpenAI's, vLLM's and Ollama's clients send
them (gpuportal.wire.sampling): their rules, and what the paged engine (inference.batching) and
transformers' generate() path (inference.serving.Executor) do with them. A seeded request picks
the same tokens whatever else its batch holds; the penalties change the logits as their authors
define them."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire import sampling
from gpuportal.wire.requestqueue import Request, read_piece
from gpuportal.wire.sampling import Sampling
from inference.batching import Batcher, Sequence, _penalized, eos_ids, run_until_idle
from inference.errors import BadInput
from inference.kvpool import BlockPool
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PagedModel, model_shape
from inference.serving import Executor, OpenAIPenalties


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-sampling"), size_mb=2, seed=5, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


PROMPT = "Once upon a time"


def batcher(model: Any, tokenizer: Any) -> Batcher:
    pool = BlockPool.for_shape(model_shape(model, 0), 64, dtype=torch.float32, device="cpu", block_tokens=4)
    return Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))


def run(b: Batcher, *seqs: Sequence) -> list[list[int]]:
    b.eos = set()  # every sequence runs to its max_tokens: the tokens compare whole
    for seq in seqs:
        b.submit(seq)
    run_until_idle(b)
    return [seq.generated for seq in seqs]


# -- the rules -----------------------------------------------------------------------------------------


def test_each_parameter_is_declared_once_with_its_bounds():
    assert tuple(f.name for f in fields(Sampling)) == (*sampling.NAMES, *sampling.LISTED_NAMES)
    assert sampling.problems({"top_p": 0, "top_k": 2.5, "seed": True, "min_p": 0.1, "stop": "x"}) == {
        "top_p": "must be above 0 and at most 1",
        "top_k": "must be a whole number",
        "seed": "must be a whole number",
    }
    assert sampling.problems({"presence_penalty": 3, "repetition_penalty": 0, "temperature": float("nan")}) == {
        "temperature": "must be a number",
        "presence_penalty": "must be from -2 to 2",
        "repetition_penalty": "must be above 0 and at most 10",
    }
    assert sampling.checked({"top_k": 5, "min_p": 0, "seed": None, "max_tokens": 3}) == {"top_k": 5, "min_p": 0.0}
    assert Sampling.of({"temperature": 0.7, "seed": -1, "top_k": None}) == Sampling(temperature=0.7, seed=-1)
    assert Sampling(seed=-1).generator_seed == 2**64 - 1
    assert Sampling().greedy and not Sampling().penalized and Sampling(repetition_penalty=1.1).penalized


# -- the paged engine ------------------------------------------------------------------------------------


def test_a_seeded_request_picks_the_same_tokens_alone_or_in_any_batch(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("Once upon a time").input_ids
    seeded = Sampling(temperature=1.0, seed=1234)

    (alone,) = run(batcher(model, tokenizer), Sequence(prompt, 12, sampling=seeded))
    # Beside unseeded sampled requests, which draw from the batcher's own generator in between.
    others = [Sequence(prompt, 12, sampling=Sampling(temperature=1.0)) for _ in range(3)]
    _, together, *_ = run(batcher(model, tokenizer), others[0], Sequence(prompt, 12, sampling=seeded), *others[1:])
    (other_seed,) = run(batcher(model, tokenizer), Sequence(prompt, 12, sampling=Sampling(temperature=1.0, seed=99)))

    assert together == alone
    assert other_seed != alone, "another seed, other tokens"


def test_top_k_of_one_and_a_min_p_of_one_sample_the_likeliest_token(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("The portal").input_ids
    greedy, top_one, min_one = run(
        batcher(model, tokenizer),
        Sequence(prompt, 10),
        Sequence(prompt, 10, sampling=Sampling(temperature=1.5, top_k=1, seed=3)),
        Sequence(prompt, 10, sampling=Sampling(temperature=1.5, min_p=1.0, seed=4)),
    )

    assert top_one == greedy and min_one == greedy


def test_min_p_and_top_k_leave_out_the_unlikely_tokens():
    b = Batcher.__new__(Batcher)  # the sampler alone: no model
    b.generator = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def drawn(**given: Any) -> set[int]:
        seq = Sequence([1], 1, sampling=Sampling(temperature=1.0, **given))
        return {b._sample(seq, logits) for _ in range(300)}

    assert drawn() == {0, 1, 2, 3}
    assert drawn(min_p=0.4) == {0, 1}, "below 0.4 of the likeliest's 0.5"
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn(top_k=-1) == {0, 1, 2, 3}, "vLLM's -1: all"


def test_the_penalties_change_the_logits_as_openai_and_vllm_define_them():
    row = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.0, 3.0])
    seq = Sequence([1, 2], 4, sampling=Sampling(presence_penalty=0.5, frequency_penalty=0.25))
    seq.generated = [3, 3, 4]

    # Generated tokens only: 3 twice (0.25 x 2 + 0.5), 4 once (0.25 + 0.5); the prompt's 1 and 2 untouched.
    assert _penalized(seq, row).tolist() == [1.0, 2.0, -1.0, -0.5, -0.75, 3.0]

    seq.sampling = Sampling(repetition_penalty=2.0)
    # The prompt's tokens and the answer's: a positive logit halved, a negative one doubled.
    assert _penalized(seq, row).tolist() == [1.0, 1.0, -2.0, 0.25, 0.0, 3.0]
    assert row.tolist() == [1.0, 2.0, -1.0, 0.5, 0.0, 3.0], "the row given is left as it was"

    seq.sampling = Sampling.of({"logit_bias": {"5": -100, "0": 2.5}})
    assert seq.sampling.penalized and seq.sampling.logit_bias == ((0, 2.5), (5, -100.0))
    assert _penalized(seq, row).tolist() == [3.5, 2.0, -1.0, 0.5, 0.0, -97.0], "OpenAI's logit_bias: added"


def test_a_logit_bias_is_a_json_object_of_token_ids_and_bounded_biases():
    assert sampling.listed_problems({"logit_bias": None}) == {} == sampling.listed_problems({"logit_bias": {}})
    assert sampling.listed_kept({"logit_bias": {"7": 1}}) == {"logit_bias": {"7": 1.0}}
    assert sampling.listed_kept({"logit_bias": {}, "stop_token_ids": []}) == {}, "empty: nothing asked"
    for value, problem in (
        ([1], 'must be an object of token ids and biases, such as {"50256": -100}'),
        ({"x": 1}, "'x' is no token id (a whole number, as text)"),
        ({"-3": 1}, "'-3' is no token id (a whole number, as text)"),
        ({"3": "1"}, "3: must be a number"),
        ({"3": float("inf")}, "3: must be a number"),
        ({"3": 101}, "3: must be from -100 to 100"),
        ({str(i): 1 for i in range(301)}, "at most 300 tokens"),
    ):
        assert sampling.listed_problems({"logit_bias": value}) == {"logit_bias": problem}, value


def test_stop_token_ids_are_a_list_of_token_ids_kept_in_order_once_each():
    assert sampling.listed_kept({"stop_token_ids": [9, 2, 9]}) == {"stop_token_ids": [2, 9]}
    assert Sampling.of({"stop_token_ids": [9, 2]}).stop_token_ids == (2, 9)
    for value, problem in (
        ({"2": 1}, "must be a list of token ids, such as [128009]"),
        ([1, True], "True is no token id (a whole number from 0 to 999999999)"),
        ([-1], "-1 is no token id (a whole number from 0 to 999999999)"),
        ([1.5], "1.5 is no token id (a whole number from 0 to 999999999)"),
        (list(range(257)), "at most 256 tokens"),
    ):
        assert sampling.listed_problems({"stop_token_ids": value}) == {"stop_token_ids": problem}, value


def test_a_penalized_request_changes_only_its_own_row_of_the_batch(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("Once upon a time").input_ids
    (plain,) = run(batcher(model, tokenizer), Sequence(prompt, 16))

    both = run(
        batcher(model, tokenizer),
        Sequence(prompt, 16),
        Sequence(prompt, 16, sampling=Sampling(repetition_penalty=5.0, frequency_penalty=2.0)),
    )

    assert both[0] == plain, "its neighbour's penalties do not reach it"
    assert both[1] != plain
    assert len(set(both[1])) > len(set(plain)), "repeating less"


def greedy_first(model: Any, tokenizer: Any) -> int:
    """The token greedy picks first after PROMPT: made the end of text, it ends an answer at once."""
    with torch.no_grad():
        return int(torch.argmax(model(torch.tensor([tokenizer(PROMPT).input_ids])).logits[0, -1]))


def test_min_tokens_keeps_the_end_of_text_from_being_picked_before_them(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPT).input_ids
    b = batcher(model, tokenizer)
    b.eos = {greedy_first(model, tokenizer)}

    ended, held = Sequence(prompt, 6), Sequence(prompt, 6, sampling=Sampling(min_tokens=3))
    whole = Sequence(prompt, 6, sampling=Sampling(min_tokens=6))
    for seq in (ended, held, whole):
        b.submit(seq)
    run_until_idle(b)

    assert (ended.generated, ended.finish) == ([*b.eos], "stop")
    assert len(held.generated) >= 3 and not b.eos & set(held.generated[:3]), held.generated
    assert (len(whole.generated), whole.finish) == (6, "length") and not b.eos & set(whole.generated)


def test_a_logit_bias_forces_or_bans_a_token_on_either_path_and_one_past_the_vocabulary_is_refused(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPT).input_ids
    first = greedy_first(model, tokenizer)
    forced = next(token for token in range(10, 500) if token != first)
    executor = Executor(model, tokenizer)

    b = batcher(model, tokenizer)
    b.eos = set()
    banned = Sequence(prompt, 3, sampling=Sampling.of({"logit_bias": {str(first): -100}}))
    pushed = Sequence(prompt, 3, sampling=Sampling.of({"logit_bias": {str(forced): 100}}))
    for seq in (banned, pushed):
        b.submit(seq)
    run_until_idle(b)
    assert banned.generated[0] != first and pushed.generated == [forced] * 3
    generated = executor.run(request(max_tokens=3, logit_bias={str(forced): 100}), None)["text"]
    assert generated == tokenizer.decode([forced] * 3)

    vocab = model.get_output_embeddings().weight.shape[0]
    beyond = request(logit_bias={str(vocab): 5})
    with pytest.raises(BadInput, match=rf"^logit_bias: token {vocab} is not in the model's vocabulary of {vocab}"):
        executor.sequence(beyond, None)
    with pytest.raises(BadInput, match="logit_bias"):
        executor.run(beyond, None)


def test_the_stop_string_that_begins_first_ends_the_answer_the_longer_where_two_begin_together():
    assert sampling.first_stop("one. two\n\nthree", ["three", "\n", "\n\n", ""]) == (8, "\n\n")
    assert sampling.first_stop("one. two", ["two", "."]) == (3, ".")
    assert sampling.first_stop("one", ["x", ""]) is None and sampling.first_stop("", []) is None


def test_a_stop_token_ends_the_answer_before_it_on_either_path_unless_min_tokens_holds_it_back(tiny):
    model, tokenizer = tiny
    prompt = tokenizer(PROMPT).input_ids
    b = batcher(model, tokenizer)
    (plain,) = run(b, Sequence(prompt, 8))
    k = next(k for k in range(2, 8) if plain[k] not in plain[:k])
    stop = plain[k]  # a token greedy picks for the first time: the answer ends before it
    streamed: list[str] = []
    ended = Sequence(prompt, 8, on_chunk=streamed.append, sampling=Sampling(stop_token_ids=(stop,)), logprobs=0)
    held = Sequence(prompt, 8, sampling=Sampling(stop_token_ids=(stop,), min_tokens=8))
    for seq in (ended, held):
        b.submit(seq)
    run_until_idle(b)

    assert (ended.generated, ended.finish) == (plain[: k + 1], "stop")
    assert ended.text == tokenizer.decode(plain[:k], skip_special_tokens=True)
    assert "".join(read_piece(piece)[0] for piece in streamed) == ended.text, "its text was never streamed"
    assert len(ended.logprob_entries) == k, "the stop token is no token of the answer"
    assert stop not in held.generated and len(held.generated) == 8
    executor = Executor(model, tokenizer)
    pieces: list[str] = []
    generated = executor.run(request(max_tokens=8, stop_token_ids=[stop], logprobs=0), pieces.append)
    assert (generated["text"], generated["finish_reason"]) == (ended.text, "stop") and "".join(pieces) == ended.text
    assert generated["usage"]["completion_tokens"] == k + 1 and len(generated["logprobs"]) == k
    assert generated["stop_reason"] == ended.result()["stop_reason"] == stop, "both say the stop token's id"
    assert "stop_reason" not in held.result()

    vocab = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(BadInput, match=rf"^stop_token_ids: token {vocab} is not in the model's vocabulary"):
        executor.sequence(request(stop_token_ids=[vocab]), None)


# -- transformers' generate() path ---------------------------------------------------------------------


def request(**params: Any) -> Request:
    params = {"max_tokens": 10, **params}
    return Request(id="r1", deployment="tiny", kind="generate", input=PROMPT, params=params)


def test_the_generate_path_takes_a_seed_and_the_penalties(tiny):
    model, tokenizer = tiny
    executor = Executor(model, tokenizer)
    sampled = {"temperature": 1.0, "top_k": 50, "min_p": 0.01}

    first = executor.run(request(seed=7, **sampled), None)["text"]
    torch.rand(1000)  # the process's own generator moves on meanwhile
    before = torch.random.get_rng_state()
    again = executor.run(request(seed=7, **sampled), None)["text"]
    assert torch.equal(torch.random.get_rng_state(), before), "the seed reached nothing else in the process"
    other = executor.run(request(seed=8, **sampled), None)["text"]
    assert first == again and other != first

    plain = executor.run(request(), None)["text"]
    assert executor.run(request(repetition_penalty=5.0, presence_penalty=2.0), None)["text"] != plain


def test_the_generate_path_holds_min_tokens_too(tiny):
    model, tokenizer = tiny
    executor = Executor(model, tokenizer)
    kept = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = greedy_first(model, tokenizer)
    try:
        ended = executor.run(request(max_tokens=6), None)
        whole = executor.run(request(max_tokens=6, min_tokens=6), None)
    finally:
        model.generation_config.eos_token_id = kept

    assert (ended["usage"]["completion_tokens"], ended["finish_reason"]) == (1, "stop")
    assert (whole["usage"]["completion_tokens"], whole["finish_reason"]) == (6, "length")


def test_an_unbounded_chat_runs_to_the_default_or_the_room_its_limits_leave_beside_the_prompt(tiny):
    assert sampling.fitted_max_tokens(10, 100) == 90, "the model's context beside the prompt"
    assert sampling.fitted_max_tokens(10, 4096, 8192) == sampling.DEFAULT_CHAT_MAX_TOKENS
    assert sampling.fitted_max_tokens(10, None, 512) == 256, "half the KV cache: room for another beside it"
    assert sampling.fitted_max_tokens(400, None, 512) == 112, "the cache's room beside a long prompt"
    assert sampling.fitted_max_tokens(10, None) == sampling.DEFAULT_CHAT_MAX_TOKENS, "no limit known"
    assert sampling.fitted_max_tokens(100, 100) == sampling.DEFAULT_CHAT_MAX_TOKENS, "no room: refused as asked"

    model, tokenizer = tiny
    context = model.config.max_position_embeddings
    prompt = len(tokenizer("Once upon a time").input_ids)
    # The generate() path, whose limit is the model's context.
    done = Executor(model, tokenizer).run(request(max_tokens=None), None)
    assert done["usage"]["completion_tokens"] <= min(sampling.DEFAULT_CHAT_MAX_TOKENS, context - prompt)
    assert done["usage"]["completion_tokens"] > 10, "more than a default of 10 or 16 tokens"


def test_openais_penalties_as_a_logits_processor_count_the_generated_tokens_only():
    penalties = OpenAIPenalties(Sampling(presence_penalty=1.0, frequency_penalty=0.5), start=2)
    ids = torch.tensor([[0, 1, 2, 2, 3]])  # the prompt is [0, 1]
    scores = torch.zeros(1, 5)

    assert penalties(ids, scores).tolist() == [[0.0, 0.0, -2.0, -1.5, 0.0]]
    assert penalties(ids[:, :2], scores).tolist() == [[0.0] * 5], "nothing generated yet"
