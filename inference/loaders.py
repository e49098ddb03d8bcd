"""How a replica builds its model (docs/architecture.md): the loaders a deployment may name.

- ``transformers``: a Hugging Face causal LM from a local directory. Never the hub: nodes have no
  network in production either, and a silent download would blow the memory plan.
- ``transformers-embedding``: a Hugging Face encoder (BERT, MiniLM...) from a local directory,
  served as sentence embeddings (inference.embedding).
- ``torch-module``: a plain PyTorch module from a factory path ``package.module:factory``.

A directory may also be named `hf:org/name`: that model's snapshot in the node's Hugging Face
cache (inference.hub), which is never filled from here.

torch, transformers and accelerate are imported inside the functions: the web process validates
sources at deploy time and should not pay seconds of imports on start-up for that.
"""

from __future__ import annotations

import importlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuportal.wire.deployment_spec import DType, Loader
from inference.hub import local_model_dir, no_directory
from inference.lazy_imports import from_transformers

if TYPE_CHECKING:
    import torch
    from torch import nn

    from inference.arena import Arena, PendingCopies

# The loaders and dtypes a deployment may name: the contract's (gpuportal.wire.deployment_spec).
TRANSFORMERS, TORCH_MODULE, EMBEDDING = Loader.TRANSFORMERS, Loader.TORCH_MODULE, Loader.EMBEDDING
LOADERS = tuple(Loader)
# The loaders whose source is a model directory (or a hf: name), with a tokenizer beside its weights.
DIRECTORY_LOADERS = (TRANSFORMERS, EMBEDDING)
DTYPES = tuple(DType)
# What transformers can load weights from; an index file alone is not weights.
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_FACTORY_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
# max_memory as accelerate takes it: GPU index → bytes (0 forbids the GPU), plus "cpu"/"disk".
MaxMemory = Mapping[int | str, int]


def validate_source(source: str, loader: str) -> None:
    """Raise ValueError saying why `source` cannot be loaded with `loader`; cheap, loads no weights."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r} (known: {', '.join(LOADERS)})")
    if not source or not source.strip():
        raise ValueError("model source is empty")
    if loader == TORCH_MODULE:
        resolve_factory(source)
        return
    root = _model_dir(source)
    if loader == EMBEDDING:
        from inference.embedding import read_recipe

        read_recipe(root)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    clean = str(name).removeprefix("torch.")
    if clean not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return getattr(torch, clean)


def load_model(
    source: str,
    loader: str,
    dtype: str,
    *,
    device: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: MaxMemory | None = None,
) -> nn.Module:
    """The model of `source`, in eval mode, cast to `dtype`.

    Without `device_map` it lands on `device` (default CPU). With one (a real GPU: "auto" plus
    `max_memory`), accelerate places it, so weights never exceed what each GPU may hold.
    """
    validate_source(source, loader)
    run_dtype = torch_dtype(dtype)
    if loader == TORCH_MODULE:
        model = _load_torch_module(source, run_dtype, device_map, max_memory)
    else:
        model = _load_transformers(_model_dir(source), run_dtype, device_map, max_memory, encoder=loader == EMBEDDING)
    if device_map is None and device is not None:
        model = model.to(device)
    return model.eval()


def empty_model(source: str, loader: str, dtype: str) -> nn.Module:
    """The model of `source` on the meta device: its modules, shapes and dtypes, with no weight
    read or allocated (a wake from deep sleep fills it from the node's host copy: inference.host_copy)."""
    import torch

    validate_source(source, loader)
    run_dtype = torch_dtype(dtype)
    if loader == TORCH_MODULE:
        with torch.device("meta"):
            module = resolve_factory(source)()
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"factory {source!r} returned a {type(module).__name__}, not a torch.nn.Module")
        return module.to(dtype=run_dtype).eval()
    from inference.model_size import load_config

    AutoModel, AutoModelForCausalLM = from_transformers("AutoModel", "AutoModelForCausalLM")
    config = load_config(_model_dir(source))
    with torch.device("meta"):
        model = (AutoModel if loader == EMBEDDING else AutoModelForCausalLM).from_config(
            config, **{_dtype_kwarg(): run_dtype}
        )
    return model.eval()


