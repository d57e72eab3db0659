"""Structure-aware fuzzing of the reader: ``validate``, ``from_bytes`` and ``unpack``.

Every case starts from a valid buffer of a fixed corpus (every dtype and encoding;
0-d, empty, one- and many-chunk tensors, capacity above nnz, chunk_log2 9-12, ndim
up to 40), applies up to three mutations chosen by the case's seed (a header field
set to a boundary, random or borrowed value; the shape with numel kept consistent;
an offsets entry; mask bits; value and sign bits; padding bytes; any bytes; a cut;
trailing bytes; a splice of two buffers; a new capacity, written out validly; the
checksum) and, usually, re-seals the CRC so that the mutation reaches the rules past
V14. The outcome must be one of:

* rejected: ``validate`` and ``from_bytes`` raise the same one of the spec's named
  errors (a subclass of ``FormatError``, never a bare one and never anything else),
  and the buffer is not valid by the oracle below;
* accepted: ``unpack`` succeeds and gives exactly the tensor that an independent
  decoder (written here from docs/format.md, sharing no code with the reader)
  reads, and the buffer is byte for byte the canonical buffer of that tensor: the one
  a writer produces (header, layout and CRC by §4-§7 written out here, planes from
  ``pack``). Since a valid buffer is unique given its tensor, dtype, encoding,
  chunk_log2 and capacity, that is also the oracle for "the reader rejected a valid
  buffer".

Each case is seeded (``BASE + index``) and replayable: a failure prints its seed;
``BITSPARSE_FUZZ_SEED=<seed> python3 -m pytest -q tests/test_fuzz.py -k replay``
reruns that case alone, and ``BITSPARSE_FUZZ_BASE`` moves the whole run to other
seeds. The default run has 20,000 cases; ``python3 -m pytest -q -m slow
tests/test_fuzz.py`` runs 1,000,000.
"""

from __future__ import annotations

import os
import random
import struct
import traceback
import zlib

import numpy as np
import pytest

import bitsparse_core as bc
from bitsparse_core import dtypes as D
from bitsparse_core import errors as E
from helpers import random_tensor

BASE = int(os.environ.get("BITSPARSE_FUZZ_BASE", "0x5EED0000"), 0)
DEFAULT_CASES, DEFAULT_BLOCKS = 20_000, 4
SLOW_CASES, SLOW_BLOCKS = 1_000_000, 20

# The named errors of docs/format.md §8, one per rule.
RULE_ERRORS = (E.TruncatedBufferError, E.BadMagicError, E.UnsupportedVersionError,
               E.UnknownDTypeError, E.UnknownEncodingError, E.ChunkSizeError,
               E.ReservedFieldError, E.HeaderSizeError, E.ShapeTooLargeError,
               E.ShapeMismatchError, E.OffsetWidthError, E.CapacityError,
               E.SectionLayoutError, E.TrailingBytesError, E.ChecksumError,
               E.NonzeroPaddingError, E.MaskCountError, E.ChunkOffsetsError, E.ZeroValueError)

# --------------------------------------------------------------------------- #
# The oracle: a decoder and a writer written from docs/format.md alone          #
# --------------------------------------------------------------------------- #
# §4, fixed part: magic version header_size dtype_code dtype_bits encoding chunk_log2
# ndim offset_width reserved checksum reserved numel nnz capacity total_size 4x(off, len)
HEADER = struct.Struct("<4s H H B B B B B B H I I Q Q Q Q 8Q")
FIELDS = [("magic", 0, "4s"), ("version", 4, "H"), ("header_size", 6, "H"),
          ("dtype_code", 8, "B"), ("dtype_bits", 9, "B"), ("encoding", 10, "B"),
          ("chunk_log2", 11, "B"), ("ndim", 12, "B"), ("offset_width", 13, "B"),
          ("reserved0", 14, "H"), ("checksum", 16, "I"), ("reserved1", 20, "I"),
          ("numel", 24, "Q"), ("nnz", 32, "Q"), ("capacity", 40, "Q"), ("total_size", 48, "Q")]
