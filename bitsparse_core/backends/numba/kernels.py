"""The Numba CUDA kernels of the ``numba`` backend (format v1, bit-exact).

Work is cut into *tiles* (one thread block each) of *groups* of 8 consecutive
elements, one mask byte per group. Each kernel family has its own tile:

* pack (``DtypeKernels.ptile``): 64 bytes per thread, so 8192 bf16 / 16384 fp8 /
  4096 fp32 elements on a GPU; each warp owns a contiguous run of groups, loaded
  one coalesced round at a time, and ranks come from one packed warp scan of the
  rounds' counts;
* unpack (``DtypeKernels.utile_log2``): 256 threads x UNPACK_ROWS rows of 16
  bytes (16384 fp8, 8192 16- or 32-bit elements), rows warp-major as in the CuPy
  kernel; relu2_backward and the gated op keep ``TILE`` = 4096 elements, thread
  ``t`` handling groups ``r * NT + t``, ranks from :func:`_tile_ranks`.

Pack is one pass (``pack``) plus a small kernel (``finish``): tiles are claimed
in order from an atomic ticket, each publishes its count (one 8-byte descriptor)
as soon as it has staged its values, then finds its value offset by a decoupled
look-back over its predecessors' counts (warp 0 reads 8 windows of 32 per round
trip). A tile writes only the stream words wholly inside its bit range, and its
first and last 32 stored bits (its edge record); ``finish`` then writes each
word holding bits of several tiles, or the stream's last partly filled word,
from the edge records (as the CuPy backend's ``bitsparse_stitch``), and at a
fixed capacity zeroes what lies past the stored values. So no word is written
twice, no atomics touch the output and padding bits come out zero.
Unpack is one launch per tile (plus a popcount + scan of the mask per
``TILE`` elements when chunks are larger than the unpack tile), one kernel per (op,
encoding): the tile's value range comes from the tile-offset array at both
ends, its stored values are decoded 32/BITS per 32-bit word into shared
memory, and each output word is the next stored values' bytes dropped into the
slots its mask bits select (one PRMT, as in the CuPy kernels). The gated
backward op still copies its two streams' slices into shared memory and cuts
each value out of the shared words (``value_at``).

Under the simulator blocks have 64 threads: pack tiles of 2 groups per thread
(a test runs the GPU's shape), an unpack tile of 4096 fp8 / 2048 other elements
(the GPU's per-thread shapes, so the simulator runs the GPU's row loops), and
``TILE`` = 1024.

Two code paths, chosen once at import: on a GPU the warp scan uses
``shfl_up_sync``, the look-back reads 256 predecessors per step with warp votes,
float32 bits are reinterpreted and bytes permuted (PRMT) through libdevice;
under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which has no warp
intrinsics, the warp scan goes through shared memory, one thread walks the
look-back, the bit casts go through NumPy, PRMT is a Python loop over the four
bytes, and the tile is smaller so small tensors still span several tiles. The
rest is the same source, so CI exercises the algorithm without a GPU.

All index arithmetic is int64 (tensors may exceed 2**31 elements); element
patterns are widened to int64 as soon as they are loaded. Hot array accesses
index with ``uint64(i)`` (``_u``): Numba adds a negative-index wraparound
(a compare, a select and an add) to every access with a signed index, which
was a large share of the kernels' instructions.
"""

from __future__ import annotations

import functools

import numpy as np

# numba-cuda <= 0.30 registers an overload for np.row_stack when it first
# compiles; NumPy 2.5 removed that alias of np.vstack, so the first compile
# fails with AttributeError. Restore the alias (the same function) if missing.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda, int32, int64, uint32, uint64  # noqa: E402

from ... import bitfloat
from ...spec import format as _fmt

SIM = bool(config.ENABLE_CUDASIM)
_u = uint64                      # index cast: no wraparound code (module docstring)

TILE_LOG2 = 10 if SIM else 12
TILE = 1 << TILE_LOG2
NT = 64 if SIM else 256          # threads per tile block (a multiple of 32)
NW = NT // 32
GPT = TILE // 8                  # groups (mask bytes) per tile
G = GPT // NT                    # groups per thread
assert G <= 2                    # _tile_ranks scans two rows' counts at once
SCAN_NT = 32 if SIM else 1024    # threads of the one-block scan
SCAN_PER = 2 if SIM else 8       # items per scan thread per pass
LANE_N = NT if SIM else 1        # the simulator's warp scan goes through shared memory
UNT = 64 if SIM else 256         # threads per unpack block (rows of 16 bytes each)
UNW = UNT // 32
ULANE_N = UNT if SIM else 1
# Unpack tiles have their own size: UR rows of 16 bytes (fp32: 32) per thread, so an
# unpack tile is UR * UNT * 16 bytes of output whatever the dtype (op 0: 4 rows, i.e.
# 16384 fp8 / 8192 bf16 / 8192 fp32 elements on the GPU, as the CuPy unpack). The
# relu2 backward op keeps TILE elements. Per dtype: DtypeKernels.utile_log2.
UNPACK_ROWS = 4
# Unpack: six 256-thread blocks per SM (42 registers); the relu2 backward op's float
# products need more registers, four blocks.
UNPACK_JIT = {op: {} if SIM else {"launch_bounds": (UNT, 6 if op == 0 else 4)} for op in (0, 1)}

RAW, NOSIGN, SIGNPLANE = 0, 1, 2
FULL_MASK = 0xFFFFFFFF
FLAG_SHIFT = 62                  # k_scan: per-entry flag bit above the count
COUNT_MASK = (1 << FLAG_SHIFT) - 1
# Look-back descriptors (int64): state in bits 61-62, the nosign flag (a stored value
# has its sign bit set: this tile's, or any up to it once inclusive) in bit 60, count below.
LB_SHIFT = 61
LB_NEG = 1 << 60
LB_COUNT = LB_NEG - 1
LB_AGG = 1 << LB_SHIFT           # the tile's own count is published
LB_INCL = 2 << LB_SHIFT          # the count up to and including the tile is published
SCRATCH_HEAD = 2                 # int64 slots before the descriptors: ticket, unused
LB_WINDOWS = 8                   # look-back: 32-descriptor windows per lane and round trip
MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED = 0, 1, 2, 3
# Pack tiles wait per block (barriers, look-back): cap registers so five 256-thread
# blocks share an SM (48 registers: a thread keeps its 64 bytes of elements in 16
# of them across the rank scan; at six blocks' 40 they spill); the relu modes'
# float squares need more registers, four blocks (as the CuPy pack gives them
# fewer). The simulator takes no such option.
PACK_JIT = {m: {} if SIM else {"launch_bounds": (NT, 4 if m in (MODE_RELU, MODE_RELU2) else 5)}
            for m in (MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED)}

# ----------------------------------------------------------------------------
# The two target-specific primitives.
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
    from numba.cuda import libdevice

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
def _tile_ranks(sh_byte, sh_rank, sh_tot, sh_lane, t):
    """sh_rank[gi] = nonzeros of the tile before group gi (gi = r*NT + t, the tile's
    group order), from the mask bytes in sh_byte. Returns the tile's total.
    The G <= 2 rows' counts share one warp scan, 16 bits apart (a row holds at
    most 8 * NT < 2**16). Every thread of the block must call it (it synchronizes)."""
    lane = t & 31
    warp = t >> 5
    packed = int32(0)
    for r in range(G):
        packed = int32(packed + (cuda.popc(int32(sh_byte[_u(r * NT + t)])) << (16 * r)))
    inc = _warp_incl_scan(packed, lane, t, sh_lane)
    if lane == 31:
        sh_tot[warp] = inc
    cuda.syncthreads()
    before = int32(inc - packed)     # 32-bit sums: no sign extension per add
    total = int32(0)
    for w in range(NW):
        tw = sh_tot[w]
        if w < warp:
            before = int32(before + tw)
        total = int32(total + tw)
    sh_rank[_u(t)] = before & 0xFFFF
    if G == 2:
        sh_rank[_u(NT + t)] = (total & 0xFFFF) + (before >> 16)
    return int64((total & 0xFFFF) + (total >> 16))


