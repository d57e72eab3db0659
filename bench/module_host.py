"""Host time of one FFN layer in training, packed against dense, where the GPU time is
negligible: what the GPU waits for in a host-bound step (bench/train_gpt.py's gpt12).

bench/host_overhead.py times the library's ops one by one; this times what a model
calls: the module's forward under autograd, and forward plus backward, on a few
tokens (GPU work of a few µs per kernel), beside the dense ReLU² MLP of the GPT
bench (``fc2(relu(fc1(x))²)``) and the same MLP under activation checkpointing.
Every loop is timed without a sync inside; each repeat runs one loop of every variant
(and of torch's ``x + x``, this host's speed) in turn, and "x dense" is the median of
the ratios within a repeat: the host of the device machine drifts by up to 2x within
minutes.

    python bench/module_host.py [--tokens 128] [--d 1024] [--ff 4096] [--out DIR]
        [--cprofile packed-nosign,packed-offload]   # also those variants under cProfile
        [--op-profile dense,packed-nosign]          # and torch.profiler's host time per op

Writes OUT/module_host.{json,md,png} (and module_host_cprofile.txt, module_host_ops.txt).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bitsparse_core.torch as bst  # noqa: E402
from bitsparse_core.torch import native  # noqa: E402
from plotting import pyplot  # noqa: E402


class DenseReLU2FFN(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class PythonHost(nn.Module):
    """A packed module on the op's Python host path (native.python_path) instead of C++."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with native.python_path():
            return self.inner(x)


def build(args, device):
    torch.manual_seed(0)
    dense = DenseReLU2FFN(args.d, args.ff).to(device, torch.bfloat16)
    with torch.no_grad():
        dense.fc1.bias.fill_(-0.02)       # some zeros, as a trained layer has many
    return {
        "dense": dense,
        "checkpoint": Checkpointed(dense),
        "packed-nosign": bst.PackedReLU2FFN.from_dense(dense.fc1, dense.fc2, encoding="nosign"),
        "packed-python": PythonHost(bst.PackedReLU2FFN.from_dense(dense.fc1, dense.fc2,
                                                                  encoding="nosign")),
        "packed-raw": bst.PackedReLU2FFN.from_dense(dense.fc1, dense.fc2, encoding="raw"),
        "packed-offload": bst.PackedReLU2FFN.from_dense(dense.fc1, dense.fc2, encoding="nosign",
                                                        offload=bst.Offloader()),
    }


