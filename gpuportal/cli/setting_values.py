"""Deployment settings by name on the command line: `gpuportal set NAME sleep.idle_timeout_s=60
fairness.popular=true` changes them (a PATCH of the deployment), `gpuportal set NAME` shows them
all, and `gpuportal deploy ... --set SETTING=VALUE` gives them at the start. A setting is named by
its place in the REST body (`group.key`, as docs/api.md and the API's errors name it) or by its
key alone where no other group has that key. Names, types and choices come from the spec
(gpuportal.wire.deployment_spec); bounds are the API's to check, and its 400 names the setting."""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote

from rich.console import Console

from gpuportal.cli.client import Client, CliError
from gpuportal.cli.options import add_wait_options
from gpuportal.wire import deployment_spec as spec
from gpuportal.wire.deployment_spec import Setting, Update

# What answers for a setting the deployment's representation does not show.
MISSING: Any = object()
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_NULL = {"null", "none"}


class Operator(Protocol):
    """What the command uses of the command line's context (gpuportal.cli.app.Context)."""

    out: Console

    @property
    def client(self) -> Client: ...


class Assignment(NamedTuple):
    setting: Setting
    value: object


def setting_named(name: str, command: str) -> Setting:
    """The setting `name` names (`group.key`, or a key no other group has); a CliError naming the
    closest names otherwise."""
    for setting in spec.SETTINGS:
        if setting.path == name:
            return setting
    if "." not in name and (alone := spec.by_key(name)) is not None:
        return alone
    # A name cut short is one setting's start; else the nearest names by spelling.
    started = [s.path for s in spec.SETTINGS if s.path.startswith(name) or s.key.startswith(name)]
    names = [s.path for s in spec.SETTINGS]
    near = (
        started
        if len(started) == 1
        else difflib.get_close_matches(name, names + [s.key for s in spec.SETTINGS], n=3, cutoff=0.6)
    )
    hint = f"; did you mean {' or '.join(dict.fromkeys(_path_of(n) for n in near))}?" if near else ""
    raise CliError(f"{command}: no setting {name!r}{hint} (`gpuportal set --help` lists them)")


def _path_of(name: str) -> str:
    found = spec.by_key(name)
    return found.path if found is not None and "." not in name else name


def parse_value(setting: Setting, text: str, command: str) -> object:
    """`text` as the setting's type, or a CliError saying what it takes."""
    lowered = text.strip().lower()
    if setting.nullable and lowered in _NULL:
        return None
    if setting.type is bool:
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise CliError(f"{command}: {setting.path} is true or false, not {text!r}")
    if setting.type is int:
        try:
            return int(text)
        except ValueError:
            raise CliError(f"{command}: {setting.path} is a whole number, not {text!r}") from None
    if setting.type is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise CliError(f"{command}: {setting.path} is a number, not {text!r}") from None
        return value
    return text_value(setting, text, command)


def text_value(setting: Setting, text: str, command: str) -> str:
    """A text setting's value held to its choices and its own syntax (as stored), or a CliError
    saying what it takes."""
    if setting.choices and text not in setting.choices:
        raise CliError(f"{command}: {setting.path} is one of {', '.join(setting.choices)}, not {text!r}")
    if setting.check is not None:
        try:
            return setting.check(text)
        except ValueError as err:
            raise CliError(f"{command}: {setting.path}: {err}") from None
    return text


def parse_assignments(items: Iterable[str], command: str, *, changing: bool) -> list[Assignment]:
    """`SETTING=VALUE` items, each setting once. `changing`: of an existing deployment, whose
    loader and memory policy cannot change (another is another deployment)."""
    assignments: list[Assignment] = []
    seen: set[str] = set()
    for item in items:
        name, equals, text = item.partition("=")
        if not equals or not name.strip():
            raise CliError(f"{command}: expected SETTING=VALUE, got {item!r}")
        setting = setting_named(name.strip(), command)
        if setting.name in seen:
            raise CliError(f"{command}: {setting.path} given twice")
        seen.add(setting.name)
        if changing and setting.update is Update.REFUSED:
            raise CliError(
                f"{command}: {setting.path} cannot change: another loader or policy is another deployment "
                "(`gpuportal deploy` it under a new name)"
            )
        assignments.append(Assignment(setting, parse_value(setting, text, command)))
    return assignments


