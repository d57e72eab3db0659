"""GPU time of the fused ops a training step runs, against the copy bandwidth of the same run.

    python3 bench/bench_fused.py [--variants NAME=OPTIONS;...] [--reps 20] [--out DIR]

The ops of a packed ReLU / ReLU² / gated FFN layer, CuPy backend, bf16, fixed capacity
(the training path's): ``relu_pack`` (ReLU and ReLU², planes and the dense output),
``relu2_backward`` (the input gradient), ``relu2_backward+square`` (the same kernel also
writing r², the next weight gradient's operand: what ``relu_linear``'s backward runs) and
``gated_backward`` (two gradients from two planes sharing a mask); the gated op's
``gated_pack`` (relu(g)'s planes and ``h = relu(g) * u`` in one kernel, mode RELU_GATED)
and ``gated_product`` (``r * u`` from both planes, the weight gradient's input), each
beside the way it was made before (``gated_pack_by_relu_mul``: relu(g)'s pack, then
``torch.mul``; ``gated_product_by_decodes``: two decodes, then the product) and timed
with the same bytes, so that their shares compare the same work. Inputs: a
pre-activation ~ N(0, 1) shifted so that a fraction ``density`` is positive, a gradient
~ N(0, 1). Shapes: a gpt12 layer's FFN activation [8192, 4096] at the density of a fresh
model (0.5) and of a trained one (0.1), and the codec bench's [8192, 14336] at 0.1.

Timing as bench_codecs.py: CUDA events on one stream, the L2 flushed and the stream held
by a sleep kernel before each call, median of ``--reps``. Bytes moved: the dense tensors
read and written plus the packed planes' bytes (the format's size formula at the
capacity), so the fraction of the copy bandwidth is the op's roofline share.

``--variants``: NVRTC option sets (``name=-DA=1 -DB=1;name2=...``) that each run in a
process of their own (CuPy caches a kernel per option set), e.g. the kernels' A/B
switches ``BS_FUSED_PER_ELEMENT``, ``BS_FUSED_BLOCKS`` and ``BS_PACK_FUSED_BLOCKS``;
``PACK_ROUNDS=n`` and ``FUSED_ROUNDS=n`` tokens (no ``-D``) set the
packs' and the fused unpack ops' rounds per warp in that process (``abi.PACK_ROUNDS``,
``abi.FUSED_ROUNDS``: host-side choices). Every process hashes the
ops' outputs; the table says whether a variant's bytes equal the default build's.

Writes ``fused.json``, ``fused.md`` and ``fused.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(HERE)]

from plotting import pyplot  # noqa: E402

CASES = (((8192, 4096), 0.5), ((8192, 4096), 0.1), ((8192, 14336), 0.1))
OPS = ("relu_pack", "relu2_pack", "relu2_backward", "relu2_backward+square", "gated_backward",
       "gated_product", "gated_product_by_decodes", "gated_pack", "gated_pack_by_relu_mul")
# relu_pack at 2 rounds and 4 blocks per SM (session 20's geometry)
DEFAULT_VARIANTS = "before=PACK_ROUNDS=2 -DBS_PACK_FUSED_BLOCKS=4"
ROUND_TOKENS = ("PACK_ROUNDS", "FUSED_ROUNDS")   # abi constants a variant may set
ROUNDS_ENV = "BITSPARSE_BENCH_ROUNDS"             # how they reach the variant's processes


def split_options(options: str) -> tuple[str, dict]:
    """A variant's NVRTC options, and the ``NAME=n`` round tokens it sets."""
    rounds, rest = {}, []
    for tok in options.split():
        name, _, value = tok.partition("=")
        if name in ROUND_TOKENS:
            rounds[name] = int(value)
        else:
            rest.append(tok)
    return " ".join(rest), rounds


def _apply_rounds() -> None:
    """This process's rounds, before anything plans a launch."""
    if os.environ.get(ROUNDS_ENV):
        from bitsparse_core.backends.cuda import abi
        for name, value in json.loads(os.environ[ROUNDS_ENV]).items():
            setattr(abi, name, value)


