"""Template filters of the dashboard."""

from __future__ import annotations

from django import template

from scheduling.dashboard import human_bytes

register = template.Library()


@register.filter(name="bytes")
def bytes_filter(n: int | None) -> str:
    return human_bytes(n)


@register.filter
def seconds(s: float | None) -> str:
    return "never" if s is None else f"{s:.0f} s"
