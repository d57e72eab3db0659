"""The pack's decoupled look-back: per-tile descriptors in the scratch buffer.

Each pack tile publishes its count (one 8-byte descriptor) as soon as it has
staged its values, then finds its value offset from its predecessors'
descriptors: on a GPU warp 0 reads ``windows`` windows of 32 per round trip
with warp votes; under the simulator one thread walks back (blocks run in
order there).
"""

from __future__ import annotations

import functools

from numba import cuda, int32, int64

from .common import FULL_MASK, SIM

# Look-back descriptors (int64): state in bits 61-62, the nosign flag (a stored value
# has its sign bit set: this tile's, or any up to it once inclusive) in bit 60, count below.
LB_SHIFT = 61
LB_NEG = 1 << 60
LB_COUNT = LB_NEG - 1
LB_AGG = 1 << LB_SHIFT           # the tile's own count is published
LB_INCL = 2 << LB_SHIFT          # the count up to and including the tile is published
SCRATCH_HEAD = 2                 # int64 slots before the descriptors: ticket, unused
LB_WINDOWS = 8                   # look-back: 32-descriptor windows per lane and round trip


@cuda.jit(device=True)
def _rd64(a, i):
    """Coherent read of a value another block publishes (an atomic goes to L2)."""
    return cuda.atomic.add(a, i, int64(0))



@cuda.jit(device=True)
def publish(desc, tile, n, neg, t):
    """Thread 0: the tile's count in one 8-byte descriptor, with its nosign flag
    (inclusive for tile 0)."""
    if t == 0:
        d = n
        if neg != 0:
            d |= LB_NEG
        if tile == 0:
            cuda.atomic.exch(desc, SCRATCH_HEAD, int64(LB_INCL) | d)
        else:
            cuda.atomic.exch(desc, SCRATCH_HEAD + tile, int64(LB_AGG) | d)


if SIM:
    def _make_lookback(windows):
        return _lb_load, _lookback

    @cuda.jit(device=True)
    def _lb_load(desc, tile, lane, f):
        pass

    @cuda.jit(device=True)
    def _lookback(desc, tile, lane, f):
        """(values before ``tile``, OR of their nosign flags) in lane 0.
        Simulator: one thread walks back (blocks run in order there)."""
        acc = int64(0)
        neg = int64(0)
        if lane == 0:
            j = tile - 1
            while j >= 0:
                d = _rd64(desc, SCRATCH_HEAD + j)
                while (d >> LB_SHIFT) == 0:
                    d = _rd64(desc, SCRATCH_HEAD + j)
                acc += d & LB_COUNT
                neg |= d & LB_NEG
                if (d >> LB_SHIFT) == 2:
                    break
                j -= 1
        return acc, int64(neg != 0)
else:
    @functools.lru_cache(maxsize=None)
    def _make_lookback(windows):
        """Warp 0's look-back, reading ``windows`` windows of 32 descriptors per
        round trip (LB_WINDOWS unless a variant asks otherwise)."""
        @cuda.jit(device=True)
        def _lb_load(desc, tile, lane, f):
            """Issue the reads of the ``windows`` nearest windows: f[q] of lane l is the
            descriptor of tile - 1 - l - 32 q (tiles before 0 read as an inclusive 0)."""
            for q in range(windows):
                j = tile - 1 - lane - 32 * q
                d = int64(LB_INCL)
                if j >= 0:
                    d = _rd64(desc, SCRATCH_HEAD + j)
                f[q] = d

        @cuda.jit(device=True)
        def _lookback(desc, tile, lane, f):
            """(values before ``tile``, OR of their nosign flags) in every lane of warp 0,
            from the windows _lb_load issued into f. Nearest window first: wait until
            its descriptors are published, sum their counts up to the nearest
            inclusive one (aggregates in 32 bits with the flags in bits 24.., the
            inclusive count by a shuffle); with none there, the next window, and past
            the last one the next ``windows`` are read (one round trip)."""
            acc = int64(0)
            neg = int32(0)
            base = tile - 1
            while True:
                done = False
                for q in range(windows):
                    if not done:
                        j = base - lane - 32 * q
                        d = f[q]
                        while cuda.any_sync(FULL_MASK, (d >> LB_SHIFT) == 0):
                            if (d >> LB_SHIFT) == 0:
                                d = _rd64(desc, SCRATCH_HEAD + j)
                        incl = int64(cuda.ballot_sync(FULL_MASK, (d >> LB_SHIFT) == 2))
                        first = 32
                        if incl != 0:                                # the nearest inclusive one
                            first = cuda.popc(int32((incl & -incl) - 1))
                        c = int32(0)
                        if lane < first:
                            c = int32(d & LB_COUNT)                  # an aggregate: one tile's count
                        if lane <= first and (d & LB_NEG) != 0:
                            c |= int32(1 << 24)
                        o = 16
                        while o > 0:
                            c = int32(c + cuda.shfl_xor_sync(FULL_MASK, c, o))
                            o >>= 1
                        acc += int64(c & 0xFFFFFF)
                        neg |= c >> 24
                        if incl != 0:
                            acc += cuda.shfl_sync(FULL_MASK, d, first) & LB_COUNT
                            done = True
                if done:
                    break
                base -= 32 * windows
                _lb_load(desc, base + 1, lane, f)
            return acc, int64(neg != 0)

        return _lb_load, _lookback
