"""End-to-end training-step benchmark of a bf16 FFN stack: dense vs checkpoint vs
save_on_cpu vs bitsparse_core.torch (raw / nosign), for ReLU and ReLU².

One run measures everything: for each kind, every variant's peak memory
(torch.cuda.max_memory_allocated over one step) and memory right after the
forward, then interleaved timed steps (variant A, B, ... each round) so clock
drift hits all variants alike. A step is: grads set to None, forward, backward
with a fixed output gradient, SGD update. Results go to
bench/results/torch_ffn.{json,md,png}, the JSON rewritten after every phase.

    python3 bench/bench_torch_ffn.py [--tokens 16384 --d 4096 --f 21504 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bitsparse_core.torch import PackedReLU2FFN, PackedReLUFFN  # noqa: E402
from bitsparse_core.torch.offload import Offloader  # noqa: E402
from plotting import pyplot  # noqa: E402

DEVICE = "cuda"
VARIANTS = ("dense", "checkpoint", "save_on_cpu", "ours_raw", "ours_nosign", "ours_offload",
            "ours_offload_hold0")
# ours_offload* (nosign, blocks in pinned host memory until backward, issue 17) run on
# request; _hold0: Offloader(hold=0), every device block released once its copy is queued
DEFAULT_VARIANTS = VARIANTS[:-2]
MIB = 1 << 20


class DenseFFN(nn.Module):
    def __init__(self, d, f, square, **kw):
        super().__init__()
        self.square = square
        self.fc1 = nn.Linear(d, f, **kw)
        self.fc2 = nn.Linear(f, d, **kw)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(torch.square(h) if self.square else h)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _allocated():
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _peak():
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _reset():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build(args, square):
    kw = dict(device=DEVICE, dtype=torch.bfloat16)
    torch.manual_seed(0)
    dense = nn.ModuleList(DenseFFN(args.d, args.f, square, **kw) for _ in range(args.layers))
    z = 0.8416212335729143  # Phi^-1(0.8): pre-activations ~N(-z, 1) are 80% negative
    with torch.no_grad():
        for blk in dense:
            nn.init.normal_(blk.fc1.weight, std=1 / math.sqrt(args.d))
            blk.fc1.bias.fill_(-z)
            nn.init.normal_(blk.fc2.weight, std=0.1 / math.sqrt(args.f))
            blk.fc2.bias.zero_()
    cls = PackedReLU2FFN if square else PackedReLUFFN
    packed = {enc: nn.ModuleList(cls.from_dense(b.fc1, b.fc2, encoding=enc) for b in dense)
              for enc in ("raw", "nosign")}
    for name, hold in (("offload", 2), ("offload_hold0", 0)):
        if "ours_" + name in args.variants:
            off = Offloader(hold=hold)   # one for the stack: it prefetches across layers
            packed[name] = nn.ModuleList(cls.from_dense(b.fc1, b.fc2, encoding="nosign",
                                                        offload=off) for b in dense)
    return dense, packed


def forward(variant, dense, packed, x):
    blocks = packed[variant[5:]] if variant.startswith("ours_") else dense
    for blk in blocks:
        if variant == "checkpoint":
            x = x + checkpoint(blk, x, use_reentrant=False)
        else:
            x = x + blk(x)
    return x


def step(variant, dense, packed, x, gy, opt):
    opt.zero_grad(set_to_none=True)
    if variant == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=DEVICE == "cuda"):
            out = forward(variant, dense, packed, x)
    else:
        out = forward(variant, dense, packed, x)
    after_forward = _allocated()
    out.backward(gy)
    del out
    opt.step()
    return after_forward


def sparsity(dense, x):
    """Fraction of zero activations per layer, on the benchmark's input."""
    fr = []
    with torch.no_grad():
        for blk in dense:
            a = blk.fc1(x)
            fr.append(float((a <= 0).float().mean()))
            x = x + blk(x)
            del a
    return fr


