"""Memory and step time of a jitted FFN training step: plain JAX, jax.checkpoint, packed.

Packed runs by both implementations side by side: ``packed`` (the jax.numpy codec) and
``packed-ffi`` (the project's CUDA kernels as XLA custom calls, ``PackConfig(impl="ffi")``).

The stack is the PyTorch adapter's benchmark shape: residual blocks
``x + relu(x @ w1 + b1) @ w2`` (bf16; default 8 layers, d=4096, f=21504, 16k
tokens), with b1 calibrated per layer so that ~80% of pre-activations are
negative. Layers run under ``lax.scan`` (one compiled body, as JAX training
loops usually are). For each mode we record the compiled executable's
``memory_analysis()`` (temp = activations saved for the backward + workspace),
the device's peak bytes in use, the compile time and the median step time, and
check that the packed gradients are bit-identical to plain JAX's. A codec
micro-benchmark (pack / unpack of one activation against a device copy, through
either implementation) measures the codec alone.

    python3 bench/bench_jax_ffn.py --out bench/results            # full size
    python3 bench/bench_jax_ffn.py --tokens 512 --d 256 --f 1024  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from bitsparse_core.jax import codec, custom_calls, ffn  # noqa: E402
from bitsparse_core.spec.format import Encoding  # noqa: E402
from plotting import pyplot  # noqa: E402

Z80 = 0.8416212335729143   # standard normal quantile of 0.8


def block(mode, cfg, layer, x):
    if mode == "packed":
        return ffn.relu_ffn(x, layer["w1"], layer["b1"], layer["w2"], cfg)
    fn = partial(ffn.dense_block, kind="relu")
    if mode == "checkpoint":
        fn = jax.checkpoint(fn)
    return fn(layer, x)


def stack_loss(params, x, mode, cfg):
    def body(h, layer):
        return h + block(mode, cfg, layer, h), None
    out, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def init(key, n_layers, d, f, tokens):
    k1, k2, kx = jax.random.split(key, 3)
    w1 = (jax.random.normal(k1, (n_layers, d, f), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (n_layers, f, d), jnp.float32) / f ** 0.5).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (tokens, d), jnp.float32).astype(jnp.bfloat16)
    return {"w1": w1, "w2": w2}, x


@jax.jit
def _calibrate_layer(w1, w2, x):
    a = jnp.dot(x, w1).astype(jnp.float32)
    b1 = (-Z80 * jnp.sqrt(jnp.mean(jnp.square(a - jnp.mean(a))))).astype(jnp.bfloat16)
    b1 = jnp.full((w1.shape[1],), b1, jnp.bfloat16)
    pre = jnp.dot(x, w1) + b1
    positive = jnp.mean((pre > 0).astype(jnp.float32))
    return b1, positive, x + jnp.dot(jax.nn.relu(pre), w2)


def calibrate(params, x):
    """b1 per layer so ~80% of that layer's pre-activations are negative."""
    b1s, dens = [], []
    for i in range(params["w1"].shape[0]):
        b1, pos, x = _calibrate_layer(params["w1"][i], params["w2"][i], x)
        b1s.append(b1)
        dens.append(float(pos))
    return {**params, "b1": jnp.stack(b1s)}, dens


def time_calls(fn, args, steps):
    """(per-call seconds, last result): one warm-up call, then ``steps`` timed calls."""
    jax.block_until_ready(fn(*args))
    times, result = [], None
    for _ in range(steps):
        del result
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times, result


def peak_bytes(dev):
    try:
        stats = dev.memory_stats() or {}
    except Exception:
        return None
    return stats.get("peak_bytes_in_use")


def bits_identical(a, b):
    def eq(u, v):
        ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[u.dtype.itemsize]
        return jnp.all(lax.bitcast_convert_type(u, ut) == lax.bitcast_convert_type(v, ut))
    return bool(all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(eq, a, b))))


