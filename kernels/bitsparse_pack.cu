// Packing: one pass over the dense input writes the mask, the chunk offsets
// and the value stream (and the sign plane) of format v1.
//
// A block takes a tile of 8 warps x R rounds x 32 lanes x one 16-byte vector
// (R = 4, cupy_backend.ROUNDS: 4096 fp32 / 8192 16-bit / 16384 fp8
// elements), tile = blockIdx.x: blocks are dispatched in index order, so every
// predecessor the look-back spins on has started (as in CUB's decoupled
// look-back). The phases of a tile are listed above the kernel; the global
// value offset comes from a decoupled look-back over tile descriptors.
//
// Value streams are written as whole 32-bit words with plain stores. A word
// that straddles two tiles is written by exactly one of them: the tile whose
// range holds the word's last bit (or, for the stream's final partial word,
// the tile that ends the stored stream). The bits it needs from predecessors
// come with the look-back: every descriptor carries the last 32 bits of the
// stream up to that tile (BsTail), so no atomics and no memset are needed and
// padding bits come out zero.
//
// Scratch (zeroed before launch): 16 unused bytes, then one 16-byte descriptor
// per tile: {2-bit state | nosign-violation bit | 61-bit count, magnitude tail |
// sign tail << 32}, written and read as single 16-byte accesses (as CUB's tile
// descriptors are), AGG (this tile alone) first, INCL (whole prefix) after the
// look-back. The nosign flag travels in the descriptors, so no atomics.
// Status area (in the packed allocation): u32 status, u32 pad, u64 nnz.

#define BS_AGG (1ull << 62)
#define BS_INCL (2ull << 62)
#define BS_NEG (1ull << 61)
#define BS_COUNT ((1ull << 61) - 1ull)

#define BS_MODE_PACK 0
#define BS_MODE_RELU 1
#define BS_MODE_RELU2 2
#define BS_MODE_MASKED 3

// Warp-wide sum / OR (one REDUX instruction from sm_80 on).
__device__ __forceinline__ u32 bs_warp_sum(u32 x) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(BS_FULL, x);
#else
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(BS_FULL, x, o);
    return x;
#endif
}
__device__ __forceinline__ u32 bs_warp_or(u32 x) {
#if __CUDA_ARCH__ >= 800
    return __reduce_or_sync(BS_FULL, x);
#else
    for (int o = 16; o > 0; o >>= 1) x |= __shfl_xor_sync(BS_FULL, x, o);
    return x;
#endif
}

