"""A Hugging Face model fetched into this node's cache (HF_HOME or HF_HUB_CACHE, as the agent has
them), with its progress: what `gpuportal pull` and `POST /api/models/pull/` ask of a node
(gpuportal.wire.pulls). The one place a node downloads: deploys and loads read the cache offline
(inference.hub). No Django.

huggingface_hub does the work (resumable downloads, the cache's layout, revisions); this module
only turns its byte bars into PullProgress, and a hub it cannot reach into a message that says how
to copy the model in by hand."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gpuportal.wire.pulls import DONE, DOWNLOADING, FAILED, PullProgress

log = logging.getLogger(__name__)

# At most this often is a node's progress written: a bar updates on every chunk.
REPORT_EVERY_S = 0.5

Report = Callable[[PullProgress], None]


class _Bytes:
    """The bytes written to the cache so far, over every file's bar, and the total as the hub
    announced it. Shared by the bars of one pull, on huggingface_hub's download threads."""

    def __init__(self, report: Report):
        self.report = report
        self.done = 0
        self.total = 0
        self._lock = threading.Lock()
        self._last = 0.0

    def add(self, done: int = 0, total: int = 0) -> None:
        with self._lock:
            self.done += done
            self.total += total
            now = time.monotonic()
            if now - self._last < REPORT_EVERY_S:
                return
            self._last = now
            progress = PullProgress(DOWNLOADING, self.done, self.total)
        self.report(progress)


def _gauge(counted: _Bytes) -> type[tqdm]:
    """A tqdm class for huggingface_hub to draw its bars with: nothing drawn, the bytes of its
    byte bars counted. (Its file-count bar, unit "it", is left alone.)"""

    class Gauge(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["file"] = io.StringIO()  # the agent's log is no terminal
            kwargs["disable"] = False
            kwargs.pop("name", None)
            # Before tqdm's own set-up, which refreshes the bar once.
            self._bytes = kwargs.get("unit") == "B" and str(kwargs.get("desc", "")).startswith("Reconstructing")
            self._total = 0
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._bytes:
                counted.add(done=int(n or 0), total=self._new_total())
            return super().update(n)

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            # huggingface_hub grows the total of the byte bar as each file starts, then refreshes.
            if self._bytes:
                counted.add(total=self._new_total())
            super().refresh(*args, **kwargs)

        def _new_total(self) -> int:
            total = int(self.total or 0)
            grown, self._total = total - self._total, total
            return max(0, grown)

    return Gauge


def unreachable(repo: str, revision: str | None, err: BaseException) -> str:
    """Why the hub could not be reached, and how to copy the model in by hand."""
    from huggingface_hub import constants

    name = f"{repo}@{revision}" if revision else repo
    said = " ".join(str(err).split())[:300].rstrip(".")
    return (
        f"cannot reach the Hugging Face hub ({constants.ENDPOINT}) from this node to fetch {name}: "
        f"{type(err).__name__}: {said}. Copy it in by hand: on a machine that "
        f"reaches the hub run `hf download {repo}{f' --revision {revision}' if revision else ''} "
        f"--cache-dir DIR`, then copy DIR's contents into this node's cache ({constants.HF_HUB_CACHE}), "
        "as the user its agent runs as"
    )


def pull(repo: str, revision: str | None, report: Report) -> PullProgress:
    """Fetch `repo` at `revision` into this node's cache, saying how far it got through `report`;
    returns the final progress (done, with the snapshot's path, or failed, with why). A model
    already in the cache is done at once, online or not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    counted = _Bytes(report)
    report(PullProgress(DOWNLOADING))
    try:
        path = snapshot_download(repo, revision=revision, tqdm_class=_gauge(counted))
    except (RepositoryNotFoundError, GatedRepoError) as err:
        final = PullProgress(FAILED, counted.done, counted.total, error=_no_such(repo, err))
    except RevisionNotFoundError:
        final = PullProgress(FAILED, counted.done, counted.total, error=f"{repo} has no revision {revision!r}")
    except HFValidationError as err:
        final = PullProgress(FAILED, error=f"{repo!r} is not a Hugging Face model name: {err}")
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as err:
        # No connection (and nothing in the cache to fall back on), or the hub down.
        final = PullProgress(FAILED, counted.done, counted.total, error=unreachable(repo, revision, err))
    else:
        files = sum(1 for p in Path(path).rglob("*") if p.is_file())
        final = PullProgress(DONE, counted.done, max(counted.total, counted.done), path=str(path), files=files)
    if final.state == FAILED:
        log.warning("pull of %s failed: %s", repo, final.error)
    report(final)
    return final


def _no_such(repo: str, err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"the Hugging Face hub has no model {repo} this node may read ({first}): check the name, and for a "
        "gated or private model give the node's agent a token (HF_TOKEN)"
    )
