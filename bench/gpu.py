"""One-command GPU validation: what the 2026-11-24 findings measured by hand.

    python -m bench.gpu [--size-mb 512] [--dtypes float32,bfloat16] [--max-tokens 512]
                        [--parts tests,probe,stack] [--model-dir DIR] [--work-dir DIR] [--no-record]

On a machine with an NVIDIA GPU it runs three parts, one after the other (each measures memory that
the others would disturb):

- tests: `pytest -m gpu` over the test files that hold such tests, counting what passed, failed and
  was skipped (and why);
- probe: a random Llama written by `manage.py make_tiny_model`, loaded by the project's ReplicaHost
  in a process of its own on cuda:0 (bench.gpu_probe): NVML per-process bytes after load, after a
  prefill of max_tokens, after sleep and after wake; the allocator cap raising out-of-memory above
  it; wake GB/s against a pinned host-to-device copy timed in the same process; greedy paged output
  against transformers' generate, before and after a wake;
- stack: the whole portal under `manage.py up` with two deployments driven through the REST API
  (bench.gpu_stack): for each GPU, the occupants' reserved bytes against NVML's bytes of their
  processes, and available_bytes against NVML's free memory, after each step.

It prints one markdown table and records it in BENCHMARKS.md under "GPU validation (bench.gpu)".
It installs nothing. Where something is missing (torch's CUDA, NVML, Django, ...) it prints one line
per missing thing, still runs the parts that can run, marks the others "not run: <why>", and exits 2
without recording. Exit status: 0 every check held; 1 a check failed (the table is still recorded:
a failure on real hardware is a finding); 2 something was missing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_rows import Row, fmt_gbps, fmt_size, gbps, nvml_vs, ok_or_fail, percent, render
from bench.report import BENCHMARKS, ROOT, machine

PARTS = ("tests", "probe", "stack")
RECORD_NAME = "gpu"
RECORD_TITLE = "GPU validation (bench.gpu)"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_LACKING = 0, 1, 2
# Whole-part limits, so that a hung child cannot hold the machine: generous against the figures of
# 2026-11-24 (tests 18 s, a 4 GB probe under a minute, the stack a few minutes).
TESTS_TIMEOUT_S = 900
PROBE_TIMEOUT_S = 600
MODEL_TIMEOUT_S = 600
# The prefix of the probe's JSON lines on stdout (anything else there is a library's noise).
PROBE_PREFIX = "PROBE "

# Python modules each part imports, beyond torch: found with find_spec, so nothing heavy is imported
# here. The probe's replica imports redis (its request queue) even when it serves no queue.
PART_MODULES: Mapping[str, tuple[str, ...]] = {
    "tests": ("pytest", "pytest_django", "django"),
    "probe": ("transformers", "accelerate", "safetensors", "redis"),
    "stack": ("django", "celery", "rest_framework", "psycopg", "redis", "transformers", "accelerate"),
}


# -- checks and rows ---------------------------------------------------------------------------


def exit_status(rows: Iterable[Row], lacking: bool) -> int:
    if lacking:
        return EXIT_LACKING
    return EXIT_CHECK_FAILED if any(r.failed for r in rows) else EXIT_OK


# -- what this machine has ---------------------------------------------------------------------


@dataclass
class Environment:
    python: str
    torch: str | None = None  # version; None: not importable
    torch_cuda: str | None = None  # the CUDA version torch was built for; None: a CPU build
    cuda_devices: int = 0  # torch.cuda.device_count() where cuda is available
    nvml_gpus: list[dict[str, Any]] | None = None  # None: NVML unusable
    driver: str | None = None
    missing_modules: list[str] = field(default_factory=list)
    # One line per missing thing, for people; empty: everything any part needs is here.
    lacks: list[str] = field(default_factory=list)


def detect() -> Environment:
    """What this machine offers the three parts. Never creates a CUDA context: this process stays
    alive during the stack part, and a context of its own (~0.5 GB) would sit in NVML's figures."""
    env = Environment(python=".".join(map(str, sys.version_info[:3])))
    try:
        import torch
    except Exception as exc:  # ImportError, or OSError from a broken install's shared libraries
        env.lacks.append(f"torch not importable: {exc}; the tests, probe and stack parts need it")
    else:
        env.torch, env.torch_cuda = torch.__version__, torch.version.cuda
        # is_available() and device_count() ask the driver how many devices there are; neither
        # creates a context (torch initialises CUDA lazily, on the first allocation).
        if torch.cuda.is_available():
            env.cuda_devices = torch.cuda.device_count()
        else:
            build = "" if env.torch_cuda else " (a CPU-only build)"
            env.lacks.append(f"no CUDA device: torch {env.torch} reports cuda unavailable{build}")
    env.nvml_gpus, env.driver, nvml_problem = nvml_inventory()
    if nvml_problem:
        env.lacks.append(f"nvidia-ml-py: {nvml_problem}")
    needed = sorted({m for mods in PART_MODULES.values() for m in mods})
    env.missing_modules = [m for m in needed if importlib.util.find_spec(m) is None]
    wheels = f"carry py{sys.version_info.major}.{sys.version_info.minor} wheels"
    for module in env.missing_modules:
        parts = [p for p, mods in PART_MODULES.items() if module in mods]
        if module == "django":
            env.lacks.append(f"django not importable: the stack part needs the project's dependencies; {wheels}")
        else:
            env.lacks.append(f"{module} not importable: the {' and '.join(parts)} part(s) need it; {wheels}")
    return env


