"""Inference requests over REST: run and wait (`/infer/`), or submit and poll (`/api/requests/`)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.http import JsonResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import permissions, serializers, status
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response
from rest_framework.views import APIView

from gpuportal.auth import user_from_header
from gpuportal.wire import sampling
from gpuportal.wire.pages import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from gpuportal.wire.requestqueue import CALLERS_INPUT, Request
from scheduling.api import bodies, idempotency
from scheduling.api.inputs import FiniteFloatField, SamplingInput, StrictSerializer
from scheduling.services import progress as progress_services
from scheduling.services import requests as request_services
from scheduling.services.errors import ServiceError

STATUSES = ["queued", "waking", "dispatched", "running", "done", "failed", "cancelled"]


class ParamsInput(StrictSerializer, SamplingInput):
    max_tokens = serializers.IntegerField(
        min_value=1, max_value=sampling.MOST_TOKENS, required=False, default=sampling.DEFAULT_MAX_TOKENS
    )
    stop = serializers.JSONField(required=False, default=list)
    # What the answer is held to as it is generated (inference.constrained), as /v1 holds it:
    # Ollama's `format` and vLLM's guided formats, one a request.
    format = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='"json": the answer is a JSON object; or a JSON Schema object: the answer is the JSON it '
        "describes (as Ollama's `format`).",
    )
    guided_choice = serializers.JSONField(
        required=False, allow_null=True, help_text="vLLM's: the answer is one of these strings."
    )
    guided_regex = serializers.JSONField(
        required=False, allow_null=True, help_text="vLLM's: the answer matches this regular expression."
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # As the request queue keeps them: temperature and top_p always (as they always were),
        # the other sampling parameters only where given.
        given = {key: value for key, value in attrs.items() if value is not None}
        if why := sampling.min_tokens_beyond(given):
            raise serializers.ValidationError({"min_tokens": why})
        formats = {
            name: given[name] for name in ("format", sampling.GUIDED_CHOICE, sampling.GUIDED_REGEX) if name in given
        }
        if (twice := sampling.one_format_problem(formats)) is not None:
            raise serializers.ValidationError({twice[0]: twice[1]})
        if "format" in given:
            given[sampling.JSON_SCHEMA] = given.pop("format")
            given[sampling.SCHEMA_FIELD] = "format"
        return {"temperature": 0.0, "top_p": 1.0, **given}

    def validate_format(self, value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        if value == "json":
            return dict(sampling.ANY_JSON_OBJECT)
        if not isinstance(value, dict):
            raise serializers.ValidationError('must be "json" or a JSON Schema object')
        if (why := sampling.schema_problem(value)) is not None:
            raise serializers.ValidationError(why)
        return value

    def validate_guided_choice(self, value: Any) -> list[str] | None:
        if value is not None and (why := sampling.choice_problem(value)) is not None:
            raise serializers.ValidationError(why)
        return value

    def validate_guided_regex(self, value: Any) -> str | None:
        if value is not None and (why := sampling.regex_problem(value)) is not None:
            raise serializers.ValidationError(why)
        return value

    def validate_stop(self, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise serializers.ValidationError("must be a string or a list of at most 4 non-empty strings")
        return stops


class RequestInput(StrictSerializer):
    deployment = serializers.SlugField(max_length=100)
    input = serializers.JSONField(help_text="Text, a list of chat messages, or a tensor as nested lists.")
    params = ParamsInput(required=False)


class InferInput(StrictSerializer):
    input = serializers.JSONField(help_text="Text, a list of chat messages, or a tensor as nested lists.")
    params = ParamsInput(required=False)
    timeout_s = FiniteFloatField(min_value=0, required=False)

    def validate_timeout_s(self, value: float) -> float:
        if value > settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:
            raise serializers.ValidationError(f"must be at most {settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:g}")
        return value


class ProgressSerializer(serializers.Serializer):
    phase = serializers.ChoiceField(
        choices=["queued", "placing", "loading", "waking", "running", "done", "failed", "cancelled"],
        help_text="What it waits for: its turn (queued), a placement, a load or a wake; or it runs, or ended.",
    )
    percent = serializers.IntegerField(allow_null=True, help_text="How far the load or the wake is.")
    queue_position = serializers.IntegerField(allow_null=True, help_text="1: the next its deployment takes.")
    estimate_s = serializers.FloatField(
        allow_null=True, help_text="Seconds until a replica serves, from the deployment's last load or wake."
    )


class RequestSerializer(serializers.Serializer):
    """The shape of a request; `GET /api/requests/{id}/` returns the same."""

    id = serializers.CharField()
    deployment = serializers.CharField()
    kind = serializers.CharField()
    status = serializers.ChoiceField(choices=STATUSES)
    replica = serializers.CharField(allow_blank=True)
    attempts = serializers.IntegerField()
    output = serializers.JSONField(allow_null=True)
    error = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField(allow_null=True)
    dispatched_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    first_token_at = serializers.DateTimeField(
        allow_null=True, help_text="When its first token was generated (a generation on a batching replica)."
    )
    finished_at = serializers.DateTimeField(allow_null=True)
    progress = ProgressSerializer()


def shape(request: Request, progress: progress_services.Reader | None = None) -> dict[str, Any]:
    """The REST shape of a request. `progress` reads what a waiting one waits for (one reader per
    answer, so a list reads each deployment once); a running or ended one reads nothing."""

    def at(stamp: float | None) -> str | None:
        return datetime.fromtimestamp(stamp, tz=UTC).isoformat() if stamp else None

    return {
        "id": request.id,
        "deployment": request.deployment,
        "kind": request.kind,
        "status": request.status,
        "replica": request.replica,
        "attempts": request.attempts,
        "output": request.output,
        "error": request.error,
        "created_at": at(request.created_at),
        "dispatched_at": at(request.dispatched_at),
        "started_at": at(request.started_at),
        "first_token_at": at(request.first_token_at),
        "finished_at": at(request.finished_at),
        "progress": (progress or progress_services.Reader()).of(request).record(),
    }


def kind_of(data: Any) -> str:
    """Text generates, a list of chat messages chats, anything else is a tensor for a plain
    module (submit refuses text for a module, and tensors for a causal LM fail at the model)."""
    if isinstance(data, str):
        return "generate"
    if isinstance(data, list) and data and all(isinstance(m, dict) for m in data):
        if all({"role", "content"} <= set(m) for m in data):
            return "chat"
        raise serializers.ValidationError({"input": ["chat messages need a role and a content"]})
    if isinstance(data, list):
        return "forward"
    raise serializers.ValidationError({"input": ["must be text, a list of {role, content} messages, or a tensor"]})


def params_of(validated: dict[str, Any]) -> dict[str, Any]:
    return dict(validated.get("params") or ParamsInput().run_validation({}))


# Over one of the caller's limits (scheduling.services.user_limits); nothing was queued.
TOO_MANY_REQUESTS = OpenApiResponse(
    description="Over the caller's limit on requests in flight or per minute; retry after `Retry-After` seconds."
)


# A failed request's HTTP answer when the caller waited for it: input the model cannot take is
# the client's to fix (400); what cannot be placed is a conflict (409); anything else is ours (503).
FAILURE_STATUS = {**dict.fromkeys(CALLERS_INPUT, 400), "placement": 409}


class InferView(APIView):
    """Runs a request and waits for it.

    The hot path of the portal (where its own overhead must stay small), so a request in the usual shape (a
    token, JSON within the usual bounds) is served by `dispatch` without DRF's request wrapping,
    serializers and renderers. Anything else (another authentication, input the fast check is not
    sure of) goes the DRF way, which gives every error its usual 4xx: the fast path accepts only
    what the serializers would accept, and validates it to the same values.
    """

    permission_classes = [permissions.IsAuthenticated]

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        fast = _fast_infer(request, kwargs["name"]) if request.method == "POST" else None
        return fast if fast is not None else super().dispatch(request, *args, **kwargs)

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        request=InferInput,
        responses={
            200: RequestSerializer,
            202: OpenApiResponse(RequestSerializer, description="Not finished within timeout_s: poll its id."),
            400: OpenApiResponse(description="A field is invalid, or the input is too long for the model."),
            404: OpenApiResponse(description="No such deployment."),
            409: OpenApiResponse(
                description="The deployment cannot be placed or woken; the body says why. With Retry-After "
                "where a wait will make room (replicas inside their min_runtime)."
            ),
            429: TOO_MANY_REQUESTS,
        },
    )
    def post(self, request: HttpRequest, name: str) -> Response:
        key = idempotency_key(request)
        data = InferInput(data=request.data)
        data.is_valid(raise_exception=True)
        kind = kind_of(data.validated_data["input"])
        timeout = data.validated_data.get("timeout_s", settings.GPUPORTAL_INFER_TIMEOUT_S)
        submitted, final = request_services.run(
            name, kind=kind, input=data.validated_data["input"], params=params_of(data.validated_data),
            owner=str(request.user.pk), timeout=timeout, idempotency_key=key,
        )  # fmt: skip
        result = final or request_services.latest(submitted)
        status_code, body = _answer(result)
        return Response(body, status=status_code, headers=retry_after(result))


def _fast_infer(request: Any, name: str) -> JsonResponse | None:
    """InferView.post without DRF, or None when the request is not one it is sure of."""
    user = user_from_header(request)
    body = json_body(request) if user is not None else None
    inputs = fast_inputs(body) if body is not None else None
    if inputs is None:
        return None
    try:
        key = idempotency.key_of(request)
    except idempotency.BadKey:
        return None  # DRF's way says what is wrong with it
    data, params, timeout = inputs
    try:
        submitted, final = request_services.run(
            name, kind=kind_of(data), input=data, params=params, owner=str(user.pk), timeout=timeout,
            idempotency_key=key,
        )  # fmt: skip
    except serializers.ValidationError as exc:  # kind_of: messages that look like chat but are not
        return JsonResponse(exc.detail, status=400)
    except ServiceError as exc:
        return JsonResponse(exc.body(), status=exc.status, headers=exc.headers())
    result = final or request_services.latest(submitted)
    status_code, body = _answer(result)
    return JsonResponse(body, status=status_code, headers=retry_after(result))


def idempotency_key(request: Any) -> str | None:
    """The Idempotency-Key header's value; a 400 naming it when it cannot be a key."""
    try:
        return idempotency.key_of(request)
    except idempotency.BadKey as err:
        raise ValidationError({idempotency.HEADER: [str(err)]}) from None


