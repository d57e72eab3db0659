"""The fused backward ops' arithmetic on an unpacked row (``UV`` elements in ``OW``
32-bit words, :mod:`.unpack`): relu2_backward's ``g (2 r)`` where ``r > 0``, and the
gated op's ``g u`` where ``r > 0`` (grad_g) and ``g r`` (grad_u).

A row is computed a 32-bit word at a time in float32: each lane is widened to
float32 bits (bf16: a shift; fp16: the conversion instruction), multiplied on the
FPU and rounded back (bf16: one carry; fp16: the conversion instruction), and the
row is stored whole. Where a product is NaN the lanes' payloads follow x86's rules
in the reference (first NaN operand quieted, 0 * inf the default NaN), which the FPU
does not give, so that row is computed again element by element through
:mod:`bitsparse_core.bitfloat`; so is every fp8 row (no float8 arithmetic to gain
from), a row past the end of the tensor and every row of an operand that is not
8-byte aligned. The CUDA C++ kernel splits its work the same way (``bs_fused_vec``).
"""

from __future__ import annotations

from numba import cuda, int64, uint32, uint64

from .common import _as_f32, _as_u32, _f16_round, _f16_widen, _store16, _u

TWO = 0x40000000                 # float32 bits of 2.0
F32_INF = 0x7F800000
OP_RELU2, OP_GATED, OP_GATED_DENSE = 1, 2, 3


@cuda.jit(device=True)
def _nan32(p):
    return (p & 0x7FFFFFFF) > F32_INF


@cuda.jit(device=True)
def _pos32(r):
    """float32 bits r > 0 (sign clear, not zero, not NaN)."""
    return r != 0 and r <= F32_INF


@cuda.jit(device=True)
def _mul32(a, b):
    return _as_u32(_as_f32(a) * _as_f32(b))


@cuda.jit(device=True)
def _relu2_lane(g, r):
    if _pos32(r):
        return _mul32(g, _mul32(r, TWO))
    return int64(0)


@cuda.jit(device=True)
def _masked_lane(g, u, r):
    if _pos32(r):
        return _mul32(g, u)
    return int64(0)