def codec_micro(tokens, f, density_bound, steps, chunk_log2):
    """Pack / unpack / mask of one [tokens, f] bf16 pre-activation vs a device copy."""
    key = jax.random.PRNGKey(7)
    a = (jax.random.normal(key, (tokens, f), jnp.float32) - Z80).astype(jnp.bfloat16)
    cap = codec.capacity_for(tokens * f, density_bound)
    pack = jax.jit(lambda t: codec.relu_pack_planes(t, capacity=cap, chunk_log2=chunk_log2))
    p = pack(a)
    unpack = jax.jit(codec.decode_dense)
    mask = jax.jit(codec.mask_of)
    copy = jax.jit(lambda t: t + jnp.ones((), t.dtype))   # read + write of one activation
    dense_bytes = tokens * f * 2
    cfg = ffn.PackConfig(density=density_bound, chunk_log2=chunk_log2, impl="ffi")
    ffi_pack = jax.jit(lambda t: custom_calls.relu_pack(t, capacity=cap, encoding=Encoding.NOSIGN,
                                                        chunk_log2=chunk_log2))
    ffi_unpack = jax.jit(partial(ffn._decode, cfg=cfg))
    q = ffn._pack(a, cfg)
    out = {"elements": tokens * f, "capacity": cap, "nnz": int(p.nnz),
           "packed_plane_bytes": p.nbytes, "dense_bytes": dense_bytes}
    for name, fn, arg, moved in (("copy", copy, a, 2 * dense_bytes),
                                 ("pack", pack, a, dense_bytes + p.nbytes),
                                 ("unpack", unpack, p, p.nbytes + dense_bytes),
                                 ("mask", mask, p, p.mask.size + tokens * f),
                                 ("ffi pack", ffi_pack, a, dense_bytes + p.nbytes),
                                 ("ffi unpack", ffi_unpack, q, p.nbytes + dense_bytes)):
        med = statistics.median(time_calls(fn, (arg,), steps)[0])
        out[name] = {"ms": med * 1e3, "GBps": moved / med / 1e9}
    return out


def run_mode(mode, params, x, cfg, steps, dev):
    step = jax.jit(jax.value_and_grad(partial(stack_loss, mode=mode, cfg=cfg)))
    t0 = time.perf_counter()
    compiled = step.lower(params, x).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    rec = {"mode": mode, "density_bound": cfg.density if mode.startswith("packed") else None,
           "compile_s": compile_s}
    for field in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes"):
        rec[field] = getattr(mem, field, None) if mem is not None else None
    times, (loss, grads) = time_calls(compiled, (params, x), steps)
    rec["step_ms"] = [t * 1e3 for t in times]
    rec["step_ms_median"] = statistics.median(times) * 1e3
    rec["peak_bytes_in_use_after"] = peak_bytes(dev)
    rec["loss"] = float(loss)
    return rec, grads


