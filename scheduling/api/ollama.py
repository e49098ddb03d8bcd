"""Ollama's own API over the portal's deployments, for what speaks it natively (Ollama's Python
and JavaScript libraries, LangChain's ChatOllama, Open WebUI's and Continue's Ollama
connections): `POST /api/chat` and `POST /api/generate` here, the model list and embeddings in
scheduling.api.ollama_models. A body is read into a chat's or a completion's and checked as
`/v1` checks one, each refusal naming Ollama's field; the answer comes as Ollama's, streamed (its
default) as lines of JSON.

Ollama's `options.num_predict` is a bound, its default none (until the model stops or its
context is full): the answer is fitted to the room its replica has, under it
(gpuportal.wire.sampling.MAX_TOKENS_BOUND). Errors are `{"error": message}`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest

from gpuportal.wire import reasoning, sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api import ollama_load
from scheduling.api.completion_input import Completion, Refused, not_text
from scheduling.api.error_shapes import ReshapedErrors
from scheduling.api.one_stream import followed
from scheduling.api.openai_compat import ChatCompletionsView, read_call
from scheduling.services.errors import ServiceError

# Ollama's options the portal reads, by the sampling parameter each is (gpuportal.wire.sampling).
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# num_predict of these: no bound (Ollama's -1, infinite; -2, the context filled).
UNBOUNDED = (-1, -2)
ROLES = ("system", "user", "assistant", "tool")
NANOSECONDS = 1_000_000_000


class OllamaChatInput(serializers.Serializer):
    """What Ollama's clients send to /api/chat, for the OpenAPI schema only."""

    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    messages = serializers.JSONField(
        help_text='[{"role": "system" | "user" | "assistant" | "tool", "content", "thinking"?, "tool_calls"?}]'
    )
    stream = serializers.BooleanField(required=False, default=True, help_text="Lines of JSON (Ollama's default).")
    format = serializers.JSONField(required=False, help_text='"json", or a JSON Schema the answer is held to.')
    options = serializers.JSONField(
        required=False,
        help_text="temperature, top_p, top_k, min_p, seed, repeat_penalty, presence_penalty, frequency_penalty, "
        "stop, num_predict (a bound; the answer fitted to its replica's room under it). Others are ignored.",
    )
    tools = serializers.JSONField(required=False, help_text='[{"type": "function", "function": {...}}], as /v1.')
    think = serializers.JSONField(required=False, help_text="false: a reasoning model told not to think.")


class OllamaGenerateInput(serializers.Serializer):
    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    prompt = serializers.CharField(help_text="The user's message (raw: the prompt as it is, no template).")
    system = serializers.CharField(required=False)
    raw = serializers.BooleanField(required=False, default=False)
    stream = serializers.BooleanField(required=False, default=True)
    format = serializers.JSONField(required=False)
    options = serializers.JSONField(required=False)
    think = serializers.JSONField(required=False)


def error(message: str) -> dict[str, Any]:
    return {"error": message}


