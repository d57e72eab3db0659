"""The fused backward ops that read a mask or two packed tensors per tile:
``relu_backward`` (grad where the mask bit is set) and ``gated`` (the gated
backward op), both in ``TILE``-element tiles.

The gated op decodes a tile's two packed tensors this way: each slice of a value
stream (and of a sign plane) is first copied into shared memory with
independent, coalesced loads (a fixed number per thread, so they are all in
flight at once); values are then cut out of the shared words (``value_at``).
Raw values are a stream of width BITS.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32

from .common import (G, GPT, LANE_N, NT, NW, RAW, SIGNPLANE, TILE, TILE_LOG2, _load_word,
                     _tile_mask_bytes, _tile_ranks)


@cuda.jit(device=True)
def stage_words(dst, t, bit0, bit1, b8, w32, nbytes, per):
    """dst[q] = stream word (bit0 >> 5) + q for the words holding [bit0, bit1)."""
    k0 = bit0 >> 5
    k1 = (bit1 + 31) >> 5
    for q in range(per):
        k = k0 + q * NT + t
        if k < k1:
            dst[q * NT + t] = _load_word(b8, w32, nbytes, k)


def make_staging(el):
    """(VWN, SWN, stage, value_at): a tile's staged stream words (shared-array
    sizes and the copy) and the stored patterns cut out of them."""
    BITS, W, EMASK, WMASK = el.BITS, el.W, el.EMASK, el.WMASK
    VWPT = (TILE * BITS // 32 + 2 + NT - 1) // NT   # value-stream words per thread
    SWPT = (TILE // 32 + 2 + NT - 1) // NT          # sign words per thread
    VWN = VWPT * NT
    SWN = SWPT * NT

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

    return VWN, SWN, stage, value_at


def make_gated(el):
    """k_gated of element type ``el``."""
    VWN, SWN, stage, value_at = make_staging(el)
    widen, narrow, is_pos, fmul = el.widen, el.narrow, el.is_pos, el.fmul
    load_group, store_group = el.load_group, el.store_group

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

    return k_gated


def make_relu_backward(el):
    """k_relu_backward of element type ``el``."""
    load_group, store_group = el.load_group, el.store_group

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

    return k_relu_backward
