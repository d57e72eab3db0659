"""Serialized buffers: ``to_bytes``, ``from_bytes`` and the full validator.

:func:`validate` applies the spec's rules in the order of docs/format.md §8 and
raises the one named error of the first rule broken; a buffer it accepts decodes
to exactly one tensor. The order is the order in which a reader can trust what it
reads: the fixed header (V1a-V8), the header's own length (V1b), the shape and
counts (V19, V9-V11), the layout (V12) and with it the buffer's length (V1c,
V13), the checksum (V14), then the payload (V15-V18). Memory stays a small
multiple of the buffer's size.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import (ChecksumError, NotSerializableError, ChunkOffsetsError, MaskCountError,
                      NonzeroPaddingError, SectionLayoutError, TrailingBytesError,
                      TruncatedBufferError, ZeroValueError)
from . import format as _fmt
from .planes import chunk_offsets, decode_values

_NAMES = ("mask", "offsets", "values", "signs")


def to_bytes(p) -> bytes:
    """Serialize a PackedTensor ``p`` (from any backend) with capacity trimmed to nnz."""
    if p.extra.get("shares_mask"):
        raise NotSerializableError("a masked_pack tensor shares another tensor's mask and may "
                                   "store zeros; it has no standalone format-v1 form")
    p.check()
    nnz = p.nnz
    lay = _fmt.layout(p.shape, p.dtype, p.encoding, nnz, p.chunk_log2)
    buf = bytearray(lay.total_size)
    for name, (off, length) in lay.sections.items():
        if length:
            plane = np.asarray(p.backend.to_numpy(getattr(p, name))).view(np.uint8).reshape(-1)[:length].copy()
            _clear_tail_bits(plane, _used_bits(name, p, nnz))
            buf[off:off + length] = plane.tobytes()
    buf[:lay.header_size] = _fmt.encode_header(lay, nnz)
    struct.pack_into("<I", buf, _fmt.CHECKSUM_SLICE.start, _fmt.crc32(buf))
    return bytes(buf)


def _used_bits(name: str, p, nnz: int):
    """Meaningful bits at the start of a trimmed section (the rest is padding)."""
    if name == "mask":
        return p.numel
    if name == "values" and p.encoding != _fmt.Encoding.RAW:
        return nnz * p.dtype.magnitude_bits
    if name == "signs":
        return nnz
    return None  # whole bytes


def _clear_tail_bits(plane: np.ndarray, used_bits) -> None:
    if used_bits is not None and used_bits % 8 and plane.size:
        plane[-1] &= (1 << (used_bits % 8)) - 1


def _tail_bits_zero(plane: np.ndarray, used_bits: int) -> bool:
    """Every bit of ``plane`` at or past bit ``used_bits`` is zero."""
    first_full = -(-used_bits // 8)
    if np.any(plane[first_full:]):
        return False
    if used_bits % 8:
        return not (int(plane[used_bits // 8]) >> (used_bits % 8))
    return True


def check_structure(mv: memoryview):
    """Rules V1a-V13 (the header, the layout, the buffer's length): ``(header, layout)``."""
    h = _fmt.decode_header(mv)                                     # V1a, V2-V8, V1b, V19, V9-V11
    lay = _fmt.layout(h.shape, h.dtype, h.encoding, h.capacity, h.chunk_log2)
    expected = (lay.mask, lay.offsets, lay.values, lay.signs)
    for name, got, want in zip(_NAMES, h.sections, expected):      # V12
        if tuple(got) != tuple(want):
            raise SectionLayoutError(f"{name} section at (offset, length)={tuple(got)}; "
                                     f"the size formula gives {tuple(want)}")
    if h.total_size != lay.total_size:
        raise SectionLayoutError(f"total_size={h.total_size}; the size formula gives {lay.total_size}")
    if len(mv) < h.total_size:                                     # V1c
        raise TruncatedBufferError(f"buffer holds {len(mv)} of its {h.total_size} bytes")
    if len(mv) > h.total_size:                                     # V13
        raise TrailingBytesError(f"{len(mv) - h.total_size} bytes follow the {h.total_size}-byte buffer")
    return h, lay


def validate(buf) -> _fmt.Header:
    """Check every rule of the spec; return the header or raise the rule's error."""
    return _validate(memoryview(buf).cast("B"))[0]


def _validate(mv: memoryview):
    h, lay = check_structure(mv)                                   # V1-V13, V19
    if _fmt.crc32(mv) != h.checksum:                               # V14
        raise ChecksumError(f"stored CRC-32 {h.checksum:#010x}, computed {_fmt.crc32(mv):#010x}")
    raw = np.frombuffer(mv, dtype=np.uint8)
    _check_padding(raw, h, lay)                                    # V15
    planes = _planes(raw, lay)
    want = chunk_offsets(planes["mask"], h.numel, h.chunk_log2)
    count = int(want[-1])
    if count != h.nnz:                                             # V16
        raise MaskCountError(f"mask has {count} set bits, header says nnz={h.nnz}")
    offsets = planes["offsets"]
    if not np.array_equal(offsets, want):                          # V17
        bad = int(np.flatnonzero(offsets != want)[0])
        raise ChunkOffsetsError(f"chunk offset {bad} is {int(offsets[bad])}, mask gives {int(want[bad])}")
    stored = decode_values(h, planes["values"], planes["signs"], h.nnz)
    zeros = np.flatnonzero(stored == 0)
    if zeros.size:                                                 # V18
        raise ZeroValueError(f"stored value {int(zeros[0])} has the all-zero bit pattern")
    return h, lay


def _check_padding(raw: np.ndarray, h: _fmt.Header, lay: _fmt.Layout) -> None:
    used = {"mask": h.numel, "offsets": None,
            "values": (h.nnz * (h.dtype.bits if h.encoding == _fmt.Encoding.RAW
                                else h.dtype.magnitude_bits)),
            "signs": h.nnz if h.encoding == _fmt.Encoding.SIGNPLANE else None}
    header_used = _fmt.FIXED_HEADER_SIZE + 8 * len(h.shape)
    if np.any(raw[header_used:h.header_size]):
        raise NonzeroPaddingError("header padding after the shape is not zero")
    for name, (off, length) in lay.sections.items():
        gap_end = off + _fmt.align(length)
        if np.any(raw[off + length:gap_end]):
            raise NonzeroPaddingError(f"alignment padding after the {name} section is not zero")
        if used[name] is not None and not _tail_bits_zero(raw[off:off + length], used[name]):
            raise NonzeroPaddingError(f"padding bits at the end of the {name} section are not zero")


def _planes(raw: np.ndarray, lay: _fmt.Layout) -> dict:
    planes = {name: raw[off:off + length] for name, (off, length) in lay.sections.items()}
    planes["offsets"] = planes["offsets"].view(f"<u{lay.offset_width}")
    return planes


def _is_immutable(mv: memoryview) -> bool:
    """``mv`` exposes a ``bytes`` object read-only: nothing can change its bytes."""
    return mv.readonly and isinstance(mv.obj, bytes)


def decode(buf, *, validate: bool = True, copy: bool | None = None):
    """``(header, layout, planes)`` of a serialized buffer; the planes are read-only
    views of ``buf``, or of a private copy of it (see :func:`~.codec.from_bytes` for
    ``copy``). The copy is taken before any rule is checked, so what was validated is
    what the planes hold. ``validate=False`` checks rules V1-V13 only."""
    mv = memoryview(buf).cast("B")
    if copy or (copy is None and not _is_immutable(mv)):
        mv = memoryview(bytes(mv))
    mv = mv.toreadonly()
    h, lay = _validate(mv) if validate else check_structure(mv)
    return h, lay, _planes(np.frombuffer(mv, dtype=np.uint8), lay)
