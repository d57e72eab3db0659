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
    for cut in (0, 10, 119, 150, len(buf) - 1):                 # V1a, V1a, V1a, V1b, V1c
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
                   E.MaskCountError, E.ChunkOffsetsError, E.ZeroValueError,
                   E.ShapeTooLargeError]
    assert len(set(rule_errors)) == 19
    assert all(issubclass(e, E.FormatError) and issubclass(e, ValueError) for e in rule_errors)
    assert {rule for rule, _, _ in RULES} == {"V1a", "V1b", "V1c", *(f"V{i}" for i in range(2, 20))}
    assert {err for _, err, _ in RULES} == set(rule_errors)


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


# --------------------------------------------------------------------------- #
# V19: the dimension bound                                                    #
# --------------------------------------------------------------------------- #
def empty_buffer(shape, dtype=D.FLOAT32) -> bytearray:
    """A sealed numel-0 buffer whose header names ``shape`` (any u64 dimensions)."""
    lay = F.layout((0,) * len(shape), dtype, "raw", 0, 9)
    buf = bytearray(lay.total_size)
    buf[:lay.header_size] = F.encode_header(lay, 0)
    struct.pack_into(f"<{len(shape)}Q", buf, F.FIXED_HEADER_SIZE, *shape)
    return seal(buf)


@pytest.mark.parametrize("shape", [(0, 2**63), (2**62, 0), (2**30, 0, 2**30), (0, 2**58 + 1),
                                   (2**64 - 1, 0), (3, 0, 2**57)], ids=str)
def test_v19_huge_dimensions_of_an_empty_tensor(shape):
    expect(E.ShapeTooLargeError, empty_buffer(shape))
    with pytest.raises(E.ShapeTooLargeError):
        F.layout(shape, D.FLOAT32, "raw", 0)


@pytest.mark.parametrize("shape", [(0, 2**58), (2**58, 0), (2**29, 0, 2**29), (0,) * 64,
                                   (1, 2**40, 0, 7)], ids=lambda s: str(s)[:40])
def test_v19_bound_is_inclusive_and_such_tensors_unpack(shape):
    buf = bytes(empty_buffer(shape))
    assert bc.validate(buf).shape == shape
    y = np.asarray(bc.unpack(bc.from_bytes(buf)))
    assert y.shape == shape and y.dtype == np.float32 and y.size == 0


def test_v19_is_checked_before_v9():
    # numel = 0 cannot match the product 2**126 either (V9); V19 comes first, so that a
    # reader never multiplies unbounded dimensions.
    expect(E.ShapeTooLargeError, empty_buffer((2**63, 2**63)))
    expect(E.ShapeMismatchError, empty_buffer((2**29, 2**29)))


# --------------------------------------------------------------------------- #
# Rule order: one breaker per rule; every pair of broken rules                 #
# --------------------------------------------------------------------------- #
# Each breaker breaks its rule and, at most, rules checked after it. A breaker is
# applied in one of three phases: "body" edits bytes (the CRC is re-sealed after all
# body edits), "crc" then spoils the checksum, "len" then cuts or extends the buffer.
def _set(fmt, offset, value):
    def apply(buf):
        struct.pack_into(fmt, buf, offset, value)
        return buf
    return apply


def _cut(size_of):
    return lambda buf: buf[:size_of(buf)]


