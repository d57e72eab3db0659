"""Where an exact pack's time goes beyond a fixed-capacity pack's (issue 20).

An exact pack (``bc.pack(x)``, CuPy backend, torch CUDA input) packs the mask and
offsets into one allocation and the values into a worst-case one, waits for the count
(which the kernel writes to a pinned host slot before it ends), copies the stored
values into an exact-size allocation and then builds the exact plan. This times, per
call, on the GPU's clock (CUDA events on the call's stream) and the host's
(perf_counter):

* ``pack``: from the call's start to the end of the pack kernel (a GPU event behind it);
* ``wait``: the host blocked in the count's read, and the GPU idle from the kernel's end
  until the host queued the first shrink copy (the gap the GPU waits for the host);
* ``shrink``: the copies' GPU time;

beside the same input's fixed-capacity pack at K = nnz, in the same run. The wrapped
steps are the backend's own; a GPU sleep before each call hides the host's work up to
the pack's launch, as bench_codecs.py does.

    python bench/profile_exact.py [--numel 134217728] [--reps 10] > exact.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sparsities", default="0.5,0.9,0.99")
    args = ap.parse_args(argv)
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, relu_like
    from bitsparse_core.backends.cupy import backend as cb

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, args.reps)
    marks = {}
    steps = cb._CupySteps
    orig = {n: getattr(steps, n) for n in ("run", "read_head", "shrink")}

    # Events are made ahead (cudaEventCreate is host time the GPU would wait for
    # between the count and the copies); a mark only records one.
    spare = []

    def event():
        e = spare.pop() if spare else torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def run(self, plan, fixed=True, count=False):
        block = orig["run"](self, plan, fixed, count)
        marks["packed"] = event()
        return block

    def read_head(self, plan, block):
        t0 = time.perf_counter()
        out = orig["read_head"](self, plan, block)
        marks["host_wait_s"] = time.perf_counter() - t0
        marks["woke"] = time.perf_counter()
        return out

    def shrink(self, plan, block, nnz):
        marks["host_to_shrink_s"] = time.perf_counter() - marks["woke"]
        marks["shrink_start"] = event()
        out = orig["shrink"](self, plan, block, nnz)
        marks["shrunk"] = event()
        return out

    print(f"{torch.cuda.get_device_name()}, {args.numel} elements, bf16, nosign; median of "
          f"{args.reps}; us")
    print("sparsity | fixed K | exact | pack (in exact) | host from the count to the first "
          "copy | GPU idle before the copies | copies")
    for sp in (float(s) for s in args.sparsities.split(",")):
        x = relu_like(torch, args.numel, sp, torch.bfloat16, seed=int(sp * 1000))
        nnz = int(torch.count_nonzero(x.view(torch.int16)))
        fixed = timer(lambda: bc.pack(x, capacity=nnz, encoding="nosign", stream=stream))
        rows = []
        for n, f in (("run", run), ("read_head", read_head), ("shrink", shrink)):
            setattr(steps, n, f)
        try:
            spare[:] = [torch.cuda.Event(enable_timing=True) for _ in range(5 * (3 + args.reps))]
            with torch.cuda.stream(stream):
                for i in range(3 + args.reps):
                    timer.flush.sum(dtype=torch.int32)
                    torch.cuda._sleep(timer.sleep_cycles)
                    start = event()
                    bc.pack(x, encoding="nosign", stream=stream)
                    end = event()
                    if i >= 3:
                        rows.append((start, end, dict(marks)))
            stream.synchronize()
        finally:
            for n, f in orig.items():
                setattr(steps, n, f)
        us = lambda a, b: a.elapsed_time(b) * 1e3   # noqa: E731  (events give ms)
        med = lambda v: statistics.median(v)         # noqa: E731
        exact = med([us(s, e) for s, e, _ in rows])
        pack = med([us(s, m["packed"]) for s, _, m in rows])
        host = med([1e6 * m["host_to_shrink_s"] for *_, m in rows])
        idle = med([us(m["packed"], m["shrink_start"]) for *_, m in rows])
        copies = med([us(m["shrink_start"], m["shrunk"]) for *_, m in rows])
        print(f"{sp} | {1e3 * fixed:.1f} | {exact:.1f} | {pack:.1f} | {host:.1f} | {idle:.1f} | "
              f"{copies:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
