"""What several commands take alike: counts, seconds, and how long to wait."""

from __future__ import annotations

import argparse

DEFAULT_TIMEOUT_S = 600.0


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def add_wait_options(parser: argparse.ArgumentParser, until: str) -> None:
    parser.add_argument("--no-wait", action="store_true", help=f"return at once instead of waiting until {until}")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"give up waiting after S seconds (default {DEFAULT_TIMEOUT_S:.0f}); the portal goes on",
    )
