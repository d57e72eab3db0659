// Unpacking and the fused backward ops that read packed values.
//
// One block per tile (same warp-major geometry as bitsparse_pack.cu), with a
// single barrier:
//   1. every thread reads the tile's first value index P and its end from the
//      chunk offsets (the tile is a whole number of chunks: prefix_mode 0) or
//      from a per-tile prefix array (chunks larger than a tile: prefix_mode 2);
//      decodes the tile's stored values, 32 / BITS per 32-bit word, from the
//      value stream (and sign plane) into shared memory (`vals`); loads its
//      mask bits and ranks them with packed warp scans (in a sparse tile while
//      the stream words are in flight).
//   B1
//   2. each lane builds its 16-byte output vector one word at a time: the
//      word's mask bits pick a PRMT selector that drops the next stored values
//      into their element slots (bs_expand_word); in a round where every lane
//      of the warp holds only a few values, it scatters them into a zeroed
//      shared slot instead (bs_scatter_vec).
//
// OP 0: unpack. OP 1: relu2_backward (2 r g where r > 0). OP 2: gated
// backward with u packed under the same mask (its own encoding UENC). OP 3:
// gated backward with u dense. OP 4: OP 1 and r² as the forward rounded it.
// OP 5: r u from the two planes of OP 2 (the gated op's activation, which its second
// GEMM's weight gradient reads).
// The fused ops compute a word at a time in float32 (bs_fused_vec), per
// element only where a result is NaN.


// Decode stored values [P, P + n) into vals, 32 / BITS per word (word q holds
// values G*q .. G*q+G-1 of the tile). Values past n in the last word are junk
// that no mask bit selects. Bit positions are tile-relative 32-bit numbers;
// only a tile whose words reach the end of the plane takes the guarded loads.
// `between` (work that needs no value, called once by every thread, outside
// any branch that could diverge) runs, in a sparse tile, after the stream loads
// are issued, so that their round trip, which follows the one for P, overlaps
// it; in a dense tile and on the guarded path it runs after the decode.
__device__ __forceinline__ u32 bs_plane_bits(const u8* plane, u64 len, u64 w0, bool fast, u32 rel) {
    const u32 k = rel >> 5;
    const u32* p = reinterpret_cast<const u32*>(plane) + w0;
    const u32 lo = fast ? p[k] : bs_load_word(plane, len, w0 + k);
    const u32 hi = fast ? p[k + 1] : bs_load_word(plane, len, w0 + k + 1);
    return bs_funnel_r(lo, hi, rel & 31u);
}

template <int BITS, int ENC, typename F>
__device__ __forceinline__ void bs_decode_tile(const u8* values, u64 vlen, const u8* signs, u64 slen,
                                               u64 P, u32 n, u32* vals, F&& between) {
    const int W = ENC == 0 ? BITS : BITS - 1;
    const int G = 32 / BITS;
    const u32 words = (n + G - 1) / G;
    const u64 w0 = (P * (u64)W) >> 5;
    const u32 sh0 = (u32)(P * (u64)W) & 31u;
    // Two words past the last group's first bit must exist as whole words.
    const bool fast = (w0 + (((u64)sh0 + (u64)words * (G * W)) >> 5) + 2) * 4 <= vlen;
    const u64 s0 = P >> 5;
    const u32 ssh = (u32)P & 31u;
    const bool sfast = ENC == 2 && (s0 + (((u64)ssh + (u64)words * G) >> 5) + 2) * 4 <= slen;
    if (fast && (ENC != 2 || sfast)) {
        // Every word in range: 32-bit offsets from the tile's first word, no guards.
        const u32* vp = reinterpret_cast<const u32*>(values) + w0;
        const u32* sp = reinterpret_cast<const u32*>(signs) + s0;
        // A sparse tile (at most two words per thread) issues its loads before
        // the ranks; a denser one decodes in a plain loop and ranks after it
        // (hoisting its first loads measured 3-5 % slower at s = 0.5).
        // fp32 with a sign plane never hoists: its 8 rounds of ranks, live
        // through the decode, would spill.
        const bool hoist = !(BITS == 32 && ENC == 2) && words <= 2u * BS_THREADS;
        if (hoist) {
            u32 lo[2], hi[2], slo[2], shi[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = threadIdx.x + i * BS_THREADS;
                const u32 rel = sh0 + q * (u32)(G * W), srel = ssh + q * (u32)G;
                lo[i] = hi[i] = slo[i] = shi[i] = 0u;
                if (q < words) {
                    lo[i] = vp[rel >> 5]; hi[i] = vp[(rel >> 5) + 1];
                    if (ENC == 2) { slo[i] = sp[srel >> 5]; shi[i] = sp[(srel >> 5) + 1]; }
                }
            }
            between();
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = threadIdx.x + i * BS_THREADS;
                const u32 rel = sh0 + q * (u32)(G * W), srel = ssh + q * (u32)G;
                if (q < words) {
                    u32 v = bs_spread<BITS, W>(bs_funnel_r(lo[i], hi[i], rel));
                    if (ENC == 2) v |= bs_spread_signs<BITS>(bs_funnel_r(slo[i], shi[i], srel));
                    vals[q] = v;
                }
            }
            return;
        }
        for (u32 q = threadIdx.x; q < words; q += BS_THREADS) {
            const u32 rel = sh0 + q * (u32)(G * W), k = rel >> 5;
            u32 v = bs_spread<BITS, W>(bs_funnel_r(vp[k], vp[k + 1], rel));   // shifts by rel % 32
            if (ENC == 2) {
                const u32 srel = ssh + q * (u32)G, sk = srel >> 5;
                v |= bs_spread_signs<BITS>(bs_funnel_r(sp[sk], sp[sk + 1], srel));
            }
            vals[q] = v;
        }
        between();
        return;
    }
    for (u32 q = threadIdx.x; q < words; q += BS_THREADS) {
        u32 v = bs_spread<BITS, W>(bs_plane_bits(values, vlen, w0, fast, sh0 + q * (u32)(G * W)));
        if (ENC == 2) v |= bs_spread_signs<BITS>(bs_plane_bits(signs, slen, s0, sfast, ssh + q * (u32)G));
        vals[q] = v;
    }
    between();
}

