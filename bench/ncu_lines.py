"""Per-source-line shares of an ncu per-instruction profile of a pack or unpack kernel.

``bench/profile_stalls.sh`` writes ncu's source page as CSV (SASS only: NVRTC builds
carry no line table). This builds the same source here with line info for sm_90
(``cuda_sass.build``, with the options the profiled build had), aligns the two
instruction sequences by opcode and adds each ncu column value (warp instructions
executed, or stall samples) to the source line of the local instruction it matched.
Needs no GPU.

    python bench/ncu_lines.py stalls.csv "bitsparse_pack<0,1,0,4>" \
        [--column "Instructions Executed"] [--options=-DX=0] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _opcode(text: str) -> str:
    parts = text.split()
    return parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else parts[0]


def ncu_rows(path: str, column: str) -> list:
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    head = next(r for r in rows if "Source" in r and "Address" in r)
    i_src, i_val = head.index("Source"), head.index(column)
    out = []
    for r in rows[rows.index(head) + 1:]:
        try:
            out.append((_opcode(r[i_src]), float(r[i_val] or 0)))
        except (IndexError, ValueError):
            continue
    return out


def local_sass(kernel: str, options=()) -> tuple:
    """``([(opcode, line)], source lines)`` of ``kernel`` built here (``cuda_sass.build``,
    with line info and the variant's ``options``)."""
    from cuda_sass import build
    name, _, args = kernel.partition("<")
    kind = {"bitsparse_pack": "pack", "bitsparse_unpack": "unpack"}[name]
    b = build(kind, [int(x) for x in args.rstrip(">").split(",")], options, lineinfo=True)
    return b.instructions, b.source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("kernel", help='e.g. "bitsparse_pack<0,1,0,4>"')
    ap.add_argument("--column", default="Instructions Executed")
    ap.add_argument("--options", default="",
                    help="the profiled build's options (BITSPARSE_CUDA_OPTIONS): --options=-DX=0")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    prof = ncu_rows(a.csv, a.column)
    ins, lines = local_sass(a.kernel, shlex.split(a.options))
    sm = difflib.SequenceMatcher(None, [o for o, _ in ins], [o for o, _ in prof], autojunk=False)
    by_line, matched = collections.Counter(), 0
    for i, j, n in sm.get_matching_blocks():
        for k in range(n):
            by_line[ins[i + k][1]] += prof[j + k][1]
            matched += 1
    total = sum(v for _, v in prof) or 1.0
    print(f"{a.column}: {total:.0f} in {len(prof)} instructions; {matched} aligned with the "
          f"{len(ins)} of the local build ({100 * sum(by_line.values()) / total:.0f} % of the total)")
    for ln, v in by_line.most_common(a.top):
        text = lines[ln - 1].strip()[:90] if ln else "?"
        print(f"{100 * v / total:5.1f}%  L{ln}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