def json_body(request: Any) -> Any | None:
    """The request's JSON body, or None if it has none or it does not parse (DRF then says so)."""
    if request.content_type != "application/json":
        return None
    try:
        return bodies.loads(request.body)
    except (ParseError, ValidationError):
        return None


_PARAM_DEFAULTS = {"max_tokens": sampling.DEFAULT_MAX_TOKENS, "temperature": 0.0, "top_p": 1.0, "stop": []}


def fast_inputs(body: Any) -> tuple[Any, dict[str, Any], float] | None:
    """(input, params, timeout_s) as InferInput validates them, for the shapes clients send most
    (text or messages; params of the right types within bounds); None for anything else, which
    InferInput then judges with its field-by-field errors."""
    if not isinstance(body, dict) or body.get("input") is None or not set(body) <= {"input", "params", "timeout_s"}:
        return None
    if not isinstance(body["input"], str) and not _finite(body["input"]):
        return None  # Python's json reads Infinity and NaN; the serializer's strict JSON refuses them
    params = fast_params(body.get("params", {}))
    if params is None:
        return None
    timeout = body.get("timeout_s", settings.GPUPORTAL_INFER_TIMEOUT_S)
    if type(timeout) not in (int, float) or not 0 <= timeout <= settings.GPUPORTAL_INFER_MAX_TIMEOUT_S:
        return None
    return body["input"], params, float(timeout)


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a parsed JSON value (InferInput's JSONField refuses them)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True


def fast_params(params: Any) -> dict[str, Any] | None:
    """ParamsInput's validated data for params it is sure of (defaults filled in), else None."""
    if not isinstance(params, dict) or not set(params) <= {*_PARAM_DEFAULTS, *sampling.NAMES, *sampling.LISTED_NAMES}:
        return None
    out = dict(_PARAM_DEFAULTS)
    max_tokens = params.get("max_tokens", out["max_tokens"])
    if type(max_tokens) is not int or not 1 <= max_tokens <= sampling.MOST_TOKENS:
        return None
    out["max_tokens"] = max_tokens
    if sampling.problems(params):
        return None
    out.update(sampling.checked(params))
    if sampling.min_tokens_beyond(out) or sampling.listed_problems(params):
        return None
    out.update(sampling.listed_kept(params))
    stop = params.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops):
        return None
    out["stop"] = list(stops)
    return out


