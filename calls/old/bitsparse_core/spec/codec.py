"""The NumPy + ml_dtypes reference codec: the executable form of docs/format.md.

Every GPU backend must produce planes byte-identical to :func:`pack_array`.
Written for clarity first, but fully vectorised (no per-element Python loop),
so the CPU demo and the CPU adapters can use it on real tensors.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as _dt
from ..backends.registry import get_backend
from ..dlpack import exportable
from ..packed import PackedTensor
from . import format as _fmt
from . import serialize
from .planes import choose_encoding, chunk_offsets, decode_values, encode_values

Encoding = _fmt.Encoding


def pack_array(arr: np.ndarray, dtype: _dt.DType, encoding="auto", *,
               chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2, capacity=None) -> PackedTensor:
    """Pack a C-contiguous NumPy array of one of the five dtypes."""
    _fmt.check_chunk_log2(chunk_log2)
    bits = arr.reshape(-1).view(dtype.uint)
    nonzero = bits != 0
    stored = bits[nonzero]
    encoding = choose_encoding(encoding, stored, dtype)
    nnz = int(stored.size)
    capacity = nnz if capacity is None else _fmt.check_capacity(capacity, bits.size)
    _fmt.layout(arr.shape, dtype, encoding, capacity, chunk_log2)  # checks the shape (V19)
    mask = np.packbits(nonzero, bitorder="little")
    values, signs = encode_values(stored, dtype, encoding, capacity)
    return PackedTensor(tuple(arr.shape), dtype, encoding, chunk_log2, capacity, mask,
                        chunk_offsets(mask, bits.size, chunk_log2), values, signs,
                        backend=get_backend("numpy"), device=("cpu", 0), _nnz=nnz)


def unpack_planes(p: PackedTensor, mask, values, signs, out: np.ndarray | None = None) -> np.ndarray:
    """Dense array from host planes (no validation beyond what decoding needs)."""
    numel = p.numel
    nonzero = np.unpackbits(np.asarray(mask, dtype=np.uint8), count=numel,
                            bitorder="little").view(bool)
    stored = decode_values(p, values, signs, p.nnz)
    if out is None:
        flat = np.zeros(numel, dtype=p.dtype.uint)
        flat[nonzero] = stored
        return exportable(flat.view(p.dtype.numpy).reshape(p.shape))
    flat = out.reshape(-1).view(p.dtype.uint)
    flat[...] = 0
    flat[nonzero] = stored
    return out


def from_bytes(buf, *, validate: bool = True, copy: bool | None = None) -> PackedTensor:
    """A CPU PackedTensor decoded from the serialized buffer ``buf`` (any object with
    the buffer protocol). Its planes are read-only NumPy arrays.

    copy:     ``None`` (default) copies ``buf`` before validating it unless ``buf`` is
              immutable -- ``bytes``, or a read-only memoryview of ``bytes`` -- which is
              viewed in place. ``True`` always copies. ``False`` never copies: the
              tensor views ``buf`` even when it is writable, which costs no memory but
              means the caller must keep ``buf`` unchanged for the tensor's lifetime.
              A later change to a bytearray / NumPy array / writable mmap silently
              changes the tensor (after validation, so it may then decode to garbage),
              and an mmap'd file truncated while the tensor lives makes the next read
              of a plane kill the process with SIGBUS. (The planes stay read-only, and
              the export held on ``buf`` stops a bytearray resize or an mmap close.)
    validate: ``False`` checks only the header and the layout (rules V1-V13); it skips
              the checksum and the payload rules, so use it only on buffers you
              produced yourself.
    """
    h, lay, planes = serialize.decode(buf, validate=validate, copy=copy)
    return PackedTensor(tuple(h.shape), h.dtype, h.encoding, h.chunk_log2, h.capacity,
                        planes["mask"], planes["offsets"], planes["values"], planes["signs"],
                        backend=get_backend("numpy"), device=("cpu", 0), _nnz=h.nnz)
