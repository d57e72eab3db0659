"""bench/pack_bound.py edits the pack kernel's source by text: every variant must still
find the text it edits in kernels/bitsparse_pack.cu (a kernel change that moves it
fails here, not on the GPU), and an unknown variant is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pack_bound  # noqa: E402
from bitsparse_core.backends.cupy.kernels import _source  # noqa: E402


@pytest.mark.parametrize("name", pack_bound.VARIANTS[1:] + (pack_bound.FLOOR,))
def test_every_variant_edits_the_kernel(name):
    src = _source("bitsparse_pack.cu")
    out = pack_bound.variant_source(src, name)
    assert out != src and "bitsparse_pack(u64 x_ptr" in out
    for part in name.split("+"):
        assert pack_bound.variant_source(src, part) != src


def test_prod_is_the_kernel_and_unknown_names_are_refused():
    src = _source("bitsparse_pack.cu")
    assert pack_bound.variant_source(src, "prod") == src
    with pytest.raises(SystemExit, match="no variant"):
        pack_bound.variant_source(src, "nolb-typo")


def test_file_variants_name_their_launch_shape():
    from bitsparse_core.backends.cuda import abi
    assert pack_bound.launch_shape("nolb", 33088) == (33088, abi.THREADS)
    assert pack_bound.launch_shape("file=k.cu", 33088) == (33088, abi.THREADS)
    assert pack_bound.launch_shape("file=k.cu@49472", 33088) == (49472, abi.THREADS)
    assert pack_bound.launch_shape("file=k.cu@49472@288", 33088) == (49472, 288)
