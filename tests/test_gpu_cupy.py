"""The CuPy backend against the NumPy reference codec and reference_ops, bit for bit.

Runs only where CuPy and a CUDA device exist (marker ``gpu``); elsewhere the
module skips. Every check draws fresh random data and compares whole planes.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import (assert_same_bits, assert_same_planes, device_bits, fresh_rng,
                      random_bits, require_cuda, special_patterns)

cp = require_cuda("cupy")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core.backends.cuda import abi, interop as ci  # noqa: E402
from bitsparse_core import dtypes as _dt  # noqa: E402
from bitsparse_core.spec import codec as reference, ops as reference_ops  # noqa: E402
from bitsparse_core.errors import (CapacityOverflowError, EncodingError,  # noqa: E402
                                   NonContiguousError, OutputMismatchError,
                                   UnsupportedDTypeError)

pytestmark = pytest.mark.gpu

DTYPES = list(_dt.ALL)
ENCODINGS = ["raw", "nosign", "signplane", "auto"]
SHAPES = [(), (0,), (1,), (7,), (33, 65), (4097,), (3, 5003), (2, 3, 4, 5), (70001,)]
BE = bc.get_backend("cupy")


_rng = fresh_rng
dev = device_bits
assert_same = assert_same_planes


def assert_bits(gpu_array, want: np.ndarray, where=""):
    assert_same_bits(np.asarray(BE.to_numpy(gpu_array)), want, where)


def assert_relu2_one_decode(p, p_ref, a, G, g, dt):
    """The torch adapter's one-decode ReLU² backward (op RELU2_AND_SQUARE) gives the
    reference gradient and relu(a)² as the forward rounds it."""
    s = ci.stream_handle(None)
    gt = ci.import_cuda(G, stream=s)
    out = ci.CudaArray.empty(p.shape, p.dtype, gt.device, s)
    h = ci.CudaArray.empty(p.shape, p.dtype, gt.device, s)
    BE._unpack_op(p, abi.Op.RELU2_AND_SQUARE, s, None, out.ptr, grad=gt.ptr, out2=h.ptr)
    assert_bits(out, reference_ops.relu2_backward(g, p_ref), "relu2 gradient, one decode")
    assert_bits(h, reference_ops.relu_pack(a, dt, square=True)[0], "relu(a)², one decode")


def clear_nan_signs(a, dt):
    """``a`` with its NaNs' sign bits cleared in place (a negative NaN survives relu, and
    nosign cannot store it): e4m3fn's 0xff becomes 0x7f."""
    if dt.name == "float8_e4m3fn":
        a.view(dt.uint)[...] = np.where(a.view(dt.uint) == 0xff, 0x7f, a.view(dt.uint))
    else:
        a.view(dt.uint)[np.isnan(a.astype(np.float32))] &= np.array(dt.sign_mask - 1,
                                                                   dtype=dt.uint)
    return a


def assert_gated_product(p, p_ref, pu, pu_ref, dt):
    """The torch adapter's weight-gradient input of the gated op (op GATED_PRODUCT): r * u
    from both planes, as reference_ops.gated_product gives it."""
    s = ci.stream_handle(None)
    h = ci.CudaArray.empty(p.shape, p.dtype, p.device[1], s)
    BE._unpack_op(p, abi.Op.GATED_PRODUCT, s, None, h.ptr, pu=BE._ready(pu, s),
                  u_encoding=pu.encoding)
    assert_bits(h, reference_ops.gated_product(p_ref, pu_ref), f"r * u {dt.name}")


def test_kernels_built_for_this_device():
    major, minor = cp.cuda.Device().compute_capability[:1], cp.cuda.Device().compute_capability[1:]
    from bitsparse_core.backends.cuda.abi import PACK_ROUNDS
    from bitsparse_core.backends.cupy.kernels import get_kernel
    k = get_kernel(cp.cuda.runtime.getDevice(), "pack", 0, 1, 0, PACK_ROUNDS)
    assert k.attributes["binary_version"] == int(major + minor)


