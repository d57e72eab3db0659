"""Prototypes of the pack kernel, as text edits of kernels/bitsparse_pack.cu (bench only;
the package never builds them). ``bench/pack_bound.py`` times each beside the package's
kernel, through the production launch, and checks its packed bytes against it.

* ``copy-async``: the next tile's input goes to shared memory in the background instead
  of into registers during B. Each thread copies its own vectors of the next tile into
  its own slots of one 16 KB input tile with ``cp.async`` (sm_80 on; a plain copy
  before) right after its A of the current tile, and waits for its own copies before
  the next A: a whole iteration for them to land, no registers held through C, and no
  barrier, since no thread reads another's slots. Tiles that are not whole and aligned
  load directly, as before. Why (bench/NOTES.md, session 29): the ``cached`` variant
  puts the loads' exposed round trip at ~8 % of the plain pack.
* ``lookback-warp``: ``copy-async`` plus a ninth warp that does the look-back alone, so
  that no worker waits at a barrier for a fold (in the package's kernel the instruction
  after B3 holds 22 % of the stall samples at bf16 0.9, and ``nolb`` takes 10 % off).
  After a tile's A, worker warp 0 hands the tile and its count to the look-back warp
  through named barrier 2 + parity (64 threads: worker warp 0 arrives, the look-back
  warp waits); the look-back warp folds its group's tiles (and whole groups only when
  no inclusive tile was among them), publishes the inclusive descriptor and the total,
  and hands the offset back through barrier 4 + parity (288 threads: it arrives, the
  workers wait at their C of that tile, an iteration later). The workers' own barriers
  are barrier 1 (256 threads). One handoff per barrier is ever in flight: the workers'
  C of the block's tile j comes before their A of tile j + 2, and the look-back warp
  hands tile j's offset over only after waiting for tile j's count. 4 blocks per SM
  (56 registers, ptxas spills ~100 bytes at bf16 nosign); ``lookback-warp3``: 3 (72,
  no spills).
"""

from __future__ import annotations

from bitsparse_core.backends.cuda import abi

