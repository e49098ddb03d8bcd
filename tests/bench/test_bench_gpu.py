"""bench.gpu: on a machine without a GPU it says what it lacks and records nothing;
its pure parts (table, GB/s, the books against NVML, the probe's rows, BENCHMARKS.md's section) are
checked here with plain numbers, since CI never has a GPU to produce real ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu
from bench.gpu import Environment, Row
from bench.gpu_stack import Books, NvmlGpu, compare_books, kv_row, registration

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2
GiB = 1024**3


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# -- the command on this machine ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(_cuda_available(), reason="with CUDA, bench.gpu runs for minutes and records its figures")
def test_without_a_gpu_it_names_what_it_lacks_exits_2_and_leaves_benchmarks_alone():
    before = (ROOT / "BENCHMARKS.md").read_bytes()

    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )

    assert result.returncode == 2, result.stdout + result.stderr
    lacks = [line for line in result.stderr.splitlines() if line.startswith("bench.gpu: ")]
    assert any(line.startswith("bench.gpu: no CUDA device: torch ") and "cuda unavailable" in line for line in lacks)
    _gpus, _driver, nvml_problem = gpu.nvml_inventory()
    if nvml_problem:
        assert f"bench.gpu: nvidia-ml-py: {nvml_problem}" in lacks
    # Every part is in the table, each saying why it did not run.
    for part in ("tests", "probe", "stack"):
        assert any(
            line.startswith(f"| {part} ") and "not run: no CUDA device" in line for line in result.stdout.splitlines()
        ), result.stdout
    assert "not recorded" in result.stderr
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before


def test_a_missing_django_is_named_with_what_to_carry(monkeypatch):
    # None in sys.modules makes find_spec report the module missing, as on a bare GPU machine.
    monkeypatch.setitem(sys.modules, "django", None)

    env = gpu.detect()

    major, minor = sys.version_info[:2]
    assert (
        f"django not importable: the stack part needs the project's dependencies; carry py{major}.{minor} wheels"
        in env.lacks
    )
    assert "django not importable" in gpu.blockers(env, model_given=True)["stack"]


def test_the_options_default_to_a_small_model_and_reject_nonsense():
    args = gpu.parse_args([])
    assert args.size_mb == 512 and args.parts == ["tests", "probe", "stack"] and not args.no_record
    assert gpu.parse_args(["--no-record", "--size-mb", "64", "--dtypes", "bfloat16"]).dtypes == ["bfloat16"]
    for bad in (["--size-mb", "0"], ["--parts", "tests,gpu"], ["--dtypes", "int8"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)


# -- a whole run, its parts replaced by canned results --------------------------------------------


@pytest.fixture
def canned(monkeypatch, tmp_path):
    """bench.gpu.main on a pretend GPU machine: every part returns figures given here, and
    BENCHMARKS.md is a file of this test's own."""
    from bench import gpu_stack

    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text(DOC)
    monkeypatch.setattr(gpu, "BENCHMARKS", benchmarks)
    monkeypatch.setattr(gpu, "detect", lambda: _env())

    def write_model(path: Path, size_mb: float) -> None:
        (path / "config.json").write_text('{"num_hidden_layers": 4, "hidden_size": 2304}')

    probe = {"result": _probe_result()}
    monkeypatch.setattr(gpu, "write_model", write_model)
    monkeypatch.setattr(gpu, "run_tests", lambda work: ([Row("tests", "pytest -m gpu", "2 passed", "ok")], {}))
    monkeypatch.setattr(gpu, "run_probe", lambda *args: probe["result"])
    monkeypatch.setattr(gpu_stack, "run_stack", lambda **kw: {"rows": [vars(Row("stack", "up", "ready", "ok"))]})
    return benchmarks, probe


@pytest.mark.slow
def test_a_complete_run_records_one_section_and_exits_by_its_checks(canned, tmp_path):
    benchmarks, probe = canned

    assert gpu.main(["--work-dir", str(tmp_path / "w1")]) == 0
    first = benchmarks.read_text()
    assert first.count("## GPU validation (bench.gpu)") == 1 and "| stack          | up " in first
    assert "Old pool figures." in first and (tmp_path / "w1" / "raw.json").exists()

    probe["result"] = _probe_result(cap={"over": "allocated", "under": "ok"})
    assert gpu.main(["--work-dir", str(tmp_path / "w2")]) == 1
    second = benchmarks.read_text()
    assert second.count("## GPU validation (bench.gpu)") == 1 and "FAIL: allocated past the cap" in second


