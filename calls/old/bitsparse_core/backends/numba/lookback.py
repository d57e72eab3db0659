"""The pack's decoupled look-back over tiles and groups of tiles.

Each pack tile publishes its count (one 8-byte descriptor) as soon as it has
staged its values, and adds it to its group's descriptor (LB_GROUP tiles per
group, one 64-bit ``atomic.add``: tiles, nosign tiles and count in fields). A
tile then finds its value offset in two steps: its own group's earlier tiles
back to the nearest inclusive one, and, where none is, whole earlier groups back
to the first whose last tile is inclusive (a group counts once all its tiles
have added to it). On a GPU warp 0 reads both windows of 32 in one round trip,
so one round trip covers 32 groups (1024 tiles) where per-tile windows covered
32 tiles; under the simulator one thread walks the same descriptors (blocks run
in order there), and groups are 4 tiles so small tensors span several.

The scratch (int64, zeroed): ticket, unused, one descriptor per tile, one per
group (:func:`scratch_slots`).
"""

from __future__ import annotations

from numba import cuda, int64

from .common import FULL_MASK, SIM

# Tile descriptors: state in bits 61-62, the nosign flag (a stored value has its
# sign bit set: this tile's, or any up to it once inclusive) in bit 60, count below.
LB_SHIFT = 61
LB_NEG = 1 << 60
LB_COUNT = LB_NEG - 1
LB_AGG = 1 << LB_SHIFT           # the tile's own count is published
LB_INCL = 2 << LB_SHIFT          # the count up to and including the tile is published
SCRATCH_HEAD = 2                 # int64 slots before the descriptors: ticket, unused
# Group descriptors: tiles added in bits 48.., of them with the nosign flag in bits
# 40-47, their counts below (32 tiles of at most 16384 values: 2**19).
LB_GROUP_LOG2 = 2 if SIM else 5
LB_GROUP = 1 << LB_GROUP_LOG2
GD_TILES = 48
GD_NEG = 40
GD_COUNT = (1 << GD_NEG) - 1
GD_ADD = 1 << GD_TILES           # one tile's share of the tiles field


