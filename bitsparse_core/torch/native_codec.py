"""The public codec ops on torch CUDA tensors, through the C++ host path.

:func:`bitsparse_core.pack`, ``relu_pack``, ``masked_pack``, ``unpack``, ``relu_backward``,
``relu2_backward`` and ``gated_backward`` cost tens of microseconds of host time per call
on the CuPy backend's Python path (``bench/results/host_overhead*.md``), most of it in
the steps between the arguments and the launch: describing the tensor, allocating,
filling the argument record, the ctypes launch. For torch CUDA tensors under torch's
defaults (no ``stream=``, ``allocator=`` or ``dtype=``; for packs a fixed ``capacity``
and an explicit encoding; the CuPy backend, asked for or chosen by ``"auto"``) those
steps run in the torch adapter's C++ extension (:mod:`.native`,
``kernels/torch_host_public.h``) instead: one call allocates from torch's caching
allocator and queues the launch from a template built here once per layout, from the
same argument records (:mod:`..backends.cuda.host`) the Python path fills. So the
kernels, their arguments and the bits are the CuPy backend's, and so are the results:
a :class:`~bitsparse_core.PackedTensor` of the CuPy backend whose planes view one torch
allocation, dense results as :class:`~..backends.cuda.interop.CudaArray`.

Each function here returns None where the call is not one it takes (another backend's
packed tensor, a check that fails, a layout the templates do not cover, the extension
off or not built); the caller then runs the backend's Python path, which also raises
the named errors. Nothing here waits for the GPU: a fixed-capacity pack's overflow is
read as on the Python path, by :meth:`PackedTensor.check` when an op reads the values.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..packed import PackedTensor
from ..backends import get_backend, select_backend
from ..backends.cuda import abi, host, protocol
from ..backends.cuda import interop as ci
from ..backends.cuda.abi import Mode, Op
from ..spec import format as _fmt
from ..spec.format import DEFAULT_CHUNK_LOG2, Encoding
from ..spec.ops import masked_encoding
from . import _bridge, native

_OFFSET_DTYPES = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
_U8, _I32 = np.dtype(np.uint8), np.dtype(np.int32)
_MAX_ENTRIES = 4096        # distinct calls remembered (shapes that never repeat: start afresh)
_lock = threading.Lock()


# --------------------------------------------------------------------------- #
# Unpack templates: host.py's records, planes and pointers left to the call  #
# --------------------------------------------------------------------------- #
_PLANE_PATCHES = tuple((name, name, None, False) for name in
                       ("mask", "mask_len", "offsets", "values", "values_len", "signs",
                        "signs_len"))
_U_PATCHES = tuple((name, name, None, False) for name in
                   ("uvalues", "uvalues_len", "usigns", "usigns_len"))
_OUT_PATCHES = native._UNPACK_PATCHES     # g, out, out2: as the FFN op's unpacks


def unpack_template(lay: _fmt.Layout, op: Op, u_encoding: Optional[Encoding], device: int):
    """An unpack-family kernel over packed tensors of ``lay``'s dtype, encoding, size and
    chunks (any capacity: the planes' addresses and lengths are a call's), as
    ``host.enqueue_unpack`` queues it; ``u_encoding``: gated's u (sharing the mask).
    None where the op needs a prefix scan (chunks longer than its tile)."""
    gated = u_encoding is not None
    L = host._unpack_launch(lay, op, int(u_encoding) if gated else 0, device)
    if L.prefix_bytes:
        return None
    r = native._copy(L.args)
    r.off64, r.prefix, r.ud, r.ud_aligned = int(lay.offset_width == 8), 0, 0, True
    for name, *_ in _PLANE_PATCHES + _U_PATCHES + _OUT_PATCHES:   # each call's own
        setattr(r, name, 0)
    patches = _PLANE_PATCHES + _OUT_PATCHES + (_U_PATCHES if gated else ())
    return native.launch_template(L.func, L.n_tiles, 0, False, r, (), patches)


def mask_select_template(lay: _fmt.Layout, device: int) -> tuple:
    """ReLU's mask-only gradient (``host.enqueue_relu_backward``)."""
    func, grid = host.mask_select_launch(lay, device)
    r = abi.MaskSelectArgs()
    r.numel = lay.numel
    return native.launch_template(func, grid, 0, False, r, (),
                                  _PLANE_PATCHES[:2] + _OUT_PATCHES[:2])


