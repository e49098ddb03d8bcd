"""A deployment's LoRA adapters (gpuportal.wire.adapters), read from PEFT's files and applied by
the paged engine (inference.paged) row by row, so that one batch mixes the base model and any of
its adapters.

PEFT saves an adapter as adapter_config.json and adapter_model.safetensors, whose tensors are
`...layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]; a
projection's output gains `B(A x) * alpha / r` (`alpha / sqrt(r)` with rsLoRA). PEFT itself wraps
the model's modules, and its mixed batches split each forward by adapter through hooks on the
modules' own calls; the paged engine calls the projections itself, so it keeps each adapted
projection's A and B stacked, one row per adapter, and adds a sequence's adapter's term where it
calls the projection. Only what that term covers is served: a variant that changes more (DoRA,
biases, extra modules or tokens, patterns of alpha) is refused by name, at the deploy.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpuportal.wire import memory

if TYPE_CHECKING:
    import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")\.lora_([AB])(?:\.[^.]+)?\.weight"
)
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# PEFT config fields whose any value but their default changes what a LoRA computes beyond B(A x).
_REFUSED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out",
    "modules_to_save": "modules_to_save (whole modules trained beside the LoRA)",
    "alpha_pattern": "alpha_pattern",
    "lora_bias": "lora_bias",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "use_qalora": "QALoRA",
    "use_bdlora": "BD-LoRA",
}

# (layer, projection): where a term is added.
Key = tuple[int, str]
T = TypeVar("T")


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: its A and B per projection (on the host, as saved) and its scale."""

    name: str
    source: str
    alpha: float
    rslora: bool
    tensors: Mapping[Key, tuple[Any, Any]]

    def scale(self, rank: int) -> float:
        return self.alpha / (math.sqrt(rank) if self.rslora else rank)


@dataclass
class Stack:
    """One projection's adapters stacked: A [adapters, R, in], B [adapters, out, R] with each
    adapter's scale folded in (R the largest rank; a smaller one, or an adapter that does not
    touch this projection, padded with zeros, which add nothing)."""

    a: torch.Tensor
    b: torch.Tensor


def directory_of(source: str) -> Path:
    from inference.hub import local_model_dir

    return local_model_dir(source)


def read_config(name: str, directory: Path) -> dict[str, Any]:
    """The adapter's PEFT config, or ValueError naming why it cannot be served."""
    try:
        config = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"adapter {name!r}: {directory} has no {CONFIG} (a PEFT LoRA adapter's directory)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"adapter {name!r}: cannot read {directory / CONFIG}: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: {CONFIG} is not a JSON object")
    if config.get("peft_type") != "LORA":
        kind = config.get("peft_type")
        raise ValueError(f"adapter {name!r}: a {kind!r} adapter; only LoRA (peft_type LORA) is served")
    for field, what in _REFUSED.items():
        if config.get(field):
            raise ValueError(f"adapter {name!r}: {what} is not served (only LoRA's B(A x) on the projections)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias {config.get('bias')!r} is not served (only bias 'none')")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    if not (directory / WEIGHTS).is_file():
        raise ValueError(f"adapter {name!r}: {directory} has no {WEIGHTS}")
    return config


def paired(name: str, tensors: Iterable[tuple[str, T]], shape_of: Callable[[T], list[int]]) -> dict[Key, tuple[T, T]]:
    """The adapter's tensors (or their shapes) by name, as each projection's (A, B); ValueError
    naming a tensor that is no LoRA A or B of a layer's projection, or an A and B that do not pair."""
    halves: dict[Key, dict[str, T]] = {}
    for tensor, value in tensors:
        found = _TENSOR.fullmatch(tensor)
        if found is None:
            raise ValueError(
                f"adapter {name!r}: {tensor} is not a LoRA A or B of a layer's projection "
                f"({', '.join(PROJECTIONS)}): not served"
            )
        halves.setdefault((int(found[1]), found[2]), {})[found[3]] = value
    pairs: dict[Key, tuple[T, T]] = {}
    for key, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        a_shape, b_shape = (shape_of(a), shape_of(b)) if a is not None and b is not None else ([], [])
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] < 1:
            raise ValueError(
                f"adapter {name!r}: layer {key[0]}'s {key[1]} has no matching lora_A [r, in] and lora_B [out, r]"
            )
        pairs[key] = (a, b)
    if not pairs:
        raise ValueError(f"adapter {name!r}: {WEIGHTS} holds no LoRA tensors")
    return pairs


def tensor_shapes(name: str, directory: Path) -> dict[Key, tuple[list[int], list[int]]]:
    """Each adapted projection's (A's shape, B's shape), read from the file's header alone."""
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS), framework="pt") as weights:
        shapes = [(tensor, list(weights.get_slice(tensor).get_shape())) for tensor in weights.keys()]  # noqa: SIM118
    return paired(name, shapes, list)


def stacked_sizes(shapes: list[Mapping[Key, tuple[list[int], list[int]]]]) -> dict[Key, tuple[int, int, int]]:
    """(R, in, out) of each projection's stack, over every adapter's shapes."""
    sizes: dict[Key, tuple[int, int, int]] = {}
    for adapter in shapes:
        for key, ((rank, fan_in), (fan_out, _)) in adapter.items():
            was = sizes.get(key)
            if was is not None and (was[1], was[2]) != (fan_in, fan_out):
                raise ValueError(
                    f"layer {key[0]}'s {key[1]}: adapters of [{fan_out} x {fan_in}] and [{was[2]} x {was[1]}] "
                    "cannot be of one model"
                )
            sizes[key] = (max(rank, was[0] if was else 0), fan_in, fan_out)
    return sizes


