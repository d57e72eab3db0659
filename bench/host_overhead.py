"""Host (CPU wall) time per call of every public bitsparse_core op, beside its GPU time.

    python3 bench/host_overhead.py [--backends cupy,numba] [--out bench/results]
                                   [--time-limit 240] [--modes torch,stream,callable]

Inputs are torch CUDA bf16 tensors handed to the ops directly (DLPack
producers), at sparsity 0.9: ``x = relu(a)`` with ``a = randn - 1.2816`` (so
~90 % of ``x`` is zero), a signed ``u`` for the gated ops, a dense ``g`` as
the gradient, ``y`` an empty output. K (the fixed capacity) is ``nnz(x)``,
counted once before timing. The ops, with their host-time targets:

    pack_fixed      pack(x, capacity=K, encoding="nosign")   <= 30 us
    pack_exact      pack(x)                                   (no target: it syncs)
    relu_pack       relu_pack(a, capacity=K)                  <= 30 us
    unpack_out      unpack(p, out=y)                          <= 20 us
    unpack          unpack(p)                                 <= 20 us
    relu_backward   relu_backward(g, p)                       <= 20 us
    relu2_backward  relu2_backward(g, p)                      <= 20 us
    masked_pack     masked_pack(u, p)                         <= 20 us
    gated_backward  gated_backward(g, p, masked_pack(u, p))   <= 20 us

``p`` is an exact ``pack(x, encoding="nosign")``, as the torch adapter saves it
(capacity == nnz, nnz known, no status word left to read).

Argument modes (``--modes``): ``torch`` passes no ``stream=`` / ``allocator=``
(on torch tensors the library then runs on torch's current stream with memory
from torch's caching allocator, as a torch user calls it: with the CuPy backend such
calls take the torch adapter's C++ host path, ``torch/native_codec.py``); ``stream``
passes ``stream=torch.cuda.current_stream().cuda_stream`` (read once) and no
allocator, the same stream and allocator on the backend's Python host path (what the
C++ path leaves to Python: the two, side by side in one run); ``callable`` passes
``stream=torch.cuda.current_stream().cuda_stream`` (read once, before timing)
and ``allocator=`` a Python function returning ``torch.empty(nbytes,
dtype=uint8)`` (what a caller wiring its own allocator pays). ``pack`` /
``relu_pack`` get ``backend=``; the other ops dispatch on the packed tensor,
which was made by that backend.

What is measured, and why
=========================

The question is how much CPU time one call costs, because in a training step
that cost is paid per layer and is not hidden when the GPU work is short.

* Small tensor (``--small``, default 1x4096): the GPU work is negligible, so
  the wall time of a tight loop is host time. ``host_us`` = wall time of a
  ``--iters`` (1000) call loop / iters, with no synchronization inside the
  loop (one ``torch.cuda.synchronize()`` before it), outputs collected in a
  list (so no call frees the previous call's memory) and dropped after the
  loop; garbage collection off during the loop. The loop runs ``--repeats``
  times, every op's loops in turns (a round runs one loop of each op), so a host whose
  speed drifts moves all ops alike; ``host_us`` is the median of the loop means,
  ``host_min_us`` the fastest (all kept in the JSON).
  The targets are checked against this number. ``wall_us`` adds the final
  sync to the loop (if it is far above ``host_us``, the GPU was the bound).
* Large tensors (``--large``, default 8192x16384 = 2^27 elements, the codec
  bench's size, and 8192x14336): ``wall_us`` = (loop of ``--large-iters``
  calls + one final sync) / iters = max(host, GPU) per call, outputs dropped
  each iteration (bounded memory); ``enqueue_us`` = the same loop's time
  before the sync / iters: host time, unless the GPU queue filled up and
  throttled the host (then it is an upper bound). ``gpu_us`` = mean over
  ``--gpu-reps`` (20) single calls bracketed by CUDA events on torch's current
  stream, each preceded by a ~1 ms sleep kernel so the call's host work is
  hidden and the events see GPU time only. An op that syncs inside (exact
  pack reads nnz back) has its host round trip inside its GPU interval.
* Small tensors get ``gpu_us`` too, to show it is negligible.

Every op is warmed up first (``--warmup`` calls, >= 20: kernel compilation,
allocator caches). One op raising is recorded as an error string and the run
goes on; past ``--time-limit`` seconds the remaining measurements are recorded
as skipped. Results: ``host_overhead.json`` (everything), ``.md`` (table),
``.png`` (host us per op, small vs large, targets as lines) in ``--out``.

Optional hook: torch custom ops
===============================

If the module ``bitsparse_core.torch.ops`` imports and has an attribute
``BENCH_CASES``, its cases are timed the same way (backend column
``torch.ops``, mode ``torch-ops``). Contract:

* ``BENCH_CASES`` is a callable ``(shape: tuple[int, ...], dtype: torch.dtype,
  device: torch.device) -> dict[str, Callable[[], Any]]``. It builds its own
  inputs for that shape (bf16, sparsity ~0.9 as above is the intent) and
  returns zero-argument callables, each one call of an op (e.g. of
  ``torch.ops.bitsparse.*``) on torch's current stream. Alternatively it may be
  a dict ``{name: factory}`` with ``factory(shape, dtype, device) -> callable``.
* The callables must be repeatable any number of times (no state that grows
  per call, no in-place change of their inputs that alters later calls), and
  return their outputs (the bench keeps or drops them as described above).
* A case's name ``"<op>"`` or ``"<op>/<variant>"``, where ``<op>`` is one of
  the keys above (e.g. ``"relu_pack/cupy"``), gets that op's target; other
  names are reported without one.
* It is called once per shape; an exception there, or in a case, is recorded
  and the run goes on.

Without CUDA the script says so and exits with status 2, writing nothing.
``--cpu-smoke`` runs the whole script on CPU tensors with the NumPy reference
backend (no stream / allocator, no GPU times) to check the script itself; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from plotting import pyplot

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (key, the call as written in the tables, host-time target in us or None)
OPS = (
    ("pack_fixed", 'pack(x, capacity=K, encoding="nosign")', 30.0),
    ("pack_exact", "pack(x)", None),
    ("relu_pack", "relu_pack(a, capacity=K)", 30.0),
    ("unpack_out", "unpack(p, out=y)", 20.0),
    ("unpack", "unpack(p)", 20.0),
    ("relu_backward", "relu_backward(g, p)", 20.0),
    ("relu2_backward", "relu2_backward(g, p)", 20.0),
    ("masked_pack", "masked_pack(u, p)", 20.0),
    ("gated_backward", "gated_backward(g, p, p_u)", 20.0),
)
# torch's own calls on the same small tensor, timed first and last: this host's speed
# (it drifts by tens of per cent within a device call) to read our times against.
REFERENCE_OPS = (("torch_add", "x + x (torch)"), ("torch_empty", "torch.empty_like(x)"))
# What x + x cost on the host the targets were set on (issue 14: "a torch x + x costs
# 10 us per call there"): a target scaled by this host's x + x over it is the same
# target at this host's speed.
TARGET_HOST_ADD_US = 10.0
REFERENCE_BACKEND = "torch"
TARGETS_US = {k: t for k, _, t in OPS}
LABELS = {k: lbl for k, lbl, _ in OPS} | dict(REFERENCE_OPS)
RELU_SHIFT = {0.9: 1.2815516}  # Phi^-1(sparsity): randn - shift is <= 0 with that probability
HOOK_MODULE = "bitsparse_core.torch.ops"
HOOK_BACKEND, HOOK_MODE = "torch.ops", "torch-ops"


# --------------------------------------------------------------------------- #
# Arguments and environment                                                   #
# --------------------------------------------------------------------------- #
def parse_shape(text: str) -> tuple:
    return tuple(int(v) for v in text.lower().split("x"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the method and the "
                                        "BENCH_CASES hook contract.")
    ap.add_argument("--backends", default="cupy,numba",
                    help="comma-separated (default: cupy,numba)")
    ap.add_argument("--modes", default="torch,stream,callable",
                    help="torch: no stream= / allocator= (torch's own, by default); stream: "
                         "torch's current stream named (the Python host path); callable: an "
                         "int stream and a Python allocator function (default: all three)")
    ap.add_argument("--small", default="1x4096", help="shape where GPU time is negligible")
    ap.add_argument("--large", default=None,
                    help="comma-separated shapes, '' for none (default: 8192x16384,8192x14336; "
                         "with --cpu-smoke: 16x4096)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--iters", type=int, default=1000, help="calls per small-tensor loop")
    ap.add_argument("--repeats", type=int, default=5, help="small-tensor loops (median reported)")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up calls per op (at least 20)")
    ap.add_argument("--large-iters", type=int, default=30, help="calls per large-tensor loop")
    ap.add_argument("--gpu-reps", type=int, default=20, help="CUDA-event timed calls per op")
    ap.add_argument("--sleep-cycles", type=int, default=2_000_000,
                    help="GPU sleep before each event-timed call (~1 ms on an H200)")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hook", action="store_true", help=f"skip {HOOK_MODULE}.BENCH_CASES")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check the script on CPU (NumPy backend, meaningless numbers)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    args = ap.parse_args(argv)
    args.warmup = max(args.warmup, 20)
    args.backends = [b for b in args.backends.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; use {', '.join(MODES)}")
    args.small = parse_shape(args.small)
    if args.large is None:
        args.large = "16x4096" if args.cpu_smoke else "8192x16384,8192x14336"
    args.large = [parse_shape(s) for s in args.large.split(",") if s]
    if args.cpu_smoke:
        args.backends, args.modes = ["numpy"], ["torch"]
    return args


def _version(modname: str):
    try:
        mod = __import__(modname)
        return getattr(mod, "__version__", "?")
    except Exception as exc:  # noqa: BLE001 -- absent or broken: both worth recording
        return f"not importable: {type(exc).__name__}"


def _git_commit():
    """The tree measured: ``BITSPARSE_TREE`` where the caller names it (a copy of a
    working tree, as the device machine gets, keeps an older HEAD), else HEAD, marked
    ``-dirty`` when tracked files differ from it."""
    named = os.environ.get("BITSPARSE_TREE")
    if named:
        return named

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        if head and git("status", "--porcelain", "--untracked-files=no"):
            head += "-dirty"
        return head or None
    except Exception:  # noqa: BLE001
        return None


def environment(torch, dev) -> dict:
    import bitsparse_core as bc
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": dev.name, "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "torch_cuda": getattr(torch.version, "cuda", None), "cupy": _version("cupy"),
            "numba": _version("numba"), "bitsparse_core": getattr(bc, "__version__", "?"),
            "git_commit": _git_commit()}
    if dev.cuda:
        info["torch_current_stream"] = int(torch.cuda.current_stream().cuda_stream)
        try:
            import cupy
            info["cupy_current_stream"] = int(cupy.cuda.get_current_stream().ptr)
        except Exception:  # noqa: BLE001
            pass
    return info


# --------------------------------------------------------------------------- #
# The device: synchronization and GPU timing (CPU stand-ins for --cpu-smoke)  #
# --------------------------------------------------------------------------- #
class Device:
    def __init__(self, torch, cpu_smoke: bool, sleep_cycles: int):
        self.torch = torch
        self.cuda = not cpu_smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.sleep_cycles = sleep_cycles
        self.sleep = getattr(torch.cuda, "_sleep", None) if self.cuda else None

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def gpu_times_us(self, fn, reps: int):
        """Per-call GPU time (us) of ``reps`` calls, each between two CUDA events on
        torch's current stream, after a sleep kernel that hides the call's host work."""
        if not self.cuda:
            return None
        torch = self.torch
        stream = torch.cuda.current_stream()
        pairs = []
        self.sync()
        for _ in range(reps):
            if self.sleep is not None and self.sleep_cycles > 0:
                self.sleep(self.sleep_cycles)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            out = fn()
            b.record(stream)
            del out
            pairs.append((a, b))
        self.sync()
        return [a.elapsed_time(b) * 1e3 for a, b in pairs]

    def release(self):
        """Give cached memory back between shapes (torch's and CuPy's pools)."""
        gc.collect()
        if not self.cuda:
            return
        self.torch.cuda.empty_cache()
        try:
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- #
# Inputs and the calls to time                                                #
# --------------------------------------------------------------------------- #
def make_inputs(torch, dev: Device, shape, sparsity: float, seed: int) -> dict:
    """bf16 a (pre-activation), x = relu(a), signed u, gradient g, output y; K = nnz(x)."""
    gen = torch.Generator(device=dev.device).manual_seed(seed)
    shift = RELU_SHIFT.get(sparsity)
    if shift is None:
        from statistics import NormalDist
        shift = NormalDist().inv_cdf(sparsity)
    bf16 = torch.bfloat16

    def randn():
        return torch.randn(shape, generator=gen, device=dev.device, dtype=torch.float32)

    a = (randn() - shift).to(bf16)
    x = torch.where(a > 0, a, torch.zeros((), dtype=bf16, device=dev.device))  # +0.0, never -0.0
    u = randn().to(bf16)
    g = randn().to(bf16)
    y = torch.empty_like(x)
    nnz = int(torch.count_nonzero(x.view(torch.int16)))
    dev.sync()
    return {"a": a, "x": x, "u": u, "g": g, "y": y, "K": nnz,
            "measured_sparsity": 1.0 - nnz / x.numel()}


MODES = ("torch", "stream", "callable")


def call_kwargs(torch, dev: Device, mode: str) -> dict:
    """``stream=`` (modes ``stream`` and ``callable``) and an ``allocator=`` function (mode
    ``callable``), or nothing."""
    if mode == "torch" or not dev.cuda:
        return {}
    stream = int(torch.cuda.current_stream().cuda_stream)
    if mode == "stream":
        return {"stream": stream}

    def allocator(nbytes, device=None, stream=None):
        d = dev.device if device is None else torch.device("cuda", int(device))
        return torch.empty((int(nbytes),), dtype=torch.uint8, device=d)

    return {"stream": stream, "allocator": allocator}


def _raiser(exc: BaseException):
    def fail():
        raise RuntimeError(f"setup failed: {exc!r}"[:300])
    return fail


def public_cases(bc, torch, dev: Device, inp: dict, backend: str, kw: dict):
    """``({op key: zero-arg callable}, setup record)`` for one backend and argument mode.

    Setup packs ``p`` (exact, nosign) and ``p_u = masked_pack(u, p)`` once and
    checks that ``unpack(p, out=y)`` gives ``x`` back bit for bit."""
    x, a, u, g, y, K = (inp[k] for k in ("x", "a", "u", "g", "y", "K"))
    setup = {}
    cases = {
        "pack_fixed": lambda: bc.pack(x, capacity=K, encoding="nosign", backend=backend, **kw),
        "pack_exact": lambda: bc.pack(x, backend=backend, **kw),
        "relu_pack": lambda: bc.relu_pack(a, capacity=K, backend=backend, **kw),
    }
    try:
        p = bc.pack(x, encoding="nosign", backend=backend, **kw)
        p_u = bc.masked_pack(u, p, **kw)
        bc.unpack(p, out=y, **kw)
        dev.sync()
        setup["roundtrip_ok"] = bool(torch.equal(y.view(torch.int16), x.view(torch.int16)))
        setup["p_nbytes"] = int(p.nbytes)
        setup["p_capacity"] = int(p.capacity)
    except Exception as exc:  # noqa: BLE001 -- recorded; the dependent ops report it
        setup["error"] = repr(exc)[:300]
        fail = _raiser(exc)
        cases.update({k: fail for k, _, _ in OPS if k not in cases})
        return cases, setup
    cases.update({
        "unpack_out": lambda: bc.unpack(p, out=y, **kw),
        "unpack": lambda: bc.unpack(p, **kw),
        "relu_backward": lambda: bc.relu_backward(g, p, **kw),
        "relu2_backward": lambda: bc.relu2_backward(g, p, **kw),
        "masked_pack": lambda: bc.masked_pack(u, p, **kw),
        "gated_backward": lambda: bc.gated_backward(g, p, p_u, **kw),
    })
    return cases, setup


def reference_cases(torch, inp: dict) -> dict:
    x = inp["x"]
    return {"torch_add": lambda: x + x, "torch_empty": lambda: torch.empty_like(x)}


def load_hook():
    """``(BENCH_CASES or None, note)`` from :data:`HOOK_MODULE`, if it is there."""
    import importlib
    try:
        mod = importlib.import_module(HOOK_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and HOOK_MODULE.startswith(exc.name):
            return None, f"{HOOK_MODULE} absent"
        return None, f"{HOOK_MODULE} failed to import: {exc!r}"[:300]
    except Exception as exc:  # noqa: BLE001
        return None, f"{HOOK_MODULE} failed to import: {exc!r}"[:300]
    hook = getattr(mod, "BENCH_CASES", None)
    if hook is None:
        return None, f"{HOOK_MODULE} has no BENCH_CASES"
    return hook, f"{HOOK_MODULE}.BENCH_CASES found"


def hook_cases(hook, torch, dev: Device, shape) -> dict:
    """The hook's ``{name: callable}`` for ``shape`` (see the module docstring)."""
    if callable(hook):
        cases = hook(tuple(shape), torch.bfloat16, dev.device)
    else:
        cases = {name: factory(tuple(shape), torch.bfloat16, dev.device)
                 for name, factory in dict(hook).items()}
    return {str(k): v for k, v in dict(cases).items()}