def _digest(arrays) -> str:
    """A hash of the bytes of DLPack-exportable device arrays (a whole op's outputs)."""
    import torch
    h = hashlib.sha256()
    for a in arrays:
        t = a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)
        h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _planes(p) -> list:
    from bitsparse_core.backends.cuda import interop as ci
    return [a for a in (p.mask, p.offsets, p.values, p.signs) if ci.plane_len(a)]


def measure(reps: int) -> dict:
    """This process's rows (its kernels built with BITSPARSE_CUDA_OPTIONS)."""
    import torch

    import bitsparse_core as bc
    from bench_codecs import Timer, copy_bandwidth
    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.backends.cuda.abi import Mode, Op
    from bitsparse_core.spec.format import Encoding
    from bitsparse_core.backends.cupy.backend import CupyBackend
    from bitsparse_core.spec import format as _fmt

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, reps)
    copy_bw, _ = copy_bandwidth(torch, timer)
    be = CupyBackend()
    rows = []
    for shape, density in CASES:
        g = torch.Generator(device="cuda").manual_seed(int(density * 1000) + shape[1])
        shift = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - density)))
        a = (torch.randn(shape, device="cuda", generator=g) - shift).to(torch.bfloat16)
        u = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        grad = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        K = int((a > 0).sum())
        n, isz = a.numel(), a.element_size()
        kw = dict(capacity=K, stream=stream)
        packed = lambda enc: _fmt.packed_size(shape, "bfloat16", enc, K)   # noqa: E731
        u_planes = sum(_fmt.layout(shape, "bfloat16", "signplane", K).sections[s][1]
                       for s in ("values", "signs"))     # u's own planes (the mask is p1's)
        with torch.cuda.stream(stream):
            y1, p1 = bc.relu_pack(a, **kw)
            y2, p2 = bc.relu_pack(a, square=True, **kw)
            pu = bc.masked_pack(u, p1, stream=stream)
            sq_out, sq_out2 = torch.empty_like(a), torch.empty_like(a)

            def relu2_and_square():
                be._unpack_op(p2, Op.RELU2_AND_SQUARE, stream.cuda_stream, None,
                              sq_out.data_ptr(), grad=grad.data_ptr(), out2=sq_out2.data_ptr())

            relu2_and_square()
            # the gated op's weight-gradient input r * u: one kernel from both blocks, and the
            # way it was formed before (two decodes and a product)
            h_one, r_buf, u_buf = (torch.empty_like(a) for _ in range(3))
            pu_planes = be._ready(pu, stream.cuda_stream)

            def gated_product():
                be._unpack_op(p1, Op.GATED_PRODUCT, stream.cuda_stream, None, h_one.data_ptr(),
                              pu=pu_planes, u_encoding=pu.encoding)

            def product_by_decodes():
                bc.unpack(p1, out=r_buf, stream=stream)
                bc.unpack(pu, out=u_buf, stream=stream)
                r_buf.mul_(u_buf)

            # the gated forward's pack: relu(g)'s planes and h = relu(g) * u in one kernel
            # (mode RELU_GATED), and before: relu(g)'s planes and relu(g), then the product
            plan_g = host.pack_plan(shape, _dt.BFLOAT16, Encoding.NOSIGN, K, 12, Mode.RELU_GATED)
            plan_r = host.pack_plan(shape, _dt.BFLOAT16, Encoding.NOSIGN, K, 12, Mode.RELU)
            blk = torch.empty(plan_g.nbytes, dtype=torch.uint8, device="cuda")
            scr = torch.empty(plan_g.scratch_bytes, dtype=torch.uint8, device="cuda")
            h_pack, r_pack, h_mul = (torch.empty_like(a) for _ in range(3))
            dev = torch.cuda.current_device()

            def gated_pack():
                host.enqueue_pack(plan_g, dev, stream.cuda_stream, a.data_ptr(), blk.data_ptr(),
                                  scr.data_ptr(), h_pack.data_ptr(), zero_tail=False,
                                  u=u.data_ptr())

            def pack_by_relu_mul():
                host.enqueue_pack(plan_r, dev, stream.cuda_stream, a.data_ptr(), blk.data_ptr(),
                                  scr.data_ptr(), r_pack.data_ptr(), zero_tail=False)
                torch.mul(r_pack, u, out=h_mul)

            gated_product()
            product_by_decodes()
            gated_pack()
            pack_by_relu_mul()
            outs = {
                "relu_pack": ((lambda: bc.relu_pack(a, **kw)), (y1, *_planes(p1)),
                              2 * n * isz + packed("nosign")),
                "relu2_pack": ((lambda: bc.relu_pack(a, square=True, **kw)), (y2, *_planes(p2)),
                               2 * n * isz + packed("nosign")),
                "relu2_backward": ((lambda: bc.relu2_backward(grad, p2, stream=stream)),
                                   (bc.relu2_backward(grad, p2, stream=stream),),
                                   2 * n * isz + packed("nosign")),
                "relu2_backward+square": (relu2_and_square, (sq_out, sq_out2),
                                          3 * n * isz + packed("nosign")),
                "gated_backward": ((lambda: bc.gated_backward(grad, p1, pu, stream=stream)),
                                   bc.gated_backward(grad, p1, pu, stream=stream),
                                   3 * n * isz + packed("nosign") + u_planes),
                # each pair with the first one's bytes: the second row's share is the same work's
                "gated_product": (gated_product, (h_one,), n * isz + packed("nosign") + u_planes),
                "gated_product_by_decodes": (product_by_decodes, (r_buf,),
                                             n * isz + packed("nosign") + u_planes),
                "gated_pack": (gated_pack, (h_pack, blk), 3 * n * isz + packed("nosign")),
                "gated_pack_by_relu_mul": (pack_by_relu_mul, (h_mul, blk),
                                           3 * n * isz + packed("nosign")),
            }
        stream.synchronize()
        for op in OPS:
            fn, results, nbytes = outs[op]
            ms = timer(fn)
            rows.append({"shape": list(shape), "density": density, "op": op, "us": ms * 1e3,
                         "bytes": nbytes, "of_copy": nbytes / (ms * 1e-3) / copy_bw,
                         "digest": _digest(results)})
            print(f"{str(shape):14s} d={density:<4} {op:22s} {ms * 1e3:8.1f} us "
                  f"{rows[-1]['of_copy']:6.1%} of copy", file=sys.stderr, flush=True)
    from bitsparse_core.backends.cuda import abi
    return {"copy_bandwidth_Bps": copy_bw, "rows": rows, "pack_rounds": abi.PACK_ROUNDS,
            "fused_rounds": abi.FUSED_ROUNDS}


