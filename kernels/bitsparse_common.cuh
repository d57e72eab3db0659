// Shared device code of the bitsparse kernels: element formats, exact float
// conversions and products, word-at-a-time bit tricks, warp helpers.
//
// Everything here is integer arithmetic on bit patterns except one product,
// done in inline PTX so that CuPy's unconditional -ftz=true cannot flush
// subnormals. Functions marked BS_HD also compile as host C++ (g++), which is
// how tests/test_kernel_math.py checks them against NumPy / ml_dtypes on a
// machine without a GPU.
#pragma once
#include "bitsparse_abi.h"  // ids and block geometry, generated from the Python ABI

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BS_HD __host__ __device__ __forceinline__
#define BS_HD_MEMBER __host__ __device__ __forceinline__
#define BS_D __device__ __forceinline__
#else
#define BS_HD static inline
#define BS_HD_MEMBER inline
#endif

// Format ids (BS_BF16 ...) come from bitsparse_abi.h.

template <int FMT> struct Fmt;
template <> struct Fmt<BS_BF16> { typedef u16 T; enum { BITS = 16, EXP = 8, MAN = 7 }; };
template <> struct Fmt<BS_FP16> { typedef u16 T; enum { BITS = 16, EXP = 5, MAN = 10 }; };
template <> struct Fmt<BS_FP32> { typedef u32 T; enum { BITS = 32, EXP = 8, MAN = 23 }; };
template <> struct Fmt<BS_E4M3> { typedef u8 T; enum { BITS = 8, EXP = 4, MAN = 3 }; };
template <> struct Fmt<BS_E5M2> { typedef u8 T; enum { BITS = 8, EXP = 5, MAN = 2 }; };

template <int FMT> BS_HD bool bs_is_nan(u32 b) {
    if (FMT == BS_E4M3) return (b & 0x7fu) == 0x7fu;  // e4m3fn: only S.1111.111 is NaN
    const u32 mag = b & ((1u << (Fmt<FMT>::BITS - 1)) - 1u);
    const u32 inf = ((1u << Fmt<FMT>::EXP) - 1u) << Fmt<FMT>::MAN;
    return mag > inf;
}

// relu keeps a where a > 0 or a is NaN (reference_ops.relu_bits).
template <int FMT> BS_HD bool bs_relu_keeps(u32 b) {
    const u32 sign = 1u << (Fmt<FMT>::BITS - 1);
    return ((b & sign) == 0u && b != 0u) || bs_is_nan<FMT>(b);
}

// float32(a) > 0 for a stored bit pattern (NaN and zeros are not > 0).
template <int FMT> BS_HD bool bs_positive(u32 b) {
    const u32 sign = 1u << (Fmt<FMT>::BITS - 1);
    return (b & sign) == 0u && b != 0u && !bs_is_nan<FMT>(b);
}

// Exact widening to float32 bits. NaN payloads move up unchanged, as NumPy's
// half -> float does (an fp8 NaN's payload never survives the rounding back).
template <int FMT> BS_HD u32 bs_to_f32(u32 b) {
    if (FMT == BS_FP32) return b;
    if (FMT == BS_BF16) return b << 16;
    const int EXP = Fmt<FMT>::EXP, MAN = Fmt<FMT>::MAN, BITS = Fmt<FMT>::BITS;
    const int BIAS = (1 << (EXP - 1)) - 1;
    const u32 s = (b >> (BITS - 1)) & 1u;
    const u32 e = (b >> MAN) & ((1u << EXP) - 1u);
    u32 m = b & ((1u << MAN) - 1u);
    if (bs_is_nan<FMT>(b)) return (s << 31) | 0x7f800000u | (m << (23 - MAN));
    if (FMT != BS_E4M3 && e == (1u << EXP) - 1u) return (s << 31) | 0x7f800000u;  // inf
    if (e == 0) {
        if (m == 0) return s << 31;
        int ex = 1 - BIAS;                       // subnormal: normalise the significand
        while (!(m & (1u << MAN))) { m <<= 1; --ex; }
        return (s << 31) | ((u32)(ex + 127) << 23) | ((m & ((1u << MAN) - 1u)) << (23 - MAN));
    }
    return (s << 31) | ((e - BIAS + 127) << 23) | (m << (23 - MAN));
}

