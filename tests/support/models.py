"""Factories for the torch-module loader, named by dotted path (`tests.support.models:tiny_mlp`):
replica processes import this module, so its imports stay light (no Django, no transformers)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_mlp() -> nn.Module:
    """A factory for the torch-module loader: ~0.3 MiB of float32 weights and a buffer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64), nn.BatchNorm1d(64))


def big_mlp() -> nn.Module:
    """256 MiB of float32 weights: big enough for NVML to tell it apart from a CUDA context (gpu tests)."""
    return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(4)))
