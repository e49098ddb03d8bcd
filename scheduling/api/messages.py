"""`POST /v1/messages`: Anthropic's Messages API (what Anthropic's SDKs, Claude Code and the agent
frameworks built on them call, and vLLM, Ollama and llama.cpp serve) as a chat of the portal's.
The body is read into a chat's (scheduling.api.messages_input) and checked as
`/v1/chat/completions` checks one, each refusal naming the Messages field; the request runs and
streams as a chat's does, and its answer is given as a message's content blocks: its thinking (a
reasoning model's, gpuportal.wire.reasoning), its text, and a `tool_use` block for each call it
makes. Errors come in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`),
which its clients raise as their own exceptions.

Anthropic's `max_tokens` is required and is a bound its models may stop before; clients send far
more than a replica holds (Claude Code asks 32,000), so the answer's length is fitted to the room
its replica has, up to it (gpuportal.wire.sampling.MAX_TOKENS_BOUND), as vLLM fits it."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest

from gpuportal.wire import reasoning, sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api import idempotency, tokens
from scheduling.api.completion_input import Completion, Refused
from scheduling.api.error_shapes import ReshapedErrors, message_of
from scheduling.api.inputs import FiniteFloatField
from scheduling.api.messages_input import FORMAT_FIELD, chat_body, renamed, thinking_budget
from scheduling.api.one_stream import followed
from scheduling.api.openai_compat import ChatCompletionsView, cached_tokens, read_call

ID_PREFIX = "msg_"
TOOL_ID_PREFIX = "toolu_"
# Anthropic's error types by HTTP status, as its clients map them to exceptions.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class AnthropicMessageInput(serializers.Serializer):
    """What Anthropic's clients send to /v1/messages, for the OpenAPI schema only: `chat_body`
    reads every body."""

    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    max_tokens = serializers.IntegerField(
        min_value=1,
        help_text="The most tokens the answer may have: it is fitted to the room its replica has, up to this.",
    )
    messages = serializers.JSONField(
        help_text='[{"role": "user" | "assistant", "content": a string or blocks}]: text, tool_use (an '
        "assistant's call), tool_result (its answer, in the user's turn) and thinking blocks."
    )
    system = serializers.JSONField(required=False, help_text="A system prompt: a string or text blocks.")
    stop_sequences = serializers.ListField(child=serializers.CharField(), required=False)
    temperature = FiniteFloatField(required=False)
    top_p = FiniteFloatField(required=False)
    top_k = serializers.IntegerField(required=False)
    stream = serializers.BooleanField(required=False, default=False, help_text="Anthropic's server-sent events.")
    tools = serializers.JSONField(
        required=False, help_text='Client tools: [{"name", "description", "input_schema": a JSON Schema}].'
    )
    tool_choice = serializers.JSONField(
        required=False,
        help_text='{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}; '
        '"disable_parallel_tool_use": true for one call at most.',
    )
    output_config = serializers.JSONField(
        required=False,
        help_text='{"format": {"type": "json_schema", "schema": {...}}}: the answer held to it as it is generated.',
    )


def error(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(output: dict[str, Any], called: bool, bound: int | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence met) of an answer asked to be at most `bound`
    tokens: one cut short of it ran out of the room its replica had (the model's context, or its
    share of the KV cache), which Anthropic tells apart from its max_tokens."""
    if called:
        return "tool_use", None
    if output.get("finish_reason") == "length":
        made = (output.get("usage") or {}).get("completion_tokens", 0)
        return ("model_context_window_exceeded" if bound is not None and made < bound else "max_tokens"), None
    met = output.get(sampling.STOP_REASON)
    if isinstance(met, str):
        return "stop_sequence", met
    return "end_turn", None


