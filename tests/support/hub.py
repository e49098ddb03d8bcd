"""A Hugging Face cache made on disk for `hf:org/name` sources (inference.hub): the layout
huggingface_hub's own downloads leave (models--org--name/refs/main naming a snapshot, the
snapshot's files), filled from a local directory. No network: tests never download."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# A commit hash as the hub names snapshots; any 40 hex digits do for a cache made by hand.
REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo: str, files: Path, *, link: bool = False) -> Path:
    """Put the model in `files` into the cache at `cache` as `repo`; returns its snapshot.
    `link`: the snapshot's files are symbolic links to `files` (as the hub's point into blobs/),
    so a model of 90 MB costs no copy."""
    home = cache / f"models--{repo.replace('/', '--')}"
    snapshot = home / "snapshots" / REVISION
    for source in files.rglob("*"):
        if source.is_dir():
            continue
        target = snapshot / source.relative_to(files)
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            target.symlink_to(source.resolve())
        else:
            shutil.copy2(source, target)
    (home / "refs").mkdir(parents=True, exist_ok=True)
    (home / "refs" / "main").write_text(REVISION)
    return snapshot


def use_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Make `cache` the Hugging Face cache of this process (huggingface_hub read its environment
    when first imported) and of the processes it starts from now on (agents, their replicas)."""
    from huggingface_hub import constants

    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
