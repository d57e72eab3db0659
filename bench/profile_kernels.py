"""One pack and one unpack per backend / dtype, for ncu (profiling range only).

    ncu --clock-control none --profile-from-start off ... python3 bench/profile_kernels.py
    python3 bench/profile_kernels.py --host     # cProfile of the host side instead

Data as in bench_codecs.py (ReLU-like, |N(0,1)| with exact zeros, 'nosign').
Everything is compiled and run once before the profiled range starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bitsparse_core as bc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--backends", default="cupy,numba")
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--host", action="store_true", help="cProfile host time of 20 calls")
    a = ap.parse_args()

    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name in a.dtypes.split(","):
        tdt = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}[name]
        x = torch.randn(a.numel, device="cuda", generator=g).abs_().clamp_(min=2.0 ** -6)
        x[torch.rand(a.numel, device="cuda", generator=g) < a.sparsity] = 0
        x = x.to(tdt)
        cap = int((x != 0).sum()) + 1024
        for be in a.backends.split(","):
            cases.append((be, name, x, cap))

    def run(be, x, cap):
        p = bc.pack(x, encoding="nosign", capacity=cap, backend=be)
        y = bc.unpack(p)
        return p, y

    for be, name, x, cap in cases:      # compile + warm
        p, y = run(be, x, cap)
        torch.cuda.synchronize()
        assert torch.equal(torch.from_dlpack(y).view(torch.uint8), x.view(torch.uint8)), (be, name)
    if a.host:
        import cProfile
        import pstats
        for be, name, x, cap in cases:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                run(be, x, cap)
            torch.cuda.synchronize()
            pr.disable()
            print(f"==== host profile {be} {name} (20 pack+unpack)")
            pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
        return
    torch.cuda.profiler.start()
    for be, name, x, cap in cases:
        run(be, x, cap)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
