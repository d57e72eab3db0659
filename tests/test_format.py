"""The spec's header, size formula and worked examples (docs/format.md §4, §6, §10)."""

from __future__ import annotations

import numpy as np
import pytest

import bitsparse_core as bc
from bitsparse_core import dtypes as D
from bitsparse_core.spec import format as F


def test_header_constants():
    assert F.MAGIC == b"BSPK" and F.VERSION == 1 and F.FIXED_HEADER_SIZE == 120
    assert F.header_size(0) == 128 and F.header_size(1) == 128 and F.header_size(2) == 192
    assert F.header_size(64) == 640


def test_dlpack_pairs():
    assert [(d.name, d.dl_code, d.bits) for d in D.ALL] == [
        ("bfloat16", 4, 16), ("float16", 2, 16), ("float32", 2, 32),
        ("float8_e4m3fn", 10, 8), ("float8_e5m2", 12, 8)]


def test_offset_width_switches_at_2_pow_32():
    assert F.offset_width(2**32 - 1) == 4 and F.offset_width(2**32) == 8


def _formula(shape, dtype, encoding, cap, clog2):
    """§6 written out independently of format.layout."""
    a64 = lambda n: -(-n // 64) * 64  # noqa: E731
    numel = int(np.prod(shape, dtype=np.int64))
    b = dtype.bits
    H = a64(120 + 8 * len(shape))
    w = 8 if numel >= 2**32 else 4
    lens = [-(-numel // 8), (-(-numel // 2**clog2) + 1) * w,
            cap * b // 8 if encoding == "raw" else -(-cap * (b - 1) // 8),
            -(-cap // 8) if encoding == "signplane" else 0]
    return H + sum(a64(n) for n in lens)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1000,), (7, 9, 11), (2**33,), (2**31 + 3,)])
@pytest.mark.parametrize("dtype", D.ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
def test_size_formula(shape, dtype, encoding):
    numel = int(np.prod(shape, dtype=np.int64))
    for cap in {0, numel // 3, numel}:
        for clog2 in (9, 12, 24):
            lay = F.layout(shape, dtype, encoding, cap, clog2)
            assert lay.total_size == _formula(shape, dtype, encoding, cap, clog2)
            assert all(off % 64 == 0 for off, _ in lay.sections.values())


def test_worked_example_float32_signplane():
    x = np.array([0, 1.5, 0, 0, -2.0, 0, 0, 0, 0, 0.25], dtype=np.float32)
    buf = bc.pack(x, encoding="signplane", chunk_log2=9).to_bytes()
    assert len(buf) == 384
    h = F.decode_header(buf)
    assert h.checksum == 0x94303799
    assert h.sections == ((128, 2), (192, 8), (256, 12), (320, 1))
    assert buf[128:130].hex() == "1202"
    assert buf[192:200].hex() == "0000000003000000"
    assert buf[256:268].hex() == "0000c03f00000020 0000a00f".replace(" ", "")
    assert buf[320:321].hex() == "02"


def test_worked_example_bf16_nosign():
    y = np.array([[0, 1, 2], [0, 0, 3], [0, 0, 0]], dtype=D.BFLOAT16.numpy)
    buf = bc.pack(y, encoding="nosign", chunk_log2=9).to_bytes()
    assert len(buf) == 384
    assert F.decode_header(buf).sections == ((192, 2), (256, 8), (320, 6), (384, 0))
    assert buf[192:194].hex() == "2600"
    assert buf[320:326].hex() == "803f00201010"


@pytest.mark.parametrize("encoding,total,ratio", [("nosign", 42_074_368, 6.38),
                                                  ("raw", 43_752_064, 6.14)])
def test_sizes_at_scale_table(encoding, total, ratio):
    n, nnz = 2**27, 13_421_773
    lay = F.layout((n,), D.BFLOAT16, encoding, nnz)
    assert lay.total_size == total
    assert round(2 * n / total, 2) == ratio


def test_edge_case_layouts():
    empty = F.layout((0, 5), D.FLOAT16, "raw", 0)
    assert empty.n_chunks == 0 and empty.offsets[1] == 4 and empty.mask[1] == 0
    scalar = F.layout((), D.BFLOAT16, "raw", 1)
    assert scalar.numel == 1 and scalar.header_size == 128
    big = F.layout((2**32,), D.FLOAT8_E4M3FN, "nosign", 10)
    assert big.offset_width == 8


def test_header_round_trip():
    lay = F.layout((3, 4, 5), D.FLOAT8_E5M2, "signplane", 17, 10)
    raw = F.encode_header(lay, 11, checksum=0xDEADBEEF)
    assert len(raw) == lay.header_size
    h = F.decode_header(raw + bytes(lay.total_size - len(raw)))
    assert (h.shape, h.nnz, h.capacity, h.checksum, h.chunk_log2) == ((3, 4, 5), 11, 17, 0xDEADBEEF, 10)
    assert h.dtype is D.FLOAT8_E5M2 and h.encoding == F.Encoding.SIGNPLANE


def _doc_rule_rows():
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    section = text[text.index("## 8. Validation"):text.index("### 8.1")]
    return [(int(m[1]), m[2], m[3]) for m in
            re.finditer(r"^\| (\d+) \| (V\d+[abc]?) \| .* \| `(\w+)` \|$", section, re.M)]


def test_spec_rule_table_is_the_order_the_reader_checks():
    """docs/format.md §8 lists the rules, their order and errors exactly as the reader
    applies them (tests/test_validation.py proves that order pair by pair)."""
    from test_validation import RULES
    rows = _doc_rule_rows()
    assert [n for n, _, _ in rows] == list(range(1, len(RULES) + 1))
    assert [(rule, err) for _, rule, err in rows] == [(r, e.__name__) for r, e, _ in RULES]
    from bitsparse_core import errors as E
    for _, rule, err in rows:   # each error's docstring names its rule
        assert rule in getattr(E, err).__doc__


def test_dimension_bound_constants():
    assert F.MAX_EXTENT == 2**58
    assert F.extent(()) == 1 and F.extent((0, 0)) == 1 and F.extent((3, 0, 5)) == 15
    F.check_extent((2**58, 0))
    with pytest.raises(bc.ShapeTooLargeError):
        F.check_extent((2**29, 2**29, 2))
