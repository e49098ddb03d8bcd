"""How a `/v1/completions`, `/v1/chat/completions` or `/v1/embeddings` body is read: one parser
for every way a call arrives (the hot path without DRF, streams and session users through DRF), so
that what is accepted and what each refusal says cannot drift apart. The serializers in
openai_compat describe the same body for the OpenAPI schema only.

Fields OpenAI's and vLLM's clients send that change nothing the portal answers (`user`,
`store`, ...) are ignored, as OpenAI's own server ignores what it does not know. One the portal
does not do (`suffix`, audio, ...) is refused where its value asks for something, naming it:
ignored, it would be an answer other than the one asked for, and taken where it asks for nothing
(`suffix: ""`), as clients send such defaults.
A field that reads as a misspelling of one the portal reads (`max_tokns`) is refused, naming the
one it is nearest: ignored, it would be a limit not applied."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gpuportal.wire import prefix_cache, reasoning, sampling, tools

Kind = Literal["generate", "chat"]

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_TOKENS = sampling.MOST_TOKENS
# The most alternatives a token's log probability comes with (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
# The most choices one call asks for (`n`, times the prompts of a completion given a list of
# them): each is a request of its own in the queue, and a call holds its HTTP worker until the
# last has ended.
MAX_CHOICES = 16
MAX_STOPS = 4
# OpenAI's own bound on the inputs of one embeddings call.
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
MIN_TIMEOUT_S = 0.001


# What the portal reads of a /v1 body.
READ_FIELDS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "n", "stream", "stream_options",
     "timeout", "input", "encoding_format", "dimensions", "logprobs", "top_logprobs", "ignore_eos", "echo",
     "response_format", "guided_json", sampling.GUIDED_CHOICE, sampling.GUIDED_REGEX, tools.TOOLS, tools.TOOL_CHOICE,
     tools.PARALLEL, reasoning.TEMPLATE_KWARGS, reasoning.CONTINUE_FINAL, reasoning.THINKING_BUDGET,
     prefix_cache.CACHE_SALT, *sampling.LISTED_NAMES, *sampling.NAMES}
)  # fmt: skip
# Fields that change nothing the portal answers: who asks (`user`), how OpenAI keeps or bills a
# call, a hint only some models read, a latency aid (`prediction`).
IGNORED_FIELDS = frozenset(
    {"user", "service_tier", "store", "metadata", "prediction", "reasoning_effort", "extra_body"}
)  # fmt: skip


@dataclass(frozen=True)
class NotDone:
    """A field the portal does not do: taken where its value asks for nothing (`asks_nothing`),
    refused with `why` otherwise."""

    name: str
    asks_nothing: Callable[[Any], bool]
    why: str


def _none_or(*nothing: Any) -> Callable[[Any], bool]:
    # By type too: `True == 1` and `0 == False`, but `skip_special_tokens: 1` is no `true`.
    return lambda value: value is None or any(type(value) is type(n) and value == n for n in nothing)


_OLD_FUNCTIONS = "not supported: OpenAI's older function calling; give the functions as `tools`"
NOT_DONE = (
    NotDone("suffix", _none_or(""), "not supported: text is only ever added after the prompt"),
    NotDone("functions", _none_or([]), _OLD_FUNCTIONS),
    NotDone("function_call", _none_or("none", "auto"), _OLD_FUNCTIONS),
    NotDone("skip_special_tokens", _none_or(True), "not supported: special tokens are always left out of the text"),
    NotDone("modalities", _none_or(["text"]), "not supported: answers are text only"),
    NotDone("audio", _none_or(), "not supported: answers are text only"),
    NotDone("web_search_options", _none_or(), "not supported: the models here search nothing"),
)
NOT_DONE_FIELDS = frozenset(field.name for field in NOT_DONE) | {"best_of"}
# How near an unknown field must be to one the portal reads to be taken for its misspelling.
TYPO_CUTOFF = 0.8


class Refused(Exception):
    """The body cannot be run: `param` names the field (OpenAI's `param`), `message` says why."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.message = param, message


# A prompt given as token ids, as vLLM takes it: the ids of the model's own tokenizer (what
# lm-evaluation-harness's local-completions sends by default, tokenized with the model's own
# tokenizer, so that the tokens it scores are exactly those it counted). The replica refuses an id
# past its vocabulary.
Prompt = str | list[int]
# An id no tokenizer reaches: a bound against a number no model could hold, not a vocabulary.
MOST_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class Completion:
    model: str
    # The prompt (a string or token ids) or the messages ([{role, content}]): the first, where a
    # completion is given a list of prompts (`prompts`).
    input: Any
    # max_tokens, the sampling parameters (gpuportal.wire.sampling), stop and stream, as the
    # request queue takes them.
    params: dict[str, Any]
    timeout_s: float
    # stream_options.include_usage: the stream ends with a chunk of no choices that carries the usage.
    include_usage: bool = False
    # OpenAI's `n`: the choices asked of each input.
    n: int = 1
    # A completion's prompts, where it was given a list of them (`input` is the first).
    prompts: tuple[Prompt, ...] = ()

    @property
    def choices(self) -> int:
        return max(1, len(self.prompts)) * self.n

    def each(self) -> list[tuple[Any, dict[str, Any]]]:
        """(input, params) of each choice, in the order of their `index`: a prompt's n choices,
        then the next prompt's, as OpenAI numbers them. A seed given is each choice's plus its
        number among its input's (seed, seed + 1, ...): n samples that differ, each reproducible."""
        inputs = self.prompts or (self.input,)
        seed = self.params.get("seed")
        return [
            (given, self.params if seed is None or j == 0 else {**self.params, "seed": seed + j})
            for given in inputs
            for j in range(self.n)
        ]


def parse(body: Any, kind: Kind, *, default_timeout_s: float, max_timeout_s: float) -> Completion:
    """The call to make, or Refused naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise Refused(None, "the body must be a JSON object")
    _no_typos(body)
    model = model_named(body)
    prompts = _prompts(body) if kind == "generate" else (_messages(body),)
    n = body.get("n")
    if n is None:
        n = 1
    if not _integer(n) or not 1 <= n <= MAX_CHOICES:
        raise Refused("n", f"must be a whole number from 1 to {MAX_CHOICES}")
    if len(prompts) * n > MAX_CHOICES:
        raise Refused("n", f"{len(prompts)} prompts of {n} choices each: at most {MAX_CHOICES} choices in one call")
    _nothing_not_done(body, n)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise Refused("stream", "must be true or false")
    if refused := sampling.problems(body):
        name, why = next(iter(refused.items()))  # the first, in the order they are declared
        raise Refused(name, why)
    logprobs = _logprobs(body, kind)
    params = {
        **({} if logprobs is None else {"logprobs": logprobs}),
        "max_tokens": _max_tokens(body, kind),
        "temperature": 0.0,
        "top_p": 1.0,
        **sampling.checked(body),
        "stop": _stops(body.get("stop")),
        "stream": stream,
    }
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise Refused("ignore_eos", "must be true or false")
    if ignore_eos:
        # vLLM's, for a load test's fixed length: as min_tokens of the whole max_tokens (the
        # replica holds it to the length it fits where the call leaves that to it).
        params["min_tokens"] = params["max_tokens"] or sampling.MOST_TOKENS
    if why := sampling.min_tokens_beyond(params):
        raise Refused("min_tokens", why)
    for name, why in sampling.listed_problems(body).items():
        raise Refused(name, why)
    params.update(sampling.listed_kept(body))
    if _echo(body, kind, stream):
        params["echo"] = True
    params.update(_format(body))
    params.update(_tools(body, kind, params))
    params.update(_template_kwargs(body, kind))
    if why := reasoning.budget_problem(budget := body.get(reasoning.THINKING_BUDGET)):
        raise Refused(reasoning.THINKING_BUDGET, why)
    if budget is not None:
        params[reasoning.THINKING_BUDGET] = budget
    if why := prefix_cache.salt_problem(salt := body.get(prefix_cache.CACHE_SALT)):
        raise Refused(prefix_cache.CACHE_SALT, why)
    if salt is not None:
        params[prefix_cache.CACHE_SALT] = salt
    params.update(_continued(body, kind, prompts[0]))
    timeout = wait_of(body.get("timeout"), default_timeout_s, max_timeout_s)
    return Completion(
        model=model.strip(),
        input=prompts[0],
        params=params,
        timeout_s=timeout,
        include_usage=_include_usage(body.get("stream_options"), stream),
        n=n,
        prompts=prompts if _listed(body.get("prompt")) else (),
    )


def _nothing_not_done(body: dict[str, Any], n: int) -> None:
    """Refused for the first field of NOT_DONE whose value asks for something."""
    for field in NOT_DONE:
        if not field.asks_nothing(body.get(field.name)):
            raise Refused(field.name, field.why)
    best_of = body.get("best_of")
    # vLLM's and OpenAI's legacy best_of: n choices kept of best_of made. Equal to n, every one is kept.
    if best_of is not None and not (_integer(best_of) and best_of == n):
        raise Refused("best_of", f"not supported beyond n: each choice made is returned (give n, here {n})")


def _logprobs(body: dict[str, Any], kind: Kind) -> int | None:
    """How many alternatives each token's log probability comes with (0: its own alone), or None
    where none is asked: a chat's `logprobs: true` with its `top_logprobs`, a completion's
    `logprobs` count, as OpenAI's two endpoints ask (streamed too: each chunk with its tokens')."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    bound = f"must be a whole number from 0 to {MAX_LOGPROBS}"
    if kind == "chat":
        if wanted is not None and not isinstance(wanted, bool):
            raise Refused("logprobs", "must be true or false (top_logprobs says how many alternatives)")
        if top is not None and (not _integer(top) or not 0 <= top <= MAX_LOGPROBS):
            raise Refused("top_logprobs", bound)
        if top and not wanted:
            raise Refused("top_logprobs", "only with logprobs: true")
        asked = (top or 0) if wanted else None
    else:
        if wanted is not None and (not _integer(wanted) or not 0 <= wanted <= MAX_LOGPROBS):
            raise Refused("logprobs", f"{bound}: the alternatives given with each token")
        asked = wanted
    return asked


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """What the answer is held to as it is generated (inference.constrained), as the request queue
    keeps it: OpenAI's `response_format`, or one of vLLM's guided formats (`guided_json`, a schema
    or its JSON text; `guided_choice`, some strings; `guided_regex`); {} for free text."""
    asked: dict[str, Any] = {}
    if (schema := _json_schema(body.get("response_format"))) is not None:
        asked["response_format"] = schema
    if (guided := body.get("guided_json")) is not None:
        asked["guided_json"] = _guided_json(guided)
    if (choices := body.get(sampling.GUIDED_CHOICE)) is not None:
        if (why := sampling.choice_problem(choices)) is not None:
            raise Refused(sampling.GUIDED_CHOICE, why)
        asked[sampling.GUIDED_CHOICE] = choices
    if (pattern := body.get(sampling.GUIDED_REGEX)) is not None:
        if (why := sampling.regex_problem(pattern)) is not None:
            raise Refused(sampling.GUIDED_REGEX, why)
        asked[sampling.GUIDED_REGEX] = pattern
    if (twice := sampling.one_format_problem(asked)) is not None:
        raise Refused(*twice)
    for name in ("response_format", "guided_json"):
        if name in asked:
            return {sampling.JSON_SCHEMA: asked[name], sampling.SCHEMA_FIELD: name}
    return asked


