"""What the CUDA driver's calls cost the host, beside the public ops that make them.

    python3 bench/driver_cost.py [--calls 200] [--repeats 15] [--backends cupy,numba]
                                 [--out bench/results]

bench/host_overhead.py says how long a public call takes; this says how much of it
is the driver's. Two parts, on a 1x4096 bf16 tensor (GPU work negligible), each a
tight loop timed as bench/host_overhead.py times its calls (no sync inside, results
kept, garbage collection off), median of ``--repeats`` loops, per call:

* the driver entry points the hot path uses, called through ctypes as
  ``backends/cuda/driver.py`` calls them: ``cuLaunchKernel`` of an empty kernel, of
  one with 24 u64 parameters and of the unpack kernel with its argument record; the
  empty kernel on two blocks per SM by ``cuLaunchKernel`` and by
  ``cuLaunchCooperativeKernel`` (what the pack's cooperative launch adds); the first
  launch through ``ctypes.PyDLL`` (the GIL kept, to see whether releasing it
  costs); CuPy's own launch of the empty kernel; ``cuMemsetD8Async`` (a pack's
  scratch); ``cuStreamQuery`` and ``cuCtxGetCurrent`` (a call's floor through ctypes);
  the relu² pack's fill and cooperative launch with its record, at 1x4096 and at the
  gpt12 layer's 8192x4096; empty kernels of 16, 128 and 256 u64 parameters launched
  with a pointer per parameter and with one parameter buffer (``extra``, as the Numba
  backend launches); with ``numba`` among ``--backends``, the Numba backend's own
  recorded launches (the ones its unpack and gated ops made) by either route (a Numba
  kernel's parameter list runs to 600-1100 bytes, CuPy's records to 56-184);
  torch's ``x + x`` and ``empty_like`` as the host's speed;
* every public op (each backend of ``--backends``, torch data, bench/host_overhead.py's
  cases) as it is, and again with the driver's queueing calls (launch, cooperative launch, memset,
  copy) replaced by no-ops: the difference is what those calls cost inside the op,
  the rest is Python. (The exact pack waits for a count the stub never writes: left
  out of the second column.)

Writes ``driver_cost.json`` / ``.md`` / ``.png`` under ``--out``. Without CUDA it
says so and exits with status 2, writing nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import host_overhead as ho  # noqa: E402
from plotting import pyplot, save  # noqa: E402


def per_call_us(fn, calls: int, repeats: int, sync) -> list:
    """Host µs per call of ``fn`` in ``repeats`` loops of ``calls`` after a warm-up, timed
    by bench/host_overhead.py's loop (results kept, garbage collection off, loops short
    enough that the GPU's queue never fills and throttles the host)."""
    ho.warm_up(fn, calls, sync)
    return [ho.timed_loop(fn, calls, sync, keep=True)[0] for _ in range(repeats)]