// float32 bits -> FMT, round to nearest even, with the NaN / overflow rules of
// ml_dtypes (bf16, fp8) and NumPy (fp16): bf16 NaN -> sign|0x7fc0; fp16 NaN
// keeps the top payload bits; e4m3fn has no inf (inf and overflow -> NaN 0x7f);
// e5m2 NaN -> sign|0x7e.
template <int FMT> BS_HD u32 bs_from_f32(u32 f) {
    if (FMT == BS_FP32) return f;
    const u32 s = f >> 31, a = f & 0x7fffffffu;
    if (FMT == BS_BF16) {
        if (a > 0x7f800000u) return (s << 15) | 0x7fc0u;
        return (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
    }
    const int EXP = Fmt<FMT>::EXP, MAN = Fmt<FMT>::MAN, BITS = Fmt<FMT>::BITS;
    const int BIAS = (1 << (EXP - 1)) - 1;
    const u32 sgn = s << (BITS - 1);
    const u32 inf = ((1u << EXP) - 1u) << MAN;
    if (a > 0x7f800000u) {
        if (FMT == BS_FP16) {
            u32 h = 0x7c00u | ((a & 0x7fffffu) >> 13);
            return sgn | (h == 0x7c00u ? 0x7c01u : h);
        }
        return FMT == BS_E4M3 ? (sgn | 0x7fu) : (sgn | 0x7eu);
    }
    if (a == 0x7f800000u) return FMT == BS_E4M3 ? (sgn | 0x7fu) : (sgn | inf);
    const int e32 = (int)(a >> 23);
    const u32 m32 = a & 0x7fffffu;
    const u32 sig = e32 ? (m32 | 0x800000u) : m32;
    const int ue = e32 ? e32 - 127 : -126;
    const int emin = 1 - BIAS;
    u32 code;
    if (ue >= emin) {
        const int sh = 23 - MAN > 0 ? 23 - MAN : 1;  // (fp32 returned above)
        const u32 v = ((u32)(ue + BIAS) << 23) | m32;
        code = (v + (1u << (sh - 1)) - 1u + ((v >> sh) & 1u)) >> sh;
    } else {
        const int sh = emin - ue + 23 - MAN;     // >= 14: value / smallest subnormal
        if (sh > 25) {
            code = 0;
        } else {
            const u32 q = sig >> sh, rem = sig & ((1u << sh) - 1u), half = 1u << (sh - 1);
            code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
        }
    }
    if (FMT == BS_E4M3) {
        if (code > 0x7eu) code = 0x7fu;          // overflow -> NaN (no inf in e4m3fn)
    } else if (code > inf) {
        code = inf;
    }
    return sgn | code;
}

// The float32 product as NumPy computes it on x86-64: IEEE round-to-nearest-
// even with subnormals; a NaN result is the first NaN operand made quiet, or
// the default NaN 0xffc00000 (inf * 0).
BS_HD u32 bs_fmul(u32 a, u32 b) {      // the bare IEEE product, any NaN
#if defined(__CUDA_ARCH__)
    u32 r;
    asm("mul.rn.f32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));  // no .ftz
    return r;
#else
    union { u32 u; float f; } x, y, z;
    x.u = a; y.u = b;
    z.f = x.f * y.f;
    return z.u;
#endif
}

BS_HD bool bs_f32_nan(u32 f) { return (f & 0x7fffffffu) > 0x7f800000u; }

BS_HD u32 bs_mul_f32(u32 a, u32 b) {
    const u32 r = bs_fmul(a, b);
    if (bs_f32_nan(r)) {
        if ((a & 0x7fffffffu) > 0x7f800000u) return a | 0x400000u;
        if ((b & 0x7fffffffu) > 0x7f800000u) return b | 0x400000u;
        return 0xffc00000u;
    }
    return r;
}

// round(a * b) to FMT with both operands in FMT (products of these formats are
// exact in float32 except fp32 itself, which rounds once, as NumPy does).
template <int FMT> BS_HD u32 bs_mul_round(u32 a, u32 b) {
    return bs_from_f32<FMT>(bs_mul_f32(bs_to_f32<FMT>(a), bs_to_f32<FMT>(b)));
}

// relu2 backward: round(g * (2 r)) where r > 0, else +0.
template <int FMT> BS_HD u32 bs_relu2_grad(u32 g, u32 r) {
    if (!bs_positive<FMT>(r)) return 0u;
    const u32 two_r = bs_mul_f32(0x40000000u, bs_to_f32<FMT>(r));
    return bs_from_f32<FMT>(bs_mul_f32(bs_to_f32<FMT>(g), two_r));
}

// ------------------------------------------------------------------------- //
// The fused ops' arithmetic a word at a time                                  //
// ------------------------------------------------------------------------- //
// The per-element functions above spend ~20 instructions on an element, most of
// them on NaN and rounding rules that only NaNs need. The fused kernels instead
// take a word (two 16-bit elements, or one fp32) to float32, compute with bare
// IEEE products, and round both lanes with one hardware conversion; a vector in
// which any result is NaN is redone by the per-element functions. Without a NaN
// the two agree bit for bit: the products are the same mul.rn.f32, and round to
// nearest even is what bs_from_f32 computes for every non-NaN input.

// -D switch for bench/bench_fused.py's A/B runs: the per-element functions for
// every element, as before the word path.
#ifndef BS_FUSED_PER_ELEMENT
#define BS_FUSED_PER_ELEMENT 0
#endif

// ReLU of every element of a word: lanes relu drops (negative, -0.0) become +0,
// NaNs stay (bs_relu_keeps). Per lane, a NaN test carries the magnitude plus
// (max magnitude - largest non-NaN magnitude) into the sign position.
template <int FMT> BS_HD u32 bs_relu_word(u32 w) {
    const int BITS = Fmt<FMT>::BITS;
    const u32 lanes = BITS == 32 ? 1u : BITS == 16 ? 0x00010001u : 0x01010101u;
    const u32 sign = lanes << (BITS - 1);
    const u32 top = (1u << (BITS - 1)) - 1u;
    const u32 lim = FMT == BS_E4M3 ? 0x7eu : ((1u << Fmt<FMT>::EXP) - 1u) << Fmt<FMT>::MAN;
    const u32 nan = ((w & ~sign) + (top - lim) * lanes) & sign;
    const u32 drop = (w & sign) & ~nan;
    const u32 lane_ones = BITS == 32 ? 0xffffffffu : (u32)((1ull << BITS) - 1ull);
    return w & ~((drop >> (BITS - 1)) * lane_ones);
}

// Whether float32 bits f are > 0 and not NaN (bs_positive of the narrow value).
BS_HD bool bs_f32_positive(u32 f) { return f - 1u < 0x7f800000u; }

// The two 16-bit lanes of a word widened to float32 bits (exact).
template <int FMT> BS_HD void bs_widen2(u32 w, u32& lo, u32& hi) {
    if (FMT == BS_BF16) { lo = w << 16; hi = w & 0xffff0000u; return; }
#if defined(__CUDA_ARCH__)
    float a, b;
    asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(a), "=f"(b) : "r"(w));
    lo = __float_as_uint(a); hi = __float_as_uint(b);
#else
    lo = bs_to_f32<FMT>(w & 0xffffu); hi = bs_to_f32<FMT>(w >> 16);
#endif
}

// Two float32 values (not NaN) rounded to nearest even into the lanes of a word.
template <int FMT> BS_HD u32 bs_narrow2(u32 lo, u32 hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    if (FMT == BS_BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "r"(hi), "r"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "r"(hi), "r"(lo));
    return r;
#else
    return bs_from_f32<FMT>(lo) | (bs_from_f32<FMT>(hi) << 16);
#endif
}

// f lane by lane over words a, b, c of 16- or 32-bit elements: f takes and returns
// float32 bits; the result is rounded to FMT, and `nan` is set where f gave a NaN
// (that lane of the result is then unspecified).
template <int FMT, typename F> BS_HD u32 bs_word_f32(u32 a, u32 b, u32 c, F f, bool& nan) {
    if (Fmt<FMT>::BITS == 32) {
        const u32 r = f(a, b, c);
        nan |= bs_f32_nan(r);
        return r;
    }
    u32 a0, a1, b0, b1, c0, c1;
    bs_widen2<FMT>(a, a0, a1);
    bs_widen2<FMT>(b, b0, b1);
    bs_widen2<FMT>(c, c0, c1);
    const u32 r0 = f(a0, b0, c0), r1 = f(a1, b1, c1);
    nan |= bs_f32_nan(r0) | bs_f32_nan(r1);
    return bs_narrow2<FMT>(r0, r1);
}

// The fused ops' lane functions on float32 bits (bs_relu2_grad, bs_mul_round, and the
// gated op's masked product), without their NaN rules.
struct BsRelu2Grad {    // (g, r): g (2 r) where r > 0, else +0
    BS_HD_MEMBER u32 operator()(u32 g, u32 r, u32) const {
        return bs_f32_positive(r) ? bs_fmul(g, bs_fmul(0x40000000u, r)) : 0u;
    }
};
struct BsSquare {       // (r): r r
    BS_HD_MEMBER u32 operator()(u32 r, u32, u32) const { return bs_fmul(r, r); }
};
struct BsProduct {      // (a, b): a b
    BS_HD_MEMBER u32 operator()(u32 a, u32 b, u32) const { return bs_fmul(a, b); }
};
struct BsGatedProduct { // (g, u, r): g u where r > 0, else +0
    BS_HD_MEMBER u32 operator()(u32 g, u32 u, u32 r) const {
        return bs_f32_positive(r) ? bs_fmul(g, u) : 0u;
    }
};

// ------------------------------------------------------------------------- //
// Word-at-a-time bit tricks of the codec kernels (host-testable)              //
// ------------------------------------------------------------------------- //
// The kernels are bound by instruction issue, not DRAM, when they touch one
// element at a time; these helpers work on a whole 32-bit word (2 bf16 / 4 fp8
// elements) per instruction. tests/test_kernel_math.py runs them on the CPU.

BS_HD u32 bs_popc(u32 x) {
#if defined(__CUDA_ARCH__)
    return (u32)__popc(x);
#else
    return (u32)__builtin_popcount(x);
#endif
}

// (hi:lo) >> (sh % 32), low 32 bits (PTX shf.r.wrap: the shift wraps for free).
BS_HD u32 bs_funnel_r(u32 lo, u32 hi, u32 sh) {
#if defined(__CUDA_ARCH__)
    return __funnelshift_r(lo, hi, sh);
#else
    return (u32)((((unsigned long long)hi << 32) | lo) >> (sh & 31u));
#endif
}

// PRMT: byte k of the result is byte (s >> 4k) & 7 of (y:x); only s's low 16 bits
// count, and every selector here keeps bit 3 of each nibble clear (PTX's prmt
// would replicate the sign there; __byte_perm instead masks it off, an extra op).
BS_HD u32 bs_prmt(u32 x, u32 y, u32 s) {
#if defined(__CUDA_ARCH__)
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
#else
    const unsigned long long xy = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int k = 0; k < 4; ++k) r |= (u32)((xy >> (8 * ((s >> (4 * k)) & 7u))) & 0xffu) << (8 * k);
    return r;
#endif
}