def _tools(body: dict[str, Any], kind: Kind, params: dict[str, Any]) -> dict[str, Any]:
    """A chat's functions and how its answer calls them, as the request queue keeps them
    (gpuportal.wire.tools); for `required` or a function named, the JSON Schema of the calls the
    answer is held to. {} where it gives no tools."""
    given, choice, parallel = body.get(tools.TOOLS), body.get(tools.TOOL_CHOICE), body.get(tools.PARALLEL)
    if parallel is not None and not isinstance(parallel, bool):
        raise Refused(tools.PARALLEL, "must be true or false")
    if given is None or given == []:
        if choice not in (None, tools.NONE, tools.AUTO):
            raise Refused(tools.TOOL_CHOICE, "asks for a call, but no tools were given")
        return {}
    if kind != "chat":
        raise Refused(tools.TOOLS, "only in a chat (/v1/chat/completions): a completion calls no functions")
    if problem := tools.tools_problem(given):
        raise Refused(*problem)
    try:
        chosen = tools.choice_of(choice, given)
    except ValueError as exc:
        raise Refused(tools.TOOL_CHOICE, str(exc)) from None
    if chosen != tools.NONE and any(name in params for name in sampling.FORMATS):
        raise Refused(tools.TOOLS, "one format at a time: an answer held to a format calls no functions")
    kept: dict[str, Any] = {tools.TOOLS: given, tools.TOOL_CHOICE: chosen}
    if parallel is False:
        kept[tools.PARALLEL] = False
    if chosen not in (tools.AUTO, tools.NONE):
        try:
            schema = tools.call_schema(given, chosen, parallel=parallel is not False)
        except ValueError as exc:
            raise Refused(tools.TOOLS, str(exc)) from None
        kept |= {sampling.JSON_SCHEMA: schema, sampling.SCHEMA_FIELD: tools.TOOLS}
    return kept