def driver_calls(torch, cupy, stream: int) -> dict:
    """``{name: zero-argument callable}`` of the driver calls measured."""
    import bitsparse_core as bc
    from bitsparse_core.backends.cuda import abi, driver, host
    from bitsparse_core.backends.cupy.backend import planes_of

    x = torch.randn(1, 4096, device="cuda").bfloat16()
    x[x < 1.2] = 0
    out = torch.empty_like(x)
    p = bc.pack(x)
    lay, planes = p.layout, planes_of(p)
    host.enqueue_unpack(lay, planes, abi.Op.UNPACK, 0, stream, out.data_ptr())   # makes the launch
    unpack = host._unpack_launch(lay, abi.Op.UNPACK, 0, 0)   # its record holds that call's
    lib = driver.lib()
    launch = lib.cuLaunchKernel
    pylib = ctypes.PyDLL("libcuda.so.1")
    pylaunch = pylib.cuLaunchKernel
    pylaunch.argtypes = launch.argtypes

    empty = cupy.RawKernel(r'extern "C" __global__ void k0() {}', "k0")
    empty.compile()
    k24 = cupy.RawKernel('extern "C" __global__ void k24('
                         + ", ".join(f"unsigned long long a{i}" for i in range(24)) + ") {}", "k24")
    k24.compile()
    f0, f24 = int(empty.kernel.ptr), int(k24.kernel.ptr)
    no_params = (ctypes.c_void_p * 1)()
    vals = (ctypes.c_uint64 * 24)()
    p24 = (ctypes.c_void_p * 24)(*[ctypes.addressof(vals) + 8 * i for i in range(24)])
    uf, grid, uptrs = unpack.func, unpack.n_tiles, unpack.args.pointers
    coop = lib.cuLaunchCooperativeKernel
    wide = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count   # resident
    ptr, ctx = out.data_ptr(), ctypes.c_void_p()
    keep = [x, out, p, empty, k24, vals, p24, no_params, pylib]   # alive while timed
    packs = {}
    for shape in PACK_SHAPES:       # the relu² pack's cooperative launch, with its fill
        try:
            packs[shape] = _relu2_pack_launch(torch, lib, shape, stream, keep)
        except Exception as exc:  # noqa: BLE001 -- the other rows still measure
            print(f"relu² pack {shape}: left out: {exc!r}", file=sys.stderr)
    return {
        **_param_size_launches(cupy, lib, stream, keep),
        "torch x + x": lambda: x + x,
        "torch.empty_like": lambda: torch.empty_like(x),
        "cuLaunchKernel, empty kernel": lambda: launch(f0, 1, 1, 1, 32, 1, 1, 0, stream,
                                                       no_params, None),
        "cuLaunchKernel, 24 u64 parameters": lambda: launch(f24, 1, 1, 1, 32, 1, 1, 0, stream,
                                                            p24, None),
        "cuLaunchKernel, the unpack kernel": lambda: launch(uf, grid, 1, 1, abi.THREADS, 1, 1, 0,
                                                            stream, uptrs, None),
        # what the pack's cooperative launch costs the host over an ordinary one, at a
        # grid of two blocks per SM (every block resident, as the pack's is)
        f"cuLaunchKernel, empty kernel, {wide} blocks": lambda: launch(
            f0, wide, 1, 1, 32, 1, 1, 0, stream, no_params, None),
        f"cuLaunchCooperativeKernel, empty kernel, {wide} blocks": lambda: coop(
            f0, wide, 1, 1, 32, 1, 1, 0, stream, no_params),
        "cuLaunchKernel through PyDLL, empty kernel": lambda: pylaunch(
            f0, 1, 1, 1, 32, 1, 1, 0, stream, no_params, None),
        "CuPy's launch, empty kernel": lambda: empty((1,), (32,), ()),
        "cuMemsetD8Async, 64 bytes": lambda: lib.cuMemsetD8Async(ptr, 0, 64, stream),
        "cuStreamQuery": lambda: lib.cuStreamQuery(stream),
        "cuCtxGetCurrent": lambda: lib.cuCtxGetCurrent(ctypes.byref(ctx)),
        **{f"cuMemsetD8Async + cuLaunchCooperativeKernel, relu² pack {s[0]}x{s[1]}": fn
           for s, fn in packs.items()},
    }, keep


PARAM_U64S = (16, 128, 256)


def _param_size_launches(cupy, lib, stream: int, keep: list) -> dict:
    """Empty kernels of ``PARAM_U64S`` u64 parameters, each launched with a pointer per
    parameter and with one parameter buffer: what a parameter list's length costs the
    driver by either route."""
    from bitsparse_core.backends.cuda import driver
    calls = {}
    for n in PARAM_U64S:
        k = cupy.RawKernel(f'extern "C" __global__ void k{n}('
                           + ", ".join(f"unsigned long long a{i}" for i in range(n)) + ") {}",
                           f"k{n}")
        k.compile()
        vals = (ctypes.c_uint64 * n)()
        ptrs = (ctypes.c_void_p * n)(*[ctypes.addressof(vals) + 8 * i for i in range(n)])
        extra, size = driver.param_buffer(vals, 8 * n)
        f = int(k.kernel.ptr)
        keep += [k, vals, ptrs, extra, size]
        calls[f"cuLaunchKernel, {n} u64 parameters, a pointer each"] = (
            lambda f=f, p=ptrs: lib.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, p, None))
        calls[f"cuLaunchKernel, {n} u64 parameters, one buffer"] = (
            lambda f=f, e=extra: lib.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, None, e))
    return calls


