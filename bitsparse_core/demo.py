"""``bitsparse demo``: pack ReLU-like tensors, check the round trip, show sizes and speed.

On a machine with a CUDA GPU and a GPU backend (CuPy, else Numba) it runs there;
otherwise on the CPU reference codec. Where PyTorch is installed it ends with a
short training comparison: a ReLU² FFN stack trained dense and with packed
activations (peak memory, step time, identical losses).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

from . import dtypes as _dt
from .spec import format as _fmt
from .backends import select_backend
from .errors import BitsparseError

SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.99)
DTYPES = (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32, _dt.FLOAT8_E4M3FN, _dt.FLOAT8_E5M2)


def relu_like(rng, n: int, sparsity: float, dtype: _dt.DType) -> np.ndarray:
    """ReLU output bits: |N(0,1)| values, a ``sparsity`` fraction of exact zeros, and
    every kept value nonzero (tiny magnitudes that round to zero are bumped to 1 ulp)."""
    x = np.abs(rng.standard_normal(n, dtype=np.float32)).astype(dtype.numpy)
    bits = x.view(dtype.uint)
    keep = rng.random(n) >= sparsity
    bits[~keep] = 0
    bits[keep & (bits == 0)] = 1
    return x


def pick_backend() -> str:
    """The backend ``pack(..., backend="auto")`` would take for a CUDA tensor, else numpy."""
    try:
        return select_backend("auto", "cuda").name
    except BitsparseError:
        return "numpy"


class _Device:
    """Moves test data to where the backend runs and times it honestly."""

    def __init__(self, backend: str):
        self.gpu = backend != "numpy"
        if self.gpu:
            import cupy
            self.cp = cupy

    def put(self, host: np.ndarray):
        # CuPy has no bf16/fp8 arrays: move the bits, pack(dtype=...) names the type.
        return self.cp.asarray(host.view(f"u{host.dtype.itemsize}")) if self.gpu else host

    def get(self, arr, dtype: _dt.DType) -> np.ndarray:
        if self.gpu:
            return self.cp.asnumpy(self.cp.asarray(arr).view(dtype.uint))
        return np.asarray(arr).view(dtype.uint)

    def sync(self):
        if self.gpu:
            self.cp.cuda.Device().synchronize()

    def timed(self, fn, repeats: int):
        fn()  # warm-up: compilation and allocation stay out of the numbers
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times)


def codec_table(numel: int, seed: int = 0) -> tuple:
    import bitsparse_core as bc

    backend = pick_backend()
    dev = _Device(backend)
    repeats = 10 if dev.gpu else 1
    rng = np.random.default_rng(seed)
    rows = []
    cases = [(d, s) for d in DTYPES for s in SPARSITIES]
    for dtype, s in tqdm(cases, desc=f"packing on {backend}", unit="case", file=sys.stderr,
                         disable=None):
        host = relu_like(rng, numel, s, dtype)
        x = dev.put(host)
        p, t_pack = dev.timed(lambda: bc.pack(x, encoding="nosign", backend=backend,
                                              dtype=dtype), repeats)
        y, t_unpack = dev.timed(lambda: bc.unpack(p), repeats)
        exact = np.array_equal(dev.get(y, dtype), host.view(dtype.uint))
        formula = _fmt.packed_size(host.shape, dtype, _fmt.Encoding.NOSIGN, p.nnz)
        dense = host.nbytes
        rows.append(dict(dtype=dtype.name, sparsity=s, nnz=p.nnz, packed=p.nbytes,
                         formula=formula, ratio=p.ratio,
                         pack_gbs=(dense + p.nbytes) / t_pack / 1e9,
                         unpack_gbs=(dense + p.nbytes) / t_unpack / 1e9, exact=exact))
    return backend, rows


def print_codec_table(backend: str, numel: int, rows: list) -> bool:
    print(f"\nbackend: {backend}   tensor of {numel:,} elements, encoding nosign, "
          "throughput = (dense + packed bytes) / median time")
    head = (f"{'dtype':<14}{'sparsity':>9}{'nnz':>11}{'packed B':>12}{'formula B':>12}"
            f"{'ratio':>7}{'pack GB/s':>11}{'unpack GB/s':>12}{'exact':>7}")
    print(head)
    print("-" * len(head))
    ok = True
    for r in rows:
        ok &= r["packed"] == r["formula"] and r["exact"]
        print(f"{r['dtype']:<14}{r['sparsity']:>9.2f}{r['nnz']:>11,}{r['packed']:>12,}"
              f"{r['formula']:>12,}{r['ratio']:>7.2f}{r['pack_gbs']:>11.1f}"
              f"{r['unpack_gbs']:>12.1f}{'yes' if r['exact'] else 'NO':>7}")
    print("all round trips bit-exact, all sizes equal to the format's formula" if ok
          else "MISMATCH: see the rows above")
    return ok


def training_comparison() -> bool:
    """Dense vs packed ReLU² FFN training (needs torch and bitsparse_core.torch)."""
    try:
        import torch
        from .torch import demo_training
    except ImportError as exc:
        print(f"\n(training comparison skipped: {exc})")
        return True
    return demo_training.run_and_print(torch.device("cuda" if torch.cuda.is_available()
                                                    else "cpu"))


def main(argv=None) -> int:
    numel = 1 << 24 if pick_backend() != "numpy" else 1 << 20
    backend, rows = codec_table(numel)
    ok = print_codec_table(backend, numel, rows)
    ok &= training_comparison()
    return 0 if ok else 1
