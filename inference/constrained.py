"""Answers held to a format as they are generated: OpenAI's `response_format` (a JSON object, or
the JSON a JSON Schema describes), vLLM's guided decoding (one of some strings, a regular
expression). Each next token is picked among those that keep the answer a prefix of such text,
and the end of text only once it is whole. lm-format-enforcer's character parsers read the
formats; this module gives them the model's own tokenizer. Runs in the replica; no Django, and
nothing imported until a request asks for it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from inference.errors import BadInput

# What a tokenizer's vocabulary is to the parser (each token's text as it reads after another
# token, and whether it begins a word), built once per tokenizer and vocabulary size: it decodes
# every token twice (about 0.8 s for 30,000 tokens), which the first request held to JSON pays.
_TOKENIZER_DATA: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()

# A token's text is read after this one's, so that a token that begins a word shows its space.
_ANCHOR_TEXT = "0"


def _tokenizer_data(tokenizer: Any, vocab_size: int, ends: Iterable[int]) -> Any:
    from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

    with contextlib.suppress(KeyError, TypeError):
        return _TOKENIZER_DATA[tokenizer][vocab_size]
    anchor = tokenizer.encode(_ANCHOR_TEXT, add_special_tokens=False)[-1]
    lead = len(tokenizer.decode([anchor]))
    special = set(tokenizer.all_special_ids)
    tokens = [token for token in range(vocab_size) if token not in special]
    after_anchor = decoded(tokenizer, [[anchor, token] for token in tokens])
    alone = decoded(tokenizer, [[token] for token in tokens])
    regular = [
        (token, after[lead:], len(after) - lead > len(text))
        for token, after, text in zip(tokens, after_anchor, alone, strict=True)
    ]

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens)).rstrip("\ufffd")  # a character whose bytes are not all here yet

    data = TokenEnforcerTokenizerData(regular, decode, sorted(ends), False, vocab_size)
    with contextlib.suppress(TypeError):  # one no weak reference can hold is built each time
        _TOKENIZER_DATA.setdefault(tokenizer, {})[vocab_size] = data
    return data


def decoded(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    """Each sequence's text as `tokenizer.decode` gives it. Where that is the tokenizers library's
    text as it is (a fast tokenizer that asks no clean-up of it), all in one call of the library:
    about five times faster than a decode each for a 30,000-token vocabulary (BENCHMARKS.md), and
    the first request held to a format on a replica waits for it. Otherwise one decode each."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return list(backend.decode_batch(sequences, skip_special_tokens=False))
    return [tokenizer.decode(sequence) for sequence in sequences]


# The root of an answer's tokens as the enforcer keys them: no token's id, so the answer's own
# tokens, not its prompt's, make each key.
_ROOT = -1


def held_to(
    tokenizer: Any,
    vocab_size: int,
    ends: Iterable[int],
    *,
    schema: dict[str, Any] | None = None,
    choices: list[str] | None = None,
    regex: str | None = None,
) -> Callable[[list[int]], list[int]]:
    """A function of an answer's tokens so far to the ids its next token may be: those that keep
    the answer a prefix of JSON `schema` describes, of one of `choices`, or of a match of `regex`
    (the one given), and one of `ends` (its end of text) once it is whole. Called with one token
    more each time. BadInput, naming the field, for a format the parser refuses."""
    from lmformatenforcer import JsonSchemaParser, RegexParser, StringParser, TokenEnforcer, UnionParser

    field, what = (
        ("response_format", "this JSON Schema")
        if schema is not None
        else ("guided_choice", "these choices")
        if choices is not None
        else ("guided_regex", "this regular expression")
    )

    def refused(exc: Exception) -> BadInput:
        return BadInput(f"{field}: {what} cannot be held to: {str(exc) or type(exc).__name__}")

    try:
        if schema is not None:
            parser = JsonSchemaParser(schema)
        elif choices is not None:
            parser = UnionParser([StringParser(choice) for choice in choices])
        else:
            parser = RegexParser(regex or "")
        parser.get_allowed_characters()  # what it cannot hold to (an unknown type) it says here
    except Exception as exc:  # the parsers raise plain Exceptions (a regex's InvalidSyntax says nothing more)
        raise refused(exc) from None
    enforcer = TokenEnforcer(_tokenizer_data(tokenizer, vocab_size, ends), parser)

    def allowed(answer: list[int]) -> list[int]:
        key = (_ROOT, *answer)
        try:
            found = list(enforcer.get_allowed_tokens(list(key)).allowed_tokens)
        except Exception as exc:  # a part of the schema it meets only now ($ref to nowhere, ...)
            raise refused(exc) from None
        # Only the last state leads on: the enforcer keeps one for every prefix of the answer,
        # keyed by the prefix itself, which would grow with the square of the answer's length.
        enforcer.prefix_states = {key: enforcer.prefix_states[key]}
        return found

    return allowed
