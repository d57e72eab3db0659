"""XLA's FFI C ABI (``xla/ffi/api/c_api.h``) in ctypes: Python functions as typed FFI handlers.

Why ctypes and not a compiled extension: the wheel stays pure Python and needs no
compiler where it is installed; the GPU work a handler queues is our own kernels
through :mod:`bitsparse_core.backends.cuda.host`, which already launches them with
ctypes. The price is a Python call per custom call (the interpreter's GIL is taken
for it): tens of microseconds, next to a kernel over a whole activation.

What a handler gets (:class:`CallFrame`): its operands and results as :class:`Buffer`
(dtype code, data pointer, dims), the attributes of its ``jax.ffi.ffi_call`` by name,
and, on a GPU, the stream XLA runs it on. Only the execute stage is implemented.

Versions: XLA asks every handler for the FFI API version it was built against and
refuses any other (``ffi_api.cc``); a ctypes handler is built against the jaxlib that
runs it, so it reports the version in the ``c_api.h`` that jaxlib ships.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
import traceback
from typing import Callable, NamedTuple

_P, _SZ, _I64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", _SZ), ("type", ctypes.c_int),
                           ("next", ctypes.POINTER(_ExtensionBase))]
EXTENSION_METADATA = 1
STAGE_EXECUTE = 3
ERROR_INVALID_ARGUMENT = 3
ERROR_INTERNAL = 13
ARG_BUFFER = RET_BUFFER = 1
ATTR_ARRAY, ATTR_DICTIONARY, ATTR_SCALAR, ATTR_STRING = 1, 2, 3, 4


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32), ("state_type_id", _I64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


# Pointers are read as plain addresses (c_void_p fields) and arrays through
# ``from_address``: a handler runs at every execution, and ctypes.cast / POINTER
# objects cost several times as much per field.
class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("dtype", ctypes.c_int),
                ("data", _P), ("rank", _I64), ("dims", _P)]


class _List(ctypes.Structure):
    """``XLA_FFI_Args`` and ``XLA_FFI_Rets``: a count, a type per entry, a pointer per entry."""
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("size", _I64),
                ("types", _P), ("items", _P)]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", _P), ("len", _SZ)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("size", _I64),
                ("types", _P), ("names", _P), ("attrs", _P)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", _P)]


class _Array(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("size", _SZ), ("data", _P)]


class _CallFrameStruct(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P),
                ("api", _P), ("ctx", _P), ("stage", ctypes.c_int), ("args", _List),
                ("rets", _List), ("attrs", _Attrs), ("future", _P)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("message", ctypes.c_char_p),
                ("errc", ctypes.c_int)]


class _StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("ctx", _P), ("stream", _P)]


class _DeviceOrdinalArgs(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("ctx", _P),
                ("device_ordinal", ctypes.c_int32)]


_ENTRY = ctypes.CFUNCTYPE(_P, _P)   # every XLA_FFI_Api entry: XLA_FFI_Error* f(Args*)


class _Api(ctypes.Structure):
    """``XLA_FFI_Api`` up to the entries used here (later versions only append)."""
    _fields_ = [("struct_size", _SZ), ("extension_start", _P), ("api_version", _ApiVersion),
                ("internal_api", _P), ("error_create", _ENTRY), ("error_get_message", _P),
                ("error_destroy", _P), ("handler_register", _P), ("stream_get", _ENTRY),
                ("type_register", _P), ("execution_context_get", _P), ("state_set", _P),
                ("state_get", _P), ("device_memory_allocate", _P), ("device_memory_free", _P),
                ("thread_pool_schedule", _P), ("thread_pool_num_threads", _P),
                ("future_create", _P), ("future_set_available", _P), ("future_set_error", _P),
                ("run_id_get", _P), ("device_ordinal_get", _ENTRY)]


# XLA_FFI_DataType codes (c_api.h) of the dtypes the project's planes use.
DTYPE_CODES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6,
               "uint16": 7, "uint32": 8, "uint64": 9, "float16": 10, "float32": 11,
               "float64": 12, "bfloat16": 16, "float8_e5m2": 19, "float8_e4m3fn": 20}
ITEMSIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 2, 8: 4, 9: 8, 10: 2, 11: 4, 12: 8, 16: 2,
             19: 1, 20: 1}
_SCALAR_CTYPES = {1: ctypes.c_bool, 2: ctypes.c_int8, 3: ctypes.c_int16, 4: ctypes.c_int32,
                  5: ctypes.c_int64, 6: ctypes.c_uint8, 7: ctypes.c_uint16, 8: ctypes.c_uint32,
                  9: ctypes.c_uint64, 11: ctypes.c_float, 12: ctypes.c_double}


class Buffer(NamedTuple):
    """One operand or result: XLA_FFI_DataType code, device (or host) address, dims."""
    dtype: int
    data: int
    shape: tuple

    @property
    def row_bytes(self) -> int:
        """Bytes of the last dimension: one block's plane in a batch of planes."""
        return self.shape[-1] * ITEMSIZES[self.dtype] if self.shape else ITEMSIZES[self.dtype]


