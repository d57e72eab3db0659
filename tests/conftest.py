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


def _serialise_simulator_shared_arrays():
    """numba-cuda's simulator (FakeCUDAShared.array) creates a shared array on its
    first use with an unlocked check-then-set keyed by the calling line, so under
    CPU load two threads of one block can each get a private copy and stop sharing
    (seen as rare wrong planes in CI, old and new kernels alike). Same lookup, under
    a lock. The method is replaced, not wrapped: it finds its caller two frames up."""
    import sys
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    lock = threading.Lock()
    original = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    _serialise_simulator_shared_arrays()
