"""The value streams' tile edges. A pack tile writes only the stream words
wholly inside its bit range (``copy_inner``). Its bits of the words it shares
with other tiles (or of the stream's last, partly filled word) reach them one of
two ways:

* a large pack records each tile's first and last 32 stored bits
  (``stream_edges``); ``k_finish`` then writes each shared word from those edge
  records (as the CuPy pack kernel's ``bs_stitch_word``) and, at a fixed
  capacity, zeroes what lies past the stored values. No word is written twice
  and no atomics touch the output.
* a small pack (the backend's fill limit) has its values and signs zeroed
  before the pack, and each tile ORs its bits of its shared words into place
  (``or_edges``): no second kernel, whose launch would cost the host more than
  the fill costs the GPU.

Either way padding bits come out zero.
"""

from __future__ import annotations

from numba import cuda, int64, uint32, uint64

from .common import FULL_MASK, NT, RAW, SIGNPLANE, _u


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
def or_edges(out, tw, a, e, width):
    """OR the bits of a tile's stream (tw, from bit a*width) that fall in words
    not wholly inside [a*width, e*width) into those words of ``out`` (zeroed
    before the pack): at most two, the one the range starts inside and the one
    it ends inside."""
    b0 = a * width
    b1 = e * width
    if b1 == b0:
        return
    first, last = stream_edges(tw, b1 - b0)
    lo = b0 & 31
    hi = b1 & 31
    f = b0 >> 5
    k = b1 >> 5
    if lo != 0 and f < out.size:
        # its first 32 - lo bits (all it has where it ends in this word too)
        cuda.atomic.or_(out, _u(f), uint32((first << lo) & FULL_MASK))
    if hi != 0 and (k != f or lo == 0) and k < out.size:
        # its last hi bits, the low bits of the word
        cuda.atomic.or_(out, _u(k), uint32(last >> (32 - hi)))


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



def make_finish(W):
    """k_finish for value streams of code width W."""
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

    return k_finish
