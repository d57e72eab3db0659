"""Compress, then offload: packed blocks in pinned host memory between forward and backward.

An :class:`Offloader` takes each packed block right after its pack, copies it to a
pinned host buffer on a side stream and lets the device memory go; in backward,
when a layer asks for its block, the blocks of the next ``ahead`` layers to run
backward are copied back on the same side stream, so those copies run while the
GPU computes this layer. Streams are ordered by events, never by the host: nothing
here synchronizes.

* The device block is held until its copy out has run (an event, queried without
  waiting at the next stash), then released. At most ``hold`` blocks are held; an older
  one is released early with ``record_stream``, which keeps the caching allocator from
  reusing its memory before the side stream has read it. A block still held when its
  backward comes (the last layers' at the turn from forward to backward, whose copies
  are still running) is taken from the device as it is: no copy back to wait for.
* Host buffers come from a pinned pool (:func:`pinned_pool`) reused step after step,
  bounded by ``max_host_bytes``, in power-of-two size classes (a block whose adaptive capacity
  moves a little finds its buffer again); a block that does not fit stays on the
  device (counted in :meth:`Offloader.stats`), it is never dropped. One side stream
  per device carries both directions, so a buffer's next copy in always follows its
  last copy out; the pool hands a buffer only to the device whose stream last used it.
* A block is copied whole (its capacity, used or not): bit-identical by
  construction, and the count it carries is read from its ticket as without
  offloading.
* A stashed block whose backward never comes (a forward without backward) gives
  its buffer back when autograd frees the graph that holds it.

On the CPU a block already lives in host memory; it moves into the pool's buffers
all the same (plain copies), which is what the CPU tests exercise.

The mechanism runs in C++ (``kernels/torch_host_offload.h``'s ``OffloadEngine``, built
with the FFN ops' C++ host path by :mod:`.native`): the packed FFN node stashes and
takes back its block there without calling into Python, which cost an offloaded layer
~130 µs of host time per step on the H200's host. This class configures it and is what
the Python callers (the ops' Python path, :mod:`.hooks`) stash through. Offloading
therefore needs the C++ host path: where it cannot be built (no C++ compiler, or
``BITSPARSE_NATIVE=0``), making an Offloader raises :class:`BackendUnavailableError`.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ..errors import BackendUnavailableError
from . import native as _native


def size_class(nbytes: int) -> int:
    """The buffer size that serves ``nbytes``: the next power of two (at least 4 KiB), as
    torch's caching host allocator rounds pinned allocations anyway, so ``held`` counts
    the pinned bytes really taken, and a block whose capacity moves a little finds its
    buffer again (the pool's own rule, from the extension)."""
    return _extension().size_class(nbytes)


def _extension():
    mod = _native.module()
    if mod is None:
        raise BackendUnavailableError(
            "offload= needs the C++ host path of the FFN ops, which could not be built here "
            f"({_native.build_error() or 'BITSPARSE_NATIVE=0'}); pass offload=None")
    return mod


def pinned_pool(max_bytes: Optional[int] = None):
    """A pool of pinned host buffers as an :class:`Offloader` keeps one: ``take(nbytes,
    lane)`` gives a free buffer of ``nbytes``' size class that last served ``lane`` (a
    device index, -1 for the CPU), or allocates one, or None where that would pass
    ``max_bytes``, after dropping free buffers of other sizes to make room; ``give(buf,
    lane)`` takes it back; ``held`` counts the bytes allocated, free or in use."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} must be >= 0 or None (no bound)")
    return _extension().PinnedPool(-1 if max_bytes is None else max_bytes)


class Offloader:
    """Offload packed blocks between forward and backward (see the module docstring).

    ``ahead``: how many layers' blocks (in backward order) are on their way back
    while a layer's backward runs. ``max_host_bytes``: the pinned pool's bound (None:
    none). ``hold``: how many device blocks at most wait for their copy out to run
    before they are released (see the module docstring; 0 releases each at once).
    One offloader serves every layer of a model: it sees the order blocks were stashed
    in, which is the reverse of the order backward takes them.

    :meth:`stash` returns the block's stash, whose ``take()`` gives the block back on its
    device (once: a second take, a second backward through the graph, raises) and whose
    ``state`` says where it is (``held``, ``on_host``, ``fetched``, ``kept``, ``taken``).
    """

    def __init__(self, ahead: int = 2, max_host_bytes: Optional[int] = None, hold: int = 2):
        if ahead < 0:
            raise ValueError(f"ahead={ahead} must be >= 0")
        if hold < 0:
            raise ValueError(f"hold={hold} must be >= 0")
        if max_host_bytes is not None and max_host_bytes < 0:
            raise ValueError(f"max_host_bytes={max_host_bytes} must be >= 0 or None (no bound)")
        self.ahead, self.hold = ahead, hold
        self.engine = _extension().OffloadEngine(
            ahead, -1 if max_host_bytes is None else max_host_bytes, hold)

    @property
    def pool(self):
        """The pinned pool (see :func:`pinned_pool`)."""
        return self.engine.pool

    def stats(self) -> dict:
        """Blocks offloaded, kept on the device (pool full), fetched ahead of their
        backward or only when asked for (late), taken from the device because their copy
        out had not been seen to finish (taken_on_device), the bytes moved out, and the
        pool's pinned bytes."""
        return {**self.engine.stats(), "pool_held_bytes": self.engine.pool.held}

    def __repr__(self) -> str:
        return (f"Offloader(ahead={self.ahead}, max_host_bytes={self.pool.max_bytes}, "
                f"hold={self.hold})")

    # A model's layers share one offloader, a resource like a stream: a deep copy of the
    # model shares it too, and pickling makes a fresh one with the same settings.
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (Offloader, (self.ahead, self.pool.max_bytes, self.hold))

    def stash(self, block: torch.Tensor):
        """Queue ``block``'s copy out (after the work queued so far on the current
        stream, which includes its pack); the caller then drops ``block``."""
        return self.engine.stash(block)


_DEFAULT = None
_DEFAULT_LOCK = threading.Lock()


def resolve(offload) -> Optional[Offloader]:
    """``offload=`` as the ops and modules take it: None / False (off), True (the
    process's shared default :class:`Offloader`), or an :class:`Offloader`."""
    global _DEFAULT
    if offload is None or offload is False:
        return None
    if offload is True:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = Offloader()
            return _DEFAULT
    if isinstance(offload, Offloader):
        return offload
    raise TypeError(f"offload={offload!r}: use True, False/None or an Offloader")
