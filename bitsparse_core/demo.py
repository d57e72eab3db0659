"""``bitsparse demo``: pack ReLU-like tensors, check the round trip, show the sizes.

Runs on the GPU backends when one is available, else on the CPU reference codec.
"""

from __future__ import annotations

import time

import numpy as np

from . import dtypes as _dt
from . import format as _fmt
from .backends import backend_available, registered_backends

SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.99)
DTYPES = (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32, _dt.FLOAT8_E4M3FN, _dt.FLOAT8_E5M2)


def relu_like(rng, shape, sparsity: float, dtype: _dt.DType) -> np.ndarray:
    """ReLU output with the given fraction of exact zeros (values from |N(0,1)|)."""
    x = np.abs(rng.standard_normal(shape, dtype=np.float32)).astype(dtype.numpy)
    x[rng.random(shape) < sparsity] = 0
    # A dtype can round tiny magnitudes to zero; make every kept value nonzero.
    bits = x.view(dtype.uint)
    bits[(bits == 0) & (rng.random(shape) >= sparsity)] = 1
    return x


def pick_backend() -> str:
    for name, dev in registered_backends().items():
        if dev == "cuda" and backend_available(name):
            return name
    return "numpy"


def run(numel: int = 1 << 22, seed: int = 0) -> list:
    import bitsparse_core as bc

    backend = pick_backend()
    rng = np.random.default_rng(seed)
    to_device, to_host = _movers(backend)
    rows = []
    for dtype in DTYPES:
        for s in SPARSITIES:
            host = relu_like(rng, (numel,), s, dtype)
            x = to_device(host)
            t0 = time.perf_counter()
            p = bc.pack(x, encoding="nosign", backend=backend, dtype=dtype)
            nnz = p.nnz
            t1 = time.perf_counter()
            y = bc.unpack(p)
            back = to_host(y)
            t2 = time.perf_counter()
            exact = np.array_equal(np.asarray(back).view(dtype.uint), host.view(dtype.uint))
            formula = _fmt.packed_size(host.shape, dtype, _fmt.Encoding.NOSIGN, nnz)
            rows.append(dict(dtype=dtype.name, sparsity=s, nnz=nnz, packed=p.nbytes,
                             formula=formula, ratio=p.ratio, pack_s=t1 - t0,
                             unpack_s=t2 - t1, exact=exact))
    return backend, rows


def _movers(backend: str):
    if backend == "numpy":
        return (lambda a: a), (lambda a: np.asarray(a))
    import cupy as cp  # CuPy has no bf16/fp8: move the bits, pack(dtype=...) names the type

    def to_host(a):
        return cp.asnumpy(cp.from_dlpack(a) if not isinstance(a, cp.ndarray) else a)

    return (lambda a: cp.asarray(a.view(f"u{a.dtype.itemsize}"))), to_host


def main(argv=None) -> int:
    backend, rows = run()
    print(f"backend: {backend}   (tensor of {1 << 22:,} elements, encoding nosign)")
    head = f"{'dtype':<14}{'sparsity':>9}{'nnz':>10}{'packed B':>11}{'formula B':>11}{'ratio':>7}{'exact':>7}"
    print(head)
    print("-" * len(head))
    ok = True
    for r in rows:
        match = r["packed"] == r["formula"]
        ok &= match and r["exact"]
        print(f"{r['dtype']:<14}{r['sparsity']:>9.2f}{r['nnz']:>10}{r['packed']:>11}"
              f"{r['formula']:>11}{r['ratio']:>7.2f}{'yes' if r['exact'] else 'NO':>7}")
    print("all round trips bit-exact and sizes equal to the spec's formula" if ok else "MISMATCH")
    return 0 if ok else 1
