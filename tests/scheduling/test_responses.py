"""OpenAI's Responses API (`/v1/responses`) as the portal reads it: a body into a chat's, each
refusal naming the Responses field, and an answer as a response's output items. Pure: no server
(served through OpenAI's client: tests/scheduling/test_openai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuportal.wire import sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api.completion_input import Refused
from scheduling.api.responses import ResponsesView

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def read(**body: Any) -> Any:
    return ResponsesView().parse({"model": "tiny", "input": "Hi", **body}, owner="1")


def refusal(**body: Any) -> str:
    with pytest.raises(Refused) as refused:
        read(**body)
    return str(refused.value)


def test_a_string_is_the_users_message_and_instructions_come_first_as_the_systems():
    call = read(instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_k=3)

    assert call.input == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert call.params["max_tokens"] == 9 and call.params["temperature"] == 0.5 and call.params["top_k"] == 3
    assert call.params["instructions"] == "Be brief.", "kept: a call that goes on from this one leaves them out"


def test_items_become_the_chat_a_template_reads_calls_joined_to_the_assistants_message():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]

    messages = read(input=items, tools=[WEATHER]).input

    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert messages[3:] == [
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
    ]


def test_function_tools_a_format_and_a_choice_are_read_as_a_chats():
    named = read(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}).params
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    held = read(text={"format": {"type": "json_schema", "name": "n", "schema": schema}}).params

    assert named[tools.TOOLS] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert named[tools.TOOL_CHOICE] == "weather" and named[sampling.JSON_SCHEMA]["properties"]["name"] == {
        "enum": ["weather"]
    }
    assert held[sampling.JSON_SCHEMA] == schema and held[sampling.SCHEMA_FIELD] == "text.format"
    assert sampling.JSON_SCHEMA not in read(text={"format": {"type": "text"}}).params


def test_bad_input_is_refused_naming_the_responses_field():
    assert refusal(input=[]).startswith("input: required")
    assert refusal(input=[{"role": "robot", "content": "x"}]).startswith("input.0.role: must be one of")
    assert refusal(input=["Hi", {"role": "user", "content": [{"type": "input_image"}]}]).startswith("input.0: must be")
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    assert refusal(input=[image]) == (
        "input.0.content.0: a part of type 'input_image' is not supported: the models served here read text parts only"
    )
    broken = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{"}
    assert refusal(input=[broken]).startswith("input.0.arguments: ")
    assert refusal(input=[{"type": "reasoning", "summary": []}]).startswith("input.0.type: 'reasoning' is not served")
    assert refusal(tools=[{"type": "web_search"}]) == (
        "tools.0.type: 'web_search' is not served here: only function tools, which the caller runs"
    )
    no_schema = {"type": "function", "name": "f", "parameters": [1]}
    assert refusal(tools=[no_schema]) == "tools.0.parameters: must be a JSON Schema object"
    assert refusal(tools=[WEATHER], tool_choice={"type": "function", "name": "stocks"}).startswith("tool_choice: ")
    assert refusal(max_output_tokens=0).startswith("max_output_tokens: must be a whole number")
    assert refusal(text={"format": {"type": "json_schema", "schema": 3}}).startswith("text.format")
    assert refusal(instructions=7) == "instructions: must be a string"
    assert refusal(max_output_token=5) == "max_output_token: unknown field; did you mean 'max_output_tokens'?"
    assert refusal(background=True).startswith("background: not supported")
    assert refusal(previous_response_id="chatcmpl-1") == "previous_response_id: must be the id of a response (resp_...)"
    assert refusal(temperature=-1).startswith("temperature: ")
    assert read(store=False, metadata={"a": "b"}, truncation="disabled", user="u").input[-1]["content"] == "Hi"


def test_an_answer_is_a_message_and_a_function_call_item_for_each_call_it_makes():
    params = read(tools=[WEATHER]).params
    asked = Request(id="r-1", deployment="tiny", kind="chat", input=[], params=params, created_at=5.0)
    hermes = 'Looking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    done = Request(**{**asked.__dict__, "output": {"text": hermes, "finish_reason": "stop", "usage": usage}})
    cut = Request(**{**asked.__dict__, "output": {"text": "It is", "finish_reason": "length", "usage": usage}})

    answer = ResponsesView().body([done], [asked], "tiny")
    short = ResponsesView().body([cut], [asked], "tiny")

    assert answer["id"] == "resp_r-1" and answer["object"] == "response" and answer["status"] == "completed"
    message, call = answer["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Looking."
    assert call["type"] == "function_call" and call["name"] == "weather" and call["arguments"] == '{"city": "Oslo"}'
    assert call["call_id"].startswith("call_") and answer["usage"]["input_tokens"] == 7
    assert answer["tools"] == [WEATHER] and answer["tool_choice"] == "auto"
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in short["output"]] == ["message"] and short["output"][0]["status"] == "incomplete"


def test_a_streams_end_sends_the_text_it_held_back_then_the_calls_whole():
    from scheduling.api.responses import _message

    view = ResponsesView()
    params = read(tools=[WEATHER]).params
    asked = Request(id="r-2", deployment="tiny", kind="chat", input=[], params=params)

    def ending(text: str, fed: list[str]) -> list[dict[str, Any]]:
        watch = tools.Watch()
        sent = "".join(watch.feed(piece) for piece in fed)
        final = Request(**{**asked.__dict__, "status": "done", "output": {"text": text, "finish_reason": "stop"}})
        answer = view.body([final], [asked], "tiny")

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, **fields}

        return list(view._ending(event, answer, final, sent, watch, _message(asked, "", "in_progress")))

    # A tail that might have begun a call's tag, kept back while the stream ran: sent at the end.
    kept = ending("Sunny <to", ["Sunny ", "<to"])
    assert [e["delta"] for e in kept if e["type"] == "response.output_text.delta"] == ["<to"]
    assert [e["text"] for e in kept if e["type"] == "response.output_text.done"] == ["Sunny <to"]
    assert kept[-1]["type"] == "response.completed"
    assert kept[-1]["response"]["output"][0]["content"][0]["text"] == "Sunny <to"
    # Text, then a call: the text was sent, the call comes whole, after the message.
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    called = ending(f"Looking. {call}", ["Looking. ", call])
    kinds = [e["type"] for e in called]
    assert kinds[kinds.index("response.output_item.done") + 1 :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" not in kinds, "nothing of the text was left to send"
    added = called[kinds.index("response.output_item.added")]
    assert added["output_index"] == 1 and added["item"]["arguments"] == "" and added["item"]["name"] == "weather"
    assert [item["type"] for item in called[-1]["response"]["output"]] == ["message", "function_call"]