def target_for(name: str):
    return TARGETS_US.get(name.split("/")[0])


# --------------------------------------------------------------------------- #
# Timing                                                                      #
# --------------------------------------------------------------------------- #
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def timed_loop(fn, iters: int, sync, keep: bool):
    """``(enqueue_us, wall_us)`` per call of ``iters`` calls: the loop alone, and the loop
    plus one final sync. No sync inside; outputs kept in a list (``keep``) or dropped."""
    sync()
    held = [] if keep else None
    gc_on = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        if keep:
            for _ in range(iters):
                held.append(fn())
        else:
            for _ in range(iters):
                fn()
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
    finally:
        if gc_on:
            gc.enable()
    del held
    return (t1 - t0) / iters / 1e3, (t2 - t0) / iters / 1e3


def warm_up(fn, n: int, sync):
    for _ in range(n):
        fn()
    sync()


def _failed(exc, dev: Device) -> dict:
    try:
        dev.sync()
    except Exception:  # noqa: BLE001 -- a sticky CUDA error: the next ops will say so
        pass
    return {"error": repr(exc)[:300], "traceback": traceback.format_exc(limit=4)[-1500:]}


def measure_small_in_turns(fns, args, dev: Device, deadline: Deadline) -> list:
    """Host time per call of ops whose GPU work is negligible: ``--repeats`` loops of
    each, taken in turns (round ``r`` runs the ``r``-th loop of every op in order), so a
    host whose speed drifts during the run moves every op's loops alike and the ops
    stay comparable; then each op's GPU time. A record per op: an ``error`` where its
    warm-up or a loop raised, ``skipped`` where the time ran out before its first loop."""
    recs, live = [{} for _ in fns], []
    for i, fn in enumerate(fns):
        try:
            warm_up(fn, args.warmup, dev.sync)
            live.append(i)
        except Exception as exc:  # noqa: BLE001 -- one op failing must not stop the others
            recs[i] = _failed(exc, dev)
    loops = {i: [] for i in live}
    for _ in range(max(1, args.repeats)):
        if deadline.passed():
            break
        for i in [i for i in live if "error" not in recs[i]]:
            try:
                loops[i].append(timed_loop(fns[i], args.iters, dev.sync, keep=True))
            except Exception as exc:  # noqa: BLE001
                recs[i] = _failed(exc, dev)
    for i in live:
        if "error" in recs[i]:
            continue
        if not loops[i]:
            recs[i] = {"skipped": "time limit"}
            continue
        hosts = [h for h, _ in loops[i]]
        rec = {"host_us": statistics.median(hosts), "host_min_us": min(hosts),
               "host_loops_us": hosts, "wall_us": statistics.median(w for _, w in loops[i]),
               "iters": args.iters}
        try:
            rec.update(_gpu_stats(dev.gpu_times_us(fns[i], args.gpu_reps)))
        except Exception as exc:  # noqa: BLE001
            rec = _failed(exc, dev)
        recs[i] = rec
    return recs


