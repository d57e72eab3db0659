"""The Numba CUDA kernels of the ``numba`` backend (format v1, bit-exact), per dtype.

Work is cut into *tiles* (one thread block each) of *groups* of 8 consecutive
elements, one mask byte per group. Each kernel family has its own module and
tile:

* :mod:`.pack` (``DtypeKernels.ptile``): one pass, 64 bytes per thread, with a
  decoupled look-back (:mod:`.lookback`), plus ``finish`` (:mod:`.edges`), which
  writes the stream words shared by tiles;
* :mod:`.unpack` (``DtypeKernels.utile_log2``): 256 threads x UNPACK_ROWS rows
  of 16 bytes, one kernel per (op, encoding); the fused ops that read packed
  values (relu2_backward, the gated op) are ops of the same kernels, in
  ``TILE``-element tiles, their arithmetic in :mod:`.fused_rows`;
* :mod:`.fused`: ``relu_backward`` (the mask only);
* :mod:`.scan`: the tile offsets of chunks larger than a tile.

:mod:`.common` holds the target switch (GPU or the CUDA simulator), the shared
constants and primitives; :mod:`.elements` one element type's constants and
group loads. This module assembles one dtype's kernels and re-exports the
names the backend, tests and bench scripts use.
"""

from __future__ import annotations

import dataclasses
import functools

from ...errors import UnsupportedDeviceError
from .common import (FULL_MASK, G, GPT, LANE_N, MODE_MASKED, MODE_PACK, MODE_RELU, MODE_RELU2,
                     NOSIGN, NT, NW, RAW, SCAN_NT, SCAN_PER, SIGNPLANE, SIM, TILE, TILE_LOG2,
                     ULANE_N, UNT, UNW)
from .edges import make_finish
from .elements import elem
from .fused import make_relu_backward
from .fused_rows import OP_GATED, OP_GATED_DENSE, OP_RELU2
from .lookback import (LB_AGG, LB_COUNT, LB_GROUP, LB_INCL, LB_NEG, LB_SHIFT, SCRATCH_HEAD,
                       scratch_slots)
from .pack import PACK_JIT, make_pack_kernels, pack_rounds_for
from .scan import COUNT_MASK, FLAG_SHIFT, k_mask_count, k_scan
from .unpack import UNPACK_JIT, UNPACK_ROWS, make_unpack_kernels

__all__ = [  # what the backend, tests and bench scripts read from this module
    "COMMITTED", "COUNT_MASK", "DtypeKernels", "PackVariant", "FLAG_SHIFT", "FULL_MASK", "G",
    "GPT", "LANE_N", "LB_AGG", "LB_COUNT", "LB_GROUP", "LB_INCL", "LB_NEG", "LB_SHIFT",
    "MODE_MASKED", "MODE_PACK", "MODE_RELU", "MODE_RELU2", "NOSIGN", "NT", "NW", "OP_GATED",
    "OP_GATED_DENSE", "OP_RELU2", "PACK_JIT", "RAW", "SCAN_NT", "SCAN_PER", "SCRATCH_HEAD",
    "SIGNPLANE", "SIM", "TILE", "TILE_LOG2", "ULANE_N", "UNPACK_JIT", "UNPACK_ROWS", "UNT",
    "UNW", "k_mask_count", "k_scan", "kernels_for", "pack_rounds_for", "scratch_slots"]