def warm() -> None:
    """Compile this process's option set's kernels of the measured ops, in parallel."""
    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda import abi
    from bitsparse_core.backends.cupy.kernels import warm_cache
    from bitsparse_core.spec.format import Encoding
    bf16, nosign, signplane = int(abi.Fmt.BF16), int(Encoding.NOSIGN), int(Encoding.SIGNPLANE)
    ru = abi.FUSED_ROUNDS
    keys = [("pack", bf16, nosign, int(m), abi.PACK_ROUNDS) for m in (abi.Mode.RELU, abi.Mode.RELU2)]
    keys += [("pack", bf16, signplane, int(abi.Mode.MASKED), abi.PACK_ROUNDS)]
    keys += [("unpack", bf16, int(op), ru, nosign, 0) for op in (abi.Op.RELU2, abi.Op.RELU2_AND_SQUARE)]
    keys += [("unpack", bf16, int(op), ru, nosign, signplane)
             for op in (abi.Op.GATED, abi.Op.GATED_PRODUCT)]
    keys += [("pack", bf16, nosign, int(abi.Mode.RELU_GATED), abi.PACK_ROUNDS)]
    keys += [("unpack", int(abi.BITS_FMT[16]), int(abi.Op.UNPACK), abi.unpack_rounds(
        _dt.BFLOAT16, abi.Op.UNPACK), e, 0) for e in (nosign, signplane)]
    warm_cache(len(keys), keys)


