"""How a `POST /v1/messages` body (Anthropic's Messages API) is read into a chat's, as
/v1/chat/completions reads one: its turns of blocks into chat messages (with the field each came
from, which a refusal of the chat's names back: `renamed`), its tools, tool choice and output
format into a chat's; Refused naming the first Messages field that is wrong. The view is
scheduling.api.messages."""

from __future__ import annotations

import difflib
import json
from typing import Any

from gpuportal.wire import reasoning, sampling, tools
from scheduling.api.completion_input import Refused, content_text, message_origin, not_text

# The largest max_tokens taken: a bound only (the answer is fitted to the room its replica has),
# kept to what any client sends.
MOST_BOUND = 2**31 - 1

READ_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "tools", "tool_choice",
     "output_config", "output_format", "metadata", "thinking", "service_tier", "mcp_servers", "timeout",
     reasoning.TEMPLATE_KWARGS, *sampling.NAMES, *sampling.LISTED_NAMES}
)  # fmt: skip
# Anthropic's fields that change nothing a replica answers (how Anthropic routes, caches or
# bills a call), read as nothing; known, so that none is taken for a misspelling (`speed`, `seed`).
IGNORED_FIELDS = frozenset(
    {"speed", "inference_geo", "container", "diagnostics", "cache_control", "context_management"}
)  # fmt: skip
# Passed on to the chat as they are: the sampling parameters (Anthropic's temperature, top_p and
# top_k among them), chat_template_kwargs and the wait, as on /v1/chat/completions.
PASSED_ON = ("timeout", reasoning.TEMPLATE_KWARGS, *sampling.NAMES, *sampling.LISTED_NAMES)
ROLES = ("user", "assistant")
FORMAT_FIELD = "output_config.format"
TYPO_CUTOFF = 0.8


def chat_body(body: Any) -> tuple[dict[str, Any], list[str]]:
    """(the chat body a Messages body asks for, the field each of its messages came from);
    Refused naming the first Messages field that is wrong."""
    if not isinstance(body, dict):
        raise Refused(None, "the body must be a JSON object")
    for key in body:
        near = (
            difflib.get_close_matches(key, sorted(READ_FIELDS), n=1, cutoff=TYPO_CUTOFF)
            if key not in READ_FIELDS | IGNORED_FIELDS
            else []
        )
        if near:
            raise Refused(key, f"unknown field; did you mean {near[0]!r}?")
    bound = body.get("max_tokens")
    if type(bound) is not int or not 1 <= bound <= MOST_BOUND:
        raise Refused("max_tokens", "required: a whole number of at least 1, the most tokens the answer may have")
    if body.get("mcp_servers"):
        raise Refused("mcp_servers", "not supported: the models here reach no MCP server; give its tools as `tools`")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": content_text(body["system"], "system")})
        origins.append("system")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise Refused("messages", "required: a non-empty list of messages")
    for i, message in enumerate(given):
        _turn(message, f"messages.{i}", messages, origins)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and (last["content"] or "").strip():
        # A prefill: the answer continues the assistant's words, as Anthropic's does.
        chat[reasoning.CONTINUE_FINAL] = True
    for name in PASSED_ON:
        if name in body:
            chat[name] = body[name]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled" and reasoning.TEMPLATE_KWARGS not in body:
        # Told not to think: a reasoning model's template that can turn its thinking off (Qwen 3's
        # switch, as Ollama's `think: false` sets it). Enabled, a model thinks as its template has it.
        chat[reasoning.TEMPLATE_KWARGS] = {"enable_thinking": False}
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if not parallel:
            chat["parallel_tool_calls"] = False
    if (answer_format := _format(body.get("output_config"))) is not None:
        chat["response_format"] = answer_format
    elif body.get("output_format") is not None:  # the beta's name for it, before output_config
        chat["response_format"] = _format({"format": body["output_format"]}, "output_format")
    return chat, origins


def thinking_budget(thinking: Any) -> int | None:
    """The most tokens an answer's thinking may have: `thinking.budget_tokens` where `thinking` is
    enabled (Anthropic's), None otherwise; Refused naming it where it is no whole number from 1."""
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if why := reasoning.budget_problem(budget):
        raise Refused("thinking.budget_tokens", why)
    return budget


