"""``bitsparse demo``: pack ReLU-like tensors, check the round trip, show sizes and speed.

On a machine with a CUDA GPU and a GPU backend (CuPy, else Numba) it runs there;
otherwise on the CPU reference codec. Where PyTorch is installed it ends with a
short training comparison: a ReLU² FFN stack trained dense and with packed
activations (peak memory, step time, identical losses).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

from . import dtypes as _dt
from .spec import format as _fmt
from .backends import select_backend
from .errors import BitsparseError

SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.99)
DTYPES = (_dt.BFLOAT16, _dt.FLOAT16, _dt.FLOAT32, _dt.FLOAT8_E4M3FN, _dt.FLOAT8_E5M2)


def relu_like(rng, n: int, sparsity: float, dtype: _dt.DType) -> np.ndarray:
    """ReLU output bits: |N(0,1)| values, a ``sparsity`` fraction of exact zeros, and
    every kept value nonzero (tiny magnitudes that round to zero are bumped to 1 ulp)."""
    x = np.abs(rng.standard_normal(n, dtype=np.float32)).astype(dtype.numpy)
    bits = x.view(dtype.uint)
    keep = rng.random(n) >= sparsity
    bits[~keep] = 0
    bits[keep & (bits == 0)] = 1
    return x


def pick_backend() -> str:
    """The backend ``pack(..., backend="auto")`` would take for a CUDA tensor, else numpy."""
    try:
        return select_backend("auto", "cuda").name
    except BitsparseError:
        return "numpy"


class _Device:
    """Moves test data to where the backend runs and times it honestly."""

    def __init__(self, backend: str):
        self.gpu = backend != "numpy"
        if self.gpu:
            import cupy
            self.cp = cupy

    def put(self, host: np.ndarray):
        # CuPy has no bf16/fp8 arrays: move the bits, pack(dtype=...) names the type.
        return self.cp.asarray(host.view(f"u{host.dtype.itemsize}")) if self.gpu else host

    def get(self, arr, dtype: _dt.DType) -> np.ndarray:
        if self.gpu:
            return self.cp.asnumpy(self.cp.asarray(arr).view(dtype.uint))
        return np.asarray(arr).view(dtype.uint)

    def sync(self):
        if self.gpu:
            self.cp.cuda.Device().synchronize()

    def timed(self, fn, repeats: int):
        fn()  # warm-up: compilation and allocation stay out of the numbers
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times)


def codec_table(numel: int, seed: int = 0, *, dtypes=DTYPES, sparsities=SPARSITIES,
                backend: str = "auto", encoding: str = "nosign", repeats: int | None = None,
                progress: bool = True) -> tuple:
    """Pack one ReLU-like tensor per (dtype, sparsity); ``(backend, rows)``."""
    import bitsparse_core as bc

    backend = pick_backend() if backend == "auto" else backend
    dev = _Device(backend)
    repeats = repeats or (10 if dev.gpu else 1)
    rng = np.random.default_rng(seed)
    rows = []
    cases = [(_dt.resolve(d), s) for d in dtypes for s in sparsities]
    for dtype, s in tqdm(cases, desc=f"packing on {backend}", unit="case", file=sys.stderr,
                         disable=None if progress else True):
        host = relu_like(rng, numel, s, dtype)
        x = dev.put(host)
        p, t_pack = dev.timed(lambda: bc.pack(x, encoding=encoding, backend=backend,
                                              dtype=dtype), repeats)
        y, t_unpack = dev.timed(lambda: bc.unpack(p), repeats)
        exact = np.array_equal(dev.get(y, dtype), host.view(dtype.uint))
        formula = _fmt.packed_size(host.shape, dtype, p.encoding, p.nnz)
        dense = host.nbytes
        rows.append(dict(dtype=dtype.name, sparsity=s, encoding=p.encoding.name.lower(),
                         nnz=p.nnz, dense=dense, packed=p.nbytes, formula=formula,
                         ratio=p.ratio, pack_gbs=(dense + p.nbytes) / t_pack / 1e9,
                         unpack_gbs=(dense + p.nbytes) / t_unpack / 1e9, exact=exact))
    return backend, rows


def codec_ok(rows: list) -> bool:
    """Every round trip bit-exact and every size equal to the format's formula."""
    return all(r["packed"] == r["formula"] and r["exact"] for r in rows)