def _guided_json(value: Any) -> dict[str, Any]:
    """vLLM's guided_json: a JSON Schema, or its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise Refused("guided_json", "must be a JSON Schema: an object, or its JSON text") from None
    if not isinstance(value, dict):
        raise Refused("guided_json", "must be a JSON Schema: an object, or its JSON text")
    if (why := sampling.schema_problem(value)) is not None:
        raise Refused("guided_json", why)
    return value


def _json_schema(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as the JSON Schema the answer is held to as it is generated
    (inference.constrained): `json_object` any JSON object, `json_schema` its `schema`; None for
    free text (`text`, or none given)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Refused("response_format", 'must be an object such as {"type": "json_object"}')
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(sampling.ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise Refused("response_format.type", "must be text, json_object or json_schema")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise Refused("response_format.json_schema", "must be an object whose `schema` is a JSON Schema object")
    if (why := sampling.schema_problem(schema)) is not None:
        raise Refused("response_format.json_schema", why)
    return schema


def _echo(body: dict[str, Any], kind: Kind, stream: bool) -> bool:
    """OpenAI's legacy `echo`: a completion's text begins with its prompt and, beside `logprobs`,
    its log probabilities with the prompt's tokens' (the first's null), which is how an eval harness
    scores a prompt (lm-evaluation-harness's loglikelihood). Not streamed, not on chats."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if not isinstance(echo, bool):
        raise Refused("echo", "must be true or false")
    if kind == "chat":
        raise Refused("echo", "not supported on chats: an answer never repeats its messages")
    if stream:
        raise Refused("echo", "not streamed: ask without stream")
    return True


def _include_usage(options: Any, stream: bool) -> bool:
    """OpenAI's `stream_options`: an object, only beside `stream: true` (as OpenAI refuses it
    otherwise), whose `include_usage` is read; the others (vLLM's `continuous_usage_stats`) are
    ignored as the body's unused fields are."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise Refused("stream_options", 'must be an object, such as {"include_usage": true}')
    if not stream:
        raise Refused("stream_options", "only allowed when stream is true")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise Refused("stream_options.include_usage", "must be true or false")
    return bool(include)


@dataclass(frozen=True)
class Embeddings:
    model: str
    # The texts to embed, in order (a single string arrives as a list of one).
    input: list[str]
    encoding_format: str
    timeout_s: float

    @property
    def texts(self) -> list[str]:
        return self.input


def parse_embeddings(body: Any, *, default_timeout_s: float, max_timeout_s: float) -> Embeddings:
    """The embeddings call to make, or Refused naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise Refused(None, "the body must be a JSON object")
    _no_typos(body)
    model = model_named(body)
    texts = _texts(body.get("input"))
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODING_FORMATS:
        raise Refused("encoding_format", f"must be one of {', '.join(ENCODING_FORMATS)}")
    if body.get("dimensions") is not None:
        raise Refused("dimensions", "not supported: each model's embeddings have the size it was trained with")
    timeout = wait_of(body.get("timeout"), default_timeout_s, max_timeout_s)
    return Embeddings(model.strip(), texts, encoding, timeout)


def _no_typos(body: dict[str, Any]) -> None:
    """Refused for the first field that is neither read nor known to be ignored, and reads as a
    misspelling of one that is read."""
    for key in body:
        if not isinstance(key, str) or key in READ_FIELDS or key in IGNORED_FIELDS or key in NOT_DONE_FIELDS:
            continue
        near = difflib.get_close_matches(key, sorted(READ_FIELDS), n=1, cutoff=TYPO_CUTOFF)
        if near:
            raise Refused(key, f"unknown field; did you mean {near[0]!r}?")


def model_named(body: dict[str, Any]) -> str:
    """The deployment a body names in `model`; Refused naming `model` where it names none."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise Refused("model", "required: the deployment's name")
    if "\x00" in model:  # no deployment's name has one, and PostgreSQL takes no text with one
        raise Refused("model", "must not contain a NUL character")
    return model


def _texts(value: Any) -> list[str]:
    texts = value if isinstance(value, list) else [value]
    if value is None or value == []:
        raise Refused("input", "required: a string or a non-empty list of strings")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise Refused("input", f"at most {MAX_EMBEDDING_INPUTS} inputs in one call")
    for i, text in enumerate(texts):
        param = f"input.{i}" if isinstance(value, list) else "input"
        if _integer(text) or (isinstance(text, list) and all(_integer(t) for t in text)):
            # Token ids are the ids of OpenAI's tokenizer, which mean nothing to this model's.
            raise Refused(param, "token arrays are not supported: send text")
        if not sampling.is_text(text):
            raise Refused(param, not_text(text, "must be a string"))
        if not text:
            raise Refused(param, "must not be an empty string")
    return texts


def wait_of(value: Any, default_s: float, max_s: float) -> float:
    """Not OpenAI's: how long the call waits for its answer (a /v1 call never hangs)."""
    if value is None:
        return default_s
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Refused("timeout", "must be a number of seconds")
    if value < MIN_TIMEOUT_S:
        raise Refused("timeout", f"at least {MIN_TIMEOUT_S:g} s")
    if value > max_s:
        raise Refused("timeout", f"at most {max_s:g} s (GPUPORTAL_INFER_MAX_TIMEOUT_S)")
    return float(value)


def _prompts(body: dict[str, Any]) -> tuple[Prompt, ...]:
    """A completion's prompt, or OpenAI's list of them (a choice each, `index` in their order):
    each a string, or token ids (a list of them alone is one prompt)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        if not sampling.is_text(prompt):
            raise Refused("prompt", not_text(prompt, "required: a string, token ids, or a list of either"))
        return (prompt,)
    if not prompt:
        raise Refused("prompt", "required: a string, token ids, or a non-empty list of either")
    if not _listed(prompt):
        return (_token_ids(prompt, "prompt"),)
    for i, given in enumerate(prompt):
        if not sampling.is_text(given) and not isinstance(given, list):
            raise Refused(f"prompt.{i}", not_text(given, "must be a string or a list of token ids"))
    if len(prompt) > MAX_CHOICES:
        raise Refused("prompt", f"at most {MAX_CHOICES} prompts in one call")
    return tuple(
        given if isinstance(given, str) else _token_ids(given, f"prompt.{i}") for i, given in enumerate(prompt)
    )


def _listed(prompt: Any) -> bool:
    """Whether a completion's `prompt` is a list of prompts (token ids alone are one)."""
    return isinstance(prompt, list) and not all(_integer(token) for token in prompt)


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not ids:
        raise Refused(param, "no token ids: a prompt has at least one")
    for j, token in enumerate(ids):
        if not _integer(token) or not 0 <= token <= MOST_TOKEN_ID:
            raise Refused(f"{param}.{j}", f"a token id is a whole number from 0 to {MOST_TOKEN_ID}")
    return ids


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("messages", "required: a non-empty list of {role, content}")
    read = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Refused(f"messages.{i}", "must be an object with role and content")
        if message.get("role") not in ROLES:
            raise Refused(f"messages.{i}.role", f"must be one of {', '.join(ROLES)}")
        if message["role"] == "assistant" and message.get("tool_calls"):
            read.append(_calling(message, f"messages.{i}") | _thought(message, f"messages.{i}"))
            continue
        content = message.get("content")
        if content is None and message["role"] == "assistant":
            content = ""  # an assistant's turn that said nothing (a call's, its calls left out)
        kept = {"role": message["role"], "content": content_text(content, f"messages.{i}.content")}
        if message["role"] == "tool" and message.get("tool_call_id") is not None:
            if not sampling.is_text(message["tool_call_id"]):
                raise Refused(f"messages.{i}.tool_call_id", "must be a string: the id of the call it answers")
            kept["tool_call_id"] = message["tool_call_id"]
        if message["role"] == "assistant":
            kept |= _thought(message, f"messages.{i}")
        read.append(kept)
    return read  # other keys of a message: ignored


def _thought(message: dict[str, Any], param: str) -> dict[str, str]:
    """An assistant's reasoning, given back as vLLM (`reasoning`) or DeepSeek (`reasoning_content`)
    gave it, as chat templates read it (`reasoning_content`: Qwen 3's, for a turn that called
    functions); {} where none."""
    for name in reasoning.GIVEN:
        if (thought := message.get(name)) is not None:
            if not sampling.is_text(thought):
                raise Refused(f"{param}.{name}", not_text(thought, "must be a string"))
            return {reasoning.TEMPLATE_FIELD: thought}
    return {}


def _template_kwargs(body: dict[str, Any], kind: Kind) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`, kept for the replica's chat template (Qwen 3's
    `enable_thinking: false`); {} where none."""
    given = body.get(reasoning.TEMPLATE_KWARGS)
    if given is None or given == {}:
        return {}
    if kind != "chat":
        raise Refused(reasoning.TEMPLATE_KWARGS, "only in a chat (/v1/chat/completions): a completion has no template")
    if not isinstance(given, dict):
        raise Refused(reasoning.TEMPLATE_KWARGS, 'must be an object: {"enable_thinking": false}')
    if taken := sorted(set(given) & reasoning.TEMPLATE_OWN):
        raise Refused(f"{reasoning.TEMPLATE_KWARGS}.{taken[0]}", "is the portal's to set, not the caller's")
    return {reasoning.TEMPLATE_KWARGS: given}


def _continued(body: dict[str, Any], kind: Kind, messages: Any) -> dict[str, Any]:
    """vLLM's `continue_final_message`: the last message, an assistant's text, continued (a
    prefill); {} where not asked."""
    given = body.get(reasoning.CONTINUE_FINAL)
    if given is None or given is False:
        return {}
    if given is not True:
        raise Refused(reasoning.CONTINUE_FINAL, "must be true or false")
    if kind != "chat":
        raise Refused(
            reasoning.CONTINUE_FINAL, "only in a chat (/v1/chat/completions): a completion is continued always"
        )
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls") or not last["content"].strip():
        raise Refused(reasoning.CONTINUE_FINAL, "the last message must be the assistant's words, to continue")
    formats = ("response_format", "guided_json", sampling.GUIDED_CHOICE, sampling.GUIDED_REGEX)
    if body.get(tools.TOOL_CHOICE) not in (None, tools.NONE, tools.AUTO) or any(
        body.get(f) is not None for f in formats
    ):
        raise Refused(
            reasoning.CONTINUE_FINAL, "an answer held to a format or a call begins anew: it continues nothing"
        )
    return {reasoning.CONTINUE_FINAL: True}


def _calling(message: dict[str, Any], param: str) -> dict[str, Any]:
    """An assistant's message that called functions, as chat templates read one: each call's
    arguments an object (OpenAI sends their JSON text), its content text or none."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise Refused(f"{param}.tool_calls", "must be a list of the calls the assistant made")
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Refused(
                f"{param}.tool_calls.{j}", 'must be {"id", "type": "function", "function": {"name", "arguments"}}'
            )
        try:
            arguments = tools.as_template_arguments(function.get("arguments", {}))
        except ValueError as exc:
            raise Refused(f"{param}.tool_calls.{j}.function.arguments", str(exc)) from None
        read.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    content = message.get("content")
    text = "" if content is None or content == "" else content_text(content, f"{param}.content")
    return {"role": "assistant", "content": text, "tool_calls": read}


def message_origin(param: str, origins: list[str], whole: str) -> str:
    """The caller's field a refusal of the chat's `messages.N...` names: where that message came
    from (`origins[N]`, as an API that reads its body into a chat's recorded it), else `whole`."""
    index = param.split(".")[1] if param.count(".") else ""
    return origins[int(index)] if index.isdigit() and int(index) < len(origins) else whole


def content_text(content: Any, param: str, parts: tuple[str, ...] = ("text",)) -> str:
    """A message's text: a string, or OpenAI's list of content parts, whose text parts (of a type
    among `parts`) are joined a line apart (as vLLM joins them); a part of another type (an image,
    audio, a file) is refused by name, this portal's models reading text alone."""
    if not isinstance(content, list):
        if not sampling.is_text(content):
            raise Refused(param, not_text(content, "required: a string or a list of text parts"))
        return content
    if not content:
        raise Refused(param, "required: a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "a part that is no {type, text} object"
            raise Refused(f"{param}.{j}", f"{what} is not supported: the models served here read text parts only")
        if not sampling.is_text(part.get("text")):
            raise Refused(f"{param}.{j}.text", not_text(part.get("text"), "required: a string"))
        texts.append(part["text"])
    return "\n".join(texts)


def _max_tokens(body: dict[str, Any], kind: Kind) -> int | None:
    """What the body asks for; none asked, a completion's 16 tokens, and a chat's None: as long
    as its replica has room for (gpuportal.wire.sampling.DEFAULT_CHAT_MAX_TOKENS)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _integer(value) or not 1 <= value <= MAX_TOKENS):
            raise Refused(key, f"must be a whole number from 1 to {MAX_TOKENS}")
    # OpenAI's newer name stands in for the older when only it is sent.
    asked = body.get("max_tokens") or body.get("max_completion_tokens")
    return asked or (None if kind == "chat" else sampling.DEFAULT_MAX_TOKENS)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise Refused("stop", f"must be a string or a list of at most {MAX_STOPS} non-empty strings")
    return list(stops)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def not_text(value: Any, required: str) -> str:
    """Why `value` is no text: not a string at all (`required`), or one no UTF-8 can hold."""
    if type(value) is str and (lone := sampling.lone_surrogate(value)) is not None:
        return f"contains a lone surrogate (U+{ord(lone):04X}), which UTF-8 cannot encode"
    return required
