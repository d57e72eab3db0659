"""The GPU backends' host code timed on a machine without a GPU.

    python3 bench/host_standin.py [--backends cupy,numba] [--repeats 7] [--calls 2000]
                                  [--variant numba:field=value ...] [--profile OP]
                                  [--out DIR]

Issue 14's host-time targets are met or missed by a few microseconds of Python per
op, and the sessions without a device machine had no way to see those microseconds.
This runs each backend's public ops on the CPU with everything below their Python
replaced by stand-ins that cost (almost) nothing:

* the CUDA driver: a shared library built here with the C compiler (``libcuda.so.1``
  by its soname, loaded before anything asks for it, so ``backends/cuda/driver.py``
  loads it as it would the real one and every ctypes call keeps its real cost); its
  entry points return at once, counting the calls (pinned host memory is ``malloc``);
* torch CUDA tensors: CPU tensors of a subclass that answers ``is_cuda`` and
  ``get_device()`` as a tensor on cuda:0 does (so the package's own import path runs);
  torch's current stream is a fixed handle, its caching allocator a ring over one CPU
  tensor (no kernel touches the memory);
* kernel handles: fake ``CUfunction`` values (CuPy's compile and Numba's dispatcher
  never run); a Numba kernel's parameter record is laid out from the argument types
  its dispatcher would infer (arrays 1-D C, Python ints int64, bools boolean).

So the time per call is the backends' Python, ctypes' argument conversion and the
torch calls they make; the driver's own share (about 5 µs a launch on the H200's host,
``results/driver_cost.md``) and the GPU are left out, and so is the cost of the real
allocator. Read the figures as a ratio between backends or between two trees on this
machine, not as the device's host time (read against session 35's device figures,
the H200's host ran CuPy's Python 1.4-1.7 x slower: bench/NOTES.md, session 42). Shapes, sparsity and ``p`` follow ``host_overhead.py`` (1x4096
bf16, 90 % zeros, ``p`` an exact nosign pack, here made at capacity nnz with its
count set, since no kernel writes it).

Per op and backend: the fastest of ``--repeats`` loops of ``--calls`` calls (µs per
call), driver calls per op by kind, and the parameter bytes the op's launches pass. The
backend ``c++`` is the public ops' C++ path for torch tensors (``torch/native_codec.py``)
on the CuPy backend's kernels, run as :func:`cxx_path` runs the FFN op's.
``--profile OP`` prints a cProfile of that op's loop per backend instead; ``--micro`` adds
what the path's building blocks cost here (a ctypes write, a launch, a Python call: a
slow host slows all of them, a slow path only its own); ``--module`` adds
the packed ReLU² FFN module against dense, forward and backward, on the torch adapter's
C++ path (its kernels and driver calls the stand-in's); ``--hf`` a tiny transformers
OPT, plain and converted (issue 16's ``bench_hf.py`` model), the same way; ``--compiled
LAYERS`` a stack of LAYERS ReLU² MLP blocks under ``torch.compile``, dense and packed, with
the packed step's extra host time by function (issue 15's compiled gap on the host).
``--variant numba:FIELD=VALUE`` builds the Numba backend with a ``PackVariant`` field
changed. The C++ path's rows allocate CPU tensors where the device would take its
caching allocator's blocks; under glibc's ``malloc`` those allocations cost microseconds
that vary with the heap (``malloc_consolidate``, ``memalign``), so run them with a
caching ``malloc`` preloaded where one is at hand (``LD_PRELOAD=.../libjemalloc.so.2``);
the header names the ``malloc`` the run had. Writes ``host_standin.json`` / ``.md``
under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import host_overhead as ho  # noqa: E402  (its loop times these calls too)

OPS = ("pack_fixed", "relu_pack", "masked_pack", "unpack_out", "unpack", "relu_backward",
       "relu2_backward", "gated_backward")
COUNTERS = ("launch", "coop", "memset", "copy", "query", "other")

# The driver entry points the package calls (backends/cuda/driver.py, slots.py,
# numba/launch.py), each returning CUDA_SUCCESS; ``standin_counts`` reads the counters.
_FAKE_DRIVER = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define PACK_TAG 0x40000000u
static long counts[6];
static int slot_index = -1;
#define COUNT(k) (counts[k]++, 0)
/* A pack kernel (its handle tagged by PACK_TAG) "finishes" at once: a clean status and
   no nonzeros in the pinned slot its record names, as the real kernel's last tile writes. */
static void pack_done(void* f, void** params) {
  if (slot_index >= 0 && ((uintptr_t)f & PACK_TAG) && params) {
    uint64_t slot = *(uint64_t*)params[slot_index];
    if (slot) { *(uint32_t*)slot = 0; *(uint64_t*)(slot + 8) = 0; }
  }
}
void standin_slot_index(int i) { slot_index = i; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void* s, void** params, void** extra)
{ pack_done(f, params); return COUNT(0); }
int cuLaunchCooperativeKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned smem, void* s, void** params)
{ pack_done(f, params); return COUNT(1); }
int cuMemsetD8Async(uint64_t p, unsigned char v, size_t n, void* s) { return COUNT(2); }
int cuMemcpyAsync(uint64_t d, uint64_t src, size_t n, void* s) { return COUNT(3); }
int cuMemcpyDtoHAsync_v2(void* d, uint64_t src, size_t n, void* s) { return COUNT(3); }
int cuStreamQuery(void* s) { return COUNT(4); }
int cuStreamSynchronize(void* s) { return COUNT(5); }
int cuCtxGetCurrent(void** c) { *c = (void*)0x1; return COUNT(5); }
int cuCtxGetDevice(int* d) { *d = 0; return COUNT(5); }
int cuEventCreate(void** e, unsigned flags) { *e = (void*)0x2; return COUNT(5); }
int cuEventRecord(void* e, void* s) { return COUNT(5); }
int cuEventDestroy_v2(void* e) { return COUNT(5); }
int cuStreamWaitEvent(void* s, void* e, unsigned flags) { return COUNT(5); }
int cuMemAllocHost_v2(void** p, size_t n) {
  *p = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
  memset(*p, 0, n);
  return 0;
}
int cuGetErrorName(int rc, const char** name) { *name = "STANDIN_ERROR"; return 0; }
int cuDeviceGetAttribute(int* v, int attr, int dev) { *v = 132; return 0; }
int cuFuncSetAttribute(void* f, int attr, int v) { return 0; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void* f, int block, size_t smem)
{ *n = 2; return 0; }
int cuKernelGetFunction(void** f, void* k) { *f = k; return 0; }
void standin_counts(long* out) { memcpy(out, counts, sizeof counts); }
"""

