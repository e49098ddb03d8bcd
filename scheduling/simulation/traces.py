"""Traces and catalogues from files: what `manage.py plan` and `POST /api/plan/` read and
`manage.py export_trace` writes. Pure: text in, dataclasses out.

A trace is CSV or JSON lines, one request a row:

    arrival,deployment,prompt_tokens,output_tokens
    2026-11-25T17:36:13.512Z,tiny-a,128,32
    2026-11-25T17:36:13.9+00:00,tiny-b,40,256

- CSV needs that header (in any order; other columns, such as `id` or `status`, are ignored);
  JSON lines are objects with the same keys. Blank lines are skipped in both.
- `arrival` is seconds (a number: since the epoch, or since any origin) or an ISO 8601 timestamp
  (`2026-11-25T17:36:13Z`, `2026-11-25 17:36:13.5+01:00`, `2026-11-25`; one with no offset is
  UTC). Only differences matter: the simulation starts at the first arrival. Rows need not be in
  order.
- `prompt_tokens` and `output_tokens` are whole numbers, at least 0 and at least 1.

A row that is not so, or that names a deployment the catalogue lacks, is a `RowError` with its
line number (1 is the first line of the file, the CSV header included); the callers refuse the
trace unless told to skip them (`--skip-bad`, `skip_bad`).

A catalogue is JSON (or TOML, by its file name): `{"deployments": [...]}` or the list alone, an
entry a deployment:

    {"name": "tiny-a", "size": "7B", "dtype": "bfloat16", "popular": true}
    {"name": "big", "weight_bytes": 141000000000, "need_bytes": 160000000000, "dedicated": true,
     "min_runtime_s": 10, "max_wait_s": 5, "idle_timeout_s": 300, "load_s": 70.5, "wake_s": 7.1}

- its model is one of `size` (a public model's shape: trace.SHAPES), `shape` (`params_b`,
  `layers`, `hidden`, `kv_heads`, `head_dim`, `intermediate`) or `weight_bytes`;
- `need_bytes` is what a replica reserves (the live portal's memory need); without it, the memory
  formula sizes it from the shape (a KV pool of `max_tokens`, by default the config's
  max_batch × context_tokens), or, from bytes alone, the weights plus the CUDA context;
- `dtype` (float32, float16, bfloat16; bfloat16 by default), `popular`, `dedicated`; the fairness
  and sleep settings `min_runtime_s`, `max_wait_s`, `idle_timeout_s` (0: never sleeps) and
  `slo_ttft_s`, each defaulting to the config's [serving] table; `load_s` and `wake_s`, the
  measured times of a cold load and a wake (otherwise bytes over the [hardware] speeds);
- `replicas` (1 by default) and `autoscale`, as a deployment's REST body has them:
  `{"max_replicas": 4, "min_replicas": 1, "target_in_flight": 4, "down_after_s": 300}`, each
  but max_replicas defaulting as a deployment's does (max_replicas 0: off);
- `node_selector` and `tolerations`, as a deployment's `placement` has them (`"team=a"`,
  `"team=a,dedicated"`): its replicas run only on the nodes they allow ([cluster] pools).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuportal.wire import deployment_spec, memory, node_labels
from scheduling.core import autoscale
from scheduling.simulation.config import Config
from scheduling.simulation.trace import SHAPES, Architecture, Deployment, Request, Trace, estimate_bytes

COLUMNS = ("arrival", "deployment", "prompt_tokens", "output_tokens")
MIN_DURATION_S = 1.0


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace file: when it arrived (seconds, on the file's own origin)."""

    line: int
    arrival_s: float
    deployment: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class RowError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class ParsedTrace:
    rows: tuple[TraceRow, ...]  # in arrival order
    errors: tuple[RowError, ...]  # in line order


class TraceFileError(ValueError):
    """A trace or catalogue that cannot be used as it is; `errors` says where and why."""

    def __init__(self, what: str, errors: Sequence[RowError | str]) -> None:
        self.what = what
        self.errors = tuple(errors)
        shown = "; ".join(str(e) for e in self.errors[:20])
        more = f"; and {len(self.errors) - 20} more" if len(self.errors) > 20 else ""
        super().__init__(f"{what}: {shown}{more}")


