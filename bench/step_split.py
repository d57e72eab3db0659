"""Which side paces a training step: its host time and its GPU time, apart.

A step's wall time is about max(host time to issue it, GPU time to run it), plus the
stalls where one waits for the other. The GPT bench's "host" column cannot tell them
apart: a host that issues work faster than the GPU runs it blocks in the launch queue,
so host time and step time both read as the larger of the two. Here each phase of a
step (forward, backward, optimizer) is issued while the GPU is held busy by a sleep
kernel queued just before it: the host issues the whole phase without ever waiting for
the GPU (its time is then pure host time), and the GPU, once the sleep ends, runs the
queued phase back to back (events around it give pure GPU time). A sync between phases
lets the backward find every pack's count landed, as it does in a normal step.

A phase whose host time comes close to the sleep ran into the launch queue's depth (the
host waited for the GPU after all); such phases are flagged, and the sleep can be
lengthened with ``--sleep-ms``.

    python bench/step_split.py --preset gpt12 --out OUT      # CUDA only

Writes ``step_split.json`` / ``.md`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_gpt as tg  # noqa: E402
from plotting import pyplot  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
DEFAULT_VARIANTS = ("dense", "ours-nosign", "ours-python", "dense-compiled", "ours-compiled",
                    "ours-offload", "checkpoint")


def sleep_cycles(device: torch.device, ms: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` that take about ``ms`` on this GPU."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)   # first call loads the kernel
    torch.cuda.synchronize(device)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize(device)
    return int(probe * ms / start.elapsed_time(end))


def split_step(call, opt, x, y, device, cycles: int) -> dict:
    """One training step, phase by phase, each issued behind a sleep kernel."""
    out = {}
    loss = None

    def phase(name, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize(device)
        out[name] = (1e3 * (t1 - t0), start.elapsed_time(end))
        return result

    loss = phase("forward", lambda: call(x, y))

    def backward():
        opt.zero_grad(set_to_none=True)
        loss.backward()
    phase("backward", backward)
    phase("optimizer", opt.step)
    return out


def whole_step(call, opt, x, y, device) -> float:
    """A normal step's wall time (ms), synced around."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    tg.train_step(call, opt, x, y)
    torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - t0)


def top_kernels(call, opt, batches, device, steps: int, top: int = 30) -> list:
    """The GPU's time per step by kernel name (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            tg.train_step(call, opt, *batches[i % len(batches)])
        torch.cuda.synchronize(device)
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:90], "calls_per_step": e.count / steps,
             "gpu_ms_per_step": e.self_device_time_total / 1e3 / steps} for e in rows[:top]]


def phases_asleep(call, opt, x, y, device, cycles: int, make_context) -> dict:
    """A forward then its backward, each issued behind a sleep kernel inside a fresh
    ``make_context()`` (a profiler); returns each phase's context object."""
    contexts, loss = {}, None
    for phase in ("forward", "backward"):
        torch.cuda._sleep(cycles)
        with make_context() as ctx:
            if phase == "forward":
                loss = call(x, y)
            else:
                opt.zero_grad(set_to_none=True)
                loss.backward()
        torch.cuda.synchronize(device)
        contexts[phase] = ctx
    opt.zero_grad(set_to_none=True)
    return contexts


def host_profile(call, opt, x, y, device, cycles: int, top: int = 30) -> dict:
    """Per phase, the host's own time by op (torch.profiler, CPU only) and by Python
    function (cProfile), with the GPU held by a sleep so that nothing waits for it."""
    import cProfile
    import io
    import pstats
    from torch.profiler import ProfilerActivity, profile
    by_op = phases_asleep(call, opt, x, y, device, cycles,
                          lambda: profile(activities=[ProfilerActivity.CPU]))
    by_function = phases_asleep(call, opt, x, y, device, cycles, cProfile.Profile)
    out = {}
    for phase, prof in by_op.items():
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        buf = io.StringIO()
        pstats.Stats(by_function[phase], stream=buf).sort_stats("tottime").print_stats(top)
        out[phase] = {"ops": [{"name": e.key[:90], "calls": e.count,
                               "self_us": e.self_cpu_time_total, "total_us": e.cpu_time_total}
                              for e in rows[:top]],
                      "cprofile": buf.getvalue()}
    return out


