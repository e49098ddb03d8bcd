"""`POST /v1/responses`: OpenAI's Responses API (what its newer clients and agent SDKs call) as a
chat of the portal's. The body is read into a chat's (`chat_body`) and checked as
`/v1/chat/completions` checks one, each refusal naming the Responses field; the request runs and
streams as a chat's does, and its answer is given as a response's output items: its reasoning (a
reasoning model's thinking, gpuportal.wire.reasoning), a message, and a `function_call` for each
call it makes.

Nothing is stored beyond the request itself: a response's id is its request's (`resp_` + the
id), and `previous_response_id` carries a conversation on from the request the queue keeps (its
messages, then its answer), for as long as it keeps it (a day); an earlier response's
`instructions` are not carried over, as OpenAI's are not."""

from __future__ import annotations

import contextlib
import difflib
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest

from gpuportal.wire import prefix_cache, reasoning, sampling, tools, truncation
from gpuportal.wire.requestqueue import Request
from scheduling.api import idempotency
from scheduling.api.completion_input import Completion, Refused, content_text, message_origin, not_text
from scheduling.api.inputs import FiniteFloatField
from scheduling.api.one_stream import followed
from scheduling.api.openai_compat import ChatCompletionsView, cached_tokens, read_call
from scheduling.services import queueing
from scheduling.services import requests as request_services
from scheduling.services.errors import InvalidInput, NotFound

ID_PREFIX = "resp_"
# Request queue params: the call's `instructions` (the system message they made, which a later
# call that continues this one leaves out), the response it continued, and how many of its
# messages came of those two (its own input follows them).
INSTRUCTIONS = "instructions"
PREVIOUS = "previous_response_id"
INPUT_AT = "input_at"
# OpenAI's `store`: false, the response is not kept to be read again (retrieve, input_items) nor
# gone on from (previous_response_id). Its request still ends in the queue as any does.
STORE = "store"
# OpenAI's `background`: the call is answered once its request is queued, and the request runs on
# for nobody waiting, read back (polled, or its stream followed again) or cancelled by its id.
BACKGROUND = "background"

# The Responses fields read, and those passed on to the chat as they are (the sampling parameters
# and chat_template_kwargs, which vLLM's Responses API takes as well).
READ_FIELDS = frozenset(
    {"model", "input", INSTRUCTIONS, "max_output_tokens", "stream", "tools", "tool_choice", "parallel_tool_calls",
     "text", PREVIOUS, "timeout", "top_logprobs", BACKGROUND, "conversation", "prompt",
     reasoning.TEMPLATE_KWARGS, reasoning.THINKING_BUDGET, prefix_cache.CACHE_SALT, truncation.TRUNCATION,
     *sampling.NAMES, *sampling.LISTED_NAMES}
)  # fmt: skip
PASSED_ON = (
    "timeout",
    reasoning.TEMPLATE_KWARGS,
    reasoning.THINKING_BUDGET,
    prefix_cache.CACHE_SALT,
    *sampling.NAMES,
    *sampling.LISTED_NAMES,
)
# Roles a Responses message may have, as a chat template knows them (a developer's is a system's).
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
TYPO_CUTOFF = 0.8


class ResponseInput(serializers.Serializer):
    """What OpenAI's clients send to /v1/responses, for the OpenAPI schema only: `chat_body`
    reads every body."""

    model = serializers.CharField(help_text="The deployment's name (a causal LM).")
    input = serializers.JSONField(
        help_text="A string (the user's message), or a list of items: messages ({role, content}, content a string "
        'or input_text/output_text parts), {"type": "function_call", "call_id", "name", "arguments"}, '
        '{"type": "function_call_output", "call_id", "output"} and reasoning items given back.'
    )
    instructions = serializers.CharField(required=False, allow_null=True, help_text="A system message, first.")
    previous_response_id = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="Go on from a response of yours (its messages and its answer, then `input`), for a day after it.",
    )
    max_output_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    temperature = FiniteFloatField(required=False, allow_null=True)
    top_p = FiniteFloatField(required=False, allow_null=True)
    stream = serializers.BooleanField(required=False, default=False, help_text="Server-sent events, typed.")
    tools = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='Function tools: [{"type": "function", "name", "description", "parameters"}].',
    )
    tool_choice = serializers.JSONField(
        required=False, allow_null=True, help_text='"auto", "required", "none" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    store = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="False: the response is not kept to retrieve, list the input of, or go on from (default true).",
    )
    truncation = serializers.ChoiceField(
        choices=[truncation.AUTO, truncation.DISABLED],  # the module's: this field is bound only after
        required=False,
        allow_null=True,
        help_text="\"auto\": a conversation longer than its replica's room loses its earliest turns (the system's "
        'messages and the last turn kept) rather than fail; "disabled" (the default): it fails as too long.',
    )
    background = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="True: answered once queued (status `queued`), the response runs on; read it back by its id "
        "(`stream=true` follows it again), or cancel it (POST /v1/responses/{id}/cancel).",
    )
    text = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='{"format": {"type": "text" | "json_object"}} or {"format": {"type": "json_schema", "name", '
        '"schema"}}: the answer held to it as it is generated.',
    )