// Fold the predecessors of `tile` (warp 0): exclusive count, nosign flag and
// stream tails. Four windows of 32 descriptors are loaded at once so that a
// tile far from the nearest inclusive one pays one round trip per 128 tiles.
template <int W, bool SIGNS>
__device__ __forceinline__ void bs_lookback(const ulonglong2* desc, u64 tile, int lane,
                                            u64& P, u32& neg, BsTail& tm, BsTail& ts) {
    const int Q = 4;
    u64 acc = 0;
    u32 ng = 0;
    BsTail am = {0u, 0u}, as = {0u, 0u};
    i64 base = (i64)tile - 1;
    bool done = false;
    while (!done) {
        ulonglong2 d[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const i64 j = base - lane - 32 * q;
            d[q] = j >= 0 ? bs_ld_desc(&desc[j]) : make_ulonglong2(BS_INCL, 0ull);
        }
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            if (done) break;
            const i64 j = base - lane - 32 * q;
            while (__any_sync(BS_FULL, (d[q].x >> 62) == 0ull)) {
                if ((d[q].x >> 62) == 0ull) {
                    __nanosleep(32);
                    d[q] = bs_ld_desc(&desc[j]);
                }
            }
            const u64 f = d[q].x;
            const u32 st = (u32)(f >> 62);
            const u64 c = f & BS_COUNT;
            const u32 nb = (u32)(f >> 61) & 1u;
            const u32 cc = c < 32ull ? (u32)c : 32u;
            BsTail m = {(u32)d[q].y, min(cc * (u32)W, 32u)};
            BsTail s = {SIGNS ? (u32)(d[q].y >> 32) : 0u, SIGNS ? cc : 0u};
            const u32 incl = __ballot_sync(BS_FULL, st == 2u);
            const int first = incl ? __ffs(incl) - 1 : 32;
            const bool use = lane <= first;          // lane 0 is the nearest predecessor
            // Counts: aggregates are at most a tile each (32 bits suffice); the
            // one inclusive descriptor, if any, adds its 64-bit prefix.
            acc += bs_warp_sum((use && lane != first) ? (u32)c : 0u);
            if (incl) acc += __shfl_sync(BS_FULL, c, first);
            ng |= bs_warp_or(use ? nb : 0u);
            // Tails, only while the 32 bits nearest this tile are incomplete.
            if (am.len < 32u || (SIGNS && as.len < 32u)) {
                BsTail wm, ws;
                const u32 l0m = __shfl_sync(BS_FULL, m.len, 0);
                const u32 l0s = SIGNS ? __shfl_sync(BS_FULL, s.len, 0) : 32u;
                if (l0m == 32u && l0s == 32u) {        // the nearest one alone has 32 bits
                    wm.bits = __shfl_sync(BS_FULL, m.bits, 0); wm.len = 32u;
                    ws.bits = SIGNS ? __shfl_sync(BS_FULL, s.bits, 0) : 0u; ws.len = SIGNS ? 32u : 0u;
                } else {
                    if (!use) { m.bits = m.len = 0u; s.bits = s.len = 0u; }
                    // Ordered fold: higher lanes are farther back.
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        BsTail m2, s2;
                        m2.bits = __shfl_down_sync(BS_FULL, m.bits, o);
                        m2.len = __shfl_down_sync(BS_FULL, m.len, o);
                        s2.bits = __shfl_down_sync(BS_FULL, s.bits, o);
                        s2.len = __shfl_down_sync(BS_FULL, s.len, o);
                        if (lane + o < 32) { m = bs_tail_cat(m2, m); s = bs_tail_cat(s2, s); }
                    }
                    wm.bits = __shfl_sync(BS_FULL, m.bits, 0); wm.len = __shfl_sync(BS_FULL, m.len, 0);
                    ws.bits = __shfl_sync(BS_FULL, s.bits, 0); ws.len = __shfl_sync(BS_FULL, s.len, 0);
                }
                am = bs_tail_cat(wm, am);
                as = bs_tail_cat(ws, as);
            }
            done = incl != 0u;
        }
        base -= 32 * Q;
    }
    P = acc; neg = ng; tm = am; ts = as;
}

// Write the stream words of bits [a*WW, e*WW) that this tile owns (see top).
// A holds the tile's own stream as if it began at bit 0 (A[-1] is `pred`, the
// top-aligned last 32 bits of the stream before it); the output word is a
// funnel shift of two neighbours by the tile's bit offset, so the words are
// written once, coalesced, with no atomics.
template <int WW>
__device__ __forceinline__ void bs_copy_stream(u32* out, const u32* A, u64 a, u64 e, u32 pred,
                                               bool final_resp) {
    const u64 B0 = a * (u64)WW, B1 = e * (u64)WW;
    const u64 w_lo = B0 >> 5, w_end = B1 >> 5;
    const u32 base = (u32)(B0 & 31u), tailb = (u32)(B1 & 31u);
    // Owned: words whose last bit lies in [B0, B1), plus the stream's final
    // partial word when this tile ends the stored stream.
    const i64 last = (final_resp && tailb) ? (i64)w_end : (i64)w_end - 1;
    if (last < (i64)w_lo) return;
    const u32 nk = (u32)(last - (i64)w_lo) + 1u;
    for (u32 k = threadIdx.x; k < nk; k += BS_THREADS) {
        u32 word = bs_funnel_l(k ? A[k - 1] : pred, A[k], base);
        if (w_lo + k == w_end) word &= (1u << tailb) - 1u;     // past the stream: padding
        out[w_lo + k] = word;
    }
}

// 32 / BITS mask bits of a 16-byte vector of a plain pack (element k -> bit k).
template <int BITS> __device__ __forceinline__ u32 bs_vec_nonzero(const uint4& v) {
    const int G = 32 / BITS;
    return bs_word_nonzero<BITS>(v.x) | (bs_word_nonzero<BITS>(v.y) << G)
         | (bs_word_nonzero<BITS>(v.z) << (2 * G)) | (bs_word_nonzero<BITS>(v.w) << (3 * G));
}

