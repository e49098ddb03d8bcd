"""How a text request's next token is chosen: the sampling parameters a request may give, each
declared once with its bounds and default, as OpenAI's, vLLM's and Ollama's clients send them.
The REST API, the `/v1` endpoints and the web's fast path check them here; the replica reads them
back as a `Sampling` (inference.batching applies it). Django-free and torch-free."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# A seed as torch's generators take one: any 64-bit integer, signed or not.
SEED_LOW, SEED_HIGH = -(2**63), 2**64 - 1

# How long an answer runs that a request leaves unbounded. A completion gets 16 tokens, as OpenAI's
# and vLLM's legacy completions do. A chat asked on /v1 without max_tokens runs on as OpenAI's
# and vLLM's chats do, but within what its replica holds (its params say `max_tokens: null`):
# `fitted_max_tokens`.
DEFAULT_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512
# The longest answer a request may ask for.
MOST_TOKENS = 4096


# Request queue params: a chat's max_tokens left to the room its replica has (as an unbounded
# chat's is), up to this many (Anthropic's `max_tokens`, a bound its models may stop before: what
# its clients send is often far past what a replica holds, and vLLM fits it to the room too).
MAX_TOKENS_BOUND = "max_tokens_bound"


def max_tokens_bound(params: Mapping[str, Any]) -> int:
    """The most tokens a chat asking for no exact length may have: its MAX_TOKENS_BOUND, else
    DEFAULT_CHAT_MAX_TOKENS."""
    return int(params.get(MAX_TOKENS_BOUND) or DEFAULT_CHAT_MAX_TOKENS)


def fitted_max_tokens(
    prompt_tokens: int, context: int | None, kv_capacity: int | None = None, most: int = DEFAULT_CHAT_MAX_TOKENS
) -> int:
    """An unbounded chat's max_tokens: `most` (DEFAULT_CHAT_MAX_TOKENS, or the bound it was
    given), or fewer where the model's `context` or the replica's KV cache (`kv_capacity` tokens)
    has less room beside the prompt, and never more than half the cache: a replica reserves a
    sequence's blocks as it admits it, and a chat holding the whole cache would leave no other
    request room beside it (as `gpuportal chat` asks for half at most). A prompt that leaves no
    room gets `most` all the same, and is refused as too long by the check that follows, as a
    request asking for it would be."""
    rooms = [most]
    if context is not None:
        rooms.append(context - prompt_tokens)
    if kv_capacity is not None:
        rooms += [kv_capacity - prompt_tokens, kv_capacity // 2]
    room = min(rooms)
    return room if room >= 1 else most


@dataclass(frozen=True)
class Param:
    """One parameter: whole or not, its bounds (`above_low`: the low bound itself refused), its
    default, and what it does, for the API's documentation."""

    name: str
    low: float
    high: float
    default: float | None
    help: str
    whole: bool = False
    above_low: bool = False

    def problem(self, value: Any) -> str | None:
        """Why `value` cannot be this parameter's, or None (None itself is its default)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return "must be a whole number" if self.whole else "must be a number"
        if self.whole and not isinstance(value, int):
            return "must be a whole number"
        if not self.low <= value <= self.high or (self.above_low and value <= self.low):
            return f"must be {self.bounds()}"
        return None

    def read(self, text: str) -> int | float:
        """`text` (a command line's) as this parameter's value, held to its bounds; ValueError
        saying why not."""
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            raise ValueError(f"not a {'whole number' if self.whole else 'number'}: {text!r}") from None
        if (why := self.problem(value)) is not None:
            raise ValueError(f"{why}, not {text}")
        return value

    def bounds(self) -> str:
        low, high = (f"{self.low:.0f}", f"{self.high:.0f}") if self.whole else (f"{self.low:g}", f"{self.high:g}")
        return f"above {low} and at most {high}" if self.above_low else f"from {low} to {high}"


PARAMS = (
    Param("temperature", 0.0, 2.0, 0.0, "0 picks the likeliest token (greedy); higher samples more freely."),
    Param("top_p", 0.0, 1.0, 1.0, "Sample from the likeliest tokens whose mass reaches it.", above_low=True),
    Param("top_k", -1, 1_000_000, 0, "Sample from the k likeliest tokens (0 or -1: all).", whole=True),
    Param("min_p", 0.0, 1.0, 0.0, "Leave out tokens less likely than this share of the likeliest one's."),
    Param(
        "presence_penalty",
        -2.0,
        2.0,
        0.0,
        "Subtracted from the logit of each token the answer holds already (OpenAI's): above 0, new topics.",
    ),
    Param(
        "frequency_penalty",
        -2.0,
        2.0,
        0.0,
        "Subtracted from a token's logit once for each time the answer holds it (OpenAI's): above 0, less repetition.",
    ),
    Param(
        "repetition_penalty",
        0.0,
        10.0,
        1.0,
        "Divides the positive logits, and multiplies the negative ones, of tokens in the prompt or the answer "
        "(vLLM's and Hugging Face's; Ollama's repeat_penalty): above 1, less repetition.",
        above_low=True,
    ),
    Param(
        "min_tokens",
        0,
        MOST_TOKENS,
        0,
        "The fewest tokens an answer has: its model's end of text is not picked before them (vLLM's), so "
        "that an answer of max_tokens runs whole (a load test's fixed length).",
        whole=True,
    ),
    Param(
        "seed",
        SEED_LOW,
        SEED_HIGH,
        None,
        "Sampling with the same seed, parameters and prompt picks the same tokens (with temperature above 0).",
        whole=True,
    ),
)
BY_NAME: Mapping[str, Param] = {p.name: p for p in PARAMS}
NAMES = tuple(BY_NAME)

# OpenAI's logit_bias: a token's id (a key of a JSON object, so text) → a bias added to its logit
# before the pick, -100 (as good as banned) to 100 (as good as forced). The ids are the model's own
# tokenizer's, as vLLM takes them (OpenAI's are its own tokenizer's, which mean nothing here).
LOGIT_BIAS = "logit_bias"
MOST_BIAS = 100.0
MOST_BIASED = 300  # tokens in one request's logit_bias, as OpenAI bounds it
_TOKEN_ID = re.compile(r"[0-9]{1,9}")
# vLLM's stop_token_ids: the answer ends at the first of these tokens the model picks, which is no
# part of its text (as the model's own end of text is not). The model's own ids, as logit_bias's.
STOP_TOKEN_IDS = "stop_token_ids"
MOST_STOP_TOKENS = 256
MOST_TOKEN_ID = 999_999_999  # nine digits, as a logit_bias key is: no vocabulary comes near it


def logit_bias_problem(value: Any) -> str | None:
    """Why `value` cannot be a logit_bias, or None (None and {} ask for none)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return 'must be an object of token ids and biases, such as {"50256": -100}'
    if len(value) > MOST_BIASED:
        return f"at most {MOST_BIASED} tokens"
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
            return f"{key!r} is no token id (a whole number, as text)"
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            return f"{key}: must be a number"
        if not -MOST_BIAS <= bias <= MOST_BIAS:
            return f"{key}: must be from {-MOST_BIAS:g} to {MOST_BIAS:g}"
    return None


def _logit_bias_kept(value: dict[str, Any] | None) -> dict[str, float]:
    return {key: float(bias) for key, bias in (value or {}).items()}


def _stop_token_ids_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list):
        return "must be a list of token ids, such as [128009]"
    if len(value) > MOST_STOP_TOKENS:
        return f"at most {MOST_STOP_TOKENS} tokens"
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MOST_TOKEN_ID:
            return f"{token!r} is no token id (a whole number from 0 to {MOST_TOKEN_ID})"
    return None


