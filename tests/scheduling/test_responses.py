"""OpenAI's Responses API (`/v1/responses`) as the portal reads it: a body into a chat's, each
refusal naming the Responses field, and an answer as a response's output items. Pure: no server
(served through OpenAI's client: tests/scheduling/test_openai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuportal.wire import sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api.completion_input import Refused
from scheduling.api.examples import RESPONSE
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
    call = read(instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_k=3, chat_template_kwargs={"x": 1})

    assert call.input == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert call.params["max_tokens"] == 9 and call.params["temperature"] == 0.5 and call.params["top_k"] == 3
    assert call.params["instructions"] == "Be brief.", "kept: a call that goes on from this one leaves them out"
    assert call.params["chat_template_kwargs"] == {"x": 1}


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


def test_reasoning_given_back_goes_to_the_assistants_message_that_follows_it():
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}
    summed = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Looked it up."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}

    messages = read(input=[{"role": "user", "content": "Hi"}, thought, said, summed, call]).input

    assert messages[1] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Hm."}
    assert messages[2]["reasoning_content"] == "Looked it up." and messages[2]["tool_calls"][0]["id"] == "c1", (
        "reasoning begins a turn of its own: the call is not joined to the message before it"
    )


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
    assert refusal(input=[{"type": "file_search_call", "id": "x"}]).startswith(
        "input.0.type: 'file_search_call' is not served"
    )
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
    assert refusal(background="yes") == "background: must be true or false"
    assert refusal(background=True, store=False).startswith("background: needs store")
    assert refusal(previous_response_id="chatcmpl-1") == "previous_response_id: must be the id of a response (resp_...)"
    assert refusal(temperature=-1).startswith("temperature: ")
    assert read(store=False, metadata={"a": "b"}, truncation="disabled", user="u").input[-1]["content"] == "Hi"
    assert refusal(store="no") == "store: must be true or false"


def test_a_response_asked_not_to_be_stored_says_so_in_its_params_and_a_stored_one_carries_nothing():
    assert read(store=False).params["store"] is False
    assert "store" not in read(store=True).params and "store" not in read().params


def test_a_response_asked_in_the_background_says_so_in_its_params_and_a_foreground_one_carries_nothing():
    assert read(background=True).params["background"] is True
    assert "background" not in read(background=False).params and "background" not in read().params


def test_an_answer_is_a_message_and_a_function_call_item_for_each_call_it_makes():
    params = read(tools=[WEATHER]).params
    asked = Request(id="r-1", deployment="tiny", kind="chat", input=[], params=params, created_at=5.0)
    hermes = 'Looking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    done = Request(**{**asked.__dict__, "output": {"text": hermes, "finish_reason": "stop", "usage": usage}})
    cut = Request(**{**asked.__dict__, "output": {"text": "It is", "finish_reason": "length", "usage": usage}})

    answer = ResponsesView().body([done], [asked], "tiny")
    short = ResponsesView().body([cut], [asked], "tiny")

    assert answer["id"] == "resp_r-1" and answer["object"] == "response" and answer["status"] == "completed"
    assert set(answer) == set(RESPONSE) and set(answer["usage"]) == set(RESPONSE["usage"]), "the API docs' example"
    message, call = answer["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Looking."
    assert call["type"] == "function_call" and call["name"] == "weather" and call["arguments"] == '{"city": "Oslo"}'
    assert call["call_id"].startswith("call_") and answer["usage"]["input_tokens"] == 7
    assert answer["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert answer["tools"] == [WEATHER] and answer["tool_choice"] == "auto"
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in short["output"]] == ["message"] and short["output"][0]["status"] == "incomplete"


def streamed(monkeypatch, pieces: list[str], text: str, **body: Any) -> list[dict[str, Any]]:
    """The events of a response streamed from `pieces`, its request ending with `text`."""
    import json

    from scheduling.api import one_stream
    from scheduling.api.openai_compat import _Said

    call = read(stream=True, **body)
    asked = Request(id="r-2", deployment="tiny", kind="chat", input=[], params=call.params)
    final = Request(**{**asked.__dict__, "status": "done", "output": {"text": text, "finish_reason": "stop"}})

    def follow(*args: Any) -> Any:
        yield from (_Said(0, text=piece) for piece in pieces)
        yield _Said(0, ended=True, final=final)

    monkeypatch.setattr(one_stream, "_follow", follow)
    sent = b"".join(ResponsesView().events([asked], call)).decode()
    return [json.loads(line.removeprefix("data: ")) for line in sent.splitlines() if line.startswith("data: ")]


def test_a_stream_sends_reasoning_then_text_as_they_come_and_what_it_held_back_at_its_end(monkeypatch):
    pieces = ["<think>\nHm", "m.</th", "ink>\n\nSunny <to"]
    events = streamed(monkeypatch, pieces, "".join(pieces), tools=[WEATHER])  # its answer may call
    kinds = [e["type"] for e in events]

    thought = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    said = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert thought == ["Hm", "m."] and said == ["Sunny ", "<to"], "a tail that may begin a call's tag, kept back"
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta"), (
        "the reasoning item closed before the message opened"
    )
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [i["type"] for i in final["output"]] == [
        "reasoning",
        "message",
    ]
    assert (
        final["output"][0]["content"][0]["text"] == "Hmm." and final["output"][1]["content"][0]["text"] == "Sunny <to"
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_stream_that_calls_sends_its_text_then_the_call_whole_after_the_message(monkeypatch):
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events = streamed(monkeypatch, ["Looking. ", call], f"Looking. {call}", tools=[WEATHER])
    kinds = [e["type"] for e in events]

    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Looking. "]
    assert kinds[kinds.index("response.output_item.done") + 1 :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[kinds.index("response.output_item.added", kinds.index("response.output_item.done"))]
    assert added["output_index"] == 1 and added["item"]["arguments"] == "" and added["item"]["name"] == "weather"
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message", "function_call"]


def test_a_stream_closed_before_its_end_stops_its_request(monkeypatch):
    from scheduling.api import one_stream
    from scheduling.api.openai_compat import _Said

    call = read(stream=True)
    asked = Request(id="r-3", deployment="tiny", kind="chat", input=[], params=call.params)
    stopped: list[list[str]] = []

    def follow(*args: Any) -> Any:
        while True:  # a long answer, still coming
            yield _Said(0, text="word ")

    monkeypatch.setattr(one_stream, "_follow", follow)
    monkeypatch.setattr(one_stream, "_stop", lambda requests, why: stopped.append([r.id for r in requests]))
    events = ResponsesView().events([asked], call)
    for _ in range(5):
        next(events)
    assert stopped == []
    events.close()  # as the server closes it when a write to a gone client fails

    assert stopped == [["r-3"]]


def test_a_responses_input_items_are_its_own_input_read_back_from_its_chat(live_server, transactional_db):
    import json as json_module
    import urllib.error
    import urllib.request

    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    from scheduling.api.response_items import input_items

    call = read(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER],
    )
    asked = Request(id="r-4", deployment="tiny", kind="chat", input=call.input, params=call.params)

    items = input_items(asked)

    assert [item["type"] for item in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[0]["content"] == [{"type": "input_text", "text": "Weather in Oslo?"}], "not the instructions"
    assert (items[1]["call_id"], items[1]["name"], json_module.loads(items[1]["arguments"])) == (
        "call_1",
        "weather",
        {"city": "Oslo"},
    )
    assert (items[2]["call_id"], items[2]["output"]) == ("call_1", "Sunny")
    assert len({item["id"] for item in items}) == 4, "each its own id"

    key = Token.objects.create(user=User.objects.create_user("carol")).key
    for query, param in (("order=up", "order"), ("limit=0", "limit")):
        call_back = urllib.request.Request(
            f"{live_server.url}/v1/responses/resp_none/input_items?{query}", headers={"Authorization": f"Bearer {key}"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(call_back, timeout=10)
        body = json_module.loads(refused.value.read())
        assert (refused.value.code, body["error"]["param"]) == (400, param), "checked before anything is looked up"
