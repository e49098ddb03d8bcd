"""Anthropic's Messages API (`/v1/messages`) as the portal reads it: a body into a chat's, each
refusal naming the Messages field, an answer as content blocks, a stream as Anthropic's events,
errors in its shape; and served, through Anthropic's own client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from django.contrib.auth.models import User
from django.http import JsonResponse
from rest_framework.authtoken.models import Token

from gpuportal.wire import reasoning, sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api import one_stream
from scheduling.api.completion_input import Refused
from scheduling.api.messages import MessagesView
from scheduling.api.openai_compat import _Said
from scheduling.models import Deployment
from tests.scheduling.test_openai import replica, served, served_longer, served_thinking  # noqa: F401

WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def read(**body: Any) -> Any:
    return MessagesView().parse({"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                                 **body}, owner="1")  # fmt: skip


def refusal(**body: Any) -> str:
    with pytest.raises(Refused) as refused:
        read(**body)
    return str(refused.value)


def test_a_system_prompt_comes_first_and_max_tokens_is_a_bound_the_replica_fits_to_its_room():
    call = read(system=[{"type": "text", "text": "Be brief."}], temperature=0.5, top_k=3, stop_sequences=["\n"])

    assert call.input == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert call.params["max_tokens"] is None and call.params[sampling.MAX_TOKENS_BOUND] == 64
    assert sampling.max_tokens_bound(call.params) == 64
    assert sampling.fitted_max_tokens(10, 50, most=64) == 40, "no more than the context's room beside the prompt"
    assert (call.params["temperature"], call.params["top_k"], call.params["stop"]) == (0.5, 3, ["\n"])
    assert read(max_tokens=32_000).params[sampling.MAX_TOKENS_BOUND] == 32_000, (
        "as Claude Code asks: fitted, not refused"
    )
    told_not_to = read(thinking={"type": "disabled"}).params
    assert told_not_to[reasoning.TEMPLATE_KWARGS] == {"enable_thinking": False}, "a template's switch, as Qwen 3's"
    assert reasoning.TEMPLATE_KWARGS not in read(thinking={"type": "enabled", "budget_tokens": 2048}).params


def test_tool_use_and_tool_result_blocks_carry_a_conversation_on_as_a_chats_calls():
    call = read(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": "x"},
                {"type": "redacted_thinking", "data": "..."},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    )  # fmt: skip

    assert call.input[1:] == [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
            ],
            reasoning.TEMPLATE_FIELD: "Ask the tool.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert reasoning.CONTINUE_FINAL not in call.params, "the user's turn is last: answered"
    prefill = read(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}])
    assert prefill.params[reasoning.CONTINUE_FINAL] is True, "the assistant's words last: continued, as Anthropic's"
    results_alone = read(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}])
    assert results_alone.input == [{"role": "tool", "tool_call_id": "t", "content": ""}]


def test_tools_a_choice_and_an_output_format_are_read_as_a_chats():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    named = read(tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"}).params
    one = read(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}).params
    held = read(output_config={"format": {"type": "json_schema", "schema": schema}}).params
    beta = read(output_format={"type": "json_schema", "schema": schema}, speed="fast").params  # `speed` no typo

    assert named[tools.TOOLS][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert named[tools.TOOL_CHOICE] == "weather"
    assert one[tools.TOOL_CHOICE] == tools.REQUIRED and one[tools.PARALLEL] is False
    assert held[sampling.JSON_SCHEMA] == schema and held[sampling.SCHEMA_FIELD] == "output_config.format"
    assert beta[sampling.JSON_SCHEMA] == schema and beta[sampling.SCHEMA_FIELD] == "output_format"
    assert read(tool_choice={"type": "none"}, tools=[WEATHER]).params[tools.TOOL_CHOICE] == tools.NONE


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": None}, "max_tokens: required"),
        ({"max_tokens": 0}, "max_tokens: required"),
        ({"max_tokns": 5}, "max_tokns: unknown field; did you mean 'max_tokens'?"),
        ({"messages": []}, "messages: required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: must be one of user, assistant"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content: required"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content: contains a lone surrogate"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "weather", "input": [1]}]}
                ]
            },
            "messages.0.content.0.input",
        ),
        ({"system": [{"type": "image"}]}, "system.0"),
        ({"stop_sequences": ["a"] * 5}, "stop_sequences: must be"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: 'web_search_20250305'"),
        ({"tools": [{**WEATHER, "input_schema": "x"}]}, "tools.0.input_schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice: must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "clock"}}, "tool_choice"),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format: must be"),
        ({"output_format": {"type": "json_schema", "schema": 5}}, "output_format"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers: not supported"),
        (
            {
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "any"},
            },
            "messages.1: an answer held to a format or a call begins anew",
        ),
        ({"temperature": 9}, "temperature"),
    ],
)
def test_bad_input_is_refused_naming_the_messages_field(body, field):
    assert refusal(**body).startswith(field)


def answered(text: str, finish: str = "stop", **output: Any) -> tuple[Request, Request]:
    params = read(tools=[WEATHER]).params
    asked = Request(id="r-1", deployment="tiny", kind="chat", input=[], params=params, created_at=5.0)
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    done = Request(**{**asked.__dict__, "output": {"text": text, "finish_reason": finish, "usage": usage, **output}})
    return done, asked


def test_an_answer_is_content_blocks_and_its_stop_reason_says_how_it_ended():
    hermes = '<think>Check.</think>Looking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    called = MessagesView().body([answered(hermes)[0]], [answered(hermes)[1]], "tiny")
    cut = MessagesView().body([answered("It is", "length")[0]], [answered("")[1]], "tiny")
    done, asked = answered("It is", "length")
    asked = Request(**{**asked.__dict__, "params": {**asked.params, sampling.MAX_TOKENS_BOUND: 3}})
    at_bound = MessagesView().body([done], [asked], "tiny")
    stopped = MessagesView().body([answered("It is", stop_reason="\n\n")[0]], [answered("")[1]], "tiny")
    ended = MessagesView().body([answered("")[0]], [answered("")[1]], "tiny")

    assert called["id"] == "msg_r1" and called["type"] == "message" and called["role"] == "assistant"
    thinking, text, call = called["content"]
    assert thinking == {"type": "thinking", "thinking": "Check.", "signature": ""}
    assert text == {"type": "text", "text": "Looking."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["input"] == {"city": "Oslo"}
    assert (called["stop_reason"], called["stop_sequence"]) == ("tool_use", None)
    assert called["usage"] == {
        "input_tokens": 7,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    # 3 tokens of the 64 asked: cut by the room its replica had, not by max_tokens.
    assert cut["stop_reason"] == "model_context_window_exceeded" and cut["content"] == [
        {"type": "text", "text": "It is"}
    ]
    assert at_bound["stop_reason"] == "max_tokens", "its 3 tokens all it asked"
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert ended["stop_reason"] == "end_turn" and ended["content"] == [{"type": "text", "text": ""}]


def streamed(monkeypatch, pieces: list[str], text: str, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) of a message streamed from `pieces`, its request ending with `text`."""
    call = read(stream=True, **body)
    asked = Request(id="r-2", deployment="tiny", kind="chat", input=[], params=call.params)
    final = Request(**{**asked.__dict__, "status": "done", "output": {"text": text, "finish_reason": "stop"}})

    def follow(*args: Any) -> Any:
        yield from (_Said(0, text=piece) for piece in pieces)
        yield _Said(0, ended=True, final=final)

    monkeypatch.setattr(one_stream, "_follow", follow)
    sent = b"".join(MessagesView().events([asked], call)).decode()
    events = []
    for chunk in sent.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert events[-1][0] == events[-1][1]["type"], "each event named as its data's type"
    return events


