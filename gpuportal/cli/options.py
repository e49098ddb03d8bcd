"""What several commands take alike: counts, seconds, how long to wait, and how to print."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml
from rich.console import Console

DEFAULT_TIMEOUT_S = 600.0


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more, not 0")
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


# What a looking command prints: a table for people, or the API's objects for scripts (as
# `kubectl get -o json` and `docker ps --format json` give them).
TABLE, JSON, YAML = "table", "json", "yaml"


def add_output_option(parser: argparse.ArgumentParser, what: str, *, how: str = "", with_yaml: bool = False) -> None:
    """`with_yaml`: the command prints YAML too (`ls`, whose deployments `gpuportal apply` reads back)."""
    parser.add_argument(
        "-o",
        "--output",
        choices=(TABLE, JSON, YAML) if with_yaml else (TABLE, JSON),
        default=TABLE,
        help=f"table (the default), or json{' or yaml' if with_yaml else ''}: {what} as the API gives them{how}, "
        "for scripts",
    )


def print_yaml(console: Console, data: Any) -> None:
    """`data` as YAML, its keys in the API's order, as `kubectl get -o yaml` prints an object."""
    console.file.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def print_json(console: Console, data: Any) -> None:
    """`data` as JSON on the console's stream, untouched by rich (no wrapping, no markup), so
    that `jq` reads it whatever the terminal's width."""
    console.file.write(json.dumps(data, indent=2) + "\n")