def chat_body(body: Any, earlier: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the chat body a Responses body asks for, the field each of its messages came from), the
    conversation going on from `earlier` (the messages of a previous response and its answer);
    Refused naming the first Responses field that is wrong."""
    if not isinstance(body, dict):
        raise Refused(None, "the body must be a JSON object")
    for key in body:
        near = (
            difflib.get_close_matches(key, sorted(READ_FIELDS), n=1, cutoff=TYPO_CUTOFF)
            if key not in READ_FIELDS
            else []
        )
        if near:
            raise Refused(key, f"unknown field; did you mean {near[0]!r}?")
    background = body.get(BACKGROUND)
    if background is not None and not isinstance(background, bool):
        raise Refused(BACKGROUND, "must be true or false")
    if background and body.get(STORE) is False:
        raise Refused(BACKGROUND, "needs store: a response run in the background is read back later (store: false)")
    for field in ("conversation", "prompt"):
        if body.get(field) is not None:
            raise Refused(field, f"not supported: give the conversation as `input`, or go on with `{PREVIOUS}`")
    if body.get("top_logprobs"):
        raise Refused("top_logprobs", "not supported on /v1/responses: /v1/chat/completions gives log probabilities")
    messages, origins = [], []
    instructions = body.get(INSTRUCTIONS)
    if instructions is not None:
        if not sampling.is_text(instructions):
            raise Refused(INSTRUCTIONS, not_text(instructions, "must be a string"))
        messages.append({"role": "system", "content": instructions})
        origins.append(INSTRUCTIONS)
    for message in earlier or ():
        messages.append(message)
        origins.append(PREVIOUS)
    _items(body.get("input"), messages, origins)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    for name in PASSED_ON:
        if name in body:
            chat[name] = body[name]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if (answer_format := _format(body.get("text"))) is not None:
        chat["response_format"] = answer_format
    return chat, origins


def _items(value: Any, messages: list[dict[str, Any]], origins: list[str]) -> None:
    """`input` as chat messages, appended with the field each came from: a string is the user's
    message; a list's function calls go into the assistant's message they follow (one message of
    them all where they follow none), each call's output a tool's message, and a reasoning item
    (one of an earlier answer's, given back) into the assistant's message that follows it, as
    chat templates read a past turn's reasoning."""
    if sampling.is_text(value):
        messages.append({"role": "user", "content": value})
        origins.append("input")
        return
    if not isinstance(value, list) or not value:
        raise Refused(
            "input", not_text(value, "required: a string, or a non-empty list of messages, function calls and outputs")
        )
    thought: list[str] = []  # reasoning given back, for the assistant's message that follows it
    for i, item in enumerate(value):
        at = f"input.{i}"
        if not isinstance(item, dict):
            raise Refused(at, "must be an object: a message, a function_call or a function_call_output")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought.append(_thought(item, at))
            continue
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise Refused(f"{at}.role", f"must be one of {', '.join(ROLES)}")
            said = {"role": role, "content": content_text(item.get("content"), f"{at}.content", TEXT_PARTS)}
            if role == "assistant" and thought:
                said[reasoning.TEMPLATE_FIELD], thought = "\n".join(thought), []
            messages.append(said)
        elif kind == "function_call":
            call = _function_call(item, at)
            if messages and messages[-1]["role"] == "assistant" and origins[-1] != PREVIOUS and not thought:
                messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought:
                messages[-1][reasoning.TEMPLATE_FIELD], thought = "\n".join(thought), []
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not sampling.is_text(call_id):
                raise Refused(f"{at}.call_id", "required: the call_id of the function_call it answers")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": content_text(item.get("output"), f"{at}.output", TEXT_PARTS),
                }
            )
        else:
            raise Refused(
                f"{at}.type",
                f"{kind!r} is not served here: an item is a message, a function_call, a function_call_output "
                "or reasoning",
            )
        origins.append(at)