FIELDS += [(f"{sec}_{part}", 56 + 16 * i + 8 * j, "Q")
           for i, sec in enumerate(("mask", "offsets", "values", "signs"))
           for j, part in enumerate(("offset", "length"))]
DTYPES = {(d.dl_code, d.bits): d for d in D.ALL}          # §2
ENCODINGS = ("raw", "nosign", "signplane")                # §3, by byte


def a64(n: int) -> int:
    return -(-n // 64) * 64


def spec_layout(ndim, numel, bits, enc, clog2, cap):
    """§6: (header_size, [(offset, length)] x 4, total_size, offset_width)."""
    width = 8 if numel >= 2**32 else 4
    lengths = [-(-numel // 8), (-(-numel // 2**clog2) + 1) * width,
               cap * bits // 8 if enc == 0 else -(-cap * (bits - 1) // 8),
               -(-cap // 8) if enc == 2 else 0]
    pos = h = a64(120 + 8 * ndim)
    spans = []
    for n in lengths:
        spans.append((pos, n))
        pos += a64(n)
    return h, spans, pos, width


def oracle_decode(buf: bytes):
    """``(dtype, encoding, chunk_log2, shape, capacity, dense bits)`` read as §4-§5
    describe, or None where the header does not describe a readable tensor."""
    if len(buf) < 120:
        return None
    (magic, version, _, code, bits, enc, clog2, ndim, _, _, _, _,
     numel, nnz, cap, _, *secs) = HEADER.unpack_from(buf)
    dt = DTYPES.get((code, bits))
    if magic != b"BSPK" or version != 1 or dt is None or enc > 2 or not 9 <= clog2 <= 24:
        return None
    if ndim > 64 or len(buf) < 120 + 8 * ndim:
        return None
    shape = struct.unpack_from(f"<{ndim}Q", buf, 120)
    product, extent = 1, 1
    for s in shape:
        product *= s
        extent *= s or 1
    if extent > 2**58 or product != numel or not nnz <= cap <= numel or numel > 8 * len(buf):
        return None
    mask_off, values_off, signs_off = secs[0], secs[4], secs[6]
    w = bits if enc == 0 else bits - 1
    if (mask_off + -(-numel // 8) > len(buf) or values_off + -(-nnz * w // 8) > len(buf)
            or (enc == 2 and signs_off + -(-nnz // 8) > len(buf))):
        return None
    raw = np.frombuffer(buf, np.uint8)
    mask = np.unpackbits(raw[mask_off:mask_off + -(-numel // 8)], bitorder="little")[:numel]
    if int(mask.sum()) != nnz:
        return None
    vbits = np.unpackbits(raw[values_off:values_off + -(-nnz * w // 8)], bitorder="little")
    codes = (vbits[:nnz * w].reshape(nnz, w).astype(np.uint64)
             << np.arange(w, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
    if enc == 2:
        sbits = np.unpackbits(raw[signs_off:signs_off + -(-nnz // 8)], bitorder="little")
        codes |= sbits[:nnz].astype(np.uint64) << np.uint64(bits - 1)
    dense = np.zeros(numel, dtype=dt.uint)
    dense[mask.astype(bool)] = codes.astype(dt.uint)
    return dt, enc, clog2, tuple(shape), cap, dense


def canonical(dt, enc, clog2, shape, cap, dense) -> bytes | None:
    """The one valid buffer of this tensor (§4-§7), or None where there is none."""
    if enc == 1 and np.any(dense >> (dt.bits - 1)):
        return None
    x = dense.reshape(shape).view(dt.numpy)
    nnz = int(np.count_nonzero(dense))
    if nnz > cap:
        return None
    p = bc.pack(x, encoding=ENCODINGS[enc], chunk_log2=clog2, capacity=cap)
    numel = dense.size
    h, spans, total, width = spec_layout(len(shape), numel, dt.bits, enc, clog2, cap)
    out = bytearray(total)
    for (off, length), plane in zip(spans, (p.mask, p.offsets, p.values, p.signs)):
        body = np.asarray(plane).view(np.uint8).tobytes()
        assert len(body) == length
        out[off:off + length] = body
    head = HEADER.pack(b"BSPK", 1, h, dt.dl_code, dt.bits, enc, clog2, len(shape), width, 0, 0, 0,
                       numel, nnz, cap, total, *(v for span in spans for v in span))
    out[:120 + 8 * len(shape)] = head + struct.pack(f"<{len(shape)}Q", *shape)
    struct.pack_into("<I", out, 16, zlib.crc32(out))
    return bytes(out)


# --------------------------------------------------------------------------- #
# The corpus                                                                  #
# --------------------------------------------------------------------------- #
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (9,), (40, 33), (513,), (2, 3, 5, 7), (1,) * 40,
          (2**20, 0), (1025, 3)]


def _corpus():
    rng = np.random.default_rng(20240518)
    out = []
    for dt in D.ALL:
        for enc in range(3):
            for shape in SHAPES:
                sparsity = float(rng.choice([0.0, 0.5, 0.9, 1.0]))
                x = random_tensor(rng, shape, dt, sparsity, signed=(enc != 1))
                nnz = int(np.count_nonzero(x.view(dt.uint)))
                numel = x.size
                cap = min(numel, nnz + int(rng.integers(0, 9))) if rng.random() < 0.3 else nnz
                clog2 = int(rng.choice([9, 9, 10, 12]))
                buf = canonical(dt, enc, clog2, shape, cap, x.reshape(-1).view(dt.uint).copy())
                assert buf is not None
                out.append(buf)
    return out


CORPUS = _corpus()
# Values worth trying in any integer field.
BOUNDARY = [0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 120, 127, 128, 192, 255, 256, 2**16 - 1, 2**31,
            2**32 - 1, 2**32, 2**58, 2**58 + 1, 2**62, 2**63, 2**64 - 1]
FMT_MAX = {"B": 2**8 - 1, "H": 2**16 - 1, "I": 2**32 - 1, "Q": 2**64 - 1}


def _fields_of(buf):
    ndim = buf[12] if len(buf) > 12 else 0
    return FIELDS + [(f"shape[{i}]", 120 + 8 * i, "Q") for i in range(min(ndim, 64))]


def _spans(buf):
    """The (offset, length) of each section, as the buffer's own header says."""
    if len(buf) < 120:
        return [(0, 0)] * 4
    secs = HEADER.unpack_from(buf)[16:]
    return [(secs[2 * i], secs[2 * i + 1]) for i in range(4)]


def _reseal(buf):
    if len(buf) >= 20:
        struct.pack_into("<I", buf, 16, 0)
        struct.pack_into("<I", buf, 16, zlib.crc32(buf))


def _flip_in(buf, r, off, length, nbits):
    """Flip ``nbits`` random bits in ``[off, off + length)``."""
    length = min(length, len(buf) - off)
    if length <= 0:
        return
    for _ in range(nbits):
        k = r.randrange(length * 8)
        buf[off + k // 8] ^= 1 << (k % 8)


def m_field(buf, r):
    name, off, fmt = r.choice(_fields_of(buf))
    if off + struct.calcsize("<" + fmt) > len(buf):
        return f"field {name}: out of buffer"
    (cur,) = struct.unpack_from("<" + fmt, buf, off)
    if fmt == "4s":
        new = r.choice([b"BSPX", b"\0\0\0\0", b"bspk", bytes(r.randrange(256) for _ in range(4))])
    else:
        top = FMT_MAX[fmt]
        pick = r.random()
        if pick < 0.4:
            new = r.choice(BOUNDARY)
        elif pick < 0.7:
            new = cur + r.choice([-64, -8, -1, 1, 8, 64])
        elif pick < 0.85:
            other = r.choice(CORPUS)
            new = struct.unpack_from("<" + fmt, other, off)[0] if off + 8 <= len(other) else 0
        else:
            new = r.randrange(top + 1)
        new %= top + 1
    struct.pack_into("<" + fmt, buf, off, new)
    return f"field {name}: {cur!r} -> {new!r}"


def m_shape(buf, r):
    """Change the shape and keep numel equal to its product (so V9 holds)."""
    ndim = buf[12] if len(buf) >= 120 else 0
    if ndim == 0 or len(buf) < 120 + 8 * ndim:
        return "shape: none"
    shape = list(struct.unpack_from(f"<{ndim}Q", buf, 120))
    i = r.randrange(ndim)
    shape[i] = r.choice([0, 1, 2, shape[i] + 1, max(shape[i] - 1, 0), 2**29, 2**58, 2**58 + 1,
                         2**62, 2**63, 2**64 - 1]) % 2**64
    product = 1
    for s in shape:
        product *= s
    struct.pack_into(f"<{ndim}Q", buf, 120, *shape)
    struct.pack_into("<Q", buf, 24, product % 2**64)
    return f"shape -> {tuple(shape)}"


def m_offsets(buf, r):
    off, length = _spans(buf)[1]
    width = buf[13] if len(buf) >= 120 and buf[13] in (4, 8) else 4
    n = length // width
    if n == 0 or off + length > len(buf):
        return "offsets: none"
    i = r.randrange(n)
    fmt = "<I" if width == 4 else "<Q"
    (cur,) = struct.unpack_from(fmt, buf, off + i * width)
    new = r.choice([cur + 1, cur - 1, 0, r.randrange(2**(8 * width)), cur + 2**31]) % 2**(8 * width)
    struct.pack_into(fmt, buf, off + i * width, new)
    return f"offsets[{i}]: {cur} -> {new}"


def m_mask(buf, r):
    off, length = _spans(buf)[0]
    _flip_in(buf, r, off, a64(length) if r.random() < 0.2 else length, r.choice([1, 1, 2, 3]))
    return "mask bits"


def m_values(buf, r):
    off, length = _spans(buf)[r.choice([2, 2, 3])]
    _flip_in(buf, r, off, a64(length) if r.random() < 0.2 else length, r.choice([1, 1, 2]))
    return "value/sign bits"


def m_zero_value(buf, r):
    """Clear every bit of one stored value (raw bytes, stream code and sign bit)."""
    if len(buf) < 120:
        return "zero value: none"
    fields = HEADER.unpack_from(buf)
    bits, enc, nnz = fields[4], fields[5], fields[13]
    voff, soff = _spans(buf)[2][0], _spans(buf)[3][0]
    if nnz == 0 or bits not in (8, 16, 32) or nnz > 8 * len(buf):
        return "zero value: none"
    i = r.randrange(nnz)
    w = bits if enc == 0 else bits - 1
    for k in range(i * w, (i + 1) * w):
        if voff + k // 8 < len(buf):
            buf[voff + k // 8] &= ~(1 << (k % 8)) & 0xFF
    if enc == 2 and soff + i // 8 < len(buf):
        buf[soff + i // 8] &= ~(1 << (i % 8)) & 0xFF
    return f"zero stored value {i}"


def m_move_mask_bit(buf, r):
    """Move one set mask bit to a clear position (same chunk: often still valid)."""
    off, length = _spans(buf)[0]
    numel = HEADER.unpack_from(buf)[12] if len(buf) >= 120 else 0
    if length == 0 or off + length > len(buf) or numel > 8 * length:
        return "move mask bit: none"
    bits = np.unpackbits(np.frombuffer(bytes(buf[off:off + length]), np.uint8), bitorder="little")[:numel]
    ones, zeros = np.flatnonzero(bits), np.flatnonzero(bits == 0)
    if not ones.size or not zeros.size:
        return "move mask bit: none"
    a = int(ones[r.randrange(ones.size)])
    near = zeros[np.abs(zeros - a) < 64]
    b = int(near[r.randrange(near.size)]) if near.size and r.random() < 0.7 else int(zeros[r.randrange(zeros.size)])
    buf[off + a // 8] &= ~(1 << (a % 8)) & 0xFF
    buf[off + b // 8] |= 1 << (b % 8)
    return f"mask bit {a} -> {b}"


def m_padding(buf, r):
    """A nonzero byte where the spec wants zeros: header tail or a section's gap."""
    if len(buf) < 120:
        return "padding: none"
    spans = _spans(buf)
    ndim = buf[12]
    gaps = [(120 + 8 * ndim, a64(120 + 8 * ndim))] + [(o + n, o + a64(n)) for o, n in spans]
    gaps = [(a, b) for a, b in gaps if a < b <= len(buf)]
    if not gaps:
        return "padding: none"
    a, b = r.choice(gaps)
    pos = r.randrange(a, b)
    buf[pos] ^= 1 << r.randrange(8)
    return f"padding byte {pos}"


def m_bytes(buf, r):
    for _ in range(r.choice([1, 1, 2, 4])):
        if buf:
            buf[r.randrange(len(buf))] ^= r.randrange(1, 256)
    return "random bytes"


def m_cut(buf, r):
    marks = [0, 1, 119, 120, 127, 128, 191, 192, len(buf) - 1, len(buf) - 64]
    n = r.choice(marks) if r.random() < 0.5 else r.randrange(len(buf) + 1)
    n = max(0, min(n, len(buf)))
    del buf[n:]
    return f"cut to {n}"


def m_extend(buf, r):
    k = r.choice([1, 8, 63, 64, 200])
    buf.extend(bytes(k) if r.random() < 0.7 else bytes(r.randrange(256) for _ in range(k)))
    return f"extend by {k}"


def m_splice(buf, r):
    other = r.choice(CORPUS)
    marks = [120, 128, 192] + [o for o, _ in _spans(buf)]
    k = r.choice(marks) if r.random() < 0.6 else r.randrange(max(len(buf), 1))
    k = max(0, min(k, len(buf)))
    buf[k:] = other[k:]
    return f"splice at {k}"


def m_capacity(buf, r):
    """A new capacity written out validly: the canonical buffer at that capacity."""
    dec = oracle_decode(bytes(buf))
    if dec is None:
        return "capacity: undecodable"
    dt, enc, clog2, shape, cap, dense = dec
    nnz = int(np.count_nonzero(dense))
    new = min(dense.size, nnz + r.choice([0, 1, 7, 8, 64]))
    fresh = canonical(dt, enc, clog2, shape, new, dense)
    if fresh is None:
        return "capacity: no canonical buffer"
    buf[:] = fresh
    return f"capacity {cap} -> {new}"


MUTATIONS = [(m_field, 30), (m_shape, 6), (m_offsets, 8), (m_mask, 8), (m_move_mask_bit, 5),
             (m_values, 10), (m_zero_value, 4), (m_padding, 8), (m_bytes, 8), (m_cut, 6),
             (m_extend, 3), (m_splice, 5), (m_capacity, 6)]
_FUNCS = [f for f, _ in MUTATIONS]
_WEIGHTS = [w for _, w in MUTATIONS]


def make_case(seed: int):
    """``(buffer, description)`` of case ``seed``."""
    r = random.Random(seed)
    src = r.randrange(len(CORPUS))
    buf = bytearray(CORPUS[src])
    steps = [f"corpus[{src}]"]
    n = r.choices([0, 1, 2, 3], weights=[3, 57, 30, 10])[0]
    for fn in r.choices(_FUNCS, weights=_WEIGHTS, k=n):
        steps.append(fn(buf, r))
    if n and r.random() < 0.85:
        _reseal(buf)
        steps.append("resealed")
    return bytes(buf), steps


# --------------------------------------------------------------------------- #
# Checking one case                                                           #
# --------------------------------------------------------------------------- #
def _outcome(fn, buf):
    try:
        return fn(buf), None
    except E.FormatError as err:
        return None, err


def check_case(seed: int):
    """``(problem, steps)``: problem is None if case ``seed`` behaves as the spec says."""
    steps = ["(making the case)"]
    try:
        buf, steps = make_case(seed)
        h, err_v = _outcome(bc.validate, buf)
        p, err_f = _outcome(bc.from_bytes, buf)
        if type(err_v) is not type(err_f):
            return f"validate raised {err_v!r} but from_bytes raised {err_f!r}", steps
        dec = oracle_decode(buf)
        if err_v is not None:
            if type(err_v) not in RULE_ERRORS:
                return f"not one of the rules' named errors: {err_v!r}", steps
            if dec is not None and canonical(*dec) == buf:
                return f"rejected a valid buffer with {err_v!r}", steps
            return None, steps
        y = np.asarray(bc.unpack(p))
        if dec is None:
            return "accepted a buffer the oracle cannot decode", steps
        dt, enc, clog2, shape, cap, dense = dec
        if p.dtype is not dt or y.shape != shape or not np.array_equal(y.view(dt.uint).reshape(-1), dense):
            return "decoded tensor differs from the oracle's", steps
        if canonical(*dec) != buf:
            return "accepted a buffer that is not the canonical buffer of its tensor", steps
        if h.nnz != p.nnz or h.capacity != cap:
            return "validate's header disagrees with from_bytes", steps
        return None, steps
    except Exception:  # anything but a named FormatError is a failure
        return "unexpected exception:\n" + traceback.format_exc(limit=6), steps


def run_block(first: int, count: int):
    failures = []
    for seed in range(first, first + count):
        problem, steps = check_case(seed)
        if problem is not None:
            failures.append(f"seed {seed:#x}: {problem}  [{'; '.join(steps)}]")
            if len(failures) >= 5:
                break
    assert not failures, ("fuzz failures (replay one with BITSPARSE_FUZZ_SEED=<seed> "
                          "python3 -m pytest -q tests/test_fuzz.py -k replay):\n" + "\n".join(failures))


def test_corpus_is_valid_and_diverse():
    for buf in CORPUS:
        assert bc.validate(buf) is not None
        assert canonical(*oracle_decode(buf)) == buf
    headers = [HEADER.unpack_from(b) for b in CORPUS]
    assert {(h[3], h[4]) for h in headers} == set(DTYPES)
    assert {h[5] for h in headers} == {0, 1, 2}
    assert any(h[14] > h[13] for h in headers)                     # capacity > nnz
    assert any(h[12] == 0 for h in headers) and any(h[7] == 0 for h in headers)


def test_mutations_reach_every_rule():
    """The default run's mutations break every rule (each error seen) and yield valid
    buffers other than the corpus' (accepted after a mutation)."""
    seen, accepted_mutants = set(), 0
    for seed in range(BASE, BASE + 4000):
        buf, steps = make_case(seed)
        try:
            bc.validate(buf)
            accepted_mutants += len(steps) > 1 and buf not in CORPUS
        except E.FormatError as err:
            seen.add(type(err))
    assert seen == set(RULE_ERRORS), set(RULE_ERRORS) - seen
    assert accepted_mutants > 20


@pytest.mark.parametrize("block", range(DEFAULT_BLOCKS))
def test_fuzz(block):
    per = DEFAULT_CASES // DEFAULT_BLOCKS
    run_block(BASE + block * per, per)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(SLOW_BLOCKS))
def test_fuzz_slow(block):
    per = SLOW_CASES // SLOW_BLOCKS
    run_block(BASE + DEFAULT_CASES + block * per, per)


@pytest.mark.skipif("BITSPARSE_FUZZ_SEED" not in os.environ, reason="set BITSPARSE_FUZZ_SEED to replay a case")
def test_replay():
    seed = int(os.environ["BITSPARSE_FUZZ_SEED"], 0)
    problem, steps = check_case(seed)
    assert problem is None, f"seed {seed:#x}: {problem}  [{'; '.join(steps)}]"
