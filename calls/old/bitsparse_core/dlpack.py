"""A small DLPack consumer and producer (ctypes), for what NumPy cannot do itself.

NumPy's own ``from_dlpack`` / ``__dlpack__`` refuse bfloat16 and float8 (DLPack
codes 4, 10, 12). We read legacy ``DLManagedTensor`` and DLPack 1.x
``DLManagedTensorVersioned`` capsules (dlpack.h) directly so that any producer --
torch, jax, cupy, numpy -- can hand us any of the five dtypes, and our results
export to any consumer. Device data is never touched here: :func:`import_capsule`
just describes it.

Producer
========
Our arrays follow the DLPack >= 1.0 / array API ``__dlpack__`` protocol
(:func:`export_host` for CPU arrays; ``CudaArray.__dlpack__`` for device ones):

* ``max_version`` None or major 0: a legacy ``"dltensor"`` capsule; major >= 1: a
  ``"dltensor_versioned"`` capsule declaring :data:`DLPACK_VERSION`, with the
  read-only and is-copied flags (NumPy < 2.1 cannot build those: legacy then, which
  the protocol allows -- consumers check the name).
* ``copy=True`` always copies (on the array's device) and sets the is-copied flag;
  ``copy=False`` never copies; ``None`` copies only where the request needs it.
* ``dl_device`` other than the array's own raises ``BufferError``, except what the
  protocol asks a producer to offer: a copy to ``kDLCPU`` (refused with
  :class:`CopyRefusedError` when ``copy=False``).
* Anything else that cannot be done raises ``BufferError``; malformed arguments
  raise ``TypeError``.

The capsule itself is always made by NumPy's exporter over a same-width unsigned
integer view of the memory (never read, so it may be device memory), then the
struct is given its true dtype code, device, version and flags. That way every
capsule has NumPy's C destructor and deleter: a Python (ctypes) capsule destructor
cannot run while a consumer's exception is in flight -- NumPy's ``from_dlpack``
refusing a bf16 capsule used to turn into a ``SystemError`` and leak the capsule.
An unconsumed capsule frees its tensor when collected; a consumed one when the
consumer calls the deleter, exactly once either way.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import dtypes as _dt
from .errors import NonContiguousError, UnsupportedDTypeError

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13
DEVICE_NAMES = {KDL_CPU: "cpu", KDL_CUDA: "cuda", KDL_CUDA_HOST: "cpu", KDL_CUDA_MANAGED: "cuda"}

DL_INT, DL_UINT = 0, 1

DLPACK_VERSION = (1, 1)    # what our versioned capsules declare (fp8 codes are DLPack 1.1)
FLAG_READ_ONLY = 1 << 0    # DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_IS_COPIED = 1 << 1    # DLPACK_FLAG_BITMASK_IS_COPIED


class CopyRefusedError(BufferError, ValueError):
    """The export needs a copy (e.g. device to host) and the consumer passed ``copy=False``.

    The array API names ``BufferError`` for a refused copy in ``copy`` and
    ``ValueError`` for one to ``kDLCPU`` in ``dl_device``; this is both."""


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

_CAPSULE = b"dltensor"
_USED = b"used_dltensor"
_VERSIONED = b"dltensor_versioned"
_USED_VERSIONED = b"used_dltensor_versioned"
_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


# --------------------------------------------------------------------------- #
# Consumer                                                                    #
# --------------------------------------------------------------------------- #
class _ManagedOwner:
    """Keeps an imported managed tensor alive; calls its deleter (once) when collected."""

    def __init__(self, ptr: int, struct=DLManagedTensor):
        self._ptr, self._struct = ptr, struct

    def __del__(self):
        ptr, self._ptr = self._ptr, None
        if ptr:
            managed = ctypes.cast(ptr, ctypes.POINTER(self._struct))
            deleter = managed.contents.deleter
            if deleter:
                deleter(managed)


@dataclass
class Imported:
    """What a DLPack capsule describes. ``owner`` must outlive any use of ``data``."""
    data: int                 # address of element 0 (byte_offset applied)
    shape: tuple
    strides: Optional[tuple]  # in elements; None means C-contiguous
    code: int
    bits: int
    lanes: int
    device_type: int
    device_id: int
    owner: Any
    read_only: bool = False   # the producer's read-only flag (versioned capsules only)

    @property
    def device(self) -> str:
        return DEVICE_NAMES.get(self.device_type, f"dlpack-device-{self.device_type}")

    @property
    def is_c_contiguous(self) -> bool:
        """C-contiguous, as NumPy and torch judge it: strides of size-1 dimensions do not
        matter, and neither do any strides of an empty tensor (torch gives ``(3, 0)``
        the strides ``(1, 1)``, and ``.contiguous()`` keeps them)."""
        if self.strides is None or self.numel == 0:
            return True
        expect = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides)):
            if dim != 1 and stride != expect:
                return False
            expect *= dim
        return True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def import_capsule(capsule) -> Imported:
    """Take ownership of an unused ``dltensor`` or ``dltensor_versioned`` capsule
    (renaming it ``used_...`` as the protocol says)."""
    if _api.PyCapsule_IsValid(capsule, _VERSIONED):
        ptr = _api.PyCapsule_GetPointer(capsule, _VERSIONED)
        managed = DLManagedTensorVersioned.from_address(ptr)
        if managed.version.major > DLPACK_VERSION[0]:
            # Not ours to free: the capsule stays unused, so its destructor frees it.
            raise BufferError(f"DLPack {managed.version.major}.{managed.version.minor} capsule; "
                              f"this reader understands major version {DLPACK_VERSION[0]}")
        _api.PyCapsule_SetName(capsule, _USED_VERSIONED)
        owner = _ManagedOwner(ptr, DLManagedTensorVersioned)
        read_only = bool(managed.flags & FLAG_READ_ONLY)
    elif _api.PyCapsule_IsValid(capsule, _CAPSULE):
        ptr = _api.PyCapsule_GetPointer(capsule, _CAPSULE)
        managed = DLManagedTensor.from_address(ptr)
        _api.PyCapsule_SetName(capsule, _USED)
        owner = _ManagedOwner(ptr)
        read_only = False
    else:
        raise TypeError("expected an unused DLPack 'dltensor' or 'dltensor_versioned' capsule")
    t = managed.dl_tensor
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    return Imported((t.data or 0) + int(t.byte_offset), shape, strides, int(t.dtype.code),
                    int(t.dtype.bits), int(t.dtype.lanes), int(t.device.device_type),
                    int(t.device.device_id), owner, read_only)


def request_capsule(x, **kwargs):
    """``x.__dlpack__(...)`` as the array API's consumer asks: a versioned capsule if
    the producer can make one, else (``TypeError``: it predates ``max_version``) legacy."""
    try:
        return x.__dlpack__(max_version=DLPACK_VERSION, **kwargs)
    except TypeError:
        return x.__dlpack__(**kwargs)


def _readable(x):
    """``x``, or a detached alias of a torch tensor that requires grad: torch refuses to
    export those (BufferError), and packing only reads the bits."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.requires_grad:
        return x.detach()
    return x


