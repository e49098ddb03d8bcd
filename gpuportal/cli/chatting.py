"""What `gpuportal chat` reads beside the conversation, as `ollama run` has it: commands that
begin with a slash (`/set temperature 0.7`, `/set system ...`, `/show`, `/clear`, `/exit`), and a
message of several lines between triple quotes. Pure: a command changes the `Session` and says
what it did; the chat loop (gpuportal.cli.talk) reads the lines and talks to the portal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpuportal.wire import sampling

# A message of several lines begins and ends with this (the closing one may end its last line).
QUOTES = '"""'
ENDS = ("/exit", "/quit", "/bye")
# What `/set` may change: the answer's length and the sampling parameters, by their API names.
MAX_TOKENS = "max_tokens"
SETTABLE = (MAX_TOKENS, *sampling.NAMES)
# `/set format json` holds each answer to a JSON object (ollama's), `/set format text` frees it.
FORMAT = "response_format"
JSON_OBJECT = {"type": "json_object"}
HELP = (
    "/set system TEXT and /set PARAM VALUE change how it answers (PARAM: "
    + ", ".join(SETTABLE)
    + "), /set format json (or text) holds each answer to a JSON object, "
    + "/set verbose (or quiet) says each answer's figures after it, "
    + "/show says how, /clear forgets the conversation, /exit (or Ctrl-D) ends; "
    + f"{QUOTES} begins and ends a message of several lines"
)


@dataclass
class Session:
    """How the model is asked: the system message that starts each conversation, and the
    parameters each turn sends (`max_tokens`, the sampling parameters)."""

    system: str | None
    asked: dict[str, Any] = field(default_factory=dict)
    # Each answer's figures said after it (`--verbose`, `/set verbose`), as ollama's.
    verbose: bool = False

    def start(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


class Done(NamedTuple):
    """What a command did: what to tell the user, whether the conversation is forgotten, and
    whether the chat ends."""

    said: str
    forget: bool = False
    end: bool = False


def is_command(line: str) -> bool:
    return line.strip().startswith("/")


def read_message(ask: Callable[[str], str], prompt: str, more: str) -> str:
    """The next message: a line, or the lines from one that begins with triple quotes to one that
    ends with them (`ask` reads a line after showing its prompt: `prompt` first, `more` after).
    Input that ends inside such a message ends it there."""
    line = ask(prompt)
    if not line.lstrip().startswith(QUOTES):
        return line
    first = line.lstrip()[len(QUOTES) :]
    if first.rstrip().endswith(QUOTES):  # """a message of one line"""
        return first.rstrip()[: -len(QUOTES)]
    lines = [first] if first else []
    while True:
        try:
            line = ask(more)
        except EOFError:
            break
        if line.rstrip().endswith(QUOTES):
            lines.append(line.rstrip()[: -len(QUOTES)])
            break
        lines.append(line)
    return "\n".join(lines).strip("\n")


def run(session: Session, line: str) -> Done:
    """The command on `line` applied to `session`; one that is none says so, with the commands."""
    words = line.strip().split(maxsplit=2)
    name = words[0]
    if name in ENDS:
        return Done("", end=True)
    if name == "/clear":
        return Done("the conversation is forgotten", forget=True)
    if name in ("/?", "/help"):
        return Done(HELP)
    if name == "/show":
        return Done(show(session))
    if name == "/set":
        return _set(session, words[1:])
    return Done(f"no command {name}: {HELP}")


def show(session: Session) -> str:
    asked = [f"{name}={session.asked[name]}" for name in SETTABLE if session.asked.get(name) is not None]
    if session.asked.get(FORMAT):
        asked.append("format=json")
    system = repr(session.system) if session.system else "none"
    return f"system message: {system}; {', '.join(asked) or 'the portal defaults'}"


def _set(session: Session, words: list[str]) -> Done:
    if words in (["verbose"], ["quiet"]):
        session.verbose = words == ["verbose"]
        return Done(f"each answer's figures are {'said' if session.verbose else 'not said'} from the next turn on")
    if len(words) < 2:
        return Done(f"/set takes what and its value, as /set temperature 0.7 or /set system Be brief. ({HELP})")
    what, value = words
    if what == "system":
        session.system = value
        return Done("the system message is set: the conversation starts again from it", forget=True)
    if what == "format":
        if value not in ("json", "text"):
            return Done(f"/set format: json or text, not {value!r}")
        if value == "json":
            session.asked[FORMAT] = JSON_OBJECT
        else:
            session.asked.pop(FORMAT, None)
        return Done(f"answers are {'a JSON object' if value == 'json' else 'free text'} from the next turn on")
    if what not in SETTABLE:
        return Done(f"/set: no parameter {what}: one of system, {', '.join(SETTABLE)}")
    try:
        number = _number(what, value)
    except ValueError as why:
        return Done(f"/set {what}: {why}")
    session.asked[what] = number
    return Done(f"{what} is {number} from the next turn on")


def _number(what: str, text: str) -> int | float:
    """`text` as the value of `what`, held to its bounds; ValueError saying why not."""
    if what != MAX_TOKENS:
        return sampling.BY_NAME[what].read(text)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= sampling.MOST_TOKENS:
        raise ValueError(f"must be from 1 to {sampling.MOST_TOKENS}, not {text}")
    return value
