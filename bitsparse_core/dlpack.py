"""A small DLPack consumer and producer (ctypes), for what NumPy cannot do itself.

NumPy's own ``from_dlpack`` / ``__dlpack__`` refuse bfloat16 and float8 (DLPack
codes 4, 10, 12). We read and write the legacy ``DLManagedTensor`` capsule
(dlpack.h) directly so that any producer -- torch, jax, cupy, numpy -- can hand
us any of the five dtypes, and our CPU results export to any consumer.
Device data is never touched here: :func:`import_capsule` just describes it.
"""

from __future__ import annotations

import ctypes
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


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

_CAPSULE = b"dltensor"
_USED = b"used_dltensor"
_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))


# --------------------------------------------------------------------------- #
# Consumer                                                                    #
# --------------------------------------------------------------------------- #
class _ManagedOwner:
    """Keeps an imported DLManagedTensor alive; calls its deleter when collected."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __del__(self):
        ptr, self._ptr = self._ptr, None
        if ptr:
            managed = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor))
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

    @property
    def device(self) -> str:
        return DEVICE_NAMES.get(self.device_type, f"dlpack-device-{self.device_type}")

    @property
    def is_c_contiguous(self) -> bool:
        if self.strides is None:
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
    """Take ownership of a legacy ``dltensor`` capsule (renaming it as the protocol says)."""
    if not _api.PyCapsule_IsValid(capsule, _CAPSULE):
        raise TypeError("expected an unused DLPack 'dltensor' capsule")
    ptr = _api.PyCapsule_GetPointer(capsule, _CAPSULE)
    _api.PyCapsule_SetName(capsule, _USED)
    owner = _ManagedOwner(ptr)
    t = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor)).contents.dl_tensor
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    return Imported((t.data or 0) + int(t.byte_offset), shape, strides, int(t.dtype.code),
                    int(t.dtype.bits), int(t.dtype.lanes), int(t.device.device_type),
                    int(t.device.device_id), owner)


def device_of(x) -> tuple:
    """``(device_name, index)`` of an array-like, without touching its data."""
    if isinstance(x, np.ndarray):
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
    """A zero-copy NumPy view of a CPU ``Imported`` tensor (C-contiguous only)."""
    if not imp.is_c_contiguous:
        raise NonContiguousError(f"tensor with shape {imp.shape} and strides {imp.strides} "
                                 "is not C-contiguous; call .contiguous() first")
    nbytes = imp.numel * dtype.itemsize
    if nbytes == 0:
        return np.empty(imp.shape, dtype=dtype.numpy)
    holder = _ArrayInterfaceHolder(imp.data, nbytes, imp.owner)
    return np.asarray(holder).view(dtype.numpy).reshape(imp.shape)


class _ArrayInterfaceHolder:
    """Exposes raw memory as a uint8 array while keeping its DLPack owner alive."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                    "version": 3}


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
        imp = import_capsule(x.__dlpack__())
        dt = resolve_dtype(imp.code, imp.bits, imp.lanes, dtype)
        return numpy_from_imported(imp, dt), dt
    raise TypeError(f"{type(x).__name__} is not a NumPy array or a DLPack producer")


# --------------------------------------------------------------------------- #
# Producer                                                                    #
# --------------------------------------------------------------------------- #
_LIVE: dict = {}  # id(managed struct) -> everything that must outlive the capsule


@_DELETER
def _delete_managed(managed_ptr):
    _LIVE.pop(ctypes.addressof(managed_ptr.contents), None)


@_CAPSULE_DESTRUCTOR
def _destroy_capsule(capsule_ptr):
    # An unconsumed capsule still owns its tensor; a consumed one was renamed.
    if _raw_is_valid(capsule_ptr, _CAPSULE):
        ptr = _raw_get_pointer(capsule_ptr, _CAPSULE)
        _delete_managed(ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor)))


def make_capsule(data: int, shape, dtype: _dt.DType, device_type: int, device_id: int,
                 owner) -> object:
    """A legacy DLPack capsule for C-contiguous memory at ``data`` kept alive by ``owner``."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    managed = DLManagedTensor()
    t = managed.dl_tensor
    t.data = data or None
    t.device = DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = DLDataType(dtype.dl_code, dtype.bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = None
    t.byte_offset = 0
    managed.deleter = _delete_managed
    _LIVE[ctypes.addressof(managed)] = (managed, shape_arr, owner)
    return _api.PyCapsule_New(ctypes.addressof(managed), _CAPSULE, _destroy_capsule)


class DLPackArray(np.ndarray):
    """A NumPy array that also exports bfloat16 / float8 through DLPack.

    Plain NumPy refuses to export those dtypes; this subclass describes them
    with their DLPack codes (4, 10, 12) and defers to NumPy for all others.
    """

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        try:
            dt = _dt.resolve(self.dtype)
        except UnsupportedDTypeError:
            dt = None
        if dt is None or dt.dl_code == _dt.DL_FLOAT:
            kwargs = {"stream": stream}
            if max_version is not None:
                kwargs["max_version"] = max_version
            return np.asarray(self).__dlpack__(**kwargs)
        if not self.flags.c_contiguous:
            raise BufferError("DLPack export needs a C-contiguous array")
        return make_capsule(self.ctypes.data, self.shape, dt, KDL_CPU, 0, self)

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


def exportable(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a :class:`DLPackArray` view (no copy)."""
    return arr.view(DLPackArray)
