// Packing: one pass over the dense input writes the mask, the chunk offsets
// and the value stream (and the sign plane) of format v1; once every tile is
// done (a grid barrier) the same kernel fills the stream words shared by two
// tiles and, at a fixed capacity, zeros the value slots past the stored ones.
//
// A tile is 8 warps x R rounds x 32 lanes x one 16-byte vector (R = 4,
// abi.PACK_ROUNDS, every mode: 4096 fp32 / 8192 16-bit / 16384 fp8 elements). The
// kernel is persistent: as many blocks as fit on the device at once, each
// taking tiles in order from a counter, one tile ahead of the one it works on,
// so that it can load its next tile while it waits for the current one's
// offset. A tile only ever waits for lower tiles, and those are held by blocks
// that run. The phases of a tile are listed above the kernel; the global value
// offset comes from a decoupled look-back over tile and group descriptors. The
// launch is cooperative (every block resident at once), which the closing grid
// barrier needs: the shared words and the tail are written after it, by all blocks.
//
// Value streams are written as whole 32-bit words with plain stores. A tile
// writes the words that lie wholly inside its bit range; a word that holds
// bits of several tiles (or the stream's last, partly filled word) is written
// once after the barrier (bs_stitch_word) from the first and last 32 bits that
// every tile leaves in scratch. So no tile waits for another tile's values, no
// atomics touch the output and padding bits come out zero.
//
// Scratch (zeroed before launch): the tile counter (8 bytes) and the barrier's
// count of arrived blocks (8 bytes); one 8-byte count
// descriptor per tile (padded to an even number) {2-bit state | nosign-
// violation bit | 61-bit count}, state AGG (this tile alone, published right
// after the tile's popcount scan) then INCL (the whole prefix up to and
// including this tile), written and read as single 8-byte accesses; then
// one 16-byte edge record per tile {first 32 stored stream bits, last 32
// stored stream bits (top-aligned), the same two for the sign plane}; then one
// 8-byte group descriptor per 32 tiles (see BS_GROUP below).
// Status area (in the packed allocation): u32 status, u32 pad, u64 nnz; the same
// 16 bytes go to a pinned host slot where the caller names one (slot_ptr, else 0).

#define BS_AGG (1ull << 62)
#define BS_INCL (2ull << 62)
#define BS_NEG (1ull << 61)
#define BS_COUNT ((1ull << 61) - 1ull)


__device__ __forceinline__ const u64* bs_count_desc(u64 scratch_ptr) {
    return reinterpret_cast<const u64*>(scratch_ptr + 16);
}
__device__ __forceinline__ uint4* bs_edges(u64 scratch_ptr, u64 n_tiles) {
    return reinterpret_cast<uint4*>(scratch_ptr + 16 + 8 * ((n_tiles + 1) & ~1ull));
}

// Group descriptors: one per 32 consecutive tiles (BS_GROUP tiles), which every tile
// of the group adds its count to with one atomic after publishing its own: bits 48..
// count the tiles arrived, bits 40..47 those with a nosign violation, bits 0..39 the
// sum of their counts (at most 32 x 16384). A group whose 32 tiles have arrived stands
// for them all, so a look-back over a persistent grid's few hundred tiles in flight
// reads one window of its own group's tiles and one of groups, not every tile.
#define BS_GROUP_LOG2 5
#define BS_GROUP (1 << BS_GROUP_LOG2)
#define BS_G_ARRIVED (1ull << 48)
#define BS_G_NEG (1ull << 40)
#define BS_G_COUNT ((1ull << 40) - 1ull)

__device__ __forceinline__ u64* bs_group_desc(u64 scratch_ptr, u64 n_tiles) {
    return reinterpret_cast<u64*>(scratch_ptr + 16 + 8 * ((n_tiles + 1) & ~1ull) + 16 * n_tiles);
}

// The look-back's loads, issued an iteration stage before the fold (their round trip
// overlaps the staging) into lb[0..1]. Warp 0: lane l < tile % 32 reads the descriptor
// of tile - 1 - l, its group's tiles before it. Warp 1: lane l reads group h = g - l
// (g: the nearest group to read) and the descriptor of its last tile; a group before
// group 0 reads as an inclusive zero.
__device__ __forceinline__ void bs_lookback_load(const u64* desc, const u64* gdesc, u64 tile,
                                                 i64 g, int warp, int lane, u64 (&lb)[2]) {
    if (warp == 0) {
        lb[0] = (u32)lane < (u32)(tile & (BS_GROUP - 1)) ? bs_ld_u64(&desc[tile - 1 - lane]) : 0ull;
    } else if (warp == 1) {
        const i64 h = g - lane;
        lb[0] = h >= 0 ? bs_ld_u64(&gdesc[h]) : 0ull;
        lb[1] = h >= 0 ? bs_ld_u64(&desc[(h << BS_GROUP_LOG2) + BS_GROUP - 1]) : BS_INCL;
    }
}

