"""The one-pass pack kernels (``DtypeKernels.pack``), one per mode and encoding.

Tiles are claimed in order from an atomic ticket. A tile stages its stored
values in order (STAGE_W words of shared memory) and publishes its count, then
turns each run of 32 into W stream words with constant shifts
(:func:`pack_words.make_pack_run`) while warp 0 looks back for the tile's value
offset (:mod:`lookback`), and finally writes the stream words that lie wholly
inside its bit range, each a funnel shift of two tile words (no per-word
gather, no division), and its edge record (:mod:`edges`, ``k_finish``), or, in a
pack whose values were zeroed before it (``or_edges``), its bits of the shared
words themselves.

Pack tiles have their own size (PTILE; unpack keeps TILE): a thread holds PR
groups of 8 elements, 64 bytes (bf16 / fp16: 4 groups, 8192 elements per tile;
fp8: 8 groups, 16384; fp32: 2 groups, 4096), as 64-bit words in registers. Warp
w owns groups w*PSEG .. (w+1)*PSEG - 1 of the tile; round r of lane l is group
w*PSEG + r*32 + l, so every round's loads are coalesced and a warp's groups are
contiguous: a group's rank is the warp's offset plus one packed warp scan of the
PR rounds' counts (8-bit fields: an exclusive prefix of 31 lanes is at most
248). The simulator runs PR = 2 (1024-element tiles of 64 threads, as the
unpack's).

The kernel's phases (loads, classify, chunk offsets, stores) are device
functions with ``inline="always"``: Numba splices them into the kernel's IR,
so the kernel compiles to the SASS it had when they stood in its body (NVVM's
own inlining of a call schedules the PTX differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numba import cuda, int32, int64, uint32, uint64

from ...spec import format as _fmt
from .common import (FULL_MASK, LANE_N, MODE_MASKED, MODE_PACK, MODE_RELU, MODE_RELU2,
                     NOSIGN, NT, NW, RAW, SIGNPLANE, SIM, _u, _warp_excl_scan,
                     _warp_excl_scan64, _warps_loop, _warps_reduced)
from .edges import copy_inner, or_edges, stream_edges
from .lookback import LB_INCL, LB_NEG, lb_load, lookback, publish, tile_slot
from .pack_words import make_pack_run, make_word_ops

MODES = (MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED)
# Pack tiles wait per block (barriers, look-back): cap registers so five 256-thread
# blocks share an SM (48 registers: a thread keeps its 64 bytes of elements in 16
# of them across the rank scan; at six blocks' 40 they spill); the relu modes'
# float squares need more registers, four blocks (as the CuPy pack gives them
# fewer). The simulator takes no such option.
PACK_JIT = {m: {} if SIM else {"launch_bounds": (NT, 4 if m in (MODE_RELU, MODE_RELU2) else 5)}
            for m in MODES}


def pack_rounds_for(bits: int, sim: bool = SIM) -> int:
    """Groups of 8 elements per pack thread: 64 bytes on a GPU (bf16 4, fp8 8,
    fp32 2), 2 under the simulator (its tiles stay at 1024 elements)."""
    return 2 if sim else 64 // bits


@dataclass(frozen=True)
class PackGeom:
    """The pack tile's shape for one element type and round count."""

    PR: int            # groups of 8 elements per thread (rounds)
    PSEG: int          # groups per warp
    PGPT: int          # groups per tile
    PTILE: int
    PTILE_LOG2: int
    PMB: int           # mask bytes, 4 rounds per uint32
    PXW: int           # a thread's elements, in uint64 words
    STAGE_W: int       # staged values' words (+ a partial run's words)
    A_W: int           # the tile's stream, whole runs
    SG_W: int          # its sign bits
    PCNT_N: int        # per warp: lane 31's packed prefix, counts
    PRS_N: int         # lane 0's group ranks (chunk offsets)
    SIGN_ALL: int      # a uint64's sign bits
    pk_excl: Any       # the packed rounds' exclusive warp scan
    PKT: Any           # the packed counts' type


