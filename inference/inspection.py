"""What a node reads of a model before any replica loads it (gpuportal.wire.inspection): the
weights' bytes and, for a causal LM, the shape the control plane's estimate needs.
Nothing is loaded: a transformers model is read from its config and safetensors headers, a
`torch-module` factory is built on the meta device. A `hf:org/name` source is read from this
node's Hugging Face cache (inference.hub), or refused saying how to download it."""

from __future__ import annotations

import json
from pathlib import Path

from gpuportal.wire.inspection import ModelReading
from inference.hub import local_model_dir
from inference.lazy_imports import from_transformers
from inference.loaders import EMBEDDING, TRANSFORMERS, factory_weight_bytes, validate_source
from inference.model_size import shape_from_model_dir


def read_model(source: str, loader: str, dtype: str, adapters: str = "") -> ModelReading:
    try:
        if loader == TRANSFORMERS:
            shape = shape_from_model_dir(source, dtype)
            refusal = _headless_refusal(source) or _tokenizer_refusal(source)
            if refusal:
                return ModelReading(refusal=refusal)
            adapter_bytes = _adapter_bytes(adapters, dtype)
            return ModelReading(weight_bytes=shape.weight_bytes, shape=shape, adapter_bytes=adapter_bytes)
        if loader == EMBEDDING:
            validate_source(source, loader)  # weights beside the config, a recipe it can follow
            weights = shape_from_model_dir(source, dtype, encoder=True).weight_bytes
            refusal = _tokenizer_refusal(source)
            # No shape: an encoder keeps no KV cache. Its need is its weights and the activation
            # floor, which its forward passes are sized to fit (inference.embedding).
            return ModelReading(refusal=refusal) if refusal else ModelReading(weight_bytes=weights)
        return ModelReading(weight_bytes=_factory_bytes(source, dtype))
    except _AdapterRefused as refused:
        return ModelReading(refusal=str(refused), refused="model.adapters")
    except ValueError as err:
        return ModelReading(refusal=str(err))
    except OSError as err:  # a path the file system refuses (too long, unreadable)
        return ModelReading(refusal=f"cannot read {source!r}: {err.strerror or err}")


class _AdapterRefused(ValueError):
    """An adapter that cannot be served: the refusal names `model.adapters`, not the model's source."""


def _adapter_bytes(adapters: str, dtype: str) -> int:
    """What the adapters' stacks take beside the weights (inference.lora), from their files' headers."""
    from gpuportal.wire.adapters import parse
    from inference.lora import reading_bytes

    try:
        return reading_bytes(parse(adapters), dtype)
    except ValueError as err:
        raise _AdapterRefused(str(err)) from None
    except OSError as err:
        raise _AdapterRefused(f"cannot read an adapter: {err.strerror or err}") from None


def _headless_refusal(source: str) -> str:
    """Why this checkpoint is no causal LM, or "": one that names only headless architectures
    (BertModel, MPNetModel: sentence encoders) would load with a language-model head of random
    weights and generate noise. Such a model is served as embeddings instead."""
    try:
        config = json.loads((local_model_dir(source) / "config.json").read_text())
    except (OSError, ValueError):  # shape_from_model_dir read it a moment ago: nothing to add
        return ""
    names = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return ""
    if not all(n.endswith("Model") and not n.endswith("LMHeadModel") for n in names):
        return ""
    return (
        f"{source} is not a causal LM: its checkpoint has no language-model head ({', '.join(names)}); "
        f"to serve it as sentence embeddings on /v1/embeddings, deploy it with model.loader {EMBEDDING}"
    )


def _tokenizer_refusal(source: str) -> str:
    """Why the replicas could not read text for this model, or "": a causal LM or an encoder takes
    only text, so one without a tokenizer would be accepted here and fail on its first request
    instead. Loaded the way a replica loads it (inference.replica), from local files; a plain
    tokenizer.json is loaded by the `tokenizers` library alone, as transformers' own backend
    would, which spares the agent transformers' and torch's imports (see inference.model_size)."""
    root = local_model_dir(source)  # a hf: name is looked up in the cache once
    if _plain_tokenizer_loads(root):
        return ""
    (AutoTokenizer,) = from_transformers("AutoTokenizer")

    try:
        AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return (
            f"{source} has no tokenizer a replica can load ({first}): a text model needs its tokenizer "
            "files (tokenizer.json, or tokenizer_config.json with its vocabulary) beside its weights"
        )
    return ""


def _factory_bytes(source: str, dtype: str) -> int:
    try:
        return factory_weight_bytes(source, dtype)
    except (ValueError, OSError):
        raise
    except Exception as err:
        # The factory is the deployer's code: whatever it raises is a source that cannot be
        # served, and the agent that ran it must answer rather than die with the task.
        raise ValueError(f"factory {source!r} raised {type(err).__name__}: {err}") from err


# The classes with which transformers loads a tokenizer.json through the `tokenizers` library and
# nothing else (what make_tiny_model and most recent checkpoints write); a tokenizer_config.json
# naming another (a model's own class, remote code) is left to AutoTokenizer, which alone knows
# whether it loads.
_PLAIN_TOKENIZER_CLASSES = {None, "TokenizersBackend", "PreTrainedTokenizerFast"}


def _plain_tokenizer_loads(root: Path) -> bool:
    try:
        settings = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # without it, the model type picks the class: AutoTokenizer's call
        return False
    if not isinstance(settings, dict) or "auto_map" in settings:
        return False
    if (
        settings.get("tokenizer_class") not in _PLAIN_TOKENIZER_CLASSES
        or settings.get("backend", "tokenizers") != "tokenizers"
    ):
        return False
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(root / "tokenizer.json"))
    except Exception:  # a file the library cannot read: AutoTokenizer says why
        return False
    return True