// Warp 0's fold over its group's tiles before `tile`, nearest first, up to and
// including the first inclusive descriptor: their count, whether an inclusive one
// was among them, the OR of their nosign flags. Waits (spins) for descriptors not yet
// published.
__device__ __forceinline__ void bs_fold_tiles(const u64* desc, u64 tile, int lane, u64 d,
                                              u64& sum, bool& found, u32& neg) {
    const bool mine = (u32)lane < (u32)(tile & (BS_GROUP - 1));
    while (__any_sync(BS_FULL, mine && (d >> 62) == 0ull)) {
        if (mine && (d >> 62) == 0ull) {
            __nanosleep(32);
            d = bs_ld_u64(&desc[tile - 1 - lane]);
        }
    }
    const u64 c = d & BS_COUNT;
    const u32 incl = __ballot_sync(BS_FULL, mine && (d >> 62) == 2ull);
    const int first = incl ? __ffs(incl) - 1 : 32;
    const bool use = mine && lane <= first;
    // Aggregates are at most a tile each (32 bits suffice); the one inclusive
    // descriptor, if any, adds its 64-bit prefix.
    sum = bs_warp_sum((use && lane != first) ? (u32)c : 0u) + (incl ? __shfl_sync(BS_FULL, c, first) : 0ull);
    neg = bs_warp_or(use ? (u32)(d >> 61) & 1u : 0u);
    found = incl != 0u;
}

// Warp 1's fold over whole groups g, g - 1, ..., g - 31, nearest first: up to the
// first whose last tile is inclusive (its prefix ends the sum), the complete groups'
// counts (waiting for groups whose tiles have not all arrived).
__device__ __forceinline__ void bs_fold_groups(const u64* gdesc, i64 g, int lane, u64 (&lb)[2],
                                               u64& sum, bool& found, u32& neg) {
    const i64 h = g - lane;
    const u32 bound = __ballot_sync(BS_FULL, (lb[1] >> 62) == 2ull);
    const int first = bound ? __ffs(bound) - 1 : 32;
    const bool whole = lane < first;          // a group wholly inside the sum
    u64 gd = lb[0];
    while (__any_sync(BS_FULL, whole && (gd >> 48) < (u64)BS_GROUP)) {
        if (whole && (gd >> 48) < (u64)BS_GROUP) {
            __nanosleep(32);
            gd = bs_ld_u64(&gdesc[h]);
        }
    }
    // A group's count fits 20 bits: 32 of them fit the 32-bit sum.
    sum = bs_warp_sum(whole ? (u32)(gd & BS_G_COUNT) : 0u)
        + (bound ? __shfl_sync(BS_FULL, lb[1] & BS_COUNT, first) : 0ull);
    neg = bs_warp_or(whole ? (((gd >> 40) & 0xffull) != 0ull ? 1u : 0u)
                           : (lane == first ? (u32)(lb[1] >> 61) & 1u : 0u));
    found = bound != 0u;
}

// 32 bits of a tile's own stream starting at bit p: of an LSB-first word stream
// (STREAM: the sign plane; or raw values, W = their width), or built from the staged
// values (nosign, signplane: their low W bits back to back). Every window read lies
// inside the stored bits (bits past them are shifted out or masked off), so what the
// stage holds past its values never shows.
template <int W, bool STREAM, typename T>
__device__ __forceinline__ u32 bs_bits_at(const T* stage, u32 p) {
    if (STREAM || W == 8 * (int)sizeof(T)) {
        const u32* A = reinterpret_cast<const u32*>(stage);
        return bs_funnel_r(A[p >> 5], A[(p >> 5) + 1], p & 31u);
    }
    return bs_stream_window<W>(stage, p);
}

// Stream words wholly inside bits [a*W, e*W): a tile's own stream, which starts at
// bit a*W, shifted into place and written coalesced.
template <int W, bool STREAM, typename T>
__device__ __forceinline__ void bs_copy_inner(u32* out, const T* stage, u64 a, u64 e) {
    const u64 B0 = a * (u64)W, B1 = e * (u64)W;
    const u64 k0 = (B0 + 31u) >> 5, k1 = B1 >> 5;
    if (k1 <= k0) return;
    const u32 off = (u32)((k0 << 5) - B0);
    for (u32 i = threadIdx.x; i < (u32)(k1 - k0); i += BS_THREADS)
        out[k0 + i] = bs_bits_at<W, STREAM>(stage, off + 32u * i);
}

// The first and last 32 bits of the L stored bits of a tile's stream (zero past L;
// the last ones top-aligned), for bs_stitch_word.
template <int W, bool STREAM, typename T>
__device__ __forceinline__ uint2 bs_stream_edges(const T* stage, u32 L) {
    if (L == 0u) return make_uint2(0u, 0u);
    const u32 f = bs_bits_at<W, STREAM>(stage, 0u);
    if (L < 32u) return make_uint2(f & ((1u << L) - 1u), f << (32u - L));
    return make_uint2(f, bs_bits_at<W, STREAM>(stage, L - 32u));
}

