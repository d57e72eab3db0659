"""Does a small device-to-host copy on one stream wait for a large one on another?

The offloaded FFN ops copy each packed block to pinned host memory on a side stream and
each pack's 16-byte count on some stream too. If copies of one direction share a copy
engine in submission order, a count copied on the compute stream waits behind the
previous layer's block copy, and the compute stream with it (bench/NOTES.md, session 14).
This times it: stream A copies ``--mib`` MiB device-to-host; right after, stream B copies
16 bytes device-to-host and then runs a tiny kernel. Reported: how long B's copy and
kernel took from their submission, beside A's copy time, and the same with B's copy left
out (its kernel alone). If B waits for A, "B: copy + kernel" is close to A's copy time.

    python bench/copy_engine_probe.py --out OUT     # CUDA only; writes copy_engine_probe.json / .md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def probe(mib: int, reps: int, small_copy: bool) -> dict:
    dev = torch.device("cuda")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    big = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
    big_host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    small = torch.zeros(16, dtype=torch.uint8, device=dev)
    small_host = torch.empty(16, dtype=torch.uint8, pin_memory=True)
    x = torch.zeros(1024, device=dev)
    times_a, times_b = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)             # both streams' work queued before any runs
        ev = torch.cuda.Event()
        ev.record()
        ea0, ea1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        eb0, eb1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(a):
            a.wait_event(ev)
            ea0.record()
            big_host.copy_(big, non_blocking=True)
            ea1.record()
        with torch.cuda.stream(b):
            b.wait_event(ev)
            eb0.record()
            if small_copy:
                small_host.copy_(small, non_blocking=True)
            x.add_(1.0)
            eb1.record()
        torch.cuda.synchronize()
        times_a.append(ea0.elapsed_time(ea1))
        times_b.append(eb0.elapsed_time(eb1))
    return {"big_copy_ms": statistics.median(times_a), "b_ms": statistics.median(times_b)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    with_copy = probe(args.mib, args.reps, True)
    without = probe(args.mib, args.reps, False)
    res = {"device": torch.cuda.get_device_name(), "mib": args.mib, "reps": args.reps,
           "with_small_copy": with_copy, "kernel_only": without,
           "waits": with_copy["b_ms"] > 0.5 * with_copy["big_copy_ms"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy_engine_probe.json").write_text(json.dumps(res, indent=1))
    md = (f"# A small device-to-host copy beside a large one ({res['device']})\n\n"
          f"Stream A copies {args.mib} MiB to pinned host memory; stream B then copies 16 "
          f"bytes and runs a small kernel (both queued behind one sleep, medians of "
          f"{args.reps}).\n\n| case | A: big copy (ms) | B: from its start (ms) |\n|---|---|---|\n"
          f"| B copies 16 bytes, then its kernel | {with_copy['big_copy_ms']:.3f} | "
          f"{with_copy['b_ms']:.3f} |\n"
          f"| B runs its kernel only | {without['big_copy_ms']:.3f} | {without['b_ms']:.3f} |\n\n"
          f"B's small copy waits for A's copy: **{'yes' if res['waits'] else 'no'}**.\n")
    (out / "copy_engine_probe.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
