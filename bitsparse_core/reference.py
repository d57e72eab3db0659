"""The NumPy + ml_dtypes reference codec: the executable form of docs/format.md.

Every GPU backend must produce planes byte-identical to :func:`pack_array`.
Written for clarity first, but fully vectorised (no per-element Python loop),
so the CPU demo and the CPU adapters can use it on real tensors.
"""

from __future__ import annotations

import numpy as np

from . import bitstream
from . import dtypes as _dt
from . import format as _fmt
from .dlpack import exportable, to_numpy
from .errors import EncodingError, OutputMismatchError
from .packed import PackedTensor

Encoding = _fmt.Encoding


def choose_encoding(encoding, stored: np.ndarray, dtype: _dt.DType) -> Encoding:
    """Resolve ``"auto"`` (nosign when legal, else raw) and check nosign is legal."""
    negative = np.flatnonzero(stored >> (dtype.bits - 1))
    if isinstance(encoding, str) and encoding.lower() == "auto":
        return Encoding.NOSIGN if negative.size == 0 else Encoding.RAW
    encoding = Encoding.parse(encoding)
    if encoding == Encoding.NOSIGN and negative.size:
        raise EncodingError(f"nosign encoding: {negative.size} stored values have their sign bit "
                            f"set (first at stored index {int(negative[0])}); "
                            "use encoding='signplane' or 'raw'")
    return encoding


