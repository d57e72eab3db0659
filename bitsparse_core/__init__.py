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
"""

from __future__ import annotations

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
    stream:     the CUDA stream to run on (GPU backends; DLPack stream rules).
    allocator:  where device memory comes from (GPU backends).
    """
    device, _ = device_of(x)
    be = select_backend(backend, device)
    return be.pack(x, dtype=dtype, encoding=encoding, chunk_log2=chunk_log2, capacity=capacity,
                   stream=stream, allocator=allocator)


def unpack(p: PackedTensor, out=None, *, stream=None, allocator=None):
    """The dense tensor of ``p``, bit-exact; on ``p``'s device, DLPack-exportable."""
    if not isinstance(p, PackedTensor):
        raise TypeError(f"unpack takes a PackedTensor, not {type(p).__name__}; "
                        "use PackedTensor.from_bytes for serialized buffers")
    return p.backend.unpack(p, out=out, stream=stream, allocator=allocator)


def _backend_for(x, backend: str):
    return select_backend(backend, device_of(x)[0])


def relu_pack(a, *, square: bool = False, encoding="nosign", backend: str = "auto",
              chunk_log2: int = DEFAULT_CHUNK_LOG2, capacity=None, dtype=None, stream=None,
              allocator=None):
    """One pass over the pre-activation ``a``: ``(y, p)`` with ``y = relu(a)`` (or
    ``relu(a)**2`` when ``square``) dense for the next matmul and ``p = pack(relu(a))``."""
    return _backend_for(a, backend).relu_pack(
        a, square=square, dtype=dtype, encoding=encoding, chunk_log2=chunk_log2,
        capacity=capacity, stream=stream, allocator=allocator)


def relu_backward(grad, p: PackedTensor, *, stream=None, allocator=None):
    """ReLU's input gradient from the mask alone: ``grad`` where ``p``'s bit is set, else 0."""
    return p.backend.relu_backward(grad, p, stream=stream, allocator=allocator)


def relu2_backward(grad, p: PackedTensor, *, stream=None, allocator=None):
    """ReLU²'s input gradient ``2·r·grad`` (0 where r <= 0), reading r from ``p``."""
    return p.backend.relu2_backward(grad, p, stream=stream, allocator=allocator)


def masked_pack(u, p_mask: PackedTensor, *, encoding="signplane", dtype=None, stream=None,
                allocator=None) -> PackedTensor:
    """``u`` at the positions set in ``p_mask`` (gated ReLU's up projection), sharing its mask."""
    return p_mask.backend.masked_pack(u, p_mask, dtype=dtype, encoding=encoding,
                                                   stream=stream, allocator=allocator)


def gated_backward(grad, p_r: PackedTensor, p_u: PackedTensor, *, stream=None, allocator=None):
    """For ``h = relu(g) * u``: ``(grad_g, grad_u)`` from the two packed tensors."""
    return p_r.backend.gated_backward(grad, p_r, p_u, stream=stream,
                                                   allocator=allocator)


__all__ = ["pack", "unpack", "relu_pack", "relu_backward", "relu2_backward", "masked_pack",
           "gated_backward", "validate", "from_bytes", "PackedTensor", "Encoding", "layout",
           "packed_size", "register_backend", "get_backend", "registered_backends",
           "backend_available", "dtypes", "errors", "format", "DEFAULT_CHUNK_LOG2",
           *errors.__all__]