def run_kind(args, kind, results, save):
    square = kind == "relu2"
    dense, packed = build(args, square)
    params = list(dense.parameters())
    opt = torch.optim.SGD(params, lr=1e-6, foreach=True)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(args.tokens, args.d, device=DEVICE, generator=g).bfloat16()
    gy = (torch.randn(args.tokens, args.d, device=DEVICE, generator=g) * 1e-3).bfloat16()
    res = results["kinds"][kind] = {"sparsity_per_layer": sparsity(dense, x), "variants": {}}
    variants = [v for v in VARIANTS if v in args.variants]

    # Phase 1: warm up, then one step per variant with the peak counter reset.
    for v in variants:
        entry = res["variants"][v] = {}
        try:
            for _ in range(args.warmup):
                step(v, dense, packed, x, gy, opt)
            _sync()
            opt.zero_grad(set_to_none=True)
            _reset()
            base = _allocated()
            after_fwd = step(v, dense, packed, x, gy, opt)
            _sync()
            entry.update(base_mib=base / MIB, after_forward_mib=after_fwd / MIB,
                         saved_mib=(after_fwd - base) / MIB, peak_mib=_peak() / MIB)
        except Exception as exc:  # noqa: BLE001 -- record it, measure the other variants
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        opt.zero_grad(set_to_none=True)
        _reset()
        print(f"[{kind}] {v}: {entry}", flush=True)
        save()

    # Phase 2: interleaved timed steps.
    ok = [v for v in variants if "error" not in res["variants"][v]]
    times = {v: [] for v in ok}
    for _ in range(args.steps):
        for v in ok:
            _sync()
            t0 = time.perf_counter()
            step(v, dense, packed, x, gy, opt)
            _sync()
            times[v].append((time.perf_counter() - t0) * 1e3)
    for v in ok:
        res["variants"][v].update(step_ms=times[v], median_ms=statistics.median(times[v]))
    if args.profile:
        res["profile"] = {}
        for v in ok:
            if v == "dense" or v.startswith("ours_"):
                try:
                    res["profile"][v] = profile_step(v, dense, packed, x, gy, opt)
                except Exception as exc:  # noqa: BLE001 -- the profile is optional
                    res["profile"][v] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    summarize(res)
    print(f"[{kind}] timings: " + ", ".join(f"{v} {res['variants'][v]['median_ms']:.1f} ms"
                                            for v in ok), flush=True)
    save()
    del dense, packed, opt, x, gy, params
    _reset()


def profile_step(v, dense, packed, x, gy, opt):
    """GPU time of one step by kernel (torch.profiler), to see where a variant's extra
    time goes and how long the GPU sits idle (wall time minus kernel time)."""
    from torch.profiler import ProfilerActivity, profile
    _sync()
    t0 = time.perf_counter()
    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step(v, dense, packed, x, gy, opt)
        _sync()
    wall = (time.perf_counter() - t0) * 1e3
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
        else:  # a CPU smoke run: self CPU time
            t = e.self_cpu_time_total
        if t > 0:
            rows.append([e.key[:90], t / 1e3, e.count])
    rows.sort(key=lambda r: -r[1])
    gpu = sum(r[1] for r in rows)
    return {"wall_ms_profiled": wall, "gpu_ms": gpu, "top": rows[:14]}


def summarize(res):
    """Ratios to dense and the targets: time within 2% of dense, peak = dense's minus
    the bytes packing saves (measured as the after-forward difference), ReLU² below
    checkpoint."""
    vs = res["variants"]
    d = vs.get("dense", {})
    if "median_ms" not in d:
        return
    for name, e in vs.items():
        if "median_ms" in e:
            e["time_vs_dense"] = e["median_ms"] / d["median_ms"]
            e["peak_vs_dense"] = e["peak_mib"] / d["peak_mib"] if d["peak_mib"] else float("nan")
        if name.startswith("ours_") and "peak_mib" in e:
            saves = d["after_forward_mib"] - e["after_forward_mib"]
            e["bytes_saved_mib"] = saves
            e["predicted_peak_mib"] = d["peak_mib"] - saves
            e["peak_minus_predicted_mib"] = e["peak_mib"] - e["predicted_peak_mib"]


