"""The CuPy backend: format v1 on CUDA with the kernels of kernels/*.cu.

CuPy compiles the kernels (:mod:`.kernels`); everything queued goes through the
CUDA host protocol of :mod:`..cuda.host` on raw pointers, and inputs, outputs,
streams and allocation through :mod:`..cuda.interop`. Packing is one persistent
cooperative kernel (after a grid barrier it writes the stream words shared by two
tiles and, at a fixed capacity, the zeros past the stored values), into one
allocation that also carries its scratch. Exact packing (``capacity=None``) packs
the mask and offsets into their own allocation and the values into a worst-case
one, waits for the count the kernel writes to a pinned host slot (no stream
synchronize: :mod:`..cuda.slots`), then copies the stored values into an
allocation of their exact size. Fixed capacity does not wait: overflow and nosign
violations stay on the device (``offsets[-1]`` and ``PackedTensor.status``) until
:meth:`PackedTensor.check`.
"""

from __future__ import annotations

import numpy as np

from ...errors import OutputMismatchError
from ...packed import PackedTensor
from ...spec import format as _fmt
from ...spec.ops import masked_encoding
from ..cuda import driver, host, protocol, shrink, slots
from ..cuda import interop as ci
from ..cuda.abi import Mode, Op
from .kernels import warm_cache  # noqa: F401  (bench scripts warm the compile cache here)

Encoding = _fmt.Encoding
_OFFSET_DTYPES = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
_U8, _I32 = np.dtype(np.uint8), np.dtype(np.int32)


def _read_host(ptr: int, nbytes: int, stream: int) -> np.ndarray:
    """A small device region copied to the host in stream order (one sync)."""
    out = np.zeros(nbytes, dtype=np.uint8)
    driver.copy_to_host(out.ctypes.data, ptr, nbytes, stream)
    driver.sync_stream(stream)
    return out


def planes_of(p: PackedTensor) -> host.Planes:
    """Device pointers and lengths of ``p``'s planes (those of any GPU backend); kept
    with ``p`` while its plane objects stay the same."""
    known = p.__dict__.get("_device_planes")
    if (known is not None and known[0] is p.mask and known[1] is p.offsets
            and known[2] is p.values and known[3] is p.signs):
        return known[4]
    ptr, n = ci.plane_ptr, ci.plane_len
    planes = host.Planes(ptr(p.mask), n(p.mask), ptr(p.offsets),
                         int(p.offsets.dtype.itemsize == 8), ptr(p.values), n(p.values),
                         ptr(p.signs), n(p.signs))
    p.__dict__["_device_planes"] = (p.mask, p.offsets, p.values, p.signs, planes)
    return planes


def _cumsum_into(device: int, stream: int):
    """``prefix_scan`` for host.enqueue_unpack: CuPy's cumsum on ``stream``."""
    def scan(ptr: int, n: int) -> None:
        import cupy
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
            mem = cupy.cuda.UnownedMemory(ptr, 8 * n, None, device)
            c = cupy.ndarray((n,), dtype=np.uint64, memptr=cupy.cuda.MemoryPointer(mem, 0))
            cupy.cumsum(c, out=c)
    return scan


# --------------------------------------------------------------------------- #
# The backend                                                                 #
# --------------------------------------------------------------------------- #
class _CupySteps:
    """The protocol's steps (:mod:`..cuda.protocol`) for one CuPy pack call."""

    def __init__(self, backend, t: ci.CudaTensor, stream: int, allocator, y: int = 0,
                 in_planes: host.Planes | None = None, scratch: int = 0):
        self.backend, self.t, self.s, self.allocator = backend, t, stream, allocator
        self.y, self.in_planes, self.scratch = y, in_planes, scratch
        self.slot = 0
        self.shrunk = None     # an exact tail the native steps made (shrink.py)

    def _with_scratch(self, nbytes: int, plan):
        """``(buffer, scratch address)``: one allocation for ``nbytes`` and, where
        relu_pack's y does not carry it, the pack's scratch behind them."""
        extra = 0 if self.scratch else plan.scratch_bytes
        buf = ci.allocate(nbytes + extra, self.t.device, self.s, self.allocator)
        return buf, self.scratch or buf.ptr + nbytes

    def run(self, plan, fixed=True, count=False):
        t = self.t
        if not fixed:               # exact: the head, and the worst-case values apart
            head = ci.allocate(plan.head_bytes, t.device, self.s, self.allocator)
            tail, scratch = self._with_scratch(plan.tail_bytes, plan)
            self.slot = slots.take() if count else 0
            host.enqueue_pack_split(plan, t.device, self.s, t.ptr, head.ptr, tail.ptr, scratch,
                                    self.y, self.slot)
            return head, tail
        block, scratch = self._with_scratch(plan.nbytes, plan)
        self.slot = slots.take() if count else 0
        host.enqueue_pack(plan, t.device, self.s, t.ptr, block.ptr, scratch, self.y,
                          self.in_planes, zero_tail=True, slot=self.slot)
        return block

    def read_head(self, plan, block):
        slot, self.slot = self.slot, 0
        if type(block) is tuple:        # exact: the count's wait and the shrink, natively
            done = shrink.wait_and_shrink(plan, slot, self.s, self.t.device, block[1].ptr,
                                          self.allocator)
            if done is not None:
                status, nnz, shrunk = done
                if shrunk is not None:
                    self.shrunk = (block[0], *shrunk)
                return status, nnz
        return slots.wait(slot, self.s)

    def shrink(self, plan, block, nnz):
        if self.shrunk is not None:
            shrunk, self.shrunk = self.shrunk, None
            return shrunk
        head, tail = block
        exact = host.tail_shrink(plan, nnz)
        out = ci.allocate(exact.nbytes, self.t.device, self.s, self.allocator)
        host.enqueue_tail_shrink(exact.copies, tail.ptr, out.ptr, self.s)
        return head, out, exact

    def packed(self, plan, block, nnz, pending_status):
        if isinstance(block, tuple):            # an exact pack's head and shrunk tail
            head, tail, exact = block
            return self.backend._packed(self.t, plan, head, self.s, nnz=nnz, status=False,
                                        tail=(tail, exact))
        return self.backend._packed(self.t, plan, block, self.s, nnz=nnz,
                                    status=pending_status)


