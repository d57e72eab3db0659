"""Test-suite wiring: ``gpu`` tests skip cleanly on machines without a CUDA GPU."""

from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def cuda_gpu_present() -> bool:
    """True when CuPy or Numba can see at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        pass
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False  # the simulator "has" a GPU; gpu tests need a real one
    try:
        from numba import cuda
        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if cuda_gpu_present():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
