"""Upper bounds of the fixed-capacity pack kernel: bitsparse_pack with parts of its
work taken out, timed beside the unchanged kernel in one run (issue 20).

Variants (text edits of kernels/bitsparse_pack.cu, compiled here; the package's
kernel is not touched):

* ``prod``: the kernel as it is, compiled the same way (checks the harness);
* ``nolb``: no decoupled look-back: each tile takes ``tile * (cap / n_tiles)`` as its
  offset instead of folding its predecessors' counts (the block barriers stay), so
  the time left is the kernel without the coupling between blocks;
* ``nolb-nowrite``: ``nolb`` without the value-stream words (the mask, offsets and
  edges are still written): what building and storing the stream's words cost;
* ``cached``: every whole tile loads the first tile's 16-byte vectors (in L1 / L2 after
  the first), so the loads cost a cache hit, not a DRAM round trip; everything else,
  the look-back included, as it is: whether the pack waits on its loads (a time well
  under ``prod``'s) or on its own work (about ``prod``'s);
* ``nostage``, ``nomask``: ``prod`` without, in turn, the staging of stored values in
  shared memory and the mask stores. Each says what one step costs where the others
  stay; ``a+b`` applies both (session 19 also cut the assembly of the W-bit stream and
  the barrier before it, which the kernel no longer has);
* ``file=PATH``, ``file=PATH@SMEM`` or ``file=PATH@SMEM@THREADS``: another version of
  bitsparse_pack.cu as it is (e.g. the last commit's, for an A/B of a change; it must
  take the same arguments and fit the current scratch), launched with SMEM bytes of
  dynamic shared memory and THREADS threads a block where they differ from the plan's.

The packed bytes (``to_bytes``) of a ``file=`` kernel are compared with
the package's kernel's on every row; "(planes differ)" marks a mismatch.

The edited kernels above write wrong planes on purpose; only their time is read. Each is
launched through the production path and argument record: while a variant is timed,
the driver's cooperative launch of the package's kernel launches the variant instead
(with the grid that fits it), and the bench checks that every timed call did.

    python bench/pack_bound.py [--numel 134217728] [--reps 10]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from bitsparse_core.backends.cuda import abi  # noqa: E402

# The texts of kernels/bitsparse_pack.cu the variants edit.
FOLD = re.compile(r"            // Warp 0 folds the tile's own group.*?"
                  r"\n            if \(\(s_lb_flag\[par\]\[0\] & 1u\) == 0u\)[^\n]*\n        }\n", re.S)
STREAM = "        bs_copy_inner<W, false>(reinterpret_cast<u32*>(values_ptr), stage, a, e);\n"
LOAD = "reinterpret_cast<const uint4*>(x + base) + (warp * (SEG / V) + lane)"
VARIANTS = ("prod", "nolb", "nolb-nowrite", "cached", "nostage", "nomask")
FLOOR = "nolb-nowrite+nostage+nomask"     # what no cut above can take away

# name -> (text of bitsparse_pack.cu, what replaces it)
CUTS = {
    "nostage": ("            T* p = stage + j;\n#pragma unroll\n            for (int i = 0; i < V; ++i)\n"
                "                if ((bits[r] >> i) & 1u) *p++ = bs_lane<T>(vec[r], i);\n", ""),
    "nomask": ("            bs_store_mask<V, R>(reinterpret_cast<u8*>(mask_ptr) + (tile_base >> 3), bits,\n"
               "                                (u32)(warp * SEG), rem, lane);\n", "            ;\n"),
}


def launch_shape(name: str, smem: int) -> tuple:
    """(dynamic shared memory, threads a block) of a variant: the plan's, unless a
    ``file=`` variant names its own (``@SMEM``, ``@SMEM@THREADS``)."""
    parts = name.split("@") if name.startswith("file=") else [name]
    return (int(parts[1]) if len(parts) > 1 else smem,
            int(parts[2]) if len(parts) > 2 else abi.THREADS)


def variant_source(src: str, name: str) -> str:
    if "+" in name and not name.startswith("file="):   # cuts in turn, e.g. nolb-nowrite+nostage
        for part in name.split("+"):
            src = variant_source(src, part)
        return src
    if name == "prod":
        return src
    if name.startswith("file="):           # the same common header, another kernel file
        own = (HERE.parent / "kernels" / "bitsparse_pack.cu").read_text()
        if not src.endswith(own):
            raise SystemExit("pack_bound: the source does not end with bitsparse_pack.cu")
        return src[:len(src) - len(own)] + Path(name[len("file="):].split("@")[0]).read_text()
    if name in CUTS:
        old, new = CUTS[name]
        if src.count(old) != 1:
            raise SystemExit(f"pack_bound: {name}'s text was not found once in bitsparse_pack.cu")
        return src.replace(old, new)
    if name == "cached":
        if LOAD not in src:
            raise SystemExit("pack_bound: the whole-tile load was not found in bitsparse_pack.cu")
        return src.replace(LOAD, "reinterpret_cast<const uint4*>(x) + (warp * (SEG / V) + lane)")
    if name not in ("nolb", "nolb-nowrite"):
        raise SystemExit(f"pack_bound: no variant {name!r} (known: {', '.join(VARIANTS)})")
    fold = FOLD.search(src)
    if fold is None:
        raise SystemExit("pack_bound: the look-back fold was not found in bitsparse_pack.cu")
    src = src[:fold.start()] + ("            P = tile * (cap / n_tiles);\n"
                                "            __syncthreads();\n        }\n") + src[fold.end():]
    if name == "nolb-nowrite":
        if STREAM not in src:
            raise SystemExit("pack_bound: the stream store was not found in bitsparse_pack.cu")
        src = src.replace(STREAM, "")
    return src


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sparsities", default="0.5,0.9,0.99")
    ap.add_argument("--variants", default=",".join(VARIANTS + (FLOOR,)))
    a = ap.parse_args(argv)
    import cupy
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, relu_like
    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import driver, host
    from bitsparse_core.backends.cupy import kernels as ck
    from bitsparse_core.spec.format import Encoding

    dev = torch.cuda.current_device()
    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, a.reps)
    src = ck._source("bitsparse_pack.cu")
    mods = {}
    print(f"{torch.cuda.get_device_name()}, {a.numel} elements, nosign, fixed capacity K = nnz; "
          f"median of {a.reps}; us (bitsparse_pack = the package's kernel)")
    print("dtype | sparsity | bitsparse_pack | " + " | ".join(a.variants.split(",")))
    for dname, tdt in (("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.float8_e4m3fn)):
        dt = D.resolve(dname)
        fmt = abi.BITS_FMT[dt.bits]
        name = "bitsparse_pack<%d,%d,%d,%d>" % (fmt, int(Encoding.NOSIGN), int(abi.Mode.PACK),
                                                abi.PACK_ROUNDS)
        for sp in (float(v) for v in a.sparsities.split(",")):
            x = relu_like(torch, a.numel, sp, tdt, seed=int(sp * 1000))
            nnz = int(torch.count_nonzero(x.view(torch.uint8 if dt.itemsize == 1 else torch.int16)))

            def call():
                return bc.pack(x, encoding="nosign", capacity=nnz, backend="cupy", stream=stream)
            call()
            ref = None                       # the package's kernel's planes, when compared
            base = timer(call)
            plan = host.pack_plan(tuple(x.shape), dt, Encoding.NOSIGN, nnz, 12, abi.Mode.PACK)
            prod_func = host.kernel(dev, "pack", fmt, int(Encoding.NOSIGN), int(abi.Mode.PACK),
                                    abi.PACK_ROUNDS)
            real = driver.launch_cooperative
            row = []
            for v in a.variants.split(","):
                key = (v, name)
                if key not in mods:
                    mods[key] = cupy.RawModule(code=variant_source(src, v),
                                               options=("-std=c++17",), name_expressions=(name,))
                func = int(mods[key].get_function(name).kernel.ptr)
                smem, threads = launch_shape(v, plan.smem)
                grid = min(plan.n_tiles, driver.resident_blocks(func, threads, smem, dev))
                swaps = []

                def swapped(f, g, block, sm, stream, args):
                    if f == prod_func:
                        swaps.append(1)
                        f, g, block, sm = func, grid, threads, smem
                    return real(f, g, block, sm, stream, args)
                try:
                    driver.launch_cooperative = swapped
                    ms = timer(call)
                finally:
                    driver.launch_cooperative = real
                if len(swaps) < a.reps:
                    raise SystemExit(f"pack_bound: {v} was launched {len(swaps)} times, not on "
                                     f"every timed call")
                note = ""
                if v.startswith("file="):            # a whole kernel
                    try:
                        driver.launch_cooperative = swapped
                        got = call()
                    finally:
                        driver.launch_cooperative = real
                    if ref is None:
                        ref = call().to_bytes()
                    note = "" if got.to_bytes() == ref else " (planes differ)"
                row.append(f"{1e3 * ms:.1f}{note}")
            print(f"{dname} | {sp} | {1e3 * base:.1f} | " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
