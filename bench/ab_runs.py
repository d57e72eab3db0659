"""Repeated train_gpt.py runs of two trees, side by side: one table and one plot.

A single GPT run on the device's host varies by tens of per cent from run to run
(the host's speed drifts), so a change to the training path is judged from several
runs of each tree, interleaved in one device call. Each argument is
``LABEL=PATH/train_gpt.json``; runs with the same label are one tree.

    python bench/ab_runs.py old=r1/train_gpt.json new=r2/train_gpt.json ... \\
        --out bench/results --stem train_gpt_ab
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from plotting import pyplot

VARIANTS = ("dense", "ours-nosign")


def collect(pairs) -> list:
    runs = []
    for order, pair in enumerate(pairs):
        label, path = pair.split("=", 1)
        res = json.loads(Path(path).read_text())
        row = {"order": order, "tree": label, "source": path}
        for v in VARIANTS:
            rec = res["variants"].get(v, {})
            row[f"{v}_step_ms"] = rec.get("median_step_ms")
            row[f"{v}_host_phase_ms"] = rec.get("median_host_phase_ms")
        d, o = row["dense_step_ms"], row["ours-nosign_step_ms"]
        row["ours_over_dense"] = o / d if d and o else None
        runs.append(row)
    return runs


def summarize(runs) -> dict:
    out = {}
    for tree in dict.fromkeys(r["tree"] for r in runs):
        mine = [r for r in runs if r["tree"] == tree and r["ours_over_dense"]]
        ratios = [r["ours_over_dense"] for r in mine]
        out[tree] = {"runs": len(mine), "median_ratio": statistics.median(ratios),
                     "min_ratio": min(ratios), "max_ratio": max(ratios),
                     "median_ours_ms": statistics.median(r["ours-nosign_step_ms"] for r in mine),
                     "median_dense_ms": statistics.median(r["dense_step_ms"] for r in mine)}
    return out


def _phases(p) -> str:
    return " / ".join(f"{x:.1f}" for x in p) if p else "-"


def markdown(runs, summary, title: str) -> str:
    lines = [f"# {title}", "",
             "Median step time per run (train_gpt.py, gpt12 preset); runs in the order they "
             "were made. Host phases: forward / backward / optimizer (ms).", "",
             "| run | tree | dense ms | ours-nosign ms | ours / dense | dense host phases | "
             "ours host phases |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['order']} | {r['tree']} | {r['dense_step_ms']:.1f} | "
                     f"{r['ours-nosign_step_ms']:.1f} | {r['ours_over_dense']:.2f} | "
                     f"{_phases(r['dense_host_phase_ms'])} | "
                     f"{_phases(r['ours-nosign_host_phase_ms'])} |")
    lines += ["", "| tree | runs | ours / dense median (min-max) | ours ms median | "
                  "dense ms median |", "| --- | --- | --- | --- | --- |"]
    for tree, s in summary.items():
        lines.append(f"| {tree} | {s['runs']} | {s['median_ratio']:.2f} ({s['min_ratio']:.2f}"
                     f"-{s['max_ratio']:.2f}) | {s['median_ours_ms']:.1f} | "
                     f"{s['median_dense_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(runs, path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    trees = list(dict.fromkeys(r["tree"] for r in runs))
    colors = {t: c for t, c in zip(trees, ("tab:blue", "tab:orange", "tab:green"))}
    for r in runs:
        ax.bar(r["order"], r["ours_over_dense"], color=colors[r["tree"]],
               label=r["tree"] if r["order"] == min(x["order"] for x in runs
                                                    if x["tree"] == r["tree"]) else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("run (in order)")
    ax.set_ylabel("ours-nosign / dense step time")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH/train_gpt.json, in run order")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--stem", default="train_gpt_ab")
    ap.add_argument("--title", default="GPT step time, two trees, repeated runs")
    args = ap.parse_args(argv)
    runs = collect(args.runs)
    summary = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps({"runs": runs, "summary": summary},
                                                      indent=1))
    (out / f"{args.stem}.md").write_text(markdown(runs, summary, args.title))
    plot(runs, out / f"{args.stem}.png", args.title)
    print(markdown(runs, summary, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
