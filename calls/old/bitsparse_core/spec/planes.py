"""The planes of format v1 as NumPy arrays: chunk offsets, the values and sign planes
(docs/format.md §5). Pure functions on arrays; the reference codec (:mod:`.codec`) and
the validator (:mod:`.serialize`) both build on them.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as _dt
from ..errors import EncodingError
from . import bitstream
from . import format as _fmt

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


def chunk_offsets(mask: np.ndarray, numel: int, chunk_log2: int) -> np.ndarray:
    """Entry c = number of set bits of the packed ``mask`` before chunk c; the last
    entry is nnz. Bits past ``numel`` must be zero (V15). A chunk's bits start on a byte
    boundary (``chunk_log2 >= 3``), so this counts bytes: memory is one count per mask
    byte plus one per chunk, never a padded whole chunk."""
    n_chunks = -(-numel >> chunk_log2)
    offsets = np.zeros(n_chunks + 1, dtype=np.dtype(f"<u{_fmt.offset_width(numel)}"))
    if n_chunks:
        mask = np.asarray(mask, dtype=np.uint8)
        starts = np.arange(0, mask.size, 1 << (chunk_log2 - 3))
        counts = np.add.reduceat(np.bitwise_count(mask), starts, dtype=np.int64)
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


def decode_values(p, values: np.ndarray, signs: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` stored bit patterns, as the dtype's unsigned integer type."""
    dtype = p.dtype
    if p.encoding == Encoding.RAW:
        return np.ascontiguousarray(values[:count * dtype.itemsize]).view(dtype.uint)
    out = bitstream.unpack(values, dtype.magnitude_bits, count, dtype.uint)
    if p.encoding == Encoding.SIGNPLANE:
        bits = np.unpackbits(np.asarray(signs, dtype=np.uint8), count=count, bitorder="little")
        out |= bits.astype(dtype.uint) << np.array(dtype.bits - 1, dtype=dtype.uint)
    return out
