"""`GET /v1/responses/{id}/input_items`: the input of a response as items (OpenAI's
`client.responses.input_items.list`), read back from the chat its request holds: the messages
of its own `input` (not its instructions, nor what `previous_response_id` carried over), each
assistant's calls a function_call item, each tool's answer a function_call_output."""

from __future__ import annotations

import json
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response

from gpuportal.wire.requestqueue import Request
from scheduling.api.openai_compat import OpenAIView, error_body
from scheduling.api.response_detail import kept_response, not_kept
from scheduling.api.responses import INPUT_AT

MOST_LISTED = 100
DEFAULT_LISTED = 20


def input_items(request: Request) -> list[dict[str, Any]]:
    """The items of a response's own input, in the order given."""
    messages = request.input if isinstance(request.input, list) else []
    items: list[dict[str, Any]] = []
    stem = request.id.replace("-", "")
    for k, message in enumerate(messages[int(request.params.get(INPUT_AT, 0)) :]):
        role, content = message.get("role"), message.get("content")
        if role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{stem}_{k}",
                    "call_id": message.get("tool_call_id", ""),
                    "output": content or "",
                    "status": "completed",
                }
            )
            continue
        if content or not message.get("tool_calls"):
            part = "output_text" if role == "assistant" else "input_text"
            items.append(
                {
                    "type": "message",
                    "id": f"msg_{stem}_{k}",
                    "role": role,
                    "status": "completed",
                    "content": [{"type": part, "text": content or ""}],
                }
            )
        for j, call in enumerate(message.get("tool_calls") or ()):
            arguments = call["function"].get("arguments", {})
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{stem}_{k}_{j}",
                    "call_id": call.get("id", ""),
                    "name": call["function"]["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                    "status": "completed",
                }
            )
    return items


class InputItemsView(OpenAIView):
    """`GET /v1/responses/{id}/input_items?order=desc&limit=20&after=ID`, as OpenAI's: newest
    first by default, a page of `limit` after the item `after`."""

    @extend_schema(
        summary="A response's input items, as OpenAI's input_items list.",
        parameters=[
            OpenApiParameter("order", str, enum=["asc", "desc"], description="desc (newest first) by default."),
            OpenApiParameter("limit", int, description=f"1 to {MOST_LISTED}; {DEFAULT_LISTED} by default."),
            OpenApiParameter("after", str, description="The id of the item the page begins after."),
        ],
        responses={200: dict, 404: dict},
        operation_id="v1_response_input_items",
    )
    def get(self, request: HttpRequest, response_id: str) -> Response:
        order, limit, after = (request.query_params.get(name) for name in ("order", "limit", "after"))
        if order not in (None, "asc", "desc"):
            return Response(error_body("order: must be asc or desc", "order"), status=400)
        if limit is not None and (not limit.isdigit() or not 1 <= int(limit) <= MOST_LISTED):
            return Response(error_body(f"limit: must be a whole number from 1 to {MOST_LISTED}", "limit"), status=400)
        found = kept_response(request, response_id)
        if found is None:
            return not_kept(response_id)
        items = input_items(found)
        if order != "asc":
            items.reverse()
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                return Response(error_body(f"after: no item {after} in this response's input", "after"), status=400)
            items = items[at + 1 :]
        page = items[: int(limit or DEFAULT_LISTED)]
        return Response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > len(page),
            }
        )
