"""Functions a chat may call (OpenAI's `tools` and `tool_choice`), as the request queue keeps
them: the web checks them and reads the calls out of the answer, the replica shows them to the
model through its chat template. No Django: the web and the replicas import it alike.

How a call is made depends on `tool_choice`:

- a function named, or `required`: the answer is held to the JSON of its calls as it is
  generated (`call_schema`: `{"name": ..., "arguments": {...}}`, the arguments held to the
  function's parameters), so any model makes well-formed calls of functions it was given: one
  call of the function named; for `required` a list of one or more (OpenAI's
  `parallel_tool_calls`, true unless given false: then one);
- `auto` (the default where tools are given): the model answers freely, and a call it writes in
  the form its chat template taught it is read out of the text (`calls_in`): Hermes' and Qwen's
  `<tool_call>{...}</tool_call>`, Mistral's `[TOOL_CALLS][...]`, an answer that is a call's
  JSON alone or a list of them (Llama 3's `{"name": ..., "parameters": {...}}`; Granite's and
  Mistral's once their special tokens are left out of the text), or a Python list of calls
  (Llama 3.2's and 4's `[weather(city="Oslo"), time()]`); with `parallel_tool_calls` false only
  its first call is made;
- `none`: the answer is text, whatever it says.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuportal.wire.sampling import schema_problem

# Request queue params: the functions as OpenAI lists them ({"type": "function", "function":
# {"name", "description", "parameters"}}), and how the answer calls them: AUTO, REQUIRED or a
# function's name (NONE: the answer is text; kept, the model still sees the functions).
TOOLS = "tools"
TOOL_CHOICE = "tool_choice"
# Kept (False) only where the caller gave it false: the answer makes at most one call.
PARALLEL = "parallel_tool_calls"
AUTO, REQUIRED, NONE = "auto", "required", "none"
MOST_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function that declares no parameters takes any object.
ANY_ARGUMENTS: Mapping[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Call:
    """One call the answer makes: the function's name and its arguments as JSON text (OpenAI's
    `function.arguments` is a string)."""

    name: str
    arguments: str


def tools_problem(value: Any) -> tuple[str, str] | None:
    """(the field, why) where `value` cannot be a chat's `tools`; None where it can."""
    if not isinstance(value, list) or not value:
        return "tools", 'must be a non-empty list of {"type": "function", "function": {...}}'
    if len(value) > MOST_TOOLS:
        return "tools", f"at most {MOST_TOOLS} tools"
    seen: set[str] = set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            return f"tools.{i}", 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return f"tools.{i}.function.name", "must be 1 to 64 letters, digits, underscores or dashes"
        if name in seen:
            return f"tools.{i}.function.name", f"{name} is given twice"
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            return f"tools.{i}.function.description", "must be a string"
        parameters = function.get("parameters")
        if parameters is not None and (why := schema_problem(parameters)) is not None:
            return f"tools.{i}.function.parameters", why
    return None


