"""bench/cuda_sass.py: the kernel's own ptxas figures are read (not a helper function's),
and where nvcc and nvdisasm are installed (not in CI) a build reports what a switch
changes: the pack's L2 prefetch is in the bf16 build's code and absent from fp8's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cuda_sass  # noqa: E402

REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z14bitsparse_packILi0ELi1ELi0ELi4EEvyy' for 'sm_90'
ptxas info    : Function properties for _Z14bitsparse_packILi0ELi1ELi0ELi4EEvyy
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : Compile time = 221.405 ms
ptxas info    : Function properties for _Z16bs_pack_epilogueyyyjybyyyy
    0 bytes stack frame, 40 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 30 registers
"""


def test_the_entry_functions_figures_are_read():
    got = cuda_sass._ptxas_entry(REPORT, "_Z14bitsparse_packILi0ELi1ELi0ELi4EEvyy")
    assert got == (64, 12, 8)
    with pytest.raises(ValueError, match="no entry function"):
        cuda_sass._ptxas_entry(REPORT, "_Z16bs_pack_epilogueyyyjybyyyy")


def test_kernels_are_named_as_kernel_spec_takes_them():
    assert cuda_sass.parse_kernel("pack:0,1,0,4") == ("pack", (0, 1, 0, 4))
    assert cuda_sass.parse_kernel("mask_select:3") == ("mask_select", (3,))


def _have_tools() -> bool:
    try:
        cuda_sass.tool("nvcc"), cuda_sass.tool("nvdisasm")
    except SystemExit:
        return False
    return shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.mark.skipif(not _have_tools(), reason="needs nvcc and nvdisasm")
def test_a_switch_shows_in_the_build_it_applies_to():
    bf16 = [cuda_sass.build("pack", (0, 1, 0, 4), opts) for opts in ((), ("-DBS_PACK_PREFETCH=0",))]
    fp8 = [cuda_sass.build("pack", (3, 1, 0, 4), opts) for opts in ((), ("-DBS_PACK_PREFETCH=0",))]
    assert all(0 < b.registers <= 255 and b.instructions for b in bf16 + fp8)
    assert any(op.startswith("UBLKPF") for op, _ in bf16[0].instructions)     # the bulk prefetch
    assert not any(op.startswith("UBLKPF") for op, _ in bf16[1].instructions)
    assert [op for op, _ in fp8[0].instructions] == [op for op, _ in fp8[1].instructions]