def scratch_slots(n_tiles: int) -> int:
    """int64 slots of the look-back's scratch: the head, a descriptor per tile and
    one per group of LB_GROUP tiles."""
    return SCRATCH_HEAD + n_tiles + -(-n_tiles // LB_GROUP)


@cuda.jit(device=True)
def _rd64(a, i):
    """Coherent read of a value another block publishes (an atomic goes to L2)."""
    return cuda.atomic.add(a, i, int64(0))


@cuda.jit(device=True)
def tile_slot(tile):
    """The scratch slot of a tile's descriptor."""
    return SCRATCH_HEAD + tile


@cuda.jit(device=True)
def _group_slot(g):
    """The scratch slot of group g's descriptor, after the tiles' (one block per tile:
    the grid's size is their number)."""
    return SCRATCH_HEAD + int64(cuda.gridDim.x) + g


@cuda.jit(device=True)
def _read_group(desc, g):
    """Group g's descriptor and its last tile's."""
    return (_rd64(desc, _group_slot(g)),
            _rd64(desc, tile_slot((g << LB_GROUP_LOG2) + LB_GROUP - 1)))


@cuda.jit(device=True)
def publish(desc, tile, n, neg, t):
    """Thread 0: the tile's count in one 8-byte descriptor, with its nosign flag
    (inclusive for tile 0), then its share of its group's descriptor (after the
    tile descriptors: the grid's size places it)."""
    if t == 0:
        d = n
        g = n | GD_ADD
        if neg != 0:
            d |= LB_NEG
            g |= int64(1) << GD_NEG
        cuda.atomic.exch(desc, tile_slot(tile), int64(LB_INCL if tile == 0 else LB_AGG) | d)
        cuda.atomic.add(desc, _group_slot(tile >> LB_GROUP_LOG2), g)


if SIM:
    @cuda.jit(device=True)
    def lb_load(desc, tile, lane, f):
        pass

    @cuda.jit(device=True)
    def lookback(desc, tile, lane, f):
        """(values before ``tile``, OR of their nosign flags) in lane 0.
        Simulator: one thread walks the tiles of its group, then whole groups."""
        acc = int64(0)
        neg = int64(0)
        if lane == 0:
            first = (tile >> LB_GROUP_LOG2) << LB_GROUP_LOG2
            j = tile - 1
            while j >= first:
                d = _rd64(desc, tile_slot(j))
                while (d >> LB_SHIFT) == 0:
                    d = _rd64(desc, tile_slot(j))
                acc += d & LB_COUNT
                neg |= d & LB_NEG
                if (d >> LB_SHIFT) == 2:
                    return acc, int64(neg != 0)
                j -= 1
            g = (tile >> LB_GROUP_LOG2) - 1
            while g >= 0:
                gd, ld = _read_group(desc, g)
                while (ld >> LB_SHIFT) != 2 and (gd >> GD_TILES) != LB_GROUP:
                    gd, ld = _read_group(desc, g)
                if (ld >> LB_SHIFT) == 2:
                    acc += ld & LB_COUNT
                    neg |= ld & LB_NEG
                    break
                acc += gd & GD_COUNT
                neg |= (gd >> GD_NEG) & 0xFF
                g -= 1
        return acc, int64(neg != 0)
else:
    @cuda.jit(device=True)
    def _group_load(desc, g, f):
        """f[1], f[2] of a lane: group ``g``'s descriptor and its last tile's (before
        group 0: an empty complete group and an inclusive 0)."""
        gd = int64(GD_ADD * LB_GROUP)
        ld = int64(LB_INCL)
        if g >= 0:
            gd, ld = _read_group(desc, g)
        f[1] = gd
        f[2] = ld

    @cuda.jit(device=True)
    def lb_load(desc, tile, lane, f):
        """Issue warp 0's reads, one round trip: f[0] of lane l is the descriptor
        of tile - 1 - l within the tile's group (an empty aggregate before the
        group's first tile), f[1] and f[2] group (tile's group) - 1 - l's."""
        first = (tile >> LB_GROUP_LOG2) << LB_GROUP_LOG2
        j = tile - 1 - lane
        d = int64(LB_AGG)
        if j >= first:
            d = _rd64(desc, tile_slot(j))
        f[0] = d
        _group_load(desc, (tile >> LB_GROUP_LOG2) - 1 - lane, f)

    @cuda.jit(device=True)
    def _upto_nearest(incl):
        """Lanes up to and including the nearest (lowest) lane set in ``incl``, all
        32 when none is: the lanes a window's sum needs."""
        if incl == 0:
            return int64(FULL_MASK)
        return ((incl & -incl) << 1) - 1

    @cuda.jit(device=True)
    def _warp_sum(c):
        """The int64 sum of c over warp 0's lanes, in every lane."""
        o = 16
        while o > 0:
            c += cuda.shfl_xor_sync(FULL_MASK, c, o)
            o >>= 1
        return c

    @cuda.jit(device=True)
    def lookback(desc, tile, lane, f):
        """(values before ``tile``, OR of their nosign flags) in every lane of warp 0,
        from the reads lb_load issued into f. First the tile's group: wait until the
        descriptors up to the nearest inclusive one are published and sum their
        counts (an inclusive descriptor's count is its prefix). With none there, the
        groups: lanes up to the nearest group whose last tile is inclusive wait for
        it or for their group to be complete, then the group sums and that tile's
        prefix are added; with none there, the next 32 groups (one round trip)."""
        j = tile - 1 - lane
        d = f[0]
        while True:
            incl = int64(cuda.ballot_sync(FULL_MASK, (d >> LB_SHIFT) == 2))
            need = _upto_nearest(incl)
            if (int64(cuda.ballot_sync(FULL_MASK, (d >> LB_SHIFT) == 0)) & need) == 0:
                break
            if (d >> LB_SHIFT) == 0:
                d = _rd64(desc, tile_slot(j))
        mine = ((need >> lane) & 1) != 0
        c = int64(0)
        if mine:
            c = d & LB_COUNT
        acc = _warp_sum(c)
        neg = cuda.ballot_sync(FULL_MASK, mine and (d & LB_NEG) != 0)
        g = (tile >> LB_GROUP_LOG2) - 1 - lane
        while incl == 0:
            gd = f[1]
            ld = f[2]
            while True:
                incl = int64(cuda.ballot_sync(FULL_MASK, (ld >> LB_SHIFT) == 2))
                need = _upto_nearest(incl)
                ready = (ld >> LB_SHIFT) == 2 or (gd >> GD_TILES) == LB_GROUP
                if (int64(cuda.ballot_sync(FULL_MASK, not ready)) & need) == 0:
                    break
                if not ready:
                    gd, ld = _read_group(desc, g)
            c = int64(0)
            gneg = False
            if ((need >> lane) & 1) != 0:
                if (ld >> LB_SHIFT) == 2:            # the nearest inclusive: its prefix
                    c = ld & LB_COUNT
                    gneg = (ld & LB_NEG) != 0
                else:                                # a whole group before it
                    c = gd & GD_COUNT
                    gneg = ((gd >> GD_NEG) & 0xFF) != 0
            acc += _warp_sum(c)
            neg |= cuda.ballot_sync(FULL_MASK, gneg)
            if incl == 0:
                g -= 32
                _group_load(desc, g, f)
        return acc, int64(neg != 0)