@pytest.mark.slow
def test_no_record_and_a_partial_run_leave_benchmarks_alone(canned, tmp_path):
    benchmarks, _ = canned

    assert gpu.main(["--no-record", "--work-dir", str(tmp_path / "w1")]) == 0
    assert gpu.main(["--parts", "tests,probe", "--work-dir", str(tmp_path / "w2")]) == 0
    assert benchmarks.read_text() == DOC


# -- which part can run where ------------------------------------------------------------------------


def _env(**overrides) -> Environment:
    full = {"python": "3.12.3", "torch": "2.11.0", "torch_cuda": "13.0", "cuda_devices": 1}
    full["nvml_gpus"] = [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "total": 85_520_809_984}]
    return Environment(**{**full, **overrides})


def test_every_part_runs_on_a_gpu_machine_with_the_dependencies():
    assert gpu.blockers(_env(), model_given=False) == {"tests": [], "probe": [], "stack": []}


def test_without_cuda_no_part_runs_and_without_nvml_only_the_probe_does():
    no_cuda = gpu.blockers(_env(cuda_devices=0, nvml_gpus=None), model_given=False)
    assert all("no CUDA device" in reasons for reasons in no_cuda.values())

    no_nvml = gpu.blockers(_env(nvml_gpus=None), model_given=False)
    assert no_nvml["probe"] == [] and no_nvml["tests"] == ["no NVML"] and no_nvml["stack"] == ["no NVML"]


def test_without_django_the_probe_runs_only_on_a_given_checkpoint():
    env = _env(missing_modules=["django"])
    assert gpu.blockers(env, model_given=True)["probe"] == []
    assert any("make_tiny_model" in r for r in gpu.blockers(env, model_given=False)["probe"])
    assert "django not importable" in gpu.blockers(env, model_given=True)["tests"]


# -- figures and the table ---------------------------------------------------------------------------


def test_gbps_is_decimal_gigabytes_per_second_and_none_without_time():
    assert gpu.gbps(4_000_000_000, 0.1) == pytest.approx(40.0)
    assert gpu.gbps(1, 0) is None and gpu.gbps(1, None) is None
    assert gpu.fmt_gbps(None) == "n/a" and gpu.fmt_gbps(54.64) == "54.6 GB/s"


def test_sizes_read_in_gib_above_one_and_mib_below():
    assert gpu.fmt_size(1_769_996_288) == "1.648 GiB"
    assert gpu.fmt_size(746_586_112) == "712.0 MiB"
    assert gpu.fmt_size(-256 * MiB) == "-256.0 MiB"
    assert gpu.fmt_size(None) == "n/a"


def test_the_table_is_markdown_with_one_row_per_figure_and_cells_kept_whole():
    text = gpu.render([Row("probe float32", "wake 1", "0.030 s | 35 GB/s\nfast", "ok"), Row("tests", "x")])

    lines = text.splitlines()
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]] == ["part", "measure", "figure", "check"]
    assert set(lines[1]) <= {"|", "-"}
    assert len(lines) == 4 and "0.030 s \\| 35 GB/s fast" in lines[2]


def test_the_exit_status_says_missing_before_failed():
    failed = [Row("probe", "cap", "", "FAIL: allocated past the cap"), Row("tests", "x", "", "ok")]
    assert gpu.exit_status(failed, lacking=True) == 2
    assert gpu.exit_status(failed, lacking=False) == 1
    assert gpu.exit_status([Row("tests", "x", "", "ok"), Row("p", "y", "", "unverified: no NVML")], False) == 0


# -- the gpu-marked tests' report --------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.inference.test_replica" name="test_the_fraction_cap_raises_out_of_memory_above_it"/>
<testcase classname="tests.inference.test_replica" name="test_sleep_frees_the_gpu_memory_per_nvml"/>
<testcase classname="tests.inference.test_replica" name="test_wake_lands_on_the_new_gpu">
  <skipped type="pytest.skip" message="needs two GPUs to wake a replica on another one">skip</skipped></testcase>
<testcase classname="tests.inference.test_agent"
  name="test_on_a_gpu_host_auto_discovery_reports_the_real_gpus_from_nvml">
  <failure message="AssertionError: assert (85520809984 == 85017493504)">long traceback</failure></testcase>