// The 16-byte vector of V elements with mask bits b whose first stored value
// is value j of the tile.
template <int BITS>
__device__ __forceinline__ uint4 bs_expand_vec(const u32* vals, u32 j, u32 b, const u32* sel8) {
    const int G = 32 / BITS;
    const u32 GM = (1u << G) - 1u;
    u32 o[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const u32 mb = (b >> (m * G)) & GM;
        o[m] = bs_expand_word<BITS>(vals, j, mb, sel8);
        j += G == 1 ? mb : bs_popc(mb);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// The same vector by scattering instead (a sparse warp): the lane's set
// elements, highest first (one bfind each), are written into its own zeroed
// 16-byte slot of shared memory, which is then read back whole: ~9 instructions
// per stored value against ~15 per 32-bit word for bs_expand_vec. The warp
// votes per round (so the branch never diverges) and scatters while no lane
// holds more than BsScatter::MAX values. Measured on the H200 (bench/NOTES.md,
// session 4): scattering wins at s = 0.99 and at bf16 s = 0.9 with these caps
// and loses where more values per lane pay the shared-memory bank conflicts of
// the 8- and 16-bit stores (lanes 8 apart share a bank).
// -D switches for bench/kernel_variants.py: BS_NO_SCATTER, the two caps, and
// the unpack's blocks per SM.
#ifndef BS_NO_SCATTER
#define BS_NO_SCATTER 0
#endif
#ifndef BS_SCATTER_MAX16
#define BS_SCATTER_MAX16 3
#endif
#ifndef BS_SCATTER_MAX8
#define BS_SCATTER_MAX8 2
#endif
#ifndef BS_UNPACK_BLOCKS
#define BS_UNPACK_BLOCKS 8   // 32 registers, no spills (fp32's 8 rounds need 6); 6 was 4-8 % slower
#endif
#ifndef BS_FUSED_BLOCKS
#define BS_FUSED_BLOCKS 8    // the fused ops' blocks per SM (fp8's gated op would spill: 6)
#endif
template <int BITS> struct BsScatter { enum { MAX = BITS == 16 ? BS_SCATTER_MAX16 : BITS == 8 ? BS_SCATTER_MAX8 : -1 }; };

template <int BITS>
__device__ __forceinline__ uint4 bs_scatter_vec(const u32* vals, u32 j, u32 b, uint4* slot) {
    const u32 B = BITS / 8;
    *slot = make_uint4(0, 0, 0, 0);
    const u8* vb = reinterpret_cast<const u8*>(vals);
    u8* sb = reinterpret_cast<u8*>(slot);
    u32 q = (j + bs_popc(b)) * B;          // one past the lane's last stored value, in bytes
    while (b) {
        const u32 i = bs_bfind(b);
        q -= B;
        if (BITS == 16) *reinterpret_cast<u16*>(sb + 2 * i) = *reinterpret_cast<const u16*>(vb + q);
        else sb[i] = vb[q];
        b ^= 1u << i;
    }
    return *slot;
}

// A fused op's output vectors (o1; o2 where the op has two) from the gradient g,
// the decoded values r and u's values, a word at a time in float32
// (bs_word_f32); false when a result is NaN, and the caller then applies the
// per-element rules (fp8 always takes those).
template <int FMT, int OP>
__device__ __forceinline__ bool bs_fused_vec(const uint4& g, const uint4& r, const uint4& u,
                                             uint4& o1, uint4& o2) {
    bool nan = false;
    auto word = [&](u32 gw, u32 rw, u32 uw, u32& a, u32& b) {
        if (OP == BS_OP_RELU2 || OP == BS_OP_RELU2_AND_SQUARE) {
            a = bs_word_f32<FMT>(gw, rw, 0u, BsRelu2Grad(), nan);
            b = OP == BS_OP_RELU2_AND_SQUARE ? bs_word_f32<FMT>(rw, 0u, 0u, BsSquare(), nan) : 0u;
        } else {
            a = bs_word_f32<FMT>(gw, uw, rw, BsGatedProduct(), nan);
            b = bs_word_f32<FMT>(gw, rw, 0u, BsProduct(), nan);
        }
    };
    word(g.x, r.x, u.x, o1.x, o2.x);
    word(g.y, r.y, u.y, o1.y, o2.y);
    word(g.z, r.z, u.z, o1.z, o2.z);
    word(g.w, r.w, u.w, o1.w, o2.w);
    return !nan;
}

// The same by the per-element rules (NaN payloads as NumPy gives them).
template <int FMT, int OP>
__device__ __forceinline__ void bs_fused_vec_exact(const uint4& g, const uint4& r, const uint4& u,
                                                   uint4& o1, uint4& o2) {
    typedef typename Fmt<FMT>::T T;
    const int V = 16 / (int)sizeof(T);
    o1 = make_uint4(0, 0, 0, 0);
    o2 = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const u32 gi = (u32)bs_lane<T>(g, i), ri = (u32)bs_lane<T>(r, i);
        if (OP == BS_OP_RELU2 || OP == BS_OP_RELU2_AND_SQUARE) {
            bs_set_lane<T>(o1, i, (T)bs_relu2_grad<FMT>(gi, ri));
            if (OP == BS_OP_RELU2_AND_SQUARE)        // r² as the forward rounded it
                bs_set_lane<T>(o2, i, (T)bs_mul_round<FMT>(ri, ri));
        } else {
            const u32 ui = (u32)bs_lane<T>(u, i);
            bs_set_lane<T>(o1, i, (T)(bs_positive<FMT>(ri) ? bs_mul_round<FMT>(gi, ui) : 0u));
            bs_set_lane<T>(o2, i, (T)bs_mul_round<FMT>(gi, ri));
        }
    }
}

// Where the word path applies, the per-element one is its rare fallback: out of
// line, so that its registers do not count against the common path's occupancy.
// Its vectors go by value both ways: a reference would make the caller keep them
// in local memory on every vector, taken or not.
struct BsVecPair { uint4 a, b; };
template <int FMT, int OP>
__device__ __noinline__ BsVecPair bs_fused_vec_fallback(uint4 g, uint4 r, uint4 u) {
    BsVecPair o;
    bs_fused_vec_exact<FMT, OP>(g, r, u, o.a, o.b);
    return o;
}

__device__ __forceinline__ u64 bs_offset_at(u64 offsets_ptr, int off64, u64 c) {
    return off64 ? reinterpret_cast<const u64*>(offsets_ptr)[c]
                 : (u64)reinterpret_cast<const u32*>(offsets_ptr)[c];
}

// L2 prefetch of a later tile's planes: the block of tile t asks its SM's copy engine
// (bs_l2_prefetch) for the mask bytes and the value (sign, u) stream bytes of tile
// t + K, K a quarter of a wave of resident blocks, so that the block taking that tile
// soon after finds its chain of dependent loads (offsets, then the values they locate)
// in L2. A whole wave ahead, or the fused ops' dense gradients too, measured slower:
// the lines left L2 before their block ran (bench/NOTES.md, session 39). A/B switches
// for bench/kernel_variants.py.
#ifndef BS_UNPACK_PREFETCH
#define BS_UNPACK_PREFETCH 1
#endif
#ifndef BS_UNPACK_AHEAD_DIV
#define BS_UNPACK_AHEAD_DIV 4     // K = resident blocks / this
#endif

// Blocks per SM of an unpack-family kernel (its launch bounds).
template <int BITS, int OP> struct BsUnpackBlocks {
    enum { N = OP != 0 ? (BITS == 8 ? 6 : BS_FUSED_BLOCKS) : BITS == 32 ? 6 : BS_UNPACK_BLOCKS };
};

template <int FMT, int OP, int R, int ENC, int UENC>
__global__ void __launch_bounds__(BS_THREADS, BsUnpackBlocks<Fmt<FMT>::BITS, OP>::N)
bitsparse_unpack(u64 numel, int chunk_log2, int prefix_mode, u64 offsets_ptr, int off64, u64 prefix_ptr,
                 u64 mask_ptr, u64 mask_len,
                 u64 values_ptr, u64 values_len, u64 signs_ptr, u64 signs_len,
                 u64 uvalues_ptr, u64 uvalues_len, u64 usigns_ptr, u64 usigns_len,
                 u64 g_ptr, int g_aligned, u64 ud_ptr, int ud_aligned,
                 u64 out_ptr, int out_aligned, u64 out2_ptr, int out2_aligned) {
    typedef typename Fmt<FMT>::T T;
    const int BITS = Fmt<FMT>::BITS;
    const int V = 16 / (int)sizeof(T);
    const int RS = 32 * V;
    const int SEG = RS * R;
    const int TILE = SEG * BS_WARPS;
    const int VW = TILE * BITS / 32 + 4;      // decoded values as words, plus guards
    const u32 VM = V == 32 ? 0xffffffffu : ((1u << V) - 1u);
    const bool UPACKED = OP == BS_OP_GATED || OP == BS_OP_GATED_PRODUCT;   // u's own planes

    __shared__ __align__(16) u32 vals[VW];
    __shared__ __align__(16) u32 uvals[UPACKED ? VW : 1];
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u32 s_sel[16];
    __shared__ uint4 s_slot[BsScatter<BITS>::MAX > 0 ? BS_THREADS : 1];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 tile = blockIdx.x;
    const u64 tile_base = tile * (u64)TILE;
    const u8* mask = reinterpret_cast<const u8*>(mask_ptr);
    if (BITS == 8 && tid < 16) s_sel[tid] = bs_byte_selector((u32)tid);

    // The stored values [first, end) of the tile starting at element ``base``, from the
    // chunk offsets at both its ends (chunks no longer than the tile: prefix_mode 0).
    auto stored_range = [=](u64 base) {
        const u64 nch = (numel + (1ull << chunk_log2) - 1ull) >> chunk_log2;
        u64 c1 = (base + TILE) >> chunk_log2;
        if (c1 > nch) c1 = nch;
        return make_ulonglong2(bs_offset_at(offsets_ptr, off64, base >> chunk_log2),
                               bs_offset_at(offsets_ptr, off64, c1));
    };
    // 1. This tile's stored values: [P, Pe).
    u64 P, Pe;
    if (prefix_mode == 0) {
        const ulonglong2 r = stored_range(tile_base);
        P = r.x;
        Pe = r.y;
    } else {
        P = reinterpret_cast<const u64*>(prefix_ptr)[tile];
        Pe = reinterpret_cast<const u64*>(prefix_ptr)[tile + 1];
    }
    // The offsets of the tile to prefetch, loaded beside P and Pe (one round trip for
    // both) and used once this thread's mask loads are issued.
    u64 ahead = ~0ull, q0 = 0, q1 = 0;
    if (BS_UNPACK_PREFETCH && BS_BULK_PREFETCH && prefix_mode == 0 && tid == BS_THREADS - 1) {
        u32 nsm;
        asm("mov.u32 %0, %%nsmid;" : "=r"(nsm));
        const u64 a = tile + ((u64)nsm * BsUnpackBlocks<BITS, OP>::N + BS_UNPACK_AHEAD_DIV - 1)
                                 / BS_UNPACK_AHEAD_DIV;
        if (a < gridDim.x) {
            const ulonglong2 r = stored_range(a * TILE);
            q0 = r.x;
            q1 = r.y;
            ahead = a;
        }
    }
    const u32 n = (u32)(Pe - P);

    u32 bits[R];
    const bool full = tile_base + TILE <= numel;
    // This lane's first vector, relative to the tile (rounds are RS elements apart).
    const u32 lane_el = (u32)(warp * SEG + lane * V);
    // In a whole tile a vector's bits are one byte (bf16), two (fp8) or a nibble
    // (fp32) at a constant offset from the lane's first.
    const u8* mrow = mask + (tile_base >> 3) + (lane_el >> 3);
    const T* gx = reinterpret_cast<const T*>(g_ptr);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(lane_el + r * RS);
        u32 b = 0;
        if (full) {
            if (V == 8) b = mrow[r * RS / 8];
            else if (V == 16) b = *reinterpret_cast<const u16*>(mrow + r * RS / 8);
            else b = (u32)(mrow[r * RS / 8] >> (lane_el & 4u)) & VM;
        } else if (g < numel) {
            b = (bs_load_word(mask, mask_len, g >> 5) >> (u32)(g & 31u)) & VM;
            if (g + V > numel) b &= (1u << (u32)(numel - g)) - 1u;
        }
        bits[r] = b;
    }
    // Ranks of the mask bits (in a sparse tile while its stream words are in
    // flight: bs_decode_tile calls this between its loads and their use).
    u32 start[R];
    auto rank = [&]() {
        const u32 wtot = bs_scan_rounds<R, V>(bits, lane, start);
        if (lane == 0) s_warp_tot[warp] = wtot;
    };
    if (BS_UNPACK_PREFETCH && ahead != ~0ull) {     // waiting for q0 / q1 is waiting for P
        const u64 ab = ahead * (u64)TILE;
        const int W = ENC == 0 ? BITS : BITS - 1;
        bs_l2_prefetch(mask_ptr, mask_len, ab >> 3, (ab + TILE) >> 3);
        bs_l2_prefetch(values_ptr, values_len, (q0 * W) >> 3, ((q1 * W) >> 3) + 8);
        if (ENC == 2) bs_l2_prefetch(signs_ptr, signs_len, q0 >> 3, (q1 >> 3) + 8);
        if (UPACKED) {
            const int UW = UENC == 0 ? BITS : BITS - 1;
            bs_l2_prefetch(uvalues_ptr, uvalues_len, (q0 * UW) >> 3, ((q1 * UW) >> 3) + 8);
            if (UENC == 2) bs_l2_prefetch(usigns_ptr, usigns_len, q0 >> 3, (q1 >> 3) + 8);
        }
    }
    bs_decode_tile<BITS, ENC>(reinterpret_cast<const u8*>(values_ptr), values_len,
                              reinterpret_cast<const u8*>(signs_ptr), signs_len, P, n, vals, rank);
    if (UPACKED)
        bs_decode_tile<BITS, UENC>(reinterpret_cast<const u8*>(uvalues_ptr), uvalues_len,
                                   reinterpret_cast<const u8*>(usigns_ptr), usigns_len, P, n, uvals,
                                   [] {});
    __syncthreads();                                                   // B1
    // The warps before this one: lane k reads warp k's count and one REDUX sums them.
    const u32 warp_excl = bs_warp_sum(lane < warp ? s_warp_tot[lane] : 0u);

    // 2. Expand and store (or combine with the gradient).
    uint4* orow = reinterpret_cast<uint4*>(reinterpret_cast<T*>(out_ptr) + tile_base + lane_el);
    const bool plain_store = full && out_aligned;   // whole 16-byte vectors, no bounds
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(lane_el + r * RS);
        // Lanes past the end hold no bits, so the vote is taken before they leave.
        const bool scatter = BsScatter<BITS>::MAX > 0 && !BS_NO_SCATTER
            && !__any_sync(BS_FULL, bs_popc(bits[r]) > (u32)BsScatter<BITS>::MAX);
        if (!full && g >= numel) continue;
        const u32 j = warp_excl + start[r];
        const uint4 rv = scatter ? bs_scatter_vec<BITS>(vals, j, bits[r], &s_slot[tid])
                                 : bs_expand_vec<BITS>(vals, j, bits[r], s_sel);
        if (OP == BS_OP_UNPACK) {
            if (plain_store) orow[r * RS / V] = rv;
            else bs_store_vec<T>(reinterpret_cast<T*>(out_ptr), g, numel, out_aligned, rv);
        } else if (OP == BS_OP_GATED_PRODUCT) {
            const uint4 uv = scatter ? bs_scatter_vec<BITS>(uvals, j, bits[r], &s_slot[tid])
                                     : bs_expand_vec<BITS>(uvals, j, bits[r], s_sel);
            const uint4 o = bs_product<FMT>(rv, uv);
            if (plain_store) orow[r * RS / V] = o;
            else bs_store_vec<T>(reinterpret_cast<T*>(out_ptr), g, numel, out_aligned, o);
        } else {
            const uint4 gv = bs_load_vec<T>(gx, g, numel, g_aligned);
            uint4 uv = make_uint4(0, 0, 0, 0);
            if (UPACKED)
                uv = scatter ? bs_scatter_vec<BITS>(uvals, j, bits[r], &s_slot[tid])
                             : bs_expand_vec<BITS>(uvals, j, bits[r], s_sel);
            if (OP == BS_OP_GATED_DENSE)
                uv = bs_load_vec<T>(reinterpret_cast<const T*>(ud_ptr), g, numel, ud_aligned);
            uint4 o1, o2;
            if constexpr (BS_FUSED_PER_ELEMENT || BITS == 8)
                bs_fused_vec_exact<FMT, OP>(gv, rv, uv, o1, o2);
            else if (!bs_fused_vec<FMT, OP>(gv, rv, uv, o1, o2)) {
                const BsVecPair o = bs_fused_vec_fallback<FMT, OP>(gv, rv, uv);
                o1 = o.a;
                o2 = o.b;
            }
            bs_store_vec<T>(reinterpret_cast<T*>(out_ptr), g, numel, out_aligned, o1);
            if (OP != BS_OP_RELU2)
                bs_store_vec<T>(reinterpret_cast<T*>(out2_ptr), g, numel, out2_aligned, o2);
        }
    }
}