// One block per tile (tile = blockIdx.x). Phases, with the barriers between:
//   1. 16-byte loads of all R rounds, mask bits per vector, packed warp scans.
//   B1 (warp totals)
//   2. the tile's stored values compacted into shared memory (`stage`).
//   B2 (with the nosign check)
//   3. warp 0: tails, publish, decoupled look-back, publish the inclusive prefix;
//      warps 1-7 meanwhile: the tile's W-bit stream as whole words (`A`, 32
//      values per thread, constant shifts) and its sign plane (ballots).
//   B3
//   4. mask bytes, chunk offsets, dense relu output, and the stream words
//      shifted into place (bs_copy_stream).
template <int FMT, int ENC, int MODE, int R>
__global__ void __launch_bounds__(BS_THREADS, (MODE == 0 || MODE == 3) ? (R >= 4 ? (Fmt<FMT>::BITS == 32 ? 4 : 5) : 6) : 2)
bitsparse_pack(u64 x_ptr, u64 numel, int x_aligned,
               u64 mask_ptr, u64 mask_len,
               u64 offsets_ptr, int off64, int chunk_log2,
               u64 values_ptr, u64 signs_ptr, u64 cap,
               u64 y_ptr, int y_aligned,
               u64 scratch_ptr, u64 status_ptr, u64 n_tiles) {
    typedef typename Fmt<FMT>::T T;
    const int BITS = Fmt<FMT>::BITS;
    const int V = 16 / (int)sizeof(T);        // elements per 16-byte vector
    const int RS = 32 * V;                    // elements per warp round
    const int SEG = RS * R;                   // elements per warp
    const int TILE = SEG * BS_WARPS;
    const int W = ENC == 0 ? BITS : BITS - 1; // value-stream width
    const bool SIGNS = ENC == 2;
    const u32 VM = V == 32 ? 0xffffffffu : ((1u << V) - 1u);
    const u32 SIGN = 1u << (BITS - 1);
    const int SWORDS = TILE * BITS / 32;      // staged values, as words
    const int AWORDS = ENC == 0 ? 1 : TILE * W / 32;

    __shared__ __align__(16) u32 stage_w[SWORDS + 4];
    __shared__ __align__(16) u32 a_s[AWORDS + 4];
    __shared__ u32 s_signs[SIGNS ? TILE / 32 + 4 : 1];
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u64 s_P;
    __shared__ u32 s_tail_m, s_tail_s;
    T* stage = reinterpret_cast<T*>(stage_w);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    ulonglong2* desc = reinterpret_cast<ulonglong2*>(scratch_ptr + 16);

    const u64 tile = blockIdx.x;
    const u64 tile_base = tile * (u64)TILE;
    const T* x = reinterpret_cast<const T*>(x_ptr);

    // 1. Load (all rounds in flight), transform, classify.
    uint4 vec[R];
    u32 bits[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
        vec[r] = g < numel ? bs_load_vec<T>(x, g, numel, x_aligned) : make_uint4(0, 0, 0, 0);
    }
    u32 neg = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
        u32 b = 0;
        if (MODE == BS_MODE_MASKED) {
            if (g < numel) {
                const u32 mw = bs_load_word(reinterpret_cast<const u8*>(mask_ptr), mask_len, g >> 5);
                b = (mw >> (u32)(g & 31u)) & VM;
                if (g + V > numel) b &= (1u << (u32)(numel - g)) - 1u;
            }
        } else if (MODE == BS_MODE_PACK) {
            b = bs_vec_nonzero<BITS>(vec[r]);          // loads past numel are zeros
            neg |= vec[r].x | vec[r].y | vec[r].z | vec[r].w;   // a set sign bit is nonzero
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                u32 e = (u32)bs_lane<T>(vec[r], i);
                if (!bs_relu_keeps<FMT>(e)) { e = 0u; bs_set_lane<T>(vec[r], i, (T)0); }
                b |= (e != 0u ? 1u : 0u) << i;
            }
        }
        bits[r] = b;
    }

    // Ranks: per-round counts packed 16 bits apart, then over warps.
    u32 start[R];
    const u32 wtot = bs_scan_rounds<R>(bits, lane, start);
    if (lane == 0) s_warp_tot[warp] = wtot;
    __syncthreads();                                                   // B1
    u32 warp_excl = 0, n = 0;