def sampled(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of Ollama's `options`, `format` and `think`: its sampling, stops, bound,
    answer format and template's thinking switch."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise Refused("options", "must be an object: {temperature, top_p, num_predict, stop, ...}")
    chat: dict[str, Any] = {OPTIONS[name]: value for name, value in options.items() if name in OPTIONS}
    if options.get("stop") is not None:
        chat["stop"] = options["stop"]
    predict = options.get("num_predict")
    if predict is not None and predict not in UNBOUNDED and (type(predict) is not int or predict < 1):
        raise Refused("options.num_predict", "must be a whole number of at least 1, or -1 for no bound")
    answer_format = body.get("format")
    if answer_format == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(answer_format, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": answer_format}}
    elif answer_format not in (None, ""):
        raise Refused("format", 'must be "json" or a JSON Schema object')
    think = body.get("think")
    if think is False:
        chat[reasoning.TEMPLATE_KWARGS] = {"enable_thinking": False}  # Qwen 3's switch, as Ollama's templates have it
    elif think not in (None, True, "low", "medium", "high"):
        raise Refused("think", 'must be true, false, or "low", "medium", "high"')
    return chat


def bound(body: dict[str, Any]) -> int:
    """The most tokens an answer may have: num_predict, or where it sets none the most any request may."""
    predict = (body.get("options") or {}).get("num_predict")
    return sampling.MOST_TOKENS if predict is None or predict in UNBOUNDED else min(predict, sampling.MOST_TOKENS)


def renamed(param: str | None) -> str | None:
    """Ollama's field of a chat field a refusal names."""
    if param is None:
        return None
    head = param.partition(".")[0]
    back = {name: option for option, name in OPTIONS.items()}
    if head in back:
        return f"options.{back[head]}"
    if head == "stop":
        return "options.stop"
    if head == "response_format":
        return "format"
    if head == reasoning.TEMPLATE_KWARGS:
        return "think"
    return param


def messages_of(given: Any) -> list[dict[str, Any]]:
    """Ollama's messages as a chat's: an assistant's `thinking` given back as its reasoning, its
    calls' arguments objects as Ollama gives them; images refused by name."""
    if not isinstance(given, list) or not given:
        raise Refused("messages", "required: a non-empty list of messages")
    read = []
    for i, message in enumerate(given):
        if not isinstance(message, dict):
            raise Refused(f"messages.{i}", "must be an object: {role, content}")
        if message.get("images"):
            raise Refused(f"messages.{i}.images", "not supported: the models served here read text")
        if message.get("role") not in ROLES:
            raise Refused(f"messages.{i}.role", f"must be one of {', '.join(ROLES)}")
        kept = {key: message[key] for key in ("role", "content", "tool_calls") if message.get(key) is not None}
        kept.setdefault("content", "")
        if message.get("thinking") is not None:
            kept[reasoning.GIVEN[0]] = message["thinking"]
        read.append(kept)
    return read


def done_reason(output: dict[str, Any]) -> str:
    """Ollama's done_reason of an answer: cut by its length, or stopped."""
    return "length" if output.get("finish_reason") == "length" else "stop"


def stamp(at: float | None = None) -> str:
    """A time as Ollama writes one (RFC 3339, UTC)."""
    return datetime.fromtimestamp(at if at is not None else time.time(), UTC).isoformat().replace("+00:00", "Z")


def durations(request: Request) -> dict[str, int]:
    """An ended request's counts and times as Ollama's are named (nanoseconds): `load_duration`
    its wait for a replica (a wake or a load included), `prompt_eval_duration` to its first token,
    `eval_duration` the rest."""
    usage = (request.output or {}).get("usage") or {}
    created = request.created_at or time.time()
    started = request.started_at or request.dispatched_at or created
    first = request.first_token_at or started
    ended = request.finished_at or time.time()

    def ns(seconds: float) -> int:
        return max(0, int(seconds * NANOSECONDS))

    return {
        "total_duration": ns(ended - created),
        "load_duration": ns(started - created),
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": ns(first - started),
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": ns(ended - first),
    }


class OllamaChatView(ReshapedErrors, ChatCompletionsView):
    """`POST /api/chat`: a chat, answered as Ollama's."""

    input_param = "messages"
    stream_type = "application/x-ndjson"

    @extend_schema(
        summary="Answer a chat as Ollama's /api/chat does.",
        description="A causal LM deployment's chat, given and answered as Ollama's API: `messages`, `options`, "
        "`format`, `tools`, `think`; streamed (the default) as lines of JSON. The key is the portal's token, as a "
        "bearer token (ollama's clients send it with `headers`).",
        request=OllamaChatInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def _answer_with_key(self, request: Any, body: Any, owner: str) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        # Both paths come here (a token's, without DRF, and DRF's): a load or an unload is no request.
        if not isinstance(body, dict) or not ollama_load.nothing_to_answer(body, self.input_param):
            return super()._answer_with_key(request, body, owner)
        try:
            done = ollama_load.load_or_unload(body, self.caller(request) or request.user)
        except Refused as refused:
            return 400, error(str(refused))
        except ServiceError as refused:
            return refused.status, error(str(refused))
        return 200, {"model": body["model"], "created_at": stamp(), **self.nothing(), "done": True, "done_reason": done}

    @staticmethod
    def nothing() -> dict[str, Any]:
        """The answer's fields when nothing was asked (a load or an unload)."""
        return {"message": {"role": "assistant", "content": ""}}

    @staticmethod
    def shape(status: int, message: str) -> dict[str, Any]:
        return error(message)

    def chat_of(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1 chat body an Ollama body asks for."""
        model = ollama_load.named(body.get("model"))
        chat = {"model": model, "messages": messages_of(body.get("messages")), **sampled(body)}
        if body.get("tools"):
            chat["tools"] = body["tools"]
        return chat

    def parse(self, body: Any, owner: str) -> Completion:
        if not isinstance(body, dict):
            raise Refused(None, "the body must be a JSON object")
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise Refused("stream", "must be true or false")
        ollama_load.keep_alive_s(body.get("keep_alive"))  # its form only: the deployment's sleep decides
        chat = {**self.chat_of(body), "stream": stream}
        try:
            call = read_call(chat, self.kind)
        except Refused as refused:
            raise Refused(renamed(refused.param), refused.message) from None
        params = {**call.params, "max_tokens": None, sampling.MAX_TOKENS_BOUND: bound(body)}
        if call.params.get(sampling.SCHEMA_FIELD) == "response_format":
            params[sampling.SCHEMA_FIELD] = "format"  # the field a replica's refusal names
        return Completion(model=call.model, input=call.input, params=params, timeout_s=call.timeout_s)

    def said(self, output: dict[str, Any], asked: Request) -> dict[str, Any]:
        """The answer's fields but its times: a chat's message (its thinking and calls apart)."""
        message = self.choice(output, asked)["message"]
        said: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get(reasoning.GIVEN[0]):
            said["thinking"] = message[reasoning.GIVEN[0]]
        if message.get("tool_calls"):
            said["tool_calls"] = [
                {"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
        return {"message": said}

    def piece(self, thought: str, text: str) -> dict[str, Any]:
        """A streamed line's fields of a piece of the answer."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thought:
            message["thinking"] = thought
        return {"message": message}

    def body(self, results: list[Request], asked: list[Request], model: str, n: int = 1) -> dict[str, Any]:
        result = results[0]
        output = result.output or {}
        return {
            "model": model,
            "created_at": stamp(result.finished_at),
            **self.said(output, asked[0]),
            "done": True,
            "done_reason": done_reason(output),
            **durations(result),
        }

    def events(self, submitted: list[Request], call: Completion) -> Iterator[bytes]:
        """Lines of JSON, as Ollama streams: one per piece of the answer as it comes (its thinking
        and its text apart), then the last, `done`, with the rest (what the stream held back: a
        call, whole) and the counts; a line of the error where the request failed. Until the
        first piece, a line of no text now and then: Ollama's clients read every line as JSON (no
        comments), and a write is how a client gone is noticed."""
        request, sent = submitted[0], {"thinking": "", "content": ""}

        def line(**fields: Any) -> bytes:
            return (json.dumps({"model": call.model, "created_at": stamp(), **fields}) + "\n").encode()

        heard = followed(request, call, held=self.held_back(call), watched=self.watched(call), begun=lambda: False)
        with contextlib.closing(heard):  # closed early (the client left), it stops the request
            for said in heard:
                if not said.ended:
                    if said.comment or said.thought or said.text:
                        sent["thinking"] += said.thought
                        sent["content"] += said.text
                        yield line(**self.piece(said.thought, said.text), done=False)
                    continue
                final = said.final
                if final is None or final.status != "done":
                    failed = self._ended_short(final, request, call.timeout_s)["error"]["message"]
                    yield (json.dumps(error(failed)) + "\n").encode()
                    return
                yield line(**self.last(final, sent, said.watch), **durations(final))

    def last(self, final: Request, sent: dict[str, str], watch: tools.Watch | None) -> dict[str, Any]:
        """The last line's fields: what of the answer the stream had not sent, `done`."""
        output = final.output or {}
        whole = self.said(output, final)
        rest = {key: value for key, value in whole.items() if key != "message"}
        message = dict(whole["message"])
        if "thinking" in message:
            message["thinking"] = message["thinking"][len(sent["thinking"]) :]
        if watch is not None and message.get("tool_calls"):
            content = reasoning.split(output.get("text", ""))[1]
            message["content"] = tools.unsent(content, watch.sent, message["content"] or None)
        else:
            message["content"] = message["content"][len(sent["content"]) :]
        return {
            **rest,
            "message": message,
            "done": True,
            "done_reason": done_reason(output),
        }


class OllamaGenerateView(OllamaChatView):
    """`POST /api/generate`: Ollama's prompt, through the model's chat template as the user's
    message (after `system`), or with `raw` the prompt as it is, a completion."""

    input_param = "prompt"

    @extend_schema(
        summary="Answer a prompt as Ollama's /api/generate does.",
        description="The prompt as a user's message through the model's template (after `system`), or with `raw` "
        "as it is; `options`, `format`, `think` as /api/chat's; streamed (the default) as lines of JSON.",
        request=OllamaGenerateInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    @staticmethod
    def nothing() -> dict[str, Any]:
        return {"response": ""}

    def chat_of(self, body: dict[str, Any]) -> dict[str, Any]:
        for field, why in (("images", "the models served here read text"), ("template", "the model's own is used"),
                           ("context", "give the conversation as /api/chat's messages"),
                           ("suffix", "text is only ever added after the prompt")):  # fmt: skip
            if body.get(field):
                raise Refused(field, f"not supported: {why}")
        prompt = body.get("prompt")
        if not sampling.is_text(prompt) or not prompt:
            raise Refused("prompt", not_text(prompt, "required: a non-empty string"))
        system = body.get("system")
        if system is not None and not sampling.is_text(system):
            raise Refused("system", not_text(system, "must be a string"))
        raw = body.get("raw", False)
        if not isinstance(raw, bool):
            raise Refused("raw", "must be true or false")
        self.kind = "generate" if raw else "chat"  # this call's: a view is made for each request
        if raw:
            # No template to render: `think` has nothing to tell it.
            chosen = {name: value for name, value in sampled(body).items() if name != reasoning.TEMPLATE_KWARGS}
            return {"model": ollama_load.named(body.get("model")), "prompt": prompt, **chosen}
        said = [{"role": "system", "content": system}] if system else []
        asked = [*said, {"role": "user", "content": prompt}]
        return {"model": ollama_load.named(body.get("model")), "messages": asked, **sampled(body)}

    def said(self, output: dict[str, Any], asked: Request) -> dict[str, Any]:
        message = super().said(output, asked)["message"]
        fields = {"response": message["content"]}
        if "thinking" in message:
            fields["thinking"] = message["thinking"]
        return fields

    def piece(self, thought: str, text: str) -> dict[str, Any]:
        return {"response": text, **({"thinking": thought} if thought else {})}

    def last(self, final: Request, sent: dict[str, str], watch: tools.Watch | None) -> dict[str, Any]:
        output = final.output or {}
        whole = self.said(output, final)
        fields = {"response": whole["response"][len(sent["content"]) :]}
        if "thinking" in whole:
            fields["thinking"] = whole["thinking"][len(sent["thinking"]) :]
        return {**fields, "done": True, "done_reason": done_reason(output)}