class CupyBackend:
    name = "cupy"
    device_type = "cuda"

    _available = None

    def is_available(self) -> bool:
        if not self._available:            # asked on every call: a yes is kept
            try:
                import cupy
                CupyBackend._available = cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all "unavailable"
                return False
        return self._available

    # ------------------------------------------------------------------ pack
    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        s = ci.stream_handle(stream)
        t = ci.import_cuda(x, dtype=dtype, stream=s)
        return self._pack(t, encoding, chunk_log2, capacity, s, allocator, Mode.PACK)

    def _pack(self, t: ci.CudaTensor, encoding, chunk_log2, capacity, s, allocator, mode,
              y: int = 0, scratch: int = 0) -> PackedTensor:
        steps = _CupySteps(self, t, s, allocator, y, scratch=scratch)
        return protocol.pack(steps, t.shape, t.dtype, encoding, chunk_log2, capacity, mode)

    def _packed(self, t, plan, buf, s, *, nnz, status, mask=None, offsets=None, extra=None,
                tail=None):
        """The PackedTensor of a block; ``tail``: an exact pack's values and signs in an
        allocation of their own and its :class:`host.ExactTail` (``plan`` then being its
        worst case: the head's planes lie where it has them, :attr:`host.PackPlan.head_bytes`)."""
        lay = plan.lay
        (mo, ml), (oo, ol), (vo, vl), (so, sl) = plan.spans
        vbuf, status_at, capacity = buf, plan.status_offset, lay.capacity
        if tail is not None:
            vbuf, exact = tail
            vo, vl, so, sl = 0, exact.values_len, exact.signs_offset, exact.signs_len
            status_at, capacity = plan.spans[2][0], nnz
        # DevicePlane(address, count, ...) directly: plane_of's checks, five times a pack
        Plane, dev = ci.DevicePlane, buf.device
        ex = {"stream": s, **extra} if extra else {"stream": s}
        if offsets is None:
            odt = _OFFSET_DTYPES[lay.offset_width]
            offsets = Plane(buf.ptr + oo, ol // odt.itemsize, odt, dev, buf, s)
        return PackedTensor(t.shape, t.dtype, lay.encoding, lay.chunk_log2, capacity,
                            Plane(buf.ptr + mo, ml, _U8, dev, buf, s) if mask is None else mask,
                            offsets,
                            Plane(vbuf.ptr + vo, vl, _U8, dev, vbuf, s),
                            Plane(vbuf.ptr + so, sl, _U8, dev, vbuf, s),
                            backend=self, device=("cuda", dev), _nnz=nnz,
                            status=(Plane(buf.ptr + status_at, 1, _I32, dev, buf, s)
                                    if status else None),
                            extra=ex)

    # ---------------------------------------------------------------- unpack
    def _ready(self, p: PackedTensor, s: int, *, values: bool = True) -> host.Planes:
        """``p``'s planes, ordered before work on ``s`` and checked for overflow and
        nosign violations when the op reads its values."""
        protocol.check_packed(p)
        ci.stream_wait(s, protocol.producer_stream(p, s), p.device[1])
        if values:
            p.check()
        return planes_of(p)

    def _unpack_op(self, p, op, s, allocator, out, planes=None, **kw):
        lay = p.layout
        planes = planes or self._ready(p, s)
        scratch = host.prefix_scratch_bytes(lay, op)
        if scratch:       # chunks larger than a tile: per-tile counts, scanned by CuPy
            prefix = ci.allocate(scratch, p.device[1], s, allocator)
            kw.update(prefix=prefix.ptr, prefix_scan=_cumsum_into(p.device[1], s))
        host.enqueue_unpack(lay, planes, op, p.device[1], s, out, **kw)

    def unpack(self, p: PackedTensor, *, out=None, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        dev = p.device[1]
        if out is not None:
            o = ci.import_cuda(out, stream=s)
            ci.check_out(o, p.shape, p.dtype, dev)
        else:
            o = ci.CudaArray.empty(p.shape, p.dtype, dev, s, allocator)
        self._unpack_op(p, Op.UNPACK, s, allocator, o.ptr)
        return out if out is not None else o

    # ------------------------------------------------------------- fused ops
    def relu_pack(self, a, *, square=False, dtype=None, encoding="nosign",
                  chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, capacity=None, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        t = ci.import_cuda(a, dtype=dtype, stream=s)
        mode = Mode.RELU2 if square else Mode.RELU
        # y's allocation carries the pack's scratch behind it (16-byte aligned)
        ybytes = _fmt.align(t.nbytes, 16)
        buf = ci.allocate(ybytes + host.pack_scratch_bytes(t.numel, t.dtype), t.device, s,
                          allocator)
        y = ci.CudaArray(buf.ptr, t.shape, t.dtype, t.device, buf, s)
        p = self._pack(t, encoding, chunk_log2, capacity, s, allocator, mode, y=buf.ptr,
                       scratch=buf.ptr + ybytes)
        return y, p

    def _grad(self, grad, p, s):
        g = ci.import_cuda(grad, stream=s)
        protocol.check_like("grad", g.shape, g.dtype, p)
        if g.device != p.device[1]:
            raise OutputMismatchError(f"grad lives on cuda:{g.device}, the packed tensor on "
                                      f"cuda:{p.device[1]}")
        return g

    def relu_backward(self, grad, p, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        g = self._grad(grad, p, s)
        out = ci.CudaArray.empty(p.shape, p.dtype, g.device, s, allocator)
        host.enqueue_relu_backward(p.layout, self._ready(p, s, values=False), g.device, s,
                                   g.ptr, out.ptr)
        return out

    def relu2_backward(self, grad, p, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        g = self._grad(grad, p, s)
        out = ci.CudaArray.empty(p.shape, p.dtype, g.device, s, allocator)
        self._unpack_op(p, Op.RELU2, s, allocator, out.ptr, grad=g.ptr)
        return out

    def masked_pack(self, u, p_mask, *, dtype=None, encoding="signplane", stream=None,
                    allocator=None):
        s = ci.stream_handle(stream)
        t = ci.import_cuda(u, dtype=dtype, stream=s)
        protocol.check_like("u", t.shape, t.dtype, p_mask)
        if t.device != p_mask.device[1]:
            raise OutputMismatchError(f"u lives on cuda:{t.device}, the mask on cuda:{p_mask.device[1]}")
        enc = masked_encoding(encoding)
        mp = self._ready(p_mask, s, values=False)
        nnz = p_mask.nnz                    # known after an exact pack; else one sync
        plan = host.pack_plan(tuple(t.shape), t.dtype, enc, nnz, p_mask.chunk_log2, Mode.MASKED)
        block = _CupySteps(self, t, s, allocator, in_planes=mp).run(plan)
        return self._packed(t, plan, block, s, nnz=nnz, status=enc == Encoding.NOSIGN,
                            mask=p_mask.mask, offsets=p_mask.offsets, extra={"shares_mask": True})

    def gated_backward(self, grad, p_r, p_u, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        g = self._grad(grad, p_r, s)
        protocol.check_pair(p_r, p_u)
        pu = self._ready(p_u, s)            # every packed input checked for overflow
        dev = g.device
        pr = self._ready(p_r, s)
        gg, gu = ci.CudaArray.empty_pair(p_r.shape, p_r.dtype, dev, s, allocator)
        if (pu.mask, pu.offsets) == (pr.mask, pr.offsets):
            self._unpack_op(p_r, Op.GATED, s, allocator, gg.ptr, planes=pr, out2=gu.ptr,
                            grad=g.ptr, pu=pu, u_encoding=p_u.encoding)
        else:
            u = self.unpack(p_u, stream=s, allocator=allocator)
            self._unpack_op(p_r, Op.GATED_DENSE, s, allocator, gg.ptr, planes=pr, out2=gu.ptr,
                            grad=g.ptr, udense=u.ptr)
        return gg, gu

    # --------------------------------------------------------------- helpers
    def read_nnz(self, p) -> int:
        s = p.extra.get("stream", 0)
        w = p.offsets.dtype.itemsize
        last = ci.plane_ptr(p.offsets) + (ci.plane_len(p.offsets) - 1) * w
        return int(_read_host(last, w, s).view(f"<u{w}")[0])

    def read_status(self, p) -> int:
        if p.status is None:
            return 0
        if "status_value" not in p.extra:        # final once the pack has run
            s = p.extra.get("stream", 0)
            p.extra["status_value"] = int(_read_host(ci.plane_ptr(p.status), 4, s)
                                          .view(np.int32)[0])
        return p.extra["status_value"]

    def to_numpy(self, array) -> np.ndarray:
        if isinstance(array, ci.CudaArray):      # dense results and planes
            return array.get()
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        return cupy.asnumpy(array)