@cuda.jit(device=True)
def load_words(w64, e0, BITS, n, words):
    """words[0..n) = the n 32-bit words of the row at element e0 (8-byte aligned)."""
    k = e0 * BITS // 64
    for p in range(n // 2):
        pair = uint64(w64[_u(k + p)])
        words[2 * p] = uint32(pair & 0xFFFFFFFF)
        words[2 * p + 1] = uint32(pair >> uint64(32))


@cuda.jit(device=True)
def store_words(o64, e0, BITS, n, words, o16):
    """The row at element e0 = words[0..n) (8-byte aligned; 16-byte stores with ``o16``)."""
    k = e0 * BITS // 64
    if o16:
        for p in range(n // 4):
            lo = uint64(words[4 * p]) | (uint64(words[4 * p + 1]) << uint64(32))
            hi = uint64(words[4 * p + 2]) | (uint64(words[4 * p + 3]) << uint64(32))
            _store16(o64, _u(k + 2 * p), lo, hi)
    else:
        for p in range(n // 2):
            o64[_u(k + p)] = uint64(words[2 * p]) | (uint64(words[2 * p + 1]) << uint64(32))


def make_word_ops(el):
    """(relu2_word, gated_word): one 32-bit word's results and whether a lane is NaN."""
    BITS, GE, LMASK = el.BITS, el.GE, (1 << el.BITS) - 1
    widen, narrow = el.widen, el.narrow
    IS_BF16, IS_F16 = el.name == "bfloat16", el.name == "float16"

    @cuda.jit(device=True)
    def wide(x):
        if IS_BF16:
            return x << 16
        if IS_F16:
            return _f16_widen(x)
        return widen(x)

    @cuda.jit(device=True)
    def round_to(p):
        """float32 bits p (not NaN) rounded to the dtype, nearest-even."""
        if IS_BF16:
            return (p + 0x7FFF + ((p >> 16) & 1)) >> 16
        if IS_F16:
            return _f16_round(p)
        return narrow(p)

    @cuda.jit(device=True)
    def relu2_word(gw, rw):
        g = int64(gw)
        r = int64(rw)
        if GE == 1:
            p = _relu2_lane(g, r)
            return uint32(p), _nan32(p)
        p0 = _relu2_lane(wide(g & LMASK), wide(r & LMASK))
        p1 = _relu2_lane(wide(g >> BITS), wide(r >> BITS))
        return uint32(round_to(p0) | (round_to(p1) << BITS)), _nan32(p0) or _nan32(p1)

    @cuda.jit(device=True)
    def gated_word(gw, rw, uw):
        """(grad_g word, grad_u word, NaN): g u where r > 0, and g r."""
        g = int64(gw)
        r = int64(rw)
        u = int64(uw)
        if GE == 1:
            a = _masked_lane(g, u, r)
            b = _mul32(g, r)
            return uint32(a), uint32(b), _nan32(a) or _nan32(b)
        g0 = wide(g & LMASK)
        g1 = wide(g >> BITS)
        r0 = wide(r & LMASK)
        r1 = wide(r >> BITS)
        a0 = _masked_lane(g0, wide(u & LMASK), r0)
        a1 = _masked_lane(g1, wide(u >> BITS), r1)
        b0 = _mul32(g0, r0)
        b1 = _mul32(g1, r1)
        nan = _nan32(a0) or _nan32(a1) or _nan32(b0) or _nan32(b1)
        return (uint32(round_to(a0) | (round_to(a1) << BITS)),
                uint32(round_to(b0) | (round_to(b1) << BITS)), nan)

    return relu2_word, gated_word


def make_fused_row(el, ug, op):
    """``fused_row``: one row's results of op (OP_RELU2, OP_GATED, OP_GATED_DENSE) from its
    decoded words ``o`` (r) and ``w2`` (u, OP_GATED), stored to ``oe`` / ``o64`` (relu2's
    result; the gated op's grad_g) and ``o2e`` / ``o2_64`` (grad_u)."""
    BITS, GE, EMASK = el.BITS, el.GE, el.EMASK
    UMB, OW = ug.UMB, ug.OW
    widen, narrow, is_pos, fmul = el.widen, el.narrow, el.is_pos, el.fmul
    load_group, store_group = el.load_group, el.store_group
    WORDS = BITS != 8
    relu2_word, gated_word = make_word_ops(el)

    @cuda.jit(device=True)
    def by_words(o, w2, gw, uw, e0, g64, u64, o64, o2_64, o16, g_loaded):
        """The row a word at a time, the results in ``gw`` (relu2's, grad_g) and ``uw``
        (grad_u), ``o`` and ``w2`` kept for the per-element rules; False (nothing
        stored) where a result is NaN. ``g_loaded``: gw holds the row's grad already."""
        if not g_loaded:
            load_words(g64, e0, BITS, OW, gw)
        if op == OP_GATED_DENSE:
            load_words(u64, e0, BITS, OW, uw)
        nan = False
        for m in range(OW):
            if op == OP_RELU2:
                gw[m], bad = relu2_word(gw[m], o[m])
            else:
                u = w2[m] if op == OP_GATED else uw[m]
                gw[m], uw[m], bad = gated_word(gw[m], o[m], u)
            nan = nan or bad
        if nan:
            return False
        store_words(o64, e0, BITS, OW, gw, o16)
        if op != OP_RELU2:
            store_words(o2_64, e0, BITS, OW, uw, o16)
        return True

    @cuda.jit(device=True)
    def by_elements(o, w2, v, gv, uv, e0, numel, ge, g64, ue, u64, fast,
                    oe, o64, o2e, o2_64):
        """The row element by element, by the reference's rules (NaN payloads included)."""
        for h in range(UMB):
            g = (e0 >> 3) + h
            gfast = fast and g * 8 + 8 <= numel
            for i in range(8):
                e = 8 * h + i
                v[i] = int64(o[e // GE] >> ((e % GE) * BITS)) & EMASK
                if op == OP_GATED:
                    uv[i] = int64(w2[e // GE] >> ((e % GE) * BITS)) & EMASK
            load_group(ge, g64, gfast, numel, g, gv)
            if op == OP_GATED_DENSE:
                load_group(ue, u64, gfast, numel, g, uv)
            for i in range(8):
                r = v[i]
                fg = widen(gv[i])
                if op == OP_RELU2:
                    v[i] = narrow(fmul(fg, fmul(widen(r), TWO))) if is_pos(r) else 0
                else:
                    v[i] = narrow(fmul(fg, widen(r)))                    # grad_u
                    uv[i] = narrow(fmul(fg, widen(uv[i]))) if is_pos(r) else 0
            if op == OP_RELU2:
                store_group(oe, o64, gfast, numel, g, v)
            else:
                store_group(oe, o64, gfast, numel, g, uv)
                store_group(o2e, o2_64, gfast, numel, g, v)

    @cuda.jit(device=True)
    def fused_row(o, w2, gw, uw, v, gv, uv, e0, full, numel, ge, g64, ue, u64, fast,
                  oe, o64, o2e, o2_64, o16, g_loaded):
        """``fast``: every operand and result 8-byte aligned (``o16``: results 16-byte);
        ``g_loaded``: gw holds the row's grad (see :func:`preload_grad`)."""
        if WORDS and full and fast:
            if by_words(o, w2, gw, uw, e0, g64, u64, o64, o2_64, o16, g_loaded):
                return
        by_elements(o, w2, v, gv, uv, e0, numel, ge, g64, ue, u64, fast, oe, o64, o2e, o2_64)

    return fused_row


def make_preload_grad(el, ug):
    """``preload_grad``: a whole tile's rows of grad into gw0 / gw1 before the values
    are decoded and ranked, so that their loads are in flight meanwhile (True where it
    loaded; fp8 rows are computed per element and load nothing here)."""
    BITS, OW = el.BITS, ug.OW
    WORDS = BITS != 8

    @cuda.jit(device=True)
    def preload_grad(g64, row0, second, rows, fast, tfull, gw0, gw1):
        if not (WORDS and fast and tfull):
            return False
        load_words(g64, row0, BITS, OW, gw0)
        if rows > 1:
            load_words(g64, second, BITS, OW, gw1)
        return True

    return preload_grad