</testsuite></testsuites>"""


def test_the_tests_part_is_given_only_the_files_holding_gpu_marked_tests(tmp_path):
    (tmp_path / "tests" / "inference").mkdir(parents=True)
    (tmp_path / "tests" / "inference" / "test_arena.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_on_cuda():\n    pass\n"
    )
    (tmp_path / "tests" / "inference" / "test_fuzz.py").write_text(
        "import schemathesis\n\n# a gpu test would say @pytest.mark.gpu\ndef test_plain():\n    pass\n"
    )
    (tmp_path / "tests" / "helpers.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef helper():\n    pass\n")

    assert gpu.gpu_test_files(tmp_path) == ["tests/inference/test_arena.py"]


def test_the_junit_report_gives_counts_failures_and_skip_reasons():
    counts = gpu.parse_junit(JUNIT)

    assert (counts.passed, counts.failed, counts.skipped, counts.errors) == (2, 1, 1, 0)
    assert counts.failures == [
        (
            "tests.inference.test_agent::test_on_a_gpu_host_auto_discovery_reports_the_real_gpus_from_nvml",
            "AssertionError: assert (85520809984 == 85017493504)",
        )
    ]
    rows = gpu.tests_rows(counts, 1, "")
    assert rows[0].figure == "2 passed, 1 failed, 1 skipped"
    assert rows[0].check == "FAIL: test_on_a_gpu_host_auto_discovery_reports_the_real_gpus_from_nvml"
    assert any(r.what.startswith("skipped:") and "two GPUs" in r.figure for r in rows)


def test_tests_that_all_skip_or_never_report_fail_the_part():
    only_skips = gpu.parse_junit(
        '<testsuite><testcase classname="t" name="a"><skipped message="needs CUDA"/></testcase></testsuite>'
    )
    assert gpu.tests_rows(only_skips, 0, "")[0].check == "FAIL: every gpu-marked test was skipped"
    assert gpu.tests_rows(None, 4, "ERROR: file not found")[0].check == "FAIL: ERROR: file not found"


# -- the probe's rows --------------------------------------------------------------------------------


def _probe_result(**overrides) -> dict:
    """A probe run shaped like bench.gpu_probe's records, figures from the 1 GB float32 findings."""
    kv = {"block_tokens": 16, "blocks_total": 40, "blocks_used": 0}
    result = {
        "setup": {
            "reservation_bytes": 2_183_152_640,
            "estimate": {"weights_bytes": 1_072_972_800, "kv_bytes": 0, "context_bytes": 757_071_872},
            "context_bare_bytes": 543_162_368,
            "context_assumed_bytes": 757_071_872,
        },
        "bandwidth": {"nbytes": 1_072_972_800, "pinned_gbps": 54.6, "pageable_gbps": 7.7},
        "load": {
            "seconds": 0.65,
            "weights_bytes": 1_072_972_800,
            "nvml_bytes": 1_769_996_288,
            "event": {"event": "serving", "kv": kv, "need_bytes": 2_100_000_000, "footprint": {"context_bytes": 1}},
        },
        "generate": {"paged": [5, 6, 7, 8], "reference": [5, 6, 7, 8]},
        "prefill": {"prompt_tokens": 496, "nvml_bytes": 1_900_000_000, "peak_reserved_bytes": 1_300_000_000},
        "cap": {"fraction": 0.02, "limit_bytes": 1_700_000_000, "margin_bytes": 32 * MiB, "over": "oom", "under": "ok"},
        "cycles": [
            {
                "n": 1,
                "sleep_s": 0.7,
                "wake_s": 1_072_972_800 / 36e9,
                "nvml_after_sleep_bytes": 746_586_112,
                "nvml_after_wake_bytes": 1_769_996_288,
                "event": {"event": "woken", "kv": kv},
            }
        ],
        "generate_after_wake": {"paged": [5, 6, 7, 8], "reference": [5, 6, 7, 8]},
    }
    result.update(overrides)
    return result


def _by_what(rows: list[Row]) -> dict[str, Row]:
    return {r.what: r for r in rows}


