"""Float conversions and float32 products done on integer bit patterns.

Numba has no bfloat16 / float8 types, so the GPU kernels of the fused ops work on
the unsigned-integer patterns and need (a) exact widening of a dtype's pattern to
float32 bits, (b) float32 -> dtype rounding (round-to-nearest-even) that matches
ml_dtypes / NumPy ``astype`` bit for bit, NaN and overflow rules included, and
(c) the float32 product the reference forms with NumPy on x86: NaN operands give
the first NaN operand, quieted; an invalid product (0 * inf) gives x86's default
NaN 0xFFC00000 (a GPU would give 0x7FFFFFFF).

Every function here is plain Python on ints, so the same source is compiled by
``numba.njit`` (exhaustively tested against ml_dtypes on the CPU) and by
``numba.cuda.jit(device=True)`` (the kernels). :func:`make` builds one dtype's
functions with its format constants frozen in, so the compiled code has no
run-time dtype branches. Arithmetic stays in int64 on values < 2**32.
"""

from __future__ import annotations

from collections import namedtuple

# name -> (bits, exponent bits, mantissa bits, style). style: "ieee" has inf and
# NaN at exponent all-ones; "fn" (e4m3fn) has no inf and one NaN per sign.
FORMATS = {
    "bfloat16": (16, 8, 7, "ieee"),
    "float16": (16, 5, 10, "ieee"),
    "float32": (32, 8, 23, "ieee"),
    "float8_e4m3fn": (8, 4, 3, "fn"),
    "float8_e5m2": (8, 5, 2, "ieee"),
}

Funcs = namedtuple("Funcs", "widen narrow is_nan is_pos fmul")

F32_QUIET = 0x00400000
F32_INF = 0x7F800000
X86_DEFAULT_NAN = 0xFFC00000


def make(name: str, jit=None, bitcast_f32=None, bitcast_u32=None) -> Funcs:
    """The functions of dtype ``name``, each wrapped by ``jit`` (``numba.njit``,
    ``cuda.jit(device=True)``; None leaves them plain Python).

    ``bitcast_f32(u)`` / ``bitcast_u32(f)`` reinterpret float32 bits; only ``fmul``
    needs them (the product itself runs on the FPU, IEEE round-to-nearest-even with
    subnormals kept), so they may be None when ``fmul`` is not compiled.
    """
    bits, E, M, style = FORMATS[name]
    SIGN = 1 << (bits - 1)
    EXP_ALL = (1 << E) - 1
    BIAS = (1 << (E - 1)) - 1
    MMASK = (1 << M) - 1
    INF = EXP_ALL << M                       # pattern of +inf (ieee styles)
    FN_NAN = (EXP_ALL << M) | MMASK          # e4m3fn's NaN (0x7f)
    SHIFT = 23 - M
    QNAN_SMALL = (EXP_ALL << M) | (1 << (M - 1))  # ml_dtypes' canonical quiet NaN
    REBIAS = 127 - BIAS
    IS_F32 = bits == 32
    IS_BF16 = name == "bfloat16"
    IS_F16 = name == "float16"
    IS_FN = style == "fn"

    def is_nan(x):
        m = x & (SIGN - 1)
        if IS_FN:
            return m == FN_NAN
        return m > INF

    def is_pos(x):
        # x > 0 as a float: sign clear, not zero, not NaN.
        return x < SIGN and x != 0 and not is_nan(x)

    def widen(x):
        """Exact float32 bits of pattern ``x`` (NaNs as NumPy / ml_dtypes widen them)."""
        if IS_F32:
            return x
        if IS_BF16:
            return x << 16
        s = (x >> (bits - 1)) << 31
        e = (x >> M) & EXP_ALL
        m = x & MMASK
        if is_nan(x):
            if IS_F16:
                return s | F32_INF | (m << SHIFT)      # NumPy keeps the payload
            return s | F32_INF | F32_QUIET             # ml_dtypes: canonical quiet NaN
        if not IS_FN and e == EXP_ALL:
            return s | F32_INF
        if e == 0:
            if m == 0:
                return s
            p = M - 1                                  # leading one of the subnormal
            while (m >> p) == 0:
                p -= 1
            return s | ((p + 1 - BIAS - M + 127) << 23) | ((m - (1 << p)) << (23 - p))
        return s | ((e + REBIAS) << 23) | (m << SHIFT)

    def narrow(f):
        """Round float32 bits ``f`` to the dtype, nearest-even, as ml_dtypes / NumPy do."""
        if IS_F32:
            return f
        s = (f >> 31) << (bits - 1)
        a = f & 0x7FFFFFFF
        if a > F32_INF:                                # NaN
            if IS_F16:
                sig = (a & 0x7FFFFF) >> SHIFT
                if sig == 0:
                    sig = 1
                return s | INF | sig
            if IS_FN:
                return s | FN_NAN
            return s | QNAN_SMALL
        if IS_BF16:
            # Same exponent range as float32: nearest-even is a carry into the kept
            # half, which also rounds overflow to inf and keeps subnormals.
            return (f + 0x7FFF + ((f >> 16) & 1)) >> 16
        if a == F32_INF:
            if IS_FN:
                return s | FN_NAN
            return s | INF
        e = a >> 23
        sig = a & 0x7FFFFF
        if e == 0:
            e = 1
        else:
            sig |= 0x800000
        et = e - REBIAS                                # target biased exponent if normal
        shift = SHIFT
        if et < 1:
            shift += 1 - et                            # subnormal in the target
            et = 1
        if shift > 40:
            shift = 40
        q = sig >> shift
        rem = sig - (q << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        # q holds the implicit bit; carries ripple into the exponent field.
        r = ((et - 1) << M) + q
        if IS_FN:
            if r > FN_NAN - 1:
                return s | FN_NAN
        elif r >= INF:
            return s | INF
        return s | r

    def fmul(fa, fb):
        """float32 bits of fa * fb with x86 SSE NaN rules (the reference runs NumPy there)."""
        if (fa & 0x7FFFFFFF) > F32_INF:
            return fa | F32_QUIET
        if (fb & 0x7FFFFFFF) > F32_INF:
            return fb | F32_QUIET
        p = bitcast_u32(bitcast_f32(fa) * bitcast_f32(fb))
        if (p & 0x7FFFFFFF) > F32_INF:
            return X86_DEFAULT_NAN
        return p

    if jit is not None:
        # Rebinding the names updates the closure cells, so each compiled function
        # calls the compiled versions of the others.
        is_nan = jit(is_nan)
        is_pos = jit(is_pos)
        widen = jit(widen)
        narrow = jit(narrow)
        fmul = jit(fmul)
    return Funcs(widen, narrow, is_nan, is_pos, fmul)
