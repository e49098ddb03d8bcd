"""Function calling (OpenAI's `tools` and `tool_choice`) as the portal reads it: the functions and
the choice as a chat's body gives them, the calls read out of an answer in the forms models
write them, and the functions shown to a model through its chat template. Pure: no server (the
calls made through `/v1` by a served model: tests/scheduling/test_openai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuportal.wire import sampling, tools
from gpuportal.wire.tools import Call, calls_in
from inference.errors import BadInput
from inference.serving import Executor
from scheduling.api import completion_input

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "time"}}
ASKED = [{"role": "user", "content": "Weather in Oslo?"}]


def read(**body: Any) -> completion_input.Completion:
    return completion_input.parse(
        {"model": "tiny", "messages": ASKED, **body}, "chat", default_timeout_s=30, max_timeout_s=300
    )


def refusal(kind: completion_input.Kind = "chat", **body: Any) -> str:
    with pytest.raises(completion_input.Refused) as refused:
        completion_input.parse(
            {"model": "tiny", "messages": ASKED, "prompt": "x", **body}, kind, default_timeout_s=30, max_timeout_s=300
        )
    return str(refused.value)


def test_calls_are_read_in_the_forms_models_write_them_and_other_text_is_left_alone():
    known = ["weather", "time"]

    hermes = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert calls_in(hermes, known) == ("Let me look.", [Call("weather", '{"city": "Oslo"}')])
    two = '<tool_call>{"name": "time", "arguments": {}}</tool_call><tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'  # noqa: E501
    assert calls_in(two, known) == (None, [Call("time", "{}"), Call("weather", '{"city": "Rome"}')])
    mistral = '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]'
    assert calls_in(mistral, known) == (None, [Call("weather", '{"city": "Oslo"}')])
    llama = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert calls_in(llama, known) == (None, [Call("weather", '{"city": "Oslo"}')])
    # Granite's and Mistral's lists once their special tokens are left out of the text.
    bare = '[{"name": "time", "arguments": {}}, {"name": "weather", "arguments": {"city": "Bergen"}}]'
    assert calls_in(bare, known) == (None, [Call("time", "{}"), Call("weather", '{"city": "Bergen"}')])
    pythonic = """ [weather(city='Oslo', days=-2, at={"hours": [9, 12.5]}, exact=true, fog=None), time()]"""
    assert calls_in(pythonic, known) == (
        None,
        [Call("weather", '{"city": "Oslo", "days": -2, "at": {"hours": [9, 12.5]}, "exact": true, "fog": null}'),
         Call("time", "{}")],
    )  # fmt: skip
    for text in (
        "It is sunny in Oslo.",
        '{"name": "stocks", "arguments": {}}',  # a function it was not given
        '{"answer": 42}',  # JSON, but no call
        '<tool_call>{"name": "weather", "arguments": {</tool_call>',  # a call cut short
        '{"name": "weather", "arguments": [1]}',
        "[weather('Oslo')]",  # by position: which parameter is it?
        "[weather(**{'city': 'Oslo'})]",
        "[weather(city=open('/etc/passwd').read())]",  # nothing of an answer is run
        "[weather(city=1 + 2)]",
        "[stocks(), time()]",
        "[weather(city='Oslo')",  # cut short
        "[]",
        "[1, 2]",
        "[" * 5000 + "]" * 5000,  # deeper than the parser goes
    ):
        assert calls_in(text, known) == (text, []), text


def test_a_chat_keeps_its_tools_and_a_named_or_required_choice_holds_the_answer_to_one_call():
    auto = read(tools=[WEATHER, TIME]).params
    named = read(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "weather"}}).params
    required = read(tools=[WEATHER, TIME], tool_choice="required").params

    assert auto[tools.TOOLS] == [WEATHER, TIME] and auto[tools.TOOL_CHOICE] == "auto"
    assert sampling.JSON_SCHEMA not in auto, "auto: the model answers freely"
    assert named[tools.TOOL_CHOICE] == "weather" and named[sampling.SCHEMA_FIELD] == "tools"
    assert named[sampling.JSON_SCHEMA] == {
        "type": "object",
        "properties": {"name": {"enum": ["weather"]}, "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    # Required: a list of one or more calls, each of any of the functions (what vLLM holds it to).
    calls = required[sampling.JSON_SCHEMA]
    assert calls["type"] == "array" and calls["minItems"] == 1 and "maxItems" not in calls
    assert [one["properties"]["name"] for one in calls["items"]["anyOf"]] == [{"enum": ["weather"]}, {"enum": ["time"]}]
    assert calls["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    # Not parallel: one call, and the queue keeps that for an auto answer too.
    one = read(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).params
    assert one[sampling.JSON_SCHEMA] == calls["items"] and one[tools.PARALLEL] is False
    assert read(tools=[WEATHER], parallel_tool_calls=False).params[tools.PARALLEL] is False
    assert tools.PARALLEL not in read(tools=[WEATHER], parallel_tool_calls=True).params, "the default is not kept"
    assert tools.PARALLEL not in read(parallel_tool_calls=False).params, "no tools: nothing to call"
    assert read(tools=[WEATHER], tool_choice="none").params[tools.TOOL_CHOICE] == "none"
    assert tools.TOOLS not in read(tools=[], tool_choice="auto").params, "no tools: a plain chat"


def test_bad_tools_and_choices_are_refused_naming_the_field():
    assert refusal("generate", tools=[WEATHER]).startswith("tools: only in a chat")
    assert refusal(tools={"weather": WEATHER}).startswith("tools: must be a non-empty list")
    assert refusal(tools=[{"type": "function", "function": {"name": "a b"}}]).startswith("tools.0.function.name: ")
    assert refusal(tools=[WEATHER, WEATHER]) == "tools.1.function.name: weather is given twice"
    no_schema = {"type": "function", "function": {"name": "f", "parameters": [1]}}
    assert refusal(tools=[no_schema]) == "tools.0.function.parameters: must be a JSON Schema object"
    assert refusal(tools=[{"type": "retrieval"}]).startswith("tools.0: must be")
    named_other = {"type": "function", "function": {"name": "stocks"}}
    assert refusal(tools=[WEATHER], tool_choice=named_other) == (
        "tool_choice: names stocks, which is not among the tools given (weather)"
    )
    assert refusal(tool_choice="required") == "tool_choice: asks for a call, but no tools were given"
    assert refusal(tools=[WEATHER], tool_choice="maybe").startswith("tool_choice: must be")
    assert refusal(tools=[WEATHER], parallel_tool_calls="no") == "parallel_tool_calls: must be true or false"
    assert refusal(parallel_tool_calls=1) == "parallel_tool_calls: must be true or false"
    assert refusal(tools=[WEATHER], response_format={"type": "json_object"}).startswith("tools: one format at a time")
    assert refusal(functions=[WEATHER["function"]]).startswith("functions: not supported")


def test_past_calls_and_what_the_tools_said_are_read_for_the_chat_template():
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    }
    said = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}

    messages = read(messages=[*ASKED, called, said], tools=[WEATHER]).input

    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
        ],
    }
    assert messages[2] == said
    quiet = read(messages=[*ASKED, {"role": "assistant", "content": None, "tool_calls": []}, *ASKED]).input
    assert quiet[1] == {"role": "assistant", "content": ""}
    broken = {**called, "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{"}}]}
    with pytest.raises(completion_input.Refused, match=r"^messages\.1\.tool_calls\.0\.function\.arguments: "):
        read(messages=[*ASKED, broken])


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from inference.management.commands.make_tiny_model import build_tokenizer

    return build_tokenizer()


SHOWS = (
    "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
)
REFUSES = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool messages here') }}{% endif %}"
    "{% endfor %}"
)


def test_the_model_sees_the_functions_through_its_template_and_a_template_that_refuses_is_the_callers_to_fix(
    tokenizer, monkeypatch
):
    plain = Executor(None, tokenizer)
    # No template: a transcript, the functions first, a past call as Hermes' template writes it.
    past = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "time", "arguments": {}}}]}
    assert plain.chat_prompt([*ASKED, past], [TIME]).splitlines() == [
        'tools: [{"name": "time"}]',
        "user: Weather in Oslo?",
        'assistant: <tool_call>{"name": "time", "arguments": {}}</tool_call>',
        "assistant:",
    ]

    monkeypatch.setattr(tokenizer, "chat_template", SHOWS, raising=False)
    assert plain.chat_prompt(ASKED, [WEATHER, TIME]) == "[weather][time]user:Weather in Oslo?;"
    monkeypatch.setattr(tokenizer, "chat_template", REFUSES, raising=False)
    with pytest.raises(BadInput, match=r"^messages: the model's chat template refused them: no tool messages here"):
        plain.chat_prompt([*ASKED, {"role": "tool", "content": "sunny"}], None)


ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {  # as pydantic writes a model with a nested one (Instructor sends these)
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"size": {"enum": ["s", "m"]}},
                    "required": ["size"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
            "additionalProperties": False,
        },
    },
}


def test_a_call_of_parameters_with_definitions_finds_them_where_their_refs_look(tokenizer):
    from inference.constrained import held_to

    schema = read(tools=[ORDER], tool_choice="required", parallel_tool_calls=False).params[sampling.JSON_SCHEMA]
    end = tokenizer.eos_token_id
    held = held_to(tokenizer, len(tokenizer), [end], schema=schema)
    assert held.wait(30)
    call = tokenizer.encode('{"name": "order", "arguments": {"item": {"size": "m"}}}', add_special_tokens=False)

    for length in range(len(call)):
        assert call[length] in held(call[:length]), tokenizer.decode(call[: length + 1])
    after = held(call)
    assert end in after and all(not tokenizer.decode([t]).strip() for t in after if t != end), "whole: it may end"
    assert schema["$defs"] == ORDER["function"]["parameters"]["$defs"]
    assert "$defs" not in schema["properties"]["arguments"]
    other = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"Item": {"type": "string"}}}}}
    assert refusal(tools=[ORDER, other], tool_choice="required") == (
        "tools: two functions define $defs.Item differently: one call cannot tell them apart"
    )


def test_a_required_choice_holds_the_answer_to_a_list_of_one_or_more_calls_each_of_a_function_given(tokenizer):
    from inference.constrained import held_to

    schema = read(tools=[WEATHER, TIME], tool_choice="required").params[sampling.JSON_SCHEMA]
    end = tokenizer.eos_token_id
    held = held_to(tokenizer, len(tokenizer), [end], schema=schema)
    assert held.wait(30)

    def allowed(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(ids[k] in held(ids[:k]) for k in range(len(ids)))

    two = '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]'
    assert allowed(two) and end in held(tokenizer.encode(two, add_special_tokens=False))
    assert allowed('[{"name": "time", "arguments": {}}]')
    assert not allowed("[]"), "at least one call"
    assert not allowed('[{"name": "stocks"'), "only functions given"
    assert not allowed('[{"name": "weather", "arguments": {"town"'), "held to the function's parameters"


def test_an_answer_not_parallel_makes_its_first_call_only():
    from gpuportal.wire.requestqueue import Request
    from scheduling.api.openai_compat import ChatCompletionsView

    both = '<tool_call>{"name": "time", "arguments": {}}</tool_call><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'  # noqa: E501
    made = {}
    for parallel in (True, False):
        params = read(tools=[WEATHER, TIME], parallel_tool_calls=parallel).params
        asked = Request(id="r-1", deployment="tiny", kind="chat", input=ASKED, params=params)
        message = ChatCompletionsView().choice({"text": both, "finish_reason": "stop"}, asked)["message"]
        made[parallel] = [call["function"]["name"] for call in message["tool_calls"]]

    assert made == {True: ["time", "weather"], False: ["time"]}


def test_a_stream_that_may_call_sends_its_text_until_it_opens_a_call_and_holds_the_rest():
    def sent(*pieces: str) -> tuple[list[str], tools.Watch]:
        watch = tools.Watch()
        return [watch.feed(piece) for piece in pieces], watch

    assert sent("It is", " sunny.")[0] == ["It is", " sunny."]
    assert sent("  ", "Hi")[0] == ["", "  Hi"], "whitespace waits for what follows it"
    assert sent("<tool", '_call>{"name"')[0] == ["", ""], "what may open a call waits, then is held"
    assert sent("{", '"name": "time"}')[0] == ["", ""]
    pieces, watch = sent("Let me look.<to", "ol_call>", "{}</tool_call>")
    assert pieces == ["Let me look.", "", ""] and watch.held and watch.sent == len("Let me look.")
    assert sent("a <to", "ol>")[0] == ["a ", "<tool>"], "a tail that might begin the tag is kept back, then sent"


def test_a_streams_last_chunk_carries_what_it_held_back_a_call_or_the_rest_of_its_text():
    from gpuportal.wire.requestqueue import Request
    from scheduling.api.openai_compat import ChatCompletionsView

    view = ChatCompletionsView()
    asked = Request(id="r-1", deployment="tiny", kind="chat", input=ASKED, params=read(tools=[WEATHER, TIME]).params)
    hermes = 'Let me look.\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'

    after_text = view.whole({"text": hermes, "finish_reason": "stop"}, asked, sent=len("Let me look.\n"), role=False)
    whole_call = view.whole({"text": '{"name": "time", "arguments": {}}', "finish_reason": "stop"}, asked)
    rest_of_text = view.whole({"text": "Sunny, I think.", "finish_reason": "length"}, asked, sent=5, role=False)

    assert after_text["finish_reason"] == "tool_calls" and "content" not in after_text["delta"]
    assert after_text["delta"]["tool_calls"][0]["function"] == {"name": "time", "arguments": "{}"}
    assert "role" not in after_text["delta"] and after_text["delta"]["tool_calls"][0]["index"] == 0
    assert whole_call["delta"]["role"] == "assistant" and whole_call["finish_reason"] == "tool_calls"
    assert rest_of_text == {"delta": {"content": ", I think."}, "logprobs": None, "finish_reason": "length"}
