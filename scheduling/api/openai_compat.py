"""OpenAI-compatible endpoints (the model is the deployment's name): `GET /v1/models` and
`/v1/models/{model}`, for causal LMs `POST /v1/completions` and `POST /v1/chat/completions` (with
`stream: true` as server-sent events; several choices a request each), for encoders
`POST /v1/embeddings`. Requests go through the same queue as `/api/.../infer/`."""

from __future__ import annotations

import base64
import json
import queue as queue_module
import sys
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections
from django.http import JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from redis import RedisError
from rest_framework import exceptions, permissions, serializers
from rest_framework.authentication import SessionAuthentication
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response
from rest_framework.views import APIView

from gpuportal.auth import (
    ApiKeyAuthentication,
    BearerTokenAuthentication,
    CachedTokenAuthentication,
    user_from_api_key,
    user_from_header,
)
from gpuportal.wire import adapters, prefix_cache, reasoning, tools
from gpuportal.wire.requestqueue import CALLERS_INPUT, TOO_LONG, Request, StreamSplice
from gpuportal.wire.sampling import STOP_REASON
from scheduling.api import completion_input, idempotency
from scheduling.api.completion_input import (
    ENCODING_FORMATS,
    MAX_CHOICES,
    MAX_EMBEDDING_INPUTS,
    MAX_LOGPROBS,
    MAX_TOKENS,
    ROLES,
    Completion,
    Refused,
)
from scheduling.api.inputs import FiniteFloatField, SamplingInput
from scheduling.api.requests import json_body, retry_after
from scheduling.models import Deployment
from scheduling.services import not_found
from scheduling.services import progress as progress_services
from scheduling.services import requests as request_services
from scheduling.services.errors import InvalidInput, NoDeployment, NotFound, ServiceError, TooManyRequests

# Streams poll Redis in slices this long, so a dropped client is noticed between slices.
STREAM_SLICE_S = 1.0
# Until its first token, a stream says what it waits for again this often: a client that left is
# noticed only by a write that fails (the server then closes the stream, which stops its
# requests), and a proxy may close a connection silent for a minute.
KEEPALIVE_S = 5.0


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema that the portal takes its tokens as HTTP bearer tokens too."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer"}


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema that the /v1 endpoints take a token in Anthropic's `x-api-key` header too."""

    target_class = ApiKeyAuthentication
    name = "apiKeyAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "apiKey", "in": "header", "name": "x-api-key"}


class WaitInput(serializers.Serializer):
    """What every /v1 call may add to OpenAI's fields, for the OpenAPI schema only."""

    # Not OpenAI's: how long the call waits for its answer (a /v1 call never hangs).
    # OpenAI clients send it with `extra_body={"timeout": 60}`.
    timeout = FiniteFloatField(
        min_value=0.001,
        required=False,
        allow_null=True,
        help_text="Seconds to wait for the answer (default GPUPORTAL_INFER_TIMEOUT_S, at most "
        "GPUPORTAL_INFER_MAX_TIMEOUT_S); past it the call ends with a 504 and the request is cancelled "
        "if it had not started.",
    )


class CompletionInput(WaitInput, SamplingInput):
    """What OpenAI clients send, for the OpenAPI schema only: completion_input.parse reads every
    body. Fields this portal does not use are accepted and ignored."""

    model = serializers.CharField()
    max_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, required=False, allow_null=True)
    max_completion_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, required=False, allow_null=True)
    stop = serializers.JSONField(required=False, allow_null=True)
    n = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=MAX_CHOICES,
        help_text=f"Choices of each input, a request each (at most {MAX_CHOICES} choices a call); a "
        "seed given is each choice's plus its number (seed, seed + 1, ...).",
    )
    stream = serializers.BooleanField(required=False, default=False)
    stream_options = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='With stream: {"include_usage": true} ends the stream with a chunk whose choices are empty and '
        "whose usage counts the tokens (every other chunk's usage null), as OpenAI's. Without it the last "
        "choice's chunk carries the usage.",
    )
    ignore_eos = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="vLLM's: run each answer to its max_tokens (as min_tokens of them all), for a load test's fixed "
        "length.",
    )
    cache_salt = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=prefix_cache.MAX_SALT_CHARS,
        help_text="vLLM's: the request shares its replica's prefix cache only with the caller's requests of the same "
        "salt (a service serving many people through one token); without it, with all of the caller's.",
    )
    response_format = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='OpenAI\'s: {"type": "json_object"} holds the answer to a JSON object as it is generated, '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} to the JSON the schema describes '
        "(a schema the replica cannot hold to is a 400); text by default.",
    )


class PromptInput(CompletionInput):
    prompt = serializers.JSONField(
        help_text=f"A string, or token ids (the model's own tokenizer's, as vLLM takes them: `[1, 450, 4996]`), or "
        f"a list of at most {MAX_CHOICES} of either: n choices each, `index` in their order."
    )
    logprobs = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_LOGPROBS,
        help_text="Each token's log probability (the model's own), with this many likeliest alternatives; not "
        "streamed.",
    )
    echo = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="The text begins with the prompt and, with logprobs, the log probabilities with the prompt's "
        "tokens' (the first's null): how an eval harness scores a prompt. Not streamed.",
    )


class MessageInput(serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES)
    content = serializers.CharField(
        allow_blank=True,
        allow_null=True,
        trim_whitespace=False,
        help_text='A string, or OpenAI\'s list of text parts ([{"type": "text", "text": "..."}]), joined a line apart; '
        "null in an assistant's message that called functions.",
    )
    tool_calls = serializers.JSONField(
        required=False, help_text="An assistant's message that called functions: the calls, as its answer gave them."
    )
    tool_call_id = serializers.CharField(required=False, help_text="A tool's message: the id of the call it answers.")