// Nonzero bits of the 32 / BITS elements of a word, element k -> bit k.
template <int BITS> BS_HD u32 bs_word_nonzero(u32 w) {
    if (BITS == 32) return w != 0u ? 1u : 0u;
    if (BITS == 16) {
        // Per 16-bit lane: the low 15 bits plus 0x7fff carry into bit 15 unless
        // zero; OR the lane's own sign bit. Bits 15 and 31 then gather to 0, 1.
        const u32 nz = (((w & 0x7fff7fffu) + 0x7fff7fffu) | w) & 0x80008000u;
        return ((nz >> 15) & 1u) | (nz >> 30);
    }
    const u32 nz = (((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u;
    return (((nz >> 7) * 0x00204081u) >> 21) & 0xfu;   // bits 0, 8, 16, 24 -> 21..24
}

// Nonzero bits of a 16-byte vector held as four words (element k -> bit k),
// equal to the four bs_word_nonzero results side by side. For 16-bit elements
// the eight flag bits (bits 15 and 31 of each word) gather with four shifts and
// two ORs instead of a gather per word.
template <int BITS> BS_HD u32 bs_quad_nonzero(u32 a, u32 b, u32 c, u32 d) {
    const int G = 32 / BITS;
    if (BITS != 16)
        return bs_word_nonzero<BITS>(a) | (bs_word_nonzero<BITS>(b) << G)
             | (bs_word_nonzero<BITS>(c) << (2 * G)) | (bs_word_nonzero<BITS>(d) << (3 * G));
    auto flags = [](u32 w) { return (((w & 0x7fff7fffu) + 0x7fff7fffu) | w) & 0x80008000u; };
    // Word k's low flag lands on bit 2k, its high flag on bit 16 + 2k ...
    const u32 t = (flags(a) >> 15) | (flags(b) >> 13) | (flags(c) >> 11) | (flags(d) >> 9);
    // ... and the high flags move down to the odd bits.
    return (t | (t >> 15)) & 0xffu;
}

// PRMT selector that moves the bytes of the first popc(mb) elements of a
// compacted word to the element slots set in mb (4-bit mb, fp8), zero elsewhere.
BS_HD u32 bs_byte_selector(u32 mb) {
    u32 s = 0, k = 0;
    for (int p = 0; p < 4; ++p) {
        const bool on = (mb >> p) & 1u;
        s |= (on ? k : 4u) << (4 * p);
        k += on ? 1u : 0u;
    }
    return s;
}

// One output word of an unpack: the 32 / BITS elements selected by mb (bit per
// element) take the next stored values, which start at value index j of the
// decoded values (packed 32 / BITS per word in vals). sel8: bs_byte_selector table.
template <int BITS> BS_HD u32 bs_expand_word(const u32* vals, u32 j, u32 mb, const u32* sel8) {
    if (BITS == 32) return mb ? vals[j] : 0u;
    const u32 byte = j * (u32)(BITS / 8);
    const u32 src = bs_funnel_r(vals[byte >> 2], vals[(byte >> 2) + 1], (byte & 3u) * 8u);
    // bf16 selectors for mb = 0..3: 0x4444, 0x4410, 0x1044, 0x3210 (4 = a zero byte).
    const u32 s = BITS == 16 ? (u32)(0x3210104444104444ull >> (mb * 16u)) & 0xffffu : sel8[mb];
    return bs_prmt(src, 0u, s);
}

// A stream chunk of 32 / BITS codes of width W (LSB-first) -> the same codes
// one per BITS-bit lane.
template <int BITS, int W> BS_HD u32 bs_spread(u32 c) {
    if (W == BITS) return c;
    if (BITS == 32) return c & 0x7fffffffu;
    if (BITS == 16) return (c & 0x7fffu) | ((c << 1) & 0x7fff0000u);
    const u32 y = (c & 0x3fffu) | ((c << 2) & 0x3fff0000u);       // two 14-bit halves
    return (y & 0x007f007fu) | ((y << 1) & 0x7f007f00u);
}

// 32 bits of a W-bit LSB-first stream starting at stream bit b, built from the values
// it is the stream of (v: one value per element of T, codes masked to W bits; at least
// the few values past the last stored one must read as zeros). A word of the stream
// without an assembled copy of it (the warp-tile pack prototype, bench/proto).
template <int W, typename T> BS_HD u32 bs_stream_window(const T* v, u32 b) {
    const int J = (W - 1 + 32 + W - 1) / W;          // values a 32-bit window can touch
    const u64 VMW = W >= 32 ? 0xffffffffull : ((1ull << W) - 1ull);
    const u32 i0 = b / (u32)W, r0 = b - i0 * (u32)W;
    u64 acc = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) acc |= ((u64)v[i0 + j] & VMW) << (j * W);
    return (u32)(acc >> r0);
}

// Sign bits 0 .. 32/BITS-1 of s -> the sign bit of each BITS-bit lane.
template <int BITS> BS_HD u32 bs_spread_signs(u32 s) {
    if (BITS == 32) return s << 31;
    if (BITS == 16) return ((s & 1u) << 15) | ((s & 2u) << 30);
    return (((s & 0xfu) * 0x00204081u) & 0x01010101u) << 7;
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// ------------------------------------------------------------------------- //
// Device-only helpers                                                       //
// ------------------------------------------------------------------------- //
#define BS_FULL 0xffffffffu

// Warp-wide sum / OR (one REDUX instruction from sm_80 on).
BS_D u32 bs_warp_sum(u32 x) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(BS_FULL, x);
#else
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(BS_FULL, x, o);
    return x;
#endif
}
BS_D u32 bs_warp_or(u32 x) {
#if __CUDA_ARCH__ >= 800
    return __reduce_or_sync(BS_FULL, x);
#else
    for (int o = 16; o > 0; o >>= 1) x |= __shfl_xor_sync(BS_FULL, x, o);
    return x;
#endif
}

// A 32-bit word of a byte plane of length len, zero past the end (planes are
// never read beyond their section).
BS_D u32 bs_load_word(const u8* p, u64 len, u64 wi) {
    const u64 b = wi * 4u;
    if (b + 4u <= len) return reinterpret_cast<const u32*>(p)[wi];
    u32 r = 0;
    for (u32 k = 0; k < 4u; ++k)
        if (b + k < len) r |= (u32)p[b + k] << (8u * k);
    return r;
}

// Index of the highest set bit of a nonzero word (one FLO; __clz needs two ops).
BS_D u32 bs_bfind(u32 x) {
    u32 i;
    asm("bfind.u32 %0, %1;" : "=r"(i) : "r"(x));
    return i;
}

// Ask the SM's copy engine to bring bytes [b0, b1) of a plane of len bytes into L2
// (one instruction, no registers held: sm_90's cp.async.bulk.prefetch; callers skip
// the work around it where BS_BULK_PREFETCH is 0). The range is widened to whole
// 16-byte blocks, which never leave the plane's pages.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BS_BULK_PREFETCH 1
#else
#define BS_BULK_PREFETCH 0
#endif
BS_D void bs_l2_prefetch(u64 base, u64 len, u64 b0, u64 b1) {
#if BS_BULK_PREFETCH
    if (b1 > len) b1 = len;
    if (b1 <= b0) return;
    const u64 a0 = (base + b0) & ~15ull, a1 = (base + b1 + 15ull) & ~15ull;
    // volatile, no memory clobber: kept, but loads may still move across it
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a0), "r"((u32)(a1 - a0)));
#endif
}

