"""compress_saved_tensors: pack what autograd saves, for any eager model, without
waiting for the GPU.

A ``torch.autograd.graph.saved_tensors_hooks`` pair: every tensor autograd
saves for backward passes through ``pack``; a float tensor that is large enough
is packed at a fixed capacity, anything else is returned as is. ``unpack``
rebuilds the exact tensor (bit for bit) and may run any number of times
(``retain_graph``, several nodes saving the same tensor).

No decision waits for the GPU. A pack is queued at a capacity the save site
(:mod:`.sites`) chose from what earlier steps saw there, and its status word and
nonzero count come back asynchronously into a pinned slot (:mod:`.capacity`).
Until they have, the hooks hold both the dense tensor and the packed block; the
first hook call that finds the count landed (each ``pack`` and ``unpack`` looks,
no CUDA call) keeps one: the packed block when it is clean, the dense tensor when
the pack overflowed or broke ``nosign``. A backward that unpacks a tensor whose
count has not come back uses the dense tensor still held, and that save site passes
through for a while (:meth:`.sites.SaveSite.late`). Every answer is exact.

A pack in flight holds its block on top of the dense tensor, so a new one is
queued only while the blocks in flight fit in what the clean packs alive already
save (or none is in flight): the hooks never hold more than plain PyTorch plus one
block. Where the host runs far ahead of the GPU, saves pass through instead
(``stats.throttled``).

Most saves need no Python: in a transformer layer a few of about thirty are worth
packing. Where the C++ extension is built (:func:`.native.hooks_module`), its front
(``kernels/torch_host_hooks.h``) sees every save first. Without a Python call it passes
through what is not a candidate, a base tensor already passed through, and a new base at
a save site that is passing for a while; answers a save of a base already packed; packs
a new base at a site whose capacity has settled (these hooks tell it the site's plan and
``version`` after packing there, :mod:`.sites`); and decodes the common unpack. It calls
these hooks for the rest, by the same rules, so both paths take the same decisions.

Hooks entered inside other saved-tensor hooks (``save_on_cpu``, an offloading pair)
compose with them: PyTorch calls only the innermost pair, so ours hand the enclosing
pair what they keep, a packed block once its pack is known clean, or a tensor they pass
through or keep dense, and take it back from that pair in backward. Hooks entered
inside ours (``torch.utils.checkpoint`` inside a hooked forward, say) take precedence
over ours for what they save, as PyTorch defines.

``offload=`` (True, or an :class:`~.offload.Offloader`) moves each clean packed block
to pinned host memory once its count has landed (the pack has then run), and brings it
back ahead of its backward, as the packed FFN ops' ``offload=`` does; blocks it moves
no longer go to the enclosing hooks. Eager only: under a CUDA graph capture blocks stay.

A tensor saved by several nodes (ReLU saves its output, the next matmul saves
the same tensor or a reshaped view of it) is packed once: packs are shared by
the base tensor they were made from while that tensor is alive and unmodified.
It is unpacked once per backward: the first node to unpack it gets a dense tensor
that the hooks hold until each of the other nodes that saved it has unpacked it
too (each gets the same tensor, or a view), so no two dense copies of one saved
tensor exist at once, and none lives longer than plain PyTorch's would.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref

import torch

from ..backends.cuda import abi
from ..backends.cuda.interop import stream_wait, torch_stream
from ..errors import SavedTensorModifiedError
from . import _bridge as B
from . import capacity as C
from . import native
from . import ops as O
from .offload import resolve as resolve_offload
from .sites import Sites

PENDING, CLEAN, DENSE = "pending", "clean", "dense"   # _Packed.state
_PLAIN = (torch.Tensor, torch.nn.Parameter)   # tensor subclasses pass through
LOST = (None, None)    # a count that can never be read (its slot was taken again)


@dataclasses.dataclass
class SavedStats:
    """What the hooks did so far: counts and bytes.

    tried:       packs queued at a fixed capacity (each held beside its dense tensor
                 until its count came back).
    packed:      tried packs found clean: the saved tensor is held packed, its dense
                 tensor dropped (``dense_bytes`` / ``packed_bytes`` count these).
    kept_dense:  tried packs dropped for the dense tensor: ``overflowed`` (more nonzeros
                 than the capacity), ``violations`` (a sign bit under nosign), or
                 ``pending_at_unpack`` (backward came before the count; the site then
                 passes through for a while).
    throttled:   saves passed through because the blocks in flight would have held more
                 than the clean packs save.
    passed:      saves returned as they are (not candidates, not worth packing at their
                 site, throttled, or a host pack found unusable at once).
    shared:      saves answered by an earlier pack of the same base tensor.
    unpacked:    packed blocks unpacked; ``reused``: unpacks answered by a dense tensor
                 still alive.
    """
    tried: int = 0
    packed: int = 0
    kept_dense: int = 0
    overflowed: int = 0
    violations: int = 0
    pending_at_unpack: int = 0
    throttled: int = 0
    passed: int = 0
    shared: int = 0
    unpacked: int = 0
    reused: int = 0
    dense_bytes: int = 0
    packed_bytes: int = 0


class _Packed:
    """A saved tensor packed at a capacity: the block and its plan, the dense tensor while
    the count is on its way (or for good when the pack was not usable)."""

    __slots__ = ("owner", "site", "block", "plan", "handle", "key", "known", "held", "version",
                 "dtype", "shape", "stream", "state", "unpacked", "saves", "to_unpack", "keep",
                 "nbytes", "__weakref__")

    def __init__(self, owner, site, block, plan, handle, key, known, dense: torch.Tensor,
                 stream, nbytes: int):
        self.owner = owner     # the hooks that made it (they unpack it)
        self.site = site       # its save site (told when the pack comes back too late)
        self.block, self.plan, self.key, self.known = block, plan, key, known
        self.handle = handle   # the C++ extension's handle of the plan, or None
        self.held, self.version = dense, dense._version
        self.dtype, self.shape, self.stream = dense.dtype, tuple(dense.shape), stream
        self.state = PENDING
        self.unpacked = None    # weak reference to the last unpacked tensor
        # Saves answered by this pack (the nodes that will unpack it), the unpacks of this
        # backward still to come, and the unpacked tensor held for them meanwhile.
        self.saves, self.to_unpack, self.keep = 1, 0, None
        self.nbytes = nbytes           # what the block holds (its pack's scratch included)


class _Outer:
    """What the saved-tensor hooks enclosing ours made of a tensor (their ``pack``'s result),
    and their ``unpack``."""

    __slots__ = ("obj", "unpack")

    def __init__(self, obj, unpack):
        self.obj, self.unpack = obj, unpack


class _Offloaded:
    """A clean packed block in the offloader's hands (what
    :meth:`~.offload.Offloader.stash` returned)."""

    __slots__ = ("stashed",)

    def __init__(self, stashed):
        self.stashed = stashed


class _View:
    """A saved view of a packed base tensor: unpack the base, view it as the saved shape."""

    __slots__ = ("base", "shape")

    def __init__(self, base: _Packed, shape):
        self.base, self.shape = base, shape


class _ByBase:
    """Packs by the base tensor they were made from, while that tensor is alive: the entry
    goes when it dies. A dict keyed by ``id`` (``torch.utils.weak.WeakIdKeyDictionary``
    runs Python-level hashing and comparison on every lookup, and the hooks look one up
    for every candidate save)."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries = {}

    def get(self, base: torch.Tensor):
        """``(version, _Packed or None)`` recorded for ``base``, or None."""
        entry = self._entries.get(id(base))
        if entry is None or entry[0]() is not base:
            return None
        return entry[1], entry[2]

    def put(self, base: torch.Tensor, version: int, packed) -> None:
        key = id(base)
        self._entries[key] = (weakref.ref(base, functools.partial(self._forget, key)),
                              version, packed)

    def _forget(self, key: int, ref) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0] is ref:   # not an entry of a later tensor
            del self._entries[key]