@cuda.jit(device=True)
def _tile_mask_bytes(mask, tile, ngroups, t, sh_byte):
    """sh_byte[gi] = mask byte of the tile's group gi (gi = r*NT + t), 0 past the end."""
    for r in range(G):
        g = tile * GPT + r * NT + t
        byte = 0
        if g < ngroups:
            byte = int32(mask[_u(g)])
        sh_byte[_u(r * NT + t)] = byte


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
def _rd64(a, i):
    """Coherent read of a value another block publishes (an atomic goes to L2)."""
    return cuda.atomic.add(a, i, int64(0))


if SIM:
    def _make_lookback(windows):
        return _lb_load, _lookback

    @cuda.jit(device=True)
    def _lb_load(desc, tile, lane, f):
        pass

    @cuda.jit(device=True)
    def _lookback(desc, tile, lane, f):
        """(values before ``tile``, OR of their nosign flags) in lane 0.
        Simulator: one thread walks back (blocks run in order there)."""
        acc = int64(0)
        neg = int64(0)
        if lane == 0:
            j = tile - 1
            while j >= 0:
                d = _rd64(desc, SCRATCH_HEAD + j)
                while (d >> LB_SHIFT) == 0:
                    d = _rd64(desc, SCRATCH_HEAD + j)
                acc += d & LB_COUNT
                neg |= d & LB_NEG
                if (d >> LB_SHIFT) == 2:
                    break
                j -= 1
        return acc, int64(neg != 0)
else:
    @functools.lru_cache(maxsize=None)
    def _make_lookback(windows):
        """Warp 0's look-back, reading ``windows`` windows of 32 descriptors per
        round trip (LB_WINDOWS unless a variant asks otherwise)."""
        @cuda.jit(device=True)
        def _lb_load(desc, tile, lane, f):
            """Issue the reads of the ``windows`` nearest windows: f[q] of lane l is the
            descriptor of tile - 1 - l - 32 q (tiles before 0 read as an inclusive 0)."""
            for q in range(windows):
                j = tile - 1 - lane - 32 * q
                d = int64(LB_INCL)
                if j >= 0:
                    d = _rd64(desc, SCRATCH_HEAD + j)
                f[q] = d

        @cuda.jit(device=True)
        def _lookback(desc, tile, lane, f):
            """(values before ``tile``, OR of their nosign flags) in every lane of warp 0,
            from the windows _lb_load issued into f. Nearest window first: wait until
            its descriptors are published, sum their counts up to the nearest
            inclusive one (aggregates in 32 bits with the flags in bits 24.., the
            inclusive count by a shuffle); with none there, the next window, and past
            the last one the next ``windows`` are read (one round trip)."""
            acc = int64(0)
            neg = int32(0)
            base = tile - 1
            while True:
                done = False
                for q in range(windows):
                    if not done:
                        j = base - lane - 32 * q
                        d = f[q]
                        while cuda.any_sync(FULL_MASK, (d >> LB_SHIFT) == 0):
                            if (d >> LB_SHIFT) == 0:
                                d = _rd64(desc, SCRATCH_HEAD + j)
                        incl = int64(cuda.ballot_sync(FULL_MASK, (d >> LB_SHIFT) == 2))
                        first = 32
                        if incl != 0:                                # the nearest inclusive one
                            first = cuda.popc(int32((incl & -incl) - 1))
                        c = int32(0)
                        if lane < first:
                            c = int32(d & LB_COUNT)                  # an aggregate: one tile's count
                        if lane <= first and (d & LB_NEG) != 0:
                            c |= int32(1 << 24)
                        o = 16
                        while o > 0:
                            c = int32(c + cuda.shfl_xor_sync(FULL_MASK, c, o))
                            o >>= 1
                        acc += int64(c & 0xFFFFFF)
                        neg |= c >> 24
                        if incl != 0:
                            acc += cuda.shfl_sync(FULL_MASK, d, first) & LB_COUNT
                            done = True
                if done:
                    break
                base -= 32 * windows
                _lb_load(desc, base + 1, lane, f)
            return acc, int64(neg != 0)

        return _lb_load, _lookback


@cuda.jit
def k_scan(cnt, n, info):
    """One block: cnt[0..n) -> exclusive prefix in place, cnt[n] = info[0] = total,
    info[1] = OR of the entries' flag bits (bit FLAG_SHIFT)."""
    t = cuda.threadIdx.x
    sh = cuda.shared.array(SCAN_NT, int64)
    carry = int64(0)
    flag = 0
    seg = SCAN_NT * SCAN_PER
    base = int64(0)
    while base < n:
        lo = base + t * SCAN_PER
        s = int64(0)
        for q in range(SCAN_PER):
            if lo + q < n:
                c = cnt[lo + q]
                s += c & COUNT_MASK
                flag |= c >> FLAG_SHIFT
        sh[t] = s
        cuda.syncthreads()
        d = 1
        while d < SCAN_NT:
            v = int64(0)
            if t >= d:
                v = sh[t - d]
            cuda.syncthreads()
            sh[t] += v
            cuda.syncthreads()
            d *= 2
        ex = carry + sh[t] - s
        for q in range(SCAN_PER):
            if lo + q < n:
                c = cnt[lo + q] & COUNT_MASK
                cnt[lo + q] = ex
                ex += c
        carry += sh[SCAN_NT - 1]
        cuda.syncthreads()
        base += seg
    anyflag = cuda.syncthreads_or(flag)
    if t == 0:
        cnt[n] = carry
        info[0] = carry
        info[1] = anyflag


@cuda.jit
def k_mask_count(mask, ngroups, cnt):
    """Nonzeros per tile, read off a mask plane (for chunks larger than a tile)."""
    t = cuda.threadIdx.x
    tile = int64(cuda.blockIdx.x)
    sh = cuda.shared.array(1, int64)
    if t == 0:
        sh[0] = 0
    cuda.syncthreads()
    c = int64(0)
    for r in range(G):
        g = tile * GPT + r * NT + t
        if g < ngroups:
            c += cuda.popc(int32(mask[g]))
    cuda.atomic.add(sh, 0, c)
    cuda.syncthreads()
    if t == 0:
        cnt[tile] = sh[0]


# ----------------------------------------------------------------------------
# Per-dtype kernels
# ----------------------------------------------------------------------------
def pack_rounds_for(bits: int, sim: bool = SIM) -> int:
    """Groups of 8 elements per pack thread: 64 bytes on a GPU (bf16 4, fp8 8,
    fp32 2), 2 under the simulator (its tiles stay at 1024 elements)."""
    return 2 if sim else 64 // bits


