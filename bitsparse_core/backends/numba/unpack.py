"""The kernels that expand packed tiles (``DtypeKernels.unpack``): op 0 the stored
patterns (unpack), op 1 relu2_backward (2*r*grad where r > 0, else +0), op 2 the
gated backward with u packed under r's mask, op 3 the same with u dense; one kernel
per op and encoding(s). The fused ops' arithmetic is in :mod:`.fused_rows`.

In the CuPy backend's per-word form: the tile's value range [P, Pe) comes from
the tile-offset array at both ends, so its stored values are decoded before the
ranks are known, 32 / BITS per 32-bit word of shared memory (a stream word pair
shifted and spread into lanes: no per-value work). Each thread then builds UR
rows of UV elements (16 bytes; 32 for float32), warp-major as in the CuPy
kernel: warp w owns UR * 32 rows of the tile, its round r covers 32 consecutive
rows, one per lane. Each output word is the next stored values' bytes (a funnel
shift of two shared words) dropped into the slots its mask bits select (one
PRMT); in a round where no row of the warp holds more than a few values
(``WINDOW_MAX``), they are read once per row as one 64-bit window, and where none holds
more than one, that one value is placed by a compare per word.

Unpack tiles have their own size: UR rows of 16 bytes (fp32: 32) per thread, so
an unpack tile is UR * UNT * 16 bytes of output whatever the dtype (op 0:
UNPACK_ROWS = 4 rows, i.e. 16384 fp8 / 8192 bf16 / 8192 fp32 elements on the
GPU, as the CuPy unpack; under the simulator 4096 fp8 / 2048 others, the GPU's
per-thread shapes). The fused ops keep TILE elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, int32, int64, uint32, uint64

from .common import (FULL_MASK, NOSIGN, NW, RAW, SIGNPLANE, SIM, TILE, ULANE_N, UNT, UNW,
                     _load_word, _prefetch_bytes, _prmt, _sm_count, _u, _warp_incl_scan,
                     _warp_last, _warp_max, _warps_before_loop, _warps_before_reduced)
from .fused_rows import (OP_GATED, OP_GATED_DENSE, OP_RELU2, make_fused_row, make_preload_grad,
                         store_words)

UNPACK_ROWS = 4
OPS = (0, OP_RELU2, OP_GATED, OP_GATED_DENSE)
# A warp round whose rows each hold at most this many stored values builds them from one
# 64-bit window of decoded words (_make_window_row): what the window holds past a value
# offset of up to GE - 1 elements in its first word (16-bit 3, fp8 5; fp32: never).
WINDOW_MAX = {bits: (64 - (32 - bits)) // bits for bits in (8, 16)}
# Unpack: six 256-thread blocks per SM (40 registers); the fused ops' float products
# need more registers (45-62), four blocks.
UNPACK_BLOCKS = {op: 6 if op == 0 else 4 for op in OPS}
assert UNW == NW    # the warps' offsets come from common's helpers, which count NW warps
UNPACK_JIT = {op: {} if SIM else {"launch_bounds": (UNT, UNPACK_BLOCKS[op])} for op in OPS}
# The L2 prefetch's distance: a quarter of a wave of resident blocks ahead (the CuPy
# kernels' measured choice, bench/NOTES.md session 39).
PREFETCH_AHEAD_DIV = 4


@dataclass(frozen=True)
class UnpackGeom:
    """The unpack rows' shape and PRMT selectors of one element type."""

    UV: int            # elements per row
    UMB: int           # mask bytes per row
    URS: int           # elements per warp round
    OW: int            # output words per row
    UR_OP: dict        # rows per thread, per op
    utile_log2: dict   # tile size (log2), per op
    SEL: Any           # PRMT selector per mask bits of an output word
    SEL16: int         # bf16 / fp16: the four selectors in one constant
    SMAX: int          # values per row a window holds (WINDOW_MAX; -1: always expand, no vote)