def nvml_inventory() -> tuple[list[dict[str, Any]] | None, str | None, str | None]:
    """(GPUs, driver version, why NVML is unusable): each GPU's index, name and NVML memory."""
    try:
        import pynvml
    except ImportError:
        return None, None, "not installed (the pynvml module); per-process GPU memory cannot be measured"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, no permission
        return None, None, f"NVML cannot start: {exc}"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)), "total": int(memory.total)})
    except Exception as exc:
        return None, None, f"NVML started but could not list the GPUs: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    if not gpus:
        return None, driver, "NVML finds no GPU"
    return gpus, driver, None


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else value


def blockers(env: Environment, *, model_given: bool) -> dict[str, list[str]]:
    """Why each part cannot run here (empty: it can). Pure, from `detect`'s findings."""
    cuda = [] if env.cuda_devices else ["no CUDA device"]
    nvml = [] if env.nvml_gpus else ["no NVML"]
    out: dict[str, list[str]] = {}
    for part, modules in PART_MODULES.items():
        reasons = ["torch not importable"] if env.torch is None else list(cuda)
        # The gpu tests skip themselves where NVML finds no GPU; the stack's agent registers its
        # GPUs through NVML and the books are compared with it. The probe reports NVML's figures
        # as unverified without it, so it can still run.
        if part in ("tests", "stack"):
            reasons += nvml
        reasons += [f"{m} not importable" for m in modules if m in env.missing_modules]
        if part in ("probe", "stack") and not model_given and "django" in env.missing_modules:
            reasons.append("django not importable to write the model with make_tiny_model (or pass --model-dir)")
        out[part] = list(dict.fromkeys(reasons))
    return out


# -- part 1: the gpu-marked tests --------------------------------------------------------------


@dataclass
class TestCounts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (test, first line of why)
    skips: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{self.passed} passed", f"{self.failed} failed", f"{self.skipped} skipped"]
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)


def parse_junit(text: str) -> TestCounts:
    """Counts from pytest's --junitxml report, testcase by testcase (deselected tests are absent)."""
    counts = TestCounts()
    for case in ET.fromstring(text).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None:
            counts.failed += 1
            counts.failures.append((name, _first_line(failure.get("message") or failure.text)))
        elif error is not None:
            counts.errors += 1
            counts.failures.append((name, _first_line(error.get("message") or error.text)))
        elif skipped is not None:
            counts.skipped += 1
            counts.skips.append((name, _first_line(skipped.get("message") or skipped.text)))
        else:
            counts.passed += 1
    return counts


def _first_line(text: str | None, limit: int = 200) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def tests_rows(counts: TestCounts | None, returncode: int, tail: str) -> list[Row]:
    if counts is None:
        return [
            Row("tests", "pytest -m gpu", f"exit {returncode}, no report", f"FAIL: {tail or 'pytest wrote no report'}")
        ]
    total = counts.passed + counts.failed + counts.errors + counts.skipped
    if total == 0:
        check = "FAIL: no gpu-marked test was collected"
    elif counts.passed == 0 and not counts.failures:
        check = "FAIL: every gpu-marked test was skipped"
    else:
        check = ok_or_fail(not counts.failures, ", ".join(n.rsplit("::", 1)[-1] for n, _ in counts.failures))
    rows = [Row("tests", "pytest -m gpu", counts.summary(), check)]
    rows += [Row("tests", f"failed: {name}", why, "FAIL") for name, why in counts.failures]
    rows += [Row("tests", f"skipped: {name}", why) for name, why in counts.skips]
    return rows