class CallFrame:
    """What one execution of a custom call hands its handler."""

    def __init__(self, frame: _CallFrameStruct):
        self._frame = frame
        self.args = _buffers(frame.args, ARG_BUFFER, "operand")
        self.rets = _buffers(frame.rets, RET_BUFFER, "result")
        attrs, n = frame.attrs, frame.attrs.size
        if n:
            kinds = (ctypes.c_int * n).from_address(attrs.types)
            names = (_P * n).from_address(attrs.names)
            values = (_P * n).from_address(attrs.attrs)
            self.attrs = {_span(names[i]): _attr(kinds[i], values[i]) for i in range(n)}
        else:
            self.attrs = {}

    def _api(self, entry: str) -> _Api:
        """XLA's API table, checked to reach ``entry`` (an older jaxlib's is shorter)."""
        api = _Api.from_address(self._frame.api)
        if api.struct_size < getattr(_Api, entry).offset + ctypes.sizeof(_P):
            raise HandlerError(f"this jaxlib's XLA FFI API ({api.api_version.major_version}."
                               f"{api.api_version.minor_version}) has no {entry}")
        return api

    @property
    def stream(self) -> int:
        """The platform stream XLA runs this call on (a ``CUstream`` on CUDA)."""
        args = _StreamGetArgs(ctypes.sizeof(_StreamGetArgs), None, self._frame.ctx, None)
        _raise_if(self._api("stream_get").stream_get(ctypes.addressof(args)),
                  "XLA_FFI_Stream_Get")
        return args.stream or 0

    @property
    def device_ordinal(self) -> int:
        args = _DeviceOrdinalArgs(ctypes.sizeof(_DeviceOrdinalArgs), None, self._frame.ctx, -1)
        _raise_if(self._api("device_ordinal_get").device_ordinal_get(ctypes.addressof(args)),
                  "XLA_FFI_DeviceOrdinal_Get")
        return int(args.device_ordinal)


