"""The CuPy backend: format v1 on CUDA with the kernels of kernels/*.cu.

CuPy compiles the kernels (:mod:`.kernels`); everything queued goes through the
CUDA host protocol of :mod:`..cuda.host` on raw pointers, and inputs, outputs,
streams and allocation through :mod:`..cuda.interop`. Packing is one persistent
kernel plus a small kernel that writes the stream words shared by two tiles.
Exact packing (``capacity=None``) packs into a worst-case block, syncs once to
read nnz (and the nosign status), then copies the sections into a block of the
exact size. Fixed capacity does not sync: overflow and nosign violations stay on
the device (``offsets[-1]`` and ``PackedTensor.status``) until
:meth:`PackedTensor.check`.
"""

from __future__ import annotations

import numpy as np

from ...errors import OutputMismatchError
from ...packed import PackedTensor
from ...spec import format as _fmt
from ...spec.ops import masked_encoding
from ..cuda import driver, host, protocol
from ..cuda import interop as ci
from ..cuda.abi import Mode, Op
from .kernels import warm_cache  # noqa: F401  (bench scripts warm the compile cache here)

Encoding = _fmt.Encoding


def _read_host(ptr: int, nbytes: int, stream: int) -> np.ndarray:
    """A small device region copied to the host in stream order (one sync)."""
    out = np.zeros(nbytes, dtype=np.uint8)
    driver.copy_to_host(out.ctypes.data, ptr, nbytes, stream)
    driver.sync_stream(stream)
    return out


