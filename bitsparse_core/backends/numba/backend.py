"""The ``numba`` backend: format-v1 pack/unpack and the fused ops with Numba CUDA.

Same contract and bit-exact results as the NumPy reference (see
:mod:`bitsparse_core.backends`); the kernels live in
:mod:`.kernels` and its siblings, the shared GPU plumbing (streams, zero-copy
inputs, the pluggable allocator, DLPack outputs) in :mod:`..cuda.interop`. A
packed tensor is one allocation (an exact pack's two: its mask and offsets apart
from its values), its planes are views into it
(:class:`..cuda.interop.DevicePlane`, like the CuPy backend's, so either
backend unpacks the other's tensors).

Exact, fixed-capacity and ``"auto"`` packing follow the host protocol both CUDA
backends share (:mod:`..cuda.protocol`), with allocations laid out by its plans;
``masked_pack`` of a tensor whose count is still pending syncs once (the
companion's capacity is that count, as in the reference).

A packed tensor remembers the stream it was made on (``extra["stream"]``); an
op on another stream first makes that stream wait for it (an event), so planes
are never read before they are written.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same host code runs on
NumPy arrays standing in for device memory (:class:`_SimPlatform`); that is how
CI tests it without a GPU.
"""

from __future__ import annotations

import functools
import threading
from functools import reduce as _reduce
from operator import or_ as _or
from typing import NamedTuple

import numpy as np
from numba import cuda as _cuda

from ...errors import OutputMismatchError, UnsupportedDeviceError
from ...packed import PackedTensor
from ...spec import format as _fmt
from ...spec.ops import masked_encoding
from ..cuda import abi, driver
from ..cuda.abi import Mode
from ..cuda import protocol
from ..cuda import host, shrink, slots
from ..cuda.host import pack_plan
from ..cuda.interop import DevicePlane
from . import kernels as K
from .launch import BoundLaunch, KernelArray, Launch, PerThread, first_launch, kinds_of, log


# The device of the context current in the running entry point (None outside one).
_ENTRY = threading.local()


def _one_context(method):
    """Run a backend entry point where a CUDA context is current. When the calling
    thread has one (PyTorch's, CuPy's or Numba's primary context), the entry point runs
    as it is: its launches and copies go through the driver, and the device comes from
    the context, asked once here (one driver call answers both questions) and read by
    :meth:`_GpuPlatform._dev`. Otherwise it runs inside a Numba context scope, which
    makes Numba's context current; entering one asks the driver and Numba's runtime for
    the context on every call (bench/NOTES.md, session 31)."""
    scoped = _cuda.require_context(method)

    @functools.wraps(method)
    def entry(*args, **kwargs):
        dev = None if K.SIM else driver.current_device()
        if dev is None:
            return scoped(*args, **kwargs)
        outer = getattr(_ENTRY, "device", None)
        _ENTRY.device = dev
        try:
            return method(*args, **kwargs)
        finally:
            _ENTRY.device = outer
    return entry


Encoding = _fmt.Encoding


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_U8, _I32 = np.dtype(np.uint8), np.dtype(np.int32)
_OFFSET_DTYPES = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
_MODES = {K.MODE_PACK: Mode.PACK, K.MODE_RELU: Mode.RELU, K.MODE_RELU2: Mode.RELU2,
          K.MODE_MASKED: Mode.MASKED}


class _Sections:
    """Where one pack plan's planes, status area and scratch lie in its allocations,
    laid out by the shared host plan (:func:`..cuda.host.pack_plan`): one allocation
    (sections 64-byte aligned in format order, then the status area, then the pack
    kernel's scratch), or an exact pack's two (``split``: the head with the mask, the
    offsets and the status area, and the tail with the values, the signs and the
    scratch, :attr:`..cuda.host.PackPlan.head_bytes`). Places are (allocation index,
    byte offset, bytes); ``sizes``: each allocation's bytes; ``written``: (allocation
    index, bytes) of what the format's size formula covers; ``planes``: the packed
    tensor's mask, offsets, values, signs and status as (allocation index, byte offset,
    count, dtype), None where they are another tensor's (a masked pack's mask and
    offsets); ``fill``: the place the fill before the pack zeroes, the scratch's head
    (``head`` bytes) alone or, where ``ored``, the values and signs up to it too (one
    range of the allocation that holds both) for a pack whose tiles OR their shared
    stream words into place (``fill_limit``: the most bytes that takes)."""

    __slots__ = ("sizes", "at", "status", "scratch", "written", "planes", "fill", "ored")

    def __init__(self, plan, split: bool, scratch: int, head: int = 0, fill_limit: int = 0):
        (mo, ml), (oo, ol), (vo, vl), (so, sl) = plan.spans
        if split:
            at = _fmt.align(plan.tail_bytes)
            self.sizes = (plan.head_bytes, at + scratch)
            self.at = {"mask": (0, mo, ml), "offsets": (0, oo, ol), "values": (1, 0, vl),
                       "signs": (1, plan.tail_signs_offset, sl)}
            self.status, self.scratch = (0, vo), (1, at)
            self.written = ((0, plan.head_bytes), (1, plan.tail_bytes))
        else:
            at = _fmt.align(plan.nbytes)
            self.sizes = (at + scratch,)
            self.at = {"mask": (0, mo, ml), "offsets": (0, oo, ol), "values": (0, vo, vl),
                       "signs": (0, so, sl)}
            if plan.mode == Mode.MASKED:         # its mask and offsets are the mask tensor's
                del self.at["mask"], self.at["offsets"]
            self.status, self.scratch = (0, plan.status_offset), (0, at)
            self.written = ((0, plan.nbytes),)
        vi, vo, _ = self.at["values"]
        si, so = self.scratch
        assert vi == si, "the values and the scratch share an allocation"
        self.ored = so + head - vo <= fill_limit
        self.fill = (vi, vo, so + head - vo) if self.ored else (si, so, head)
        odt = _OFFSET_DTYPES[plan.lay.offset_width]
        self.planes = tuple(None if name not in self.at else
                            (self.at[name][0], self.at[name][1], self.at[name][2] // dt.itemsize,
                             dt)
                            for name, dt in (("mask", _U8), ("offsets", odt), ("values", _U8),
                                             ("signs", _U8))) + ((*self.status, 1, _I32),)


class _Recipe:
    """What a pack with one plan needs on every call, worked out once per (plan, pack
    variant): the pack kernels, the tiles, the scratch (its zeroed head and its whole
    size) and the plan's sections, one allocation or two (:class:`_Sections`, with what
    the fill before the pack zeroes)."""

    __slots__ = ("plan", "variant", "kern", "n_tiles", "head", "_sections")

    def __init__(self, plan, variant):
        self.plan, self.variant = plan, variant
        numel, dt = plan.lay.numel, plan.lay.dtype
        self.kern = K.kernels_for(dt.name, variant)
        self.n_tiles, self.head, scratch = _scratch_bytes(numel, self.kern.ptile)
        self._sections = tuple(_Sections(plan, split, scratch, self.head, variant.fill_limit)
                               for split in (False, True))

    def sections(self, split: bool) -> _Sections:
        return self._sections[split]


