"""No kernel keeps values in local memory.

A value whose address is taken (a reference passed to a ``__noinline__`` helper, an
array indexed at run time) lives in local memory, and every use costs a load or a store.
Session 20 found a fallback that took its vectors by reference: the caller stored them
to local memory for every vector, whether the fallback ran or not, and the fused
backward ran slower than the code it replaced (bench/NOTES.md). This test compiles
every kernel the CuPy backend can launch to PTX with nvcc and looks for local loads and
stores. PTX comes before register allocation, so spills do not show here; only what the
source forces into memory does.

Needs nvcc. It skips without one: CI has none, but the GPU machine and CUDA dev boxes do.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from bitsparse_core.backends.cupy.kernels import _source, all_kernel_keys, kernel_spec

from gpu_util import find_nvcc


def _kernels_by_file() -> dict:
    by_file: dict = {}
    for key in all_kernel_keys():
        file, name = kernel_spec(*key)
        by_file.setdefault(file, set()).add(name)
    return by_file


KERNELS = _kernels_by_file()
LOCAL = re.compile(r"\b(ld|st)\.local\b")


@pytest.mark.parametrize("file", sorted(KERNELS))
def test_no_kernel_loads_or_stores_local_memory(tmp_path, file):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    names = sorted(KERNELS[file])
    # the backend's own source text, every template it launches instantiated
    src = _source(file) + "\n" + "\n".join(f"template __global__ decltype({n}) {n};" for n in names)
    cu, ptx = tmp_path / file, tmp_path / (file + ".ptx")
    cu.write_text(src)
    # -ftz=true as CuPy compiles; sm_80 is the oldest target of the paired conversions
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", "-ptx", "-ftz=true", str(cu), "-o", str(ptx)],
                   check=True, capture_output=True)
    text = ptx.read_text()
    entries = list(re.finditer(r"\.entry (\S+)\(", text))
    assert len(entries) == len(names)
    offenders = {}
    for m in entries:
        body = text[m.end():]
        body = body[:body.index("\n}\n")]
        n = sum(1 for line in body.split("\n") if LOCAL.search(line))
        if n:
            offenders[m.group(1)] = n
    assert not offenders, f"local loads / stores per kernel: {offenders}"
