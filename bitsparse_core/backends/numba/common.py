"""What every Numba kernel family shares: the target switch, tile constants,
the target-specific primitives and the sums over a block's warps.

Two code paths, chosen once at import: on a GPU the warp scan uses
``shfl_up_sync``, float32 bits are reinterpreted and bytes permuted (PRMT)
through libdevice, float16 and bfloat16 are converted by the conversion
instructions (two float32 lanes rounded by one), and the unpack stores 16-byte
words by inline PTX; under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which
has no warp intrinsics, the warp scan goes through shared memory, the bit casts
and 16-bit float conversions go through NumPy and ml_dtypes, PRMT is a Python
loop over the four bytes, a 16-byte store is two 8-byte ones,
and tiles are smaller so small tensors still span several tiles (blocks of 64
threads, ``TILE`` = 1024). The rest is the same source, so CI exercises the
algorithms without a GPU.

All index arithmetic is int64 (tensors may exceed 2**31 elements); element
patterns are widened to int64 as soon as they are loaded. Hot array accesses
index with ``uint64(i)`` (``_u``): Numba adds a negative-index wraparound
(a compare, a select and an add) to every access with a signed index.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# numba-cuda <= 0.30 registers an overload for np.row_stack when it first
# compiles; NumPy 2.5 removed that alias of np.vstack, so the first compile
# fails with AttributeError. Restore the alias (the same function) if missing.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda, int32, int64, uint32, uint64  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
_u = uint64                      # index cast: no wraparound code (module docstring)

TILE_LOG2 = 10 if SIM else 12
TILE = 1 << TILE_LOG2
NT = 64 if SIM else 256          # threads per tile block (a multiple of 32)
NW = NT // 32
GPT = TILE // 8                  # groups (mask bytes) per tile
G = GPT // NT                    # groups per thread
SCAN_NT = 32 if SIM else 1024    # threads of the one-block scan
SCAN_PER = 2 if SIM else 8       # items per scan thread per pass
LANE_N = NT if SIM else 1        # the simulator's warp scan goes through shared memory
UNT = 64 if SIM else 256         # threads per unpack block (rows of 16 bytes each)
UNW = UNT // 32
ULANE_N = UNT if SIM else 1

RAW, NOSIGN, SIGNPLANE = 0, 1, 2
FULL_MASK = 0xFFFFFFFF
MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED = 0, 1, 2, 3


@cuda.jit(device=True)
def _warps_before_loop(sh_tot, warp, lane, t, sh_lane):
    """The sum of sh_tot[w] for w < warp, each thread reading the counts before its
    warp's. The signature is :func:`_warps_before_reduced`'s."""
    before = int32(0)
    for w in range(NW):
        if w < warp:
            before = int32(before + sh_tot[w])
    return before


@cuda.jit(device=True)
def _warps_loop(sh_tot, warp, lane, t, sh_lane):
    """(sum of sh_tot[w] for w < warp, sum over the NW warps), each thread reading all
    NW counts (32-bit sums: no sign extension per add). The signature is
    :func:`_warps_reduced`'s."""
    before = int32(0)
    total = int32(0)
    for w in range(NW):
        tw = sh_tot[w]
        if w < warp:
            before = int32(before + tw)
        total = int32(total + tw)
    return before, total