def measure_large(fn, args, dev: Device) -> dict:
    """Wall per call (loop + one sync), the loop's enqueue time, and CUDA-event GPU time."""
    warm_up(fn, args.warmup, dev.sync)
    enqueue, wall = timed_loop(fn, args.large_iters, dev.sync, keep=False)
    rec = {"enqueue_us": enqueue, "wall_us": wall, "iters": args.large_iters}
    rec.update(_gpu_stats(dev.gpu_times_us(fn, args.gpu_reps)))
    return rec


def _gpu_stats(times):
    if not times:
        return {"gpu_us": None}
    return {"gpu_us": statistics.fmean(times), "gpu_median_us": statistics.median(times),
            "gpu_min_us": min(times), "gpu_reps": len(times)}


def measure_case(fn, args, dev: Device, deadline: Deadline) -> dict:
    """One op on a large tensor: its numbers, or ``error`` / ``skipped``; never raises."""
    if deadline.passed():
        return {"skipped": "time limit"}
    try:
        return measure_large(fn, args, dev)
    except Exception as exc:  # noqa: BLE001 -- one op failing must not stop the others
        return _failed(exc, dev)


# --------------------------------------------------------------------------- #
# The run                                                                     #
# --------------------------------------------------------------------------- #
def available_backends(bc, names):
    ok, missing = [], {}
    for name in names:
        try:
            if bc.backend_available(name):
                ok.append(name)
            else:
                missing[name] = "not available"
        except Exception as exc:  # noqa: BLE001
            missing[name] = repr(exc)[:200]
    return ok, missing


