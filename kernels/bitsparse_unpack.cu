// Unpacking and the fused backward ops that read packed values.
//
// One block per tile, same geometry as bitsparse_pack.cu. The tile's first
// value index P comes from the chunk offsets (plus a popcount of the mask
// words between the chunk start and the tile when a chunk spans a few tiles,
// or from a precomputed per-tile prefix when it spans many). Each lane takes
// its 16-byte vector's mask bits, a packed warp scan and a block scan give its
// rank, the tile's stream words are staged in shared memory with coalesced
// loads, and each lane decodes its values and writes one 16-byte vector.
//
// OP 0: unpack. OP 1: relu2_backward (2 r g where r > 0). OP 2: gated
// backward with u packed under the same mask. OP 3: gated backward with u
// dense. Value streams are generic here (width w, optional sign plane) so that
// the two packed operands of OP 2 may use different encodings.

#define BS_OP_UNPACK 0
#define BS_OP_RELU2 1
#define BS_OP_GATED 2
#define BS_OP_GATED_DENSE 3

struct BsStream {
    const u8* values; u64 values_len; int w;
    const u8* signs; u64 signs_len; int has_signs;
};

// Stage the words of stream bits [P*w, (P+n)*w) (and sign bits [P, P+n)).
__device__ __forceinline__ void bs_stage_stream(const BsStream& s, u64 P, u32 n, u32* sw, u32* ss) {
    const u64 w0 = (P * (u64)s.w) >> 5;
    const u32 nw = (u32)((((P + n) * (u64)s.w + 31ull) >> 5) - w0);
    for (u32 i = threadIdx.x; i < nw; i += BS_THREADS) sw[i] = bs_load_word(s.values, s.values_len, w0 + i);
    if (threadIdx.x == 0) sw[nw] = 0u;
    if (s.has_signs) {
        const u64 s0 = P >> 5;
        const u32 ns = (u32)(((P + n + 31ull) >> 5) - s0);
        for (u32 i = threadIdx.x; i < ns; i += BS_THREADS) ss[i] = bs_load_word(s.signs, s.signs_len, s0 + i);
    }
}

template <int BITS>
__device__ __forceinline__ u32 bs_decode(const BsStream& s, const u32* sw, const u32* ss, u64 P, u32 j) {
    const u32 bp = (u32)((P * (u64)s.w) & 31ull) + j * (u32)s.w;
    const u64 pair = (u64)sw[bp >> 5] | ((u64)sw[(bp >> 5) + 1] << 32);
    const u32 wm = s.w >= 32 ? 0xffffffffu : ((1u << s.w) - 1u);
    u32 v = (u32)(pair >> (bp & 31u)) & wm;
    if (s.has_signs) {
        const u32 sp = (u32)(P & 31ull) + j;
        v |= ((ss[sp >> 5] >> (sp & 31u)) & 1u) << (BITS - 1);
    }
    return v;
}

