"""`make test`'s processes share the rewriting of the test files (tests/support/rewrite_share.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.rewrite_share import ROOT, files_under, turn


def test_each_worker_starts_on_its_own_share_and_imports_every_file():
    files = [Path(f"test_{n}.py") for n in range(10)]

    turns = [turn(files, worker, 3) for worker in range(3)]

    assert [t[0].name for t in turns] == ["test_0.py", "test_3.py", "test_6.py"]
    assert all(sorted(t) == files for t in turns)
    assert turn(files, 0, 1) == files


def test_the_files_are_those_the_session_was_asked_for_in_one_order():
    whole = files_under(["tests/gpuportal"])
    this = Path(__file__).resolve()

    assert this in whole and whole == sorted(whole) and all(p.name.startswith("test_") for p in whole)
    assert files_under([f"{this.relative_to(ROOT)}::test_the_files_are_those"]) == [this]
    assert files_under(["tests/gpuportal", "tests/gpuportal/test_up.py"]) == whole, "named twice, imported once"
    assert files_under(["tests/support"]) == [], "no test file there"
