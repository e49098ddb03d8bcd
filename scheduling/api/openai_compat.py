"""OpenAI-compatible endpoints for causal-LM deployments (the model is the deployment's name):
`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, with `stream: true` as
server-sent events. Requests go through the same queue as `/api/.../infer/`."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.http import JsonResponse, StreamingHttpResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, permissions, serializers
from rest_framework.authentication import SessionAuthentication
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response
from rest_framework.views import APIView

from gpuportal.auth import CachedTokenAuthentication, user_from_header
from gpuportal.wire.requestqueue import Request, StreamSplice
from scheduling.api.inputs import FiniteFloatField
from scheduling.api.requests import ParamsInput, fast_params, json_body
from scheduling.models import Deployment
from scheduling.services import requests as request_services
from scheduling.services.errors import InvalidInput, NotFound, ServiceError

# Streams poll Redis in slices this long, so a dropped client is noticed between slices.
STREAM_SLICE_S = 1.0


class BearerTokenAuthentication(CachedTokenAuthentication):
    """The portal's API tokens, sent the way OpenAI clients send keys: `Authorization: Bearer <key>`."""

    keyword = "Bearer"


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema that /v1 takes the portal's tokens as HTTP bearer tokens."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer"}


class CompletionInput(serializers.Serializer):
    """What OpenAI clients send; fields this portal does not use are accepted and ignored."""

    model = serializers.CharField()
    max_tokens = serializers.IntegerField(min_value=1, max_value=4096, required=False, allow_null=True)
    max_completion_tokens = serializers.IntegerField(min_value=1, max_value=4096, required=False, allow_null=True)
    temperature = FiniteFloatField(min_value=0, max_value=2, required=False, allow_null=True)
    top_p = FiniteFloatField(min_value=0, max_value=1, required=False, allow_null=True)
    stop = serializers.JSONField(required=False, allow_null=True)
    n = serializers.IntegerField(required=False, allow_null=True)
    stream = serializers.BooleanField(required=False, default=False)
    # Not OpenAI's: how long the call waits for its answer (issue 16: a /v1 call never hangs).
    # OpenAI clients send it with `extra_body={"timeout": 60}`.
    timeout = FiniteFloatField(
        min_value=0.001,
        required=False,
        allow_null=True,
        help_text="Seconds to wait for the answer (default GPUPORTAL_INFER_TIMEOUT_S, at most "
        "GPUPORTAL_INFER_MAX_TIMEOUT_S); past it the call ends with a 504 and the request is cancelled "
        "if it had not started.",
    )

    def validate_timeout(self, value: float | None) -> float | None:
        if value is not None and value > settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:
            raise serializers.ValidationError(
                f"at most {settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:g} s (GPUPORTAL_INFER_MAX_TIMEOUT_S)"
            )
        return value

    def wait_s(self) -> float:
        timeout = self.validated_data.get("timeout")
        return settings.GPUPORTAL_INFER_TIMEOUT_S if timeout is None else float(timeout)

    def validate_n(self, value: int | None) -> int | None:
        if value not in (None, 1):
            raise serializers.ValidationError("only n=1 is supported")
        return value

    def params(self) -> dict[str, Any]:
        data = self.validated_data
        raw = {
            "max_tokens": data.get("max_tokens") or data.get("max_completion_tokens"),
            "temperature": data.get("temperature"),
            "top_p": data.get("top_p"),
            "stop": data.get("stop"),
        }
        params = ParamsInput(data={k: v for k, v in raw.items() if v is not None})
        if not params.is_valid():
            raise serializers.ValidationError(params.errors)
        return {**params.validated_data, "stream": data["stream"]}


class PromptInput(CompletionInput):
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)


ROLES = ("system", "user", "assistant", "developer")


class MessageInput(serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES)
    content = serializers.CharField(allow_blank=True, trim_whitespace=False)


class ChatInput(CompletionInput):
    messages = MessageInput(many=True, allow_empty=False)


def openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> Response:
    return Response(error_body(message, param, kind), status=status)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _text(value: Any) -> bool:
    """A string DRF's CharField takes as it is: no lone surrogates (which it refuses)."""
    return type(value) is str and (value.isascii() or not any("\ud800" <= c <= "\udfff" for c in value))


def _service_error(exc: ServiceError) -> tuple[int, dict[str, Any]]:
    return exc.status, error_body(str(exc), kind="invalid_request_error" if exc.status < 500 else "server_error")


class OpenAIView(APIView):
    authentication_classes = [BearerTokenAuthentication, CachedTokenAuthentication, SessionAuthentication]
    permission_classes = [permissions.IsAuthenticated]

    def handle_exception(self, exc: Exception) -> Response:
        """Errors in OpenAI's shape, so its clients raise their usual exceptions with our message."""
        if isinstance(exc, exceptions.ValidationError):
            param, message = _first_error(exc.detail)
            return openai_error(400, f"{param}: {message}" if param else message, param)
        if isinstance(exc, exceptions.AuthenticationFailed | exceptions.NotAuthenticated):
            return openai_error(401, str(exc.detail), kind="authentication_error")
        if isinstance(exc, ServiceError):
            return Response(*reversed(_service_error(exc)))
        return super().handle_exception(exc)