def stacked_bytes(shapes: list[Mapping[Key, tuple[list[int], list[int]]]], dtype: str) -> int:
    """What the stacks of these adapters take on the GPU, as the caching allocator holds them:
    what the scheduler counts beside the weights, and the replica sizes its KV pool after."""
    count, element = len(shapes), memory.dtype_bytes(dtype)
    return memory.allocations_bytes(
        size
        for rank, fan_in, fan_out in stacked_sizes(shapes).values()
        for size in (count * rank * fan_in * element, count * fan_out * rank * element)
    )


def reading_bytes(named: Mapping[str, str], dtype: str) -> int:
    """The stacks' bytes of the adapters `named` ({name: source}), from their files' headers: what
    a node reads at a deploy (inference.inspection). ValueError naming the adapter at fault."""
    shapes = []
    for name, source in named.items():
        directory = directory_of(source)
        read_config(name, directory)
        shapes.append(tensor_shapes(name, directory))
    return stacked_bytes(shapes, dtype) if shapes else 0


class Adapters:
    """A replica's adapters, in the order the deployment names them (a sequence's adapter is its
    index here), held on the host; `stacks` puts them where the model is."""

    def __init__(self, adapters: list[Adapter]):
        self.adapters = adapters
        self.names = tuple(a.name for a in adapters)
        self._shapes = [{k: (list(a.shape), list(b.shape)) for k, (a, b) in x.tensors.items()} for x in adapters]

    @classmethod
    def read(cls, named: Mapping[str, str]) -> Adapters:
        """Read every adapter's files (ValueError naming the one at fault)."""
        from safetensors.torch import load_file

        adapters = []
        for name, source in named.items():
            directory = directory_of(source)
            config = read_config(name, directory)
            tensors = paired(name, load_file(str(directory / WEIGHTS)).items(), lambda t: list(t.shape))
            adapters.append(Adapter(name, source, float(config["lora_alpha"]), bool(config.get("use_rslora")), tensors))
        read = cls(adapters)
        stacked_sizes(read._shapes)  # adapters of two models: refused here, not at a wake
        return read

    def index(self, name: str) -> int:
        """The adapter's row in every stack; ValueError naming the adapters there are."""
        try:
            return self.names.index(name)
        except ValueError:
            there = ", ".join(self.names) or "none"
            raise ValueError(f"no adapter {name!r} (its adapters: {there})") from None

    def nbytes(self, dtype: str) -> int:
        return stacked_bytes(self._shapes, dtype)

    def check_fits(self, model: Any) -> None:
        """ValueError unless every adapted projection is one of the model's, of the same shape."""
        layers = model.model.layers
        for adapter in self.adapters:
            for (layer, projection), (a, b) in adapter.tensors.items():
                if layer >= len(layers):
                    raise ValueError(f"adapter {adapter.name!r}: layer {layer}, but the model has {len(layers)}")
                module = _projection(layers[layer], projection)
                if module is None or tuple(module.weight.shape) != (b.shape[0], a.shape[1]):
                    has = "none" if module is None else "x".join(map(str, module.weight.shape))
                    raise ValueError(
                        f"adapter {adapter.name!r}: layer {layer}'s {projection} is [{b.shape[0]} x {a.shape[1]}] in "
                        f"the adapter and {has} in the model: an adapter of another model"
                    )

    def stacks(self, dtype: torch.dtype, device: torch.device) -> dict[Key, Stack]:
        """Every adapted projection's stack, made on `device` in `dtype` (at each load and wake)."""
        import torch

        stacks: dict[Key, Stack] = {}
        count = len(self.adapters)
        for key, (rank, fan_in, fan_out) in stacked_sizes(self._shapes).items():
            a = torch.zeros((count, rank, fan_in), dtype=dtype, device=device)
            b = torch.zeros((count, fan_out, rank), dtype=dtype, device=device)
            for row, adapter in enumerate(self.adapters):
                pair = adapter.tensors.get(key)
                if pair is None:
                    continue
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                a[row, :r] = lora_a.to(device=device, dtype=dtype)
                # The scale folded into B: one multiply fewer per step. In float32 first, so a
                # bfloat16 B is rounded once, as PEFT's own (unscaled B, scaled output) rounds it.
                b[row, :, :r] = (lora_b.float() * adapter.scale(r)).to(device=device, dtype=dtype)
            stacks[key] = Stack(a, b)
        return stacks


def _projection(layer: Any, projection: str) -> Any:
    part = layer.self_attn if projection in PROJECTIONS[:4] else layer.mlp
    return getattr(part, projection, None)


def grouped(adapters: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """(adapter, its rows in the batch) for each adapter the batch's sequences use (-1: none)."""
    import torch

    rows: dict[int, list[int]] = {}
    for row, adapter in enumerate(adapters):
        if adapter >= 0:
            rows.setdefault(adapter, []).append(row)
    return [(adapter, torch.tensor(at, dtype=torch.long, device=device)) for adapter, at in rows.items()]


def add_terms(
    out: torch.Tensor, x: torch.Tensor, stack: Stack | None, groups: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """`out` (a projection of `x`, [batch, tokens, out]) with each group's adapter's term added
    to its rows."""
    if stack is None:
        return out
    for adapter, rows in groups:
        term = (x[rows] @ stack.a[adapter].transpose(0, 1)) @ stack.b[adapter].transpose(0, 1)
        out.index_add_(0, rows, term)
    return out