def _scratch_bytes(numel: int, ptile: int) -> tuple:
    """(tiles, zeroed head, total bytes) of a pack's scratch: the look-back's (ticket,
    unused, a descriptor per tile and per group; zeroed before each pack), each tile's
    start and the total, and 16 bytes of stream edges per tile (for k_finish). Tiles
    are the pack kernel's own (``ptile`` elements)."""
    if numel == 0:
        return 0, 0, 0
    n_tiles = _ceil_div(numel, ptile)
    head = K.scratch_slots(n_tiles) * 8
    return n_tiles, head, head + 8 * (n_tiles + 1) + 16 * n_tiles


_RECIPES: dict = {}


def _recipe(plan, variant) -> _Recipe:
    """The plan's recipe for ``variant`` (plans are cached by the protocol, so the same
    arguments bring the same plan: the ids key the cache, the objects confirm it)."""
    entry = _RECIPES.get((id(plan), id(variant)))
    if entry is not None and entry.plan is plan and entry.variant is variant:
        return entry
    if len(_RECIPES) >= 4096:
        _RECIPES.clear()
    entry = _RECIPES[(id(plan), id(variant))] = _Recipe(plan, variant)
    return entry


class _Alloc:
    """One packed tensor's memory: the allocations of ``plan``'s sections ``sec`` (an
    exact pack's two), head first."""

    __slots__ = ("plan", "lay", "sec", "blocks")

    def __init__(self, P, plan, sec: _Sections, st, allocator):
        self.plan, self.lay, self.sec = plan, plan.lay, sec
        self.blocks = tuple(P.alloc(n, st, allocator) for n in sec.sizes)

    @property
    def head(self):
        return self.blocks[0]

    @property
    def tail(self):
        return self.blocks[1]

    @property
    def scratch(self) -> tuple:
        """(allocation, offset) of the pack kernel's scratch."""
        i, off = self.sec.scratch
        return self.blocks[i], off

    @property
    def status(self) -> tuple:
        i, off = self.sec.status
        return self.blocks[i], off

    @property
    def written(self) -> tuple:
        return tuple((self.blocks[i], n) for i, n in self.sec.written)

    def nbytes(self, name) -> int:
        return self.sec.at[name][2]

    def view(self, P, name, count, np_dtype):
        i, off, _ = self.sec.at[name]
        return P.view(self.blocks[i], off, count, np_dtype)


class _NumbaSteps:
    """The protocol's steps (:mod:`..cuda.protocol`) for one Numba pack call."""

    def __init__(self, backend, P, st, buf, dt, mode, allocator, ybuf):
        self.backend, self.P, self.st, self.buf, self.dt = backend, P, st, buf, dt
        self.mode, self.allocator, self.ybuf = mode, allocator, ybuf
        self.variant, self.slot = backend.variant, 0
        self.exact, self.shrunk = False, None
        self.fixed_key, self.launches = None, None

    def run(self, plan, fixed, count=False):
        recipe = _recipe(plan, self.variant)
        al = _Alloc(self.P, plan, recipe.sections(not fixed), self.st, self.allocator)
        self.slot = self.P.take_slot() if count else 0
        self.exact = not fixed
        kept = self.backend._run_pack(self.P, self.st, self.buf, recipe, self.mode, al,
                                      self.ybuf, None, zero_tail=fixed, slot=self.slot)
        self.launches = kept if fixed and not count else None
        return al

    def read_head(self, plan, al):
        slot, self.slot = self.slot, 0      # run(count=True) took one: the kernel writes it
        if self.exact and not K.SIM:        # the count's wait and the shrink, natively
            st = self.st
            done = shrink.wait_and_shrink(plan, slot, st[0], st[2], al.tail.ptr, self.allocator)
            if done is not None:
                status, nnz, shrunk = done
                if shrunk is not None:
                    self.shrunk = _Shrunk(al, *shrunk)
                return status, nnz
        return self.P.wait_slot(slot, self.st)

    def shrink(self, plan, al, nnz):
        """The stored values into an exact-size tail (laid out by ``host.tail_shrink``,
        no exact plan: the GPU waits for this host work, as for CuPy's shrink)."""
        if self.shrunk is not None:
            shrunk, self.shrunk = self.shrunk, None
            return shrunk
        P, st = self.P, self.st
        exact = host.tail_shrink(plan, nnz)
        tail = P.alloc(exact.nbytes, st, self.allocator)
        for d, s, n in exact.copies:
            P.copy(tail, d, al.tail, s, n, st)
        return _Shrunk(al, tail, exact)

    def packed(self, plan, al, nnz, pending_status):
        if type(al) is _Shrunk:
            return self.backend._packed(self.P, self.st, al.blocks, al.planes, plan.lay,
                                        nnz, False, capacity=nnz)
        if self.launches is not None and self.fixed_key is not None:
            _FIXED_PACKS.put(self.fixed_key, self.variant,
                             _FixedPack(al, self.launches, pending_status))
        return self.backend._packed(self.P, self.st, al.blocks, al.sec.planes, al.lay, nnz,
                                    pending_status)


class _Shrunk(NamedTuple):
    """An exact pack after its shrink: the worst-case pack's allocations (the head kept),
    the exact tail, and where the tail's values and signs lie (a ``host.ExactTail``)."""
    packed: _Alloc
    tail: object
    exact: host.ExactTail

    @property
    def blocks(self) -> tuple:
        return self.packed.head, self.tail

    @property
    def planes(self) -> tuple:
        """:attr:`_Sections.planes` of the exact pack: the head's mask, offsets and status
        where the worst case has them, the values and signs where the tail has them."""
        mask, offsets, _, _, status = self.packed.sec.planes
        e = self.exact
        return (mask, offsets, (1, 0, e.values_len, _U8),
                (1, e.signs_offset, e.signs_len, _U8), status)


# A plan gets launch records of its own the second time this thread packs with it: a
# masked pack's plan follows its mask's count, so it may never come back, and building
# the records costs more than a few launches through the platform.
_PACK_LAUNCHES = PerThread(1024)
_SEEN_ONCE, _NOT_COVERED = "seen once", "not covered"
_SHARES_MASK = {"shares_mask": True}


# The unpack family's launches likewise, keyed by what fixes every argument but the
# buffers' addresses (:meth:`NumbaBackend._queue`).
_OP_LAUNCHES = PerThread(1024)


def _bind(P, st, launch: Launch | None, buffers, addresses) -> BoundLaunch | None:
    """A BoundLaunch of ``launch``, already queued by ``P.launch`` (which compiled the
    kernel and checked its record); TypeError where the kernel is not covered."""
    if launch is None:
        return None
    template = P.handle_launch(launch.kernel, st, launch.args)
    if template is None:
        raise TypeError("it launches through the dispatcher")
    return BoundLaunch(template, launch, buffers, addresses)


