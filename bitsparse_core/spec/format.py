"""Format v1: constants, the header, and the size formula (docs/format.md §3-§6).

This module is pure arithmetic on integers and bytes; it never looks at tensor
data. Backends call :func:`layout` to size their buffers, so every backend
allocates exactly what the spec says.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .. import dtypes as _dt
from ..errors import (BadMagicError, ChunkSizeError, HeaderSizeError, OffsetWidthError,
                     ReservedFieldError, ShapeMismatchError, ShapeTooLargeError,
                     TruncatedBufferError, UnknownEncodingError, UnsupportedVersionError,
                     CapacityError, EncodingError)

MAGIC = b"BSPK"
VERSION = 1
ALIGN = 64
FIXED_HEADER_SIZE = 120          # bytes before the shape array
MAX_NDIM = 64
# V19: the product of the nonzero dimensions is at most 2**58, so every bit index into
# the dense tensor (numel * 32 bits) or into any section fits a signed 64-bit integer,
# and NumPy (whose sizes are intp) can hold any shape a valid buffer names.
MAX_EXTENT = 1 << 58
MIN_CHUNK_LOG2 = 9               # 512 elements: each chunk's mask bytes start 64-byte aligned
MAX_CHUNK_LOG2 = 24
DEFAULT_CHUNK_LOG2 = 12          # 4096 elements per chunk
OFFSETS_64BIT_FROM = 1 << 32     # numel >= 2**32 -> 64-bit chunk offsets

# Little-endian header, fixed part (docs/format.md §4).
_FIXED = struct.Struct("<4sHHBBBBBBHIIQQQQ8Q")
assert _FIXED.size == FIXED_HEADER_SIZE
CHECKSUM_SLICE = slice(16, 20)
SECTION_NAMES = ("mask", "offsets", "values", "signs")   # in buffer order


class Encoding(enum.IntEnum):
    """How the values plane stores each nonzero bit pattern."""
    RAW = 0        # native width, little-endian
    NOSIGN = 1     # (b-1)-bit stream, sign bit dropped; every stored sign must be 0
    SIGNPLANE = 2  # (b-1)-bit magnitude stream + 1-bit-per-value sign plane

    @classmethod
    def parse(cls, spec) -> "Encoding":
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            try:
                return cls[spec.upper()]
            except KeyError:
                pass
        raise EncodingError(f"unknown encoding {spec!r}; use 'raw', 'nosign', 'signplane' or 'auto'")


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def header_size(ndim: int) -> int:
    return align(FIXED_HEADER_SIZE + 8 * ndim)


def offset_width(numel: int) -> int:
    """Bytes per chunk-offset entry: 4 while every offset fits in uint32, else 8."""
    return 8 if numel >= OFFSETS_64BIT_FROM else 4


def values_nbytes(dtype: _dt.DType, encoding: Encoding, count: int) -> int:
    if encoding == Encoding.RAW:
        return count * dtype.itemsize
    return (count * dtype.magnitude_bits + 7) // 8


def signs_nbytes(encoding: Encoding, count: int) -> int:
    return (count + 7) // 8 if encoding == Encoding.SIGNPLANE else 0


@dataclass(frozen=True)
class Layout:
    """Byte positions of every section of one buffer (the size formula, §6)."""
    dtype: _dt.DType
    encoding: Encoding
    chunk_log2: int
    shape: tuple
    numel: int
    capacity: int
    header_size: int
    mask: tuple          # (offset, length) of each section
    offsets: tuple
    values: tuple
    signs: tuple
    total_size: int

    @property
    def chunk_size(self) -> int:
        return 1 << self.chunk_log2

    @property
    def n_chunks(self) -> int:
        return -(-self.numel // self.chunk_size)

    @property
    def offset_width(self) -> int:
        return offset_width(self.numel)

    @property
    def sections(self) -> dict:
        return {"mask": self.mask, "offsets": self.offsets, "values": self.values,
                "signs": self.signs}


def _as_int(value, what: str, cls) -> int:
    """``value`` as a Python int; bools, floats, strings and other non-integers raise ``cls``."""
    if isinstance(value, (bool, np.bool_)):
        raise cls(f"{what}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise cls(f"{what}={value!r} must be an int, not {type(value).__name__}") from None


def check_chunk_log2(chunk_log2: int, cls=ChunkSizeError) -> int:
    chunk_log2 = _as_int(chunk_log2, "chunk_log2", cls)
    if not (MIN_CHUNK_LOG2 <= chunk_log2 <= MAX_CHUNK_LOG2):
        raise cls(f"chunk_log2={chunk_log2} outside [{MIN_CHUNK_LOG2}, {MAX_CHUNK_LOG2}]")
    return chunk_log2


def check_capacity(capacity, numel: int) -> int:
    """A fixed capacity as an int in [0, numel]; anything else raises :class:`CapacityError`."""
    capacity = _as_int(capacity, "capacity", CapacityError)
    if not 0 <= capacity <= numel:
        raise CapacityError(f"capacity={capacity} must lie in [0, numel={numel}]")
    return capacity


def extent(shape) -> int:
    """Product of the nonzero dimensions (1 if there are none): numel for a non-empty tensor."""
    n = 1
    for s in shape:
        if s:
            n *= int(s)
    return n


def check_extent(shape) -> None:
    """Rule V19: the product of the nonzero dimensions is at most :data:`MAX_EXTENT`."""
    if extent(shape) > MAX_EXTENT:
        raise ShapeTooLargeError(f"shape {tuple(shape)}: the product of its nonzero dimensions "
                                 f"exceeds 2**58")


def numel_of(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def layout(shape, dtype, encoding, capacity=None, chunk_log2: int = DEFAULT_CHUNK_LOG2) -> Layout:
    """The exact layout of a buffer; ``capacity`` defaults to numel (the worst case)."""
    dtype = _dt.resolve(dtype)
    encoding = Encoding.parse(encoding)
    chunk_log2 = check_chunk_log2(chunk_log2)
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_NDIM:
        raise HeaderSizeError(f"ndim={len(shape)} exceeds {MAX_NDIM}")
    if any(s < 0 for s in shape):
        raise ShapeMismatchError(f"negative dimension in shape {shape}")
    check_extent(shape)
    numel = numel_of(shape)
    capacity = numel if capacity is None else check_capacity(capacity, numel)
    n_chunks = -(-numel // (1 << chunk_log2))
    hs = header_size(len(shape))
    lengths = [(numel + 7) // 8,
               (n_chunks + 1) * offset_width(numel),
               values_nbytes(dtype, encoding, capacity),
               signs_nbytes(encoding, capacity)]
    pos, spans = hs, []
    for n in lengths:
        spans.append((pos, n))
        pos += align(n)
    return Layout(dtype, encoding, chunk_log2, shape, numel, capacity, hs, *spans, pos)


@functools.lru_cache(maxsize=4096)
def cached_layout(shape: tuple, dtype: _dt.DType, encoding: Encoding, capacity: int,
                  chunk_log2: int) -> Layout:
    """:func:`layout` of canonical arguments, computed once (hot paths ask per call; the
    same arguments then give the same object)."""
    return layout(shape, dtype, encoding, capacity, chunk_log2)


def packed_size(shape, dtype, encoding, nnz: int, chunk_log2: int = DEFAULT_CHUNK_LOG2) -> int:
    """Serialized size in bytes of a tensor with ``nnz`` nonzeros (capacity = nnz)."""
    return layout(shape, dtype, encoding, nnz, chunk_log2).total_size


# --------------------------------------------------------------------------- #
# Header                                                                      #
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Header:
    dtype: _dt.DType
    encoding: Encoding
    chunk_log2: int
    shape: tuple
    numel: int
    nnz: int
    capacity: int
    checksum: int
    total_size: int
    header_size: int
    sections: tuple  # ((off, len) x 4) in order mask, offsets, values, signs


def encode_header(lay: Layout, nnz: int, checksum: int = 0) -> bytes:
    """Header bytes (fixed part, shape, zero padding) for ``lay``."""
    secs = [v for span in (lay.mask, lay.offsets, lay.values, lay.signs) for v in span]
    fixed = _FIXED.pack(MAGIC, VERSION, lay.header_size, lay.dtype.dl_code, lay.dtype.bits,
                        int(lay.encoding), lay.chunk_log2, len(lay.shape), lay.offset_width,
                        0, checksum, 0, lay.numel, nnz, lay.capacity, lay.total_size, *secs)
    shape = struct.pack(f"<{len(lay.shape)}Q", *lay.shape)
    return (fixed + shape).ljust(lay.header_size, b"\0")


def decode_header(buf) -> Header:
    """Parse and check the header: rules V1a, V2-V8, V1b, V19, V9-V11, in that order
    (docs/format.md §8). Nothing past the header is read.

    Section positions (V12) and everything after them are checked by
    :func:`bitsparse_core.spec.serialize.validate`.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < FIXED_HEADER_SIZE:                                             # V1a
        raise TruncatedBufferError(f"{len(mv)} bytes is shorter than the {FIXED_HEADER_SIZE}-byte fixed header")
    (magic, version, hsize, code, bits, enc, clog2, ndim, owidth, res0, checksum, res1,
     numel, nnz, capacity, total, *secs) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:                                                          # V2
        raise BadMagicError(f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != VERSION:                                                      # V3
        raise UnsupportedVersionError(f"format version {version}; this library reads version {VERSION}")
    dtype = _dt.from_dlpack_pair(code, bits, in_header=True)                    # V4
    try:
        encoding = Encoding(enc)                                                # V5
    except ValueError:
        raise UnknownEncodingError(f"encoding byte {enc} is not 0, 1 or 2") from None
    check_chunk_log2(clog2)                                                     # V6
    if res0 or res1:                                                            # V7
        raise ReservedFieldError(f"reserved header fields are {res0}, {res1}; both must be 0")
    if ndim > MAX_NDIM or hsize != header_size(ndim):                           # V8
        raise HeaderSizeError(f"header_size={hsize} with ndim={ndim}; expected "
                              f"{header_size(min(ndim, MAX_NDIM))} and ndim <= {MAX_NDIM}")
    if len(mv) < hsize:                                                         # V1b
        raise TruncatedBufferError(f"{len(mv)} bytes is shorter than the {hsize}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", mv, FIXED_HEADER_SIZE)
    check_extent(shape)                                                         # V19
    if numel_of(shape) != numel:                                                # V9
        raise ShapeMismatchError(f"numel={numel} but shape {shape} holds {numel_of(shape)}")
    if owidth != offset_width(numel):                                           # V10
        raise OffsetWidthError(f"offset_width={owidth}; numel={numel} requires {offset_width(numel)}")
    if not (nnz <= capacity <= numel):                                          # V11
        raise CapacityError(f"need nnz <= capacity <= numel; got nnz={nnz}, capacity={capacity}, numel={numel}")
    sections = tuple((secs[2 * i], secs[2 * i + 1]) for i in range(4))
    return Header(dtype, encoding, clog2, shape, numel, nnz, capacity, checksum, total, hsize, sections)


def crc32(buf) -> int:
    """CRC-32 (zlib's, ISO-HDLC) of ``buf`` with the checksum field read as zeros."""
    mv = memoryview(buf).cast("B")
    crc = zlib.crc32(mv[:CHECKSUM_SLICE.start])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(mv[CHECKSUM_SLICE.stop:], crc)