# A test the `gpu` marker selects, as its decorator reads in a test file.
GPU_MARK = re.compile(r"^\s*@pytest\.mark\.gpu\b", re.MULTILINE)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files holding a `gpu`-marked test, relative to `root`. pytest is given these alone:
    collecting every file would import what only other tests use (a browser driver, a schema
    fuzzer), which a GPU machine need not carry."""
    files = (root / "tests").rglob("test_*.py")
    return sorted(str(f.relative_to(root)) for f in files if GPU_MARK.search(f.read_text()))


def run_tests(work: Path) -> tuple[list[Row], dict[str, Any]]:
    report = work / "gpu-tests.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    argv += gpu_test_files()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return [Row("tests", "pytest -m gpu", "", f"FAIL: did not finish in {TESTS_TIMEOUT_S} s")], {}
    (work / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    counts = parse_junit(report.read_text()) if report.exists() else None
    raw = {"returncode": proc.returncode, "counts": asdict(counts) if counts else None}
    return tests_rows(counts, proc.returncode, _last_line(proc.stdout + proc.stderr)), raw


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# -- the model ---------------------------------------------------------------------------------


def write_model(path: Path, size_mb: float) -> None:
    """`manage.py make_tiny_model`: the project's own writer, in a child (it imports torch and Django)."""
    argv = [sys.executable, "manage.py", "make_tiny_model", str(path), "--size-mb", str(size_mb), "--force"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=MODEL_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"make_tiny_model failed: {_last_line(proc.stderr or proc.stdout)}")


def describe_model(path: Path) -> dict[str, Any]:
    """What the table says of the checkpoint: its config's shape and its safetensors' bytes on disk."""
    config = json.loads((path / "config.json").read_text())
    return {
        "path": str(path),
        "layers": config.get("num_hidden_layers"),
        "hidden": config.get("hidden_size"),
        "intermediate": config.get("intermediate_size"),
        "vocab": config.get("vocab_size"),
        "file_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
    }


def model_row(model: Mapping[str, Any], seconds: float | None) -> Row:
    written = f", written in {seconds:.1f} s" if seconds is not None else ""
    figure = (
        f"random Llama, {model.get('layers')} layers, hidden {model.get('hidden')}, "
        f"{fmt_size(model.get('file_bytes'))} of float32 safetensors{written}"
    )
    return Row("model", "make_tiny_model", figure)


# -- part 2: the probe -------------------------------------------------------------------------


def parse_probe_output(stdout: str) -> dict[str, Any]:
    """bench.gpu_probe's `PROBE {json}` lines, merged by tag; `cycle` records are kept in order."""
    result: dict[str, Any] = {"cycles": []}
    for line in stdout.splitlines():
        if not line.startswith(PROBE_PREFIX):
            continue
        try:
            record = json.loads(line[len(PROBE_PREFIX) :])
        except ValueError:
            continue
        tag = record.pop("tag", None)
        if tag == "cycle":
            result["cycles"].append(record)
        elif tag:
            result[tag] = record
    return result


def run_probe(model_dir: Path, dtype: str, max_tokens: int, work: Path, gpu: int) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "bench.gpu_probe", "--model-dir", str(model_dir), "--dtype", dtype,
        "--max-tokens", str(max_tokens), "--gpu", str(gpu),
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        result = parse_probe_output(_decoded(exc.stdout))
        result["error"] = {"step": "timeout", "error": f"did not finish in {PROBE_TIMEOUT_S} s"}
        return result
    (work / f"probe-{dtype}.log").write_text(proc.stderr)
    result = parse_probe_output(proc.stdout)
    if proc.returncode != 0 and "error" not in result:
        result["error"] = {"step": "exit", "error": f"exit {proc.returncode}: {_last_line(proc.stderr)}"}
    return result


