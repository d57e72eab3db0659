"""An exact pack's wait for its count and its shrink in native code, where its
allocations come from PyTorch's caching allocator on torch's current stream.

Between the pack's kernel and the shrink's copies the GPU waits for the host: the count's
read (:func:`.slots.wait`), the exact tail's layout (:func:`.host.tail_shrink`), its
allocation and the copies' launch. The torch adapter's C++ extension does these four
without Python (``exact_shrink`` in ``kernels/torch_host_exact.h``) and registers itself
here (:func:`register`, from :mod:`bitsparse_core.torch.native`); both CUDA backends' pack
steps ask :func:`wait_and_shrink` first and take the Python steps where it declines:
another allocator or stream, the extension off or not built.
"""

from __future__ import annotations

from . import interop as ci
from . import slots
from .host import ExactTail, PackPlan, tail_shrink

_native = None     # (slot, stream, device, src_tail, plan) -> (status, nnz, tensor or None) or None


def register(fn) -> None:
    """The native steps (``fn`` as above; None to drop them)."""
    global _native
    _native = fn


def wait_and_shrink(plan: PackPlan, slot: int, stream: int, device: int, src_tail: int,
                    allocator):
    """``(status, nnz, shrunk)`` of an exact pack whose worst-case tail is at ``src_tail``
    and whose kernel writes ``slot``: ``shrunk`` is ``(buffer, ExactTail)``, the exact tail
    with its copies queued on ``stream``, or None where the status refuses it (a nosign
    violation). None where the native steps do not apply; nothing was waited for then."""
    fn = _native
    if (fn is None or allocator is not ci.torch_allocator
            or not ci.same_stream(stream, ci.torch_stream(device))):
        return None
    done = fn(slot, stream, device, src_tail, plan)
    if done is None:
        return None
    slots.release(slot)
    status, nnz, tail = done
    if tail is None:
        return status, nnz, None
    exact: ExactTail = tail_shrink(plan, nnz)
    return status, nnz, (ci.DeviceBuffer(tail.data_ptr(), exact.nbytes, device, tail), exact)
