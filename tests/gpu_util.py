"""Shared helpers of the GPU test modules (CuPy and Numba backends).

``require_cuda(module)`` skips the calling test module cleanly where the
package or a CUDA device is missing (CI has no GPU), without relying on a
conftest. The data helpers draw bit patterns that stress a codec: exact zeros
at a chosen sparsity, -0.0, NaNs with payloads, infinities and subnormals.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from bitsparse_core import dtypes as _dt


def find_nvcc():
    """Path of an nvcc (PATH, $CUDA_HOME, /usr/local/cuda), or None: CI has none."""
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    return None


def require_cuda(module: str = "cupy"):
    """Import ``module`` or skip the whole test module; also skip without a device."""
    mod = pytest.importorskip(module)
    try:
        if module == "cupy":
            ok = mod.cuda.runtime.getDeviceCount() > 0
        elif module in ("numba", "numba.cuda"):
            from numba import cuda
            ok = cuda.is_available()
        else:
            ok = True
    except Exception as exc:  # noqa: BLE001 -- a missing driver shows up as many error types
        pytest.skip(f"no usable CUDA device ({exc})", allow_module_level=True)
    if not ok:
        pytest.skip("no CUDA device", allow_module_level=True)
    return mod


def special_patterns(dt: _dt.DType) -> np.ndarray:
    """Bit patterns a codec must carry unchanged: -0.0, NaN payloads, inf, subnormals."""
    b, s = dt.bits, dt.sign_mask
    m = (1 << (b - 1)) - 1
    vals = {s, 1, s | 1, m, s | m, 2, m - 1}                # -0, min subnormal, all-ones (NaN)
    if dt.name == "float8_e4m3fn":
        vals |= {0x7f, 0xff, 0x7e, 0x08, 0x07}
    elif dt.name == "float8_e5m2":
        vals |= {0x7c, 0xfc, 0x7d, 0x7e, 0xfe, 0x03}
    elif b == 16 and dt.name == "bfloat16":
        vals |= {0x7f80, 0xff80, 0x7f81, 0xffc1, 0x7fc0, 0x0001, 0x807f}
    elif b == 16:
        vals |= {0x7c00, 0xfc00, 0x7c01, 0xfe55, 0x7e00, 0x03ff, 0x8001}
    else:
        vals |= {0x7f800000, 0xff800000, 0x7f800001, 0xffc12345, 0x007fffff, 0x80000001}
    return np.array(sorted(vals), dtype=np.uint64).astype(dt.uint)


def random_bits(rng, shape, dt: _dt.DType, sparsity: float, *, signs: bool = True) -> np.ndarray:
    """Random bit patterns with about ``sparsity`` exact zeros and a sprinkle of specials.

    ``signs=False`` clears every sign bit (legal for encoding='nosign')."""
    n = int(np.prod(shape, dtype=np.int64))
    bits = rng.integers(0, 1 << dt.bits, n, dtype=np.uint64).astype(dt.uint)
    sp = special_patterns(dt)
    k = rng.random(n) < 0.05
    bits[k] = rng.choice(sp, int(k.sum()))
    bits[rng.random(n) < sparsity] = 0
    if not signs:
        bits &= np.array(dt.sign_mask - 1, dtype=dt.uint)
    return bits.view(dt.numpy).reshape(shape)


# --------------------------------------------------------------------------- #
# Comparisons shared by the CuPy and Numba test modules                       #
# --------------------------------------------------------------------------- #
def fresh_rng(request):
    """A generator with a fresh seed, printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy % (1 << 32)
    print(f"seed={seed} for {request.node.name}")
    return np.random.default_rng(seed)


def device_bits(arr: np.ndarray):
    """A CuPy array holding ``arr``'s bits (CuPy has no bf16 / fp8: pass ``dtype=``)."""
    import cupy as cp
    return cp.asarray(arr.copy(order="C").view(_dt.resolve(arr.dtype).uint))


def plane_bytes(p, name: str) -> np.ndarray:
    """Plane ``name`` of ``p`` (from any backend) as host bytes."""
    plane = p.backend.to_numpy(getattr(p, name))
    return np.asarray(plane).view(np.uint8).reshape(-1)


def assert_same_planes(p, ref, where: str = "") -> None:
    """``p`` and ``ref`` agree in metadata and byte for byte in every plane."""
    assert p.shape == ref.shape and p.dtype == ref.dtype, where
    assert p.encoding == ref.encoding, f"{where}: {p.encoding} vs {ref.encoding}"
    assert p.capacity == ref.capacity and p.nnz == ref.nnz, where
    for name in ("mask", "offsets", "values", "signs"):
        got, want = plane_bytes(p, name), plane_bytes(ref, name)
        assert got.size == want.size, f"{where}: {name} has {got.size} bytes, want {want.size}"
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            pytest.fail(f"{where}: {name} differs at {bad.size} bytes, first {bad[:8]} "
                        f"(got {got[bad[:8]]}, want {want[bad[:8]]}) of {got.size}")


def assert_same_bits(got: np.ndarray, want: np.ndarray, where: str = "") -> None:
    """A host copy of a dense result equals ``want`` bit for bit."""
    dt = _dt.resolve(want.dtype)
    assert got.shape == want.shape, where
    g = got.view(dt.uint).reshape(-1)
    w = want.copy(order="C").view(dt.uint).reshape(-1)
    if not np.array_equal(g, w):
        bad = np.flatnonzero(g != w)
        pytest.fail(f"{where}: {bad.size} elements differ, first at {bad[:5]}: "
                    f"got {[hex(v) for v in g[bad[:5]]]}, want {[hex(v) for v in w[bad[:5]]]}")