class ChatInput(CompletionInput):
    messages = MessageInput(many=True, allow_empty=False)
    logprobs = serializers.BooleanField(
        required=False, allow_null=True, help_text="Each token's log probability (the model's own); not streamed."
    )
    top_logprobs = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_LOGPROBS,
        help_text="With logprobs: this many likeliest alternatives of each token.",
    )
    tools = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='Functions the answer may call: [{"type": "function", "function": {"name", "description", '
        f'"parameters": a JSON Schema}}}}], at most {tools.MOST_TOOLS}. Shown to the model through its chat template.',
    )
    tool_choice = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='"auto" (with tools, the default): a call the model writes is read out of its answer; '
        '"required": the answer is a list of calls (one with parallel_tool_calls false), or {"type": "function", '
        '"function": {"name": ...}}: one call of it, held to the function\'s parameters as it is generated; '
        '"none": text.',
    )
    parallel_tool_calls = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="False: the answer makes at most one call (auto: its first; required: one). True by default.",
    )
    thinking_token_budget = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="vLLM's: a reasoning model's thinking is closed (its `</think>`) once it has had this many tokens, "
        "and the answer follows.",
    )


class EmbeddingInput(WaitInput):
    """What OpenAI clients send to /v1/embeddings, for the OpenAPI schema only:
    completion_input.parse_embeddings reads every body."""

    model = serializers.CharField(help_text="The deployment's name (a transformers-embedding deployment).")
    input = serializers.JSONField(
        help_text=f"A string, or a list of at most {MAX_EMBEDDING_INPUTS} strings; none may be empty. "
        "Token arrays are refused."
    )
    encoding_format = serializers.ChoiceField(
        choices=ENCODING_FORMATS,
        required=False,
        default="float",
        help_text="float: each vector a list of numbers; base64: its float32 values, little-endian, "
        "base64-encoded (what OpenAI's Python client asks for and decodes).",
    )
    dimensions = serializers.IntegerField(required=False, allow_null=True, help_text="Not supported: leave it out.")
    user = serializers.CharField(required=False, help_text="Ignored.")


def read_call(body: Any, kind: completion_input.Kind) -> Completion:
    """completion_input.parse with this portal's waits (GPUPORTAL_INFER_TIMEOUT_S, at most
    GPUPORTAL_INFER_MAX_TIMEOUT_S): how every API the portal speaks reads its chat or completion."""
    return completion_input.parse(
        body,
        kind,
        default_timeout_s=settings.GPUPORTAL_INFER_TIMEOUT_S,
        max_timeout_s=settings.GPUPORTAL_INFER_MAX_TIMEOUT_S,
    )


def openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> Response:
    return Response(error_body(message, param, kind), status=status)


