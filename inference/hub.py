"""`hf:org/name` model sources: a Hugging Face model name, read from the node's local
Hugging Face cache (HF_HOME or HF_HUB_CACHE, as the agent has them) and never downloaded by a
deploy or a load: a download in the middle of one would hang it and blow the memory plan, and
many nodes have no network. A model missing from the cache is refused, saying how to put it there:
`gpuportal pull` ahead of the deploy (inference.pull), or a copy by hand.

Everything else that takes a model directory resolves its source here first, so a `hf:` name is
read (inspection) and loaded (replicas) exactly as the directory it names in the cache."""

from __future__ import annotations

from pathlib import Path

from gpuportal.wire.pulls import HUB_PREFIX as PREFIX
from gpuportal.wire.pulls import is_repo_id


def is_hub_name(source: str) -> bool:
    return source.startswith(PREFIX)


def local_model_dir(source: str | Path) -> Path:
    """The directory `source` names: itself, or for `hf:org/name` its snapshot in the local
    Hugging Face cache. ValueError saying how to download it when the cache does not hold it.
    A bare `org/name` (or `gpt2`) that names no directory here is taken for a Hugging Face name
    when the cache holds it (as `vllm serve Qwen/Qwen2.5-0.5B-Instruct` takes one); else it stays a
    path, and what refuses it says how to write the name (`no_directory`)."""
    if isinstance(source, Path):
        return source
    if not is_hub_name(source):
        if is_repo_id(source) and not Path(source).exists():
            cached = _cached(source)
            if cached is not None:
                return cached
        return Path(source)
    repo = source.removeprefix(PREFIX)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: the cache's refs/main and its snapshot, no request to the hub at all.
        return Path(snapshot_download(repo, local_files_only=True))
    except HFValidationError as err:
        raise ValueError(f"{source!r} is not a Hugging Face model name (hf:org/name): {err}") from None
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{source} is not in this node's Hugging Face cache ({constants.HF_HUB_CACHE}), and a deploy never "
            f"downloads: pull it first (`gpuportal pull {repo}`), or on each node, as the user its agent runs "
            f"as, run `hf download {repo}`, then deploy again"
        ) from None


def _cached(repo: str) -> Path | None:
    """The snapshot of `repo` in the local Hugging Face cache, or None (no request to the hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError):
        return None


def no_directory(source: str | Path, root: Path) -> str:
    """Why `source` names no model directory (`root`, what it resolved to, does not exist), with
    the `hf:` spelling when it reads as a Hugging Face model name rather than a path."""
    message = f"not a model directory: {root} does not exist"
    # A name alone (`gpt2`) is as likely a mistyped directory as one of the hub's oldest models:
    # the hint is for org/name, the spelling nearly every model on the hub has.
    if isinstance(source, str) and is_repo_id(source) and "/" in source:
        message += (
            f", and this node's Hugging Face cache holds no model {source}: a deploy never downloads; pull it "
            f"first (`gpuportal pull {source}`), then deploy hf:{source} (or {source})"
        )
    return message