class DtypeKernels:
    """The kernels of one element type, compiled on first launch."""

    def __init__(self, name: str, pack_rounds: int | None = None, pack_blocks: int | None = None,
                 lb_windows: int = LB_WINDOWS, lb_early: bool = False, ticket: bool = True):
        """Pack variants (for tests and A/B timings; the defaults are the committed
        choices): ``pack_rounds`` groups of 8 elements per pack thread instead of
        the target's (the simulator tests run the GPU's this way); ``pack_blocks``
        the blocks per SM the plain and masked pack's launch bounds ask for
        (default 5); ``lb_windows`` the look-back's windows per round trip;
        ``lb_early``: publish the count and issue the look-back's reads before
        staging, not after; ``ticket=False``: a block's tile is its block index
        (no atomic ticket and no barrier before the loads; forward progress then
        rests on blocks being dispatched in index order, as CUB's scans assume)."""
        bits = bitfloat.FORMATS[name][0]
        self.name = name
        self.bits = bits
        F = bitfloat.make(name, cuda.jit(device=True), _as_f32, _as_u32)
        BITS = bits
        ITEM = bits // 8                 # bytes per element = uint64 words per group
        EMASK = (1 << bits) - 1
        SIGN = 1 << (bits - 1)
        W = bits - 1                     # stream code width
        WMASK = (1 << W) - 1
        PER_WORD = 8 // ITEM             # elements per uint64 word
        GE = 32 // BITS                  # elements per 32-bit word
        widen, narrow, is_nan, is_pos, fmul = F.widen, F.narrow, F.is_nan, F.is_pos, F.fmul
        TWO = 0x40000000                 # float32 bits of 2.0
        ENP = {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]   # for views

        @cuda.jit(device=True)
        def load_group(xe, x64, fast, numel, g, v):
            """v[0..8) = patterns of group g (0 past numel). ``fast``: uint64 loads."""
            if fast:
                for q in range(ITEM):
                    w = int64(x64[_u(g * ITEM + q)])
                    for j in range(PER_WORD):
                        v[q * PER_WORD + j] = (w >> (j * BITS)) & EMASK
            else:
                for j in range(8):
                    e = g * 8 + j
                    if e < numel:
                        v[j] = int64(xe[_u(e)])
                    else:
                        v[j] = 0

        @cuda.jit(device=True)
        def square(r):
            f = widen(r)
            return narrow(fmul(f, f))

        @cuda.jit(device=True)
        def store_group(oe, o64, fast, numel, g, v):
            if fast:
                for q in range(ITEM):
                    w = int64(0)
                    for j in range(PER_WORD):
                        w |= v[q * PER_WORD + j] << (j * BITS)
                    o64[_u(g * ITEM + q)] = w
            else:
                for j in range(8):
                    e = g * 8 + j
                    if e < numel:
                        oe[_u(e)] = v[j]

        # The gated backward op decodes a tile's two packed tensors this way: each
        # slice of a value stream (and of a sign plane) is first copied into shared
        # memory with independent, coalesced loads (a fixed number per thread, so
        # they are all in flight at once); values are then cut out of shared words.
        # Raw values are a stream of width BITS.
        VWPT = (TILE * BITS // 32 + 2 + NT - 1) // NT   # value-stream words per thread
        SWPT = (TILE // 32 + 2 + NT - 1) // NT          # sign words per thread
        VWN = VWPT * NT
        SWN = SWPT * NT

        @cuda.jit(device=True)
        def stage_words(dst, t, bit0, bit1, b8, w32, nbytes, per):
            """dst[q] = stream word (bit0 >> 5) + q for the words holding [bit0, bit1)."""
            k0 = bit0 >> 5
            k1 = (bit1 + 31) >> 5
            for q in range(per):
                k = k0 + q * NT + t
                if k < k1:
                    dst[q * NT + t] = _load_word(b8, w32, nbytes, k)

        @cuda.jit(device=True)
        def stage(sw_v, sw_s, t, off, n, enc, vb, vw, nvb, sb, sw, nsb):
            width = int64(BITS)
            if enc != RAW:
                width = int64(W)
            stage_words(sw_v, t, off * width, (off + n) * width, vb, vw, nvb, VWPT)
            if enc == SIGNPLANE:
                stage_words(sw_s, t, off, off + n, sb, sw, nsb, SWPT)

        @cuda.jit(device=True)
        def value_at(sw_v, sw_s, off, i, enc):
            """Stored pattern number off + i, from the staged words."""
            width = int64(BITS)
            wmask = int64(EMASK)
            if enc != RAW:
                width = int64(W)
                wmask = int64(WMASK)
            bit = (off + i) * width - (((off * width) >> 5) << 5)
            k = bit >> 5
            sh = bit & 31
            lo = int64(sw_v[k]) >> sh
            if sh + width > 32:
                lo |= int64(sw_v[k + 1]) << (32 - sh)
            code = lo & wmask
            if enc == SIGNPLANE:
                sbit = (off + i) - ((off >> 5) << 5)
                code |= ((int64(sw_s[sbit >> 5]) >> (sbit & 31)) & 1) << (BITS - 1)
            return code

        # Pack stages the tile's stored values in order (STAGE_W words of shared
        # memory), then turns each run of 32 into W stream words with constant
        # shifts (CuPy's bs_pack_group) while warp 0 looks back, and finally
        # writes the stream words that lie wholly inside the tile's bit range,
        # each a funnel shift of two tile words (no per-word gather, no
        # division). The words shared by two tiles (and the stream's last,
        # partly filled word) are written by k_finish from every tile's edge
        # record: its first and last 32 stored bits (CuPy's bitsparse_stitch).
        #
        # Pack tiles have their own size (PTILE; unpack keeps TILE): a thread holds
        # PR groups of 8 elements, 64 bytes (bf16 / fp16: 4 groups, 8192 elements
        # per tile; fp8: 8 groups, 16384; fp32: 2 groups, 4096), as 64-bit words in
        # registers. Warp w owns groups w*PSEG .. (w+1)*PSEG - 1 of the tile; round r
        # of lane l is group w*PSEG + r*32 + l, so every round's loads are coalesced
        # and a warp's groups are contiguous: a group's rank is the warp's offset
        # plus one packed warp scan of the PR rounds' counts (8-bit fields: an
        # exclusive prefix of 31 lanes is at most 248). The simulator runs PR = 2
        # (1024-element tiles of 64 threads, as the unpack's).
        PR = pack_rounds or pack_rounds_for(bits)
        PSEG = 32 * PR                              # groups per warp
        PGPT = NW * PSEG                            # groups per tile
        PTILE = 8 * PGPT
        PTILE_LOG2 = PTILE.bit_length() - 1
        PMB = (PR + 3) // 4                         # mask bytes, 4 rounds per uint32
        PXW = PR * ITEM                             # a thread's elements, in uint64 words
        assert PR in (1, 2, 4, 8) and PTILE == 1 << PTILE_LOG2
        # Chunk starts (>= 512 elements = 64 groups) fall on lane 0 of even rounds.
        assert _fmt.MIN_CHUNK_LOG2 >= 9 and PSEG % 64 == 0
        pk_excl = _warp_excl_scan if PR <= 4 else _warp_excl_scan64
        PKT = int32 if PR <= 4 else int64           # the packed counts' type
        self.ptile, self.ptile_log2 = PTILE, PTILE_LOG2
        pack_jit = PACK_JIT
        if pack_blocks and not SIM:
            pack_jit = {m: {"launch_bounds": (NT, min(4, pack_blocks) if m in (MODE_RELU, MODE_RELU2)
                                              else pack_blocks)} for m in PACK_JIT}
        LBW = lb_windows
        lb_load, lookback = _make_lookback(LBW)
        STAGE_W = PTILE * BITS // 32 + BITS         # + a partial run's words
        A_W = (PTILE // 32 + 1) * W + 1             # the tile's stream, whole runs
        SG_W = PTILE // 32 + 2                      # its sign bits
        PCNT_N = 2 * NW                             # per warp: lane 31's packed prefix, counts
        PRS_N = NW * PR                             # lane 0's group ranks (chunk offsets)
        SIGN_ALL = sum(SIGN << (j * BITS) for j in range(PER_WORD))   # a uint64's sign bits

        # relu of the 32 / BITS elements of a 32-bit word at once: an element with
        # its sign bit set becomes zero unless it is a NaN (relu keeps NaNs), i.e.
        # unless its low BITS-1 bits exceed NAN_GT (a carry into the sign position).
        _, _E, _M, _style = bitfloat.FORMATS[name]
        NAN_GT = ((1 << _E) - 1) << _M                     # +inf: larger magnitudes are NaNs
        if _style == "fn":
            NAN_GT = (((1 << _E) - 1) << _M | ((1 << _M) - 1)) - 1   # e4m3fn: only 0x7f
        LANE_LOW = sum((SIGN - 1) << (k * BITS) for k in range(GE))
        LANE_HIGH = sum(SIGN << (k * BITS) for k in range(GE))
        LANE_ADD = sum((SIGN - 1 - NAN_GT) << (k * BITS) for k in range(GE))
        LANE_ONE = sum(1 << (k * BITS) for k in range(GE))

        @cuda.jit(device=True)
        def relu_word(w):
            """relu of each element of the 32-bit word w (an int64 < 2**32)."""
            nan = ((w & LANE_LOW) + LANE_ADD) & LANE_HIGH
            kill = (w & LANE_HIGH) & ~nan
            return w & ~(((kill >> (BITS - 1)) & LANE_ONE) * EMASK)

        @cuda.jit(device=True)
        def word_nonzero(w):
            """Nonzero bits of the 32 / BITS elements of a 32-bit word, element k -> bit k
            (a carry out of the low BITS-1 bits, OR the lane's sign bit)."""
            w = uint32(w)                    # 32-bit arithmetic throughout
            if BITS == 32:
                return int32(w != 0)
            if BITS == 16:
                nz = uint32((((w & 0x7FFF7FFF) + 0x7FFF7FFF) | w) & 0x80008000)
                return int32(((nz >> 15) & 1) | (nz >> 30))
            nz = uint32((((w & 0x7F7F7F7F) + 0x7F7F7F7F) | w) & 0x80808080)
            # bits 7, 15, 23, 31 -> 21..24 (the low 32 bits of the product suffice)
            return int32(_mul32(nz >> 7, 0x00204081) >> 21) & 0xF

        @cuda.jit(device=True)
        def pair_nonzero(w):
            """Nonzero bits of the PER_WORD elements of a uint64 word w (an int64),
            element k -> bit k. bf16 / fp16: each half's lane flags (bits 15, 31) are
            gathered into one word by a byte permute (bits 7, 15, 23, 31) and
            compressed by a multiply, 9 instructions for 4 elements."""
            lo = uint32(w & FULL_MASK)
            hi = uint32((w >> 32) & FULL_MASK)
            if BITS == 16:
                nz0 = uint32((((lo & 0x7FFF7FFF) + 0x7FFF7FFF) | lo) & 0x80008000)
                nz1 = uint32((((hi & 0x7FFF7FFF) + 0x7FFF7FFF) | hi) & 0x80008000)
                g = _prmt2(nz0, nz1, 0x7531)
                return int32(_mul32(g, 0x00204081) >> 28)
            return word_nonzero(lo) | (word_nonzero(hi) << GE)

        @cuda.jit(device=True)
        def pack_run(stage_w, q, a_s, s_sg, signs):
            """Run q (staged values 32q .. 32q+31) -> its W stream words in a_s and,
            with ``signs``, its sign bits in s_sg. Every shift is a constant."""
            acc = cuda.local.array(W, uint32)
            for m in range(W):
                acc[m] = 0
            sg = uint32(0)
            for tt in range(BITS):
                word = uint32(stage_w[_u(q * BITS + tt)])
                for g in range(GE):
                    j = tt * GE + g
                    wi = (j * W) >> 5
                    c = (word >> (g * BITS)) & WMASK
                    acc[wi] |= (c << ((j * W) & 31)) & FULL_MASK
                    if ((j * W) & 31) + W > 32 and wi + 1 < W:
                        acc[wi + 1] |= c >> (32 - ((j * W) & 31))
                    if (j * W + W) >> 5 > wi:
                        a_s[_u(q * W + wi)] = acc[wi]     # complete: store it, free its register
                    if signs:
                        sg |= ((word >> (g * BITS + BITS - 1)) & 1) << j
            if signs:
                s_sg[_u(q)] = sg

        @cuda.jit(device=True)
        def copy_inner(out, tw, t, a, e, width):
            """Write the stream words wholly inside bits [a*width, e*width): tw is the
            tile's stream from bit a*width (LSB-first words)."""
            B0 = a * width
            k0 = (B0 + 31) >> 5
            k1 = (e * width) >> 5
            if k1 > out.size:
                k1 = out.size
            off = uint64((k0 << 5) - B0)                 # < 32: word i is tw bits off + 32 i ..
            i = int64(t)
            while k0 + i < k1:
                pair = (uint64(tw[_u(i + 1)]) << uint64(32)) | uint64(tw[_u(i)])
                out[_u(k0 + i)] = (pair >> off) & uint64(FULL_MASK)
                i += NT

        @cuda.jit(device=True)
        def stream_edges(tw, L):
            """The first and the last 32 of the L bits of a tile's stream tw (zero past
            L; the last ones top-aligned, i.e. their last bit in bit 31)."""
            if L == 0:
                return int64(0), int64(0)
            w0 = int64(tw[0])
            if L < 32:
                return w0 & ((int64(1) << L) - 1), (w0 << (32 - L)) & FULL_MASK
            p = L - 32
            k = p >> 5
            pair = (uint64(tw[_u(k + 1)]) << uint64(32)) | uint64(tw[_u(k)])
            return w0, int64((pair >> uint64(p & 31)) & uint64(FULL_MASK))

        @cuda.jit(device=True)
        def stitch_word(out, starts, edges, n_tiles, cap, i, width, col):
            """Write the stream word holding the first stored bit of tile i (i =
            n_tiles: the stored end) when that bit is not word-aligned and no earlier
            tile starts inside the same word: the bits of tile i - 1 in it (its
            edge record's last bits), then those of tiles i, i+1, ... that start in
            it before the stored end (their first bits; zero past each tile's end).
            col: the edge record's column pair (0 values, 2 signs)."""
            end = starts[n_tiles]
            if end > cap:
                end = cap
            s = starts[i]
            if s > cap:
                s = cap
            b0 = s * width
            lo = (b0 >> 5) << 5
            if b0 == lo:
                return
            sp = starts[i - 1]                           # i >= 1: tile 0 starts at bit 0
            if sp > cap:
                sp = cap
            if sp * width > lo:
                return
            word = int64(edges[_u((i - 1) * 4 + col + 1)]) >> (32 - (b0 - lo))
            k = i
            while k < n_tiles:
                fk = starts[k]
                if fk > cap:
                    fk = cap
                if fk >= end or fk * width >= lo + 32:
                    break
                word |= (int64(edges[_u(k * 4 + col)]) << (fk * width - lo)) & FULL_MASK
                k += 1
            if (b0 >> 5) < out.size:
                out[_u(b0 >> 5)] = word

        @cuda.jit(device=True)
        def publish(desc, tile, n, neg, t):
            """Thread 0: the tile's count in one 8-byte descriptor, with its nosign flag
            (inclusive for tile 0)."""
            if t == 0:
                d = n
                if neg != 0:
                    d |= LB_NEG
                if tile == 0:
                    cuda.atomic.exch(desc, SCRATCH_HEAD, int64(LB_INCL) | d)
                else:
                    cuda.atomic.exch(desc, SCRATCH_HEAD + tile, int64(LB_AGG) | d)

        def make_pack(mode, enc):
            """The pack kernel of one mode and encoding (both compile-time constants,
            so the other modes' code and the run-time encoding tests drop out)."""
            SIGNS = enc == SIGNPLANE

            @cuda.jit(**pack_jit[mode])
            def k_pack(xe, x64, use64, numel, ye, y64, ouse64, msrc, cap, incl_every,
                       mask, offsets, chunk_log2, vt, vw, sw, scratch, starts, edges, stat):
                """One-pass pack. mode 0: x's nonzeros; 1: relu(x)'s, writing y = relu(x);
                2: the same with y = relu(x)**2; 3 (masked_pack): x at the set bits of the
                mask plane ``msrc`` (mask and offsets are then shared, not written).
                ``scratch`` (int64, zeroed): ticket, unused, one descriptor per tile;
                ``starts`` (int64): each tile's first value index, then the total;
                ``edges`` (uint32): 4 per tile (k_finish); ``stat`` (int64): status
                word, total count. ``incl_every`` > 1 makes only every such tile publish
                its inclusive count (tests use it to make the look-back walk)."""
                t = cuda.threadIdx.x
                lane = t & 31
                warp = t >> 5
                n_tiles = int64(cuda.gridDim.x)
                stage_w = cuda.shared.array(STAGE_W, uint32)
                sv = stage_w.view(ENP)                       # the tile's values, compacted
                a_s = cuda.shared.array(A_W, uint32)
                s_sg = cuda.shared.array(SG_W, uint32)
                sh_tot = cuda.shared.array(NW, int32)
                sh_cnt = cuda.shared.array(PCNT_N, int64)   # lane 31's packed prefix and counts
                sh_rs = cuda.shared.array(PRS_N, int32)   # lane 0's group ranks
                sh_lane = cuda.shared.array(LANE_N, int64)
                sh_p = cuda.shared.array(2, int64)
                xw = cuda.local.array(PXW, int64)           # the elements, kept in registers
                mb = cuda.local.array(PMB, int32)           # their mask bytes, 4 per word
                lbf = cuda.local.array(LBW, int64)          # warp 0: look-back descriptors
                if ticket:
                    if t == 0:
                        sh_p[0] = cuda.atomic.add(scratch, 0, int64(1))
                    cuda.syncthreads()
                    tile = sh_p[0]
                else:
                    tile = int64(cuda.blockIdx.x)
                ngroups = (numel + 7) >> 3
                g0 = tile * PGPT + warp * PSEG + lane        # this thread's group of round 0
                # All loads first (a branch per round would expose each round's latency):
                # whole uint64 words when the tile lies inside an aligned input, else
                # element loads (elements past numel read as zero).
                if use64 and (tile + 1) * PTILE <= numel:
                    for r in range(PR):
                        for q in range(ITEM):
                            xw[r * ITEM + q] = int64(x64[_u((g0 + r * 32) * ITEM + q)])
                else:
                    for r in range(PR):
                        for q in range(ITEM):
                            w = int64(0)
                            for j in range(PER_WORD):
                                e = (g0 + r * 32) * 8 + q * PER_WORD + j
                                if e < numel:
                                    w |= int64(xe[_u(e)]) << (j * BITS)
                            xw[r * ITEM + q] = w
                neg = uint64(0)                              # OR of the stored patterns
                pk = PKT(0)                                  # round r's count in bits 8r..
                for k in range(PMB):
                    mb[k] = 0
                for r in range(PR):
                    g = g0 + r * 32
                    byte = int32(0)
                    if mode == MODE_PACK:
                        for q in range(ITEM):
                            w = xw[r * ITEM + q]
                            neg |= uint64(w)                 # zeros have no sign bit
                            byte |= pair_nonzero(w) << (q * PER_WORD)
                    elif mode == MODE_MASKED:
                        if g < ngroups:
                            byte = int32(msrc[_u(g)])
                        for j in range(8):
                            if (byte >> j) & 1:
                                neg |= uint64(xw[r * ITEM + j // PER_WORD] >> ((j % PER_WORD) * BITS))
                    else:
                        # relu per 32-bit word, y = relu(x) (or its square) stored per word.
                        yfast = ouse64 and g * 8 + 8 <= numel
                        for q in range(ITEM):
                            w0 = xw[r * ITEM + q]
                            w = relu_word(w0 & FULL_MASK) | (relu_word((w0 >> 32) & FULL_MASK) << 32)
                            xw[r * ITEM + q] = w
                            neg |= uint64(w)                 # a kept negative: a NaN
                            byte |= pair_nonzero(w) << (q * PER_WORD)
                            yw = w
                            if mode == MODE_RELU2:
                                yw = int64(0)
                                for j in range(PER_WORD):
                                    yw |= square((w >> (j * BITS)) & EMASK) << (j * BITS)
                            if g < ngroups:
                                if yfast:
                                    y64[_u(g * ITEM + q)] = yw
                                else:
                                    for j in range(PER_WORD):
                                        e = g * 8 + q * PER_WORD + j
                                        if e < numel:
                                            ye[_u(e)] = (yw >> (j * BITS)) & EMASK
                    if g < ngroups and mode != MODE_MASKED:
                        mask[_u(g)] = byte
                    mb[r >> 2] |= int32(byte) << (8 * (r & 3))
                    pk += PKT(cuda.popc(int32(byte))) << PKT(8 * r)
                negf = int32(enc == NOSIGN and (neg & uint64(SIGN_ALL)) != 0)

                # Ranks: the packed rounds' counts scanned across the warp; lane 31's
                # prefix and counts give the warp's round totals, sh_tot the warps'.
                ex = pk_excl(pk, lane, t, sh_lane)          # fields of lanes before: <= 248
                if lane == 31:
                    tot = int32(0)
                    for r in range(PR):
                        tot += int32(((ex >> (8 * r)) & 0xFF) + ((pk >> (8 * r)) & 0xFF))
                    sh_tot[warp] = tot
                    sh_cnt[2 * warp] = ex
                    sh_cnt[2 * warp + 1] = pk
                negf = cuda.syncthreads_or(negf)             # any stored value with its sign set
                before = int32(0)
                n32 = int32(0)
                for w in range(NW):
                    tw = sh_tot[w]
                    if w < warp:
                        before = int32(before + tw)
                    n32 = int32(n32 + tw)
                n = int64(n32)
                ex31 = sh_cnt[2 * warp]
                pk31 = sh_cnt[2 * warp + 1]
                if lb_early:
                    publish(scratch, tile, n, negf, t)
                    if t < 32 and tile > 0:
                        lb_load(scratch, tile, lane, lbf)

                # Stage the stored values in order.
                for r in range(PR):
                    rk = int32(before + ((ex >> (8 * r)) & 0xFF))
                    before = int32(before + ((ex31 >> (8 * r)) & 0xFF) + ((pk31 >> (8 * r)) & 0xFF))
                    if mode != MODE_MASKED and lane == 0:
                        sh_rs[_u(warp * PR + r)] = rk              # round r's first rank
                    byte = (mb[r >> 2] >> (8 * (r & 3))) & 0xFF
                    for j in range(8):
                        if (byte >> j) & 1:
                            sv[_u(rk)] = (xw[r * ITEM + j // PER_WORD] >> ((j % PER_WORD) * BITS)) & EMASK
                            rk += 1
                if not lb_early:
                    # Publish the count now (before staging, the extra live
                    # registers spill the elements).
                    publish(scratch, tile, n, negf, t)
                cuda.syncthreads()

                # Warp 0: the tile's offset from the look-back, then its inclusive
                # count and its start (for k_finish). The other warps meanwhile
                # build the tile's stream.
                if t < 32:
                    P = int64(0)
                    pneg = int64(0)
                    if tile > 0:
                        if not lb_early:
                            lb_load(scratch, tile, lane, lbf)
                        P, pneg = lookback(scratch, tile, lane, lbf)
                    if t == 0:
                        if negf != 0:
                            pneg = int64(1)
                        if tile > 0 and tile % incl_every == 0:
                            d = int64(LB_INCL) | (P + n)
                            if pneg != 0:
                                d |= LB_NEG
                            cuda.atomic.exch(scratch, SCRATCH_HEAD + tile, d)
                        starts[tile] = P
                        if tile == n_tiles - 1:
                            starts[n_tiles] = P + n
                            stat[0] = pneg
                            stat[1] = P + n
                            if mode != MODE_MASKED:
                                offsets[offsets.size - 1] = P + n
                        sh_p[1] = P
                elif enc != RAW:
                    q = int64(t - 32)
                    while q * 32 < n:
                        pack_run(stage_w, q, a_s, s_sg, SIGNS)
                        q += NT - 32
                cuda.syncthreads()
                P = sh_p[1]

                if mode != MODE_MASKED and lane == 0:
                    # The chunks starting in the warp's segment (each at a round's
                    # first element, see PSEG): a loop over them, not over the rounds.
                    s0 = (tile * PGPT + warp * PSEG) * 8
                    s1 = s0 + PSEG * 8
                    if s1 > numel:
                        s1 = numel
                    c = (s0 + (int64(1) << chunk_log2) - 1) >> chunk_log2
                    while (c << chunk_log2) < s1:
                        offsets[_u(c)] = P + sh_rs[_u(warp * PR + (((c << chunk_log2) - s0) >> 8))]
                        c += 1
                # The stored values, clipped to the capacity.
                a = P
                if a > cap:
                    a = cap
                e = P + n
                if e > cap:
                    e = cap
                if enc == RAW:
                    i = int64(t)
                    while P + i < e:
                        vt[_u(P + i)] = int64(sv[_u(i)])
                        i += NT
                else:
                    copy_inner(vw, a_s, t, a, e, W)
                    if SIGNS:
                        copy_inner(sw, s_sg, t, a, e, 1)
                    if t == 0:
                        ef, el = stream_edges(a_s, (e - a) * W)
                        edges[_u(tile * 4)] = ef
                        edges[_u(tile * 4 + 1)] = el
                        if SIGNS:
                            ef, el = stream_edges(s_sg, e - a)
                            edges[_u(tile * 4 + 2)] = ef
                            edges[_u(tile * 4 + 3)] = el
            return k_pack

        @cuda.jit
        def k_finish(starts, edges, n_tiles, stat, cap, enc, zero, vt, vw, sw):
            """After a pack: thread i <= n_tiles writes the stream word that tile i
            starts inside (see stitch_word; none for raw values); with ``zero``
            (fixed capacity), the grid then zeroes what lies past the stored values
            (count from ``stat``)."""
            i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
            step = int64(cuda.gridDim.x) * cuda.blockDim.x
            if enc != RAW and i <= n_tiles:
                stitch_word(vw, starts, edges, n_tiles, cap, i, W, 0)
                if enc == SIGNPLANE:
                    stitch_word(sw, starts, edges, n_tiles, cap, i, 1, 2)
            if zero:
                stored = stat[1]
                if stored > cap:
                    stored = cap
                if enc == RAW:
                    e = stored + i
                    while e < cap:
                        vt[e] = 0
                        e += step
                else:
                    k = ((stored * W + 31) >> 5) + i
                    while k < vw.size:
                        vw[k] = 0
                        k += step
                    k = ((stored + 31) >> 5) + i
                    while k < sw.size:
                        sw[k] = 0
                        k += step

        # Unpack: one kernel per (op, encoding), in the CuPy backend's per-word
        # form. The tile's value range [P, Pe) comes from the tile-offset array at
        # both ends, so its stored values are decoded before the ranks are known,
        # 32 / BITS per 32-bit word of shared memory (a stream word pair shifted
        # and spread into lanes: no per-value work). Each thread then builds UR
        # rows of UV elements (16 bytes; 32 for float32), warp-major as in the
        # CuPy kernel: warp w owns UR * 32 rows of the tile, its round r covers
        # 32 consecutive rows, one per lane. Each output word is the next stored
        # values' bytes (a funnel shift of two shared words) dropped into the
        # slots its mask bits select (one PRMT).
        UV = 8 if BITS == 32 else 128 // BITS
        UMB = UV // 8                    # mask bytes per row
        URS = 32 * UV                    # elements per warp round
        OW = UV * BITS // 32             # output words per row
        # Rows per thread and tile size (log2) per op: plain unpack UNPACK_ROWS rows,
        # relu2 backward TILE elements.
        UR_OP = {0: UNPACK_ROWS, 1: max(1, TILE // (UV * UNT))}
        self.utile_log2 = {op: int(UR_OP[op] * UV * UNT).bit_length() - 1 for op in (0, 1)}
        for op in (0, 1):
            assert (1 << self.utile_log2[op]) == UR_OP[op] * UV * UNT >= TILE
        # PRMT selector per mask bits of a word: the next values' bytes go to the
        # selected elements' slots, selector nibble 4 (a zero byte of y = 0) elsewhere.
        SEL = np.zeros(1 << GE, dtype=np.uint32)
        for mb in range(1 << GE):
            k = 0
            for p in range(GE):
                for q in range(BITS // 8):
                    byte = k * (BITS // 8) + q if (mb >> p) & 1 else 4
                    SEL[mb] |= byte << (4 * (p * (BITS // 8) + q))
                k += (mb >> p) & 1

        @cuda.jit(device=True)
        def spread_signs(s):
            """Sign bits 0 .. GE-1 of s -> the sign bit of each BITS-bit lane."""
            if BITS == 32:
                return (s & 1) << 31
            if BITS == 16:
                return ((s & 1) << 15) | ((s & 2) << 30)
            return (((s & 0xF) * 0x00204081) & 0x01010101) << 7

        @cuda.jit(device=True)
        def plane_pair(b8, w32, nbytes, fast, k, sh):
            """Bits [32 k + sh, 32 k + sh + 32) of a plane (sh < 32)."""
            if fast:
                lo = uint64(w32[_u(k)])
                hi = uint64(w32[_u(k + 1)])
            else:
                lo = uint64(_load_word(b8, w32, nbytes, k))
                hi = uint64(_load_word(b8, w32, nbytes, k + 1))
            return uint32((((hi << uint64(32)) | lo) >> uint64(sh)) & FULL_MASK)

        # bf16 / fp16: the four 16-bit selectors in one constant, picked by a shift.
        # fp8: a 16-entry table in shared memory (sel, filled per block). Indexing a
        # constant-memory table by a per-lane mb instead serialises the warp over
        # its distinct addresses (measured: fp8 s=0.5 unpack 2x CuPy's time).
        SEL16 = sum(int(SEL[mb]) << (16 * mb) for mb in range(4)) if BITS == 16 else 0

        @cuda.jit(device=True)
        def expand_word(vals, sel, j, mb):
            """The GE elements of an output word with mask bits mb, whose first set
            element takes stored value j of the tile."""
            if BITS == 32:
                return vals[_u(j)] if mb != 0 else uint32(0)
            byte = j * (BITS // 8)
            k = byte >> 2
            pair = (uint64(vals[_u(k + 1)]) << uint64(32)) | uint64(vals[_u(k)])
            src = uint32((pair >> uint64((byte & 3) * 8)) & FULL_MASK)
            if BITS == 16:
                return _prmt(src, uint32((uint64(SEL16) >> uint64(16 * mb)) & 0xFFFF))
            return _prmt(src, sel[mb])

        def make_unpack(op, enc):
            WD = BITS if enc == RAW else W
            WG = GE * WD                 # stream bits per decoded word
            UR = UR_OP[op]               # rows per thread
            UTL = self.utile_log2[op]
            UT = 1 << UTL                # elements per tile
            SEG = UR * URS               # elements per warp
            VALS_W = UT * BITS // 32 + 4     # decoded words (+ guards for the pair reads)
            assert UR in (1, 2, 4)
            GE_LOG2 = GE.bit_length() - 1
            SEL_N = 16 if BITS == 8 else 1

            @cuda.jit(device=True)
            def spread(c):
                """A stream word pair's 32 / BITS codes of width WD -> one per BITS-bit lane."""
                if WD == BITS:
                    return c
                if BITS == 32:
                    return c & 0x7FFFFFFF
                if BITS == 16:
                    return (c & 0x7FFF) | ((c << 1) & 0x7FFF0000)
                y = (c & 0x3FFF) | ((c << 2) & 0x3FFF0000)          # two 14-bit halves
                return (y & 0x007F007F) | ((y << 1) & 0x7F007F00)

            @cuda.jit(device=True)
            def row_bits(mask, e0, guard, ngroups):
                """The mask bits of the row at element e0; with ``guard``, 0 past the end."""
                g = e0 >> 3
                b = uint32(0)
                for h in range(UMB):
                    if guard:
                        if g + h < ngroups:
                            b = uint32(b | (uint32(mask[_u(g + h)]) << uint32(8 * h)))
                    else:
                        b = uint32(b | (uint32(mask[_u(g + h)]) << uint32(8 * h)))
                return b

            @cuda.jit(device=True)
            def emit_row(vals, sel, o, v, gv, b, j, e0, tfull, numel, ge, g64, guse64,
                         oe, o64, ouse64):
                """Expand and store the row at element e0 with mask bits b, whose first
                set element takes stored value j of the tile."""
                if tfull or e0 < numel:
                    for m in range(OW):
                        mb = uint32((b >> uint32(m * GE)) & uint32((1 << GE) - 1))
                        o[m] = expand_word(vals, sel, j, mb)
                        j = int32(j + cuda.popc(mb))
                    full = tfull or e0 + UV <= numel
                    if op == 0 and ouse64 and full:
                        for p in range(OW // 2):
                            pair = uint64(o[2 * p]) | (uint64(o[2 * p + 1]) << uint64(32))
                            o64[_u(e0 * BITS // 64 + p)] = pair
                    else:
                        for h in range(UMB):
                            g = (e0 >> 3) + h
                            for i in range(8):
                                e = 8 * h + i
                                v[i] = int64(o[e // GE] >> ((e % GE) * BITS)) & EMASK
                            if op == 1:
                                load_group(ge, g64, guse64 and g * 8 + 8 <= numel, numel, g, gv)
                                for i in range(8):
                                    rj = v[i]
                                    if is_pos(rj):
                                        v[i] = narrow(fmul(widen(gv[i]), fmul(widen(rj), TWO)))
                                    else:
                                        v[i] = 0
                            store_group(oe, o64, ouse64 and g * 8 + 8 <= numel, numel, g, v)

            @cuda.jit(device=True)
            def scan_pair(acc, ba, bb, two, tot_needed, lane, t, sh_lane):
                """Warp ranks of two rounds (bb only with ``two``), counts 16 bits apart
                in one scan (a round holds at most 32 * UV < 2**16): (start of round a,
                start of round b, acc + both rounds' warp totals). Without
                ``tot_needed`` only lane 31's third value is right."""
                packed = int32(cuda.popc(ba))
                if two:
                    packed = int32(packed | (cuda.popc(bb) << 16))
                inc = int32(_warp_incl_scan(packed, lane, t, sh_lane))
                tot = inc
                if tot_needed:
                    tot = int32(_warp_last(inc, lane, t, sh_lane))
                excl = int32(inc - packed)
                sa = int32(acc + (excl & 0xFFFF))
                sb = int32(acc + (tot & 0xFFFF) + (excl >> 16))
                return sa, sb, int32(acc + (tot & 0xFFFF) + (tot >> 16))

            @cuda.jit(**UNPACK_JIT[op])
            def k_unpack(mask, numel, toff, toff_shift, vb, vw, nvb, sb, sw, nsb,
                         ge, g64, guse64, oe, o64, ouse64):
                """Dense output of one tile of UT elements. op 0: the stored patterns
                (unpack); op 1: relu2_backward, 2*r*grad where r > 0, else +0. The
                tile's stored values are toff[(i << UTL) >> toff_shift] up to the
                same at tile i + 1 (toff has one entry past the last tile or chunk);
                vb/vw: the values plane as bytes and as its whole 32-bit words
                (empty when unaligned), nvb its length (likewise the signs).
                The UR <= 4 rows are written out (scalars, not a loop over a local
                array: the compiler does not always unroll it, and the array then
                lives in local memory)."""
                t = cuda.threadIdx.x
                lane = t & 31
                warp = t >> 5
                tile = int64(cuda.blockIdx.x)
                vals = cuda.shared.array(VALS_W, uint32)
                sh_tot = cuda.shared.array(UNW, int32)
                sh_lane = cuda.shared.array(ULANE_N, int32)
                sel = cuda.shared.array(SEL_N, uint32)
                if BITS == 8 and t < SEL_N:
                    sel[t] = cuda.const.array_like(SEL)[t]   # read after the rank barrier
                o = cuda.local.array(OW, uint32)
                v = cuda.local.array(8, int64)
                gv = cuda.local.array(8, int64)
                ngroups = (numel + 7) >> 3
                base = tile << UTL
                tfull = base + UT <= numel       # no per-row bounds in a whole tile
                row0 = base + (warp * SEG + lane * UV)

                # The tile's value range (its loads first: the decode waits on them).
                off = int64(toff[_u(base >> toff_shift)])
                ie = ((tile + 1) << UTL) >> toff_shift
                if ie > toff.size - 1:
                    ie = toff.size - 1
                n = int64(toff[_u(ie)]) - off
                # Mask bits of this thread's rows (round r: element row0 + r * URS). A
                # whole tile loads them without a test between (all loads in flight).
                b1 = uint32(0)
                b2 = uint32(0)
                b3 = uint32(0)
                if tfull:
                    b0 = row_bits(mask, row0, False, ngroups)
                    if UR > 1:
                        b1 = row_bits(mask, row0 + URS, False, ngroups)
                    if UR > 2:
                        b2 = row_bits(mask, row0 + 2 * URS, False, ngroups)
                        b3 = row_bits(mask, row0 + 3 * URS, False, ngroups)
                else:
                    b0 = row_bits(mask, row0, True, ngroups)
                    if UR > 1:
                        b1 = row_bits(mask, row0 + URS, True, ngroups)
                    if UR > 2:
                        b2 = row_bits(mask, row0 + 2 * URS, True, ngroups)
                        b3 = row_bits(mask, row0 + 3 * URS, True, ngroups)

                # The tile's stored values, GE per shared word.
                words = (n + GE - 1) >> GE_LOG2
                bit0 = off * WD
                w0 = bit0 >> 5
                sh0 = bit0 & 31
                fast = w0 + ((sh0 + words * WG) >> 5) + 2 <= vw.size
                s0 = off >> 5
                ssh = off & 31
                sfast = s0 + ((ssh + words * GE) >> 5) + 2 <= sw.size
                if fast and (enc != SIGNPLANE or sfast):
                    # Every word in range: 32-bit bit positions relative to the tile's
                    # first word (a tile holds < 2**27 stream bits), no guards.
                    words32 = uint32(words)
                    q32 = uint32(t)
                    while q32 < words32:
                        rel = uint32(uint32(sh0) + q32 * uint32(WG))
                        k = uint64(w0) + uint64(rel >> uint32(5))
                        pair = (uint64(vw[k + uint64(1)]) << uint64(32)) | uint64(vw[k])
                        c = spread(uint32((pair >> uint64(rel & uint32(31))) & FULL_MASK))
                        if enc == SIGNPLANE:
                            rs = uint32(uint32(ssh) + q32 * uint32(GE))
                            ks = uint64(s0) + uint64(rs >> uint32(5))
                            sp = (uint64(sw[ks + uint64(1)]) << uint64(32)) | uint64(sw[ks])
                            c |= spread_signs(uint32((sp >> uint64(rs & uint32(31))) & FULL_MASK))
                        vals[q32] = c
                        q32 = uint32(q32 + uint32(UNT))
                else:
                    q = int64(t)
                    while q < words:
                        rel = sh0 + q * WG
                        c = spread(plane_pair(vb, vw, nvb, fast, w0 + (rel >> 5), rel & 31))
                        if enc == SIGNPLANE:
                            rs = ssh + q * GE
                            c |= spread_signs(plane_pair(sb, sw, nsb, sfast, s0 + (rs >> 5), rs & 31))
                        vals[_u(q)] = c
                        q += UNT

                # Ranks within the warp (rounds in order), then the warps before this one.
                st0, st1, acc = scan_pair(int32(0), b0, b1, UR > 1, UR > 1, lane, t, sh_lane)
                st2 = int32(0)
                st3 = int32(0)
                if UR > 2:
                    st2, st3, acc = scan_pair(acc, b2, b3, True, True, lane, t, sh_lane)
                if lane == 31:
                    sh_tot[warp] = acc
                cuda.syncthreads()
                before = int32(0)
                for w in range(UNW):
                    if w < warp:
                        before = int32(before + sh_tot[w])

                emit_row(vals, sel, o, v, gv, b0, int32(before + st0), row0, tfull, numel,
                         ge, g64, guse64, oe, o64, ouse64)
                if UR > 1:
                    emit_row(vals, sel, o, v, gv, b1, int32(before + st1), row0 + URS, tfull,
                             numel, ge, g64, guse64, oe, o64, ouse64)
                if UR > 2:
                    emit_row(vals, sel, o, v, gv, b2, int32(before + st2), row0 + 2 * URS,
                             tfull, numel, ge, g64, guse64, oe, o64, ouse64)
                    emit_row(vals, sel, o, v, gv, b3, int32(before + st3), row0 + 3 * URS,
                             tfull, numel, ge, g64, guse64, oe, o64, ouse64)
            return k_unpack

        @cuda.jit
        def k_gated(mask_r, toff_r, shift_r, enc_r, vb_r, vw_r, nvb_r, sb_r, sw_r, nsb_r,
                    mask_u, toff_u, shift_u, enc_u, vb_u, vw_u, nvb_u, sb_u, sw_u, nsb_u,
                    numel, ge, g64, guse64, og, og64, ou, ou64, ouse64):
            """gated_backward: grad_u = grad*r everywhere, grad_g = grad*u where r > 0.
            Per packed tensor the arguments of ``unpack``."""
            t = cuda.threadIdx.x
            tile = int64(cuda.blockIdx.x)
            wr = cuda.shared.array(VWN, uint32)
            sr = cuda.shared.array(SWN, uint32)
            wu = cuda.shared.array(VWN, uint32)
            su = cuda.shared.array(SWN, uint32)
            byte_r = cuda.shared.array(GPT, int32)
            rank_r = cuda.shared.array(GPT, int32)
            byte_u = cuda.shared.array(GPT, int32)
            rank_u = cuda.shared.array(GPT, int32)
            sh_tot = cuda.shared.array(NW, int32)
            sh_lane = cuda.shared.array(LANE_N, int64)
            rv = cuda.local.array(8, int64)
            uv = cuda.local.array(8, int64)
            gv = cuda.local.array(8, int64)
            ngroups = (numel + 7) >> 3
            _tile_mask_bytes(mask_r, tile, ngroups, t, byte_r)
            _tile_mask_bytes(mask_u, tile, ngroups, t, byte_u)
            cuda.syncthreads()
            n_r = _tile_ranks(byte_r, rank_r, sh_tot, sh_lane, t)
            cuda.syncthreads()
            n_u = _tile_ranks(byte_u, rank_u, sh_tot, sh_lane, t)
            off_r = int64(toff_r[(tile << TILE_LOG2) >> shift_r])
            off_u = int64(toff_u[(tile << TILE_LOG2) >> shift_u])
            stage(wr, sr, t, off_r, n_r, enc_r, vb_r, vw_r, nvb_r, sb_r, sw_r, nsb_r)
            stage(wu, su, t, off_u, n_u, enc_u, vb_u, vw_u, nvb_u, sb_u, sw_u, nsb_u)
            cuda.syncthreads()
            for r in range(G):
                gi = r * NT + t
                g = tile * GPT + gi
                if g < ngroups:
                    full = g * 8 + 8 <= numel
                    load_group(ge, g64, guse64 and full, numel, g, gv)
                    br = byte_r[gi]
                    kr = int64(rank_r[gi])
                    bu = byte_u[gi]
                    ku = int64(rank_u[gi])
                    for j in range(8):
                        rj = int64(0)
                        if (br >> j) & 1:
                            rj = value_at(wr, sr, off_r, kr, enc_r)
                            kr += 1
                        uj = int64(0)
                        if (bu >> j) & 1:
                            uj = value_at(wu, su, off_u, ku, enc_u)
                            ku += 1
                        fg = widen(gv[j])
                        rv[j] = narrow(fmul(fg, widen(rj)))
                        if is_pos(rj):
                            uv[j] = narrow(fmul(fg, widen(uj)))
                        else:
                            uv[j] = 0
                    store_group(ou, ou64, ouse64 and full, numel, g, rv)
                    store_group(og, og64, ouse64 and full, numel, g, uv)

        @cuda.jit
        def k_relu_backward(mask, numel, ge, g64, guse64, oe, o64, ouse64):
            """grad where the mask bit is set, else +0: one group per thread."""
            v = cuda.local.array(8, int64)
            ngroups = (numel + 7) >> 3
            g = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
            step = int64(cuda.gridDim.x) * cuda.blockDim.x
            while g < ngroups:
                full = g * 8 + 8 <= numel
                load_group(ge, g64, guse64 and full, numel, g, v)
                byte = int32(mask[g])
                for j in range(8):
                    if ((byte >> j) & 1) == 0:
                        v[j] = 0
                store_group(oe, o64, ouse64 and full, numel, g, v)
                g += step

        self.pack = {(m, e): make_pack(m, e) for m in (MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED)
                     for e in (RAW, NOSIGN, SIGNPLANE)}
        self.finish = k_finish
        self.unpack = {(op, e): make_unpack(op, e) for op in (0, 1) for e in (RAW, NOSIGN, SIGNPLANE)}
        self.gated = k_gated
        self.relu_backward = k_relu_backward


@functools.lru_cache(maxsize=None)
def kernels_for(name: str) -> DtypeKernels:
    return DtypeKernels(name)
