"""Static SASS of the CuPy backend's CUDA C++ kernels for sm_90, built here without a GPU.

    python3 bench/cuda_sass.py pack:0,1,0,4 [unpack:0,0,4,1,0 ...] [--options="-DX=1"]
        [--against="-DX=0"] [--lines 30]
    python3 bench/cuda_sass.py --sweep [--options=...] [--against=...]

Builds each kernel instantiation (``kind:args`` as ``kernels.kernel_spec`` takes them;
``--sweep``: every kernel the backend launches) from the source CuPy compiles, with nvcc
``-arch=sm_90 -cubin`` and the NVRTC options a variant would get through
``BITSPARSE_CUDA_OPTIONS``, and prints per kernel what ptxas reports (registers, spill
bytes) and the static SASS instruction count of the kernel's own code; with
``--against`` the same under a second option set, side by side. ``--lines N`` builds
with line info and prints the N source lines with the most SASS instructions (static
counts: unrolled loops count once per copy; ``ncu_lines.py`` maps a profile's executed
counts instead). A cheap check of a kernel switch's register and spill cost before
spending device time on it. Needs nvcc and nvdisasm (the pip CUDA packages or the PATH).
"""

from __future__ import annotations

import argparse
import collections
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from numba_sass import tool  # noqa: E402

from bitsparse_core.backends.cupy.kernels import _source, kernel_spec  # noqa: E402


@dataclass
class Build:
    """One instantiation's ptxas report and SASS (the kernel's own section)."""
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    instructions: list = field(default_factory=list)   # (opcode.modifiers, source line or None)
    source: list = field(default_factory=list)         # the compiled source's lines


def _ptxas_entry(report: str, mangled: str) -> tuple:
    """(registers, spill store bytes, spill load bytes) of the entry ``mangled``."""
    lines = report.splitlines()
    start = next((i for i, ln in enumerate(lines) if "entry function" in ln and mangled in ln), None)
    if start is None:
        raise ValueError(f"ptxas compiled no entry function {mangled}")
    regs = stores = loads = 0
    for ln in lines[start + 1:]:
        if "Compiling entry function" in ln or "Function properties for" in ln and mangled not in ln:
            break
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m:
            stores, loads = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", ln)
        if m:
            regs = int(m.group(1))
            break
    return regs, stores, loads


def build(kind: str, args, options=(), lineinfo: bool = False) -> Build:
    """Compile one instantiation (taking its address instantiates any template)."""
    file, name = kernel_spec(kind, *args)
    src = _source(file) + f"\nstatic void* bs_instance = (void*)&{name};\n"
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        cu.write_text(src)
        cmd = [tool("nvcc"), "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
               *(["-lineinfo"] if lineinfo else []), *options, str(cu), "-o", str(cubin)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{name} {' '.join(options)}: nvcc failed\n{r.stderr[-3000:]}")
        dis = subprocess.run([tool("nvdisasm"), *(["-g"] if lineinfo else []), "-c", str(cubin)],
                             check=True, capture_output=True, text=True).stdout
    base = name.split("<")[0]
    section = re.search(r"\.text\.(_Z\w*" + base + r"\w*):", dis)
    mangled = section.group(1) if section else base
    regs, stores, loads = _ptxas_entry(r.stderr, mangled)
    ins, line, inside = [], None, False
    for text in dis.splitlines():
        if text.startswith(".text."):
            inside = text.startswith(f".text.{mangled}:")
        m = re.search(r'//## File ".*", line (\d+)', text)
        if m:
            line = int(m.group(1))
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
        if m and inside:
            ins.append((m.group(1), line))
    return Build(name, regs, stores, loads, ins, src.splitlines())


def sweep_keys() -> list:
    from bitsparse_core.backends.cupy.kernels import all_kernel_keys
    return [(k[0], k[1:]) for k in all_kernel_keys()]


def parse_kernel(text: str) -> tuple:
    kind, _, args = text.partition(":")
    return kind, tuple(int(a) for a in args.split(",") if a)


def row(b: Build) -> str:
    return (f"{b.registers:3d} regs, spills {b.spill_stores:3d} / {b.spill_loads:3d} B, "
            f"{len(b.instructions):5d} SASS")


def by_line(b: Build, top: int) -> list:
    counts = collections.Counter(ln for _, ln in b.instructions)
    out = []
    for ln, c in counts.most_common(top):
        text = b.source[ln - 1].strip()[:90] if ln else "?"
        out.append(f"{c:5d}  L{ln}: {text}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="*", help="kind:args, e.g. pack:0,1,0,4 (kernel_spec)")
    ap.add_argument("--sweep", action="store_true", help="every kernel the backend launches")
    ap.add_argument("--options", default="",
                    help="options as BITSPARSE_CUDA_OPTIONS takes them: --options=-DBS_PACK_PREFETCH=0")
    ap.add_argument("--against", default=None, help="a second option set, shown beside")
    ap.add_argument("--lines", type=int, default=0, help="top source lines by SASS count")
    a = ap.parse_args(argv)
    keys = sweep_keys() if a.sweep else [parse_kernel(k) for k in a.kernels]
    if not keys:
        ap.error("name a kernel (kind:args) or --sweep")
    sets = [shlex.split(a.options)] + ([shlex.split(a.against)] if a.against is not None else [])
    print("kernel | " + " | ".join(" ".join(s) or "(default)" for s in sets))
    for kind, args in keys:
        builds = [build(kind, args, s, lineinfo=a.lines > 0) for s in sets]
        print(f"{builds[0].name} | " + " | ".join(row(b) for b in builds), flush=True)
        for b, s in zip(builds, sets):
            if a.lines:
                print(f"  {' '.join(s) or '(default)'}:")
                print("\n".join("    " + t for t in by_line(b, a.lines)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