// relu_backward: grad where the mask bit is set, else +0 (reads only the mask).
template <int FMT>
__global__ void __launch_bounds__(BS_THREADS)
bitsparse_mask_select(u64 g_ptr, int g_aligned, u64 mask_ptr, u64 mask_len, u64 numel,
                      u64 out_ptr, int out_aligned) {
    typedef typename Fmt<FMT>::T T;
    const int V = 16 / (int)sizeof(T);
    const u32 VM = V == 32 ? 0xffffffffu : ((1u << V) - 1u);
    const u64 nvec = (numel + V - 1) / V;
    for (u64 vi = blockIdx.x * (u64)blockDim.x + threadIdx.x; vi < nvec; vi += (u64)gridDim.x * blockDim.x) {
        const u64 g = vi * V;
        const uint4 gv = bs_load_vec<T>(reinterpret_cast<const T*>(g_ptr), g, numel, g_aligned);
        const u32 b = (bs_load_word(reinterpret_cast<const u8*>(mask_ptr), mask_len, g >> 5) >> (u32)(g & 31u)) & VM;
        uint4 o = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < V; ++i)
            if ((b >> i) & 1u) bs_set_lane<T>(o, i, bs_lane<T>(gv, i));
        bs_store_vec<T>(reinterpret_cast<T*>(out_ptr), g, numel, out_aligned, o);
    }
}

// Set bits per tile (for unpacking chunks that span many tiles).
template <int FMT, int R>
__global__ void __launch_bounds__(BS_THREADS)
bitsparse_tile_counts(u64 mask_ptr, u64 mask_len, u64 numel, u64 counts_ptr) {
    typedef typename Fmt<FMT>::T T;
    const int TILE = R * 32 * (16 / (int)sizeof(T)) * BS_WARPS;
    __shared__ u32 s_sum[BS_WARPS];
    const u64 base = (u64)blockIdx.x * TILE;
    u32 sum = 0;
    for (u32 k = threadIdx.x; k < TILE / 32; k += BS_THREADS) {
        const u64 g = base + 32ull * k;
        if (g >= numel) break;
        u32 wd = bs_load_word(reinterpret_cast<const u8*>(mask_ptr), mask_len, g >> 5);
        if (g + 32 > numel) wd &= (1u << (u32)(numel - g)) - 1u;
        sum += __popc(wd);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(BS_FULL, sum, o);
    if ((threadIdx.x & 31) == 0) s_sum[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 t = 0;
        for (int k = 0; k < BS_WARPS; ++k) t += s_sum[k];
        reinterpret_cast<u64*>(counts_ptr)[blockIdx.x] = t;
    }
}
