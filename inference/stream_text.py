"""What of a streamed answer may go out: each new token's text, as a decode of every token so far.

Decoding a prefix can change its tail (bytes that merge with the next token's), and a byte-level
tokenizer's token can end inside a multi-byte character, which decodes to U+FFFD until the
character's last byte arrives. Text goes out only once it is settled, so that the pieces a client
receives add up to the answer's text."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def newly_settled(text: str, sent: str, *, final: bool = False) -> str:
    """What of `text` (the decode of every token so far) follows `sent` and is settled: a trailing
    incomplete character waits for its last byte, unless the answer is `final`; a tail that changed
    under what was sent gives nothing (the answer's text still has it)."""
    settled = text if final else text.rstrip(REPLACEMENT)
    if settled.startswith(sent) and len(settled) > len(sent):
        return settled[len(sent) :]
    return ""


class IncrementalText:
    """The text of a sequence's generated tokens as they grow, each new token decoded with only
    the few before it (the window that can still change), not the whole list again: a decode
    a token whatever the answer's length, where decoding the whole list made each token cost as
    much as all before it. The window starts one settled token back, so a tokenizer that drops a
    word's leading space at the start of a decode (SentencePiece's) still gives it. A token that
    ends inside a character adds nothing until the character is whole."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # where the window starts: the first token of the last piece added
        self._read = 0  # the tokens already in `text`

    def update(self, ids: list[int]) -> str:
        """`text` once `ids` (every generated token so far, the last ones new) are in."""
        decode = self.tokenizer.decode
        before = decode(ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
        return self.text