# --- traces ----------------------------------------------------------------------------------


def sniff_format(text: str, name: str = "") -> str:
    """ "jsonl" or "csv": by the file name's suffix, else by the first character that is not blank."""
    lowered = name.lower()
    if lowered.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if lowered.endswith(".csv"):
        return "csv"
    return "jsonl" if text.lstrip().startswith("{") else "csv"


def parse_trace(text: str, *, fmt: str | None = None, known: Collection[str] | None = None) -> ParsedTrace:
    """Every row of a trace file, and every row that is not a request (or names a deployment
    outside `known`, when given), with its line number. Never raises on bad content."""
    fmt = fmt or sniff_format(text)
    if fmt not in ("csv", "jsonl"):
        raise ValueError(f"unknown trace format {fmt!r}: expected csv or jsonl")
    raw = _csv_rows(text) if fmt == "csv" else _jsonl_rows(text)
    rows: list[TraceRow] = []
    errors: list[RowError] = []
    for line, fields in raw:
        if isinstance(fields, RowError):
            errors.append(fields)
            continue
        row = _row(line, fields)
        if isinstance(row, RowError):
            errors.append(row)
        elif known is not None and row.deployment not in known:
            errors.append(RowError(line, f"unknown deployment {row.deployment!r} (not in the catalogue)"))
        else:
            rows.append(row)
    rows.sort(key=lambda r: (r.arrival_s, r.line))
    return ParsedTrace(tuple(rows), tuple(errors))


def parse_arrival(value: Any) -> float:
    """Seconds from a number of seconds or an ISO 8601 timestamp (UTC when it names no offset)."""
    if isinstance(value, bool):
        raise ValueError(f"arrival {value!r} is neither seconds nor an ISO 8601 timestamp")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                stamp = datetime.fromisoformat(text)
            except ValueError:
                raise ValueError(f"arrival {text!r} is neither seconds nor an ISO 8601 timestamp") from None
            seconds = (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"arrival {value!r} is not a finite number of seconds")
    return seconds