def numba_launches(torch, stream: int, keep: list) -> dict:
    """The Numba backend's recorded launches of its unpack and gated ops (1x4096 bf16),
    each by its parameter buffer and by a pointer per parameter, with no Python around
    them: whether a Numba kernel's long parameter list is what its ops' driver share
    pays for."""
    import bitsparse_core as bc
    from bitsparse_core.backends.cuda import driver
    from bitsparse_core.backends.numba import backend as nb
    from bitsparse_core.backends.numba.launch import BoundLaunch
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    x[x < 1.2] = 0
    u, g = torch.randn_like(x), torch.randn_like(x)
    p = bc.pack(x, backend="numba", encoding="nosign")
    pu = bc.masked_pack(u, p)
    for _ in range(3):              # the second call of a key binds its record
        keep += [bc.unpack(p), bc.gated_backward(g, p, pu)]
    keep += [x, u, g, p, pu]
    calls = {}
    for b in (v for _, v in nb._OP_LAUNCHES._entries().values() if type(v) is BoundLaunch):
        rec = b.record
        what = f"Numba launch, {len(rec.fields)} parameters ({rec._extra_size.value} bytes)"
        calls[f"{what}, one buffer"] = (
            lambda r=rec, b=b: r.launch(b.grid, b.block, stream))
        calls[f"{what}, a pointer each"] = (
            lambda r=rec, b=b: driver.launch(r.func, b.grid, b.block, 0, stream, r))
    return calls


# relu_pack's shapes: host_overhead.py's small tensor and the gpt12 layer's activation
PACK_SHAPES = ((1, 4096), (8192, 4096))


def _relu2_pack_launch(torch, lib, shape, stream: int, keep: list):
    """A zero-argument call queueing the relu² pack of a ``shape`` bf16 tensor as the
    library does after its Python (the scratch's fill, then the cooperative launch), with
    the record of one real call; its buffers are appended to ``keep``."""
    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import abi, host
    from bitsparse_core.spec.format import DEFAULT_CHUNK_LOG2, Encoding
    a = torch.randn(shape, device="cuda").bfloat16()
    plan = host.pack_plan(shape, D.BFLOAT16, Encoding.NOSIGN, a.numel() // 2, DEFAULT_CHUNK_LOG2,
                          abi.Mode.RELU2)
    y, block = torch.empty_like(a), torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device="cuda")
    host.enqueue_pack(plan, a.get_device(), stream, a.data_ptr(), block.data_ptr(),
                      scratch.data_ptr(), y=y.data_ptr())
    L = host._pack_launch(plan, a.get_device())
    keep += [a, y, block, scratch, L]
    sp, sn, ptrs, smem = scratch.data_ptr(), plan.scratch_bytes, L.args.pointers, plan.smem

    def call():
        lib.cuMemsetD8Async(sp, 0, sn, stream)
        lib.cuLaunchCooperativeKernel(L.pack, L.grid, 1, 1, abi.THREADS, 1, 1, smem, stream, ptrs)
    return call


