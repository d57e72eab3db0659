"""The numba backend under Numba's CUDA simulator: bit-exact against the reference.

CI has no GPU. This module runs the numba backend's own kernels and host code in
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), in a child pytest process: the
variable must be set before ``numba.cuda`` is first imported, and other tests of
this process may already have imported it. Run directly with the variable set,
the tests below run in-process.

What CI covers here (simulator, tiny tensors): every dtype x encoding (raw,
nosign, signplane, auto) for pack and unpack, exact and fixed capacity (under,
exact fit, overflow reported on the device and by ``check``), nosign sign
violations (raised at pack time when exact, status word when fixed), every fused
op (relu_pack plain and squared, relu_backward, relu2_backward, masked_pack in
each encoding, gated_backward), chunks smaller and larger than a kernel tile,
empty and 0-d tensors, ``out=``, inputs not 8-byte aligned (the element-wise
load path), and special bit patterns (±0, ±inf, NaN payloads, subnormals). The
simulator path differs from the GPU path only in the warp scan and broadcast
(shared memory instead of ``shfl_up_sync`` / ``shfl_sync``), the float32 bit
casts and the byte permute (NumPy and a Python loop instead of libdevice) and
the tile sizes (64 threads instead of 256: pack tiles of 1024 elements instead
of 64 bytes per thread, i.e. 8192 bf16 / 16384 fp8; unpack tiles of 4096 fp8 /
2048 others instead of 16384 / 8192; ``TILE`` 1024 instead of 4096).

What only the GPU run covers (tests/test_gpu_numba.py): the shuffle scan, the
libdevice casts and byte permute as compiled by NVVM, float32 products on the GPU's FPU
(subnormals, no flush-to-zero), the GPU's tile sizes, torch / CuPy / JAX device
inputs (DLPack and __cuda_array_interface__), explicit streams, the pluggable
allocator, and agreement with the CuPy backend.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SIM_ACTIVE = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
ROOT = Path(__file__).resolve().parent.parent


if not SIM_ACTIVE:
    def test_simulator_suite():
        """Run this module again in a child process with the simulator switched on."""
        if importlib.util.find_spec("numba") is None:
            pytest.skip("numba is not installed")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
             str(Path(__file__).relative_to(ROOT))],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        out = proc.stdout + proc.stderr
        print(out)
        if proc.returncode == 5 or (proc.returncode == 0 and not re.search(r"\d+ passed", out)):
            pytest.skip("the simulator suite collected or ran no test:\n" + out[-2000:])
        assert proc.returncode == 0, "simulator suite failed:\n" + out[-12000:]

else:
    pytest.importorskip("numba.cuda")
    from bitsparse_core import dtypes as D
    from bitsparse_core.spec import codec as R
    from bitsparse_core.spec import ops as RO
    from bitsparse_core.errors import (CapacityOverflowError, EncodingError,
                                       OutputMismatchError)
    from bitsparse_core.backends.numba import kernels as NK
    from bitsparse_core.backends.numba.backend import NumbaBackend
    from helpers import ALL_DTYPES, random_tensor, same_bits

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

    # 1100 elements: two simulator tiles (1024 + 76), three 512-element chunks.
    SHAPE = (4, 275)

    # ------------------------------------------------------------------ pack
    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
    @pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane", "auto"])
    def test_pack_unpack_exact(dtype, encoding):
        rng = _rng("exact", dtype.name, encoding)
        signed = encoding != "nosign"
        x = random_tensor(rng, SHAPE, dtype, 0.5, signed=signed)
        ref = R.pack_array(x, dtype, encoding, chunk_log2=9)
        p = BE.pack(x, encoding=encoding, chunk_log2=9)
        _assert_planes(p, ref)
        assert p.nnz == ref.nnz
        assert same_bits(BE.unpack(p), x, dtype)

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
    def test_auto_picks_nosign_for_unsigned(dtype):
        x = random_tensor(_rng("auto", dtype.name), (300,), dtype, 0.3, signed=False)
        p = BE.pack(x, encoding="auto", chunk_log2=9)
        _assert_planes(p, R.pack_array(x, dtype, "auto", chunk_log2=9))
        assert p.encoding.name == "NOSIGN"

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
    @pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
    def test_fixed_capacity(dtype, encoding):
        """Under, exact fit and overflow: planes as the reference's, counts on device."""
        rng = _rng("cap", dtype.name, encoding)
        x = random_tensor(rng, (1030,), dtype, 0.6, signed=encoding != "nosign")
        nnz = int(np.count_nonzero(x.view(dtype.uint)))
        # One case per test, rotating over dtypes: room to spare, exact fit, overflow.
        case = (ALL_DTYPES.index(dtype) + ("raw", "nosign", "signplane").index(encoding)) % 3
        for cap in ((nnz + 37, nnz, nnz - 29)[case],):
            p = BE.pack(x, encoding=encoding, chunk_log2=9, capacity=cap)
            assert p._nnz is None  # no host sync happened
            ref = R.pack_array(x, dtype, encoding, chunk_log2=9, capacity=cap)
            _assert_planes(p, ref)
            assert p.nnz == nnz
            if cap >= nnz:
                p.check()
                assert same_bits(BE.unpack(p), x, dtype)
            else:
                with pytest.raises(CapacityOverflowError):
                    p.check()
                with pytest.raises(CapacityOverflowError):
                    BE.unpack(p)

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

    @pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (9,)], ids=str)
    def test_tiny_and_empty(shape):
        dtype = D.BFLOAT16
        x = random_tensor(_rng("tiny", shape), shape, dtype, 0.3)
        for cap in (None, int(np.prod(shape, dtype=np.int64))):
            p = BE.pack(x, encoding="signplane", chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, "signplane", chunk_log2=9, capacity=cap))
            y = BE.unpack(p)
            assert np.asarray(y).shape == shape and same_bits(y, x, dtype)

    def test_out_mismatch_refused():
        x = random_tensor(_rng("out"), (40,), D.FLOAT16, 0.5)
        p = BE.pack(x, encoding="raw", chunk_log2=9)
        with pytest.raises(OutputMismatchError):
            BE.unpack(p, out=np.zeros(41, dtype=np.float16))
        with pytest.raises(OutputMismatchError):
            BE.unpack(p, out=np.zeros(40, dtype=np.float32))

    # ------------------------------------------------------------- fused ops
    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
    @pytest.mark.parametrize("square", [False, True])
    def test_relu_pack(dtype, square):
        a = _no_neg_nan(random_tensor(_rng("relu", dtype.name, square), SHAPE, dtype, 0.2), dtype)
        y_ref, p_ref = RO.relu_pack(a, dtype, square=square, encoding="nosign", chunk_log2=9)
        y, p = BE.relu_pack(a, square=square, encoding="nosign", chunk_log2=9)
        assert same_bits(y, y_ref, dtype)
        _assert_planes(p, p_ref)
        # Fixed capacity, no sync: same planes.
        y2, p2 = BE.relu_pack(a, square=square, encoding="signplane", chunk_log2=9,
                              capacity=p_ref.nnz + 5)
        assert same_bits(y2, y_ref, dtype)
        _assert_planes(p2, R.pack_array(RO.relu_bits(a, dtype), dtype, "signplane", chunk_log2=9,
                                        capacity=p_ref.nnz + 5))

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E5M2], ids=IDS)
    def test_relu_pack_negative_nan(dtype):
        """relu keeps NaN with its sign, so nosign must refuse a negative NaN."""
        a = random_tensor(_rng("nnan", dtype.name), (500,), dtype, 0.2)
        a.view(dtype.uint)[123] = dtype.sign_mask | (dtype.sign_mask - 1)  # -NaN
        with pytest.raises(EncodingError):
            RO.relu_pack(a, dtype, encoding="nosign", chunk_log2=9)
        with pytest.raises(EncodingError):
            BE.relu_pack(a, encoding="nosign", chunk_log2=9)
        _, p = BE.relu_pack(a, encoding="nosign", chunk_log2=9, capacity=500)
        with pytest.raises(EncodingError):
            p.check()

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
    def test_backward_ops(dtype):
        rng = _rng("bwd", dtype.name)
        a = _no_neg_nan(random_tensor(rng, SHAPE, dtype, 0.2), dtype)
        g = random_tensor(rng, SHAPE, dtype, 0.05)
        _, p = BE.relu_pack(a, encoding="nosign", chunk_log2=9)
        _, p_ref = RO.relu_pack(a, dtype, encoding="nosign", chunk_log2=9)
        assert same_bits(BE.relu_backward(g, p), RO.relu_backward(g, p_ref), dtype)
        with np.errstate(all="ignore"):
            want = RO.relu2_backward(g, p_ref)
        assert same_bits(BE.relu2_backward(g, p), want, dtype)

    @pytest.mark.parametrize("dtype,encoding", [
        (D.BFLOAT16, "signplane"), (D.FLOAT16, "raw"), (D.FLOAT32, "nosign"),
        (D.FLOAT8_E4M3FN, "signplane"), (D.FLOAT8_E5M2, "raw")], ids=str)
    def test_masked_pack_and_gated_backward(dtype, encoding):
        """Every dtype, every companion encoding (rotated over dtypes to keep the
        simulator run short; the GPU suite runs the full product)."""
        rng = _rng("gated", dtype.name, encoding)
        gate = _no_neg_nan(random_tensor(rng, SHAPE, dtype, 0.2), dtype)
        u = random_tensor(rng, SHAPE, dtype, 0.1, signed=encoding != "nosign")
        g = random_tensor(rng, SHAPE, dtype, 0.05)
        # Where grad and r (or u) are both NaN the reference's NaN payload depends on
        # NumPy's loop (see bitfloat: near the array's end it took r's, elsewhere
        # grad's), so grad gets a plain value there: the products stay defined.
        nan = lambda x: np.isnan(x.astype(np.float32))  # noqa: E731
        g = np.where(nan(g) & (nan(gate) | nan(u)), np.ones((), dtype.numpy), g).astype(dtype.numpy)
        _, p_r = BE.relu_pack(gate, encoding="nosign", chunk_log2=9)
        _, pr_ref = RO.relu_pack(gate, dtype, encoding="nosign", chunk_log2=9)
        p_u = BE.masked_pack(u, p_r, encoding=encoding)
        pu_ref = RO.masked_pack(u, dtype, pr_ref, encoding=encoding)
        _assert_planes(p_u, pu_ref)
        p_u.check()
        with np.errstate(all="ignore"):
            gg_ref, gu_ref = RO.gated_backward(g, pr_ref, pu_ref)
        gg, gu = BE.gated_backward(g, p_r, p_u)
        assert same_bits(gu, gu_ref, dtype) and same_bits(gg, gg_ref, dtype)

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT32], ids=IDS)
    def test_masked_pack_large_chunks_and_fixed_capacity_mask(dtype):
        """A mask tensor packed with chunk_log2=11 at a fixed capacity (count pending)."""
        rng = _rng("mlarge", dtype.name)
        gate = _no_neg_nan(random_tensor(rng, (2500,), dtype, 0.3), dtype)
        u = random_tensor(rng, (2500,), dtype, 0.1)
        g = random_tensor(rng, (2500,), dtype, 0.0)
        _, p_r = BE.relu_pack(gate, encoding="nosign", chunk_log2=11, capacity=2500)
        _, pr_ref = RO.relu_pack(gate, dtype, encoding="nosign", chunk_log2=11, capacity=2500)
        _assert_planes(p_r, pr_ref)
        p_u = BE.masked_pack(u, p_r, encoding="signplane")
        pu_ref = RO.masked_pack(u, dtype, pr_ref, encoding="signplane")
        _assert_planes(p_u, pu_ref)
        with np.errstate(all="ignore"):
            gg_ref, gu_ref = RO.gated_backward(g, pr_ref, pu_ref)
            r2_ref = RO.relu2_backward(g, pr_ref)
        gg, gu = BE.gated_backward(g, p_r, p_u)
        assert same_bits(gu, gu_ref, dtype) and same_bits(gg, gg_ref, dtype)
        assert same_bits(BE.relu2_backward(g, p_r), r2_ref, dtype)

    def test_masked_pack_nosign_violation_in_status():
        dtype = D.FLOAT16
        rng = _rng("mviol")
        gate = _no_neg_nan(random_tensor(rng, (700,), dtype, 0.0), dtype)
        gate.view(dtype.uint)[:] &= np.uint16(0x7FFF)
        gate.view(dtype.uint)[gate.view(dtype.uint) == 0] = 1
        u = random_tensor(rng, (700,), dtype, 0.0, signed=False)
        u.view(dtype.uint)[650] |= np.uint16(0x8000)
        _, p_r = BE.relu_pack(gate, encoding="nosign", chunk_log2=9)
        p_u = BE.masked_pack(u, p_r, encoding="nosign")
        with pytest.raises(EncodingError):
            p_u.check()

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

    @pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT32, D.FLOAT8_E4M3FN], ids=IDS)
    def test_lookback_walks_aggregates(dtype, monkeypatch):
        """Tiles that publish only their own count make later tiles' look-back walk
        back over several predecessors, summing their counts (in the simulator
        blocks run in order, so otherwise the nearest one is always done). Some
        tiles hold fewer than 32 stream bits, so several tiles share a stream word."""
        monkeypatch.setattr(BE, "incl_every", 3)
        rng = _rng("walk", dtype.name)
        T = NK.kernels_for(dtype.name).ptile         # the pack's tile
        x = random_tensor(rng, (5 * T + 7,), dtype, 0.5)
        xb = x.view(dtype.uint)
        xb[T:2 * T] = 0                              # an empty tile
        xb[2 * T:3 * T - 1] = 0                      # one value in this tile
        xb[3 * T:4 * T - 2] = 0                      # two in this one
        for enc in ("raw", "signplane"):
            for cap in (None, int(np.count_nonzero(xb)) - 3):
                p = BE.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
                _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))

    @pytest.mark.parametrize("dtype,encodings,variant", [
        (D.FLOAT8_E4M3FN, ("nosign", "signplane"), {}),
        (D.BFLOAT16, ("raw", "nosign"), {"lb_early": True, "ticket": False})], ids=str)
    def test_pack_gpu_rounds(dtype, encodings, variant, monkeypatch):
        """The pack with the GPU's groups per thread (fp8: 8, a 64-bit packed scan;
        bf16: 4) instead of the simulator's 2, over a few of its larger tiles:
        a sparse and an empty tile, then one whose first warp holds only nonzeros
        (every round's 8-bit count field full, the top one wrapping), exact and
        fixed capacity. bf16 also runs two variants of the A/B knobs (the count
        published before staging, tiles by block index)."""
        kern = NK.DtypeKernels(dtype.name, NK.pack_rounds_for(dtype.bits, sim=False), **variant)
        monkeypatch.setattr(NK, "kernels_for", lambda name: kern)
        T = kern.ptile
        rng = _rng("gpurounds", dtype.name)
        x = random_tensor(rng, (2 * T + 3 * T // 4 + 5,), dtype, 0.9, signed=False)
        xb = x.view(dtype.uint)
        xb[T:2 * T] = 0
        xb[2 * T:2 * T + T // 2 + 3] |= 1
        for i, enc in enumerate(encodings):
            nnz = int(np.count_nonzero(xb))
            cap = None if i == 0 else nnz - 50
            p = BE.pack(x, encoding=enc, chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, enc, chunk_log2=9, capacity=cap))

    def test_stitch_tiles_sharing_words():
        """Tiles holding 0-3 values, so that several tiles start inside one stream word
        (fp8: 7-bit codes; the sign plane: 1 bit per value): k_finish writes those
        words from the tiles' edge records. Exact, and capacities ending inside a
        word several tiles share."""
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
            p = BE.pack(x, encoding="signplane", chunk_log2=9, capacity=cap)
            _assert_planes(p, R.pack_array(x, dtype, "signplane", chunk_log2=9, capacity=cap))

    @pytest.mark.parametrize("incl_every", [1, 2])
    def test_nosign_flag_travels_the_look_back(incl_every, monkeypatch):
        """A sign bit in the first of three tiles: the flag reaches the status word
        through the descriptors (the first tile's inclusive one, or the second's
        aggregate when it publishes no inclusive count)."""
        monkeypatch.setattr(BE, "incl_every", incl_every)
        dtype = D.BFLOAT16
        T = NK.kernels_for(dtype.name).ptile
        x = random_tensor(_rng("negflag"), (2 * T + 100,), dtype, 0.7, signed=False)
        x.view(dtype.uint)[17] = dtype.sign_mask | 5
        p = BE.pack(x, encoding="nosign", chunk_log2=9, capacity=x.size)
        assert BE.read_status(p) & 1
        with pytest.raises(EncodingError):
            p.check()
        x.view(dtype.uint)[17] = 5
        p = BE.pack(x, encoding="nosign", chunk_log2=9, capacity=x.size)
        assert BE.read_status(p) == 0