// Tile count descriptors: one 8-byte access each way (never torn), relaxed at
// GPU scope: a count carries no other data, so no ordering is needed.
BS_D u64 bs_ld_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
BS_D void bs_st_u64(u64* p, u64 a) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(a) : "memory");
}

// Element i of a 16-byte vector viewed as V elements of T.
template <typename T> BS_D T bs_lane(const uint4& v, int i) {
    const u32 w = (i * (int)sizeof(T)) / 4 == 0 ? v.x
                : (i * (int)sizeof(T)) / 4 == 1 ? v.y
                : (i * (int)sizeof(T)) / 4 == 2 ? v.z : v.w;
    if (sizeof(T) == 4) return (T)w;
    const int sh = ((i * (int)sizeof(T)) % 4) * 8;
    return (T)(w >> sh);
}

template <typename T> BS_D void bs_set_lane(uint4& v, int i, T x) {
    const int word = (i * (int)sizeof(T)) / 4;
    const int sh = ((i * (int)sizeof(T)) % 4) * 8;
    const u32 m = (sizeof(T) == 4) ? 0xffffffffu : (((1u << (8 * sizeof(T))) - 1u) << sh);
    const u32 bits = ((u32)x << sh) & m;
    if (word == 0) v.x = (v.x & ~m) | bits;
    else if (word == 1) v.y = (v.y & ~m) | bits;
    else if (word == 2) v.z = (v.z & ~m) | bits;
    else v.w = (v.w & ~m) | bits;
}