def unpack_geometry(el) -> UnpackGeom:
    BITS, GE = el.BITS, el.GE
    UV = 8 if BITS == 32 else 128 // BITS
    UMB = UV // 8                    # mask bytes per row
    URS = 32 * UV                    # elements per warp round
    OW = UV * BITS // 32             # output words per row
    # Rows per thread and tile size (log2) per op: plain unpack UNPACK_ROWS rows,
    # the fused ops TILE elements.
    UR_OP = {op: UNPACK_ROWS if op == 0 else max(1, TILE // (UV * UNT)) for op in OPS}
    utile_log2 = {op: int(UR_OP[op] * UV * UNT).bit_length() - 1 for op in OPS}
    for op in OPS:
        assert (1 << utile_log2[op]) == UR_OP[op] * UV * UNT >= TILE
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
    # bf16 / fp16: the four 16-bit selectors in one constant, picked by a shift.
    # fp8: a 16-entry table in shared memory (sel, filled per block). Indexing a
    # constant-memory table by a per-lane mb instead serialises the warp over
    # its distinct addresses (bench/NOTES_numba.md, session 5).
    SEL16 = sum(int(SEL[mb]) << (16 * mb) for mb in range(4)) if BITS == 16 else 0
    return UnpackGeom(UV=UV, UMB=UMB, URS=URS, OW=OW, UR_OP=UR_OP, utile_log2=utile_log2,
                      SEL=SEL, SEL16=SEL16, SMAX=WINDOW_MAX.get(BITS, -1))


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


def make_word_expand(el, ug):
    """(spread_signs, select, expand_word) of element type ``el``."""
    BITS, SEL16 = el.BITS, ug.SEL16

    @cuda.jit(device=True)
    def spread_signs(s):
        """Sign bits 0 .. GE-1 of s -> the sign bit of each BITS-bit lane."""
        if BITS == 32:
            return (s & 1) << 31
        if BITS == 16:
            return ((s & 1) << 15) | ((s & 2) << 30)
        return (((s & 0xF) * 0x00204081) & 0x01010101) << 7

    @cuda.jit(device=True)
    def select(sel, mb):
        """The PRMT selector of an output word with mask bits mb (8- and 16-bit)."""
        if BITS == 16:
            return uint32((uint64(SEL16) >> uint64(16 * mb)) & 0xFFFF)
        return sel[mb]

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
        return _prmt(src, select(sel, mb))

    return spread_signs, select, expand_word


def _make_spread(el, enc):
    BITS, WD = el.BITS, el.BITS if enc == RAW else el.W

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

    return spread


def _make_row_bits(ug):
    """``row_bits``: a row's mask bits."""
    UMB = ug.UMB

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

    return row_bits


@cuda.jit(device=True)
def fullest_row(b):
    """The stored values of the warp round's fullest row (mask bits b): the vote that
    makes the warp take one path (:func:`_make_single_row`, :func:`_make_window_row`),
    one REDUX. Under the simulator, which has no votes, the row's own: each lane decides
    alone (the words do not depend on the path)."""
    if SIM:
        return uint32(cuda.popc(b))
    return _warp_max(uint32(cuda.popc(b)))


def _make_window_row(el, ug, select):
    """``window_row``: a row's output words when no row of its warp round holds more
    than ``ug.SMAX`` stored values. A few values all lie in one 64-bit window of the
    decoded words, loaded once per row; each output word is that window shifted past
    the row's values before the word, through the word's PRMT selector (no shared-memory
    load per word, as :func:`make_word_expand`'s ``expand_word`` needs)."""
    BITS, GE, SMAX, OW = el.BITS, el.GE, ug.SMAX, ug.OW
    GE_LOG2 = GE.bit_length() - 1
    GMASK = (1 << GE) - 1

    @cuda.jit(device=True)
    def window_row(vals, sel, j, b, o):
        """o[0..OW) = the row with mask bits b (at most SMAX set), whose first set
        element takes stored value j of the tile."""
        k = uint32(j) >> uint32(GE_LOG2)
        window = (((uint64(vals[_u(k + uint32(1))]) << uint64(32)) | uint64(vals[_u(k)]))
                  >> uint64((uint32(j) & uint32(GE - 1)) * uint32(BITS)))
        for m in range(OW):
            mb = uint32((b >> uint32(m * GE)) & uint32(GMASK))
            before = uint32(cuda.popc(uint32(b & uint32((1 << (m * GE)) - 1))))
            src = uint32((window >> uint64(before * uint32(BITS))) & uint64(FULL_MASK))
            o[m] = _prmt(src, select(sel, mb))

    return window_row


def _make_single_row(el, ug):
    """``single_row``: a row's output words when no row of its warp round holds more
    than one stored value: zeros but for the one element, placed with a compare per
    word, no window shifts and no selectors (most rounds at 99 % zeros)."""
    BITS, GE, OW, EMASK = el.BITS, el.GE, ug.OW, el.EMASK
    GE_LOG2 = GE.bit_length() - 1

    @cuda.jit(device=True)
    def single_row(vals, j, b, o):
        """o[0..OW) = the row with mask bits b (at most one set), whose set element
        takes stored value j of the tile (b = 0: zeros; the value read is then junk
        that no word takes)."""
        i = int32(31 - cuda.clz(uint32(b)))            # the set element, -1 for none
        jw = uint32(j)
        v = uint32((vals[_u(jw >> uint32(GE_LOG2))] >> ((jw & uint32(GE - 1)) * uint32(BITS)))
                   & uint32(EMASK))
        placed = uint32(v << uint32((i & (GE - 1)) * BITS))
        word = i >> GE_LOG2
        for m in range(OW):
            o[m] = placed if word == m else uint32(0)

    return single_row


def _make_emit_row(el, ug, op, select, expand_word):
    """``emit_row``: a row expanded and stored (op 0), or the fused op's results."""
    BITS, GE, EMASK = el.BITS, el.GE, el.EMASK
    UV, UMB, OW = ug.UV, ug.UMB, ug.OW
    store_group = el.store_group
    fused_row = make_fused_row(el, ug, op) if op else None
    SMAX = ug.SMAX
    window_row = _make_window_row(el, ug, select)
    single_row = _make_single_row(el, ug)

    @cuda.jit(device=True)
    def emit_row(vals, vals2, sel, o, w2, gw, uw, v, gv, uv, b, j, e0, tfull, numel,
                 ge, g64, ue, u64, fast, oe, o64, o2e, o2_64, o16, g_loaded):
        """Expand the row at element e0 with mask bits b, whose first set element takes
        stored value j of the tile (``vals``; the gated op's u: the same of ``vals2``),
        and store it (op 0) or the fused op's results. ``fast``: every operand and result
        8-byte aligned (a whole row then moves as words), ``o16``: the results 16-byte
        aligned (16-byte stores), ``g_loaded``: gw holds the row's grad already."""
        few = one = False
        if SMAX >= 0:                # 8- and 16-bit rows (fp32 always expands)
            most = fullest_row(b)    # every lane votes, those past the end too
            few = most <= SMAX
            one = most <= 1
        if tfull or e0 < numel:
            if one:
                single_row(vals, j, b, o)
                if op == OP_GATED:
                    single_row(vals2, j, b, w2)
            elif few:
                window_row(vals, sel, j, b, o)
                if op == OP_GATED:
                    window_row(vals2, sel, j, b, w2)
            else:
                for m in range(OW):
                    mb = uint32((b >> uint32(m * GE)) & uint32((1 << GE) - 1))
                    o[m] = expand_word(vals, sel, j, mb)
                    if op == OP_GATED:
                        w2[m] = expand_word(vals2, sel, j, mb)
                    j = int32(j + cuda.popc(mb))
            full = tfull or e0 + UV <= numel
            if op != 0:
                fused_row(o, w2, gw, uw, v, gv, uv, e0, full, numel, ge, g64, ue, u64, fast,
                          oe, o64, o2e, o2_64, o16, g_loaded)
            elif full and fast:
                store_words(o64, e0, BITS, OW, o, o16)
            else:
                for h in range(UMB):
                    g = (e0 >> 3) + h
                    for i in range(8):
                        e = 8 * h + i
                        v[i] = int64(o[e // GE] >> ((e % GE) * BITS)) & EMASK
                    store_group(oe, o64, fast and g * 8 + 8 <= numel, numel, g, v)

    return emit_row


def make_decode(el, enc, spread_signs):
    """``decode``: a tile's stored values [off, off + n) of encoding ``enc`` into
    ``vals``, GE per shared word (word q holds values GE q .. GE q + GE - 1)."""
    BITS, W, GE = el.BITS, el.W, el.GE
    spread = _make_spread(el, enc)
    WD = BITS if enc == RAW else W
    WG = GE * WD                 # stream bits per decoded word
    GE_LOG2 = GE.bit_length() - 1

    @cuda.jit(device=True)
    def decode(vals, t, off, n, vb, vw, nvb, sb, sw, nsb):
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

    return decode


def make_tile(el, ug, op, enc, prefetch, warp_redux):
    """(tile_head, rows_starts): where a thread's rows are, the tile's stored-value
    range and the rows' mask bits; then each row's first stored value (block-wide: it
    synchronizes, which also publishes the decoded values). ``prefetch``: tile_head
    also asks for a later tile's planes in L2 (:data:`PREFETCH_AHEAD_DIV`); ``warp_redux``:
    the warps before a thread's are summed by a warp reduction, not a loop."""
    warps_before = _warps_before_reduced if warp_redux else _warps_before_loop
    WD = el.BITS if enc == RAW else el.W     # stream bits per stored value
    BLOCKS = UNPACK_BLOCKS[op]
    UR = ug.UR_OP[op]            # rows per thread
    UTL = ug.utile_log2[op]
    UT = 1 << UTL
    URS = ug.URS
    SEG = UR * URS               # elements per warp
    UV = ug.UV
    assert UR in (1, 2, 4)
    row_bits = _make_row_bits(ug)

    @cuda.jit(device=True)
    def tile_values(toff, toff_shift, tile):
        """(off, n): the tile's stored values are [off, off + n). toff has one entry
        past the last tile or chunk."""
        off = int64(toff[_u((tile << UTL) >> toff_shift)])
        ie = ((tile + 1) << UTL) >> toff_shift
        if ie > toff.size - 1:
            ie = toff.size - 1
        return off, int64(toff[_u(ie)]) - off

    @cuda.jit(device=True)
    def rows_bits(mask, row0, tfull, ngroups):
        """Mask bits of the thread's rows (round r: element row0 + r URS). A whole tile
        loads them without a test between (all loads in flight)."""
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
        return b0, b1, b2, b3

    @cuda.jit(device=True)
    def rows_starts(b0, b1, b2, b3, lane, t, warp, sh_tot, sh_lane):
        """Ranks within the warp (rounds in order), then the warps before this one."""
        st0, st1, acc = scan_pair(int32(0), b0, b1, UR > 1, UR > 1, lane, t, sh_lane)
        st2 = int32(0)
        st3 = int32(0)
        if UR > 2:
            st2, st3, acc = scan_pair(acc, b2, b3, True, True, lane, t, sh_lane)
        if lane == 31:
            sh_tot[warp] = acc
        cuda.syncthreads()
        before = warps_before(sh_tot, warp, lane, t, sh_lane)
        return (int32(before + st0), int32(before + st1), int32(before + st2),
                int32(before + st3))

    @cuda.jit(device=True)
    def tile_head(mask, numel, toff, toff_shift, vb, sb):
        """(t, lane, warp, tfull, row0, off, n, b0, b1, b2, b3): the thread, whether the
        tile is whole (no per-row bounds), the thread's first row, the tile's stored
        values [off, off + n) and the rows' mask bits (their loads issued first).
        With ``prefetch``, the block's last thread loads the value range of the tile a
        fraction of a wave ahead beside its own, and once the mask loads are issued
        asks for that tile's mask, value (and sign) bytes in L2."""
        t = cuda.threadIdx.x
        tile = int64(cuda.blockIdx.x)
        base = tile << UTL
        tfull = base + UT <= numel
        row0 = base + ((t >> 5) * SEG + (t & 31) * UV)
        off, n = tile_values(toff, toff_shift, tile)
        ahead = int64(-1)
        q0 = int64(0)
        qn = int64(0)
        if prefetch and t == UNT - 1:
            a = tile + (int64(_sm_count()) * BLOCKS + PREFETCH_AHEAD_DIV - 1) // PREFETCH_AHEAD_DIV
            if a < cuda.gridDim.x:
                q0, qn = tile_values(toff, toff_shift, a)
                ahead = a
        b0, b1, b2, b3 = rows_bits(mask, row0, tfull, (numel + 7) >> 3)
        if prefetch and ahead >= 0:     # waiting for q0, qn here is waiting for off, n
            ab = ahead << UTL
            _prefetch_bytes(mask, ab >> 3, (ab + UT) >> 3)
            _prefetch_bytes(vb, (q0 * WD) >> 3, (((q0 + qn) * WD) >> 3) + 8)
            if enc == SIGNPLANE:
                _prefetch_bytes(sb, q0 >> 3, ((q0 + qn) >> 3) + 8)
        return t, t & 31, t >> 5, tfull, row0, off, n, b0, b1, b2, b3

    return tile_head, rows_starts


def _shapes(el, ug, op):
    """(rows per thread, decoded words per tile (+ guards for the pair reads), fp8's
    selector table size)."""
    UT = 1 << ug.utile_log2[op]
    return ug.UR_OP[op], UT * el.BITS // 32 + 4, 16 if el.BITS == 8 else 1


def make_unpack(el, ug, op, enc, spread_signs, select, expand_word, prefetch, warp_redux):
    """The unpack kernel of op 0 (unpack) or 1 (relu2_backward) and an encoding."""
    BITS, OW, SEL = el.BITS, ug.OW, ug.SEL
    UR, VALS_W, SEL_N = _shapes(el, ug, op)
    URS = ug.URS
    decode = make_decode(el, enc, spread_signs)
    tile_head, rows_starts = make_tile(el, ug, op, enc, prefetch, warp_redux)
    emit_row = _make_emit_row(el, ug, op, select, expand_word)
    preload_grad = make_preload_grad(el, ug)

    @cuda.jit(**UNPACK_JIT[op])
    def k_unpack(mask, numel, toff, toff_shift, vb, vw, nvb, sb, sw, nsb,
                 ge, g64, fast, oe, o64, o16):
        """Dense output of one tile of UT elements. op 0: the stored patterns
        (unpack); op 1: relu2_backward, 2*r*grad where r > 0, else +0. The
        tile's stored values are toff[(i << UTL) >> toff_shift] up to the
        same at tile i + 1; vb/vw: the values plane as bytes and as its whole
        32-bit words (empty when unaligned), nvb its length (likewise the signs).
        ``fast``: grad (op 1) and the output 8-byte aligned (g64, o64 view
        them), ``o16``: the output 16-byte aligned. The UR <= 4 rows are
        written out (scalars, not a loop over a local array: the compiler does
        not always unroll it, and the array then lives in local memory)."""
        t, lane, warp, tfull, row0, off, n, b0, b1, b2, b3 = tile_head(mask, numel, toff,
                                                                       toff_shift, vb, sb)
        vals = cuda.shared.array(VALS_W, uint32)
        sh_tot = cuda.shared.array(UNW, int32)
        sh_lane = cuda.shared.array(ULANE_N, int32)
        sel = cuda.shared.array(SEL_N, uint32)
        if BITS == 8 and t < SEL_N:
            sel[t] = cuda.const.array_like(SEL)[t]   # read after the rank barrier
        o = cuda.local.array(OW, uint32)
        gw = cuda.local.array(OW, uint32)            # relu2: the rows' grad, then results
        gw1 = cuda.local.array(OW, uint32)
        v = cuda.local.array(8, int64)
        gv = cuda.local.array(8, int64)
        g_loaded = False
        if op != 0:
            g_loaded = preload_grad(g64, row0, row0 + URS, UR, fast, tfull, gw, gw1)
        decode(vals, t, off, n, vb, vw, nvb, sb, sw, nsb)
        j0, j1, j2, j3 = rows_starts(b0, b1, b2, b3, lane, t, warp, sh_tot, sh_lane)
        emit_row(vals, vals, sel, o, o, gw, gw, v, gv, gv, b0, j0, row0, tfull, numel,
                 ge, g64, ge, g64, fast, oe, o64, oe, o64, o16, g_loaded)
        if UR > 1:
            emit_row(vals, vals, sel, o, o, gw1, gw1, v, gv, gv, b1, j1, row0 + URS, tfull,
                     numel, ge, g64, ge, g64, fast, oe, o64, oe, o64, o16, g_loaded)
        if UR > 2:
            emit_row(vals, vals, sel, o, o, gw, gw, v, gv, gv, b2, j2, row0 + 2 * URS,
                     tfull, numel, ge, g64, ge, g64, fast, oe, o64, oe, o64, o16, False)
            emit_row(vals, vals, sel, o, o, gw, gw, v, gv, gv, b3, j3, row0 + 3 * URS,
                     tfull, numel, ge, g64, ge, g64, fast, oe, o64, oe, o64, o16, False)
    return k_unpack


def make_gated(el, ug, op, enc, uenc, spread_signs, select, expand_word, prefetch,
               warp_redux):
    """The gated backward kernel: op 2 with u packed under r's mask (encoding ``uenc``),
    op 3 with u dense."""
    BITS, OW, SEL = el.BITS, ug.OW, ug.SEL
    UR, VALS_W, SEL_N = _shapes(el, ug, op)
    URS = ug.URS
    VALS2_W = VALS_W if op == OP_GATED else 1
    decode = make_decode(el, enc, spread_signs)
    decode_u = make_decode(el, uenc, spread_signs)
    tile_head, rows_starts = make_tile(el, ug, op, enc, prefetch, warp_redux)
    emit_row = _make_emit_row(el, ug, op, select, expand_word)
    preload_grad = make_preload_grad(el, ug)
    assert UR <= 2

    @cuda.jit(**UNPACK_JIT[op])
    def k_gated(mask, numel, toff, toff_shift, vb, vw, nvb, sb, sw, nsb,
                uvb, uvw, nuvb, usb, usw, nusb, ue, u64, ge, g64, fast, og, og64, ou, ou64, o16):
        """gated_backward of one tile of UT elements: og = grad u where r > 0, else +0
        (grad_g), ou = grad r (grad_u). r's planes as k_unpack's; op 2: u's values and
        signs likewise (uvb .. nusb), under r's mask and offsets; op 3: u dense (ue,
        u64). ``fast``: grad, u and both outputs 8-byte aligned; ``o16``: both
        outputs 16-byte aligned."""
        t, lane, warp, tfull, row0, off, n, b0, b1, b2, b3 = tile_head(mask, numel, toff,
                                                                       toff_shift, vb, sb)
        vals = cuda.shared.array(VALS_W, uint32)
        vals2 = cuda.shared.array(VALS2_W, uint32)   # op 2: u's values
        sh_tot = cuda.shared.array(UNW, int32)
        sh_lane = cuda.shared.array(ULANE_N, int32)
        sel = cuda.shared.array(SEL_N, uint32)
        if BITS == 8 and t < SEL_N:
            sel[t] = cuda.const.array_like(SEL)[t]   # read after the rank barrier
        o = cuda.local.array(OW, uint32)
        w2 = cuda.local.array(OW, uint32)
        gw = cuda.local.array(OW, uint32)            # the rows' grad, then grad_g
        gw1 = cuda.local.array(OW, uint32)
        uw = cuda.local.array(OW, uint32)            # op 3: u; then grad_u
        v = cuda.local.array(8, int64)
        gv = cuda.local.array(8, int64)
        uv = cuda.local.array(8, int64)
        g_loaded = preload_grad(g64, row0, row0 + URS, UR, fast, tfull, gw, gw1)
        decode(vals, t, off, n, vb, vw, nvb, sb, sw, nsb)
        if op == OP_GATED:
            decode_u(vals2, t, off, n, uvb, uvw, nuvb, usb, usw, nusb)
        j0, j1, j2, j3 = rows_starts(b0, b1, b2, b3, lane, t, warp, sh_tot, sh_lane)
        emit_row(vals, vals2, sel, o, w2, gw, uw, v, gv, uv, b0, j0, row0, tfull, numel,
                 ge, g64, ue, u64, fast, og, og64, ou, ou64, o16, g_loaded)
        if UR > 1:
            emit_row(vals, vals2, sel, o, w2, gw1, uw, v, gv, uv, b1, j1, row0 + URS, tfull,
                     numel, ge, g64, ue, u64, fast, og, og64, ou, ou64, o16, g_loaded)
    return k_gated


def make_unpack_kernels(el, prefetch=False, warp_redux=False):
    """(utile_log2, kernels): {(op, encoding): k_unpack} for ops 0 and 1,
    {(OP_GATED, encoding, u's encoding): k_gated} and {(OP_GATED_DENSE, encoding): k_gated}.
    ``prefetch``: every kernel asks for a later tile's mask, values and signs in L2 (not
    the gated op's u, nor the fused ops' dense inputs); sm_90 and later. ``warp_redux``:
    the warps' offsets by a warp reduction (:func:`make_tile`)."""
    ug = unpack_geometry(el)
    knobs = (*make_word_expand(el, ug), prefetch, warp_redux)
    encs = (RAW, NOSIGN, SIGNPLANE)
    kernels = {(op, enc): make_unpack(el, ug, op, enc, *knobs)
               for op in (0, OP_RELU2) for enc in encs}
    for enc in encs:
        kernels[OP_GATED_DENSE, enc] = make_gated(el, ug, OP_GATED_DENSE, enc, RAW, *knobs)
        for uenc in encs:
            kernels[OP_GATED, enc, uenc] = make_gated(el, ug, OP_GATED, enc, uenc, *knobs)
    return ug.utile_log2, kernels
