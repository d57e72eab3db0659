"""The kernels' float arithmetic (kernels/bitsparse_common.cuh), run as host C++.

The fused GPU ops must round exactly as reference_ops does through NumPy and
ml_dtypes. The conversions and the product are plain integer code shared by
host and device, so they are checked here on the CPU against NumPy: every
16-bit and 8-bit pattern, and a dense sweep of float32 patterns. Skips where no
C++ compiler is installed.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from bitsparse_core import dtypes as _dt
from bitsparse_core.backends.cuda.sources import kernel_dir
from bitsparse_core.spec.ops import mul_f32

FMT = {"bfloat16": 0, "float16": 1, "float32": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}

_SHIM = r"""
#include <type_traits>
#include "bitsparse_common.cuh"
#define DISPATCH(F, ...) switch (fmt) { \
    case 0: F<0>(__VA_ARGS__); break; case 1: F<1>(__VA_ARGS__); break; \
    case 2: F<2>(__VA_ARGS__); break; case 3: F<3>(__VA_ARGS__); break; \
    default: F<4>(__VA_ARGS__); }
template <int F> static void from_f32(const u32* in, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_from_f32<F>(in[i]); }
template <int F> static void to_f32(const u32* in, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_to_f32<F>(in[i]); }
template <int F> static void mul_round(const u32* a, const u32* b, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_mul_round<F>(a[i], b[i]); }
template <int F> static void relu2(const u32* g, const u32* r, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_relu2_grad<F>(g[i], r[i]); }
template <int F> static void relu(const u32* a, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_relu_keeps<F>(a[i]) ? a[i] : 0u; }
template <int F> static void relu_word(const u32* w, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_relu_word<F>(w[i]); }
template <int F> static void fused_word(int op, const u32* a, const u32* b, const u32* c, u32* out,
                                        u32* nan, long n) {
    for (long i = 0; i < n; ++i) {
        bool f = false;
        out[i] = op == 0 ? bs_word_f32<F>(a[i], b[i], c[i], BsRelu2Grad(), f)
               : op == 1 ? bs_word_f32<F>(a[i], b[i], c[i], BsSquare(), f)
               : op == 2 ? bs_word_f32<F>(a[i], b[i], c[i], BsProduct(), f)
               : bs_word_f32<F>(a[i], b[i], c[i], BsGatedProduct(), f);
        nan[i] = f; } }
extern "C" {
void bs_relu_w(int fmt, const u32* w, u32* out, long n) { DISPATCH(relu_word, w, out, n) }
void bs_fused_w(int fmt, int op, const u32* a, const u32* b, const u32* c, u32* out, u32* nan,
                long n) {
    switch (fmt) { case 0: fused_word<0>(op, a, b, c, out, nan, n); break;
                   case 1: fused_word<1>(op, a, b, c, out, nan, n); break;
                   default: fused_word<2>(op, a, b, c, out, nan, n); } }
void bs_from(int fmt, const u32* in, u32* out, long n) { DISPATCH(from_f32, in, out, n) }
void bs_to(int fmt, const u32* in, u32* out, long n) { DISPATCH(to_f32, in, out, n) }
void bs_mul(int fmt, const u32* a, const u32* b, u32* out, long n) { DISPATCH(mul_round, a, b, out, n) }
void bs_relu2(int fmt, const u32* g, const u32* r, u32* out, long n) { DISPATCH(relu2, g, r, out, n) }
void bs_relu(int fmt, const u32* a, u32* out, long n) { DISPATCH(relu, a, out, n) }
}
#define BY_BITS(F, ...) switch (bits) { case 8: F<8>(__VA_ARGS__); break; \
    case 16: F<16>(__VA_ARGS__); break; default: F<32>(__VA_ARGS__); }
template <int B> static void nonzero(const u32* w, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_word_nonzero<B>(w[i]); }
template <int B> static void quad_nonzero(const u32* w, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_quad_nonzero<B>(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]); }
template <int B, int W> static void window_w(const void* v, const u32* b, u32* out, long n) {
    typedef typename std::conditional<B == 8, u8, typename std::conditional<B == 16, u16, u32>::type>::type T;
    for (long i = 0; i < n; ++i) out[i] = bs_stream_window<W>(static_cast<const T*>(v), b[i]); }
template <int B> static void window(int raw, const void* v, const u32* b, u32* out, long n) {
    if (raw) window_w<B, B>(v, b, out, n); else window_w<B, B - 1>(v, b, out, n); }
