"""How early a pack's count reaches the host through its pinned slot (issue 20).

The pack kernel writes its status and count into a pinned host slot as soon as the grid's
last tile knows them (``PackArgs.slot``). This queues fixed-capacity packs of a 2^27
bf16 tensor with nothing else on the stream and times, on the host's clock from the
launch's return: when the slot lands (spinning on it, no CUDA call), and when the stream
is seen done (spinning on ``cuStreamQuery`` right after), beside the call's GPU time
(CUDA events around it: the host's queueing, which the idle GPU waits for, included).
A slot landing before the stream is done is what lets an exact pack queue its shrink
while the kernel still runs.

    python bench/slot_latency.py [--reps 20] [--numel 134217728]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sparsities", default="0.5,0.9,0.99")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from bench_codecs import relu_like
    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import abi, driver, host, slots
    from bitsparse_core.spec.format import Encoding

    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}, {args.numel} bf16 elements, nosign, fixed "
          f"capacity = numel; median of {args.reps}; us from the launch's return")
    print("sparsity | call (GPU events) | slot landed | stream done | done - landed")
    for sp in (float(s) for s in args.sparsities.split(",")):
        x = relu_like(torch, args.numel, sp, torch.bfloat16, seed=int(sp * 1000))
        plan = host.pack_plan((args.numel,), D.BFLOAT16, Encoding.NOSIGN, args.numel, 12,
                              abi.Mode.PACK)
        block = torch.empty(plan.nbytes + plan.scratch_bytes, dtype=torch.uint8, device="cuda")
        rows = []
        for i in range(3 + args.reps):
            torch.cuda.synchronize()
            slot = slots.take()
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * abi.SLOT_BYTES).from_address(slot))
            v32, v64 = raw.view(np.uint32), raw.view(np.uint64)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            host.enqueue_pack(plan, 0, stream, x.data_ptr(), block.data_ptr(),
                              block.data_ptr() + plan.nbytes, slot=slot)
            t0 = time.perf_counter()
            b.record()
            while v32[0] == abi.SLOT_SENTINEL32 or v64[1] == abi.SLOT_SENTINEL64:
                pass
            t_slot = time.perf_counter()
            while not driver.stream_done(stream):
                pass
            t_done = time.perf_counter()
            status, nnz = slots.wait(slot, stream)        # landed: returns it to the ring
            assert status == 0 and nnz == int(torch.count_nonzero(x.view(torch.int16)))
            if i >= 3:
                rows.append((a.elapsed_time(b) * 1e3, (t_slot - t0) * 1e6, (t_done - t0) * 1e6))
        med = [statistics.median(r[k] for r in rows) for k in range(3)]
        print(f"{sp} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[2] - med[1]:.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