def shape_name(shape) -> str:
    return "x".join(str(s) for s in shape)


def _build(base, backend, mode, build, res) -> dict:
    """One group's ops by name (none where building them raised: the setup says why)."""
    try:
        cases, setup = build()
    except Exception as exc:  # noqa: BLE001
        cases, setup = {}, {"error": repr(exc)[:300]}
    res["setup"].append({**base, "backend": backend, "mode": mode, **setup})
    return cases


def _add_row(res, base, backend, mode, name, rec) -> None:
    res["rows"].append({**base, "op": name, "call": LABELS.get(name, name), "backend": backend,
                        "mode": mode, "target_us": target_for(name), **rec})
    print_row(res["rows"][-1])


def _run_small(groups, base, args, dev, deadline, res) -> None:
    """Every group's ops built first, their loops then taken in turns."""
    built = [(backend, mode, name, fn) for backend, mode, build in groups
             for name, fn in _build(base, backend, mode, build, res).items()]
    recs = measure_small_in_turns([fn for *_, fn in built], args, dev, deadline)
    for (backend, mode, name, _), rec in zip(built, recs):
        _add_row(res, base, backend, mode, name, rec)


def _run_large(groups, base, args, dev, deadline, res) -> None:
    """One group at a time (its outputs are large), each op measured on its own."""
    for backend, mode, build in groups:
        if deadline.passed():
            res["notes"].append(f"{shape_name(base['shape'])} {backend}/{mode} skipped: "
                                "time limit")
            continue
        cases = _build(base, backend, mode, build, res)
        for name, fn in cases.items():
            _add_row(res, base, backend, mode, name, measure_case(fn, args, dev, deadline))
        del cases