def print_codec_table(backend: str, numel: int, rows: list) -> bool:
    encodings = ", ".join(sorted({r.get("encoding", "nosign") for r in rows}))
    print(f"\nbackend: {backend}   tensor of {numel:,} elements, encoding {encodings}, "
          "throughput = (dense + packed bytes) / median time")
    head = (f"{'dtype':<14}{'sparsity':>9}{'nnz':>11}{'packed B':>12}{'formula B':>12}"
            f"{'ratio':>7}{'pack GB/s':>11}{'unpack GB/s':>12}{'exact':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['dtype']:<14}{r['sparsity']:>9.2f}{r['nnz']:>11,}{r['packed']:>12,}"
              f"{r['formula']:>12,}{r['ratio']:>7.2f}{r['pack_gbs']:>11.1f}"
              f"{r['unpack_gbs']:>12.1f}{'yes' if r['exact'] else 'NO':>7}")
    ok = codec_ok(rows)
    print("all round trips bit-exact, all sizes equal to the format's formula" if ok
          else "MISMATCH: see the rows above")
    return ok


def training_comparison(steps: int | None = None, threads: int | None = 1):
    """Dense vs packed ReLU² FFN training: ``(result, None)``, or ``(None, why skipped)``.

    On the CPU the model is tiny, and torch's default of one intra-op thread per
    core makes its step time swing by two orders of magnitude on a busy machine
    (threads spinning against each other and against other processes); the
    comparison runs with ``threads`` intra-op threads (None or 0: torch's
    default) and reports the minimum and median step time.
    """
    try:
        import torch
        from .torch import demo_training
    except ImportError as exc:
        return None, str(exc)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device.type == "cpu"
    previous = torch.get_num_threads()
    if cpu and threads:
        torch.set_num_threads(threads)
    try:
        res = demo_training.run(device, steps=steps or (12 if cpu else 6))
        res["threads"] = torch.get_num_threads() if cpu else None
    finally:
        torch.set_num_threads(previous)
    return summarize_training(res), None


def summarize_training(res: dict) -> dict:
    """``demo_training.run``'s result with each variant's row as a dict (times in ms)."""
    dense = res["rows"]["dense"][0]
    rows = {name: dict(peak_mib=peak, median_ms=1e3 * median, min_ms=1e3 * min(times),
                       final_loss=losses[-1], losses_equal_dense=losses == dense, losses=losses)
            for name, (losses, median, peak, times) in res["rows"].items()}
    return {**res, "rows": rows}


def print_training(res: dict) -> bool:
    threads = f", {res['threads']} CPU thread(s)" if res.get("threads") else ""
    print(f"\ntraining comparison on {res['device']}: {res['layers']}-layer ReLU² FFN stack, "
          f"d={res['d']}, f={res['f']}, {res['tokens']} tokens, {res['dtype']}, "
          f"{res['steps']} AdamW steps (step times after the first){threads}")
    head = (f"{'variant':<18}{'peak MiB':>10}{'min ms':>9}{'median ms':>11}{'final loss':>13}"
            f"{'losses = dense':>16}")
    print(head)
    print("-" * len(head))
    for name, r in res["rows"].items():
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "n/a"
        print(f"{name:<18}{peak:>10}{r['min_ms']:>9.1f}{r['median_ms']:>11.1f}"
              f"{r['final_loss']:>13.6f}{'yes' if r['losses_equal_dense'] else 'NO':>16}")
    return training_ok(res)


def training_ok(res) -> bool:
    return res is None or all(r["losses_equal_dense"] for r in res["rows"].values())


def default_numel(backend: str = "auto") -> int:
    backend = pick_backend() if backend == "auto" else backend
    return 1 << 24 if backend != "numpy" else 1 << 20