def _decoded(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _kv_capacity(kv: Mapping[str, Any] | None) -> int | None:
    if not kv or kv.get("blocks_total") is None or kv.get("block_tokens") is None:
        return None
    return int(kv["blocks_total"]) * int(kv["block_tokens"])


def _kv_row(part: str, what: str, kv: Mapping[str, Any] | None, max_tokens: int) -> Row:
    capacity = _kv_capacity(kv)
    if capacity is None:
        return Row(part, what, "no KV pool reported", "FAIL: no KV pool")
    assert kv is not None
    figure = f"{kv['blocks_total']} blocks × {kv['block_tokens']} tokens = {capacity} tokens"
    return Row(part, what, figure, ok_or_fail(capacity >= max_tokens, f"below max_tokens {max_tokens}"))


def _greedy_row(part: str, what: str, gen: Mapping[str, Any] | None) -> Row:
    if not gen:
        return Row(part, what, "not measured", "FAIL: no result")
    if gen.get("error"):
        return Row(part, what, gen["error"], "FAIL: generation raised")
    paged, reference = gen.get("paged"), gen.get("reference")
    n = len(paged or [])
    if paged == reference:
        return Row(part, what, f"{n} tokens, equal", "ok")
    first = next((i for i, (a, b) in enumerate(zip(paged or [], reference or [], strict=False)) if a != b), None)
    at = f"first difference at token {first}" if first is not None else "lengths differ"
    return Row(part, what, f"{n} vs {len(reference or [])} tokens, {at}", "FAIL: paged output differs")


def probe_rows(result: Mapping[str, Any], dtype: str, max_tokens: int) -> list[Row]:
    """The probe's records (parse_probe_output) as table rows. Pure: the unit tests feed plain dicts."""
    part = f"probe {dtype}"
    reserved = (result.get("setup") or {}).get("reservation_bytes")
    rows = [
        *_setup_rows(part, result.get("setup") or {}),
        *_load_rows(part, result.get("load") or {}, reserved, max_tokens),
        _greedy_row(part, "greedy paged = transformers generate", result.get("generate")),
        *_prefill_and_cap_rows(part, result.get("prefill"), result.get("cap"), reserved),
    ]
    bandwidth = result.get("bandwidth") or {}
    if bandwidth:
        rows.append(
            Row(
                part,
                f"host→device copy, {fmt_size(bandwidth.get('nbytes'))}",
                f"pinned {fmt_gbps(bandwidth.get('pinned_gbps'))}, pageable {fmt_gbps(bandwidth.get('pageable_gbps'))}",
            )
        )
    for cycle in result.get("cycles") or []:
        rows += _cycle_rows(part, cycle, result.get("load") or {}, reserved, bandwidth.get("pinned_gbps"), max_tokens)
    if result.get("cycles"):
        rows.append(_greedy_row(part, "greedy after the wakes = before", result.get("generate_after_wake")))
    error = result.get("error")
    if error:
        rows.append(
            Row(
                part,
                f"probe stopped at {error.get('step')}",
                _first_line(error.get("error"), 300),
                "FAIL: the probe raised",
            )
        )
    return rows


def _setup_rows(part: str, setup: Mapping[str, Any]) -> list[Row]:
    if not setup:
        return []
    est = setup.get("estimate") or {}
    named = [(k, v) for k, v in est.items() if k.endswith("_bytes") and k != "total_bytes" and v]
    parts = ", ".join(f"{k.removesuffix('_bytes')} {fmt_size(v)}" for k, v in named)
    context = f"{fmt_size(setup.get('context_bare_bytes'))} (assumed {fmt_size(setup.get('context_assumed_bytes'))})"
    reservation = f"{fmt_size(setup.get('reservation_bytes'))}: {parts}"
    return [
        Row(part, "reservation (gpuportal.wire.memory.estimate)", reservation),
        Row(part, "CUDA context, before any load", context),
    ]


def _load_rows(part: str, load: Mapping[str, Any], reserved: int | None, max_tokens: int) -> list[Row]:
    if not load:
        return []
    figure, check = nvml_vs(load.get("nvml_bytes"), reserved, "NVML")
    rows = [Row(part, f"load ({load.get('seconds', 0):.2f} s): NVML process bytes", figure, check)]
    serving = load.get("event") or {}
    if serving.get("need_bytes") is not None:
        footprint = serving.get("footprint") or {}
        figure = f"{fmt_size(serving['need_bytes'])}, context counted {fmt_size(footprint.get('context_bytes'))}"
        if serving.get("context_measured_bytes") is not None:
            figure += f", measured {fmt_size(serving['context_measured_bytes'])}"
        rows.append(Row(part, "replica's measured need (serving event)", figure))
    rows.append(_kv_row(part, "KV pool after load", serving.get("kv"), max_tokens))
    return rows


def _prefill_and_cap_rows(part: str, prefill: Any, cap: Any, reserved: int | None) -> list[Row]:
    rows: list[Row] = []
    if prefill:
        if prefill.get("error"):
            rows.append(Row(part, "prefill at max_tokens", prefill["error"], "FAIL: prefill raised"))
        else:
            figure, check = nvml_vs(prefill.get("nvml_bytes"), reserved, "NVML")
            peak = f"; allocator peak {fmt_size(prefill.get('peak_reserved_bytes'))}"
            rows.append(
                Row(part, f"after a prefill of {prefill.get('prompt_tokens')} tokens: NVML", figure + peak, check)
            )
    if cap:
        held = cap.get("over") == "oom" and cap.get("under") == "ok"
        why = "allocated past the cap" if cap.get("over") != "oom" else f"under the cap: {cap.get('under')}"
        margin = fmt_size(cap.get("margin_bytes"))
        limit = fmt_size(cap.get("limit_bytes"))
        figure = (
            f"fraction {cap.get('fraction')} → {limit}; +{margin}: {cap.get('over')}, −{margin}: {cap.get('under')}"
        )
        rows.append(Row(part, "allocator cap", figure, ok_or_fail(held, why)))
        if cap.get("nvml_at_cap_bytes") is not None:
            at_cap, check = nvml_vs(cap.get("nvml_at_cap_bytes"), reserved, "allocator at its cap + context")
            rows.append(Row(part, "NVML with the allocator at its cap", at_cap, check))
    return rows


def _cycle_rows(
    part: str,
    cycle: Mapping[str, Any],
    load: Mapping[str, Any],
    reserved: int | None,
    pinned: float | None,
    max_tokens: int,
) -> list[Row]:
    n = cycle.get("n")
    loaded_nvml, weights = load.get("nvml_bytes"), load.get("weights_bytes")
    left = cycle.get("nvml_after_sleep_bytes")
    allocator = cycle.get("allocator_after_sleep_bytes")
    if left is None:
        check = "unverified: no NVML figure"
    elif not weights:
        check = ""
    elif allocator is not None:
        # NVML's figure is the context too, which grows as the process loads kernels (610 MiB at
        # the load, 780 MiB asleep on the H100 of 2026-11-26): the allocator's says whether the weights went.
        check = ok_or_fail(allocator <= 0.1 * weights, f"the allocator still holds {fmt_size(allocator)}")
    elif loaded_nvml is None:
        check = ""
    else:
        check = ok_or_fail(left <= loaded_nvml - 0.9 * weights, "the weights were not freed")
    wake_rate = gbps(weights or 0, cycle.get("wake_s"))
    # The wake's own reservation: the need plus what the context grew by (gpu_probe.wake_reservation).
    woke_into = cycle.get("reserved_bytes") or reserved
    nvml_figure, nvml_check = nvml_vs(cycle.get("nvml_after_wake_bytes"), woke_into, "NVML")
    rows = [
        Row(
            part,
            f"sleep {n} ({cycle.get('sleep_s', 0):.3f} s): NVML left",
            fmt_size(left) + (f" (allocator {fmt_size(allocator)})" if allocator is not None else ""),
            check,
        ),
        Row(
            part,
            f"wake {n}",
            f"{cycle.get('wake_s', 0):.3f} s, {fmt_gbps(wake_rate)} ({percent(wake_rate, pinned)} of pinned)",
        ),
        Row(part, f"wake {n}: NVML process bytes", nvml_figure, nvml_check),
        _kv_row(part, f"wake {n}: KV pool", (cycle.get("event") or {}).get("kv"), max_tokens),
    ]
    if cycle.get("rss_bytes") is not None:
        rows.append(Row(part, f"wake {n}: host RSS of the process", fmt_size(cycle["rss_bytes"])))
    return rows


# -- recording -----------------------------------------------------------------------------------


def upsert_section(text: str, name: str, title: str, section_body: str, run_line: str) -> str:
    """BENCHMARKS.md with this benchmark's section replaced, or appended when it has none.

    The section is the one bench.report.record writes (between `<!-- bench:name -->` markers); a
    `## title` heading written without the markers (by hand) is replaced up to the next heading.
    """
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n## {title}\n\n{run_line}\n\n{section_body.strip()}\n{end}"
    marked = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if marked.search(text):
        return marked.sub(lambda _: section, text)
    bare = re.compile(r"^## " + re.escape(title) + r"[ \t]*\n.*?(?=^## |^<!-- bench:|\Z)", re.DOTALL | re.MULTILINE)
    if bare.search(text):
        return bare.sub(lambda _: section + "\n\n", text, count=1).rstrip() + "\n"
    return text.rstrip() + "\n\n" + section + "\n"


def record(body: str) -> None:
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n\nRecorded by the scripts in `bench/`.\n"
    run_line = f"_Run {dt.date.today().isoformat()} on {machine()}._"
    BENCHMARKS.write_text(upsert_section(text, RECORD_NAME, RECORD_TITLE, body, run_line))


def code_version() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def header(env: Environment, args: argparse.Namespace) -> str:
    gpus = ", ".join(f"{g['name']} ({fmt_size(g['total'])})" for g in env.nvml_gpus or []) or "none found"
    return "\n".join(
        [
            f"GPUs: {gpus}; driver {env.driver or 'n/a'}; torch {env.torch or 'n/a'} "
            f"(CUDA {env.torch_cuda or 'none'}); Python {env.python}; code {code_version()}.",
            f"Model: make_tiny_model --size-mb {args.size_mb:g}, probed in {', '.join(args.dtypes)}; "
            f"max_tokens {args.max_tokens}. Figures are one run each; checks: ok, FAIL, unverified (no NVML figure).",
        ]
    )


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=512.0, help="Weights of the random Llama, MiB (default 512).")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="Dtypes the probe loads the model in.")
    parser.add_argument("--max-tokens", type=int, default=512, help="The deployments' memory.max_tokens.")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated, of {', '.join(PARTS)}.")
    parser.add_argument("--gpu", type=int, default=0, help="The GPU the probe runs on (default 0).")
    parser.add_argument("--model-dir", default=None, help="Use this checkpoint instead of writing one.")
    parser.add_argument("--work-dir", default=None, help="Keep logs and raw results here (default: a temp dir).")
    parser.add_argument("--no-record", action="store_true", help="Print the table; leave BENCHMARKS.md alone.")
    parser.add_argument(
        "--virtual-stack",
        action="store_true",
        help="Run the stack part on virtual GPUs (up --virtual-gpus) to check the driver where there is no "
        "GPU: nothing is compared with NVML, and nothing is recorded.",
    )
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    bad = sorted(set(args.dtypes) - {"float32", "float16", "bfloat16"})
    if bad or not args.dtypes:
        parser.error(f"--dtypes must name float32, float16 or bfloat16, got {args.dtypes}")
    if not args.size_mb > 0 or args.max_tokens < 1:
        parser.error("--size-mb and --max-tokens must be positive")
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} holds no config.json (write one with manage.py make_tiny_model)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = detect()
    for line in env.lacks:
        print(f"bench.gpu: {line}", file=sys.stderr, flush=True)
    blocked = blockers(env, model_given=args.model_dir is not None)
    if args.virtual_stack:
        # Virtual GPUs need neither CUDA nor NVML: only the project's dependencies.
        blocked["stack"] = [r for r in blocked["stack"] if r not in ("no CUDA device", "no NVML")]
    runnable = [p for p in args.parts if not blocked[p]]
    # Absolute: the children run in the repository root, and write their reports here.
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="gpuportal-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = [Row(p, "", "", f"not run: {'; '.join(blocked[p])}") for p in args.parts if blocked[p]]
    raw: dict[str, Any] = {"environment": asdict(env), "args": dict(vars(args))}
    model_tmp: Path | None = None
    try:
        if "tests" in runnable:
            print("bench.gpu: tests: pytest -m gpu", file=sys.stderr, flush=True)
            test_rows, raw["tests"] = run_tests(work)
            rows += test_rows
        model_dir, model_tmp, runnable = prepare_model(args, runnable, rows, raw)
        if model_dir is not None:
            rows += run_model_parts(args, runnable, model_dir, work, raw)
    finally:
        if model_tmp is not None:
            shutil.rmtree(model_tmp, ignore_errors=True)
        (work / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
    return conclude(env, args, rows, any(blocked[p] for p in args.parts), work)


def prepare_model(
    args: argparse.Namespace, runnable: list[str], rows: list[Row], raw: dict[str, Any]
) -> tuple[Path | None, Path | None, list[str]]:
    """(the model the probe and the stack run, the temporary one written for them or None, the
    parts still runnable): the one given, or a random Llama written for the run."""
    model_dir = Path(args.model_dir).resolve() if args.model_dir else None
    if not {"probe", "stack"} & set(runnable):
        return model_dir, None, runnable
    if model_dir is not None:
        raw["model"] = describe_model(model_dir)
        rows.append(model_row(raw["model"], None))
        return model_dir, None, runnable
    # Outside the work dir: a kept work dir (say, a device's output folder) gets no checkpoint.
    model_tmp = Path(tempfile.mkdtemp(prefix="gpuportal-bench-gpu-model-"))
    print(f"bench.gpu: writing a {args.size_mb:g} MiB random Llama", file=sys.stderr, flush=True)
    began = time.monotonic()
    try:
        write_model(model_tmp, args.size_mb)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        rows.append(Row("model", "make_tiny_model", "", f"FAIL: {exc}"))
        return None, model_tmp, [p for p in runnable if p == "tests"]
    raw["model"] = describe_model(model_tmp)
    rows.append(model_row(raw["model"], time.monotonic() - began))
    return model_tmp, model_tmp, runnable


def run_model_parts(
    args: argparse.Namespace, runnable: list[str], model_dir: Path, work: Path, raw: dict[str, Any]
) -> list[Row]:
    """The probe (per dtype) and the stack, on `model_dir`."""
    rows: list[Row] = []
    if "probe" in runnable:
        raw["probe"] = {}
        for dtype in args.dtypes:
            print(f"bench.gpu: probe: {dtype}", file=sys.stderr, flush=True)
            result = run_probe(model_dir, dtype, args.max_tokens, work, args.gpu)
            raw["probe"][dtype] = result
            rows += probe_rows(result, dtype, args.max_tokens)
    if "stack" in runnable:
        from bench import gpu_stack

        print("bench.gpu: stack: manage.py up, two deployments", file=sys.stderr, flush=True)
        deployments = [("a", args.dtypes[0]), ("b", args.dtypes[1] if len(args.dtypes) > 1 else args.dtypes[0])]
        result = gpu_stack.run_stack(
            model_dir=model_dir,
            deployments=deployments,
            max_tokens=args.max_tokens,
            work=work,
            virtual=args.virtual_stack,
        )
        raw["stack"] = result
        rows += gpu_stack.stack_rows(result)
    return rows


def conclude(env: Environment, args: argparse.Namespace, rows: list[Row], blocked: bool, work: Path) -> int:
    """Print the table, record it where the run was whole on a real GPU, and say where the logs are."""
    text = render(rows)
    print(header(env, args))
    print()
    print(text)
    lacking = bool(env.lacks) or blocked
    status = exit_status(rows, lacking)
    if lacking:
        print("\nbench.gpu: not recorded: this machine lacks what the parts marked 'not run' need", file=sys.stderr)
    elif args.virtual_stack:
        print("\nbench.gpu: not recorded: --virtual-stack checks the driver, not a GPU", file=sys.stderr)
    elif set(args.parts) != set(PARTS):
        print(f"\nbench.gpu: not recorded: only {', '.join(args.parts)} ran", file=sys.stderr)
    elif args.no_record:
        print("\nbench.gpu: not recorded (--no-record)", file=sys.stderr)
    else:
        record(header(env, args) + "\n\n" + text)
        print(f"\nbench.gpu: recorded in {BENCHMARKS.name}", file=sys.stderr)
    if args.work_dir or any(r.failed for r in rows):
        print(f"bench.gpu: logs and raw results in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