def parse_since(text: str, now: datetime) -> datetime:
    """`7d`, `12h`, `30m`, `90s`, `2w` before `now`, or an ISO 8601 time (UTC when it names none)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if match:
        seconds = float(match[1]) * _UNITS[match[2]]
        if seconds > 100 * 365 * 86400:
            raise ValueError(f"{text!r} is further back than a century")
        return now - timedelta(seconds=seconds)
    try:
        stamp = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (7d, 12h, 30m) nor an ISO 8601 time") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def write_trace(rows: Iterable[TraceRow], out: io.TextIOBase | Any, *, fmt: str = "csv") -> int:
    """Rows as a trace file (arrival as an ISO 8601 UTC timestamp, to the microsecond); the count."""
    count = 0
    writer = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
    if writer is not None:
        writer.writerow(COLUMNS)
    for row in rows:
        arrival = datetime.fromtimestamp(row.arrival_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        values = (arrival, row.deployment, row.prompt_tokens, row.output_tokens)
        if writer is not None:
            writer.writerow(values)
        else:
            out.write(json.dumps(dict(zip(COLUMNS, values, strict=True))) + "\n")
        count += 1
    return count


def _csv_rows(text: str) -> Iterable[tuple[int, dict[str, Any] | RowError]]:
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if line.strip()), None)
    if header_at is None:
        return
    try:
        header = [h.strip() for h in next(csv.reader([lines[header_at]]))]
    except csv.Error as err:
        yield header_at + 1, RowError(header_at + 1, f"not a CSV header: {err}")
        return
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        yield header_at + 1, RowError(header_at + 1, f"the CSV header lacks {', '.join(missing)} (it has {header})")
        return
    for number, line in enumerate(lines[header_at + 1 :], start=header_at + 2):
        if not line.strip():
            continue
        try:
            cells = next(csv.reader([line]))
        except csv.Error as err:
            yield number, RowError(number, f"not a CSV row: {err}")
            continue
        if len(cells) < len(header):
            yield number, RowError(number, f"{len(cells)} fields, the header has {len(header)}")
            continue
        yield number, dict(zip(header, cells, strict=False))


def _jsonl_rows(text: str) -> Iterable[tuple[int, dict[str, Any] | RowError]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            yield number, RowError(number, f"not JSON: {err}")
            continue
        if not isinstance(value, dict):
            yield number, RowError(number, f"a JSON {type(value).__name__}, not an object")
            continue
        yield number, value


def _row(line: int, fields: Mapping[str, Any]) -> TraceRow | RowError:
    missing = [c for c in COLUMNS if fields.get(c) in (None, "")]
    if missing:
        return RowError(line, f"no {', '.join(missing)}")
    try:
        arrival = parse_arrival(fields["arrival"])
        prompt = _count(fields["prompt_tokens"], "prompt_tokens", least=0)
        output = _count(fields["output_tokens"], "output_tokens", least=1)
    except ValueError as err:
        return RowError(line, str(err))
    deployment = str(fields["deployment"]).strip()
    if not deployment:
        return RowError(line, "an empty deployment name")
    return TraceRow(line, arrival, deployment, prompt, output)


def _count(value: Any, name: str, *, least: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} {value!r} is not a whole number")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} {value!r} is not a whole number")
        value = int(value)
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("+").isdigit():
            raise ValueError(f"{name} {value!r} is not a whole number")
        value = int(text)
    if not isinstance(value, int):
        raise ValueError(f"{name} {value!r} is not a whole number")
    if value < least:
        raise ValueError(f"{name} {value} is below {least}")
    return value


# --- catalogues ------------------------------------------------------------------------------

_ENTRY_KEYS = {
    "name", "size", "shape", "weight_bytes", "need_bytes", "dtype", "max_tokens", "popular", "dedicated",
    "min_runtime_s", "max_wait_s", "idle_timeout_s", "slo_ttft_s", "load_s", "wake_s", "replicas", "autoscale",
    "node_selector", "tolerations",
}  # fmt: skip
_SHAPE_KEYS = ("params_b", "layers", "hidden", "kv_heads", "head_dim", "intermediate")
_SECONDS = ("min_runtime_s", "max_wait_s", "idle_timeout_s", "slo_ttft_s", "load_s", "wake_s")


@dataclass(frozen=True)
class CatalogueEntry:
    """A deployment as a catalogue describes it; `resolve` makes it the simulator's."""

    name: str
    dtype: str = "bfloat16"
    size: str | None = None
    shape: Architecture | None = None
    weight_bytes: int | None = None
    need_bytes: int | None = None
    max_tokens: int | None = None
    popular: bool = False
    dedicated: bool = False
    min_runtime_s: float | None = None
    max_wait_s: float | None = None
    idle_timeout_s: float | None = None
    slo_ttft_s: float | None = None
    load_s: float | None = None
    wake_s: float | None = None
    replicas: int = 1
    autoscale: autoscale.Policy | None = None
    # Its placement.node_selector and placement.tolerations, as a deployment stores them ("": none).
    node_selector: str = ""
    tolerations: str = ""

    def to_record(self) -> dict[str, Any]:
        """The entry as a catalogue file writes it (None and default values left out)."""
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype}
        if self.size is not None:
            out["size"] = self.size
        if self.shape is not None:
            out["shape"] = {k: getattr(self.shape, f) for k, f in zip(_SHAPE_KEYS, _SHAPE_FIELDS, strict=True)}
        for key in ("weight_bytes", "need_bytes", "max_tokens", *_SECONDS):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key in ("popular", "dedicated"):
            if getattr(self, key):
                out[key] = True
        if self.replicas != 1:
            out["replicas"] = self.replicas
        if self.autoscale is not None:
            out["autoscale"] = {setting.key: getattr(self.autoscale, setting.key) for setting in _AUTOSCALE}
        for key in ("node_selector", "tolerations"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


_SHAPE_FIELDS = ("params_b", "layers", "hidden", "kv_heads", "head_dim", "intermediate")


def parse_catalogue(text: str, *, name: str = "") -> tuple[CatalogueEntry, ...]:
    """A catalogue file's deployments; raises TraceFileError naming every bad entry."""
    try:
        data: Any = tomllib.loads(text) if name.lower().endswith(".toml") else json.loads(text)
    except ValueError as err:
        raise TraceFileError("the catalogue is not valid JSON or TOML", [str(err)]) from None
    return catalogue_from(data)


def catalogue_from(data: Any) -> tuple[CatalogueEntry, ...]:
    entries = data.get("deployments") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise TraceFileError("the catalogue", ["expected a list of deployments, or {'deployments': [...]}"])
    out: list[CatalogueEntry] = []
    errors: list[str] = []
    seen: set[str] = set()
    for i, raw in enumerate(entries, start=1):
        label = f"deployment #{i}" + (f" ({raw.get('name')})" if isinstance(raw, dict) and raw.get("name") else "")
        try:
            entry = _entry(raw)
        except (TypeError, ValueError) as err:
            errors.append(f"{label}: {err}")
            continue
        if entry.name in seen:
            errors.append(f"{label}: {entry.name!r} is listed twice")
            continue
        seen.add(entry.name)
        out.append(entry)
    if errors:
        raise TraceFileError("the catalogue", errors)
    return tuple(out)


def _entry(raw: Any) -> CatalogueEntry:
    if not isinstance(raw, dict):
        raise ValueError("not an object")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("no name")
    dtype = raw.get("dtype", "bfloat16")
    if not isinstance(dtype, str) or dtype not in memory.DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(memory.DTYPE_BYTES)}")
    models = [k for k in ("size", "shape", "weight_bytes") if raw.get(k) is not None]
    if len(models) != 1:
        raise ValueError("give its model as exactly one of size, shape or weight_bytes")
    size = raw.get("size")
    if size is not None and (not isinstance(size, str) or size not in SHAPES):
        raise ValueError(f"size {size!r} is not one of {list(SHAPES)}")
    shape = None
    if raw.get("shape") is not None:
        given = raw["shape"]
        if not isinstance(given, dict) or sorted(given) != sorted(_SHAPE_KEYS):
            raise ValueError(f"shape needs exactly {list(_SHAPE_KEYS)}")
        params_b = given["params_b"]
        if isinstance(params_b, bool) or not isinstance(params_b, int | float) or not 0 < params_b < 1e5:
            raise ValueError(f"shape.params_b must be billions of parameters above 0, got {params_b!r}")
        shape = Architecture(float(params_b), *(_positive_int(given[k], k) for k in _SHAPE_KEYS[1:]))
    seconds = {}
    for key in _SECONDS:
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a number of seconds >= 0, got {value!r}")
            seconds[key] = float(value)
    flags = {}
    for key in ("popular", "dedicated"):
        value = raw.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        flags[key] = value
    return CatalogueEntry(
        name=name.strip(),
        dtype=dtype,
        size=size,
        shape=shape,
        weight_bytes=_optional_int(raw, "weight_bytes"),
        need_bytes=_optional_int(raw, "need_bytes"),
        max_tokens=_optional_int(raw, "max_tokens"),
        **flags,
        **seconds,
        replicas=_replicas(raw.get("replicas", 1), "replicas"),
        autoscale=_autoscale(raw.get("autoscale")),
        **_placement(raw),
    )


