"""The numba backend under Numba's CUDA simulator: bit-exact against the reference.

CI has no GPU. This module runs the numba backend's own kernels and host code in
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), in a child pytest process: the
variable must be set before ``numba.cuda`` is first imported, and other tests of
this process may already have imported it. Run directly with the variable set,
the tests below run in-process.

The generic contract (every dtype x encoding for pack and unpack, exact and
fixed capacity, overflow, every fused op, empty and 0-d tensors, ``out=``,
special bit patterns) is checked for every backend, this one under the
simulator included, by tests/test_backend_conformance.py. What CI covers here
(simulator, tiny tensors) is the numba backend's own machinery: nosign sign
violations in the status word, chunks smaller and larger than a kernel tile
(the unpack tiles and the mask-prefix path), inputs not 8-byte aligned (the
element-wise load path), the one-block scan, the decoupled look-back walking
over aggregates and groups of tiles (and carrying the nosign flag), the GPU's
pack rounds, and the stitching of stream words shared by tiles.

The simulator path differs from the GPU path only in the warp scan and broadcast
(shared memory instead of ``shfl_up_sync`` / ``shfl_sync``), the unpack's vote on
windowed rows (each row decides alone instead of the warp), the float32 bit
casts and the byte permute (NumPy and a Python loop instead of libdevice) and
the tile sizes (64 threads instead of 256: pack tiles of 1024 elements instead
of 64 bytes per thread, i.e. 8192 bf16 / 16384 fp8; unpack tiles of 4096 fp8 /
2048 others instead of 16384 / 8192; ``TILE`` 1024 instead of 4096; look-back
groups of 4 tiles instead of 32, walked by one thread instead of warp 0's windows).

What only the GPU run covers (tests/test_gpu_numba.py): the shuffle scan, the
libdevice casts and byte permute as compiled by NVVM, float32 products on the GPU's FPU
(subnormals, no flush-to-zero), the GPU's tile sizes, torch / CuPy / JAX device
inputs (DLPack and __cuda_array_interface__), explicit streams, the pluggable
allocator, and agreement with the CuPy backend.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import SIM_ACTIVE, run_in_simulator


if not SIM_ACTIVE:
    def test_simulator_suite():
        """Run this module again in a child process with the simulator switched on."""
        run_in_simulator(__file__)

else:
    pytest.importorskip("numba.cuda")
    from bitsparse_core import dtypes as D
    from bitsparse_core.spec import codec as R
    from bitsparse_core.spec import ops as RO
    from bitsparse_core.errors import EncodingError
    from bitsparse_core.backends.numba import kernels as NK
    from bitsparse_core.backends.numba.backend import NumbaBackend
    from helpers import random_tensor, same_bits

    assert NK.SIM, "numba_kernels did not pick its simulator path"
    BE = NumbaBackend()
    IDS = lambda d: d.name  # noqa: E731
    PLANES = ("mask", "offsets", "values", "signs")

    def _rng(*key):
        return np.random.default_rng(abs(hash(key)) % 2**32)

    def _assert_planes(p, ref):
        assert p.shape == ref.shape and p.dtype == ref.dtype
        assert p.encoding == ref.encoding and p.capacity == ref.capacity
        assert p.chunk_log2 == ref.chunk_log2
        for name in PLANES:
            a, b = np.asarray(getattr(p, name)), np.asarray(getattr(ref, name))
            assert a.dtype == b.dtype, name
            assert np.array_equal(a, b), f"{name} differs at bytes {np.flatnonzero(a != b)[:8]}"

    def _no_neg_nan(x, dtype):
        """Clear the sign of negative NaNs (relu keeps them, so nosign would refuse)."""
        b = x.view(dtype.uint).copy()
        f = x.astype(np.float32)
        b[np.isnan(f)] &= np.array(dtype.sign_mask - 1, dtype=dtype.uint)
        return b.view(dtype.numpy)

    # ------------------------------------------------------------------ pack
    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN, D.FLOAT32], ids=IDS)
    def test_nosign_violation(dtype):
        x = random_tensor(_rng("viol", dtype.name), (600,), dtype, 0.5, signed=False)
        b = x.view(dtype.uint)
        b[577] = dtype.sign_mask | 3
        with pytest.raises(EncodingError):
            BE.pack(x, encoding="nosign", chunk_log2=9)
        p = BE.pack(x, encoding="nosign", chunk_log2=9, capacity=600)
        assert p._nnz is None and p.status is not None
        assert BE.read_status(p) & 1
        with pytest.raises(EncodingError):
            p.check()
        # A clean tensor leaves the status word at zero.
        b[577] = 3
        p = BE.pack(x, encoding="nosign", chunk_log2=9, capacity=600)
        assert BE.read_status(p) == 0
        p.check()

    @pytest.mark.parametrize("dtype", [D.FLOAT16, D.FLOAT8_E5M2], ids=IDS)
    @pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
    def test_large_chunks_and_unaligned_input(dtype, encoding):
        """chunk_log2=11 (chunks span two simulator tiles: the mask-prefix path) and an
        input that starts one element past an aligned address (element loads)."""
        rng = _rng("big", dtype.name, encoding)
        base = random_tensor(rng, (2601,), dtype, 0.4, signed=encoding != "nosign")
        x = base[1:]
        assert x.ctypes.data % 8 != 0
        ref = R.pack_array(np.ascontiguousarray(x), dtype, encoding, chunk_log2=11)
        p = BE.pack(x, encoding=encoding, chunk_log2=11)
        _assert_planes(p, ref)
        out_base = np.zeros(2601, dtype=dtype.numpy)
        out = out_base[1:]
        assert BE.unpack(p, out=out) is out
        assert same_bits(out, x, dtype)

    @pytest.mark.parametrize("dtype,chunk_log2", [
        (D.FLOAT8_E4M3FN, 9), (D.FLOAT8_E4M3FN, 11), (D.FLOAT8_E5M2, 13),
        (D.BFLOAT16, 11), (D.FLOAT16, 12), (D.FLOAT32, 10)], ids=str)
    def test_unpack_tiles(dtype, chunk_log2):
        """Unpack tiles are UNPACK_ROWS rows per thread (simulator: 4096 fp8 / 2048
        16- and 32-bit elements), larger than ``TILE``: tensors over several of
        them with a partial last tile, one tile empty and one nearly so, chunks
        smaller than ``TILE``, between it and the unpack tile, equal to the
        unpack tile (tile offsets straight from the chunk offsets) and larger
        (the prefix counted per ``TILE``); relu2_backward (``TILE``-sized) alongside."""
        ut = 1 << NK.kernels_for(dtype.name).utile_log2[0]
        assert ut > NK.TILE
        n = 2 * ut + 3 * 64 + 13
        for enc in ("nosign", "signplane", "raw"):
            if enc == "raw" and chunk_log2 != 11:
                continue
            rng = _rng("utiles", dtype.name, chunk_log2, enc)
            x = random_tensor(rng, (n,), dtype, 0.4, signed=enc != "nosign")
            xb = x.view(dtype.uint)
            xb[ut:2 * ut] = 0                          # an empty tile
            xb[ut + 100] = 1                           # ... but for one value
            xb[2 * ut + 7:2 * ut + 90] = 0
            p = BE.pack(x, encoding=enc, chunk_log2=chunk_log2)
            _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=chunk_log2))
            assert same_bits(BE.unpack(p), x, dtype), enc
        # relu2_backward over the same geometry (its own, pack-sized tile).
        rng = _rng("utiles-bw", dtype.name, chunk_log2)
        a = _no_neg_nan(random_tensor(rng, (n,), dtype, 0.5), dtype)
        g = random_tensor(rng, (n,), dtype, 0.05)
        _, p = BE.relu_pack(a, encoding="nosign", chunk_log2=chunk_log2)
        _, p_ref = RO.relu_pack(a, dtype, encoding="nosign", chunk_log2=chunk_log2)
        with np.errstate(all="ignore"):
            want = RO.relu2_backward(g, p_ref)
        assert same_bits(BE.relu2_backward(g, p), want, dtype)

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN, D.FLOAT16], ids=IDS)
    @pytest.mark.parametrize("encoding", ["nosign", "signplane"])
    def test_unpack_window_rows(dtype, encoding):
        """Rows of 16 bytes holding 0 .. WINDOW_MAX + 1 stored values, the first at
        every offset in its decoded word: those of at most one value place it alone,
        the others within the cap read one window (under the simulator each row decides
        alone, so the paths run side by side), the rest expand. Unpack, relu2_backward
        and the gated op (u under r's mask) against the reference."""
        from bitsparse_core.backends.numba.unpack import WINDOW_MAX
        cap = WINDOW_MAX[dtype.bits]
        row = 16 // dtype.itemsize
        rng = _rng("window", dtype.name, encoding)
        n_rows = 3 * 64 + 5                       # several simulator unpack tiles' rows
        counts = np.arange(n_rows) % (cap + 2)    # 0 .. cap + 1, the first-value offsets
        rng.shuffle(counts)                       # (the running count) take every residue
        a = np.zeros(n_rows * row, dtype=dtype.uint)
        for i, c in enumerate(counts):
            at = i * row + rng.choice(row, size=int(c), replace=False)
            a[at] = rng.integers(1, 1 << (dtype.bits - 1), size=int(c), dtype=np.uint64)
        if encoding == "signplane":                 # signed values, still nonzero
            a[(a != 0) & (rng.random(a.size) < 0.5)] |= np.array(dtype.sign_mask, dtype.uint)
        a = _no_neg_nan(a.view(dtype.numpy), dtype)
        p = BE.pack(a, encoding=encoding, chunk_log2=10)
        assert same_bits(BE.unpack(p), a, dtype)
        # The fused ops over the same rows: r = relu(a) under its own mask.
        g = random_tensor(rng, a.shape, dtype, 0.0, specials=False)
        u = random_tensor(rng, a.shape, dtype, 0.0, signed=encoding != "nosign",
                          specials=False)
        r = np.where(a.view(dtype.uint) >> (dtype.bits - 1) == 0, a, np.zeros((), dtype.numpy))
        _, p_r = BE.relu_pack(a, encoding="nosign", chunk_log2=10)
        _, p_r_ref = RO.relu_pack(a, dtype, encoding="nosign", chunk_log2=10)
        assert same_bits(BE.unpack(p_r), r, dtype)
        with np.errstate(all="ignore"):
            assert same_bits(BE.relu2_backward(g, p_r), RO.relu2_backward(g, p_r_ref), dtype)
            p_u = BE.masked_pack(u, p_r, encoding=encoding)
            p_u_ref = RO.masked_pack(u, dtype, p_r_ref, encoding=encoding)
            got, want = BE.gated_backward(g, p_r, p_u), RO.gated_backward(g, p_r_ref, p_u_ref)
        assert all(same_bits(x, y, dtype) for x, y in zip(got, want))

    # ------------------------------------------------------------- kernels
    def test_scan_kernel_many_passes():
        """The one-block scan (unpack's tile offsets when chunks span several tiles)
        over more entries than one pass of its threads holds."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        rng = _rng("scan")
        n = 5 * NK.SCAN_NT * NK.SCAN_PER + 3
        counts = rng.integers(0, NK.TILE + 1, size=n).astype(np.int64)
        cnt = np.append(counts, -1).astype(np.int64)
        info = np.full(2, -1, dtype=np.int64)
        NK.k_scan[1, NK.SCAN_NT](FakeCUDAArray(cnt), n, FakeCUDAArray(info))
        want = np.concatenate([[0], np.cumsum(counts)])
        assert np.array_equal(cnt, want)
        assert info[0] == want[-1] and info[1] == 0

    @pytest.mark.parametrize("fill_limit", [0, NK.PackVariant.fill_limit])
    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT32, D.FLOAT8_E4M3FN], ids=IDS)
    def test_lookback_walks_aggregates(dtype, fill_limit):
        """Tiles that publish only their own count make later tiles' look-back walk
        back over several predecessors, summing their counts (in the simulator
        blocks run in order, so otherwise the nearest one is always done). Some
        tiles hold fewer than 32 stream bits, so several tiles share a stream word:
        k_finish writes it (``fill_limit`` 0) or the tiles OR their bits into it."""
        be = NumbaBackend(NK.PackVariant(incl_every=3, fill_limit=fill_limit))
        rng = _rng("walk", dtype.name)
        T = NK.kernels_for(dtype.name).ptile         # the pack's tile
        x = random_tensor(rng, (5 * T + 7,), dtype, 0.5)
        xb = x.view(dtype.uint)
        xb[T:2 * T] = 0                              # an empty tile
        xb[2 * T:3 * T - 1] = 0                      # one value in this tile
        xb[3 * T:4 * T - 2] = 0                      # two in this one
        for enc in ("raw", "signplane"):
            for cap in (None, int(np.count_nonzero(xb)) - 3):
                p = be.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
                _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))

    @pytest.mark.parametrize("dtype,encodings,variant", [
        (D.FLOAT8_E4M3FN, ("nosign", "signplane"), {}),
        (D.BFLOAT16, ("raw", "nosign"), {"lb_early": True, "ticket": False})], ids=str)
    def test_pack_gpu_rounds(dtype, encodings, variant):
        """The pack with the GPU's groups per thread (fp8: 8, a 64-bit packed scan;
        bf16: 4) instead of the simulator's 2, over a few of its larger tiles:
        a sparse and an empty tile, then one whose first warp holds only nonzeros
        (every round's 8-bit count field full, the top one wrapping), exact and
        fixed capacity. bf16 also runs two variants of the A/B knobs (the count
        published before staging, tiles by block index)."""
        v = NK.PackVariant(pack_rounds=NK.pack_rounds_for(dtype.bits, sim=False), **variant)
        be = NumbaBackend(v)
        T = NK.kernels_for(dtype.name, v).ptile
        rng = _rng("gpurounds", dtype.name)
        x = random_tensor(rng, (2 * T + 3 * T // 4 + 5,), dtype, 0.9, signed=False)
        xb = x.view(dtype.uint)
        xb[T:2 * T] = 0
        xb[2 * T:2 * T + T // 2 + 3] |= 1
        for i, enc in enumerate(encodings):
            nnz = int(np.count_nonzero(xb))
            cap = None if i == 0 else nnz - 50
            p = be.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN], ids=IDS)
    def test_warp_redux_variant(dtype):
        """The variant whose warps' counts are summed by warp reductions (here through
        shared memory): plain and masked packs (the relu packs keep the loop) over an
        empty tile, a tile of nonzeros only (both warps' counts at their maximum) and one
        whose only value lies in its last warp, against the reference; the unpack family
        of the same variant gives the tensors back."""
        be = NumbaBackend(NK.PackVariant(warp_redux=True))
        T = NK.kernels_for(dtype.name).ptile
        rng = _rng("redux", dtype.name)
        x = random_tensor(rng, (4 * T + 9,), dtype, 0.6, signed=False)
        xb = x.view(dtype.uint)
        xb[0:T] = 0
        xb[T:2 * T] = rng.integers(1, 1 << (dtype.bits - 1), size=T).astype(dtype.uint)
        xb[2 * T:3 * T] = 0
        xb[3 * T - 2] = 1
        n = int(np.count_nonzero(xb))
        for enc, cap in (("nosign", None), ("raw", n - 4), ("signplane", n)):
            p = be.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))
            if cap is None:
                assert same_bits(be.unpack(p), x, dtype), enc
        y, p = be.relu_pack(x, square=True, chunk_log2=9)
        y_ref, p_ref = RO.relu_pack(x, dtype, square=True, chunk_log2=9)
        assert same_bits(y, y_ref, dtype)
        _assert_planes(p, p_ref)
        u = random_tensor(rng, x.shape, dtype, 0.3)
        p_u = be.masked_pack(u, p, encoding="signplane")
        pu_ref = RO.masked_pack(u, dtype, p_ref, encoding="signplane")
        _assert_planes(p_u, pu_ref)
        g = random_tensor(rng, x.shape, dtype, 0.1)
        with np.errstate(all="ignore"):
            gg, gu = be.gated_backward(g, p, p_u)
            gg_ref, gu_ref = RO.gated_backward(g, p_ref, pu_ref)
        assert same_bits(gg, gg_ref, dtype) and same_bits(gu, gu_ref, dtype)

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN], ids=IDS)
    def test_unpack_prefetch_variant(dtype):
        """The unpack family with the L2 prefetch of a later tile's planes (here a
        no-op after the same range arithmetic; the ahead tile lies in the grid for the
        first tiles and past it for the last): unpack, relu2_backward and the gated op
        from every encoding, against the reference."""
        be = NumbaBackend(NK.PackVariant(unpack_prefetch=True))
        rng = _rng("prefetch", dtype.name)
        x = _no_neg_nan(random_tensor(rng, (5 * NK.TILE + 13,), dtype, 0.7), dtype)
        g = random_tensor(rng, x.shape, dtype, 0.1)
        for enc in ("raw", "nosign", "signplane"):
            xx = x if enc != "nosign" else RO.relu_bits(x, dtype)
            p = be.pack(xx, encoding=enc, chunk_log2=9)
            assert same_bits(be.unpack(p), xx, dtype), enc
        y, p = be.relu_pack(x, square=True, chunk_log2=9)
        _, p_ref = RO.relu_pack(x, dtype, square=True, chunk_log2=9)
        with np.errstate(all="ignore"):
            assert same_bits(be.relu2_backward(g, p), RO.relu2_backward(g, p_ref), dtype)
            u = random_tensor(rng, x.shape, dtype, 0.2)
            p_u = be.masked_pack(u, p, encoding="signplane")
            gg, gu = be.gated_backward(g, p, p_u)
            gg_ref, gu_ref = RO.gated_backward(
                g, p_ref, RO.masked_pack(u, dtype, p_ref, encoding="signplane"))
        assert same_bits(gg, gg_ref, dtype) and same_bits(gu, gu_ref, dtype)

    @pytest.mark.parametrize("fill_limit", [0, NK.PackVariant.fill_limit])
    def test_stitch_tiles_sharing_words(fill_limit):
        """Tiles holding 0-3 values, so that several tiles start inside one stream word
        (fp8: 7-bit codes; the sign plane: 1 bit per value): k_finish writes those
        words from the tiles' edge records (``fill_limit`` 0), or each tile ORs its
        bits into them. Exact, and capacities ending inside a word several tiles
        share."""
        be = NumbaBackend(NK.PackVariant(fill_limit=fill_limit))
        dtype = D.FLOAT8_E4M3FN
        T = NK.kernels_for(dtype.name).ptile
        rng = _rng("stitch")
        x = np.zeros(11 * T + 5, dtype=dtype.numpy)
        xb = x.view(dtype.uint)
        for k in range(11):
            pos = rng.choice(T, size=(0, 1, 2, 3, 1, 0, 0, 2, 3, 1, 1)[k], replace=False)
            xb[k * T + pos] = rng.integers(1, 256, size=pos.size)
        xb[-1] = 0x85
        nnz = int(np.count_nonzero(xb))
        for cap in (None, nnz - 1, 9):
            p = be.pack(x, encoding="signplane", chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, "signplane", chunk_log2=9, capacity=cap))

    @pytest.mark.parametrize("incl_every", [1, 2])
    def test_nosign_flag_travels_the_look_back(incl_every):
        """A sign bit in the first of three tiles: the flag reaches the status word
        through the descriptors (the first tile's inclusive one, or the second's
        aggregate when it publishes no inclusive count)."""
        be = NumbaBackend(NK.PackVariant(incl_every=incl_every))
        dtype = D.BFLOAT16
        T = NK.kernels_for(dtype.name).ptile
        x = random_tensor(_rng("negflag"), (2 * T + 100,), dtype, 0.7, signed=False)
        x.view(dtype.uint)[17] = dtype.sign_mask | 5
        p = be.pack(x, encoding="nosign", chunk_log2=9, capacity=x.size)
        assert be.read_status(p) & 1
        with pytest.raises(EncodingError):
            p.check()
        x.view(dtype.uint)[17] = 5
        p = be.pack(x, encoding="nosign", chunk_log2=9, capacity=x.size)
        assert be.read_status(p) == 0

    @pytest.mark.parametrize("incl_every", [1000, 7])
    def test_lookback_folds_groups(incl_every):
        """Eleven tiles, three groups (the simulator's groups are 4 tiles). At 1000 only
        tile 0 is inclusive: each tile of groups 1 and 2 sums its own group's earlier
        tiles, then whole groups' descriptors back to the start. At 7 group 1's last
        tile is inclusive: group 2's tiles stop there. An empty tile, and a sign bit in
        tile 1 whose nosign flag reaches the status word through group 0's descriptor
        (or tile 7's inclusive one)."""
        assert NK.LB_GROUP == 4
        be = NumbaBackend(NK.PackVariant(incl_every=incl_every))
        dtype = D.BFLOAT16
        T = NK.kernels_for(dtype.name).ptile
        x = random_tensor(_rng("groups", incl_every), (10 * T + 9,), dtype, 0.8, signed=False)
        x.view(dtype.uint)[5 * T:6 * T] = 0
        nnz = int(np.count_nonzero(x.view(dtype.uint)))
        for enc, cap in (("nosign", None), ("signplane", nnz - 40)):
            p = be.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))
        x.view(dtype.uint)[T + 3] = dtype.sign_mask | 9
        p = be.pack(x, encoding="nosign", chunk_log2=9, capacity=x.size)
        assert be.read_status(p) & 1
