"""The bit-level float conversions and products of the numba backend, on the CPU.

:mod:`bitsparse_core.bitfloat` is the same source the GPU kernels compile; here
it is compiled with ``numba.njit`` and compared with ml_dtypes / NumPy:
widening of every 8- and 16-bit pattern, float32 -> dtype rounding on every
sign/exponent combination with the mantissas around each rounding boundary plus
random ones, and the float32 product (NaN operands, 0 * inf, subnormals). The
full 2**32 sweep of the rounding (run once by hand for every dtype: no mismatch)
takes minutes, too long for CI.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from bitsparse_core import bitfloat  # noqa: E402
from bitsparse_core import dtypes as D  # noqa: E402

SMALL = [D.BFLOAT16, D.FLOAT16, D.FLOAT8_E4M3FN, D.FLOAT8_E5M2]


@numba.njit
def _f32(u):
    return np.array([u], dtype=np.int64).astype(np.uint32).view(np.float32)[0]


@numba.njit
def _u32(f):
    return np.int64(np.array([f], dtype=np.float32).view(np.uint32)[0])


@pytest.fixture(scope="module")
def funcs():
    return {d.name: bitfloat.make(d.name, numba.njit, _f32, _u32) for d in D.ALL}


def _apply(fn, xs):
    @numba.njit
    def run(a, out):
        for i in range(a.size):
            out[i] = fn(np.int64(a[i]))
    out = np.empty(xs.size, dtype=np.int64)
    run(xs.astype(np.int64), out)
    return out


@pytest.mark.parametrize("dt", SMALL, ids=lambda d: d.name)
def test_widen_every_pattern(funcs, dt):
    pats = np.arange(1 << dt.bits, dtype=np.uint64).astype(dt.uint)
    want = pats.view(dt.numpy).astype(np.float32).view(np.uint32).astype(np.int64)
    got = _apply(funcs[dt.name].widen, pats)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(pats[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def _rounding_sample(rng):
    """Every sign and exponent with mantissas at and around each rounding boundary."""
    mants = set(rng.integers(0, 1 << 23, 400).tolist())
    for s in range(1, 24):                       # s = bits dropped (more for subnormals)
        half = 1 << (s - 1)
        for base in (0, 1 << s, (1 << 23) - (1 << s)):
            for d in (-1, 0, 1):
                for lsb in (0, 1 << s):
                    m = base + lsb + half + d
                    if 0 <= m < (1 << 23):
                        mants.add(m)
    mants |= {0, 1, (1 << 23) - 1, 1 << 22, (1 << 22) + 1}
    m = np.array(sorted(mants), dtype=np.uint64)
    se = np.arange(512, dtype=np.uint64) << np.uint64(23)
    return (se[:, None] | m[None, :]).reshape(-1).astype(np.uint32)


@pytest.mark.parametrize("dt", SMALL, ids=lambda d: d.name)
def test_narrow_rounding(funcs, dt):
    rng = np.random.default_rng(7)
    pats = _rounding_sample(rng)
    with np.errstate(all="ignore"):
        want = pats.view(np.float32).astype(dt.numpy).view(dt.uint).astype(np.int64)
    got = _apply(funcs[dt.name].narrow, pats)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(pats[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def _f32_specials():
    return np.array([0, 0x80000000, 1, 0x807fffff, 0x00800000, 0x3f800000, 0xbf800000,
                     0x7f7fffff, 0x7f800000, 0xff800000, 0x7f800001, 0xffc12345, 0x7fc00000,
                     0x3f000000, 0x1f800000, 0x5f800000, 0x40000000], dtype=np.uint32)


def test_fmul_matches_numpy(funcs):
    rng = np.random.default_rng(11)
    n = 200_000
    a = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    sp = _f32_specials()
    a[: n // 4] = rng.choice(sp, n // 4)
    b[n // 8: n // 2] = rng.choice(sp, n // 2 - n // 8)
    # Products of two small-exponent values land in the subnormal range.
    a[-1000:] = (a[-1000:] & 0x807fffff) | (rng.integers(60, 80, 1000).astype(np.uint32) << 23)
    b[-1000:] = (b[-1000:] & 0x807fffff) | (rng.integers(40, 70, 1000).astype(np.uint32) << 23)
    fa, fb = a.view(np.float32), b.view(np.float32)
    both_nan = np.isnan(fa) & np.isnan(fb)      # NumPy's pick then depends on its loop
    invalid = ((fa == 0) & np.isinf(fb)) | (np.isinf(fa) & (fb == 0))
    keep = ~both_nan
    if platform.machine().lower() not in ("x86_64", "amd64"):
        keep &= ~invalid                         # the default NaN is x86's 0xFFC00000
    a, b = a[keep], b[keep]
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) * b.view(np.float32)).view(np.uint32).astype(np.int64)
    fmul = funcs["float32"].fmul

    @numba.njit
    def run(x, y, out):
        for i in range(x.size):
            out[i] = fmul(np.int64(x[i]), np.int64(y[i]))
    got = np.empty(a.size, dtype=np.int64)
    run(a, b, got)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(a[i]), hex(b[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