def test_a_stream_sends_thinking_then_text_as_they_come_and_a_call_whole_at_its_end(monkeypatch):
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    pieces = ["<think>\nHm", "m.</th", "ink>\n\nLooking. ", call]
    events = streamed(monkeypatch, pieces, "".join(pieces), tools=[WEATHER])
    kinds = [name for name, _ in events]

    assert kinds[0] == "message_start" and events[0][1]["message"]["content"] == []
    assert kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [(data["index"], data["delta"]) for name, data in events if name == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "Hm"}),
        (0, {"type": "thinking_delta", "thinking": "m."}),
        (1, {"type": "text_delta", "text": "Looking. "}),
        (2, {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}),
    ], "the call's tag never sent as text"
    started = [(data["index"], data["content_block"]["type"]) for name, data in events if name == "content_block_start"]
    assert started == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    stopped = [data["index"] for name, data in events if name == "content_block_stop"]
    assert stopped == [0, 1, 2], "each block closed before the next opened"
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_a_stream_closed_before_its_end_stops_its_request(monkeypatch):
    call = read(stream=True)
    asked = Request(id="r-3", deployment="tiny", kind="chat", input=[], params=call.params)
    stopped: list[list[str]] = []

    def follow(*args: Any) -> Any:
        while True:  # a long answer, still coming
            yield _Said(0, text="word ")

    monkeypatch.setattr(one_stream, "_follow", follow)
    monkeypatch.setattr(one_stream, "_stop", lambda requests, why: stopped.append([r.id for r in requests]))
    events = MessagesView().events([asked], call)
    for _ in range(3):
        next(events)
    assert stopped == []
    events.close()  # as the server closes it when a write to a gone client fails

    assert stopped == [["r-3"]]