def body_of(assignments: Iterable[Assignment]) -> dict[str, Any]:
    """The REST body that gives these settings, each in its group."""
    body: dict[str, Any] = {}
    for setting, value in assignments:
        if setting.group:
            body.setdefault(setting.group, {})[setting.key] = value
        else:
            body[setting.key] = value
    return body


def current(deployment: Mapping[str, Any], setting: Setting) -> object:
    """The setting's value in a deployment as the API shows it; MISSING where it does not."""
    if setting.name == "replicas":
        return deployment.get("replicas_wanted", MISSING)  # "replicas" there lists the replicas themselves
    if not setting.group:
        return deployment.get(setting.key, MISSING)
    group = deployment.get(setting.group)
    return group.get(setting.key, MISSING) if isinstance(group, Mapping) else MISSING


def shown(value: object) -> str:
    if value is MISSING:
        return "?"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def set_settings(ctx: Operator, args: argparse.Namespace, assignments: list[Assignment]) -> dict[str, Any] | None:
    """Change the settings `assignments` name (each change said), or show them all (none named).
    The PATCH's answer when it changed the model (a rolling restart onto it began, unless nothing
    ran; the caller waits for it); None otherwise."""
    path = f"/api/deployments/{quote(args.name, safe='')}/"
    before = ctx.client.get(path)
    if not assignments:
        for setting in spec.SETTINGS:
            if (value := current(before, setting)) is not MISSING:
                ctx.out.print(f"{setting.path}={shown(value)}", markup=False, highlight=False)
        return None
    after = ctx.client.patch(path, body_of(assignments))
    lines, rolled = [], False
    for setting, _ in assignments:
        was, now = current(before, setting), current(after, setting)
        if shown(was) == shown(now):
            unchanged = shown(now) or '""'
            lines.append(f"{setting.path} {unchanged} (unchanged)")
            continue
        lines.append(change_said(setting, was, now))
        rolled = rolled or setting.update is Update.ROLLOUT
    ctx.out.print(f"{after['name']}: " + "; ".join(lines), markup=False, highlight=False)
    return after if rolled else None


def changed_text(path: str, before: object, after: object) -> str:
    """A setting's change as the commands say it: `sleep.idle_timeout_s 60 → 300`, an empty text
    (no node selector) said as "", not as nothing at all."""
    was, now = (shown(value) or '""' for value in (before, after))
    return f"{path} {was} → {now}"


def change_said(setting: Setting, before: object, after: object) -> str:
    """A change as `set`, `apply` and `rollback` say it, with what it does: `sleep.idle_timeout_s
    60 → 300 (applies at once)`."""
    return f"{changed_text(setting.path, before, after)} ({spec.patch_effect(setting)})"


def rolls(assignments: Iterable[Assignment]) -> bool:
    """Whether a change of these settings rolls every replica onto it (a new model)."""
    return any(assignment.setting.update is Update.ROLLOUT for assignment in assignments)


def add_set(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], run: Callable[[Any, argparse.Namespace], int]
) -> None:
    listed = "\n".join(
        f"  {s.path:<32} {spec.patch_effect(s)}" for s in spec.SETTINGS if s.update is not Update.REFUSED
    )
    command = commands.add_parser(
        "set",
        help="change a deployment's settings (SETTING=VALUE ...), or show them all",
        description="Change a deployment's settings, e.g. `gpuportal set tiny sleep.idle_timeout_s=60 "
        "popular=true`, or show them all (no SETTING=VALUE). A setting is named group.key as in the "
        "REST body, or by its key alone where that is unique; `null` clears a setting that may be "
        "null. docs/api.md describes each.",
        epilog=f"settings, and what a change does:\n{listed}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("name")
    command.add_argument("assignments", nargs="*", metavar="SETTING=VALUE")
    add_wait_options(command, "a new model is rolled onto every replica")
    command.set_defaults(run=run)
