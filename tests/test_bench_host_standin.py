"""bench/host_standin.py on the CPU: both backends' ops run on its stand-in driver, with
the driver calls each op is known to make (its own process: the stand-in libcuda must
not be the one this process's driver module loads)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("numba.cuda")

ROOT = Path(__file__).resolve().parents[1]
PACKS = ("pack_fixed", "relu_pack", "masked_pack")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-in driver")
def test_every_op_runs_with_the_driver_calls_it_makes(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "host_standin.py"), "--calls", "20",
           "--repeats", "1", "--micro", "--out", str(tmp_path)]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "host_standin.json").read_text())
    rows = {(r["backend"], r["op"]): r for r in res["rows"]}
    assert {b for b, _ in rows} == {"cupy", "numba"} and len(rows) == 16
    for (backend, op), r in rows.items():
        calls = {k: v for k, v in r["calls"].items() if v}
        if backend == "cupy":     # the pack is one cooperative kernel
            want = {"coop": 1, "memset": 1} if op in PACKS else {"launch": 1}
        else:                     # Numba's entry points ask the driver for the device
            want = {"launch": 1, "other": 1} | ({"memset": 1} if op in PACKS else {})
        assert calls == want, (backend, op, calls)
        assert r["us"] > 0 and r["param_bytes"] > 0
    assert "| masked_pack |" in (tmp_path / "host_standin.md").read_text()
    assert res["malloc"] in ("glibc", "jemalloc", "tcmalloc", "unknown")
    blocks = {r["block"] for r in res["micro"]}
    assert "a Python call" in blocks and any("bound launch" in b for b in blocks)


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("c++") is None,
                    reason="no C / C++ compiler for the stand-in driver and the extension")
def test_cpp_rows_take_the_public_ops_native_path(tmp_path):
    """--backends cupy,c++: the public ops through their C++ path (torch/native_codec.py)
    make the CuPy backend's driver calls, from C++ (no record Python sees)."""
    cmd = [sys.executable, str(ROOT / "bench" / "host_standin.py"), "--calls", "20",
           "--repeats", "1", "--backends", "cupy,c++", "--out", str(tmp_path)]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(r["backend"], r["op"]): r
            for r in json.loads((tmp_path / "host_standin.json").read_text())["rows"]}
    assert len(rows) == 16
    for op in PACKS + ("unpack", "unpack_out", "relu_backward", "relu2_backward",
                       "gated_backward"):
        cupy, native = rows[("cupy", op)], rows[("c++", op)]
        assert {k: v for k, v in native["calls"].items() if v} == \
            {k: v for k, v in cupy["calls"].items() if v}, op
        assert native["param_bytes"] is None and cupy["param_bytes"] > 0 and native["us"] > 0


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("c++") is None,
                    reason="no C / C++ compiler for the stand-in driver and the extension")
def test_module_rows_run_the_packed_ffn_through_the_cpp_path(tmp_path):
    """--module: the packed FFN's forward and backward on the C++ path with the stand-in's
    entry points (its packs' slots written clean, so no recompute), beside dense; --hf
    (where transformers is installed): a tiny OPT, plain and converted, the same way."""
    try:
        import transformers  # noqa: F401
        hf = ["--hf"]
    except ImportError:
        hf = []
    cmd = [sys.executable, str(ROOT / "bench" / "host_standin.py"), "--calls", "40",
           "--repeats", "1", "--module", *hf, "--backends", "cupy", "--out", str(tmp_path)]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "host_standin.json").read_text())
    rows = res["module"]
    assert [r["variant"] for r in rows] == ["dense", "packed-nosign"]
    # times are reported, never asserted
    assert all(r[k] > 0 for r in rows for k in ("forward_us", "train_us"))
    if hf:
        assert [r["variant"] for r in res["hf"]] == ["plain", "converted"]
        assert all(r[k] > 0 for r in res["hf"] for k in ("forward_us", "train_us"))


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("c++") is None,
                    reason="no C / C++ compiler for the stand-in driver, the extension and "
                           "inductor's CPU kernels")
def test_compiled_rows_compare_the_compiled_stacks_and_name_the_ops(tmp_path):
    """--compiled: a stack of MLP blocks under torch.compile, dense and packed, on the C++
    path; the packed step's extra host time by function names the bitsparse ops, both of
    them (forward and backward: pstats alone would keep one of the two entries that print
    alike)."""
    cmd = [sys.executable, str(ROOT / "bench" / "host_standin.py"), "--calls", "40",
           "--repeats", "1", "--compiled", "2", "--backends", "cupy", "--out", str(tmp_path)]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "host_standin.json").read_text())["compiled"]
    assert res["layers"] == 2
    assert [r["variant"] for r in res["rows"]] == ["dense", "packed-nosign"]
    assert all(r[k] > 0 for r in res["rows"] for k in ("forward_us", "train_us"))
    for name, per_block in (("by_function", 2), ("by_function_forward", 1)):
        ops = [r for r in res[name] if "torch._ops.bitsparse" in r["function"]]
        assert len(ops) == 1 and ops[0]["dense_calls"] == 0
        assert ops[0]["packed_calls"] == 2 * per_block   # forward (and backward) op a block
