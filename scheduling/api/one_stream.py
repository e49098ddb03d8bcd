"""One request's stream as the APIs of typed events (OpenAI's Responses, Anthropic's Messages)
send it: what it waits for until it begins, then its reasoning and its text apart as they come
(gpuportal.wire.reasoning), the text held back once it may open a call (gpuportal.wire.tools.Watch)
or whole where it must be read whole, then its end. Each API turns what is heard into its own
events; this is where a client that leaves stops the request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpuportal.wire import reasoning, tools
from gpuportal.wire.requestqueue import Request
from scheduling.api.completion_input import Completion
from scheduling.api.openai_compat import KEEPALIVE_S, _follow, _stop


@dataclass(frozen=True)
class Heard:
    """A comment to send as it is (what the request waits for), a piece of its reasoning and of its
    text to send, or its end: the request as it ended (None where it did not within the call's
    timeout), with the watch that held back what may be a call."""

    comment: bytes = b""
    thought: str = ""
    text: str = ""
    ended: bool = False
    final: Request | None = None
    watch: tools.Watch | None = None


def followed(
    request: Request,
    call: Completion,
    *,
    held: bool,
    watched: bool,
    begun: Callable[[], bool],
    stops_when_left: bool = True,
) -> Iterator[Heard]:
    """What `request`'s stream says, until its end. `held`: its text is read whole at its end;
    `watched`: it goes out until it opens a call; `begun`: whether the API's stream has sent
    something of the answer (no more waiting comments then). Closed before the end (its client
    left), the request is stopped wherever it is, so that nothing generates an answer for nobody;
    not with `stops_when_left` false (a request whose answer is read back later)."""
    deadline, stop = time.monotonic() + call.timeout_s, threading.Event()
    splitter, watch = reasoning.Splitter(), tools.Watch() if watched else None
    told, told_at, ended = "", time.monotonic(), False
    try:
        for item in _follow(request, call.model, deadline, 0, stop):
            if item.waiting:
                if not begun() and (item.waiting != told or time.monotonic() - told_at >= KEEPALIVE_S):
                    told, told_at = item.waiting, time.monotonic()
                    yield Heard(comment=f": {told}\n\n".encode())  # an SSE comment, which clients skip
                continue
            if not item.ended:
                if held:
                    continue
                thought, text = splitter.feed(item.text)
                yield Heard(thought=thought, text=watch.feed(text) if watch is not None else text)
                continue
            ended = True
            yield Heard(ended=True, final=item.final, watch=watch)
            return
    except GeneratorExit:
        if not ended and stops_when_left:
            _stop([request], "its caller left: the stream was closed")
        raise
    finally:
        stop.set()