#pragma unroll
    for (int k = 0; k < BS_WARPS; ++k) {
        const u32 t = s_warp_tot[k];
        warp_excl += k < warp ? t : 0u;
        n += t;
    }

    // 2. Stage the tile's values in order.
#pragma unroll
    for (int r = 0; r < R; ++r) {
        u32 j = warp_excl + start[r];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if ((bits[r] >> i) & 1u) {
                const T e = bs_lane<T>(vec[r], i);
                if (MODE != BS_MODE_PACK) neg |= (u32)e;
                stage[j++] = e;
            }
        }
    }
    u32 sign_mask = SIGN;                     // the sign bits of a word's lanes
    if (MODE == BS_MODE_PACK) for (int k = 1; k < 32 / BITS; ++k) sign_mask |= SIGN << (k * BITS);
    const int any_neg = __syncthreads_or(ENC == 1 && (neg & sign_mask) != 0u);   // B2

    if (warp == 0) {
        // 3a. Publish, look back, publish the inclusive prefix.
        BsTail lm, ls;
        {
            const int p = (int)(n * (u32)W) - 32 + lane;
            u32 bit = 0;
            if (p >= 0) {
                const int j = p / W;
                bit = (((u32)stage[j] & (W >= 32 ? 0xffffffffu : ((1u << W) - 1u))) >> (p - j * W)) & 1u;
            }
            lm.bits = __ballot_sync(BS_FULL, bit);
            lm.len = min(n * (u32)W, 32u);
        }
        ls.bits = 0u; ls.len = 0u;
        if (SIGNS) {
            const int p = (int)n - 32 + lane;
            ls.bits = __ballot_sync(BS_FULL, p >= 0 ? (((u32)stage[p] >> (BITS - 1)) & 1u) : 0u);
            ls.len = min(n, 32u);
        }
        u64 P = 0;
        u32 pneg = 0;
        BsTail em = {0u, 0u}, es = {0u, 0u};
        const u64 own = (u64)n | (any_neg ? BS_NEG : 0ull);
        if (lane == 0)
            bs_st_desc(&desc[tile], (tile == 0 ? BS_INCL : BS_AGG) | own,
                       (u64)lm.bits | ((u64)ls.bits << 32));
        __syncwarp();
        if (tile > 0) {
            bs_lookback<W, SIGNS>(desc, tile, lane, P, pneg, em, es);
            if (lane == 0) {
                const BsTail im = bs_tail_cat(em, lm), is = bs_tail_cat(es, ls);
                bs_st_desc(&desc[tile], BS_INCL | ((pneg || any_neg) ? BS_NEG : 0ull) | (P + n),
                           (u64)im.bits | ((u64)is.bits << 32));
            }
        }
        if (lane == 0) {
            s_P = P; s_tail_m = em.bits; s_tail_s = es.bits;
            if (tile == n_tiles - 1) {
                const u64 total = P + n;
                const u32 status = ((pneg | (u32)any_neg) ? 1u : 0u) | (total > cap ? 2u : 0u);
                if (MODE != BS_MODE_MASKED) {
                    const u64 nch = (numel + (1ull << chunk_log2) - 1ull) >> chunk_log2;
                    if (off64) reinterpret_cast<u64*>(offsets_ptr)[nch] = total;
                    else reinterpret_cast<u32*>(offsets_ptr)[nch] = (u32)total;
                }
                reinterpret_cast<u32*>(status_ptr)[0] = status;
                reinterpret_cast<u64*>(status_ptr)[1] = total;
            }
        }
    } else {
        // 3b. The tile's stream as whole words, independent of where it lands.
        const u32 groups = (n + 31u) >> 5;
        if (ENC != 0) {
            for (u32 q = (u32)tid - 32u; q < groups; q += BS_THREADS - 32) {
                u32 words[BITS];
                const uint4* src = reinterpret_cast<const uint4*>(stage_w + q * BITS);
#pragma unroll
                for (int t = 0; t < BITS / 4; ++t) {
                    const uint4 v = src[t];
                    words[4 * t] = v.x; words[4 * t + 1] = v.y;
                    words[4 * t + 2] = v.z; words[4 * t + 3] = v.w;
                }
                bs_pack_group<BITS, W>(words, a_s + q * W);
            }
        }
        if (SIGNS) {
            for (u32 j = (u32)tid - 32u; j < groups * 32u; j += BS_THREADS - 32) {
                const u32 sb = j < n ? (((u32)stage[j] >> (BITS - 1)) & 1u) : 0u;
                const u32 word = __ballot_sync(BS_FULL, sb);
                if (lane == 0) s_signs[j >> 5] = word;
            }
        }
    }
    __syncthreads();                                                   // B3
    const u64 P = s_P;

    // 4a. Mask: one byte (bf16) or two (fp8) per vector, or a word per 8 lanes (fp32).
    if (MODE != BS_MODE_MASKED) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u64 g0 = tile_base + (u64)(warp * SEG + r * RS);
            const u64 g = g0 + (u64)(lane * V);
            if (V == 8) {
                if (g < numel) reinterpret_cast<u8*>(mask_ptr)[g >> 3] = (u8)bits[r];
            } else if (V == 16) {
                if (g + 8 < numel) reinterpret_cast<u16*>(mask_ptr)[g >> 4] = (u16)bits[r];
                else if (g < numel) reinterpret_cast<u8*>(mask_ptr)[g >> 3] = (u8)bits[r];
            } else {
                u32 part = bits[r] << ((lane & 7) * 4);
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) part |= __shfl_xor_sync(BS_FULL, part, o);
                const u64 wi = (g0 >> 5) + (u64)(lane >> 3);
                if ((lane & 7) == 0 && (wi << 5) < numel) reinterpret_cast<u32*>(mask_ptr)[wi] = part;
            }
        }
    }
    if (MODE == BS_MODE_RELU || MODE == BS_MODE_RELU2) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
            if (g >= numel) continue;
            uint4 yv = vec[r];
            if (MODE == BS_MODE_RELU2) {
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    const u32 e = (u32)bs_lane<T>(yv, i);
                    bs_set_lane<T>(yv, i, (T)bs_mul_round<FMT>(e, e));
                }
            }
            bs_store_vec<T>(reinterpret_cast<T*>(y_ptr), g, numel, y_aligned, yv);
        }
    }

    // 4b. Chunk offsets at the round starts that begin a chunk.
    if (MODE != BS_MODE_MASKED && lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u64 g0 = tile_base + (u64)(warp * SEG + r * RS);
            if (g0 < numel && (g0 & ((1ull << chunk_log2) - 1ull)) == 0ull) {
                const u64 v = P + warp_excl + start[r];    // lane 0: the round's first index
                if (off64) reinterpret_cast<u64*>(offsets_ptr)[g0 >> chunk_log2] = v;
                else reinterpret_cast<u32*>(offsets_ptr)[g0 >> chunk_log2] = (u32)v;
            }
        }
    }

    // 4c. Value stream (and sign plane), clipped to the capacity.
    const u64 a = P < cap ? P : cap;
    const u64 e = P + n < cap ? P + n : cap;
    const bool final_resp = (P < cap && P + n >= cap) || (tile == n_tiles - 1 && P + n < cap);
    bs_copy_stream<W>(reinterpret_cast<u32*>(values_ptr), ENC == 0 ? stage_w : a_s, a, e, s_tail_m,
                      final_resp);
    if (SIGNS)
        bs_copy_stream<1>(reinterpret_cast<u32*>(signs_ptr), s_signs, a, e, s_tail_s, final_resp);
}

// Fixed capacity: zero the value/sign words past the stored stream (the pack
// kernel writes every word up to and including the stream's last one).
extern "C" __global__ void bitsparse_zero_tail(u64 status_ptr, u64 cap, int w, u64 values_ptr,
                                               u64 values_words, int has_signs, u64 signs_ptr,
                                               u64 signs_words) {
    const u64 nnz = reinterpret_cast<const u64*>(status_ptr)[1];
    const u64 stored = nnz < cap ? nnz : cap;
    const u64 v0 = (stored * (u64)w + 31ull) >> 5, s0 = (stored + 31ull) >> 5;
    const u64 n = values_words > signs_words ? values_words : signs_words;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (i >= v0 && i < values_words) reinterpret_cast<u32*>(values_ptr)[i] = 0u;
        if (has_signs && i >= s0 && i < signs_words) reinterpret_cast<u32*>(signs_ptr)[i] = 0u;
    }
}