// The V elements of one 16-byte vector at element index g of a tensor of
// numel elements: one vector load when aligned and in range, two 8-byte loads
// when in range at an 8-byte boundary (a view 8 bytes into another tensor,
// where scalars would be several times slower), else scalars (zero past the end).
template <typename T> BS_D uint4 bs_load_vec(const T* x, u64 g, u64 numel, bool aligned) {
    const int V = 16 / sizeof(T);
    if (aligned && g + V <= numel) return *reinterpret_cast<const uint4*>(x + g);
    if (g + V <= numel && (reinterpret_cast<u64>(x + g) & 7u) == 0u) {
        const uint2* p = reinterpret_cast<const uint2*>(x + g);
        const uint2 a = p[0], b = p[1];
        return make_uint4(a.x, a.y, b.x, b.y);
    }
    uint4 v = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < V; ++i)
        if (g + i < numel) bs_set_lane<T>(v, i, x[g + i]);
    return v;
}

// Its store, the same three ways.
template <typename T> BS_D void bs_store_vec(T* y, u64 g, u64 numel, bool aligned, const uint4& v) {
    const int V = 16 / sizeof(T);
    if (aligned && g + V <= numel) { *reinterpret_cast<uint4*>(y + g) = v; return; }
    if (g + V <= numel && (reinterpret_cast<u64>(y + g) & 7u) == 0u) {
        uint2* p = reinterpret_cast<uint2*>(y + g);
        p[0] = make_uint2(v.x, v.y);
        p[1] = make_uint2(v.z, v.w);
        return;
    }
#pragma unroll
    for (int i = 0; i < V; ++i)
        if (g + i < numel) y[g + i] = bs_lane<T>(v, i);
}

