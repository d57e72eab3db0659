"""The exact pack's shrink copy: ``cuMemcpyAsync`` device to device against a plain
16-byte-vector copy kernel, on the GPU's clock (CUDA events, L2 flushed, a GPU sleep
hiding the host) and the host's (enqueue time per call), for the byte counts an exact
bf16 nosign pack of 2^27 elements moves at sparsity 0.5 / 0.9 / 0.99 (issue 20).

    python bench/shrink_copy_probe.py [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

COPY16 = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += stride)
        dst[i] = src[i];
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks-per-sm", default="4,8,16")
    a = ap.parse_args(argv)
    import ctypes

    import cupy
    import torch

    from bench_codecs import Timer
    from bitsparse_core.backends.cuda import driver

    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    timer = Timer(torch, stream, a.reps)
    func = int(cupy.RawModule(code=COPY16).get_function("copy16").kernel.ptr)
    sms = driver.sm_count(torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}; median of {a.reps}; GPU us (host us to enqueue)")
    print("bytes | cuMemcpyAsync | " + " | ".join(f"kernel {b}/SM" for b in a.blocks_per_sm.split(",")))
    nnz_bf16 = {0.5: 67108864, 0.9: 13421773, 0.99: 1342177}
    for sp, nnz in nnz_bf16.items():
        nbytes = (nnz * 15 + 7) // 8 // 16 * 16
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        cells = []

        def host_us(fn, n=200):
            with torch.cuda.stream(stream):
                fn()
                stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                t = (time.perf_counter() - t0) / n
                stream.synchronize()
            return 1e6 * t

        def memcpy():
            driver.copy(dst.data_ptr(), src.data_ptr(), nbytes, s)
        cells.append((timer(memcpy), host_us(memcpy)))
        assert torch.equal(src, dst)
        for b in (int(v) for v in a.blocks_per_sm.split(",")):
            n16 = nbytes // 16
            args = (ctypes.c_uint64 * 3)(src.data_ptr(), dst.data_ptr(), n16)
            ptrs = (ctypes.c_void_p * 3)(*[ctypes.addressof(args) + 8 * i for i in range(3)])
            grid = max(1, min(-(-n16 // 256), b * sms))

            def kern():
                driver.check(driver.lib().cuLaunchKernel(ctypes.c_void_p(func), grid, 1, 1, 256, 1, 1, 0,
                                                         ctypes.c_void_p(s), ptrs, None), "launch")
            dst.zero_()
            cells.append((timer(kern), host_us(kern)))
            assert torch.equal(src, dst)
        print(f"{nbytes} (s={sp}) | " + " | ".join(f"{1e3 * g:.1f} ({h:.1f})" for g, h in cells),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
