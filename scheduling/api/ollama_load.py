"""Ollama's idioms for loading and unloading a model, over a deployment's sleep: a call with
nothing to answer (`/api/generate` with no prompt, `/api/chat` with no messages) loads the model,
what `ollama run` and Open WebUI send first; with `keep_alive` 0 it unloads it, what `ollama stop`
sends. Here a load wakes the deployment as a request would (any user), and an unload puts it to
sleep as `POST /api/deployments/{name}/sleep/` does (staff). A `keep_alive` with something to
answer is read for its form and left to the deployment's own sleep settings."""

from __future__ import annotations

import re
from typing import Any

from scheduling.api.completion_input import Refused
from scheduling.services import sleep as sleep_services
from scheduling.services.errors import NotFound, ServiceError

# Go's durations, as Ollama reads them ("5m", "1h30m", "-1"), or a number of seconds.
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class StaffOnly(ServiceError):
    status = 403


def keep_alive_s(value: Any) -> float | None:
    """`keep_alive` in seconds (negative: for ever), None where it is not given."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise Refused("keep_alive", 'must be a duration such as "5m" or a number of seconds')
    if not isinstance(value, str):
        return float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.removeprefix("-")
    if re.fullmatch(r"\d+(?:\.\d+)?", text):  # a number in a string: seconds, as a number is
        return sign * float(text)
    if text and re.fullmatch(f"(?:{_PART.pattern})+", text):
        return sign * sum(float(number) * _SECONDS[unit] for number, unit in _PART.findall(text))
    raise Refused("keep_alive", f'{value!r} is no duration: say "5m", "1h30m", "0" or "-1"')


# Ollama's tag of a model named without one: `tiny:latest` is `tiny`, as Ollama's clients (and
# its users) write it. Any other tag names a LoRA adapter of the deployment (gpuportal.wire.adapters).
DEFAULT_TAG = ":latest"


def named(model: Any) -> Any:
    """The model a body names, its default tag dropped; anything else as it is (checked later)."""
    return model.removesuffix(DEFAULT_TAG) if isinstance(model, str) else model


def nothing_to_answer(body: dict[str, Any], input_param: str) -> bool:
    return input_param not in body or body[input_param] in ("", [], None)


def load_or_unload(body: dict[str, Any], user: Any) -> str:
    """Wakes or puts to sleep the deployment `body` names: Ollama's `done_reason`, "load" or "unload"."""
    name = named(body.get("model"))
    if not isinstance(name, str) or not name:
        raise Refused("model", "required: a deployment's name")
    who = user.get_username()
    try:
        if keep_alive_s(body.get("keep_alive")) == 0:
            if not user.is_staff:
                raise StaffOnly(f"only staff may put model '{name}' to sleep (keep_alive 0): it is shared")
            sleep_services.sleep_deployment(name, reason=f"put to sleep by {who} (Ollama's keep_alive 0)")
            return "unload"
        sleep_services.wake_deployment(name, reason=f"woken for {who}'s load (Ollama's)", for_requests=True)
    except NotFound:
        raise NotFound(f"model '{name}' not found") from None
    return "load"
