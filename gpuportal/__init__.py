"""The project package: settings, URLs, the Celery app, authentication, metrics and the stack that
`manage.py up` runs. The Celery app is loaded on first use rather than at import: a replica
process imports gpuportal.wire, and must not pay for Celery and Django's settings to do so.
`celery -A gpuportal` finds the app in gpuportal.celery itself."""

from typing import Any

__all__ = ("celery_app",)


def __getattr__(name: str) -> Any:
    if name == "celery_app":
        from gpuportal.celery import app

        return app
    raise AttributeError(f"module 'gpuportal' has no attribute {name!r}")