def usage(output: dict[str, Any]) -> dict[str, Any]:
    """A replica's token counts as a message's usage."""
    counted = output.get("usage") or {}
    cached = cached_tokens(counted)
    # Anthropic's input_tokens are those not read from its cache: the prompt is the sum of the two.
    said: dict[str, Any] = {
        "input_tokens": counted.get("prompt_tokens", 0) - cached,
        "output_tokens": counted.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
    if (details := counted.get("completion_tokens_details")) is not None:
        said["output_tokens_details"] = {"thinking_tokens": details.get("reasoning_tokens", 0)}
    return said


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"{TOOL_ID_PREFIX}{call['id'].removeprefix('call_')}",
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


class MessagesView(ReshapedErrors, ChatCompletionsView):
    """`POST /v1/messages`: a chat, its answer as a message's content blocks."""

    input_param = "messages"

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        summary="Answer as Anthropic's Messages API does.",
        description="A chat of a causal LM deployment, given and answered as Anthropic's Messages API: `system`, "
        "`messages` of text, tool_use, tool_result and thinking blocks, client tools, `output_config.format`; "
        "streamed as its events. The key comes as `x-api-key` or a bearer token.",
        request=AnthropicMessageInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    @staticmethod
    def shape(status: int, message: str) -> dict[str, Any]:
        return error(status, message)

    def parse(self, body: Any, owner: str) -> Completion:
        chat, origins = chat_body(body)
        try:
            call = read_call(chat, "chat")
        except Refused as refused:
            param = renamed(refused.param, origins)
            if param == FORMAT_FIELD and body.get("output_config") is None:
                param = "output_format"
            raise Refused(param, refused.message) from None
        params = {**call.params, "max_tokens": None, sampling.MAX_TOKENS_BOUND: body["max_tokens"]}
        if (budget := thinking_budget(body.get("thinking"))) is not None:
            params[reasoning.THINKING_BUDGET] = budget
        if call.params.get(sampling.SCHEMA_FIELD) == "response_format":  # the field a replica's refusal names
            params[sampling.SCHEMA_FIELD] = FORMAT_FIELD if body.get("output_config") is not None else "output_format"
        return Completion(model=call.model, input=call.input, params=params, timeout_s=call.timeout_s)

    def body(self, results: list[Request], asked: list[Request], model: str, n: int = 1) -> dict[str, Any]:
        output = results[0].output or {}
        blocks = self.blocks(output, asked[0])
        called = any(block["type"] == "tool_use" for block in blocks)
        reason, met = stop_reason(output, called, asked[0].params.get(sampling.MAX_TOKENS_BOUND))
        return {
            **self.begun(asked[0], model),
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": met,
            "usage": usage(output),
        }

    def blocks(self, output: dict[str, Any], asked: Request) -> list[dict[str, Any]]:
        """A message's content blocks: its thinking (a reasoning model's, where it has any), its
        text (where it says anything, or is nothing else), then a tool_use for each call."""
        message = self.choice(output, asked)["message"]
        thought, text, calls = message.get(reasoning.GIVEN[0]), message.get("content"), message.get("tool_calls")
        blocks: list[dict[str, Any]] = []
        if thought:
            blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
        if text or not (calls or thought):
            blocks.append({"type": "text", "text": text or ""})
        blocks += [_tool_use_block(call) for call in calls or ()]
        return blocks

    @staticmethod
    def begun(request: Request, model: str) -> dict[str, Any]:
        """The message as it begins: no content yet, no stop_reason."""
        return {
            "id": f"{ID_PREFIX}{request.id.replace('-', '')}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    def events(self, submitted: list[Request], call: Completion) -> Iterator[bytes]:
        """Anthropic's server-sent events: message_start, then a content block of the thinking and
        one of the text as they come (content_block_start, its deltas, content_block_stop), each
        call whole as a tool_use block with its input in one input_json_delta, then message_delta
        (the stop_reason and the usage) and message_stop; an error event instead where the request
        failed or did not end within the call's timeout. An answer that may call tools sends its
        text until it opens a call, as a chat's stream does (gpuportal.wire.tools.Watch)."""
        request = submitted[0]
        blocks = _Blocks()
        yield blocks.event("message_start", message=self.begun(request, call.model))
        heard = followed(
            request, call, held=self.held_back(call), watched=self.watched(call), begun=lambda: blocks.opened
        )
        with contextlib.closing(heard):  # closed early (the client left), it stops the request
            for said in heard:
                if not said.ended:
                    if said.comment:
                        yield said.comment
                    yield from blocks.said(THINKING, said.thought)
                    yield from blocks.said(TEXT, said.text)
                    continue
                final = said.final
                if final is None or final.status != "done":
                    failed = self._ended_short(final, request, call.timeout_s)
                    yield blocks.event("error", **error(_status_of(failed), message_of(failed)))
                    return
                yield from self._ending(blocks, final, said.watch)

    def _ending(self, blocks: _Blocks, final: Request, watch: tools.Watch | None) -> Iterator[bytes]:
        """The events of an answer's end: the rest of its thinking and text (what the stream held
        back), each call whole, the stop_reason and the usage."""
        output = final.output or {}
        message = self.choice(output, final)["message"]
        content = reasoning.split(output.get("text", ""))[1]
        calls = message.get("tool_calls") or []
        whole = {THINKING: message.get(reasoning.GIVEN[0]) or "", TEXT: message.get("content") or ""}
        for kind in (THINKING, TEXT):
            if kind == TEXT and watch is not None and calls:
                rest = tools.unsent(content, watch.sent, message.get("content"))
            else:
                rest = whole[kind][len(blocks.sent.get(kind, "")) :]
            # A text block even for no text where the answer is nothing else, as a message's is.
            yield from blocks.said(kind, rest, force=kind == TEXT and not calls and not blocks.opened)
        yield from blocks.close_open()
        for call in calls:
            block = _tool_use_block(call)
            index = blocks.open_index()
            yield blocks.event("content_block_start", index=index, content_block={**block, "input": {}})
            yield blocks.event(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)},
            )
            yield blocks.event("content_block_stop", index=index)
        reason, met = stop_reason(output, bool(calls), final.params.get(sampling.MAX_TOKENS_BOUND))
        yield blocks.event("message_delta", delta={"stop_reason": reason, "stop_sequence": met}, usage=usage(output))
        yield blocks.event("message_stop")


