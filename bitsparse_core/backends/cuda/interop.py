"""GPU plumbing shared by the CUDA backends (CuPy and Numba): streams, inputs,
allocation, and the dense output arrays.

Contract
========

Streams.  Every GPU entry point takes ``stream=``: ``None`` (CuPy's current
stream; the public ``bitsparse_core`` functions pass torch's current stream for
torch CUDA data instead, :func:`torch_defaults`), a raw ``cudaStream_t`` as an
int (1 = legacy default, 2 = per-thread default), a ``cupy.cuda.Stream``
(``.ptr``), or any object with ``.cuda_stream``
(torch streams) or ``.handle`` (Numba streams). :func:`stream_handle` turns it
into the raw int every kernel launch uses. Nothing runs on an implicit stream.

Inputs.  :func:`import_cuda` takes a CUDA tensor through DLPack
(``x.__dlpack__(stream=ours)``, so the producer orders its pending work before
our stream, as the DLPack stream rule says) or, failing that, through
``__cuda_array_interface__`` (v3: if it names a stream we make ours wait on
it). It returns a :class:`CudaTensor` (pointer, shape, DType, device, owner).
Non-C-contiguous tensors raise :class:`NonContiguousError`; dtypes outside the
five raise :class:`UnsupportedDTypeError`. ``dtype=`` reinterprets an integer
tensor of the same width (CuPy has no bf16 / fp8 arrays: pass uint16 / uint8).

Allocation.  An allocator is any callable
``allocator(nbytes: int, device: int, stream: int) -> obj`` where ``obj``
exposes ``__cuda_array_interface__`` or ``__dlpack__`` for a 1-D uint8 buffer of
at least ``nbytes`` bytes on ``device``, usable in stream order on ``stream``;
the object is kept alive as long as any view of the memory. The default is
CuPy's memory pool (stream-ordered on ``stream``); the public functions use
PyTorch's caching allocator for torch CUDA data (:func:`torch_allocator`, so
``torch.cuda.max_memory_allocated`` sees it).
A packed tensor is ONE allocation, laid out by :func:`.host.pack_plan`.
Torch tensors (inputs, and allocator results) are taken by pointer, without a
DLPack round trip.

Outputs.  Dense results (unpack, relu_pack's y, backward gradients) are
:class:`CudaArray`: ``__dlpack__`` exports the true dtype (bf16 code 4, fp8
codes 10 / 12) and implements the producer side of the stream rule (an event
recorded on our stream, the consumer's stream made to wait on it);
``__cuda_array_interface__`` is there too, with the dtype's unsigned integer
typestr for bf16 / fp8 (the interface has no codes for them).

Stream waits go through :mod:`.driver`; pointer queries and host copies of
results through CuPy's runtime bindings, which both backends have on a CUDA
machine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ...spec import format as _fmt
from . import driver
from ... import dtypes as _dt
from ...dlpack import (DL_INT, DL_UINT, KDL_CUDA, KDL_CUDA_MANAGED, import_capsule, make_capsule,
                       resolve_dtype)
from ...errors import NonContiguousError, OutputMismatchError, UnsupportedDeviceError, UnsupportedDTypeError

_CUDA_DEVICES = (KDL_CUDA, KDL_CUDA_MANAGED)
_TORCH_DTYPE_NAMES = {"bfloat16": _dt.BFLOAT16, "float16": _dt.FLOAT16, "float32": _dt.FLOAT32,
                      "float8_e4m3fn": _dt.FLOAT8_E4M3FN, "float8_e5m2": _dt.FLOAT8_E5M2}


_TORCH_DTYPES: dict = {}    # torch dtype -> DType; filled on the first torch tensor


def _format_dtype_of(t):
    """The format DType of a torch tensor's dtype, or None (importing this module never
    imports torch: the table is filled on first use)."""
    if not _TORCH_DTYPES:
        torch = sys.modules["torch"]
        _TORCH_DTYPES.update({getattr(torch, n): d for n, d in _TORCH_DTYPE_NAMES.items()
                              if hasattr(torch, n)})
    return _TORCH_DTYPES.get(t.dtype)


def _runtime():
    from cupy.cuda import runtime
    return runtime


# --------------------------------------------------------------------------- #
# Streams                                                                     #
# --------------------------------------------------------------------------- #
def stream_handle(stream) -> int:
    """The raw ``cudaStream_t`` (as an int) for a user's stream argument."""
    if type(stream) is int and stream >= 0:        # the hot path's own handles
        return stream
    if stream is None:
        import cupy
        return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, (int, np.integer)):
        if int(stream) < 0:
            raise ValueError(f"stream handle {stream} is negative")
        return int(stream)
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if hasattr(stream, "handle"):                      # numba.cuda streams
        h = stream.handle
        return int(getattr(h, "value", h) or 0)
    raise TypeError(f"cannot use {type(stream).__name__} as a CUDA stream; pass an int handle, "
                    "a cupy/torch/numba stream, or None")