COPY_ASYNC = (
    # the copy helpers (cp.async from sm_80 on)
    ("""\
// 16 bytes go to a pinned host slot where the caller names one (slot_ptr, else 0).

""",
     """\
// 16 bytes go to a pinned host slot where the caller names one (slot_ptr, else 0).

// Copy 16 bytes from global to shared memory in the background (sm_80 on; a plain
// copy before), and wait for this thread's copies.
__device__ __forceinline__ void bs_copy_async16(uint4* dst, const uint4* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#else
    *dst = *src;
#endif
}
__device__ __forceinline__ void bs_copy_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bs_copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;\\n" ::: "memory");
#endif
}

"""),
    # the input tile after the two buffers: the size check
    ("""\
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < 2u * (u32)sizeof(Buf)) __trap();   // the host's size formula disagrees
    }
""",
     """\
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < 2u * (u32)sizeof(Buf) + (u32)(TILE * sizeof(T))) __trap();   // the host's size formula disagrees
    }
"""),
    # prefetch (into this thread's slots) and load (from them, or from global memory)
    ("""\

    // Issue the loads of a tile's vectors, all rounds in flight.
    auto load = [&](u64 tile) {
        const u64 base = tile * (u64)TILE;
        if (x_aligned && base + (u64)TILE <= numel) {     // a whole tile: no guards
            const uint4* p = reinterpret_cast<const uint4*>(x + base) + (warp * (SEG / V) + lane);
#pragma unroll
            for (int r = 0; r < R; ++r) vec[r] = p[r * 32];
            return;
""",
     """\

    // This thread's slots of the input tile (after the two buffers): vector r at
    // mine[32 r], as in the tile's global layout (consecutive lanes, consecutive slots).
    uint4* mine = reinterpret_cast<uint4*>(bufs + 2) + (warp * (SEG / V) + lane);
    auto whole = [&](u64 tile) { return x_aligned && tile * (u64)TILE + (u64)TILE <= numel; };
    // Copy this thread's vectors of a whole tile into its slots in the background.
    auto prefetch = [&](u64 tile) {
        if (!whole(tile)) return;
        const uint4* p = reinterpret_cast<const uint4*>(x + tile * (u64)TILE) + (warp * (SEG / V) + lane);
#pragma unroll
        for (int r = 0; r < R; ++r) bs_copy_async16(mine + r * 32, p + r * 32);
        bs_copy_async_commit();
    };
    // This thread's vectors of a tile: from its slots (a whole tile, prefetched), else loaded.
    auto load = [&](u64 tile) {
        if (whole(tile)) {
            bs_copy_async_wait();
#pragma unroll
            for (int r = 0; r < R; ++r) vec[r] = mine[r * 32];
            return;
"""),
    # B no longer loads the next tile
    ("""\
    // B(t): everything of t that needs no offset.
    auto stage_tile = [&](u64 tile, Buf& buf, u64 next) {
        const u64 tile_base = tile * (u64)TILE;
""",
     """\
    // B(t): everything of t that needs no offset.
    auto stage_tile = [&](u64 tile, Buf& buf) {
        const u64 tile_base = tile * (u64)TILE;
"""),
    # B no longer loads the next tile
    ("""\
                                (u32)(warp * SEG), rem, lane);
        if (next < n_tiles) load(next);
        if (SIGNS) {
""",
     """\
                                (u32)(warp * SEG), rem, lane);
        if (SIGNS) {
"""),
    # the first tile: copy, then read
    ("""\
    if (tile < n_tiles) {
        load(tile);
""",
     """\
    if (tile < n_tiles) {
        prefetch(tile);
        load(tile);
"""),
    # the second tile's copy starts right after the first one's A
    ("""\
        u64 next = s_next;
        // The first iteration has no C (whose B3 otherwise parts an iteration's A from
""",
     """\
        u64 next = s_next;
        if (next < n_tiles) prefetch(next);    // this thread has read its slots (classify used them)
        // The first iteration has no C (whose B3 otherwise parts an iteration's A from
"""),
    # A reads the copied vectors before classifying
    ("""\
                bs_lookback_load(cdesc, gdesc, prev, (i64)(prev >> BS_GROUP_LOG2) - 1, warp, lane, lb);
            if (have) stage_tile(tile, bufs[k & 1], more ? next : n_tiles);
            if (prev != ~0ull) finish_tile(prev, bufs[(k - 1) & 1], (k - 1) & 1);
            if (more) classify(next, claim);
            prev = have ? tile : ~0ull;
""",
     """\
                bs_lookback_load(cdesc, gdesc, prev, (i64)(prev >> BS_GROUP_LOG2) - 1, warp, lane, lb);
            if (have) stage_tile(tile, bufs[k & 1]);
            if (prev != ~0ull) finish_tile(prev, bufs[(k - 1) & 1], (k - 1) & 1);
            if (more) {
                load(next);
                classify(next, claim);
            }
            prev = have ? tile : ~0ull;
"""),
    # each tile's copy starts right after the previous tile's A
    ("""\
            next = more ? s_next : n_tiles;
        }
""",
     """\
            next = more ? s_next : n_tiles;
            if (next < n_tiles) prefetch(next);
        }
"""),
)

