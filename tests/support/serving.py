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


def host_for(
    model: Any, tokenizer: Any, *, paged: bool = True, adapters: Any = None, prefix_cache: str = "user"
) -> SimpleNamespace:
    """Serving, with a KV pool under a cap of 256 MiB, for requests of up to 1,024 tokens (or,
    `paged` False, no pool: generate() runs each request alone, as on a model the paged engine
    does not take), and the LoRA `adapters` (inference.lora.Adapters) beside the model; whose requests
    share its prefix cache (`prefix_cache`, gpuportal.wire.prefix_cache.MODES)."""
    engine = (
        engine_for(
            model, weights_bytes=8 * MiB, cap_bytes=256 * MiB, max_tokens=1024, context_bytes=0, adapters=adapters
        )
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
        prefix_cache=prefix_cache,
    )


def tiny_llama_config(context: int = 256) -> Any:
    """The suite's tiny Llama (two layers of hidden size 64, the tiny tokenizer's 512 tokens), of a
    `context` of tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=context,
    )


def gate_views(monkeypatch: Any) -> tuple[threading.Event, threading.Event]:
    """(building, gate): the parser's views of tokenizers (inference.constrained) are built only
    once the test sets `gate`; `building` is set when a build has begun. Set `gate` at the end."""
    from inference import constrained

    building, gate = threading.Event(), threading.Event()
    build = constrained._built_view

    def gated(*args: Any) -> Any:
        building.set()
        assert gate.wait(60), "the test never let the view be built"
        return build(*args)

    monkeypatch.setattr(constrained, "_built_view", gated)
    return building, gate
