"""The CUDA host protocol on raw pointers: what every GPU entry point queues.

A packed tensor on the device is ONE block: the sections of
:func:`~bitsparse_core.spec.format.layout` at their serialized offsets minus the
header (64-byte aligned: the payload of a serialized buffer), then a 64-byte
status area (u32 status, u32 pad, u64 nnz) the pack kernel writes. A
:class:`PackPlan` holds everything about one pack that follows from its shape,
dtype, encoding, capacity and mode (layout, spans, tiles, kernel, shared memory),
computed once per distinct call (cached); the ``enqueue_*`` functions then only
fill an argument record and launch. They never allocate, never synchronize and
never look at the framework: callers pass device pointers and a stream and own
the memory (the CuPy backend through its allocator, the torch ops through torch's
caching allocator).

Rules every caller relies on:

* stream order: everything is queued on ``stream``; a caller whose inputs were
  produced on another stream orders ``stream`` after it first;
* scratch: a pack's scratch (``plan.scratch_bytes``, zeroed here) must stay
  allocated until the queued kernels have run — stream-ordered allocators (torch's,
  CuPy's) guarantee that when the caller drops it after queueing;
* overflow: a fixed-capacity pack keeps the first ``capacity`` values and sets
  ``STATUS_OVERFLOW``; every op that reads values must be given only packed
  tensors known not to have overflowed (the callers check the status first).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import NamedTuple

from ... import dtypes as _dt
from ...spec import format as _fmt
from ...spec.format import Encoding
from . import abi, driver, slots

Mode, Op = abi.Mode, abi.Op


class Planes(NamedTuple):
    """Device pointers and byte lengths of one packed tensor's planes."""
    mask: int
    mask_len: int
    offsets: int
    off64: int
    values: int
    values_len: int
    signs: int
    signs_len: int


@dataclass(frozen=True)
class PackPlan:
    lay: _fmt.Layout
    mode: Mode
    spans: tuple          # (offset in the block, length) of mask, offsets, values, signs
    status_offset: int
    nbytes: int           # the whole block, status area included
    rounds: int
    n_tiles: int
    scratch_bytes: int
    smem: int
    width: int            # bits per stored value in the value stream

    def planes(self, block: int) -> Planes:
        """The planes of a block made by this plan (not a masked one: its mask and
        offsets live in the mask tensor's block)."""
        (mo, ml), (oo, _), (vo, vl), (so, sl) = self.spans
        return Planes(block + mo, ml, block + oo, int(self.lay.offset_width == 8),
                      block + vo, vl, block + so, sl)

    def status(self, block: int) -> int:
        return block + self.status_offset

    # An exact pack lives in two allocations: the head (mask, offsets, then the status
    # area where the block has its values), whose size the count does not change, and
    # the values and signs, packed into a worst-case tail and copied into one of the
    # exact size. So the shrink moves only the stored values, never the mask.
    @property
    def head_bytes(self) -> int:
        return self.spans[2][0] + abi.STATUS_BYTES

    @property
    def tail_signs_offset(self) -> int:
        """Where the signs start in a tail (the values at 0)."""
        return _fmt.align(self.spans[2][1])

    @property
    def tail_bytes(self) -> int:
        return self.tail_signs_offset + _fmt.align(self.spans[3][1])


@functools.lru_cache(maxsize=4096)
def pack_plan(shape: tuple, dtype: _dt.DType, encoding: Encoding, capacity: int, chunk_log2: int,
              mode: Mode = Mode.PACK) -> PackPlan:
    """The plan of one pack; ``mode`` MASKED lays out values and signs only."""
    lay = _fmt.cached_layout(shape, dtype, encoding, capacity, chunk_log2)
    names = ("values", "signs") if mode == Mode.MASKED else ("mask", "offsets", "values", "signs")
    spans, pos = {}, 0
    for name in names:
        length = lay.sections[name][1]
        spans[name] = (pos, length)
        pos += _fmt.align(length)
    for name in ("mask", "offsets"):   # a masked pack's: lengths only (another block's)
        spans.setdefault(name, (0, lay.sections[name][1]))
    rounds = abi.PACK_ROUNDS
    n_tiles = pack_tiles(lay.numel, dtype)
    return PackPlan(lay, Mode(mode), tuple(spans[n] for n in ("mask", "offsets", "values", "signs")),
                    pos, pos + abi.STATUS_BYTES, rounds, n_tiles,
                    pack_scratch_bytes(lay.numel, dtype),
                    abi.pack_smem_bytes(dtype, encoding, rounds), abi.stream_width(dtype, encoding))