def test_errors_come_in_anthropics_shape_their_headers_kept():
    with_headers = JsonResponse({"error": {"message": "slow down", "type": "requests"}}, status=429)
    with_headers["Retry-After"] = "3"

    converted = MessagesView().reshaped(429, with_headers)
    plain = MessagesView().reshaped(404, {"error": {"message": "The model `x` does not exist.", "type": "x"}})

    assert json.loads(converted.content) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert converted["Retry-After"] == "3" and converted.status_code == 429
    assert plain == {"type": "error", "error": {"type": "not_found_error", "message": "The model `x` does not exist."}}


# -- served, through Anthropic's client --------------------------------------------------------


@pytest.fixture
def claude(live_server, replica) -> Iterator[anthropic.Anthropic]:  # noqa: F811
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    with anthropic.Anthropic(base_url=live_server.url, api_key=key, max_retries=0, timeout=30) as client:
        yield client


def test_a_thinking_budget_is_the_most_tokens_an_answer_may_think_and_a_bad_one_is_refused_naming_it():
    assert read(thinking={"type": "enabled", "budget_tokens": 2048}).params[reasoning.THINKING_BUDGET] == 2048
    assert reasoning.THINKING_BUDGET not in read(thinking={"type": "disabled"}).params
    assert reasoning.THINKING_BUDGET not in read(thinking={"type": "enabled"}).params, "no budget: unbounded"
    assert reasoning.THINKING_BUDGET not in read().params
    for bad in ("lots", 0, True, 2.5):
        assert refusal(thinking={"type": "enabled", "budget_tokens": bad}) == (
            "thinking.budget_tokens: must be a whole number of at least 1"
        )


@pytest.fixture
def served_tags(replica) -> Iterator[Any]:  # noqa: F811
    """`served`, over a tiny Llama whose tokenizer has the thinking's tags as tokens of their own."""
    from tests.scheduling.test_openai import _serving
    from tests.scheduling.test_reasoning import thinking_model

    model, tokenizer = thinking_model()
    yield from _serving(replica, model, tokenizer)


def test_a_thinking_budget_closes_a_reasoning_models_thinking_and_its_answer_follows(claude, served_tags):
    asked = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}]}

    budgeted = claude.messages.create(**asked, thinking={"type": "enabled", "budget_tokens": 3})
    unbounded = claude.messages.create(**asked, thinking={"type": "enabled", "budget_tokens": 1024})

    assert [block.type for block in budgeted.content] == ["thinking", "text"], "closed at 3: the answer follows"
    assert budgeted.stop_reason == "max_tokens" and budgeted.content[1].text
    assert [block.type for block in unbounded.content] == ["thinking"], "within its budget, cut by max_tokens"
    assert unbounded.content[0].thinking.startswith(budgeted.content[0].thinking), "the same thinking, longer"


