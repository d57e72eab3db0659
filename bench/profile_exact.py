"""Where an exact pack's time goes beyond a fixed-capacity pack's (issue 20).

An exact pack (``bc.pack(x)``, torch CUDA input, the CuPy or the Numba backend) packs
the mask and offsets into one allocation and the values into a worst-case one, waits for
the count (written to a pinned host slot before the pack's kernels end), copies the
stored values into an exact-size allocation laid out by ``host.tail_shrink`` and then
builds the PackedTensor. This times,
per call, on the GPU's clock (CUDA events on the call's stream) and the host's
(perf_counter):

* ``pack``: from the call's start to the end of the pack's kernels (a GPU event behind
  them; Numba's stitching kernel included);
* ``host in run``: the host's time to queue them (hidden behind the GPU sleep unless
  it is longer);
* ``wait``: the host blocked in the count's read, and the GPU idle from the kernels' end
  until the host queued the first shrink copy (the gap the GPU waits for the host);
* ``copies``: from there to the event after the copies (the exact allocation's and the
  copies' host time included);
* ``after``: the rest of the call (the PackedTensor, host work the end event waits for
  when it outlasts the copies);

beside the same input's fixed-capacity pack at K = nnz, in the same run. The exact pack
is timed twice: with the Python steps after the count (inside ``native.python_path()``)
and, where the torch extension builds, with its native wait and shrink
(``backends/cuda/shrink.py``: the Timer makes the call's stream torch's current one);
the marked calls run the Python steps. The wrapped
steps are the backend's own; a GPU sleep before each call hides the host's work up to
the pack's launch, as bench_codecs.py does.

The marks cost host time of their own where the GPU waits for the host (the event
before the copies, the one after them), so the ratio to the fixed pack is read from the
plain exact call, timed as the fixed one is (events around the call only), the two in
alternating turns; the marked calls give the phases.

    python bench/profile_exact.py [--backend cupy] [--numel 134217728] [--reps 10] > exact.txt
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
    ap.add_argument("--backend", default="cupy", choices=("cupy", "numba"))
    ap.add_argument("--turns", type=int, default=3,
                    help="alternating turns of the fixed and the plain exact pack")
    args = ap.parse_args(argv)
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, relu_like
    from bitsparse_core.torch import native
    # the native steps (backends/cuda/shrink.py) need the extension; None: Python only
    has_native = native.cuda_module() is not None

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, args.reps)
    marks = {}
    if args.backend == "cupy":
        from bitsparse_core.backends.cupy.backend import _CupySteps as steps
    else:
        from bitsparse_core.backends.numba.backend import _NumbaSteps as steps
    orig = {n: getattr(steps, n) for n in ("run", "read_head", "shrink")}

    # Events are made ahead (cudaEventCreate is host time the GPU would wait for
    # between the count and the copies); a mark only records one.
    spare = []

    def event():
        e = spare.pop() if spare else torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def run(self, plan, fixed=True, count=False):
        t0 = time.perf_counter()
        block = orig["run"](self, plan, fixed, count)
        marks["host_run_s"] = time.perf_counter() - t0
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

    print(f"{torch.cuda.get_device_name()}, {args.backend}, {args.numel} elements, bf16, "
          f"nosign; median of {args.reps}; us")
    print(f"fixed K and exact: median over {args.turns} alternating turns of each one's "
          "median")
    print("sparsity | fixed K | exact | exact / fixed | exact, native steps | native / fixed | "
          "exact, marked | pack (in exact) | host in run | host from the count to the first "
          "copy | GPU idle before the copies | copies | after")
    for sp in (float(s) for s in args.sparsities.split(",")):
        x = relu_like(torch, args.numel, sp, torch.bfloat16, seed=int(sp * 1000))
        nnz = int(torch.count_nonzero(x.view(torch.int16)))
        turns = {"fixed": [], "exact": [], "native": []}

        def exact():
            return bc.pack(x, encoding="nosign", stream=stream, backend=args.backend)
        for _ in range(args.turns):
            turns["fixed"].append(timer(lambda: bc.pack(x, capacity=nnz, encoding="nosign",
                                                        stream=stream, backend=args.backend)))
            with native.python_path():          # the Python steps after the count
                turns["exact"].append(timer(exact))
            if has_native:                      # the Timer makes ``stream`` torch's current one
                turns["native"].append(timer(exact))
        fixed, plain = (1e3 * statistics.median(turns[k]) for k in ("fixed", "exact"))
        nat = 1e3 * statistics.median(turns["native"]) if has_native else float("nan")
        rows = []
        for n, f in (("run", run), ("read_head", read_head), ("shrink", shrink)):
            setattr(steps, n, f)
        try:
            spare[:] = [torch.cuda.Event(enable_timing=True) for _ in range(5 * (3 + args.reps))]
            with torch.cuda.stream(stream), native.python_path():   # the Python steps' phases
                for i in range(3 + args.reps):
                    timer.flush.sum(dtype=torch.int32)
                    torch.cuda._sleep(timer.sleep_cycles)
                    start = event()
                    bc.pack(x, encoding="nosign", stream=stream, backend=args.backend)
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
        after = med([us(m["shrunk"], e) for _, e, m in rows])
        run_host = med([1e6 * m["host_run_s"] for *_, m in rows])
        print(f"{sp} | {fixed:.1f} | {plain:.1f} | {plain / fixed:.2f} | {nat:.1f} | "
              f"{nat / fixed:.2f} | {exact:.1f} | "
              f"{pack:.1f} | {run_host:.1f} | {host:.1f} | {idle:.1f} | {copies:.1f} | "
              f"{after:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