class _PackLaunches:
    """One pack plan's launches (the pack kernel, and k_finish where it runs), each by a
    :class:`.launch.BoundLaunch`: a call writes the buffers' addresses, nothing else."""

    __slots__ = ("pack", "finish")

    def __init__(self, pack: BoundLaunch, finish: BoundLaunch | None):
        self.pack, self.finish = pack, finish

    @classmethod
    def build(cls, P, st, pack: Launch, finish: Launch | None, buffers, addresses):
        """From one call's launches; None where either kernel is not covered."""
        try:
            return cls(_bind(P, st, pack, buffers, addresses),
                       _bind(P, st, finish, buffers, addresses))
        except Exception as exc:  # noqa: BLE001 -- any mismatch: the plan keeps P.launch
            log.info("a pack plan keeps launching through the platform: %s", exc)
            return None

    def queue(self, st, addresses):
        """The pack, then k_finish, in stream order."""
        self.pack(st[0], addresses)
        if self.finish is not None:
            self.finish(st[0], addresses)


class _FixedPack:
    """A whole fixed-capacity pack call (explicit encoding: nothing to wait for) on
    arguments a thread has packed with before: the one allocation, the fill, the
    launches by their records (:class:`_PackLaunches`) and the packed tensor's planes,
    all worked out from that earlier call, so a call is these steps and no more. Kept
    by :data:`_FIXED_PACKS` under what fixes them (:meth:`NumbaBackend._fixed_key`)."""

    __slots__ = ("nbytes", "fill_at", "fill_len", "launches", "specs", "lay")

    def __init__(self, al: _Alloc, launches: _PackLaunches, with_status: bool):
        sec = al.sec
        (self.nbytes,) = sec.sizes
        _, self.fill_at, self.fill_len = sec.fill
        self.launches, self.lay = launches, al.lay
        planes = sec.planes if with_status else (*sec.planes[:4], None)
        self.specs = tuple(None if sp is None else sp[1:] for sp in planes)

    def __call__(self, backend, P, st, buf, ybuf, allocator, mask_buf=None, mask=None,
                 offsets=None, nnz=None, extra=None) -> PackedTensor:
        """The packed tensor of ``buf`` (and relu_pack's ``ybuf``, masked_pack's mask
        plane ``mask_buf`` with the mask tensor's ``mask``, ``offsets`` and count)."""
        s, dev = st[0], st[2]
        block = P.alloc(self.nbytes, st, allocator)
        base = block.ptr
        P.memset0(block, self.fill_at, self.fill_len, st)
        addresses = [buf.ptr, buf.ptr if ybuf is None else ybuf.ptr, base]
        if mask_buf is not None:
            addresses.append(mask_buf.ptr)
        self.launches.queue(st, addresses)
        planes = [None if sp is None else DevicePlane(base + sp[0], sp[1], sp[2], dev, block, s)
                  for sp in self.specs]
        return _packed_tensor(backend, self.lay, self.lay.capacity, planes, ("cuda", dev), nnz,
                              s, mask, offsets, extra)


def _packed_tensor(backend, lay, capacity, planes, device, nnz, stream, mask=None, offsets=None,
                   extra=None) -> PackedTensor:
    """The PackedTensor of ``planes`` (mask, offsets, values, signs, status) laid out by
    ``lay`` at ``capacity``; ``mask`` / ``offsets``: a masked pack's, its companion's."""
    m, o, v, sg, status = planes
    return PackedTensor(
        lay.shape, lay.dtype, lay.encoding, lay.chunk_log2, capacity,
        m if mask is None else mask, o if offsets is None else offsets, v, sg,
        backend=backend, device=device, _nnz=nnz, status=status,
        extra={"stream": stream, **extra} if extra else {"stream": stream})


# Fixed-capacity pack calls by what fixes them, one set per thread (the launch records
# inside are a thread's own); the anchor is the backend's kernel variant.
_FIXED_PACKS = PerThread(1024)


# ----------------------------------------------------------------------------
# Platforms: where device memory comes from and how kernels see it.
# ----------------------------------------------------------------------------
class _SimPlatform:
    """NumPy arrays as device memory, for the CUDA simulator."""

    def __init__(self):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        self._fake = FakeCUDAArray
        self._slots = {}

    def stream(self, stream):
        return None

    def device(self, st):
        return ("cuda", 0)

    def import_dense(self, x, dtype, st):
        from ...dlpack import to_numpy
        arr, dt = to_numpy(x, dtype)
        return arr.reshape(-1).view(np.uint8), tuple(arr.shape), dt

    def import_out(self, out, shape, dt, st):
        from ...dlpack import to_numpy
        arr, odt = to_numpy(out)
        if odt != dt or tuple(arr.shape) != tuple(shape):
            raise OutputMismatchError(f"out has {odt.name}{tuple(arr.shape)}; "
                                      f"need {dt.name}{tuple(shape)}")
        if not arr.flags.writeable:
            raise OutputMismatchError("out is read-only")
        return arr.reshape(-1).view(np.uint8)

    def new_dense(self, shape, dt, st, allocator):
        from ...dlpack import exportable
        n = _fmt.numel_of(shape) * dt.itemsize
        buf = self.alloc(n, st, allocator)
        return buf, exportable(buf[:n].view(dt.numpy).reshape(shape))

    def new_dense_pair(self, shape, dt, st, allocator):
        """Two of :meth:`new_dense` in one allocation (the second 16-byte aligned)."""
        from ...dlpack import exportable
        n = _fmt.numel_of(shape) * dt.itemsize
        half = _fmt.align(n, 16)
        buf = self.alloc(2 * half, st, allocator)
        return tuple((b, exportable(b.view(dt.numpy).reshape(shape)))
                     for b in (buf[:n], buf[half:half + n]))

    def alloc(self, nbytes, st, allocator):
        if allocator is not None:
            return np.asarray(allocator(int(nbytes), 0, 0)).reshape(-1).view(np.uint8)
        # Poisoned, not zeroed: the tests see any byte a kernel fails to write.
        return np.full(int(nbytes), 0xA5, dtype=np.uint8)

    def import_plane(self, plane):
        return np.asarray(plane).reshape(-1).view(np.uint8)

    def ptr(self, buf):
        return buf.ctypes.data

    def planes(self, blocks, specs, st):
        """The planes ``specs`` (allocation index, offset, count, dtype) of ``blocks``."""
        return [None if sp is None else
                blocks[sp[0]][sp[1]:sp[1] + sp[2] * sp[3].itemsize].view(sp[3]) for sp in specs]

    def view(self, buf, off, count, np_dtype):
        size = np.dtype(np_dtype).itemsize
        return self._fake(buf[off:off + count * size].view(np_dtype))

    def memset0(self, buf, off, nbytes, st):
        buf[off:off + nbytes] = 0

    def copy(self, dst, doff, src, soff, nbytes, st):
        dst[doff:doff + nbytes] = src[soff:soff + nbytes]

    def read(self, buf, off, count, np_dtype, st):
        size = np.dtype(np_dtype).itemsize
        return buf[off:off + count * size].view(np_dtype).copy()

    # Slots as on a GPU (the kernel writes the count into one), in host arrays of
    # this platform's own: the simulator has no pinned memory.
    def take_slot(self) -> int:
        buf = np.zeros(abi.SLOT_BYTES, dtype=np.uint8)
        slot = buf.ctypes.data
        self._slots[slot] = buf
        slots.write(slot, abi.SLOT_SENTINEL32, abi.SLOT_SENTINEL64)
        return slot

    def slot_buffer(self, slot):
        return self._slots[slot]

    def wait_slot(self, slot, st) -> tuple:
        try:
            return slots.written(slot)     # the kernel has run: its launch returned
        finally:
            del self._slots[slot]

    def launch(self, kernel, grid, block, st, *args):
        kernel[grid, block](*args)

    def order_after(self, p, st):
        pass


