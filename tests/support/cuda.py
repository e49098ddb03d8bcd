"""What the CUDA driver says of host memory, for the tests of inference.arena's page-locked arenas.

Only the tests ask it: the arena knows whether it registered its pages (Arena.pinned); the tests
check that the driver agrees, before and after the release."""

from __future__ import annotations

from typing import Any

import torch


def is_page_locked(tensor: torch.Tensor) -> bool | None:
    """Whether CUDA sees `tensor`'s memory as page-locked host memory (registered or allocated
    pinned); None when it cannot be asked (no driver, an error other than "not CUDA's memory").

    Not `Tensor.is_pinned()`: it only recognises blocks of torch's own caching host allocator, so
    it says False for an arena registered by inference.arena._host_buffer. The driver's
    cuPointerGetAttribute writes one unsigned int for the memory type; the runtime's
    cudaPointerGetAttributes fills a struct whose size grew between CUDA versions (read into a
    buffer sized for CUDA 11, it crashed the gpu tests on CUDA 13, 2026-11-26).
    """
    import ctypes

    driver = _cuda_driver()
    if driver is None:
        return None
    kind = ctypes.c_uint(0)
    error = driver.cuPointerGetAttribute(
        ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(tensor.data_ptr())
    )
    if error == _CUDA_ERROR_INVALID_VALUE:  # memory CUDA never registered: pageable
        return False
    if error != 0:
        return None
    return kind.value == _CU_MEMORYTYPE_HOST


# cuda.h: CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST, CUDA_ERROR_INVALID_VALUE.
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_MEMORYTYPE_HOST = 1
_CUDA_ERROR_INVALID_VALUE = 1


def _cuda_driver() -> Any | None:
    """The CUDA driver library (libcuda), through ctypes; None where there is none (the CPU)."""
    import ctypes

    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
