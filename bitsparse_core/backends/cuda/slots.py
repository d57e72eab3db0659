"""Pinned host slots for a pack's count: what the host waits on when it needs one.

An exact pack (and ``encoding="auto"``) needs its status word and nonzero count on the
host. The pack kernel writes them into the slot named by ``PackArgs.slot`` as soon as
the grid's last tile knows them, before the other blocks' last tiles and the kernel's
epilogue are done; the host watches the slot instead of synchronizing with the stream,
so it plans the shrink while the GPU is still busy and the copies it queues follow the
kernel without a gap. A slot is 16 bytes of pinned host memory (``abi.SLOT_BYTES``:
u32 status, u32 pad, u64 nnz; mapped, so a kernel writes it through the same address);
both fields hold a sentinel until the kernel writes them, and each lands whole, so no
CUDA call is needed to see the count arrive. The stream is queried now and then, so
that a failed kernel raises instead of hanging.

Slots belong to a thread (a wait is synchronous); one whose wait did not complete is
never handed out again, since its kernel may still write it.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from ...errors import CudaDriverError
from . import abi, driver

_PAGE = 4096
_PER_PAGE = _PAGE // abi.SLOT_BYTES
# Spin this long (a sleep, even of 0 s, costs the timer slack: ~50 us on Linux), then
# block in a stream synchronize, which releases the GIL, for a long wait.
_SPIN_S = 2e-3
_QUERY_EVERY = 64         # looks between two stream queries
_local = threading.local()


def _free() -> list:
    free = getattr(_local, "free", None)
    if free is None:
        free = _local.free = []
    if not free:
        base = driver.alloc_host(_PAGE)          # kept for the process (a page per thread)
        free.extend(base + abi.SLOT_BYTES * k for k in range(_PER_PAGE - 1, -1, -1))
    return free


def _fields(slot: int):
    return ctypes.c_uint32.from_address(slot), ctypes.c_uint64.from_address(slot + 8)


def take() -> int:
    """A slot's host address, its fields set to the sentinels."""
    slot = _free().pop()
    write(slot, abi.SLOT_SENTINEL32, abi.SLOT_SENTINEL64)
    return slot


def write(slot: int, status: int, nnz: int) -> None:
    """Fill a slot from the host (a pack with nothing to launch: an empty tensor)."""
    st, n = _fields(slot)
    n.value = nnz
    st.value = status


def _landed(view32: np.ndarray, view64: np.ndarray):
    s, n = int(view32[0]), int(view64[1])
    if s == abi.SLOT_SENTINEL32 or n == abi.SLOT_SENTINEL64:
        return None
    return s, n


def _views(slot: int) -> tuple:
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * abi.SLOT_BYTES).from_address(slot))
    return raw.view(np.uint32), raw.view(np.uint64)


def _written(view32: np.ndarray, view64: np.ndarray) -> tuple:
    state = _landed(view32, view64)
    if state is None:
        raise CudaDriverError("the pack kernel finished without writing its count to the "
                              "host slot")
    return state


def written(slot: int) -> tuple:
    """``(status, nnz)`` of a slot whose kernel is known to have run (raises where it
    did not write the slot)."""
    return _written(*_views(slot))


def release(slot: int) -> None:
    """Give back a slot whose count has been read (its kernel will not write it again)."""
    _free().append(slot)


def wait(slot: int, stream: int) -> tuple:
    """``(status, nnz)`` once the pack queued on ``stream`` has written ``slot``; the slot
    is then free again."""
    view32, view64 = _views(slot)
    deadline = time.perf_counter() + _SPIN_S
    looks = 0
    while (state := _landed(view32, view64)) is None:
        looks += 1
        if looks % _QUERY_EVERY:
            continue
        if time.perf_counter() > deadline:
            driver.sync_stream(stream)
        elif not driver.stream_done(stream):
            continue
        state = _written(view32, view64)   # the stream has run: the kernel wrote it
        break
    release(slot)
    return state
