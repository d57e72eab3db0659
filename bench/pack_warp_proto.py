"""The warp-tile pack prototype (bench/proto/pack_warp.cu) against bitsparse_pack.

For each dtype, sparsity and prototype tile size: the prototype packs the input at a
fixed capacity K = nnz into a block laid out by the production plan, its mask, offsets,
values and status are compared byte for byte with ``bc.pack``'s (CuPy backend), and
both are timed as ``bench_codecs.py`` times them (CUDA events, L2 flushed, a GPU sleep
hiding the host; the scratch fill counted in both). A prototype that differs in one
byte is reported (which plane, from which byte) and not timed. Session 19 measured it
1.4-2.0 x bitsparse_pack's time (bench/NOTES.md).

    python bench/pack_warp_proto.py [--numel 134217728] [--reps 10] [--rounds 4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

# Blocks per SM each tile size's registers are budgeted for (ptxas, sm_90: R = 4 uses
# 62 registers at 4 blocks, R = 8 spills at 4 and 68 bytes at 3; bench/NOTES.md).
MIN_BLOCKS = {4: 4, 8: 3}
DTYPES = {"bfloat16": (0, 2), "float8_e4m3fn": (3, 1)}      # FMT id, bytes per element


def compile_proto(device: int, fmt: int, rounds: int):
    import cupy

    from bitsparse_core.backends.cupy import kernels as ck
    name = "bitsparse_pack_warp<%d,%d,%d>" % (fmt, 1, rounds)
    src = ck._source("bitsparse_pack.cu") + "\n" + (HERE / "proto" / "pack_warp.cu").read_text()
    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=src, options=("-std=c++17", f"-DPW_MIN_BLOCKS={MIN_BLOCKS[rounds]}"),
                             name_expressions=(name,))
        return int(mod.get_function(name).kernel.ptr), mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", default="4,8")
    ap.add_argument("--sparsities", default="0.5,0.9,0.99")
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    a = ap.parse_args(argv)
    import cupy
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, relu_like
    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import abi, driver, host
    from bitsparse_core.spec.format import Encoding

    dev = torch.cuda.current_device()
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    timer = Timer(torch, stream, a.reps)
    print(f"{torch.cuda.get_device_name()}, {a.numel} elements, nosign, fixed capacity K = nnz; "
          f"median of {a.reps}; us")
    print("dtype | sparsity | bitsparse_pack | prototype R | prototype us | proto / production")
    for dname in a.dtypes.split(","):
        fmt, size = DTYPES[dname]
        dt = D.resolve(dname)
        for sp in (float(v) for v in a.sparsities.split(",")):
            x = relu_like(torch, a.numel, sp, getattr(torch, dname), seed=int(sp * 1000))
            nnz = int(torch.count_nonzero(x.view(torch.uint8 if size == 1 else torch.int16)))
            ref = bc.pack(x, encoding="nosign", capacity=nnz, backend="cupy", stream=stream)
            base_ms = timer(lambda: bc.pack(x, encoding="nosign", capacity=nnz, backend="cupy",
                                            stream=stream))
            plan = host.pack_plan(tuple(x.shape), dt, Encoding.NOSIGN, nnz, 12)
            (mo, ml), (oo, ol), (vo, vl), (so, sl) = plan.spans
            for rounds in (int(r) for r in a.rounds.split(",")):
                func, _mod = compile_proto(dev, fmt, rounds)
                tile = rounds * 32 * (16 // size)
                n_tiles = -(-a.numel // tile)
                scratch_bytes = abi.pack_scratch_bytes(n_tiles)
                block = torch.zeros(plan.nbytes + scratch_bytes, dtype=torch.uint8, device="cuda")
                b = block.data_ptr()
                smem = 8 * ((tile + 16 + 7) & ~7) * size
                grid = driver.resident_blocks(func, abi.THREADS, smem, dev)
                args = abi.PackArgs().set(
                    x=x.data_ptr(), numel=a.numel, x_aligned=1, mask=b + mo, mask_len=ml,
                    offsets=b + oo, off64=0, chunk_log2=12, values=b + vo, signs=b + so, cap=nnz,
                    y=0, y_aligned=0, scratch=b + plan.nbytes, status=b + plan.status_offset,
                    n_tiles=n_tiles, zero_values_words=-(-vl // 4), zero_signs_words=0, slot=0)

                def run():
                    driver.memset0(b + plan.nbytes, scratch_bytes, s)
                    driver.launch_cooperative(func, grid, abi.THREADS, smem, s, args)

                with torch.cuda.stream(stream):
                    run()
                stream.synchronize()
                got = cupy.asarray(block)
                wrong = []
                for plane, o, n, p in (("mask", mo, ml, ref.mask), ("offsets", oo, ol, ref.offsets),
                                       ("values", vo, vl, ref.values)):
                    bad = cupy.flatnonzero(got[o:o + n] != cupy.asarray(p).view(cupy.uint8))
                    if bad.size:
                        wrong.append(f"{plane}: {int(bad.size)} bytes from byte {int(bad[0])} of {n}")
                st = got[plan.status_offset:plan.status_offset + 16].get()
                status, count = int(st[:4].view("<u4")[0]), int(st[8:].view("<u8")[0])
                if status != 0 or count != nnz:
                    wrong.append(f"status {status} count {count} (want 0, {nnz})")
                if wrong:
                    print(f"{dname} | {sp} | {1e3 * base_ms:.1f} | {rounds} | DIFFERS | - | "
                          + "; ".join(wrong), flush=True)
                    continue
                ms = timer(run)
                print(f"{dname} | {sp} | {1e3 * base_ms:.1f} | {rounds} | {1e3 * ms:.1f} | "
                      f"{ms / base_ms:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