def _first_error(detail: Any, field: str = "") -> tuple[str, str]:
    """The first error in DRF's nested detail, as (dotted field name, message)."""
    if isinstance(detail, dict) and detail:
        key, value = next(iter(detail.items()))
        # A list- or object-level error belongs to the field holding it.
        inner = field if key == "non_field_errors" else (f"{field}.{key}" if field else str(key))
        return _first_error(value, inner)
    if isinstance(detail, list) and detail:
        return _first_error(detail[0], field)
    return field, str(detail)


class ModelsView(OpenAIView):
    @extend_schema(responses={200: dict})
    def get(self, request: HttpRequest) -> Response:
        rows = Deployment.objects.filter(loader=Deployment.Loader.TRANSFORMERS).values_list("name", "created_at")
        return Response(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": int(created.timestamp()), "owned_by": "gpuportal"}
                    for name, created in rows
                ],
            }
        )


class _Generate(OpenAIView, ABC):
    """What completions and chat completions share; each says what its input and output are."""

    input_class: type[CompletionInput]
    kind: str
    object_name: str
    id_prefix: str

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # The hot path (issue 4's overhead budget): a non-streamed request in the usual shape is
        # answered without DRF; anything else (streams, other authentication, input the fast
        # check is not sure of) goes the DRF way, with its usual errors.
        fast = self._fast(request) if request.method == "POST" else None
        return fast if fast is not None else super().dispatch(request, *args, **kwargs)

    def _fast(self, request: Any) -> JsonResponse | None:
        user = user_from_header(request, ("Bearer", "Token"))
        body = json_body(request) if user is not None else None
        read = self.fast_input(body) if isinstance(body, dict) else None
        if read is None:
            return None
        model, request_input, params, timeout = read
        try:
            code, payload = self.run(model, request_input, params, str(user.pk), timeout)
        except ServiceError as exc:
            code, payload = _service_error(exc)
        return JsonResponse(payload, status=code)

    def fast_input(self, body: dict[str, Any]) -> tuple[str, Any, dict[str, Any], float] | None:
        """(model, input, params, timeout) as the input class validates them, for a non-streamed
        request of the usual shape; None for anything else."""
        model = body.get("model")
        if not _text(model) or not model or model != model.strip() or body.get("stream", False) is not False:
            return None
        timeout = body.get("timeout")
        if timeout is None:
            timeout = settings.GPUPORTAL_INFER_TIMEOUT_S
        elif type(timeout) not in (int, float) or not 0.001 <= timeout <= settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:
            return None  # the DRF way says what is wrong with it
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            return None
        request_input = self.fast_payload(body)
        if request_input is None:
            return None
        raw = {
            "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "stop": body.get("stop"),
        }
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and (type(value) is not int or not 1 <= value <= 4096):
                return None
        params = fast_params({k: v for k, v in raw.items() if v is not None})
        return None if params is None else (model, request_input, {**params, "stream": False}, float(timeout))

    def post(self, request: HttpRequest) -> Response | StreamingHttpResponse:
        data = self.input_class(data=request.data)
        data.is_valid(raise_exception=True)
        model = data.validated_data["model"]
        params = data.params()
        request_input = self.input_of(data.validated_data)
        owner = str(request.user.pk)
        if not params["stream"]:
            code, payload = self.run(model, request_input, params, owner, data.wait_s())
            return Response(payload, status=code)
        try:
            submitted = request_services.submit(model, kind=self.kind, input=request_input, params=params, owner=owner)
        except (NotFound, InvalidInput) as exc:
            return Response(*reversed(self.refusal(exc, model)))
        response = StreamingHttpResponse(self.events(submitted, model, data.wait_s()), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        return response

    def run(
        self, model: str, request_input: Any, params: dict[str, Any], owner: str, timeout: float
    ) -> tuple[int, dict[str, Any]]:
        """Run a non-streamed request and wait for it, at most `timeout` seconds: the HTTP status
        and OpenAI-shaped body."""
        # The service checks the model exists and is a causal LM in the statement that accepts the
        # request (no look-up of our own first: one database round trip per request, not two).
        try:
            submitted, result = request_services.run(
                model, kind=self.kind, input=request_input, params=params, owner=owner, timeout=timeout
            )
        except (NotFound, InvalidInput) as exc:
            return self.refusal(exc, model)
        if result is None:
            return 504, error_body(timed_out(submitted.id, timeout), kind="timeout")
        if result.status != "done":
            code = 400 if result.error_kind == "bad_input" else 503
            return code, error_body(
                result.error,
                "messages" if self.kind == "chat" else "prompt",
                "server_error" if code == 503 else "invalid_request_error",
            )
        return 200, self.body(result, model)

    @staticmethod
    def refusal(exc: NotFound | InvalidInput, model: str) -> tuple[int, dict[str, Any]]:
        if isinstance(exc, NotFound):
            return 404, error_body(f"The model `{model}` does not exist", "model", "model_not_found")
        return 400, error_body(f"`{model}` is not a causal language model", "model")

    @abstractmethod
    def fast_payload(self, body: dict[str, Any]) -> Any | None:
        """The request's input (prompt or messages) as the input class reads it, or None."""

    @abstractmethod
    def input_of(self, data: dict[str, Any]) -> Any: ...

    @abstractmethod
    def choice(self, output: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def delta(self, text: str, first: bool) -> dict[str, Any]: ...

    def body(self, result: Request, model: str) -> dict[str, Any]:
        output = result.output or {}
        return {
            "id": f"{self.id_prefix}-{result.id}",
            "object": self.object_name,
            "created": int(result.created_at or time.time()),
            "model": model,
            "choices": [{"index": 0, "finish_reason": output.get("finish_reason", "stop"), **self.choice(output)}],
            "usage": output.get("usage", {}),
        }

    def events(self, submitted: Request, model: str, timeout: float) -> Iterator[bytes]:
        """Server-sent events: a chunk per piece of text as it is generated, then [DONE]; an
        error event instead of the last chunk if it fails or does not end within `timeout`."""
        queue = request_services.queue()
        sent, first, deadline = 0, True, time.monotonic() + timeout
        splice = StreamSplice()
        base = {
            "id": f"{self.id_prefix}-{submitted.id}",
            "object": f"{self.object_name}.chunk" if self.kind == "chat" else self.object_name,
            "model": model,
            "created": int(time.time()),
        }
        while time.monotonic() < deadline:
            chunks, ended = queue.read_stream(submitted.id, sent, STREAM_SLICE_S)
            for chunk in chunks:
                # A re-run (its replica died or drained mid-answer) starts over: send only what is new.
                if text := splice.feed(chunk):
                    yield _sse({**base, "choices": [{"index": 0, "finish_reason": None, **self.delta(text, first)}]})
                    first = False
            sent += len(chunks)
            if ended:
                break
        final = queue.get(submitted.id)
        output = (final.output if final else None) or {}
        if final is not None and final.status == "failed":
            yield _sse({"error": {"message": final.error, "type": "server_error", "param": None, "code": None}})
        elif final is None or final.status != "done":
            message = timed_out(submitted.id, timeout)
            yield _sse({"error": {"message": message, "type": "timeout", "param": None, "code": None}})
        else:
            yield _sse(
                {
                    **base,
                    "choices": [
                        {"index": 0, "finish_reason": output.get("finish_reason", "stop"), **self.delta("", first)}
                    ],
                    "usage": output.get("usage"),
                }
            )
        yield b"data: [DONE]\n\n"


def timed_out(request_id: str, timeout: float) -> str:
    """What a caller whose answer did not come in time is told. A request that has not started
    is cancelled, so that nothing runs for a caller who has gone; one already running is left to
    finish, and its answer kept for polling."""
    if request_services.cancel_unstarted(request_id, reason=f"its /v1 call timed out after {timeout:g} s"):
        return f"request {request_id} did not start within {timeout:g} s and was cancelled"
    return f"request {request_id} did not finish within {timeout:g} s; poll /api/requests/{request_id}/ for its answer"


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class CompletionsView(_Generate):
    input_class = PromptInput
    kind = "generate"
    object_name = "text_completion"
    id_prefix = "cmpl"

    @extend_schema(request=PromptInput, responses={200: dict})
    def post(self, request: HttpRequest) -> Response | StreamingHttpResponse:
        return super().post(request)

    def input_of(self, data: dict[str, Any]) -> Any:
        return data["prompt"]

    def fast_payload(self, body: dict[str, Any]) -> Any | None:
        prompt = body.get("prompt")
        return prompt if _text(prompt) else None

    def choice(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"text": output.get("text", ""), "logprobs": None}

    def delta(self, text: str, first: bool) -> dict[str, Any]:
        return {"text": text, "logprobs": None}


class ChatCompletionsView(_Generate):
    input_class = ChatInput
    kind = "chat"
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    @extend_schema(request=ChatInput, responses={200: dict})
    def post(self, request: HttpRequest) -> Response | StreamingHttpResponse:
        return super().post(request)

    def input_of(self, data: dict[str, Any]) -> Any:
        return [dict(m) for m in data["messages"]]

    def fast_payload(self, body: dict[str, Any]) -> Any | None:
        messages = body.get("messages")
        if type(messages) is not list or not messages:
            return None
        out = []
        for m in messages:
            if type(m) is not dict or m.get("role") not in ROLES or not _text(m.get("content")):
                return None
            out.append({"role": m["role"], "content": m["content"]})  # other keys: ignored, as MessageInput does
        return out

    def choice(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": output.get("text", "")}}

    def delta(self, text: str, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if first:
            delta["role"] = "assistant"
        return {"delta": delta}