def error_body(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _service_error(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, TooManyRequests):  # as OpenAI answers a rate limit, which its clients back off from
        return exc.status, error_body(str(exc), kind="requests", code="rate_limit_exceeded")
    return exc.status, error_body(str(exc), kind="invalid_request_error" if exc.status < 500 else "server_error")


class OpenAIView(APIView):
    # The key as OpenAI's clients send it (a bearer token), as Anthropic's do (x-api-key), as the
    # portal's own CLI does (Token), or a signed-in browser's session.
    authentication_classes = [
        BearerTokenAuthentication,
        ApiKeyAuthentication,
        CachedTokenAuthentication,
        SessionAuthentication,
    ]
    permission_classes = [permissions.IsAuthenticated]

    def handle_exception(self, exc: Exception) -> Response:
        """Errors in OpenAI's shape, so its clients raise their usual exceptions with our message."""
        if isinstance(exc, exceptions.ParseError):
            return openai_error(400, f"the body is not JSON: {exc.detail}")
        if isinstance(exc, exceptions.AuthenticationFailed | exceptions.NotAuthenticated):
            return openai_error(401, str(exc.detail), kind="authentication_error")
        if isinstance(exc, ServiceError):
            code, body = _service_error(exc)
            return Response(body, status=code, headers=exc.headers())
        return super().handle_exception(exc)


# What /v1/embeddings and rerank refuse a deployment for not being.
ENCODER = "an embedding model"
# What /v1 serves: causal LMs (completions, chat) and encoders (embeddings); a plain PyTorch
# module takes tensors, which no OpenAI endpoint carries.
OPENAI_LOADERS = (Deployment.Loader.TRANSFORMERS, Deployment.Loader.EMBEDDING)


def _model(name: str, created: datetime, max_tokens: int, source: str, parent: str | None = None) -> dict[str, Any]:
    """A deployment as OpenAI lists a model, with vLLM's `max_model_len` (the longest prompt and
    answer together a replica serves: its `memory.max_tokens`, what its KV cache is sized for),
    which clients read to fit a conversation; and as Anthropic's clients read one (`type`,
    `display_name`, `created_at`, `max_input_tokens`). vLLM's `root` (what it was loaded from) and
    `parent` (a LoRA adapter's base model; null for a model of its own)."""
    return {
        "id": name,
        "object": "model",
        "created": int(created.timestamp()),
        "owned_by": "gpuportal",
        "root": source,
        "parent": parent,
        "max_model_len": max_tokens,
        "type": "model",
        "display_name": name,
        "created_at": created.isoformat(),
        "max_input_tokens": max_tokens,
    }


def _models(name: str, created: datetime, max_tokens: int, source: str, adapter_text: str) -> list[dict[str, Any]]:
    """A deployment, then each of its LoRA adapters as a model of its own (`deployment:adapter`)."""
    served = adapters.parse(adapter_text)
    return [
        _model(name, created, max_tokens, source),
        *(_model(adapters.model_id(name, a), created, max_tokens, root, name) for a, root in served.items()),
    ]


_MODEL_FIELDS = ("name", "created_at", "max_tokens", "model_source", "model_adapters")


class ModelsView(OpenAIView):
    @extend_schema(responses={200: dict})
    def get(self, request: HttpRequest) -> Response:
        rows = Deployment.objects.filter(loader__in=OPENAI_LOADERS).order_by("name")
        data = [model for row in rows.values_list(*_MODEL_FIELDS) for model in _models(*row)]
        # Anthropic's list says it is whole (`has_more`), and where it begins and ends.
        ends = {"first_id": data[0]["id"], "last_id": data[-1]["id"]} if data else {"first_id": None, "last_id": None}
        return Response({"object": "list", "data": data, "has_more": False, **ends})


class ModelView(OpenAIView):
    """One model as the list shows it: OpenAI's "retrieve model" (`client.models.retrieve(name)`),
    which clients call to check a name before they use it."""

    @extend_schema(responses={200: dict, 404: dict}, operation_id="v1_model_retrieve")
    def get(self, request: HttpRequest, model: str) -> Response:
        served = Deployment.objects.filter(loader__in=OPENAI_LOADERS)
        name, adapter = adapters.split_model(model)
        found = served.filter(name=name).values_list(*_MODEL_FIELDS).first()
        if found is None:
            # As a completion naming it is refused: the nearest name, and what /v1 serves.
            missing = NoDeployment(name, list(served.order_by("name").values_list("name", flat=True)))
            status, body = _refusal(missing, model, "")
            return Response(body, status=status)
        listed = {entry["id"]: entry for entry in _models(*found)}
        if model not in listed:
            status, body = _refusal(not_found.adapter(name, str(adapter), list(adapters.parse(found[-1]))), model, "")
            return Response(body, status=status)
        return Response(listed[model])


class _Answered(OpenAIView, ABC):
    """A POST answered from its JSON body the same way on both paths: `answer` says how."""

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # The hot path (where the portal's own overhead must stay small): a call with the portal's token is answered
        # without DRF; other authentication (a session) goes the DRF way. Both read the body
        # with completion_input.
        fast = self._fast(request) if request.method == "POST" else None
        return fast if fast is not None else super().dispatch(request, *args, **kwargs)

    def _fast(self, request: Any) -> HttpResponseBase | None:
        user = self.caller(request)
        body = json_body(request) if user is not None else None
        if body is None:
            return None  # not JSON: DRF's parser says why
        code, answer = self._answer_with_key(request, body, str(user.pk))
        return JsonResponse(answer, status=code) if isinstance(answer, dict) else answer

    @staticmethod
    def caller(request: Any) -> Any | None:
        """The user whose key the request carries, read without DRF; None hands the request to
        DRF, whose authentication says what is wrong."""
        return user_from_header(request) or user_from_api_key(request)

    def post(self, request: HttpRequest) -> HttpResponseBase:
        code, answer = self._answer_with_key(request, request.data, str(request.user.pk))
        return Response(answer, status=code) if isinstance(answer, dict) else answer

    def _answer_with_key(self, request: Any, body: Any, owner: str) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            key = idempotency.key_of(request)
        except idempotency.BadKey as err:
            return 400, error_body(str(err), idempotency.HEADER)
        return self.answer(body, owner, key)

    @abstractmethod
    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        """The status and OpenAI-shaped body of a call, or the response that answers it (a stream,
        or an error with headers); `key`, the caller's Idempotency-Key."""


def _service_answer(exc: ServiceError) -> tuple[int, dict[str, Any] | HttpResponseBase]:
    code, error = _service_error(exc)
    # With headers (a 429's Retry-After) the answer is a response of its own, which both the fast
    # path and DRF's pass on as it is.
    return code, JsonResponse(error, status=code, headers=exc.headers()) if exc.headers() else error


def _code(failed: Request) -> str | None:
    """OpenAI's `code` of a failure where it has one: a prompt plus max_tokens past what the
    replica holds is its `context_length_exceeded`, on which clients trim a conversation."""
    return "context_length_exceeded" if failed.error_kind == TOO_LONG else None


def _failure(result: Request, param: str) -> tuple[int, dict[str, Any] | HttpResponseBase]:
    """A request that ended without an answer: input the model cannot take is the caller's to fix.
    With a Retry-After where its failure said when asking again may succeed: OpenAI's client
    library waits that long before it retries a 503. One cancelled while the call waited
    (`DELETE /api/requests/{id}/`) is a 409 its client must not send again: OpenAI's retries a 409
    unless `x-should-retry` says false, and a retry would run what was cancelled."""
    if result.status == "cancelled":
        cancelled = error_body(f"request {result.id} was {result.error or 'cancelled'}", None, "cancelled")
        return 409, JsonResponse(cancelled, status=409, headers={"x-should-retry": "false"})
    code = 400 if result.error_kind in CALLERS_INPUT else 503
    # A replica's refusal names the field at its start where it is another than the input
    # (`stop_token_ids: token 9 is not in the model's vocabulary ...`): OpenAI's `param` says it too.
    named = result.error.partition(":")[0]
    if code == 400 and named in completion_input.READ_FIELDS:
        param = named
    error = error_body(result.error, param, "server_error" if code == 503 else "invalid_request_error", _code(result))
    headers = retry_after(result)
    return code, JsonResponse(error, status=code, headers=headers) if headers else error


class _Generate(_Answered):
    """What completions and chat completions share; each says what its input and output are."""

    kind: completion_input.Kind
    object_name: str
    id_prefix: str
    # The field that carries the input, which a failure of the model's on it names.
    input_param: str
    # What a stream is sent as: server-sent events (OpenAI's, Anthropic's), or lines of JSON.
    stream_type = "text/event-stream"

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            call = self.parse(body, owner)
        except Refused as refused:
            return 400, error_body(str(refused), refused.param)
        try:
            if call.params["stream"]:
                return self.stream(call, owner, key)
            if call.choices > 1:
                return self.run_each(call, owner, key)
            return self.run(call.model, call.input, call.params, owner, call.timeout_s, key)
        except ServiceError as exc:
            return _service_answer(exc)

    def run_each(self, call: Completion, owner: str, key: str | None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        """Several choices (`n`, or a list of prompts): a request each, all queued before any is
        waited for, so that a replica batches them; the call's answer once every one has ended,
        within the one timeout. A choice failed, the others are stopped wherever they are; timed
        out, what no replica has taken is cancelled (what runs is kept for polling)."""
        submitted = self.submit_each(call, owner, key)
        if not isinstance(submitted, list):
            return submitted
        queue, deadline = request_services.queue(), time.monotonic() + call.timeout_s
        results: list[Request] = []
        for done, request in enumerate(submitted):
            result = queue.wait(request.id, max(0.0, deadline - time.monotonic()))
            if result is None or not result.final:
                _cancel(submitted[done + 1 :], f"another choice of its /v1 call timed out after {call.timeout_s:g} s")
                return 504, error_body(timed_out(request.id, call.timeout_s), kind="timeout")
            if result.status != "done":
                _stop(submitted[done + 1 :], "another choice of its /v1 call failed")
                return _failure(result, self.input_param)
            results.append(result)
        return 200, self.body(results, submitted, call.model, call.n)

    def submit_each(
        self, call: Completion, owner: str, key: str | None
    ) -> list[Request] | tuple[int, dict[str, Any] | HttpResponseBase]:
        """A request for each choice, in the order of their `index`; or the refusal of the call,
        which leaves nothing of it queued (what was queued before a refusal is stopped). Under
        an Idempotency-Key, one choice under the key itself, several each under the key and its
        index."""
        submitted: list[Request] = []
        try:
            for index, (given, params) in enumerate(call.each()):
                choice_key = key if key is None or call.choices == 1 else f"{key}#{index}"
                submitted.append(
                    request_services.submit(
                        call.model, kind=self.kind, input=given, params=params, owner=owner, idempotency_key=choice_key
                    )
                )
        except (NotFound, InvalidInput) as exc:
            _stop(submitted, "another choice of its call was refused")
            return self.refusal(exc, call.model)
        except ServiceError:
            _stop(submitted, "another choice of its call was refused")
            raise
        return submitted

    def parse(self, body: Any, owner: str) -> Completion:
        """The call `body` asks for (`owner`'s), or Refused naming the first field that is wrong."""
        return read_call(body, self.kind)

    def stream(
        self, call: Completion, owner: str, key: str | None = None
    ) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        submitted = self.submit_each(call, owner, key)
        if not isinstance(submitted, list):
            return submitted
        response = StreamingHttpResponse(self.events(submitted, call), content_type=self.stream_type)
        response["Cache-Control"] = "no-cache"
        return 200, response

    def run(
        self, model: str, request_input: Any, params: dict[str, Any], owner: str, timeout: float, key: str | None = None
    ) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        """Run a non-streamed request and wait for it, at most `timeout` seconds: the HTTP status
        and OpenAI-shaped body."""
        # The service checks the model exists and is a causal LM in the statement that accepts the
        # request (no look-up of our own first: one database round trip per request, not two).
        try:
            submitted, result = request_services.run(
                model, kind=self.kind, input=request_input, params=params, owner=owner, timeout=timeout,
                idempotency_key=key,
            )  # fmt: skip
        except (NotFound, InvalidInput) as exc:
            return self.refusal(exc, model)
        if result is None:
            return 504, error_body(timed_out(submitted.id, timeout), kind="timeout")
        if result.status != "done":
            return _failure(result, self.input_param)
        return 200, self.body([result], [submitted], model)

    @staticmethod
    def refusal(exc: NotFound | InvalidInput, model: str) -> tuple[int, dict[str, Any]]:
        return _refusal(exc, model, "a causal language model")

    @abstractmethod
    def choice(self, output: dict[str, Any], asked: Request) -> dict[str, Any]:
        """A choice of the answer: the replica's `output` of the request `asked`."""

    @abstractmethod
    def delta(
        self, text: str, first: bool, picked: list[dict[str, Any]] | None, start: int, thought: str = ""
    ) -> dict[str, Any]:
        """A streamed chunk's choice but its index and finish_reason: `text`, and where log
        probabilities are asked, those of `picked` (the text's tokens, the first at `start`); a
        chat's reasoning, `thought`, beside it."""

    def held_back(self, call: Completion) -> bool:
        """Whether a stream's text is held back until its answer ends (read whole then: a chat
        whose answer may call functions, whose call is JSON to read, not text to show)."""
        return False

    def watched(self, call: Completion) -> bool:
        """Whether a stream's text goes out until it opens a call, the rest held back (`Watch`)."""
        return False

    def whole(
        self, output: dict[str, Any], asked: Request, sent: int = 0, role: bool = True, thought: str | None = None
    ) -> dict[str, Any]:
        """A held-back stream's last chunk of its choice: what of it was not sent (`sent`
        characters of its text were), and its finish_reason; `role` where none went out yet; of a
        chat's reasoning, `thought` (None: the whole of it, none having gone out)."""
        rest = output.get("text", "")[sent:]
        return {"finish_reason": output.get("finish_reason", "stop"), **self.delta(rest, role, None, 0)}

    def body(self, results: list[Request], asked: list[Request], model: str, n: int = 1) -> dict[str, Any]:
        """The answer of a call's requests (`results`, as they ended; `asked`, as they were
        submitted: what a final read leaves out): their choices, `index` in the order asked."""
        outputs = [result.output or {} for result in results]
        return {
            "id": f"{self.id_prefix}-{results[0].id}",
            "object": self.object_name,
            "created": int(results[0].created_at or time.time()),
            "model": model,
            "choices": [
                {
                    "index": index,
                    "finish_reason": output.get("finish_reason", "stop"),
                    **self.choice(output, given),
                    STOP_REASON: output.get(STOP_REASON),
                }
                for index, (output, given) in enumerate(zip(outputs, asked, strict=True))
            ],
            "usage": _usage_of(outputs, n),
        }

    def events(self, submitted: list[Request], call: Completion) -> Iterator[bytes]:
        """Server-sent events: a chunk per piece of text as it is generated, then [DONE]; an
        error event instead of the last chunk if one fails or does not end within the call's
        timeout. Several choices (`n`, a list of prompts) are followed together, each chunk naming
        its choice's `index`, each choice's last chunk sent as it ends. `include_usage`
        (stream_options): every chunk says `usage: null`, and a chunk with no choices carries the
        usage before [DONE], as OpenAI's stream; without it the last choice's chunk carries it
        (what this portal always sent, and clients read it there)."""
        deadline = time.monotonic() + call.timeout_s
        base: dict[str, Any] = {
            "id": f"{self.id_prefix}-{submitted[0].id}",
            "object": f"{self.object_name}.chunk" if self.kind == "chat" else self.object_name,
            "model": call.model,
            "created": int(time.time()),
        }
        if call.include_usage:
            base["usage"] = None
        stop = threading.Event()
        said = (
            _follow(submitted[0], call.model, deadline, 0, stop)
            if len(submitted) == 1
            else _together([_follow(r, call.model, deadline, i, stop) for i, r in enumerate(submitted)], stop)
        )
        started: set[int] = set()
        ended: set[int] = set()
        outputs: dict[int, dict[str, Any]] = {}
        # Asked for log probabilities: each choice's streamed so far (how many, and the length of
        # their tokens' text, where the next begins). Those a piece did not carry (the generate
        # path streams text alone) come with the choice's last chunk, from its answer.
        asked = call.params.get("logprobs") is not None
        picks_sent: dict[int, tuple[int, int]] = {}

        def picks(index: int, picked: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, int]:
            count, at = picks_sent.get(index, (0, 0))
            if not asked:
                return None, at
            picked = picked or []
            picks_sent[index] = (count + len(picked), at + sum(len(entry["token"]) for entry in picked))
            return picked, at

        told, told_at = "", time.monotonic()
        held = self.held_back(call)
        # An answer that may call functions (tool_choice auto): its text goes out until it opens a
        # call (gpuportal.wire.tools.Watch), the rest in its last chunk; `voiced`: the choices whose
        # role went out.
        watches: dict[int, tools.Watch] | None = {} if self.watched(call) else None
        # A chat's reasoning told from its content as it comes (gpuportal.wire.reasoning), each
        # sent as a delta of its own field; the content goes on to the watch where there is one.
        splitters: dict[int, reasoning.Splitter] | None = {} if self.kind == "chat" and not held else None
        unsent_picks: dict[int, list[dict[str, Any]]] = {}
        voiced: set[int] = set()
        try:
            for item in said:
                if item.waiting:
                    # Until the first token: what it waits for, as an SSE comment (a line starting
                    # with ':'), which OpenAI's clients skip; sent when it changes, and again
                    # every KEEPALIVE_S.
                    if not started and (item.waiting != told or time.monotonic() - told_at >= KEEPALIVE_S):
                        told, told_at = item.waiting, time.monotonic()
                        yield f": {told}\n\n".encode()
                    continue
                if not item.ended:
                    started.add(item.index)
                    if held:
                        continue  # read whole at its end (`whole`)
                    thought, text = (
                        splitters.setdefault(item.index, reasoning.Splitter()).feed(item.text)
                        if splitters is not None
                        else ("", item.text)
                    )
                    if watches is not None:
                        text = watches.setdefault(item.index, tools.Watch()).feed(text)
                    if not text and not thought:
                        # Held back: its log probabilities go with the piece it comes out with.
                        unsent_picks.setdefault(item.index, []).extend(item.picks or ())
                        continue
                    given = [*unsent_picks.pop(item.index, ()), *(item.picks or ())]
                    picked = picks(item.index, given) if watches is None else (None, 0)
                    delta = self.delta(text, item.index not in voiced, *picked, thought=thought)
                    voiced.add(item.index)
                    yield _sse({**base, "choices": [{"index": item.index, "finish_reason": None, **delta}]})
                    continue
                ended.add(item.index)
                final = item.final
                if final is None or final.status != "done":
                    error = self._ended_short(final, submitted[item.index], call.timeout_s)
                    # Before the error is sent: a client closes the stream on reading it.
                    others = [r for i, r in enumerate(submitted) if i != item.index]
                    _stop(others, "another choice of its /v1 call did not end with an answer")
                    yield _sse(error)
                    break
                outputs[item.index] = final.output or {}
                left = (outputs[item.index].get("logprobs") or [])[picks_sent.get(item.index, (0, 0))[0] :]
                answer, asked_of = outputs[item.index], submitted[item.index]
                thought, text = (
                    splitters.setdefault(item.index, reasoning.Splitter()).end() if splitters is not None else ("", "")
                )
                if held:
                    last = {"index": item.index, **self.whole(answer, asked_of)}
                elif watches is not None:
                    sent = watches.get(item.index, tools.Watch()).sent
                    whole = self.whole(answer, asked_of, sent, item.index not in voiced, thought=thought)
                    last = {"index": item.index, **whole}
                else:
                    last = {
                        "index": item.index,
                        "finish_reason": answer.get("finish_reason", "stop"),
                        **self.delta(text, item.index not in voiced, *picks(item.index, left), thought=thought),
                    }
                last[STOP_REASON] = answer.get(STOP_REASON)  # vLLM's: the stop string or token it ended on
                if len(outputs) < len(submitted):
                    yield _sse({**base, "choices": [last]})
                    continue
                usage = _usage_of([outputs[i] for i in range(len(submitted))], call.n)
                if call.include_usage:
                    yield _sse({**base, "choices": [last]})
                    yield _sse({**base, "choices": [], "usage": usage})
                else:
                    yield _sse({**base, "choices": [last], "usage": usage})
        except GeneratorExit:
            # The client left: the server closes a stream whose write failed. What it asked and
            # has not ended is stopped, so that no replica generates an answer for nobody.
            _stop([r for i, r in enumerate(submitted) if i not in ended], "its caller left: the stream was closed")
            raise
        finally:
            stop.set()  # a caller gone: the other choices' followers stop reading
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _ended_short(final: Request | None, request: Request, timeout: float) -> dict[str, Any]:
        """The error event of a choice that failed, was cancelled (`DELETE /api/requests/{id}/`
        while it streamed), or did not end within the call's timeout."""
        if final is not None and final.status == "failed":
            kind = "invalid_request_error" if final.error_kind in CALLERS_INPUT else "server_error"
            return error_body(final.error, None, kind, _code(final))
        if final is not None and final.status == "cancelled":
            return error_body(f"request {final.id} was {final.error or 'cancelled'}", None, "cancelled")
        return {"error": {"message": timed_out(request.id, timeout), "type": "timeout", "param": None, "code": None}}


@dataclass(frozen=True)
class _Said:
    """What following one choice's request gave: a piece of its text, what it waits for until its
    first token, or its end (the request as it ended, None if unknown)."""

    index: int
    text: str = ""
    # The log probabilities of the text's tokens, where its piece carried them.
    picks: list[dict[str, Any]] | None = None
    waiting: str = ""
    ended: bool = False
    final: Request | None = None


def _follow(submitted: Request, model: str, deadline: float, index: int, stop: threading.Event) -> Iterator[_Said]:
    """A request's stream as it is written, until it ends or `deadline` passes (or `stop` is set),
    then its end. What it waits for until its first token is read for the first choice alone:
    the choices of a call wait for the same deployment, and reading it reads the database (a
    connection for each follower's thread, where one says it all)."""
    queue = request_services.queue()
    sent, first, told = 0, True, ""
    splice = StreamSplice()
    with queue.reading(submitted.id):
        while time.monotonic() < deadline and not stop.is_set():
            chunks, ended = queue.read_stream(submitted.id, sent, STREAM_SLICE_S)
            if first and index == 0 and not chunks and not ended:
                # Every slice, changed or not: the response says it again now and then (KEEPALIVE_S).
                told = _waiting_line(submitted, model) or told or "waiting"
                yield _Said(index, waiting=told)
            for chunk in chunks:
                # A re-run (its replica died or drained mid-answer) starts over: send only what is new.
                text, picked = splice.feed_piece(chunk)
                if text:
                    yield _Said(index, text=text, picks=picked)
                    first = False
            sent += len(chunks)
            if ended:
                break
    yield _Said(index, ended=True, final=queue.get(submitted.id))


def _together(followers: list[Iterator[_Said]], stop: threading.Event) -> Iterator[_Said]:
    """Several followers' items as each comes: a thread each, which reads its own request's
    stream (a read blocks until its next piece). What one raises is raised here."""
    said: queue_module.SimpleQueue[_Said | BaseException] = queue_module.SimpleQueue()

    def pump(follower: Iterator[_Said]) -> None:
        try:
            for item in follower:
                said.put(item)
        except BaseException as exc:  # handed to the response's thread, which raises it
            said.put(exc)
        finally:
            connections.close_all()  # this thread's own (its waiting lines read the database)

    threads = [threading.Thread(target=pump, args=(f,), daemon=True) for f in followers]
    for thread in threads:
        thread.start()
    try:
        ended = 0
        while ended < len(followers):
            item = said.get()
            if isinstance(item, BaseException):
                raise item
            ended += item.ended
            yield item
    finally:
        stop.set()


def _completion_logprobs(picked: list[dict[str, Any]] | None, start: int = 0) -> dict[str, Any] | None:
    """A replica's picks (inference.token_logprobs.entries) as OpenAI's completions give them:
    parallel lists of the tokens, their log probabilities, their alternatives and where each
    begins in the text (the first at `start`: a streamed chunk's, after those sent before it).
    None where none were asked."""
    if picked is None:
        return None
    offsets, at = [], start
    for entry in picked:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in picked],
        "token_logprobs": [entry["logprob"] for entry in picked],
        # An echoed prompt's first token has none (nothing comes before it): null, as OpenAI's.
        "top_logprobs": [None if entry["top"] is None else dict(entry["top"]) for entry in picked],
        "text_offset": offsets,
    }


