"""The CUDA C++ kernels (kernels/*.cu), compiled by CuPy's RawModule and cached.

Kernels are templates over the element format, the encoding and the fused
operation, compiled on first use for the device's own architecture (CuPy builds
a cubin for the current device, and keeps it in its on-disk cache) and kept per
device. :func:`function` returns the raw ``CUfunction`` handle the launch layer
(:mod:`..cuda.driver`) calls. The ABI header (ids, block geometry) is generated
from :mod:`..cuda.abi` and prepended to every source.

``BITSPARSE_CUDA_OPTIONS`` (environment) adds NVRTC options to every compile,
e.g. ``-D`` switches when timing kernel variants (bench/kernel_variants.py).
"""

from __future__ import annotations

import os
import threading

from ... import dtypes as _dt
from ...spec.format import Encoding
from ..cuda import abi
from ..cuda.sources import read_source

_FUNCTIONS: dict = {}
_LOCK = threading.Lock()


def _source(file: str) -> str:
    common = read_source("bitsparse_common.cuh").replace("#pragma once", "")
    common = common.replace('#include "bitsparse_abi.h"', abi.header().replace("#pragma once", ""))
    return common + "\n" + read_source(file)


def kernel_spec(kind: str, *args) -> tuple:
    """(file, name) of a kernel; ``name`` is a name expression for templates."""
    args = tuple(int(a) for a in args)
    if kind == "pack":
        return "bitsparse_pack.cu", "bitsparse_pack<%d,%d,%d,%d>" % args
    if kind == "unpack":
        return "bitsparse_unpack.cu", "bitsparse_unpack<%d,%d,%d,%d,%d>" % args
    if kind == "mask_select":
        return "bitsparse_unpack.cu", "bitsparse_mask_select<%d>" % args
    if kind == "tile_counts":
        return "bitsparse_unpack.cu", "bitsparse_tile_counts<%d,%d>" % args
    if kind == "set_condition":
        return "bitsparse_graph.cu", "bitsparse_set_condition"
    raise KeyError(kind)


def get_kernel(device: int, kind: str, *args):
    """The compiled ``cupy.RawKernel``-like function, built once per device."""
    key = (device, kind) + tuple(int(a) for a in args)
    k = _FUNCTIONS.get(key)
    if k is not None:
        return k
    import cupy
    with _LOCK:
        k = _FUNCTIONS.get(key)
        if k is None:
            file, name = kernel_spec(kind, *args)
            templated = "<" in name
            with cupy.cuda.Device(device):
                extra = tuple(os.environ.get("BITSPARSE_CUDA_OPTIONS", "").split())
                mod = cupy.RawModule(code=_source(file), options=("-std=c++17",) + extra,
                                     name_expressions=(name,) if templated else None)
                k = mod.get_function(name)
            _FUNCTIONS[key] = k
    return k


def function(device: int, kind: str, *args) -> int:
    """The ``CUfunction`` handle of a kernel on ``device`` (compiled on first use)."""
    return int(get_kernel(device, kind, *args).kernel.ptr)


def all_kernel_keys(sweep_rounds=()) -> list:
    """Every kernel the backend can launch (for warming the compile cache), plus
    plain pack / unpack of bf16 and fp8 at ``sweep_rounds`` (the bench)."""
    keys = []
    encs = [int(e) for e in Encoding]
    rp = abi.PACK_ROUNDS
    for name, fmt in abi.FMT_OF.items():
        dt = _dt.resolve(name)
        ru = abi.unpack_rounds(dt, abi.Op.RELU2)
        for enc in encs:
            for mode in (abi.Mode.RELU, abi.Mode.RELU2, abi.Mode.RELU_GATED):
                keys.append(("pack", fmt, enc, mode, rp))
            for op in (abi.Op.RELU2, abi.Op.RELU2_AND_SQUARE):
                keys.append(("unpack", fmt, op, ru, enc, 0))
            keys.append(("unpack", fmt, abi.Op.GATED_DENSE, ru, enc, 0))
            for uenc in encs:
                for op in (abi.Op.GATED, abi.Op.GATED_PRODUCT):
                    keys.append(("unpack", fmt, op, ru, enc, uenc))
    for bits, fmt in sorted(abi.BITS_FMT.items()):
        dt = _dt.resolve({8: "float8_e4m3fn", 16: "bfloat16", 32: "float32"}[bits])
        ru = abi.unpack_rounds(dt, abi.Op.UNPACK)
        for enc in encs:
            keys.append(("pack", fmt, enc, abi.Mode.PACK, abi.PACK_ROUNDS))
            keys.append(("pack", fmt, enc, abi.Mode.MASKED, abi.PACK_ROUNDS))
            keys.append(("unpack", fmt, abi.Op.UNPACK, ru, enc, 0))
        keys += [("mask_select", fmt), ("tile_counts", fmt, ru),
                 ("tile_counts", fmt, abi.unpack_rounds(dt, abi.Op.RELU2))]
    for r in sweep_rounds:
        for fmt in (abi.Fmt.BF16, abi.Fmt.E4M3):
            keys += [("pack", fmt, int(Encoding.NOSIGN), abi.Mode.PACK, r),
                     ("unpack", fmt, abi.Op.UNPACK, r, int(Encoding.NOSIGN), 0)]
    return list(dict.fromkeys(tuple(int(a) if not isinstance(a, str) else a for a in k)
                              for k in keys))


def _warm_worker(keys):
    import cupy
    for key in keys:
        get_kernel(cupy.cuda.runtime.getDevice(), *key)
    return len(keys)


def warm_cache(processes: int = 8, keys=None, sweep_rounds=()) -> int:
    """Compile kernels in parallel processes so that CuPy's on-disk cache holds them;
    later processes (and this one) then only load cubins."""
    import multiprocessing as mp
    keys = list(keys or all_kernel_keys(sweep_rounds))
    processes = max(1, min(processes, len(keys)))
    parts = [keys[i::processes] for i in range(processes)]
    with mp.get_context("spawn").Pool(processes) as pool:
        return sum(pool.map(_warm_worker, parts))