// The product a b of two 16-byte vectors, each element rounded once as bs_mul_round
// does: a word at a time in float32 (false when a product is NaN, whose payload the
// caller then takes from bs_product_vec_fallback), or per element by that rule (the
// fallback: out of line, so that its registers do not count against the word path's).
template <int FMT> BS_D bool bs_product_vec(const uint4& a, const uint4& b, uint4& o) {
    bool nan = false;
    o.x = bs_word_f32<FMT>(a.x, b.x, 0u, BsProduct(), nan);
    o.y = bs_word_f32<FMT>(a.y, b.y, 0u, BsProduct(), nan);
    o.z = bs_word_f32<FMT>(a.z, b.z, 0u, BsProduct(), nan);
    o.w = bs_word_f32<FMT>(a.w, b.w, 0u, BsProduct(), nan);
    return !nan;
}
template <int FMT> BS_D uint4 bs_product_vec_exact(const uint4& a, const uint4& b) {
    typedef typename Fmt<FMT>::T T;
    uint4 o = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i)
        bs_set_lane<T>(o, i, (T)bs_mul_round<FMT>((u32)bs_lane<T>(a, i), (u32)bs_lane<T>(b, i)));
    return o;
}
template <int FMT> __device__ __noinline__ uint4 bs_product_vec_fallback(uint4 a, uint4 b) {
    return bs_product_vec_exact<FMT>(a, b);
}
// a b as the gated pack and product form it: per element for 8-bit formats (and under
// BS_FUSED_PER_ELEMENT), else a word at a time with the per-element rule at a NaN.
template <int FMT> BS_D uint4 bs_product(const uint4& a, const uint4& b) {
    if constexpr (BS_FUSED_PER_ELEMENT || Fmt<FMT>::BITS == 8) {
        return bs_product_vec_exact<FMT>(a, b);
    } else {
        uint4 o;
        if (!bs_product_vec<FMT>(a, b, o)) o = bs_product_vec_fallback<FMT>(a, b);
        return o;
    }
}