// 32 / BITS mask bits of a 16-byte vector of a plain pack (element k -> bit k).
template <int BITS> __device__ __forceinline__ u32 bs_vec_nonzero(const uint4& v) {
    return bs_quad_nonzero<BITS>(v.x, v.y, v.z, v.w);
}

// relu_pack(square=True)'s output: every element squared, rounded as bs_mul_round
// does; a word at a time in float32 (bs_word_f32) unless a square is NaN or the
// elements are fp8, then per element. The per-element path is out of line where
// it is the rare one (it would otherwise hold registers the tile loop needs).
template <int FMT> __device__ __forceinline__ uint4 bs_square_vec_exact(uint4 v) {
    typedef typename Fmt<FMT>::T T;
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) {
        const u32 e = (u32)bs_lane<T>(v, i);
        bs_set_lane<T>(v, i, (T)bs_mul_round<FMT>(e, e));
    }
    return v;
}
template <int FMT> __device__ __noinline__ uint4 bs_square_vec_fallback(uint4 v) {
    return bs_square_vec_exact<FMT>(v);
}
template <int FMT> __device__ __forceinline__ uint4 bs_square_vec(const uint4& v) {
    if constexpr (Fmt<FMT>::BITS == 8 || BS_FUSED_PER_ELEMENT) {
        return bs_square_vec_exact<FMT>(v);
    } else {
        bool nan = false;
        const uint4 y = make_uint4(bs_word_f32<FMT>(v.x, 0u, 0u, BsSquare(), nan),
                                   bs_word_f32<FMT>(v.y, 0u, 0u, BsSquare(), nan),
                                   bs_word_f32<FMT>(v.z, 0u, 0u, BsSquare(), nan),
                                   bs_word_f32<FMT>(v.w, 0u, 0u, BsSquare(), nan));
        return nan ? bs_square_vec_fallback<FMT>(v) : y;
    }
}

// The last tile's news: the stored count and the status word (nosign violation,
// overflow) into the status area, the offsets' last entry (OFFSETS: not a masked pack),
// and the same two words into the host's pinned slot where the caller names one: known
// to the host before the grid's last tiles and epilogue are done. Each slot word lands
// whole; the host reads the slot once neither holds its sentinel. The fence pushes the
// stores out to the system now, not at the kernel's end.
template <bool OFFSETS>
__device__ __forceinline__ void bs_write_total(u64 total, u32 neg, u64 cap, u64 numel,
                                               int chunk_log2, int off64, u64 offsets_ptr,
                                               u64 status_ptr, u64 slot_ptr) {
    const u32 status = (neg ? 1u : 0u) | (total > cap ? 2u : 0u);
    if (OFFSETS) {
        const u64 nch = (numel + (1ull << chunk_log2) - 1ull) >> chunk_log2;
        if (off64) reinterpret_cast<u64*>(offsets_ptr)[nch] = total;
        else reinterpret_cast<u32*>(offsets_ptr)[nch] = (u32)total;
    }
    reinterpret_cast<u32*>(status_ptr)[0] = status;
    reinterpret_cast<u64*>(status_ptr)[1] = total;
    if (slot_ptr != 0ull) {
        reinterpret_cast<volatile u64*>(slot_ptr)[1] = total;
        reinterpret_cast<volatile u32*>(slot_ptr)[0] = status;
        __threadfence_system();
    }
}

// How many of the TILE elements of the tile at tile_base exist (all but the last tile's).
template <int TILE>
__device__ __forceinline__ u32 bs_tile_rem(u64 numel, u64 tile_base) {
    const u64 left = numel - tile_base;
    return left < (u64)TILE ? (u32)left : (u32)TILE;
}

// A warp's mask bits of R rounds (32 V-element vectors each, the first at element
// `first` of a tile whose mask bytes start at mask_tile, `rem` elements of which
// exist): a byte (bf16) or two (fp8) per lane and round, or a word per 8 lanes (fp32).
template <int V, int R>
__device__ __forceinline__ void bs_store_mask(u8* mask_tile, const u32 (&bits)[R], u32 first,
                                              u32 rem, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 o0 = first + (u32)(r * 32 * V);
        const u32 o = o0 + (u32)(lane * V);
        if (V == 8) {
            if (o < rem) mask_tile[o >> 3] = (u8)bits[r];
        } else if (V == 16) {
            if (o + 8u < rem) reinterpret_cast<u16*>(mask_tile)[o >> 4] = (u16)bits[r];
            else if (o < rem) mask_tile[o >> 3] = (u8)bits[r];
        } else {
            u32 part = bits[r] << ((lane & 7) * 4);
#pragma unroll
            for (int q = 1; q < 8; q <<= 1) part |= __shfl_xor_sync(BS_FULL, part, q);
            const u32 wi = (o0 >> 5) + (u32)(lane >> 3);
            if ((lane & 7) == 0 && (wi << 5) < rem) reinterpret_cast<u32*>(mask_tile)[wi] = part;
        }
    }
}

