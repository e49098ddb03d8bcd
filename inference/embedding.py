"""Sentence embeddings from a Hugging Face encoder: what a `transformers-embedding`
replica runs for `POST /v1/embeddings`. Runs in the replica process (and, reading the recipe, in
the node's inspection); no Django.

The recipe is sentence-transformers' for the models it publishes (all-MiniLM-L6-v2 and its kin),
read from the model directory: the encoder's last hidden states pooled over the attention mask (the
mean of the real tokens, or the first token) as `1_Pooling/config.json` says, then scaled to unit
length when `modules.json` lists a Normalize step. Inputs longer than `sentence_bert_config.json`'s
`max_seq_length` are truncated, as sentence-transformers truncates them. A directory without
`modules.json` (a plain encoder) gets mean pooling and unit length, as OpenAI's embeddings have.
A recipe this module cannot follow exactly (a Dense step, max pooling) is refused at deploy rather
than served with vectors that differ from the model's own.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The steps of a sentence-transformers pipeline this module runs, by their class's name.
_STEPS = ("Transformer", "Pooling", "Normalize")
_POOLINGS = ("mean", "cls")
# The inputs an encoder's forward takes from its tokenizer; anything else a tokenizer returns
# (offsets, special-token masks) is not for the model.
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class Interrupted(Exception):
    """A drain's deadline passed between two forward passes: the request goes back to its queue."""


@dataclass(frozen=True)
class Recipe:
    """How token states become one vector per input."""

    pooling: str = "mean"  # "mean" over the attention mask, or "cls": the first token's state
    normalize: bool = True
    # Tokens an input is truncated to; None: the model's own limit (its position embeddings).
    max_tokens: int | None = None
    lowercase: bool = False


def read_recipe(root: Path) -> Recipe:
    """The recipe of the model in `root`; ValueError naming what this portal cannot run."""
    modules = root / "modules.json"
    if not modules.is_file():
        return Recipe()
    steps = _read_json(modules)
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ValueError(f"{modules} is not a list of sentence-transformers modules")
    names = [str(step.get("type", "")).rpartition(".")[2] for step in steps]
    unknown = [name for name in names if name not in _STEPS]
    if unknown:
        raise ValueError(
            f"{modules} lists a {unknown[0]} step, which this portal does not run (it runs "
            f"{', '.join(_STEPS)}): its embeddings would differ from the model's own"
        )
    if names[:1] != ["Transformer"] or str(steps[0].get("path", "")) != "" or "Pooling" not in names:
        raise ValueError(f"{modules} must list the encoder in the model directory itself, then a Pooling step")
    pooling = _pooling_mode(root / str(steps[names.index("Pooling")].get("path", "")) / "config.json")
    encoder = root / "sentence_bert_config.json"
    settings = _read_json(encoder) if encoder.is_file() else {}
    limit = settings.get("max_seq_length") if isinstance(settings, dict) else None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{encoder}: max_seq_length must be a positive whole number, not {limit!r}")
    return Recipe(
        pooling=pooling,
        normalize="Normalize" in names,
        max_tokens=limit,
        lowercase=bool(settings.get("do_lower_case", False)) if isinstance(settings, dict) else False,
    )


def _pooling_mode(config: Path) -> str:
    """The pooling a Pooling step's config asks for, "mean" or "cls": its `pooling_mode` or, as
    older releases wrote it, the one `pooling_mode_*` flag set."""
    settings = _read_json(config)
    if not isinstance(settings, dict):
        raise ValueError(f"{config} is not a JSON object")
    mode = settings.get("pooling_mode")
    if mode is None:
        flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
        others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in flags.values()]
        chosen = [name for name, flag in flags.items() if settings.get(flag)]
        mode = chosen[0] if len(chosen) == 1 and not others else [*chosen, *others]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in _POOLINGS:
        raise ValueError(f"{config}: pooling {mode!r} is not supported (only one of: {', '.join(_POOLINGS)})")
    return str(mode)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None


class Embedder:
    """Embeds lists of texts with a loaded encoder, by its recipe.

    The inputs of one request run in as few forward passes as the activation budget allows: the
    replica's reservation holds weights and the activation floor (gpuportal.wire.memory) and no KV
    cache, so a pass takes at most the tokens whose activations fit that floor (and at least one
    input, whatever its length). Inputs are sorted by length first, so each pass pads little."""

    def __init__(self, model: Any, tokenizer: Any, recipe: Recipe):
        self.model, self.tokenizer, self.recipe = model, tokenizer, recipe
        own = getattr(model.config, "max_position_embeddings", None)
        limits = [n for n in (recipe.max_tokens, own, getattr(tokenizer, "model_max_length", None)) if n]
        self.max_tokens = int(min(limits)) if limits else 512
        self.tokens_per_pass = max(self.max_tokens, _tokens_within_floor(model))

    def embed(self, texts: list[str], abort: threading.Event | None = None) -> dict[str, Any]:
        """{"embeddings": one list of floats per text, in order, "usage": {prompt_tokens, total_tokens}};
        Interrupted if `abort` is set between two passes."""
        if self.recipe.lowercase:
            texts = [text.lower() for text in texts]
        lengths = [len(ids) for ids in self._tokenize(texts)["input_ids"]]
        vectors: list[list[float] | None] = [None] * len(texts)
        for group in self._passes(lengths):
            if abort is not None and abort.is_set():
                raise Interrupted("cut short by a drain past its deadline")
            for index, vector in zip(group, self._pass([texts[i] for i in group]), strict=True):
                vectors[index] = vector
        tokens = sum(lengths)
        return {"embeddings": vectors, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _tokenize(self, texts: list[str], **kwargs: Any) -> Any:
        return self.tokenizer(texts, truncation=True, max_length=self.max_tokens, **kwargs)

    def _passes(self, lengths: list[int]) -> list[list[int]]:
        """Indexes of the inputs, longest first, in groups whose padded tokens fit one pass."""
        groups: list[list[int]] = []
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            # Sorted longest first: a group's first input sets its padded length.
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= self.tokens_per_pass:
                groups[-1].append(index)
            else:
                groups.append([index])
        return groups

    def _pass(self, texts: list[str]) -> list[list[float]]:
        import torch

        batch = self._tokenize(texts, padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        inputs = {name: batch[name].to(device) for name in _MODEL_INPUTS if name in batch}
        with torch.no_grad():
            out = self.model(**inputs)
        states = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        pooled = pool(states, inputs["attention_mask"], self.recipe.pooling)
        if self.recipe.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().tolist()


def pool(states: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One float32 vector per sequence from its token states (batch, tokens, hidden): the mean
    over the tokens the attention mask keeps (padding is not part of the text), or the first."""
    states = states.float()  # a half-precision sum over hundreds of tokens loses digits
    if mode == "cls":
        return states[:, 0]
    kept = mask.unsqueeze(-1).to(states.dtype)
    return (states * kept).sum(dim=1) / kept.sum(dim=1).clamp(min=1e-9)


def _tokens_within_floor(model: Any) -> int:
    """Tokens of one forward pass whose activations fit the activation floor the reservation
    holds, by the scheduler's own per-token formula (gpuportal.wire.memory)."""
    from gpuportal.wire import memory
    from inference.paged import model_shape

    try:
        per_token = memory.activation_bytes_per_token(model_shape(model, 0))
    except (AttributeError, TypeError, ValueError):  # a config without the usual fields
        return 0
    return memory.ACTIVATION_FLOOR_BYTES // max(1, per_token)