def retry_after(result: Request) -> dict[str, str] | None:
    """A failed request's Retry-After, where its failure said when asking again may succeed (a
    wake refused only for replicas inside their min_runtime); a client library that honours it
    (OpenAI's does) asks again then rather than at once."""
    if result.status != "failed" or result.retry_after_s is None:
        return None
    return {"Retry-After": str(result.retry_after_s)}


def _answer(result: Request) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body for a request waited on: 202 while unfinished."""
    if not result.final:
        return status.HTTP_202_ACCEPTED, shape(result)
    if result.status == "failed":
        code = FAILURE_STATUS.get(result.error_kind, status.HTTP_503_SERVICE_UNAVAILABLE)
        body = shape(result)
        if code == 400:
            body["input"] = [result.error]
        return code, body
    return status.HTTP_200_OK, shape(result)


class RequestFilters(serializers.Serializer):
    """The query of `GET /api/requests/`; anything out of bounds is a 400 naming the parameter."""

    deployment = serializers.SlugField(max_length=100, required=False)
    status = serializers.ChoiceField(choices=STATUSES, required=False)
    page = serializers.IntegerField(min_value=1, max_value=10_000, required=False, default=1)
    page_size = serializers.IntegerField(
        min_value=1, max_value=MAX_PAGE_SIZE, required=False, default=DEFAULT_PAGE_SIZE
    )


class RequestPageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True, help_text="The next page, newer to older; null on the last.")
    previous = serializers.URLField(allow_null=True)
    results = RequestSerializer(many=True)


class RequestListView(APIView):
    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(
        summary="List requests",
        operation_id="api_requests_list",
        description=(
            "The caller's requests (staff: everyone's), newest first, from the last 24 hours (how long "
            "the portal keeps a request), filterable by deployment and status. No total count: "
            "follow `next` until it is null."
        ),
        parameters=[RequestFilters],
        responses={200: RequestPageSerializer, 400: OpenApiResponse(description="A filter is invalid.")},
    )
    def get(self, request: HttpRequest) -> Response:
        filters = RequestFilters(data=request.query_params)
        filters.is_valid(raise_exception=True)
        query = filters.validated_data
        page, size = query["page"], query["page_size"]
        found, more = request_services.recent(
            user_id=str(request.user.pk), staff=request.user.is_staff, deployment=query.get("deployment"),
            status=query.get("status"), offset=(page - 1) * size, limit=size,
        )  # fmt: skip

        reader = progress_services.Reader()

        def link(to: int) -> str:
            params = request.query_params.copy()
            params["page"] = str(to)
            return request.build_absolute_uri(f"{request.path}?{params.urlencode()}")

        return Response(
            {
                "next": link(page + 1) if more else None,
                "previous": link(page - 1) if page > 1 else None,
                "results": [shape(r, reader) for r in found],
            }
        )

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        request=RequestInput,
        responses={202: RequestSerializer, 429: TOO_MANY_REQUESTS},
    )
    def post(self, request: HttpRequest) -> Response:
        key = idempotency_key(request)
        data = RequestInput(data=request.data)
        data.is_valid(raise_exception=True)
        name = data.validated_data["deployment"]
        submitted = request_services.submit(
            name,
            kind=kind_of(data.validated_data["input"]),
            input=data.validated_data["input"],
            params=params_of(data.validated_data),
            owner=str(request.user.pk),
            idempotency_key=key,
        )
        return Response(shape(submitted), status=status.HTTP_202_ACCEPTED)


class RequestDetailView(APIView):
    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(responses={200: RequestSerializer, 404: OpenApiResponse(description="No such request.")})
    def get(self, request: HttpRequest, pk: str) -> Response:
        found = request_services.get(pk, user_id=str(request.user.pk), staff=request.user.is_staff)
        return Response(shape(found))

    @extend_schema(
        summary="Cancel a request",
        description=(
            "A waiting request is cancelled at once. One a replica is generating is stopped there "
            "between two of its steps and ends `cancelled`, its `output` what was generated until "
            "then (its KV cache goes to the other requests): answered once it has ended, or with a "
            "202 and the request still running if the replica has not stopped it within a few "
            "seconds (poll it). A forward pass or an embedding runs to its end."
        ),
        responses={
            200: RequestSerializer,
            202: OpenApiResponse(RequestSerializer, description="Asked stopped; not ended yet: poll its id."),
            404: OpenApiResponse(description="No such request."),
            409: OpenApiResponse(description="It has ended: there is nothing to cancel."),
        },
    )
    def delete(self, request: HttpRequest, pk: str) -> Response:
        cancelled = request_services.cancel(pk, user_id=str(request.user.pk), staff=request.user.is_staff)
        return Response(shape(cancelled), status=status.HTTP_200_OK if cancelled.final else status.HTTP_202_ACCEPTED)