STREAM = 0x5EED    # torch's "current stream" here: any nonzero handle
ARENA_BYTES = 1 << 28
PACK_TAG = 0x4000_0000    # set in the fake handles of pack kernels (their slot is written)


def build_fake_driver(directory: Path) -> ctypes.CDLL:
    """Compile the stand-in driver and load it under libcuda's soname, so that a later
    ``ctypes.CDLL("libcuda.so.1")`` gets this one."""
    src, lib = directory / "fake_cuda.c", directory / "libcuda.so.1"
    src.write_text(_FAKE_DRIVER.replace("PACK_TAG 0x40000000u", f"PACK_TAG {PACK_TAG:#x}u"))
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(src)], check=True)
    return ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def counts(fake) -> list:
    out = (ctypes.c_long * len(COUNTERS))()
    fake.standin_counts(out)
    return list(out)


def fake_kernel_handles():
    """A stand-in for ``host.kernel``: a handle per kernel key, a pack's tagged."""
    handles: dict = {}

    def kernel(device, *key):
        tag = PACK_TAG if key[0] == "pack" else 0
        return handles.setdefault(key, tag | (0x10000 + 16 * len(handles)))
    return kernel


def watch_pack_slots(fake) -> None:
    """Have the stand-in's pack launches write their slot (the record's ``slot`` field)."""
    from bitsparse_core.backends.cuda import abi
    fake.standin_slot_index([n for n, _ in abi.PackArgs._fields_].index("slot"))