def loops_in_turn(fns: dict, n: int, repeats: int, sync) -> dict:
    """``{name: [µs per call, one per repeat]}``: each repeat times one loop of ``n`` calls
    of every function in turn (the order rotated each repeat), so that the host's drift
    lands on all of them alike (bench/interleaved.py does the same for whole steps)."""
    names = list(fns)
    out = {k: [] for k in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fns[name]()
            out[name].append((time.perf_counter() - t0) / n * 1e6)
            sync()
    return out


def op_table(name: str, fn, iters: int, sync) -> str:
    """torch.profiler's host time per op over ``iters`` calls of ``fn`` (C++ ops, the
    library's own named ones among them), sorted by self CPU time."""
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return f"## {name}: forward + backward, {iters} calls\n{table}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cprofile", default="",
                    help="comma-separated variants to run under cProfile too (e.g. packed-nosign)")
    ap.add_argument("--op-profile", default="",
                    help="comma-separated variants whose ops' host time torch.profiler tables "
                         "(module_host_ops.txt)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    models = build(args, device)
    x = torch.randn(args.tokens, args.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(args.tokens, args.d, device=device, dtype=torch.bfloat16)
    small = torch.randn(1, 4096, device=device)

    def forward(m):
        return lambda: m(x)

    def train(m):
        return lambda: m(x).backward(g)

    def add():
        return small + small

    for m in models.values():          # warm-up: kernels, capacity policies, allocator
        for _ in range(30):
            train(m)()
    sync()
    fns = {"x+x": add}
    for name, m in models.items():
        fns[("forward", name)] = forward(m)
        fns[("train", name)] = train(m)
    loops = loops_in_turn(fns, args.iters, args.repeats, sync)
    med = {k: statistics.median(v) for k, v in loops.items()}
    ref = [loops["x+x"][0], loops["x+x"][-1]]
    add_us = med["x+x"]
    rows = [{"variant": name, "forward_us": med[("forward", name)],
             "train_us": med[("train", name)]} for name in models]
    dense = rows[0]
    for r in rows:
        r["backward_us"] = r["train_us"] - r["forward_us"]
        r["train_in_adds"] = r["train_us"] / add_us
        r["train_minus_dense_us"] = r["train_us"] - dense["train_us"]
        # the median over repeats of the ratio within a repeat (loops close in time)
        r["train_x_dense"] = statistics.median(
            a / b for a, b in zip(loops[("train", r["variant"])], loops[("train", "dense")]))
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime()),
           "config": {k: getattr(args, k) for k in ("tokens", "d", "ff", "iters", "repeats")},
           "x_plus_x_us": ref, "rows": rows,
           "native": native.host_path(device)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = []
    for name in filter(None, args.cprofile.split(",")):
        prof = cProfile.Profile()
        fn = train(models[name])
        prof.enable()
        for _ in range(args.iters):
            fn()
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        texts.append(f"## {name}: forward + backward, {args.iters} calls\n{text.getvalue()}")
    if texts:
        (out / "module_host_cprofile.txt").write_text("\n\n".join(texts))
    tables = [op_table(name, train(models[name]), args.iters, sync)
              for name in filter(None, args.op_profile.split(","))]
    if tables:
        (out / "module_host_ops.txt").write_text("\n\n".join(tables))
    (out / "module_host.json").write_text(json.dumps(res, indent=2))
    write_md(res, out / "module_host.md")
    write_plot(res, out / "module_host.png")
    for r in rows:
        print(f"{r['variant']:14s} forward {r['forward_us']:7.1f} us  backward "
              f"{r['backward_us']:7.1f} us  train {r['train_us']:7.1f} us  "
              f"x dense {r['train_x_dense']:.2f}")
    print(f"x + x {ref[0]:.1f} / {ref[1]:.1f} us (first / last)")
    return 0


def write_md(res: dict, path: Path) -> None:
    c = res["config"]
    lines = [f"# Host time of one FFN layer in training ({res['device']})", "",
             f"{res['date_utc']}; torch {res['torch']}; bf16, {c['tokens']} tokens, d={c['d']}, "
             f"d_ff={c['ff']} (GPU time negligible); median of {c['repeats']} loops of "
             f"{c['iters']} calls, no sync inside a loop, each repeat timing one loop of every "
             f"variant in turn; × dense: the median of the ratios within a repeat. This host: "
             f"`x + x` {res['x_plus_x_us'][0]:.1f} / {res['x_plus_x_us'][1]:.1f} µs (first / "
             f"last repeat).", "",
             "| variant | forward µs | backward µs | forward + backward µs | in x+x | "
             "− dense µs | × dense |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['forward_us']:.1f} | {r['backward_us']:.1f} | "
                     f"{r['train_us']:.1f} | {r['train_in_adds']:.1f} | "
                     f"{r['train_minus_dense_us']:+.1f} | {r['train_x_dense']:.2f} |")
    lines += ["", "Backward = (forward + backward) − forward of separate loops. The dense "
              "layer is the GPT bench's MLP; `checkpoint` is it under non-reentrant "
              "checkpointing; `packed-*` are `PackedReLU2FFN.from_dense` of it "
              "(`packed-offload`: nosign with an `Offloader`; `packed-python`: nosign on the "
              "op's Python host path; the others took the "
              f"{res.get('native', '?')} one)."]
    path.write_text("\n".join(lines) + "\n")


def write_plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    names = [r["variant"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    fwd = [r["forward_us"] for r in rows]
    bwd = [r["backward_us"] for r in rows]
    ax.barh(names, fwd, label="forward")
    ax.barh(names, bwd, left=fwd, label="backward")
    ax.set_xlabel("host µs per layer (forward + backward)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    ax.set_title("One FFN layer's host time in training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
