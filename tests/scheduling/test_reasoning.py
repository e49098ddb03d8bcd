"""A reasoning model's thinking (`<think>...</think>`) told apart from its answer: whole, as it
streams (the same texts, however the answer is cut into pieces), and where the chat template
opened it. Pure: no server (served through `/v1`: tests/scheduling/test_openai.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.wire.reasoning import Splitter, opened_by, split


def test_the_thinking_is_the_reasoning_and_what_follows_it_the_content():
    assert split("<think>\nWeigh it.\n</think>\n\nYes.") == ("Weigh it.", "Yes.")
    assert split("  <think>a</think>b") == ("a", "b")
    assert split("<think>\nStill weighing") == ("Still weighing", ""), "cut before it ended: all reasoning"
    assert split("<think>\n\n</think>\n\nYes.") == ("", "Yes."), "told not to think (Qwen 3's empty block)"
    assert split("Yes.") == (None, "Yes.")
    assert split("Yes. </think> no") == (None, "Yes. </think> no"), "a tag it did not open is text"
    assert split("") == (None, "")


def test_a_prompt_that_opens_thinking_is_told_by_its_end():
    assert opened_by("<|user|>Hi<|assistant|><think>\n") == "<think>\n"
    assert opened_by("<|user|>Hi<|assistant|>") == ""
    assert opened_by("<think>\n\n</think>\n\n") == "", "opened and closed: Qwen 3 told not to think"
    assert opened_by("Explain <think> tags<|assistant|>") == "", "a tag the user wrote is not where it ends"


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think>", " ", "\n", "a", "b c", "<"]))


@given(PIECES, st.data())
def test_a_stream_splits_into_the_same_reasoning_and_content_as_the_whole(words, data):
    text = "".join(words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    splitter = Splitter()
    said = [splitter.feed(piece) for piece in pieces] + [splitter.end()]
    thought = "".join(r for r, _ in said)
    content = "".join(c for _, c in said)

    whole_thought, whole_content = split(text)
    assert thought == (whole_thought or "") and content == whole_content, (pieces, said)


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>", " <think>"],
        ["<think>", " ", "\nHm", "</think>"],
        ["<think>a</think>", " ", "\nYes"],
        ["<think>a</think>", " "],
    ],
    ids=["reasoning", "reasoning-in-three", "content", "no-content"],
)
def test_leading_whitespace_in_pieces_of_its_own_is_dropped_as_the_whole_drops_it(pieces):
    splitter = Splitter()
    said = [splitter.feed(piece) for piece in pieces] + [splitter.end()]

    thought, content = split("".join(pieces))
    assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == (thought or "", content)


def test_a_stream_sends_the_reasoning_as_it_comes_and_holds_only_what_may_be_a_tag():
    splitter = Splitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\nLet me") == ("Let me", "")
    assert splitter.feed(" see </thi") == (" see", ""), "the tag's beginning, and the space before it, wait"
    assert splitter.feed("nk>\n\n") == ("", "")
    assert splitter.feed("Yes") == ("", "Yes")
    assert splitter.feed(" </think>") == ("", " </think>"), "after the thinking, text is content"


# A template that opens the thinking itself, as DeepSeek-R1's and QwQ's do, unless told not to
# think (Qwen 3's `enable_thinking`, through chat_template_kwargs).
THINKING = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %} <think>\n\n</think>\n\n{% else %} <think>\n{% endif %}"
)


def test_an_answer_to_a_prompt_that_opened_thinking_begins_with_the_tag_whole_and_streamed():
    import torch
    from transformers import LlamaForCausalLM

    from gpuportal.wire.requestqueue import Request
    from inference.management.commands.make_tiny_model import build_tokenizer
    from inference.serving import Executor
    from tests.support.serving import tiny_llama_config

    torch.manual_seed(7)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # tokens of their own, as a reasoning model's tokenizer has them
    tokenizer.chat_template = THINKING
    config = tiny_llama_config()
    config.vocab_size = len(tokenizer)
    executor = Executor(LlamaForCausalLM(config).eval(), tokenizer)  # generate(): no KV pool

    def answer(**params: object) -> tuple[str, str, dict[str, int]]:
        pieces: list[str] = []
        asked = Request(id="r", deployment="t", kind="chat", input=[{"role": "user", "content": "Hi"}],
                        params={"max_tokens": 6, "stream": True, **params})  # fmt: skip
        output = executor.run(asked, pieces.append)
        return output["text"], "".join(pieces), output["usage"]

    text, streamed, usage = answer()
    told_not_to, _, plain_usage = answer(chat_template_kwargs={"enable_thinking": False})
    held, _, _ = answer(guided_choice=["yes", "no"])

    assert text.startswith("<think>\n") and streamed == text, "its text as the model's whole turn reads"
    assert split(text)[0] is not None and "</think>" not in text
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}, "cut: all thinking"
    assert not told_not_to.startswith("<think>"), "the template closed the thinking: all content"
    assert plain_usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert held in ("yes", "no"), "held to a format: no room to think, nothing begun"


def test_the_thinking_tokens_are_counted_to_the_closing_tag_as_openais_reasoning_tokens():
    from inference.batching import Sequence

    close = 9
    thought = Sequence([1], 4, generated=[5, 6, close, 7], text="Hm.</think>Yes", opened="<think>", close_id=close)
    cut = Sequence([1], 2, generated=[5, 6], text="Hm.", opened="<think>", close_id=close)
    plain = Sequence([1], 2, generated=[5, close], text="Yes</think>", close_id=close)
    unknown = Sequence([1], 2, generated=[5, 6], text="Hm.", opened="<think>")

    assert thought.result()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert cut.result()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert plain.result()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}, "it did not think"
    assert "completion_tokens_details" not in unknown.result()["usage"], "a model with no closing tag to count to"


def thinking_model() -> tuple[object, object]:
    """A tiny random Llama whose tokenizer has the tags as tokens of their own, and whose chat
    template opens the thinking (THINKING)."""
    import torch
    from transformers import LlamaForCausalLM

    from inference.management.commands.make_tiny_model import build_tokenizer
    from tests.support.serving import tiny_llama_config

    torch.manual_seed(7)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING
    config = tiny_llama_config()
    config.vocab_size = len(tokenizer)
    return LlamaForCausalLM(config).eval(), tokenizer


def test_a_thinking_that_has_had_its_budget_is_closed_and_the_answer_follows():
    import torch

    from gpuportal.wire.reasoning import THINKING_BUDGET, tag_ids
    from gpuportal.wire.requestqueue import Request
    from inference.batching import Batcher, eos_ids, run_until_idle
    from inference.kvpool import BlockPool
    from inference.paged import PagedModel, model_shape
    from inference.serving import Executor

    model, tokenizer = thinking_model()
    open_id, close_id = tag_ids(tokenizer)
    executor = Executor(model, tokenizer)
    pool = BlockPool.for_shape(model_shape(model, 0), 64, dtype=torch.float32, device="cpu", block_tokens=4)
    batcher = Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))
    batcher.eos = set()  # each runs to its max_tokens

    def answered(budget: int | None, **params: object) -> object:
        asked = {"max_tokens": 8, **({THINKING_BUDGET: budget} if budget is not None else {}), **params}
        seq = executor.sequence(Request(id="r", deployment="t", kind="chat", input=[{"role": "user", "content": "Hi"}],
                                        params=asked), None)  # fmt: skip
        batcher.submit(seq)
        run_until_idle(batcher)
        return seq

    budgeted, unbounded = answered(3), answered(None)
    # A model the paged engine does not take runs on transformers' generate(): held the same.
    alone = executor.run(Request(id="g", deployment="t", kind="chat", input=[{"role": "user", "content": "Hi"}],
                                 params={"max_tokens": 8, THINKING_BUDGET: 3}), None)  # fmt: skip
    # A model that opens its own thinking: its first token `<think>` (biased to it throughout here).
    own = answered(3, chat_template_kwargs={"enable_thinking": False}, logit_bias={str(open_id): 100})
    unbudgeted_own = answered(None, chat_template_kwargs={"enable_thinking": False}, logit_bias={str(open_id): 100})

    assert budgeted.opened and budgeted.generated[:3] == unbounded.generated[:3], "the same thinking until the budget"
    assert budgeted.generated[3] == close_id != unbounded.generated[3], "then closed"
    assert close_id not in budgeted.generated[:3] and budgeted.generated.count(close_id) == 1, "once"
    assert budgeted.result()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert split(budgeted.result()["text"])[0] is not None, "its reasoning apart from what follows"
    assert own.generated[:4] == [open_id, open_id, open_id, close_id] and close_id not in unbudgeted_own.generated
    assert alone["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert alone["text"] == budgeted.result()["text"], "greedy: the same answer either way"


def read(kind: str = "chat", **body: object) -> object:
    from scheduling.api import completion_input

    asked = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", **body}
    return completion_input.parse(asked, kind, default_timeout_s=30, max_timeout_s=300)


def test_a_thinking_budget_is_vllms_field_on_v1_and_the_responses_api_passes_it_on():
    from gpuportal.wire.reasoning import THINKING_BUDGET
    from scheduling.api.completion_input import Refused
    from scheduling.api.responses import ResponsesView

    assert read(thinking_token_budget=64).params[THINKING_BUDGET] == 64
    assert read("generate", thinking_token_budget=64).params[THINKING_BUDGET] == 64
    assert THINKING_BUDGET not in read().params
    for bad in (0, -1, "64", True, 6.5):
        with pytest.raises(Refused) as refused:
            read(thinking_token_budget=bad)
        assert str(refused.value) == "thinking_token_budget: must be a whole number of at least 1"
    answered = ResponsesView().parse({"model": "tiny", "input": "Hi", "thinking_token_budget": 64}, owner="1")
    assert answered.params[THINKING_BUDGET] == 64


def test_reasoning_given_back_and_the_templates_arguments_are_kept_for_the_chat_template():
    import pytest

    from scheduling.api.completion_input import Refused

    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]  # fmt: skip

    call = read(messages=turns, chat_template_kwargs={"enable_thinking": False})

    assert [m.get("reasoning_content") for m in call.input] == [None, "Greet back.", "Look it up."]
    assert call.params["chat_template_kwargs"] == {"enable_thinking": False}
    for body, refused in (
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt: "),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs: must be an object"),
        ({"messages": [{"role": "assistant", "content": "x", "reasoning": 5}]}, "messages.0.reasoning: must be"),
    ):
        with pytest.raises(Refused) as told:
            read(**body)
        assert str(told.value).startswith(refused)
    with pytest.raises(Refused) as completion:
        read("generate", chat_template_kwargs={"enable_thinking": False})
    assert str(completion.value).startswith("chat_template_kwargs: only in a chat")


def test_a_chat_stream_held_back_while_it_may_open_thinking_keeps_every_tokens_log_probability(monkeypatch):
    import json

    from gpuportal.wire.requestqueue import Request
    from scheduling.api import openai_compat
    from scheduling.api.openai_compat import ChatCompletionsView, _Said

    def pick(token: str) -> dict[str, object]:
        return {"token": token, "logprob": -1.0, "top": []}

    pieces = [
        ("\n", [pick("\n")]),
        ("<th", [pick("<th")]),
        ("ink>Hm", [pick("ink>"), pick("Hm")]),
        ("</think>Yes", [pick("</think>"), pick("Yes")]),
    ]
    text = "".join(piece for piece, _ in pieces)
    call = read(stream=True, logprobs=True)
    asked = Request(id="r-3", deployment="tiny", kind="chat", input=[], params=call.params)
    output = {"text": text, "finish_reason": "stop", "logprobs": [p for _, ps in pieces for p in ps]}
    final = Request(**{**asked.__dict__, "status": "done", "output": output})

    def follow(*args: object) -> object:
        yield from (_Said(0, text=piece, picks=picked) for piece, picked in pieces)
        yield _Said(0, ended=True, final=final)

    monkeypatch.setattr(openai_compat, "_follow", follow)
    sent = b"".join(ChatCompletionsView().events([asked], call)).decode()
    chunks = [json.loads(line[6:]) for line in sent.splitlines() if line.startswith("data: {")]

    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    tokens = [e["token"] for c in chunks if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    assert (
        "".join(d.get("reasoning", "") for d in deltas) == "Hm"
        and "".join(d.get("content", "") for d in deltas) == "Yes"
    )
    assert tokens == ["\n", "<th", "ink>", "Hm", "</think>", "Yes"], "each token once, in order"


def test_a_calls_choices_add_up_their_thinking_tokens():
    from scheduling.api.openai_compat import _usage_of

    def usage(made: int, thought: int) -> dict[str, object]:
        counts = {"prompt_tokens": 4, "completion_tokens": made, "total_tokens": 4 + made}
        return {"usage": {**counts, "completion_tokens_details": {"reasoning_tokens": thought}}}

    assert _usage_of([usage(5, 2), usage(6, 3)], 2) == {
        "prompt_tokens": 4,
        "completion_tokens": 11,
        "total_tokens": 15,
        "completion_tokens_details": {"reasoning_tokens": 5},
    }