// The stream words the tiles leave out: those holding bits of several tiles,
// and the stored stream's last word when it is partly filled. Index t
// (0 <= t <= n_tiles; t = n_tiles stands for the stored end) writes the word
// holding tile t's first bit when that bit is not word-aligned and no earlier
// tile starts inside the same word. Tile t - 1 then covers the word's start
// (its last bits come from its edge record), and tiles t, t+1, ... that start
// inside the word add their first bits. Runs after the grid barrier: the
// descriptors and edges of other blocks are read from L2 (__ldcg), never from
// a stale L1 line.
__device__ __forceinline__ void bs_stitch_word(u64 scratch_ptr, u64 n_tiles, u64 cap, u32 w,
                                               u64 values_ptr, bool has_signs, u64 signs_ptr,
                                               u64 t) {
    const u64* cdesc = bs_count_desc(scratch_ptr);
    const uint4* edges = bs_edges(scratch_ptr, n_tiles);
    // First stored value of tile i (clipped to the capacity); i = n_tiles: the end.
    auto first = [&](u64 i) -> u64 {
        const u64 p = i == 0 ? 0ull : (__ldcg(&cdesc[i - 1]) & BS_COUNT);
        return p < cap ? p : cap;
    };
    const u64 s = first(t), sp = t > 0 ? first(t - 1) : 0ull, end = first(n_tiles);
    for (int plane = 0; plane < 1 + (has_signs ? 1 : 0); ++plane) {
        const u64 W = plane == 0 ? (u64)w : 1ull;
        const u64 b0 = s * W;
        const u64 lo = b0 & ~31ull;
        if ((b0 & 31u) == 0u || sp * W > lo) continue;
        const uint4 pe = __ldcg(&edges[t - 1]);     // t >= 1: b0 > 0
        u32 word = (plane == 0 ? pe.y : pe.w) >> (32u - (u32)(b0 - lo));
        // Tiles from the stored end on hold nothing; a run of empty tiles
        // inside one word is walked through (rare: a tile has 4096+ elements).
        for (u64 i = t; i < n_tiles; ++i) {
            const u64 bi = first(i) * W;
            if (bi >= lo + 32u || first(i) >= end) break;
            const uint4 ei = __ldcg(&edges[i]);
            word |= (plane == 0 ? ei.x : ei.z) << (u32)(bi - lo);
        }
        reinterpret_cast<u32*>(plane == 0 ? values_ptr : signs_ptr)[b0 >> 5] = word;
    }
}

// Wait until every block of the grid has arrived (all are resident: the launch
// is cooperative). A block's writes before it arrives are visible to every
// block after the wait.
__device__ __forceinline__ void bs_grid_barrier(u64 scratch_ptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* arrived = reinterpret_cast<u64*>(scratch_ptr + 8);
        __threadfence();
        atomicAdd(reinterpret_cast<unsigned long long*>(arrived), 1ull);
        while (bs_ld_u64(arrived) < (u64)gridDim.x) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}

// After the barrier, over the whole grid: the shared stream words, then (a
// fixed capacity: values_words > 0) zeros in the value / sign words past the
// stored stream. The two sets of words are disjoint: a stitched word lies below
// ceil(stored * w / 32). Not inlined: the tile loop's register allocation stays
// as it was (inlined, an fp8 pack spilled 8 bytes).
__device__ __noinline__ void bs_pack_epilogue(u64 scratch_ptr, u64 n_tiles, u64 cap, u32 w,
                                                 u64 values_ptr, bool has_signs, u64 signs_ptr,
                                                 u64 status_ptr, u64 values_words,
                                                 u64 signs_words) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    for (u64 t = first; t <= n_tiles; t += stride)
        bs_stitch_word(scratch_ptr, n_tiles, cap, w, values_ptr, has_signs, signs_ptr, t);
    if (values_words == 0ull && signs_words == 0ull) return;     // not a fixed capacity
    const u64 nnz = __ldcg(reinterpret_cast<const u64*>(status_ptr) + 1);
    const u64 stored = nnz < cap ? nnz : cap;
    const u64 v0 = (stored * (u64)w + 31ull) >> 5, s0 = (stored + 31ull) >> 5;
    for (u64 i = v0 + first; i < values_words; i += stride) reinterpret_cast<u32*>(values_ptr)[i] = 0u;
    if (has_signs)
        for (u64 i = s0 + first; i < signs_words; i += stride) reinterpret_cast<u32*>(signs_ptr)[i] = 0u;
}