# --------------------------------------------------------------------------- #
# pack / unpack vs the reference codec                                        #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_pack_matches_reference(request, dt, encoding):
    rng = _rng(request)
    for shape in SHAPES:
        for sparsity in (0.0, 0.6, 0.97, 1.0):
            signs = encoding != "nosign" and not (encoding == "auto" and rng.random() < 0.5)
            x = random_bits(rng, shape, dt, sparsity, signs=signs)
            chunk_log2 = int(rng.choice([9, 10, 12, 13]))
            where = f"{dt.name} {encoding} {shape} s={sparsity} c={chunk_log2}"
            ref = reference.pack_array(x, dt, encoding, chunk_log2=chunk_log2)
            p = bc.pack(dev(x), dtype=dt.name, encoding=encoding, chunk_log2=chunk_log2,
                        backend="cupy")
            assert p._nnz is not None, "exact packing knows nnz"
            assert_same(p, ref, where)
            y = bc.unpack(p)
            assert_bits(y, x, where)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_every_bit_pattern(request, dt):
    """All 2**16 / 2**8 patterns, shuffled, in several encodings and tile phases."""
    rng = _rng(request)
    pats = np.arange(1 << min(dt.bits, 16), dtype=np.uint64)
    if dt.bits == 32:
        pats = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64)
        pats = np.concatenate([pats, special_patterns(dt).astype(np.uint64)])
    for rep in range(3):
        bits = rng.permutation(np.repeat(pats, 3))[: pats.size * 3 - rep * 17].astype(dt.uint)
        x = bits.view(dt.numpy)
        for enc in ("raw", "signplane", "auto"):
            ref = reference.pack_array(x, dt, enc)
            p = bc.pack(dev(x), dtype=dt.name, encoding=enc, backend="cupy")
            assert_same(p, ref, f"{dt.name} {enc} rep {rep}")
            assert_bits(bc.unpack(p), x, f"{dt.name} {enc} rep {rep}")
        pos = x.view(dt.uint) & np.array(dt.sign_mask - 1, dtype=dt.uint)
        xp = pos.view(dt.numpy)
        ref = reference.pack_array(xp, dt, "nosign")
        p = bc.pack(dev(xp), dtype=dt.name, encoding="nosign", backend="cupy")
        assert_same(p, ref, f"{dt.name} nosign rep {rep}")
        assert_bits(bc.unpack(p), xp)


@pytest.mark.parametrize("chunk_log2", [9, 11, 12, 14, 16, 19])
@pytest.mark.parametrize("dt", [_dt.BFLOAT16, _dt.FLOAT32, _dt.FLOAT8_E5M2], ids=lambda d: d.name)
def test_chunk_sizes_and_many_tiles(request, dt, chunk_log2):
    """Chunks smaller than, equal to and spanning few or many tiles (unpack prefix modes)."""
    rng = _rng(request)
    n = int(rng.integers(1 << 20, 3 << 20))
    x = random_bits(rng, (n,), dt, float(rng.choice([0.3, 0.9, 0.995])))
    for enc in ("signplane", "raw"):
        ref = reference.pack_array(x, dt, enc, chunk_log2=chunk_log2)
        p = bc.pack(dev(x), dtype=dt.name, encoding=enc, chunk_log2=chunk_log2, backend="cupy")
        assert_same(p, ref, f"{dt.name} {enc} n={n} c={chunk_log2}")
        assert_bits(bc.unpack(p), x)


def test_nonzero_runs_and_empty_tiles(request):
    """Long runs of empty tiles between single values: look-back tails across many tiles."""
    rng = _rng(request)
    for dt in DTYPES:
        n = 300_000
        bits = np.zeros(n, dtype=dt.uint)
        idx = rng.choice(n, 37, replace=False)
        bits[idx] = rng.integers(1, 1 << (dt.bits - 1), 37, dtype=np.uint64).astype(dt.uint)
        bits[-1] = 1
        x = bits.view(dt.numpy)
        for enc in ("nosign", "signplane", "raw"):
            ref = reference.pack_array(x, dt, enc)
            p = bc.pack(dev(x), dtype=dt.name, encoding=enc, backend="cupy")
            assert_same(p, ref, f"{dt.name} {enc} sparse runs")
            assert_bits(bc.unpack(p), x)


