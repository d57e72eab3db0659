"""Backends: the registry (:mod:`.registry`), the NumPy reference backend
(:mod:`.numpy`), and the two CUDA backends (:mod:`.cupy`, :mod:`.numba`) over the
one CUDA host layer they share (:mod:`.cuda`)."""

from __future__ import annotations

import importlib

from .registry import (Backend, backend_available, get_backend, register_backend,
                       registered_backends, select_backend)


def _factory(module: str, cls: str):
    """A factory importing ``module`` only when the backend is first used, so that
    ``import bitsparse_core`` never imports CuPy or Numba."""
    def make():
        return getattr(importlib.import_module(module, __name__), cls)()
    return make


# Priority order: for CUDA inputs, backend="auto" takes CuPy, then Numba.
register_backend("numpy", "cpu", _factory(".numpy", "NumpyBackend"))
register_backend("cupy", "cuda", _factory(".cupy.backend", "CupyBackend"))
register_backend("numba", "cuda", _factory(".numba.backend", "NumbaBackend"))

__all__ = ["Backend", "backend_available", "get_backend", "register_backend",
           "registered_backends", "select_backend"]
