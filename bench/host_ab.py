"""Two trees' host times per op, from host_overhead.py runs made in turns (A B B A ...).

    python3 bench/host_ab.py --base pointers --out DIR --stem NAME \\
        packed=run1.log pointers=run2.log pointers=run3.log packed=run4.log

A device call returns only a few files, and the host's speed drifts within a call, so
an A/B of host time is several host_overhead.py processes in turns, each read from the
lines it prints under "host-time targets" (backend, mode, op, µs). Per label and op:
the median of its runs; per other label against ``--base``: the difference in µs and
the ratio, beside each run's torch ``x + x`` (the host's speed at the time). Writes
``NAME.json``, ``NAME.md`` and ``NAME.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot, save  # noqa: E402

# "  numba     torch     pack_fixed           25.7   <= 30  met  (2.8 x+x); ..."
_ROW = re.compile(r"^\s+(\S+)\s+(\S+)\s+(\S+)\s+([0-9.]+)\s")


def read_log(path: Path) -> dict:
    """``{(backend, mode, op): µs}`` from one run's printed targets block."""
    rows, inside = {}, False
    for line in path.read_text().splitlines():
        if line.startswith("host-time targets"):
            inside = True
            continue
        if inside:
            m = _ROW.match(line)
            if m is None:
                if line.strip() and not line.startswith("  "):
                    break
                continue
            rows[m.group(1), m.group(2), m.group(3)] = float(m.group(4))
    if not rows:
        raise ValueError(f"{path}: no host-time targets block")
    return rows


def summarise(runs: list, base: str) -> dict:
    """``runs``: ``[(label, {key: µs})]`` in the order they ran."""
    labels = list(dict.fromkeys(label for label, _ in runs))
    if base not in labels:
        raise ValueError(f"--base {base!r} is none of the labels {labels}")
    keys = [k for k in runs[0][1] if all(k in r for _, r in runs)]
    med = {lb: {k: statistics.median(r[k] for label, r in runs if label == lb) for k in keys}
           for lb in labels}
    adds = [r.get(("torch", "first", "torch_add")) for _, r in runs]
    rows = []
    for k in keys:
        if k[0] == "torch":            # the host's own ops (x + x, empty): its speed
            continue
        row = {"backend": k[0], "mode": k[1], "op": k[2],
               "runs": {lb: [r[k] for label, r in runs if label == lb] for lb in labels},
               "median_us": {lb: med[lb][k] for lb in labels}}
        row["minus_base_us"] = {lb: med[lb][k] - med[base][k] for lb in labels if lb != base}
        row["x_base"] = {lb: med[lb][k] / med[base][k] for lb in labels if lb != base}
        rows.append(row)
    return {"base": base, "labels": labels, "order": [label for label, _ in runs],
            "torch_add_us": adds, "rows": rows}


def markdown(res: dict, title: str) -> str:
    others = [lb for lb in res["labels"] if lb != res["base"]]
    head = (["backend", "mode", "op"] + [f"{lb} µs (runs)" for lb in res["labels"]]
            + [f"{lb} − {res['base']} µs" for lb in others]
            + [f"{lb} × {res['base']}" for lb in others])
    out = [f"# {title}", "",
           f"Runs in the order {', '.join(res['order'])}; torch `x + x` at each run's start: "
           + ", ".join("-" if a is None else f"{a:.1f}" for a in res["torch_add_us"])
           + " µs. Per label the median of its runs.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [r["backend"], r["mode"], r["op"]]
        cells += [f"{r['median_us'][lb]:.1f} ({', '.join(f'{v:.1f}' for v in r['runs'][lb])})"
                  for lb in res["labels"]]
        cells += [f"{r['minus_base_us'][lb]:+.1f}" for lb in others]
        cells += [f"{r['x_base'][lb]:.3f}" for lb in others]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    rows, labels = res["rows"], res["labels"]
    width = 0.8 / len(labels)
    for i, lb in enumerate(labels):
        ax.bar([j + i * width for j in range(len(rows))], [r["median_us"][lb] for r in rows],
               width, label=lb)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['backend']}\n{r['op']}" for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("host µs per call (median of runs)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=host_overhead log, in the order they ran")
    ap.add_argument("--base", required=True)
    ap.add_argument("--title", default="Host time per call, A/B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stem", default="host_ab")
    args = ap.parse_args(argv)
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            ap.error(f"{item!r} is not LABEL=PATH")
        runs.append((label, read_log(Path(path))))
    res = summarise(runs, args.base)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{args.stem}.md").write_text(markdown(res, args.title))
    plot(res, out / f"{args.stem}.png", args.title)
    print(markdown(res, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
