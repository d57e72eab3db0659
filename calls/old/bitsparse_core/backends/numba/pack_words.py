"""The pack's word-at-a-time element tricks: relu and nonzero flags of the
32 / BITS elements of a 32-bit word at once, and a run of 32 staged values cut
into its W stream words with constant shifts."""

from __future__ import annotations

from numba import cuda, int32, uint32

from ... import bitfloat
from .common import FULL_MASK, _mul32, _prmt2, _u


def make_word_ops(e):
    """(relu_word, pair_nonzero, square) of element type ``e``."""
    name, BITS, EMASK, SIGN, GE = e.name, e.BITS, e.EMASK, e.SIGN, e.GE
    widen, narrow, fmul = e.widen, e.narrow, e.fmul

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
    def square(r):
        f = widen(r)
        return narrow(fmul(f, f))

    return relu_word, pair_nonzero, square


def make_pack_run(e):
    """pack_run of element type ``e``."""
    BITS, W, WMASK, GE = e.BITS, e.W, e.WMASK, e.GE

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

    return pack_run