# ----------------------------------------------------------------------------
# Target-specific primitives.
# ----------------------------------------------------------------------------
if SIM:
    def _as_f32(u):
        return np.array([u], dtype=np.int64).astype(np.uint32).view(np.float32)[0]

    def _as_u32(f):
        return np.int64(np.array([f], dtype=np.float32).view(np.uint32)[0])

    def _prmt(x, s):
        """PRMT with y = 0: byte k of the result is byte (s >> 4k) & 7 of (0:x)."""
        r = 0
        for k in range(4):
            sel = (int(s) >> (4 * k)) & 7
            if sel < 4:
                r |= ((int(x) >> (8 * sel)) & 0xFF) << (8 * k)
        return np.uint32(r)

    def _prmt2(x, y, s):
        """PRMT: byte k of the result is byte (s >> 4k) & 7 of (y:x)."""
        xy = int(x) | (int(y) << 32)
        r = 0
        for k in range(4):
            r |= ((xy >> (8 * ((int(s) >> (4 * k)) & 7))) & 0xFF) << (8 * k)
        return np.uint32(r)

    def _mul32(a, b):
        """The low 32 bits of a * b (NumPy's uint32 product warns on the wrap)."""
        return np.uint32((int(a) * int(b)) & 0xFFFFFFFF)

    def _f16_widen(x):
        """float32 bits of the float16 pattern x (exact)."""
        h = np.array([int(x) & 0xFFFF], dtype=np.uint16).view(np.float16)
        return np.int64(h.astype(np.float32).view(np.uint32)[0])

    def _round_pair(np_dtype):
        def round_pair(hi, lo):
            """float32 bits hi, lo (not NaN) rounded to the 16-bit dtype, nearest-even,
            as one word: hi's result in the upper half."""
            f = np.array([int(lo) & 0xFFFFFFFF, int(hi) & 0xFFFFFFFF],
                         dtype=np.uint32).view(np.float32)
            with np.errstate(over="ignore"):
                h = f.astype(np_dtype).view(np.uint16)
            return np.int64(int(h[0]) | (int(h[1]) << 16))
        return round_pair

    _bf16_round_pair = _round_pair(ml_dtypes.bfloat16)
    _f16_round_pair = _round_pair(np.float16)

    @cuda.jit(device=True)
    def _store16(a64, i, lo, hi):
        """a64[i], a64[i + 1] = lo, hi (on a GPU one 16-byte store)."""
        a64[i] = lo
        a64[i + 1] = hi

    def _warp_max(v):
        raise NotImplementedError("the simulator has no warp reduction: its callers decide "
                                  "per lane")

    def _sm_count():
        return 1

    def _address(a):
        return 0

    def _l2_prefetch(address, nbytes):
        """No cache to fill in the simulator."""

    @cuda.jit(device=True)
    def _warps_reduced(sh_tot, warp, lane, t, sh_lane):
        """The GPU's algorithm (lane k reads warp k's count, two warp sums) with the
        sums through shared memory. Every thread of the block must call it."""
        c = int64(0)
        if lane < NW:
            c = int64(sh_tot[lane])
        before = sum(int(v) for v in _warp_lanes(c if lane < warp else 0, lane, t, sh_lane))
        total = sum(int(v) for v in _warp_lanes(c, lane, t, sh_lane))
        return int32(before & 0xFFFFFFFF), int32(total & 0xFFFFFFFF)

    @cuda.jit(device=True)
    def _warps_before_reduced(sh_tot, warp, lane, t, sh_lane):
        """The GPU's algorithm (lane k reads warp k's count, one warp sum) through
        shared memory. Every thread of the block must call it."""
        c = int64(0)
        if lane < warp:
            c = int64(sh_tot[lane])
        return int32(sum(int(v) for v in _warp_lanes(c, lane, t, sh_lane)) & 0xFFFFFFFF)

    @cuda.jit(device=True)
    def _warp_lanes(v, lane, t, sh_lane):
        # Shared-memory stand-in for the warp intrinsics (the simulator has no
        # shuffles): every lane publishes v and gets its warp's 32 values.
        sh_lane[t] = v
        cuda.syncthreads()
        vals = [sh_lane[q] for q in range(t - lane, t - lane + 32)]
        cuda.syncthreads()
        return vals

    @cuda.jit(device=True)
    def _warp_incl_scan(v, lane, t, sh_lane):
        s = int64(0)
        for x in _warp_lanes(v, lane, t, sh_lane)[: lane + 1]:
            s += x
        return s

    @cuda.jit(device=True)
    def _warp_last(v, lane, t, sh_lane):
        # The broadcast of lane 31's value.
        return _warp_lanes(v, lane, t, sh_lane)[31]

    @cuda.jit(device=True)
    def _warp_excl_scan(v, lane, t, sh_lane):
        # The pack's packed-field scan: the sum of the lanes before, wrapped to
        # int64 as the GPU's arithmetic wraps (the fields themselves never carry).
        s = sum(int(x) for x in _warp_lanes(v, lane, t, sh_lane)[:lane])
        return np.array([s & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64).view(np.int64)[0]

    _warp_excl_scan64 = _warp_excl_scan
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    @cuda.jit(device=True)
    def _as_f32(u):
        return libdevice.int_as_float(int32(u))

    @cuda.jit(device=True)
    def _as_u32(f):
        return int64(libdevice.float_as_int(f)) & 0xFFFFFFFF

    @cuda.jit(device=True)
    def _prmt(x, s):
        """PRMT with y = 0: byte k of the result is byte (s >> 4k) & 7 of (0:x)."""
        return uint32(libdevice.byte_perm(int32(x), int32(0), int32(s)))

    @cuda.jit(device=True)
    def _prmt2(x, y, s):
        """PRMT: byte k of the result is byte (s >> 4k) & 7 of (y:x)."""
        return uint32(libdevice.byte_perm(int32(x), int32(y), int32(s)))

    @cuda.jit(device=True)
    def _mul32(a, b):
        """The low 32 bits of a * b."""
        return uint32(uint32(a) * uint32(b))

    def _integer_intrinsic(ret, emit):
        """An intrinsic of one integer argument returning Numba type ``ret``, whose code
        ``emit(context, builder, value, numba type of the argument)`` makes."""
        @intrinsic
        def one(typingctx, x):
            if not isinstance(x, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                return emit(context, builder, args[0], sig.args[0])

            return ret(x), codegen
        return one

    def _convert(src, dst, op):
        """An intrinsic: the low bits of an integer as float ``src``, converted to float
        ``dst`` by LLVM instruction ``op`` (fpext / fptrunc: the conversion instruction,
        round to nearest even), returned as the bits of ``dst`` in an int64."""
        bits = {"half": 16, "float": 32}

        def emit(context, builder, v, ty):
            if ty.bitwidth > bits[src]:
                v = builder.trunc(v, ir.IntType(bits[src]))
            f = builder.bitcast(v, ir.HalfType() if src == "half" else ir.FloatType())
            g = getattr(builder, op)(f, ir.HalfType() if dst == "half" else ir.FloatType())
            return builder.zext(builder.bitcast(g, ir.IntType(bits[dst])), ir.IntType(64))
        return _integer_intrinsic(types.int64, emit)

    _f16_widen = _convert("half", "float", "fpext")
    _f16_widen.__doc__ = "float32 bits of the float16 pattern x (exact)."

    def _round_pair(kind):
        """An intrinsic: float32 bits hi, lo rounded to 16-bit float ``kind`` (bf16,
        f16), nearest-even, by one ``cvt.rn.{kind}x2.f32`` (sm_80 and later), returned
        as one word in an int64: hi's result in the upper half. Not for NaN inputs
        (the instruction gives the canonical NaN, not the reference's payload)."""
        @intrinsic
        def round_pair(typingctx, hi, lo):
            if not (isinstance(hi, types.Integer) and isinstance(lo, types.Integer)):
                return None
            sig = types.int64(hi, lo)

            def codegen(context, builder, sig, args):
                i32, f32 = ir.IntType(32), ir.FloatType()
                a, b = (builder.bitcast(builder.trunc(v, i32) if t.bitwidth > 32 else v, f32)
                        for v, t in zip(args, sig.args))
                cvt = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]),
                                   f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
                return builder.zext(builder.call(cvt, [a, b]), ir.IntType(64))

            return sig, codegen
        return round_pair

    _bf16_round_pair = _round_pair("bf16")
    _f16_round_pair = _round_pair("f16")

    @intrinsic
    def _store16(typingctx, a64, i, lo, hi):
        """a64[i], a64[i + 1] = lo, hi as one 16-byte store (``st.global.v2.u64``; Numba
        itself stores at most 8 bytes per instruction). a64: a 1-D uint64 array in
        global memory whose element i lies on a 16-byte boundary; no bounds check."""
        if not (isinstance(a64, types.Array) and a64.ndim == 1 and a64.dtype == types.uint64
                and isinstance(i, types.Integer)):
            return None
        sig = types.void(a64, i, lo, hi)

        def codegen(context, builder, sig, args):
            aty, ity, lty, hty = sig.args
            arr, idx, lv, hv = args
            ary = context.make_array(aty)(context, builder, value=arr)
            idx = context.cast(builder, idx, ity, types.intp)
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [idx], wraparound=False)
            lv = context.cast(builder, lv, lty, types.uint64)
            hv = context.cast(builder, hv, hty, types.uint64)
            u64 = ir.IntType(64)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, u64, u64])
            st = ir.InlineAsm(fnty, "st.global.v2.u64 [$0], {$1, $2};", "l,l,l,~{memory}",
                              side_effect=True)
            builder.call(st, [ptr, lv, hv])
            return context.get_dummy_value()

        return sig, codegen

    def _redux(op):
        """An intrinsic: the ``op`` (max, add: modulo 2**32) of an unsigned 32-bit v
        over the warp's 32 lanes, in every lane: one ``redux.sync.{op}.u32`` (sm_80 and
        later); every lane must take part."""
        def emit(context, builder, v, ty):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]),
                               f"redux.sync.{op}.u32 $0, $1, 0xffffffff;", "=r,r",
                               side_effect=True)
            return builder.call(asm, [context.cast(builder, v, ty, types.uint32)])
        return _integer_intrinsic(types.uint32, emit)

    _warp_max = _redux("max")
    _warp_sum = _redux("add")

    @intrinsic
    def _sm_count(typingctx):
        """The GPU's SM count (``%nsmid``)."""
        sig = types.uint32()

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, []), "mov.u32 $0, %nsmid;", "=r")
            return builder.call(asm, [])

        return sig, codegen

    @intrinsic
    def _address(typingctx, a):
        """The device address of a 1-D array's first element, as an integer."""
        if not (isinstance(a, types.Array) and a.ndim == 1):
            return None
        sig = types.uint64(a)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(ary.data, ir.IntType(64))

        return sig, codegen

    @intrinsic
    def _l2_prefetch(typingctx, address, nbytes):
        """Ask the SM's copy engine to bring ``nbytes`` at ``address`` (both multiples of
        16, within one allocation) into L2: ``cp.async.bulk.prefetch.L2.global`` (sm_90;
        no registers held, nothing waits for it)."""
        if not (isinstance(address, types.Integer) and isinstance(nbytes, types.Integer)):
            return None
        sig = types.void(address, nbytes)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.uint64)
            n = context.cast(builder, args[1], sig.args[1], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)]),
                               "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
                               side_effect=True)
            builder.call(asm, [a, n])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True)
    def _warps_reduced(sh_tot, warp, lane, t, sh_lane):
        """What :func:`_warps_loop` gives, by two warp reductions of lane k's read of
        warp k's count in place of NW shared loads and their adds in every thread.
        Every lane of the warp must take part."""
        c = uint32(0)
        if lane < NW:
            c = uint32(sh_tot[lane])
        before = _warp_sum(c if lane < warp else uint32(0))
        return int32(before), int32(_warp_sum(c))

    @cuda.jit(device=True)
    def _warps_before_reduced(sh_tot, warp, lane, t, sh_lane):
        """What :func:`_warps_before_loop` gives, by one warp reduction of lane k's read
        of warp k's count (k < warp). Every lane of the warp must take part."""
        c = uint32(0)
        if lane < warp:
            c = uint32(sh_tot[lane])
        return int32(_warp_sum(c))

    @cuda.jit(device=True)
    def _warp_incl_scan(v, lane, t, sh_lane):
        x = int32(v)                 # sums of a warp's counts: one 32-bit shuffle per step
        d = 1
        while d < 32:
            y = cuda.shfl_up_sync(FULL_MASK, x, d)
            if lane >= d:
                x = int32(x + y)
            d *= 2
        return x

    @cuda.jit(device=True)
    def _warp_excl_scan(v, lane, t, sh_lane):
        """The pack's exclusive scan of four 8-bit count fields (32-bit shuffles;
        a full top field wraps out of the inclusive sum, not out of the result)."""
        return int32(_warp_incl_scan(v, lane, t, sh_lane) - int32(v))

    @cuda.jit(device=True)
    def _warp_excl_scan64(v, lane, t, sh_lane):
        """The same for eight fields (the fp8 pack's rounds), in 64 bits."""
        x = int64(v)
        d = 1
        while d < 32:
            y = cuda.shfl_up_sync(FULL_MASK, x, d)
            if lane >= d:
                x += y
            d *= 2
        return x - int64(v)

    @cuda.jit(device=True)
    def _warp_last(v, lane, t, sh_lane):
        """Lane 31's v, in every lane."""
        return cuda.shfl_sync(FULL_MASK, int32(v), 31)


@cuda.jit(device=True)
def _load_word(b8, w32, nbytes, k):
    """Little-endian 32-bit word k of a byte plane; bytes past nbytes read as 0.
    w32 is the plane's uint32 view (length 0 when the plane is not 4-byte aligned)."""
    if k < w32.size:
        return int64(w32[_u(k)])
    v = int64(0)
    for q in range(4):
        i = 4 * k + q
        if i < nbytes:
            v |= int64(b8[_u(i)]) << (8 * q)
    return v


@cuda.jit(device=True)
def _prefetch_bytes(b8, b0, b1):
    """Bytes [b0, b1) of the byte plane ``b8`` (clipped to it, widened to 16-byte
    boundaries inside its allocation's alignment) into L2 (:func:`_l2_prefetch`)."""
    if b1 > b8.size:
        b1 = b8.size
    if b1 <= b0:
        return
    base = _address(b8)
    a0 = (base + uint64(b0)) & ~uint64(15)
    a1 = (base + uint64(b1) + uint64(15)) & ~uint64(15)
    _l2_prefetch(a0, uint32(a1 - a0))

