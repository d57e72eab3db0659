"""Writes the golden fixtures once. Re-running it after a format change is a
deliberate act: the committed fixtures are what makes such a change break CI.

    PYTHONPATH=. python tests/golden/make_golden.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import bitsparse_core as bc
from bitsparse_core import dtypes as D

HERE = Path(__file__).resolve().parent

CASES = [  # name, dtype, shape, encoding, sparsity, chunk_log2, seed
    ("bf16_nosign_relu", D.BFLOAT16, (24, 70), "nosign", 0.85, 9, 11),
    ("fp16_raw_odd", D.FLOAT16, (3, 5, 67), "raw", 0.6, 9, 12),
    ("fp32_signplane", D.FLOAT32, (1031,), "signplane", 0.9, 10, 13),
    ("e4m3_signplane_specials", D.FLOAT8_E4M3FN, (600,), "signplane", 0.3, 9, 14),
    ("e5m2_nosign", D.FLOAT8_E5M2, (2, 2, 257), "nosign", 0.5, 9, 15),
    ("bf16_scalar", D.BFLOAT16, (), "raw", 0.0, 12, 16),
    ("fp16_empty", D.FLOAT16, (4, 0), "nosign", 0.0, 12, 17),
    ("fp32_all_zero", D.FLOAT32, (100,), "raw", 1.0, 9, 18),
]


def dense(dtype, shape, encoding, sparsity, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    bits = rng.integers(1, 1 << dtype.bits, size=n, dtype=np.uint64).astype(dtype.uint)
    if encoding == "nosign":
        bits &= np.array(dtype.sign_mask - 1, dtype=dtype.uint)
        bits[bits == 0] = 1
    bits[rng.random(n) < sparsity] = 0
    return bits.reshape(shape)


def main() -> None:
    for name, dtype, shape, enc, s, clog2, seed in CASES:
        bits = dense(dtype, shape, enc, s, seed)
        p = bc.pack(bits, dtype=dtype, encoding=enc, chunk_log2=clog2)
        (HERE / f"{name}.bspk").write_bytes(p.to_bytes())
        np.save(HERE / f"{name}.bits.npy", bits)  # the dense tensor's bit patterns
        print(name, p)


if __name__ == "__main__":
    main()
