"""Host time of one cuBLAS call under the GPT bench's settings and under PyTorch's defaults.

    python bench/gemm_host.py [--settings bench,defaults,no-bf16-reduction,deterministic]
                              [--out DIR]                                   # CUDA only

The GPT bench (``train_gpt.py``) runs with deterministic algorithms, a fixed cuBLAS
workspace and bf16 reduced-precision reductions off, for its bit-for-bit comparisons. In
its profiles an ``addmm`` with a bias took ~120 µs of host time and an ``mm`` ~55 (the
H100's host, session 52), enough to make a compiled step's forward host-paced. Users
train with PyTorch's defaults. Each setting runs in a process of its own (the settings
are process-wide); per call, the host time of 50 calls issued while a sleep kernel holds
the GPU (so no call waits for the GPU), the fastest of 3 loops, at gpt12's first MLP GEMM
([8192, 1024] x [1024, 4096], bf16), with torch's ``x + x`` for the host's speed.
Writes ``gemm_host.json`` / ``.md`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "bench": "train_gpt.py's: deterministic algorithms, CUBLAS_WORKSPACE_CONFIG, no bf16 "
             "reduced-precision reductions",
    "defaults": "PyTorch's defaults",
    "no-bf16-reduction": "defaults but bf16 reduced-precision reductions off",
    "deterministic": "defaults but deterministic algorithms and CUBLAS_WORKSPACE_CONFIG",
}


def apply_settings(name: str) -> None:
    """Set ``name``'s process-wide flags (before any cuBLAS handle exists), with
    ``train_gpt.py``'s own functions."""
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
    import train_gpt as tg
    if name in ("bench", "deterministic"):
        tg.deterministic_algorithms()
    if name in ("bench", "no-bf16-reduction"):
        tg.exact_bf16_reductions()


def measure(name: str, calls: int = 50, loops: int = 3) -> dict:
    import torch
    apply_settings(name)
    dev = torch.device("cuda")
    x = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    fns = {"addmm with bias": lambda: torch.addmm(b, x, w.t()),
           "mm": lambda: torch.mm(x, w.t()), "x + x": lambda: x + x}
    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    out = {}
    for op, fn in fns.items():
        best = float("inf")
        for _ in range(loops):
            torch.cuda._sleep(200_000_000)      # the GPU busy: no call waits for it
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        out[op] = best
    return {"setting": name, "device": torch.cuda.get_device_name(dev), "host_us": out}


def markdown(rows: list) -> str:
    ops = list(rows[0]["host_us"])
    lines = [f"# Host µs per call by setting ({rows[0]['device']})", "",
             "| setting | " + " | ".join(ops) + " |", "|---" * (1 + len(ops)) + "|"]
    lines += [f"| {r['setting']} | " + " | ".join(f"{r['host_us'][o]:.1f}" for o in ops) + " |"
              for r in rows]
    lines += [""] + [f"- {k}: {v}" for k, v in SETTINGS.items()
                     if k in {r["setting"] for r in rows}]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)      # a child process: one setting
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    rows = []
    for name in args.settings.split(","):
        if name not in SETTINGS:
            ap.error(f"unknown setting {name!r}")
        run = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    text = markdown(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_host.json").write_text(json.dumps(rows, indent=1))
        (out / "gemm_host.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