def tensor_bytes(module: nn.Module) -> int:
    """Bytes held by the module's parameters and buffers; tied weights count once, as they are stored once."""
    return sum(tensor_bytes_by_device(module).values())


def weight_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What a checkpoint holds: parameters and persistent buffers, tied weights once.

    Non-persistent buffers (rotary tables) are not weights: the estimate from the checkpoint
    cannot see them, and counting them would take their bytes out of the KV pool.
    """
    tensors: list[torch.Tensor] = list(module.parameters())
    seen = {id(t) for t in tensors}
    for sub in module.modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buffer in sub.named_buffers(recurse=False):
            if name not in skip and id(buffer) not in seen:
                seen.add(id(buffer))
                tensors.append(buffer)
    return tensors


def buffer_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The non-persistent buffers: what the activation reserve holds besides temporaries."""
    weights = {id(t) for t in weight_tensors(module)}
    return [b for b in module.buffers() if id(b) not in weights]


def weight_allocation_bytes(module: nn.Module) -> int:
    """The weights as PyTorch's caching allocator holds them, tensor by tensor (gpuportal.wire.memory)."""
    from gpuportal.wire.memory import allocations_bytes

    return allocations_bytes(t.numel() * t.element_size() for t in weight_tensors(module))


def tensor_bytes_by_device(module: nn.Module) -> dict[str, int]:
    """{"cuda:0": bytes, "cpu": bytes, ...}: where the module's memory actually is."""
    sizes: Counter[str] = Counter()
    # parameters() and buffers() drop duplicates (tied weights) by identity.
    for tensor in (*module.parameters(), *module.buffers()):
        sizes[str(tensor.device)] += tensor.numel() * tensor.element_size()
    return dict(sizes)


def parameter_devices(module: nn.Module) -> set[str]:
    return {str(p.device) for p in module.parameters()}


def place_on_gpus(model: nn.Module, max_memory: MaxMemory, arena: Arena | None = None) -> nn.Module:
    """Dispatch a CPU model onto the GPUs that `max_memory` allows, with accelerate.

    One GPU needs no hooks: a plain move is enough and keeps forward() free of accelerate's
    per-module device checks. Several GPUs get a device map and the hooks that move activations.
    With `arena` (a sleeping replica's weights, inference.arena) the weights come out of it: one
    block copy per device instead of a copy per tensor; dispatch then finds them in place. Returns
    once they have landed (wake_on_gpus returns while they copy).
    """
    if arena is None:
        return _place(model, max_memory, None)[0]
    model, copies = wake_on_gpus(model, max_memory, arena)
    copies.wait()
    return model


def wake_on_gpus(
    model: nn.Module, max_memory: MaxMemory, arena: Arena, *, keep: bool = False
) -> tuple[nn.Module, PendingCopies]:
    """`place_on_gpus` out of `arena`, returning while the copies may still run: the caller does
    what needs only sizes and devices (the cap check, the KV pool), then waits on the handle
    before anything reads a weight (inference.arena.PendingCopies). With `keep` the wait keeps the
    arena for the next sleep (`PendingCopies.kept`) instead of freeing it."""
    model, copies = _place(model, max_memory, arena, keep=keep)
    assert copies is not None
    return model, copies


