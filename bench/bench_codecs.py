"""Pack / unpack throughput on the GPU against the device's own copy bandwidth,
a naive PyTorch baseline and nvCOMP.

    python3 bench/bench_codecs.py [--backends cupy,numba] [--numel 134217728] [--reps 20]

For each backend, dtype (bf16, fp8 e4m3fn) and sparsity: ReLU-like data
(|N(0,1)| with exact zeros), encoding 'nosign'. Timed with CUDA events on one
torch stream; before each timed call the L2 is flushed (a 256 MiB read) and
the stream is held by a ~1 ms sleep kernel so that the call's host-side
overhead is hidden and the events bracket GPU time only (a call that syncs
internally, like exact packing, still pays its sync). Median of --reps.

Bytes moved = dense bytes + packed_size(shape, dtype, encoding, nnz) (the
format's size formula) for both directions; the fraction is against a large
device-to-device copy measured in the same run (read + write bytes).

Writes bench/results/codecs.json, codecs.md and codecs.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bitsparse_core as bc  # noqa: E402
from bitsparse_core.backends.cuda import abi  # noqa: E402
from bitsparse_core.spec import format as _fmt  # noqa: E402
from plotting import pyplot  # noqa: E402

NVCOMP_CODECS = ("ANS", "Cascaded", "Bitcomp", "Zstd")


class Timer:
    def __init__(self, torch, stream, reps, warmup=3):
        self.torch, self.stream, self.reps, self.warmup = torch, stream, reps, warmup
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        # ~1 ms of GPU sleep hides the Python launch overhead of the timed call.
        self.sleep_cycles = 2_000_000

    def __call__(self, fn, reps=None):
        torch = self.torch
        reps = reps or self.reps
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup):
                fn()
            pairs = []
            for _ in range(reps):
                self.flush.sum(dtype=torch.int32)      # evict L2 with clean lines (reads only)
                torch.cuda._sleep(self.sleep_cycles)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                fn()
                b.record(self.stream)
                pairs.append((a, b))
            self.stream.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in pairs)


def relu_like(torch, n, sparsity, tdtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g).abs_().clamp_(min=2.0 ** -6)
    x[torch.rand(n, device="cuda", generator=g) < sparsity] = 0
    return x.to(tdtype)


def copy_bandwidth(torch, timer):
    """(copy, write-only) bandwidth in bytes/s: a 1 GiB copy_ (read + write) and a
    1 GiB cudaMemsetAsync (torch's fill_ kernel writes ~25 % slower than the
    driver's memset on the H200, so it is no ceiling: bench/NOTES.md, session 5)."""
    from cupy.cuda import runtime
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    ms_fill = timer(lambda: runtime.memsetAsync(dst.data_ptr(), 7, dst.numel(),
                                                torch.cuda.current_stream().cuda_stream))
    return 2 * src.numel() / (ms * 1e-3), src.numel() / (ms_fill * 1e-3)


def torch_naive(torch, x, timer):
    shifts = torch.arange(8, device="cuda", dtype=torch.uint8)

    x = x.view(torch.int16 if x.element_size() == 2 else torch.uint8)   # bits (fp8 lacks ops)

    def pack():
        m = x != 0
        vals = torch.masked_select(x, m)
        bits = (m.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)
        return bits, vals

    bits, vals = pack()
    out = torch.empty_like(x)

    def unpack():
        m = ((bits.unsqueeze(1) >> shifts) & 1).bool().view(-1)
        out.zero_()
        out.masked_scatter_(m, vals)

    t_pack = timer(pack)
    t_unpack = timer(unpack)
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    return t_pack, t_unpack, bits.numel() + vals.numel() * x.element_size()


def nvcomp_runs(torch, x, timer, stream):
    try:
        from nvidia import nvcomp
    except Exception as exc:  # noqa: BLE001 -- a missing or broken wheel is a result to record
        return {"error": f"nvidia.nvcomp not importable: {exc!r}"}
    raw = x.view(torch.uint16 if x.element_size() == 2 else torch.uint8)
    typestr = "<u2" if x.element_size() == 2 else "|u1"
    out = {"version": getattr(nvcomp, "__version__", "?")}
    for name in NVCOMP_CODECS:
        opts = {"data_type": typestr} if name in ("Cascaded", "Bitcomp") else {}
        try:
            codec = nvcomp.Codec(algorithm=name, cuda_stream=stream.cuda_stream, device_id=0, **opts)
            arr = nvcomp.as_array(raw, cuda_stream=stream.cuda_stream)
            comp = codec.encode(arr)
            stream.synchronize()
            size = int(comp.buffer_size)
            cfg = codec.decompression_config(comp)
            dec = codec.decode(comp, decompression_config=cfg)
            stream.synchronize()
            try:
                back = torch.from_dlpack(dec).view(raw.dtype).reshape(raw.shape)
                ok = bool(torch.equal(back, raw))
            except Exception as exc:  # noqa: BLE001 -- record, keep timing
                ok = f"unchecked: {exc!r}"[:120]
            t_c = timer(lambda: codec.encode(arr), reps=max(5, timer.reps // 2))
            t_d = timer(lambda: codec.decode(comp, decompression_config=cfg), reps=max(5, timer.reps // 2))
            out[name] = {"compressed_bytes": size, "compress_ms": t_c, "decompress_ms": t_d,
                         "roundtrip_ok": ok}
        except Exception as exc:  # noqa: BLE001 -- one codec failing must not end the run
            out[name] = {"error": repr(exc)[:300]}
    return out


def run(args):
    import torch
    assert torch.cuda.is_available(), "needs a CUDA device"
    stream = torch.cuda.Stream()
    timer = Timer(torch, stream, args.reps)
    props = torch.cuda.get_device_properties(0)
    copy_bw, fill_bw = copy_bandwidth(torch, timer)
    print(f"device {props.name}, copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write), "
          f"fill {fill_bw / 1e9:.0f} GB/s", flush=True)
    res = {"device": props.name, "sm_count": props.multi_processor_count,
           "copy_bandwidth_Bps": copy_bw, "fill_bandwidth_Bps": fill_bw, "rounds": {"pack": abi.PACK_ROUNDS, "unpack": abi.UNPACK_ROUNDS, "fused": abi.FUSED_ROUNDS}, "numel": args.numel, "reps": args.reps,
           "encoding": "nosign", "python": platform.python_version(), "torch": torch.__version__,
           "rows": [], "baseline": [], "nvcomp": []}
    dtypes = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
    backends = [b for b in args.backends.split(",") if b]
    for bname in list(backends):
        if not bc.backend_available(bname):
            res.setdefault("unavailable", []).append(bname)
            backends.remove(bname)
    for dname in args.dtypes.split(","):
        for sp in [float(v) for v in args.sparsities.split(",")]:
            x = relu_like(torch, args.numel, sp, dtypes[dname], seed=int(sp * 1000))
            torch.cuda.synchronize()
            nnz = int(torch.count_nonzero(x.view(torch.uint8 if x.element_size() == 1 else torch.int16)))
            dense = x.numel() * x.element_size()
            formula = _fmt.packed_size(tuple(x.shape), dname, "nosign", nnz)
            moved = dense + formula
            for bname in backends:
                out = torch.empty_like(x)
                p = bc.pack(x, encoding="nosign", backend=bname, stream=stream)
                bc.unpack(p, out=out, stream=stream)
                stream.synchronize()
                assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), "round trip failed"
                assert p.nnz == nnz and p.nbytes == formula
                t_exact = timer(lambda: bc.pack(x, encoding="nosign", backend=bname, stream=stream))
                t_fixed = timer(lambda: bc.pack(x, encoding="nosign", capacity=nnz, backend=bname,
                                                stream=stream))
                t_unpack = timer(lambda: bc.unpack(p, out=out, stream=stream))
                # Host-side cost per call, pipelined (no sleep): what a tight loop sees.
                with torch.cuda.stream(stream):
                    stream.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        bc.pack(x, encoding="nosign", capacity=nnz, backend=bname, stream=stream)
                    stream.synchronize()
                    wall_fixed = (time.perf_counter() - t0) / args.reps * 1e3
                row = {"backend": bname, "dtype": dname, "sparsity": sp,
                       "measured_sparsity": 1 - nnz / x.numel(), "nnz": nnz,
                       "dense_bytes": dense, "packed_bytes": p.nbytes, "formula_bytes": formula,
                       "ratio": dense / formula, "bytes_moved": moved,
                       "pack_exact_ms": t_exact, "pack_fixed_ms": t_fixed, "unpack_ms": t_unpack,
                       "pack_fixed_wall_ms": wall_fixed}
                for k in ("pack_exact", "pack_fixed", "unpack"):
                    row[f"{k}_frac_copy"] = moved / (row[f"{k}_ms"] * 1e-3) / copy_bw
                    row[f"{k}_dense_GBps"] = dense / (row[f"{k}_ms"] * 1e-3) / 1e9
                if bname == "cupy" and args.rounds:
                    row["rounds_sweep"] = rounds_sweep(torch, x, nnz, out, timer, stream, args.rounds)
                res["rows"].append(row)
                print(f"{bname:6s} {dname:14s} s={sp:.2f} ratio={row['ratio']:.2f} "
                      f"pack exact {t_exact * 1e3:7.1f} us ({row['pack_exact_frac_copy']:.0%}) "
                      f"fixed {t_fixed * 1e3:7.1f} us ({row['pack_fixed_frac_copy']:.0%}) "
                      f"unpack {t_unpack * 1e3:7.1f} us ({row['unpack_frac_copy']:.0%}) "
                      f"wall/call {wall_fixed * 1e3:.0f} us", flush=True)
                del p, out
            tp, tu, tbytes = torch_naive(torch, x, timer)
            res["baseline"].append({"dtype": dname, "sparsity": sp, "pack_ms": tp, "unpack_ms": tu,
                                    "bytes": tbytes, "pack_dense_GBps": dense / tp / 1e6,
                                    "unpack_dense_GBps": dense / tu / 1e6})
            print(f"torch  {dname:14s} s={sp:.2f} pack {tp * 1e3:.0f} us unpack {tu * 1e3:.0f} us",
                  flush=True)
            if not args.no_nvcomp:
                nv = nvcomp_runs(torch, x, timer, stream)
                nv.update({"dtype": dname, "sparsity": sp, "dense_bytes": dense})
                res["nvcomp"].append(nv)
                print("nvcomp", dname, sp, {k: (v if not isinstance(v, dict) else
                                                {kk: (round(vv, 3) if isinstance(vv, float) else vv)
                                                 for kk, vv in v.items()})
                                            for k, v in nv.items() if k in NVCOMP_CODECS or k == "error"},
                      flush=True)
            del x
            torch.cuda.empty_cache()
    summarize(res)
    return res


def rounds_sweep(torch, x, nnz, out, timer, stream, spec):
    """Tile sizes are ABI constants now (bitsparse_core/backends/cuda/abi.py) that the
    host plans and the kernel build share; a sweep needs a variant record passed to
    both, which is not built yet."""
    raise SystemExit("--rounds sweeps are not available since the ABI refactor; edit "
                     "abi.PACK_ROUNDS / UNPACK_ROUNDS and rerun instead")


def summarize(res):
    """Ratios against nvCOMP's fastest codec and the target checks."""
    for row in res["rows"]:
        nv = next((n for n in res["nvcomp"] if n["dtype"] == row["dtype"]
                   and n["sparsity"] == row["sparsity"]), None)
        if not nv:
            continue
        ok = {k: v for k, v in nv.items() if isinstance(v, dict) and "compress_ms" in v}
        if ok:
            best_c = min(ok, key=lambda k: ok[k]["compress_ms"])
            best_d = min(ok, key=lambda k: ok[k]["decompress_ms"])
            row["nvcomp_fastest_compress"] = best_c
            row["nvcomp_fastest_decompress"] = best_d
            row["pack_vs_nvcomp"] = ok[best_c]["compress_ms"] / row["pack_exact_ms"]
            row["pack_fixed_vs_nvcomp"] = ok[best_c]["compress_ms"] / row["pack_fixed_ms"]
            row["unpack_vs_nvcomp"] = ok[best_d]["decompress_ms"] / row["unpack_ms"]


def _times(row, key):
    """A row's ratio to nvCOMP's fastest codec, or '-' where nvCOMP did not run."""
    v = row.get(key)
    return "-" if v is None or v != v else f"{v:.1f}"


def write_outputs(res, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "codecs.json").write_text(json.dumps(res, indent=1))
    bw = res["copy_bandwidth_Bps"] / 1e9
    lines = [f"# Codec throughput on {res['device']}", "",
             f"numel {res['numel']:,} per tensor, encoding nosign, median of {res['reps']} CUDA-event "
             f"timings (L2 flushed, launch overhead hidden). Device copy bandwidth measured in the "
             f"same run: **{bw:.0f} GB/s** (read + write; write-only fill: "
             f"{res.get('fill_bandwidth_Bps', 0) / 1e9:.0f} GB/s). Bytes moved = dense + packed_size(nnz). "
             f"Tile rounds (pack/unpack/fused): {res.get('rounds')}.",
             ""] + [n + "\n" for n in res.get("notes", [])] + [
             "| backend | dtype | sparsity | ratio | pack exact us | % copy | pack fixed us | % copy | "
             "unpack us | % copy | x nvCOMP pack (fixed) | x nvCOMP unpack |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['backend']} | {r['dtype']} | {r['sparsity']} | {r['ratio']:.2f} | "
            f"{r['pack_exact_ms'] * 1e3:.1f} | {r['pack_exact_frac_copy']:.0%} | "
            f"{r['pack_fixed_ms'] * 1e3:.1f} | {r['pack_fixed_frac_copy']:.0%} | "
            f"{r['unpack_ms'] * 1e3:.1f} | {r['unpack_frac_copy']:.0%} | "
            f"{_times(r, 'pack_vs_nvcomp')} ({_times(r, 'pack_fixed_vs_nvcomp')}) | "
            f"{_times(r, 'unpack_vs_nvcomp')} |")
    lines += ["", "Naive PyTorch baseline (x != 0, masked_select, bit packing by shifts; masked_scatter):", "",
              "| dtype | sparsity | pack us | unpack us |", "|---|---|---|---|"]
    for b in res["baseline"]:
        lines.append(f"| {b['dtype']} | {b['sparsity']} | {b['pack_ms'] * 1e3:.0f} | {b['unpack_ms'] * 1e3:.0f} |")
    if not res["nvcomp"]:
        lines += ["", "nvCOMP was not run (`--no-nvcomp`)."]
    else:
        lines += ["", "nvCOMP (same data; bf16 as uint16, fp8 as uint8; ratio = dense / compressed):", "",
                  "| dtype | sparsity | codec | ratio | compress us | decompress us |", "|---|---|---|---|---|---|"]
    for n in res["nvcomp"]:
        if "error" in n:
            lines.append(f"| {n['dtype']} | {n['sparsity']} | - | - | {n['error']} | |")
            continue
        for c in NVCOMP_CODECS:
            v = n.get(c, {})
            if "error" in v:
                lines.append(f"| {n['dtype']} | {n['sparsity']} | {c} | - | error: {v['error'][:80]} | |")
            elif v:
                lines.append(f"| {n['dtype']} | {n['sparsity']} | {c} | "
                             f"{n['dense_bytes'] / v['compressed_bytes']:.2f} | "
                             f"{v['compress_ms'] * 1e3:.0f} | {v['decompress_ms'] * 1e3:.0f} |")
    if res.get("unavailable"):
        lines += ["", f"Backends not available in this run: {', '.join(res['unavailable'])}."]
    (out_dir / "codecs.md").write_text("\n".join(lines) + "\n")
    try:
        plot(res, out_dir / "codecs.png")
    except Exception as exc:  # noqa: BLE001 -- the table and JSON still stand
        print("plot failed:", exc)


def plot(res, path):
    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['backend']}\n{r['dtype'].replace('float8_', '')}\ns={r['sparsity']}" for r in rows]
    xs = np.arange(len(rows))
    for i, (k, name) in enumerate((("pack_exact", "pack (exact)"), ("pack_fixed", "pack (fixed cap.)"),
                                   ("unpack", "unpack"))):
        axes[0].bar(xs + (i - 1) * 0.27, [100 * r[f"{k}_frac_copy"] for r in rows], 0.27, label=name)
    axes[0].axhline(80, color="k", ls="--", lw=0.8)
    axes[0].axhline(70, color="gray", ls=":", lw=0.8)
    axes[0].set_xticks(xs, labels, fontsize=7)
    axes[0].set_ylabel("% of measured copy bandwidth")
    axes[0].set_title(f"bytes moved / time vs copy ({res['copy_bandwidth_Bps'] / 1e9:.0f} GB/s)")
    axes[0].legend(fontsize=8)
    series = {"ours pack (fixed)": [r["pack_fixed_dense_GBps"] for r in rows],
              "ours unpack": [r["unpack_dense_GBps"] for r in rows]}
    base = {(b["dtype"], b["sparsity"]): b for b in res["baseline"]}
    series["torch naive pack"] = [base.get((r["dtype"], r["sparsity"]), {}).get("pack_dense_GBps", 0)
                                  for r in rows]
    best = []
    for r in rows:
        nv = next((n for n in res["nvcomp"] if n["dtype"] == r["dtype"] and n["sparsity"] == r["sparsity"]), {})
        ok = [v["compress_ms"] for v in nv.values() if isinstance(v, dict) and "compress_ms" in v]
        best.append(r["dense_bytes"] / min(ok) / 1e6 if ok else 0)
    series["nvCOMP fastest compress"] = best
    w = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        axes[1].bar(xs + (i - len(series) / 2 + 0.5) * w, vals, w, label=name)
    axes[1].set_yscale("log")
    axes[1].set_xticks(xs, labels, fontsize=7)
    axes[1].set_ylabel("dense GB/s")
    axes[1].set_title("throughput (uncompressed bytes / s)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cupy")
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--sparsities", default="0.5,0.9,0.95,0.99")
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-nvcomp", action="store_true")
    ap.add_argument("--rounds", default="", help="also time pack/unpack at these tile sizes, e.g. 2,4,8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    res = run(args)
    write_outputs(res, Path(args.out))
    print(open(os.path.join(args.out, "codecs.md")).read())


if __name__ == "__main__":
    main()
