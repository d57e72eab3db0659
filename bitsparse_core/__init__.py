"""bitsparse_core: lossless bitmask + values storage for sparse (ReLU) activations.

The codec contract, for every backend:

* ``pack(x)`` takes any DLPack producer (NumPy, torch, JAX, CuPy) holding a
  C-contiguous bf16 / fp16 / fp32 / fp8-e4m3fn / fp8-e5m2 tensor and returns a
  :class:`PackedTensor` whose planes are byte-identical, on every backend, to
  the NumPy reference codec's. Packing is lossless at the bit level: -0.0, NaN
  payloads, infinities and subnormals all round-trip.
* ``unpack(p)`` returns the dense tensor, bit for bit, as an array on the
  tensor's device that exports through DLPack; ``unpack(p, out=y)`` writes
  into ``y`` instead.
* ``PackedTensor.to_bytes()`` / ``from_bytes()`` serialize to the format of
  ``docs/format.md``; ``validate(buf)`` checks every rule of that spec and
  raises the rule's named error (see :mod:`bitsparse_core.errors`).
* Nothing is ever silently copied between devices, silently made contiguous,
  or silently truncated: those are errors.
* On torch CUDA tensors (and packed tensors made from them) the GPU functions
  behave as torch's own ops: ``stream=None`` is torch's current stream and
  memory comes from torch's caching allocator, unless ``stream=`` /
  ``allocator=`` say otherwise. Anything else defaults to CuPy's current stream
  and memory pool. Such calls under torch's defaults (and, for packs, a fixed
  capacity and an explicit encoding) take the torch adapter's C++ host path
  (``torch/native_codec.py``): the CuPy backend's kernels, records and results,
  with a few microseconds of host time per call instead of tens.
"""

from __future__ import annotations

import sys

from . import dtypes, errors
from .backends import (backend_available, get_backend, register_backend, registered_backends,
                       select_backend)
from .dlpack import device_of
from .errors import *  # noqa: F401,F403  (the named errors are part of the API)
from .packed import PackedTensor
from .spec import format
from .spec.codec import from_bytes
from .spec.format import DEFAULT_CHUNK_LOG2, Encoding, layout, packed_size
from .spec.serialize import validate

__version__ = "0.1.0"

_TORCH_MADE = "torch"     # PackedTensor.extra key: packed from torch CUDA data


def _torch_device(x) -> int:
    """The CUDA device index of a torch CUDA tensor (or of a packed tensor made from
    one), else -1; never imports torch."""
    if isinstance(x, PackedTensor):
        return x.device[1] if x.extra.get(_TORCH_MADE) else -1
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        return x.get_device()
    return -1


_interop = None     # backends.cuda.interop, imported on the first torch CUDA call
# The torch adapter's C++ host path of these ops for torch CUDA data under torch's defaults
# (bitsparse_core/torch/native_codec.py), attached on the first torch CUDA call: each op
# sends it the calls it takes and runs the backend's Python path for the rest.
_native_codec = None
_native_tried = False


def _attach_native() -> None:
    """Import the torch adapter's C++ host path (once): it attaches ``_native_codec`` and
    has an exact pack of torch CUDA data wait for its count and shrink natively
    (``backends/cuda/shrink.py``); the extension itself is built or loaded on first use."""
    global _native_tried
    _native_tried = True
    try:
        from .torch import native_codec
    except ImportError:     # a torch the adapter cannot use: the Python path runs
        return
    except Exception as exc:  # noqa: BLE001 - the adapter broken: say so, keep the Python path
        import logging
        logging.getLogger("bitsparse_core").warning(
            "bitsparse: the torch adapter could not be imported (%s: %s); the public ops run "
            "their Python host path", type(exc).__name__, exc)
        return
    native_codec.attach()


def _context(x, stream, allocator):
    """``(stream, allocator, torch device or -1)`` of a GPU call on ``x``: torch's
    current stream and caching allocator for torch data where the caller named none."""
    dev = _torch_device(x)
    if dev >= 0:
        if not _native_tried:
            _attach_native()
        if stream is None or allocator is None:
            global _interop
            if _interop is None:
                from .backends.cuda import interop as _interop
            stream, allocator = _interop.torch_defaults(dev, stream, allocator)
    return stream, allocator, dev


def _mark(p: PackedTensor, torch_dev: int) -> PackedTensor:
    if torch_dev >= 0:
        p.extra[_TORCH_MADE] = True     # its unpack-family ops default as torch's would
    return p