@dataclasses.dataclass(frozen=True)
class PackVariant:
    """A variant of the kernels (the pack's; the unpack family's prefetch and warp sums),
    for tests and A/B timings; the defaults are the committed choices, which the
    registered backend uses.

    ``pack_rounds``: groups of 8 elements per pack thread instead of the target's (the
    simulator tests run the GPU's this way); ``pack_blocks``: the blocks per SM the plain
    and masked pack's launch bounds ask for (default 5); ``lb_early``: publish the count
    and issue the look-back's reads before staging, not after; ``ticket=False``: a
    block's tile is its block index (no atomic ticket and no barrier before the loads;
    forward progress then rests on blocks being dispatched in index order, as CUB's
    scans assume); ``incl_every``: a tile publishes its inclusive count only every this
    many tiles (a launch argument: tests raise it to make look-backs walk);
    ``fill_limit``: a pack whose values, signs and zeroed scratch take at most this many
    bytes zeroes them with one fill and lets its tiles OR the stream words they share
    (no ``k_finish``: up to this size the fill costs the GPU no more than k_finish
    does, and the host one launch less; larger packs run it, bench/NOTES.md session
    35). Tests set 0 to run ``k_finish`` on small tensors. ``warp_redux``: the warps'
    counts summed by warp reductions (``redux.sync``) instead of every thread's loop
    over them, in the plain and masked packs and the unpack family (under the
    simulator, through shared memory). ``unpack_prefetch``: the
    unpack-family kernels ask for the planes of the tile a quarter of a wave ahead in L2
    (``cp.async.bulk.prefetch``, as the CuPy unpack does); True is refused on a device
    older than sm_90, None (the default) means where the device has it (and under the
    simulator). Both defaults: bench/NOTES.md, session 43."""
    pack_rounds: int | None = None
    pack_blocks: int | None = None
    lb_early: bool = False
    ticket: bool = True
    warp_redux: bool = True
    unpack_prefetch: bool | None = None
    incl_every: int = 1
    fill_limit: int = 8 << 20

    def compiled(self) -> "PackVariant":
        """The part that selects compiled kernels (``incl_every`` is passed at launch, and
        ``fill_limit`` picks among them)."""
        return dataclasses.replace(self, incl_every=1, fill_limit=PackVariant.fill_limit)


COMMITTED = PackVariant()


def _check_bulk_prefetch() -> None:
    """``unpack_prefetch`` compiles ``cp.async.bulk.prefetch`` (sm_90 and later): refuse it,
    by name, on a device known to be older (an offline build has none to ask)."""
    if SIM:
        return
    try:
        from numba import cuda
        cc = tuple(cuda.get_current_device().compute_capability)
    except Exception:  # noqa: BLE001 -- no driver or context here: nothing to check against
        return
    if cc < (9, 0):
        raise UnsupportedDeviceError(f"PackVariant(unpack_prefetch=True) needs compute "
                                     f"capability 9.0 or later; this device has {cc[0]}.{cc[1]}")


def _bulk_prefetch(requested: bool | None) -> bool:
    """Whether the unpack family is built with its L2 prefetch: as ``requested`` (True
    checked against the device), or with None, where the current device is sm_90 or
    later (always under the simulator; never where no device can be asked)."""
    if requested is not None:
        if requested:
            _check_bulk_prefetch()
        return bool(requested)
    if SIM:
        return True
    try:
        from numba import cuda
        return tuple(cuda.get_current_device().compute_capability) >= (9, 0)
    except Exception:  # noqa: BLE001 -- no driver or context: the build that runs anywhere
        return False


class DtypeKernels:
    """The kernels of one element type, compiled on first launch."""

    def __init__(self, name: str, variant: PackVariant = COMMITTED):
        self.prefetch = prefetch = _bulk_prefetch(variant.unpack_prefetch)
        el = elem(name)
        self.name, self.variant = name, variant
        self.bits = el.BITS
        geo, self.pack = make_pack_kernels(el, variant.pack_rounds, variant.pack_blocks,
                                           variant.lb_early, variant.ticket, variant.warp_redux)
        self.ptile, self.ptile_log2 = geo.PTILE, geo.PTILE_LOG2
        self.finish = make_finish(el.W)
        self.utile_log2, self.unpack = make_unpack_kernels(el, prefetch, variant.warp_redux)
        self.relu_backward = make_relu_backward(el)


@functools.lru_cache(maxsize=None)
def _kernels(name: str, variant: PackVariant) -> DtypeKernels:
    return DtypeKernels(name, variant)


_COMMITTED_BY_NAME: dict = {}


def kernels_for(name: str, variant: PackVariant = COMMITTED) -> DtypeKernels:
    """The kernels of one dtype and pack variant, built once. The committed variant's
    are looked up by name alone: every op asks, and hashing a variant record (or making
    its ``compiled()`` copy) costs microseconds of host time."""
    if variant is COMMITTED:
        kern = _COMMITTED_BY_NAME.get(name)
        if kern is None:
            kern = _COMMITTED_BY_NAME[name] = _kernels(name, COMMITTED)
        return kern
    return _kernels(name, variant.compiled())
