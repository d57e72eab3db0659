"""kernel_variants.py runs of several option sets, side by side: one table and one plot.

Each ``kernel_variants.py`` process times one option set (NVRTC options, compiled apart);
an A/B alternates the sets in one device call (a, b, b, a, ...). Each argument is
``LABEL=LOG``, LOG one process's output; logs with the same label are one variant, and
each row takes a variant's minimum over its runs (the host's drift between runs is the
noise, the minimum its least disturbed reading). Ratios are to ``--base``.

    python bench/variant_table.py base=r1.log new=r2.log new=r3.log base=r4.log \\
        --base base --out bench/results --stem pack_ab [--title "..."]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from plotting import pyplot

LINE = re.compile(r"(?P<dtype>bfloat16|float8_e4m3fn|float16|float32)\s+s=(?P<s>[\d.]+)\s+"
                  r"(?P<kind>pack fixed|unpack)\s+(?P<us>[\d.]+) us")


def parse(text: str) -> list:
    """(kind, dtype, sparsity, µs) of every timing line of one kernel_variants.py run."""
    return [(m["kind"], m["dtype"], float(m["s"]), float(m["us"])) for m in LINE.finditer(text)]


def summarize(runs, base: str) -> list:
    """runs: [(label, [(kind, dtype, s, us), ...])]. One row per (kind, dtype, s): each
    variant's runs and minimum, and its minimum over the base's."""
    rows = {}
    for label, timings in runs:
        for kind, dtype, s, us in timings:
            rows.setdefault((kind, dtype, s), {}).setdefault(label, []).append(us)
    out = []
    for (kind, dtype, s), by in rows.items():
        if base not in by:
            raise SystemExit(f"no {base!r} run times {kind} {dtype} s={s}")
        ref = min(by[base])
        out.append({"kind": kind, "dtype": dtype, "sparsity": s,
                    "variants": {lab: {"runs_us": v, "min_us": min(v), "over_base": min(v) / ref}
                                 for lab, v in by.items()}})
    return out


def markdown(rows, labels, base: str, title: str) -> str:
    head = [f"# {title}", "",
            f"µs, the minimum of each variant's runs; in brackets its ratio to `{base}` "
            "(< 1: faster).", "",
            "| kernel | dtype | sparsity | " + " | ".join(f"`{lab}`" for lab in labels) + " |",
            "|---|---|---|" + "---|" * len(labels)]
    for r in rows:
        cells = []
        for lab in labels:
            v = r["variants"].get(lab)
            cells.append(f"{v['min_us']:.1f} ({v['over_base']:.3f})" if v else "")
        head.append(f"| {r['kind']} | {r['dtype']} | {r['sparsity']} | " + " | ".join(cells) + " |")
    return "\n".join(head) + "\n"


def plot(rows, labels, base: str, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    others = [lab for lab in labels if lab != base]
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "e4m3"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 3.6))
    width = 0.8 / max(1, len(others))
    ratios = []
    for k, lab in enumerate(others):
        xs = [i + k * width for i in range(len(rows))]
        ys = [r["variants"].get(lab, {}).get("over_base", float("nan")) for r in rows]
        ratios += [y for y in ys if y == y]
        ax.bar(xs, ys, width, label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    lo, hi = min(ratios + [1.0]), max(ratios + [1.0])
    ax.set_ylim(lo - 0.1 * (hi - lo) - 0.01, hi + 0.1 * (hi - lo) + 0.01)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['kind'].split()[0]}\n{short.get(r['dtype'], r['dtype'])} {r['sparsity']}"
                        for r in rows], fontsize=7)
    ax.set_ylabel(f"time / {base}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=LOG, one kernel_variants.py output each")
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--stem", default="kernel_variants")
    ap.add_argument("--title", default="Kernel variants (bench/kernel_variants.py)")
    a = ap.parse_args(argv)
    runs = []
    for pair in a.runs:
        label, _, path = pair.partition("=")
        runs.append((label, parse(Path(path).read_text())))
    labels = list(dict.fromkeys(lab for lab, _ in runs))
    rows = summarize(runs, a.base)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.stem}.json").write_text(json.dumps(
        {"title": a.title, "base": a.base, "order": [lab for lab, _ in runs], "rows": rows},
        indent=1) + "\n")
    (out / f"{a.stem}.md").write_text(markdown(rows, labels, a.base, a.title))
    plot(rows, labels, a.base, out / f"{a.stem}.png")
    print(markdown(rows, labels, a.base, a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
