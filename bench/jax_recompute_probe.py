"""Does the overflow recompute give the forward's bits back on this GPU (issue 19)?

On an overflowing batch the packed JAX FFN's backward recomputes ``x @ w1 + b1`` under
``lax.cond``, a computation XLA compiles apart from the forward's. This compiles a
residual FFN stack (the layers under ``lax.scan``, and unrolled) with a capacity below
the real density, so every layer recomputes, and reports whether the gradients are
bit-identical to plain JAX's, once per candidate way of writing the recompute (the
adapter's own among them) put in place of ``ffn._recompute_up``. Beside each,
the matmuls of the optimized HLO (cuBLAS calls with their epilogue and algorithm,
Triton GEMM fusions with their tiling); ``--hlo`` also writes each optimized HLO.
On the H200 this found the bias fused into the recompute's cuBLAS epilogue
(bench/NOTES.md, session 15).

    python3 bench/jax_recompute_probe.py --out OUT [--hlo]
    python3 bench/jax_recompute_probe.py --d 256 --f 1024 --tokens 512 --out OUT   # small
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import bench_jax_ffn as bench  # noqa: E402
from bitsparse_core.jax import ffn  # noqa: E402

barrier = lax.optimization_barrier


# Ways of writing the recomputed pre-activation ``x @ w1 + b1``, each put in place of the
# adapter's ``ffn._recompute_up`` (which the FFN ops' backwards call under ``lax.cond``).
CANDIDATES = {
    # what the adapter does (barriers around the recompute's inputs and result)
    "current": ffn._recompute_up,
    # a barrier around the result only (the adapter before session 15)
    "output-barrier": lambda x, w, b: barrier(ffn._up(x, w, b)),
    # relu inside the barrier (the dense forward's dot + bias + relu pattern)
    "relu-in-barrier": lambda x, w, b: barrier(jax.nn.relu(ffn._up(x, w, b))),
    # no barrier at all
    "plain-recompute": ffn._up,
}


def stack_loss(params, x, kind, mode, cfg, scan):
    """The residual stack's loss, its layers under ``lax.scan`` (one compiled body, as
    ``bench_jax_ffn``) or unrolled (each layer its own code, its weights sliced
    statically)."""
    if mode == "packed":
        blk = partial(ffn.packed_block, kind=kind, cfg=cfg)
    else:
        blk = partial(ffn.dense_block, kind=kind)
    if scan:
        x, _ = lax.scan(lambda h, layer: (h + blk(layer, h), None), x, params)
    else:
        for i in range(params["w1"].shape[0]):
            x = x + blk(jax.tree_util.tree_map(lambda t: t[i], params), x)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


_CUBLAS = re.compile(r'custom_call_target="(__cublas[^"]*)"')


def matmuls(hlo: str) -> list:
    """One line per matmul of the optimized HLO: cuBLAS calls (shape, epilogue, algorithm)
    and Triton GEMM fusions (tiling)."""
    out = []
    for line in hlo.splitlines():
        m = _CUBLAS.search(line)
        if m:
            shape = line.split("=", 1)[1].split(" custom-call(")[0].strip()[:80]
            epi = re.search(r'"epilogue":"(\w+)"', line)
            alg = re.search(r'"selected_algorithm":"?(-?\d+)', line)
            dims = re.search(r'"lhs_contracting_dimensions":\[[^\]]*\][^}]*', line)
            out.append(f"{m.group(1)} {shape} epilogue={epi.group(1) if epi else '-'} "
                       f"alg={alg.group(1) if alg else '-'} {dims.group(0)[:90] if dims else ''}")
        elif "__triton_gemm" in line and "fusion(" in line:
            shape = line.split("=", 1)[1].split(" fusion(")[0].strip()[:80]
            tiling = re.search(r'"triton_gemm_config":\{[^}]*\}', line)
            out.append(f"triton_gemm {shape} {tiling.group(0)[:160] if tiling else ''}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=21504)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--overflow-density", type=float, default=0.15)
    ap.add_argument("--impl", default="ffi", choices=ffn.IMPLS)
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help="ways of writing the recompute, tried for every kind")
    ap.add_argument("--kinds", default="relu,relu2,gated")
    ap.add_argument("--contexts", default="scan,unrolled")
    ap.add_argument("--hlo", action="store_true", help="also write each optimized HLO")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    params, x = bench.init(jax.random.PRNGKey(0), args.layers, args.d, args.f, args.tokens)
    params, dens = bench.calibrate(params, x)
    params["wu"] = jax.random.normal(jax.random.PRNGKey(1), params["w1"].shape,
                                     jnp.float32).astype(params["w1"].dtype) / args.d ** 0.5
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "config": vars(args), "positive_fraction": dens, "rows": []}
    cfg = ffn.PackConfig(density=args.overflow_density, impl=args.impl)
    own = ffn._recompute_up

    def step(kind, mode, scan):
        used = params if kind == "gated" else {k: v for k, v in params.items() if k != "wu"}
        fn = jax.jit(jax.value_and_grad(partial(stack_loss, kind=kind, mode=mode, cfg=cfg,
                                                scan=scan)))
        c = fn.lower(used, x).compile()
        return c, c(used, x)[1]

    def save(name, text):
        if args.hlo:
            with open(os.path.join(args.out, f"hlo_{name}.txt"), "w") as fh:
                fh.write(text)

    try:
        for context in args.contexts.split(","):
            scan = context == "scan"
            for kind in args.kinds.split(","):
                dense, ref = step(kind, "dense", scan)
                save(f"{context}_{kind}_dense", dense.as_text())
                res.setdefault("dense_matmuls", {})[f"{context} {kind}"] = matmuls(dense.as_text())
                for name in args.candidates.split(","):
                    ffn._recompute_up = CANDIDATES[name]
                    c, grads = step(kind, "packed", scan)
                    same = {k: bench.bits_identical(ref[k], grads[k]) for k in ref}
                    save(f"{context}_{kind}_{name}", c.as_text())
                    row = {"context": context, "kind": kind, "candidate": name,
                           "bit_identical": all(same.values()), "by_param": same,
                           "matmuls": matmuls(c.as_text())}
                    res["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "matmuls"}),
                          flush=True)
                    del grads
                ffn._recompute_up = own
                del ref
    finally:
        ffn._recompute_up = own
    with open(os.path.join(args.out, "jax_recompute_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    lines = [f"# Overflow recompute candidates ({res['device']}, jax {res['jax']})", "",
             f"{args.layers} layers, d={args.d}, f={args.f}, {args.tokens} tokens, bf16, "
             f"impl={args.impl}, capacity bound {args.overflow_density} (positive fraction "
             f"{', '.join(f'{v:.3f}' for v in dens)}): every layer's backward recomputes. "
             "Contexts: the layers under `lax.scan`, or unrolled.", "",
             "| context | kind | candidate | grads bit-identical to plain | per parameter |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['context']} | {r['kind']} | {r['candidate']} | {r['bit_identical']} | "
              f"{', '.join(f'{k}: {v}' for k, v in r['by_param'].items())} |" for r in res["rows"]]
    lines += ["", "## Matmuls in the optimized HLO"]
    for key, mm in res.get("dense_matmuls", {}).items():
        lines += ["", f"plain, {key}:", "```", *mm, "```"]
    for r in res["rows"]:
        lines += ["", f"{r['context']} {r['kind']} {r['candidate']}:", "```", *r["matmuls"], "```"]
    with open(os.path.join(args.out, "jax_recompute_probe.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines[:len(res["rows"]) + 8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