def run(args) -> dict:
    shape, device = tg.shape_and_device(args, tg.PRESETS[args.preset])
    bench = tg.Bench(args, shape, tg.stdlib_bytes(limit=64 << 20),
                     tg.initial_state(shape, args.seed), device)
    pretrained = tg.pretrain(bench, args.pretrain_steps) if args.pretrain_steps else None
    names = args.variants.split(",")
    batches = [(x.to(device), y.to(device)) for x, y in
               tg.make_batches(bench.data, 8, shape.batch, shape.seq, args.seed)]
    cycles = sleep_cycles(device, args.sleep_ms)
    built = {n: tg.build(bench, n) for n in names}
    samples = {n: {"step": [], **{p: [] for p in PHASES}} for n in names}
    with tg.attention_backend(args.attn):
        for i in range(args.warmup + args.turns):
            k = i % len(names)
            for n in names[k:] + names[:k]:
                _, call, opt = built[n]
                x, y = batches[i % len(batches)]
                if i < args.warmup:
                    tg.train_step(call, opt, x, y)
                    continue
                samples[n]["step"].append(whole_step(call, opt, x, y, device))
                for p, hg in split_step(call, opt, x, y, device, cycles).items():
                    samples[n][p].append(hg)
            if i >= args.warmup and bench.remaining() <= 0:
                break         # --time-limit: the turns timed so far are reported
    kernels = {n: top_kernels(*built[n][1:], batches, device, args.kernel_steps)
               for n in names} if args.kernel_steps else {}
    hosts = {}
    for n in (args.host_profile.split(",") if args.host_profile else ()):
        x, y = batches[0]
        hosts[n] = host_profile(*built[n][1:], x, y, device, cycles)
    res = {}
    for n in names:
        s = samples[n]
        row = {"step_ms": statistics.median(s["step"])}
        for p in PHASES:
            row[f"{p}_host_ms"] = statistics.median(h for h, _ in s[p])
            row[f"{p}_gpu_ms"] = statistics.median(g for _, g in s[p])
            row[f"{p}_queue_full"] = max(h for h, _ in s[p]) > 0.8 * args.sleep_ms
        row["host_ms"] = sum(row[f"{p}_host_ms"] for p in PHASES)
        row["gpu_ms"] = sum(row[f"{p}_gpu_ms"] for p in PHASES)
        # per step: warm-up steps, and a whole and a split step per timed turn
        row["capacity"] = tg.capacity_stats(built[n][0], args.warmup + 2 * len(s["step"]))
        row["kernels"] = kernels.get(n)
        row["host_profile"] = hosts.get(n)
        res[n] = row
    return {"device": torch.cuda.get_device_name(device), "shape": vars(shape),
            "sleep_ms": args.sleep_ms, "turns": len(samples[names[0]]["step"]),
            "warmup": args.warmup, "pretrain": pretrained, "torch_defaults": args.torch_defaults,
            "torch": torch.__version__, "variants": res}


def markdown(summary: dict) -> str:
    s = summary["shape"]
    lines = [f"# Host time and GPU time of a training step apart ({summary['device']})", "",
             f"GPT {s['layers']} layers, d={s['d']}, d_ff={s['d_ff']}, seq={s['seq']}, "
             f"batch={s['batch']}, bf16; medians of {summary['turns']} turns (variants in "
             f"rotated order each turn). Each phase is issued while a {summary['sleep_ms']:.0f} ms "
             "sleep kernel holds the GPU: host = the time to issue it (no waiting for the GPU), "
             "GPU = the time the GPU then takes to run it. Step = a normal step, synced "
             "around."
             + (f" In this run {tg.pretrained_text(summary['pretrain'])}."
                if summary.get("pretrain") else "")
             + (f" {tg.TORCH_DEFAULTS_TEXT}." if summary.get("torch_defaults") else ""), "",
             "| variant | step (ms) | host (ms) | GPU (ms) | host fwd / bwd / opt | "
             "GPU fwd / bwd / opt | paced by |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in summary["variants"].items():
        flag = " (queue full)" if any(r[f"{p}_queue_full"] for p in PHASES) else ""
        lines.append(
            f"| {n} | {r['step_ms']:.1f} | {r['host_ms']:.1f} | {r['gpu_ms']:.1f} | "
            + " / ".join(f"{r[f'{p}_host_ms']:.1f}" for p in PHASES) + " | "
            + " / ".join(f"{r[f'{p}_gpu_ms']:.1f}" for p in PHASES)
            + f" | {'host' if r['host_ms'] > r['gpu_ms'] else 'GPU'}{flag} |")
    for n, r in summary["variants"].items():
        if not r.get("kernels"):
            continue
        lines += ["", f"## {n}: GPU time by kernel (ms per step)", "",
                  "| kernel | calls/step | GPU ms/step |", "| --- | --- | --- |"]
        lines += [f"| `{k['name']}` | {k['calls_per_step']:.0f} | {k['gpu_ms_per_step']:.2f} |"
                  for k in r["kernels"]]
    for n, r in summary["variants"].items():
        for phase, hp in (r.get("host_profile") or {}).items():
            lines += ["", f"## {n}, {phase}: host time by op (µs, GPU asleep)", "",
                      "| op | calls | self µs | total µs |", "| --- | --- | --- | --- |"]
            lines += [f"| `{o['name']}` | {o['calls']} | {o['self_us']:.0f} | {o['total_us']:.0f} |"
                      for o in hp["ops"]]
            lines += ["", "```", hp["cprofile"].strip(), "```"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(summary["variants"])
    rows = summary["variants"]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.27
    ax.bar([x - w for x in xs], [rows[n]["step_ms"] for n in names], w, label="step")
    ax.bar(list(xs), [rows[n]["host_ms"] for n in names], w, label="host (issue only)")
    ax.bar([x + w for x in xs], [rows[n]["gpu_ms"] for n in names], w, label="GPU (run only)")
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_ylabel("ms per step")
    ax.legend()
    ax.set_title("Training step: host and GPU time apart")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(tg.PRESETS), default="gpt12")
    for name in ("layers", "d", "heads", "d-ff", "seq", "batch"):
        ap.add_argument(f"--{name}", type=int, help="override the preset")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--kernel-steps", type=int, default=2,
                    help="steps profiled per variant for the GPU time by kernel (0: none)")
    ap.add_argument("--host-profile", default="",
                    help="variants whose forward and backward host time is profiled by op and "
                         "by Python function, the GPU asleep")
    ap.add_argument("--sleep-ms", type=float, default=80.0)
    ap.add_argument("--attn", choices=("auto", "math"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pretrain-steps", type=int, default=0,
                    help="start from the dense model trained this many steps (train_gpt.pretrain)")
    ap.add_argument("--compile-fullgraph", action="store_true")
    ap.add_argument("--torch-defaults", action="store_true",
                    help="PyTorch's default GEMM and determinism settings (train_gpt's flag)")
    ap.add_argument("--ours-kwargs", type=json.loads, default={})
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    unknown = set(args.variants.split(",")) - set(tg.VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    summary = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_split.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (out / "step_split.md").write_text(text)
    plot(summary, out / "step_split.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