def test_a_probe_within_its_reservation_passes_and_reports_wake_against_pinned():
    rows = _by_what(gpu.probe_rows(_probe_result(), "float32", 512))

    assert not [r for r in rows.values() if r.failed]
    assert rows["load (0.65 s): NVML process bytes"].figure == "1.648 GiB of 2.033 GiB reserved (81 %)"
    assert rows["load (0.65 s): NVML process bytes"].check == "ok"
    assert rows["KV pool after load"].figure == "40 blocks × 16 tokens = 640 tokens"
    assert rows["wake 1"].figure == "0.030 s, 36.0 GB/s (66 % of pinned)"
    assert rows["sleep 1 (0.700 s): NVML left"].figure == "712.0 MiB"
    assert rows["greedy paged = transformers generate"].check == "ok"
    assert rows["host→device copy, 1023.3 MiB"].figure == "pinned 54.6 GB/s, pageable 7.7 GB/s"


def test_the_probe_fails_what_the_findings_saw_break():
    cycle = {
        "n": 1,
        "sleep_s": 0.7,
        "wake_s": 0.03,
        "nvml_after_sleep_bytes": 1_700_000_000,  # weights still on the GPU
        "nvml_after_wake_bytes": 2_613_051_392,  # above the 2,183,152,640 B reservation
        "event": {"event": "woken", "kv": {"block_tokens": 16, "blocks_total": 0}},  # the 0-block replica
    }
    result = _probe_result(
        generate={"paged": [5, 6, 9, 9], "reference": [5, 6, 7, 8]},
        cap={"fraction": 0.02, "limit_bytes": 1, "margin_bytes": MiB, "over": "allocated", "under": "ok"},
        cycles=[cycle],
    )

    rows = _by_what(gpu.probe_rows(result, "float32", 512))

    assert rows["greedy paged = transformers generate"].figure == "4 vs 4 tokens, first difference at token 2"
    assert rows["allocator cap"].check == "FAIL: allocated past the cap"
    assert rows["sleep 1 (0.700 s): NVML left"].check == "FAIL: the weights were not freed"
    assert rows["wake 1: NVML process bytes"].check == "FAIL: NVML 410.0 MiB above the reservation"
    assert rows["wake 1: KV pool"].check == "FAIL: below max_tokens 512"


def test_a_sleep_is_judged_by_what_the_allocator_holds_and_a_wake_by_its_own_reservation():
    """The H100 of 2026-11-26: asleep, NVML showed 780 MiB where the load had shown a 610 MiB
    context (kernels loaded since), with nothing left in the allocator; the wake was reserved the
    need plus that growth, and NVML stayed inside it."""
    grown = {
        "n": 1,
        "sleep_s": 0.06,
        "wake_s": 0.012,
        "nvml_after_sleep_bytes": 780 * MiB,
        "allocator_after_sleep_bytes": 0,
        "reserved_bytes": 2_300_000_000,
        "nvml_after_wake_bytes": 2_200_000_000,  # above the load's 2,100,000,000 B, inside the wake's
        "event": {"event": "woken", "kv": {"block_tokens": 16, "blocks_total": 72}},
    }
    kept = {**grown, "n": 2, "allocator_after_sleep_bytes": 600 * MiB}

    rows = _by_what(gpu.probe_rows(_probe_result(cycles=[grown, kept]), "float32", 512))

    assert rows["sleep 1 (0.060 s): NVML left"].figure == "780.0 MiB (allocator 0.0 MiB)"
    assert rows["sleep 1 (0.060 s): NVML left"].check == "ok"
    assert rows["wake 1: NVML process bytes"].check == "ok"
    assert rows["sleep 2 (0.060 s): NVML left"].check == "FAIL: the allocator still holds 600.0 MiB"


def test_a_probe_without_nvml_figures_is_unverified_and_a_crash_is_a_failure():
    load = {"seconds": 1.0, "weights_bytes": 10, "nvml_bytes": None, "event": {"kv": None}}
    rows = gpu.probe_rows(
        {"setup": {"reservation_bytes": 100}, "load": load, "error": {"step": "cap", "error": "E"}}, "bfloat16", 512
    )

    by_what = _by_what(rows)
    assert by_what["load (1.00 s): NVML process bytes"].check.startswith("unverified")
    assert by_what["KV pool after load"].check == "FAIL: no KV pool"
    assert rows[-1] == Row("probe bfloat16", "probe stopped at cap", "E", "FAIL: the probe raised")


