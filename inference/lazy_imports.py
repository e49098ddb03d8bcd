"""transformers' names, imported under one lock per process. Its lazy module is not safe to import
from several threads at once: the first `from transformers import AutoConfig` in eight threads
fails in seven with an ImportError, and a node agent reads several models' files at once (parallel
deploys). Each name resolved here once is then a plain attribute, so the lock costs nothing after."""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()


def from_transformers(*names: str) -> list[Any]:
    """`from transformers import <names>`, one thread at a time."""
    with _lock:
        import transformers

        return [getattr(transformers, name) for name in names]
