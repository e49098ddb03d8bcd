"""Answers held to a format as they are generated: OpenAI's `response_format` (a JSON object, or
the JSON a JSON Schema describes), vLLM's guided decoding (one of some strings, a regular
expression). Each next token is picked among those that keep the answer a prefix of such text,
and the end of text only once it is whole. lm-format-enforcer's character parsers read the
formats; this module gives them the model's own tokenizer. Runs in the replica; no Django, and
nothing imported until a request asks for it."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from inference.errors import BadInput

# What a tokenizer's vocabulary is to the parser (each token's text as it reads after another
# token, and whether it begins a word, and the parser's index of them), built once per tokenizer
# and vocabulary size, on a thread of its own: a few tenths of a second for 32,000 tokens (a
# second and more with the garbage collector running: _Collector), which the replica's batch
# would otherwise stand still for when the first request held to a format reaches it. Read and
# written under _VIEWS_LOCK.
_VIEWS: weakref.WeakKeyDictionary[Any, dict[int, Future[Any]]] = weakref.WeakKeyDictionary()
_VIEWS_LOCK = threading.Lock()

# A token's text is read after this one's, so that a token that begins a word shows its space.
_ANCHOR_TEXT = "0"


def tokenizer_view(tokenizer: Any, vocab_size: int, ends: Iterable[int]) -> Future[Any]:
    """The parser's view of `tokenizer`'s first `vocab_size` tokens: done already where an earlier
    request had it built, else being built on a thread of its own (one for every asker)."""
    with _VIEWS_LOCK:
        with contextlib.suppress(KeyError, TypeError):
            return _VIEWS[tokenizer][vocab_size]
        view: Future[Any] = Future()
        with contextlib.suppress(TypeError):  # one no weak reference can hold is built for each asker
            _VIEWS.setdefault(tokenizer, {})[vocab_size] = view
    # What the thread reads of the tokenizer's settings is read here, on the caller's thread: an
    # encode may change the fast tokenizer's truncation (a mutable borrow of the Rust object),
    # which a decode running meanwhile on the other thread would refuse ("Already borrowed").
    anchor = tokenizer.encode(_ANCHOR_TEXT, add_special_tokens=False)[-1]
    special = set(tokenizer.all_special_ids)
    ends = sorted(ends)

    def build() -> None:
        try:
            with _collector_paused():
                view.set_result(_built_view(tokenizer, vocab_size, ends, anchor, special))
        except BaseException as exc:
            with _VIEWS_LOCK, contextlib.suppress(KeyError, TypeError):
                del _VIEWS[tokenizer][vocab_size]  # the next request tries again
            view.set_exception(exc)

    threading.Thread(target=build, name="format-view", daemon=True).start()
    return view


class _Collector:
    """Python's cyclic garbage collector, paused while views are built (how many builds run is
    counted, so the last one to end lets it run again). A view is some hundred thousand small
    objects (the parser's tree of token prefixes); with the collector running, their allocation
    sets off full collections over everything the replica holds, each a few hundred milliseconds
    of the interpreter's lock which the serving thread then waits for: the batch stood still
    about as long as with the view built on it (BENCHMARKS.md). Paused, the view takes 3-6 times
    less time to build; then everything alive is frozen (gc.freeze: never scanned again), or the
    collections the view's objects set off later would stall a step the same way. What is
    frozen is the view and what the replica keeps for its life (its model, its modules) beside
    any cyclic garbage not collected yet, which stays: at most once per view, once per tokenizer."""

    lock = threading.Lock()
    builds = 0
    was_enabled = True


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    with _Collector.lock:
        _Collector.builds += 1
        if _Collector.builds == 1:
            _Collector.was_enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _Collector.lock:
            _Collector.builds -= 1
            if _Collector.builds == 0:
                gc.freeze()
                if _Collector.was_enabled:
                    gc.enable()


def _built_view(tokenizer: Any, vocab_size: int, ends: list[int], anchor: int, special: set[int]) -> Any:
    from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

    lead = len(tokenizer.decode([anchor]))
    tokens = [token for token in range(vocab_size) if token not in special]
    after_anchor = decoded(tokenizer, [[anchor, token] for token in tokens])
    alone = decoded(tokenizer, [[token] for token in tokens])
    # A token begins a "word" to the parser where its text does not depend on the tokens before
    # it: one that shows a space only after another (SentencePiece's "▁"), or one whose text is
    # the same alone and after another (a byte-level BPE's, whole characters). The parser reads
    # the text of the tokens since the last such one by decoding them together, each step: with
    # none (a byte-level BPE read by the first rule alone), that was the whole answer, each step.
    regular = [
        (token, after[lead:], len(after) - lead > len(text) or (after[lead:] == text and "\ufffd" not in text))
        for token, after, text in zip(tokens, after_anchor, alone, strict=True)
    ]

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens)).rstrip("\ufffd")  # a character whose bytes are not all here yet

    view = TokenEnforcerTokenizerData(regular, decode, ends, False, vocab_size)
    # The characters a string may hold, to the parser: lm-format-enforcer's are those some token
    # begins with, so a character a byte-level BPE has only after a space (" ん" but no "ん") was
    # let into a string by the token's text and then refused by the parser, which ended the
    # answer there, its JSON unfinished. Every character of every token's text is one (not the
    # replacement character of a token that is part of a character's bytes).
    every = {character for _, text, _ in regular for character in text} - {"\ufffd"}
    view.tokenizer_alphabet = "".join(sorted(every | set(view.tokenizer_alphabet)))
    return view


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
    schema_field: str = "response_format",
) -> Held:
    """What an answer's next token may be, held to JSON `schema` describes, to one of `choices`,
    or to a match of `regex` (the one given). BadInput, naming the field (`schema_field`: the
    caller's name for the schema), for a format the parser refuses, here and now; the parser's
    view of the tokenizer may still be being built (`Held`)."""
    from lmformatenforcer import JsonSchemaParser, RegexParser, StringParser, UnionParser

    field, what = (
        (schema_field, "this JSON Schema")
        if schema is not None
        else ("guided_choice", "these choices")
        if choices is not None
        else ("guided_regex", "this regular expression")
    )
    try:
        if schema is not None:
            parser = JsonSchemaParser(schema)
        elif choices is not None:
            parser = UnionParser([StringParser(choice) for choice in choices])
        else:
            parser = RegexParser(regex or "")
        parser.get_allowed_characters()  # what it cannot hold to (an unknown type) it says here
    except Exception as exc:  # the parsers raise plain Exceptions (a regex's InvalidSyntax says nothing more)
        raise BadInput(f"{field}: {what} cannot be held to: {str(exc) or type(exc).__name__}") from None
    return Held(tokenizer_view(tokenizer, vocab_size, ends), parser, f"{field}: {what} cannot be held to")


class Held:
    """One answer's format: called with the answer's tokens so far (one more each time), the ids
    its next token may be (a list not to be changed): those that keep the answer a prefix of the
    format's text, and its end of text once it is whole; the very list of the call before where
    they are the same. A call waits for the parser's view of the tokenizer; `ready` says whether
    it would (the batcher lets others by meanwhile)."""

    def __init__(self, view: Future[Any], parser: Any, refusal: str):
        self._view, self._parser, self._refusal = view, parser, refusal
        self._enforcer: Any = None
        self._last: list[int] = []

    def ready(self) -> bool:
        return self._view.done()

    def wait(self, timeout: float) -> bool:
        """Whether the view is built (or failed) within `timeout` seconds."""
        with contextlib.suppress(FutureTimeout):
            self._view.exception(timeout)
        return self._view.done()

    def __call__(self, answer: list[int]) -> list[int]:
        if self._enforcer is None:
            from lmformatenforcer import TokenEnforcer

            self._enforcer = TokenEnforcer(self._view.result(), self._parser)
            context = getattr(self._parser, "context", None)
            if hasattr(context, "alphabet_without_quotes"):
                # A JSON Schema parser reads what a string may hold before its minLength from the
                # config it was made with (lm-format-enforcer's default: printable ASCII), not the
                # tokenizer's the enforcer gives it: any other character ended the string there,
                # and the object with it, half written.
                context.alphabet_without_quotes = self._parser.config.alphabet.replace('"', "")
        enforcer = self._enforcer
        key = (_ROOT, *answer)
        try:
            found: list[int] = enforcer.get_allowed_tokens(list(key)).allowed_tokens
        except Exception as exc:  # a part of the schema it meets only now ($ref to nowhere, ...)
            raise BadInput(f"{self._refusal}: {str(exc) or type(exc).__name__}") from None
        # Only the last state leads on: the enforcer keeps one for every prefix of the answer,
        # keyed by the prefix itself, which would grow with the square of the answer's length.
        enforcer.prefix_states = {key: enforcer.prefix_states[key]}
        if found == self._last:
            # The same ids as the step before (inside a string, most steps): the same list, so
            # that the batcher reuses its mask of them. Quick to tell: the lists hold the same
            # int objects, the enforcer's cached ones.
            return self._last
        self._last = found
        return found