def write_outputs(results, out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [f"# bf16 FFN stack training step ({results['device']})", "",
             f"{results['config']['layers']} layers, d={results['config']['d']}, "
             f"f={results['config']['f']}, {results['config']['tokens']} tokens; "
             f"median of {results['config']['steps']} interleaved steps after "
             f"{results['config']['warmup']} warm-up steps; peak = max_memory_allocated "
             "over one step (params and grads included).", ""]
    for kind, res in results["kinds"].items():
        sp = res["sparsity_per_layer"]
        lines += [f"## {kind} (zero activations per layer: {min(sp):.3f}-{max(sp):.3f})", "",
                  "| variant | peak MiB | vs dense | saved after fwd MiB | step ms | vs dense |"
                  " predicted peak MiB | peak - predicted MiB |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for v, e in res["variants"].items():
            if "error" in e:
                lines.append(f"| {v} | {e['error'][:60]} | | | | | | |")
                continue
            f = lambda k, fmt="{:.0f}": fmt.format(e[k]) if k in e else ""  # noqa: E731
            lines.append(f"| {v} | {f('peak_mib')} | {f('peak_vs_dense', '{:.3f}')} | "
                         f"{f('saved_mib')} | {f('median_ms', '{:.1f}')} | "
                         f"{f('time_vs_dense', '{:.3f}')} | {f('predicted_peak_mib')} | "
                         f"{f('peak_minus_predicted_mib', '{:.1f}')} |")
        lines.append("")
        prof = res.get("profile", {})
        if prof:
            lines += [f"GPU time by kernel over one profiled {kind} step (torch.profiler; "
                      "wall time includes the profiler's overhead):", "",
                      "| variant | kernel | ms | calls |", "| --- | --- | ---: | ---: |"]
            for v, pr in prof.items():
                if "error" in pr:
                    lines.append(f"| {v} | {pr['error'][:80]} | | |")
                    continue
                lines.append(f"| {v} | **all kernels** (wall {pr['wall_ms_profiled']:.1f}) | "
                             f"{pr['gpu_ms']:.2f} | |")
                for name, ms, n in pr["top"][:8]:
                    name = name.replace("|", "/")
                    lines.append(f"| {v} | `{name[:70]}` | {ms:.2f} | {n} |")
            lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    kinds = [k for k in results["kinds"] if any("median_ms" in e for e in
                                                results["kinds"][k]["variants"].values())]
    if not kinds:
        return
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.2 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        vs = {v: e for v, e in results["kinds"][kind]["variants"].items() if "median_ms" in e}
        names = list(vs)
        row[0].barh(names, [vs[v]["peak_mib"] for v in names], color="tab:blue")
        row[0].set_xlabel("peak memory (MiB)")
        row[1].barh(names, [vs[v]["median_ms"] for v in names], color="tab:orange")
        row[1].set_xlabel("median step time (ms)")
        row[0].set_title(f"{kind}: peak memory")
        row[1].set_title(f"{kind}: step time")
        for ax in row:
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=21504)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kinds", default="relu,relu2")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"any of {','.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of dense and ours per kind (kernel times)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no memory figures)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "torch_ffn"))
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__,
               "config": {k: getattr(args, k) for k in ("tokens", "d", "f", "layers", "warmup",
                                                        "steps")},
               "kinds": {}}
    save = lambda: write_outputs(results, out)  # noqa: E731
    for kind in args.kinds.split(","):
        run_kind(args, kind, results, save)
    save()


if __name__ == "__main__":
    main()
