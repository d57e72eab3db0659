"""One test per validation rule of docs/format.md §8, each with a corrupted buffer.

Corruptions after the checksum rule (V15-V18) re-seal the CRC so that the rule
under test, not the checksum, is what catches them.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bitsparse_core as bc
from bitsparse_core import dtypes as D
from bitsparse_core import errors as E
from bitsparse_core.spec import format as F
from helpers import random_tensor


def make(encoding="signplane", shape=(40, 33), dtype=D.BFLOAT16, sparsity=0.6, seed=0):
    x = random_tensor(np.random.default_rng(seed), shape, dtype, sparsity,
                      signed=(encoding != "nosign"))
    p = bc.pack(x, encoding=encoding, chunk_log2=9)
    return bytearray(p.to_bytes()), p


def seal(buf: bytearray) -> bytearray:
    struct.pack_into("<I", buf, 16, F.crc32(buf))
    return buf


def put(buf, fmt, offset, value, reseal=True):
    struct.pack_into(fmt, buf, offset, value)
    return seal(buf) if reseal else buf


def sections(buf):
    return F.decode_header(bytes(buf)).sections


def expect(err, buf):
    with pytest.raises(err):
        bc.validate(bytes(buf))
    with pytest.raises(err):
        bc.from_bytes(bytes(buf))


def test_valid_buffer_passes():
    buf, p = make()
    h = bc.validate(bytes(buf))
    assert h.nnz == p.nnz and h.shape == (40, 33)


def test_v1_truncated():
    buf, _ = make()
    for cut in (0, 10, 119, 150, len(buf) - 1):
        expect(E.TruncatedBufferError, buf[:cut])


def test_v2_bad_magic():
    buf, _ = make()
    buf[0:4] = b"BSPX"
    expect(E.BadMagicError, seal(buf))


def test_v3_version():
    buf, _ = make()
    expect(E.UnsupportedVersionError, put(buf, "<H", 4, 2))


def test_v4_dtype():
    buf, _ = make()
    expect(E.UnknownDTypeError, put(buf, "<B", 8, 7))          # float8_e3m4: not supported
    buf, _ = make()
    expect(E.UnknownDTypeError, put(buf, "<B", 9, 8))          # bf16 with 8 bits


def test_v5_encoding():
    buf, _ = make()
    expect(E.UnknownEncodingError, put(buf, "<B", 10, 3))


def test_v6_chunk_size():
    for bad in (8, 25):
        buf, _ = make()
        expect(E.ChunkSizeError, put(buf, "<B", 11, bad))


def test_v7_reserved():
    buf, _ = make()
    expect(E.ReservedFieldError, put(buf, "<H", 14, 1))
    buf, _ = make()
    expect(E.ReservedFieldError, put(buf, "<I", 20, 1))


def test_v8_header_size():
    buf, _ = make()
    expect(E.HeaderSizeError, put(buf, "<H", 6, 256))
    buf, _ = make()
    expect(E.HeaderSizeError, put(buf, "<B", 12, 65))


def test_v9_shape_mismatch():
    buf, _ = make()
    expect(E.ShapeMismatchError, put(buf, "<Q", 120, 41))


def test_v10_offset_width():
    buf, _ = make()
    expect(E.OffsetWidthError, put(buf, "<B", 13, 8))


def test_v11_capacity():
    buf, p = make()
    expect(E.CapacityError, put(buf, "<Q", 40, p.nnz - 1))     # capacity < nnz
    buf, p = make()
    expect(E.CapacityError, put(buf, "<Q", 40, p.numel + 1))   # capacity > numel


def test_v12_section_layout():
    buf, _ = make()
    expect(E.SectionLayoutError, put(buf, "<Q", 56, 256))      # mask offset moved
    buf, _ = make()
    expect(E.SectionLayoutError, put(buf, "<Q", 96, 1))        # values length
    buf, _ = make()
    expect(E.SectionLayoutError, put(buf, "<Q", 48, len(buf) + 64))


def test_v13_trailing_bytes():
    buf, _ = make()
    expect(E.TrailingBytesError, buf + b"\0")


def test_v14_checksum():
    buf, _ = make()
    off, length = sections(buf)[2]
    buf[off] ^= 0x01                                            # one flipped value bit
    expect(E.ChecksumError, buf)
    buf, _ = make()
    expect(E.ChecksumError, put(buf, "<I", 16, F.crc32(buf) ^ 1, reseal=False))


def test_v15_nonzero_padding():
    buf, p = make()
    hs = F.header_size(2)
    buf[hs - 1] = 1                                             # header tail
    expect(E.NonzeroPaddingError, seal(buf))
    buf, _ = make()
    off, length = sections(buf)[1]
    buf[off + length] = 1                                       # gap after offsets
    expect(E.NonzeroPaddingError, seal(buf))
    buf, _ = make()
    off, length = sections(buf)[0]                              # 1320 elements: 165 full bytes
    buf2, _ = make(shape=(41, 33))                              # 1353 elements: 1 pad bit
    off2, len2 = sections(buf2)[0]
    buf2[off2 + len2 - 1] |= 0x80
    expect(E.NonzeroPaddingError, seal(buf2))
    buf, _ = make(encoding="nosign")
    off, length = sections(buf)[2]
    used = p.nnz * 15
    if used % 8:
        buf[off + length - 1] |= 0x80                           # bit past the last code
        expect(E.NonzeroPaddingError, seal(buf))
    buf, p = make(encoding="signplane")
    off, length = sections(buf)[3]
    assert p.nnz % 8
    buf[off + length - 1] |= 0x80                               # sign bit past nnz
    expect(E.NonzeroPaddingError, seal(buf))


def _capacity_buffer():
    """A valid buffer with capacity > nnz (as a fixed-capacity writer may emit)."""
    x = random_tensor(np.random.default_rng(3), (100,), D.FLOAT32, 0.5)
    p = bc.pack(x, encoding="raw", chunk_log2=9)
    lay = F.layout(p.shape, p.dtype, p.encoding, p.nnz + 4, 9)
    buf = bytearray(lay.total_size)
    for name, (off, length) in lay.sections.items():
        plane = np.asarray(getattr(p, name)).view(np.uint8)
        buf[off:off + plane.size] = plane.tobytes()
    buf[:lay.header_size] = F.encode_header(lay, p.nnz)
    return seal(buf), p


def test_capacity_above_nnz_is_valid_and_unused_slots_must_be_zero():
    buf, p = _capacity_buffer()
    q = bc.from_bytes(bytes(buf))
    assert q.capacity == p.nnz + 4
    assert np.array_equal(np.asarray(bc.unpack(q)).view(np.uint32),
                          np.asarray(bc.unpack(p)).view(np.uint32))
    off, length = sections(buf)[2]
    buf[off + length - 1] = 9
    expect(E.NonzeroPaddingError, seal(buf))


def test_v16_mask_count():
    # (An nnz field that lies is caught earlier, by V11/V12/V15: the values
    # section's size and padding are derived from it.)
    buf, _ = make()
    off, _ = sections(buf)[0]
    first_set = int(np.flatnonzero(np.unpackbits(np.frombuffer(bytes(buf[off:off + 8]), np.uint8),
                                                 bitorder="little"))[0])
    buf[off + first_set // 8] &= ~(1 << (first_set % 8)) & 0xFF  # a missing mask bit
    expect(E.MaskCountError, seal(buf))
    buf, _ = make()
    off, _ = sections(buf)[0]
    mask = np.frombuffer(bytes(buf[off:off + 8]), np.uint8)
    zero_bit = int(np.flatnonzero(np.unpackbits(mask, bitorder="little") == 0)[0])
    buf[off + zero_bit // 8] |= 1 << (zero_bit % 8)             # an extra mask bit
    expect(E.MaskCountError, seal(buf))


def test_v17_chunk_offsets():
    buf, _ = make()
    off, _ = sections(buf)[1]
    (first,) = struct.unpack_from("<I", buf, off + 4)
    expect(E.ChunkOffsetsError, put(buf, "<I", off + 4, first + 1))


def test_v17_moving_a_mask_bit_across_chunks():
    buf, _ = make(sparsity=0.5)
    off, _ = sections(buf)[0]
    bits = np.unpackbits(np.frombuffer(bytes(buf[off:off + 165]), np.uint8), bitorder="little")
    src = int(np.flatnonzero(bits[:512])[0])                    # set bit in chunk 0
    dst = 512 + int(np.flatnonzero(bits[512:1024] == 0)[0])     # clear bit in chunk 1
    buf[off + src // 8] &= ~(1 << (src % 8)) & 0xFF
    buf[off + dst // 8] |= 1 << (dst % 8)
    expect(E.ChunkOffsetsError, seal(buf))


def test_v18_zero_value():
    for enc in ("raw", "nosign", "signplane"):
        buf, p = make(encoding=enc, dtype=D.FLOAT8_E5M2)
        off, _ = sections(buf)[2]
        if enc == "raw":
            buf[off] = 0
        else:                                                   # clear code 0 (7 bits)
            buf[off] &= 0x80
        if enc == "signplane":
            soff, _ = sections(buf)[3]
            buf[soff] &= 0xFE
        expect(E.ZeroValueError, seal(buf))


def test_every_rule_has_its_own_error_class():
    rule_errors = [E.TruncatedBufferError, E.BadMagicError, E.UnsupportedVersionError,
                   E.UnknownDTypeError, E.UnknownEncodingError, E.ChunkSizeError,
                   E.ReservedFieldError, E.HeaderSizeError, E.ShapeMismatchError,
                   E.OffsetWidthError, E.CapacityError, E.SectionLayoutError,
                   E.TrailingBytesError, E.ChecksumError, E.NonzeroPaddingError,
                   E.MaskCountError, E.ChunkOffsetsError, E.ZeroValueError]
    assert len(set(rule_errors)) == 18
    assert all(issubclass(e, E.FormatError) and issubclass(e, ValueError) for e in rule_errors)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 4), cut=st.booleans(),
       encoding=st.sampled_from(["raw", "nosign", "signplane"]))
def test_corrupted_or_truncated_buffers_never_decode(seed, flips, cut, encoding):
    buf, _ = make(encoding=encoding, seed=seed % 7)
    rng = np.random.default_rng(seed)
    if cut:
        buf = buf[:int(rng.integers(0, len(buf)))]
    else:
        for pos in rng.choice(len(buf), size=flips, replace=False):
            buf[pos] ^= int(rng.integers(1, 256))
    with pytest.raises(E.FormatError):
        bc.from_bytes(bytes(buf))