def test_the_probe_output_is_read_by_tag_past_other_lines():
    stdout = "\n".join(
        [
            "Loading weights: 100%",
            'PROBE {"tag": "load", "seconds": 1.5}',
            'PROBE {"tag": "cycle", "n": 1}',
            "PROBE {not json",
            'PROBE {"tag": "cycle", "n": 2}',
        ]
    )
    assert gpu.parse_probe_output(stdout) == {"load": {"seconds": 1.5}, "cycles": [{"n": 1}, {"n": 2}]}


# -- the books against NVML --------------------------------------------------------------------------


def _gpu_row(available: int, *occupants: tuple[str, str, int], node: str = "local", index: int = 0) -> dict:
    return {
        "node": node,
        "index": index,
        "available_bytes": available,
        "occupants": [{"replica": r, "state": s, "reserved_bytes": b} for r, s, b in occupants],
    }


def test_books_that_cover_nvml_pass():
    gpus = [_gpu_row(70 * GiB, ("a", "serving", 2 * GiB), ("b", "serving", 3 * GiB))]
    nvml = {0: NvmlGpu(total=80 * GiB, free=75 * GiB, used=5 * GiB, procs={101: int(1.8 * GiB), 102: int(2.9 * GiB)})}

    [books] = compare_books(gpus, {"a": 101, "b": 102}, nvml, "local")

    assert books.reserved_bytes == 5 * GiB and books.nvml_bytes == int(1.8 * GiB) + int(2.9 * GiB)
    assert books.check() == "ok"


def test_a_replica_over_its_reservation_and_available_above_free_fail():
    # The findings' run: a 2,183,152,640 B reservation, 2,613,051,392 B in use by its process.
    gpus = [_gpu_row(83_337_657_344, ("a", "serving", 2_183_152_640))]
    nvml = {0: NvmlGpu(total=85_520_809_984, free=82_404_442_112, used=3_116_367_872, procs={7: 2_613_051_392})}

    [books] = compare_books(gpus, {"a": 7}, nvml, "local")

    assert books.over_by_replica == {"a": 429_898_752}
    assert books.check() == (
        "FAIL: NVML 410.0 MiB above the reservations; "
        "available 890.0 MiB above NVML free + sleeping/absent reservations"
    )
    assert "over its reservation: a by 410.0 MiB" in books.figure()