def chunk_offsets(nonzero: np.ndarray, chunk_log2: int) -> np.ndarray:
    """Entry c = number of nonzeros before chunk c; the last entry is nnz."""
    numel, size = nonzero.size, 1 << chunk_log2
    n_chunks = -(-numel // size)
    padded = np.zeros(n_chunks * size, dtype=bool)
    padded[:numel] = nonzero
    counts = np.count_nonzero(padded.reshape(n_chunks, size), axis=1)
    width = _fmt.offset_width(numel)
    offsets = np.zeros(n_chunks + 1, dtype=np.dtype(f"<u{width}"))
    np.cumsum(counts, out=offsets[1:])
    return offsets


def encode_values(stored: np.ndarray, dtype: _dt.DType, encoding: Encoding, capacity: int):
    """(values plane, signs plane) holding ``stored`` at ``capacity`` slots."""
    stored = stored[:capacity]
    values = np.zeros(_fmt.values_nbytes(dtype, encoding, capacity), dtype=np.uint8)
    signs = np.zeros(_fmt.signs_nbytes(encoding, capacity), dtype=np.uint8)
    if encoding == Encoding.RAW:
        body = stored.astype(dtype.uint, copy=False).view(np.uint8)
    else:
        magnitude = stored & np.array(dtype.sign_mask - 1, dtype=dtype.uint)
        body = bitstream.pack(magnitude, dtype.magnitude_bits)
        if encoding == Encoding.SIGNPLANE:
            s = np.packbits((stored >> (dtype.bits - 1)).astype(bool), bitorder="little")
            signs[:s.size] = s
    values[:body.size] = body
    return values, signs


def decode_values(p: PackedTensor, values: np.ndarray, signs: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` stored bit patterns, as the dtype's unsigned integer type."""
    dtype = p.dtype
    if p.encoding == Encoding.RAW:
        return np.ascontiguousarray(values[:count * dtype.itemsize]).view(dtype.uint)
    out = bitstream.unpack(values, dtype.magnitude_bits, count, dtype.uint)
    if p.encoding == Encoding.SIGNPLANE:
        bits = np.unpackbits(np.asarray(signs, dtype=np.uint8), count=count, bitorder="little")
        out |= bits.astype(dtype.uint) << np.array(dtype.bits - 1, dtype=dtype.uint)
    return out


def pack_array(arr: np.ndarray, dtype: _dt.DType, encoding="auto", *,
               chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2, capacity=None) -> PackedTensor:
    """Pack a C-contiguous NumPy array of one of the five dtypes."""
    _fmt.check_chunk_log2(chunk_log2)
    bits = arr.reshape(-1).view(dtype.uint)
    nonzero = bits != 0
    stored = bits[nonzero]
    encoding = choose_encoding(encoding, stored, dtype)
    nnz = int(stored.size)
    capacity = nnz if capacity is None else int(capacity)
    lay = _fmt.layout(arr.shape, dtype, encoding, capacity, chunk_log2)
    mask = np.packbits(nonzero, bitorder="little")
    values, signs = encode_values(stored, dtype, encoding, capacity)
    return PackedTensor(tuple(arr.shape), dtype, encoding, chunk_log2, capacity, mask,
                        chunk_offsets(nonzero, chunk_log2), values, signs, backend="numpy",
                        device=("cpu", 0), _nnz=nnz)


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


class NumpyBackend:
    """CPU backend: the reference codec behind the registry contract."""

    name = "numpy"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        arr, dt = to_numpy(x, dtype)
        return pack_array(arr, dt, encoding, chunk_log2=chunk_log2, capacity=capacity)

    def unpack(self, p: PackedTensor, *, out=None, stream=None, allocator=None):
        p.check()
        target = None
        if out is not None:
            target, dt = to_numpy(out)
            if dt != p.dtype or tuple(target.shape) != tuple(p.shape):
                raise OutputMismatchError(f"out has {dt.name}{tuple(target.shape)}; "
                                          f"need {p.dtype.name}{tuple(p.shape)}")
            if not target.flags.writeable:
                raise OutputMismatchError("out is read-only")
        result = unpack_planes(p, p.mask, p.values, p.signs, target)
        return out if out is not None else result

    # ----------------------------------------------------------- fused ops
    def relu_pack(self, a, *, square=False, dtype=None, encoding="nosign",
                  chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, capacity=None, stream=None, allocator=None):
        from . import reference_ops
        arr, dt = to_numpy(a, dtype)
        y, p = reference_ops.relu_pack(arr, dt, square=square, encoding=encoding,
                                       chunk_log2=chunk_log2, capacity=capacity)
        return exportable(y), p

    def relu_backward(self, grad, p, *, stream=None, allocator=None):
        from . import reference_ops
        return exportable(reference_ops.relu_backward(self._grad(grad, p), p))

    def relu2_backward(self, grad, p, *, stream=None, allocator=None):
        from . import reference_ops
        p.check()
        return exportable(reference_ops.relu2_backward(self._grad(grad, p), p))

    def masked_pack(self, u, p_mask, *, dtype=None, encoding="signplane", stream=None,
                    allocator=None):
        from . import reference_ops
        arr, dt = to_numpy(u, dtype)
        if tuple(arr.shape) != tuple(p_mask.shape) or dt != p_mask.dtype:
            raise OutputMismatchError(f"u is {dt.name}{tuple(arr.shape)}, mask tensor is "
                                      f"{p_mask.dtype.name}{tuple(p_mask.shape)}")
        return reference_ops.masked_pack(arr, dt, p_mask, encoding=encoding)

    def gated_backward(self, grad, p_r, p_u, *, stream=None, allocator=None):
        from . import reference_ops
        p_r.check()
        gg, gu = reference_ops.gated_backward(self._grad(grad, p_r), p_r, p_u)
        return exportable(gg), exportable(gu)

    @staticmethod
    def _grad(grad, p):
        arr, dt = to_numpy(grad)
        if dt != p.dtype or tuple(arr.shape) != tuple(p.shape):
            raise OutputMismatchError(f"grad is {dt.name}{tuple(arr.shape)}; the packed "
                                      f"activation is {p.dtype.name}{tuple(p.shape)}")
        return arr

    # ------------------------------------------------------------- helpers
    def read_nnz(self, p) -> int:
        return int(p.offsets[-1])

    def read_status(self, p) -> int:
        return 0

    def to_numpy(self, array) -> np.ndarray:
        return np.asarray(array)
