// Prototype (bench only, not used by the package): a pack in which every warp packs
// tiles of its own, with a warp-level decoupled look-back, and no block barrier in
// the tile loop. bench/pack_warp_proto.py compiles it after bitsparse_common.cuh and
// bitsparse_pack.cu (whose descriptors, edge records, grid barrier and epilogue it
// reuses), checks its planes byte for byte against bitsparse_pack's and
// times both. Plain packs (MODE_PACK) of raw and nosign streams only. Its parameter
// list is bitsparse_pack's, so abi.PackArgs launches it.
//
// Why (bench/NOTES.md, session 18): bitsparse_pack's tile is a whole block, so one
// warp's wait in the look-back holds seven others at the barrier after the fold
// (27 % of stall samples at bf16 0.9). Here a warp that waits holds only itself, and
// the SM's other warps (4 blocks of 8 at <= 64 registers) keep loading.
//
// A warp tile is R rounds x 32 lanes x one 16-byte vector (R = 8: 2048 bf16, 4096
// fp8, 1024 fp32 elements). Per tile: load every round; mask bits and ranks
// (bs_scan_rounds); publish the tile's count (AGG); issue the look-back loads; write
// the mask bytes and stage the stored values in the warp's shared memory; fold the
// look-back; publish the inclusive count (INCL); chunk offsets; the stream words that
// lie wholly inside the tile's bit range, each built from the staged values it holds
// (bs_stream_window: no assembled copy of the stream); the tile's edge record for the
// epilogue's stitch.

// The prototype's look-back (bitsparse_pack's until session 27): a warp reads
// BS_LB_WINDOWS windows of 32 count descriptors in one round trip.
#define BS_LB_WINDOWS 4
#define BS_LB_SPAN (32 * BS_LB_WINDOWS)

// Load a warp's windows: lane l of window q holds tile nearest - l - 32 q
// (tiles before 0 read as an inclusive zero). Issued before the tile stages
// its values, so that the round trip overlaps that work.
__device__ __forceinline__ void pw_lookback_load(const u64* desc, i64 nearest, int lane,
                                                 u64 (&d)[BS_LB_WINDOWS]) {
#pragma unroll
    for (int q = 0; q < BS_LB_WINDOWS; ++q) {
        const i64 j = nearest - lane - 32 * q;
        d[q] = j >= 0 ? bs_ld_u64(&desc[j]) : BS_INCL;
    }
}

// Fold a warp's loaded windows, nearest first, up to and including the first
// inclusive descriptor: its count sum, whether one was found, and the OR of
// the nosign flags. Waits (spins) for descriptors not yet published.
__device__ __forceinline__ void pw_lookback_fold(const u64* desc, i64 nearest, int lane,
                                                 u64 (&d)[BS_LB_WINDOWS], u64& sum, bool& found,
                                                 u32& neg) {
    u64 acc = 0;
    u32 ng = 0;
    bool done = false;
#pragma unroll
    for (int q = 0; q < BS_LB_WINDOWS; ++q) {
        if (done) break;
        const i64 j = nearest - lane - 32 * q;
        while (__any_sync(BS_FULL, (d[q] >> 62) == 0ull)) {
            if ((d[q] >> 62) == 0ull) {
                __nanosleep(32);
                d[q] = bs_ld_u64(&desc[j]);
            }
        }
        const u64 c = d[q] & BS_COUNT;
        const u32 incl = __ballot_sync(BS_FULL, (d[q] >> 62) == 2ull);
        const int first = incl ? __ffs(incl) - 1 : 32;
        const bool use = lane <= first;          // lane 0 is the nearest predecessor
        // Aggregates are at most a tile each (32 bits suffice); the one
        // inclusive descriptor, if any, adds its 64-bit prefix.
        acc += bs_warp_sum((use && lane != first) ? (u32)c : 0u);
        if (incl) acc += __shfl_sync(BS_FULL, c, first);
        ng |= bs_warp_or(use ? (u32)(d[q] >> 61) & 1u : 0u);
        done = incl != 0u;
    }
    sum = acc; found = done; neg = ng;
}

#ifndef PW_MIN_BLOCKS
#define PW_MIN_BLOCKS 4
#endif

