// Packing: one pass over the dense input writes the mask, the chunk offsets
// and the value stream (and the sign plane) of format v1.
//
// A block takes a tile of 8 warps x R rounds x 32 lanes x one 16-byte vector
// (R = 2: 2048 fp32 / 4096 16-bit / 8192 fp8 elements; R is a template
// parameter so that the tile size can be tuned), tile = blockIdx.x: blocks
// are dispatched in index order, so every predecessor the look-back spins on
// has started (as in CUB's decoupled look-back). Per tile: mask bits per lane,
// packed warp scans of the per-round counts, a block scan over warps, and the
// tile's values compacted into shared memory. The global value offset comes
// from a decoupled look-back over tile descriptors.
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
            u64 c = f & BS_COUNT;
            u32 nb = (u32)(f >> 61) & 1u;
            const u64 cc = c < 32ull ? c : 32ull;
            BsTail m = {(u32)d[q].y, (u32)min(cc * (u64)W, 32ull)};
            BsTail s = {SIGNS ? (u32)(d[q].y >> 32) : 0u, SIGNS ? (u32)cc : 0u};
            const u32 incl = __ballot_sync(BS_FULL, st == 2u);
            const int first = incl ? __ffs(incl) - 1 : 32;
            if (lane > first) { c = 0; nb = 0; m.bits = m.len = 0u; s.bits = s.len = 0u; }
            // Ordered reduction: lane 0 is the nearest predecessor, higher lanes farther.
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 c2 = __shfl_down_sync(BS_FULL, c, o);
                const u32 n2 = __shfl_down_sync(BS_FULL, nb, o);
                BsTail m2, s2;
                m2.bits = __shfl_down_sync(BS_FULL, m.bits, o);
                m2.len = __shfl_down_sync(BS_FULL, m.len, o);
                s2.bits = __shfl_down_sync(BS_FULL, s.bits, o);
                s2.len = __shfl_down_sync(BS_FULL, s.len, o);
                if (lane + o < 32) { c += c2; nb |= n2; m = bs_tail_cat(m2, m); s = bs_tail_cat(s2, s); }
            }
            c = __shfl_sync(BS_FULL, c, 0);
            nb = __shfl_sync(BS_FULL, nb, 0);
            m.bits = __shfl_sync(BS_FULL, m.bits, 0); m.len = __shfl_sync(BS_FULL, m.len, 0);
            s.bits = __shfl_sync(BS_FULL, s.bits, 0); s.len = __shfl_sync(BS_FULL, s.len, 0);
            acc += c;
            ng |= nb;
            am = bs_tail_cat(m, am);
            as = bs_tail_cat(s, as);
            done = incl != 0u;
        }
        base -= 32 * Q;
    }
    P = acc; neg = ng; tm = am; ts = as;
}

// Write the words of stream bits [a*W, (a+cnt)*W) that this tile owns (see top).
// SIGNBIT: the 1-bit sign stream of the staged values instead of their codes.
template <int W, bool SIGNBIT, int BITS, typename T>
__device__ __forceinline__ void bs_write_stream(u32* out, const T* stage, u64 a, u64 cnt, u32 pred,
                                                bool final_resp) {
    const u32 VMASK = W >= 32 ? 0xffffffffu : ((1u << W) - 1u);
    const u64 base = a * (u64)W, end = base + cnt * (u64)W;
    const u64 wlo = base >> 5, whi = end >> 5;
    for (u64 wd = wlo + threadIdx.x; wd <= whi; wd += BS_THREADS) {
        const u64 lo = wd << 5;
        const bool full = (lo + 32u <= end) && (lo + 32u > base);
        const bool fin = final_resp && wd == whi && (end & 31u);
        if (!full && !fin) continue;
        const i64 L = (i64)lo - (i64)base;
        u64 acc = 0;
        if (cnt) {
            const i64 j0 = L > 0 ? L / W : 0;
            i64 j1 = (L + 31) / W;
            if (j1 > (i64)cnt - 1) j1 = (i64)cnt - 1;
            for (i64 j = j0; j <= j1; ++j) {
                const u32 v = SIGNBIT ? (((u32)stage[j] >> (BITS - 1)) & 1u) : ((u32)stage[j] & VMASK);
                acc |= (u64)v << (int)(j * W - L + 32);
            }
        }
        u32 word = (u32)(acc >> 32);
        if (L < 0) word |= pred >> (int)(32 + L);
        out[wd] = word;
    }
}