def dlpack_stream_arg(handle: int) -> int:
    """Our stream as the DLPack ``stream=`` argument (0 is not allowed there)."""
    return 1 if handle == 0 else handle


def same_stream(a: int, b: int) -> bool:
    legacy = (0, 1)
    return a == b or (a in legacy and b in legacy)


def stream_wait(consumer: int, producer: int, device: int) -> None:
    """Make ``consumer`` wait for the work queued so far on ``producer``."""
    if not same_stream(consumer, producer):
        driver.stream_wait(consumer, producer)


# --------------------------------------------------------------------------- #
# Inputs                                                                      #
# --------------------------------------------------------------------------- #
@dataclass
class CudaTensor:
    """A C-contiguous CUDA tensor we may read (and, for ``out=``, write)."""
    ptr: int
    shape: tuple
    dtype: _dt.DType
    device: int
    owner: Any = field(repr=False)

    @property
    def numel(self) -> int:
        return _fmt.numel_of(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def aligned16(self) -> bool:
        return self.ptr % 16 == 0


_TYPESTR_CODES = {"f": 2, "u": 1, "i": 0}


def _c_contiguous(shape, strides_elems) -> bool:
    if strides_elems is None:
        return True
    expect = 1
    for dim, st in zip(reversed(shape), reversed(strides_elems)):
        if dim != 1 and st != expect:
            return False
        expect *= dim
    return True


def _from_cai(x, dtype, handle: int) -> CudaTensor:
    cai = x.__cuda_array_interface__
    shape = tuple(int(s) for s in cai["shape"])
    typestr = cai["typestr"]
    kind, itemsize = typestr[1], int(typestr[2:])
    code = _TYPESTR_CODES.get(kind)
    if code is None and kind == "V" and dtype is not None:
        code = 1                                      # raw bits with a dtype override
    if code is None:
        raise UnsupportedDTypeError(f"__cuda_array_interface__ typestr {typestr!r} is not supported; "
                                    "pass dtype= for raw bit patterns")
    dt = resolve_dtype(code, itemsize * 8, 1, dtype)
    strides = cai.get("strides")
    if strides is not None:
        if any(s % itemsize for s in strides):
            raise NonContiguousError(f"strides {strides} are not multiples of the item size")
        strides = tuple(int(s) // itemsize for s in strides)
    if _fmt.numel_of(shape) and not _c_contiguous(shape, strides):
        raise NonContiguousError(f"tensor with shape {shape} and strides {cai.get('strides')} is not "
                                 "C-contiguous; make it contiguous first")
    ptr = int(cai["data"][0] or 0)
    if ptr:
        attrs = _runtime().pointerGetAttributes(ptr)
        device = int(attrs.device)
    else:
        device = _runtime().getDevice()
    producer = cai.get("stream")
    if producer is not None and cai.get("version", 0) >= 3:
        stream_wait(handle, int(producer), device)
    return CudaTensor(ptr, shape, dt, device, x)


def _torch_tensor(x):
    """``x`` if it is a torch tensor (without importing torch), else None."""
    torch = sys.modules.get("torch")
    return x if torch is not None and isinstance(x, torch.Tensor) else None


def _from_torch(t, dtype, stream: int) -> CudaTensor:
    """A torch CUDA tensor by pointer: no DLPack capsule on the hot path. Ordered
    after torch's current stream, as the DLPack stream rule would order it."""
    if not t.is_cuda:
        raise UnsupportedDeviceError(f"tensor lives on {t.device}, not CUDA")
    if not t.is_contiguous() and t.numel():
        raise NonContiguousError(f"tensor with shape {tuple(t.shape)} and strides {t.stride()} "
                                 "is not C-contiguous; call .contiguous() first")
    dt = _format_dtype_of(t)
    if dt is None or dtype is not None:
        code = 2 if t.dtype.is_floating_point else (0 if t.dtype.is_signed else 1)
        dt = resolve_dtype(code, 8 * t.element_size(), 1, dtype)
    dev = t.get_device()
    stream_wait(stream, torch_stream(dev), dev)
    return CudaTensor(t.data_ptr(), tuple(t.shape), dt, dev, t)


def torch_stream(device: int) -> int:
    """The raw handle of torch's current stream on ``device`` (no Stream object made)."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def import_cuda(x, dtype=None, stream: int = 0) -> CudaTensor:
    """Describe a CUDA tensor (no copy), ordered before work on ``stream``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(x, dtype, stream)
    if isinstance(x, DevicePlane):       # integer bits: packable with a dtype= override
        dt = resolve_dtype(x._elem.dl_code, x._elem.bits, 1, dtype)
        stream_wait(stream, x.stream, x.device)
        return CudaTensor(x.ptr, x.shape, dt, x.device, x)
    if isinstance(x, CudaArray):
        dt = x.dtype
        if dtype is not None:
            want = _dt.resolve(dtype)
            if want != dt:
                raise UnsupportedDTypeError(f"dtype={want.name} given for a {dt.name} array")
        stream_wait(stream, x.stream, x.device)
        return CudaTensor(x.ptr, x.shape, dt, x.device, x)
    if hasattr(x, "__dlpack__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) not in _CUDA_DEVICES:
            raise UnsupportedDeviceError(f"tensor lives on DLPack device type {dev_type}, not CUDA")
        imp = import_capsule(x.__dlpack__(stream=dlpack_stream_arg(stream)))
        dt = resolve_dtype(imp.code, imp.bits, imp.lanes, dtype)
        if imp.numel and not imp.is_c_contiguous:
            raise NonContiguousError(f"tensor with shape {imp.shape} and strides {imp.strides} is not "
                                     "C-contiguous; call .contiguous() first")
        return CudaTensor(int(imp.data), tuple(imp.shape), dt, int(imp.device_id), (x, imp.owner))
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, dtype, stream)
    raise TypeError(f"{type(x).__name__} is neither a DLPack producer nor a CUDA array")


# --------------------------------------------------------------------------- #
# Allocation                                                                  #
# --------------------------------------------------------------------------- #
Allocator = Callable[[int, int, int], Any]


def cupy_allocator(nbytes: int, device: int, stream: int):
    """CuPy's memory pool, stream-ordered on ``stream``."""
    import cupy
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
        return cupy.empty(nbytes, dtype=cupy.uint8)


@dataclass
class DeviceBuffer:
    ptr: int
    nbytes: int
    device: int
    owner: Any = field(repr=False)


_TORCH_DEVICES: dict = {}      # device index -> torch.device, made once each


def torch_device(device: int):
    """torch's ``cuda:device``, made once per index."""
    dev = _TORCH_DEVICES.get(device)
    if dev is None:
        dev = _TORCH_DEVICES[device] = sys.modules["torch"].device("cuda", device)
    return dev


class TorchBlock:
    """A block of PyTorch's caching allocator taken by address (no tensor around it),
    given back to the allocator when the last reference goes. torch's memory
    statistics count it as they count a tensor's."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            try:
                _torch_raw_delete()(self.ptr)
            except Exception:  # noqa: BLE001 -- torch already torn down at exit: nothing to give back to
                pass


def _torch_raw_delete():
    """torch's ``caching_allocator_delete`` without its Python frame where torch has the
    binding it calls (a block is given back on every op's result)."""
    torch = sys.modules["torch"]
    return getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete",
                   torch.cuda.caching_allocator_delete)


def torch_buffer(nbytes: int, device: int, stream: int) -> DeviceBuffer:
    """``nbytes`` from PyTorch's caching allocator, stream-ordered on ``stream``, taken
    by address: no tensor and no stream object are made, so a side stream costs what
    torch's current one does. The legacy default stream (1) shares the null stream's
    pool, as torch's default stream does. On torch's current device the block comes
    straight from the binding ``torch.cuda.caching_allocator_alloc`` calls, without
    the device switch that function makes around it (a few µs per op)."""
    if nbytes == 0:
        return DeviceBuffer(0, 0, device, None)
    import torch
    s = 0 if stream == 1 else stream
    C = torch._C
    raw = getattr(C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    if raw is not None and torch.cuda.is_initialized() and C._cuda_getDevice() == device:
        ptr = raw(nbytes, s)
    else:
        ptr = torch.cuda.caching_allocator_alloc(nbytes, device, s)
    return DeviceBuffer(ptr, nbytes, device, TorchBlock(ptr))


def torch_tensor_buffer(nbytes: int, device: int, stream: int) -> DeviceBuffer:
    """``nbytes`` from PyTorch's caching allocator as a 1-D uint8 tensor (the owner),
    stream-ordered on ``stream``; no stream context when ``stream`` is torch's current
    one on ``device``."""
    import torch
    dev = torch_device(device)
    if same_stream(stream, torch_stream(device)):
        t = torch.empty((nbytes,), dtype=torch.uint8, device=dev)
    else:
        on = (torch.cuda.default_stream(dev) if stream in (0, 1)
              else torch.cuda.ExternalStream(stream, device=dev))
        with torch.cuda.stream(on):
            t = torch.empty((nbytes,), dtype=torch.uint8, device=dev)
    return DeviceBuffer(t.data_ptr(), nbytes, device, t)


def torch_allocator(nbytes: int, device: int, stream: int):
    """PyTorch's caching allocator (counted by ``torch.cuda.max_memory_allocated``): a
    1-D uint8 tensor. The default for torch CUDA inputs (:func:`torch_defaults`)."""
    return torch_tensor_buffer(int(nbytes), int(device), int(stream)).owner


def torch_defaults(device: int, stream, allocator):
    """``(stream, allocator)`` of a call on torch CUDA data on ``device``: where the
    caller named none, torch's current stream there and its caching allocator, as
    torch's own ops would use (not CuPy's stream and pool, which torch neither
    orders after nor counts)."""
    return (torch_stream(device) if stream is None else stream,
            torch_allocator if allocator is None else allocator)


def default_buffer(nbytes: int, device: int, stream: int) -> DeviceBuffer:
    """``nbytes`` from CuPy's pool (what ``cupy_allocator`` gives, without an array),
    stream-ordered on ``stream``; no context switch when ``stream`` is already CuPy's
    current one on ``device`` (a call that named no stream)."""
    import cupy
    if (cupy.cuda.get_current_stream().ptr == stream
            and cupy.cuda.runtime.getDevice() == device):
        mem = cupy.cuda.alloc(nbytes)
    else:
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
            mem = cupy.cuda.alloc(nbytes)
    return DeviceBuffer(mem.ptr, nbytes, device, mem)


def allocate(nbytes: int, device: int, stream: int, allocator: Optional[Allocator] = None) -> DeviceBuffer:
    """``nbytes`` bytes from ``allocator`` (default: CuPy's pool), checked."""
    if allocator is None:
        return default_buffer(int(nbytes), int(device), int(stream))
    if allocator is torch_allocator:          # no tensor round trip through the callable
        return torch_buffer(int(nbytes), int(device), int(stream))
    obj = allocator(int(nbytes), int(device), int(stream))
    if _torch_tensor(obj) is not None:
        ptr, size, owner = obj.data_ptr(), obj.numel() * obj.element_size(), obj
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        ptr = int(cai["data"][0] or 0)
        size = _fmt.numel_of(cai["shape"]) * int(cai["typestr"][2:])
        owner = obj
    elif hasattr(obj, "__dlpack__"):
        imp = import_capsule(obj.__dlpack__(stream=dlpack_stream_arg(stream)))
        ptr, size, owner = int(imp.data), imp.numel * imp.bits // 8, (obj, imp.owner)
    else:
        raise TypeError(f"allocator returned {type(obj).__name__}, which exposes neither "
                        "__cuda_array_interface__ nor __dlpack__")
    if size < nbytes or (nbytes and not ptr):
        raise MemoryError(f"allocator returned {size} bytes; {nbytes} were requested")
    return DeviceBuffer(ptr, int(nbytes), int(device), owner)


# --------------------------------------------------------------------------- #
# Outputs                                                                     #
# --------------------------------------------------------------------------- #
def _typestr(dtype: _dt.DType) -> str:
    kind = {_dt.DL_FLOAT: "f", DL_INT: "i"}.get(dtype.dl_code, "u")
    return f"<{kind}{dtype.itemsize}" if dtype.itemsize > 1 else f"|{kind}1"


# The element types of a packed tensor's planes (mask, values and signs bytes, u32 / u64
# offsets, the i32 status word), described for export as the format dtypes are.
_PLANE_ELEMS = {np.dtype(n): _dt.DType(np.dtype(n).name, code, 8 * np.dtype(n).itemsize,
                                       np.dtype(n))
                for n, code in (("u1", DL_UINT), ("<u4", DL_UINT), ("<u8", DL_UINT),
                                ("<i4", DL_INT))}


class CudaArray:
    """A dense C-contiguous result on a CUDA device, produced on ``stream``."""

    __slots__ = ("ptr", "shape", "dtype", "device", "stream", "_owner", "_elem")

    def __init__(self, ptr: int, shape, dtype: _dt.DType, device: int, owner, stream: int):
        self.ptr = int(ptr)
        self.shape = shape if type(shape) is tuple else tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device = int(device)
        self.stream = int(stream)
        self._owner = owner
        self._elem = dtype        # what DLPack and the host copy describe the bits as

    @classmethod
    def empty(cls, shape, dtype: _dt.DType, device: int, stream: int, allocator=None) -> "CudaArray":
        nbytes = _fmt.numel_of(shape) * dtype.itemsize
        buf = allocate(nbytes, device, stream, allocator)
        return cls(buf.ptr, shape, dtype, device, buf, stream)

    @classmethod
    def empty_pair(cls, shape, dtype: _dt.DType, device: int, stream: int,
                   allocator=None) -> tuple:
        """Two arrays of one shape in one allocation (the second 16-byte aligned): an
        op's two results for one allocator call."""
        half = _fmt.align(_fmt.numel_of(shape) * dtype.itemsize, 16)
        buf = allocate(2 * half, device, stream, allocator)
        return (cls(buf.ptr, shape, dtype, device, buf, stream),
                cls(buf.ptr + half, shape, dtype, device, buf, stream))

    @property
    def size(self) -> int:
        return _fmt.numel_of(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self._elem.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, dtype={self._elem.name}, "
                f"device=cuda:{self.device})")

    # DLPack producer ---------------------------------------------------------
    def __dlpack_device__(self):
        return (KDL_CUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """The DLPack >= 1.0 / array API export (see :mod:`bitsparse_core.dlpack`).

        ``stream``: the consumer's (None = legacy default, -1 = no ordering); our
        pending work is ordered before it. ``copy=True`` copies on that stream (on
        ours for -1) and sets the is-copied flag. ``dl_device=(kDLCPU, 0)`` exports
        a host copy, complete on return (``copy=False`` raises CopyRefusedError);
        any other device but ours raises BufferError."""
        from ...dlpack import KDL_CPU, CopyRefusedError, export_host, export_request
        versioned, target, copy = export_request(max_version, dl_device, copy)
        if target == (KDL_CPU, 0):
            if copy is False:
                raise CopyRefusedError(f"exporting cuda:{self.device} data to the CPU needs a "
                                       "device-to-host copy, and copy=False forbids it")
            # A consumer may pass its stream on our device (torch does); the host copy
            # is complete when this returns, so it needs no ordering on that stream.
            return export_host(self.get(), self._elem, max_version=max_version, copied=True)
        if target is not None and target != (KDL_CUDA, self.device):
            raise BufferError(f"cannot export a cuda:{self.device} array to DLPack device "
                              f"{target}; it lives on {(KDL_CUDA, self.device)}")
        # Stream rule: None means the legacy default stream, -1 means no sync.
        if stream is None:
            stream = 1
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
            raise TypeError(f"stream must be an int handle or None, not {stream!r}")
        if int(stream) == 0:
            raise BufferError("stream=0 is ambiguous in DLPack; use 1 (legacy) or 2 (per-thread)")
        if int(stream) < -1:
            raise BufferError(f"stream={stream} is not a CUDA stream handle")
        if int(stream) != -1:
            stream_wait(int(stream), self.stream, self.device)
        src = self
        if copy:
            on = self.stream if int(stream) == -1 else int(stream)
            src = CudaArray.empty(self.shape, self._elem, self.device, on)
            if self.nbytes:
                rt = _runtime()
                prev = rt.getDevice()
                rt.setDevice(self.device)
                try:
                    rt.memcpyAsync(src.ptr, self.ptr, self.nbytes, rt.memcpyDeviceToDevice, on)
                finally:
                    rt.setDevice(prev)
        return make_capsule(src.ptr, src.shape, self._elem, KDL_CUDA, src.device, src,
                            versioned=versioned, copied=bool(copy))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": _typestr(self._elem), "strides": None,
                "data": (self.ptr, False), "version": 3,
                "stream": dlpack_stream_arg(self.stream)}

    def get(self) -> np.ndarray:
        """An explicit copy to host memory (a NumPy array of the true dtype)."""
        from ...dlpack import exportable
        out = np.empty(self.shape, dtype=self._elem.numpy)
        if out.nbytes:
            rt = _runtime()
            prev = rt.getDevice()
            rt.setDevice(self.device)
            try:
                rt.memcpyAsync(out.ctypes.data, self.ptr, out.nbytes, rt.memcpyDeviceToHost,
                               self.stream)
                rt.streamSynchronize(self.stream)
            finally:
                rt.setDevice(prev)
        return exportable(out)


class DevicePlane(CudaArray):
    """One plane of a packed tensor on a CUDA device: a 1-D view of ``count`` elements of
    a NumPy integer ``dtype`` at ``ptr``, kept alive by ``owner`` (the tensor's block).

    A plane is data, not a framework array: it exports through DLPack and
    ``__cuda_array_interface__`` (``cupy.asarray(p.mask)`` views it without a copy)
    and copies to the host with :meth:`get`. Making one costs a few attribute writes,
    where a CuPy array view costs microseconds: a pack makes four or five."""

    __slots__ = ()

    def __init__(self, ptr: int, count: int, dtype: np.dtype, device: int, owner, stream: int):
        self.ptr = ptr
        self.shape = (count,)
        self.device = device
        self.stream = stream
        self.dtype = dtype
        self._owner = owner
        self._elem = _PLANE_ELEMS[dtype]

    @classmethod
    def empty(cls, *args, **kwargs):
        raise TypeError("a DevicePlane views a packed tensor's block and is never allocated "
                        "on its own; CudaArray.empty allocates a dense result")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def get(self) -> np.ndarray:
        return np.asarray(super().get())


def plane_of(buf, offset: int, nbytes: int, dtype, stream: int) -> DevicePlane:
    """The plane of ``nbytes`` bytes at ``offset`` in the device buffer ``buf``."""
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    return DevicePlane(buf.ptr + offset, nbytes // dtype.itemsize, dtype, buf.device, buf, stream)


def plane_ptr(plane) -> int:
    """The device address of a plane (a :class:`DevicePlane`, or any CUDA array) or 0
    when it is empty."""
    if isinstance(plane, CudaArray):
        return plane.ptr if plane.shape[0] else 0
    cai = plane.__cuda_array_interface__
    return int(cai["data"][0] or 0) if _fmt.numel_of(cai["shape"]) else 0


def plane_len(plane) -> int:
    """Elements in a plane."""
    if isinstance(plane, CudaArray):
        return plane.shape[0]
    return _fmt.numel_of(plane.__cuda_array_interface__["shape"])


def check_out(out: CudaTensor, shape, dtype: _dt.DType, device: int) -> None:
    if out.dtype != dtype or tuple(out.shape) != tuple(shape):
        raise OutputMismatchError(f"out has {out.dtype.name}{tuple(out.shape)}; "
                                  f"need {dtype.name}{tuple(shape)}")
    if out.device != device:
        raise OutputMismatchError(f"out lives on cuda:{out.device}; the data on cuda:{device}")
