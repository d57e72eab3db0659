"""Fixed-capacity pack and unpack timings of the CuPy kernels under extra NVRTC options.

    BITSPARSE_CUDA_OPTIONS="-DSOME_SWITCH" python3 bench/kernel_variants.py [--unpack-only]
        [--pack-rounds R] [--encoding nosign|signplane|raw]

For A/B tests of compile-time kernel variants within one device call (each
option set is compiled separately; CuPy's cache keys include the options).
bf16 and fp8 e4m3fn at sparsity 0.5, 0.9 and 0.99, 2^27 elements, median of 10
CUDA-event timings as in bench_codecs.py. No correctness check: a variant that
drops work on purpose (e.g. a fake offset) still times; bench_codecs.py and
the GPU tests check the committed kernels. ``--pack-rounds`` sets the pack
tile's rounds per warp for this process (``abi.PACK_ROUNDS``; the plans, the
grid and the shared-memory size follow it). Each pack row ends with a digest of the
packed planes, to compare variants across their processes. ``--encoding`` (default
nosign) picks the encoding packed and unpacked; the input is ReLU-like either way, so a
signplane run times its kernels with an all-zero sign plane.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import bitsparse_core as bc  # noqa: E402
from bench_codecs import Timer, relu_like  # noqa: E402


def main() -> None:
    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, 10)
    tag = os.environ.get("BITSPARSE_CUDA_OPTIONS", "") or "(default)"
    unpack_only = "--unpack-only" in sys.argv
    enc = sys.argv[sys.argv.index("--encoding") + 1] if "--encoding" in sys.argv else "nosign"
    if enc != "nosign":
        tag += f" {enc}"
    if "--pack-rounds" in sys.argv:
        from bitsparse_core.backends.cuda import abi
        abi.PACK_ROUNDS = int(sys.argv[sys.argv.index("--pack-rounds") + 1])
        tag += f" R={abi.PACK_ROUNDS}"
    for dname, tdtype in (("bfloat16", torch.bfloat16), ("float8_e4m3fn", torch.float8_e4m3fn)):
        for sp in (0.5, 0.9, 0.99):
            x = relu_like(torch, 1 << 27, sp, tdtype, seed=int(sp * 1000))
            nnz = int(torch.count_nonzero(x.view(torch.uint8 if x.element_size() == 1 else torch.int16)))
            # With --unpack-only the input is packed by the default-option kernel
            # (the warm cache's), so a variant compiles only its unpack kernels.
            opts = os.environ.pop("BITSPARSE_CUDA_OPTIONS", None) if unpack_only else None
            p = bc.pack(x, encoding=enc, capacity=nnz, backend="cupy", stream=stream)
            if opts is not None:
                os.environ["BITSPARSE_CUDA_OPTIONS"] = opts
            if not unpack_only:
                ms = timer(lambda: bc.pack(x, encoding=enc, capacity=nnz, backend="cupy",
                                           stream=stream))
                digest = hashlib.sha256(p.to_bytes()).hexdigest()[:12]
                print(f"{tag:28s} {dname:14s} s={sp} pack fixed {ms * 1e3:7.1f} us planes {digest}",
                      flush=True)
            out = torch.empty_like(x)
            ms = timer(lambda: bc.unpack(p, out=out, stream=stream))
            print(f"{tag:28s} {dname:14s} s={sp} unpack     {ms * 1e3:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