// Shared memory of bitsparse_pack (dynamic, sized by the host with the same
// formula, abi.pack_smem_bytes): two buffers, so that a tile's values
// stay while the next tile is staged; each holds the staged values (the value
// stream's words are built from them as they are written out), the sign plane and
// the tile's count, nosign flag and round offsets (rel: warp-relative rank of each
// warp's round starts).
template <int FMT, int ENC, int R> struct __align__(16) BsPackBuf {
    enum {
        BITS = Fmt<FMT>::BITS,
        TILE = BS_WARPS * R * 32 * (16 / (int)sizeof(typename Fmt<FMT>::T)),
        W = ENC == 0 ? BITS : BITS - 1,
        SWORDS = TILE * BITS / 32 + 4,            // staged values (+ guard words: windows read past them)
        GWORDS = ENC == 2 ? TILE / 32 + 4 : 1,    // sign plane
    };
    u32 stage[SWORDS];
    u32 signs[GWORDS];
    u32 n, neg;
    u32 rel[BS_WARPS][R];
};

// A block's tiles t_0, t_1, ... (taken from the counter, see the top) go
// through a software pipeline of three stages, so that no tile waits for its
// offset:
//   A(t)  mask bits and nosign check per 16-byte vector (loaded during the
//         previous iteration), relu_pack's output, packed warp scans; B1;
//         publish t's count.
//   B(t)  stage t's values in shared memory buffer k % 2 and write its mask
//         bytes, none of which needs its offset; load the next tile's
//         vectors; (signplane: B2, t's sign plane from the staged values).
//   C(t)  warps 0 and 1 fold the look-back (loaded at the start of the
//         iteration); B3; the block takes the offset and publishes t's
//         inclusive count; chunk offsets, the stream words inside t's range
//         built from the staged values (bs_copy_inner), the edge record for
//         bs_stitch_word.
// Iteration k issues the look-back loads of t_{k-1}, runs B(t_k), C(t_{k-1})
// and A(t_{k+1}): a count is published about an iteration before its
// successors load it (fewer spins on unpublished counts: issuing the loads one
// stage earlier measured 5 % slower, bench/NOTES.md), and B's work hides the
// loads' round trip.
#ifndef BS_PACK_BLOCKS
#define BS_PACK_BLOCKS 4         // a plain or masked pack's blocks per SM (64 registers)
#endif
// The tile a block takes goes to L2 (bs_l2_prefetch) about an iteration before its
// loads: 16- and 32-bit formats (fp8's pack measured 1-3 % slower with it).
#ifndef BS_PACK_PREFETCH
#define BS_PACK_PREFETCH 1
#endif
#ifndef BS_PACK_FUSED_BLOCKS
#define BS_PACK_FUSED_BLOCKS 3   // relu_pack's blocks per SM (72 registers)
#endif
template <int FMT, int ENC, int MODE, int R>
__global__ void __launch_bounds__(BS_THREADS, (MODE == 0 || MODE == 3) ? BS_PACK_BLOCKS : BS_PACK_FUSED_BLOCKS)
bitsparse_pack(u64 x_ptr, u64 numel, int x_aligned,
               u64 mask_ptr, u64 mask_len,
               u64 offsets_ptr, int off64, int chunk_log2,
               u64 values_ptr, u64 signs_ptr, u64 cap,
               u64 y_ptr, int y_aligned,
               u64 scratch_ptr, u64 status_ptr, u64 n_tiles,
               u64 zero_values_words, u64 zero_signs_words, u64 slot_ptr,
               u64 u_ptr, int u_aligned) {
    typedef typename Fmt<FMT>::T T;
    typedef BsPackBuf<FMT, ENC, R> Buf;
    const int BITS = Fmt<FMT>::BITS;
    const int G = 32 / BITS;                  // elements per 32-bit word
    const int V = 16 / (int)sizeof(T);        // elements per 16-byte vector
    const int RS = 32 * V;                    // elements per warp round
    const int SEG = RS * R;                   // elements per warp
    const int TILE = SEG * BS_WARPS;
    const int W = ENC == 0 ? BITS : BITS - 1; // value-stream width
    const bool SIGNS = ENC == 2;
    const u32 VM = V == 32 ? 0xffffffffu : ((1u << V) - 1u);
    const u32 GM = G == 32 ? 0xffffffffu : ((1u << G) - 1u);

    extern __shared__ __align__(16) u32 bs_dyn_smem[];
    Buf* bufs = reinterpret_cast<Buf*>(bs_dyn_smem);
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u32 s_warp_neg[BS_WARPS];
    // Warps 0 and 1's folds, by the parity of the iteration: a C with no A since the
    // last C (a block's last iteration) writes while the last C's readers may still read.
    __shared__ u64 s_lb_sum[2][2];
    __shared__ u32 s_lb_flag[2][2];
    __shared__ u64 s_first, s_next;   // tiles the block took: its first, the one to load next
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < 2u * (u32)sizeof(Buf)) __trap();   // the host's size formula disagrees
    }

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u64* cdesc = const_cast<u64*>(bs_count_desc(scratch_ptr));
    u64* gdesc = bs_group_desc(scratch_ptr, n_tiles);
    const T* x = reinterpret_cast<const T*>(x_ptr);
    const u64 lane_off = (u64)(warp * SEG + lane * V);
    uint4 vec[R];                 // this thread's vectors of the classified tile
    u32 bits[R], start[R];        // their mask bits and warp-relative ranks
    u32 warp_excl = 0, n = 0, any_neg = 0;
    u64 lb[2];                    // look-back loads of the tile awaiting C (warps 0 and 1)

    // Issue the loads of a tile's vectors, all rounds in flight.
    auto load = [&](u64 tile) {
        const u64 base = tile * (u64)TILE;
        if (x_aligned && base + (u64)TILE <= numel) {     // a whole tile: no guards
            const uint4* p = reinterpret_cast<const uint4*>(x + base) + (warp * (SEG / V) + lane);
#pragma unroll
            for (int r = 0; r < R; ++r) vec[r] = p[r * 32];
            return;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u64 g = tile * (u64)TILE + lane_off + (u64)(r * RS);
            vec[r] = g < numel ? bs_load_vec<T>(x, g, numel, x_aligned) : make_uint4(0, 0, 0, 0);
        }
    };

    // relu_pack's y (y_ptr 0: planes only): offsets inside the tile are 32-bit, and
    // rem is how many of its elements exist. RELU_GATED: y = relu(x) u, u read here a
    // vector at a time, not with the tile's loads (R more vectors held would cost
    // occupancy).
    auto store_y = [&](u64 tile) {
        if (MODE == BS_MODE_PACK || MODE == BS_MODE_MASKED || y_ptr == 0ull) return;
        const u64 tile_base = tile * (u64)TILE;
        const u32 rem = bs_tile_rem<TILE>(numel, tile_base);
        T* y_tile = reinterpret_cast<T*>(y_ptr) + tile_base;
        const bool whole = y_aligned && rem == (u32)TILE
                           && (MODE != BS_MODE_RELU_GATED || u_aligned);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 o = (u32)lane_off + (u32)(r * RS);
            if (o >= rem) continue;
            uint4 yv;
            if (MODE == BS_MODE_RELU_GATED) {
                const T* u = reinterpret_cast<const T*>(u_ptr);
                const uint4 uv = whole ? *reinterpret_cast<const uint4*>(u + tile_base + o)
                                       : bs_load_vec<T>(u, tile_base + o, numel, u_aligned);
                yv = bs_product<FMT>(vec[r], uv);
            } else {
                yv = MODE == BS_MODE_RELU2 ? bs_square_vec<FMT>(vec[r]) : vec[r];
            }
            if (whole) *reinterpret_cast<uint4*>(y_tile + o) = yv;
            else bs_store_vec<T>(reinterpret_cast<T*>(y_ptr), tile_base + o, numel, y_aligned, yv);
        }
    };

    // A(t).
    auto classify = [&](u64 tile, u64 claim) {
        u32 neg = 0;              // sign bits of stored elements, by word lane
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u64 g = tile * (u64)TILE + lane_off + (u64)(r * RS);
            u32 b = 0;
            if (MODE == BS_MODE_MASKED) {
                if (g < numel) {
                    const u32 mw = bs_load_word(reinterpret_cast<const u8*>(mask_ptr), mask_len, g >> 5);
                    b = (mw >> (u32)(g & 31u)) & VM;
                    if (g + V > numel) b &= (1u << (u32)(numel - g)) - 1u;
                }
                neg |= (vec[r].x & bs_spread_signs<BITS>(b & GM))
                     | (vec[r].y & bs_spread_signs<BITS>((b >> G) & GM))
                     | (vec[r].z & bs_spread_signs<BITS>((b >> (2 * G)) & GM))
                     | (vec[r].w & bs_spread_signs<BITS>((b >> (3 * G)) & GM));
            } else {
                if (MODE != BS_MODE_PACK && BS_FUSED_PER_ELEMENT) {
#pragma unroll
                    for (int i = 0; i < V; ++i)
                        if (!bs_relu_keeps<FMT>((u32)bs_lane<T>(vec[r], i))) bs_set_lane<T>(vec[r], i, (T)0);
                } else if (MODE != BS_MODE_PACK) {         // relu, a word at a time
                    vec[r].x = bs_relu_word<FMT>(vec[r].x); vec[r].y = bs_relu_word<FMT>(vec[r].y);
                    vec[r].z = bs_relu_word<FMT>(vec[r].z); vec[r].w = bs_relu_word<FMT>(vec[r].w);
                }
                b = bs_vec_nonzero<BITS>(vec[r]);          // loads past numel are zeros
                // Unstored elements are zero here, and a zero has no sign bit.
                neg |= (vec[r].x | vec[r].y | vec[r].z | vec[r].w) & bs_spread_signs<BITS>(GM);
            }
            bits[r] = b;
        }
        store_y(tile);
        // Ranks: per-round counts packed into 8- or 16-bit fields of warp scans
        // (bs_scan_rounds), then over warps.
        const u32 wtot = bs_scan_rounds<R, V>(bits, lane, start);
        // Only nosign carries its flag (the other encodings' is 0 by construction).
        const bool wneg = ENC == 1 && __any_sync(BS_FULL, neg != 0u);
        if (lane == 0) {
            s_warp_tot[warp] = wtot;
            if (ENC == 1) s_warp_neg[warp] = wneg;
        }
        if (tid == 0) s_next = claim;
        __syncthreads();                                                   // B1
        // Lane k reads warp k's count: the tile's count, this warp's offset in it and the
        // nosign flag are three REDUX.
        const u32 wt = lane < BS_WARPS ? s_warp_tot[lane] : 0u;
        warp_excl = bs_warp_sum(lane < warp ? wt : 0u);
        n = bs_warp_sum(wt);
        any_neg = ENC == 1 ? bs_warp_or(lane < BS_WARPS ? s_warp_neg[lane] : 0u) : 0u;
        if (tid == 0) {
            bs_st_u64(&cdesc[tile], (tile == 0 ? BS_INCL : BS_AGG) | (any_neg ? BS_NEG : 0ull) | n);
            atomicAdd(reinterpret_cast<unsigned long long*>(&gdesc[tile >> BS_GROUP_LOG2]),
                      BS_G_ARRIVED | (any_neg ? BS_G_NEG : 0ull) | n);
        }
    };

    // B(t): everything of t that needs no offset.
    auto stage_tile = [&](u64 tile, Buf& buf, u64 next) {
        const u64 tile_base = tile * (u64)TILE;
        T* stage = reinterpret_cast<T*>(buf.stage);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 j = warp_excl + start[r];
            if (lane == 0) buf.rel[warp][r] = j;
            T* p = stage + j;
#pragma unroll
            for (int i = 0; i < V; ++i)
                if ((bits[r] >> i) & 1u) *p++ = bs_lane<T>(vec[r], i);
        }
        if (tid == 0) { buf.n = n; buf.neg = any_neg; }
        // Mask bytes: offsets inside the tile are 32-bit, and rem is how many of its
        // elements exist.
        const u32 rem = bs_tile_rem<TILE>(numel, tile_base);
        if (MODE != BS_MODE_MASKED)
            bs_store_mask<V, R>(reinterpret_cast<u8*>(mask_ptr) + (tile_base >> 3), bits,
                                (u32)(warp * SEG), rem, lane);
        if (next < n_tiles) load(next);
        if (SIGNS) {
            __syncthreads();                                               // B2
            const u32 groups = (n + 31u) >> 5;
            for (u32 j = (u32)tid; j < groups * 32u; j += BS_THREADS) {
                const u32 sb = j < n ? (((u32)stage[j] >> (BITS - 1)) & 1u) : 0u;
                const u32 word = __ballot_sync(BS_FULL, sb);
                if (lane == 0) buf.signs[j >> 5] = word;
            }
        }
    };

    // C(t): the offset, then everything that needs it.
    auto finish_tile = [&](u64 tile, const Buf& buf, int par) {
        u64 P = 0;
        u32 pneg = 0;
        if (tile == 0) {
            __syncthreads();                                               // B3
        } else {
            // Warp 0 folds the tile's own group, warp 1 whole groups before it (a
            // further 32 per round trip in the rare case that no inclusive prefix ends
            // within 1024 tiles); warp 1's sum counts only where warp 0 found no
            // inclusive descriptor.
            const i64 g0 = (i64)(tile >> BS_GROUP_LOG2) - 1;
            if (warp == 0) {
                u64 sum;
                bool found;
                u32 ng;
                bs_fold_tiles(cdesc, tile, lane, lb[0], sum, found, ng);
                if (lane == 0) { s_lb_sum[par][0] = sum; s_lb_flag[par][0] = (found ? 1u : 0u) | (ng << 1); }
            } else if (warp == 1) {
                u64 acc = 0;
                u32 ngs = 0;
                for (i64 g = g0;; g -= BS_GROUP) {
                    if (g != g0) bs_lookback_load(cdesc, gdesc, tile, g, warp, lane, lb);
                    u64 sum;
                    bool found;
                    u32 ng;
                    bs_fold_groups(gdesc, g, lane, lb, sum, found, ng);
                    acc += sum;
                    ngs |= ng;
                    if (found) break;
                }
                if (lane == 0) { s_lb_sum[par][1] = acc; s_lb_flag[par][1] = ngs << 1; }
            }
            __syncthreads();                                               // B3
            P = s_lb_sum[par][0];
            pneg = s_lb_flag[par][0] >> 1;
            if ((s_lb_flag[par][0] & 1u) == 0u) { P += s_lb_sum[par][1]; pneg |= s_lb_flag[par][1] >> 1; }
        }
        // Read after B3: in a block's last iteration no A parts them from B's writes.
        const u32 tn = buf.n, tneg = buf.neg;
        if (tid == 0) {
            if (tile > 0) bs_st_u64(&cdesc[tile], BS_INCL | ((pneg || tneg) ? BS_NEG : 0ull) | (P + tn));
            if (tile == n_tiles - 1)
                bs_write_total<MODE != BS_MODE_MASKED>(P + tn, pneg | tneg, cap, numel, chunk_log2,
                                                       off64, offsets_ptr, status_ptr, slot_ptr);
        }
        // Chunk offsets at the round starts that begin a chunk.
        if (MODE != BS_MODE_MASKED && lane == 0) {
            // Tiles start on a multiple of TILE, so a round start's low chunk_log2
            // bits are those of its 32-bit offset in the tile plus the tile's.
            const u64 tile_base = tile * (u64)TILE;
            const u32 rem = bs_tile_rem<TILE>(numel, tile_base);
            const u32 cmask = (1u << chunk_log2) - 1u;     // chunk_log2 <= 24
            const u32 base_lo = (u32)tile_base;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 o0 = (u32)(warp * SEG + r * RS);
                const u64 g0 = tile_base + o0;
                if (o0 < rem && ((base_lo + o0) & cmask) == 0u) {
                    const u64 v = P + buf.rel[warp][r];
                    if (off64) reinterpret_cast<u64*>(offsets_ptr)[g0 >> chunk_log2] = v;
                    else reinterpret_cast<u32*>(offsets_ptr)[g0 >> chunk_log2] = (u32)v;
                }
            }
        }
        // Value stream (and sign plane) words inside the tile's range, clipped
        // to the capacity; the edges of what was stored, for bs_stitch_word.
        const T* stage = reinterpret_cast<const T*>(buf.stage);
        const u64 a = P < cap ? P : cap;
        const u64 e = P + tn < cap ? P + tn : cap;
        bs_copy_inner<W, false>(reinterpret_cast<u32*>(values_ptr), stage, a, e);
        if (SIGNS) bs_copy_inner<1, true>(reinterpret_cast<u32*>(signs_ptr), buf.signs, a, e);
        if (tid == 0) {
            const u32 L = (u32)(e - a);
            const uint2 m = bs_stream_edges<W, false>(stage, L * (u32)W);
            const uint2 sg = SIGNS ? bs_stream_edges<1, true>(buf.signs, L) : make_uint2(0u, 0u);
            bs_edges(scratch_ptr, n_tiles)[tile] = make_uint4(m.x, m.y, sg.x, sg.y);
        }
    };

    // Tiles are taken in order from a counter (scratch word 0), one ahead of
    // the one being loaded: a tile only ever waits for lower tiles, which
    // blocks that run hold, and a slow block simply takes fewer.
    u64* ticket = reinterpret_cast<u64*>(scratch_ptr);
    auto take = [&]() -> u64 { return atomicAdd(reinterpret_cast<unsigned long long*>(ticket), 1ull); };
    if (tid == 0) s_first = take();
    __syncthreads();
    u64 tile = s_first, prev = ~0ull;
    if (tile < n_tiles) {
        load(tile);
        classify(tile, tid == 0 ? take() : 0ull);
        u64 next = s_next;
        // The first iteration has no C (whose B3 otherwise parts an iteration's A from
        // the last one's reads of s_warp_tot and s_next).
        __syncthreads();
        // Iteration k: look-back loads of prev, B(tile), C(prev), A(next).
        for (int k = 0; tile < n_tiles || prev != ~0ull; ++k) {
            const bool have = tile < n_tiles, more = have && next < n_tiles;
            const u64 claim = tid == 0 && more ? take() : 0ull;   // its round trip hides behind B and C
            if (prev != ~0ull && prev > 0)
                bs_lookback_load(cdesc, gdesc, prev, (i64)(prev >> BS_GROUP_LOG2) - 1, warp, lane, lb);
            if (have) stage_tile(tile, bufs[k & 1], more ? next : n_tiles);
            // The tile just taken, which the next iteration's B loads (the ticket's round
            // trip is over by here).
            if (BS_PACK_PREFETCH && BS_BULK_PREFETCH && BITS >= 16 && tid == 0 && more
                && claim < n_tiles)
                bs_l2_prefetch(x_ptr, numel * sizeof(T), claim * (u64)TILE * sizeof(T),
                               (claim + 1) * (u64)TILE * sizeof(T));
            if (prev != ~0ull) finish_tile(prev, bufs[(k - 1) & 1], (k - 1) & 1);
            if (more) classify(next, claim);
            prev = have ? tile : ~0ull;
            tile = more ? next : n_tiles;
            next = more ? s_next : n_tiles;
        }
    }
    bs_grid_barrier(scratch_ptr);
    bs_pack_epilogue(scratch_ptr, n_tiles, cap, (u32)W, values_ptr, SIGNS, signs_ptr, status_ptr,
                     zero_values_words, zero_signs_words);
}
