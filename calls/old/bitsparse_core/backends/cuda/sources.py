"""Locating the CUDA C++ sources, from a checkout or an installed wheel.

They live in the checkout's top-level ``kernels/`` folder and ship inside the wheel as
``bitsparse_core._kernels`` (pyproject.toml). That folder is not a Python package (no
``__init__.py``): a checkout's root is often first on ``sys.path``, and a package named
``kernels`` there would shadow the Hugging Face ``kernels`` package that transformers
imports (tests/test_packaging.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` / ``.cuh`` sources."""
    # A checkout's own sources first: an installed copy elsewhere may be stale.
    checkout = Path(__file__).resolve().parents[3] / "kernels"
    if (checkout / "bitsparse_common.cuh").is_file():
        return checkout
    spec = importlib.util.find_spec("bitsparse_core._kernels")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    raise FileNotFoundError("bitsparse_core's CUDA sources (kernels/) are missing from this install")


def read_source(name: str) -> str:
    return (kernel_dir() / name).read_text()