def _cupy_view(ptr: int, nbytes: int, dtype, owner, device: int):
    import cupy
    itemsize = np.dtype(dtype).itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
    return cupy.ndarray((nbytes // itemsize,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _ptr(arr) -> int:
    return int(arr.data.ptr) if arr is not None and arr.size else 0


def planes_of(p: PackedTensor) -> host.Planes:
    """Device pointers and lengths of ``p``'s planes (CuPy arrays of any GPU backend)."""
    return host.Planes(_ptr(p.mask), int(p.mask.size), _ptr(p.offsets),
                       int(p.offsets.dtype.itemsize == 8), _ptr(p.values), int(p.values.size),
                       _ptr(p.signs), int(p.signs.size))


def _cumsum_into(device: int, stream: int):
    """``prefix_scan`` for host.enqueue_unpack: CuPy's cumsum on ``stream``."""
    def scan(ptr: int, n: int) -> None:
        import cupy
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
            c = _cupy_view(ptr, 8 * n, np.uint64, None, device)
            cupy.cumsum(c, out=c)
    return scan


# --------------------------------------------------------------------------- #
# The backend                                                                 #
# --------------------------------------------------------------------------- #
class _CupySteps:
    """The protocol's steps (:mod:`..cuda.protocol`) for one CuPy pack call."""

    def __init__(self, backend, t: ci.CudaTensor, stream: int, allocator, y: int = 0,
                 in_planes: host.Planes | None = None):
        self.backend, self.t, self.s, self.allocator = backend, t, stream, allocator
        self.y, self.in_planes = y, in_planes

    def run(self, plan, fixed=True):
        t = self.t
        block = ci.allocate(plan.nbytes, t.device, self.s, self.allocator)
        scratch = ci.allocate(plan.scratch_bytes, t.device, self.s, self.allocator)
        host.enqueue_pack(plan, t.device, self.s, t.ptr, block.ptr, scratch.ptr, self.y,
                          self.in_planes, zero_tail=fixed)
        return block       # scratch is freed in stream order, after the queued kernels

    def read_head(self, plan, block):
        head = _read_host(plan.status(block.ptr), 16, self.s)
        return int(head[:4].view(np.uint32)[0]), int(head[8:16].view(np.uint64)[0])

    def shrink(self, plan, block, small):
        out = ci.allocate(small.nbytes, self.t.device, self.s, self.allocator)
        host.enqueue_shrink(plan, block.ptr, small, out.ptr, self.s)
        return out

    def packed(self, plan, block, nnz, pending_status):
        return self.backend._packed(self.t, plan, block, self.s, nnz=nnz, status=pending_status)


class CupyBackend:
    name = "cupy"
    device_type = "cuda"

    def is_available(self) -> bool:
        try:
            import cupy
            return cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all "unavailable"
            return False

    # ------------------------------------------------------------------ pack
    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        s = ci.stream_handle(stream)
        t = ci.import_cuda(x, dtype=dtype, stream=s)
        return self._pack(t, encoding, chunk_log2, capacity, s, allocator, Mode.PACK)

    def _pack(self, t: ci.CudaTensor, encoding, chunk_log2, capacity, s, allocator, mode,
              y: ci.CudaArray | None = None) -> PackedTensor:
        steps = _CupySteps(self, t, s, allocator, y.ptr if y else 0)
        return protocol.pack(steps, tuple(t.shape), t.dtype, encoding, chunk_log2, capacity, mode)

    def _packed(self, t, plan, buf, s, *, nnz, status, mask=None, offsets=None, extra=None):
        lay, dev = plan.lay, buf.device
        dtypes = (np.uint8, np.dtype(f"<u{lay.offset_width}"), np.uint8, np.uint8)
        views = [_cupy_view(buf.ptr + off, n, d, buf, dev)
                 for (off, n), d in zip(plan.spans, dtypes)]
        ex = {"stream": s, **(extra or {})}
        return PackedTensor(tuple(t.shape), t.dtype, lay.encoding, lay.chunk_log2, lay.capacity,
                            views[0] if mask is None else mask,
                            views[1] if offsets is None else offsets,
                            views[2], views[3], backend=self, device=("cuda", dev), _nnz=nnz,
                            status=(_cupy_view(plan.status(buf.ptr), 4, np.int32, buf, dev)
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

    def _unpack_op(self, p, op, s, allocator, out, **kw):
        lay = p.layout
        scratch = host.prefix_scratch_bytes(lay, op)
        prefix = ci.allocate(scratch, p.device[1], s, allocator) if scratch else None
        host.enqueue_unpack(lay, self._ready(p, s), op, p.device[1], s, out,
                            prefix=prefix.ptr if prefix else 0,
                            prefix_scan=_cumsum_into(p.device[1], s), **kw)

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
        y = ci.CudaArray.empty(t.shape, t.dtype, t.device, s, allocator)
        p = self._pack(t, encoding, chunk_log2, capacity, s, allocator,
                       Mode.RELU2 if square else Mode.RELU, y=y)
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
        gg = ci.CudaArray.empty(p_r.shape, p_r.dtype, dev, s, allocator)
        gu = ci.CudaArray.empty(p_r.shape, p_r.dtype, dev, s, allocator)
        pr = planes_of(p_r)
        if (pu.mask, pu.offsets) == (pr.mask, pr.offsets):
            self._unpack_op(p_r, Op.GATED, s, allocator, gg.ptr, out2=gu.ptr, grad=g.ptr,
                            pu=pu, u_encoding=p_u.encoding)
        else:
            u = self.unpack(p_u, stream=s, allocator=allocator)
            self._unpack_op(p_r, Op.GATED_DENSE, s, allocator, gg.ptr, out2=gu.ptr, grad=g.ptr,
                            udense=u.ptr)
        return gg, gu

    # --------------------------------------------------------------- helpers
    def read_nnz(self, p) -> int:
        s = p.extra.get("stream", 0)
        w = p.offsets.dtype.itemsize
        last = int(p.offsets.data.ptr) + (p.offsets.size - 1) * w
        return int(_read_host(last, w, s).view(f"<u{w}")[0])

    def read_status(self, p) -> int:
        if p.status is None:
            return 0
        if "status_value" not in p.extra:        # final once the pack has run
            s = p.extra.get("stream", 0)
            p.extra["status_value"] = int(_read_host(int(p.status.data.ptr), 4, s)
                                          .view(np.int32)[0])
        return p.extra["status_value"]

    def to_numpy(self, array) -> np.ndarray:
        if isinstance(array, ci.CudaArray):
            return array.get()
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        return cupy.asnumpy(array)