class _GpuPlatform:
    """Device memory through cuda_interop; kernels see zero-copy Numba views."""

    def __init__(self):
        from numba import cuda
        from numba.cuda.cudadrv import devicearray, driver
        from ..cuda import interop as ci
        self.cuda, self.driver, self.devicearray, self.ci = cuda, driver, devicearray, ci
        self._streams = {}
        self._local = threading.local()     # launch records: one set per thread

    # A stream is (raw handle, numba Stream, device): the context current in the entry
    # point fixes the device, so it is asked for once per call.
    def stream(self, stream):
        h = self.ci.stream_handle(stream)
        ns = self._streams.get(h)
        if ns is None:
            ns = self.cuda.external_stream(h) if h else self.cuda.default_stream()
            self._streams[h] = ns
        return h, ns, self._dev()

    def device(self, st):
        return ("cuda", st[2])

    def _dev(self):
        dev = getattr(_ENTRY, "device", None)     # set by the entry point (_one_context)
        if dev is None:
            dev = driver.current_device()
        return dev if dev is not None else int(self.cuda.get_current_device().id)

    def import_dense(self, x, dtype, st):
        t = self.ci.import_cuda(x, dtype=dtype, stream=st[0])
        if t.device != st[2]:
            raise UnsupportedDeviceError(f"tensor on cuda:{t.device}, but Numba's current device "
                                         f"is cuda:{st[2]}; select it with numba.cuda.select_device")
        return t, tuple(t.shape), t.dtype

    def import_out(self, out, shape, dt, st):
        t = self.ci.import_cuda(out, stream=st[0])
        self.ci.check_out(t, shape, dt, st[2])
        return t

    def new_dense(self, shape, dt, st, allocator):
        arr = self.ci.CudaArray.empty(shape, dt, st[2], st[0], allocator)
        return arr, arr

    def new_dense_pair(self, shape, dt, st, allocator):
        a, b = self.ci.CudaArray.empty_pair(shape, dt, st[2], st[0], allocator)
        return (a, a), (b, b)

    def alloc(self, nbytes, st, allocator):
        return self.ci.allocate(nbytes, st[2], st[0], allocator)

    def import_plane(self, plane):
        """A plane as a buffer with ``ptr`` (what :meth:`view` reads): our planes are
        that already; any other CUDA array is read through its interface."""
        if isinstance(plane, self.ci.CudaArray):
            return plane
        cai = plane.__cuda_array_interface__
        n = _fmt.numel_of(cai["shape"]) * int(cai["typestr"][2:])
        return self.ci.DeviceBuffer(int(cai["data"][0] or 0), n, self._dev(), plane)

    def ptr(self, buf):
        return int(buf.ptr)

    def planes(self, blocks, specs, st):
        """The planes ``specs`` (allocation index, offset, count, dtype) of ``blocks``."""
        Plane, s = self.ci.DevicePlane, st[0]
        return [None if sp is None else
                Plane(blocks[sp[0]].ptr + sp[1], sp[2], sp[3], blocks[sp[0]].device,
                      blocks[sp[0]], s) for sp in specs]

    def view(self, buf, off, count, np_dtype):
        dt = np_dtype if isinstance(np_dtype, np.dtype) else np.dtype(np_dtype)
        return KernelArray(int(buf.ptr) + off if count else 0, count, dt, buf)

    def _device_array(self, a):
        """A Numba device array of a KernelArray (what the dispatcher takes)."""
        data = self.driver.MemoryPointer(self.cuda.current_context(),
                                         self.driver.binding.CUdeviceptr(a.ptr),
                                         size=a.count * a.dtype.itemsize, owner=a.owner)
        return self.devicearray.DeviceNDArray(shape=(a.count,), strides=(a.dtype.itemsize,),
                                              dtype=a.dtype, gpu_data=data, stream=0)

    # Fills and copies go through the driver on raw pointers (as the CuPy backend's
    # do), in the context the entry point's Numba scope made current; reads through
    # the CUDA runtime. A Numba device-array view per call costs tens of microseconds
    # of Python, which the exact-size pack pays after its host sync.
    def memset0(self, buf, off, nbytes, st):
        driver.memset0(int(buf.ptr) + off, nbytes, st[0])

    def copy(self, dst, doff, src, soff, nbytes, st):
        driver.copy(int(dst.ptr) + doff, int(src.ptr) + soff, nbytes, st[0])

    def read(self, buf, off, count, np_dtype, st):
        out = np.zeros(count, dtype=np_dtype)
        if out.nbytes:
            rt = self.ci._runtime()
            with self._on_dev(st):
                rt.memcpyAsync(out.ctypes.data, int(buf.ptr) + off, out.nbytes,
                               rt.memcpyDeviceToHost, st[0])
                rt.streamSynchronize(st[0])
        return out

    def take_slot(self) -> int:
        return slots.take()

    def slot_buffer(self, slot):
        """A pinned slot as a buffer kernels write through its host address (unified
        addressing)."""
        return _HostSlot(slot)

    def wait_slot(self, slot, st) -> tuple:
        return slots.wait(slot, st[0])

    def device_sync(self):
        self.cuda.synchronize()

    def _on_dev(self, st):
        import cupy
        return cupy.cuda.Device(st[2])

    def launch(self, kernel, grid, block, st, *args):
        """By the kernel's handle (:mod:`.launch`) once a launch through the dispatcher
        has compiled it for these kinds of arguments on this device and thread."""
        if grid <= 0:
            return
        cache = getattr(self._local, "launches", None)
        if cache is None:
            cache = self._local.launches = {}
        key = (kernel, st[2], kinds_of(args))
        fast = cache.get(key, False)
        if fast:
            fast(grid, block, st[0], args)
            return
        numba_args = [self._device_array(a) if type(a) is KernelArray else a for a in args]
        if fast is None:                       # not covered: the dispatcher, every time
            kernel[grid, block, st[1]](*numba_args)
        else:
            cache[key] = first_launch(kernel, grid, block, st[1], args, numba_args)

    def handle_launch(self, kernel, st, args):
        """The HandleLaunch :meth:`launch` keeps for arguments of these kinds on this
        thread and device; None where it has none (not covered, or not launched yet)."""
        launches = getattr(self._local, "launches", None) or {}
        return launches.get((kernel, st[2], kinds_of(args))) or None

    def order_after(self, p, st):
        """Make our stream wait for the work that produced p's planes (on p's stream)."""
        self.ci.stream_wait(st[0], protocol.producer_stream(p, st[0]), p.device[1])


