"""The numba backend on a real GPU: bit-exact against the reference and the CuPy backend.

Marker ``gpu``: skipped cleanly where numba-cuda, CuPy (cuda_interop's
allocator and runtime calls) or a CUDA device is missing, i.e. in CI.

What only this GPU run covers (the simulator suite, tests/test_numba_sim.py,
runs the same algorithm in CI): the kernels as NVVM compiles them (shuffle
warp scan, warp-parallel decoupled look-back spinning on predecessors that are
really concurrent, libdevice bit casts, float32 products on the FPU with
subnormals kept), the 4096-element tiles, look-back windows of 32 tiles and of 32
groups of 32 tiles over hundreds of tiles, tensors of millions of elements, inputs
from CuPy (DLPack and ``__cuda_array_interface__``), torch (bf16/fp8 through DLPack) and JAX, explicit
non-default streams, the pluggable allocator (torch's caching allocator), and
agreement with the CuPy backend: the same tensors packed by both give identical
planes, and each backend unpacks the other's output.

Tests are grouped per dtype for ``pytest -n N --dist loadgroup`` so each worker
compiles one dtype's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import (assert_same_bits, assert_same_planes, device_bits, fresh_rng,
                      random_bits, require_cuda)

cp = require_cuda("cupy")
require_cuda("numba.cuda")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core.backends.cuda import interop as ci  # noqa: E402
from bitsparse_core import dtypes as _dt  # noqa: E402
from bitsparse_core.backends.numba import kernels as NK  # noqa: E402
from bitsparse_core.backends.numba.backend import NumbaBackend  # noqa: E402
from bitsparse_core.spec import codec as reference, ops as reference_ops  # noqa: E402
from bitsparse_core.errors import (CapacityOverflowError, EncodingError,  # noqa: E402
                                   OutputMismatchError)

pytestmark = pytest.mark.gpu

DTYPES = list(_dt.ALL)
BE = bc.get_backend("numba")
CUPY_OK = bc.backend_available("cupy")


def _group(dt):
    return pytest.param(dt, id=dt.name, marks=pytest.mark.xdist_group(dt.name))


DT_PARAMS = [_group(d) for d in DTYPES]


@pytest.fixture
def rng(request):
    return fresh_rng(request)


dev = device_bits


def assert_same(p, ref, where=""):
    assert not NK.SIM
    assert_same_planes(p, ref, where)


def assert_bits(gpu_array, want: np.ndarray, where=""):
    assert_same_bits(np.asarray(BE.to_numpy(gpu_array)), want, where)


def _unsigned(x, dt):
    """x with every sign bit cleared (legal for encoding='nosign')."""
    return (x.view(dt.uint) & np.array(dt.sign_mask - 1, dt.uint)).view(dt.numpy)


def _no_neg_nan(x, dt):
    b = x.copy(order="C").view(dt.uint)
    b[np.isnan(x.astype(np.float32))] &= np.array(dt.sign_mask - 1, dtype=dt.uint)
    return b.view(dt.numpy)


def _check_masked_and_gated(be, dt, g, u, p, p_ref, encodings, tag=""):
    """masked_pack of u under p's mask in each encoding (nosign: u's signs cleared), then
    the gated backward from the two, against the reference."""
    for enc in encodings:
        uu = u if enc != "nosign" else _unsigned(u, dt)
        p_u = be.masked_pack(dev(uu), p, dtype=dt.name, encoding=enc)
        pu_ref = reference_ops.masked_pack(uu, dt, p_ref, encoding=enc)
        assert_same(p_u, pu_ref, f"{tag}masked_pack {enc}")
        with np.errstate(all="ignore"):
            gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu_ref)
        gg, gu = be.gated_backward(_tdev(g, dt), p, p_u)
        assert_bits(gu, gu_ref, f"{tag}gated grad_u {enc}")
        assert_bits(gg, gg_ref, f"{tag}gated grad_g {enc}")


# --------------------------------------------------------------------------- #
# pack / unpack                                                               #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_pack_unpack_every_encoding(rng, dt):
    for shape, chunk_log2 in (((), 12), ((0,), 12), ((7,), 9), ((33, 65), 9), ((3, 5003), 12),
                              ((70001,), 10), ((2, 3, 40961), 14), (((1 << 20) + 3,), 16)):
        for enc in ("raw", "nosign", "signplane", "auto"):
            sp = rng.choice([0.0, 0.5, 0.9, 1.0])
            x = random_bits(rng, shape, dt, sp, signs=enc != "nosign")
            p = BE.pack(dev(x), dtype=dt.name, encoding=enc, chunk_log2=chunk_log2)
            where = f"{dt.name} {shape} {enc} chunk_log2={chunk_log2}"
            assert_same(p, reference.pack_array(x, dt, enc, chunk_log2=chunk_log2), where)
            assert_bits(BE.unpack(p), x, where)


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_fixed_capacity_no_sync_and_overflow(rng, dt):
    x = random_bits(rng, (4, 100003), dt, 0.6)
    nnz = int(np.count_nonzero(x.view(dt.uint)))
    for enc in ("raw", "nosign", "signplane"):
        xx = x if enc != "nosign" else _unsigned(x, dt)
        n = int(np.count_nonzero(xx.view(dt.uint)))
        for cap in (n + 1001, n, n - 777, 0):
            p = BE.pack(dev(xx), dtype=dt.name, encoding=enc, capacity=cap, chunk_log2=12)
            assert p._nnz is None and (p.status is not None) == (enc == "nosign")
            assert_same(p, reference.pack_array(xx, dt, enc, capacity=cap), f"{enc} cap={cap}")
            if cap >= n:
                p.check()
                assert_bits(BE.unpack(p), xx, f"{enc} cap={cap}")
            else:
                with pytest.raises(CapacityOverflowError):
                    BE.unpack(p)
    assert nnz > 0


@pytest.mark.parametrize("incl_every", [700, 63])
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_lookback_walks_many_windows(rng, dt, incl_every):
    """Only every 700th (63rd) tile publishes its inclusive count, so look-backs fold
    whole groups of concurrent predecessors, past the 32 groups one round trip reads:
    at 700 no group's last tile is inclusive (the walk goes back to tile 0), at 63
    only group 1's (the walk stops there, in its second window of groups); sparse
    and empty tiles share stream words."""
    assert NK.LB_GROUP == 32 and 63 % 32 == 31
    be = NumbaBackend(NK.PackVariant(incl_every=incl_every))
    T = NK.kernels_for(dt.name).ptile            # the pack's tile
    n = 1500 * T + 123
    x = random_bits(rng, (n,), dt, 0.999)
    x.view(dt.uint)[5 * T:9 * T] = 0
    for enc in ("nosign", "signplane"):
        xx = x if enc != "nosign" else _unsigned(x, dt)
        p = be.pack(dev(xx), dtype=dt.name, encoding=enc, chunk_log2=9)
        assert_same(p, reference.pack_array(xx, dt, enc, chunk_log2=9), f"walk {enc}")


@pytest.mark.parametrize("fill_limit", [0, 1 << 30])
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_stitch_tiles_sharing_words(rng, dt, fill_limit):
    """Pack tiles holding 0-3 values (and runs of empty ones), so that several tiles
    start inside one stream word and many words are written by the stitch step
    (k_finish, ``fill_limit`` 0) from the tiles' edge records, or by the tiles' ORs
    into values zeroed before the pack (every pack here within the limit), with tiles
    really concurrent; exact and capacities ending inside such a word."""
    be = NumbaBackend(NK.PackVariant(fill_limit=fill_limit))
    T = NK.kernels_for(dt.name).ptile
    n_t = 700
    x = np.zeros(n_t * T + 77, dtype=dt.numpy)
    xb = x.view(dt.uint)
    counts = rng.integers(0, 4, size=n_t)
    counts[100:140] = 0                          # a run of empty tiles
    for k in range(n_t):
        pos = rng.choice(T, size=counts[k], replace=False)
        xb[k * T + pos] = rng.integers(1, 1 << dt.bits, size=pos.size)
    nnz = int(np.count_nonzero(xb))
    for enc in ("raw", "nosign", "signplane"):
        xx = x if enc != "nosign" else _unsigned(x, dt)
        n = int(np.count_nonzero(xx.view(dt.uint)))
        for cap in (None, n - 1, n // 2 + 1, 5):
            p = be.pack(dev(xx), dtype=dt.name, encoding=enc, capacity=cap, chunk_log2=9)
            assert_same(p, reference.pack_array(xx, dt, enc, capacity=cap, chunk_log2=9),
                        f"stitch {enc} cap={cap}")
    assert nnz > 0


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_warp_redux_variant_packs_as_the_reference(rng, dt):
    """The variant that sums the warps' counts by warp reductions (an A/B candidate):
    plain packs of every encoding and capacity kind and masked packs (the relu packs keep
    the loop), over tiles with no nonzeros, with every element nonzero (each warp's count
    at its maximum) and with a single value in the last warp, bit-exact against the
    reference; its unpack family and gated op give them back."""
    be = NumbaBackend(NK.PackVariant(warp_redux=True))
    T = NK.kernels_for(dt.name).ptile
    x = random_bits(rng, (40 * T + 777,), dt, 0.7)
    xb = x.view(dt.uint)
    xb[2 * T:3 * T] = 0
    xb[3 * T:4 * T] = rng.integers(1, 1 << (dt.bits - 1), size=T).astype(dt.uint)
    xb[4 * T:5 * T] = 0
    xb[5 * T - 3] = 1
    for enc in ("raw", "nosign", "signplane"):
        xx = x if enc != "nosign" else _unsigned(x, dt)
        n = int(np.count_nonzero(xx.view(dt.uint)))
        for cap in (None, n, n - 5):
            p = be.pack(dev(xx), dtype=dt.name, encoding=enc, capacity=cap, chunk_log2=9)
            assert_same(p, reference.pack_array(xx, dt, enc, capacity=cap, chunk_log2=9),
                        f"warp_redux {enc} cap={cap}")
            if cap != n - 5:
                assert_bits(be.unpack(p), xx, f"warp_redux unpack {enc} cap={cap}")
    a = _no_neg_nan(x, dt)
    for square in (False, True):
        y, p = be.relu_pack(dev(a), dtype=dt.name, square=square, chunk_log2=12)
        y_ref, p_ref = reference_ops.relu_pack(a, dt, square=square, chunk_log2=12)
        assert_bits(y, y_ref, f"warp_redux relu_pack y square={square}")
        assert_same(p, p_ref, f"warp_redux relu_pack square={square}")
    _check_masked_and_gated(be, dt, random_bits(rng, x.shape, dt, 0.05),
                            random_bits(rng, x.shape, dt, 0.2), p, p_ref, ("raw", "signplane"),
                            "warp_redux ")


@pytest.mark.parametrize("dt", [_group(_dt.BFLOAT16), _group(_dt.FLOAT8_E4M3FN)])
def test_nosign_flag_travels_the_look_back(rng, dt):
    """A sign bit in an early tile of many: the flag reaches the status word through
    the look-back descriptors (inclusive ones, or aggregates when most tiles
    publish none)."""
    T = NK.kernels_for(dt.name).ptile
    x = random_bits(rng, (300 * T + 5,), dt, 0.9, signs=False)
    for incl_every in (1, 7):
        be = NumbaBackend(NK.PackVariant(incl_every=incl_every))
        for where in (3 * T + 11, 150 * T):
            xx = x.copy()
            xx.view(dt.uint)[where] = dt.sign_mask | 1
            p = be.pack(dev(xx), dtype=dt.name, encoding="nosign", capacity=xx.size)
            with pytest.raises(EncodingError):
                p.check()
        p = be.pack(dev(x), dtype=dt.name, encoding="nosign", capacity=x.size)
        p.check()


@pytest.mark.parametrize("dt", [_group(_dt.BFLOAT16), _group(_dt.FLOAT8_E4M3FN)])
def test_nosign_violation(rng, dt):
    x = random_bits(rng, (50001,), dt, 0.5, signs=False)
    x.view(dt.uint)[49999] = dt.sign_mask | 1
    with pytest.raises(EncodingError):
        BE.pack(dev(x), dtype=dt.name, encoding="nosign")
    p = BE.pack(dev(x), dtype=dt.name, encoding="nosign", capacity=50001)
    with pytest.raises(EncodingError):
        p.check()
    assert BE.pack(dev(x), dtype=dt.name, encoding="auto").encoding == bc.Encoding.RAW


@pytest.mark.xdist_group("float16")
def test_misaligned_input_and_out(rng):
    dt = _dt.FLOAT16
    x = random_bits(rng, (123457,), dt, 0.5)
    base = dev(np.concatenate([x[:1], x]).view(dt.numpy))
    xin = base[1:]                       # 2 bytes past an aligned address
    assert xin.data.ptr % 8 != 0
    p = BE.pack(xin, dtype=dt.name, encoding="signplane", chunk_log2=9)
    assert_same(p, reference.pack_array(x, dt, "signplane", chunk_log2=9), "misaligned")
    out_base = cp.zeros(x.size + 1, dtype=cp.float16)
    out = out_base[1:]                   # misaligned output too
    assert BE.unpack(p, out=out) is out
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), x.view(np.uint16))
    with pytest.raises(OutputMismatchError):
        BE.unpack(p, out=cp.zeros(x.size, dtype=cp.float32))


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_unpack_out_aligned_to_8_or_16_bytes(rng, dt):
    """The unpack stores whole rows as 16-byte words into an output aligned to 16
    bytes, and as 8-byte words into one aligned to 8 only: both give the input's
    bits, over several tiles and a partial last row."""
    torch = pytest.importorskip("torch")           # CuPy has no bf16 / fp8 arrays for out=
    n = 3 * (1 << NK.kernels_for(dt.name).utile_log2[0]) + 1001
    x = random_bits(rng, (n,), dt, 0.7)
    p = BE.pack(dev(x), dtype=dt.name, encoding="signplane", chunk_log2=9)
    step = 8 // dt.itemsize
    for shift, align in ((0, 0), (step, 8)):
        base = torch.zeros(n + step, dtype=getattr(torch, dt.name), device="cuda")
        out = base[shift:shift + n]
        assert out.data_ptr() % 16 == align
        assert BE.unpack(p, out=out) is out
        got = out.cpu().view(torch.uint8).numpy()
        assert np.array_equal(got, x.view(np.uint8)), align


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_unpack_tiles_and_chunk_sizes(rng, dt):
    """Plain unpack tiles (``utile_log2[0]``: 16384 fp8 / 8192 others) are larger
    than ``TILE`` (4096): tensors over many of them with an odd size (partial last
    tile and row), empty and nearly empty tiles, chunks smaller than ``TILE``,
    equal to it, between it and the unpack tile (fp8), equal to the unpack tile
    (offsets straight from the chunk table) and larger (the prefix counted per
    ``TILE``); relu2_backward (``TILE``-sized tiles) and a misaligned out= alongside."""
    ul = NK.kernels_for(dt.name).utile_log2[0]
    ut = 1 << ul
    assert ut > NK.TILE
    n = 37 * ut + 4099
    x = random_bits(rng, (n,), dt, 0.7)
    xb = x.view(dt.uint)
    xb[3 * ut:5 * ut] = 0                    # two empty tiles ...
    xb[4 * ut + 5] = 1                       # ... but for one value
    xb[8 * ut + 3:9 * ut - 1] = 0            # a nearly empty one
    for chunk_log2 in sorted({9, NK.TILE_LOG2, NK.TILE_LOG2 + 1, ul, ul + 1, 20}):
        for enc in ("nosign", "signplane", "raw"):
            xx = x if enc != "nosign" else _unsigned(x, dt)
            p = BE.pack(dev(xx), dtype=dt.name, encoding=enc, chunk_log2=chunk_log2)
            where = f"{dt.name} n={n} {enc} chunk_log2={chunk_log2}"
            assert_same(p, reference.pack_array(xx, dt, enc, chunk_log2=chunk_log2), where)
            assert_bits(BE.unpack(p), xx, where)
        if dt.name in ("float16", "float32"):          # CuPy has these dtypes
            out_base = cp.zeros(n + 1, dtype=dt.numpy)
            out = out_base[1:]                           # not 8-byte aligned
            assert BE.unpack(p, out=out) is out
            assert_bits(out, x, f"misaligned out chunk_log2={chunk_log2}")
        a = _no_neg_nan(x, dt)
        g = random_bits(rng, (n,), dt, 0.05)
        _, pa = BE.relu_pack(dev(a), dtype=dt.name, chunk_log2=chunk_log2)
        _, pa_ref = reference_ops.relu_pack(a, dt, chunk_log2=chunk_log2)
        with np.errstate(all="ignore"):
            want = reference_ops.relu2_backward(g, pa_ref)
        assert_bits(BE.relu2_backward(_tdev(g, dt), pa), want,
                    f"relu2_backward chunk_log2={chunk_log2}")


# --------------------------------------------------------------------------- #
# fused ops                                                                   #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_fused_ops(rng, dt):
    shape = (3, 70001)
    a = _no_neg_nan(random_bits(rng, shape, dt, 0.3), dt)
    g = random_bits(rng, shape, dt, 0.05)
    u = random_bits(rng, shape, dt, 0.1)
    for square in (False, True):
        y, p = BE.relu_pack(dev(a), dtype=dt.name, square=square, chunk_log2=12)
        y_ref, p_ref = reference_ops.relu_pack(a, dt, square=square, chunk_log2=12)
        assert_bits(y, y_ref, f"relu_pack y square={square}")
        assert_same(p, p_ref, f"relu_pack p square={square}")
    _, p_fix = BE.relu_pack(dev(a), dtype=dt.name, capacity=p_ref.nnz + 10)
    assert p_fix._nnz is None and p_fix.nnz == p_ref.nnz
    assert_bits(BE.relu_backward(_tdev(g, dt), p), reference_ops.relu_backward(g, p_ref),
                "relu_backward")
    with np.errstate(all="ignore"):
        want2 = reference_ops.relu2_backward(g, p_ref)
    assert_bits(BE.relu2_backward(_tdev(g, dt), p), want2, "relu2_backward")
    _check_masked_and_gated(BE, dt, g, u, p, p_ref, ("raw", "nosign", "signplane"))


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_unpack_prefetch_variant(rng, dt):
    """The unpack family with the L2 prefetch of the tile a quarter of a wave ahead
    (an A/B candidate): over enough tiles that most blocks prefetch and the last ones
    find no tile ahead, from every encoding, exact and fixed capacity, bit-exact."""
    be = NumbaBackend(NK.PackVariant(unpack_prefetch=True))
    n = 3000 * NK.TILE + 1001
    x = _no_neg_nan(random_bits(rng, (n,), dt, 0.8), dt)
    g = random_bits(rng, (n,), dt, 0.05)
    u = random_bits(rng, (n,), dt, 0.3)
    for enc in ("raw", "nosign", "signplane"):
        xx = x if enc != "nosign" else _unsigned(x, dt)
        for cap in (None, int(np.count_nonzero(xx.view(dt.uint))) + 3):
            p = be.pack(dev(xx), dtype=dt.name, encoding=enc, capacity=cap)
            assert_bits(be.unpack(p), xx, f"prefetch unpack {enc} cap={cap}")
    _, p = be.relu_pack(dev(x), dtype=dt.name, square=True)
    _, p_ref = reference_ops.relu_pack(x, dt, square=True)
    with np.errstate(all="ignore"):
        want = reference_ops.relu2_backward(g, p_ref)
    assert_bits(be.relu2_backward(_tdev(g, dt), p), want, "prefetch relu2_backward")
    _check_masked_and_gated(be, dt, g, u, p, p_ref, ("nosign", "signplane"), "prefetch ")


def _rows_of_few(rng, dt, n_rows, most):
    """n_rows 16-byte rows, each with 0 .. ``most`` nonzero elements at random places
    (signs random, no negative NaN: relu_pack's nosign output keeps them)."""
    row = 16 // dt.itemsize
    rank = np.argsort(rng.random((n_rows, row)), axis=1)      # a random order per row
    keep = rank < rng.integers(0, most + 1, size=(n_rows, 1))
    bits = rng.integers(1, 1 << dt.bits, size=(n_rows, row), dtype=np.uint64).astype(dt.uint)
    return _no_neg_nan((bits * keep).reshape(-1).view(dt.numpy), dt)


@pytest.mark.parametrize("dt", [_group(d) for d in DTYPES if d.bits < 32])
def test_window_rows(rng, dt):
    """Rounds whose every row holds at most one value (the warp votes for the single
    path), at most a window's values (unpack.WINDOW_MAX: the window path), and one value
    more (the votes fail in most warps); unpack, relu2_backward and the gated op against
    the reference."""
    from bitsparse_core.backends.numba.unpack import WINDOW_MAX
    cap = WINDOW_MAX[dt.bits]
    n = 40000
    a = np.concatenate([_rows_of_few(rng, dt, n, 1), _rows_of_few(rng, dt, n, cap),
                        _rows_of_few(rng, dt, n, cap + 1)])
    g = random_bits(rng, a.shape, dt, 0.05)
    for enc in ("raw", "nosign", "signplane"):
        x = a if enc != "nosign" else _unsigned(a, dt)
        p = BE.pack(dev(x), dtype=dt.name, encoding=enc, chunk_log2=12)
        assert_bits(BE.unpack(p), x, f"unpack {enc}")
    _, p = BE.relu_pack(dev(a), dtype=dt.name, chunk_log2=12)
    _, p_ref = reference_ops.relu_pack(a, dt, chunk_log2=12)
    with np.errstate(all="ignore"):
        want = reference_ops.relu2_backward(g, p_ref)
        p_u = BE.masked_pack(dev(g), p, dtype=dt.name, encoding="signplane")
        gg_ref, gu_ref = reference_ops.gated_backward(
            g, p_ref, reference_ops.masked_pack(g, dt, p_ref, encoding="signplane"))
    assert_bits(BE.relu2_backward(_tdev(g, dt), p), want, "relu2_backward")
    gg, gu = BE.gated_backward(_tdev(g, dt), p, p_u)
    assert_bits(gu, gu_ref, "gated grad_u")
    assert_bits(gg, gg_ref, "gated grad_g")


def _tdev(x, dt):
    """A dense CUDA input exporting its true dtype through DLPack (bf16 / fp8 too)."""
    arr = dev(x)
    return ci.CudaArray(arr.data.ptr, arr.shape, dt, arr.device.id, arr,
                        cp.cuda.get_current_stream().ptr)


# --------------------------------------------------------------------------- #
# agreement with the CuPy backend                                             #
# --------------------------------------------------------------------------- #
@pytest.mark.skipif(not CUPY_OK, reason="CuPy backend unavailable")
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_same_planes_as_cupy_and_cross_unpack(rng, dt):
    cb = bc.get_backend("cupy")
    for shape, enc, cap in (((5, 77777), "raw", None), ((5, 77777), "signplane", None),
                            (((1 << 20) + 5,), "nosign", None), ((300001,), "signplane", 120000),
                            ((300001,), "raw", 200000)):
        x = random_bits(rng, shape, dt, 0.6, signs=enc != "nosign")
        pn = BE.pack(dev(x), dtype=dt.name, encoding=enc, capacity=cap)
        pc = cb.pack(dev(x), dtype=dt.name, encoding=enc, capacity=cap)
        assert pn.nnz == pc.nnz
        assert_same(pn, pc, f"numba vs cupy {shape} {enc} cap={cap}")
        if cap is None or cap >= pn.nnz:
            assert_bits(cb.unpack(pn), x, "cupy unpacks numba")
            assert_bits(BE.unpack(pc), x, "numba unpacks cupy")
    a = _no_neg_nan(random_bits(rng, (2, 50021), dt, 0.4), dt)
    g = random_bits(rng, (2, 50021), dt, 0.0)
    u = random_bits(rng, (2, 50021), dt, 0.0)
    yn, pn = BE.relu_pack(dev(a), dtype=dt.name, square=True)
    yc, pc = cb.relu_pack(dev(a), dtype=dt.name, square=True)
    assert np.array_equal(np.asarray(BE.to_numpy(yn)).view(dt.uint),
                          np.asarray(cb.to_numpy(yc)).view(dt.uint))
    assert_same(pn, pc, "relu_pack numba vs cupy")
    un = BE.masked_pack(dev(u), pc, dtype=dt.name)      # numba's companion of cupy's mask
    uc = cb.masked_pack(dev(u), pn, dtype=dt.name)
    assert_same(un, uc, "masked_pack across backends")
    gn = BE.gated_backward(_tdev(g, dt), pn, un)
    gc = cb.gated_backward(_tdev(g, dt), pc, uc)
    for a_, b_ in zip(gn, gc):
        assert np.array_equal(np.asarray(BE.to_numpy(a_)).view(dt.uint),
                              np.asarray(cb.to_numpy(b_)).view(dt.uint))


# --------------------------------------------------------------------------- #
# streams, inputs, allocator                                                  #
# --------------------------------------------------------------------------- #
@pytest.mark.xdist_group("bfloat16")
def test_streams_order_work(rng):
    """Producer work pending on one stream, pack on another, unpack on a third:
    the DLPack stream rule and our stream arguments order everything."""
    torch = pytest.importorskip("torch")
    dt = _dt.BFLOAT16
    x = random_bits(rng, (1 << 22,), dt, 0.5)
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        tx = torch.from_numpy(x.view(np.int16)).to("cuda").view(torch.bfloat16)
        torch.cuda._sleep(50_000_000)                        # keep s1 busy
        tx2 = tx.clone()                                     # still queued on s1
        p = BE.pack(tx2, encoding="signplane", stream=s2)    # DLPack: s2 waits for s1
    with torch.cuda.stream(s3):
        torch.cuda._sleep(20_000_000)
    y = BE.unpack(p, stream=s3)
    ty = torch.from_dlpack(y)                                # waits for s3 on the current stream
    assert torch.equal(ty.view(torch.int16).cpu(), torch.from_numpy(x.view(np.int16)))
    assert_same(p, reference.pack_array(x, dt, "signplane"), "streams")
    # A fixed-capacity pack on a busy stream returns before the work is done.
    with torch.cuda.stream(s2):
        torch.cuda._sleep(50_000_000)
    pf = BE.pack(tx2, encoding="signplane", stream=s2, capacity=x.size)
    assert pf._nnz is None
    assert pf.nnz == int(np.count_nonzero(x.view(np.uint16)))


@pytest.mark.xdist_group("float32")
def test_cai_numba_and_jax_inputs(rng):
    from numba import cuda
    dt = _dt.FLOAT32
    x = random_bits(rng, (100003,), dt, 0.7)
    d = cuda.to_device(x.view(np.uint32))                   # __cuda_array_interface__ only
    p = BE.pack(d, dtype="float32", encoding="raw", stream=cuda.default_stream())
    assert_same(p, reference.pack_array(x, dt, "raw"), "numba device array input")
    try:
        import jax
        import jax.numpy as jnp
        gpu = [dv for dv in jax.devices() if dv.platform == "gpu"]
    except Exception:  # noqa: BLE001 -- no JAX / no GPU JAX: skip that part
        gpu = []
    if gpu:
        jx = jax.device_put(jnp.asarray(x.view(np.uint32)).view(jnp.float32), gpu[0])
        p = BE.pack(jx, encoding="raw")
        assert_same(p, reference.pack_array(x, dt, "raw"), "jax input")


@pytest.mark.xdist_group("bfloat16")
def test_torch_allocator_sees_memory(rng):
    torch = pytest.importorskip("torch")
    dt = _dt.BFLOAT16
    x = random_bits(rng, (3_000_001,), dt, 0.5)
    calls = []

    def alloc(nbytes, device, stream):
        calls.append(nbytes)
        return ci.torch_allocator(nbytes, device, stream)

    tx = torch.from_numpy(x.view(np.int16)).to("cuda").view(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    p = BE.pack(tx, encoding="signplane", capacity=x.size, allocator=alloc)
    assert len(calls) == 1, "a fixed-capacity pack allocates once (its scratch included)"
    assert torch.cuda.memory_allocated() - before >= p.nbytes - p.layout.header_size
    assert_same(p, reference.pack_array(x, dt, "signplane", capacity=x.size), "torch allocator")
    y = BE.unpack(p, allocator=alloc)
    assert_bits(y, x, "torch allocator unpack")


# --------------------------------------------------------------------------- #
# launches by function handle                                                 #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dt", DT_PARAMS)
def test_every_kernel_launches_by_handle_after_its_first_launch(rng, dt):
    """Each kernel the ops launch passes launch.py's checks (parameter sizes from the
    driver, values against Numba's marshalling), and the results of launches by handle
    (every call after a kernel's first) are the reference's."""
    from bitsparse_core.backends.numba import backend as nb
    from bitsparse_core.backends.numba.launch import HandleLaunch
    shape = (5, 40961)
    a = _no_neg_nan(random_bits(rng, shape, dt, 0.4), dt)
    g = random_bits(rng, shape, dt, 0.05)
    u = random_bits(rng, shape, dt, 0.1)
    y_ref, p_ref = reference_ops.relu_pack(a, dt, chunk_log2=16)
    pu_ref = reference_ops.masked_pack(u, dt, p_ref, encoding="signplane")
    with np.errstate(all="ignore"):
        gg_ref, gu_ref = reference_ops.gated_backward(g, p_ref, pu_ref)
        r2_ref = reference_ops.relu2_backward(g, p_ref)
    for turn in range(2):
        y, p = BE.relu_pack(dev(a), dtype=dt.name, chunk_log2=16)
        p_fix = BE.pack(dev(y_ref), dtype=dt.name, encoding="nosign", capacity=p_ref.nnz,
                        chunk_log2=16)
        p_u = BE.masked_pack(dev(u), p, dtype=dt.name)
        gg, gu = BE.gated_backward(_tdev(g, dt), p, p_u)
        where = f"{dt.name} turn {turn}"
        assert_bits(y, y_ref, where)
        assert_same(p, p_ref, where)
        assert_same(p_u, pu_ref, where)
        assert_bits(BE.unpack(p_fix), y_ref, where)
        assert_bits(BE.relu_backward(_tdev(g, dt), p), reference_ops.relu_backward(g, p_ref), where)
        assert_bits(BE.relu2_backward(_tdev(g, dt), p), r2_ref, where)
        assert_bits(gg, gg_ref, where)
        assert_bits(gu, gu_ref, where)
    launches = nb._platform()._local.launches
    kept = [key[0] for key, launch in launches.items() if not isinstance(launch, HandleLaunch)]
    assert launches and not kept, f"kernels left on the dispatcher: {kept}"


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_a_plan_packs_other_tensors_by_its_own_records(rng, dt):
    """From a plan's third pack on a thread, its launches go by records of its own that
    take only the new addresses (backend._PackLaunches): two tensors packed in turn with
    one plan, at 8-byte aligned and misaligned addresses in turn, give the reference's
    bytes (and the CuPy backend's) every time, in every pack variant: fixed capacity,
    exact (two blocks, the count to a pinned slot), relu_pack, masked_pack."""
    from bitsparse_core.backends.numba import backend as nb
    nb._PACK_LAUNCHES._entries().clear()
    cb = bc.get_backend("cupy") if CUPY_OK else None
    shape, c = (3, 40961), 12
    xs = [_unsigned(random_bits(rng, shape, dt, sp), dt) for sp in (0.6, 0.8)]
    as_ = [_no_neg_nan(random_bits(rng, shape, dt, sp), dt) for sp in (0.3, 0.5)]
    us = [random_bits(rng, shape, dt, 0.1) for _ in range(2)]
    m = random_bits(rng, shape, dt, 0.7)
    cap = max(int(np.count_nonzero(x.view(dt.uint))) for x in xs) + 5
    cap_r = max(reference_ops.relu_pack(a, dt, chunk_log2=c)[1].nnz for a in as_) + 3
    fixed_ref = [reference.pack_array(x, dt, "nosign", capacity=cap, chunk_log2=c) for x in xs]
    exact_ref = [reference.pack_array(x, dt, "signplane", chunk_log2=c) for x in xs]
    relu_ref = [reference_ops.relu_pack(a, dt, chunk_log2=c, capacity=cap_r) for a in as_]
    m_ref = reference.pack_array(m, dt, "signplane", chunk_log2=c)
    masks = [BE.pack(dev(m), dtype=dt.name, encoding="signplane", chunk_log2=c) for _ in range(2)]
    masked_ref = [reference_ops.masked_pack(u, dt, m_ref) for u in us]

    def placed(x, off):
        """x on the device ``off`` elements past an 8-byte aligned address."""
        return dev(np.concatenate([x.reshape(-1)[:off], x.reshape(-1)]))[off:].reshape(x.shape)

    for turn in range(10):
        i, off = turn % 2, (turn // 2) % 2
        where = f"{dt.name} turn {turn}"
        x = placed(xs[i], off)
        assert (x.data.ptr % 8 != 0) == bool(off)
        p = BE.pack(x, dtype=dt.name, encoding="nosign", capacity=cap, chunk_log2=c)
        assert_same(p, fixed_ref[i], f"fixed {where}")
        if cb is not None:
            assert_same(p, cb.pack(x, dtype=dt.name, encoding="nosign", capacity=cap,
                                   chunk_log2=c), f"fixed vs cupy {where}")
        assert_same(BE.pack(dev(xs[i]), dtype=dt.name, encoding="signplane", chunk_log2=c),
                    exact_ref[i], f"exact {where}")
        y, pr = BE.relu_pack(dev(as_[i]), dtype=dt.name, capacity=cap_r, chunk_log2=c)
        assert_bits(y, relu_ref[i][0], f"relu y {where}")
        assert_same(pr, relu_ref[i][1], f"relu {where}")
        assert_same(BE.masked_pack(dev(us[i]), masks[i], dtype=dt.name), masked_ref[i],
                    f"masked {where}")
    kept = [v for _, v in nb._PACK_LAUNCHES._entries().values()]
    # fixed (aligned and not), exact, relu_pack, masked_pack
    assert sum(type(v) is nb._PackLaunches for v in kept) == 5, kept


@pytest.mark.parametrize("dt", DT_PARAMS)
def test_unpack_ops_launch_other_tensors_by_their_own_records(rng, dt):
    """From a key's third call on a thread, the unpack family launches by records of its
    own that take only the new addresses (NumbaBackend._queue): two packed tensors of one
    layout, their gradients at 8-byte aligned and misaligned addresses in turn, through
    unpack (into a fresh and a given output), relu2_backward, relu_backward and both
    gated forms (u under r's mask, u under its own), give the reference's bytes every
    time."""
    from bitsparse_core.backends.numba import backend as nb
    nb._OP_LAUNCHES._entries().clear()
    shape, c = (3, 40961), 12
    as_ = [_no_neg_nan(random_bits(rng, shape, dt, sp), dt) for sp in (0.4, 0.6)]
    gs = [random_bits(rng, shape, dt, 0.05) for _ in range(2)]
    us = [random_bits(rng, shape, dt, 0.1) for _ in range(2)]
    refs = [reference_ops.relu_pack(a, dt, chunk_log2=c, capacity=a.size) for a in as_]
    packed = [BE.relu_pack(dev(a), dtype=dt.name, chunk_log2=c, capacity=a.size)[1]
              for a in as_]
    masked = [BE.masked_pack(dev(u), p, dtype=dt.name) for u, p in zip(us, packed)]
    own = [BE.pack(dev(u), dtype=dt.name, encoding="signplane", chunk_log2=c,
                   capacity=u.size) for u in us]

    def placed(x, off):
        """x on the device ``off`` elements past an 8-byte aligned address."""
        flat = dev(np.concatenate([x.reshape(-1)[:off], x.reshape(-1)]))
        return ci.CudaArray(flat.data.ptr + off * dt.itemsize, shape, dt, flat.device.id, flat,
                            cp.cuda.get_current_stream().ptr)

    for turn in range(8):
        i, off = turn % 2, turn // 4
        where = f"{dt.name} turn {turn}"
        (y_ref, p_ref), p, g = refs[i], packed[i], gs[i]
        gd = placed(g, off)
        assert (gd.ptr % 8 != 0) == bool(off)
        out = _tdev(np.invert(y_ref.view(dt.uint)).view(y_ref.dtype), dt)  # all differ from y
        assert BE.unpack(p, out=out) is out
        assert_bits(out, y_ref, f"unpack out= {where}")
        assert_bits(BE.unpack(p), y_ref, f"unpack {where}")
        with np.errstate(all="ignore"):
            assert_bits(BE.relu2_backward(gd, p), reference_ops.relu2_backward(g, p_ref),
                        f"relu2_backward {where}")
            assert_bits(BE.relu_backward(gd, p), reference_ops.relu_backward(g, p_ref),
                        f"relu_backward {where}")
            for pu, form in ((masked[i], "masked"), (own[i], "own")):
                gg_ref, gu_ref = reference_ops.gated_backward(
                    g, p_ref, reference.pack_array(us[i], dt, "signplane", capacity=us[i].size,
                                                   chunk_log2=c)
                    if form == "own" else reference_ops.masked_pack(us[i], dt, p_ref))
                gg, gu = BE.gated_backward(gd, p, pu)
                assert_bits(gg, gg_ref, f"gated {form} grad_g {where}")
                assert_bits(gu, gu_ref, f"gated {form} grad_u {where}")
    # every key came back (two packed tensors per layout): each has its record, ten in
    # all (unpack, u's own unpack, and four ops at two alignments of the gradient)
    kept = [v for _, v in nb._OP_LAUNCHES._entries().values()]
    assert len(kept) >= 10 and all(type(v) is nb.BoundLaunch for v in kept), kept


@pytest.mark.xdist_group("bfloat16")
def test_entry_points_run_with_or_without_a_current_context(rng):
    """With a current context (here torch's) an op runs in it, on the device it names
    (asked once by the entry point, and forgotten when it returns); a thread that has
    made no CUDA call yet has none, and the op then runs in a Numba context scope: the
    same bytes either way."""
    import threading

    from bitsparse_core.backends.cuda import driver
    from bitsparse_core.backends.numba import backend as nb
    torch = pytest.importorskip("torch")
    dt = _dt.BFLOAT16
    x = random_bits(rng, (70_001,), dt, 0.9)
    tx = torch.from_numpy(x.view(np.int16)).to("cuda").view(torch.bfloat16)
    assert driver.current_device() == torch.cuda.current_device()
    p = BE.pack(tx, encoding="signplane", capacity=x.size)
    assert getattr(nb._ENTRY, "device", None) is None
    seen = {}

    def fresh_thread():
        seen["context before"] = driver.has_context()
        seen["planes"] = BE.pack(tx, encoding="signplane", capacity=x.size)
        seen["unpacked"] = BE.unpack(p)
        seen["device after"] = getattr(nb._ENTRY, "device", None)
    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert seen["context before"] is False and seen["device after"] is None
    want = reference.pack_array(x, dt, "signplane", capacity=x.size)
    assert_same(p, want, "current context")
    assert_same(seen["planes"], want, "fresh thread")
    assert_bits(seen["unpacked"], x, "fresh thread unpack")


@pytest.mark.xdist_group("float16")
def test_half_conversions_are_the_reference_ones():
    """The fused ops' 16-bit float conversions on the GPU (the conversion instructions):
    every float16 pattern but NaN widened to float32 exactly, and pairs of float32 values
    rounded to float16 and to bfloat16 as NumPy and ml_dtypes round them (nearest-even,
    overflow to inf, subnormals kept), the first of a pair in the word's upper half. NaN
    is left out: a NaN operand makes a NaN product, and the fused ops compute that row by
    bitfloat's per-element rules (fused_rows)."""
    import ml_dtypes
    from numba import cuda
    from bitsparse_core.backends.numba.common import (_bf16_round_pair, _f16_round_pair,
                                                      _f16_widen)

    @cuda.jit
    def k(h, wide, hi, lo, r16, rb16):
        i = cuda.grid(1)
        if i < h.size:
            wide[i] = _f16_widen(h[i])
        if i < hi.size:
            r16[i] = _f16_round_pair(hi[i], lo[i])
            rb16[i] = _bf16_round_pair(hi[i], lo[i])

    h = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(7)
    # Every exponent but NaN's and inf's (each dtype's subnormals, normals and overflow),
    # the low bits near either dtype's rounding boundary (bit 12 for float16, 15 for
    # bfloat16) and random mantissas; signs both ways; zeros and infinities.
    e = np.arange(0, 255, dtype=np.uint32)
    near = np.arange(-64, 64, dtype=np.int64)
    low = np.concatenate([(b + near) & 0x7FFFFF for b in (0, 1 << 12, 1 << 13, 1 << 15,
                                                           1 << 16, 1 << 17)]
                         + [rng.integers(0, 1 << 23, 512)]).astype(np.uint32)
    low = low | (rng.integers(0, 1 << 7, low.size).astype(np.uint32) << 16)
    f = ((e[:, None] << 23) | low[None, :]).reshape(-1)
    f = np.concatenate([f, f | 0x80000000, np.array([0, 0x80000000, 0x7F800000, 0xFF800000,
                                                     0x7F7FFFFF, 0xFF7FFFFF],
                                                    dtype=np.uint32)])
    hi, lo = f, rng.permutation(f)
    wide = cuda.device_array(h.size, dtype=np.int64)
    r16 = cuda.device_array(f.size, dtype=np.int64)
    rb16 = cuda.device_array(f.size, dtype=np.int64)
    n = max(h.size, f.size)
    k[(n + 255) // 256, 256](cuda.to_device(h), wide, cuda.to_device(hi), cuda.to_device(lo),
                             r16, rb16)
    want_wide = h.view(np.float16).astype(np.float32).view(np.uint32)
    num = ~np.isnan(h.view(np.float16))
    np.testing.assert_array_equal(wide.copy_to_host().astype(np.uint32)[num], want_wide[num])
    for got, dtype in ((r16, np.float16), (rb16, ml_dtypes.bfloat16)):
        with np.errstate(over="ignore"):
            half = [a.view(np.float32).astype(dtype).view(np.uint16).astype(np.int64)
                    for a in (hi, lo)]
        np.testing.assert_array_equal(got.copy_to_host(), (half[0] << 16) | half[1],
                                      err_msg=np.dtype(dtype).name)