def install(torch):
    """Answer what the package asks of CUDA, torch's CUDA side and the kernels' compilers
    (see the module docstring)."""
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.backends.cuda import interop as ci
    from bitsparse_core.backends.numba import backend as nb
    from bitsparse_core.backends.numba import launch as L

    arena = torch.empty((ARENA_BYTES,), dtype=torch.uint8)
    base, at = arena.data_ptr(), [0]

    def torch_buffer(nbytes, device, stream):
        # a ring over one CPU tensor: no kernel ever touches it, and a real allocator's
        # cost (page faults of ever-new memory here) would be the stand-in's, not ours
        if nbytes == 0:
            return ci.DeviceBuffer(0, 0, device, None)
        if at[0] + nbytes > ARENA_BYTES:
            at[0] = 0
        ptr, at[0] = base + at[0], at[0] + (nbytes + 511) // 512 * 512
        return ci.DeviceBuffer(ptr, nbytes, device, arena)

    def torch_tensor_buffer(nbytes, device, stream):
        return torch_buffer(nbytes, device, stream)

    ci.torch_stream = lambda device: STREAM
    ci.torch_buffer = torch_buffer
    ci.torch_tensor_buffer = torch_tensor_buffer
    host.kernel = fake_kernel_handles()
    host.driver.resident_blocks = lambda *a: 264
    host.driver.sm_count = lambda device: 132

    class _Kernel:        # what HandleLaunch reads of a compiled Numba kernel
        def __init__(self, argument_types):
            self.argument_types = argument_types
            self.cooperative = False

    def numba_type(arg):
        from numba.core import types
        from numba.np.numpy_support import from_dtype
        if type(arg) is L.KernelArray:
            return types.Array(from_dtype(arg.dtype), 1, "C")
        if isinstance(arg, bool):
            return types.boolean
        return types.int64

    def first_launch(dispatcher, grid, block, numba_stream, args, numba_args):
        launch = L.HandleLaunch(_Kernel([numba_type(a) for a in args]), args)
        launch(grid, block, 0, args)
        return launch

    L._function_handle = lambda kernel: 0x20000 + 16 * (id(kernel) % 4096)
    L.first_launch = nb.first_launch = first_launch
    original_init = L.HandleLaunch.__init__

    def handle_init(self, kernel, args):
        # what the driver says of a compiled kernel's parameters: NVVM's layout of them
        from numba.core import types
        sizes = []
        for ty in kernel.argument_types:
            if isinstance(ty, types.Array):
                sizes += [8] * 7
            else:
                sizes.append(1 if isinstance(ty, types.Boolean) else ty.bitwidth // 8)
        layout, end = [], 0
        for size in sizes:                  # each at the next multiple of its size
            end = -(-end // size) * size
            layout.append((end, size))
            end += size
        L._param_layout = lambda func: layout
        original_init(self, kernel, args)
    L.HandleLaunch.__init__ = handle_init

    class _Stream:
        handle = STREAM

    plat = nb._GpuPlatform()
    plat.cuda = type("cuda", (), {"external_stream": staticmethod(lambda h: _Stream()),
                                  "default_stream": staticmethod(lambda: _Stream())})
    plat._device_array = lambda a: a      # only the dispatcher's first launch makes these
    nb._PLATFORM = plat
    nb.NumbaBackend.is_available = lambda self: True
    from bitsparse_core.backends.cupy import backend as cb
    cb.CupyBackend.is_available = lambda self: True


def as_cuda(torch, t):
    """A CPU tensor that says it lives on cuda:0 (``is_cuda``, ``get_device``), with no
    ``__torch_function__`` cost; its data pointer is the CPU tensor's."""
    global _CudaLooking
    if _CudaLooking is None:
        class _CudaLooking(torch.Tensor):
            __torch_function__ = torch._C._disabled_torch_function_impl
            is_cuda, is_cpu = True, False

            def get_device(self):
                return 0
    return torch.Tensor._make_subclass(_CudaLooking, t)


_CudaLooking = None


def make_inputs(torch, shape, seed=0) -> dict:
    """host_overhead.py's inputs (sparsity 0.9), on the CPU, looking like CUDA tensors."""
    g = torch.Generator().manual_seed(seed)

    def randn():
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    a = (randn().float() - 1.2815516).to(torch.bfloat16)
    x = torch.relu(a)
    inp = {"a": a, "x": x, "u": randn(), "g": randn(), "y": torch.empty_like(x)}
    inp = {k: as_cuda(torch, v) for k, v in inp.items()}
    inp["K"] = int((x != 0).sum())
    return inp


def cases(bc, inp: dict, backend: str) -> dict:
    """The ops of host_overhead.py's public cases (torch mode), on stand-in memory."""
    x, a, u, g, y, K = (inp[k] for k in ("x", "a", "u", "g", "y", "K"))
    p = bc.pack(x, capacity=K, encoding="nosign", backend=backend)
    p._nnz, p.status = K, None     # as an exact pack's: its count known, no status left
    p_u = bc.masked_pack(u, p)
    return {
        "pack_fixed": lambda: bc.pack(x, capacity=K, encoding="nosign", backend=backend),
        "relu_pack": lambda: bc.relu_pack(a, capacity=K, backend=backend),
        "masked_pack": lambda: bc.masked_pack(u, p),
        "unpack_out": lambda: bc.unpack(p, out=y),
        "unpack": lambda: bc.unpack(p),
        "relu_backward": lambda: bc.relu_backward(g, p),
        "relu2_backward": lambda: bc.relu2_backward(g, p),
        "gated_backward": lambda: bc.gated_backward(g, p, p_u),
    }


NATIVE = "c++"     # the --backends name of the public ops' C++ path (torch/native_codec.py)


def native_cases(bc, torch, inp: dict) -> dict:
    """:func:`cases` through the public ops' C++ path: plain CPU tensors, which the path
    takes under :func:`cxx_path` (its allocations the CPU allocator's, its launches the
    stand-in driver's); ``bitsparse_core`` sends them there while :func:`native_calls`."""
    plain = {k: v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v
             for k, v in inp.items()}
    with native_calls(bc, NATIVE):
        return cases(bc, plain, "cupy")


@contextlib.contextmanager
def native_calls(bc, backend: str):
    """Within this block the public ops send calls to their C++ path if ``backend`` is
    :data:`NATIVE`, else to none (the backends' Python paths)."""
    from bitsparse_core.torch import native_codec
    bc._native_tried = True          # no attaching behind the bench's back
    prev, bc._native_codec = bc._native_codec, (native_codec._NativeCodec if backend == NATIVE
                                                 else None)
    try:
        yield
    finally:
        bc._native_codec = prev


def loop_us(fn, calls: int) -> float:
    """µs per call of a loop of ``calls`` calls, outputs kept (host_overhead.py's loop)."""
    return ho.timed_loop(fn, calls, lambda: None, keep=True)[0]


def param_bytes(fn) -> int:
    """Bytes of parameters the launches of one call pass (Numba: its records' fields;
    CuPy: its abi records), read from the records the call fills."""
    from bitsparse_core.backends.numba import launch as L
    seen = []
    original = L.HandleLaunch.launch

    def spy(self, grid, block, stream):
        seen.append(sum(ctypes.sizeof(f) for f in self.fields))
        original(self, grid, block, stream)
    from bitsparse_core.backends.cuda import driver
    d_launch, d_coop = driver.launch, driver.launch_cooperative

    def abi_spy(orig):
        def f(func, grid, block, smem, stream, args):
            if not isinstance(args, L.HandleLaunch):
                seen.append(ctypes.sizeof(args))
            return orig(func, grid, block, smem, stream, args)
        return f
    L.HandleLaunch.launch = spy
    driver.launch, driver.launch_cooperative = abi_spy(d_launch), abi_spy(d_coop)
    try:
        fn()
    finally:
        L.HandleLaunch.launch = original
        driver.launch, driver.launch_cooperative = d_launch, d_coop
    return sum(seen)


@contextlib.contextmanager
def cxx_path(torch, fake):
    """The torch adapter's C++ path on the stand-in (``native.emulate_on_host`` with the
    stand-in's entry points: CPU tensors take it, its kernels and driver calls do
    nothing; a pack writes its slot clean, so a backward takes the clean branch)."""
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import native
    watch_pack_slots(fake)
    host.kernel = fake_kernel_handles()
    C.claim_slot = C.SLAB.acquire          # no CUDA graph capture to ask about
    native._handles.clear()
    host._RECORDS.__dict__.clear()
    entry = [ctypes.cast(getattr(fake, n), ctypes.c_void_p).value
             for n in ("cuLaunchKernel", "cuLaunchCooperativeKernel", "cuMemsetD8Async",
                       "cuMemcpyDtoHAsync_v2", "cuGetErrorName")]
    with native.emulate_on_host(entry):
        yield


def fastest_in_turns(fns: dict, repeats: int, calls: int) -> dict:
    """µs per call of each of ``fns``: the fastest of ``repeats`` loops, taken in turns."""
    for fn in fns.values():
        loop_us(fn, 200)
    loops = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            loops[k].append(loop_us(fn, calls))
    return {k: min(v) for k, v in loops.items()}


def _forward_backward_rows(fastest: dict, names) -> list:
    rows = []
    for name in names:
        f, t = fastest[(name, "forward")], fastest[(name, "train")]
        rows.append({"variant": name, "forward_us": f, "backward_us": t - f, "train_us": t})
    return rows


def _forward_backward_table(title: str, rows) -> list:
    """Markdown lines of :func:`_forward_backward_rows`' rows under ``title``."""
    return (["", f"{title}, µs per call:", "",
             "| variant | forward | backward | forward + backward |", "|---|---|---|---|"]
            + [f"| {r['variant']} | {r['forward_us']:.2f} | {r['backward_us']:.2f} | "
               f"{r['train_us']:.2f} |" for r in rows])


def module_rows(torch, fake, repeats: int, calls: int, dims=(4, 16, 64)) -> list:
    """Forward, and forward plus backward, of the GPT bench's dense ReLU² MLP and of its
    ``PackedReLU2FFN`` on the torch adapter's C++ path (:func:`cxx_path`), at sizes where
    the CPU's GEMMs cost about a microsecond: µs per call, fastest of ``repeats`` loops.
    The C++ node's kernels do nothing, so the packed backward's GEMMs read whatever
    memory the CPU allocator gives: only tiny sizes keep that from showing."""
    import bitsparse_core.torch as bst
    tokens, d, ff = dims
    from module_host import DenseReLU2FFN
    torch.manual_seed(0)
    dense = DenseReLU2FFN(d, ff).to(torch.bfloat16)
    with cxx_path(torch, fake):
        x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, d, dtype=torch.bfloat16)
        fns, packed = {}, []
        for use in ("forward", "train"):   # a module of its own per loop, as in hf_rows
            m = copy.deepcopy(dense)
            packed.append(bst.PackedReLU2FFN.from_dense(m.fc1, m.fc2, encoding="nosign"))
            for name, mod in (("dense", m), ("packed-nosign", packed[-1])):
                fns[(name, use)] = ((lambda mod=mod: mod(x)) if use == "forward" else
                                    (lambda mod=mod: mod(x).backward(g)))
        fastest = fastest_in_turns(fns, repeats, calls)
        if any(p.stats()["recomputes"] for p in packed):
            raise RuntimeError("the packed backward recomputed: the stand-in's slot did not land")
    return _forward_backward_rows(fastest, ("dense", "packed-nosign"))


def hf_rows(torch, fake, repeats: int, calls: int, dims=(2, 16, 64, 8)) -> list:
    """bench_hf.py's model at a tiny size (``transformers.OPTForCausalLM`` from a config:
    ReLU FFN, SDPA, bf16; ``dims`` = layers, d, d_ff, tokens), plain and converted
    (``bitsparse_core.torch.convert``), forward and forward plus backward of the sum of
    the logits on the C++ path (:func:`cxx_path`): what conversion adds to a step's host
    time, µs per call, fastest of ``repeats`` loops taken in turns."""
    import bitsparse_core.torch as bst
    from transformers import OPTConfig, OPTForCausalLM
    layers, d, ff, seq = dims
    cfg = OPTConfig(vocab_size=64, hidden_size=d, word_embed_proj_dim=d, num_hidden_layers=layers,
                    ffn_dim=ff, num_attention_heads=2, max_position_embeddings=seq,
                    activation_function="relu", dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, layerdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = OPTForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, seq))
    with cxx_path(torch, fake):
        # a model of its own for each loop: a model that trains in turns with its forward
        # loop makes that forward ~5 % slower on this CPU (bench/NOTES.md, session 44)
        models = {}
        for name, use in itertools.product(("plain", "converted"), ("forward", "train")):
            m = models[(name, use)] = copy.deepcopy(plain)
            if name == "converted":
                report = bst.convert(m)
                if len(report.replaced) != layers:
                    raise RuntimeError(f"convert() replaced {len(report.replaced)} of {layers} "
                                       f"layers: {report}")
        fns = {}
        for (name, use), m in models.items():
            fns[(name, use)] = ((lambda m=m: m(input_ids=ids, use_cache=False).logits)
                                if use == "forward" else
                                (lambda m=m: m(input_ids=ids, use_cache=False).logits.float()
                                 .sum().backward()))
        fastest = fastest_in_turns(fns, repeats, calls)
        from bitsparse_core.torch.convert import packed_modules
        if any(p.stats()["recomputes"] for use in ("forward", "train")
               for p in packed_modules(models[("converted", use)]).values()):
            raise RuntimeError("a converted backward recomputed: the stand-in's slot did not land")
    return _forward_backward_rows(fastest, ("plain", "converted"))