class _HostSlot:
    """A pinned host slot where a launch's buffers are listed (a BoundLaunch writes its
    address into the record like any buffer's)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


_PLATFORM = None


def _platform():
    global _PLATFORM
    if _PLATFORM is None:
        _PLATFORM = _SimPlatform() if K.SIM else _GpuPlatform()
    return _PLATFORM


# ----------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------
class NumbaBackend:
    """CUDA backend written with ``numba.cuda.jit``."""

    name = "numba"
    device_type = "cuda"

    def __init__(self, variant: K.PackVariant = K.COMMITTED):
        self.variant = variant      # tests and A/B timings pass others (kernels.PackVariant)

    def is_available(self) -> bool:
        if K.SIM:
            return True
        try:
            from numba import cuda
            import cupy  # noqa: F401 -- cuda_interop's allocator and runtime calls
            return bool(cuda.is_available())
        except Exception:  # noqa: BLE001 -- no numba-cuda, CuPy, driver or device: unavailable
            return False

    # ----------------------------------------------------------- views
    @staticmethod
    def _dense_views(P, buf, numel, dt):
        """(elements, uint64 words, fast) views of a dense tensor; ``fast`` when it is
        8-byte aligned (whole groups of 8 elements then move as uint64 words)."""
        el = P.view(buf, 0, numel, dt.uint)
        fast = P.ptr(buf) % 8 == 0
        w64 = P.view(buf, 0, numel * dt.itemsize // 8 if fast else 0, np.uint64)
        return el, w64, fast

    @staticmethod
    def _planes(P, p) -> tuple:
        """p's (mask, offsets, values, signs) as buffers the views and launch records
        take (:meth:`_GpuPlatform.import_plane`), each imported once per call."""
        return (P.import_plane(p.mask), P.import_plane(p.offsets), P.import_plane(p.values),
                P.import_plane(p.signs))

    @staticmethod
    def _plane_views(P, buf, nbytes):
        """(bytes, uint32 words) views of an imported plane; the word view covers the
        whole words only, and is empty when the plane is not 4-byte aligned (the
        kernels then read bytes)."""
        b8 = P.view(buf, 0, nbytes, np.uint8)
        w32 = P.view(buf, 0, nbytes // 4 if P.ptr(buf) % 4 == 0 else 0, np.uint32)
        return b8, w32

    def _stored(self, P, p, planes):
        """Kernel arguments of p's values and signs: (vb, vw, nvb, sb, sw, nsb)."""
        lay = p.layout
        vb, vw = self._plane_views(P, planes[2], lay.values[1])
        sb, sw = self._plane_views(P, planes[3], lay.signs[1])
        return vb, vw, lay.values[1], sb, sw, lay.signs[1]

    def _tile_offsets(self, P, p, planes, st, allocator, tile_log2=K.TILE_LOG2):
        """(mask, array, shift): the first value index of the kernel's tile i
        (``1 << tile_log2`` elements, a multiple of K.TILE) is
        array[(i << tile_log2) >> shift]. When chunks are larger than the kernel's
        tile, the array holds the prefix counts per K.TILE elements (k_mask_count's
        tile, which serves any larger tile) in a scratch allocation it keeps alive."""
        lay = p.layout
        n_tiles = _ceil_div(p.numel, K.TILE)
        mask = P.view(planes[0], 0, lay.mask[1], np.uint8)
        if p.chunk_log2 <= tile_log2:
            odt = _OFFSET_DTYPES[lay.offset_width]
            return mask, P.view(planes[1], 0, lay.n_chunks + 1, odt), p.chunk_log2
        # Chunks span several tiles: prefix-sum the mask's popcount per K.TILE elements.
        scratch = P.alloc((n_tiles + 3) * 8, st, allocator)
        cnt = P.view(scratch, 0, n_tiles + 1, np.int64)
        info = P.view(scratch, (n_tiles + 1) * 8, 2, np.int64)
        P.launch(K.k_mask_count, n_tiles, K.NT, st, mask, (p.numel + 7) >> 3, cnt)
        P.launch(K.k_scan, 1, K.SCAN_NT, st, cnt, n_tiles, info)
        return mask, cnt, K.TILE_LOG2

    # ----------------------------------------------------------- packing
    @_one_context
    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        P = _platform()
        st = P.stream(stream)
        buf, shape, dt = P.import_dense(x, dtype, st)
        return self._pack(P, st, buf, shape, dt, K.MODE_PACK, encoding, chunk_log2, capacity,
                          allocator)

    @_one_context
    def relu_pack(self, a, *, square=False, dtype=None, encoding="nosign",
                  chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, capacity=None, stream=None, allocator=None):
        P = _platform()
        st = P.stream(stream)
        buf, shape, dt = P.import_dense(a, dtype, st)
        ybuf, y = P.new_dense(shape, dt, st, allocator)
        p = self._pack(P, st, buf, shape, dt, K.MODE_RELU2 if square else K.MODE_RELU, encoding,
                       chunk_log2, capacity, allocator, ybuf)
        return y, p

    def _pack(self, P, st, buf, shape, dt, mode, encoding, chunk_log2, capacity, allocator,
              ybuf=None):
        key = self._fixed_key(st, buf, ybuf, shape, dt, mode, encoding, chunk_log2, capacity)
        if key is not None:
            fixed = _FIXED_PACKS.get(key, self.variant)
            if fixed is not None:
                return fixed(self, P, st, buf, ybuf, allocator)
        steps = _NumbaSteps(self, P, st, buf, dt, mode, allocator, ybuf)
        steps.fixed_key = key
        return protocol.pack(steps, tuple(shape), dt, encoding, chunk_log2, capacity,
                             _MODES[mode])

    def _fixed_key(self, st, buf, ybuf, shape, dt, mode, encoding, chunk_log2, capacity):
        """The :data:`_FIXED_PACKS` key of a pack call: its arguments (a fixed capacity,
        the encoding as given: the protocol decides once whether the call waits), the
        device, the kernel variant's id, whether there is a y, and the dense tensors'
        8-byte alignment (:meth:`_pack_key`); None where an argument's type could make
        an equal key of arguments the protocol treats differently (``capacity=True``,
        a float chunk size, an encoding that is neither a name nor an Encoding)."""
        if (K.SIM or type(capacity) is not int or type(chunk_log2) is not int
                or (type(encoding) is not str and type(encoding) is not Encoding)):
            return None
        return (mode, shape, dt, encoding, chunk_log2, capacity, st[2], id(self.variant),
                buf.ptr % 8 == 0, None if ybuf is None else ybuf.ptr % 8 == 0)

    def _run_pack(self, P, st, buf, recipe, mode, al, ybuf, p_mask, zero_tail, slot=0):
        """Launch the one-pass pack into ``al`` (and, at fixed capacity, zero what
        lies past the stored values), with its scratch at ``al.scratch``, after the
        fill of ``al.sec.fill`` (the scratch's head, or with it the values and signs of
        a pack whose tiles OR their shared words: then no k_finish); its last tile
        writes the status and count into ``slot`` too (a pinned host slot, 0 for none).
        On a GPU, a plan this thread has packed with before launches by records of its
        own (:class:`_PackLaunches`); returns them where it did (else None)."""
        if recipe.n_tiles == 0:           # an empty tensor: its header-less planes zeroed
            for b, n in al.written:
                P.memset0(b, 0, n, st)
            if slot:
                slots.write(slot, 0, 0)
            return None
        fi, fo, fn = al.sec.fill
        P.memset0(al.blocks[fi], fo, fn, st)
        mask_plane = None if p_mask is None else P.import_plane(p_mask.mask)
        slot_buf = P.slot_buffer(slot) if slot else None
        # every buffer a launch argument lies in, in an order the key fixes
        buffers = (buf, buf if ybuf is None else ybuf, *al.blocks,
                   *(() if mask_plane is None else (mask_plane,)),
                   *(() if slot_buf is None else (slot_buf,)))
        key = kept = None
        if not K.SIM:
            addresses = [b.ptr for b in buffers]
            key = self._pack_key(st, recipe, mode, al, addresses, ybuf is not None,
                                 p_mask is not None, zero_tail, bool(slot))
            kept = _PACK_LAUNCHES.get(key, al.plan)
            if type(kept) is _PackLaunches:
                kept.queue(st, addresses)
                return kept
        pack, finish = self._pack_launches(P, recipe, mode, al, buf, ybuf, mask_plane,
                                           zero_tail, slot_buf)
        P.launch(pack.kernel, pack.grid, pack.block, st, *pack.args)
        if finish is not None:
            P.launch(finish.kernel, finish.grid, finish.block, st, *finish.args)
        if key is not None and kept is not _NOT_COVERED:
            kept = (_SEEN_ONCE if kept is None else
                    _PackLaunches.build(P, st, pack, finish, buffers, addresses) or _NOT_COVERED)
            _PACK_LAUNCHES.put(key, al.plan, kept)
        return kept if type(kept) is _PackLaunches else None

    def _pack_key(self, st, recipe, mode, al, addresses, has_y, masked, zero_tail, has_slot):
        """What fixes every argument of a pack's launches but the buffers' addresses
        (and so the arguments' kinds): the plan (counts, offsets, capacity, chunk size),
        the device, the kernels (dtype, compiled variant) and incl_every, the mode,
        zero_tail, one block or two, whether the tiles OR their shared words (then no
        k_finish), whether y, a mask tensor and a host slot are given, and which
        dense tensors are 8-byte aligned (the word views of the others are empty)."""
        return (id(al.plan), st[2], recipe.kern, self.variant.incl_every, mode, zero_tail,
                len(al.blocks), al.sec.ored, has_y, masked, has_slot, addresses[0] % 8 == 0,
                has_y and addresses[1] % 8 == 0)

    def _pack_launches(self, P, recipe, mode, al, buf, ybuf, mask_plane, zero_tail, slot_buf):
        """``(pack, finish)``: the pack kernel's launch over kernel views of ``al``, the
        dense input ``buf``, relu_pack's output ``ybuf``, masked_pack's mask plane and
        the host slot ``slot_buf`` (None: none), and k_finish's, which writes the
        stream words shared by tiles (value streams) and, at fixed capacity, the zeros
        past the stored values (None: neither, or a pack whose fill zeroed its values
        and whose tiles OR their shared words)."""
        lay, kern, n_tiles, head = al.lay, recipe.kern, recipe.n_tiles, recipe.head
        numel, dt, enc = lay.numel, lay.dtype, lay.encoding
        scratch, s0 = al.scratch
        desc = P.view(scratch, s0, head // 8, np.int64)
        starts = P.view(scratch, s0 + head, n_tiles + 1, np.int64)
        edges = P.view(scratch, s0 + head + 8 * (n_tiles + 1), 4 * n_tiles, np.uint32)
        xe, x64, use64 = self._dense_views(P, buf, numel, dt)
        if ybuf is not None:
            ye, y64, yfast = self._dense_views(P, ybuf, numel, dt)
        else:
            ye, y64, yfast = xe, x64, False
        vt, vw, sw = self._value_views(P, lay, al)
        stat = P.view(*al.status, 2, np.int64)
        slot = (P.view(*al.status, 0, np.int64) if slot_buf is None
                else P.view(slot_buf, 0, 2, np.int64))
        if mask_plane is None:
            mask = al.view(P, "mask", lay.mask[1], np.uint8)
            offsets = al.view(P, "offsets", lay.n_chunks + 1, _OFFSET_DTYPES[lay.offset_width])
            msrc = mask
        else:
            msrc = P.view(mask_plane, 0, lay.mask[1], np.uint8)
            mask, offsets = msrc, P.view(scratch, s0, 0, np.uint32)
        ored = al.sec.ored
        pack = Launch(kern.pack[(mode, int(enc), ored)], n_tiles, K.NT,
                      (xe, x64, use64, numel, ye, y64, yfast, msrc, lay.capacity,
                       int(self.variant.incl_every), mask, offsets, lay.chunk_log2, vt, vw, sw,
                       desc, starts, edges, stat, slot))
        zero = zero_tail and lay.capacity > 0
        if ored or (enc == Encoding.RAW and not zero):
            return pack, None
        block = 256 if not K.SIM else 32
        grid = _ceil_div(n_tiles + 1, block) if enc != Encoding.RAW else 1
        if zero:                                # a grid-stride loop past that
            words = lay.capacity if enc == Encoding.RAW else max(vw.size, sw.size)
            grid = max(grid, min(_ceil_div(max(words, 1), 256), 4096))
        return pack, Launch(kern.finish, grid, block,
                            (starts, edges, n_tiles, stat, lay.capacity, int(enc), zero, vt, vw, sw))

    @staticmethod
    def _value_views(P, lay, al):
        """Kernel views of the values / signs sections being written (the word views
        run into each section's padding up to a whole word)."""
        enc, dt = lay.encoding, lay.dtype
        vn, sn = al.nbytes("values"), al.nbytes("signs")
        raw = enc == Encoding.RAW
        vt = al.view(P, "values", vn // dt.itemsize if raw else 0, dt.uint)
        vw = al.view(P, "values", 0 if raw else _ceil_div(vn, 4), np.uint32)
        sw = al.view(P, "signs", _ceil_div(sn, 4) if enc == Encoding.SIGNPLANE else 0, np.uint32)
        return vt, vw, sw

    def _packed(self, P, st, blocks, specs, lay, nnz, with_status, capacity=None, mask=None,
                offsets=None, extra=None):
        """The PackedTensor of the planes ``specs`` (:attr:`_Sections.planes`) of
        ``blocks``, laid out by ``lay`` (at ``capacity``, where given: an exact pack's
        count, ``lay`` its worst case)."""
        planes = P.planes(blocks, specs if with_status else (*specs[:4], None), st)
        return _packed_tensor(self, lay, lay.capacity if capacity is None else capacity, planes,
                              P.device(st), nnz, st[0] if st is not None else 0, mask, offsets,
                              extra)

    @_one_context
    def masked_pack(self, u, p_mask, *, dtype=None, encoding="signplane", stream=None,
                    allocator=None) -> PackedTensor:
        P = _platform()
        protocol.check_packed(p_mask)
        st = P.stream(stream)
        buf, shape, dt = P.import_dense(u, dtype, st)
        protocol.check_like("u", shape, dt, p_mask)
        enc = masked_encoding(encoding)
        P.order_after(p_mask, st)
        nnz = p_mask.nnz  # the companion stores every masked position (sync if pending)
        key = self._fixed_key(st, buf, None, shape, dt, K.MODE_MASKED, enc, p_mask.chunk_log2,
                              nnz)
        fixed = None if key is None else _FIXED_PACKS.get(key, self.variant)
        if fixed is not None:
            return fixed(self, P, st, buf, None, allocator, P.import_plane(p_mask.mask),
                         p_mask.mask, p_mask.offsets, nnz, _SHARES_MASK)
        plan = pack_plan(tuple(shape), dt, enc, nnz, p_mask.chunk_log2, Mode.MASKED)
        recipe = _recipe(plan, self.variant)
        al = _Alloc(P, plan, recipe.sections(False), st, allocator)
        kept = self._run_pack(P, st, buf, recipe, K.MODE_MASKED, al, None, p_mask,
                              zero_tail=False)
        with_status = enc == Encoding.NOSIGN
        if kept is not None and key is not None:
            _FIXED_PACKS.put(key, self.variant, _FixedPack(al, kept, with_status))
        return self._packed(P, st, al.blocks, al.sec.planes, al.lay, nnz, with_status,
                            mask=p_mask.mask, offsets=p_mask.offsets, extra=_SHARES_MASK)

    # ----------------------------------------------------------- unpacking
    @_one_context
    def unpack(self, p: PackedTensor, *, out=None, stream=None, allocator=None):
        P = _platform()
        protocol.check_packed(p)
        st = P.stream(stream)
        P.order_after(p, st)
        p.check()
        if out is not None:
            obuf, result = P.import_out(out, p.shape, p.dtype, st), out
        else:
            obuf, result = P.new_dense(p.shape, p.dtype, st, allocator)
        self._decode(P, st, p, 0, None, obuf, allocator)
        return result

    @_one_context
    def relu2_backward(self, grad, p, *, stream=None, allocator=None):
        P = _platform()
        protocol.check_packed(p)
        st = P.stream(stream)
        P.order_after(p, st)
        p.check()
        gbuf = self._grad(P, st, grad, p)
        obuf, result = P.new_dense(p.shape, p.dtype, st, allocator)
        self._decode(P, st, p, 1, gbuf, obuf, allocator)
        return result

    def _decode(self, P, st, p, op, gbuf, obuf, allocator):
        """Queue unpack kernel ``op`` (0: unpack, 1: relu2_backward) of p into obuf."""
        lay, dt = p.layout, p.dtype
        numel = lay.numel
        if numel == 0:
            return
        kern = K.kernels_for(dt.name, self.variant)
        tile_log2 = kern.utile_log2[op]
        planes = self._planes(P, p)

        def launch():
            mask, toff, shift = self._tile_offsets(P, p, planes, st, allocator, tile_log2)
            oe, o64, fast = self._dense_views(P, obuf, numel, dt)
            if gbuf is not None:
                ge, g64, gfast = self._dense_views(P, gbuf, numel, dt)
                fast = fast and gfast
            else:
                ge, g64 = oe, o64
            o16 = fast and P.ptr(obuf) % 16 == 0
            return Launch(kern.unpack[(op, int(p.encoding))], _ceil_div(numel, 1 << tile_log2),
                          K.UNT, (mask, numel, toff, shift, *self._stored(P, p, planes), ge, g64,
                                  fast, oe, o64, o16))
        # chunks larger than the tile: a scratch of prefix counts per call, no record
        key = ("unpack", op, id(lay), kern) if p.chunk_log2 <= tile_log2 else None
        self._queue(P, st, key, lay,
                    (*planes, obuf) if gbuf is None else (*planes, gbuf, obuf), launch)

    def _queue(self, P, st, key, anchor, buffers, launch):
        """Queue the :class:`.launch.Launch` that ``launch()`` makes. ``key`` (with
        ``anchor``, the object an ``id`` in it stands for; None: no record) fixes every
        argument but the addresses of ``buffers``, which hold every array argument; the
        addresses' alignment joins it (it fixes the word views' lengths). The second
        time a thread queues a key, the launch gets a record of its own
        (:class:`.launch.BoundLaunch`), which later calls fill with the addresses alone."""
        if key is None or K.SIM:
            made = launch()
            P.launch(made.kernel, made.grid, made.block, st, *made.args)
            return
        addresses = [b.ptr for b in buffers]
        # every buffer 16-byte aligned (torch's and our allocations are): one 0 says so
        aligned = not _reduce(_or, addresses) & 15
        key = (key, st[2], 0 if aligned else tuple([a & 15 for a in addresses]))
        kept = _OP_LAUNCHES.get(key, anchor)
        if type(kept) is BoundLaunch:
            kept(st[0], addresses)
            return
        made = launch()
        P.launch(made.kernel, made.grid, made.block, st, *made.args)
        if kept is _NOT_COVERED:
            return
        if kept is _SEEN_ONCE:
            try:
                kept = _bind(P, st, made, buffers, addresses)
            except Exception as exc:  # noqa: BLE001 -- any mismatch: it keeps P.launch
                log.info("an unpack-family launch keeps the platform: %s", exc)
                kept = _NOT_COVERED
        else:
            kept = _SEEN_ONCE
        _OP_LAUNCHES.put(key, anchor, kept)

    @_one_context
    def relu_backward(self, grad, p, *, stream=None, allocator=None):
        P = _platform()
        protocol.check_packed(p)
        st = P.stream(stream)
        P.order_after(p, st)
        gbuf = self._grad(P, st, grad, p)
        obuf, result = P.new_dense(p.shape, p.dtype, st, allocator)
        self._relu_backward(P, st, p, gbuf, obuf)
        return result

    def _relu_backward(self, P, st, p, gbuf, obuf):
        """Queue the relu_backward kernel: grad where p's mask bit is set, else 0."""
        lay, dt = p.layout, p.dtype
        numel = lay.numel
        ngroups = (numel + 7) >> 3
        if not ngroups:
            return
        mbuf = P.import_plane(p.mask)

        def launch():
            mask = P.view(mbuf, 0, lay.mask[1], np.uint8)
            ge, g64, gfast = self._dense_views(P, gbuf, numel, dt)
            oe, o64, ofast = self._dense_views(P, obuf, numel, dt)
            block = 32 if K.SIM else 256
            return Launch(K.kernels_for(dt.name).relu_backward,
                          min(_ceil_div(ngroups, block), 8192), block,
                          (mask, numel, ge, g64, gfast, oe, o64, ofast))
        self._queue(P, st, ("relu_backward", id(lay)), lay, (mbuf, gbuf, obuf), launch)

    @_one_context
    def gated_backward(self, grad, p_r, p_u, *, stream=None, allocator=None):
        P = _platform()
        protocol.check_packed(p_r)
        protocol.check_packed(p_u)
        protocol.check_pair(p_r, p_u)
        st = P.stream(stream)
        P.order_after(p_r, st)
        P.order_after(p_u, st)
        p_r.check()
        p_u.check()
        gbuf = self._grad(P, st, grad, p_r)
        numel, dt = p_r.numel, p_r.dtype
        (gg_buf, grad_g), (gu_buf, grad_u) = P.new_dense_pair(p_r.shape, dt, st, allocator)
        if numel:
            self._gated(P, st, p_r, p_u, gbuf, gg_buf, gu_buf, allocator)
        return grad_g, grad_u

    def _gated(self, P, st, p_r, p_u, gbuf, gg_buf, gu_buf, allocator):
        """Queue the gated kernel: u's values read under r's mask where u was packed
        under it (masked_pack), else from u unpacked first."""
        dt = p_r.dtype
        kern = K.kernels_for(dt.name, self.variant)
        r_planes = self._planes(P, p_r)
        shared = (p_u.mask is p_r.mask and p_u.offsets is p_r.offsets   # masked_pack's
                  and p_u.chunk_log2 == p_r.chunk_log2)
        if shared:
            u_planes = (P.import_plane(p_u.values), P.import_plane(p_u.signs))
        else:
            u_planes = self._planes(P, p_u)
            shared = (p_u.chunk_log2 == p_r.chunk_log2
                      and P.ptr(u_planes[0]) == P.ptr(r_planes[0])
                      and P.ptr(u_planes[1]) == P.ptr(r_planes[1]))
            u_planes = u_planes[2:]
        op = K.OP_GATED if shared else K.OP_GATED_DENSE
        tile_log2 = kern.utile_log2[op]
        lay_r = p_r.layout
        if shared:
            lay_u = p_u.layout
            ubuf, u_key = None, (lay_u.encoding, lay_u.values[1], lay_u.signs[1])
            buffers = (*r_planes, *u_planes, gbuf, gg_buf, gu_buf)
        else:
            ubuf, _ = P.new_dense(p_u.shape, dt, st, allocator)
            self._decode(P, st, p_u, 0, None, ubuf, allocator)
            u_key = None
            buffers = (*r_planes, ubuf, gbuf, gg_buf, gu_buf)

        def launch():
            numel = p_r.numel
            mask, toff, shift = self._tile_offsets(P, p_r, r_planes, st, allocator, tile_log2)
            ge, g64, fast = self._dense_views(P, gbuf, numel, dt)
            og, og64, gg_fast = self._dense_views(P, gg_buf, numel, dt)
            ou, ou64, gu_fast = self._dense_views(P, gu_buf, numel, dt)
            if shared:
                u_stored = self._stored(P, p_u, (None, None, *u_planes))
                ue, u64, u_fast = ge, g64, True
                kernel = kern.unpack[(op, int(p_r.encoding), int(p_u.encoding))]
            else:
                # op 3 reads u dense: its planes' arguments are empty ones of their kinds
                u_stored = (mask, P.view(ubuf, 0, 0, np.uint32), 0) * 2
                ue, u64, u_fast = self._dense_views(P, ubuf, numel, dt)
                kernel = kern.unpack[(op, int(p_r.encoding))]
            fast = fast and gg_fast and gu_fast and u_fast
            o16 = fast and P.ptr(gg_buf) % 16 == 0 and P.ptr(gu_buf) % 16 == 0
            return Launch(kernel, _ceil_div(numel, 1 << tile_log2), K.UNT,
                          (mask, numel, toff, shift, *self._stored(P, p_r, r_planes), *u_stored,
                           ue, u64, ge, g64, fast, og, og64, ou, ou64, o16))
        key = ("gated", op, id(lay_r), u_key, kern) if p_r.chunk_log2 <= tile_log2 else None
        self._queue(P, st, key, lay_r, buffers, launch)

    def _grad(self, P, st, grad, p):
        gbuf, shape, dt = P.import_dense(grad, None, st)
        protocol.check_like("grad", shape, dt, p)
        return gbuf

    # ----------------------------------------------------------- host reads
    def _pstream(self, P, p):
        return P.stream(p.extra.get("stream", 0)) if not K.SIM else None

    @_one_context
    def read_nnz(self, p) -> int:
        P = _platform()
        lay = p.layout
        w = lay.offset_width
        return int(P.read(P.import_plane(p.offsets), lay.n_chunks * w, 1, np.dtype(f"<u{w}"),
                          self._pstream(P, p))[0])

    def read_status(self, p) -> int:
        if p.status is None:
            return 0
        code = p.extra.get("status_value")  # final once the pack has run: read once
        if code is None:
            code = p.extra["status_value"] = self._read_status_now(p)
        return code

    @_one_context
    def _read_status_now(self, p) -> int:
        P = _platform()
        return int(P.read(P.import_plane(p.status), 0, 1, np.int32, self._pstream(P, p))[0])

    @_one_context
    def to_numpy(self, array) -> np.ndarray:
        if K.SIM:
            return np.asarray(array).copy()
        # After all queued work, on every stream (as the CuPy backend's): a plane made
        # on a caller's non-blocking stream is read whole.
        _platform().device_sync()
        if hasattr(array, "get") and not hasattr(array, "copy_to_host"):
            return np.asarray(array.get())          # CuPy arrays, CudaArray
        return array.copy_to_host()
