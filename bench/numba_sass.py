"""Static SASS of the Numba codec kernels for sm_90, built here without a GPU.

    python3 bench/numba_sass.py [--dtype bfloat16] [--out /tmp] [--all] [--variant k=v,...]

Compiles the nosign unpack and plain-pack kernels (with --all every op, mode and
encoding, the fused ops' unpack kernels included: does each compile for sm_90?) to
PTX with numba-cuda, assembles them with ptxas and disassembles them with cuobjdump
(which needs nvdisasm beside it; all from the pip CUDA packages or the PATH; with
--lineinfo, nvdisasm with source lines), then prints instructions, registers and
local-memory accesses per kernel: a cheap check of a Numba change before spending
device time on it. numba-cuda asks
the (absent) driver for the compute capability of device functions; it is told 9.0.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tool(name: str) -> str:
    """The pip CUDA packages' tool first: it matches the NVVM that numba-cuda uses
    (an older system ptxas rejects its newer PTX version)."""
    try:
        import nvidia
        for base in nvidia.__path__:
            for cand in sorted(Path(base).glob(f"cu*/bin/{name}")):
                return str(cand)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        return found
    sys.exit(f"{name} not found (pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump "
             "nvidia-cuda-nvdisasm)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--all", action="store_true",
                    help="every op / mode and encoding of unpack and pack, not only nosign")
    ap.add_argument("--lineinfo", action="store_true",
                    help="build with line info and disassemble with nvdisasm --print-line-info "
                         "(inlined device functions show as their call sites in the kernel)")
    ap.add_argument("--variant", default="",
                    help="pack variant, PackVariant fields: e.g. pack_blocks=6,lb_early=1")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    import numba.cuda.dispatcher as disp
    from numba import cuda, types

    class _Device:
        compute_capability = (9, 0)
    disp.get_current_device = lambda: _Device()
    from bitsparse_core.backends.numba import kernels as K

    kw = {key: int(val) for key, val in (item.split("=") for item in a.variant.split(",") if item)}
    k = K.kernels_for(a.dtype, K.PackVariant(**kw))
    arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
    et = {8: types.uint8, 16: types.uint16, 32: types.uint32}[k.bits]
    u8, u32, u64, el, i64, b = arr(types.uint8), arr(types.uint32), arr(types.uint64), arr(et), types.int64, types.boolean
    planes = (u8, u32, i64, u8, u32, i64)          # a packed tensor's values and signs
    unpack_sig = (u8, i64, u32, i64, *planes, el, u64, b, el, u64, b)
    gated_sig = (u8, i64, u32, i64, *planes, *planes, el, u64, el, u64, b, el, u64, el, u64, b)
    pack_sig = (el, u64, b, i64, el, u64, b, u8, i64, i64, u8, u32, i64, el, u32, u32,
                arr(types.int64), arr(types.int64), u32, arr(types.int64), arr(types.int64))
    finish_sig = (arr(types.int64), u32, i64, arr(types.int64), i64, i64, b, el, u32, u32)
    encs = (K.RAW, K.NOSIGN, K.SIGNPLANE) if a.all else (K.NOSIGN,)
    ename = {K.RAW: "raw", K.NOSIGN: "nosign", K.SIGNPLANE: "signplane"}
    kernels = {}
    for op in ((0, K.OP_RELU2) if a.all else (0,)):
        for e in encs:
            kernels[f"unpack{'_relu2bw' if op else ''}_{ename[e]}"] = (k.unpack[(op, e)], unpack_sig)
    if a.all:
        for e in encs:
            kernels[f"gated_dense_u_{ename[e]}"] = (k.unpack[(K.OP_GATED_DENSE, e)], gated_sig)
            for ue in encs:
                kernels[f"gated_{ename[e]}_u_{ename[ue]}"] = (k.unpack[(K.OP_GATED, e, ue)],
                                                              gated_sig)
    for mode in ((K.MODE_PACK, K.MODE_RELU, K.MODE_RELU2, K.MODE_MASKED) if a.all else (K.MODE_PACK,)):
        for e in encs:
            name = f"pack{'_mode%d' % mode if mode else ''}_{ename[e]}"
            kernels[name] = (k.pack[(mode, e, False)], pack_sig)
            if e != K.RAW:
                kernels[name + "_ored"] = (k.pack[(mode, e, True)], pack_sig)
    kernels["finish"] = (k.finish, finish_sig)
    for name, (kern, sig) in kernels.items():
        # The kernel's own launch bounds: they cap its registers (spills show as local accesses).
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), lineinfo=a.lineinfo,
                                  launch_bounds=kern.targetoptions.get("launch_bounds"))
        base = Path(a.out) / f"numba_{name}"
        base.with_suffix(".ptx").write_text(ptx)
        lineinfo = ["-lineinfo"] if a.lineinfo else []
        r = subprocess.run([tool("ptxas"), "-arch=sm_90", "-v", *lineinfo,
                            str(base.with_suffix(".ptx")), "-o", str(base.with_suffix(".cubin"))],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        dis = ([tool("nvdisasm"), "--print-line-info", "--print-code"] if a.lineinfo
               else [tool("cuobjdump"), "-sass"])
        sass = subprocess.run([*dis, str(base.with_suffix(".cubin"))],
                              capture_output=True, text=True).stdout
        base.with_suffix(".sass").write_text(sass)
        n = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        if n == 0:      # cuobjdump prints only the header when it cannot find nvdisasm
            sys.exit(f"{name}: no SASS came out; is nvdisasm beside cuobjdump "
                     "(pip install nvidia-cuda-nvdisasm)?")
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        smem = re.findall(r"(\d+) bytes smem", r.stderr)
        print(f"{name}: {n} SASS instructions, {regs[0] if regs else '?'} registers, "
              f"{len(re.findall('LDL|STL', sass))} local accesses, "
              f"{smem[0] if smem else '?'} bytes static smem -> {base}.sass")


if __name__ == "__main__":
    main()
