"""The README's quickstart, run as a user types it: in a shell, in the checkout, against a fresh
`make run` (`up` with no GPUPORTAL_ADMIN_PASSWORD, so the token step reads var/admin-password).
After the first deploy and the first request come the README's "Using the API" commands and the
embeddings example of docs/api.md, in the same shell. Only the model's directory is the test's own:
the port is read from var/stack.env, as the quickstart does. (tests/gpuportal/test_docs.py checks,
without a stack, where the quickstart sits.)"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.support.up import ROOT, Up

pytestmark = pytest.mark.slow


def sh_blocks(path: str, heading: str) -> list[str]:
    """The ```sh blocks of the section of `path` (relative to the checkout) under the line `heading`."""
    text = (ROOT / path).read_text()
    section = text[text.index(f"\n{heading}\n") + 1 :]
    section = section[: section.index("\n## ")] if "\n## " in section else section
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


def run_as_typed(script: str, *, cwd, model_dir) -> str:
    # The port is not the test's to change: the quickstart reads it from var/stack.env.
    script = script.replace("/tmp/tiny", str(model_dir))
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def json_values(text: str) -> list:
    """The JSON objects in a shell's output, in order: curl ends none of them with a newline, so
    they run into each other and into the lines other commands print."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        found.append(value)
        at = end
    return found


def test_the_readmes_quickstart_works_as_typed_on_a_fresh_stack(tmp_path):
    make, first_deploy = sh_blocks("README.md", "## Quickstart")  # `make run` is what the test starts
    (using_the_api,) = sh_blocks("README.md", "## Using the API")
    embeddings, reranking = sh_blocks("docs/api.md", "## Embeddings")
    assert make.startswith("make run")
    checkout = tmp_path / "checkout"  # the checkout as the user's shell sees it, var/ being up's
    checkout.mkdir()
    for name in (".venv", "manage.py"):
        (checkout / name).symlink_to(ROOT / name)
    (checkout / "var").symlink_to(tmp_path / "var", target_is_directory=True)
    # A call that names no timeout_s waits 120 s rather than 30: here two other test processes
    # share the machine's two cores, and the encoder's load waits for a load slot behind the
    # scale-up's two (20 s and more each under that load, seconds on a user's idle machine).
    up = Up(tmp_path / "var", "--virtual-gpus", "2x4GiB", admin_password=None,
            settings={"GPUPORTAL_INFER_TIMEOUT_S": "120"})  # fmt: skip
    try:
        up.wait_up()
        assert (tmp_path / "var" / "admin-password").stat().st_mode & 0o777 == 0o600

        # One shell, as a user pastes one block after the other: the later ones use the first's $AUTH.
        said = run_as_typed(
            first_deploy + using_the_api + embeddings + reranking, cwd=checkout, model_dir=tmp_path / "tiny"
        )

        created, inferred, scaled, gpus, followed, listed, encoder, embedded, reranked = json_values(said)
        assert created["name"] == "tiny-a" and created["replicas_wanted"] == 1, created
        # The first request waits (timeout_s 30) for the first replica to load and serve it.
        assert inferred["status"] == "done" and inferred["output"]["text"], inferred
        assert scaled["replicas_wanted"] == 3, scaled
        assert len(gpus["results"]) == 2, gpus
        # The request submitted without waiting, followed by the id its answer gave.
        assert followed["deployment"] == "tiny-a", followed
        assert followed["status"] in ("queued", "waking", "dispatched", "running", "done"), followed
        assert inferred["id"] in [r["id"] for r in listed["results"]], listed
        # The packaged sentence encoder (a dev dependency), deployed and asked as docs/api.md says.
        assert encoder["name"] == "minilm", encoder
        assert [len(d["embedding"]) for d in embedded["data"]] == [384, 384], embedded
        # Its rerank, as docs/api.md shows it: a real encoder's sense of which document is about cats.
        assert [r["document"]["text"] for r in reranked["results"]] == ["Cats sleep in the sun."], reranked
    finally:
        assert up.stop() == 0
