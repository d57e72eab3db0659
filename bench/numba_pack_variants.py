"""Fixed-capacity pack and unpack timings of Numba kernel variants, within one device call.

    python3 bench/numba_pack_variants.py "" pack_blocks=6 lb_early=1 ticket=0 unpack_prefetch=1

Each argument is one variant: ``PackVariant`` fields (``pack_rounds``,
``pack_blocks``, ``lb_early``, ``ticket``, ``warp_redux``, ``unpack_prefetch``; see
numba/kernels.py), "" for the committed kernels. bf16 and fp8 e4m3fn at sparsity 0.5,
0.9 and 0.99, 2^27 elements, encoding nosign, median of 10 CUDA-event timings as in
bench_codecs.py (so the pack and its k_finish launch are timed together). Every
variant's planes are compared byte for byte with the committed kernels', and its
unpack of the committed pack with the input (``same`` column); the GPU tests check
the committed kernels against the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import cupy  # noqa: E402
import torch  # noqa: E402

from bitsparse_core.backends.numba import kernels as NK  # noqa: E402
from bitsparse_core.backends.numba.backend import NumbaBackend  # noqa: E402
from bench_codecs import Timer, relu_like  # noqa: E402

PLANES = ("mask", "offsets", "values", "signs")


def _same_plane(a, b) -> bool:
    """Both absent (nosign has no sign plane), or equal byte for byte."""
    if a is None or b is None:
        return a is None and b is None
    return bool(cupy.array_equal(cupy.asarray(a), cupy.asarray(b)))


def main() -> None:
    variants = sys.argv[1:] or [""]
    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, 10)
    for dname, tdtype in (("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.float8_e4m3fn)):
        for sp in (0.5, 0.9, 0.99):
            x = relu_like(torch, 1 << 27, sp, tdtype, seed=int(sp * 1000))
            nnz = int(torch.count_nonzero(x.view(torch.uint8 if x.element_size() == 1 else torch.int16)))

            def pack(be):
                return be.pack(x, encoding="nosign", capacity=nnz, stream=stream)

            ref = pack(NumbaBackend())
            stream.synchronize()
            for v in variants:
                kw = {k: int(val) for k, val in (item.split("=") for item in v.split(",") if item)}
                be = NumbaBackend(NK.PackVariant(**kw))
                p = pack(be)
                stream.synchronize()
                same = all(_same_plane(getattr(p, n), getattr(ref, n)) for n in PLANES)
                ms = timer(lambda: pack(be))
                print(f"{v or '(committed)':32s} {dname:14s} s={sp} pack fixed {ms * 1e3:7.1f} us"
                      f"  same={same}", flush=True)
                out = torch.empty_like(x)
                be.unpack(ref, out=out, stream=stream)
                stream.synchronize()
                same = bool(torch.equal(out.view(torch.uint8), x.view(torch.uint8)))
                ms = timer(lambda: be.unpack(ref, out=out, stream=stream))
                print(f"{v or '(committed)':32s} {dname:14s} s={sp} unpack     {ms * 1e3:7.1f} us"
                      f"  same={same}", flush=True)


if __name__ == "__main__":
    main()
