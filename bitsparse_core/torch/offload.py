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
* Host buffers come from a :class:`PinnedPool` reused step after step, bounded by
  ``max_host_bytes``, in power-of-two size classes (a block whose adaptive capacity
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
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Optional

import torch

from ..backends.cuda import driver
from ..backends.cuda.interop import torch_stream
from . import native as _native


def size_class(nbytes: int) -> int:
    """The buffer size that serves ``nbytes``: the next power of two (at least 4 KiB), as
    torch's caching host allocator rounds pinned allocations anyway, so ``held`` counts
    the pinned bytes really taken, and a block whose capacity moves a little finds its
    buffer again."""
    return max(4096, 1 << (nbytes - 1).bit_length())


_PRUNE_MIN = 256    # stash entries before dead ones (a forward without backward) are dropped


class _SideStream:
    """One device's side stream; ``with side.current():`` makes it torch's current stream
    as ``torch.cuda.stream(s)`` does, without the Stream objects and device queries that
    context makes (tens of µs per use on the host path of a training step) when the
    stream's device is the current one (torch's own context otherwise)."""

    __slots__ = ("stream", "packed")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        # (stream_id, device_index, device_type): how torch._C and the C++ host path's
        # copies (c10::Stream::unpack3) name it
        self.packed = (stream.stream_id, stream.device_index, stream.device_type)

    def current(self) -> "_Current":
        return _Current(self)


class _Current:
    """One ``with`` of :meth:`_SideStream.current` (its own state: threads share a side)."""

    __slots__ = ("side", "prev", "ctx")

    def __init__(self, side: _SideStream):
        self.side = side

    def __enter__(self):
        dev = self.side.stream.device_index
        if torch._C._cuda_getDevice() == dev:
            self.ctx = None
            self.prev = torch._C._cuda_getCurrentStream(dev)    # (id, device, type)
            sid, dev, dtype = self.side.packed
            torch._C._cuda_setStream(stream_id=sid, device_index=dev, device_type=dtype)
        else:
            self.ctx = torch.cuda.stream(self.side.stream)
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        sid, dev, dtype = self.prev
        torch._C._cuda_setStream(stream_id=sid, device_index=dev, device_type=dtype)
        return False


class PinnedPool:
    """Host buffers by size class, pinned where CUDA is, reused; at most ``max_bytes`` held.

    A buffer comes back with the ``lane`` its last copy ran on (the side stream of one
    device) and is handed out again only for that lane: copies on one stream are ordered,
    copies on two are not."""

    def __init__(self, max_bytes: Optional[int] = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0 or None (no bound)")
        self.max_bytes = max_bytes
        self.held = 0                    # bytes allocated, free or in use
        self._free: dict = {}            # (lane, nbytes) -> [buffer]
        self._lock = threading.Lock()

    def take(self, nbytes: int, lane=None) -> Optional[torch.Tensor]:
        """A buffer of at least ``nbytes`` (its size class) free for ``lane``, or None when
        the bound leaves no room for one."""
        nbytes = size_class(nbytes)
        with self._lock:
            free = self._free.get((lane, nbytes))
            if free:
                return free.pop()
            if self.max_bytes is not None and self.held + nbytes > self.max_bytes:
                self._evict(self.held + nbytes - self.max_bytes)
                if self.held + nbytes > self.max_bytes:
                    return None
            self.held += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                           pin_memory=torch.cuda.is_available())

    def give(self, buf: torch.Tensor, lane=None) -> None:
        with self._lock:
            self._free.setdefault((lane, buf.numel()), []).append(buf)

    def _evict(self, need: int) -> None:
        """Drop free buffers (of sizes no longer asked for, say) until ``need`` bytes are
        gone (they go back to torch's pinned-memory cache)."""
        for key in sorted(self._free, key=lambda k: k[1], reverse=True):
            bufs = self._free[key]
            while bufs and need > 0:
                bufs.pop()
                self.held -= key[1]
                need -= key[1]
            if need <= 0:
                break

    def free_bytes(self) -> int:
        with self._lock:
            return sum(key[1] * len(b) for key, b in self._free.items())


class Stashed:
    """One packed block between its forward and its backward: on the host (``host``),
    on its way back (``back`` and its ``ready`` event), or kept on the device."""

    __slots__ = ("owner", "host", "back", "ready", "fetched_on", "device", "nbytes", "taken",
                 "block", "out_done", "__weakref__")

    def __init__(self, owner: "Offloader", device: torch.device, nbytes: int,
                 host: Optional[torch.Tensor] = None, kept: Optional[torch.Tensor] = None):
        self.owner, self.device, self.nbytes = owner, device, nbytes
        self.host, self.back, self.ready, self.fetched_on = host, kept, None, 0
        self.taken = False
        # the device block while its copy out may still run, and the event after that copy
        self.block, self.out_done = None, 0

    def take(self) -> torch.Tensor:
        """The block on its device, ordered before what the current stream runs next. Once
        only: the host buffer is reused after that, so a second take (a second backward
        through the graph, ``retain_graph=True``) raises."""
        if self.taken:
            raise RuntimeError("an offloaded packed block is taken back by one backward only: "
                               "a second backward through it (retain_graph=True) needs "
                               "offload=None")
        self.taken = True
        return self.owner._take(self)

    def __del__(self):
        if self.block is not None:
            self.owner._drop_block(self, copied=False)
        host, self.host = self.host, None
        ready, self.ready = self.ready, None
        if ready is not None:                # fetched, never taken: ``back``'s memory goes
            driver.release_event(ready)      # back to its stream once the copy is done
            self.back.record_stream(self.owner._side(self.device.index).stream)
        if host is not None:
            self.owner.pool.give(host, self.device)


class Offloader:
    """Offload packed blocks between forward and backward (see the module docstring).

    ``ahead``: how many layers' blocks (in backward order) are on their way back
    while a layer's backward runs. ``max_host_bytes``: the pinned pool's bound (None:
    none). ``hold``: how many device blocks at most wait for their copy out to run
    before they are released (see the module docstring; 0 releases each at once).
    One offloader serves every layer of a model: it sees the order blocks were stashed
    in, which is the reverse of the order backward takes them.
    """

    def __init__(self, ahead: int = 2, max_host_bytes: Optional[int] = None, hold: int = 2):
        if ahead < 0:
            raise ValueError(f"ahead={ahead} must be >= 0")
        if hold < 0:
            raise ValueError(f"hold={hold} must be >= 0")
        self.ahead, self.hold = ahead, hold
        self.pool = PinnedPool(max_host_bytes)
        self._stashed: list = []        # weakrefs, in stash order
        self._held = collections.deque()  # weakrefs of stashes holding their block, in order
        self._prune_at = _PRUNE_MIN
        self._streams: dict = {}
        # reentrant: a Stashed collected inside a locked section releases its block here
        self._lock = threading.RLock()
        self._stats = {"offloaded": 0, "kept_on_device": 0, "prefetched": 0, "late": 0,
                       "taken_on_device": 0, "bytes_offloaded": 0}

    def stats(self) -> dict:
        """Blocks offloaded, kept on the device (pool full), fetched ahead of their
        backward or only when asked for (late), taken from the device because their copy
        out had not been seen to finish (taken_on_device), and the bytes moved out."""
        return {**self._stats, "pool_held_bytes": self.pool.held}

    def __repr__(self) -> str:
        return (f"Offloader(ahead={self.ahead}, max_host_bytes={self.pool.max_bytes}, "
                f"hold={self.hold})")

    # A model's layers share one offloader, a resource like a stream: a deep copy of the
    # model shares it too, and pickling makes a fresh one with the same settings.
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (Offloader, (self.ahead, self.pool.max_bytes, self.hold))

    def _side(self, index: int) -> _SideStream:
        """The side stream of CUDA device ``index``."""
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = _SideStream(torch.cuda.Stream(index))
        return s

    def copy_stream(self, device: torch.device) -> tuple:
        """The stream this offloader's copies on ``device`` run on, as the C++ host path
        names it (``(stream_id, device_index, device_type)``): the device's side stream, or
        the CPU's (plain copies)."""
        if device.type == "cuda":
            return self._side(device.index).packed
        return (0, -1, 0)    # c10::Stream of the CPU

    def copy_stream_handle(self, device: torch.device) -> int:
        """The raw CUDA stream (``cudaStream_t``) of this offloader's copies on ``device``."""
        return self._side(device.index).stream.cuda_stream

    def stash(self, block: torch.Tensor) -> Stashed:
        """Queue ``block``'s copy out (after the work queued so far on the current
        stream, which includes its pack); the caller then drops ``block``."""
        self._release_copied()
        nbytes = block.numel()
        host = self.pool.take(nbytes, block.device)
        if host is None:
            self._stats["kept_on_device"] += 1
            return self._track(Stashed(self, block.device, nbytes, kept=block))
        done = self._copy_out(block, host)
        self._stats["offloaded"] += 1
        self._stats["bytes_offloaded"] += nbytes
        h = self._track(Stashed(self, block.device, nbytes, host=host))
        if done:
            h.block, h.out_done = block, done
            with self._lock:
                self._held.append(weakref.ref(h))
                over = len(self._held) - self.hold
                early = [self._held.popleft() for _ in range(max(over, 0))]
            for ref in early:
                s = ref()
                if s is not None and s.block is not None:
                    self._drop_block(s, copied=False)
        return h

    def _copy_out(self, block: torch.Tensor, host: torch.Tensor) -> int:
        """Queue the copy of ``block`` into ``host``; the event after it (0: done now)."""
        native = _native.loaded_for(block.device)
        if native is not None:     # the same calls as below, in one call into C++
            return native.offload_out(block, host, *self.copy_stream(block.device))
        if block.is_cuda:
            dev = block.get_device()
            side = self._side(dev)
            driver.stream_wait(side.stream.cuda_stream, torch_stream(dev))   # after the pack
            with side.current():
                host[:block.numel()].copy_(block, non_blocking=True)
            return driver.record_event(side.stream.cuda_stream)
        host[:block.numel()].copy_(block)
        return 0

    def _copied(self, event: int) -> bool:
        return driver.event_done(event)

    def _release_copied(self) -> None:
        """Release the held blocks whose copy out has run (in stash order: copies on one
        stream run in order, so the first still running ends the search)."""
        while True:
            with self._lock:
                if not self._held:
                    return
                h = self._held[0]()
                if h is not None and h.block is not None and not self._copied(h.out_done):
                    return
                self._held.popleft()
            if h is not None and h.block is not None:
                self._drop_block(h, copied=True)

    def _drop_block(self, h: Stashed, copied: bool) -> None:
        """Let ``h``'s device block go (once, whichever thread comes first); where its
        copy out may still run, the caching allocator is told to wait for the side
        stream first."""
        with self._lock:
            block, event, h.block, h.out_done = h.block, h.out_done, None, 0
        if block is None:
            return
        if not copied and block.is_cuda:
            block.record_stream(self._side(block.device.index).stream)
        self._forget(event)

    def _forget(self, event: int) -> None:
        driver.release_event(event)

    def _track(self, h: Stashed) -> Stashed:
        """Remember ``h`` in stash order (kept ones too: a backward that takes one still
        fetches the next ones ahead)."""
        with self._lock:
            if len(self._stashed) >= self._prune_at:   # forwards whose backward never came
                self._stashed = [r for r in self._stashed if r() is not None]
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._stashed))
            self._stashed.append(weakref.ref(h))
        return h

    def _fetch(self, h: Stashed) -> None:
        """Queue ``h``'s copy back (no-op when it is back, on its way, was kept, or still
        holds its block)."""
        if h.back is not None or h.host is None or h.block is not None:
            return
        native = _native.loaded_for(h.device)
        if native is not None:     # the same calls as below, in one call into C++
            back, ready = native.offload_in(h.host, h.nbytes, h.device,
                                            *self.copy_stream(h.device))
            if ready:
                h.ready, h.fetched_on = ready, torch_stream(h.device.index)
        elif h.device.type == "cuda":
            dev = h.device.index
            side = self._side(dev)
            # ``back`` comes from the compute stream's memory: the side stream writes it
            # after the work queued there so far, the compute stream waits on ``ready``
            # before it reads it (and should the handle die before its backward takes it,
            # Stashed.__del__ keeps the allocator from reusing it under the copy)
            cur = torch_stream(dev)
            back = torch.empty(h.nbytes, dtype=torch.uint8, device=h.device)
            driver.stream_wait(side.stream.cuda_stream, cur)
            with side.current():
                back.copy_(h.host[:h.nbytes], non_blocking=True)
            h.ready, h.fetched_on = driver.record_event(side.stream.cuda_stream), cur
        else:
            back = h.host[:h.nbytes].clone()
        h.back = back

    def _take(self, h: Stashed) -> torch.Tensor:
        block = h.block
        on_device = block is not None
        if on_device:              # its copy out was not seen to finish: use it as it is
            h.back = block
            self._drop_block(h, copied=False)
        late = h.back is None and h.host is not None
        self._fetch(h)
        nxt = []
        with self._lock:
            # Backward takes blocks in the reverse of stash order: ``h`` is (nearly) the
            # last entry, and the next ones to fetch are just before it.
            mine = None
            for i in range(len(self._stashed) - 1, -1, -1):
                s = self._stashed[i]()
                if mine is None:
                    if s is h:
                        mine = i
                elif s is not None:
                    nxt.append(s)
                    if len(nxt) == self.ahead:
                        break
            if mine is not None:
                del self._stashed[mine]
        for s in nxt:                    # the blocks whose backward comes next
            if s.back is None and s.host is not None and s.block is None:
                self._fetch(s)
                self._stats["prefetched"] += 1
        self._stats["late"] += int(late)
        self._stats["taken_on_device"] += int(on_device)
        back, ready, h.ready = h.back, h.ready, None
        if ready is not None:
            cur = torch_stream(h.device.index)
            native = _native.loaded_for(h.device)
            (native.wait_event if native is not None else driver.wait_event)(cur, ready)
            if cur != h.fetched_on:      # allocated on another stream than the one using it
                back.record_stream(torch.cuda.current_stream(h.device))
        host, h.host, h.back = h.host, None, None
        if host is not None:             # its next copy in runs after this one (one stream)
            self.pool.give(host, h.device)
        return back


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
