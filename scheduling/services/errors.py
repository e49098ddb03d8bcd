"""What services raise; the API turns each into its HTTP status with a JSON body."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence


class ServiceError(Exception):
    status = 400

    def body(self) -> dict:
        return {"detail": str(self)}

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries beside its body."""
        return {}


class NotFound(ServiceError):
    status = 404


class NoDeployment(NotFound):
    """A name that names no deployment, saying what is deployed and the name it is nearest, so that
    a typo or a forgotten name is answered with what to ask instead."""

    LISTED = 10  # names listed at most

    def __init__(self, name: str, deployed: Sequence[str]):
        self.name = name
        self.deployed = list(deployed)
        near = difflib.get_close_matches(name, self.deployed, n=1, cutoff=0.6)
        self.near = near[0] if near else None
        super().__init__(f"no deployment named {name!r}{self.hint()}")

    def hint(self) -> str:
        """What follows the refusal: nothing deployed, or the nearest name and those deployed."""
        if not self.deployed:
            return ": nothing is deployed (POST /api/deployments/ deploys a model)"
        listed = ", ".join(self.deployed[: self.LISTED])
        if len(self.deployed) > self.LISTED:
            listed += f" and {len(self.deployed) - self.LISTED} more"
        return (f"; did you mean {self.near!r}?" if self.near else "") + f" (deployed: {listed})"


class InvalidInput(ServiceError):
    """Bad input, naming the field (dotted for nested shapes, e.g. `model.source`)."""

    status = 400

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")

    def body(self) -> dict:
        return {self.field: [self.message]}


class AlreadyExists(InvalidInput):
    """A name that is taken (409), naming the field."""

    status = 409


class CannotPlace(ServiceError):
    """No node can host what was asked; nothing was applied. `retry_after`: in how many seconds
    asking again may succeed (replicas in the way leave their min_runtime), or None; asked only
    when the refusal is answered, as the Retry-After header, since it places the ask again."""

    status = 409

    def __init__(self, reason: str, reasons: Mapping[str, str], *, retry_after: Callable[[], int | None] | None = None):
        self.reasons = dict(reasons)
        self._retry_after = retry_after
        self._headers: dict[str, str] = {}
        super().__init__(reason)

    def body(self) -> dict:
        return {"detail": str(self), "reasons": self.reasons}

    def headers(self) -> dict[str, str]:
        if self._retry_after is not None:  # once: an answer may ask for its headers twice
            seconds, self._retry_after = self._retry_after(), None
            self._headers = {"Retry-After": str(seconds)} if seconds is not None else {}
        return self._headers


class InvalidState(ServiceError):
    """The thing exists but cannot do that now (e.g. evicting a replica that is not serving)."""

    status = 409


class TransitionRefused(InvalidState):
    """A state change the replica state machine does not allow (gpuportal.wire.states); nothing
    was written. Names both states, so a caller sees what it asked and what the replica is."""

    def __init__(self, replica_id: str, before: str, after: str, why: str = ""):
        self.replica_id, self.before, self.after = replica_id, before, after
        super().__init__(f"replica {replica_id} is {before}: it cannot become {after}" + (f", {why}" if why else ""))

    def body(self) -> dict:
        return {"detail": str(self), "state": self.before, "wanted": self.after}


class Unavailable(ServiceError):
    """It exists but cannot serve now, and waiting would not help (a deployment that gave up)."""

    status = 503


class OutcomeUnknown(ServiceError):
    """Redis went away after a request's submit was sent and before it said whether the request
    was written (killed or frozen mid-call, and not back in time to look): the request may run,
    so this is not a 503, which says it was not. A 504 naming the request's id, by which it can be
    looked up once Redis is back (a 404 if it was never written)."""

    status = 504

    def __init__(self, request_id: str, keyed: bool):
        self.request_id = request_id
        again = (
            "send it again with the same Idempotency-Key: it runs once"
            if keyed
            else f"GET /api/requests/{request_id}/ says once Redis is back (404: it was not accepted); "
            "send an Idempotency-Key to retry such a request safely"
        )
        super().__init__(f"Redis stopped answering before it said whether request {request_id} was accepted: {again}")

    def body(self) -> dict:
        return {"detail": str(self), "request": self.request_id}


class KeyReused(ServiceError):
    """An Idempotency-Key sent again with another request than the one first accepted under it:
    a retry must be the same request, and a new request needs a new key (the IETF draft's 422)."""

    status = 422


class TooManyRequests(ServiceError):
    """Over one of the caller's own limits (429): nothing was queued, and the same request sent
    again after `retry_after_s` may be taken. `limit` names which limit: "concurrent" or "per_minute"."""

    status = 429

    def __init__(self, message: str, *, limit: str, retry_after_s: int):
        self.limit, self.retry_after_s = limit, retry_after_s
        super().__init__(message)

    def body(self) -> dict:
        return {"detail": str(self), "limit": self.limit, "retry_after_s": self.retry_after_s}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}