def _residual_stack(torch, mlps):
    """Residual blocks ``x + mlp(x)``, one per MLP: the GPT bench's MLPs without attention."""
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlps = torch.nn.ModuleList(mlps)

        def forward(self, x):
            for mlp in self.mlps:
                x = x + mlp(x)
            return x
    return Stack()


def _tottime_by_function(fn, calls: int) -> dict:
    """cProfile's own time (µs per call of ``fn``) and calls per call, by function; the
    modules inductor writes are one entry, ``inductor's generated code``. Read from the
    profiler's raw entries: pstats keys C functions by how they print, and every op of a
    ``torch.ops`` namespace prints as ``torch._ops.<namespace>.``, so it keeps one of them;
    here they add up into that one row."""
    import cProfile
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    out: dict = {}
    for e in pr.getstats():
        code = e.code
        if isinstance(code, str):
            key = code
        elif "torchinductor" in code.co_filename:
            key = "inductor's generated code"
        else:
            key = f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"
        us, n = out.get(key, (0.0, 0.0))
        out[key] = (us + e.inlinetime / calls * 1e6, n + e.callcount / calls)
    return out


def compiled_rows(torch, fake, repeats: int, calls: int, layers: int = 12,
                  dims=(4, 16, 64), top: int = 25, fixed_density: float | None = None) -> dict:
    """Issue 15's compiled gap on the host: a ``layers``-block residual stack of the GPT
    bench's ReLU² MLP, dense and with ``PackedReLU2FFN`` (nosign), each under
    ``torch.compile`` (inductor, which on the CPU needs a C++ compiler), on the C++ path
    (:func:`cxx_path`): forward and forward plus backward µs per step (fastest of
    ``repeats`` loops in turns), and what the packed step, and its forward alone, spend
    more than dense's, by function (cProfile's own time, the ``top`` largest differences):
    the ops' C++ halves, dynamo's guards (booked to the module call that enters the frame),
    the size reads of the capacities' stand-ins, inductor's size asserts and the capacity
    polls. ``fixed_density``: a third variant, packed at that fixed density (no capacity
    symbol in its graphs), to read the adaptive capacity's share of the gap."""
    import bitsparse_core.torch as bst
    from module_host import DenseReLU2FFN
    tokens, d, ff = dims
    torch.manual_seed(0)
    dense = _residual_stack(torch, [DenseReLU2FFN(d, ff) for _ in range(layers)]).to(
        torch.bfloat16)
    with cxx_path(torch, fake):
        x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, d, dtype=torch.bfloat16)
        fns, packed = {}, []
        for use in ("forward", "train"):   # a model of its own per loop, as in hf_rows
            m, p = copy.deepcopy(dense), copy.deepcopy(dense)
            p.mlps = torch.nn.ModuleList(
                bst.PackedReLU2FFN.from_dense(b.fc1, b.fc2, encoding="nosign") for b in p.mlps)
            packed.append(p)
            variants = [("dense", m), ("packed-nosign", p)]
            if fixed_density is not None:
                f = copy.deepcopy(dense)
                f.mlps = torch.nn.ModuleList(
                    bst.PackedReLU2FFN.from_dense(b.fc1, b.fc2, encoding="nosign",
                                                  density=fixed_density) for b in f.mlps)
                packed.append(f)
                variants.append(("packed-fixed", f))
            for name, mod in variants:
                call = torch.compile(mod, fullgraph=True)
                fns[(name, use)] = ((lambda c=call: c(x)) if use == "forward" else
                                    (lambda c=call: c(x).backward(g)))
        fastest = fastest_in_turns(fns, repeats, calls)
        by_function = {key: _tottime_by_function(fn, calls) for key, fn in fns.items()}
        if any(b.stats()["recomputes"] for p in packed for b in p.mlps):
            raise RuntimeError("the packed backward recomputed: the stand-in's slot did not land")
    out = {"layers": layers, "dims": list(dims),
           "fixed_density": fixed_density,
           "rows": _forward_backward_rows(fastest, ("dense", "packed-nosign")
                                          + (("packed-fixed",) if fixed_density is not None
                                             else ()))}
    # the forward alone too: where the backward is GPU-paced, only the forward's host time
    # (and what runs before the first kernel) shows in the step
    for use, name in (("train", "by_function"), ("forward", "by_function_forward")):
        a, b = by_function[("dense", use)], by_function[("packed-nosign", use)]
        zero = (0.0, 0.0)
        diff = sorted(({"function": k, "us": b.get(k, zero)[0] - a.get(k, zero)[0],
                        "dense_calls": a.get(k, zero)[1], "packed_calls": b.get(k, zero)[1]}
                       for k in set(a) | set(b)), key=lambda r: -abs(r["us"]))
        out[name] = diff[:top]
        out[f"{name}_total_us"] = (sum(v[0] for v in b.values())
                                   - sum(v[0] for v in a.values()))
    return out