def _landed(key, known):
    """A pack's ``(status, nnz)`` once it is on the host, None while on its way, LOST if it
    never can be. ``key``: its slot's ``(index, generation)``; ``known``: the state of a
    pack made on the host."""
    if known is not None:
        return known
    state = C.SLAB.read_slot(*key)
    if state is None and C.SLAB.lost_slot(*key):
        return LOST
    return state


class compress_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager packing saved activations of any eager model.

    min_sparsity: pack only where at least this fraction of the elements are zero bit
                  patterns: the first pack at a save site has room for the rest, later
                  ones are sized from the counts seen there.
    min_numel:    pack only tensors with at least this many elements.
    encoding:     ``"auto"`` (nosign until a site saves a value with its sign bit set,
                  then raw there), ``"raw"``, ``"nosign"`` (signplane after such a value)
                  or ``"signplane"``.
    margin:       room above the densest recent count of a site when sizing its packs.
    devices:      device types to pack on (CPU uses the slow NumPy reference codec).
    backend:      codec for CUDA tensors: ``"auto"`` or ``"cupy"`` (the kernels the
                  torch ops queue by pointer).
    offload:      None, True (the process's shared :class:`~.offload.Offloader`) or an
                  Offloader: clean packed blocks wait for backward in pinned host memory.

    ``stats`` (a :class:`SavedStats`) counts what was packed; ``with
    compress_saved_tensors() as c:`` binds the hooks object itself, so ``c.stats``
    can be read inside the block and after it. Save sites are counted from each
    ``with``: enter the hooks once per forward for them to learn across steps.
    """

    def __init__(self, *, min_sparsity: float = 0.5, min_numel: int = 1 << 16,
                 encoding: str = "auto", margin: float = 0.1, devices=("cuda", "cpu"),
                 backend: str = "auto", offload=None):
        from .functional import _check_backend, _check_encoding
        if not 0.0 <= float(min_sparsity) <= 1.0:
            raise ValueError(f"min_sparsity={min_sparsity} must lie in [0, 1]")
        if not float(margin) >= 0.0:
            raise ValueError(f"margin={margin!r} must be >= 0")
        _check_backend(backend, "cuda")
        self.min_sparsity = float(min_sparsity)
        self.min_numel = max(1, int(min_numel))
        self.encoding = _check_encoding(encoding)
        self.margin = float(margin)
        self.devices = tuple(devices)
        # (t.device makes an object per call: the hooks see every saved tensor)
        self._on_cuda, self._on_cpu = "cuda" in self.devices, "cpu" in self.devices
        self._stats = SavedStats()
        self._by_base = _ByBase()  # base tensor -> (version, _Packed or None)
        self._sites = Sites(self.encoding)
        self._ordinal = 0
        # (slot key, known, site, numel, block bytes, weak _Packed) of each pack whose count
        # the hooks have not taken in yet, in queue order
        self._flights = collections.deque()
        self._in_flight = 0   # bytes of the blocks in self._flights
        self._credit = 0      # bytes the clean packs still alive save
        self._alive = set()   # weak references to those packs, whose deaths release it
        self._outer = None
        self.offload = resolve_offload(offload)
        self._front = self._front_mod = None   # the C++ front's state, its module
        self._front_hooks = None               # the front's (pack, unpack), once made
        self._front_counts = False             # it counts the skips of passing sites down
        super().__init__(self._pack, self._unpack)

    @property
    def stats(self) -> SavedStats:
        if self._front is not None:   # what the C++ front did without Python
            passed, shared, unpacked, reused, tried = self._front_mod.hooks_front_take_counts(
                self._front)
            self._stats.tried += tried
            self._stats.passed += passed
            self._stats.shared += shared
            self._stats.unpacked += unpacked
            self._stats.reused += reused
        return self._stats

    @stats.setter
    def stats(self, value: SavedStats) -> None:
        if self._front is not None:
            self._front_mod.hooks_front_take_counts(self._front)
        self._stats = value

    def __enter__(self) -> "compress_saved_tensors":
        self._ordinal = 0
        # The hooks active outside ours: what we keep for backward (a packed block, or a
        # tensor we pass through) goes on to them, as if they had been given it.
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._use_front()
        super().__enter__()  # torch's returns None
        return self

    def _use_front(self) -> None:
        """Let the C++ front (:func:`.native.hooks_module`) see the saves first where it is
        built: it answers those that need no Python (``kernels/torch_host_hooks.h``).
        Decided at each ``__enter__`` (:func:`.native.python_path` turns it off)."""
        mod = native.hooks_module()
        # where other hooks enclose ours, the front hands every save to Python
        self._front_counts = mod is not None and self._outer is None
        if mod is None:
            self.pack_hook, self.unpack_hook = self._pack, self._unpack
            return
        if self._front_hooks is None or self._front_mod is not mod:
            self._front_mod = mod
            cls = type(self)
            self._front, pack, unpack = mod.hooks_front(
                self, cls._front_new, cls._pack, cls._poll, _unpack_saved,
                _Packed, _View, _Outer, CLEAN, DENSE, self.min_numel, self._on_cuda,
                self._on_cpu, list(B.TORCH_TO_BS))
            self._front_hooks = (pack, unpack)
        mod.hooks_front_enter(self._front, self._outer is not None)
        self.pack_hook, self.unpack_hook = self._front_hooks

    def _to_outer(self, t):
        return t if self._outer is None else _Outer(self._outer[0](t), self._outer[1])

    @staticmethod
    def _from_outer(x):
        return x.unpack(x.obj) if type(x) is _Outer else x

    # ------------------------------------------------------------------ pack
    def _candidate(self, t) -> bool:
        # cheapest first: most saves are parameters or small tensors
        return (type(t) in _PLAIN and t.numel() >= self.min_numel
                and not (t.requires_grad and t.is_leaf)  # parameters stay alive anyway
                and t.dtype in B.TORCH_TO_BS
                and ((t.is_cuda and self._on_cuda) or (t.is_cpu and self._on_cpu))
                and t.layout == torch.strided and t.is_contiguous())

    def _pack(self, t):
        if self._flights:
            self._poll()
        if not self._candidate(t):
            self._stats.passed += 1
            return t if self._outer is None else self._to_outer(t)
        base = t._base
        if base is None:
            base = t
        if base is not t and not (base.is_contiguous() and base.numel() == t.numel()
                                  and t.storage_offset() == base.storage_offset()):
            base = t  # a proper part of its base: pack just this view
        hit = self._by_base.get(base)
        if hit is not None and hit[0] == base._version:
            if hit[1] is None:
                self._stats.passed += 1
                return self._to_outer(t)
            return self._share(hit[1], t, base is t)
        self._ordinal += 1
        packed = self._pack_new(base, self._ordinal)
        self._by_base.put(base, base._version, packed)
        return self._keep(packed, t, base is t)

    def _keep(self, packed, t, whole: bool):
        """What autograd keeps for a save of ``t`` whose base was just looked at: ``packed``
        (None: ``t`` passes through), or a view of it."""
        if packed is None:
            self._stats.passed += 1
            return self._to_outer(t)
        return packed if whole else _View(packed, tuple(t.shape))

    def _front_new(self, base: torch.Tensor, t, ordinal: int):
        """The C++ front's call for a new base at a site that is not passing (it has taken
        in the counts that landed): ``(the pack made of base or None, what autograd keeps
        for t)``."""
        packed = self._pack_new(base, ordinal)
        if packed is not None and packed.handle is not None and self._front_counts:
            # the next saves at this site pack in C++ while the site stays as it is now
            site = packed.site
            self._front_mod.hooks_front_ready(self._front, ordinal, list(base.shape), base.dtype,
                                              base.get_device(), site, site.version,
                                              packed.plan, packed.handle, packed.nbytes)
        return packed, self._keep(packed, t, base is t)

    def _share(self, packed: _Packed, t, whole: bool):
        """A save of a base tensor already packed (the C++ front does the same itself:
        ``share`` in torch_host_hooks.h)."""
        if packed.state == DENSE:
            self._stats.passed += 1
            return self._to_outer(t)
        self._stats.shared += 1
        packed.saves += 1
        return packed if whole else _View(packed, tuple(t.shape))

    def _pack_new(self, t: torch.Tensor, ordinal: int):
        """Queue the pack of ``t`` at the capacity of its site (the ``ordinal``-th new base
        of this forward): a pending ``_Packed``, or None where ``t`` is better kept as it
        is (as far as the host knows now)."""
        site = self._sites.get((ordinal, t.shape, t.dtype))
        numel = t.numel()
        capacity = site.capacity(numel, 1.0 - self.min_sparsity, self.margin)
        if capacity is None:
            if site.skip and self._front_counts:   # the C++ front counts the skip down
                self._front_mod.hooks_front_skip(self._front, ordinal, list(t.shape), t.dtype,
                                                 site.skip)
                site.skip = 0
            return None
        cuda = t.is_cuda
        plan, mod, handle, nbytes = self._prepared(site, t, capacity)
        if nbytes >= numel * t.element_size():
            return None
        if self._in_flight and self._in_flight + nbytes > self._credit:
            self._stats.throttled += 1
            return None
        t = t.detach()    # held while the count is on its way: no autograd history
        if handle is not None:
            block, i, gen = mod.hooks_pack(handle, t)
            key, known = (i, gen), None
        else:
            block, key, known = O.pack_plain(t, plan)
        if block is None:
            return None   # no slot for its count (a graph capture, or the ring in flight)
        packed = _Packed(self, site, block, plan, handle, key, known, t,
                         torch_stream(t.get_device()) if cuda else None, nbytes)
        self._flights.append((key, known, site, numel, nbytes, weakref.ref(packed)))
        if len(self._flights) == 1:
            self._tell_head()
        self._in_flight += nbytes
        self._stats.tried += 1
        if known is not None:
            self._poll()   # a host pack's count is known at once
        return None if packed.state == DENSE else packed

    @staticmethod
    def _prepared(site, t: torch.Tensor, capacity: int):
        """``(plan, extension, handle, block bytes)`` of a pack of ``t`` at ``capacity``,
        kept on its site: step after step a site packs at the same capacity, on the same
        device and path, and the lookups by plan cost more than the pack's own Python."""
        mod = native._module_for(t)
        key = (capacity, site.encoding, t.get_device(), mod)
        prep = site.prepared
        if prep is None or prep[0] != key:
            plan = O.plain_plan(t.shape, t.dtype, capacity, int(site.encoding))
            mod, handle = native.plain_handle(t, plan)   # queued from C++ where it is built
            prep = site.prepared = (key, plan, mod, handle,
                                    O.plain_block_bytes(plan, t.is_cuda or handle is not None))
        return prep[1:]

    def _poll(self, forward: bool = True) -> None:
        """Take in every count that has landed, in queue order (no CUDA call). In backward
        (``forward`` False) a clean block stays where it is: its backward comes soon."""
        taken = False
        while self._flights:
            key, known, site, numel, nbytes, ref = self._flights[0]
            state = _landed(key, known)
            if state is None:
                break
            self._flights.popleft()
            taken = True
            self._in_flight -= nbytes
            if state is not LOST:
                site.observe(state[0], state[1], numel)
            packed = ref()
            if packed is not None and packed.state == PENDING:
                self._settle(packed, state, forward)
        if taken:
            self._tell_head()

    def _tell_head(self) -> None:
        """Show the C++ front the oldest pack in flight: it looks at that pack's pinned slot
        at every save and calls :meth:`_poll` once the count is there (or never can be)."""
        if not self._front_counts:
            return
        if not self._flights:
            head = (0, 0, 0)
        else:
            (i, gen), known = self._flights[0][:2]
            if known is None and 0 <= i < C.SLAB.total:
                head = (C.SLAB.base() + 16 * i, C.SLAB.generations + 8 * i, gen)
            else:   # a count known on the host: Python looks
                head = (-1, 0, 0)
        self._front_mod.hooks_front_head(self._front, *head)

    def _settle(self, packed: _Packed, state, forward: bool = False) -> None:
        """Keep the packed block of a clean pack, else the dense tensor; ``forward``: its
        backward is still to come (the block may go to the offloader)."""
        status = state[0]
        if status == 0:
            dense = packed.held.numel() * packed.held.element_size()
            saving = dense - packed.nbytes
            packed.held, packed.state = None, CLEAN
            packed.block = self._keep_block(packed.block, forward)
            self._credit += saving
            # a weak reference with a callback: far cheaper per pack than weakref.finalize
            self._alive.add(weakref.ref(packed, functools.partial(self._release, saving)))
            self._stats.packed += 1
            self._stats.dense_bytes += dense
            self._stats.packed_bytes += packed.nbytes
            return
        self._keep_dense(packed, offer=True)
        if status is not None:
            self._stats.overflowed += bool(status & abi.STATUS_OVERFLOW)
            self._stats.violations += bool(status & abi.STATUS_NOSIGN_VIOLATION)

    def _keep_block(self, block: torch.Tensor, forward: bool):
        """A clean block as the hooks hold it: with the offloader (its count landed, so
        its pack has run), else with the enclosing hooks."""
        if (self.offload is None or not forward
                or (block.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self._to_outer(block)
        return _Offloaded(self.offload.stash(block))

    def _keep_dense(self, packed: _Packed, offer: bool = False) -> None:
        """Drop the block; ``offer``: hand the dense tensor on to the enclosing hooks
        (unless it was modified in place since it was saved: unpack then raises)."""
        packed.block, packed.state = None, DENSE
        if offer and packed.held._version == packed.version:
            packed.held = self._to_outer(packed.held)
        self._stats.kept_dense += 1

    def _release(self, saving: int, ref) -> None:
        """A clean pack died: what it saved is no longer credit."""
        self._alive.discard(ref)
        self._credit -= saving

    # ---------------------------------------------------------------- unpack
    def _unpack(self, obj):
        # The C++ front decodes a clean pack, or reuses this backward's decode, itself
        # (torch_host_hooks.h, unpack_here): the two keep the same rules.
        cls = type(obj)
        if cls is _View:
            return self._unpack(obj.base).view(obj.shape)
        if cls is not _Packed:       # passed through (to the enclosing hooks, if any)
            return self._from_outer(obj)
        if self._flights:
            self._poll(forward=False)
        if obj.state == PENDING:
            self._unpack_pending(obj)
        if obj.state == DENSE:
            if type(obj.held) is _Outer:
                return self._from_outer(obj.held)
            if obj.held._version != obj.version:
                raise SavedTensorModifiedError(
                    f"a {obj.dtype} tensor of shape {obj.shape} saved for backward was "
                    "modified in place after it was saved (and its packed copy overflowed)")
            return obj.held
        alive = obj.unpacked() if obj.unpacked is not None else None
        if alive is not None:
            self._stats.reused += 1
            obj.to_unpack -= 1
            if obj.to_unpack <= 0:    # the last node of this backward has it: hold no more
                obj.keep = None
            return alive
        if type(obj.block) is _Offloaded:
            # back on the device ahead of this backward; held there for any later
            # backward through the graph (retain_graph) until autograd frees it
            obj.block = obj.block.stashed.take()
        block = self._from_outer(obj.block)
        reader = None if obj.stream is None else torch_stream(block.get_device())
        if reader is not None and obj.stream != reader:
            # read on another stream than it was made on: after the pack's kernels, and
            # not reused by the allocator before this read
            stream_wait(reader, obj.stream, block.get_device())
            block.record_stream(torch.cuda.current_stream(block.device))
        t = None if obj.handle is None else native.plain_unpack(block, obj.handle, obj.shape,
                                                                  obj.dtype)
        if t is None:
            t = O._unpack(block, obj.plan, obj.shape, obj.dtype)
        self._stats.unpacked += 1
        obj.unpacked = weakref.ref(t)
        # Held until every other node that saved it has unpacked it (a later unpack of this
        # backward reuses it): one decode, and no longer alive than plain's dense tensor.
        obj.to_unpack = obj.saves - 1
        obj.keep = t if obj.to_unpack > 0 else None
        return t

    def _unpack_pending(self, obj: _Packed) -> None:
        """Backward came before the count: use the dense tensor held (its count still
        teaches the site when it lands); only when that was modified in place since is
        the count waited for on the host (no CUDA call), the packed copy being exact.
        Either way the pack came too late to save anything: its site passes through for a
        while."""
        obj.site.late()
        if obj.held._version == obj.version:
            self._stats.pending_at_unpack += 1
            self._keep_dense(obj)
            return
        state = obj.known or C.SLAB.wait_slot(*obj.key)
        self._settle(obj, LOST if state is None else state)


def _unpack_saved(obj):
    """The C++ front's unpack of what it leaves to Python: a pack or a view of one that is
    not a clean decode on its stream (their hooks unpack them), or what enclosing hooks
    keep."""
    cls = type(obj)
    if cls is _Outer:
        return compress_saved_tensors._from_outer(obj)
    return (obj.base if cls is _View else obj).owner._unpack(obj)