def pack(x, *, encoding="auto", backend: str = "auto", chunk_log2: int = DEFAULT_CHUNK_LOG2,
         capacity=None, dtype=None, stream=None, allocator=None) -> PackedTensor:
    """Pack ``x`` losslessly.

    encoding:   ``"raw"``, ``"nosign"`` (every stored sign bit must be 0, as for
                ReLU outputs), ``"signplane"``, or ``"auto"`` (nosign when legal,
                else raw).
    backend:    a registered backend name, or ``"auto"`` (the first available for
                the input's device; CPU inputs use the NumPy reference).
    capacity:   None packs exactly. An int packs into a fixed number of value
                slots; a GPU backend then needs no host sync. Overflow keeps the
                first ``capacity`` values and is reported by ``p.check()`` (and by
                ``unpack``), never silently.
    dtype:      reinterpret an integer tensor's bits as this dtype (for
                frameworks that cannot export bf16/fp8 through DLPack).
    stream:     the CUDA stream to run on (GPU backends; DLPack stream rules;
                None: torch's current stream for a torch tensor, else CuPy's).
    allocator:  where device memory comes from (GPU backends; None: torch's
                caching allocator for a torch tensor, else CuPy's pool).
    """
    fast = _native_codec
    if (fast is not None and type(capacity) is int and stream is None and allocator is None
            and dtype is None and chunk_log2 == DEFAULT_CHUNK_LOG2 and backend in fast.backends):
        p = fast.pack(x, encoding, capacity)
        if p is not None:
            return p
    device, _ = device_of(x)
    be = select_backend(backend, device)
    stream, allocator, tdev = _context(x, stream, allocator)
    return _mark(be.pack(x, dtype=dtype, encoding=encoding, chunk_log2=chunk_log2,
                         capacity=capacity, stream=stream, allocator=allocator), tdev)


def unpack(p: PackedTensor, out=None, *, stream=None, allocator=None):
    """The dense tensor of ``p``, bit-exact; on ``p``'s device, DLPack-exportable."""
    fast = _native_codec
    if fast is not None and stream is None and allocator is None:
        y = fast.unpack(p, out)
        if y is not None:
            return y
    if not isinstance(p, PackedTensor):
        raise TypeError(f"unpack takes a PackedTensor, not {type(p).__name__}; "
                        "use PackedTensor.from_bytes for serialized buffers")
    stream, allocator, _ = _context(p if out is None else out, stream, allocator)
    return p.backend.unpack(p, out=out, stream=stream, allocator=allocator)


def _backend_for(x, backend: str):
    return select_backend(backend, device_of(x)[0])


def relu_pack(a, *, square: bool = False, encoding="nosign", backend: str = "auto",
              chunk_log2: int = DEFAULT_CHUNK_LOG2, capacity=None, dtype=None, stream=None,
              allocator=None):
    """One pass over the pre-activation ``a``: ``(y, p)`` with ``y = relu(a)`` (or
    ``relu(a)**2`` when ``square``) dense for the next matmul and ``p = pack(relu(a))``."""
    fast = _native_codec
    if (fast is not None and type(capacity) is int and stream is None and allocator is None
            and dtype is None and chunk_log2 == DEFAULT_CHUNK_LOG2 and backend in fast.backends):
        yp = fast.relu_pack(a, square, encoding, capacity)
        if yp is not None:
            return yp
    be = _backend_for(a, backend)
    stream, allocator, tdev = _context(a, stream, allocator)
    y, p = be.relu_pack(a, square=square, dtype=dtype, encoding=encoding, chunk_log2=chunk_log2,
                        capacity=capacity, stream=stream, allocator=allocator)
    return y, _mark(p, tdev)


def relu_backward(grad, p: PackedTensor, *, stream=None, allocator=None):
    """ReLU's input gradient from the mask alone: ``grad`` where ``p``'s bit is set, else 0."""
    fast = _native_codec
    if fast is not None and stream is None and allocator is None:
        out = fast.relu_backward(grad, p)
        if out is not None:
            return out
    stream, allocator, _ = _context(grad, stream, allocator)
    return p.backend.relu_backward(grad, p, stream=stream, allocator=allocator)


def relu2_backward(grad, p: PackedTensor, *, stream=None, allocator=None):
    """ReLU²'s input gradient ``2·r·grad`` (0 where r <= 0), reading r from ``p``."""
    fast = _native_codec
    if fast is not None and stream is None and allocator is None:
        out = fast.relu2_backward(grad, p)
        if out is not None:
            return out
    stream, allocator, _ = _context(grad, stream, allocator)
    return p.backend.relu2_backward(grad, p, stream=stream, allocator=allocator)


def masked_pack(u, p_mask: PackedTensor, *, encoding="signplane", dtype=None, stream=None,
                allocator=None) -> PackedTensor:
    """``u`` at the positions set in ``p_mask`` (gated ReLU's up projection), sharing its mask."""
    fast = _native_codec
    if fast is not None and dtype is None and stream is None and allocator is None:
        p = fast.masked_pack(u, p_mask, encoding)
        if p is not None:
            return p
    stream, allocator, tdev = _context(u, stream, allocator)
    return _mark(p_mask.backend.masked_pack(u, p_mask, dtype=dtype, encoding=encoding,
                                            stream=stream, allocator=allocator), tdev)


def gated_backward(grad, p_r: PackedTensor, p_u: PackedTensor, *, stream=None, allocator=None):
    """For ``h = relu(g) * u``: ``(grad_g, grad_u)`` from the two packed tensors."""
    fast = _native_codec
    if fast is not None and stream is None and allocator is None:
        grads = fast.gated_backward(grad, p_r, p_u)
        if grads is not None:
            return grads
    stream, allocator, _ = _context(grad, stream, allocator)
    return p_r.backend.gated_backward(grad, p_r, p_u, stream=stream, allocator=allocator)


__all__ = ["pack", "unpack", "relu_pack", "relu_backward", "relu2_backward", "masked_pack",
           "gated_backward", "validate", "from_bytes", "PackedTensor", "Encoding", "layout",
           "packed_size", "register_backend", "get_backend", "registered_backends",
           "backend_available", "dtypes", "errors", "format", "DEFAULT_CHUNK_LOG2",
           *errors.__all__]
