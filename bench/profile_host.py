"""Where the host time of one public ``bc.*`` call goes: cProfile of a tight loop.

bench/host_overhead.py says how long a call takes; this says which functions the
time is spent in (self time, sorted), on the small tensor where the GPU time is
negligible, for the same calls and argument modes. cProfile adds its own cost to
every Python call, so read the shares, not the absolute numbers.

Usage (GPU machine): python bench/profile_host.py [--ops pack_fixed,unpack]
    [--modes torch] [--calls 2000] [--top 18] > profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import host_overhead as ho  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated op keys (default: all)")
    ap.add_argument("--modes", default="torch")
    ap.add_argument("--backend", default="cupy", help="cupy, numba or torch.ops")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--shape", default="1x4096")
    ap.add_argument("--preimport", default="",
                    help="modules to import first (comma-separated), e.g. bitsparse_core.torch.ops "
                         "as host_overhead.py's hook does")
    args = ap.parse_args(argv)
    import importlib

    import torch
    import bitsparse_core as bc
    for name in filter(None, args.preimport.split(",")):
        importlib.import_module(name)
    dev = ho.Device(torch, cpu_smoke=False, sleep_cycles=0)
    inp = ho.make_inputs(torch, dev, ho.parse_shape(args.shape), 0.9, 0)
    wanted = [o for o in args.ops.split(",") if o]
    for mode in args.modes.split(","):
        if args.backend == "torch.ops":       # the torch adapter's ops (bench hook)
            from bitsparse_core.torch.ops import BENCH_CASES
            cases = BENCH_CASES(ho.parse_shape(args.shape), torch.bfloat16, dev.device)
        else:
            cases, _ = ho.public_cases(bc, torch, dev, inp, args.backend,
                                       ho.call_kwargs(torch, dev, mode))
        for name, fn in cases.items():
            if wanted and name not in wanted:
                continue
            for _ in range(50):
                fn()
            dev.sync()
            held = []
            gc.disable()          # as host_overhead.py times: no collection inside the loop
            t0 = time.perf_counter()
            for _ in range(args.calls):
                held.append(fn())
            per_call = (time.perf_counter() - t0) / args.calls * 1e6
            dev.sync()
            held.clear()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                held.append(fn())
            prof.disable()
            dev.sync()
            held.clear()
            gc.enable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
            body = buf.getvalue()
            body = body[body.find("ncalls"):]
            print(f"=== {args.backend} {mode} {name}: {per_call:.1f} us per call unprofiled")
            print(body.rstrip())
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