def device_of(x) -> tuple:
    """``(device_name, index)`` of an array-like, without touching its data."""
    if isinstance(x, np.ndarray):
        return ("cpu", 0)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        # torch's __dlpack_device__ is Python, and each .device access makes an object
        if x.is_cuda:
            return ("cuda", x.get_device())
        if x.is_cpu:
            return ("cpu", 0)
    if hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        return (DEVICE_NAMES.get(int(dev_type), f"dlpack-device-{int(dev_type)}"), int(dev_id))
    if hasattr(x, "__cuda_array_interface__"):
        return ("cuda", -1)
    if hasattr(x, "__array_interface__") or isinstance(x, (list, tuple)):
        return ("cpu", 0)
    raise TypeError(f"{type(x).__name__} is neither a DLPack producer nor an array")


def resolve_dtype(code: int, bits: int, lanes: int, override=None) -> _dt.DType:
    """The element type, honouring ``override`` for integer inputs of the same width
    (frameworks without a DLPack code for a float8/bf16 pass its bits as uint8/uint16)."""
    if lanes != 1:
        raise UnsupportedDTypeError(f"vector dtypes (lanes={lanes}) are not supported")
    if override is not None:
        want = _dt.resolve(override)
        if code in (DL_INT, DL_UINT) and bits == want.bits:
            return want
        have = _dt.from_dlpack_pair(code, bits)
        if have != want:
            raise UnsupportedDTypeError(f"dtype={want.name} given for a {have.name} tensor")
        return want
    return _dt.from_dlpack_pair(code, bits)


