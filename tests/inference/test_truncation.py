"""Responses' `truncation: "auto"`: a conversation longer than its replica's room loses its
earliest whole turns, the system's messages and its last turn kept, rather than fail; without it
(or `"disabled"`) it fails as too long, as before."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from django.conf import settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire import truncation
from gpuportal.wire.requestqueue import RequestQueue
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.serving import Server
from tests.support.serving import host_for

SYSTEM = {"role": "system", "content": "Be brief."}


def turn(i: int, words: int = 1) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question {i} " + "word " * words},
        {"role": "assistant", "content": f"answer {i} " + "word " * words},
    ]


def length(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in messages)


def test_the_fewest_earliest_whole_turns_are_dropped_and_the_system_and_last_turn_kept():
    called = []
    conversation = [SYSTEM, *[m for i in range(40) for m in turn(i)], {"role": "user", "content": "last?"}]

    def fits(messages: list[dict[str, Any]]) -> bool:
        called.append(len(messages))
        return length(messages) <= 300

    found = truncation.shortest_fit(conversation, fits)

    assert found is not None
    kept, dropped = found
    assert kept[0] == SYSTEM and kept[1]["role"] == "user" and kept[-1]["content"] == "last?"
    assert fits(kept) and not fits([SYSTEM, *conversation[dropped - 1 :]]), "one turn fewer dropped: too long"
    assert dropped % 2 == 0, "whole turns: a question and its answer"
    assert len(called) <= 2 + 7 + 2, "the fewest found by halving, not one turn at a time"


def test_a_turn_with_calls_goes_whole_and_a_conversation_that_fits_is_left_as_it_is():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "x" * 50}
    conversation = [{"role": "user", "content": "call f"}, call, answer, {"role": "assistant", "content": "done"},
                    {"role": "user", "content": "and?"}]  # fmt: skip

    assert truncation.cut_points(conversation) == [4]
    assert truncation.shortest_fit(conversation, lambda m: length(m) < 20) == ([conversation[-1]], 4)
    assert truncation.shortest_fit(conversation, lambda m: True) == (conversation, 0)
    assert truncation.shortest_fit(conversation, lambda m: False) is None, "even the last turn too long"
    assert truncation.shortest_fit([SYSTEM, {"role": "user", "content": "x"}], lambda m: False) is None


def test_truncation_is_auto_or_disabled():
    assert truncation.problem(None) is None and truncation.problem("auto") is None
    assert truncation.problem("disabled") is None
    assert truncation.problem("yes") == 'must be "auto" or "disabled"'


@pytest.mark.django_db
def test_the_responses_api_passes_auto_on_says_it_in_the_response_and_refuses_another_value():
    from scheduling.api.completion_input import Refused
    from scheduling.api.responses import ResponsesView

    def parse(**body: Any) -> Any:
        return ResponsesView().parse({"model": "tiny", "input": "Hi", **body}, owner="1")

    assert parse(truncation="auto").params[truncation.TRUNCATION] == "auto"
    assert truncation.TRUNCATION not in parse(truncation="disabled").params
    with pytest.raises(Refused) as refused:
        parse(truncation="sometimes")
    assert refused.value.param == "truncation"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-truncation"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_a_replica_answers_a_conversation_past_its_context_as_the_one_cut_to_fit(tiny):
    model, tokenizer = tiny
    host = host_for(model, tokenizer)
    executor = host.executor()
    conversation = [SYSTEM, *[m for i in range(30) for m in turn(i, words=20)], {"role": "user", "content": "Why?"}]
    context, max_tokens = model.config.max_position_embeddings, 8

    def tokens(messages: list[dict[str, Any]]) -> int:
        return len(tokenizer(executor.chat_prompt(messages)).input_ids)

    assert tokens(conversation) + max_tokens > context, "the whole conversation is past the model's context"
    # What it must be cut to: the system's message, then from the first question that leaves room.
    first = next(
        i for i in range(1, len(conversation), 2) if tokens([SYSTEM, *conversation[i:]]) + max_tokens <= context
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    rq, deployment = RequestQueue(client), f"d-{uuid.uuid4().hex[:8]}"
    server = Server(host, rq, deployment, poll_s=0.05)
    server.start()
    try:
        answers = [
            rq.wait(rq.submit(deployment, kind="chat", input=messages, params=params, owner="u").id, 60)
            for messages, params in (
                (conversation, {"max_tokens": max_tokens, truncation.TRUNCATION: "auto"}),
                ([SYSTEM, *conversation[first:]], {"max_tokens": max_tokens}),
                (conversation, {"max_tokens": max_tokens}),
            )
        ]
    finally:
        server.stopped.set()
        server.join(10)
        client.close()

    cut, by_hand, whole = answers
    assert cut is not None and cut.status == "done", cut
    assert by_hand is not None and by_hand.status == "done", by_hand
    assert cut.output["text"] == by_hand.output["text"]
    assert (
        cut.output["usage"]["prompt_tokens"]
        == by_hand.output["usage"]["prompt_tokens"]
        == tokens([SYSTEM, *conversation[first:]])
    )
    assert whole is not None and whole.status == "failed" and whole.error_kind == "too_long", whole


def test_a_model_served_by_generate_cuts_the_conversation_to_its_context_alike(tiny):
    model, tokenizer = tiny
    host = host_for(model, tokenizer, paged=False)  # transformers' generate(), one request at a time
    executor = host.executor()
    conversation = [SYSTEM, *[m for i in range(30) for m in turn(i, words=20)], {"role": "user", "content": "Why?"}]
    client = redis.Redis.from_url(settings.REDIS_URL)
    rq, deployment = RequestQueue(client), f"d-{uuid.uuid4().hex[:8]}"
    server = Server(host, rq, deployment, poll_s=0.05)
    server.start()
    try:
        params = {"max_tokens": 4, truncation.TRUNCATION: "auto"}
        cut = rq.wait(rq.submit(deployment, kind="chat", input=conversation, params=params, owner="u").id, 60)
    finally:
        server.stopped.set()
        server.join(10)
        client.close()

    assert cut is not None and cut.status == "done", cut
    context = model.config.max_position_embeddings
    kept = truncation.shortest_fit(
        conversation, lambda m: len(tokenizer(executor.chat_prompt(m)).input_ids) + 4 <= context
    )
    assert kept is not None and cut.output["usage"]["prompt_tokens"] == len(
        tokenizer(executor.chat_prompt(kept[0])).input_ids
    )
