"""Numba kernels launched by their CUDA function handle, with an argument record.

Numba's dispatcher types every argument and marshals every array on each launch,
and a Numba device array costs a MemoryPointer and a DeviceNDArray to make: a pack's
two launches and fifteen views cost a few hundred microseconds of host time
(``bench/results/host_overhead.md``). Here a kernel argument is a :class:`KernelArray`
(address, element count, dtype: a few attribute writes) and the first launch of a
kernel with a given set of argument types goes through the dispatcher, which
compiles it; :class:`HandleLaunch` then takes the function handle of the kernel that
launch ran and lays out Numba's parameter list once: an array is seven parameters
(meminfo, parent, element count, item size, data, shape, stride), an integer or a
boolean one of its width. The fields lie in one buffer at the offsets the driver gives
for the kernel's parameters, so a launch hands the driver that buffer
(``CU_LAUNCH_PARAM_BUFFER_POINTER``) rather than a pointer per parameter, each of which
the driver would copy on its own. Later launches write the few fields that change and
call ``cuLaunchKernel`` (:mod:`..cuda.driver`).

Where a caller's launches differ between calls only in where a few buffers are (one
pack plan's), a :class:`BoundLaunch` holds a record of its own with every other field
written once, and a launch writes only the arrays' data pointers; :class:`PerThread`
keeps such objects, one set per thread.

The layout is Numba's private ABI, so it is checked against the compiled kernel before
it is used: the parameters' number and sizes against the driver's ``cuFuncGetParamInfo``
(which gives their offsets too), and the values against what Numba's own marshalling
(``_Kernel._prepare_args``) makes of the first launch's arguments. A kernel that fails a
check, or that this module does not cover (launch-config-sensitive, debug, an argument
type other than a 1-D C-contiguous array, an integer or a boolean), keeps launching
through the dispatcher.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import NamedTuple

import numpy as np

from ..cuda import driver

log = logging.getLogger("bitsparse_core.numba")

_INT64, _PTR = ctypes.c_int64, ctypes.c_void_p
CUDA_ERROR_INVALID_VALUE = 1


class KernelArray:
    """A 1-D C-contiguous kernel argument: ``count`` elements of ``dtype`` at ``ptr``
    (0 when empty), kept alive by ``owner``."""

    __slots__ = ("ptr", "count", "dtype", "owner")

    def __init__(self, ptr: int, count: int, dtype: np.dtype, owner):
        self.ptr, self.count, self.dtype, self.owner = ptr, count, dtype, owner

    @property
    def size(self) -> int:
        return self.count


class Launch(NamedTuple):
    """One kernel launch as a caller queues it: a Numba dispatcher, grid, block, arguments."""
    kernel: object
    grid: int
    block: int
    args: tuple


def kinds_of(args) -> tuple:
    """What of each argument selects a compiled kernel (a launch cache's key): an
    array's dtype, any other argument's type."""
    return tuple([a.dtype if type(a) is KernelArray else type(a) for a in args])


def _param_layout(func: int) -> list | None:
    """``(offset, size)`` in bytes of each of a kernel's parameters, from the driver; None
    where it cannot say."""
    get = getattr(driver.lib(), "cuFuncGetParamInfo", None)
    if get is None:
        return None
    layout, off, size = [], ctypes.c_size_t(), ctypes.c_size_t()
    while True:
        rc = get(_PTR(func), ctypes.c_size_t(len(layout)), ctypes.byref(off), ctypes.byref(size))
        if rc == CUDA_ERROR_INVALID_VALUE:
            return layout
        if rc:
            return None
        layout.append((off.value, size.value))


def _function_handle(kernel) -> int:
    """The ``CUfunction`` of a compiled Numba kernel in the current context (a library
    kernel, ``CUkernel``, is turned into the context's function)."""
    h = kernel._codelibrary.get_cufunc().handle
    addr = int(getattr(h, "value", h) if not isinstance(h, int) else h)
    if type(h).__name__ == "CUkernel":
        f = _PTR()
        driver.check(driver.lib().cuKernelGetFunction(ctypes.byref(f), _PTR(addr)),
                     "cuKernelGetFunction")
        addr = f.value
    return addr


class HandleLaunch:
    """One compiled kernel's launches with a record laid out as its parameter list."""

    def __init__(self, kernel, args):
        from numba.core import types
        self.kernel = kernel            # so that another record can be built for it
        self.func = _function_handle(kernel)
        self.cooperative = bool(getattr(kernel, "cooperative", False))
        kinds, self.is_array = [], []     # (ctypes type, initial value) per parameter
        for ty, arg in zip(kernel.argument_types, args):
            if isinstance(ty, types.Array):
                if ty.ndim != 1 or ty.layout != "C" or type(arg) is not KernelArray:
                    raise TypeError(f"argument type {ty} is not a 1-D C-contiguous KernelArray")
                item = arg.dtype.itemsize
                kinds += [(_PTR, 0), (_PTR, 0), (_INT64, 0), (_INT64, item),
                          (ctypes.c_uint64, 0), (_INT64, 0), (_INT64, item)]
                self.is_array.append(True)
            elif isinstance(ty, types.Boolean):
                kinds.append((ctypes.c_bool, False))
                self.is_array.append(False)
            elif isinstance(ty, types.Integer):
                kinds.append((getattr(ctypes, f"c_{ty}"), 0))
                self.is_array.append(False)
            else:
                raise TypeError(f"argument type {ty} is not covered")
        layout = _param_layout(self.func)
        if layout is None or [size for _, size in layout] != [ctypes.sizeof(k) for k, _ in kinds]:
            raise TypeError(f"parameter sizes {layout and [size for _, size in layout]} differ "
                            f"from the record's {[ctypes.sizeof(k) for k, _ in kinds]}")
        end = max((off + size for off, size in layout), default=0)
        self.buffer = (ctypes.c_uint64 * ((end + 7) // 8))()    # 8-byte aligned
        self.fields = fields = [k.from_buffer(self.buffer, off) for (k, _), (off, _) in
                                zip(kinds, layout)]
        for f, (_, value) in zip(fields, kinds):
            f.value = value
        self.slots, k = [], 0
        for is_array in self.is_array:
            if is_array:
                # count, data, shape
                self.slots.append((fields[k + 2], fields[k + 4], fields[k + 5]))
                k += 7
            else:
                self.slots.append(fields[k])
                k += 1
        self.pointers = (_PTR * len(fields))(*[ctypes.addressof(f) for f in fields])
        self.extra, self._extra_size = driver.param_buffer(self.buffer, end)

    def fill(self, args) -> None:
        for is_array, slot, arg in zip(self.is_array, self.slots, args):
            if is_array:
                slot[0].value = slot[2].value = arg.count
                slot[1].value = arg.ptr
            else:
                slot.value = arg

    def values(self) -> list:
        """The parameters as the kernel reads them, as integers (for the check against
        Numba's marshalling)."""
        return [int(f.value or 0) for f in self.fields]

    def launch(self, grid: int, block: int, stream: int) -> None:
        """Launch with the record as it stands (a cooperative launch takes no parameter
        buffer: it gets the parameter pointers, which point into the same buffer)."""
        if self.cooperative:
            driver.launch_cooperative(self.func, grid, block, 0, stream, self)
        else:
            driver.launch_packed(self.func, grid, block, 0, stream, self)

    def __call__(self, grid: int, block: int, stream: int, args) -> None:
        self.fill(args)
        self.launch(grid, block, stream)


class BoundLaunch:
    """One kernel's launches whose arguments differ between calls only in the addresses
    of ``buffers`` (the same buffers, in the same order, every call): a
    :class:`HandleLaunch` of its own, filled once from a call's arguments; a launch then
    writes each array's data pointer (its buffer's address plus the offset it had in
    that call; a null one stays null) and calls the driver. Counts, shapes, item sizes
    and every scalar are the caller's to keep fixed (its cache key).

    ``template``: the HandleLaunch that checked this kernel against Numba's
    marshalling for arguments of these kinds; raises TypeError where an array argument
    lies in none of the buffers."""

    __slots__ = ("record", "grid", "block", "data")

    def __init__(self, template: HandleLaunch, launch: Launch, buffers, addresses):
        record = HandleLaunch(template.kernel, launch.args)
        record.fill(launch.args)
        self.record, self.grid, self.block = record, launch.grid, launch.block
        self.data = [(slot[1], *_place(arg, buffers, addresses))
                     for is_array, slot, arg in zip(record.is_array, record.slots, launch.args)
                     if is_array and arg.ptr]

    def __call__(self, stream: int, addresses) -> None:
        for data, i, offset in self.data:
            data.value = addresses[i] + offset
        self.record.launch(self.grid, self.block, stream)


def _place(arg: KernelArray, buffers, addresses) -> tuple:
    """(index, byte offset) of an array argument in the buffer that owns it."""
    for i, buf in enumerate(buffers):
        if arg.owner is buf:
            return i, arg.ptr - addresses[i]
    raise TypeError("an array argument lies in none of the launch's buffers")


class _ThreadEntries(threading.local):
    """A dict of each thread's own (made on the thread's first read)."""

    def __init__(self):
        self.entries = {}


class PerThread:
    """Launch objects by key, one set per thread (a launch reads its record while ctypes
    has released the GIL, so threads never share one), at most ``limit`` per thread
    (then emptied). ``anchor``: the object an ``id`` in the key stands for; an entry
    made for another object that had the same id is not returned."""

    def __init__(self, limit: int):
        self.limit = limit
        self._local = _ThreadEntries()

    def _entries(self) -> dict:
        return self._local.entries

    def get(self, key, anchor):
        entry = self._local.entries.get(key)
        return entry[1] if entry is not None and entry[0] is anchor else None

    def put(self, key, anchor, value) -> None:
        entries = self._entries()
        if len(entries) >= self.limit:
            entries.clear()
        entries[key] = (anchor, value)


def numba_values(kernel, args, stream) -> list:
    """What Numba's own marshalling makes of ``args`` (Numba device arrays), as integers."""
    kernelargs, retr = [], []
    for ty, val in zip(kernel.argument_types, args):
        kernel._prepare_args(ty, val, stream, retr, kernelargs)
    return [int(getattr(v, "value", v) or 0) for v in kernelargs]


def first_launch(dispatcher, grid: int, block: int, numba_stream, args, numba_args):
    """Launch through the dispatcher (compiling if needed) and return the
    :class:`HandleLaunch` for later launches with arguments of the same kinds, or None
    where the kernel is not covered or fails a check (it keeps the dispatcher)."""
    config = dispatcher[grid, block, numba_stream]
    ran = []
    callbacks = getattr(config, "pre_launch_callbacks", None)
    if callbacks is not None:
        callbacks.append(lambda kernel, _config: ran.append(kernel))
    config(*numba_args)
    if len(ran) != 1:
        return None
    kernel = ran[0]
    if getattr(kernel, "launch_config_sensitive", False) or getattr(kernel, "debug", False) \
            or getattr(kernel, "extensions", None):
        return None
    try:
        launch = HandleLaunch(kernel, args)
        launch.fill(args)
        if launch.values() != numba_values(kernel, numba_args, numba_stream):
            raise TypeError("the record's values differ from Numba's marshalling")
    except Exception as exc:  # noqa: BLE001 -- any mismatch: this kernel keeps the dispatcher
        log.info("Numba kernel %s launches through the dispatcher: %s",
                 getattr(dispatcher, "__name__", dispatcher), exc)
        return None
    return launch
