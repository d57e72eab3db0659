"""Per-source-line shares of an ncu per-instruction profile of a pack or unpack kernel.

``bench/profile_stalls.sh`` writes ncu's source page as CSV (SASS only: NVRTC builds
carry no line table). This builds the same source here with ``nvcc -lineinfo`` for
sm_90, disassembles it with ``nvdisasm -g`` (not in this machine's CUDA: ``pip download
--no-deps nvidia-cuda-nvdisasm`` and unzip the wheel; its ``bin/nvdisasm`` needs +x), aligns the two instruction sequences by opcode and adds each ncu column value
(warp instructions executed, or stall samples) to the source line of the local
instruction it matched. Needs no GPU.

    python bench/ncu_lines.py stalls.csv "bitsparse_pack<0,1,0,4>" \
        [--column "Instructions Executed"] [--nvdisasm PATH] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIGNATURES = {   # parameter lists of the kernel templates, for an explicit instantiation
    "bitsparse_pack": ("bitsparse_pack.cu", "(u64,u64,int,u64,u64,u64,int,int,u64,u64,u64,u64,"
                       "int,u64,u64,u64,u64,u64,u64)"),
}


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


def local_sass(kernel: str, nvdisasm: str) -> tuple:
    """``([(opcode, line)], source lines)`` of ``kernel`` built here."""
    from bitsparse_core.backends.cupy.kernels import _source
    name = kernel.split("<")[0]
    file, sig = SIGNATURES[name]
    src = _source(file) + f"\ntemplate __global__ void {kernel}{sig};\n"
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        cu.write_text(src)
        subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_90", "-O3", "-lineinfo",
                        str(cu), "-o", str(cubin)], check=True)
        dis = subprocess.run([nvdisasm, "-g", "-c", str(cubin)], check=True,
                             capture_output=True, text=True).stdout
    ins, line, inside = [], None, False
    for text in dis.splitlines():
        m = re.search(r'//## File ".*", line (\d+)', text)
        if m:
            line = int(m.group(1))
            continue
        if ".text." in text and ":" in text:
            inside = name in text and "epilogue" not in text
        m = re.match(r"\s+/\*[0-9a-f]{4,5}\*/\s+(.*?);", text)
        if m and inside:
            ins.append((_opcode(m.group(1).strip()), line))
    return ins, src.splitlines()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("kernel", help='e.g. "bitsparse_pack<0,1,0,4>"')
    ap.add_argument("--column", default="Instructions Executed")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    prof = ncu_rows(a.csv, a.column)
    ins, lines = local_sass(a.kernel, a.nvdisasm)
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