def pack_geometry(el, pack_rounds: int | None = None) -> PackGeom:
    BITS, ITEM, W, PER_WORD = el.BITS, el.ITEM, el.W, el.PER_WORD
    PR = pack_rounds or pack_rounds_for(BITS)
    PSEG = 32 * PR
    PGPT = NW * PSEG
    PTILE = 8 * PGPT
    PTILE_LOG2 = PTILE.bit_length() - 1
    assert PR in (1, 2, 4, 8) and PTILE == 1 << PTILE_LOG2
    # Chunk starts (>= 512 elements = 64 groups) fall on lane 0 of even rounds.
    assert _fmt.MIN_CHUNK_LOG2 >= 9 and PSEG % 64 == 0
    return PackGeom(
        PR=PR, PSEG=PSEG, PGPT=PGPT, PTILE=PTILE, PTILE_LOG2=PTILE_LOG2, PMB=(PR + 3) // 4,
        PXW=PR * ITEM, STAGE_W=PTILE * BITS // 32 + BITS, A_W=(PTILE // 32 + 1) * W + 1,
        SG_W=PTILE // 32 + 2, PCNT_N=2 * NW, PRS_N=NW * PR,
        SIGN_ALL=sum(el.SIGN << (j * BITS) for j in range(PER_WORD)),
        pk_excl=_warp_excl_scan if PR <= 4 else _warp_excl_scan64,
        PKT=int32 if PR <= 4 else int64)


def pack_jit(pack_blocks: int | None = None) -> dict:
    """Each mode's launch options: PACK_JIT, or ``pack_blocks`` blocks per SM
    (the relu modes at most 4)."""
    if pack_blocks and not SIM:
        return {m: {"launch_bounds": (NT, min(4, pack_blocks) if m in (MODE_RELU, MODE_RELU2)
                                      else pack_blocks)} for m in PACK_JIT}
    return PACK_JIT


def make_pack_kernels(el, pack_rounds=None, pack_blocks=None, lb_early=False, ticket=True,
                      warp_redux=False):
    """(geometry, {(mode, encoding, or_edges): k_pack}) of element type ``el``; the
    keywords are DtypeKernels' A/B knobs. ``or_edges``: the tiles OR their bits of
    shared stream words into a zeroed output (no k_finish); raw values share no
    words, so both keys name one kernel."""
    geo = pack_geometry(el, pack_rounds)
    jit = pack_jit(pack_blocks)
    load = _make_load(el, geo)
    words = make_word_ops(el)
    pack_run = make_pack_run(el)
    chunk_offsets = _make_chunk_offsets(geo)
    kernels = {}
    for mode in MODES:
        classify = _make_classify(el, geo, mode, words)
        for enc in (RAW, NOSIGN, SIGNPLANE):
            for ored in (False, True):
                if enc == RAW and ored:
                    kernels[(mode, enc, ored)] = kernels[(mode, enc, False)]
                    continue
                store = _make_store(el.W, enc, ored)
                kernels[(mode, enc, ored)] = make_pack(el, geo, mode, enc, jit[mode], lb_early,
                                                       ticket, warp_redux, load, classify,
                                                       pack_run, chunk_offsets, store)
    return geo, kernels


def _make_load(el, geo):
    BITS, ITEM, PER_WORD = el.BITS, el.ITEM, el.PER_WORD
    PR, PTILE = geo.PR, geo.PTILE

    @cuda.jit(device=True, inline="always")
    def load_elems(xw, xe, x64, use64, numel, tile, g0):
        """xw = the thread's PR groups (round r: group g0 + 32 r), all loads first
        (a branch per round would expose each round's latency): whole uint64 words
        when the tile lies inside an aligned input, else element loads (elements
        past numel read as zero)."""
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

    return load_elems


def _make_classify(el, geo, mode, words):
    BITS, ITEM, EMASK, PER_WORD = el.BITS, el.ITEM, el.EMASK, el.PER_WORD
    PR, PMB, PKT = geo.PR, geo.PMB, geo.PKT
    relu_word, pair_nonzero, square = words

    @cuda.jit(device=True, inline="always")
    def classify(xw, mb, g0, ngroups, numel, msrc, mask, ye, y64, ouse64):
        """Each round's mask byte (into mb, 4 per word, and the mask plane unless
        masked), relu applied to xw (and y written) in the relu modes. Returns
        (OR of the stored patterns, round r's count in bits 8r..)."""
        neg = uint64(0)
        pk = PKT(0)
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
        return neg, pk

    return classify


def _make_chunk_offsets(geo):
    PR, PSEG, PGPT = geo.PR, geo.PSEG, geo.PGPT

    @cuda.jit(device=True, inline="always")
    def chunk_offsets(offsets, sh_rs, P, tile, warp, numel, chunk_log2):
        """Lane 0: the offsets of the chunks starting in the warp's segment (each at
        a round's first element, see PSEG): a loop over them, not over the rounds."""
        s0 = (tile * PGPT + warp * PSEG) * 8
        s1 = s0 + PSEG * 8
        if s1 > numel:
            s1 = numel
        c = (s0 + (int64(1) << chunk_log2) - 1) >> chunk_log2
        while (c << chunk_log2) < s1:
            offsets[_u(c)] = P + sh_rs[_u(warp * PR + (((c << chunk_log2) - s0) >> 8))]
            c += 1

    return chunk_offsets