def _place(
    model: nn.Module, max_memory: MaxMemory, arena: Arena | None, *, keep: bool = False
) -> tuple[nn.Module, PendingCopies | None]:
    gpus = [k for k, v in max_memory.items() if isinstance(k, int) and v > 0]
    device_map: dict[str, Any]
    copies: PendingCopies | None = None
    try:
        if len(gpus) == 1:
            device_map = {"": gpus[0]}
            if arena is not None:
                from inference.arena import unpack_async

                copies = unpack_async(model, arena, device_map, keep=keep)
            model = model.to(f"cuda:{gpus[0]}")  # a no-op for what the arena placed
        else:
            from accelerate import dispatch_model, infer_auto_device_map

            device_map = infer_auto_device_map(
                model,
                max_memory=dict(max_memory),
                no_split_module_classes=getattr(model, "_no_split_modules", None),
            )
            if arena is not None:
                from inference.arena import unpack_async

                # What the map sends off the GPUs ("cpu", "disk": no room) lands on the CPU, where
                # dispatch treats it as today and the replica's check fails it as out of memory.
                copies = unpack_async(
                    model, arena, {k: v if isinstance(v, int) else "cpu" for k, v in device_map.items()}, keep=keep
                )
            # Dispatch reads devices, not values; any device work it queues follows the copies
            # on the current stream (unpack_async orders it so).
            model = dispatch_model(model, device_map=device_map)
    except BaseException:
        if copies is not None:
            copies.wait()  # nothing may still read the arena's pages once it is freed
            if copies.kept is not None:  # a failed wake keeps nothing: nobody would count it
                copies.kept.release()
        raise
    if hasattr(model, "hf_device_map"):
        # transformers reads it (generate, model.device helpers): it must describe where weights are now.
        model.hf_device_map = device_map
    return model, copies


def resolve_factory(source: str) -> Callable[[], Any]:
    """The callable named by 'package.module:factory' (the part after ':' may be dotted: 'mod:Class.build')."""
    if not _FACTORY_PATH.match(source):
        raise ValueError(f"not a factory path: {source!r} (expected 'package.module:factory')")
    module_name, attr_path = source.split(":", 1)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: any failure means the path is unusable
        raise ValueError(f"cannot import module {module_name!r} of factory {source!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise ValueError(f"factory {source!r} not found: {module_name!r} has no {attr_path!r}") from None
    if not callable(target):
        raise ValueError(f"factory {source!r} is not callable (it is a {type(target).__name__})")
    return target


def _model_dir(source: str) -> Path:
    root = local_model_dir(source)
    if not root.exists():
        raise ValueError(no_directory(source, root))
    if not root.is_dir():
        raise ValueError(f"not a model directory: {root} is not a directory")
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"not a model directory: no config.json in {root}")
    try:
        json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a model directory: {config} is not valid JSON ({exc})") from exc
    if not any(any(root.glob(pattern)) for pattern in _WEIGHT_GLOBS):
        raise ValueError(f"not a model directory: no weights in {root} (expected *.safetensors or pytorch_model*.bin)")
    return root


def _dtype_kwarg() -> str:
    # transformers 4.56 renamed torch_dtype to dtype; 5.x warns on the old name, <4.56 ignores the new.
    (version,) = from_transformers("__version__")
    major, minor = (int(part) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _load_transformers(
    root: Path,
    dtype: torch.dtype,
    device_map: str | dict[str, Any] | None,
    max_memory: MaxMemory | None,
    *,
    encoder: bool = False,
) -> nn.Module:
    # An encoder is loaded headless (AutoModel): its last hidden states are what embeddings pool.
    AutoModel, AutoModelForCausalLM = from_transformers("AutoModel", "AutoModelForCausalLM")

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False, _dtype_kwarg(): dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = dict(max_memory)
    return (AutoModel if encoder else AutoModelForCausalLM).from_pretrained(root, **kwargs)


def _load_torch_module(
    source: str, dtype: torch.dtype, device_map: str | dict[str, Any] | None, max_memory: MaxMemory | None
) -> nn.Module:
    from torch import nn

    model = resolve_factory(source)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"factory {source!r} returned a {type(model).__name__}, not a torch.nn.Module")
    # Module.to(dtype) casts floating tensors only: integer buffers (indices, masks) keep their type.
    model = model.to(dtype=dtype)
    if device_map is not None:
        if max_memory is None:
            raise ValueError("placing a torch-module model with a device_map needs max_memory")
        model = place_on_gpus(model, max_memory)
    return model


def factory_weight_bytes(source: str, dtype: str) -> int:
    """Bytes of the factory's module in `dtype`, counted on the meta device: no memory is
    allocated and nothing is initialised, so a large model costs nothing to measure."""
    import torch

    factory = resolve_factory(source)
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"factory {source!r} returned a {type(module).__name__}, not a torch.nn.Module")
    itemsize = torch_dtype(dtype).itemsize
    return sum(t.numel() * (itemsize if t.is_floating_point() else t.element_size()) for t in _tensors(module))


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
