"""The kernel ABI (bitsparse_core/backends/cuda/abi.py) against the CUDA sources: the
generated header is the one checked in, and every argument record matches its
kernel's parameter list field for field (name order and width)."""

from __future__ import annotations

import ctypes
import re

import pytest

from bitsparse_core.backends.cuda import abi
from bitsparse_core.backends.cuda.sources import kernel_dir, read_source

RECORDS = {
    ("bitsparse_pack.cu", "bitsparse_pack"): abi.PackArgs,
    ("bitsparse_unpack.cu", "bitsparse_unpack"): abi.UnpackArgs,
    ("bitsparse_unpack.cu", "bitsparse_mask_select"): abi.MaskSelectArgs,
    ("bitsparse_unpack.cu", "bitsparse_tile_counts"): abi.TileCountsArgs,
}
_WIDTH = {"u64": ctypes.c_uint64, "int": ctypes.c_int32}


def _params(source: str, kernel: str) -> list:
    """``[(type, name), ...]`` of a ``__global__`` kernel's parameter list."""
    m = re.search(r"\b" + kernel + r"\s*\(([^)]*)\)\s*\{", source)
    assert m, f"{kernel} not found"
    params = []
    for p in m.group(1).split(","):
        typ, name = p.split()
        params.append((typ, name))
    return params


def test_header_file_is_the_generated_one():
    assert (kernel_dir() / "bitsparse_abi.h").read_text() == abi.header()


@pytest.mark.parametrize("where", sorted(RECORDS), ids=lambda w: w[1])
def test_record_matches_kernel_signature(where):
    file, kernel = where
    params = _params(read_source(file), kernel)
    fields = RECORDS[where]._fields_
    assert len(fields) == len(params)
    for (fname, ftype), (ptype, pname) in zip(fields, params):
        assert ftype is _WIDTH[ptype], (fname, pname, ptype)
        # names agree up to the kernels' _ptr suffixes and a few spelled-out ones
        base = pname.removesuffix("_ptr")
        assert fname == base or {fname, base} in ({"width", "w"},), (fname, pname)


def test_record_pointers_follow_the_fields():
    r = abi.UnpackArgs()
    r.out = 0x1234
    out_index = [n for n, _ in r._fields_].index("out")
    assert ctypes.c_uint64.from_address(r.pointers[out_index]).value == 0x1234
