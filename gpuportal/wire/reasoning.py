"""A reasoning model's thinking, told apart from its answer: the text between `<think>` and
`</think>` (DeepSeek-R1's, QwQ's, Qwen 3's, and the many models trained on their traces) is the
answer's reasoning, what follows it its content, as vLLM's reasoning parsers give them. No Django:
the replica marks where a chat's prompt opened the thinking, and the web splits what it answers.

A chat template may open the thinking itself (its generation prompt ends with `<think>`, as
DeepSeek-R1's and QwQ's do): the model then writes only the closing tag. The replica begins such
an answer's text with the opening tag it was given (`opened_by`), so that the text reads as the
model's whole turn and the web tells the two apart the same way whichever template it was. An
answer that does not begin with the tag is all content: a model that did not think, or was told
not to (Qwen 3's `enable_thinking: false`, through `chat_template_kwargs`). A thinking may have a
budget of tokens, past which the replica closes it (`past_budget`)."""

from __future__ import annotations

from typing import Any

OPEN, CLOSE = "<think>", "</think>"
# An answer's reasoning, as vLLM names it now and as DeepSeek (and vLLM before) named it: a
# message and a stream's delta carry both, and either is read back in a conversation.
GIVEN = ("reasoning", "reasoning_content")
# Where chat templates read a past turn's reasoning (Qwen 3's).
TEMPLATE_FIELD = "reasoning_content"
# Request queue params: vLLM's `chat_template_kwargs`, what a chat's template is rendered with
# besides its messages (`enable_thinking: false` turns Qwen 3's thinking off), but for the names
# the replica passes itself.
TEMPLATE_KWARGS = "chat_template_kwargs"
# Request queue params (vLLM's name): the chat's last message, an assistant's, is continued
# rather than answered, its template rendered without a new turn (`continue_final_message`):
# a prefill, which Anthropic's Messages API makes of any conversation that ends with the
# assistant's words. The answer is what follows them.
CONTINUE_FINAL = "continue_final_message"
# Request queue params (vLLM's name, which /v1 takes as it is): the most tokens an answer's
# thinking may have (Anthropic's `thinking.budget_tokens`). At it, the replica makes the
# thinking's next token its closing tag, and the answer follows; a model with no tags as tokens
# of their own thinks unbounded.
THINKING_BUDGET = "thinking_token_budget"
TEMPLATE_OWN = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "chat_template"}
)  # fmt: skip


def opened_by(prompt: str) -> str:
    """What of a chat's prompt opened thinking that the answer continues (the tag and the
    whitespace after it, "" where it opened none): its last `<think>`, closed by no `</think>`
    after it, with nothing but whitespace after it."""
    at = prompt.rfind(OPEN)
    if at < 0 or prompt[at + len(OPEN) :].strip():
        return ""
    return prompt[at:]


def tag_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of `tokenizer`'s tokens `<think>` and `</think>` where it has the tags as tokens of
    their own (a reasoning model's: Qwen 3's, DeepSeek-R1's), None otherwise."""
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in (OPEN, CLOSE)]
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        return None
    return (ids[0], ids[1]) if tokenizer.convert_ids_to_tokens(ids[1]) == CLOSE else None


def past_budget(
    answer: list[int], budget: int | None, tags: tuple[int, int] | None, *, opened: bool, closed: bool
) -> bool:
    """Whether an answer (its token ids so far) thinks on past its budget (THINKING_BUDGET): its
    next token is to be the closing tag. Thinking: opened by its prompt (`opened`), or begun by
    its own first token, the opening tag (`tags`: the tags' ids); `closed`: it has closed it."""
    if budget is None or tags is None or closed:
        return False
    thinking = opened or (bool(answer) and answer[0] == tags[0])
    return thinking and len(answer) >= budget


def budget_problem(value: Any) -> str | None:
    """Why `value` cannot be a thinking budget, or None (None itself asks for none)."""
    if value is None or (type(value) is int and value >= 1):
        return None
    return "must be a whole number of at least 1"


def closing_id(tokenizer: Any) -> int | None:
    """The id of `tokenizer`'s token `</think>` (`tag_ids`): what an answer's reasoning tokens are
    counted to, and what closes a thinking past its budget."""
    tags = tag_ids(tokenizer)
    return tags[1] if tags is not None else None


