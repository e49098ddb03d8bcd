"""What a node reads of a model before any replica loads it (gpuportal.wire.inspection): the
weights' bytes and, for a transformers model, the shape the control plane's estimate needs.
Nothing is loaded: a transformers model is read from its config and safetensors headers, a
`torch-module` factory is built on the meta device."""

from __future__ import annotations

from gpuportal.wire.inspection import ModelReading
from inference.loaders import factory_weight_bytes
from inference.model_size import shape_from_model_dir

TRANSFORMERS = "transformers"


def read_model(source: str, loader: str, dtype: str) -> ModelReading:
    try:
        if loader == TRANSFORMERS:
            shape = shape_from_model_dir(source, dtype)
            refusal = _tokenizer_refusal(source)
            if refusal:
                return ModelReading(refusal=refusal)
            return ModelReading(weight_bytes=shape.weight_bytes, shape=shape)
        return ModelReading(weight_bytes=_factory_bytes(source, dtype))
    except ValueError as err:
        return ModelReading(refusal=str(err))
    except OSError as err:  # a path the file system refuses (too long, unreadable)
        return ModelReading(refusal=f"cannot read {source!r}: {err.strerror or err}")


def _tokenizer_refusal(source: str) -> str:
    """Why the replicas could not read text for this model, or "": a transformers deployment takes
    only text and chat, so one without a tokenizer would be accepted here and fail on its first
    request (issue 18). Loaded the way a replica loads it (inference.replica), from local files."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(source, local_files_only=True)
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