def _compiled_tables(res: dict) -> list:
    tokens, d, ff = res["dims"]
    lines = _forward_backward_table(
        f"A {res['layers']}-block residual stack of the ReLU² MLP under torch.compile "
        f"(inductor), dense and packed, on the torch adapter's C++ path ({tokens} tokens, "
        f"d {d}, d_ff {ff}, bf16)", res["rows"])
    for name, what in (("by_function", "step (forward + backward)"),
                       ("by_function_forward", "forward alone")):
        lines += ["", f"Where the compiled packed {what} spends more host time than dense's: "
                  "cProfile's own time by function, µs per step (all functions: "
                  f"{res[name + '_total_us']:+.0f} µs under the profiler, which inflates rows "
                  "of many small Python calls):", "",
                  "| function | packed − dense µs | calls dense / packed |", "|---|---|---|"]
        lines += [f"| `{r['function']}` | {r['us']:+.1f} | {r['dense_calls']:.1f} / "
                  f"{r['packed_calls']:.1f} |" for r in res[name]]
    return lines


def micro_rows(torch, calls: int) -> list:
    """What the hot path's building blocks cost on this machine, µs per call (the fastest
    of 5 timeit loops): to tell a slow host (every block slower) from a slow path."""
    import threading
    import timeit

    from bitsparse_core.backends.cuda import driver
    from bitsparse_core.backends.numba import backend as nb
    value, local = ctypes.c_uint64(), threading.local()
    local.x = 1
    lib = driver.lib()
    bound = next((v.pack for _, v in nb._PACK_LAUNCHES._entries().values()
                  if type(v) is nb._PackLaunches), None)
    addresses = [0x10000 * i for i in range(8)]
    blocks = {
        "a Python call": lambda: len(addresses),
        "a ctypes c_uint64 .value write": lambda: setattr(value, "value", 123456789),
        "a threading.local read": lambda: local.x,
        "driver.current_device() (cuCtxGetDevice through ctypes)": driver.current_device,
        "lib.cuStreamQuery (a ctypes call of one argument)": lambda: lib.cuStreamQuery(5),
        "torch.empty(8192, uint8) on the CPU": lambda: torch.empty(8192, dtype=torch.uint8),
    }
    if bound is not None:
        blocks[f"a Numba pack's bound launch ({len(bound.data)} pointer writes, the ctypes "
               "launch)"] = lambda: bound(5, addresses)
    return [{"block": k, "us": min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6}
            for k, fn in blocks.items()]