def _thought(item: dict[str, Any], at: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's (OpenAI's own models
    give a summary alone)."""
    for field, part in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        if parts:
            return content_text(parts, f"{at}.{field}", (part,))
    return ""


def _function_call(item: dict[str, Any], at: str) -> dict[str, Any]:
    """A function_call item as a chat's assistant message lists a call."""
    for field in ("call_id", "name"):
        if not sampling.is_text(item.get(field)):
            raise Refused(f"{at}.{field}", "required: a string")
    arguments = item.get("arguments", "{}")
    try:
        tools.as_template_arguments(arguments)
    except (ValueError, TypeError) as exc:
        raise Refused(f"{at}.arguments", str(exc)) from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _tools(value: Any) -> Any:
    """Responses' function tools (their fields at the top) as a chat's (under `function`); what
    is no list is left for the chat's check to refuse."""
    if not isinstance(value, list):
        return value
    chat = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise Refused(f"tools.{i}.type", f"{kind!r} is not served here: only function tools, which the caller runs")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(value: Any) -> dict[str, Any] | None:
    """`text` as a chat's response_format; None for text."""
    if value is None:
        return None
    answer_format = value.get("format") if isinstance(value, dict) else None
    if answer_format is None:
        if not isinstance(value, dict):
            raise Refused("text", 'must be {"format": {"type": "text" | "json_object" | "json_schema", ...}}')
        return None
    if not isinstance(answer_format, dict):
        raise Refused("text.format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    if answer_format.get("type") == "json_schema":
        fields = {key: answer_format[key] for key in ("name", "schema", "strict") if key in answer_format}
        return {"type": "json_schema", "json_schema": fields}
    return answer_format


def renamed(param: str | None, origins: list[str]) -> str | None:
    """The Responses field of a chat field a refusal names."""
    if param is None:
        return None
    head = param.partition(".")[0]
    if head == "messages":
        return message_origin(param, origins, "input")
    if head == "tools":
        return param.replace(".function.", ".").removesuffix(".function")
    return {
        "max_completion_tokens": "max_output_tokens",
        "max_tokens": "max_output_tokens",
        "response_format": "text.format",
    }.get(head, param)


def response_id(request: Request) -> str:
    return f"{ID_PREFIX}{request.id}"


class ResponsesView(ChatCompletionsView):
    """`POST /v1/responses`: a chat, its answer as a response's output items."""

    input_param = "input"

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        summary="Answer as OpenAI's Responses API does.",
        description="A chat of a causal LM deployment, given and answered as OpenAI's Responses API: `input`, "
        "`instructions`, `previous_response_id`, function tools, `text.format`; streamed as its typed events.",
        request=ResponseInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def run(
        self, model: str, request_input: Any, params: dict[str, Any], owner: str, timeout: float, key: str | None = None
    ) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        if not params.get(BACKGROUND):
            return super().run(model, request_input, params, owner, timeout, key)
        try:
            submitted = request_services.submit(
                model, kind=self.kind, input=request_input, params=params, owner=owner, idempotency_key=key
            )
        except (NotFound, InvalidInput) as exc:
            return self.refusal(exc, model)
        return 200, self.standing(submitted)

    def standing(self, found: Request) -> dict[str, Any]:
        """A response as its request stands: its answer once done; its status and error (none
        while it waits or runs) before that, or where it ended without an answer."""
        if found.status == "done":
            return self.body([found], [found], found.deployment)
        if found.final:
            status, error = self.unanswered(found, found, 0)
        else:
            status, error = ("in_progress" if found.status in ("dispatched", "running") else "queued"), None
        answer = self.response(found, found.deployment, created=found.created_at, status=status, output=[], usage=None)
        return {**answer, "error": error}

    def parse(self, body: Any, owner: str) -> Completion:
        earlier = self.earlier(body.get(PREVIOUS) if isinstance(body, dict) else None, owner)
        chat, origins = chat_body(body, earlier)
        try:
            call = read_call(chat, "chat")
        except Refused as refused:
            raise Refused(renamed(refused.param, origins), refused.message) from None
        kept = {key: body[key] for key in (INSTRUCTIONS, PREVIOUS) if body.get(key) is not None}
        store = body.get(STORE)
        if store is not None and not isinstance(store, bool):
            raise Refused(STORE, "must be true or false")
        if store is False:
            kept[STORE] = False
        if body.get(BACKGROUND):
            kept[BACKGROUND] = True
        if why := truncation.problem(cut := body.get(truncation.TRUNCATION)):
            raise Refused(truncation.TRUNCATION, why)
        if cut == truncation.AUTO:  # the replica, which counts the prompt's tokens, drops its earliest turns
            kept[truncation.TRUNCATION] = truncation.AUTO
        # Where this call's own input begins among the messages (input_items lists it alone).
        kept[INPUT_AT] = sum(1 for origin in origins if origin in (INSTRUCTIONS, PREVIOUS))
        if call.params.get(sampling.SCHEMA_FIELD) == "response_format":
            kept[sampling.SCHEMA_FIELD] = "text.format"
        return Completion(model=call.model, input=call.input, params={**call.params, **kept}, timeout_s=call.timeout_s)

    @staticmethod
    def earlier(previous: Any, owner: str) -> list[dict[str, Any]] | None:
        """The conversation a previous response of `owner`'s leaves: its messages (but those its
        instructions made) and its answer."""
        if previous is None:
            return None
        if not sampling.is_text(previous) or not previous.startswith(ID_PREFIX):
            raise Refused(PREVIOUS, f"must be the id of a response ({ID_PREFIX}...)")
        try:
            found = queueing.get(previous.removeprefix(ID_PREFIX), user_id=owner, staff=False)
        except NotFound:
            raise Refused(PREVIOUS, f"no response {previous} of yours (responses are kept for a day)") from None
        if found.kind != "chat" or not isinstance(found.input, list):
            raise Refused(PREVIOUS, f"{previous} is not a response")
        if found.params.get(STORE) is False:
            raise Refused(PREVIOUS, f"{previous} was not stored (it was asked with store: false)")
        if found.status != "done":
            raise Refused(PREVIOUS, f"{previous} has no answer to go on from (it is {found.status})")
        said = found.input[1:] if found.params.get(INSTRUCTIONS) is not None else found.input
        message = ChatCompletionsView().choice(found.output or {}, found)["message"]
        return [*said, {key: value for key, value in message.items() if key != "logprobs"}]

    def body(self, results: list[Request], asked: list[Request], model: str, n: int = 1) -> dict[str, Any]:
        result, request = results[0], asked[0]
        output = result.output or {}
        items = self.items(output, request)
        ended = output.get("finish_reason", "stop")
        return self.response(
            request,
            model,
            created=result.created_at,
            status="incomplete" if ended == "length" else "completed",
            output=items,
            usage=_usage(output.get("usage") or {}),
        )

    def items(self, output: dict[str, Any], asked: Request) -> list[dict[str, Any]]:
        """The output items of a request's answer: its reasoning (a reasoning model's thinking,
        where it has any), its message (where it says anything, or is nothing else), then a
        function_call for each call it makes."""
        message = self.choice(output, asked)["message"]
        status = "incomplete" if output.get("finish_reason") == "length" else "completed"
        items = []
        if thought := message.get(reasoning.GIVEN[0]):
            items.append(_reasoning(asked, thought, status))
        if message.get("content") or not (message.get("tool_calls") or thought):
            items.append(_message(asked, message.get("content") or "", status))
        for call in message.get("tool_calls") or ():
            items.append(_function_call_item(call))
        return items

    @staticmethod
    def response(
        request: Request,
        model: str,
        *,
        created: float | None,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object, with what it was asked as OpenAI's echoes it."""
        params = request.params
        choice = params.get(tools.TOOL_CHOICE, tools.AUTO)
        schema = params.get(sampling.JSON_SCHEMA) if params.get(sampling.SCHEMA_FIELD) == "text.format" else None
        return {
            "id": response_id(request),
            "object": "response",
            "created_at": int(created or time.time()),
            "status": status,
            "model": model,
            "output": output,
            "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": params.get(INSTRUCTIONS),
            "previous_response_id": params.get(PREVIOUS),
            "max_output_tokens": params.get("max_tokens"),
            "temperature": params.get("temperature"),
            "top_p": params.get("top_p"),
            "tools": [{"type": "function", **tool["function"]} for tool in params.get(tools.TOOLS) or ()],
            "tool_choice": choice
            if choice in (tools.AUTO, tools.REQUIRED, tools.NONE)
            else {"type": "function", "name": choice},
            "parallel_tool_calls": params.get(tools.PARALLEL, True),
            "text": {"format": {"type": "json_schema", "schema": schema} if schema else {"type": "text"}},
            "store": params.get(STORE, True),
            "background": params.get(BACKGROUND, False),
            "truncation": params.get(truncation.TRUNCATION, truncation.DISABLED),
            "metadata": {},
        }

    def events(self, submitted: list[Request], call: Completion) -> Iterator[bytes]:
        # The call's own stream: its client leaving stops the request, unless it runs in the background.
        request = submitted[0]
        return self.followed_again(request, call, after=-1, stops_when_left=not request.params.get(BACKGROUND))

    def followed_again(
        self, request: Request, call: Completion, *, after: int, stops_when_left: bool = False
    ) -> Iterator[bytes]:
        """Responses' typed server-sent events, those numbered past `after`: response.created,
        then the reasoning and the message's text as they come (reasoning_text.delta,
        output_text.delta), then each function call whole, then response.completed (or
        .incomplete, cut by max_output_tokens; .failed, with its error, where the request failed
        or did not end within the call's timeout). An answer that may call functions sends its
        text until it opens a call, as a chat's stream does (gpuportal.wire.tools.Watch).

        The events come of what the request's stream holds, read from its start, so that
        following it again (GET /v1/responses/{id}?stream=true&starting_after=N) numbers each as
        it was numbered the first time. Closed early (its client left), it stops the request only
        with `stops_when_left`: one who follows a response again is not the one who asked it."""
        events = self._events(request, call, _Outline(request, after), stops_when_left)
        with contextlib.closing(events):  # closed early, `_events` says what becomes of the request
            for event in events:
                if event:
                    yield event

    def _events(self, request: Request, call: Completion, outline: _Outline, stops_when_left: bool) -> Iterator[bytes]:
        background = bool(request.params.get(BACKGROUND))
        # Its created_at the request's, so that following it again makes these events as they were.
        begun = self.response(
            request, call.model, created=request.created_at, status="in_progress", output=[], usage=None
        )
        yield outline.event("response.created", response=begun)
        yield outline.event("response.in_progress", response=begun)
        heard = followed(
            request,
            call,
            held=self.held_back(call),
            watched=self.watched(call),
            begun=lambda: bool(outline.at),
            stops_when_left=stops_when_left,
        )
        with contextlib.closing(heard):  # closed early (the client left), it stops the request if it is to
            for said in heard:
                if not said.ended:
                    if said.comment:
                        yield said.comment
                    yield from outline.said(REASONING, said.thought)
                    yield from outline.said(MESSAGE, said.text)
                    continue
                final = said.final
                if (background or not stops_when_left) and final is not None and not final.final:
                    return  # the wait is over, not the response: followed again from here, it goes on
                if final is None or final.status != "done":
                    status, error = self.unanswered(final, request, call.timeout_s)
                    ended_short = self.response(request, call.model, created=None, status=status, output=[], usage=None)
                    yield outline.event("response.failed", response={**ended_short, "error": error})
                    return
                yield from self._ending(outline, self.body([final], [request], call.model), final, said.watch)

    def unanswered(self, final: Request | None, request: Request, timeout: float) -> tuple[str, dict[str, Any]]:
        """The status and error of a response whose request ended without an answer (failed,
        cancelled), or did not end within `timeout`."""
        error = self._ended_short(final, request, timeout)["error"]
        status = "cancelled" if final is not None and final.status == "cancelled" else "failed"
        return status, {"code": error.get("code") or error["type"], "message": error["message"]}

    def _ending(
        self, outline: _Outline, answer: dict[str, Any], final: Request, watch: tools.Watch | None
    ) -> Iterator[bytes]:
        """The events of an answer's end: the rest of its reasoning and message (what a stream
        held back), each call whole, then the response, its items as the stream sent them."""
        output = final.output or {}
        content = reasoning.split(output.get("text", ""))[1]
        done = {item["type"]: item for item in answer["output"] if item["type"] in (REASONING, MESSAGE)}
        for kind in (REASONING, MESSAGE):
            whole = done[kind]["content"][0]["text"] if kind in done else None
            if whole is None and kind not in outline.at:
                continue
            sent = outline.sent.get(kind, "")
            if kind == MESSAGE and watch is not None and len(answer["output"]) > len(done):
                rest = tools.unsent(content, watch.sent, self.choice(output, final)["message"].get("content"))
            else:
                rest = (whole or "")[len(sent) :]
            yield from outline.said(kind, rest, force=True)
            status = done[kind]["status"] if kind in done else "completed"
            yield from outline.close(kind, status)
        calls = [item for item in answer["output"] if item["type"] == "function_call"]
        for item in calls:
            index = len(outline.at)
            outline.at[item["id"]] = index
            added = {**item, "arguments": "", "status": "in_progress"}
            yield outline.event("response.output_item.added", output_index=index, item=added)
            at = {"item_id": item["id"], "output_index": index}
            yield outline.event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield outline.event(
                "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
            )
            yield outline.event("response.output_item.done", output_index=index, item=item)
        answer["output"] = [*outline.closed, *calls]
        kind = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
        yield outline.event(kind, response=answer)


REASONING, MESSAGE = "reasoning", "message"


class _Outline:
    """The items a response's stream has opened, each at its output_index in the order opened,
    and the text each has sent; its events numbered in order."""

    def __init__(self, request: Request, after: int = -1):
        self.request = request
        self.numbers = itertools.count()
        self.after = after  # events numbered up to it are not sent (a client following again has them)
        self.at: dict[str, int] = {}  # an item's kind (or a call's id) → its output_index
        self.sent: dict[str, str] = {}
        self.closed: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        number = next(self.numbers)
        if number <= self.after:
            return b""
        data = json.dumps({"type": kind, "sequence_number": number, **fields})
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def item(self, kind: str, text: str, status: str) -> dict[str, Any]:
        return (_reasoning if kind == REASONING else _message)(self.request, text, status)

    def said(self, kind: str, text: str, *, force: bool = False) -> Iterator[bytes]:
        """The events of `text` of the item of `kind` (opened first where it is not; the reasoning
        closed once the message opens); with `force`, the item opened even for no text."""
        if not text and not (force and kind not in self.at):
            return
        if kind not in self.at:
            if kind == MESSAGE and REASONING in self.at:
                yield from self.close(REASONING, "completed")  # its thinking ended where the answer began
            self.at[kind] = len(self.at)
            item = self.item(kind, "", "in_progress")
            yield self.event("response.output_item.added", output_index=self.at[kind], item={**item, "content": []})
            yield self.event("response.content_part.added", **self._of(kind), part=item["content"][0])
        if text:
            self.sent[kind] = self.sent.get(kind, "") + text
            delta = "response.reasoning_text.delta" if kind == REASONING else "response.output_text.delta"
            yield self.event(delta, **self._of(kind), delta=text, **({} if kind == REASONING else {"logprobs": []}))

    def close(self, kind: str, status: str) -> Iterator[bytes]:
        if any(item["type"] == kind for item in self.closed):
            return
        whole = self.item(kind, self.sent.get(kind, ""), status)
        part = whole["content"][0]
        if kind == REASONING:
            yield self.event("response.reasoning_text.done", **self._of(kind), text=part["text"])
        else:
            yield self.event("response.output_text.done", **self._of(kind), text=part["text"], logprobs=[])
        yield self.event("response.content_part.done", **self._of(kind), part=part)
        yield self.event("response.output_item.done", output_index=self.at[kind], item=whole)
        self.closed.append(whole)

    def _of(self, kind: str) -> dict[str, Any]:
        return {"item_id": self.item(kind, "", "").get("id"), "output_index": self.at[kind], "content_index": 0}


def _message(request: Request, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{request.id.replace('-', '')}",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _reasoning(request: Request, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{request.id.replace('-', '')}",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call['id'].removeprefix('call_')}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A replica's token counts as a response's usage."""
    given, made = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": cached_tokens(usage)},
        "output_tokens": made,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": given + made,
    }