def _stop_token_ids_kept(value: list[int] | None) -> list[int]:
    return sorted(set(value or []))


# OpenAI's response_format, as the request queue keeps it: the JSON Schema the answer is held to
# as it is generated ({"type": "object"} for a JSON object); absent, the answer is free text.
JSON_SCHEMA = "json_schema"
# The caller's name for that schema (OpenAI's response_format, vLLM's guided_json, Ollama's
# format), kept beside it so that a replica that cannot hold to it names what the caller sent;
# response_format where absent.
SCHEMA_FIELD = "json_schema_field"
MOST_SCHEMA_BYTES = 65_536
# What OpenAI's json_object and Ollama's "json" ask for: any JSON object.
ANY_JSON_OBJECT: Mapping[str, Any] = {"type": "object"}
# vLLM's guided decoding beside it, kept as given: an answer held to one of some strings
# (classification, an eval's multiple choice) or to a regular expression. One format a request.
GUIDED_CHOICE = "guided_choice"
GUIDED_REGEX = "guided_regex"
FORMATS = (JSON_SCHEMA, GUIDED_CHOICE, GUIDED_REGEX)
MOST_CHOICES = 256
MOST_PATTERN_CHARS = 4096


def schema_problem(value: Any) -> str | None:
    """Why `value` cannot be the JSON Schema an answer is held to (None: it can, as far as its
    shape goes; the replica's parser judges the rest)."""
    if not isinstance(value, dict):
        return "must be a JSON Schema object"
    if len(json.dumps(value)) > MOST_SCHEMA_BYTES:
        return f"a schema of at most {MOST_SCHEMA_BYTES} bytes"
    return None


