"""The host protocol both CUDA backends follow, written once.

A backend supplies the steps that touch its memory and kernels (a
:class:`PackSteps`); this module decides what to queue and when the host must
wait:

* fixed capacity with an explicit encoding: queue the pack, never wait;
  overflow and nosign violations stay on the device until ``PackedTensor.check``;
* ``capacity=None`` (exact): pack the values into a worst-case capacity, wait once
  for the count, copy the stored values into an exact-size allocation (the shrink);
* ``encoding="auto"``: wait once for the status word; a set sign bit packs
  again as raw.

A backend whose kernel writes the count to a pinned host slot (:mod:`.slots`) waits
there rather than on the stream, and learns it before the kernel has finished.

and which checks every op makes of its packed inputs: on the device that made
them, ordered after the stream that made them, not overflowed when the op reads
their values.
"""

from __future__ import annotations

import functools
from typing import Protocol

from ...errors import EncodingError, OutputMismatchError, UnsupportedDeviceError
from ...spec import format as _fmt
from ...spec.format import Encoding, check_capacity
from . import abi
from .host import PackPlan, pack_plan

NOSIGN_MESSAGE = ("nosign encoding: a stored value has its sign bit set; use encoding='signplane' "
                  "or 'raw'")


class PackSteps(Protocol):
    """What a backend does for one pack call (one object per call)."""

    def run(self, plan: PackPlan, fixed: bool, count: bool):
        """Allocate a block for ``plan`` and queue the pack into it; return the block.
        ``fixed``: a caller's capacity, whose unused value slots must read as zeros
        (else the worst case of an exact pack, shrunk later). ``count``: the host
        will read the status and count (:meth:`read_head`)."""

    def read_head(self, plan: PackPlan, block) -> tuple:
        """``(status, nnz)`` of the pack (waits for it)."""

    def shrink(self, plan: PackPlan, block, nnz: int):
        """A block holding what ``block`` stored, at capacity ``nnz``, its copies queued
        (laid out by :func:`.host.tail_shrink`, not by an exact plan: the GPU waits for
        every step between the count and the copies, and is idle for those after)."""

    def packed(self, plan: PackPlan, block, nnz, pending_status: bool):
        """The PackedTensor of a block (``nnz`` None while it is on the device); of a
        shrunk block, ``plan`` is the worst case it was packed into."""


@functools.lru_cache(maxsize=1024, typed=True)
def _first_plan(shape: tuple, dtype, encoding, chunk_log2, capacity, mode) -> tuple:
    """``(plan, auto, exact)`` of a pack call's arguments, checked (bad ones raise and
    are not kept; ``typed``: ``capacity=True`` is not ``capacity=1``)."""
    chunk_log2 = _fmt.check_chunk_log2(chunk_log2)
    auto = isinstance(encoding, str) and encoding.lower() == "auto"
    enc = Encoding.NOSIGN if auto else Encoding.parse(encoding)
    numel = _fmt.numel_of(shape)
    exact = capacity is None
    cap = numel if exact else check_capacity(capacity, numel)
    return pack_plan(shape, dtype, enc, cap, chunk_log2, mode), auto, exact


def pack(steps: PackSteps, shape: tuple, dtype, encoding, chunk_log2, capacity,
         mode: abi.Mode = abi.Mode.PACK):
    """Run the protocol above for one pack; returns ``steps.packed(...)``."""
    args = (tuple(shape), dtype, encoding, chunk_log2, capacity, mode)
    try:
        plan, auto, exact = _first_plan(*args)
    except TypeError:           # an unhashable argument: checked uncached, named error
        plan, auto, exact = _first_plan.__wrapped__(*args)
    enc = plan.lay.encoding
    block = steps.run(plan, not exact, exact or auto)
    if not (exact or auto):
        return steps.packed(plan, block, None, enc == Encoding.NOSIGN)
    status, nnz = steps.read_head(plan, block)                 # the one wait
    if status & abi.STATUS_NOSIGN_VIOLATION:
        if auto:
            return pack(steps, shape, dtype, Encoding.RAW, chunk_log2, capacity, mode)
        raise EncodingError(NOSIGN_MESSAGE)
    if exact:       # the GPU waits for the host until the shrink's copies are queued
        block = steps.shrink(plan, block, nnz)
    return steps.packed(plan, block, nnz, False)


def check_packed(p, device_type: str = "cuda") -> None:
    if p.device[0] != device_type:
        raise UnsupportedDeviceError(f"packed tensor lives on {p.device}; this backend works on "
                                     f"{device_type} tensors")


def check_like(what: str, shape, dtype, p) -> None:
    """A dense argument (grad, u) must have the packed tensor's shape and dtype."""
    if dtype != p.dtype or tuple(shape) != tuple(p.shape):
        raise OutputMismatchError(f"{what} is {dtype.name}{tuple(shape)}; the packed tensor is "
                                  f"{p.dtype.name}{tuple(p.shape)}")


def check_pair(p_r, p_u) -> None:
    if tuple(p_u.shape) != tuple(p_r.shape) or p_u.dtype != p_r.dtype:
        raise OutputMismatchError(f"p_u is {p_u.dtype.name}{tuple(p_u.shape)}, p_r is "
                                  f"{p_r.dtype.name}{tuple(p_r.shape)}")


def producer_stream(p, default: int = 0) -> int:
    """The stream a packed tensor was made on (ops on other streams wait for it)."""
    return int(p.extra.get("stream", default))