template <int FMT, int ENC, int R>
__global__ void __launch_bounds__(BS_THREADS, PW_MIN_BLOCKS)
bitsparse_pack_warp(u64 x_ptr, u64 numel, int x_aligned,
                    u64 mask_ptr, u64 mask_len,
                    u64 offsets_ptr, int off64, int chunk_log2,
                    u64 values_ptr, u64 signs_ptr, u64 cap,
                    u64 y_ptr, int y_aligned,
                    u64 scratch_ptr, u64 status_ptr, u64 n_tiles,
                    u64 zero_values_words, u64 zero_signs_words, u64 slot_ptr,
                    u64 u_ptr, int u_aligned) {   // RELU_GATED's u: unused here
    static_assert(ENC != 2, "prototype: raw and nosign streams only");
    typedef typename Fmt<FMT>::T T;
    const int BITS = Fmt<FMT>::BITS;
    const int G = 32 / BITS;
    const int V = 16 / (int)sizeof(T);
    const int RS = 32 * V;
    const int TILE = RS * R;
    const int W = ENC == 0 ? BITS : BITS - 1;
    const int GUARD = 16;                       // zeroed slots past the stored values
    const int STRIDE = (TILE + GUARD + 7) & ~7; // elements per warp's stage (16-byte rows)
    const u32 GM = G == 32 ? 0xffffffffu : ((1u << G) - 1u);

    extern __shared__ __align__(16) u32 pw_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T* stage = reinterpret_cast<T*>(pw_smem) + warp * STRIDE;
    u64* cdesc = const_cast<u64*>(bs_count_desc(scratch_ptr));
    u64* ticket = reinterpret_cast<u64*>(scratch_ptr);
    const T* x = reinterpret_cast<const T*>(x_ptr);
    const u32 cmask = (1u << chunk_log2) - 1u;

    for (;;) {
        u64 t = 0;
        if (lane == 0) t = atomicAdd(reinterpret_cast<unsigned long long*>(ticket), 1ull);
        t = __shfl_sync(BS_FULL, t, 0);
        if (t >= n_tiles) break;
        const u64 base = t * (u64)TILE;
        const u64 left = numel - base;
        const u32 rem = left < (u64)TILE ? (u32)left : (u32)TILE;

        uint4 vec[R];
        if (x_aligned && rem == (u32)TILE) {
            const uint4* p = reinterpret_cast<const uint4*>(x + base) + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) vec[r] = p[r * 32];
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 o = (u32)(r * RS + lane * V);
                vec[r] = o < rem ? bs_load_vec<T>(x, base + o, numel, x_aligned)
                                 : make_uint4(0, 0, 0, 0);
            }
        }

        u32 bits[R], start[R], neg = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            bits[r] = bs_vec_nonzero<BITS>(vec[r]);         // loads past numel are zeros
            neg |= (vec[r].x | vec[r].y | vec[r].z | vec[r].w) & bs_spread_signs<BITS>(GM);
        }
        const u32 n = bs_scan_rounds<R, V>(bits, lane, start);
        const bool tneg = __any_sync(BS_FULL, ENC == 1 && neg != 0u);
        if (lane == 0)
            bs_st_u64(&cdesc[t], (t == 0 ? BS_INCL : BS_AGG) | (tneg ? BS_NEG : 0ull) | n);

        // The look-back's first windows, in flight while the mask and stage are written.
        u64 lb[BS_LB_WINDOWS];
        if (t > 0) pw_lookback_load(cdesc, (i64)t - 1, lane, lb);

        bs_store_mask<V, R>(reinterpret_cast<u8*>(mask_ptr) + (base >> 3), bits, 0u, rem, lane);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            T* p = stage + start[r];
#pragma unroll
            for (int i = 0; i < V; ++i)
                if ((bits[r] >> i) & 1u) *p++ = bs_lane<T>(vec[r], i);
        }
        if (lane < GUARD) stage[n + lane] = (T)0;
        __syncwarp();

        u64 P = 0;
        u32 pneg = 0;
        if (t > 0) {
            for (i64 nearest = (i64)t - 1;; nearest -= BS_LB_SPAN) {
                if (nearest != (i64)t - 1) pw_lookback_load(cdesc, nearest, lane, lb);
                u64 sum;
                bool found;
                u32 ng;
                pw_lookback_fold(cdesc, nearest, lane, lb, sum, found, ng);
                P += sum;
                pneg |= ng;
                if (found) break;
            }
        }
        const u64 total = P + n;
        if (lane == 0) {
            if (t > 0) bs_st_u64(&cdesc[t], BS_INCL | ((pneg || tneg) ? BS_NEG : 0ull) | total);
            if (t == n_tiles - 1)
                bs_write_total<true>(total, pneg | (tneg ? 1u : 0u), cap, numel, chunk_log2, off64,
                                     offsets_ptr, status_ptr, slot_ptr);
            // Chunk offsets at the round starts that begin a chunk (lane 0's start[r]
            // is the warp's count before round r).
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 o0 = (u32)(r * RS);
                if (o0 < rem && (((u32)base + o0) & cmask) == 0u) {
                    const u64 v = P + start[r];
                    const u64 c = (base + o0) >> chunk_log2;
                    if (off64) reinterpret_cast<u64*>(offsets_ptr)[c] = v;
                    else reinterpret_cast<u32*>(offsets_ptr)[c] = (u32)v;
                }
            }
        }

        // Stream words wholly inside the stored part of the tile's bit range.
        const u64 a = P < cap ? P : cap;
        const u64 e = total < cap ? total : cap;
        const u64 B0 = a * (u64)W, B1 = e * (u64)W;
        const u64 k0 = (B0 + 31ull) >> 5, k1 = B1 >> 5;
        u32* out = reinterpret_cast<u32*>(values_ptr);
        for (u64 k = k0 + lane; k < k1; k += 32) out[k] = bs_stream_window<W>(stage, (u32)((k << 5) - B0));
        if (lane == 0) {
            const u32 L = (u32)(e - a) * (u32)W;       // stored bits (a == P whenever L > 0)
            uint2 m = make_uint2(0u, 0u);
            if (L >= 32u)
                m = make_uint2(bs_stream_window<W>(stage, 0u), bs_stream_window<W>(stage, L - 32u));
            else if (L > 0u) {
                const u32 f = bs_stream_window<W>(stage, 0u) & ((1u << L) - 1u);
                m = make_uint2(f, f << (32u - L));
            }
            bs_edges(scratch_ptr, n_tiles)[t] = make_uint4(m.x, m.y, 0u, 0u);
        }
        __syncwarp();          // the stage is rewritten by the next tile
    }
    bs_grid_barrier(scratch_ptr);
    bs_pack_epilogue(scratch_ptr, n_tiles, cap, (u32)W, values_ptr, false, signs_ptr, status_ptr,
                     zero_values_words, zero_signs_words);
}