def run_shape(bc, torch, dev, shape, size, backends, hook, args, deadline, res):
    """Every (backend, mode, op) on one shape, appended to ``res['rows']``."""
    if deadline.passed():
        res["notes"].append(f"shape {shape_name(shape)} skipped: time limit")
        return
    try:
        inp = make_inputs(torch, dev, shape, args.sparsity, args.seed)
    except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: the other shapes still run
        res["notes"].append(f"shape {shape_name(shape)}: inputs failed: {exc!r}"[:300])
        return
    base = {"shape": list(shape), "numel": math.prod(shape), "size": size}
    res["inputs"].append({**base, "K": inp["K"], "measured_sparsity": inp["measured_sparsity"]})
    groups = []
    if size == "small":
        groups.append((REFERENCE_BACKEND, "first", lambda: (reference_cases(torch, inp), {})))
    for backend in backends:
        for mode in args.modes:
            groups.append((backend, mode, lambda b=backend, m=mode: public_cases(
                bc, torch, dev, inp, b, call_kwargs(torch, dev, m))))
    if hook is not None:
        groups.append((HOOK_BACKEND, HOOK_MODE, lambda: (hook_cases(hook, torch, dev, shape), {})))
    if size == "small":
        groups.append((REFERENCE_BACKEND, "last", lambda: (reference_cases(torch, inp), {})))
    (_run_small if size == "small" else _run_large)(groups, base, args, dev, deadline, res)
    del inp
    dev.release()