def test_available_may_exceed_free_by_what_sleepers_and_absent_replicas_reserved():
    # A sleeper keeps its context (NVML 0.5 GiB) of a 2 GiB reservation; a pending replica has no process yet.
    gpus = [_gpu_row(10 * GiB, ("s", "sleeping", 2 * GiB), ("p", "loading", 1 * GiB))]
    nvml = {0: NvmlGpu(total=16 * GiB, free=int(8.0 * GiB), used=8 * GiB, procs={5: GiB // 2})}

    [books] = compare_books(gpus, {"s": 5, "p": None}, nvml, "local")

    assert books.slack_bytes == int(1.5 * GiB) + GiB
    assert books.check() == "ok"
    tighter = compare_books(
        [_gpu_row(11 * GiB, *[(o["replica"], o["state"], o["reserved_bytes"]) for o in gpus[0]["occupants"]])],
        {"s": 5, "p": None},
        nvml,
        "local",
    )
    assert tighter[0].check() == "FAIL: available 512.0 MiB above NVML free + sleeping/absent reservations"


def test_a_replica_holding_memory_without_a_reservation_counts_against_the_books_and_strangers_do_not():
    gpus = [_gpu_row(70 * GiB, ("a", "serving", 2 * GiB))]
    # 11: replica a; 12: replica z, asleep with no reservation on this GPU; 99: someone else's process.
    nvml = {0: NvmlGpu(total=80 * GiB, free=74 * GiB, used=6 * GiB, procs={11: int(1.8 * GiB), 12: GiB // 2, 99: GiB})}

    [books] = compare_books(gpus, {"a": 11, "z": 12}, nvml, "local")

    assert books.unreserved == {"z": GiB // 2} and books.strangers == {99: GiB}
    assert books.nvml_bytes == int(1.8 * GiB) + GiB // 2
    assert books.check().startswith("FAIL: NVML 307.2 MiB above the reservations")


def test_books_without_nvml_or_without_the_replicas_pids_are_unverified_and_other_nodes_ignored():
    gpus = [_gpu_row(70 * GiB, ("a", "serving", 2 * GiB)), _gpu_row(GiB, node="other", index=1)]

    [virtual] = compare_books(gpus, {"a": 11}, None, "local")
    assert virtual.check() == "unverified: no NVML figures (virtual GPUs)"
    assert virtual.figure() == "1 occupant(s) reserve 2.000 GiB; available 70.000 GiB"

    namespaced = NvmlGpu(total=80 * GiB, free=78 * GiB, used=2 * GiB, procs={4242: 2 * GiB})
    [hidden] = compare_books(gpus, {"a": 11}, {0: namespaced}, "local")
    assert hidden.check().startswith("unverified: NVML lists none of the replicas' processes")


def test_a_registered_total_above_what_cuda_can_allocate_fails():
    # The findings: NVML's total registered, 503,316,480 B above what CUDA can allocate.
    idle = NvmlGpu(total=85_520_809_984, free=85_017_493_504, used=503_316_480, procs={})

    assert registration(85_520_809_984, idle)[1] == "FAIL: 480.0 MiB above what CUDA can allocate"
    assert registration(85_017_493_504, idle)[1] == "ok"
    busy = NvmlGpu(total=idle.total, free=idle.free - GiB, used=idle.used + GiB, procs={3: GiB})
    assert registration(85_017_493_504, busy)[1] == "unverified: 1 process(es) already on the GPU"


def test_a_replica_without_a_pool_or_below_max_tokens_fails_its_kv_row():
    assert kv_row("a woken", {"id": "0123456789", "kv": None}, 512).check == "FAIL: no KV pool"
    small = kv_row("a woken", {"id": "0123456789", "kv": {"blocks_total": 0, "block_tokens": 16}}, 512)
    assert (small.what, small.check) == ("a woken: KV pool of 01234567", "FAIL: below max_tokens 512")
    assert kv_row("a", {"id": "x", "kv": {"blocks_total": 32, "block_tokens": 16}}, 512).check == "ok"


def test_books_are_plain_data_for_the_raw_record():
    books = Books(node="local", gpu=0, occupants=0, reserved_bytes=0, available_bytes=GiB)
    assert Books(**books.__dict__) == books


# -- BENCHMARKS.md -----------------------------------------------------------------------------------

DOC = """# Benchmarks

## Reading the numbers

Text.

<!-- bench:kvpool -->
## KV block pool (cpu)

Old pool figures.
<!-- /bench:kvpool -->
"""


def test_the_section_is_appended_then_replaced_in_place():
    once = gpu.upsert_section(DOC, "gpu", "GPU validation (bench.gpu)", "| a |", "_Run 1._")
    assert once.startswith(DOC.rstrip()) and once.endswith(
        "<!-- bench:gpu -->\n## GPU validation (bench.gpu)\n\n_Run 1._\n\n| a |\n<!-- /bench:gpu -->\n"
    )

    twice = gpu.upsert_section(once, "gpu", "GPU validation (bench.gpu)", "| b |", "_Run 2._")
    assert twice == once.replace("| a |", "| b |").replace("_Run 1._", "_Run 2._")


def test_a_hand_written_section_under_the_heading_is_replaced_and_the_next_kept():
    doc = DOC.replace(
        "## Reading the numbers", "## GPU validation (bench.gpu)\n\nNo GPU was lent.\n\n## Reading the numbers"
    )

    out = gpu.upsert_section(doc, "gpu", "GPU validation (bench.gpu)", "| a |", "_Run 1._")

    assert "No GPU was lent." not in out and out.count("## GPU validation (bench.gpu)") == 1
    assert "## Reading the numbers\n\nText." in out and "Old pool figures." in out
    assert out.index("<!-- /bench:gpu -->") < out.index("## Reading the numbers")


def test_the_stacks_api_reads_a_long_answer_whole_and_cuts_an_error_page():
    """/metrics runs past 2000 characters, and its GPU gauges come late: cut, the H100 run of
    2026-11-26 read them as "not exported"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.gpu_stack import Api

    body = "# HELP filler\n" * 400 + 'gpuportal_gpu_overcommit_bytes{gpu="0",node="n1"} 0.0\n'

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            code = 200 if self.path == "/metrics" else 500
            payload = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = Api(f"http://127.0.0.1:{server.server_address[1]}")
        code, text = api.call("GET", "/metrics")
        assert code == 200 and text == body and text.rstrip().endswith("} 0.0")
        code, text = api.call("GET", "/broken")
        assert code == 500 and len(text) == 2000
    finally:
        server.shutdown()
        server.server_close()
