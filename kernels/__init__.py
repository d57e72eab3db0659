"""CUDA C++ sources compiled at run time by CuPy's RawModule.

This folder ships inside the wheel as ``bitsparse_core._kernels`` (see
pyproject.toml); :func:`bitsparse_core.kernel_sources.kernel_dir` finds it both
from a checkout and from an installed package.
"""
