"""`hf:org/name` model sources: a Hugging Face model name, read from the node's local
Hugging Face cache (HF_HOME or HF_HUB_CACHE, as the agent has them) and never downloaded. Nodes
have no network in production either, and a download in the middle of a deploy or a load would
hang it and blow the memory plan; a model missing from the cache is refused, saying how to put it
there.

Everything else that takes a model directory resolves its source here first, so a `hf:` name is
read (inspection) and loaded (replicas) exactly as the directory it names in the cache."""

from __future__ import annotations

from pathlib import Path

PREFIX = "hf:"


def is_hub_name(source: str) -> bool:
    return source.startswith(PREFIX)


def local_model_dir(source: str | Path) -> Path:
    """The directory `source` names: itself, or for `hf:org/name` its snapshot in the local
    Hugging Face cache. ValueError saying how to download it when the cache does not hold it."""
    if isinstance(source, Path) or not is_hub_name(source):
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
            f"{source} is not in this node's Hugging Face cache ({constants.HF_HUB_CACHE}), and nodes never "
            f"download: on each node, as the user its agent runs as, run `hf download {repo}` (or in Python "
            f"`huggingface_hub.snapshot_download({repo!r})`), then deploy again"
        ) from None