def counted(output: dict[str, Any], ids: list[int], close_id: int | None) -> dict[str, Any]:
    """An answer's `output` (its text, its usage), the usage saying how many of its tokens (`ids`)
    were thinking, OpenAI's `completion_tokens_details.reasoning_tokens`, where the model has a
    closing tag to count to."""
    if close_id is not None:
        details = {"reasoning_tokens": thought_tokens(ids, close_id, output["text"])}
        output["usage"]["completion_tokens_details"] = details
    return output


def thought_tokens(ids: list[int], close_id: int, text: str) -> int:
    """How many of an answer's tokens (`ids`, its text `text`) are its thinking: up to and with the
    closing tag's token (`close_id`), all of them where it was cut before it; none where the
    answer did not think. OpenAI's `reasoning_tokens`."""
    if not text.lstrip().startswith(OPEN):
        return 0
    return ids.index(close_id) + 1 if close_id in ids else len(ids)


def split(text: str) -> tuple[str | None, str]:
    """(its reasoning, or None where it has none; its content) of an answer's text: an answer
    that begins with `<think>` reasons until `</think>` (to its end, where it was cut before the
    tag), and its content follows it, leading whitespace dropped."""
    body = text.lstrip()
    if not body.startswith(OPEN):
        return None, text
    body = body[len(OPEN) :]
    thought, closed, content = body.partition(CLOSE)
    return thought.strip(), content.lstrip() if closed else ""


class Splitter:
    """`split` as an answer streams: each piece's reasoning and content, the same texts in the end
    as `split` gives of the whole. Whitespace that might yet be dropped, and a tail that might
    begin a tag, are held until what follows tells them apart (`end` gives what is held then)."""

    def __init__(self) -> None:
        self.state = "start"  # start | thinking | answering | plain
        self.held = ""
        self.thinking_begun = False  # whether any reasoning was sent: before it, whitespace is dropped

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send now of `piece`, "" for none of either."""
        self.held += piece
        if self.state == "start":
            body = self.held.lstrip()
            if not body or (OPEN.startswith(body) and body != OPEN):
                return "", ""  # whitespace, or what may still open thinking ("<thi")
            if not body.startswith(OPEN):
                self.state, out, self.held = "plain", self.held, ""
                return "", out
            self.state, self.held = "thinking", body[len(OPEN) :].lstrip()
        if self.state == "thinking":
            return self._thinking(), self._answering() if self.state == "answering" else ""
        if self.state == "answering":
            return "", self._answering()
        out, self.held = self.held, ""
        return "", out

    def end(self) -> tuple[str, str]:
        """(reasoning, content) held at the answer's end: what it ends with is no tag's beginning."""
        if self.state == "start":
            # Nothing but whitespace, or a beginning of the tag that never came: content, as split has it.
            self.state = "plain"
        if self.state == "thinking":
            out, self.held = self.held.rstrip(), ""
            return out, ""
        if self.state == "answering":
            self.held = ""  # only whitespace is held before the content: dropped, as split drops it
            return "", ""
        out, self.held = self.held, ""
        return "", out

    def _thinking(self) -> str:
        if not self.thinking_begun:
            # The reasoning's leading whitespace, dropped as split drops it, however many pieces
            # it comes in ("<think>", " ", "Hm").
            self.held = self.held.lstrip()
        at = self.held.find(CLOSE)
        if at >= 0:
            out = self.held[:at].rstrip()
            self.held, self.state = self.held[at + len(CLOSE) :].lstrip(), "answering"
            return out
        # Kept back: a tail that may begin the tag, and the whitespace before it (dropped where
        # the tag follows it).
        held = self.held
        begun = next((n for n in range(min(len(held), len(CLOSE) - 1), 0, -1) if CLOSE.startswith(held[-n:])), 0)
        kept = len(held[: len(held) - begun].rstrip())
        out, self.held = held[:kept], held[kept:]
        self.thinking_begun = self.thinking_begun or bool(out)
        return out

    def _answering(self) -> str:
        if not self.held.strip():
            return ""  # the content's leading whitespace, dropped as split drops it
        out, self.held = self.held.lstrip(), ""  # whitespace held from earlier pieces, dropped too
        self.state = "plain"  # nothing of it is held from now on
        return out
