"""A replica host as far as the serving loop (inference.serving.Server) uses one, for tests that
run the loop in-process over real Redis."""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace
from typing import Any

from inference.paged import engine_for
from inference.serving import Executor

MiB = 1024**2


def host_for(model: Any, tokenizer: Any, *, paged: bool = True) -> SimpleNamespace:
    """Serving, with a KV pool under a cap of 256 MiB, for requests of up to 1,024 tokens (or,
    `paged` False, no pool: generate() runs each request alone, as on a model the paged engine
    does not take)."""
    engine = (
        engine_for(model, weights_bytes=8 * MiB, cap_bytes=256 * MiB, max_tokens=1024, context_bytes=0)
        if paged
        else None
    )
    accepting = threading.Event()
    accepting.set()
    return SimpleNamespace(
        replica_id=f"r-{uuid.uuid4().hex[:8]}",
        loader="transformers",
        tokenizer=tokenizer,
        paged=engine,
        fence=None,
        node_fence=None,
        accepting=accepting,
        abort=threading.Event(),
        lock=threading.Lock(),
        on_stop_taking=None,
        begin_request=lambda: True,
        end_request=lambda: None,
        executor=lambda: Executor(model, tokenizer),
        kv_stats=lambda: None,
        on_stale=lambda reason: None,
    )