def numpy_from_imported(imp: Imported, dtype: _dt.DType) -> np.ndarray:
    """A zero-copy NumPy view of a CPU ``Imported`` tensor (C-contiguous only); read-only
    where the producer flagged its memory read-only."""
    if not imp.is_c_contiguous:
        raise NonContiguousError(f"tensor with shape {imp.shape} and strides {imp.strides} "
                                 "is not C-contiguous; call .contiguous() first")
    if imp.numel == 0:
        return np.empty(imp.shape, dtype=dtype.numpy)
    holder = _ArrayInterfaceHolder(imp.data, imp.shape, dtype.uint.str, imp.owner,
                                   imp.read_only)
    return np.asarray(holder).view(dtype.numpy)


class _ArrayInterfaceHolder:
    """Exposes raw memory as a C-contiguous array while keeping its owner alive."""

    def __init__(self, ptr: int, shape, typestr: str, owner, read_only: bool = False):
        self.owner = owner
        self.__array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                    "data": (ptr, bool(read_only)), "version": 3}


def to_numpy(x, dtype=None) -> tuple:
    """``(array, DType)`` for a CPU input: NumPy arrays as they are, anything else
    through its ``__dlpack__``. Never copies; refuses non-contiguous data."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise NonContiguousError(f"array with shape {x.shape} and strides {x.strides} is not "
                                     "C-contiguous; pass np.ascontiguousarray(x)")
        if dtype is not None and x.dtype.kind in "ui":
            want = _dt.resolve(dtype)
            if x.dtype.itemsize != want.itemsize:
                raise UnsupportedDTypeError(f"dtype={want.name} given for a {x.dtype} array")
            return x.view(want.numpy), want
        found = _dt.resolve(x.dtype)
        if dtype is not None and _dt.resolve(dtype) != found:
            raise UnsupportedDTypeError(f"dtype={_dt.resolve(dtype).name} given for a {found.name} array")
        return x, found
    if hasattr(x, "__dlpack__"):
        imp = import_capsule(request_capsule(_readable(x)))
        dt = resolve_dtype(imp.code, imp.bits, imp.lanes, dtype)
        return numpy_from_imported(imp, dt), dt
    raise TypeError(f"{type(x).__name__} is not a NumPy array or a DLPack producer")


# --------------------------------------------------------------------------- #
# Producer                                                                    #
# --------------------------------------------------------------------------- #
def export_request(max_version, dl_device, copy) -> tuple:
    """The consumer's ``__dlpack__`` keywords, checked: ``(versioned, dl_device, copy)``
    with ``dl_device`` as a ``(type, id)`` tuple of ints or None."""
    versioned = False
    if max_version is not None:
        try:
            major, _minor = (operator.index(v) for v in max_version)
        except (TypeError, ValueError):
            raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, "
                            f"not {max_version!r}") from None
        versioned = major >= 1
    if dl_device is not None:
        try:
            dl_device = tuple(operator.index(v) for v in dl_device)
        except TypeError:
            dl_device = ()
        if len(dl_device) != 2:
            raise TypeError(f"dl_device must be None or a (device_type, device_id) tuple, "
                            f"not {dl_device!r}")
    if copy is not None and not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be True, False or None, not {copy!r}")
    return versioned, dl_device, None if copy is None else bool(copy)


def export_host(arr: np.ndarray, dtype: _dt.DType, *, stream=None, max_version=None,
                dl_device=None, copy=None, copied: bool = False):
    """``__dlpack__`` of a CPU array holding ``dtype``'s bit patterns (any strides).

    ``copied``: ``arr`` is already a copy made for this export (the is-copied flag)."""
    versioned, target, copy = export_request(max_version, dl_device, copy)
    if target is not None and target != (KDL_CPU, 0):
        raise BufferError(f"cannot export a CPU array to DLPack device {target}; "
                          f"it lives on {(KDL_CPU, 0)}")
    if stream is not None:
        raise BufferError(f"stream={stream!r} given for CPU data; DLPack takes stream=None "
                          "on devices without streams")
    carrier = np.asarray(arr).view(dtype.uint)
    if copy:
        carrier, copied = carrier.copy(order="C"), True
    return _capsule(carrier, dtype, (KDL_CPU, 0), versioned, copied)


def make_capsule(data: int, shape, dtype: _dt.DType, device_type: int, device_id: int,
                 owner, *, versioned: bool = False, copied: bool = False) -> object:
    """A DLPack capsule for C-contiguous memory at ``data`` (any device: it is never
    read here) kept alive by ``owner`` until the consumer's deleter runs."""
    holder = _ArrayInterfaceHolder(data, shape, dtype.uint.str, owner)
    return _capsule(np.asarray(holder), dtype, (device_type, device_id), versioned, copied,
                    data=data)