template <int B> static void spread(int raw, const u32* c, u32* out, long n) {
    for (long i = 0; i < n; ++i)
        out[i] = raw ? bs_spread<B, B>(c[i]) : bs_spread<B, B - 1>(c[i]); }
template <int B> static void spread_signs(const u32* s, u32* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = bs_spread_signs<B>(s[i]); }
template <int B> static void expand(const u32* vals, const u32* j, const u32* mb, u32* out, long n) {
    u32 sel[16];
    for (u32 k = 0; k < 16; ++k) sel[k] = bs_byte_selector(k);
    for (long i = 0; i < n; ++i) out[i] = bs_expand_word<B>(vals, j[i], mb[i], sel); }
extern "C" {
void bs_nonzero(int bits, const u32* w, u32* out, long n) { BY_BITS(nonzero, w, out, n) }
void bs_quad(int bits, const u32* w, u32* out, long n) { BY_BITS(quad_nonzero, w, out, n) }
void bs_window(int bits, int raw, const void* v, const u32* b, u32* out, long n) {
    BY_BITS(window, raw, v, b, out, n) }
void bs_spread_c(int bits, int raw, const u32* c, u32* out, long n) { BY_BITS(spread, raw, c, out, n) }
void bs_signs(int bits, const u32* s, u32* out, long n) { BY_BITS(spread_signs, s, out, n) }
void bs_expand(int bits, const u32* v, const u32* j, const u32* mb, u32* out, long n) {
    BY_BITS(expand, v, j, mb, out, n) }
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("bsmath")
    src = d / "shim.cpp"
    src.write_text(_SHIM)
    so = d / "shim.so"
    # No -ffast-math: the host product must be IEEE, as NumPy's is.
    subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{kernel_dir()}",
                    str(src), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


def _call(lib, fn, fmt, *arrays):
    arrays = [np.ascontiguousarray(a, dtype=np.uint32) for a in arrays]
    out = np.empty_like(arrays[0])
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    getattr(lib, fn)(ctypes.c_int(FMT[fmt]), *[ptr(a) for a in arrays], ptr(out),
                     ctypes.c_long(out.size))
    return out


def _patterns(dt: _dt.DType) -> np.ndarray:
    return np.arange(1 << dt.bits, dtype=np.uint64).astype(dt.uint)


def _f32_sweep(rng) -> np.ndarray:
    """Every exponent with dense mantissas near the rounding boundaries, plus random bits."""
    exps = np.arange(256, dtype=np.uint32)
    low = np.arange(1 << 12, dtype=np.uint32)
    mant = np.concatenate([low, 0x7fffff - low, (1 << 13) * np.arange(1 << 10, dtype=np.uint32),
                           (1 << 20) - 2048 + low[:4096]])
    mant = mant[mant <= 0x7fffff]
    body = (exps[:, None] << 23) | mant[None, :]
    body = body.reshape(-1)
    rand = rng.integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(np.uint32)
    allv = np.concatenate([body, body | 0x80000000, rand])
    return allv


SMALL = [_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT8_E4M3FN, _dt.FLOAT8_E5M2]


@pytest.mark.parametrize("dt", SMALL, ids=lambda d: d.name)
def test_from_f32_matches_numpy(lib, dt):
    rng = np.random.default_rng(1)
    f = _f32_sweep(rng)
    with np.errstate(all="ignore"):
        want = f.view(np.float32).astype(dt.numpy).view(dt.uint).astype(np.uint32)
    got = _call(lib, "bs_from", dt.name, f)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(f[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("dt", SMALL, ids=lambda d: d.name)
def test_to_f32_exact(lib, dt):
    pats = _patterns(dt)
    want = pats.view(dt.numpy).astype(np.float32).view(np.uint32)
    got = _call(lib, "bs_to", dt.name, pats.astype(np.uint32))
    wnan = np.isnan(want.view(np.float32))
    assert np.array_equal(np.isnan(got.view(np.float32)), wnan)
    if dt == _dt.FLOAT16:
        assert np.array_equal(got, want)      # NumPy keeps fp16 NaN payloads
    else:
        assert np.array_equal(got[~wnan], want[~wnan])


@pytest.mark.parametrize("dt", SMALL + [_dt.FLOAT32], ids=lambda d: d.name)
def test_products_match_reference(lib, dt):
    """relu(a)**2, grad*r and relu2's 2*r*grad as reference_ops rounds them."""
    rng = np.random.default_rng(2)
    n = 1 << 20
    if dt.bits == 32:
        a = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        b = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        # plus specials: NaN payloads, infs, zeros, subnormal products
        sp = np.array([0x7f800001, 0xffc01234, 0x7f800000, 0xff800000, 0, 0x80000000, 1,
                       0x00800000, 0x3f800000, 0x1f800000], dtype=np.uint32)
        a = np.concatenate([a, np.repeat(sp, sp.size)])
        b = np.concatenate([b, np.tile(sp, sp.size)])
    else:
        pats = _patterns(dt)
        a = rng.choice(pats, n).astype(np.uint32)
        b = rng.choice(pats, n).astype(np.uint32)
        if dt.bits == 8:   # every pair
            a = np.repeat(pats, pats.size).astype(np.uint32)
            b = np.tile(pats, pats.size).astype(np.uint32)
    A = a.astype(dt.uint).view(dt.numpy)
    B = b.astype(dt.uint).view(dt.numpy)
    # The products through the reference's mul_f32 (its NaN rule, not the installed
    # NumPy's: which NaN of two NumPy's multiply keeps changed between versions).
    with np.errstate(all="ignore"):
        want = mul_f32(A, B).astype(dt.numpy)
        r32 = B.astype(np.float32)
        want2 = np.where(r32 > 0, mul_f32(A, mul_f32(2.0, r32)).astype(dt.numpy),
                         np.zeros((), dt.numpy)).astype(dt.numpy)
    got = _call(lib, "bs_mul", dt.name, a, b)
    assert np.array_equal(got, want.view(dt.uint).astype(np.uint32))
    got2 = _call(lib, "bs_relu2", dt.name, a, b)
    assert np.array_equal(got2, want2.view(dt.uint).astype(np.uint32))


@pytest.mark.parametrize("dt", SMALL + [_dt.FLOAT32], ids=lambda d: d.name)
def test_relu_predicate(lib, dt):
    from bitsparse_core.spec.ops import relu_bits
    if dt.bits == 32:
        pats = np.random.default_rng(3).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
        pats = np.concatenate([pats, np.array([0, 0x80000000, 0x7f800001, 0xff800001, 1, 0x80000001],
                                              dtype=np.uint32)])
    else:
        pats = _patterns(dt).astype(np.uint32)
    x = pats.astype(dt.uint).view(dt.numpy)
    with np.errstate(all="ignore"):
        want = relu_bits(x, dt).view(dt.uint).astype(np.uint32)
    assert np.array_equal(_call(lib, "bs_relu", dt.name, pats), want)


def _lane_words(rng, dt: _dt.DType, n: int) -> np.ndarray:
    """Words of random lanes of dt, every bit pattern among them (16- and 8-bit), plus
    fp32's NaN payloads, infinities, zeros and subnormals."""
    if dt.bits == 32:
        sp = np.array([0x7f800001, 0xffc01234, 0x7f800000, 0xff800000, 0, 0x80000000, 1,
                       0x80000001, 0x00800000, 0x3f800000, 0x1f800000], dtype=np.uint32)
        return np.concatenate([rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32),
                               rng.choice(sp, n)])
    pats = _patterns(dt).astype(np.uint32)
    per = 32 // dt.bits
    lanes = rng.choice(pats, (n, per))
    lanes[: pats.size, 0] = pats           # every pattern in the first lane ...
    lanes[: pats.size, per - 1] = pats[::-1]   # ... and in the last
    return _words_of_lanes(lanes, dt.bits)


@pytest.mark.parametrize("dt", SMALL + [_dt.FLOAT32], ids=lambda d: d.name)
def test_relu_word_is_relu_per_lane(lib, dt):
    from bitsparse_core.spec.ops import relu_bits
    w = _lane_words(np.random.default_rng(11), dt, 1 << 17)
    lanes = _lanes(w, dt.bits)
    with np.errstate(all="ignore"):
        want = relu_bits(lanes.astype(dt.uint).view(dt.numpy), dt).view(dt.uint).astype(np.uint32)
    assert np.array_equal(_call(lib, "bs_relu_w", dt.name, w), _words_of_lanes(want, dt.bits))


FUSED_WORD_OPS = {"relu2_grad": 0, "square": 1, "product": 2, "gated_product": 3}


@pytest.mark.parametrize("op", FUSED_WORD_OPS)
@pytest.mark.parametrize("dt", [_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32], ids=lambda d: d.name)
def test_word_f32_matches_per_element(lib, dt, op):
    """bs_word_f32 (the fused kernels' word path) gives the per-element functions'
    result whenever it raises no NaN flag, and raises it exactly where a lane's
    result is NaN (the kernels then redo the vector element by element)."""
    rng = np.random.default_rng(12 + FUSED_WORD_OPS[op])
    n = 1 << 17
    a, b, c = (_lane_words(rng, dt, n) for _ in range(3))
    out, nan = np.empty_like(a), np.empty_like(a)
    lib.bs_fused_w(ctypes.c_int(FMT[dt.name]), ctypes.c_int(FUSED_WORD_OPS[op]), _ptr(a), _ptr(b),
                   _ptr(c), _ptr(out), _ptr(nan), ctypes.c_long(a.size))
    A, B, C = (_lanes(x, dt.bits).astype(dt.uint).view(dt.numpy) for x in (a, b, c))
    zero = np.zeros((), dt.numpy)
    with np.errstate(all="ignore"):
        if op == "relu2_grad":      # (g, r)
            want = np.where(B.astype(np.float32) > 0,
                            mul_f32(A, mul_f32(2.0, B.astype(np.float32))).astype(dt.numpy), zero)
        elif op == "square":
            want = mul_f32(A, A).astype(dt.numpy)
        elif op == "product":
            want = mul_f32(A, B).astype(dt.numpy)
        else:                       # (g, u, r)
            want = np.where(C.astype(np.float32) > 0, mul_f32(A, B).astype(dt.numpy), zero)
    want = want.astype(dt.numpy)
    want_nan = np.isnan(want.astype(np.float32)).any(axis=1)
    assert np.array_equal(nan.astype(bool), want_nan)
    ok = ~want_nan
    assert ok.mean() > 0.5        # the fast path is the common one
    assert np.array_equal(out[ok], _words_of_lanes(want.view(dt.uint).astype(np.uint32), dt.bits)[ok])


# --------------------------------------------------------------------------- #
# Word-at-a-time helpers of the pack / unpack kernels                         #
# --------------------------------------------------------------------------- #
WIDTHS = [8, 16, 32]


def _u32(a):
    return np.ascontiguousarray(a, dtype=np.uint32)


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _lanes(words: np.ndarray, bits: int) -> np.ndarray:
    """The BITS-bit lanes of 32-bit words, lane k of word i at [i, k]."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint64) * bits
    return ((words.astype(np.uint64)[:, None] >> shifts) & ((1 << bits) - 1)).astype(np.uint32)


def _words_of_lanes(lanes: np.ndarray, bits: int) -> np.ndarray:
    shifts = np.arange(lanes.shape[1], dtype=np.uint64) * bits
    return (lanes.astype(np.uint64) << shifts).sum(axis=1).astype(np.uint32)


def _random_words(rng, n, bits):
    """Words whose lanes are zero, -0.0-like (sign only), or random, in equal shares."""
    lanes = rng.integers(0, 1 << bits, (n, 32 // bits), dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 3, lanes.shape)
    lanes[kind == 0] = 0
    lanes[kind == 1] = np.uint32(1 << (bits - 1)) if bits < 32 else np.uint32(0x80000000)
    return _words_of_lanes(lanes, bits)


@pytest.mark.parametrize("bits", WIDTHS)
def test_word_nonzero(lib, bits):
    rng = np.random.default_rng(10 + bits)
    w = _random_words(rng, 1 << 16, bits)
    if bits == 16:   # every pair of interesting 16-bit lanes
        v = np.array([0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x0100], dtype=np.uint32)
        w = np.concatenate([w, (v[:, None] | (v[None, :] << 16)).ravel()])
    if bits == 8:    # every byte in every lane position
        b = np.arange(256, dtype=np.uint32)
        w = np.concatenate([w, b, b << 8, b << 16, b << 24])
    out = np.empty_like(w)
    lib.bs_nonzero(ctypes.c_int(bits), _ptr(w), _ptr(out), ctypes.c_long(w.size))
    want = ((_lanes(w, bits) != 0) << np.arange(32 // bits)).sum(axis=1)
    assert np.array_equal(out, want.astype(np.uint32))


@pytest.mark.parametrize("bits", WIDTHS)
def test_quad_nonzero(lib, bits):
    """A 16-byte vector's mask bits: element k of the four words -> bit k."""
    rng = np.random.default_rng(15 + bits)
    w = _random_words(rng, 4 << 14, bits)
    if bits == 16:   # every interesting pair in every word of the vector
        v = np.array([0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x0100], dtype=np.uint32)
        pairs = (v[:, None] | (v[None, :] << 16)).ravel()
        for k in range(4):
            quad = np.zeros((pairs.size, 4), dtype=np.uint32)
            quad[:, k] = pairs
            w = np.concatenate([w, quad.ravel()])
    out = np.empty(w.size // 4, dtype=np.uint32)
    lib.bs_quad(ctypes.c_int(bits), _ptr(w), _ptr(out), ctypes.c_long(out.size))
    want = ((_lanes(w, bits) != 0).reshape(out.size, -1) << np.arange(128 // bits)).sum(axis=1)
    assert np.array_equal(out, want.astype(np.uint32))


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "magnitude"])
@pytest.mark.parametrize("bits", WIDTHS)
def test_spread_inverts_the_stream(lib, bits, raw):
    """A stream chunk of 32/BITS codes spreads back to one code per lane."""
    from bitsparse_core.spec import bitstream
    rng = np.random.default_rng(20 + bits)
    width = bits if raw else bits - 1
    per = 32 // bits
    codes = rng.integers(0, 1 << width, (4096, per), dtype=np.uint64).astype(np.uint32)
    stream = [bitstream.pack(c, width) for c in codes]
    chunks = _u32([int.from_bytes(bytes(s[:4]).ljust(4, b"\0"), "little") for s in stream])
    out = np.empty_like(chunks)
    lib.bs_spread_c(ctypes.c_int(bits), ctypes.c_int(raw), _ptr(chunks), _ptr(out),
                    ctypes.c_long(chunks.size))
    assert np.array_equal(_lanes(out, bits), codes)
    s = _u32(rng.integers(0, 1 << 32, 4096, dtype=np.uint64))
    lib.bs_signs(ctypes.c_int(bits), _ptr(s), _ptr(out), ctypes.c_long(s.size))
    want = (((s[:, None] >> np.arange(per, dtype=np.uint32)) & 1) << (bits - 1)).astype(np.uint32)
    assert np.array_equal(_lanes(out, bits), want)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "magnitude"])
@pytest.mark.parametrize("bits", WIDTHS)
def test_stream_window_reads_the_stream(lib, bits, raw):
    """32 stream bits at any bit position, built from the values the stream holds (sign
    bits dropped for the magnitude width), as bitstream.pack lays them out; zeros past
    the last value."""
    from bitsparse_core.spec import bitstream
    rng = np.random.default_rng(50 + bits)
    width = bits if raw else bits - 1
    dt = {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]
    n = 700
    vals = rng.integers(0, 1 << bits, n, dtype=np.uint64).astype(dt)
    held = np.concatenate([vals, np.zeros(16, dt)])          # what a stage holds past them
    codes = vals.astype(np.uint64) & np.uint64((1 << width) - 1)
    stream = np.frombuffer(bitstream.pack(codes, width).tobytes() + bytes(8), dtype=np.uint8)
    b = np.arange(0, n * width - 31, dtype=np.uint32)
    out = np.empty(b.size, dtype=np.uint32)
    lib.bs_window(ctypes.c_int(bits), ctypes.c_int(raw), held.ctypes.data_as(ctypes.c_void_p),
                  _ptr(b), _ptr(out), ctypes.c_long(b.size))
    bits_le = np.unpackbits(stream, bitorder="little").astype(np.uint64)
    want = (bits_le[b[:, None] + np.arange(32)] << np.arange(32, dtype=np.uint64)).sum(axis=1)
    assert np.array_equal(out, want.astype(np.uint32))


@pytest.mark.parametrize("bits", WIDTHS)
def test_expand_word(lib, bits):
    """Mask bits of one output word pick the next stored values, in order."""
    rng = np.random.default_rng(40 + bits)
    per = 32 // bits
    stored = rng.integers(1, 1 << bits, 256, dtype=np.uint64).astype(np.uint32)
    vals = _u32(np.concatenate([_words_of_lanes(stored.reshape(-1, per), bits), [0, 0]]))
    n = 20000
    mb = _u32(rng.integers(0, 1 << per, n))
    j = _u32(rng.integers(0, 256 - per, n))
    out = np.empty(n, dtype=np.uint32)
    lib.bs_expand(ctypes.c_int(bits), _ptr(vals), _ptr(j), _ptr(mb), _ptr(out), ctypes.c_long(n))
    lanes = np.zeros((n, per), dtype=np.uint32)
    for i in range(n):
        k = j[i]
        for p in range(per):
            if (mb[i] >> p) & 1:
                lanes[i, p] = stored[k]
                k += 1
    assert np.array_equal(out, _words_of_lanes(lanes, bits))
