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


@pytest.mark.parametrize("name", sorted(pack_bound.pack_protos.PROTOS))
def test_prototypes_apply_to_the_kernel_and_name_their_launch(name):
    from bitsparse_core.backends.cuda import abi
    src = _source("bitsparse_pack.cu")
    out = pack_bound.variant_source(src, name)
    assert out != src and "bitsparse_pack(u64 x_ptr" in out
    smem, threads = pack_bound.launch_shape(name, 33088)
    assert smem == 33088 + pack_bound.pack_protos.INPUT_TILE
    assert threads == (abi.THREADS + 32 if name.startswith("lookback-warp") else abi.THREADS)


@pytest.mark.parametrize("name", sorted(pack_bound.pack_protos.PROTOS))
def test_prototypes_compile(tmp_path, name):
    """nvcc (where there is one: not in CI) compiles each prototype's plain bf16 and fp8
    nosign packs for sm_90, as the GPU machine's NVRTC will."""
    import subprocess

    from gpu_util import find_nvcc
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    src = pack_bound.variant_source(_source("bitsparse_pack.cu"), name)
    src += "".join(f"\ntemplate __global__ decltype(bitsparse_pack<{f},1,0,4>) bitsparse_pack<{f},1,0,4>;"
                   for f in (0, 3))
    cu = tmp_path / "proto.cu"
    cu.write_text(src)
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-cubin", str(cu), "-o", str(tmp_path / "p.cubin")],
                   check=True, capture_output=True)
