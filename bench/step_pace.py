"""Which side paces a training step: the GPU's kernel time beside the step's wall time.

    python3 bench/step_pace.py [--variants plain,hooks,noop-hooks] [--turns 60] [--out DIR]
    python3 bench/step_pace.py --device cpu --small --turns 2 --out /tmp/x    # CPU check

The model and variants are bench_hf.py's (issue 16's OPT step; ``--variants`` any of its
variants, plain among them). Two parts, every variant resident at once:

* wall and host time per step in interleaved turns (``bench/interleaved.py``: one step of
  each variant per turn, its ratio to plain taken within the turn);
* then ``--profiled`` steps of each variant under torch.profiler with the GPU's activity
  alone (CUPTI: no CPU op is recorded, so the host runs about as fast as unprofiled): the
  summed time of the GPU's kernels, copies and fills per step, their busy time (the union
  of their intervals) and the variant's largest kernels.

A step whose GPU busy time is well under its wall time is paced by the host: what a
variant adds on the host shows in the step in full, while what it adds on the GPU can run
in the gaps. bench_hf.py's sync counts come from the full profiler, which records every
CPU op and slows the host several-fold, so its GPU figures cannot say which side paces
the unprofiled step; this bench's can. Writes ``step_pace.{json,md,png}``; on the CPU
the GPU columns stay empty.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_hf as hf  # noqa: E402
import interleaved  # noqa: E402
import train_gpt as tg  # noqa: E402
from plotting import pyplot, save  # noqa: E402
from profile_syncs import _busy_ms  # noqa: E402

TOP_KERNELS = 8


def gpu_activity(step, steps: int, device: torch.device) -> dict | None:
    """The GPU's work per step over ``steps`` calls of ``step(i)`` (None off CUDA): the
    summed and the busy ms of its kernels, copies and fills, and the largest kernels."""
    if device.type != "cuda":
        return None
    tg.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        tg.sync(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"steps": steps,
            "summed_ms": sum(by_name.values()) / 1e3 / steps,
            "busy_ms": _busy_ms(events) / steps,
            "top": [{"name": n, "ms_per_step": t / 1e3 / steps} for n, t in top]}


def run(args) -> dict:
    names = hf.variants_with_plain(args.variants)
    bench, shape, device, batches = hf.resident_bench(args.device, args.seed, args.small,
                                                      args.time_limit, args.out)
    resident = {}   # kept past run_variants, which drops its own references to the steps

    def make_step(name):
        _, forward, opt, _ = hf.prepare(bench, name)
        resident[name] = lambda i: tg.train_step(forward, opt, *batches[i % len(batches)])
        return resident[name]
    summary = hf.tool_summary(args, shape, device)
    try:
        with tg.attention_backend("auto"):
            summary["interleaved"] = interleaved.run_variants(
                names, make_step, "plain", args.turns, args.warmup, lambda: tg.sync(device),
                bench.check_time)
            summary["gpu"] = {n: gpu_activity(step, args.profiled, device)
                              for n, step in resident.items()}
    finally:
        resident.clear()
        tg.free_memory(device)
    return summary


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(summary: dict) -> str:
    inter, gpu = summary["interleaved"], summary.get("gpu", {})
    s = summary["shape"]
    lines = [f"# Which side paces the OPT step ({summary['device']})", "",
             f"bench_hf.py's model: {s['layers']} layers, d={s['d']}, {s['heads']} heads, "
             f"ffn={s['d_ff']}, seq={s['seq']}, batch={s['batch']}, bf16, AdamW; "
             f"{inter.get('turns', 0)} interleaved turns, then "
             f"{summary['config']['profiled']} steps of each variant with the GPU's activity "
             f"profiled alone; torch {summary['torch']}.", ""]
    if inter.get("status") != "ok":
        return "\n".join(lines + [f"Interleaved steps: {inter.get('status')}", ""])
    lines += ["| variant | wall ms | host ms | × plain | 95 % interval | GPU summed ms | "
              "GPU busy ms | GPU busy / wall |", "|---|---|---|---|---|---|---|---|"]
    for name, rec in inter["variants"].items():
        g = gpu.get(name) or {}
        ci = rec.get("median_ratio_ci95")
        busy, wall = g.get("busy_ms"), rec["median_step_ms"]
        lines.append(
            f"| {name} | {_f(wall)} | {_f(rec['median_host_ms'])} | "
            f"{_f(rec.get('median_ratio'), '.3f')} | "
            f"{'-' if not ci else f'{ci[0]:.3f}-{ci[1]:.3f}'} | {_f(g.get('summed_ms'))} | "
            f"{_f(busy)} | {_f(busy / wall if busy and wall else None)} |")
    lines += ["", "Wall: a step from its start to the end of the sync after it; host: to the "
              "step's return, before that sync. The GPU columns come from the profiled steps, "
              "not the timed ones.", ""]
    for name, g in gpu.items():
        if g:
            lines += [f"Largest GPU items of {name} (ms a step): " + "; ".join(
                f"{t['ms_per_step']:.2f} {t['name'][:60]}" for t in g["top"]), ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    inter = summary["interleaved"]
    if plt is None or inter.get("status") != "ok":
        return
    names = list(inter["variants"])
    wall = [inter["variants"][n]["median_step_ms"] for n in names]
    busy = [(summary["gpu"].get(n) or {}).get("busy_ms") or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.4 * len(names)))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], wall, height=0.4, label="wall per step")
    ax.barh([i - 0.2 for i in y], busy, height=0.4, label="GPU busy per step")
    ax.set_yticks(list(y), names)
    ax.set_xlabel("ms")
    ax.legend()
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="plain,hooks,noop-hooks")
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5, help="untimed turns first")
    ap.add_argument("--profiled", type=int, default=6, help="steps per variant, GPU profiled")
    hf.add_resident_args(ap, time_limit=300.0, out=str(HERE / "results"))
    args = ap.parse_args(argv)
    summary = run(args)
    hf.write_tool_reports(summary, args.out, "step_pace", markdown, plot)
    return 0 if summary["interleaved"].get("status") == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