def test_anthropics_client_gets_a_message_streams_it_and_is_refused_in_its_own_errors(claude, served, live_server):  # noqa: F811
    asked = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Once upon a time"}]}

    said = claude.messages.create(**asked, system="Be brief.")
    with claude.messages.stream(**asked, system="Be brief.") as stream:
        texts = list(stream.text_stream)
    built = stream.get_final_message()
    stop = said.content[0].text[2:5]
    stopped = claude.messages.create(**asked, system="Be brief.", stop_sequences=[stop])
    # Claude Code's max_tokens, far past what this replica holds: fitted to its room.
    long = claude.messages.create(**{**asked, "max_tokens": 32_000})
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**asked, tools=[{"type": "bash_20250124", "name": "bash"}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(**{**asked, "model": "tinny"})
    with (
        anthropic.Anthropic(base_url=live_server.url, api_key="wrong", max_retries=0) as stranger,
        pytest.raises(anthropic.AuthenticationError) as unknown,
    ):
        stranger.messages.create(**asked)
    # Anthropic's own header for the key, as Claude Code and curl examples send it.
    by_header = urllib.request.Request(
        f"{live_server.url}/v1/messages",
        data=json.dumps({**asked, "system": "Be brief."}).encode(),
        headers={"Content-Type": "application/json", "x-api-key": claude.api_key, "anthropic-version": "2023-06-01"},
    )
    with urllib.request.urlopen(by_header, timeout=30) as answer:
        plain = json.loads(answer.read())
    listed = list(claude.models.list())  # its paging reads has_more
    one = claude.models.retrieve("tiny")

    assert said.type == "message" and said.role == "assistant" and said.model == "tiny"
    assert said.stop_reason == "max_tokens" and said.usage.output_tokens == 8 and said.usage.input_tokens > 0
    assert len(texts) > 1 and "".join(texts) == said.content[0].text, "greedy: the same text, as it came"
    assert built.usage.output_tokens == 8 and said.usage.cache_read_input_tokens == 0
    # The same prompt again: its replica's prefix cache held all but its last block, which Anthropic's
    # usage counts apart from the tokens read anew.
    assert built.usage.input_tokens + built.usage.cache_read_input_tokens == said.usage.input_tokens
    assert built.usage.cache_read_input_tokens > 0
    assert built.stop_reason == "max_tokens" and built.content[0].text == said.content[0].text
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == said.content[0].text[: said.content[0].text.find(stop)]
    assert long.usage.output_tokens > 8 and long.stop_reason in ("model_context_window_exceeded", "end_turn")
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": refused.value.body["error"]["message"]},
    }
    assert refused.value.body["error"]["message"].startswith("tools.0.type: 'bash_20250124' is not served here")
    assert missing.value.body["error"]["type"] == "not_found_error" and "did you mean `tiny`?" in str(missing.value)
    assert unknown.value.body["error"]["type"] == "authentication_error"
    assert plain["content"][0]["text"] == said.content[0].text
    assert [(m.id, m.type, m.display_name) for m in listed] == [("tiny", "model", "tiny")]
    assert one.max_input_tokens == Deployment.objects.get(name="tiny").max_tokens and one.created_at.year >= 2026


def test_anthropics_client_calls_a_tool_and_reads_its_result(claude, served_longer):  # noqa: F811
    convert = {
        "name": "convert",
        "input_schema": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "kelvin"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    }
    asked = {"model": "tiny", "max_tokens": 600, "tools": [convert], "messages": [{"role": "user", "content": "Go"}]}

    called = claude.messages.create(**asked, tool_choice={"type": "tool", "name": "convert"})
    with claude.messages.stream(**asked, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        kinds = [event.type for event in stream]
    built = stream.get_final_message()
    (use,) = called.content
    answered = claude.messages.create(
        model="tiny",
        max_tokens=4,
        tools=[convert],
        tool_choice={"type": "none"},
        messages=[
            *asked["messages"],
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "273 K"}]},
        ],
    )

    assert use.type == "tool_use" and use.name == "convert" and use.input["unit"] in ("celsius", "kelvin")
    assert called.stop_reason == "tool_use" and use.id.startswith("toolu_")
    assert kinds[0] == "message_start" and "content_block_stop" in kinds and kinds[-1] == "message_stop"
    (streamed_use,) = built.content
    assert streamed_use.type == "tool_use" and streamed_use.input == use.input, "greedy: the same call, its JSON read"
    assert built.stop_reason == "tool_use"
    assert answered.content[0].type == "text" and answered.stop_reason in ("max_tokens", "end_turn")


def test_a_reasoning_models_thinking_is_a_thinking_block(claude, served_thinking):  # noqa: F811
    asked = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}

    said = claude.messages.create(**asked)
    with claude.messages.stream(**asked) as stream:
        thought = "".join(event.thinking for event in stream if event.type == "thinking")

    (block,) = said.content
    assert block.type == "thinking" and block.thinking and said.stop_reason == "max_tokens"
    assert thought == block.thinking, "streamed as thinking deltas, the same thinking"
    assert stream.get_final_message().content[0].thinking == block.thinking


def test_a_stream_whose_request_fails_ends_with_an_error_event(claude, served):  # noqa: F811
    with (
        pytest.raises(anthropic.APIStatusError) as failed,
        claude.messages.stream(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "word " * 2000}]
        ) as stream,
    ):
        list(stream)

    assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"] == "invalid_request_error"
    assert "too long" in failed.value.body["error"]["message"]


def test_a_key_that_is_wrong_in_x_api_key_is_refused_in_anthropics_shape(live_server, replica):  # noqa: F811
    call = urllib.request.Request(
        f"{live_server.url}/v1/messages",
        data=b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}',
        headers={"Content-Type": "application/json", "x-api-key": "wrong"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(call, timeout=30)

    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["type"] == "authentication_error"