def choice_problem(value: Any) -> str | None:
    """Why `value` cannot be GUIDED_CHOICE's strings."""
    if not isinstance(value, list) or not value or not all(is_text(choice) and choice for choice in value):
        return "must be a non-empty list of non-empty strings"
    if len(value) > MOST_CHOICES:
        return f"at most {MOST_CHOICES} strings"
    return None


def regex_problem(value: Any) -> str | None:
    """Why `value` cannot be GUIDED_REGEX's pattern."""
    if not is_text(value) or not value or len(value) > MOST_PATTERN_CHARS:
        return f"must be a regular expression of 1 to {MOST_PATTERN_CHARS} characters"
    return None


def one_format_problem(given: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the name refused, why) where `given` (the formats asked, by the caller's names) asks for
    more than one: one format a request."""
    if len(given) < 2:
        return None
    names = sorted(given)
    return names[1], f"one format at a time: {' and '.join(names)} were both given"


# Request queue params: the prompt is tokenized and counted, nothing generated (vLLM's
# /tokenize and /detokenize, Anthropic's count_tokens: only the model's own tokenizer counts its
# tokens, and the web has none). The output's usage counts them, its PROMPT_TOKEN_IDS lists
# them, and a prompt given as ids comes back decoded (`prompt_text`).
COUNT_ONLY = "count_only"
PROMPT_TOKEN_IDS = "prompt_token_ids"

# A replica's output says what ended an answer on a stop the caller gave (vLLM's `stop_reason`):
# the stop string matched, or the stop token's id; absent where it ended otherwise.
STOP_REASON = "stop_reason"


def first_stop(text: str, stops: Iterable[str]) -> tuple[int, str] | None:
    """(where it begins, which) of the stop string that begins first in `text`, the longest of
    those that begin there (both "\n" and "\n\n" asked: the text was cut at either, and the
    longer one is what it held); None where none is in it."""
    found = [(text.find(stop), -len(stop), stop) for stop in stops if stop and stop in text]
    if not found:
        return None
    at, _, stop = min(found)
    return at, stop


def is_text(value: Any) -> bool:
    """A string UTF-8 can carry (JSON can carry lone surrogates, which it cannot)."""
    return type(value) is str and lone_surrogate(value) is None


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in `text`, which no UTF-8 can encode (None: there is none)."""
    if text.isascii():
        return None
    return next((c for c in text if "\ud800" <= c <= "\udfff"), None)


@dataclass(frozen=True)
class Listed:
    """A parameter whose value is a collection of the model's token ids, not a number: why a
    value cannot be it (None and an empty one ask for nothing), and the value as the request
    queue keeps it (empty: nothing asked, left out)."""

    name: str
    problem: Callable[[Any], str | None]
    kept: Callable[[Any], Any]
    help: str


LISTED = (
    Listed(
        LOGIT_BIAS,
        logit_bias_problem,
        _logit_bias_kept,
        "OpenAI's: a bias from -100 to 100 added to the logit of each token named, by the id the model's own "
        f'tokenizer gives it, e.g. {{"50256": -100}}; at most {MOST_BIASED} tokens.',
    ),
    Listed(
        STOP_TOKEN_IDS,
        _stop_token_ids_problem,
        _stop_token_ids_kept,
        "vLLM's: the answer ends at the first of these tokens (the model's own ids) it picks, which is no part "
        f"of its text; at most {MOST_STOP_TOKENS}.",
    ),
)
LISTED_BY_NAME: Mapping[str, Listed] = {p.name: p for p in LISTED}
LISTED_NAMES = tuple(LISTED_BY_NAME)


def listed_problems(params: Mapping[str, Any]) -> dict[str, str]:
    """{name: why} of the listed parameters in `params` that are refused."""
    return {p.name: why for p in LISTED if (why := p.problem(params.get(p.name))) is not None}


def listed_kept(params: Mapping[str, Any]) -> dict[str, Any]:
    """The listed parameters `params` asks something of, as the request queue keeps them. The
    caller has refused `listed_problems`."""
    return {p.name: kept for p in LISTED if (kept := p.kept(params.get(p.name)))}


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters, defaults filled in."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    seed: int | None = None
    # (token id, bias), by token id: what LOGIT_BIAS asks for.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What STOP_TOKEN_IDS asks for, in order.
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> Sampling:
        """The sampling a request's params ask for; what they leave out (or a replica of an older
        portal did not know) is the default. The web checked them (`problems`)."""
        given = {name: params[name] for name in NAMES if params.get(name) is not None}
        biased = sorted((int(token), float(bias)) for token, bias in (params.get(LOGIT_BIAS) or {}).items())
        stops = tuple(sorted({int(token) for token in params.get(STOP_TOKEN_IDS) or ()}))
        return cls(**given, logit_bias=tuple(biased), stop_token_ids=stops)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        """Whether the logits change before a token is chosen, greedy or not."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def generator_seed(self) -> int | None:
        """The seed as torch's Generator.manual_seed takes it (unsigned 64 bits)."""
        return None if self.seed is None else self.seed % 2**64


def problems(params: Mapping[str, Any]) -> dict[str, str]:
    """{name: why} of the sampling parameters in `params` that are refused (others are not read)."""
    return {name: why for name in NAMES if name in params and (why := BY_NAME[name].problem(params[name]))}


def min_tokens_beyond(params: Mapping[str, Any]) -> str | None:
    """Why a request's min_tokens cannot be had within its max_tokens, or None (either left out,
    or max_tokens left to the replica, which holds min_tokens to the length it fits)."""
    least, most = params.get("min_tokens"), params.get("max_tokens")
    if isinstance(least, int) and isinstance(most, int) and least > most:
        return f"must be at most max_tokens ({most})"
    return None


def checked(params: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters of `params` as the request queue takes them: numbers as floats,
    whole ones as ints, those given as null left out (the replica fills in the default). The
    caller has refused `problems`."""
    out: dict[str, Any] = {}
    for name in NAMES:
        value = params.get(name)
        if value is not None:
            out[name] = int(value) if BY_NAME[name].whole else float(value)
    return out
