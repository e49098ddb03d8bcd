"""Template filters of the dashboard."""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone

from scheduling.web.dashboard import human_bytes

register = template.Library()


@register.filter(name="bytes")
def bytes_filter(n: int | None) -> str:
    return human_bytes(n)


@register.filter
def seconds(s: float | None) -> str:
    return "never" if s is None else f"{s:.0f} s"


@register.filter
def age(then: datetime | None) -> str:
    """How long ago, in seconds under two minutes: what an operator watching a wake wants."""
    if then is None:
        return "–"
    s = max(0.0, (timezone.now() - then).total_seconds())
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.0f} h ago"