def run(args, torch, dev: Device) -> dict:
    import bitsparse_core as bc
    deadline = Deadline(args.time_limit)
    backends, missing = available_backends(bc, args.backends)
    hook, hook_note = (None, "skipped (--no-hook)") if args.no_hook else load_hook()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    res = {"meta": environment(torch, dev), "config": config, "targets_us": TARGETS_US,
           "backends": backends, "unavailable": missing, "hook": hook_note,
           "notes": [], "inputs": [], "setup": [], "rows": []}
    if args.cpu_smoke:
        res["notes"].append("--cpu-smoke: CPU tensors, NumPy backend; the numbers mean nothing")
    print(f"device {dev.name}; backends {backends or 'none'}"
          + (f" (unavailable: {missing})" if missing else "") + f"; hook: {hook_note}", flush=True)
    t0 = time.monotonic()
    try:
        run_shape(bc, torch, dev, args.small, "small", backends, hook, args, deadline, res)
        for shape in args.large:
            run_shape(bc, torch, dev, shape, "large", backends, hook, args, deadline, res)
    except KeyboardInterrupt:
        res["notes"].append("interrupted")
    res["elapsed_s"] = time.monotonic() - t0
    res["summary"] = summarize(res)
    return res


# --------------------------------------------------------------------------- #
# Targets and reports                                                         #
# --------------------------------------------------------------------------- #
def _f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def print_row(r):
    shape = shape_name(r["shape"])
    head = f"{r['backend']:9s} {r['mode']:9s} {shape:12s} {r['op']:16s}"
    if "error" in r or "skipped" in r:
        print(f"{head} {r.get('error') or r.get('skipped')}", flush=True)
    elif r["size"] == "small":
        print(f"{head} host {_f(r['host_us']):>8s} us  wall {_f(r['wall_us']):>8s} us  "
              f"gpu {_f(r['gpu_us']):>8s} us", flush=True)
    else:
        print(f"{head} enqueue {_f(r['enqueue_us']):>8s} us  wall {_f(r['wall_us']):>9s} us  "
              f"gpu {_f(r['gpu_us']):>9s} us", flush=True)


def met_state(row) -> str:
    if row is None:
        return "not run"
    if "error" in row:
        return "error"
    if "skipped" in row:
        return "skipped"
    if row.get("target_us") is None:
        return "no target"
    return "met" if row["host_us"] <= row["target_us"] else "not met"


def reference_add_us(res):
    """torch's ``x + x`` host time on the small tensor, the mean of its first and last
    measurement (None if neither ran)."""
    times = [r["host_us"] for r in res["rows"] if r["size"] == "small"
             and r["op"] == "torch_add" and r.get("host_us") is not None]
    return statistics.fmean(times) if times else None


def summarize(res) -> list:
    """One entry per (op, backend, mode): small-tensor host time against its target, and
    in units of torch's ``x + x`` on the same host."""
    out, add = [], reference_add_us(res)
    for r in res["rows"]:
        if r["size"] != "small":
            continue
        host, target = r.get("host_us"), r.get("target_us")
        scaled = target * add / TARGET_HOST_ADD_US if target is not None and add else None
        out.append({"op": r["op"], "backend": r["backend"], "mode": r["mode"],
                    "host_us": host, "target_us": target,
                    "in_adds": host / add if host is not None and add else None,
                    "state": met_state(r), "target_at_this_speed_us": scaled,
                    "state_at_this_speed": (None if scaled is None or host is None
                                            else "met" if host <= scaled else "not met")})
    return out


