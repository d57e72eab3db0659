"""compress_saved_tensors: pack what autograd saves, for any eager model.

A ``torch.autograd.graph.saved_tensors_hooks`` pair: every tensor autograd
saves for backward passes through ``pack``; a float tensor that is large and
sparse enough is replaced by its packed form, anything else is returned as is.
``unpack`` rebuilds the exact tensor (bit for bit) and may run any number of
times (``retain_graph``, several nodes saving the same tensor).

A tensor saved by several nodes (ReLU saves its output, the next matmul saves
the same tensor or a reshaped view of it) is packed once: packs are shared by
the base tensor they were made from while that tensor is alive and unmodified.
Unpacks are shared the same way: while one unpacked tensor is alive, every other
unpack of the same pack returns it (or a view), so no two dense copies of one
saved tensor exist at once where plain PyTorch holds one.
Deciding "worth packing" counts the nonzeros, one host sync per candidate.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..spec import format as _fmt
from . import _bridge as B


@dataclasses.dataclass
class SavedStats:
    """What the hooks did so far: counts and bytes (dense = bytes the packed tensors replace)."""
    packed: int = 0
    passed: int = 0
    shared: int = 0
    unpacked: int = 0
    reused: int = 0          # unpacks answered by a dense tensor still alive
    dense_bytes: int = 0
    packed_bytes: int = 0


class _Packed:
    """A packed saved tensor: the PackedTensor, its plane tensors, and how to view it back."""

    __slots__ = ("p", "planes", "dtype", "device", "shape", "stream", "backend", "dense")

    def __init__(self, p, planes, dtype, device, shape, stream, backend):
        self.p, self.planes, self.dtype = p, planes, dtype
        self.device, self.shape, self.stream, self.backend = device, shape, stream, backend
        self.dense = None    # weak reference to the last unpacked tensor


class _View:
    """A saved view of a packed base tensor: unpack the base, view it as the saved shape."""

    __slots__ = ("base", "shape")

    def __init__(self, base: _Packed, shape):
        self.base, self.shape = base, shape


class compress_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager packing saved activations of any eager model.

    min_sparsity: pack only if at least this fraction of the elements are zero bit patterns.
    min_numel:    pack only tensors with at least this many elements.
    encoding:     ``"auto"`` (nosign when no stored value has its sign bit set, else raw),
                  ``"raw"``, ``"nosign"`` (falls back to ``signplane`` for signed data) or
                  ``"signplane"``.
    devices:      device types to pack on (CPU uses the slow NumPy reference codec).
    backend:      bitsparse_core backend for CUDA tensors (``"auto"``: the first available).

    ``stats`` (a :class:`SavedStats`) counts what was packed; ``with
    compress_saved_tensors() as c:`` binds the hooks object itself, so ``c.stats``
    can be read inside the block and after it.
    """

    def __init__(self, *, min_sparsity: float = 0.5, min_numel: int = 1 << 16,
                 encoding: str = "auto", devices=("cuda", "cpu"), backend: str = "auto"):
        from .functional import _check_encoding
        if not 0.0 <= float(min_sparsity) <= 1.0:
            raise ValueError(f"min_sparsity={min_sparsity} must lie in [0, 1]")
        self.min_sparsity = float(min_sparsity)
        self.min_numel = max(1, int(min_numel))
        self.encoding = _check_encoding(encoding)
        self.devices = tuple(devices)
        self.backend = backend
        self.stats = SavedStats()
        self._by_base = WeakIdKeyDictionary()  # base tensor -> (version, _Packed)
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "compress_saved_tensors":
        super().__enter__()  # torch's returns None
        return self

    # ------------------------------------------------------------------ pack
    def _candidate(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and t.dtype in B.TORCH_TO_BS
                and t.layout == torch.strided and t.device.type in self.devices
                and t.numel() >= self.min_numel and t.is_contiguous()
                and not (t.is_leaf and t.requires_grad)  # parameters stay alive anyway
                and type(t) in (torch.Tensor, torch.nn.Parameter))

    def _pack(self, t):
        if not self._candidate(t):
            self.stats.passed += 1
            return t
        base = t._base if t._base is not None else t
        if base is not t and not (base.is_contiguous() and base.numel() == t.numel()
                                  and t.storage_offset() == base.storage_offset()):
            base = t  # a proper part of its base: pack just this view
        hit = self._by_base.get(base)
        if hit is not None and hit[0] == base._version:
            self.stats.shared += 1
            return hit[1] if base is t else _View(hit[1], tuple(t.shape))
        packed = self._pack_dense(base.detach())
        if packed is None:
            self.stats.passed += 1
            return t
        self._by_base[base] = (base._version, packed)
        return packed if base is t else _View(packed, tuple(t.shape))

    def _pack_dense(self, t):
        """Pack ``t`` if it is worth it, else None."""
        d = B.bs_dtype(t.dtype)
        bits = B.bits_view(t)
        counts = torch.stack([torch.count_nonzero(bits), torch.count_nonzero(bits < 0)])
        nnz, negative = (int(v) for v in counts.tolist())
        numel = t.numel()
        if numel - nnz < self.min_sparsity * numel:
            return None
        enc = self.encoding
        if enc in ("auto", "nosign") and negative:
            enc = "raw" if enc == "auto" else "signplane"
        elif enc == "auto":
            enc = "nosign"
        size = _fmt.packed_size(t.shape, d, enc, nnz)
        if size >= numel * d.itemsize:
            return None
        call = B.Call(t.device, self.backend)
        obj, dt = B.export(t)
        p = call.backend.pack(obj, dtype=dt, encoding=enc, capacity=nnz,
                              chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, **call.kwargs)
        owners = call.owners()
        planes = B.planes_as_torch(p, owners)
        skel = B.skeleton(p)
        # Packed at capacity = the nnz counted above, with nosign only where no value has its
        # sign bit set: neither overflow nor a nosign violation can occur, so the pending
        # device counters need not be read back (that would sync at every unpack).
        skel._nnz, skel.status = nnz, None
        p = B.rebuild(skel, planes)  # the planes now own nothing but torch memory
        self.stats.packed += 1
        self.stats.dense_bytes += numel * d.itemsize
        self.stats.packed_bytes += sum(x.numel() * x.element_size() for x in planes)
        return _Packed(p, planes, t.dtype, t.device, tuple(t.shape), call.stream,
                       call.backend.name)

    # ---------------------------------------------------------------- unpack
    def _unpack(self, obj):
        if isinstance(obj, _View):
            return self._unpack(obj.base).view(obj.shape)
        if not isinstance(obj, _Packed):
            return obj
        alive = obj.dense() if obj.dense is not None else None
        if alive is not None:
            self.stats.reused += 1
            return alive
        call = B.Call(obj.device, obj.backend)
        B.keep_alive_on_stream(obj.planes, call, obj.stream)
        arr = call.backend.unpack(obj.p, **call.kwargs)
        self.stats.unpacked += 1
        t = B.as_torch(arr, obj.dtype, obj.shape, call.owners())
        obj.dense = weakref.ref(t)
        return t
