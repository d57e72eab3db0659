"""Tile offsets of a packed tensor whose chunks span several tiles:
``k_mask_count`` reads each ``TILE``'s nonzeros off the mask plane and ``k_scan``
(one block) turns the counts into an exclusive prefix.
"""

from __future__ import annotations

from numba import cuda, int32, int64

from .common import G, GPT, NT, SCAN_NT, SCAN_PER

FLAG_SHIFT = 62                  # k_scan: per-entry flag bit above the count
COUNT_MASK = (1 << FLAG_SHIFT) - 1


@cuda.jit
def k_scan(cnt, n, info):
    """One block: cnt[0..n) -> exclusive prefix in place, cnt[n] = info[0] = total,
    info[1] = OR of the entries' flag bits (bit FLAG_SHIFT)."""
    t = cuda.threadIdx.x
    sh = cuda.shared.array(SCAN_NT, int64)
    carry = int64(0)
    flag = 0
    seg = SCAN_NT * SCAN_PER
    base = int64(0)
    while base < n:
        lo = base + t * SCAN_PER
        s = int64(0)
        for q in range(SCAN_PER):
            if lo + q < n:
                c = cnt[lo + q]
                s += c & COUNT_MASK
                flag |= c >> FLAG_SHIFT
        sh[t] = s
        cuda.syncthreads()
        d = 1
        while d < SCAN_NT:
            v = int64(0)
            if t >= d:
                v = sh[t - d]
            cuda.syncthreads()
            sh[t] += v
            cuda.syncthreads()
            d *= 2
        ex = carry + sh[t] - s
        for q in range(SCAN_PER):
            if lo + q < n:
                c = cnt[lo + q] & COUNT_MASK
                cnt[lo + q] = ex
                ex += c
        carry += sh[SCAN_NT - 1]
        cuda.syncthreads()
        base += seg
    anyflag = cuda.syncthreads_or(flag)
    if t == 0:
        cnt[n] = carry
        info[0] = carry
        info[1] = anyflag


@cuda.jit
def k_mask_count(mask, ngroups, cnt):
    """Nonzeros per tile, read off a mask plane (for chunks larger than a tile)."""
    t = cuda.threadIdx.x
    tile = int64(cuda.blockIdx.x)
    sh = cuda.shared.array(1, int64)
    if t == 0:
        sh[0] = 0
    cuda.syncthreads()
    c = int64(0)
    for r in range(G):
        g = tile * GPT + r * NT + t
        if g < ngroups:
            c += cuda.popc(int32(mask[g]))
    cuda.atomic.add(sh, 0, c)
    cuda.syncthreads()
    if t == 0:
        cnt[tile] = sh[0]