THINKING, TEXT = "thinking", "text"


def _status_of(failed: dict[str, Any]) -> int:
    """The HTTP status an error event's failure would have had: the caller's input a 400, a
    timeout a 504, a cancel a 409, anything else the replica's (503)."""
    kind = failed["error"]["type"]
    return {"invalid_request_error": 400, "timeout": 504, "cancelled": 409}.get(kind, 503)


class _Blocks:
    """The content blocks a message's stream has opened, each at its index in the order opened,
    and the text each has sent; one open at a time (the thinking closed as the text opens)."""

    def __init__(self) -> None:
        self.count = itertools.count()
        self.at: dict[str, int] = {}  # a block's kind → its index
        self.open: str | None = None
        self.sent: dict[str, str] = {}

    @property
    def opened(self) -> bool:
        return bool(self.at)

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    def open_index(self) -> int:
        return next(self.count)

    def said(self, kind: str, text: str, *, force: bool = False) -> Iterator[bytes]:
        """The events of `text` of the block of `kind` (opened first where it is not, the one
        open before it closed); with `force`, the block opened even for no text."""
        if not text and not (force and kind not in self.at):
            return
        if kind not in self.at:
            yield from self.close_open()
            self.at[kind], self.open = self.open_index(), kind
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == THINKING
                else {"type": "text", "text": ""}
            )
            yield self.event("content_block_start", index=self.at[kind], content_block=block)
        if text:
            self.sent[kind] = self.sent.get(kind, "") + text
            delta = (
                {"type": "thinking_delta", "thinking": text}
                if kind == THINKING
                else {"type": "text_delta", "text": text}
            )
            yield self.event("content_block_delta", index=self.at[kind], delta=delta)

    def close_open(self) -> Iterator[bytes]:
        if self.open is not None:
            yield self.event("content_block_stop", index=self.at[self.open])
            self.open = None


class CountTokensView(MessagesView):
    """`POST /v1/messages/count_tokens`: the tokens a Messages body's prompt holds (its system,
    messages and tools, through the model's template), as Anthropic's count_tokens; counted by a
    replica (scheduling.api.tokens)."""

    @extend_schema(
        parameters=[],
        summary="Count a Messages body's input tokens, as Anthropic's count_tokens.",
        description="The system prompt, messages and tools through the model's chat template, counted by a "
        "replica with the model's own tokenizer; a deployment asleep is woken. `max_tokens` is not needed.",
        request=AnthropicMessageInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            if isinstance(body, dict) and body.get("max_tokens") is None:
                body = {**body, "max_tokens": 1}  # a count's body needs none: it generates nothing
            call = self.parse(body, owner)
        except Refused as refused:
            return 400, {"error": {"message": str(refused), "param": refused.param}}
        params = tokens.template_params(call)
        code, result = tokens.counted(call.model, "chat", call.input, params, owner, call.timeout_s, "messages")
        if not isinstance(result, Request):
            return code, result
        return 200, {"input_tokens": len((result.output or {})[sampling.PROMPT_TOKEN_IDS])}
