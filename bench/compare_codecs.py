"""Two runs of ``bench_codecs.py`` side by side: this tree against an older commit.

Both runs are made in one device call, one after the other, on the same inputs
(same seed, sizes, sparsities), so the ratio ``new / old`` of each kernel time
is the regression check (> 1: slower now).

    python bench/compare_codecs.py OLD/codecs.json NEW/codecs.json \\
        --old-label d86f346 --new-label HEAD --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import pyplot  # noqa: E402

TIMES = ("pack_fixed_ms", "pack_exact_ms", "unpack_ms")


def compare(old: dict, new: dict) -> list:
    key = lambda r: (r["backend"], r["dtype"], r["sparsity"])   # noqa: E731
    before = {key(r): r for r in old["rows"]}
    rows = []
    for r in new["rows"]:
        o = before.get(key(r))
        if o is None:
            continue
        rows.append({"backend": r["backend"], "dtype": r["dtype"], "sparsity": r["sparsity"],
                     **{f"old_{t}": o[t] for t in TIMES}, **{f"new_{t}": r[t] for t in TIMES},
                     **{f"ratio_{t}": r[t] / o[t] for t in TIMES}})
    return rows


def markdown(summary: dict) -> str:
    out = [f"# Codec kernels: {summary['new_label']} against {summary['old_label']} "
           f"({summary['device']})", "",
           f"2^{summary['numel_log2']} elements, {summary['reps']} timed calls each, copy "
           f"bandwidth {summary['old_copy_TBps']:.2f} / {summary['new_copy_TBps']:.2f} TB/s in "
           "the two runs. Ratio = new time / old time (> 1: slower now).", "",
           "| backend | dtype | sparsity | pack fixed (ms) old → new | ratio | "
           "pack exact (ms) old → new | ratio | unpack (ms) old → new | ratio |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        cells = [f"{r['old_' + t]:.4f} → {r['new_' + t]:.4f} | {r['ratio_' + t]:.3f}"
                 for t in TIMES]
        out.append(f"| {r['backend']} | {r['dtype']} | {r['sparsity']} | " + " | ".join(cells)
                   + " |")
    return "\n".join(out) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = summary["rows"]
    labels = [f"{r['dtype']}\ns={r['sparsity']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for i, t in enumerate(TIMES):
        ax.bar([k + (i - 1) * width for k in range(len(rows))], [r[f"ratio_{t}"] for r in rows],
               width, label=t.removesuffix("_ms").replace("_", " "))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel(f"time {summary['new_label']} / {summary['old_label']}")
    ax.legend(fontsize=8)
    ax.set_title("Codec kernels against the older commit (same device call)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--old-label", default="old")
    ap.add_argument("--new-label", default="new")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--stem", default="codecs_vs_old")
    args = ap.parse_args(argv)
    old, new = (json.loads(Path(p).read_text()) for p in (args.old, args.new))
    summary = {"old_label": args.old_label, "new_label": args.new_label,
               "device": new["device"], "numel_log2": new["numel"].bit_length() - 1,
               "reps": new["reps"], "old_copy_TBps": old["copy_bandwidth_Bps"] / 1e12,
               "new_copy_TBps": new["copy_bandwidth_Bps"] / 1e12, "rows": compare(old, new),
               "old_run": old, "new_run": new}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(summary, indent=1))
    (out / f"{args.stem}.md").write_text(markdown(summary))
    plot(summary, out / f"{args.stem}.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