def _malloc() -> str:
    """The ``malloc`` this process runs on: a preloaded jemalloc or tcmalloc, else glibc's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return next((name for name in ("jemalloc", "tcmalloc") if name in maps), "glibc")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_variant(texts) -> dict:
    out = {}
    for t in texts:
        backend, _, kv = t.partition(":")
        k, _, v = kv.partition("=")
        if backend != "numba" or not k:
            raise SystemExit(f"--variant {t!r}: use numba:FIELD=VALUE")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cupy,numba")
    ap.add_argument("--shape", default="1x4096")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--profile", default=None, help="an op: print its cProfile instead")
    ap.add_argument("--micro", action="store_true",
                    help="also the building blocks' costs (a ctypes write, a launch, ...)")
    ap.add_argument("--module", action="store_true",
                    help="also the packed ReLU² FFN module against dense on the C++ path")
    ap.add_argument("--hf", action="store_true",
                    help="also a tiny transformers OPT, plain and converted, on the C++ path")
    ap.add_argument("--compiled-density", type=float, default=None, metavar="D",
                    help="with --compiled: a third variant packed at the fixed density D")
    ap.add_argument("--compiled", type=int, default=0, metavar="LAYERS",
                    help="also a LAYERS-block MLP stack under torch.compile, dense and packed, "
                         "on the C++ path, with the packed step's extra host time by function")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    tmp = Path(tempfile.mkdtemp(prefix="host_standin_"))
    fake = build_fake_driver(tmp)
    import torch
    install(torch)
    # the module rows' GEMMs stand in for the GPU's: one thread, so no OpenMP hand-off
    # (a few µs a GEMM here) is counted as host time
    torch.set_num_threads(1)
    import bitsparse_core as bc
    from bitsparse_core.backends import registry
    from bitsparse_core.backends.numba import backend as nb
    from bitsparse_core.backends.numba import kernels as K
    if args.variant:
        import dataclasses
        variant = dataclasses.replace(K.COMMITTED, **parse_variant(args.variant))
        registry._INSTANCES["numba"] = nb.NumbaBackend(variant)
    shape = tuple(int(v) for v in args.shape.split("x"))
    inp = make_inputs(torch, shape)
    backends = [b for b in args.backends.split(",") if b]
    scope = contextlib.ExitStack()
    if NATIVE in backends:      # the C++ path on the stand-in driver, for the whole run
        from bitsparse_core.torch import native_codec
        scope.enter_context(cxx_path(torch, fake))
        native_codec._cupy = bc.get_backend("cupy")
    by_backend = {}
    for b in backends:
        with native_calls(bc, b):
            by_backend[b] = native_cases(bc, torch, inp) if b == NATIVE else cases(bc, inp, b)
    if args.profile:
        import cProfile
        import pstats
        for b in backends:
            fn = by_backend[b][args.profile]
            with native_calls(bc, b):
                loop_us(fn, 200)
                pr = cProfile.Profile()
                pr.enable()
                loop_us(fn, args.calls)
                pr.disable()
            print(f"== {b} {args.profile}")
            pstats.Stats(pr).sort_stats("tottime").print_stats(60)
        scope.close()
        return 0
    rows = []
    for op in OPS:
        for b in backends:
            fn = by_backend[b][op]
            with native_calls(bc, b):
                loop_us(fn, 200)               # warm: records, plans, launch caches
                before = counts(fake)
                fn()
                calls = [n - m for n, m in zip(counts(fake), before)]
                rows.append({"op": op, "backend": b, "calls": dict(zip(COUNTERS, calls)),
                             # the C++ path fills its records out of Python's sight
                             "param_bytes": None if b == NATIVE else param_bytes(fn),
                             "loops_us": []})
    for _ in range(args.repeats):              # every op once per round, in turn
        for r in rows:
            with native_calls(bc, r["backend"]):
                r["loops_us"].append(loop_us(by_backend[r["backend"]][r["op"]], args.calls))
    scope.close()       # before the module rows, which enter cxx_path themselves
    add = [loop_us(lambda: inp["x"] + inp["x"], args.calls) for _ in range(args.repeats)]
    for r in rows:
        r["us"] = min(r["loops_us"])
    res = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": list(shape), "calls": args.calls, "repeats": args.repeats,
           "variant": args.variant, "torch_add_us": min(add), "rows": rows, "malloc": _malloc(),
           "commit": _commit()}
    lines = [f"stand-in host µs per call ({args.shape} bf16; fastest of {args.repeats} loops of "
             f"{args.calls}; torch x + x {min(add):.2f} µs on this CPU; {res['malloc']} malloc)",
             "",
             "| op | " + " | ".join(f"{b} µs" for b in backends)
             + " | " + " | ".join(f"{b} driver calls" for b in backends)
             + " | " + " | ".join(f"{b} param bytes" for b in backends) + " |",
             "|---" * (1 + 3 * len(backends)) + "|"]
    for op in OPS:
        rs = {r["backend"]: r for r in rows if r["op"] == op}
        calls = [", ".join(f"{k} {v}" for k, v in rs[b]["calls"].items() if v) for b in backends]
        lines.append(f"| {op} | " + " | ".join(f"{rs[b]['us']:.2f}" for b in backends) + " | "
                     + " | ".join(calls) + " | "
                     + " | ".join(str(rs[b]["param_bytes"] or "-") for b in backends) + " |")
    if args.micro:
        res["micro"] = micro_rows(torch, 20 * args.calls)
        lines += ["", "Building blocks, µs per call:", "", "| block | µs |", "|---|---|"]
        lines += [f"| {r['block']} | {r['us']:.3f} |" for r in res["micro"]]
    if args.module:
        res["module"] = module_rows(torch, fake, args.repeats, args.calls // 4)
        lines += _forward_backward_table(
            "The packed ReLU² FFN against dense on the torch adapter's C++ path (4 tokens, "
            "d 16, d_ff 64, bf16)", res["module"])
    if args.hf:
        res["hf"] = hf_rows(torch, fake, args.repeats, args.calls // 10)
        lines += _forward_backward_table(
            "A tiny OPT (transformers; 2 layers, d 16, d_ff 64, 8 tokens, bf16), plain and "
            "converted, on the torch adapter's C++ path", res["hf"])
    if args.compiled:
        res["compiled"] = compiled_rows(torch, fake, args.repeats, max(args.calls // 10, 1),
                                        layers=args.compiled,
                                        fixed_density=args.compiled_density)
        lines += _compiled_tables(res["compiled"])
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_standin.json").write_text(json.dumps(res, indent=1))
        (out / "host_standin.md").write_text(
            f"# Host code on a stand-in driver (no GPU)\n\n{res['when']}, commit "
            f"{res['commit']}.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
