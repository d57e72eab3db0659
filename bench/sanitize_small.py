"""A small pack / unpack / fused-op workload for compute-sanitizer (memcheck, racecheck).

Run under the sanitizer by bench/gpu_session.sh; exits non-zero if any result
differs from the reference codec. Sizes are small so the sanitizer stays fast,
but cover several tiles, a partial last tile, fixed capacity and every encoding,
and one bf16 tensor of more tiles than a wave of resident blocks.
"""

from __future__ import annotations

import sys

import numpy as np

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import bitsparse_core as bc  # noqa: E402
from bitsparse_core import dtypes as _dt
from bitsparse_core.backends.cuda import abi  # noqa: E402
from bitsparse_core.spec import codec as reference, ops as reference_ops  # noqa: E402
from gpu_util import random_bits  # noqa: E402


def main() -> int:
    import cupy as cp
    rng = np.random.default_rng(7)
    be = bc.get_backend("cupy")
    bad = 0
    for dt in (_dt.BFLOAT16, _dt.FLOAT8_E4M3FN, _dt.FLOAT32):
        x = random_bits(rng, (20_011,), dt, 0.8, signs=False)
        d = cp.asarray(x.view(dt.uint))
        for enc in ("raw", "nosign", "signplane"):
            for cap in (None, 3000):
                p = bc.pack(d, dtype=dt.name, encoding=enc, capacity=cap, backend="cupy")
                ref = reference.pack_array(x, dt, enc, capacity=cap)
                for name in ("mask", "offsets", "values", "signs"):
                    got = np.asarray(be.to_numpy(getattr(p, name))).view(np.uint8)
                    bad += not np.array_equal(got, np.asarray(getattr(ref, name)).view(np.uint8))
                if cap is None:
                    y = np.asarray(be.to_numpy(bc.unpack(p))).view(dt.uint)
                    bad += not np.array_equal(y, x.view(dt.uint))
        y, p = bc.relu_pack(d, dtype=dt.name, square=True, backend="cupy")
        y_ref, p_ref = reference_ops.relu_pack(x, dt, square=True)
        bad += not np.array_equal(np.asarray(be.to_numpy(y)).view(dt.uint), y_ref.view(dt.uint))
        g = bc.relu2_backward(y, p)
        bad += not np.array_equal(np.asarray(be.to_numpy(g)).view(dt.uint),
                                  reference_ops.relu2_backward(y_ref, p_ref).view(dt.uint))
    # More tiles than a wave of resident blocks: the pack and the unpack ask for later
    # tiles' planes in L2 (sm_90), which the small tensors above never reach.
    dt = _dt.BFLOAT16
    tile = abi.tile_elems(dt, abi.PACK_ROUNDS)
    n = 5 * cp.cuda.Device().attributes["MultiProcessorCount"] * tile + tile // 2 + 3
    x = random_bits(rng, (n,), dt, 0.5, signs=False)
    p = bc.pack(cp.asarray(x.view(dt.uint)), dtype=dt.name, encoding="nosign", backend="cupy")
    bad += not np.array_equal(np.asarray(be.to_numpy(bc.unpack(p))).view(dt.uint), x.view(dt.uint))
    cp.cuda.runtime.deviceSynchronize()
    print("sanitize_small: mismatches =", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