// Plain and masked packing are held to 4-6 resident blocks per SM (64 / 48
// registers, no spills): bytes in flight per SM is what bounds this kernel.
template <int FMT, int ENC, int MODE, int R>
__global__ void __launch_bounds__(BS_THREADS, (MODE == 0 || MODE == 3) ? (R >= 8 ? 4 : (R >= 4 ? 5 : 6)) : 1)
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

    __shared__ T stage[TILE];
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u64 s_P;
    __shared__ u32 s_tail_m, s_tail_s;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    ulonglong2* desc = reinterpret_cast<ulonglong2*>(scratch_ptr + 16);

    const u64 tile = blockIdx.x;
    const u64 tile_base = tile * (u64)TILE;
    const T* x = reinterpret_cast<const T*>(x_ptr);

    // 1. Load, transform, classify.
    uint4 vec[R];
    u32 bits[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
        vec[r] = g < numel ? bs_load_vec<T>(x, g, numel, x_aligned) : make_uint4(0, 0, 0, 0);
        u32 b = 0;
        if (MODE == BS_MODE_MASKED) {
            if (g < numel) {
                const u32 mw = bs_load_word(reinterpret_cast<const u8*>(mask_ptr), mask_len, g >> 5);
                b = (mw >> (u32)(g & 31u)) & VM;
                if (g + V > numel) b &= (1u << (u32)(numel - g)) - 1u;
            }
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                u32 e = (u32)bs_lane<T>(vec[r], i);
                if (MODE == BS_MODE_RELU || MODE == BS_MODE_RELU2) {
                    if (!bs_relu_keeps<FMT>(e)) { e = 0u; bs_set_lane<T>(vec[r], i, (T)0); }
                }
                b |= (e != 0u ? 1u : 0u) << i;
            }
        }
        bits[r] = b;
    }

    // 2. (The mask words and y are stored after the look-back, so that the
    //    publishing thread's release does not wait on them.)

    // 3. Scan: per-round counts packed 16 bits apart, then over warps.
    u32 start[R];
    const u32 wtot = bs_scan_rounds<R>(bits, lane, start);
    if (lane == 0) s_warp_tot[warp] = wtot;
    __syncthreads();
    u32 warp_excl = 0, n = 0;
#pragma unroll
    for (int k = 0; k < BS_WARPS; ++k) {
        const u32 t = s_warp_tot[k];
        warp_excl += k < warp ? t : 0u;
        n += t;
    }

    // 4. Stage the tile's values in order.
    u32 neg = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        u32 j = warp_excl + start[r];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if ((bits[r] >> i) & 1u) {
                const T e = bs_lane<T>(vec[r], i);
                neg |= (u32)e & SIGN;
                stage[j++] = e;
            }
        }
    }
    const int any_neg = __syncthreads_or(ENC == 1 && neg != 0u);

    // 5. Publish, look back, publish the inclusive prefix (warp 0).
    if (warp == 0) {
        BsTail lm, ls;
        {
            const i64 p = (i64)n * W - 32 + lane;
            u32 bit = 0;
            if (p >= 0) {
                const i64 j = p / W;
                bit = (((u32)stage[j] & (W >= 32 ? 0xffffffffu : ((1u << W) - 1u))) >> (int)(p - j * W)) & 1u;
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
    }
    __syncthreads();
    const u64 P = s_P;

    // 6a. Mask words: a round's 32*V bits are V words, one per group of 32/V
    //     lanes; and the dense relu output.
    if (MODE != BS_MODE_MASKED) {
        const int G = 32 / V;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            u32 part = bits[r] << ((lane % G) * V);
#pragma unroll
            for (int o = 1; o < G; o <<= 1) part |= __shfl_xor_sync(BS_FULL, part, o);
            const u64 g0 = tile_base + (u64)(warp * SEG + r * RS);
            const u64 wi = (g0 >> 5) + (u64)(lane / G);
            if (lane % G == 0 && (wi << 5) < numel) reinterpret_cast<u32*>(mask_ptr)[wi] = part;
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

    // 6b. Chunk offsets at the round starts that begin a chunk.
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

    // 7. Value stream (and sign plane), clipped to the capacity.
    const u64 a = P < cap ? P : cap;
    const u64 e = P + n < cap ? P + n : cap;
    const bool final_resp = (P < cap && P + n >= cap) || (tile == n_tiles - 1 && P + n < cap);
    bs_write_stream<W, false, BITS, T>(reinterpret_cast<u32*>(values_ptr), stage, a, e - a, s_tail_m,
                                       final_resp);
    if (SIGNS)
        bs_write_stream<1, true, BITS, T>(reinterpret_cast<u32*>(signs_ptr), stage, a, e - a, s_tail_s,
                                          final_resp);
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
