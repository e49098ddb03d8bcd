"""What services raise; the API turns each into its HTTP status with a JSON body."""

from __future__ import annotations

from collections.abc import Mapping


class ServiceError(Exception):
    status = 400

    def body(self) -> dict:
        return {"detail": str(self)}


class NotFound(ServiceError):
    status = 404


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
    """No node can host what was asked; nothing was applied."""

    status = 409

    def __init__(self, reason: str, reasons: Mapping[str, str]):
        self.reasons = dict(reasons)
        super().__init__(reason)

    def body(self) -> dict:
        return {"detail": str(self), "reasons": self.reasons}


class InvalidState(ServiceError):
    """The thing exists but cannot do that now (e.g. evicting a replica that is not serving)."""

    status = 409


class Unavailable(ServiceError):
    """It exists but cannot serve now, and waiting would not help (a deployment that gave up)."""

    status = 503
