"""The few CUDA driver calls of the hot path, through ctypes on ``libcuda``.

A launch is one ctypes call with an argument record built once (see
:mod:`.abi`); copies and fills are ``cuMemcpyAsync`` / ``cuMemsetD8Async`` on raw
pointers. Each costs about a microsecond of host time, where a CuPy array wrapper
or a DLPack round trip costs tens. Every call names its stream: nothing here runs
on an implicit one. All calls act on the context current to the calling thread;
PyTorch, CuPy and Numba all use the device's primary context.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from ...errors import CudaDriverError

_P, _U, _SZ = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


@functools.lru_cache(maxsize=None)
def lib():
    cuda = ctypes.CDLL("libcuda.so.1")
    launch_types = [_P, _U, _U, _U, _U, _U, _U, _U, _P, _P]
    cuda.cuLaunchKernel.argtypes = launch_types + [_P]
    cuda.cuLaunchCooperativeKernel.argtypes = launch_types
    cuda.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, _SZ, _P]
    cuda.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, _SZ, _P]
    cuda.cuMemcpyDtoHAsync_v2.argtypes = [_P, ctypes.c_uint64, _SZ, _P]
    cuda.cuMemAllocHost_v2.argtypes = [ctypes.POINTER(_P), _SZ]
    cuda.cuStreamQuery.argtypes = [_P]
    return cuda


def check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        lib().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaDriverError(f"{what} failed: {name.value.decode() if name.value else rc}")


@functools.lru_cache(maxsize=None)
def _untyped() -> tuple:
    """The launches and the fill without declared argument types: ctypes' conversion of
    eleven declared arguments costs twice the call (0.8 µs against 0.4 on the
    development CPU). Their arguments are passed as ctypes objects where they are
    pointers or ``size_t`` (:func:`_pointer`) and as Python ints that fit a C ``int``
    otherwise (grid, block, shared bytes, the fill's byte value); a larger int raises
    ``ctypes.ArgumentError``."""
    cuda = ctypes.CDLL("libcuda.so.1")      # its own function objects: lib()'s keep theirs
    return cuda.cuLaunchKernel, cuda.cuLaunchCooperativeKernel, cuda.cuMemsetD8Async


_POINTERS: dict = {}


def _pointer(value: int) -> ctypes.c_void_p:
    """A ``void *`` argument of ``value`` (function handles and streams recur: each is
    made once)."""
    p = _POINTERS.get(value)
    if p is None:
        if len(_POINTERS) >= 4096:
            _POINTERS.clear()
        p = _POINTERS[value] = _P(value)
    return p


def launch(func: int, grid: int, block: int, smem: int, stream: int, args) -> None:
    """``func<<<grid, block, smem, stream>>>(*args)``; ``args`` an :mod:`.abi` record."""
    if grid > 0:
        rc = _untyped()[0](_pointer(func), grid, 1, 1, block, 1, 1, smem, _pointer(stream),
                           args.pointers, None)
        if rc:
            check(rc, "cuLaunchKernel")


def launch_packed(func: int, grid: int, block: int, smem: int, stream: int, args) -> None:
    """``func<<<grid, block, smem, stream>>>`` with its parameters in one buffer, laid out
    as the kernel's parameter list: ``args.extra`` the ``CU_LAUNCH_PARAM_BUFFER_POINTER`` /
    ``_SIZE`` / ``_END`` array (:func:`param_buffer`). The driver then copies one buffer,
    where an array of parameter pointers costs it a copy per parameter (a Numba kernel
    has a hundred and more)."""
    if grid > 0:
        rc = _untyped()[0](_pointer(func), grid, 1, 1, block, 1, 1, smem, _pointer(stream),
                           None, args.extra)
        if rc:
            check(rc, "cuLaunchKernel")


CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


def param_buffer(buffer, nbytes: int) -> tuple:
    """``(extra, size)`` for :func:`launch_packed`: the ``extra`` array that names the
    first ``nbytes`` of ``buffer`` (a ctypes object, kept alive by the caller; ``nbytes``
    exactly the kernel's parameter bytes: the driver refuses a larger size) and the
    ``size_t`` it points at, which the caller keeps alive with it."""
    size = _SZ(nbytes)
    extra = (_P * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
                     CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), CU_LAUNCH_PARAM_END)
    return extra, size


def launch_cooperative(func: int, grid: int, block: int, smem: int, stream: int, args) -> None:
    """A launch whose blocks are all resident at once (the pack kernel's closing grid
    barrier relies on it); needs no relocatable device code."""
    if grid > 0:
        rc = _untyped()[1](_pointer(func), grid, 1, 1, block, 1, 1, smem, _pointer(stream),
                           args.pointers)
        if rc:
            check(rc, "cuLaunchCooperativeKernel")


def memset0(ptr: int, nbytes: int, stream: int) -> None:
    if nbytes:
        rc = _untyped()[2](ctypes.c_uint64(ptr), 0, _SZ(nbytes), _pointer(stream))
        if rc:
            check(rc, "cuMemsetD8Async")


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device (or pinned) to device copy in stream order."""
    if nbytes:
        check(lib().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def copy_to_host(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device to host copy in stream order (asynchronous when ``dst`` is pinned)."""
    if nbytes:
        check(lib().cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


CUDA_ERROR_NOT_READY = 600


def stream_done(stream: int) -> bool:
    """Whether everything queued on ``stream`` has run (raises the error of a failed kernel)."""
    rc = lib().cuStreamQuery(_P(stream))
    if rc == CUDA_ERROR_NOT_READY:
        return False
    check(rc, "cuStreamQuery")
    return True


def alloc_host(nbytes: int) -> int:
    """Pinned host memory that kernels can write through the same address (unified
    addressing); never freed by this module's callers (small, per thread)."""
    p = _P()
    check(lib().cuMemAllocHost_v2(ctypes.byref(p), nbytes), "cuMemAllocHost")
    return p.value


def has_context() -> bool:
    """Whether the calling thread has a current CUDA context (False before ``cuInit``)."""
    ctx = _P()
    return lib().cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)


def current_device() -> int | None:
    """The device ordinal of the calling thread's current context, None without one
    (the call fails then; a ``CUdevice`` is its ordinal, as Numba, CuPy and PyTorch take
    it to be)."""
    try:
        dev, ref = _DEVICE_OUT.slot
    except AttributeError:              # the thread's first call: its own output int
        dev = ctypes.c_int()
        ref = ctypes.byref(dev)
        _DEVICE_OUT.slot = dev, ref
    return dev.value if lib().cuCtxGetDevice(ref) == 0 else None


_DEVICE_OUT = threading.local()


def sync_stream(stream: int) -> None:
    check(lib().cuStreamSynchronize(_P(stream)), "cuStreamSynchronize")


def stream_wait(consumer: int, producer: int) -> None:
    """Make ``consumer`` wait for the work queued so far on ``producer`` (an event)."""
    wait_event(consumer, record_event(producer))


def record_event(stream: int) -> int:
    """A new event recorded on ``stream``, for :func:`wait_event` (or :func:`release_event`)."""
    ev = _P()
    check(lib().cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")   # CU_EVENT_DISABLE_TIMING
    try:
        check(lib().cuEventRecord(ev, _P(stream)), "cuEventRecord")
    except CudaDriverError:
        lib().cuEventDestroy_v2(ev)
        raise
    return ev.value


def wait_event(consumer: int, event: int) -> None:
    """Make ``consumer`` wait for ``event``, then release the event (the driver keeps it
    until the wait is satisfied)."""
    try:
        check(lib().cuStreamWaitEvent(_P(consumer), _P(event), 0), "cuStreamWaitEvent")
    finally:
        release_event(event)


def release_event(event: int) -> None:
    lib().cuEventDestroy_v2(_P(event))


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    n = ctypes.c_int()
    check(lib().cuDeviceGetAttribute(ctypes.byref(n), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                     device), "cuDeviceGetAttribute")
    return n.value


@functools.lru_cache(maxsize=None)
def resident_blocks(func: int, block: int, smem: int, device: int) -> int:
    """How many blocks of ``func`` fit on ``device`` at once, after allowing it ``smem``
    bytes of dynamic shared memory (the grid of a persistent kernel)."""
    check(lib().cuFuncSetAttribute(_P(func), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   ctypes.c_int(smem)), "cuFuncSetAttribute")
    n = ctypes.c_int()
    check(lib().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), _P(func), block,
                                                            _SZ(smem)),
          "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    if n.value < 1:
        raise CudaDriverError(f"a block of {block} threads with {smem} bytes of shared memory "
                              f"does not fit on device {device}")
    return n.value * sm_count(device)
