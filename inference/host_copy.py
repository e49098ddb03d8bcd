"""A deep sleeper's weights in its node's host memory: the host copy.

A replica asleep keeps its process and CUDA context (hundreds of MiB of GPU memory each) so that a
wake is only a copy. Sleeping deeply, it gives those up: its process writes the weights it holds in
its host arena to one file in the node's shared memory (`folder()`, /dev/shm by default: RAM, not
disk), then exits. The file is the node's, not the process's: it outlives the replica's process,
the agent deletes it when the replica stops or leaves the host cache, and the control plane counts
it in the node's host cache like a sleeper's arena (scheduling.services.host_cache).

A wake starts a fresh process that builds the model's skeleton on the meta device from its
source's configuration (no weight read from disk: `inference.loaders.empty_model`), points it at
the copy's tensors (`assign`), packs them into an arena and copies that to the GPU as a wake from
the first level does (inference.arena). It deletes the copy once the weights are in its own memory.

The file is `torch.save` of every parameter and buffer (non-persistent ones too: a skeleton's
rotary tables are empty), tied tensors once. The arena's views share one storage, so the file is
that storage written once, in order; `torch.load(mmap=True, weights_only=True)` reads it back
without a pickle that could run code.

No Django here: the replica process and the agent both use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

# Where a node keeps its host copies; default: a folder of /dev/shm (RAM), else the temp folder.
FOLDER_ENV = "GPUPORTAL_HOST_COPY_DIR"
SUFFIX = ".pt"


def folder() -> Path:
    """The node's folder of host copies: the operator's, else one of this user's in /dev/shm."""
    configured = os.environ.get(FOLDER_ENV, "").strip()
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"gpuportal-host-copies-{os.getuid()}"


def node_folder(log_dir: str | Path) -> Path:
    """One agent's host copies: a folder of `folder()` named after its replicas' folder, since two
    portals on one host may both run a node `local` (and list their own copies at registration)."""
    digest = hashlib.sha256(str(Path(log_dir).resolve()).encode()).hexdigest()[:16]
    return folder() / digest


def held(where: Path) -> list[str]:
    """The replica ids whose host copies are in `where`."""
    try:
        return sorted(p.name.removesuffix(SUFFIX) for p in where.iterdir() if p.name.endswith(SUFFIX))
    except FileNotFoundError:
        return []


def path_of(where: Path, replica_id: str) -> Path:
    return where / f"{replica_id}{SUFFIX}"


def save(model: nn.Module, path: Path) -> int:
    """Write the model's tensors to `path` (atomically: a crash leaves no half copy under its name);
    returns the file's size. Only its owner may read it: a model's weights may be private."""
    import torch

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        # A tied tensor is one object under two names: pickled once, it loads as one object again.
        tensors[name] = by_id.setdefault(id(tensor), tensor.detach())
    partial = path.with_name(path.name + ".partial")
    try:
        with os.fdopen(_create(partial), "wb") as out:
            torch.save(tensors, out)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def _create(partial: Path) -> int:
    flags, mode = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
    try:
        return os.open(partial, flags, mode)
    except FileNotFoundError:
        # An agent leaving removed the folder, empty, after this process made it (tidy).
        partial.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return os.open(partial, flags, mode)


def tidy(where: Path) -> bool:
    """Remove a node's folder of host copies once it holds none (its agent is leaving), so that
    agents gone leave no empty folders behind; whether it went. One holding a copy stays: the
    next agent of the node offers it."""
    try:
        where.rmdir()
    except OSError:  # not empty, already gone, or not ours to remove
        return False
    return True


def load(path: Path) -> dict[str, torch.Tensor]:
    """The copy's tensors by name, mapped from the file rather than read into private memory."""
    import torch

    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point a skeleton's parameters and buffers at the copy's tensors, keeping ties (one tensor
    under two names becomes one Parameter in both places). ValueError when the copy does not fit
    the skeleton: a tensor it lacks, or one of another shape."""
    from torch import nn

    made: dict[int, nn.Parameter] = {}
    for name, current in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if name not in tensors:
            raise ValueError(f"the host copy has no tensor {name!r}")
        tensor = tensors[name]
        if tensor.shape != current.shape:
            raise ValueError(f"the host copy's {name!r} is {tuple(tensor.shape)}, the model's {tuple(current.shape)}")
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._parameters:
            owner._parameters[attr] = made.setdefault(id(tensor), nn.Parameter(tensor, requires_grad=False))
        else:
            owner._buffers[attr] = tensor


def forget(path: Path) -> bool:
    """Delete a host copy; whether there was one."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return True
    return False
