"""A response read back by its id, for as long as its request is kept: `GET /v1/responses/{id}`
as it stands, or its events followed again (`?stream=true&starting_after=N`, what a client of a
background response reconnects with); `DELETE` it; `POST .../cancel` it. Yours (staff:
anyone's)."""

from __future__ import annotations

import contextlib

from django.conf import settings
from django.http import StreamingHttpResponse
from django.http.response import HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response

from gpuportal.wire.requestqueue import Request
from scheduling.api.completion_input import Completion
from scheduling.api.openai_compat import OpenAIView, error_body
from scheduling.api.responses import ID_PREFIX, STORE, ResponsesView
from scheduling.services import queueing
from scheduling.services.errors import InvalidState, NotFound

FLAGS = {"true": True, "1": True, "false": False, "0": False}
STREAM = OpenApiParameter(
    "stream", OpenApiTypes.BOOL, description="Its events as server-sent events, from the first, as it goes on."
)
STARTING_AFTER = OpenApiParameter(
    "starting_after",
    OpenApiTypes.INT,
    description="With stream: only the events numbered past it (a client that lost its stream has those).",
)


def kept_response(request: HttpRequest, response_id: str) -> Request | None:
    """The request of a response the caller may read (theirs; staff, anyone's), while it is kept."""
    if not response_id.startswith(ID_PREFIX):
        return None
    with contextlib.suppress(NotFound):
        user = request.user
        found = queueing.get(response_id.removeprefix(ID_PREFIX), user_id=str(user.pk), staff=user.is_staff)
        return found if found.kind == "chat" and found.params.get(STORE) is not False else None
    return None


def not_kept(response_id: str) -> Response:
    body = error_body(
        f"no response {response_id} (responses are kept for a day, not those deleted or asked with store: false)",
        "response_id",
        "not_found",
    )
    return Response(body, status=404)


class ResponseDetailView(OpenAIView):
    """`GET /v1/responses/{id}`: a response as it stands (OpenAI's `client.responses.retrieve`),
    or with `stream`, its events from the first (past `starting_after`) as it goes on; `DELETE`:
    gone before its day is out."""

    @extend_schema(
        parameters=[STREAM, STARTING_AFTER],
        responses={200: dict, 400: dict, 404: dict},
        operation_id="v1_response_retrieve",
    )
    def get(self, request: HttpRequest, response_id: str) -> HttpResponseBase:
        asked = request.query_params
        stream = FLAGS.get(asked.get("stream", "false").lower())
        if stream is None:
            return Response(error_body("must be true or false", "stream"), status=400)
        after = asked.get("starting_after")
        if after is not None and not stream:
            refusal = error_body("only with stream=true: the events to follow from", "starting_after")
            return Response(refusal, status=400)
        try:
            after_number = -1 if after is None else int(after)
        except ValueError:
            return Response(error_body(f"must be an event's sequence_number, not {after!r}", "starting_after"), 400)
        found = kept_response(request, response_id)
        if found is None:
            return not_kept(response_id)
        if not stream:
            return Response(ResponsesView().standing(found))
        call = Completion(
            model=found.deployment,
            input=found.input,
            params=found.params,
            timeout_s=settings.GPUPORTAL_INFER_TIMEOUT_S,
        )
        events = ResponsesView().followed_again(found, call, after=after_number)
        response = StreamingHttpResponse(events, content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        return response

    @extend_schema(responses={200: dict, 404: dict, 409: dict}, operation_id="v1_response_delete")
    def delete(self, request: HttpRequest, response_id: str) -> Response:
        """`DELETE /v1/responses/{id}` (OpenAI's `client.responses.delete`): the response, what it
        was asked and what it answered are deleted, once it has ended."""
        found = kept_response(request, response_id)
        if found is None:
            return not_kept(response_id)
        user = request.user
        try:
            queueing.forget(found.id, user_id=str(user.pk), staff=user.is_staff)
        except NotFound:
            return not_kept(response_id)
        except InvalidState:
            message = (
                f"response {response_id} has not ended yet: it can be deleted once it has "
                f"(cancel it first: POST /v1/responses/{response_id}/cancel)"
            )
            return Response(error_body(message, "response_id", code="conflict"), status=409)
        return Response({"id": response_id, "object": "response.deleted", "deleted": True})


class ResponseCancelView(OpenAIView):
    """`POST /v1/responses/{id}/cancel` (OpenAI's `client.responses.cancel`): a response that waits
    is cancelled at once, one a replica generates is stopped where it is (its status `cancelled`
    once the replica has ended it, within a few seconds); one that has ended is answered as it
    ended, so that a cancel sent again changes nothing."""

    @extend_schema(request=None, responses={200: dict, 404: dict}, operation_id="v1_response_cancel")
    def post(self, request: HttpRequest, response_id: str) -> Response:
        found = kept_response(request, response_id)
        if found is None:
            return not_kept(response_id)
        user = request.user
        try:
            found = queueing.cancel(found.id, user_id=str(user.pk), staff=user.is_staff)
        except NotFound:
            return not_kept(response_id)
        except InvalidState:
            found = kept_response(request, response_id)
            if found is None:  # deleted meanwhile
                return not_kept(response_id)
        return Response(ResponsesView().standing(found))