// Inclusive warp scan of a u32 (packed fields add independently while they do not carry).
BS_D u32 bs_warp_scan(u32 x, int lane) {
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const u32 y = __shfl_up_sync(BS_FULL, x, s);
        if (lane >= s) x += y;
    }
    return x;
}

// Ranks within a warp for R rounds (R even): start[r] is the warp-relative index
// of this lane's first set bit in round r (rounds in order, lanes in order);
// returns the warp's total. A lane holds at most MAXC set bits per round. With
// MAXC <= 8 (bf16, fp32) four rounds share one scan of 8-bit fields: an
// exclusive sum is at most 31 * 8 = 248 per field, so incl - x is exact even
// when a field of the inclusive sum reaches 256 and carries (mod 2^32); the
// round totals come from lane 31's exclusive sums plus its own counts.
// Otherwise two rounds share one scan of 16-bit fields.
template <int R, int MAXC>
BS_D u32 bs_scan_rounds(const u32 (&bits)[R], int lane, u32 (&start)[R]) {
    u32 acc = 0;
    if (MAXC <= 8 && R % 4 == 0) {
#pragma unroll
        for (int q = 0; q < R / 4; ++q) {
            u32 packed = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) packed |= (u32)__popc(bits[4 * q + k]) << (8 * k);
            const u32 excl = bs_warp_scan(packed, lane) - packed;
            const u32 last_excl = __shfl_sync(BS_FULL, excl, 31);
            const u32 last_own = __shfl_sync(BS_FULL, packed, 31);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                start[4 * q + k] = acc + ((excl >> (8 * k)) & 0xffu);
                acc += ((last_excl >> (8 * k)) & 0xffu) + ((last_own >> (8 * k)) & 0xffu);
            }
        }
    } else {
#pragma unroll
        for (int q = 0; q < R / 2; ++q) {
            const u32 packed = (u32)__popc(bits[2 * q]) | ((u32)__popc(bits[2 * q + 1]) << 16);
            const u32 incl = bs_warp_scan(packed, lane);
            const u32 excl = incl - packed;
            const u32 tot = __shfl_sync(BS_FULL, incl, 31);
            start[2 * q] = acc + (excl & 0xffffu);
            start[2 * q + 1] = acc + (tot & 0xffffu) + (excl >> 16);
            acc += (tot & 0xffffu) + (tot >> 16);
        }
    }
    return acc;
}
#endif