def _make_store(W, enc, ored):
    SIGNS = enc == SIGNPLANE

    @cuda.jit(device=True, inline="always")
    def store_values(P, n, cap, t, tile, sv, a_s, s_sg, vt, vw, sw, edges):
        """The tile's stored values, clipped to the capacity: raw values one per
        thread, streams as their inner words and the tile's edge record (``ored``:
        its bits of the shared words ORed into place instead)."""
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
            if ored:
                if t == 0:
                    or_edges(vw, a_s, a, e, W)
                    if SIGNS:
                        or_edges(sw, s_sg, a, e, 1)
            elif t == 0:
                ef, el = stream_edges(a_s, (e - a) * W)
                edges[_u(tile * 4)] = ef
                edges[_u(tile * 4 + 1)] = el
                if SIGNS:
                    ef, el = stream_edges(s_sg, e - a)
                    edges[_u(tile * 4 + 2)] = ef
                    edges[_u(tile * 4 + 3)] = el

    return store_values


def make_pack(el, geo, mode, enc, jit, lb_early, ticket, warp_redux, load_elems, classify,
              pack_run, chunk_offsets, store_values):
    """The pack kernel of one mode and encoding (both compile-time constants,
    so the other modes' code and the run-time encoding tests drop out)."""
    # The relu modes keep the loop: with the reductions nvcc gives them 64 registers
    # instead of 56 (bench/NOTES.md, session 41), and the A/B times the plain pack.
    redux = warp_redux and mode in (MODE_PACK, MODE_MASKED)
    warps_before_and_total = _warps_reduced if redux else _warps_loop
    SIGNS = enc == SIGNPLANE
    ENP = el.ENP
    PR, PSEG, PGPT, PXW, PMB = geo.PR, geo.PSEG, geo.PGPT, geo.PXW, geo.PMB
    STAGE_W, A_W, SG_W, PCNT_N, PRS_N = geo.STAGE_W, geo.A_W, geo.SG_W, geo.PCNT_N, geo.PRS_N
    ITEM, PER_WORD, BITS, EMASK = el.ITEM, el.PER_WORD, el.BITS, el.EMASK
    SIGN_ALL, pk_excl = geo.SIGN_ALL, geo.pk_excl

    @cuda.jit(**jit)
    def k_pack(xe, x64, use64, numel, ye, y64, ouse64, msrc, cap, incl_every,
               mask, offsets, chunk_log2, vt, vw, sw, scratch, starts, edges, stat, slot):
        """One-pass pack. mode 0: x's nonzeros; 1: relu(x)'s, writing y = relu(x);
        2: the same with y = relu(x)**2; 3 (masked_pack): x at the set bits of the
        mask plane ``msrc`` (mask and offsets are then shared, not written).
        ``scratch`` (int64, zeroed): ticket, unused, one descriptor per tile and
        one per group of tiles (lookback.scratch_slots);
        ``starts`` (int64): each tile's first value index, then the total;
        ``edges`` (uint32): 4 per tile (k_finish); ``stat`` (int64): status
        word, total count; ``slot`` (int64, 2 or none): the same two words in a
        pinned host slot, written by the last tile as soon as it knows them (the
        host waits there, not for the kernel's end). ``incl_every`` > 1 makes only
        every such tile publish its inclusive count (tests use it to make the
        look-back walk)."""
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
        lbf = cuda.local.array(3, int64)            # warp 0: look-back descriptors
        if ticket:
            if t == 0:
                sh_p[0] = cuda.atomic.add(scratch, 0, int64(1))
            cuda.syncthreads()
            tile = sh_p[0]
        else:
            tile = int64(cuda.blockIdx.x)
        ngroups = (numel + 7) >> 3
        g0 = tile * PGPT + warp * PSEG + lane        # this thread's group of round 0
        load_elems(xw, xe, x64, use64, numel, tile, g0)
        neg, pk = classify(xw, mb, g0, ngroups, numel, msrc, mask, ye, y64, ouse64)
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
        before, n32 = warps_before_and_total(sh_tot, warp, lane, t, sh_lane)
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
                    cuda.atomic.exch(scratch, tile_slot(tile), d)
                starts[tile] = P
                if tile == n_tiles - 1:
                    starts[n_tiles] = P + n
                    stat[0] = pneg
                    stat[1] = P + n
                    if slot.size > 0:
                        slot[1] = P + n
                        slot[0] = pneg
                        cuda.threadfence_system()
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
            chunk_offsets(offsets, sh_rs, P, tile, warp, numel, chunk_log2)
        store_values(P, n, cap, t, tile, sv, a_s, s_sg, vt, vw, sw, edges)
    return k_pack
