"""Unpack into an ``out=`` on a 16-byte boundary and into one 8 bytes past it, CuPy and
Numba, one packed tensor per backend, within one process.

    python3 bench/unpack_alignment.py [--numel 134217728] [--reps 10]

An ``out=`` 8 bytes off a 16-byte boundary (a view into a larger tensor) cannot take
16-byte stores; the CUDA C++ kernels then store two 8-byte words per vector, Numba's
unpack 8-byte words throughout (bench/NOTES.md, session 28). bf16 and fp8 e4m3fn at
sparsity 0.5 / 0.9 / 0.99, encoding nosign, median of ``--reps`` CUDA-event timings as in
bench_codecs.py; every output is checked byte for byte against the input first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, relu_like

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, args.reps)
    backends = [b for b in ("cupy", "numba") if bc.backend_available(b)]
    print("dtype | sparsity | " + " | ".join(f"{b} aligned us | {b} 8 bytes off us"
                                            for b in backends))
    for dname, tdt in (("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.float8_e4m3fn)):
        for sp in (0.5, 0.9, 0.99):
            x = relu_like(torch, args.numel, sp, tdt, seed=int(sp * 1000))
            step = 8 // x.element_size()
            base = torch.empty(x.numel() + step, dtype=tdt, device="cuda")
            outs = (base[:x.numel()], base[step:step + x.numel()])
            assert outs[0].data_ptr() % 16 == 0 and outs[1].data_ptr() % 16 == 8
            row = []
            for b in backends:
                p = bc.pack(x, encoding="nosign", backend=b, stream=stream)
                for out in outs:
                    bc.unpack(p, out=out, stream=stream)
                    stream.synchronize()
                    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), (b, dname, sp)
                    row.append(timer(lambda: bc.unpack(p, out=out, stream=stream)) * 1e3)
            print(f"{dname} | {sp} | " + " | ".join(f"{t:.1f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