def names(tools: Iterable[Mapping[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def choice_of(value: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """`tool_choice` as the queue keeps it (AUTO, REQUIRED, NONE or a function's name), its
    default where absent (AUTO with tools, NONE without); ValueError saying why it cannot be."""
    if value is None:
        return AUTO if tools else NONE
    if value in (AUTO, REQUIRED, NONE):
        if value == REQUIRED and not tools:
            raise ValueError("required asks for a call, but no tools were given")
        return str(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if name not in names(tools or ()):
        given = ", ".join(names(tools or ())) or "none"
        raise ValueError(f"names {name}, which is not among the tools given ({given})")
    return name


# Where a schema keeps the definitions its `$ref`s name ("#/$defs/Item"), as pydantic writes them.
_DEFINITIONS = ("$defs", "definitions")


def call_schema(tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True) -> dict[str, Any]:
    """The JSON Schema an answer that must call `choice` (a function's name, or REQUIRED: any of
    `tools`) is held to: one call, `{"name": ..., "arguments": {...}}`, or for REQUIRED and
    `parallel` a list of one or more (what vLLM holds it to). The parameters' definitions move to
    its root, where their `$ref`s ("#/$defs/...") look for them. ValueError where two functions
    define one name differently."""
    chosen = [tool["function"] for tool in tools if choice == REQUIRED or tool["function"]["name"] == choice]
    definitions: dict[str, dict[str, Any]] = {}
    each = []
    for function in chosen:
        parameters = dict(function.get("parameters") or ANY_ARGUMENTS)
        for key in _DEFINITIONS:
            for name, definition in (parameters.pop(key, None) or {}).items():
                kept = definitions.setdefault(key, {})
                if kept.setdefault(name, definition) != definition:
                    raise ValueError(f"two functions define {key}.{name} differently: one call cannot tell them apart")
        each.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [function["name"]]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = each[0] if len(each) == 1 else {"anyOf": each}
    if choice == REQUIRED and parallel:
        schema = {"type": "array", "items": schema, "minItems": 1}
    return {**schema, **definitions}


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


def calls_in(text: str, known: Iterable[str]) -> tuple[str | None, list[Call]]:
    """(what the answer says besides its calls, or None where nothing; the calls) of an answer
    `text`, reading the forms the module's docstring names. A call of a function not `known`, or
    one that is not a call's JSON, is no call: the answer is then text, as it was written."""
    known = set(known)
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = [_call(raw, known) for raw in tagged]
        if all(call is not None for call in calls):
            rest = _TAGGED.sub("", text).strip()
            return rest or None, [call for call in calls if call is not None]
        return text, []
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    if stripped.startswith(_MISTRAL):
        stripped = stripped[len(_MISTRAL) :].strip()
    if stripped.startswith(("{", "[")):
        try:
            parsed = _json(stripped)
        except ValueError:
            pythonic = _pythonic(stripped, known)
            return (None, pythonic) if pythonic else (text, [])
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call(item, known) for item in items]
        if items and all(call is not None for call in calls):
            return None, [call for call in calls if call is not None]
    return text, []


def _pythonic(text: str, known: set[str]) -> list[Call] | None:
    """The calls of a Python list of them (`[weather(city="Oslo"), time()]`), each of a known
    function, its arguments by keyword and literal; None where `text` is not that."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # what ast.parse raises on any text
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known):
            return None
        if node.args or any(keyword.arg is None for keyword in node.keywords):
            return None  # by position, or **: nothing names the parameter
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
        except ValueError:
            return None
        calls.append(Call(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


# JSON's words, which a model writing Python calls writes as often as Python's.
_JSON_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    """A Python literal's value as JSON holds it (a tuple as a list); ValueError for anything
    else (a name, a call, an operation): nothing of the answer is evaluated."""
    match node:
        case ast.Constant(value=str() | int() | float() | None as value):
            return value
        case ast.UnaryOp(op=ast.USub() | ast.UAdd(), operand=ast.Constant(value=int() | float() as value)):
            return -value if isinstance(node.op, ast.USub) else value
        case ast.Name(id=word) if word in _JSON_WORDS:
            return _JSON_WORDS[word]
        case ast.List(elts=items) | ast.Tuple(elts=items):
            return [_literal(item) for item in items]
        case ast.Dict(keys=keys, values=values):
            held = {}
            for key, value in zip(keys, values, strict=True):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise ValueError("a key that is not a string")
                held[key.value] = _literal(value)
            return held
    raise ValueError(f"not a literal: {ast.dump(node)[:40]}")


# What may open a call at an answer's start (the forms `calls_in` reads); Hermes' tag anywhere.
_OPENINGS = ("<tool_call>", _MISTRAL, _PYTHON_TAG, "{", "[")
_TAG = "<tool_call>"


class Watch:
    """What of an answer that may call functions (tool_choice auto) a stream sends as it comes:
    its text, until it opens a call. An answer that opens with one (a tag, `[TOOL_CALLS]`, JSON)
    is held from its start, one with text first is sent up to `<tool_call>`, and a tail that may
    begin that tag is kept back until it is told apart; what is held is read whole at the end
    (`unsent`)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # how much of `text` went out
        self.held = False

    def feed(self, piece: str) -> str:
        """The text to send now of `piece` and what was kept back before it ("" for none)."""
        self.text += piece
        if self.held:
            return ""
        if self.sent == 0:
            body = self.text.lstrip()
            if not body or any(opening.startswith(body) for opening in _OPENINGS if opening != body):
                return ""  # whitespace alone, or what may still open a call ("<tool")
            if body.startswith(_OPENINGS):
                self.held = True
                return ""
        at = self.text.find(_TAG, self.sent)
        if at >= 0:
            out, self.sent, self.held = self.text[self.sent : at], at, True
            return out
        end = len(self.text) - _tag_begun(self.text[self.sent :])
        out, self.sent = self.text[self.sent : end], end
        return out


def _tag_begun(text: str) -> int:
    """How many of `text`'s last characters may begin Hermes' tag (a proper prefix of it)."""
    return next((n for n in range(min(len(text), len(_TAG) - 1), 0, -1) if _TAG.startswith(text[-n:])), 0)


def unsent(text: str, sent: int, content: str | None) -> str:
    """What an answer that calls functions says besides its calls (`content`, as `calls_in` read
    it) that a stream has not sent, having sent `text[:sent]`."""
    if content is None:
        return ""
    return content if sent == 0 else _TAGGED.sub("", text[sent:]).strip()


def _json(text: str) -> Any:
    """`text`'s JSON; ValueError where it is not JSON, or nests deeper than the parser goes (a
    model's answer may be a thousand `[`)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _call(raw: Any, known: set[str]) -> Call | None:
    if isinstance(raw, str):
        try:
            raw = _json(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict) or raw.get("name") not in known:
        return None
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(str(raw["name"]), json.dumps(arguments, ensure_ascii=False))


def as_template_arguments(arguments: Any) -> Any:
    """A past call's arguments as chat templates read them (an object), from OpenAI's JSON text;
    ValueError where the text is not a JSON object."""
    if isinstance(arguments, str):
        arguments = _json(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("must be a JSON object, or its text")
    return arguments
