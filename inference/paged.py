"""A paged forward pass for Llama-style causal LMs: keys and values live in the replica's BlockPool.

Our own forward over the model's modules (embeddings, per layer: RMSNorm, q/k/v projections,
rotary embedding, attention, o_proj, MLP; final norm, lm_head) rather than a transformers Cache
subclass: attention here reads K/V gathered from each sequence's blocks with a per-sequence mask,
so sequences of any lengths step together, and nothing depends on transformers' internal mask and
cache plumbing, which changes between releases. The arithmetic per token is the model's own (its
modules, its rotary embedding, SDPA), so greedy outputs equal those of model.generate.

Architectures: those whose decoder layer is Llama's (`SUPPORTED`). Anything else, and models
spread over several devices, keep transformers' generate() (inference.serving.Executor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuportal.wire.memory import DEFAULT_BLOCK_TOKENS, ModelShape, dtype_bytes, kv_pool_blocks
from inference.lora import Key, Stack, add_terms, grouped
from inference.token_logprobs import Picked, of_rows

if TYPE_CHECKING:
    import torch

    from inference.kvpool import BlockPool
    from inference.lora import Adapters

# model_type → what must hold of its config for the Llama layer to be exact. Mistral and Qwen2 differ
# from Llama only by sliding-window attention (when enabled) and Qwen2's q/k/v biases (inside the
# projections); Qwen3 adds per-head q/k RMSNorms, applied below when the attention has them.
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}

# A prefill runs at most this many new tokens per slice in one pass (PagedModel.forward), which bounds
# a step's activations whatever the prompt: the linear temporaries (and the padding of a batch of
# unequal prompts) are at most C tokens wide, and the attention scores that SDPA's math backend
# materialises (a boolean mask; float32) are C x keys per head instead of prompt x keys. Why 128: each
# chunk reads every weight once more, so a 512-token prompt pays 4 weight reads instead of 1, which is
# small next to its decode steps (one weight read per generated token) and keeps GEMMs 128 rows tall;
# while a chunk's scores stay small next to the linear budget: 25 heads x 128 queries x 512 keys in
# float32 are 6.25 MiB per slice, a quarter of what a 512-token prompt in one pass would need.
PREFILL_CHUNK_TOKENS = 128
# An echoed prompt's tokens are scored (PagedModel.forward_scored) this many rows of the vocabulary's
# logits at a time: 32 x a 152k vocabulary in float32 is 19 MiB, small next to a chunk's activations.
SCORED_ROWS = 32


def text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot use the paged path, or None if it can."""
    config = text_config(model)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r} is not Llama-style ({', '.join(sorted(SUPPORTED))})"
    if getattr(config, "use_sliding_window", False) or (
        kind == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window attention is not paged"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model has no Llama-style decoder"
    if len({p.device for p in model.parameters()}) != 1:
        return "the model is spread over several devices"
    return None


def model_shape(model: Any, weight_bytes: int) -> ModelShape:
    """The loaded model's shape for gpuportal.wire.memory, in the dtype it runs in."""
    config = text_config(model)
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    dtype = next(model.parameters()).dtype
    return ModelShape(
        weight_bytes=weight_bytes,
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        dtype_bytes=dtype_bytes(str(dtype)),
        hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None),
        vocab_size=getattr(config, "vocab_size", None),
    )


