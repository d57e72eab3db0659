"""torch <-> bitsparse_core: dtypes, DLPack crossing, allocator, stream, planes as tensors.

Everything device-specific of the adapter lives here, so the autograd code in
:mod:`functional` and :mod:`hooks` reads like plain PyTorch:

* CUDA memory is taken from torch's caching allocator (``torch.empty`` of
  uint8), so ``torch.cuda.max_memory_allocated`` sees every byte, and every
  kernel runs on torch's current stream.
* Results come back as ordinary torch tensors viewing those allocations (not
  DLPack wrappers), so ``record_stream``, ``save_for_backward`` and storage
  introspection work on them like on any tensor.
* CPU tensors go through the NumPy reference codec (exact, slow).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import numpy as np
import torch

from .. import dtypes as _dt
from ..backends import get_backend, select_backend
from ..dlpack import import_capsule
from ..errors import UnsupportedDTypeError, UnsupportedDeviceError
from ..packed import PackedTensor

PLANES = ("mask", "offsets", "values", "signs")

TORCH_TO_BS = {
    torch.bfloat16: _dt.BFLOAT16,
    torch.float16: _dt.FLOAT16,
    torch.float32: _dt.FLOAT32,
}
for _name, _d in (("float8_e4m3fn", _dt.FLOAT8_E4M3FN), ("float8_e5m2", _dt.FLOAT8_E5M2)):
    if hasattr(torch, _name):
        TORCH_TO_BS[getattr(torch, _name)] = _d
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integers of its width (its bit patterns)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])
_NP_TO_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint32): torch.uint32,
                np.dtype(np.uint64): torch.uint64, np.dtype(np.int32): torch.int32}


def bs_dtype(dtype: torch.dtype) -> _dt.DType:
    """The format dtype of a torch dtype, or a clear error."""
    try:
        return TORCH_TO_BS[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in TORCH_TO_BS)
        raise UnsupportedDTypeError(f"bitsparse_core.torch packs {names}; got {dtype}") from None


def check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedDeviceError(f"bitsparse_core.torch runs on CPU and CUDA tensors, "
                                     f"not {device.type}")


def backend_for(device: torch.device, name: str = "auto"):
    """The codec for tensors on ``device``: the NumPy reference on CPU, a GPU backend on CUDA."""
    check_device(device)
    if device.type == "cpu":
        return get_backend("numpy") if name == "auto" else select_backend(name, "cpu")
    return select_backend(name, "cuda")


@functools.lru_cache(maxsize=None)
def _dlpack_exports(dtype: torch.dtype) -> bool:
    """Whether this torch build exports ``dtype`` through DLPack with the right code."""
    want = TORCH_TO_BS[dtype]
    try:
        imp = import_capsule(torch.empty(1, dtype=dtype).__dlpack__())
    except Exception:
        return False
    return (imp.code, imp.bits) == (want.dl_code, want.bits)


def export(t: torch.Tensor):
    """``(object, dtype=)`` to hand a float tensor to a backend: the tensor itself,
    or a same-width integer view plus the dtype name where torch cannot export it."""
    d = bs_dtype(t.dtype)
    t = t.detach()  # DLPack refuses tensors that require grad; the codec only reads bits
    if _dlpack_exports(t.dtype):
        return t, None
    return t.view(_INT_OF_WIDTH[d.itemsize]), d.name


# --------------------------------------------------------------------------- #
# Allocation and streams                                                      #
# --------------------------------------------------------------------------- #
class CapturingAllocator:
    """``allocator=`` for GPU backends: uint8 tensors from torch's caching allocator.

    Called as ``allocator(nbytes, device, stream)`` (the backends' contract). The
    buffer is made on torch's current stream, which is the stream the backend was
    given, so the caching allocator orders its reuse after our kernels. It
    remembers what it handed out, so results the backend returns as its own
    arrays can be mapped back to the torch tensors owning their memory.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._handed = []

    def __call__(self, nbytes: int, device=None, stream=None) -> torch.Tensor:
        dev = self.device if device is None else torch.device("cuda", int(device))
        buf = torch.empty((int(nbytes),), dtype=torch.uint8, device=dev)
        self._handed.append(weakref.ref(buf))
        return buf

    def owners(self) -> list:
        """The buffers handed out and still alive; forgets them (call right after the
        backend call: a buffer the backend dropped is already freed)."""
        refs, self._handed = self._handed, []
        return [b for b in (r() for r in refs) if b is not None]


class Call:
    """Keyword arguments of one backend call on a device, plus what it allocated."""

    def __init__(self, device: torch.device, backend: str = "auto"):
        self.device = device
        self.backend = backend_for(device, backend)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.current_stream(device)
            self.allocator = CapturingAllocator(device)
            self.kwargs = {"stream": self.stream.cuda_stream, "allocator": self.allocator}
        else:
            self.stream = None
            self.allocator = None
            self.kwargs = {}

    def owners(self) -> list:
        return self.allocator.owners() if self.cuda else []


def _device_pointer(arr):
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if isinstance(arr, torch.Tensor):
        return int(arr.data_ptr())
    return None


def as_torch(arr, dtype: torch.dtype, shape, owners=()) -> torch.Tensor:
    """A backend result as a torch tensor of ``dtype`` and ``shape`` (no copy).

    On CUDA the result is a view of the caching-allocator buffer that holds it
    (found by address among ``owners``), so it behaves like any torch tensor.
    """
    if isinstance(arr, torch.Tensor):
        t = arr
    else:
        t = None
        ptr = _device_pointer(arr)
        if ptr is not None:
            nbytes = _nbytes(dtype, shape)
            for buf in owners:
                base = buf.data_ptr()
                if base <= ptr and ptr + nbytes <= base + buf.numel():
                    t = buf[ptr - base: ptr - base + nbytes]
                    break
        if t is None:
            if isinstance(arr, np.ndarray) and arr.dtype in _NP_TO_TORCH:
                t = torch.from_numpy(np.ascontiguousarray(arr))
            else:
                t = torch.from_dlpack(arr)
    if t.dtype != dtype:  # e.g. a backend without bf16 returns its bits as uint16
        t = t.reshape(-1).view(torch.uint8).view(dtype)
    return t.reshape(shape)


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


# --------------------------------------------------------------------------- #
# Packed tensors as (skeleton, plane tensors)                                 #
# --------------------------------------------------------------------------- #
_PLANE_DTYPES = {"mask": torch.uint8, "values": torch.uint8, "signs": torch.uint8}


def planes_as_torch(p: PackedTensor, owners=()) -> tuple:
    """``p``'s four planes as 1-D torch tensors on its device (views, no copies)."""
    out = []
    for name in PLANES:
        arr = getattr(p, name)
        if name == "offsets":
            dt = torch.uint64 if p.layout.offset_width == 8 else torch.uint32
        else:
            dt = _PLANE_DTYPES[name]
        length = getattr(p.layout, name)[1]
        n = length // (8 if dt is torch.uint64 else 4 if dt is torch.uint32 else 1)
        if n == 0:
            dev = "cpu" if p.device[0] == "cpu" else torch.device("cuda", p.device[1])
            out.append(torch.empty((0,), dtype=dt, device=dev))
        else:
            out.append(as_torch(arr, dt, (n,), owners))
    return tuple(out)


def skeleton(p: PackedTensor) -> PackedTensor:
    """``p`` without its planes: the metadata to rebuild it around saved plane tensors."""
    return dataclasses.replace(p, mask=None, offsets=None, values=None, signs=None,
                               extra=dict(p.extra))


def rebuild(skel: PackedTensor, planes) -> PackedTensor:
    """A PackedTensor on ``skel``'s backend whose planes view the torch tensors ``planes``."""
    native = [_native(skel.backend.name, t) for t in planes]
    return dataclasses.replace(skel, **dict(zip(PLANES, native)), extra=dict(skel.extra))


def _native(backend: str, t: torch.Tensor):
    """A backend array viewing the torch tensor ``t`` (no copy, no stream sync)."""
    if t.device.type == "cpu":
        return t.numpy()
    if backend == "cupy":
        import cupy
        np_dtype = {torch.uint8: np.uint8, torch.uint32: np.uint32, torch.uint64: np.uint64,
                    torch.int32: np.int32}[t.dtype]
        if t.numel() == 0:
            return cupy.empty((0,), dtype=np_dtype)
        with cupy.cuda.Device(t.device.index):
            mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                          device_id=t.device.index)
            return cupy.ndarray((t.numel(),), dtype=np_dtype,
                                memptr=cupy.cuda.MemoryPointer(mem, 0))
    if backend == "numba":
        from numba import cuda
        return cuda.as_cuda_array(t, sync=False)
    return t


def keep_alive_on_stream(tensors, call: Call, pack_stream) -> None:
    """Tell the caching allocator that ``tensors`` (made on ``pack_stream``) are also read
    on the current stream, so their memory is not handed out again too early."""
    if not call.cuda or pack_stream is None or pack_stream == call.stream:
        return
    for t in tensors:
        if t.numel():
            t.record_stream(call.stream)
