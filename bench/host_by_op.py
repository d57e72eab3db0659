"""Where a variant's host time goes, op by op: the OPT step's forward and backward under
torch.profiler, each variant against plain.

    python3 bench/host_by_op.py [--variants plain,hooks,converted] [--steps 6] [--out DIR]
    python3 bench/host_by_op.py --device cpu --small --steps 2 --out /tmp/x   # CPU check

The model and variants are bench_hf.py's, every variant resident at once. Each turn runs
one step of every variant, in a rotating order; the forward and the backward (with the
optimizer) each run inside a profiler of their own (CPU ops, and on CUDA the runtime's
calls), so every op's self host time is booked to its phase. Per variant, phase and op:
calls and self µs per step, and the difference from plain.

A saved-tensor hook, and a packed op's own Python, runs inside the op that calls it:
the profiler books a hook's time as the self time of the op that saved the tensor
(``aten::relu``'s for the pack of its output, say), so an op whose self time grows
names where a variant's extra host time lies. bench/NOTES.md (session 49) read this
way what session 48 took for "a millisecond outside the hooks' calls". The profiler
slows every op, so read differences, not absolute times. Writes ``host_by_op.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_hf as hf  # noqa: E402
import train_gpt as tg  # noqa: E402
from plotting import pyplot, save  # noqa: E402

PHASES = ("forward", "backward")
TOP = 12        # ops per variant and phase in the report


def _booked(prof, into: dict) -> None:
    """Add each op's calls and self host µs from ``prof`` to ``into`` (op -> [calls, µs])."""
    for e in prof.key_averages():
        entry = into[e.key]
        entry[0] += e.count
        entry[1] += e.self_cpu_time_total


def profiled_turns(steps: dict, turns: int, warmup: int, device: torch.device, remaining):
    """``steps``: variant -> ``(forward, opt)``; forward(i) returns the loss of batch i.
    Returns variant -> phase -> op -> [calls, µs] summed over the profiled turns, and
    the turns profiled (fewer than asked once ``remaining()`` seconds run out)."""
    names = list(steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    books = {n: {ph: collections.defaultdict(lambda: [0, 0.0]) for ph in PHASES} for n in names}
    done = 0
    for i in range(warmup + turns):
        if i >= warmup and remaining() <= 0:
            break
        k = i % len(names)
        for name in names[k:] + names[:k]:       # each variant first in turn
            forward, opt = steps[name]
            tg.sync(device)
            if i < warmup:
                loss = forward(i)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                continue
            with profile(activities=acts) as prof:
                loss = forward(i)
            _booked(prof, books[name]["forward"])
            with profile(activities=acts) as prof:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tg.sync(device)
            _booked(prof, books[name]["backward"])
        done += i >= warmup
    return books, done


def compare(books: dict, turns: int, base: str = "plain") -> dict:
    """Per variant and phase: every op's calls and self µs per step, its difference from
    ``base``, and the phase's total difference; ops sorted by the size of that difference."""
    out = {}
    for name, phases in books.items():
        out[name] = {}
        for ph, ops in phases.items():
            ref = books[base][ph]
            rows = []
            for op in set(ops) | set(ref):
                calls, us = ops.get(op, (0, 0.0))
                bcalls, bus = ref.get(op, (0, 0.0))
                rows.append({"op": op, "calls": calls / turns, "us": us / turns,
                             "minus_base_us": (us - bus) / turns,
                             "minus_base_calls": (calls - bcalls) / turns})
            rows.sort(key=lambda r: -abs(r["minus_base_us"]))
            out[name][ph] = {"total_us": sum(r["us"] for r in rows),
                             "minus_base_us": sum(r["minus_base_us"] for r in rows),
                             "ops": rows}
    return out


def run(args) -> dict:
    names = hf.variants_with_plain(args.variants)
    bench, shape, device, batches = hf.resident_bench(args.device, args.seed, args.small,
                                                      args.time_limit, args.out)
    steps = {}
    for name in names:
        _, forward, opt, _ = hf.prepare(bench, name)
        steps[name] = ((lambda i, f=forward: f(*batches[i % len(batches)])), opt)
    summary = hf.tool_summary(args, shape, device)
    try:
        with tg.attention_backend("auto"):
            books, turns = profiled_turns(steps, args.steps, args.warmup, device,
                                          bench.remaining)
    finally:
        steps.clear()
        tg.free_memory(device)
    summary["turns"] = turns
    summary["variants"] = compare(books, turns) if turns else {}
    return summary


def markdown(summary: dict) -> str:
    s = summary["shape"]
    lines = [f"# Host time by op, each variant against plain ({summary['device']})", "",
             f"bench_hf.py's model: {s['layers']} layers, d={s['d']}, ffn={s['d_ff']}, "
             f"seq={s['seq']}, batch={s['batch']}, bf16; {summary['turns']} profiled turns "
             f"(torch {summary['torch']}). Self host µs per step under torch.profiler; a hook "
             "or a packed op's Python is booked to the op that ran it.", ""]
    variants = summary["variants"]
    if not variants:
        return "\n".join(lines + ["No turn was profiled.", ""])
    lines += ["| variant | forward µs | − plain | backward µs | − plain |",
              "|---|---|---|---|---|"]
    for name, ph in variants.items():
        f, b = ph["forward"], ph["backward"]
        lines.append(f"| {name} | {f['total_us']:.0f} | {f['minus_base_us']:+.0f} | "
                     f"{b['total_us']:.0f} | {b['minus_base_us']:+.0f} |")
    for name, ph in variants.items():
        if name == "plain":
            continue
        for phase in PHASES:
            lines += ["", f"## {name}, {phase}: the {TOP} ops whose self time moved most", "",
                      "| op | calls | − plain | self µs | − plain |", "|---|---|---|---|---|"]
            for r in ph[phase]["ops"][:TOP]:
                lines.append(f"| {r['op'][:70]} | {r['calls']:.0f} | {r['minus_base_calls']:+.0f} "
                             f"| {r['us']:.0f} | {r['minus_base_us']:+.0f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    others = [n for n in summary["variants"] if n != "plain"]
    if plt is None or not others:
        return
    fig, axes = plt.subplots(len(others), 2, figsize=(11, 3.2 * len(others)), squeeze=False)
    for row, name in zip(axes, others):
        for ax, phase in zip(row, PHASES):
            ops = summary["variants"][name][phase]["ops"][:8][::-1]
            ax.barh([r["op"][:40] for r in ops], [r["minus_base_us"] for r in ops])
            ax.set_title(f"{name} − plain, {phase} (self µs a step)", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="plain,hooks,converted")
    ap.add_argument("--steps", type=int, default=6, help="profiled turns")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled turns first")
    hf.add_resident_args(ap, time_limit=240.0, out=str(HERE / "results"))
    args = ap.parse_args(argv)
    summary = run(args)
    hf.write_tool_reports(summary, args.out, "host_by_op", markdown, plot)
    return 0 if summary["turns"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
