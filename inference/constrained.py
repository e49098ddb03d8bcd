"""Answers held to JSON as they are generated (OpenAI's `response_format`: a JSON object, or the
JSON a JSON Schema describes): each next token is picked among those that keep the answer a
prefix of such JSON, and the end of text only once it is whole. lm-format-enforcer's character
parser does the JSON; this module gives it the model's own tokenizer. Runs in the replica; no
Django, and nothing imported until a request asks for it."""

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
    regular = []
    for token in range(vocab_size):
        if token in special:
            continue
        after = tokenizer.decode([anchor, token])[lead:]
        regular.append((token, after, len(after) > len(tokenizer.decode([token]))))

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens)).rstrip("\ufffd")  # a character whose bytes are not all here yet

    data = TokenEnforcerTokenizerData(regular, decode, sorted(ends), False, vocab_size)
    with contextlib.suppress(TypeError):  # one no weak reference can hold is built each time
        _TOKENIZER_DATA.setdefault(tokenizer, {})[vocab_size] = data
    return data


# The root of an answer's tokens as the enforcer keys them: no token's id, so the answer's own
# tokens, not its prompt's, make each key.
_ROOT = -1


def json_allowed(
    tokenizer: Any, vocab_size: int, ends: Iterable[int], schema: dict[str, Any]
) -> Callable[[list[int]], list[int]]:
    """A function of an answer's tokens so far to the ids its next token may be: those that keep
    the answer a prefix of JSON `schema` describes, and one of `ends` (its end of text) once that
    JSON is whole. Called with one token more each time. BadInput for a schema the parser refuses."""
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer

    try:
        parser = JsonSchemaParser(schema)
        parser.get_allowed_characters()  # what it cannot hold to (an unknown type) it says here
    except Exception as exc:  # the parser raises plain Exceptions for schemas it does not take
        raise BadInput(f"response_format: this JSON Schema cannot be held to: {exc}") from None
    enforcer = TokenEnforcer(_tokenizer_data(tokenizer, vocab_size, ends), parser)

    def allowed(answer: list[int]) -> list[int]:
        key = (_ROOT, *answer)
        try:
            found = list(enforcer.get_allowed_tokens(list(key)).allowed_tokens)
        except Exception as exc:  # a part of the schema it meets only now ($ref to nowhere, ...)
            raise BadInput(f"response_format: this JSON Schema cannot be held to: {exc}") from None
        # Only the last state leads on: the enforcer keeps one for every prefix of the answer,
        # keyed by the prefix itself, which would grow with the square of the answer's length.
        enforcer.prefix_states = {key: enforcer.prefix_states[key]}
        return found

    return allowed
