"""OpenAI's Responses `truncation: "auto"`: a conversation longer than its replica's room loses
its earliest turns, not the request.

The web passes the choice on in a chat's params; the replica, which alone knows the prompt's
tokens and its room, drops whole turns from the beginning (after the system's messages, which
stay) until the rest fits: a turn is a user's message and all that follows it up to the next
user's, so that no call is left without its caller or a tool's answer without its call. The last
turn always stays; where even it does not fit, the request is refused as too long, as without
truncation. No Django here: the Responses view checks the field, the replica cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TRUNCATION = "truncation"
AUTO, DISABLED = "auto", "disabled"


def problem(value: Any) -> str | None:
    """Why `value` is no `truncation` (None where it is one, or none was given)."""
    if value is None or value in (AUTO, DISABLED):
        return None
    return f'must be "{AUTO}" or "{DISABLED}"'


def _system(messages: Sequence[dict[str, Any]]) -> int:
    """How many of the messages, from the first, are the system's (or the developer's): they stay."""
    return next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))


def cut_points(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Where the conversation may begin once earlier turns are dropped: each user's message after
    the first message that is no system's, in order."""
    return [i for i in range(_system(messages) + 1, len(messages)) if messages[i].get("role") == "user"]


def shortest_fit(
    messages: list[dict[str, Any]], fits: Callable[[list[dict[str, Any]]], bool]
) -> tuple[list[dict[str, Any]], int] | None:
    """The conversation with the fewest earliest turns dropped that `fits` (the system's messages
    kept), and how many messages were dropped; None where even its last turn alone does not fit.
    `fits` is asked O(log turns) times: the more turns dropped, the shorter the prompt, so the
    fewest that fit are found by halving."""
    cuts, system = cut_points(messages), _system(messages)

    def dropped(k: int) -> list[dict[str, Any]]:
        return messages if k == 0 else [*messages[:system], *messages[cuts[k - 1] :]]

    if fits(messages):
        return messages, 0
    low, high = 1, len(cuts)  # the fewest turns dropped that may fit, the most there are
    if high == 0 or not fits(dropped(high)):
        return None
    while low < high:
        middle = (low + high) // 2
        if fits(dropped(middle)):
            high = middle
        else:
            low = middle + 1
    kept = dropped(low)
    return kept, len(messages) - len(kept)
