"""Giving a process's GPU memory back to the driver, down to its CUDA context."""

from __future__ import annotations

from typing import Any


def give_back_cached(torch: Any) -> None:
    """The caching allocator's free segments, and cuBLAS's workspaces first: torch allocates those
    through the allocator and holds them per handle and stream until told, so `empty_cache` alone
    leaves them (32 MiB on a Hopper GPU: what a sleeping replica still held on the H200 of
    2026-11-26, beside its context). The caller has synchronised: no kernel may still use them.
    The next matmul allocates a workspace again, inside the cap a wake or a takeover sets."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: absent in some builds
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