def _mask_bit_set(buf):
    off, _ = sections(buf)[0]
    bits = np.unpackbits(np.frombuffer(bytes(buf[off:off + 64]), np.uint8), bitorder="little")
    clear = int(np.flatnonzero(bits == 0)[0])
    buf[off + clear // 8] |= 1 << (clear % 8)
    return buf


def _zero_first_value(buf):
    off, _ = sections(buf)[2]
    buf[off:off + 2] = b"\0\0"                                  # raw bf16: stored value 0
    return buf


def _huge_shape(buf):
    struct.pack_into("<2Q", buf, 120, 2**59, 1)
    struct.pack_into("<Q", buf, 24, 2**59)                       # numel = product (V9 holds)
    return buf


# (rule, error, (phase, breaker)) in the order of docs/format.md §8.
RULES = [
    ("V1a", E.TruncatedBufferError, ("len", _cut(lambda b: 100))),
    ("V2", E.BadMagicError, ("body", _set("<4s", 0, b"BSPX"))),
    ("V3", E.UnsupportedVersionError, ("body", _set("<H", 4, 2))),
    ("V4", E.UnknownDTypeError, ("body", _set("<B", 8, 7))),
    ("V5", E.UnknownEncodingError, ("body", _set("<B", 10, 3))),
    ("V6", E.ChunkSizeError, ("body", _set("<B", 11, 8))),
    ("V7", E.ReservedFieldError, ("body", _set("<H", 14, 1))),
    ("V8", E.HeaderSizeError, ("body", _set("<H", 6, 1024))),
    ("V1b", E.TruncatedBufferError, ("len", _cut(lambda b: F.header_size(2) - 1))),
    ("V19", E.ShapeTooLargeError, ("body", _huge_shape)),
    ("V9", E.ShapeMismatchError, ("body", lambda b: _set("<Q", 128, 34)(b))),
    ("V10", E.OffsetWidthError, ("body", _set("<B", 13, 3))),
    ("V11", E.CapacityError, ("body", lambda b: _set("<Q", 40, struct.unpack_from("<Q", b, 32)[0] - 1)(b))),
    ("V12", E.SectionLayoutError, ("body", _set("<Q", 56, 256))),
    ("V1c", E.TruncatedBufferError, ("len", _cut(lambda b: struct.unpack_from("<Q", b, 48)[0] - 1))),
    ("V13", E.TrailingBytesError, ("len", lambda b: b + b"\0")),
    ("V14", E.ChecksumError, ("crc", lambda b: _set("<I", 16, struct.unpack_from("<I", b, 16)[0] ^ 1)(b))),
    ("V15", E.NonzeroPaddingError, ("body", _set("<B", F.header_size(2) - 1, 1))),
    ("V16", E.MaskCountError, ("body", _mask_bit_set)),
    ("V17", E.ChunkOffsetsError, ("body", lambda b: _set("<I", sections(b)[1][0], 1)(b))),
    ("V18", E.ZeroValueError, ("body", _zero_first_value)),
]
ORDER = {rule: i for i, (rule, _, _) in enumerate(RULES)}
_LENGTH_RULES = {"V1a", "V1b", "V1c", "V13"}


def break_rules(rules) -> bytearray:
    """The base buffer (bf16 (40, 33), raw, 3 chunks) with every rule of ``rules`` broken."""
    buf, _ = make(encoding="raw")
    todo = sorted(rules, key=ORDER.get, reverse=True)            # later rules' edits first
    breakers = {rule: brk for rule, _, brk in RULES}
    for phase in ("body", "crc", "len"):
        for rule in todo:
            if breakers[rule][0] == phase:
                buf = breakers[rule][1](buf)
        if phase == "body":
            seal(buf)
    return buf


def first_error(buf):
    errors = []
    for fn in (bc.validate, bc.from_bytes):
        with pytest.raises(E.FormatError) as info:
            fn(bytes(buf))
        errors.append(type(info.value))
    assert errors[0] is errors[1]
    return errors[0]


@pytest.mark.parametrize("rule,error", [(r, e) for r, e, _ in RULES], ids=[r for r, _, _ in RULES])
def test_each_breaker_breaks_its_rule(rule, error):
    assert first_error(break_rules([rule])) is error


PAIRS = [(a, b) for i, (a, _, _) in enumerate(RULES) for (b, _, _) in RULES[i + 1:]
         if not ({a, b} <= _LENGTH_RULES and "V13" in {a, b})]  # short and long at once: impossible


@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_the_first_broken_rule_wins(first, second):
    want = dict((r, e) for r, e, _ in RULES)[first]
    assert first_error(break_rules([first, second])) is want


def test_pairs_cover_every_rule_pair():
    assert len(PAIRS) == 21 * 20 // 2 - 3


def _example_10_1() -> bytearray:
    x = np.array([0, 1.5, 0, 0, -2.0, 0, 0, 0, 0, 0.25], dtype=np.float32)
    buf = bytearray(bc.pack(x, encoding="signplane", chunk_log2=9).to_bytes())
    assert len(buf) == 384
    return buf


@pytest.mark.parametrize("change,error", [
    (lambda b: b, E.TruncatedBufferError),
    (lambda b: put(b, "<4s", 0, b"BSPX"), E.BadMagicError),
    (lambda b: put(b, "<Q", 48, 448), E.SectionLayoutError),
    (lambda b: put(b, "<H", 6, 1024), E.HeaderSizeError),
    (lambda b: b[:100], E.TruncatedBufferError),
    (lambda b: put(b, "<I", 16, 0, reseal=False), E.TruncatedBufferError),
], ids=["none", "magic", "total_size", "header_size", "cut_to_100", "checksum"])
def test_spec_examples_of_rule_order(change, error):
    """The table under §8 of docs/format.md: §10.1's buffer cut by one byte, and more."""
    buf = change(_example_10_1())
    assert first_error(buf[:383] if len(buf) > 383 else buf) is error


# --------------------------------------------------------------------------- #
# Validation memory is bounded by the buffer's size                           #
# --------------------------------------------------------------------------- #
def test_validation_memory_is_proportional_to_the_buffer():
    import tracemalloc
    x = np.zeros(10, np.float32)
    x[3] = 1.0
    buf = bc.pack(x, encoding="raw", chunk_log2=24).to_bytes()    # one 16 Mi-element chunk
    assert len(buf) == 320
    tracemalloc.start()
    try:
        bc.validate(buf)
        np.asarray(bc.unpack(bc.from_bytes(buf)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak                                # was 16 MiB + per chunk


# --------------------------------------------------------------------------- #
# The reader never lets validated data change (copy unless immutable)        #
# --------------------------------------------------------------------------- #
def _source_kinds():
    import mmap
    import tempfile
    kinds = {
        "bytearray": lambda b: bytearray(b),
        "memoryview(bytearray)": lambda b: memoryview(bytearray(b)),
        "readonly memoryview(bytearray)": lambda b: memoryview(bytearray(b)).toreadonly(),
        "numpy": lambda b: np.frombuffer(b, np.uint8).copy(),
        "readonly numpy view": lambda b: np.frombuffer(bytearray(b), np.uint8)[:],
    }

    def writable_mmap(b):
        f = tempfile.TemporaryFile()
        f.write(b)
        f.flush()
        return mmap.mmap(f.fileno(), len(b), access=mmap.ACCESS_WRITE)
    kinds["mmap"] = writable_mmap
    return kinds


MUTABLE_KINDS = _source_kinds()


def _corrupt(src):
    """Flip the first stored value's low bit in ``src`` (through a writable view)."""
    mv = memoryview(src.obj if isinstance(src, memoryview) and src.readonly else src).cast("B")
    off = sections(bytes(mv))[2][0]
    mv[off] ^= 1


@pytest.mark.parametrize("kind", list(MUTABLE_KINDS))
def test_mutable_sources_are_copied_before_validation(kind):
    good, p = make(encoding="raw")
    want = np.asarray(bc.unpack(p)).view(np.uint16).copy()
    src = MUTABLE_KINDS[kind](bytes(good))
    if kind == "readonly numpy view":
        src.flags.writeable = False
    q = bc.from_bytes(src)
    raw = np.frombuffer(src, np.uint8)
    assert not any(np.shares_memory(raw, plane) for plane in q.planes.values())
    del raw
    if kind == "readonly numpy view":
        np.frombuffer(src.base, np.uint8)[sections(good)[2][0]] ^= 1
    else:
        _corrupt(src)                                            # the caller changes the source
    assert np.array_equal(np.asarray(bc.unpack(q)).view(np.uint16), want)
    for plane in q.planes.values():
        assert not plane.flags.writeable
        with pytest.raises(ValueError):
            plane[...] = 0
    if kind == "mmap":
        src.close()                                              # nothing of it is still exported
        assert np.array_equal(np.asarray(bc.unpack(q)).view(np.uint16), want)


@pytest.mark.parametrize("kind", ["bytes", "readonly memoryview(bytes)", "memoryview slice of bytes"])
def test_immutable_sources_are_viewed_in_place(kind):
    good, p = make(encoding="raw")
    b = bytes(good)
    src = {"bytes": b, "readonly memoryview(bytes)": memoryview(b),
           "memoryview slice of bytes": memoryview(b"xx" + b)[2:]}[kind]
    q = bc.from_bytes(src)
    assert np.shares_memory(np.frombuffer(src, np.uint8), q.values)
    assert all(not plane.flags.writeable for plane in q.planes.values())
    copied = bc.from_bytes(src, copy=True)
    assert not np.shares_memory(np.frombuffer(src, np.uint8), copied.values)
    assert np.array_equal(np.asarray(bc.unpack(q)).view(np.uint16),
                          np.asarray(bc.unpack(p)).view(np.uint16))


def test_copy_false_views_a_writable_source_read_only():
    good, p = make(encoding="raw")
    src = bytearray(good)
    q = bc.from_bytes(src, copy=False)
    assert np.shares_memory(np.frombuffer(src, np.uint8), q.values)
    with pytest.raises(ValueError):
        q.values[0] = 1                                          # no write reaches the caller's buffer
    with pytest.raises(ValueError):
        q.values.flags.writeable = True
    with pytest.raises(BufferError):
        src.extend(b"\0")                                        # the export pins the buffer
    _corrupt(src)                                                # the documented risk of copy=False
    assert not np.array_equal(np.asarray(bc.unpack(q)).view(np.uint16),
                              np.asarray(bc.unpack(p)).view(np.uint16))


def test_truncating_a_mapped_file_after_from_bytes_is_safe(tmp_path):
    """Before: from_bytes viewed the mmap, and truncating the file killed the process (SIGBUS)."""
    import subprocess
    import sys
    good, _ = make(encoding="raw")
    path = tmp_path / "t.bspk"
    path.write_bytes(bytes(good))
    script = f"""
import mmap, os, numpy as np, bitsparse_core as bc
f = open({str(path)!r}, "r+b")
m = mmap.mmap(f.fileno(), 0)
q = bc.from_bytes(m)
os.truncate({str(path)!r}, 0)
y = np.asarray(bc.unpack(q))
print("ok", int(np.count_nonzero(y.view(np.uint16))))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.startswith("ok ")


def test_validate_false_still_checks_the_layout():
    buf, _ = make()
    with pytest.raises(E.SectionLayoutError):
        bc.from_bytes(bytes(put(buf, "<Q", 48, len(buf) + 64)), validate=False)
    buf, _ = make()
    with pytest.raises(E.TrailingBytesError):
        bc.from_bytes(bytes(buf) + b"\0", validate=False)
    buf, _ = make()
    buf[sections(buf)[2][0]] ^= 1                                # checksum now wrong: not checked
    bc.from_bytes(bytes(buf), validate=False)