def _capsule(carrier: np.ndarray, dtype: _dt.DType, device: tuple, versioned: bool,
             copied: bool, data: Optional[int] = None):
    """NumPy's capsule for the unsigned ``carrier``, rewritten to describe ``dtype`` on
    ``device`` (NumPy's exporter never reads the data, and its C destructor is safe to
    run with a consumer's exception in flight)."""
    cap = None
    if versioned:
        try:
            cap = carrier.__dlpack__(max_version=(1, 0))
        except TypeError:  # NumPy < 2.1 makes legacy capsules only
            pass
    if cap is None:
        cap = carrier.__dlpack__()
    if _api.PyCapsule_IsValid(cap, _VERSIONED):
        managed = DLManagedTensorVersioned.from_address(_api.PyCapsule_GetPointer(cap, _VERSIONED))
        managed.version.major, managed.version.minor = DLPACK_VERSION
        if copied:
            managed.flags |= FLAG_IS_COPIED
    else:
        managed = DLManagedTensor.from_address(_api.PyCapsule_GetPointer(cap, _CAPSULE))
    t = managed.dl_tensor
    t.dtype.code = dtype.dl_code
    t.device.device_type, t.device.device_id = device
    if data is not None:
        t.data = data or None  # an empty carrier points at NumPy's placeholder
    return cap


class DLPackArray(np.ndarray):
    """A NumPy array that also exports bfloat16 / float8 through DLPack.

    Plain NumPy refuses to export those dtypes; this subclass describes them with
    their DLPack codes (4, 10, 12), following the protocol of :func:`export_host`
    for the five dtypes of the format, and defers to NumPy for any other.
    """

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        try:
            dt = _dt.resolve(self.dtype)
        except UnsupportedDTypeError:
            given = {"stream": stream, "max_version": max_version, "dl_device": dl_device,
                     "copy": copy}
            return np.asarray(self).__dlpack__(**{k: v for k, v in given.items()
                                                  if v is not None})
        return export_host(self, dt, stream=stream, max_version=max_version,
                           dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


def exportable(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a :class:`DLPackArray` view (no copy)."""
    return arr.view(DLPackArray)