class _NoQueueing:
    """The driver's queueing calls as no-ops, for the ``with`` block. Every launch
    entry is among them: one left real would launch a kernel whose scratch the no-op
    memset left unzeroed (Numba's ``launch_packed`` did: an illegal address)."""

    NAMES = ("launch", "launch_packed", "launch_cooperative", "memset0", "copy")

    def __enter__(self):
        from bitsparse_core.backends.cuda import driver
        self.driver = driver
        self.saved = {n: getattr(driver, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(driver, n, lambda *a: None)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(self.driver, n, f)


def public_ops(torch, dev, args, sync, backend: str) -> dict:
    """``{op: {"real": [...], "no_queueing": [...]}}`` host µs per call of ``backend``'s
    ops on ``dev`` (a bench/host_overhead.py Device)."""
    import bitsparse_core as bc
    inp = ho.make_inputs(torch, dev, (1, 4096), 0.9, 0)
    cases, _ = ho.public_cases(bc, torch, dev, inp, backend, ho.call_kwargs(torch, dev, "torch"))
    res = {k: {"real": per_call_us(fn, args.calls, args.repeats, sync)} for k, fn in cases.items()}
    with _NoQueueing():
        for k, fn in cases.items():
            if k != "pack_exact":
                res[k]["no_queueing"] = per_call_us(fn, args.calls, args.repeats, sync)
    return res


def markdown(summary: dict) -> str:
    """The tables; per call the median and the fastest of the loops. The driver's share
    is taken from the fastest loops: this host's speed drifts within a run (a loop can
    take twice another's), and the fastest loop of each column is its steady state."""
    med = statistics.median
    env = summary["environment"]
    lines = [f"# Host cost of the CUDA driver's calls ({env['device']})", "",
             f"{env['date_utc']}; torch {env['torch']}, cupy {env['cupy']}, commit "
             f"{env['git_commit']}. Per call, loops of {summary['calls']} calls on a "
             f"1x4096 bf16 tensor, {summary['repeats']} loops: their median and the fastest "
             "(every loop in the JSON).", "",
             "| call | host µs, median | fastest |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {med(v):.2f} | {min(v):.2f} |"
              for name, v in summary["driver"].items()]
    lines += ["", "Public ops (torch data): as they are, and with the driver's "
              "queueing calls (launch, cooperative launch, memset, copy) made no-ops; the "
              "driver's share is the difference of the two columns' fastest loops.", "",
              "| backend | op | host µs, median / fastest | without queueing, median / fastest | "
              "the driver's share |",
              "| --- | --- | ---: | ---: | ---: |"]
    for backend, ops in summary["ops"].items():
        for op, v in ops.items():
            real = f"{med(v['real']):.1f} / {min(v['real']):.1f}"
            if "no_queueing" in v:
                rest = f"{med(v['no_queueing']):.1f} / {min(v['no_queueing']):.1f}"
                share = f"{min(v['real']) - min(v['no_queueing']):.1f}"
            else:
                rest = share = "-"
            lines.append(f"| {backend} | `{op}` | {real} | {rest} | {share} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [(f"{b} {op}", v) for b, ops in summary["ops"].items() for op, v in ops.items()
            if "no_queueing" in v]
    ops = [name for name, _ in rows]
    rest = [min(v["no_queueing"]) for _, v in rows]
    drv = [min(v["real"]) - r for (_, v), r in zip(rows, rest)]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * len(rows)))
    ax.barh(ops, rest, label="Python and the rest")
    ax.barh(ops, drv, left=rest, label="driver queueing calls")
    ax.set_xlabel("host µs per call (fastest loop)")
    ax.legend()
    save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--backends", default="cupy",
                    help="comma-separated backends whose public ops are measured")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("driver_cost: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    import cupy
    sync = torch.cuda.synchronize
    stream = torch.cuda.current_stream().cuda_stream
    calls, keep = driver_calls(torch, cupy, stream)
    if "numba" in args.backends.split(","):
        calls.update(numba_launches(torch, stream, keep))
    driver = {name: per_call_us(fn, args.calls, args.repeats, sync) for name, fn in calls.items()}
    dev = ho.Device(torch, cpu_smoke=False, sleep_cycles=0)
    ops = {b: public_ops(torch, dev, args, sync, b) for b in args.backends.split(",")}
    driver["torch x + x, at the end"] = per_call_us(calls["torch x + x"], args.calls,
                                                    args.repeats, sync)
    del keep
    summary = {"environment": ho.environment(torch, dev), "calls": args.calls,
               "repeats": args.repeats, "driver": driver, "ops": ops}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver_cost.json").write_text(json.dumps(summary, indent=1))
    (out / "driver_cost.md").write_text(markdown(summary))
    plot(summary, out / "driver_cost.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