# --------------------------------------------------------------------------- #
# What one kind of call needs, made on its first use                          #
# --------------------------------------------------------------------------- #
class _Pack(NamedTuple):
    """A pack call's template id and plan, and what its PackedTensor is made of."""
    launch: int
    plan: host.PackPlan
    dense_bytes: int       # relu_pack's activation (with the scratch behind it), else 0
    meta: tuple            # the PackedTensor's shape, dtype, encoding, chunk_log2, capacity
    # the planes in the block: mask, offsets (offset, count, dtype), values, signs
    # (offset, bytes), the status word's offset (-1: none, the encoding is not nosign)
    spans: tuple


_MISSING = object()


def _remember(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on a miss (None: the call is not taken)."""
    entry = cache.get(key, _MISSING)
    if entry is _MISSING:
        with _lock:
            if len(cache) >= _MAX_ENTRIES:     # shapes or counts that never repeat
                _forget()
            entry = cache[key] = make()
    return entry


def _forget() -> None:
    """Drop every entry and the extension's templates with them (their ids go)."""
    _PACKS.clear()
    _UNPACKS.clear()
    for mod in {native._emulation, native._cuda} - {None}:
        mod.forget_public_launches()


def _add(mod, template):
    """The extension's id of a new template, or None (none made; the table full)."""
    if template is None:
        return None
    launch = mod.add_public_launch(template)
    return launch if launch >= 0 else None


def _pack_entry(mod, shape, tdtype, encoding, capacity, mode, device):
    bs_dtype = _bridge.TORCH_TO_BS.get(tdtype)
    if bs_dtype is None or isinstance(encoding, str) and encoding.lower() == "auto":
        return None
    # checks capacity and encoding as the Python path does (its named errors)
    plan, _, _ = protocol._first_plan(tuple(shape), bs_dtype, encoding, DEFAULT_CHUNK_LOG2,
                                      capacity, mode)
    lay = plan.lay
    if lay.numel == 0:
        return None
    # the pack as the CuPy backend queues it at a fixed capacity: the tail zeroed
    launch = _add(mod, native.pack_template(plan, device, zero_tail=True))
    if launch is None:
        return None
    dense = _fmt.align(lay.numel * bs_dtype.itemsize, 16) if mode in (Mode.RELU, Mode.RELU2) else 0
    odt = _OFFSET_DTYPES[lay.offset_width]
    (mo, ml), (oo, ol), (vo, vl), (so, sl) = plan.spans
    status = plan.status_offset if lay.encoding == Encoding.NOSIGN else -1
    return _Pack(launch, plan, dense, (tuple(shape), bs_dtype, lay.encoding, lay.chunk_log2,
                                       lay.capacity),
                 (mo, ml, oo, ol // odt.itemsize, odt, vo, vl, so, sl, status))


def _packed(e: _Pack, block: torch.Tensor, s: int, dev: int, mask=None, offsets=None,
            nnz=None, extra=None) -> PackedTensor:
    """The CuPy backend's PackedTensor of a block (what its ``_packed`` makes of a block of
    its own); ``mask`` and ``offsets``: a masked pack's, the mask tensor's planes."""
    at, Plane = block.data_ptr(), ci.DevicePlane
    mo, ml, oo, on, odt, vo, vl, so, sl, st = e.spans
    if mask is None:
        mask, offsets = Plane(at + mo, ml, _U8, dev, block, s), Plane(at + oo, on, odt, dev,
                                                                      block, s)
    ex = {"stream": s, "torch": True}
    if extra:
        ex.update(extra)
    return PackedTensor(*e.meta, mask, offsets, Plane(at + vo, vl, _U8, dev, block, s),
                        Plane(at + so, sl, _U8, dev, block, s), _cupy, ("cuda", dev), nnz,
                        Plane(at + st, 1, _I32, dev, block, s) if st >= 0 else None, ex)


_PACKS: dict = {}
_UNPACKS: dict = {}
_cupy = None              # the CuPy backend object every packed tensor here names


def _path(t):
    """``(extension, device, stream)`` of a call on the torch tensor ``t``: its CUDA device
    and torch's current stream there; under :func:`.native.emulate_on_host`, host tensors
    (device 0, stream 0). None where this path does not run."""
    if native._off or not isinstance(t, torch.Tensor):
        return None
    if t.is_cuda:
        return _cuda_path(t.get_device())
    mod = native._emulation
    return None if mod is None else (mod, 0, 0)


def _cuda_path(dev: int):
    """:func:`_path` on cuda:``dev`` (None without the built extension)."""
    mod = native._cuda or native.cuda_module()
    return None if mod is None else (mod, dev, ci.torch_stream(dev))


# --------------------------------------------------------------------------- #
# The ops (each: the result, or None for the Python path)                     #
# --------------------------------------------------------------------------- #
def pack(x, encoding, capacity: int, mode: Mode = Mode.PACK):
    """``bitsparse_core.pack(x, encoding=, capacity=)`` (and relu_pack's pack: ``mode``)."""
    path = _path(x)
    if path is None or not x.is_contiguous():
        return None
    mod, dev, s = path
    try:
        e = _remember(_PACKS, (mode, x.shape, x.dtype, encoding, capacity, dev),
                      lambda: _pack_entry(mod, x.shape, x.dtype, encoding, capacity, mode, dev))
    except TypeError:       # an unhashable encoding: the Python path names the error
        return None
    if e is None:
        return None
    plan = e.plan
    made = mod.public_pack(e.launch, x, plan.nbytes, plan.scratch_bytes, e.dense_bytes, None, s)
    if made is None:        # its template forgotten meanwhile (another thread's reset)
        return None
    block, dense = made
    p = _packed(e, block, s, dev)
    if dense is None:
        return p
    return ci.CudaArray(dense.data_ptr(), e.meta[0], e.meta[1], dev, dense, s), p


def relu_pack(a, square: bool, encoding, capacity: int):
    """``bitsparse_core.relu_pack(a, square=, encoding=, capacity=)``: ``(y, p)``."""
    return pack(a, encoding, capacity, Mode.RELU2 if square else Mode.RELU)


def _packed_input(p, dev: int, s: int, values: bool):
    """``p``'s planes when this path takes it (a CuPy-made packed tensor of torch data on
    ``dev``), ordered after its producer and checked as ``CupyBackend._ready`` does."""
    if type(p) is not PackedTensor or p.backend is not _cupy or p.device[1] != dev:
        return None
    extra = p.extra
    if not extra.get("torch"):
        return None
    producer = extra.get("stream", s)
    if producer != s:
        ci.stream_wait(s, producer, dev)
    # check() reads nothing where the count is known and no status word is pending
    if values and (p.status is not None or p._nnz is None or p._nnz > p.capacity):
        p.check()
    return _planes_of(p)


def _dense_like(t, p) -> bool:
    """``t`` may stand for a dense argument (grad, u, out) of ``p``'s shape and dtype."""
    return (type(p) is PackedTensor and isinstance(t, torch.Tensor) and t.is_contiguous()
            and _bridge.TORCH_TO_BS.get(t.dtype) is p.dtype and t.shape == p.shape)


def masked_pack(u, p_mask, encoding):
    """``bitsparse_core.masked_pack(u, p_mask, encoding=)``."""
    path = _path(u)
    if path is None or not _dense_like(u, p_mask):
        return None
    mod, dev, s = path
    planes = _packed_input(p_mask, dev, s, values=False)
    if planes is None:
        return None
    nnz = p_mask.nnz                    # known after an exact pack; else one sync (as in Python)
    enc = masked_encoding(encoding)     # "auto" is signplane here: no wait
    e = _remember(_PACKS, (Mode.MASKED, u.shape, u.dtype, enc, nnz, dev),
                  lambda: _pack_entry(mod, u.shape, u.dtype, enc, nnz, Mode.MASKED, dev))
    if e is None:
        return None
    made = mod.public_pack(e.launch, u, e.plan.nbytes, e.plan.scratch_bytes, 0, planes, s)
    if made is None:
        return None
    return _packed(e, made[0], s, dev, mask=p_mask.mask, offsets=p_mask.offsets, nnz=nnz,
                   extra={"shares_mask": True})


class _Unpack(NamedTuple):
    """An unpack-family call's template id and the bytes of its dense result."""
    launch: int
    out_bytes: int


def _unpack_entry(mod, p, op: Optional[Op], u_enc, dev: int):
    template = (mask_select_template(p.layout, dev) if op is None
                else unpack_template(p.layout, op, u_enc, dev))
    launch = _add(mod, template)
    return None if launch is None else _Unpack(launch, p.numel * p.dtype.itemsize)


def _unpack_launch(mod, p, op: Optional[Op], dev: int, p_u=None):
    """The :class:`_Unpack` of ``op`` (None: ReLU's mask-only gradient) over ``p``, or None."""
    u_enc = p_u.encoding if p_u is not None else None
    return _remember(_UNPACKS, (p.shape, p.dtype, p.encoding, p.chunk_log2, op, u_enc, dev),
                     lambda: _unpack_entry(mod, p, op, u_enc, dev))


def _unpack_op(path, p, op: Optional[Op], g, out):
    """One unpack-family launch over ``p`` (``op`` None: ReLU's mask-only gradient) on
    ``path`` (:func:`_path`), with the gradient ``g`` and ``out`` (None: a new result),
    torch tensors or None."""
    if path is None:
        return None
    mod, dev, s = path
    planes = _packed_input(p, dev, s, values=op is not None)
    if planes is None:
        return None
    e = _unpack_launch(mod, p, op, dev)
    if e is None:
        return None
    made = mod.public_unpack(e.launch, dev, planes, None, g.data_ptr() if g is not None else 0,
                             out.data_ptr() if out is not None else 0, e.out_bytes, 0, s)
    if made is None or made is True:    # forgotten meanwhile (nothing queued) / out= written
        return None if made is None else out
    return ci.CudaArray(made.data_ptr(), p.shape, p.dtype, dev, made, s)


def _packed_path(p):
    """:func:`_path` of a call on a packed tensor alone (``unpack`` without ``out=``): its
    device, where this path made it or the CuPy backend made it from torch data."""
    if native._off or type(p) is not PackedTensor or p.backend is not _cupy \
            or not p.extra.get("torch"):
        return None
    mod = native._emulation
    return (mod, 0, 0) if mod is not None else _cuda_path(p.device[1])


def unpack(p, out):
    """``bitsparse_core.unpack(p, out=)``."""
    if out is None:
        return _unpack_op(_packed_path(p), p, Op.UNPACK, None, None)
    if not _dense_like(out, p):
        return None
    return _unpack_op(_path(out), p, Op.UNPACK, None, out)


def relu_backward(grad, p):
    """``bitsparse_core.relu_backward(grad, p)``."""
    return _unpack_op(_path(grad), p, None, grad, None) if _dense_like(grad, p) else None


def relu2_backward(grad, p):
    """``bitsparse_core.relu2_backward(grad, p)``."""
    return _unpack_op(_path(grad), p, Op.RELU2, grad, None) if _dense_like(grad, p) else None


def gated_backward(grad, p_r, p_u):
    """``bitsparse_core.gated_backward(grad, p_r, p_u)`` where the two share a mask."""
    if not _dense_like(grad, p_r) or type(p_u) is not PackedTensor or p_u.shape != p_r.shape \
            or p_u.dtype is not p_r.dtype:
        return None
    path = _path(grad)
    if path is None:
        return None
    mod, dev, s = path
    pu = _packed_input(p_u, dev, s, values=True)      # every packed input checked
    pr = _packed_input(p_r, dev, s, values=True) if pu is not None else None
    if pr is None or (pu.mask, pu.offsets) != (pr.mask, pr.offsets):
        return None
    e = _unpack_launch(mod, p_r, Op.GATED, dev, p_u)
    if e is None:
        return None
    half = _fmt.align(e.out_bytes, 16)     # both results in one allocation
    made = mod.public_unpack(e.launch, dev, pr, pu, grad.data_ptr(), 0, 2 * half, half, s)
    if made is None:
        return None
    at, shape, dtype = made.data_ptr(), p_r.shape, p_r.dtype
    return (ci.CudaArray(at, shape, dtype, dev, made, s),
            ci.CudaArray(at + half, shape, dtype, dev, made, s))


def _planes_of(p):
    from ..backends.cupy.backend import planes_of
    global _planes_of
    _planes_of = planes_of
    return planes_of(p)


# --------------------------------------------------------------------------- #
# Taking the calls                                                            #
# --------------------------------------------------------------------------- #
BACKENDS = ("auto", "cupy")     # the backend= values this path stands in for


def attach() -> bool:
    """Have the public ops send the calls above here (once CuPy is the CUDA backend and
    the extension is not switched off); True if they do."""
    global _cupy
    import bitsparse_core as bc
    if native.setting() == "off":
        return False
    try:
        cupy_backend = get_backend("cupy")
        if not cupy_backend.is_available() or select_backend("auto", "cuda") is not cupy_backend:
            return False
    except Exception:  # noqa: BLE001 - no CuPy or no CUDA: the Python path, as before
        return False
    _cupy = cupy_backend
    bc._native_codec = _NativeCodec
    return True


class _NativeCodec:
    """What ``bitsparse_core`` calls (a namespace: the functions above)."""
    backends = BACKENDS
    pack = staticmethod(pack)
    relu_pack = staticmethod(relu_pack)
    masked_pack = staticmethod(masked_pack)
    unpack = staticmethod(unpack)
    relu_backward = staticmethod(relu_backward)
    relu2_backward = staticmethod(relu2_backward)
    gated_backward = staticmethod(gated_backward)
