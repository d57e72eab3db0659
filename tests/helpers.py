"""Data generators shared by the CPU tests, and the simulator re-run of a test module."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bitsparse_core import dtypes as D

ALL_DTYPES = D.ALL
ENCODINGS = ("raw", "nosign", "signplane")


def special_patterns(dtype: D.DType) -> np.ndarray:
    """Bit patterns that break careless codecs: ±0, ±inf, NaN payloads, subnormals, extremes."""
    b = dtype.bits
    sign = 1 << (b - 1)
    exp_bits = {16: (8 if dtype is D.BFLOAT16 else 5), 32: 8, 8: (4 if dtype is D.FLOAT8_E4M3FN else 5)}[b]
    mant = b - 1 - exp_bits
    exp_all = ((1 << exp_bits) - 1) << mant
    pats = {0, sign, 1, sign | 1, (1 << mant) - 1, exp_all, sign | exp_all, exp_all | 1,
            exp_all | (1 << (mant - 1)), sign | exp_all | ((1 << mant) - 1), sign - 1, (1 << b) - 1}
    return np.array(sorted(pats), dtype=dtype.uint)


def random_tensor(rng, shape, dtype: D.DType, sparsity: float, *, signed=True,
                  specials=True) -> np.ndarray:
    """Random bit patterns (every pattern possible) with the given fraction zeroed."""
    n = int(np.prod(shape, dtype=np.int64))
    bits = rng.integers(0, 1 << dtype.bits, size=n, dtype=np.uint64).astype(dtype.uint)
    if specials and n:
        sp = special_patterns(dtype)
        where = rng.integers(0, n, size=min(n, 2 * sp.size))
        bits[where] = sp[rng.integers(0, sp.size, size=where.size)]
    if not signed:
        bits &= np.array(dtype.sign_mask - 1, dtype=dtype.uint)
    bits[rng.random(n) < sparsity] = 0
    return bits.view(dtype.numpy).reshape(shape)


def same_bits(a, b, dtype: D.DType) -> bool:
    a = np.asarray(a)
    b = np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(dtype.uint), b.view(dtype.uint))


SIM_ACTIVE = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """``python3 bench/<script> *args`` from the repository root, the package importable,
    one OpenMP thread unless set (a bench's small matmuls crawl on a busy machine's many
    threads); its output captured as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def run_in_simulator(test_file: str, timeout: int = 1800) -> None:
    """Run the test module ``test_file`` again in a child pytest process with Numba's
    CUDA simulator switched on (``NUMBA_ENABLE_CUDASIM=1``): the variable must be set
    before ``numba.cuda`` is first imported, and other tests of this process may
    already have imported it. Skips without numba or when the child ran no test;
    fails with the child's output when it failed."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
         str(Path(test_file).resolve().relative_to(ROOT))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    print(out)
    if proc.returncode == 5 or (proc.returncode == 0 and not re.search(r"\d+ passed", out)):
        pytest.skip("the simulator suite collected or ran no test:\n" + out[-2000:])
    assert proc.returncode == 0, "simulator suite failed:\n" + out[-12000:]


def jax_gpu():
    """JAX's first GPU device, or skip the test (JAX imported by the caller's module)."""
    import jax
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