def _chat_logprobs(picked: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The picks as OpenAI's chat completions give them: each token with its log probability,
    its UTF-8 bytes and its alternatives. None where none were asked."""
    if picked is None:
        return None

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**token(entry["token"], entry["logprob"]), "top_logprobs": [token(t, lp) for t, lp in entry["top"]]}
            for entry in picked
        ]
    }


def cached_tokens(usage: dict[str, Any]) -> int:
    """Of a replica's count of a prompt's tokens, those its prefix cache held (0 where it says none)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _usage_of(outputs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The usage of a call's choices: one choice's as its replica counted it; of several, each
    prompt's tokens once (its n choices read the same prompt, as OpenAI counts them), every
    choice's completion."""
    if len(outputs) == 1:
        return outputs[0].get("usage", {})
    usages = [output.get("usage") or {} for output in outputs]
    prompt_tokens = sum(usage.get("prompt_tokens", 0) for usage in usages[::n])
    completion_tokens = sum(usage.get("completion_tokens", 0) for usage in usages)
    summed = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if any("prompt_tokens_details" in usage for usage in usages):  # what the prefix caches held, once a prompt
        summed["prompt_tokens_details"] = {"cached_tokens": sum(cached_tokens(u) for u in usages[::n])}
    thought = [usage["completion_tokens_details"] for usage in usages if "completion_tokens_details" in usage]
    if thought:  # a reasoning model's: how many of the tokens were its thinking
        summed["completion_tokens_details"] = {"reasoning_tokens": sum(d["reasoning_tokens"] for d in thought)}
    return summed


def _refusal(exc: NotFound | InvalidInput, model: str, wanted: str) -> tuple[int, dict[str, Any]]:
    """A model that does not exist, or is not what the endpoint serves (the service says what it is)."""
    if isinstance(exc, NotFound):
        hint = f": {exc}."  # which adapters its deployment serves, say
        if isinstance(exc, NoDeployment):
            deployed = ", ".join(f"`{name}`" for name in exc.deployed[: exc.LISTED])
            hint = f"; did you mean `{exc.near}`?" if exc.near else "."
            hint += f" Deployed: {deployed}." if deployed else " Nothing is deployed."
        return 404, error_body(f"The model `{model}` does not exist{hint}", "model", "model_not_found")
    return 400, error_body(f"`{model}` is not {wanted} ({exc.message})", "model")


def _waiting_line(submitted: Request, model: str) -> str:
    """What a streamed request waits for, in one line; "" when it cannot be read just now."""
    try:
        current = request_services.queue().get(submitted.id) or submitted
        return progress_services.Reader().of(current).line(model)
    except (DatabaseError, RedisError):  # a comment is a courtesy: the stream goes on without it
        return ""


def timed_out(request_id: str, timeout: float) -> str:
    """What a caller whose answer did not come in time is told. A request that has not started
    is cancelled, so that nothing runs for a caller who has gone; one already running is left to
    finish, and its answer kept for polling."""
    if request_services.cancel_unstarted(request_id, reason=f"its /v1 call timed out after {timeout:g} s"):
        return f"request {request_id} did not start within {timeout:g} s and was cancelled"
    return f"request {request_id} did not finish within {timeout:g} s; poll /api/requests/{request_id}/ for its answer"


def _stop(requests: list[Request], reason: str) -> None:
    """A call's requests whose answers nobody will read (another choice failed or was refused,
    or the stream's client left): stopped wherever they are, so that no replica runs them."""
    request_services.stop_abandoned([request.id for request in requests], reason=reason)


def _cancel(requests: list[Request], reason: str) -> None:
    """What a call with several choices queued and no longer waits for: cancelled where no
    replica has taken it (one that has runs on, and its answer is kept for polling)."""
    for request in requests:
        request_services.cancel_unstarted(request.id, reason=reason)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class CompletionsView(_Generate):
    kind = "generate"
    input_param = "prompt"
    object_name = "text_completion"
    id_prefix = "cmpl"

    @extend_schema(parameters=[idempotency.PARAMETER], request=PromptInput, responses={200: dict})
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def choice(self, output: dict[str, Any], asked: Request) -> dict[str, Any]:
        text, picked = output.get("text", ""), output.get("logprobs")
        if asked.params.get("echo"):
            # The prompt as it was given (given as token ids: as the replica decoded them), and
            # with logprobs its tokens' first (the replica's).
            prompt = asked.input if isinstance(asked.input, str) else output.get("prompt_text", "")
            text = f"{prompt}{text}"
            if picked is not None:
                picked = [*output.get("prompt_logprobs", []), *picked]
        return {"text": text, "logprobs": _completion_logprobs(picked)}

    def delta(
        self, text: str, first: bool, picked: list[dict[str, Any]] | None, start: int, thought: str = ""
    ) -> dict[str, Any]:
        return {"text": text, "logprobs": _completion_logprobs(picked, start)}


class ChatCompletionsView(_Generate):
    kind = "chat"
    input_param = "messages"
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    @extend_schema(parameters=[idempotency.PARAMETER], request=ChatInput, responses={200: dict})
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def choice(self, output: dict[str, Any], asked: Request) -> dict[str, Any]:
        """The answer's message: its text, or the functions it calls (gpuportal.wire.tools) with
        what it says besides, `finish_reason: tool_calls`. An answer cut short by max_tokens is its
        text, its call unfinished."""
        thought, text = reasoning.split(output.get("text", ""))
        thinking = {} if thought is None else dict.fromkeys(reasoning.GIVEN, thought)
        called = asked.params.get(tools.TOOL_CHOICE) not in (None, tools.NONE)
        content, calls = (
            tools.calls_in(text, tools.names(asked.params[tools.TOOLS]))
            if called and output.get("finish_reason", "stop") == "stop"
            else (text, [])
        )
        if asked.params.get(tools.PARALLEL) is False:
            calls = calls[:1]  # as vLLM does: the first call, what follows it left unmade
        if not calls:
            return {
                "message": {"role": "assistant", "content": text, **thinking},
                "logprobs": _chat_logprobs(output.get("logprobs")),
            }
        made = [
            {"id": f"call_{asked.id.replace('-', '')[:20]}{k}", "type": "function", "function": asdict(call)}
            for k, call in enumerate(calls)
        ]
        return {
            "message": {"role": "assistant", "content": content, "tool_calls": made, **thinking},
            "logprobs": _chat_logprobs(output.get("logprobs")),
            "finish_reason": "tool_calls",
        }

    def delta(
        self, text: str, first: bool, picked: list[dict[str, Any]] | None, start: int, thought: str = ""
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if thought:
            delta |= dict.fromkeys(reasoning.GIVEN, thought)
        if first:
            delta["role"] = "assistant"
        return {"delta": delta, "logprobs": _chat_logprobs(picked)}

    def held_back(self, call: Completion) -> bool:
        # A call asked for: the answer is its JSON, read whole.
        return call.params.get(tools.TOOL_CHOICE) not in (None, tools.NONE, tools.AUTO)

    def watched(self, call: Completion) -> bool:
        return call.params.get(tools.TOOL_CHOICE) == tools.AUTO

    def whole(
        self, output: dict[str, Any], asked: Request, sent: int = 0, role: bool = True, thought: str | None = None
    ) -> dict[str, Any]:
        choice = self.choice(output, asked)
        message = choice["message"]
        text = reasoning.split(output.get("text", ""))[1]
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        thought = message.get(reasoning.GIVEN[0]) if thought is None else thought
        if thought:
            delta |= dict.fromkeys(reasoning.GIVEN, thought)
        if message.get("tool_calls"):
            if rest := tools.unsent(text, sent, message.get("content")):
                delta["content"] = rest
            delta["tool_calls"] = [{"index": k, **made} for k, made in enumerate(message["tool_calls"])]
        elif text[sent:]:
            delta["content"] = text[sent:]
        finish = choice.get("finish_reason", output.get("finish_reason", "stop"))
        return {"delta": delta, "logprobs": choice["logprobs"], "finish_reason": finish}


class EmbeddedAnswer(_Answered, ABC):
    """An answer made of texts' vectors, all embedded in one request (one pass on the replica, or
    as few as fit): /v1/embeddings', a rerank's, a score's. `read` says what a body asks for."""

    # The field a failure of the texts names.
    param = "input"

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        try:
            call = self.read(
                body,
                default_timeout_s=settings.GPUPORTAL_INFER_TIMEOUT_S,
                max_timeout_s=settings.GPUPORTAL_INFER_MAX_TIMEOUT_S,
            )
        except Refused as refused:
            return 400, error_body(str(refused), refused.param)
        result = ran(
            call.model, kind="embed", given=call.texts, params={}, owner=owner, timeout=call.timeout_s, key=key,
            param=self.param, wanted=ENCODER,
        )  # fmt: skip
        if not isinstance(result, Request):
            return result
        output = result.output or {}
        vectors = output.get("embeddings") or []
        if len(vectors) != len(call.texts):  # a replica of another release, or a broken one
            message = f"the replica gave {len(vectors)} vectors for {len(call.texts)} texts"
            return 502, error_body(message, kind="server_error")
        return 200, self.shaped(call, result, vectors, output.get("usage", {}))

    @staticmethod
    @abstractmethod
    def read(body: Any, *, default_timeout_s: float, max_timeout_s: float) -> Any:
        """The call a body asks for (its `model`, `texts` and `timeout_s`), or Refused naming its
        field."""

    @abstractmethod
    def shaped(self, call: Any, result: Request, vectors: list[list[float]], usage: dict[str, Any]) -> dict[str, Any]:
        """The answer, of the texts' vectors (in the call's order)."""


class EmbeddingsView(EmbeddedAnswer):
    """`POST /v1/embeddings` for a `transformers-embedding` deployment: one request in its queue
    for all the inputs of a call, which its replica embeds in as few forward passes as fit."""

    read = staticmethod(completion_input.parse_embeddings)

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        summary="Embed texts with an embedding deployment, as OpenAI's embeddings API does.",
        description="One vector per input, in order, each of unit length when the model's recipe "
        "normalises (sentence-transformers models do). Inputs longer than the model takes are "
        "truncated. A deployment that is not an embedding model is a 400 naming `model`.",
        request=EmbeddingInput,
        responses={200: dict},
    )  # its example: scheduling.api.examples
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def shaped(
        self, call: completion_input.Embeddings, result: Request, vectors: list[list[float]], usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(vector, call.encoding_format)}
                for i, vector in enumerate(vectors)
            ],
            "model": call.model,
            "usage": usage,
        }


def ran(
    model: str,
    *,
    kind: str,
    given: Any,
    params: dict[str, Any],
    owner: str,
    timeout: float,
    key: str | None,
    param: str,
    wanted: str,
) -> Request | tuple[int, dict[str, Any] | HttpResponseBase]:
    """A request of `model` run and waited for, up to `timeout`: the request done, or the answer
    of a call it could not be (the model unknown, or not `wanted`: "an embedding model"; a limit;
    a timeout; a failure the call's `param` is named in)."""
    try:
        submitted, result = request_services.run(
            model, kind=kind, input=given, params=params, owner=owner, timeout=timeout, idempotency_key=key
        )
    except (NotFound, InvalidInput) as exc:
        return _refusal(exc, model, wanted)
    except ServiceError as exc:
        return _service_answer(exc)
    if result is None:
        return 504, error_body(timed_out(submitted.id, timeout), kind="timeout")
    if result.status != "done":
        return _failure(result, param)
    return result


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the call asked for it: numbers, or (base64) its float32 values little-endian,
    base64-encoded, which OpenAI's clients decode. The replica's floats are float32 values, so
    neither way loses a digit."""
    if encoding_format == "float":
        return vector
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