def print_targets(res):
    print("\nhost-time targets (small tensor, us per call):")
    for s in res["summary"]:
        tgt = "-" if s["target_us"] is None else f"<= {s['target_us']:.0f}"
        adds = "" if s.get("in_adds") is None else f"  ({s['in_adds']:.1f} x+x)"
        scaled = ("" if s.get("state_at_this_speed") is None else
                  f"; at this host's speed <= {s['target_at_this_speed_us']:.1f}: "
                  f"{s['state_at_this_speed']}")
        print(f"  {s['backend']:9s} {s['mode']:9s} {s['op']:16s} {_f(s['host_us']):>8s}  "
              f"{tgt:>6s}  {s['state']}{adds}{scaled}")
    counted = [s for s in res["summary"] if s["target_us"] is not None]
    met = sum(s["state"] == "met" for s in counted)
    print(f"  {met} of {len(counted)} targeted measurements met their target")
    fair = [s for s in counted if s.get("state_at_this_speed") is not None]
    if fair:
        print(f"  {sum(s['state_at_this_speed'] == 'met' for s in fair)} of {len(fair)} at this "
              f"host's speed (targets x {fair[0]['target_at_this_speed_us'] / fair[0]['target_us']:.2f})")


def _row_index(res):
    idx = {}
    for r in res["rows"]:
        idx[(r["op"], r["backend"], r["mode"], tuple(r["shape"]))] = r
    return idx


def _ordered_keys(res):
    """(op, backend, mode) in table order: OPS order, then hook cases; backend, mode."""
    seen = []
    for r in res["rows"]:
        k = (r["op"], r["backend"], r["mode"])
        if k not in seen:
            seen.append(k)
    rank = {k: i for i, (k, _, _) in enumerate(OPS)}
    return sorted(seen, key=lambda k: (k[1] == HOOK_BACKEND, rank.get(k[0], len(rank)),
                                       seen.index(k)))


def _cell(r, fields):
    if r is None:
        return "-"
    if "error" in r:
        return "error: " + r["error"][:60].replace("|", "/")
    if "skipped" in r:
        return r["skipped"]
    return " / ".join(_f(r.get(f)) for f in fields)


def _host_cell(r) -> str:
    """The median loop's host µs, the fastest loop's in brackets (where the run has it)."""
    cell = _cell(r, ["host_us"])
    if r is not None and r.get("host_min_us") is not None and "error" not in r:
        cell += f" ({_f(r['host_min_us'])})"
    return cell