LOOKBACK_WARP = (
    # named barriers (immediate ids) and the look-back warp's block size
    ("""\
#endif
}

#define BS_AGG (1ull << 62)
""",
     """\
#endif
}

// Named barriers: wait for `n` threads (whole warps) at barrier ID (+ par), or arrive
// there without waiting; each orders the shared-memory accesses before it for those
// that wait. Immediate ids, so that ptxas reserves only the barriers used.
template <int ID> __device__ __forceinline__ void bs_bar_sync(int n) {
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "r"(n) : "memory");
}
template <int ID> __device__ __forceinline__ void bs_bar_arrive(int n) {
    asm volatile("bar.arrive %0, %1;" :: "n"(ID), "r"(n) : "memory");
}
template <int ID> __device__ __forceinline__ void bs_bar_sync(int par, int n) {
    if (par) bs_bar_sync<ID + 1>(n); else bs_bar_sync<ID>(n);
}
template <int ID> __device__ __forceinline__ void bs_bar_arrive(int par, int n) {
    if (par) bs_bar_arrive<ID + 1>(n); else bs_bar_arrive<ID>(n);
}
#define BS_BAR_WORKERS 1     // the eight worker warps
#define BS_BAR_COUNT 2       // + parity: a tile's count is published (worker warp 0 -> look-back warp)
#define BS_BAR_OFFSET 4      // + parity: a tile's offset is known (look-back warp -> workers)
#define BS_LB_THREADS (BS_THREADS + 32)
#ifndef BS_LB_BLOCKS
#define BS_LB_BLOCKS 4       // blocks per SM of a plain pack (56 registers; 3: 72)
#endif

#define BS_AGG (1ull << 62)
"""),
    # launch bounds for 288 threads
    ("""\
#endif
template <int FMT, int ENC, int MODE, int R>
__global__ void __launch_bounds__(BS_THREADS, (MODE == 0 || MODE == 3) ? BS_PACK_BLOCKS : BS_PACK_FUSED_BLOCKS)
bitsparse_pack(u64 x_ptr, u64 numel, int x_aligned,
               u64 mask_ptr, u64 mask_len,
""",
     """\
#endif
template <int FMT, int ENC, int MODE, int R>
__global__ void __launch_bounds__(BS_LB_THREADS, (MODE == 0 || MODE == 3) ? BS_LB_BLOCKS : BS_PACK_FUSED_BLOCKS)
bitsparse_pack(u64 x_ptr, u64 numel, int x_aligned,
               u64 mask_ptr, u64 mask_len,
"""),
    # the handoff slots replace the folds' shared sums
    ("""\
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u32 s_warp_neg[BS_WARPS];
    // Warps 0 and 1's folds, by the parity of the iteration: a C with no A since the
    // last C (a block's last iteration) writes while the last C's readers may still read.
    __shared__ u64 s_lb_sum[2][2];
    __shared__ u32 s_lb_flag[2][2];
    __shared__ u64 s_first, s_next;   // tiles the block took: its first, the one to load next
    {
""",
     """\
    __shared__ u32 s_warp_tot[BS_WARPS];
    __shared__ u32 s_warp_neg[BS_WARPS];
    // Handoffs by the parity of the tile's place in the block's sequence: the tile, its
    // count and nosign flag (workers -> look-back warp; tile ~0: no more tiles), and
    // its offset (look-back warp -> workers).
    __shared__ u64 s_cnt_tile[2], s_off[2];
    __shared__ u32 s_cnt_n[2], s_cnt_neg[2];
    __shared__ u64 s_first, s_next;   // tiles the block took: its first, the one to load next
    {
"""),
    # no look-back loads in the workers
    ("""\
    u32 bits[R], start[R];        // their mask bits and warp-relative ranks
    u32 warp_excl = 0, n = 0, any_neg = 0;
    u64 lb[2];                    // look-back loads of the tile awaiting C (warps 0 and 1)

    // This thread's slots of the input tile (after the two buffers): vector r at
""",
     """\
    u32 bits[R], start[R];        // their mask bits and warp-relative ranks
    u32 warp_excl = 0, n = 0, any_neg = 0;

    // This thread's slots of the input tile (after the two buffers): vector r at
"""),
    # A hands its tile to the look-back warp (its parity)
    ("""\

    // A(t).
    auto classify = [&](u64 tile, u64 claim) {
        u32 neg = 0;              // sign bits of stored elements, by word lane
#pragma unroll
""",
     """\

    // A(t).
    auto classify = [&](u64 tile, u64 claim, int par) {
        u32 neg = 0;              // sign bits of stored elements, by word lane
#pragma unroll
"""),
    # B1 among the workers
    ("""\
        if (lane == 0) { s_warp_tot[warp] = wtot; s_warp_neg[warp] = wneg; }
        if (tid == 0) s_next = claim;
        __syncthreads();                                                   // B1
        warp_excl = 0; n = 0; any_neg = 0;
#pragma unroll
""",
     """\
        if (lane == 0) { s_warp_tot[warp] = wtot; s_warp_neg[warp] = wneg; }
        if (tid == 0) s_next = claim;
        bs_bar_sync<BS_BAR_WORKERS>(BS_THREADS);                           // B1
        warp_excl = 0; n = 0; any_neg = 0;
#pragma unroll
"""),
    # the handoff of a tile's count, and of the end
    ("""\
            atomicAdd(reinterpret_cast<unsigned long long*>(&gdesc[tile >> BS_GROUP_LOG2]),
                      BS_G_ARRIVED | (any_neg ? BS_G_NEG : 0ull) | n);
        }
    };

""",
     """\
            atomicAdd(reinterpret_cast<unsigned long long*>(&gdesc[tile >> BS_GROUP_LOG2]),
                      BS_G_ARRIVED | (any_neg ? BS_G_NEG : 0ull) | n);
            s_cnt_tile[par] = tile;
            s_cnt_n[par] = n;
            s_cnt_neg[par] = any_neg;
        }
        if (warp == 0) { __syncwarp(); bs_bar_arrive<BS_BAR_COUNT>(par, 64); }
    };
    // No tile follows: the look-back warp's loop ends.
    auto hand_over_end = [&](int par) {
        if (tid == 0) s_cnt_tile[par] = ~0ull;
        if (warp == 0) { __syncwarp(); bs_bar_arrive<BS_BAR_COUNT>(par, 64); }
    };

"""),
    # B2 among the workers
    ("""\
                                (u32)(warp * SEG), rem, lane);
        if (SIGNS) {
            __syncthreads();                                               // B2
            const u32 groups = (n + 31u) >> 5;
            for (u32 j = (u32)tid; j < groups * 32u; j += BS_THREADS) {
""",
     """\
                                (u32)(warp * SEG), rem, lane);
        if (SIGNS) {
            bs_bar_sync<BS_BAR_WORKERS>(BS_THREADS);                       // B2
            const u32 groups = (n + 31u) >> 5;
            for (u32 j = (u32)tid; j < groups * 32u; j += BS_THREADS) {
"""),
    # C waits for the look-back warp's offset instead of folding
    ("""\
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
""",
     """\
    // C(t): the offset, then everything that needs it.
    auto finish_tile = [&](u64 tile, const Buf& buf, int par) {
        // The look-back warp's offset (this barrier also parts B's writes of buf from
        // the reads below in a block's last iteration, where no A comes between).
        bs_bar_sync<BS_BAR_OFFSET>(par, BS_LB_THREADS);
        const u64 P = s_off[par];
        const u32 tn = buf.n;
        // Chunk offsets at the round starts that begin a chunk.
        if (MODE != BS_MODE_MASKED && lane == 0) {
"""),
    # the look-back warp's loop, and the workers' loop
    ("""\
    if (tid == 0) s_first = take();
    __syncthreads();
    u64 tile = s_first, prev = ~0ull;
    if (tile < n_tiles) {
        prefetch(tile);
        load(tile);
        classify(tile, tid == 0 ? take() : 0ull);
        u64 next = s_next;
        if (next < n_tiles) prefetch(next);    // this thread has read its slots (classify used them)
        // The first iteration has no C (whose B3 otherwise parts an iteration's A from
        // the last one's reads of s_warp_tot and s_next).
        __syncthreads();
        // Iteration k: look-back loads of prev, B(tile), C(prev), A(next).
        for (int k = 0; tile < n_tiles || prev != ~0ull; ++k) {
            const bool have = tile < n_tiles, more = have && next < n_tiles;
            const u64 claim = tid == 0 && more ? take() : 0ull;   // its round trip hides behind B and C
            if (prev != ~0ull && prev > 0)
                bs_lookback_load(cdesc, gdesc, prev, (i64)(prev >> BS_GROUP_LOG2) - 1, warp, lane, lb);
            if (have) stage_tile(tile, bufs[k & 1]);
            if (prev != ~0ull) finish_tile(prev, bufs[(k - 1) & 1], (k - 1) & 1);
            if (more) {
                load(next);
                classify(next, claim);
            }
            prev = have ? tile : ~0ull;
            tile = more ? next : n_tiles;
            next = more ? s_next : n_tiles;
            if (next < n_tiles) prefetch(next);
        }
    }
""",
     """\
    if (tid == 0) s_first = take();
    __syncthreads();
    if (warp == BS_WARPS) {
        // The look-back warp: for each tile of the block in turn, once its count is
        // published: the offset (its group's earlier tiles back to an inclusive one, else
        // whole groups too), the inclusive descriptor, the total after the last tile.
        for (int j = 0;; ++j) {
            const int par = j & 1;
            bs_bar_sync<BS_BAR_COUNT>(par, 64);
            const u64 t = s_cnt_tile[par];
            if (t == ~0ull) break;
            const u32 tn = s_cnt_n[par], tneg = s_cnt_neg[par];
            u64 P = 0;
            u32 pneg = 0;
            if (t > 0) {
                const i64 g0 = (i64)(t >> BS_GROUP_LOG2) - 1;
                u64 lt[2], lg[2];
                bs_lookback_load(cdesc, gdesc, t, g0, 0, lane, lt);
                bs_lookback_load(cdesc, gdesc, t, g0, 1, lane, lg);
                bool found;
                bs_fold_tiles(cdesc, t, lane, lt[0], P, found, pneg);
                for (i64 g = g0; !found; g -= BS_GROUP) {
                    if (g != g0) bs_lookback_load(cdesc, gdesc, t, g, 1, lane, lg);
                    u64 sum;
                    u32 ng;
                    bs_fold_groups(gdesc, g, lane, lg, sum, found, ng);
                    P += sum;
                    pneg |= ng;
                }
            }
            if (lane == 0) {
                if (t > 0) bs_st_u64(&cdesc[t], BS_INCL | ((pneg || tneg) ? BS_NEG : 0ull) | (P + tn));
                if (t == n_tiles - 1)
                    bs_write_total<MODE != BS_MODE_MASKED>(P + tn, pneg | tneg, cap, numel, chunk_log2,
                                                           off64, offsets_ptr, status_ptr, slot_ptr);
                s_off[par] = P;
            }
            __syncwarp();
            bs_bar_arrive<BS_BAR_OFFSET>(par, BS_LB_THREADS);
        }
    } else {
        u64 tile = s_first, prev = ~0ull;
        if (tile < n_tiles) {
            prefetch(tile);
            load(tile);
            classify(tile, tid == 0 ? take() : 0ull, 0);
            u64 next = s_next;
            if (next < n_tiles) prefetch(next);    // this thread has read its slots (classify used them)
            // The first iteration has no C (whose barrier otherwise parts an iteration's A
            // from the last one's reads of s_warp_tot and s_next).
            bs_bar_sync<BS_BAR_WORKERS>(BS_THREADS);
            // Iteration k: B(tile), C(prev), A(next); tile is the block's k-th.
            for (int k = 0; tile < n_tiles || prev != ~0ull; ++k) {
                const bool have = tile < n_tiles, more = have && next < n_tiles;
                const u64 claim = tid == 0 && more ? take() : 0ull;   // its round trip hides behind B and C
                if (have) stage_tile(tile, bufs[k & 1]);
                if (prev != ~0ull) finish_tile(prev, bufs[(k - 1) & 1], (k - 1) & 1);
                if (more) {
                    load(next);
                    classify(next, claim, (k + 1) & 1);
                } else if (have) {
                    hand_over_end((k + 1) & 1);
                }
                prev = have ? tile : ~0ull;
                tile = more ? next : n_tiles;
                next = more ? s_next : n_tiles;
                if (next < n_tiles) prefetch(next);
            }
        } else {
            hand_over_end(0);
        }
    }
"""),
)

# name -> (edits in order, extra dynamic shared memory in bytes, threads a block)
INPUT_TILE = abi.WARPS * abi.PACK_ROUNDS * 32 * 16     # one tile of 16-byte vectors
PROTOS = {
    "copy-async": (COPY_ASYNC, INPUT_TILE, abi.THREADS),
    "lookback-warp": (COPY_ASYNC + LOOKBACK_WARP, INPUT_TILE, abi.THREADS + 32),
    "lookback-warp3": (COPY_ASYNC + LOOKBACK_WARP
                       + (("#define BS_LB_BLOCKS 4 ", "#define BS_LB_BLOCKS 3 "),),
                       INPUT_TILE, abi.THREADS + 32),
}


def proto_source(src: str, name: str) -> str:
    """``src`` (the package's pack kernel source) with prototype ``name``'s edits; each
    edit's text must occur exactly once (a kernel change that moves it fails here)."""
    for old, new in PROTOS[name][0]:
        if src.count(old) != 1:
            raise SystemExit(f"pack_protos: {name}: an edit's text occurs {src.count(old)} "
                             f"times in bitsparse_pack.cu, not once:\n{old}")
        src = src.replace(old, new)
    return src