@pytest.mark.parametrize("offset_bytes", [None, 8], ids=["one-element", "8-bytes"])
def test_misaligned_input_and_out(request, offset_bytes):
    """Input and out= views off a 16-byte boundary: one element off (scalar loads and
    stores), or 8 bytes off (two 8-byte loads and stores per vector); the bytes before
    the out= view stay untouched."""
    rng = _rng(request)
    for dt in (_dt.BFLOAT16, _dt.FLOAT8_E4M3FN, _dt.FLOAT32):
        k = 1 if offset_bytes is None else offset_bytes // dt.itemsize
        x = random_bits(rng, (50_001,), dt, 0.7)
        big = cp.zeros(x.size + k, dtype=dt.uint)
        big[k:] = dev(x)
        view = big[k:]
        assert view.data.ptr % 16 == k * dt.itemsize
        ref = reference.pack_array(x, dt, "signplane")
        p = bc.pack(view, dtype=dt.name, encoding="signplane", backend="cupy")
        assert_same(p, ref, f"misaligned {dt.name} by {k}")
        out = cp.full(x.size + k, 0x5A, dtype=dt.uint)
        res = bc.unpack(p, out=_Bits(out[k:], dt))
        assert isinstance(res, _Bits)
        assert np.array_equal(cp.asnumpy(out[k:]), x.view(dt.uint))
        assert np.all(cp.asnumpy(out[:k]) == 0x5A)