def write_markdown(res, path: Path):
    meta, cfg = res["meta"], res["config"]
    small = tuple(cfg["small"])
    large = [tuple(s) for s in cfg["large"]]
    idx = _row_index(res)
    lines = [f"# Host overhead per call on {meta['device']}", "",
             f"{meta['date_utc']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}), "
             f"cupy {meta['cupy']}, numba {meta['numba']}, Python {meta['python']}, "
             f"commit {(meta.get('git_commit') or '?')[:12]}.", "",
             f"bf16 inputs at sparsity {cfg['sparsity']}; K = nnz(x); p = exact nosign pack. "
             f"Mode `torch`: no stream / allocator arguments (torch's current stream and caching "
             f"allocator, the library's defaults for torch data; on CuPy the torch adapter's C++ "
             f"host path); `stream`: torch's current stream named (the same stream and "
             f"allocator on the backend's Python host path); `callable`: an int stream and "
             f"a Python allocator function returning torch uint8 tensors.", "",
             f"* small [{shape_name(small)}]: host = wall of a {cfg['iters']}-call loop / "
             f"{cfg['iters']} (no sync inside, outputs kept), median of {cfg['repeats']} loops "
             f"taken in turns with every other op's (fastest in brackets); "
             f"GPU = CUDA events, mean of {cfg['gpu_reps']} calls. The targets are checked on "
             f"host.",
             f"* large: enqueue = {cfg['large_iters']}-call loop / {cfg['large_iters']} (host, "
             f"unless throttled by the GPU queue); wall = loop + one sync = max(host, GPU) per "
             f"call; GPU = CUDA events (host work hidden behind a sleep kernel), mean of "
             f"{cfg['gpu_reps']}.", ""]
    lines += ["Notes: " + "; ".join(res["notes"]), ""] if res["notes"] else []
    add = reference_add_us(res)
    if add:
        lines += [f"This host's speed: torch's `x + x` on the small tensor took {add:.1f} us "
                  f"per call (mean of the first and the last measurement of the run); "
                  f"\"in x+x\" is a call's host time in those units.", ""]
    head = (["op", "backend", "mode", f"small {shape_name(small)} host us", "in x+x",
             "small GPU us"]
            + [f"{shape_name(s)} enqueue / wall / GPU us" for s in large] + ["target us", "met"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, backend, mode in _ordered_keys(res):
        rs = idx.get((op, backend, mode, small))
        tgt = target_for(op)
        state = met_state(rs)
        in_adds = (f"{rs['host_us'] / add:.1f}" if add and rs is not None
                   and rs.get("host_us") is not None else "-")
        cells = [f"`{LABELS.get(op, op)}`", backend, mode, _host_cell(rs), in_adds,
                 _cell(rs, ["gpu_us"]) if rs is not None and "host_us" in rs else "-"]
        cells += [_cell(idx.get((op, backend, mode, s)), ["enqueue_us", "wall_us", "gpu_us"])
                  for s in large]
        cells += ["-" if tgt is None else f"{tgt:.0f}",
                  {"met": "yes", "not met": "**no**"}.get(state, state)]
        lines.append("| " + " | ".join(cells) + " |")
    counted = [s for s in res["summary"] if s["target_us"] is not None]
    lines += ["", f"{sum(s['state'] == 'met' for s in counted)} of {len(counted)} targeted "
                  f"measurements met their target (pack fixed / relu_pack <= 30 us, unpack and "
                  f"the fused ops <= 20 us host)."]
    fair = [s for s in counted if s.get("state_at_this_speed") is not None]
    if fair:
        k = fair[0]["target_at_this_speed_us"] / fair[0]["target_us"]
        lines += ["", f"At this host's speed (the targets were set where `x + x` took "
                      f"{TARGET_HOST_ADD_US:.0f} us; here the targets × {k:.2f}): "
                      f"{sum(s['state_at_this_speed'] == 'met' for s in fair)} of {len(fair)} "
                      f"met; not met: " + (", ".join(
                          f"{s['backend']}/{s['mode']} {s['op']}" for s in fair
                          if s["state_at_this_speed"] != "met") or "none") + "."]
    bad = [s for s in res["setup"] if "error" in s or s.get("roundtrip_ok") is False]
    for s in bad:
        lines.append(f"* setup {s['backend']}/{s['mode']} {shape_name(s['shape'])}: "
                     f"{s.get('error') or 'unpack(p) did not give x back'}")
    if res["unavailable"]:
        lines.append(f"* backends not available: {res['unavailable']}")
    lines.append(f"* hook: {res['hook']}")
    path.write_text("\n".join(lines) + "\n")


def plot(res, path: Path):
    """Host us per op (log scale): small host, large enqueue; targets as red lines."""
    plt = pyplot()
    if plt is None:
        return False
    import matplotlib.ticker
    cfg = res["config"]
    shapes = [("small", tuple(cfg["small"]), "host_us")] + [
        ("large", tuple(s), "enqueue_us") for s in cfg["large"]]
    idx = _row_index(res)
    mode = "torch" if "torch" in cfg["modes"] else cfg["modes"][0]
    groups = [(b, mode) for b in res["backends"]]
    if any(r["backend"] == HOOK_BACKEND for r in res["rows"]):
        groups.append((HOOK_BACKEND, HOOK_MODE))
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.2 * len(groups)), squeeze=False)
    width = 0.8 / len(shapes)
    for ax, (backend, m) in zip(axes[:, 0], groups):
        ops = [k[0] for k in _ordered_keys(res) if k[1] == backend and k[2] == m]
        for j, (size, shape, field) in enumerate(shapes):
            vals = []
            for op in ops:
                r = idx.get((op, backend, m, shape)) or {}
                v = r.get(field)
                vals.append(v if v is not None and v > 0 else float("nan"))
            xs = [i + (j - (len(shapes) - 1) / 2) * width for i in range(len(ops))]
            label = f"{shape_name(shape)} " + ("host" if size == "small" else "enqueue")
            ax.bar(xs, vals, width, label=label)
        labelled = False
        for i, op in enumerate(ops):
            tgt = target_for(op)
            if tgt is not None:
                ax.hlines(tgt, i - 0.45, i + 0.45, colors="red", linestyles="--", linewidth=1.2,
                          label=None if labelled else "target")
                labelled = True
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the legend
        ax.set_xticks(range(len(ops)), ops, fontsize=7, rotation=20)
        ax.set_ylabel("host us / call")
        ax.set_title(f"{backend} ({m})", fontsize=9)
        ax.legend(fontsize=7, ncol=len(shapes) + 1, loc="upper left")
    fig.suptitle(f"bitsparse_core host time per call, {res['meta']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_outputs(res, out_dir: Path, with_plot: bool):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host_overhead.json").write_text(json.dumps(res, indent=1, default=str))
    write_markdown(res, out_dir / "host_overhead.md")
    if with_plot:
        try:
            if plot(res, out_dir / "host_overhead.png"):
                return
        except Exception as exc:  # noqa: BLE001 -- the table and the JSON still stand
            print(f"plot failed: {exc!r}", file=sys.stderr)


# --------------------------------------------------------------------------- #
# Entry point                                                                 #
# --------------------------------------------------------------------------- #
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        print(f"host_overhead.py needs torch: {exc!r}. Nothing measured, nothing written.",
              file=sys.stderr)
        return 2
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"host_overhead.py needs a CUDA device: torch {torch.__version__} sees none "
              "(torch.cuda.is_available() is False). Nothing measured, nothing written. "
              "To check the script itself on CPU: --cpu-smoke.", file=sys.stderr)
        return 2
    dev = Device(torch, args.cpu_smoke, args.sleep_cycles)
    res = run(args, torch, dev)
    out = Path(args.out)
    write_outputs(res, out, not args.no_plot)
    print_targets(res)
    print(f"\nwrote {out / 'host_overhead.json'}, .md" + ("" if args.no_plot else ", .png")
          + f" in {res['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