def _placement(raw: Mapping[str, Any]) -> dict[str, str]:
    """node_selector and tolerations as a deployment stores them; ValueError naming a bad one."""
    out = {}
    for key, canonical in (
        ("node_selector", node_labels.canonical),
        ("tolerations", node_labels.canonical_tolerations),
    ):
        value = raw.get(key, "")
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string such as team=a,gpu=h100, got {value!r}")
        try:
            out[key] = canonical(value)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    return out


# The autoscale settings in their REST order; each one's default and bounds are the spec's.
_AUTOSCALE = deployment_spec.in_group("autoscale")
# A replica count's bound here, where the portal's is its GPUPORTAL_MAX_REPLICAS (32 by default):
# the simulator keeps an object per replica, and the oracle starts autoscale.max_replicas of each.
MAX_REPLICAS = 1024


def _replicas(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPLICAS:
        raise ValueError(f"{name} must be a whole number from 1 to {MAX_REPLICAS}, got {value!r}")
    return value


def _autoscale(raw: Any) -> autoscale.Policy | None:
    """A catalogue entry's `autoscale`, held to a deployment's bounds; None when off."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"autoscale must be an object of {[s.key for s in _AUTOSCALE]}, got {raw!r}")
    unknown = sorted(set(raw) - {setting.key for setting in _AUTOSCALE})
    if unknown:
        raise ValueError(f"autoscale: unknown keys {unknown}")
    values: dict[str, Any] = {}
    for setting in _AUTOSCALE:
        value = raw.get(setting.key, setting.default)
        number = int | float if setting.type is float else int
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            raise ValueError(f"autoscale.{setting.key} must be a {setting.type.__name__}, got {value!r}")
        most = MAX_REPLICAS if setting.type is int else setting.max
        if (setting.min is not None and value < setting.min) or (most is not None and value > most):
            raise ValueError(f"autoscale.{setting.key} must be from {setting.min:g} to {most:g}, got {value!r}")
        values[setting.name] = setting.type(value)
    problem = deployment_spec.autoscale_problem(values)
    if problem is not None:
        raise ValueError(f"{problem[0]} {problem[1]}")
    if not values["autoscale_max_replicas"]:
        return None
    return autoscale.Policy(**{setting.key: values[setting.name] for setting in _AUTOSCALE})


def _optional_int(raw: Mapping[str, Any], name: str) -> int | None:
    return None if raw.get(name) is None else _positive_int(raw[name], name)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a whole number above 0, got {value!r}")
    return value


def resolve(entry: CatalogueEntry, config: Config, rate_per_s: float) -> Deployment:
    """The simulator's deployment: its bytes from its shape or its own figures."""
    element = memory.dtype_bytes(entry.dtype)
    arch = SHAPES[entry.size] if entry.size is not None else entry.shape
    serving = config.serving
    if entry.max_tokens is not None:
        # The KV pool estimate_bytes sizes is max_batch × context_tokens: one batch of max_tokens.
        serving = _with_tokens(config, entry.max_tokens)
    if arch is not None:
        weights = int(arch.params_b * 1e9) * element
        need = entry.need_bytes or estimate_bytes(arch, entry.dtype, serving, config.hardware)
        params = arch.params_b * 1e9
    else:
        assert entry.weight_bytes is not None
        weights = entry.weight_bytes
        need = entry.need_bytes or weights + config.hardware.cuda_context_mib * memory.MiB
        params = weights / element
    return Deployment(
        name=entry.name,
        size=entry.size or (f"{arch.params_b:g}B" if arch is not None else f"{weights / 1e9:.1f} GB"),
        dtype=entry.dtype,
        weight_bytes=weights,
        estimate_bytes=need,
        rate_per_s=rate_per_s,
        popular=entry.popular,
        flops_per_token=2 * params,
        dedicated=entry.dedicated,
        min_runtime_s=entry.min_runtime_s,
        max_wait_s=entry.max_wait_s,
        idle_timeout_s=entry.idle_timeout_s,
        slo_ttft_s=entry.slo_ttft_s,
        load_s=entry.load_s,
        wake_s=entry.wake_s,
        replicas=entry.replicas,
        autoscale=entry.autoscale,
        node_selector=entry.node_selector,
        tolerations=entry.tolerations,
    )


def _with_tokens(config: Config, max_tokens: int) -> Any:
    from dataclasses import replace

    return replace(config.serving, max_batch=1, context_tokens=max_tokens)


def build_trace(rows: Sequence[TraceRow], catalogue: Sequence[CatalogueEntry], config: Config) -> Trace:
    """The simulator's trace: arrivals from the first one on, every catalogue deployment (those
    the trace never names too: they hold memory all the same), each one's rate from its rows."""
    origin = rows[0].arrival_s if rows else 0.0
    last = rows[-1].arrival_s - origin if rows else 0.0
    duration = max(MIN_DURATION_S, last)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.deployment] = counts.get(row.deployment, 0) + 1
    deployments = tuple(resolve(e, config, counts.get(e.name, 0) / duration) for e in catalogue)
    known = {d.name for d in deployments}
    requests = tuple(
        Request(i, r.deployment, r.arrival_s - origin, r.prompt_tokens, r.output_tokens)
        for i, r in enumerate(r for r in rows if r.deployment in known)
    )
    return Trace(deployments, requests, duration)
