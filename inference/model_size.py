"""Read a model directory's shape for the memory estimate (gpuportal.wire.memory) without loading weights.

Weight bytes come from the safetensors headers (a few KiB read per file, however big the model) or,
for checkpoints without safetensors, from a build on the meta device, which allocates no storage.
The shape comes from config.json itself for the common model types (_PLAIN_TYPES), else through
transformers' AutoConfig. A node agent reads every model deployed on it, so the common case
imports neither transformers nor torch: those cost the agent 3 s of CPU and 270 MB of memory,
which only its replicas need.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuportal.wire.memory import DTYPE_BYTES, ModelShape, allocation_bytes, dtype_bytes
from inference.hub import local_model_dir, no_directory
from inference.lazy_imports import from_transformers

# safetensors dtype codes whose tensors a loader casts to the requested dtype. Integer, boolean and
# 8-bit float tensors are quantised data or indices, which loaders keep as stored, so they are not
# rescaled.
_CASTABLE = {"F64", "F32", "F16", "BF16"}
# A header is a few KiB to a few MiB of JSON; a bigger length field means the file is not safetensors,
# and reading it would be a memory bomb.
_MAX_HEADER_BYTES = 100 * 1024**2


def shape_from_model_dir(path: str | Path, dtype: str | None = None, *, encoder: bool = False) -> ModelShape:
    """The shape of the causal LM in `path` (a directory or `hf:org/name`) as it will run in `dtype`
    (None: the checkpoint's own dtype); `encoder`: of the headless encoder there instead, which
    matters only for a checkpoint without safetensors, sized by building it.

    Raises ValueError naming what is missing or malformed; the API reports it on `model.source`.
    """
    root = _model_dir(path)
    config = None
    values = plain_config(root)
    if values is None:
        config = load_config(root)
        values = config_values(config, root)

    run_dtype = str(dtype).removeprefix("torch.") if dtype is not None else values.dtype
    run_bytes = dtype_bytes(run_dtype)

    files = _safetensors_files(root)
    headers = [_tensors(f) for f in files]  # each file's header read once, for its shapes and bytes
    if headers and values.model_type in _CHECKED_TYPES and values.intermediate and values.vocab:
        shapes = {name: tuple(info["shape"]) for tensors in headers for name, info in tensors.items()}
        if mismatches := config_mismatches(values, shapes):
            more = len(mismatches) - _MISMATCHES_NAMED
            raise ValueError(
                f"the weights in {root} do not match its config.json: "
                + "; ".join(mismatches[:_MISMATCHES_NAMED])
                + (f"; and {more} more" if more > 0 else "")
            )
    weight_bytes = (
        sum(_safetensors_bytes(tensors, run_bytes) for tensors in headers)
        if files
        else _meta_bytes(config or load_config(root), root, run_bytes, encoder=encoder)
    )
    return ModelShape(
        weight_bytes=weight_bytes,
        num_layers=values.layers,
        num_kv_heads=values.kv_heads,
        head_dim=values.head_dim,
        dtype_bytes=run_bytes,
        hidden_size=values.hidden,
        intermediate_size=values.intermediate,
        vocab_size=values.vocab,
    )


@dataclass(frozen=True)
class ConfigValues:
    """What the estimate reads of a model's config: its text model's, for a multimodal one."""

    layers: int
    heads: int
    hidden: int
    kv_heads: int
    head_dim: int
    intermediate: int | None
    vocab: int | None
    dtype: str  # the checkpoint's own, one of DTYPE_BYTES
    # Its text model's type ("llama"): which tensors its checkpoint holds, under which names.
    model_type: str = ""


# The model types whose config class keeps config.json's values as written, under their own names
# (no attribute map, nothing nested), and what it takes for num_key_value_heads when the file leaves
# it out (None: one per attention head). A file leaving out head_dim gets hidden_size / heads, as
# config_values reads these classes. tests/gpuportal/test_memory.py checks every entry against
# transformers' own reading; any other type, or a file that leaves out another value, is read
# through AutoConfig, which alone knows the class's defaults.
_PLAIN_TYPES: dict[str, int | None] = {"llama": None, "mistral": 8, "qwen2": 32, "bert": None}
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")


def plain_config(root: Path) -> ConfigValues | None:
    """The values of `root`'s config.json read as JSON, or None where only its config class can
    say what they are (another model type, a value left out, anything malformed: AutoConfig then
    reads it, and says what is wrong)."""
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in _PLAIN_TYPES:
        return None
    layers, heads, hidden, intermediate, vocab = (raw.get(name) for name in _REQUIRED)
    if not all(_positive(v) for v in (layers, heads, hidden, intermediate, vocab)):
        return None
    if "num_key_value_heads" in raw:
        kv_heads = raw["num_key_value_heads"]
        if not _positive(kv_heads):
            return None  # a null asks the class for its own rule, which differs from leaving it out
    else:
        kv_heads = _PLAIN_TYPES[raw["model_type"]] or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if not _positive(head_dim):
        return None
    return ConfigValues(
        layers=layers,
        heads=heads,
        hidden=hidden,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype")),
        model_type=raw["model_type"],
    )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_values(config: Any, root: Path) -> ConfigValues:
    """What the estimate reads of a config loaded by transformers (load_config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _config_int(text, root, "num_hidden_layers")  # first: the error names the first missing
    heads = _config_int(text, root, "num_attention_heads")
    hidden = _config_int(text, root, "hidden_size")
    return ConfigValues(
        layers=layers,
        heads=heads,
        hidden=hidden,
        # Without GQA/MQA the config leaves num_key_value_heads out (or None): every head has its own K and V.
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        # Some models (Gemma, Qwen3) set head_dim independently of hidden / heads.
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        intermediate=_optional_int(text, "intermediate_size"),
        vocab=_optional_int(text, "vocab_size"),
        dtype=_config_dtype(config),
        model_type=str(getattr(text, "model_type", "") or ""),
    )


def _model_dir(path: str | Path) -> Path:
    root = local_model_dir(path)
    if not root.exists():
        raise ValueError(no_directory(path, root))
    if not root.is_dir():
        raise ValueError(f"not a model directory: {root} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"no config.json in {root}")
    return root


def load_config(root: Path) -> Any:
    # Through transformers rather than json.load: a saved config omits values equal to its class's
    # defaults (Mistral's num_key_value_heads=8, for one), and only the config class knows them.
    (AutoConfig,) = from_transformers("AutoConfig")

    try:
        json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a model directory: {root / 'config.json'} is not valid JSON ({exc})") from exc
    try:
        return AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError, KeyError, OSError... for unknown configs
        raise ValueError(f"not a model directory: cannot read {root / 'config.json'} ({exc})") from exc


def _config_dtype(config: Any) -> str:
    # transformers 5 calls it dtype, older releases torch_dtype; a config without either loads as float32.
    # Reading torch_dtype on a transformers 5 config logs a deprecation warning, hence the hasattr.
    return _dtype_name(config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None))


def _dtype_name(value: Any) -> str:
    name = str(value or "float32").removeprefix("torch.")
    return name if name in DTYPE_BYTES else "float32"


def _config_int(config: Any, root: Path, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json in {root} has no {name} (a positive integer)")
    return value


def _optional_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and value > 0 else None


def _safetensors_files(root: Path) -> list[Path]:
    # The index decides when present: a directory may also hold a consolidated copy (Mistral ships
    # consolidated.safetensors beside the shards) that would otherwise be counted twice.
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a model directory: {index} is not a safetensors index ({exc})") from exc
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ValueError(f"not a model directory: {index} lists missing shards: {', '.join(missing)}")
        return [root / n for n in names]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(root.glob("*.safetensors"))


def _tensors(path: Path) -> dict[str, dict[str, Any]]:
    """The header's tensors ({name: {dtype code, shape, bytes as stored}}). The format is an 8-byte
    little-endian header length, then that many bytes of JSON; the tensor data after it is never
    read."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER_BYTES or length > path.stat().st_size - 8:
                raise ValueError(f"header length {length} does not fit the file")
            header = json.loads(f.read(length))
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            shape = [int(n) for n in info["shape"]]
            tensors[name] = {"dtype": info["dtype"], "shape": shape, "stored": end - begin}
        return tensors
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a model directory: {path} is not a safetensors file ({exc})") from exc


# A Llama-style checkpoint's tensors whose shapes config.json fixes, under their usual names: what
# transformers builds from that config, and refuses to load (or, for a missing layer, fills with
# random weights) where the checkpoint differs.
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight")
_CHECKED_TYPES = frozenset({"llama", "mistral", "qwen2"})
# How many differences a refusal spells out; the rest are counted.
_MISMATCHES_NAMED = 3


def config_mismatches(values: ConfigValues, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Where a Llama-style checkpoint's weights (their shapes, from the headers) differ from what
    its config.json makes of them, one line per kind of tensor; [] where they agree. Other
    tensors (biases, quantised or fused layouts, other names) are left to the loader. Pure."""
    q, kv, hidden = values.heads * values.head_dim, values.kv_heads * values.head_dim, values.hidden
    wanted = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (values.intermediate, hidden),
        "mlp.up_proj": (values.intermediate, hidden),
        "mlp.down_proj": (hidden, values.intermediate),
    }
    layers: set[int] = set()
    differ: dict[tuple[str, tuple[int, ...], tuple[int | None, ...]], int] = {}
    for name, shape in sorted(shapes.items()):
        if match := _LAYER_TENSOR.fullmatch(name):
            layers.add(int(match[1]))
            kind, want = f"model.layers.*.{match[2]}.weight", wanted[match[2]]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            kind, want = name, (values.vocab, hidden)
        else:
            continue
        if tuple(shape) != want:
            differ[kind, tuple(shape), want] = differ.get((kind, tuple(shape), want), 0) + 1
    found = []
    if layers and (max(layers) + 1 != values.layers or len(layers) != values.layers):
        found.append(f"num_hidden_layers is {values.layers}, the weights hold {len(layers)} layers")
    for (kind, shape, want), count in differ.items():
        where = f" ({count} layers)" if kind.startswith("model.layers.*") else ""
        found.append(f"{kind}{where} is {list(shape)} in the weights, {list(want)} by config.json")
    return found


def _safetensors_bytes(tensors: dict[str, dict[str, Any]], run_bytes: int) -> int:
    # Tensor by tensor as the allocator will hold them (gpuportal.wire.memory.allocation_bytes): what
    # the replica's weights take on the GPU, so the estimate and the replica's own count agree.
    return sum(
        allocation_bytes(math.prod(t["shape"]) * run_bytes if t["dtype"] in _CASTABLE else t["stored"])
        for t in tensors.values()
    )


def _meta_bytes(config: Any, root: Path, run_bytes: int, *, encoder: bool = False) -> int:
    """Bytes of the model's parameters and saved buffers, counted on a storage-less meta-device build."""
    from accelerate import init_empty_weights

    AutoModel, AutoModelForCausalLM = from_transformers("AutoModel", "AutoModelForCausalLM")

    try:
        # include_buffers: buffers too stay off the host, so even a huge model costs only its metadata.
        with init_empty_weights(include_buffers=True):
            model = (AutoModel if encoder else AutoModelForCausalLM).from_config(config)
    except Exception as exc:  # any failure to build means we cannot size it; say why
        what = "an encoder" if encoder else "a causal LM"
        raise ValueError(
            f"not a model directory: no safetensors in {root} and its config does not build {what} ({exc})"
        ) from exc

    # parameters() yields tied weights once, as save_pretrained stores them once. Non-persistent buffers
    # (rotary tables) are excluded: they are not in a checkpoint either, so both paths agree.
    tensors = list(model.parameters())
    for module in model.modules():
        skip = module._non_persistent_buffers_set
        tensors.extend(b for name, b in module.named_buffers(recurse=False) if name not in skip)
    return sum(
        allocation_bytes(t.numel() * (run_bytes if t.is_floating_point() else t.element_size())) for t in tensors
    )