class _Bits:
    """A CuPy uint array exported through DLPack as another dtype (bf16 / fp8 bits)."""

    def __init__(self, arr, dt):
        self.arr, self.dt = arr, dt

    def __dlpack_device__(self):
        return (2, self.arr.device.id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        from bitsparse_core.dlpack import make_capsule
        return make_capsule(self.arr.data.ptr, self.arr.shape, self.dt, 2, self.arr.device.id,
                            self.arr)


class _CaiOnly:
    """An object offering only __cuda_array_interface__ (the fallback import path)."""

    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = arr.__cuda_array_interface__


def test_cuda_array_interface_input(request):
    rng = _rng(request)
    for dt in (_dt.FLOAT16, _dt.FLOAT32, _dt.BFLOAT16):
        x = random_bits(rng, (3001,), dt, 0.5)
        arr = cp.asarray(x) if dt.name != "bfloat16" else dev(x)
        p = bc.pack(_CaiOnly(arr), dtype=None if dt.name != "bfloat16" else "bfloat16",
                    encoding="signplane", backend="cupy")
        assert_same(p, reference.pack_array(x, dt, "signplane"), f"CAI {dt.name}")


# --------------------------------------------------------------------------- #
# fixed capacity                                                              #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_fixed_capacity(request, dt):
    rng = _rng(request)
    x = random_bits(rng, (40_000,), dt, 0.8, signs=False)
    nnz = int(np.count_nonzero(x.view(dt.uint)))
    for enc in ("nosign", "signplane", "raw"):
        for cap in (nnz + 1000, nnz, nnz - 1, nnz // 3, 0):
            ref = reference.pack_array(x, dt, enc, capacity=cap)
            p = bc.pack(dev(x), dtype=dt.name, encoding=enc, capacity=cap, backend="cupy")
            assert p._nnz is None, "fixed capacity must not sync"
            # the status word is kept where it can say more than the count: a nosign violation
            assert (p.status is not None) == (enc == "nosign")
            assert_same(p, ref, f"{dt.name} {enc} cap={cap} nnz={nnz}")
            assert BE.read_nnz(p) == nnz
            if cap >= nnz:
                p.check()
                assert_bits(bc.unpack(p), x)
            else:
                with pytest.raises(CapacityOverflowError):
                    p.check()
                with pytest.raises(CapacityOverflowError):
                    bc.unpack(p)
                if p.status is not None:
                    assert BE.read_status(p) & 2


def test_nosign_violations(request):
    rng = _rng(request)
    dt = _dt.BFLOAT16
    x = random_bits(rng, (10_000,), dt, 0.5, signs=False)
    x.view(dt.uint)[1234] = 0x8000        # -0.0 is stored (nonzero pattern) with its sign
    with pytest.raises(EncodingError):
        bc.pack(dev(x), dtype=dt.name, encoding="nosign", backend="cupy")
    p = bc.pack(dev(x), dtype=dt.name, encoding="nosign", capacity=5000, backend="cupy")
    with pytest.raises(EncodingError):
        p.check()
    p = bc.pack(dev(x), dtype=dt.name, encoding="auto", capacity=9000, backend="cupy")
    assert p.encoding == bc.Encoding.RAW
    assert_same(p, reference.pack_array(x, dt, "auto", capacity=9000), "auto fixed")


# --------------------------------------------------------------------------- #
# > 2**31 elements (cheap device-side checks)                                 #
# --------------------------------------------------------------------------- #
_GEN = None
_MASK = None


def _mask_of(x):
    """LSB-first mask bytes of x != 0 (cupy.packbits stops at 2**31 elements)."""
    global _MASK
    if _MASK is None:
        _MASK = cp.ElementwiseKernel(
            "raw T x, uint64 n", "uint8 m",
            """unsigned int b = 0;
               for (int t = 0; t < 8; ++t) {
                   unsigned long long e = (unsigned long long)i * 8ull + t;
                   if (e < n && x[e] != 0) b |= 1u << t;
               }
               m = (unsigned char)b;""", "bitsparse_test_mask")
    m = cp.empty((x.size + 7) // 8, dtype=cp.uint8)
    _MASK(x, np.uint64(x.size), m)
    return m


def _big(n, dt, sparsity_per_256):
    """A deterministic hashed pattern of n elements, generated on the device."""
    global _GEN
    if _GEN is None:
        _GEN = cp.ElementwiseKernel(
            "uint32 thresh, uint32 bmask", "T y",
            """unsigned long long h = (unsigned long long)i * 0x9E3779B97F4A7C15ull;
               h ^= h >> 29; h *= 0xBF58476D1CE4E5B9ull; h ^= h >> 32;
               unsigned int v = (unsigned int)h & bmask;
               y = ((unsigned int)(h >> 40) & 255u) < thresh ? (T)0 : (T)(v ? v : 1u);""",
            "bitsparse_test_hash")
    y = cp.empty(n, dtype=dt.uint)
    _GEN(np.uint32(sparsity_per_256), np.uint32((1 << dt.bits) - 1), y)
    return y


@pytest.mark.parametrize("n,dt,enc", [((1 << 32) + 12_345, _dt.BFLOAT16, "raw"),
                                      ((1 << 31) + 4_321, _dt.FLOAT8_E4M3FN, "signplane")],
                         ids=["bf16-2^32+", "fp8-2^31+"])
def test_over_2_31_elements(n, dt, enc):
    free = cp.cuda.runtime.memGetInfo()[0]
    if free < 6 * n * dt.itemsize:
        pytest.skip("not enough device memory")
    x = _big(n, dt, 180)
    p = bc.pack(x, dtype=dt.name, encoding=enc, backend="cupy")
    nz = x != 0
    nnz = int(cp.count_nonzero(nz))
    assert p.nnz == nnz
    assert p.offsets.dtype == (np.uint64 if n >= 1 << 32 else np.uint32)
    assert cp.array_equal(cp.asarray(p.mask), _mask_of(x))   # planes view as CuPy arrays
    chunk = 1 << p.chunk_log2
    full = n // chunk
    counts = nz[: full * chunk].reshape(full, chunk).sum(axis=1, dtype=cp.uint64)
    offs = cp.asarray(p.offsets).astype(cp.uint64)
    assert int(offs[0]) == 0 and int(offs[-1]) == nnz
    assert cp.array_equal(offs[1: full + 1] - offs[:full], counts)
    del counts, offs
    if enc == "raw":      # the values are x's nonzeros in order: same sum, and the round trip below
        values = cp.asarray(p.values).view(dt.uint)
        assert int(values.sum(dtype=cp.uint64)) == int(x.sum(dtype=cp.uint64))
    del nz
    y = bc.unpack(p)
    yv = cp.ndarray(x.shape, dtype=dt.uint, memptr=cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(y.ptr, y.nbytes, y), 0))
    cp.cuda.runtime.deviceSynchronize()
    assert cp.array_equal(yv, x)


# --------------------------------------------------------------------------- #
# streams                                                                     #
# --------------------------------------------------------------------------- #
def test_non_default_and_concurrent_streams(request):
    rng = _rng(request)
    dt = _dt.BFLOAT16
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    xs = [random_bits(rng, (1 << 20,), dt, sp) for sp in (0.5, 0.9, 0.99, 0.7)]
    with s1:                       # upload on s1, pack with stream=s1: no default stream
        d = [dev(x) for x in xs]
    packed = []
    for i, arr in enumerate(d):
        s = (s1, s2)[i % 2]
        if s is s2:
            s2.wait_event(s1.record())
        packed.append(bc.pack(arr, dtype=dt.name, encoding="signplane", capacity=1 << 20,
                              stream=s, backend="cupy"))
    outs = [bc.unpack(p, stream=(s2, s1)[i % 2]) for i, p in enumerate(packed)]
    for x, p, y in zip(xs, packed, outs):
        ref = reference.pack_array(x, dt, "signplane", capacity=1 << 20)
        assert_same(p, ref, "streams")
        assert_bits(y, x, "streams")


def test_torch_streams_and_dlpack(request):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = _rng(request)
    side = torch.cuda.Stream()
    for dt, tdt in ((_dt.BFLOAT16, torch.bfloat16), (_dt.FLOAT16, torch.float16),
                    (_dt.FLOAT32, torch.float32), (_dt.FLOAT8_E4M3FN, torch.float8_e4m3fn),
                    (_dt.FLOAT8_E5M2, torch.float8_e5m2)):
        x = random_bits(rng, (1000, 37), dt, 0.75)
        with torch.cuda.stream(side):
            ix = x.view({8: np.uint8, 16: np.int16, 32: np.int32}[dt.bits]).copy()
            tx = torch.from_numpy(ix).to("cuda").view(tdt)
            try:
                p = bc.pack(tx, encoding="signplane", stream=side, backend="cupy")
            except (BufferError, RuntimeError, TypeError):   # torch without DLPack fp8 codes
                p = bc.pack(tx.view(torch.uint8), dtype=dt.name, encoding="signplane",
                            stream=side, backend="cupy")
            y = bc.unpack(p, stream=side)
            ty = torch.from_dlpack(y)            # producer-side stream rule
            assert ty.dtype == tdt and tuple(ty.shape) == x.shape
            same = torch.equal(ty.view({8: torch.uint8, 16: torch.int16, 32: torch.int32}[dt.bits]),
                               tx.view({8: torch.uint8, 16: torch.int16, 32: torch.int32}[dt.bits]))
        side.synchronize()
        assert same, dt.name
        assert_same(p, reference.pack_array(x, dt, "signplane"), f"torch {dt.name}")
        out = torch.empty_like(tx)
        bc.unpack(p, out=out, stream=torch.cuda.current_stream())
        assert torch.equal(out.view(torch.uint8), tx.view(torch.uint8))


def test_cupy_dlpack_and_cai_round_trip(request):
    rng = _rng(request)
    for dt, cdt in ((_dt.FLOAT16, cp.float16), (_dt.FLOAT32, cp.float32)):
        x = random_bits(rng, (777, 13), dt, 0.6)
        cx = cp.asarray(x)                       # native CuPy float array
        p = bc.pack(cx, encoding="auto", backend="cupy")
        y = bc.unpack(p)
        assert cp.from_dlpack(y).dtype == cdt
        assert cp.array_equal(cp.from_dlpack(y).view(dt.uint), cx.view(dt.uint))
        assert cp.array_equal(cp.asarray(y).view(dt.uint), cx.view(dt.uint))   # CAI
        assert_same(p, reference.pack_array(x, dt, "auto"), f"cupy native {dt.name}")


def test_torch_allocator_sees_memory(request):
    torch = pytest.importorskip("torch")
    rng = _rng(request)
    x = random_bits(rng, (1 << 22,), _dt.BFLOAT16, 0.9)
    before = torch.cuda.memory_allocated()
    p = bc.pack(dev(x), dtype="bfloat16", encoding="signplane", backend="cupy",
                allocator=ci.torch_allocator)
    assert torch.cuda.memory_allocated() - before >= p.nbytes - p.layout.header_size
    assert_same(p, reference.pack_array(x, _dt.BFLOAT16, "signplane"), "torch allocator")
    y = bc.unpack(p, allocator=ci.torch_allocator)
    assert_bits(y, x)


def test_torch_block_is_counted_and_given_back():
    """``torch_buffer`` (the backends' route for torch data) takes a block of torch's
    caching allocator by address: counted while held, given back when dropped, and
    kept in the pool of the stream it names (the side stream's freed block is what
    the side stream's next request of that size gets)."""
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    blocks = [ci.torch_buffer(3 << 20, dev, h) for h in (side.cuda_stream, 0, 1)]
    assert torch.cuda.memory_allocated() - before >= 3 * (3 << 20)
    assert len({b.ptr for b in blocks}) == 3 and all(b.ptr for b in blocks)
    side_ptr = blocks[0].ptr
    del blocks
    assert torch.cuda.memory_allocated() == before
    again = ci.torch_buffer(3 << 20, dev, side.cuda_stream)    # the side stream's pool
    assert again.ptr == side_ptr
    assert ci.torch_buffer(0, dev, 0).ptr == 0


def test_torch_data_defaults_to_torch_stream_and_allocator(request):
    """On torch CUDA tensors, calls that name no stream / allocator run as torch's own
    ops: on torch's current stream, with memory torch counts; the packed tensor's ops
    follow it. An explicit allocator still wins."""
    torch = pytest.importorskip("torch")
    rng = _rng(request)
    x = random_bits(rng, (1 << 20,), _dt.BFLOAT16, 0.9)
    relu_in = random_bits(rng, (1 << 20,), _dt.BFLOAT16, 0.5)
    tx = torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    ta = torch.from_numpy(relu_in.view(np.int16)).cuda().view(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        before = torch.cuda.memory_allocated()
        cap = int(np.count_nonzero(x.view(np.uint16))) + 7
        p = bc.pack(tx, capacity=cap, encoding="signplane")
        assert p.extra["stream"] == side.cuda_stream
        assert torch.cuda.memory_allocated() - before >= p.nbytes - p.layout.header_size
        mid = torch.cuda.memory_allocated()
        y = bc.unpack(p)
        assert y.stream == side.cuda_stream
        assert torch.cuda.memory_allocated() - mid >= x.nbytes
        r, pr = bc.relu_pack(ta, capacity=ta.numel(), encoding="signplane")  # -NaN stays
        g = bc.relu2_backward(tx, pr)
        assert (r.stream, pr.extra["stream"], g.stream) == (side.cuda_stream,) * 3
    torch.cuda.current_stream().wait_stream(side)
    assert_bits(y, x)
    assert_bits(r, reference_ops.relu_bits(relu_in, _dt.BFLOAT16))
    assert_same(p, reference.pack_array(x, _dt.BFLOAT16, "signplane", capacity=cap),
                "torch defaults")
    before = torch.cuda.memory_allocated()
    q = bc.pack(tx, capacity=tx.numel(), encoding="signplane", allocator=ci.cupy_allocator)
    assert torch.cuda.memory_allocated() == before
    assert_bits(bc.unpack(q, allocator=ci.cupy_allocator), x)
    assert torch.cuda.memory_allocated() == before


def test_unpack_sparse_and_dense_warps(request):
    """Unpack picks, per warp and round, a scatter of the few stored values or the
    per-word expand: density changing every 64..1024 elements puts both, and the
    switch between them, inside one tile, for unpack and the fused unpack ops."""
    rng = _rng(request)
    for dt in DTYPES:
        n = int(rng.integers(200_000, 300_000))
        dens = np.repeat(rng.choice([0.0, 0.02, 0.2, 0.6, 0.9, 1.0], n // 64 + 1), 64)
        k = int(rng.integers(0, 4))              # runs of 64 << k elements
        dens = np.repeat(dens[:: 1 << k], 1 << k)[:n]
        x = random_bits(rng, (n,), dt, 0.0, signs=True)
        x.view(dt.uint)[rng.random(n) >= dens] = 0
        for enc in ("raw", "signplane"):
            ref = reference.pack_array(x, dt, enc)
            p = bc.pack(dev(x), dtype=dt.name, encoding=enc, backend="cupy")
            assert_same(p, ref, f"{dt.name} {enc} mixed density k={k}")
            assert_bits(bc.unpack(p), x, f"{dt.name} {enc} mixed density k={k}")
        a = clear_nan_signs(x.copy(), dt)
        g = random_bits(rng, (n,), dt, 0.1)
        u = random_bits(rng, (n,), dt, 0.2)
        _, p = bc.relu_pack(dev(a), dtype=dt.name, backend="cupy")
        _, p_ref = reference_ops.relu_pack(a, dt)
        G = _Bits(dev(g), dt)
        assert_bits(bc.relu2_backward(G, p), reference_ops.relu2_backward(g, p_ref), "relu2_bwd")
        assert_relu2_one_decode(p, p_ref, a, G, g, dt)
        pu = bc.masked_pack(_Bits(dev(u), dt), p, encoding="signplane")
        pu_ref = reference_ops.masked_pack(u, dt, p_ref, encoding="signplane")
        gg, gu = bc.gated_backward(G, p, pu)
        gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu_ref)
        assert_bits(gg, gg_ref, f"gated grad_g {dt.name}")
        assert_bits(gu, gu_ref, f"gated grad_u {dt.name}")
        assert_gated_product(p, p_ref, pu, pu_ref, dt)


# --------------------------------------------------------------------------- #
# fused ops vs reference_ops                                                  #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_fused_ops(request, dt):
    rng = _rng(request)
    for shape in ((0,), (), (513,), (64, 1001)):
        a = random_bits(rng, shape, dt, 0.3)
        g = random_bits(rng, shape, dt, 0.1)
        u = random_bits(rng, shape, dt, 0.2)
        clear_nan_signs(a, dt)
        for square in (False, True):
            for enc, cap in (("nosign", None), ("signplane", None), ("raw", None), ("nosign", "fit")):
                capacity = None
                if cap == "fit":
                    capacity = int(np.count_nonzero(reference_ops.relu_bits(a, dt).view(dt.uint)))
                y_ref, p_ref = reference_ops.relu_pack(a, dt, square=square, encoding=enc,
                                                       capacity=capacity)
                y, p = bc.relu_pack(dev(a), dtype=dt.name, square=square, encoding=enc,
                                    capacity=capacity, backend="cupy")
                where = f"relu_pack {dt.name} {shape} square={square} {enc} cap={capacity}"
                assert_bits(y, y_ref, where)
                assert_same(p, p_ref, where)
        _, p = bc.relu_pack(dev(a), dtype=dt.name, backend="cupy")
        _, p_ref = reference_ops.relu_pack(a, dt)
        G = _Bits(dev(g), dt)
        assert_bits(bc.relu_backward(G, p), reference_ops.relu_backward(g, p_ref), "relu_bwd")
        assert_bits(bc.relu2_backward(G, p), reference_ops.relu2_backward(g, p_ref), "relu2_bwd")
        assert_relu2_one_decode(p, p_ref, a, G, g, dt)
        for enc in ("signplane", "raw"):
            pu = bc.masked_pack(_Bits(dev(u), dt), p, encoding=enc)
            pu_ref = reference_ops.masked_pack(u, dt, p_ref, encoding=enc)
            assert_same(pu, pu_ref, f"masked_pack {enc}")
            gg, gu = bc.gated_backward(G, p, pu)
            gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu_ref)
            assert_bits(gg, gg_ref, f"gated grad_g {enc}")
            assert_bits(gu, gu_ref, f"gated grad_u {enc}")
            assert_gated_product(p, p_ref, pu, pu_ref, dt)
        # a p_u with its own mask takes the dense path
        pu2 = bc.pack(dev(u), dtype=dt.name, encoding="raw", backend="cupy")
        pu2_ref = reference.pack_array(u, dt, "raw")
        gg, gu = bc.gated_backward(G, p, pu2)
        gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu2_ref)
        assert_bits(gg, gg_ref, "gated dense grad_g")
        assert_bits(gu, gu_ref, "gated dense grad_u")


def assert_gated_pack(a, u, dt, enc, cap, u_off=0):
    """The torch adapter's gated pack (mode RELU_GATED) of ``a`` beside ``u`` (``u_off``
    elements past a 16-byte boundary): the planes of relu(a), byte for byte those of mode
    RELU, and y = relu(a) * u as reference_ops.gated_relu_pack rounds it."""
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.spec.format import Encoding
    device = cp.cuda.runtime.getDevice()
    A = dev(a)
    U = cp.zeros(a.size + 1, dtype=dt.uint)
    U[u_off:u_off + a.size] = dev(u.reshape(-1))
    blocks, ys = {}, {}
    for mode in (abi.Mode.RELU, abi.Mode.RELU_GATED):
        plan = host.pack_plan(a.shape, dt, Encoding.parse(enc), cap, 12, mode)
        block = cp.zeros(plan.nbytes, dtype=cp.uint8)
        scratch = cp.empty(max(plan.scratch_bytes, 1), dtype=cp.uint8)
        y = cp.zeros(a.shape, dtype=dt.uint)
        gated = mode == abi.Mode.RELU_GATED
        host.enqueue_pack(plan, device, 0, A.data.ptr, block.data.ptr, scratch.data.ptr,
                          y.data.ptr, zero_tail=True,
                          u=U.data.ptr + u_off * dt.itemsize if gated else 0)
        blocks[mode], ys[mode] = block.get(), y
    where = f"{dt.name} {a.shape} {enc} cap={cap} u+{u_off}"
    assert np.array_equal(blocks[abi.Mode.RELU], blocks[abi.Mode.RELU_GATED]), where
    assert_bits(ys[abi.Mode.RELU], reference_ops.relu_bits(a, dt), f"relu {where}")
    assert_bits(ys[abi.Mode.RELU_GATED], reference_ops.gated_relu_pack(a, u, dt)[0],
                f"relu(a) * u {where}")


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_gated_relu_pack_mode(request, dt):
    """assert_gated_pack on fresh random bits (specials included): every encoding, a
    capacity that fits and one that overflows (where relu kept two or more), u aligned and
    not."""
    rng = _rng(request)
    for shape in ((0,), (), (513,), (64, 1001), (3, 8199)):
        a = random_bits(rng, shape, dt, 0.3)
        u = random_bits(rng, shape, dt, 0.2)
        clear_nan_signs(a, dt)
        kept = int(np.count_nonzero(reference_ops.relu_bits(a, dt).view(dt.uint)))
        for enc, cap in (("nosign", kept), ("signplane", kept), ("raw", kept // 2)):
            for u_off in (0, 1):
                assert_gated_pack(a, u, dt, enc, cap, u_off)


@pytest.mark.parametrize("dt", [_dt.BFLOAT16, _dt.FLOAT32, _dt.FLOAT8_E4M3FN], ids=lambda d: d.name)
def test_many_waves_of_tiles(request, dt):
    """More tiles than a wave of resident blocks, the last one partial: where the pack and
    the unpack-family kernels ask for later tiles' planes in L2 (sm_90), every op reading
    them is bit-exact (the smaller tests never reach that distance)."""
    rng = _rng(request)
    tile = abi.tile_elems(dt, abi.PACK_ROUNDS)
    # more tiles than the pack's persistent grid (at most 4 blocks per SM) holds
    n = 6 * cp.cuda.Device().attributes["MultiProcessorCount"] * tile + int(rng.integers(1, tile))
    a = random_bits(rng, (n,), dt, 0.5, signs=False)
    g = random_bits(rng, (n,), dt, 0.1)
    u = random_bits(rng, (n,), dt, 0.2)
    for enc in ("nosign", "signplane", "raw"):
        ref = reference.pack_array(a, dt, enc)
        p = bc.pack(dev(a), dtype=dt.name, encoding=enc, backend="cupy")
        assert_same(p, ref, f"pack {dt.name} {enc} n={n}")
        assert_bits(bc.unpack(p), a, f"unpack {enc}")
    _, p = bc.relu_pack(dev(a), dtype=dt.name, square=True, backend="cupy")
    _, p_ref = reference_ops.relu_pack(a, dt, square=True)
    G = _Bits(dev(g), dt)
    assert_bits(bc.relu2_backward(G, p), reference_ops.relu2_backward(g, p_ref), "relu2_bwd")
    assert_relu2_one_decode(p, p_ref, a, G, g, dt)
    pu = bc.masked_pack(_Bits(dev(u), dt), p, encoding="signplane")
    pu_ref = reference_ops.masked_pack(u, dt, p_ref, encoding="signplane")
    gg, gu = bc.gated_backward(G, p, pu)
    gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu_ref)
    assert_bits(gg, gg_ref, "gated grad_g")
    assert_bits(gu, gu_ref, "gated grad_u")
    assert_gated_product(p, p_ref, pu, pu_ref, dt)
    assert_gated_pack(a, u, dt, "nosign", n // 2)


def test_masked_pack_nosign_status(request):
    rng = _rng(request)
    dt = _dt.FLOAT16
    a = random_bits(rng, (5000,), dt, 0.5)
    u = random_bits(rng, (5000,), dt, 0.0)
    _, p = bc.relu_pack(dev(a), dtype=dt.name, encoding="signplane", backend="cupy")
    pu = bc.masked_pack(_Bits(dev(u), dt), p, encoding="nosign")
    with pytest.raises(EncodingError):
        pu.check()


# --------------------------------------------------------------------------- #
# input errors                                                                #
# --------------------------------------------------------------------------- #
def test_input_errors():
    x = cp.zeros((64, 32), dtype=cp.float16)
    with pytest.raises(NonContiguousError):
        bc.pack(x.T, backend="cupy")
    with pytest.raises(UnsupportedDTypeError):
        bc.pack(cp.zeros(10, dtype=cp.float64), backend="cupy")
    with pytest.raises(UnsupportedDTypeError):
        bc.pack(cp.zeros(10, dtype=cp.uint16), backend="cupy")           # bits need dtype=
    p = bc.pack(cp.ones(100, dtype=cp.float16), backend="cupy")
    with pytest.raises(OutputMismatchError):
        bc.unpack(p, out=cp.zeros(99, dtype=cp.float16))
    with pytest.raises(OutputMismatchError):
        bc.unpack(p, out=cp.zeros(100, dtype=cp.float32))