def run_variant(name: str, options: str, reps: int) -> dict:
    nvrtc, rounds = split_options(options)
    env = dict(os.environ, BITSPARSE_CUDA_OPTIONS=nvrtc, **{ROUNDS_ENV: json.dumps(rounds)})
    t0 = time.monotonic()
    # the variant's kernels compile in parallel first (one after another they take minutes)
    subprocess.run([sys.executable, __file__, "--warm"], env=env, check=True, cwd=ROOT)
    out = subprocess.run([sys.executable, __file__, "--child", "--reps", str(reps)], env=env,
                         check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    res = json.loads(out.stdout)
    res["seconds"] = time.monotonic() - t0
    res["options"] = options      # NVRTC options and round tokens, as the variant gave them
    return res


def markdown(summary: dict) -> str:
    names = list(summary["variants"])
    base = summary["variants"][names[0]]["rows"]
    lines = [f"# Fused ops on {summary['device']}", "",
             f"{summary['date']}; torch {summary['torch']}, cupy {summary['cupy']}, commit "
             f"{summary['commit']}. bf16, CuPy backend, fixed capacity = the nonzeros; CUDA "
             f"events, median of {summary['reps']} (L2 flushed, stream held by a sleep before "
             "each call). Copy bandwidth in the same run: "
             f"{summary['variants'][names[0]]['copy_bandwidth_Bps'] / 1e12:.2f} TB/s "
             "(read + write bytes of a 1 GiB copy). Variants (NVRTC options): "
             + "; ".join(f"`{n}` = `{summary['variants'][n]['options'] or '(none)'}`"
                         for n in names) + ".", "",
             "µs per call, the share of the copy bandwidth (bytes moved: dense tensors read "
             "and written + packed planes), and each variant's time over the default build's "
             "(> 1: the default is faster); `same` says whether the variant's output bytes equal the default's.",
             "", "| shape | density | op | MB moved | " + " | ".join(
                 f"{n} µs | {n} % of copy" + ("" if i == 0 else f" | {n} / default | same")
                 for i, n in enumerate(names)) + " |",
             "| --- | --- | --- | --- | " + " | ".join(
                 "--- | ---" + ("" if i == 0 else " | --- | ---") for i in range(len(names))) + " |"]
    for k, row in enumerate(base):
        cells = [f"{row['shape'][0]}x{row['shape'][1]}", f"{row['density']}", f"`{row['op']}`",
                 f"{row['bytes'] / 1e6:.0f}"]
        for i, n in enumerate(names):
            r = summary["variants"][n]["rows"][k]
            cells += [f"{r['us']:.1f}", f"{r['of_copy']:.0%}"]
            if i:
                cells += [f"{r['us'] / row['us']:.2f}", "yes" if r["digest"] == row["digest"] else "**NO**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(summary["variants"])
    base = summary["variants"][names[0]]["rows"]
    labels = [f"{r['op']}\n{r['shape'][1]} d={r['density']}" for r in base]
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels)), 4.5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [100 * r["of_copy"] for r in summary["variants"][n]["rows"]]
        ax.bar([k + i * w for k in range(len(labels))], vals, w, label=n)
    ax.set_xticks([k + 0.4 - w / 2 for k in range(len(labels))], labels, rotation=70, fontsize=7)
    ax.set_ylabel("% of copy bandwidth")
    ax.set_title(f"Fused ops, bf16 ({summary['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="name=NVRTC options, ';'-separated ('' for none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    _apply_rounds()
    if args.warm:
        warm()
        return 0
    if args.child:
        print(json.dumps(measure(args.reps)))
        return 0
    import cupy
    import torch
    variants = {"default": ""}
    for item in filter(None, args.variants.split(";")):
        name, _, opts = item.partition("=")
        variants[name.strip()] = opts.strip()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cupy": cupy.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "reps": args.reps,
               "commit": os.environ.get("BITSPARSE_TREE") or subprocess.run(
                   ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                   text=True).stdout.strip(),
               "variants": {n: run_variant(n, o, args.reps) for n, o in variants.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (out / "fused.md").write_text(text)
    plot(summary, out / "fused.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
