"""The REST API over HTTP. Every error the portal answers becomes an ApiError carrying the API's
own message (its `detail`, or each field's errors named as in the request body), and a portal
that cannot be reached becomes Unreachable with one line saying so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import requests

from gpuportal.wire.pages import MAX_PAGE_SIZE

# A deploy waits for a node agent to read the model's files: give it more than a read needs.
TIMEOUT_S = 60.0


class CliError(Exception):
    """Ends the command with its message on stderr and exit code 1."""


class Unreachable(CliError):
    pass


class ApiError(CliError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


def field_errors(errors: Any, prefix: str = "") -> list[str]:
    """DRF's validation errors, one line each, the field named as in the request body
    (nested groups dotted: `memory.max_tokens: ...`); errors about the whole body unnamed."""
    if isinstance(errors, dict):
        lines = []
        for key, value in errors.items():
            if key in ("non_field_errors", "detail"):
                lines.extend(field_errors(value, prefix))
            else:
                lines.extend(field_errors(value, f"{prefix}.{key}" if prefix else str(key)))
        return lines
    if isinstance(errors, list):
        if all(not isinstance(item, (dict, list)) for item in errors):
            return [f"{prefix}: {item}" if prefix else str(item) for item in errors]
        lines = []
        for index, item in enumerate(errors):
            lines.extend(field_errors(item, f"{prefix}.{index}" if prefix else str(index)))
        return lines
    return [f"{prefix}: {errors}" if prefix else str(errors)]


def api_message(status: int, body: Any, reason: str = "") -> str:
    """What the API said, as an operator reads it. A body with a `detail` is that detail (and a
    placement refusal's reason per node); other JSON bodies are field errors; anything else (a
    proxy's HTML page) is the status line."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]:
        return str(body["error"]["message"])  # /v1's answers, in OpenAI's shape
    if isinstance(body, dict) and "detail" in body:
        detail = str(body["detail"])
        reasons = body.get("reasons")
        if not isinstance(reasons, dict) or not reasons:
            return detail
        said = [f"{where}: {why}" for where, why in reasons.items()]
        return "\n".join([_without(detail, said), *(f"  {line}" for line in said)])
    if isinstance(body, (dict, list)) and body:
        return "\n".join(field_errors(body))
    return f"HTTP {status} {reason}".rstrip()


def _without(detail: str, said: list[str]) -> str:
    """A refusal's detail less the per-node reasons it spells out (a placement's does, on one line)
    when the lines below give each once: what comes before the first and after the last."""
    found = [(detail.find(line), line) for line in said]
    if any(at < 0 for at, _ in found):
        return detail
    first = min(at for at, _ in found)
    end = max(at + len(line) for at, line in found)
    return " ".join(part for part in (detail[:first].rstrip(" :;"), detail[end:].strip(" ;")) if part)


class Client:
    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.headers["Accept"] = "application/json"
        if token:
            self.session.headers["Authorization"] = f"Token {token}"

    def request(self, method: str, path: str, *, params: dict | None = None, body: Any = None) -> Any:
        """The answer's JSON (None for a 204); ApiError for any 4xx or 5xx."""
        try:
            response = self.session.request(
                method, self.url + path, params=params, json=body, timeout=self.timeout_s, allow_redirects=False
            )
        except requests.ConnectionError:
            raise self._unreachable() from None
        except requests.Timeout:
            raise Unreachable(f"the portal at {self.url} did not answer within {self.timeout_s:.0f} s") from None
        except requests.RequestException as err:
            raise Unreachable(f"cannot talk to the portal at {self.url}: {err}") from None
        try:
            body = response.json() if response.content else None
        except ValueError:
            body = None
        if response.status_code >= 400:
            raise ApiError(response.status_code, api_message(response.status_code, body, response.reason or ""))
        if 300 <= response.status_code < 400:
            # The API never redirects: a redirect means the URL names something else (a login page).
            where = response.headers.get("Location", "?")
            raise ApiError(response.status_code, f"{self.url} redirected to {where}: is it the portal's URL?")
        return body

    def events(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        """A streamed answer's server-sent events (each `data:` line's JSON, until `[DONE]`) as
        they arrive; ApiError for a refusal. No read timeout: the portal ends a call that runs past
        its own `timeout` with an error event."""
        try:
            response = self.session.post(
                self.url + path, json=body, stream=True, timeout=(self.timeout_s, None), allow_redirects=False
            )
        except requests.ConnectionError:
            raise self._unreachable() from None
        with response:
            if response.status_code >= 300:
                try:
                    refusal = response.json() if response.content else None
                except ValueError:
                    refusal = None
                raise ApiError(response.status_code, api_message(response.status_code, refusal, response.reason))
            # chunk_size None: each piece as the server sends it, not once 512 bytes have come.
            for raw in response.iter_lines(chunk_size=None):
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                if not line.startswith("data: "):
                    continue  # a comment (what the call waits for) or the blank line between events
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def _unreachable(self) -> Unreachable:
        return Unreachable(
            f"cannot reach the portal at {self.url} (is it up? give its address with --url or GPUPORTAL_URL)"
        )

    def get(self, path: str, params: dict | None = None) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body=body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body=body)

    def delete(self, path: str, params: dict | None = None) -> Any:
        return self.request("DELETE", path, params=params)

    def pages(self, path: str, params: dict | None = None, *, page_size: int = MAX_PAGE_SIZE) -> Iterator[dict]:
        """Every result of a paginated list, page after page. By page number rather than the
        answer's `next` link: that link names the host as the server saw it (behind a proxy, not
        the one this client can reach)."""
        page = 1
        while True:
            answer = self.get(path, {**(params or {}), "page": page, "page_size": page_size})
            yield from answer.get("results", [])
            if not answer.get("next"):
                return
            page += 1

    def token(self, username: str, password: str) -> str:
        answer = self.post("/api/auth/token/", {"username": username, "password": password})
        return answer["token"]