@dataclass
class Slice:
    """One sequence's part of a forward: `tokens` at positions start.. (start = tokens cached)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    # The sequence's LoRA adapter: its row in the engine's stacks (inference.lora); -1 the base model.
    adapter: int = -1


class PagedModel:
    """The model's forward with its KV cache in `pool`. Not thread-safe: one forward at a time."""

    def __init__(self, model: Any, pool: BlockPool, adapters: Adapters | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.pool = pool
        self.adapters = adapters
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.device = next(model.parameters()).device
        config = text_config(model)
        self.context = getattr(config, "max_position_embeddings", None)
        self.lora: dict[Key, Stack] = {}
        if adapters is not None:
            adapters.check_fits(model)
            self.lora = adapters.stacks(next(model.parameters()).dtype, self.device)

    def forward(self, batch: list[Slice]) -> torch.Tensor:
        """Run each slice's tokens, writing their K/V into its blocks (which must cover them);
        returns the logits of each slice's last token, [len(batch), vocab], in float32.

        A prefill longer than PREFILL_CHUNK_TOKENS runs chunk by chunk: in step k every slice's
        tokens [k*C, (k+1)*C) go through all layers (their K/V into the pool) before the next chunk
        attends to them, so no pass holds more than C new tokens per slice; slices whose tokens are
        used up drop out. Same logits as one pass, up to float rounding."""
        self._check_blocks(batch)
        width = max(len(s.tokens) for s in batch)
        if width <= PREFILL_CHUNK_TOKENS:  # decode steps and short prefills: one pass, as always
            return self.lm_head(self._last_hidden(batch)[0]).float()
        return self._chunked(batch, {})[0]

    def forward_scored(
        self, batch: list[Slice], scored: Mapping[int, int]
    ) -> tuple[torch.Tensor, dict[int, list[Picked]]]:
        """forward's logits, and for each slice `scored` names ({index: k}) each of its tokens after
        the first with its log probability given those before it and its k likeliest alternatives
        (an echoed prompt's, inference.token_logprobs): read chunk by chunk as the pass goes,
        SCORED_ROWS rows of the vocabulary at a time, so that no prompt's length sets the memory."""
        self._check_blocks(batch)
        return self._chunked(batch, scored)

    def _chunked(self, batch: list[Slice], scored: Mapping[int, int]) -> tuple[torch.Tensor, dict[int, list[Picked]]]:
        """forward_scored's pass, chunk by chunk; its caller checked the blocks."""
        import torch

        chunk = PREFILL_CHUNK_TOKENS
        width = max(len(s.tokens) for s in batch)
        last: list[Any] = [None] * len(batch)
        scores: dict[int, list[Picked]] = {i: [] for i in scored}
        for begin in range(0, width, chunk):
            members = [i for i, s in enumerate(batch) if len(s.tokens) > begin]
            part = [
                Slice(batch[i].tokens[begin : begin + chunk], batch[i].start + begin, batch[i].blocks, batch[i].adapter)
                for i in members
            ]
            kept = [row for row, i in enumerate(members) if i in scores]
            hidden, every = self._last_hidden(part, kept)
            for row, i in enumerate(members):
                if len(batch[i].tokens) <= begin + chunk:  # its last token was in this chunk
                    last[i] = hidden[row]
            for row, rows in zip(kept, every, strict=True):
                i = members[row]
                # Each token's row predicts the next; the last token's next is no token of the slice.
                following = batch[i].tokens[begin + 1 : begin + 1 + chunk]
                for at in range(0, len(following), SCORED_ROWS):
                    logits = self.lm_head(rows[at : at + SCORED_ROWS][: len(following) - at]).float()
                    targets = following[at : at + SCORED_ROWS]
                    scores[i] += of_rows(logits, targets, [scored[i]] * len(targets))
        return self.lm_head(torch.stack(last)).float(), scores

    def _check_blocks(self, batch: list[Slice]) -> None:
        bt = self.pool.block_tokens
        for s in batch:
            if len(s.blocks) * bt < s.start + len(s.tokens):
                raise ValueError(f"blocks for {len(s.blocks) * bt} tokens, the slice needs {s.start + len(s.tokens)}")

    def _last_hidden(self, batch: list[Slice], kept: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass of the slices through every layer (K/V into the pool); the final-normed hidden
        state of each slice's last token, [len(batch), hidden], and of every token of the slices
        `kept` names (by index), [its tokens, hidden] each. The blocks were checked by the caller."""
        import torch
        import torch.nn.functional as F
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        pool = self.pool
        assert pool.k is not None and pool.v is not None, "the pool was released"
        bt = pool.block_tokens
        device = self.device
        size = len(batch)
        lengths = [len(s.tokens) for s in batch]
        width = max(lengths)  # new tokens per slice, padded
        keys_len = max(s.start + n for s, n in zip(batch, lengths, strict=True))
        span = -(-keys_len // bt)  # blocks to gather per slice

        # Whole tensors at once, not a Python loop per token: on a GPU, where a decode step's
        # forward takes about a millisecond, the host's bookkeeping is what sets a step's pace.
        lens = torch.tensor(lengths)
        starts = torch.tensor([s.start for s in batch])
        cols = torch.arange(width)
        real = cols[None, :] < lens[:, None]  # [batch, width]: a real token, not padding
        ids = torch.zeros((size, width), dtype=torch.long)
        ids[real] = torch.tensor([t for s in batch for t in s.tokens], dtype=torch.long)
        # Padding repeats the slice's last position (any valid one would do: its output is dropped).
        positions = starts[:, None] + torch.minimum(cols[None, :], (lens - 1)[:, None])
        # Padded with block 0: masked out below.
        table = torch.tensor([(s.blocks[:span] + [0] * span)[:span] for s in batch], dtype=torch.long)
        rows, slot_cols = real.nonzero(as_tuple=True)
        slot_positions = positions[rows, slot_cols]
        slot_blocks = table[rows, slot_positions // bt]
        slot_offsets = slot_positions % bt
        # One copy to the device instead of one per tensor.
        parts = [ids, positions, table, rows, slot_cols, slot_blocks, slot_offsets, lens - 1]
        sent = torch.cat([part.flatten() for part in parts]).to(device)
        ids, positions, table, rows_t, cols_t, blk_t, off_t, last = (
            piece.view(part.shape)
            for piece, part in zip(sent.split([part.numel() for part in parts]), parts, strict=True)
        )
        # Query j of slice i (position start+j) sees key positions up to its own: causal inside the
        # new tokens, everything cached before them. Padded queries see position 0 only (no NaN).
        key_pos = torch.arange(span * bt, device=device)
        mask = key_pos[None, None, :] <= positions[:, :, None]
        mask = mask[:, None, :, :]  # [batch, 1 (heads), queries, keys]

        # The rows of each LoRA adapter the batch uses; none, and every projection is the model's alone.
        groups = grouped([s.adapter for s in batch], device) if self.lora else []

        def project(module: Any, x: torch.Tensor, index: int, name: str) -> torch.Tensor:
            out = module(x)
            return add_terms(out, x, self.lora.get((index, name)), groups) if groups else out

        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, positions)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)
            shape = (size, width, -1, self.head_dim)
            q = project(attn.q_proj, x, index, "q_proj").view(shape)
            k = project(attn.k_proj, x, index, "k_proj").view(shape)
            v = project(attn.v_proj, x, index, "v_proj").view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            # Into the pool: only real tokens, each to its block and offset.
            pool.k[index, blk_t, off_t] = k.transpose(1, 2)[rows_t, cols_t]
            pool.v[index, blk_t, off_t] = v[rows_t, cols_t]
            # Out of the pool: every slice's blocks, as [batch, kv_heads, span*bt, head_dim].
            keys = pool.k[index][table].flatten(1, 2).transpose(1, 2)
            values = pool.v[index][table].flatten(1, 2).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )
            hidden = residual + project(attn.o_proj, out.transpose(1, 2).reshape(size, width, -1), index, "o_proj")
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            if groups:  # the MLP's three projections one by one, each with its adapters' terms
                mlp = layer.mlp
                gate = project(mlp.gate_proj, x, index, "gate_proj")
                gated = mlp.act_fn(gate) * project(mlp.up_proj, x, index, "up_proj")
                hidden = residual + project(mlp.down_proj, gated, index, "down_proj")
            else:
                hidden = residual + layer.mlp(x)
        every = [self.norm(hidden[row, : lengths[row]]) for row in kept]
        return self.norm(hidden[torch.arange(size, device=device), last]), every


def engine_for(
    model: Any,
    *,
    weights_bytes: int,
    cap_bytes: int,
    max_tokens: int,
    context_bytes: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    standby_context_bytes: int = 0,
    overhead_bytes: int = 0,
    adapters: Adapters | None = None,
) -> PagedModel:
    """A PagedModel whose pool takes what the cap leaves after the weights, the activation budget
    for max_tokens, the CUDA context(s) and memory outside the allocator: gpuportal.wire.memory's
    arithmetic, the scheduler's own. `weights_bytes` is the weights as allocated, buffers aside,
    and the stacks of the `adapters` it serves beside them (inference.lora)."""
    from inference.kvpool import BlockPool

    shape = model_shape(model, weights_bytes)
    blocks = kv_pool_blocks(
        shape,
        cap_bytes=cap_bytes,
        max_tokens=max_tokens,
        cuda_context_bytes=context_bytes,
        block_tokens=block_tokens,
        standby_context_bytes=standby_context_bytes,
        overhead_bytes=overhead_bytes,
    )
    param = next(model.parameters())
    pool = BlockPool.for_shape(shape, blocks, dtype=param.dtype, device=param.device, block_tokens=block_tokens)
    return PagedModel(model, pool, adapters)
