"""A failover standby's warm-up: the first forward pass's one-off costs paid while standing by.

A standby holds its weights in pinned host memory and only a CUDA context on its GPU (its active
partner fills the memory the pair reserved). The first forward pass a process runs on a GPU loads
the kernels it uses (CUDA's lazy module loading) and initialises cuBLAS: 200-565 ms measured on an
H100 for a 512 MB model, against 4-8 ms for the next. Paid after a takeover, that is most of the
time from the SIGKILL of the active member to the standby's first answer.

So the standby runs, once, on its GPU, the serving path a takeover will use over a skeleton of its
model: the same architecture and config (hidden size, heads, kv heads, head_dim, intermediate
size, vocabulary, dtype, attention implementation) with ONE decoder layer, so the matmuls have the
real shapes (cuBLAS picks its kernels by shape and dtype) and every kernel of a layer runs once.
A model the paged engine can run goes through a PagedModel over a pool of a few blocks and one
short request through the Batcher (a prefill, then decode steps), as the replica serves it; any
other through transformers' generate(). Then everything is freed and the standby holds its
context again, grown by the kernels it loaded (that is what its `standby` event's residual
reports, and what the pair's books count for it).

Never CUDA_MODULE_LOADING=EAGER: that loads whole libraries and grows the context by an amount no
estimate counts. Never the model's own weights on the GPU: that memory is the partner's.

It never fails the standby: any exception (out of memory above all: the GPU may be full) is
logged and reported as skipped, and the takeover then simply pays the first pass itself.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from inference.allocator import give_back_cached

log = logging.getLogger(__name__)

PROMPT_TOKENS = 16
NEW_TOKENS = 3
# A request of PROMPT_TOKENS + NEW_TOKENS tokens needs 2 blocks of 16; a few more cost nothing.
POOL_BLOCKS = 4


@dataclass
class WarmUp:
    """What the warm-up did: `path` "paged" or "generate", or None with `skipped` saying why."""

    path: str | None
    seconds: float
    tokens: int = 0
    skipped: str | None = None
    # The skeleton's parameters and buffers (tied embeddings counted once), and on a GPU the
    # allocator's peak during the warm-up and what it still held after it (0: all given back).
    skeleton_bytes: int = 0
    peak_bytes: int | None = None
    left_bytes: int | None = None

    def as_event(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 6)}


class _Silent:
    """The Batcher's tokenizer: the warm-up's tokens are never read as text."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def warm_up(model: Any, device: Any, dtype: Any = None, *, paged: bool | None = None) -> WarmUp:
    """Run the serving path once on `device` over a one-layer skeleton of `model`; `model` itself
    (its parameters, wherever they are) is never touched. `dtype`: the skeleton's (default: the
    model's). `paged`: False forces generate() (a model that will be spread over several GPUs),
    None decides as the replica does (inference.paged.unsupported_reason). Never raises."""
    started = time.monotonic()
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is there wherever a standby runs
        return WarmUp(None, 0.0, skipped=f"no torch: {exc}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    work: dict[str, Any] = {}
    result: WarmUp
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        # The skeleton's random init must not move the generators serving will sample with.
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
            result = _run(model, device, dtype, paged, work)
        if cuda:
            torch.cuda.synchronize(device)
    except Exception as exc:
        result = WarmUp(None, 0.0, skipped=f"{type(exc).__name__}: {exc}".strip()[:500])
    finally:
        work.clear()
        _free(torch, device)
    if cuda:
        result.peak_bytes = int(torch.cuda.max_memory_allocated(device))
        result.left_bytes = int(torch.cuda.memory_reserved(device))
    result.seconds = time.monotonic() - started
    if result.skipped is not None:
        log.warning("standby warm-up skipped (the first request after a takeover pays for it): %s", result.skipped)
    else:
        log.info(
            "standby warm-up on %s: %s path, %d tokens in %.3f s (skeleton %d bytes, peak %s bytes)",
            device,
            result.path,
            result.tokens,
            result.seconds,
            result.skeleton_bytes,
            result.peak_bytes,
        )
    return result


def skeleton_config(model: Any) -> Any:
    """`model`'s config with one decoder layer and tied input/output embeddings (one vocabulary
    table instead of two: lm_head's matmul keeps its shape, so its kernel, at half the memory)."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_hidden_layers", None) is None:
        raise ValueError(f"config {type(config).__name__} has no num_hidden_layers")
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), list):  # per-layer kinds (sliding, full)
        text.layer_types = text.layer_types[:1]
    for c in {id(config): config, id(text): text}.values():
        if hasattr(c, "tie_word_embeddings"):
            c.tie_word_embeddings = True
    return config


def _run(model: Any, device: Any, dtype: Any, paged: bool | None, work: dict[str, Any]) -> WarmUp:
    import torch

    from inference.loaders import _dtype_kwarg, tensor_bytes
    from inference.paged import unsupported_reason

    if getattr(model, "config", None) is None:
        return WarmUp(None, 0.0, skipped="not a transformers model (no config)")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    use_paged = unsupported_reason(model) is None if paged is None else paged
    if not use_paged and not (hasattr(model, "generate") and getattr(model, "can_generate", lambda: True)()):
        return WarmUp(None, 0.0, skipped="neither the paged engine nor generate() serves this model")
    # The skeleton is built on the device directly (the init runs there, in milliseconds); so are
    # buffers computed at construction (the rotary embedding's inv_freq), which to_empty would not.
    # Transient memory outside the memory books: one decoder layer, one vocabulary table and a
    # pool of POOL_BLOCKS blocks (for a 8B Llama in bf16: ~0.4 GB + ~1 GB + 0.5 MB), freed below.
    with torch.device(device):
        skeleton = type(model)._from_config(skeleton_config(model), **{_dtype_kwarg(): dtype})
    skeleton.eval()
    work["skeleton"] = skeleton
    size = tensor_bytes(skeleton)
    vocab = int(skeleton.get_input_embeddings().num_embeddings)
    prompt = [1 + i % max(1, vocab - 1) for i in range(PROMPT_TOKENS)]
    if use_paged:
        tokens = _paged(skeleton, size, device, dtype, prompt, work)
        return WarmUp("paged", 0.0, tokens=tokens, skeleton_bytes=size)
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        out = skeleton.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return WarmUp("generate", 0.0, tokens=int(out.shape[1] - ids.shape[1]), skeleton_bytes=size)


def _paged(skeleton: Any, size: int, device: Any, dtype: Any, prompt: list[int], work: dict[str, Any]) -> int:
    """One request through the Batcher over a PagedModel, as the replica serves it."""
    from gpuportal.wire.memory import DEFAULT_BLOCK_TOKENS
    from inference.batching import Batcher, Sequence, run_until_idle
    from inference.kvpool import BlockPool
    from inference.paged import PagedModel, model_shape

    shape = model_shape(skeleton, size)
    pool = BlockPool.for_shape(shape, POOL_BLOCKS, dtype=dtype, device=device, block_tokens=DEFAULT_BLOCK_TOKENS)
    work["pool"] = pool
    engine = PagedModel(skeleton, pool)
    work["engine"] = engine
    # No end-of-sequence ids: the request runs its prefill and every decode step.
    batcher = Batcher(engine, _Silent(), set())
    seq = Sequence(prompt=prompt, max_tokens=NEW_TOKENS)
    batcher.submit(seq)
    run_until_idle(batcher)
    if seq.error is not None:  # the Batcher fails the sequence, not the caller: fail the warm-up
        raise seq.error
    return len(seq.generated)


def _free(torch: Any, device: Any) -> None:
    """Back to the context alone: the skeleton, the pool and the allocator's cached segments, and
    cuBLAS's workspaces (held per handle and stream, which empty_cache leaves alone); serving
    allocates them again inside its own budget."""
    try:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            give_back_cached(torch)
    except Exception as exc:  # never the standby's failure
        log.warning("standby warm-up: freeing its memory failed: %s", exc)