def write_outputs(res, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "jax_ffn.json"), "w") as fh:
        json.dump(res, fh, indent=2)
    cfg = res["config"]
    gib = 1 / 2 ** 30
    lines = [f"# JAX FFN training step: plain vs jax.checkpoint vs packed ({res['device']})", "",
             f"{cfg['layers']} residual ReLU FFN blocks, bf16, d={cfg['d']}, f={cfg['f']}, "
             f"{cfg['tokens']} tokens; b1 calibrated per layer; measured positive fraction "
             f"per layer: {', '.join(f'{v:.3f}' for v in res['positive_fraction'])}. "
             f"jax {res['jax']}. Step = jit(value_and_grad) under lax.scan over layers; "
             f"median of {cfg['steps']} steps after one warm-up.", "",
             "| mode | density bound | temp (GiB) | args+outputs (GiB) | peak in use (GiB) | "
             "step (ms) | step / plain | compile (s) | grads bit-identical to plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    plain = next((r["step_ms_median"] for r in res["modes"] if r["mode"] == "dense"), None)
    for r in res["modes"]:
        io = (r["argument_size_in_bytes"] or 0) + (r["output_size_in_bytes"] or 0)
        peak = r.get("peak_bytes_in_use_after")
        bound = r["density_bound"] if r["density_bound"] else "-"
        peak_s = f"{peak * gib:.2f}" if peak else "-"
        ratio = f"{r['step_ms_median'] / plain:.3f}" if plain else "-"
        lines.append(f"| {r['mode']} | {bound} | {(r['temp_size_in_bytes'] or 0) * gib:.2f} | "
                     f"{io * gib:.2f} | {peak_s} | {r['step_ms_median']:.1f} | {ratio} | "
                     f"{r['compile_s']:.1f} | {r.get('bit_identical_to_dense', '-')} |")
    if "codec" in res:
        c = res["codec"]
        lines += ["", f"Codec on one [{cfg['tokens']}, {cfg['f']}] bf16 activation "
                  f"(nnz {c['nnz']}, capacity {c['capacity']}, "
                  f"planes {c['packed_plane_bytes'] / 2**20:.0f} MiB "
                  f"vs dense {c['dense_bytes'] / 2**20:.0f} MiB):", "",
                  "| op | ms | GB/s (bytes read + written) |", "| --- | --- | --- |"]
        for k in ("copy", "pack", "unpack", "mask", "ffi pack", "ffi unpack"):
            lines.append(f"| {k} | {c[k]['ms']:.3f} | {c[k]['GBps']:.0f} |")
    lines += ["", "temp: the compiled step's memory_analysis() temp size (activations kept for the "
              "backward plus workspace; parameters are in args, gradients in outputs). "
              "peak in use: the device's peak_bytes_in_use read after each mode, a running "
              "maximum over the modes run so far, which also holds the gradients kept for the "
              "bit-identity check; use temp to compare modes. "
              "packed-overflow: a capacity below the real density, so every layer's backward "
              "takes the recompute path. packed-ffi*: the same through the custom calls "
              "(impl='ffi'); ffi pack / unpack: the codec through them."]
    with open(os.path.join(out_dir, "jax_ffn.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    modes = [r["mode"] + (f"\n(bound {r['density_bound']})" if r["density_bound"] else "")
             for r in res["modes"]]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar(modes, [(r["temp_size_in_bytes"] or 0) * gib for r in res["modes"]], color="C0")
    ax[0].set_ylabel("compiled temp memory (GiB)")
    ax[0].set_title("activations + workspace")
    ax[1].bar(modes, [r["step_ms_median"] for r in res["modes"]], color="C1")
    ax[1].set_ylabel("median step time (ms)")
    ax[1].set_title("training step")
    for a in ax:
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"JAX FFN stack, {cfg['layers']}x(d={cfg['d']}, f={cfg['f']}), "
                 f"{cfg['tokens']} tokens, bf16 ({res['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "jax_ffn.png"), dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=21504)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--density", type=float, default=0.25, help="capacity bound of the packed mode")
    ap.add_argument("--overflow-density", type=float, default=0.15,
                    help="a bound below the real density: every layer takes the exact "
                         "recompute path (0 skips this mode)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="packed,packed-ffi,checkpoint,dense")
    ap.add_argument("--no-codec", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    res = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
           "jax": jax.__version__, "python": platform.python_version(),
           "config": {k: getattr(args, k) for k in ("layers", "d", "f", "tokens", "density",
                                                    "overflow_density", "steps")},
           "modes": []}
    params, x = init(jax.random.PRNGKey(0), args.layers, args.d, args.f, args.tokens)
    params, res["positive_fraction"] = calibrate(params, x)
    print("positive fraction per layer:", [round(v, 4) for v in res["positive_fraction"]],
          flush=True)

    if not args.no_codec:
        res["codec"] = codec_micro(args.tokens, args.f, args.density, max(args.steps, 5), 12)
        print("codec:", {k: v for k, v in res["codec"].items()}, flush=True)
        write_outputs(res, args.out)

    impl = lambda name: "ffi" if "ffi" in name else "jnp"   # noqa: E731
    names = args.modes.split(",")
    modes = [(m, ffn.PackConfig(density=args.density, impl=impl(m))) for m in names]
    if args.overflow_density > 0:
        modes += [(m + "-overflow", ffn.PackConfig(density=args.overflow_density, impl=impl(m)))
                  for m in names if m.startswith("packed")]
    ref_grads, pending = None, {}
    for name, cfg in modes:
        mode = "packed" if name.startswith("packed") else name
        rec, grads = run_mode(mode, params, x, cfg, args.steps, dev)
        rec["mode"] = name
        res["modes"].append(rec)
        if mode == "dense":
            ref_grads = grads
            for r in res["modes"]:
                if r["mode"] in pending:
                    r["bit_identical_to_dense"] = bits_identical(grads, pending.pop(r["mode"]))
        elif ref_grads is not None:
            rec["bit_identical_to_dense"] = bits_identical(ref_grads, grads)
        else:
            pending[name] = grads
        del grads
        print(json.dumps(rec), flush=True)
        write_outputs(res, args.out)
    print(open(os.path.join(args.out, "jax_ffn.md")).read())


if __name__ == "__main__":
    main()