def _turn(message: Any, at: str, messages: list[dict[str, Any]], origins: list[str]) -> None:
    """A Messages turn as chat messages, appended with the field each came from: a user's
    tool_result blocks each a tool's message (first: a template reads them right after the call
    they answer), then its text; an assistant's text, thinking and tool_use blocks one message."""
    if not isinstance(message, dict):
        raise Refused(at, "must be an object: {role, content}")
    role = message.get("role")
    if role not in ROLES:
        raise Refused(f"{at}.role", f"must be one of {', '.join(ROLES)}")
    content = message.get("content")
    if not isinstance(content, list):
        if not sampling.is_text(content):
            raise Refused(f"{at}.content", not_text(content, "required: a string or a list of content blocks"))
        messages.append({"role": role, "content": content})
        origins.append(at)
        return
    if not content:
        raise Refused(f"{at}.content", "required: a string or a non-empty list of content blocks")
    texts: list[str] = []
    thought: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not sampling.is_text(block.get("text")):
                raise Refused(f"{where}.text", not_text(block.get("text"), "required: a string"))
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            messages.append(_tool_result(block, where))
            origins.append(where)
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "thinking" and role == "assistant":
            if not sampling.is_text(block.get("thinking")):
                raise Refused(f"{where}.thinking", not_text(block.get("thinking"), "required: a string"))
            thought.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # another model's thinking, encrypted: nothing a template could read
        else:
            what = f"a block of type {kind!r}" if isinstance(kind, str) else "a block that is no {type, ...} object"
            raise Refused(
                f"{where}.type" if isinstance(kind, str) else where,
                f"{what} is not served in a {role}'s turn: the models here read text, tool_use, tool_result "
                "and thinking blocks",
            )
    if role == "user":
        if texts:  # a turn of tool results alone is those results
            messages.append({"role": "user", "content": "\n".join(texts)})
            origins.append(at)
        return
    said: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        said["tool_calls"] = calls
    if thought:
        said[reasoning.TEMPLATE_FIELD] = "\n".join(thought)
    messages.append(said)
    origins.append(at)


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A tool_result block as a chat's tool message; an error result says so, as the model must
    read it."""
    if not sampling.is_text(block.get("tool_use_id")):
        raise Refused(f"{at}.tool_use_id", "required: the id of the tool_use it answers")
    given = block.get("content", "")
    text = "" if given == [] else content_text(given, f"{at}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A tool_use block (a call the assistant made) as a chat's assistant message lists a call."""
    for field in ("id", "name"):
        if not sampling.is_text(block.get(field)):
            raise Refused(f"{at}.{field}", "required: a string")
    given = block.get("input", {})
    if not isinstance(given, dict):
        raise Refused(f"{at}.input", "must be an object: the call's arguments")
    arguments = json.dumps(given, ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _tools(value: Any) -> Any:
    """Anthropic's client tools as a chat's functions (`input_schema` their `parameters`); a
    server tool (web search, code execution, a computer: a `type` of its own) is refused by name.
    What is no list is left for the chat's check to refuse."""
    if not isinstance(value, list):
        return value
    chat = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise Refused(f"tools.{i}", 'must be an object: {"name", "description", "input_schema"}')
        if tool.get("type", "custom") not in ("custom", None):
            raise Refused(
                f"tools.{i}.type",
                f"{tool['type']!r} is not served here: only client tools (a name and an input_schema), which the "
                "caller runs",
            )
        function = {key: tool[key] for key in ("name", "description") if tool.get(key) is not None}
        if tool.get("input_schema") is not None:
            function["parameters"] = tool["input_schema"]
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(value: Any) -> tuple[Any, bool]:
    """(a chat's tool_choice, whether the answer may make several calls)."""
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise Refused("tool_choice", 'must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None and type(parallel) is not bool:
        raise Refused("tool_choice.disable_parallel_tool_use", "must be a boolean")
    kind = value["type"]
    if kind == "tool":
        if not sampling.is_text(value.get("name")):
            raise Refused("tool_choice.name", "required: the name of a tool given")
        choice: Any = {"type": "function", "function": {"name": value["name"]}}
    else:
        choice = {"auto": tools.AUTO, "any": tools.REQUIRED, "none": tools.NONE}[kind]
    return choice, not parallel


def _format(value: Any, field: str = FORMAT_FIELD) -> dict[str, Any] | None:
    """`output_config.format` (or what `field` names) as a chat's response_format; None for text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Refused("output_config", 'must be {"format": {"type": "json_schema", "schema": {...}}}')
    answer_format = value.get("format")
    if answer_format is None:
        return None
    if not isinstance(answer_format, dict) or answer_format.get("type") != "json_schema":
        raise Refused(field, 'must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": answer_format.get("schema")}}


def renamed(param: str | None, origins: list[str]) -> str | None:
    """The Messages field of a chat field a refusal names."""
    if param is None:
        return None
    head = param.partition(".")[0]
    if head == "messages":
        return message_origin(param, origins, "messages")
    if head == reasoning.CONTINUE_FINAL:  # a prefill: the last turn, the assistant's
        return origins[-1]
    if head == "tools":
        return (
            param.replace(".function.parameters", ".input_schema").replace(".function.", ".").removesuffix(".function")
        )
    return {
        "stop": "stop_sequences",
        "max_completion_tokens": "max_tokens",
        "response_format": FORMAT_FIELD,
        "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    }.get(head, param)