template <int FMT, int OP, int R>
__global__ void __launch_bounds__(BS_THREADS, OP == 0 ? (R >= 8 ? 4 : (R >= 4 ? 6 : 8)) : 1)
bitsparse_unpack(u64 numel, int chunk_log2, int prefix_mode, u64 offsets_ptr, int off64, u64 prefix_ptr,
                 u64 mask_ptr, u64 mask_len,
                 u64 values_ptr, u64 values_len, int w, u64 signs_ptr, u64 signs_len, int has_signs,
                 u64 uvalues_ptr, u64 uvalues_len, int uw, u64 usigns_ptr, u64 usigns_len, int uhas_signs,
                 u64 g_ptr, int g_aligned, u64 ud_ptr, int ud_aligned,
                 u64 out_ptr, int out_aligned, u64 out2_ptr, int out2_aligned) {
    typedef typename Fmt<FMT>::T T;
    const int BITS = Fmt<FMT>::BITS;
    const int V = 16 / (int)sizeof(T);
    const int RS = 32 * V;
    const int SEG = RS * R;
    const int TILE = SEG * BS_WARPS;
    const int SW = TILE * BITS / 32 + 4;      // stream words of a full tile, plus guards
    const int SS = TILE / 32 + 4;
    const u32 VM = V == 32 ? 0xffffffffu : ((1u << V) - 1u);

    __shared__ u32 sw[SW];
    __shared__ u32 ss[SS];
    __shared__ u32 uw_[OP == BS_OP_GATED ? SW : 1];
    __shared__ u32 us_[OP == BS_OP_GATED ? SS : 1];
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u64 s_P;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u64 tile = blockIdx.x;
    const u64 tile_base = tile * (u64)TILE;
    const u8* mask = reinterpret_cast<const u8*>(mask_ptr);

    if (warp == 0) {
        u64 P;
        if (prefix_mode == 2) {
            P = reinterpret_cast<const u64*>(prefix_ptr)[tile];
        } else {
            const u64 c = tile_base >> chunk_log2;
            P = off64 ? reinterpret_cast<const u64*>(offsets_ptr)[c]
                      : (u64)reinterpret_cast<const u32*>(offsets_ptr)[c];
            if (prefix_mode == 1) {
                u32 sum = 0;
                for (u64 i = ((c << chunk_log2) >> 5) + lane; i < (tile_base >> 5); i += 32)
                    sum += __popc(bs_load_word(mask, mask_len, i));
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(BS_FULL, sum, o);
                P += sum;
            }
        }
        if (lane == 0) s_P = P;
    }

    u32 bits[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
        u32 b = 0;
        if (g < numel) {
            b = (bs_load_word(mask, mask_len, g >> 5) >> (u32)(g & 31u)) & VM;
            if (g + V > numel) b &= (1u << (u32)(numel - g)) - 1u;
        }
        bits[r] = b;
    }
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
    const u64 P = s_P;

    BsStream sr = {reinterpret_cast<const u8*>(values_ptr), values_len, w,
                   reinterpret_cast<const u8*>(signs_ptr), signs_len, has_signs};
    BsStream su = {reinterpret_cast<const u8*>(uvalues_ptr), uvalues_len, uw,
                   reinterpret_cast<const u8*>(usigns_ptr), usigns_len, uhas_signs};
    bs_stage_stream(sr, P, n, sw, ss);
    if (OP == BS_OP_GATED) bs_stage_stream(su, P, n, uw_, us_);
    __syncthreads();

#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64 g = tile_base + (u64)(warp * SEG + r * RS + lane * V);
        if (g >= numel) continue;
        u32 j = warp_excl + start[r];
        uint4 rv = make_uint4(0, 0, 0, 0), uv = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            if (bits[r] && ((bits[r] >> i) & 1u)) {
                bs_set_lane<T>(rv, i, (T)bs_decode<BITS>(sr, sw, ss, P, j));
                if (OP == BS_OP_GATED) bs_set_lane<T>(uv, i, (T)bs_decode<BITS>(su, uw_, us_, P, j));
                ++j;
            }
        }
        if (OP == BS_OP_UNPACK) {
            bs_store_vec<T>(reinterpret_cast<T*>(out_ptr), g, numel, out_aligned, rv);
        } else {
            const uint4 gv = bs_load_vec<T>(reinterpret_cast<const T*>(g_ptr), g, numel, g_aligned);
            if (OP == BS_OP_GATED_DENSE)
                uv = bs_load_vec<T>(reinterpret_cast<const T*>(ud_ptr), g, numel, ud_aligned);
            uint4 o1 = make_uint4(0, 0, 0, 0), o2 = make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const u32 gi = (u32)bs_lane<T>(gv, i), ri = (u32)bs_lane<T>(rv, i);
                if (OP == BS_OP_RELU2) {
                    bs_set_lane<T>(o1, i, (T)bs_relu2_grad<FMT>(gi, ri));
                } else {
                    const u32 ui = (u32)bs_lane<T>(uv, i);
                    bs_set_lane<T>(o1, i, (T)(bs_positive<FMT>(ri) ? bs_mul_round<FMT>(gi, ui) : 0u));
                    bs_set_lane<T>(o2, i, (T)bs_mul_round<FMT>(gi, ri));
                }
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
