"""Where the packed JAX step's temp memory goes: compile the bench's step, summarise XLA's
memory-usage report of it.

Compiles (does not run) ``bench_jax_ffn``'s training step for one mode and prints
``memory_analysis()``'s temp size. Run it under ``XLA_FLAGS=--xla_dump_to=DIR`` and XLA
writes the optimized module's buffer assignment and memory-usage report to DIR; ``--summary`` then reads the report from DIR and writes its
largest allocations (with the shapes of the values sharing each) to a short Markdown
file, which is what two modes are compared by (issue 19: the FFI path's temp against the
jax.numpy codec's).

    XLA_FLAGS=--xla_dump_to=/tmp/d_ffi python3 bench/jax_temp_probe.py --mode packed-ffi \\
        --summary /tmp/d_ffi --out bench/results/jax_temp_ffi.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

import bench_jax_ffn as B  # noqa: E402
from bitsparse_core.jax import ffn  # noqa: E402

GIB = 1 << 30


def compile_step(mode: str, layers: int, d: int, f: int, tokens: int, density: float):
    impl = "ffi" if "ffi" in mode else "jnp"
    cfg = ffn.PackConfig(density=density, impl=impl)
    params, x = B.init(jax.random.PRNGKey(0), layers, d, f, tokens)
    params, _ = B.calibrate(params, x)      # adds the biases (b1), as the bench does
    plain = "packed" if mode.startswith("packed") else mode
    step = jax.jit(jax.value_and_grad(partial(B.stack_loss, mode=plain, cfg=cfg)))
    return step.lower(params, x).compile()


def usage_report(dump_dir: str, top: int) -> tuple[str, list[str]]:
    """The step module's memory-usage report (XLA's allocations of the optimized module,
    largest first, each with the shapes of the values that share it): its first ``top``
    rows."""
    files = glob.glob(os.path.join(dump_dir, "*jit_stack_loss*memory-usage-report.txt"))
    if not files:
        return "", []
    path = max(files, key=os.path.getsize)
    return path, open(path).read().splitlines()[:top + 4]


# Ways of ordering the ReLU backward, put in place of ffn._dw2_first: the adapter's own,
# and none (XLA's schedule as it comes).
ORDERINGS = {"dw2-first": None, "as-scheduled": lambda dy, dw2: (dy, dw2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="packed-ffi")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=21504)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--ordering", default="dw2-first", choices=sorted(ORDERINGS),
                    help="how the ReLU backward is ordered (ffn._dw2_first or none)")
    ap.add_argument("--summary", default="", help="the XLA dump directory to summarise")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    own = ffn._dw2_first
    ffn._dw2_first = ORDERINGS[args.ordering] or own
    try:
        compiled = compile_step(args.mode, args.layers, args.d, args.f, args.tokens,
                                args.density)
    finally:
        ffn._dw2_first = own
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None)
    rec = {"mode": args.mode, "ordering": args.ordering,
           "temp_gib": temp / GIB if temp is not None else None}
    print(json.dumps(rec), flush=True)
    if args.summary:
        path, rows = usage_report(args.summary, args.top)
        lines = [f"# Memory use of the {args.mode} step ({jax.devices()[0].device_kind})", "",
                 f"temp {rec['temp_gib']:.3f} GiB; from `{os.path.basename(path)}`", "", "```"]
        lines += rows or ["(no memory-usage report found)"]
        lines += ["```"]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)


if __name__ == "__main__":
    main()
