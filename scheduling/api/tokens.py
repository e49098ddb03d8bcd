"""Counting a model's tokens, which only its own tokenizer does (the web has none, so a replica
counts): vLLM's `POST /tokenize` (a prompt, or a chat's messages through its template, as token
ids and their count beside the model's `max_model_len`) and `POST /detokenize` (token ids as
text). Anthropic's `POST /v1/messages/count_tokens` (scheduling.api.messages) counts the same way.

A count is a request of the deployment's queue asked to count only
(gpuportal.wire.sampling.COUNT_ONLY): a replica tokenizes it at once, beside its batch, and
generates nothing; a deployment asleep is woken for it, as for any request."""

from __future__ import annotations

from typing import Any

from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest

from gpuportal.wire import reasoning, sampling, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api import completion_input
from scheduling.api.completion_input import Refused
from scheduling.api.openai_compat import (
    _Answered,
    error_body,
    ran,
    read_call,
)
from scheduling.models import Deployment

# What of a chat's params reaches its template, and so its count.
TEMPLATE_PARAMS = (tools.TOOLS, reasoning.TEMPLATE_KWARGS, reasoning.CONTINUE_FINAL)


class TokenizeInput(serializers.Serializer):
    """What vLLM's clients send to /tokenize, for the OpenAPI schema only."""

    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    prompt = serializers.CharField(required=False, help_text="A text to tokenize as a completion's prompt is.")
    messages = serializers.JSONField(
        required=False, help_text="Or a chat's messages, through the model's chat template as a chat's are."
    )
    tools = serializers.JSONField(required=False, help_text="With messages: the functions the template shows.")


class DetokenizeInput(serializers.Serializer):
    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    tokens = serializers.ListField(child=serializers.IntegerField(), help_text="Token ids of the model's tokenizer.")


def counted(
    model: str, kind: str, given: Any, params: dict[str, Any], owner: str, timeout: float, param: str
) -> tuple[int, dict[str, Any] | HttpResponseBase | Request]:
    """(200, the ended request) of a count of `given` on `model`'s replica; or the status and
    OpenAI-shaped error of a count refused (`param` the field a failure of the input names), or
    not answered within `timeout`."""
    result = ran(
        model, kind=kind, given=given, params={**params, sampling.COUNT_ONLY: True}, owner=owner, timeout=timeout,
        key=None, param=param, wanted="a causal language model",
    )  # fmt: skip
    return (200, result) if isinstance(result, Request) else result


def template_params(call: completion_input.Completion) -> dict[str, Any]:
    return {name: call.params[name] for name in TEMPLATE_PARAMS if name in call.params}


class TokenizeView(_Answered):
    """`POST /tokenize`: a prompt's (or a chat's) tokens, as vLLM's."""

    @extend_schema(
        summary="A prompt's or a chat's tokens and their count, as vLLM's /tokenize.",
        description="Counted by a replica with the model's own tokenizer (a chat through its template); a "
        "deployment asleep is woken. `max_model_len` is the longest prompt and answer its replicas serve.",
        request=TokenizeInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            kind, given, params, call = self.read(body)
        except Refused as refused:
            return 400, error_body(str(refused), refused.param)
        code, result = counted(
            call.model, kind, given, params, owner, call.timeout_s, "messages" if kind == "chat" else "prompt"
        )
        if not isinstance(result, Request):
            return code, result
        ids = (result.output or {})[sampling.PROMPT_TOKEN_IDS]
        longest = Deployment.objects.filter(name=call.model).values_list("max_tokens", flat=True).first()
        return 200, {"count": len(ids), "max_model_len": longest, "tokens": ids}

    @staticmethod
    def read(body: Any) -> tuple[str, Any, dict[str, Any], completion_input.Completion]:
        """(the request's kind, its input, its params, the call read) of a /tokenize body."""
        if not isinstance(body, dict):
            raise Refused(None, "the body must be a JSON object")
        if ("prompt" in body) == ("messages" in body):
            raise Refused("prompt", "give a `prompt` or `messages`: one of them")
        if "messages" in body:
            names = ("model", "messages", "timeout", *TEMPLATE_PARAMS)
            call = read_call({name: body[name] for name in names if name in body}, "chat")
            return "chat", call.input, template_params(call), call
        if not sampling.is_text(body["prompt"]):
            raise Refused("prompt", completion_input.not_text(body["prompt"], "required: a string"))
        call = read_call({name: body[name] for name in ("model", "prompt", "timeout") if name in body}, "generate")
        return "generate", call.input, {}, call


class DetokenizeView(_Answered):
    """`POST /detokenize`: token ids as the model's tokenizer decodes them, as vLLM's."""

    @extend_schema(
        summary="Token ids as text, as vLLM's /detokenize.",
        description="Decoded by a replica with the model's own tokenizer; an id past its vocabulary is a 400.",
        request=DetokenizeInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            if not isinstance(body, dict):
                raise Refused(None, "the body must be a JSON object")
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
                raise Refused("tokens", "required: a non-empty list of token ids")
            asked = {"model": body.get("model"), "prompt": tokens}
            call = read_call({**asked, "timeout": body["timeout"]} if "timeout" in body else asked, "generate")
        except Refused as refused:
            param = refused.param.replace("prompt", "tokens", 1) if refused.param else None
            return 400, error_body(f"{param}: {refused.message}" if param else refused.message, param)
        code, result = counted(call.model, "generate", call.input, {}, owner, call.timeout_s, "tokens")
        if isinstance(result, dict) and result["error"]["param"] == "prompt":
            # The replica's refusal of an id names the prompt, which the caller sent as `tokens`.
            message = result["error"]["message"]
            result["error"] |= {"param": "tokens", "message": f"tokens{message.removeprefix('prompt')}"}
        if not isinstance(result, Request):
            return code, result
        return 200, {"prompt": (result.output or {}).get("prompt_text", "")}