class HandlerError(Exception):
    """Raised inside a handler to fail the custom call with this message (an
    XLA_FFI_Error, which the caller sees as JAX's runtime error); ``invalid=True``
    reports INVALID_ARGUMENT instead of INTERNAL."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


def _buffers(lst: _List, kind: int, what: str) -> list:
    n = lst.size
    if not n:
        return []
    kinds = (ctypes.c_int * n).from_address(lst.types)
    items = (_P * n).from_address(lst.items)
    out = []
    for i in range(n):
        if kinds[i] != kind:
            raise HandlerError(f"a non-buffer {what} reached a bitsparse handler", invalid=True)
        b = _Buffer.from_address(items[i])
        dims = tuple((_I64 * b.rank).from_address(b.dims)) if b.rank else ()
        out.append(Buffer(b.dtype, b.data or 0, dims))
    return out


def _span(ptr: int) -> str:
    span = _ByteSpan.from_address(ptr)
    return ctypes.string_at(span.ptr, span.len).decode() if span.len else ""


def _attr(kind: int, ptr: int):
    if kind == ATTR_SCALAR:
        s = _Scalar.from_address(ptr)
        return _SCALAR_CTYPES[s.dtype].from_address(s.value).value
    if kind == ATTR_STRING:
        return _span(ptr)
    if kind == ATTR_ARRAY:
        a = _Array.from_address(ptr)
        return tuple((_SCALAR_CTYPES[a.dtype] * a.size).from_address(a.data)) if a.size else ()
    raise HandlerError(f"attribute kind {kind} (a dictionary?) is not used by bitsparse "
                       "handlers", invalid=True)


def _error(api_ptr: int, message: str, code: int) -> int:
    api = _Api.from_address(api_ptr)
    msg = ctypes.create_string_buffer(message.encode(errors="replace"))
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None,
                            ctypes.cast(msg, ctypes.c_char_p), code)
    return api.error_create(ctypes.addressof(args)) or 0


def _raise_if(error: int, what: str) -> None:
    if error:   # (the XLA_FFI_Error itself is left alone: failing the call is what matters)
        raise HandlerError(f"{what} failed inside XLA")


@functools.lru_cache(maxsize=None)
def api_version() -> tuple:
    """``(major, minor)`` of the FFI API of the installed jaxlib, read from the
    ``c_api.h`` it ships (XLA refuses a handler that reports any other)."""
    import jax.ffi
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ImportError(f"cannot read the XLA FFI header {path} that jaxlib ships ({exc}); "
                          "the FFI path needs it to report its API version") from exc
    found = {k: re.search(rf"#define XLA_FFI_API_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")}
    if not all(found.values()):
        raise ImportError(f"{path} defines no XLA_FFI_API_MAJOR / MINOR")
    return int(found["MAJOR"].group(1)), int(found["MINOR"].group(1))


_HANDLERS: dict = {}        # (name, platform) -> ctypes callback (kept alive for XLA)
_LOCK = threading.Lock()


def make_handler(fn: Callable[[CallFrame], None]):
    """The ctypes ``XLA_FFI_Handler`` that answers XLA's metadata query and runs
    ``fn(frame)`` at execution. An exception from ``fn`` becomes an XLA_FFI_Error
    with its message and traceback: an exception must never cross into XLA."""
    major, minor = api_version()

    def handler(frame_ptr: int) -> int:
        frame = _CallFrameStruct.from_address(frame_ptr)
        ext = frame.extension_start
        if ext and _ExtensionBase.from_address(ext).type == EXTENSION_METADATA:
            meta = _MetadataExtension.from_address(ext).metadata.contents
            meta.api_version.major_version = major
            meta.api_version.minor_version = minor
            meta.traits = 0      # not command-buffer safe: a Python call runs at each execution
            return 0
        if frame.stage != STAGE_EXECUTE:
            return 0
        try:
            fn(CallFrame(frame))
            return 0
        except HandlerError as exc:
            code = ERROR_INVALID_ARGUMENT if exc.invalid else ERROR_INTERNAL
            return _error(frame.api, str(exc), code)
        except BaseException as exc:    # noqa: BLE001 -- nothing may unwind into XLA
            return _error(frame.api, f"{type(exc).__name__}: {exc}\n"
                          + "".join(traceback.format_exception(exc)), ERROR_INTERNAL)

    return _ENTRY(handler)


def register(name: str, fn: Callable[[CallFrame], None], platform: str) -> None:
    """Register ``fn`` as the FFI target ``name`` on ``platform`` ("cpu" or "cuda"),
    once per process (XLA refuses a second handler under one name)."""
    import jax.ffi
    key = (name, platform.lower())
    with _LOCK:
        if key in _HANDLERS:
            return
        cb = make_handler(fn)
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(ctypes.cast(cb, _P).value),
                                    platform=platform)
        _HANDLERS[key] = cb


def registered(name: str, platform: str) -> bool:
    return (name, platform.lower()) in _HANDLERS