def pack_tiles(numel: int, dtype: _dt.DType) -> int:
    return -(-numel // abi.tile_elems(dtype, abi.PACK_ROUNDS))


def pack_scratch_bytes(numel: int, dtype: _dt.DType) -> int:
    """The scratch of any pack of ``numel`` elements, in any mode (whatever its capacity:
    a caller may allocate it before the plan is known)."""
    return abi.pack_scratch_bytes(pack_tiles(numel, dtype))


# Argument records are built once per thread (a launch copies them, so a record
# is free for reuse as soon as the call returns).
_RECORDS = threading.local()
_LAUNCH_CACHE_SIZE = 4096      # distinct launches (plan or layout, op, device) kept per thread


def _record(cls):
    rec = getattr(_RECORDS, cls.__name__, None)
    if rec is None:
        rec = cls()
        setattr(_RECORDS, cls.__name__, rec)
    return rec


@functools.lru_cache(maxsize=None)
def kernel(device: int, *key) -> int:
    """The ``CUfunction`` of a kernel on ``device`` (CuPy compiles kernels/*.cu)."""
    from ..cupy import kernels
    return kernels.function(device, *key)


# --------------------------------------------------------------------------- #
# Packing                                                                     #
# --------------------------------------------------------------------------- #
class _PackLaunch:
    """The launches of one plan on one device, with every field that follows from the
    plan already in the argument records: a call then sets only the pointers."""

    def __init__(self, plan: PackPlan, device: int):
        lay = plan.lay
        enc = lay.encoding
        fused = plan.mode in (Mode.RELU, Mode.RELU2, Mode.RELU_GATED)
        fmt = abi.FMT_OF[lay.dtype.name] if fused else abi.BITS_FMT[lay.dtype.bits]
        self.pack = kernel(device, "pack", fmt, int(enc), int(plan.mode), plan.rounds)
        self.grid = min(plan.n_tiles, driver.resident_blocks(self.pack, abi.THREADS, plan.smem,
                                                             device))
        self.args = abi.PackArgs().set(numel=lay.numel, mask_len=plan.spans[0][1],
                                       off64=lay.offset_width == 8, chunk_log2=lay.chunk_log2,
                                       cap=lay.capacity, n_tiles=plan.n_tiles)
        # The value / sign words the kernel zeros past the stored stream when asked to
        # (a masked pack's slots are never read past its count).
        self.tail_words = ((0, 0) if plan.mode == Mode.MASKED
                           else (-(-plan.spans[2][1] // 4), -(-plan.spans[3][1] // 4)))


def _launch(kind: str, key, make, anchor=None):
    """This thread's launch object for ``key`` (a launch reads its record while ctypes has
    released the GIL, so threads never share one), made by ``make()`` on a miss.
    ``anchor``: the object an ``id`` in the key stands for (an id can be reused)."""
    cache = getattr(_RECORDS, kind, None)
    if cache is None or len(cache) > _LAUNCH_CACHE_SIZE:
        cache = {}
        setattr(_RECORDS, kind, cache)
    entry = cache.get(key)
    if entry is None or entry[0] is not anchor:
        entry = cache[key] = (anchor, make())
    return entry[1]


def _pack_launch(plan: PackPlan, device: int) -> _PackLaunch:
    return _launch("pack", (id(plan), device), lambda: _PackLaunch(plan, device), plan)


def enqueue_pack(plan: PackPlan, device: int, stream: int, x: int, block: int, scratch: int,
                 y: int = 0, in_planes: Planes | None = None, zero_tail: bool = True,
                 slot: int = 0, u: int = 0) -> None:
    """Queue the pack of the dense tensor at ``x`` into ``block`` (``plan.nbytes``).

    ``y``: where relu_pack writes the dense activation (modes RELU / RELU2 / RELU_GATED;
    0 writes the planes only); ``u``: RELU_GATED's other factor, a dense tensor of x's
    shape and dtype (y = relu(x) * u). ``in_planes``: the mask tensor's planes (mode
    MASKED).
    ``scratch``: ``plan.scratch_bytes`` of device memory, zeroed here. ``zero_tail``:
    zero the value slots past the stored values (a fixed capacity; an exact pack's
    worst-case values are shrunk to the stored ones instead). ``slot``: a pinned host
    slot (:mod:`.slots`, or the torch adapter's slab) the kernel writes the status
    word and count to, 0 for none.
    """
    (mo, _), (oo, _), (vo, _), (so, _) = plan.spans
    if in_planes is not None:                       # masked: the mask tensor's own mask
        mask, offsets = in_planes.mask, 0
    else:
        mask, offsets = block + mo, block + oo
    enqueue_pack_planes(plan, device, stream, x, mask, offsets, block + vo, block + so,
                        block + plan.status_offset, scratch, y=y, zero_tail=zero_tail,
                        slot=slot, whole=(block, plan.nbytes), u=u)


def enqueue_pack_planes(plan: PackPlan, device: int, stream: int, x: int, mask: int,
                        offsets: int, values: int, signs: int, status: int, scratch: int, *,
                        y: int = 0, zero_tail: bool = True, slot: int = 0,
                        whole: tuple | None = None, u: int = 0) -> None:
    """:func:`enqueue_pack` into planes that live apart (an XLA custom call's results, an
    exact pack's two allocations): the mask, offsets, values and signs at the plan's
    lengths, each rounded up to a whole 4-byte word (the kernel stores words), and
    ``abi.STATUS_BYTES`` of status. A masked pack reads its mask at ``mask`` and writes
    no offsets. ``whole``: ``(address, bytes)`` of one block holding them all, which an
    empty pack zeros in one fill."""
    if plan.lay.numel == 0:                         # no planes but the offsets' one entry
        if whole is not None:
            driver.memset0(*whole, stream)
        else:
            if offsets:
                driver.memset0(offsets, plan.spans[1][1], stream)
            driver.memset0(status, abi.STATUS_BYTES, stream)
        if slot:
            slots.write(slot, 0, 0)
        return
    L = _pack_launch(plan, device)
    driver.memset0(scratch, plan.scratch_bytes, stream)
    r = L.args
    r.x, r.x_aligned, r.y, r.y_aligned = x, x % 16 == 0, y, bool(y) and y % 16 == 0
    r.mask, r.offsets, r.values, r.signs = mask, offsets, values, signs
    r.scratch, r.status = scratch, status
    r.zero_values_words, r.zero_signs_words = L.tail_words if zero_tail else (0, 0)
    r.slot = slot
    if (plan.mode == Mode.RELU_GATED) != bool(u and y):
        raise ValueError("a RELU_GATED pack takes u and y, and only it takes u")
    r.u, r.u_aligned = u, bool(u) and u % 16 == 0
    driver.launch_cooperative(L.pack, L.grid, abi.THREADS, plan.smem, stream, r)


class ExactTail(NamedTuple):
    """An exact pack's tail at its count (:func:`tail_shrink`): its size, the copies that
    fill it from the worst-case tail as ``(dst offset, src offset, bytes)``, and where its
    values (at 0) and signs lie in it: the tail of the plan at capacity ``nnz``."""
    nbytes: int
    copies: tuple
    values_len: int
    signs_offset: int
    signs_len: int


class TailTerms(NamedTuple):
    """:func:`tail_shrink`'s layout as arithmetic on the count, for native code that
    repeats it (``exact_shrink``, kernels/torch_host_exact.h): values ceil(nnz *
    value_bits / 8) bytes at 0, signs ceil(nnz * sign_bits / 8) bytes at the values' end
    rounded up to ``align``, copied from ``src_signs`` in the worst-case tail."""
    value_bits: int
    sign_bits: int
    align: int
    src_signs: int


def tail_terms(src: PackPlan) -> TailTerms:
    lay = src.lay
    # eight values take as many bytes as one takes bits (the format's size formula)
    return TailTerms(_fmt.values_nbytes(lay.dtype, lay.encoding, 8),
                     _fmt.signs_nbytes(lay.encoding, 8), _fmt.ALIGN, src.tail_signs_offset)


def tail_shrink(src: PackPlan, nnz: int) -> ExactTail:
    """The exact-size tail of an exact pack whose worst-case plan is ``src`` (see
    :attr:`PackPlan.head_bytes`) and whose count is ``nnz``. Plain arithmetic on the size
    formula: the exact plan itself is never built on the path the GPU waits for (the
    head's planes and status area are where ``src`` has them, at any capacity)."""
    if not 0 <= nnz <= src.lay.capacity:
        raise ValueError(f"tail_shrink: count {nnz} outside the plan's capacity "
                         f"{src.lay.capacity}")
    vl = _fmt.values_nbytes(src.lay.dtype, src.lay.encoding, nnz)
    sl = _fmt.signs_nbytes(src.lay.encoding, nnz)
    so = _fmt.align(vl)
    copies = ((0, 0, vl), (so, src.tail_signs_offset, sl)) if sl else ((0, 0, vl),)
    return ExactTail(so + _fmt.align(sl), copies if vl else (), vl, so, sl)


def enqueue_pack_split(plan: PackPlan, device: int, stream: int, x: int, head: int, tail: int,
                       scratch: int, y: int = 0, slot: int = 0) -> None:
    """Queue an exact pack's kernel into its head and worst-case tail."""
    (mo, _), (oo, _), (vo, _), _ = plan.spans
    enqueue_pack_planes(plan, device, stream, x, head + mo, head + oo, tail,
                        tail + plan.tail_signs_offset, head + vo, scratch, y=y,
                        zero_tail=False, slot=slot)


def enqueue_tail_shrink(copies: tuple, src_tail: int, dst_tail: int, stream: int) -> None:
    """Queue an :class:`ExactTail`'s copies from a worst-case tail into an exact-size one."""
    for d, s, n in copies:
        driver.copy(dst_tail + d, src_tail + s, n, stream)


# --------------------------------------------------------------------------- #
# Unpacking and the fused backward ops                                        #
# --------------------------------------------------------------------------- #
def prefix_scratch_bytes(lay: _fmt.Layout, op: Op) -> int:
    """Scratch an unpack-family op needs: 0 when every tile is a whole number of
    chunks (the offsets table has both ends of each tile's value range), else one
    prefix count per tile plus one."""
    rounds = abi.unpack_rounds(lay.dtype, op)
    tile = abi.tile_elems(lay.dtype, rounds)
    if (1 << lay.chunk_log2) <= tile or lay.numel == 0:
        return 0
    return 8 * (-(-lay.numel // tile) + 1)


class _UnpackLaunch:
    """An unpack-family kernel for one layout, op and device, with the record's fields
    that follow from them already set: a call then sets the pointers."""

    def __init__(self, lay: _fmt.Layout, op: Op, u_encoding: int, device: int):
        rounds = abi.unpack_rounds(lay.dtype, op)
        self.n_tiles = -(-lay.numel // abi.tile_elems(lay.dtype, rounds))
        self.prefix_bytes = prefix_scratch_bytes(lay, op)
        fmt = abi.BITS_FMT[lay.dtype.bits] if op == Op.UNPACK else abi.FMT_OF[lay.dtype.name]
        self.func = kernel(device, "unpack", fmt, int(op), rounds, int(lay.encoding), u_encoding)
        self.args = abi.UnpackArgs().set(numel=lay.numel, chunk_log2=lay.chunk_log2,
                                         prefix_mode=2 if self.prefix_bytes else 0)
        if self.prefix_bytes:
            self.counts = kernel(device, "tile_counts", abi.BITS_FMT[lay.dtype.bits], rounds)
            self.counts_args = abi.TileCountsArgs().set(numel=lay.numel)


def _unpack_launch(lay: _fmt.Layout, op: Op, u_encoding: int, device: int) -> _UnpackLaunch:
    # keyed by what the launch follows from, not the capacity: every exact pack has a
    # capacity (and so a layout) of its own
    key = (lay.dtype, lay.encoding, lay.numel, lay.chunk_log2, op, u_encoding, device)
    return _launch("unpack", key, lambda: _UnpackLaunch(lay, op, u_encoding, device))


def enqueue_unpack(lay: _fmt.Layout, p: Planes, op: Op, device: int, stream: int, out: int,
                   *, grad: int = 0, out2: int = 0, pu: Planes | None = None,
                   u_encoding: Encoding = Encoding.RAW, udense: int = 0, prefix: int = 0,
                   prefix_scan=None) -> None:
    """Queue an unpack-family kernel over the packed tensor ``p`` of layout ``lay``.

    ``prefix``: ``prefix_scratch_bytes(lay, op)`` bytes of device memory when that
    is nonzero; ``prefix_scan(ptr, n)`` then queues the in-place inclusive sum of
    ``n`` u64 tile counts at ``ptr`` on ``stream`` (a framework's cumsum).
    """
    if lay.numel == 0:
        return
    L = _unpack_launch(lay, op, int(u_encoding) if pu is not None else 0, device)
    if L.prefix_bytes:
        tc = L.counts_args
        tc.mask, tc.mask_len, tc.counts = p.mask, p.mask_len, prefix + 8
        driver.memset0(prefix, 8, stream)
        driver.launch(L.counts, L.n_tiles, abi.THREADS, 0, stream, tc)
        prefix_scan(prefix + 8, L.n_tiles)
    r = L.args
    r.offsets, r.off64, r.prefix = p.offsets, p.off64, prefix if L.prefix_bytes else 0
    r.mask, r.mask_len = p.mask, p.mask_len
    r.values, r.values_len, r.signs, r.signs_len = p.values, p.values_len, p.signs, p.signs_len
    if op in (Op.GATED, Op.GATED_PRODUCT):           # u's planes (its own values, our mask)
        r.uvalues, r.uvalues_len, r.usigns, r.usigns_len = (pu.values, pu.values_len, pu.signs,
                                                            pu.signs_len)
    r.g, r.g_aligned, r.ud, r.ud_aligned = grad, grad % 16 == 0, udense, udense % 16 == 0
    r.out, r.out_aligned, r.out2, r.out2_aligned = out, out % 16 == 0, out2, out2 % 16 == 0
    driver.launch(L.func, L.n_tiles, abi.THREADS, 0, stream, r)


def enqueue_relu_backward(lay: _fmt.Layout, p: Planes, device: int, stream: int, grad: int,
                          out: int) -> None:
    """ReLU's input gradient from the mask alone: ``grad`` where the bit is set, else 0."""
    if lay.numel == 0:
        return
    func, grid = mask_select_launch(lay, device)
    r = _record(abi.MaskSelectArgs)
    r.g, r.g_aligned, r.mask, r.mask_len = grad, grad % 16 == 0, p.mask, p.mask_len
    r.numel, r.out, r.out_aligned = lay.numel, out, out % 16 == 0
    driver.launch(func, grid, abi.THREADS, 0, stream, r)


def mask_select_launch(lay: _fmt.Layout, device: int) -> tuple:
    """``(CUfunction, grid)`` of ReLU's mask-only gradient over ``lay``: a grid-stride
    kernel, enough blocks to fill the device, not one per vector."""
    v = 16 // lay.dtype.itemsize
    grid = min(-(-lay.numel // (v * abi.THREADS)), driver.sm_count(device) * 32)
    return kernel(device, "mask_select", abi.BITS_FMT[lay.dtype.bits]), grid
