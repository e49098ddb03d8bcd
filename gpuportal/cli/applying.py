"""`gpuportal apply -f FILE`: deployments declared in a file, made to match it, as `kubectl apply`
does: one the portal lacks is deployed; one it has gets the settings the file gives that differ
(one PATCH of those alone, so a new model rolls out and the rest applies as `gpuportal set` would);
one that matches is left alone. A setting the file leaves out stays as it is.

The file is YAML or JSON (JSON is YAML): a deployment in the REST body's shape (docs/api.md), a
list of them, or several YAML documents. A deployment as `gpuportal ls NAME -o yaml` (or `-o json`)
prints it is read back too: what the API shows beside the settings (its status, its replicas
listed, the memory it measured) is skipped, `replicas_wanted` read as `replicas`.

Every deployment of the file is read and checked (names, types) before the first call, so a
mistyped file changes nothing. The API checks bounds and models; a deployment it refuses stops
the apply there, and what was applied before it is said.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from gpuportal.cli import config, setting_values
from gpuportal.cli.client import CliError
from gpuportal.cli.setting_values import MISSING, Assignment
from gpuportal.wire import deployment_spec as spec
from gpuportal.wire.deployment_spec import Setting

# A deployment's fields in the API's answer that are not settings: skipped where a file holds one.
SHOWN_ONLY = frozenset(
    {"status", "failed_reason", "load_failures", "retry_at", "rollout", "created_at", "updated_at", "warnings"}
)
GROUPS = frozenset(setting.group for setting in spec.SETTINGS if setting.group)
READ_BACK_MARKS = frozenset({"created_at", "status", "replicas_wanted"})


@dataclass(frozen=True)
class Declared:
    """A deployment as the file declares it: its settings, and where in the file it is (errors)."""

    name: str
    settings: dict[str, object]  # by Setting.name
    where: str

    def body(self) -> dict[str, Any]:
        """The REST body that deploys it: its settings, each in its group."""
        given = (Assignment(spec.BY_NAME[name], value) for name, value in self.settings.items())
        return {"name": self.name, **setting_values.body_of(given)}


def documents(text: str, source: str) -> list[tuple[str, Any]]:
    """Each deployment object of the file, with where it is ("FILE: document 2, item 1")."""
    try:
        loaded = [document for document in yaml.safe_load_all(text) if document is not None]
    except yaml.YAMLError as err:
        raise CliError(f"apply: {source} is not YAML or JSON: {_said(err)}") from None
    found: list[tuple[str, Any]] = []
    for number, document in enumerate(loaded, 1):
        here = f"{source}" + (f": document {number}" if len(loaded) > 1 else "")
        if isinstance(document, list):
            found += [(f"{here}: item {index}", item) for index, item in enumerate(document, 1)]
        else:
            found.append((here, document))
    if not found:
        raise CliError(f"apply: {source} declares no deployment")
    return found


def _said(err: yaml.YAMLError) -> str:
    """What the parser says, and where: "line 3, column 7: expected ',' or ']'"."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(err).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def declared(where: str, document: Any) -> Declared:
    """The deployment a document declares, its values of the settings' types; a CliError naming
    what is wrong (where, and the setting by its place in the body)."""
    if not isinstance(document, Mapping):
        raise CliError(f"apply: {where}: a deployment is a mapping (name, model, ...), not {_kind(document)}")
    name = document.get("name")
    if not isinstance(name, str) or not name:
        raise CliError(f"apply: {where}: every deployment needs a name")
    where = f"{where} ({name})"
    read_back = bool(READ_BACK_MARKS & document.keys())
    settings: dict[str, object] = {}
    for key, value in document.items():
        if key == "name" or key in SHOWN_ONLY:
            continue
        if key == "replicas_wanted" or (key == "replicas" and isinstance(value, list) and read_back):
            # An answer read back lists its replicas under `replicas`; their count is replicas_wanted.
            if key == "replicas_wanted":
                settings["replicas"] = _checked(spec.BY_NAME["replicas"], value, where)
            continue
        if key in GROUPS:
            if not isinstance(value, Mapping):
                raise CliError(f"apply: {where}: {key} is a mapping of its settings, not {_kind(value)}")
            for inner, given in value.items():
                setting = spec.BY_PATH.get(f"{key}.{inner}")
                if setting is None:
                    if read_back:
                        continue  # what the answer shows of the group beside its settings (need_bytes, ...)
                    raise CliError(f"apply: {where}: no setting {key}.{inner}{_near(f'{key}.{inner}')}")
                settings[setting.name] = _checked(setting, given, where)
            continue
        setting = spec.BY_PATH.get(key)
        if setting is None:
            raise CliError(f"apply: {where}: no setting {key}{_near(key)}")
        settings[setting.name] = _checked(setting, value, where)
    if "source" not in settings:
        raise CliError(f"apply: {where}: model.source is required")
    settings["source"] = config.model_source(str(settings["source"]))
    return Declared(name, settings, where)


def _near(path: str) -> str:
    near = difflib.get_close_matches(path, [setting.path for setting in spec.SETTINGS], n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(near)}?" if near else " (docs/api.md lists the settings)"


def _kind(value: object) -> str:
    """What a YAML value is, in YAML's words."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true or false"
    kinds = {int: "a number", float: "a number", str: "text", list: "a list"}
    return kinds.get(type(value), type(value).__name__)


def _checked(setting: Setting, value: object, where: str) -> object:
    """`value` if it is of the setting's type (an int for a float too); a CliError otherwise.
    Bounds are the API's to check: its 400 names the setting."""
    if value is None:
        if setting.nullable:
            return None
        raise CliError(f"apply: {where}: {setting.path} cannot be null")
    if setting.type is bool:
        ok = isinstance(value, bool)
    elif setting.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif setting.type is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        wanted = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}[setting.type]
        raise CliError(f"apply: {where}: {setting.path} is {wanted}, not {value!r}")
    return setting_values.text_value(setting, value, f"apply: {where}") if isinstance(value, str) else value


def read_all(text: str, source: str) -> list[Declared]:
    """Every deployment of the file, checked, each name once."""
    found = [declared(where, document) for where, document in documents(text, source)]
    seen: dict[str, str] = {}
    for deployment in found:
        if deployment.name in seen:
            raise CliError(f"apply: {deployment.name} is declared twice ({seen[deployment.name]}, {deployment.where})")
        seen[deployment.name] = deployment.where
    return found


def differing(wanted: Declared, deployment: Mapping[str, Any]) -> list[Assignment]:
    """The settings the file gives that differ from the deployment's (the API's answer), in the
    spec's order. One the answer does not show (the memory policy, which cannot change) is not
    compared; one that cannot change (the loader) is given too: the API's 400 names it."""
    changed = []
    for setting in spec.SETTINGS:
        if setting.name in wanted.settings:
            now = setting_values.current(deployment, setting)
            if now is not MISSING and now != wanted.settings[setting.name]:
                changed.append(Assignment(setting, wanted.settings[setting.name]))
    return changed
