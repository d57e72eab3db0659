"""The C++ host path of the packed ReLU / ReLU² FFN op, for CUDA tensors.

A training step of a model with a few hundred microseconds of GPU work per layer is
bound by host time, and the Python autograd node and Python-level torch calls of
:class:`~.functional.ReLULinearFunction` cost a packed layer's backward about 300 µs
more than dense's on the H200's host (``bench/results/module_host.md``). This module
builds ``kernels/torch_ffn_host.cpp`` as a PyTorch C++ extension (the first use in a
process compiles it, about half a minute, then torch's extension cache keeps it) and
sends :func:`~.functional.relu_linear` there when the C++ path applies: the forward's
pack launch and the whole backward then run in C++, the backward in an autograd node of
the extension's own. ``relu_ffn`` in plain eager (a packed module's forward among its
callers) enters it once for its first GEMM and the op (``relu_ffn_call``, from
:func:`.functional._eager_call`). The backward reads the pack's count from its pinned
slot (:class:`.capacity.FlagSlab`) itself and calls back into Python
(:func:`.ops._clean_state`, the capacity policy) only where the pack is not known clean
there, and every 8th backward of a policy, whose poll moves the capacity. A pack's
pinned slot comes from the extension's own ring of the slab, and the pack is queued for
its policy there (:func:`.capacity.drain_native_tracks` hands the queue over when the
policy polls). The same C++ halves of the op, without the autograd node, are the
dispatcher's CUDA kernels of ``bitsparse::relu_linear`` and ``relu_linear_backward``,
registered with the dispatcher by the extension itself when it is loaded (and reached
from the Python autograd function through ``ops.CUDA_KERNELS``): what torch.compile's
graphs, CUDA graph captures and ``torch.ops`` calls run, with no Python on the way.

The same extension holds :class:`~.hooks.compress_saved_tensors`' C++ front
(``kernels/torch_host_hooks.h``: :func:`hooks_module`) and queues the hooks' packs and
unpacks (:func:`plain_handle`, :func:`plain_unpack`), and an exact pack's wait for its
count and its shrink for torch CUDA tensors (``kernels/torch_host_exact.h``, registered
with :mod:`..backends.cuda.shrink`).

The extension needs a C++ compiler and PyTorch's headers, not CUDA's: it launches the
CuPy-compiled kernels through the driver entry points of
:mod:`..backends.cuda.driver`, with argument records Python builds once per plan
(:func:`launch_template`). Where it cannot be built, the Python path runs and a
warning says why. ``BITSPARSE_NATIVE=0`` turns it off, ``=1`` makes a failed build
an error, and :func:`python_path` turns it off within a block. Both paths run the
same GEMMs and kernels in the same order (C++ makes the GEMMs' 2-D views with fewer
calls), so their bits agree (``tests/test_torch_gpu.py``
checks it on the GPU, ``tests/test_torch_native.py`` on the CPU through
:func:`emulate_on_host`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import threading

import torch

from ..backends.cuda import abi, host, interop, shrink
from ..backends.cuda.sources import kernel_dir
from ..spec.format import DEFAULT_CHUNK_LOG2
from . import _bridge
from . import capacity as C
from . import ops as _ops

log = logging.getLogger("bitsparse_core.torch")

ENV = "BITSPARSE_NATIVE"
SOURCE = "torch_ffn_host.cpp"
HEADERS = "torch_host_*.h"     # its parts, included by SOURCE
# The pointers a call supplies, in the order of the C++ ``Role`` enum.
ROLE_NAMES = ("x", "y", "scratch", "g", "out", "out2", "slot",
              "mask", "mask_len", "offsets", "values", "values_len", "signs", "signs_len",
              "uvalues", "uvalues_len", "usigns", "usigns_len", "u")

_lock = threading.Lock()
_off = 0                   # depth of python_path() blocks
_built: dict = {}          # "module" / "error", once tried
_cuda = None               # the extension once cuda_module() handed it the CUDA driver
_plans: dict = {}          # handle -> PackPlan (what the backward's state call needs)
_handles: dict = {}        # (square, shape, dtype, capacity, encoding, device) -> handle or None


def setting() -> str:
    """``off``, ``on`` (a failed build raises) or ``auto`` (a failed build warns)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    return "auto"


_emulation = None   # the extension, while emulate_on_host() runs


@contextlib.contextmanager
def emulate_on_host(entry_points):
    """Within this block, CPU tensors take the C++ path too, with ``entry_points`` (what
    :meth:`set_driver` takes: five C function addresses) standing in for the CUDA driver:
    the tests' emulation, whose "kernels" run the NumPy reference on host memory, so
    that CI (no GPU) runs the C++ autograd node end to end."""
    global _emulation, _cuda
    mod = module()
    if mod is None:
        raise RuntimeError(f"the C++ host path is not built: {_built.get('error')}")
    mod.set_driver(*entry_points, 0)   # no graph captures on the host
    mod.set_host_emulation(True)
    _hand_slab(mod)
    _forget_handles(mod)   # plans of an earlier driver name kernels this one does not know
    mod.register_kernels("CPU")
    # the CUDA entry points are handed over again on the next CUDA call
    _emulation, _cuda = mod, None
    try:
        yield mod
    finally:
        _emulation = None
        mod.unregister_kernels("CPU")
        mod.set_host_emulation(False)
        mod.set_driver(0, 0, 0, 0, 0, 0)    # the stand-ins' entry points may not outlive this
        _forget_handles(mod)


@contextlib.contextmanager
def python_path():
    """Within this block the FFN ops take the Python host path, in every thread (a
    backward runs on autograd's device threads): for comparing the two paths, and as an
    escape hatch."""
    global _off
    with _lock:
        _off += 1
        _tell_python_path()
    try:
        yield
    finally:
        with _lock:
            _off -= 1
            _tell_python_path()


def _tell_python_path() -> None:
    """Hand the depth of python_path() blocks to the extension (its dispatcher kernels
    read it)."""
    mod = _built.get("module")
    if mod is not None:
        mod.set_python_path_depth(_off)


def build():
    """The compiled extension (built on first use; torch caches it across processes, and
    rebuilds when a source changes: it hashes the listed sources and the flags, so the
    headers' hash rides in a flag)."""
    from torch.utils import cpp_extension
    headers = hashlib.sha256()
    for path in sorted(kernel_dir().glob(HEADERS)):
        headers.update(path.name.encode() + b"\0" + path.read_bytes())
    return cpp_extension.load(name="bitsparse_torch_ffn_host", sources=[str(kernel_dir() / SOURCE)],
                              extra_cflags=["-O2", "-DBITSPARSE_HOST_HEADERS="
                                            + headers.hexdigest()[:16]],
                              verbose=False)


def module():
    """The extension, or None where it is off or could not be built."""
    if "module" in _built:
        return _built["module"]
    with _lock:
        if "module" not in _built:
            mode, mod = setting(), None
            if mode != "off":
                try:
                    mod = build()
                    mod.set_state_fn(_pack_is_clean)
                    mod.set_dispatch(_handle_for, _ops.relu_linear, _ops.relu_linear_backward,
                                     DEFAULT_CHUNK_LOG2)
                    mod.set_gated_dispatch(_gated_handles_for, _ops.gated_relu_linear,
                                           _ops.gated_relu_linear_backward)
                    mod.set_python_path_depth(_off)
                    mod.set_stored_dtypes(list(_bridge.TORCH_TO_BS))
                    C.NATIVE_TRACKS = mod.drain_tracks
                    C.NATIVE_BLOCK_TICKET = mod.block_ticket
                    C.NATIVE_REPLAY_RECOMPUTES = replay_recomputes
                    C.NATIVE_DROP_REPLAY_COUNTERS = mod.drop_replay_counter
                except Exception as exc:   # no compiler, no headers, a failed build
                    if mode == "on":
                        raise
                    _built["error"] = exc
                    log.warning("bitsparse: the C++ host path of the FFN ops could not be "
                                "built (%s: %s); the Python path runs instead (set %s=0 to "
                                "skip the attempt)", type(exc).__name__, exc, ENV)
            _built["module"] = mod
    return _built["module"]


def hooks_module():
    """The extension for :class:`~.hooks.compress_saved_tensors`' C++ front, or None: inside
    :func:`python_path`, where it is off or failed to build, and where CUDA is absent and
    nothing in this process has built it yet (the hooks alone do not build it for CPU
    tensors)."""
    if _off:
        return None
    if "module" in _built:
        return _built["module"]
    if not torch.cuda.is_available():
        return None
    return module()


def build_error():
    """Why :func:`module` gave None (the build's exception), or None."""
    return _built.get("error")


def cuda_module():
    """:func:`module` with the CUDA driver's entry points handed over, or None."""
    global _cuda
    if _cuda is not None:
        return _cuda
    mod = module()
    if mod is None:
        return None
    with _lock:
        if _cuda is None:
            lib = host.driver.lib()
            addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value   # noqa: E731
            mod.set_driver(addr(lib.cuLaunchKernel), addr(lib.cuLaunchCooperativeKernel),
                           addr(lib.cuMemsetD8Async), addr(lib.cuMemcpyDtoHAsync_v2),
                           addr(lib.cuGetErrorName), addr(lib.cuStreamIsCapturing))
            mod.set_offload_driver(addr(lib.cuEventCreate), addr(lib.cuEventRecord),
                                   addr(lib.cuStreamWaitEvent), addr(lib.cuEventDestroy_v2),
                                   addr(lib.cuEventQuery), addr(lib.cuMemcpyHtoDAsync_v2))
            mod.set_exact_driver(addr(lib.cuMemcpyDtoDAsync_v2), addr(lib.cuStreamQuery),
                                 addr(lib.cuStreamSynchronize))
            _hand_graph_driver(mod, lib, addr)
            if hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool"):
                mod.set_body_pool_fn(_route_body_allocations)
            _hand_slab(mod)
            # from now on the dispatcher runs the C++ kernels, and eager CUDA calls too
            mod.register_kernels("CUDA")
            _ops.CUDA_KERNELS.update(
                relu_linear=mod.relu_linear_kernel,
                relu_linear_backward=mod.relu_linear_backward_kernel,
                gated_relu_linear=mod.gated_relu_linear_kernel,
                gated_relu_linear_backward=mod.gated_relu_linear_backward_kernel)
            _cuda = mod
    return mod


def _hand_slab(mod) -> None:
    """Where the pinned slots and their generations live, and which of them are the
    extension's own ring: C++ takes slots there and finds a pack's slot from its ticket."""
    slab = C.SLAB
    mod.set_slab(slab.base(), slab.generations, slab.total, slab.slots)


def _forget_handles(mod) -> None:
    """Drop every plan handle the extension and this module have looked up (the plans
    themselves stay registered)."""
    _handles.clear()
    mod.forget_handles()


def host_path(device) -> str:
    """Which host path the FFN ops take for tensors on ``device`` (for bench reports)."""
    if getattr(device, "type", device) != "cuda":
        return "python (CPU tensors)"
    return "c++" if cuda_module() is not None else "python (the C++ path did not build)"


def _exact_shrink(slot: int, stream: int, device: int, src_tail: int, plan: host.PackPlan):
    """:mod:`..backends.cuda.shrink`'s native steps: ``(status, nnz, tail tensor or
    None)``, or None where the extension is off or could not be built (it is built, or
    loaded from torch's extension cache, on the first exact pack that asks)."""
    if _off:
        return None
    mod = cuda_module()
    if mod is None:
        return None
    return mod.exact_shrink(slot, stream, interop.torch_device(device), src_tail,
                            plan.lay.capacity, *host.tail_terms(plan), abi.STATUS_NOSIGN_VIOLATION)


def _pack_is_clean(handle: int, policy: int, ticket: torch.Tensor, block: torch.Tensor,
                   recompute_source: bool, gated: bool = False) -> bool:
    """The C++ backward's question: may it read the packed values? (The policy waits for
    or gives up on a count not back yet, re-picks its bucket, counts recomputes; without
    a recompute source the host waits and an overflow raises.) A block the extension has
    no ticket for may be one the Python kernel made (inside :func:`python_path`)."""
    if ticket.tolist()[0] == C.NO_SLOT:
        ticket = _ops.block_ticket(block)
    return _ops._clean_state(block, ticket, _plans[handle], C.POLICIES.get(policy),
                             recompute_source, "gated_relu_linear" if gated else "relu_linear")


# --------------------------------------------------------------------------- #
# Launch templates                                                            #
# --------------------------------------------------------------------------- #
def _copy(record):
    """A detached copy of an argument record (the original is a thread's live one)."""
    return type(record).from_buffer(bytearray(ctypes.string_at(ctypes.addressof(record),
                                                                ctypes.sizeof(record))))


def launch_template(func: int, grid: int, smem: int, cooperative: bool, record,
                    block_fields=(), patches=()) -> tuple:
    """What the C++ ``Launch`` is made from: ``record``'s bytes (the plan's fields set,
    the block-relative fields holding offsets into the block), the offset of every
    field, those block-relative fields, and ``patches``: ``(role, field, alignment flag
    field or None, a null pointer reads unaligned)`` for the pointers a call supplies."""
    cls = type(record)

    def off(name):
        return getattr(cls, name).offset

    return (int(func), int(grid), abi.THREADS, int(smem), bool(cooperative),
            ctypes.string_at(ctypes.addressof(record), ctypes.sizeof(record)),
            [off(name) for name, _ in cls._fields_], [off(name) for name in block_fields],
            [(ROLE_NAMES.index(role), off(field), off(flag) if flag else -1, bool(null))
             for role, field, flag, null in patches])


_UNPACK_PATCHES = (("g", "g", "g_aligned", False), ("out", "out", "out_aligned", False),
                   ("out2", "out2", "out2_aligned", False))


def pack_template(plan: host.PackPlan, device: int, zero_tail: bool = False) -> tuple:
    """The fused pack (``host.enqueue_pack``): ``zero_tail`` as there (the public pack's
    fixed capacity; the FFN op's blocks are never read past their count); a masked pack
    reads the mask tensor's mask (a role), not the block's."""
    L = host._pack_launch(plan, device)
    r = _copy(L.args)
    (mo, _), (oo, _), (vo, _), (so, _) = plan.spans
    r.values, r.signs, r.status = vo, so, plan.status_offset
    r.zero_values_words, r.zero_signs_words = L.tail_words if zero_tail else (0, 0)
    r.x = r.y = r.scratch = r.slot = r.u = 0
    block_fields = ["values", "signs", "status"]
    patches = [("x", "x", "x_aligned", False), ("y", "y", "y_aligned", True),
               ("scratch", "scratch", None, False), ("slot", "slot", None, False)]
    if plan.mode == abi.Mode.RELU_GATED:
        patches.append(("u", "u", "u_aligned", True))
    if plan.mode == abi.Mode.MASKED:
        r.mask = r.offsets = 0
        patches.append(("mask", "mask", None, False))
    else:
        r.mask, r.offsets = mo, oo
        block_fields += ["mask", "offsets"]
    return launch_template(L.pack, L.grid, plan.smem, True, r, block_fields, patches)


def unpack_template(plan: host.PackPlan, op: abi.Op, device: int,
                    u_plan: host.PackPlan | None = None):
    """An unpack-family kernel over the plan's block (``host.enqueue_unpack``), or None
    where it needs a prefix scan (chunks longer than its tile). ``u_plan``: the gated
    ops' u, whose values and signs come as roles ``uvalues`` and ``usigns``."""
    lay = plan.lay
    L = host._unpack_launch(lay, op, int(u_plan.lay.encoding) if u_plan is not None else 0,
                            device)
    if L.prefix_bytes:
        return None
    r = _copy(L.args)
    p = plan.planes(0)
    r.off64, r.prefix, r.mask_len = p.off64, 0, p.mask_len
    r.values, r.values_len, r.signs, r.signs_len = p.values, p.values_len, p.signs, p.signs_len
    r.offsets, r.mask = p.offsets, p.mask
    r.uvalues = r.uvalues_len = r.usigns = r.usigns_len = 0
    r.g = r.out = r.out2 = r.ud = 0
    r.ud_aligned = True
    block_fields = ["values", "signs", "offsets", "mask"]
    patches = list(_UNPACK_PATCHES)
    if u_plan is not None:
        pu = u_plan.planes(0)
        r.uvalues_len, r.usigns_len = pu.values_len, pu.signs_len
        patches += [("uvalues", "uvalues", None, False), ("usigns", "usigns", None, False)]
    return launch_template(L.func, L.n_tiles, 0, False, r, block_fields, patches)


def mask_select_template(plan: host.PackPlan, device: int) -> tuple:
    """ReLU's mask-only gradient (``host.enqueue_relu_backward``)."""
    lay = plan.lay
    func, grid = host.mask_select_launch(lay, device)
    r = abi.MaskSelectArgs()
    r.mask, r.mask_len, r.numel = plan.spans[0][0], plan.spans[0][1], lay.numel
    r.g_aligned = r.out_aligned = True
    return launch_template(func, grid, 0, False, r, ("mask",),
                           (("g", "g", "g_aligned", False), ("out", "out", "out_aligned", False)))


def plan_templates(plan: host.PackPlan, device: int):
    """Every launch of one plan's forward and backward, or None where one is missing."""
    launches = {"pack": pack_template(plan, device)}
    if plan.mode == abi.Mode.RELU2:
        ops = {"unpack": abi.Op.UNPACK, "relu2": abi.Op.RELU2,
               "relu2_and_square": abi.Op.RELU2_AND_SQUARE}
    else:
        ops = {"unpack": abi.Op.UNPACK}
        launches["mask_select"] = mask_select_template(plan, device)
    for name, op in ops.items():
        launches[name] = unpack_template(plan, op, device)
        if launches[name] is None:
            return None
    return launches


# IF nodes with an ELSE body came with the CUDA 12.8 driver (kernels/torch_host_graphs.h).
CONDITIONAL_DRIVER = 12080
_CONDITIONAL_ENTRY_POINTS = ("cuStreamGetCaptureInfo_v3", "cuGraphConditionalHandleCreate",
                             "cuGraphAddNode_v2", "cuStreamUpdateCaptureDependencies_v2",
                             "cuStreamBeginCaptureToGraph", "cuStreamEndCapture",
                             "cuCtxGetCurrent")
_conditional_devices: dict = {}   # device -> its condition kernel's CUfunction (0: none)
_conditionals_off = 0             # depth of no_conditional_nodes() blocks


def _hand_graph_driver(mod, lib, addr) -> None:
    """The entry points of conditional graph nodes, where the driver has them (else a
    captured backward recomputes, as it did before they were used)."""
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < CONDITIONAL_DRIVER:
        return
    try:
        mod.set_graph_driver(*(addr(getattr(lib, name)) for name in _CONDITIONAL_ENTRY_POINTS))
    except AttributeError:   # a driver without one of them
        return


_body_pools: dict = {}   # device -> the private memory pool of conditional bodies' allocations


def _route_body_allocations(device: int, begin: bool) -> None:
    """While a conditional node's body is captured (the C++ path calls this with the body's
    side stream current), what that stream allocates goes to a private pool of its own:
    cuBLAS's workspaces, which inductor's CUDA graphs clear before and after a recording,
    so a recording makes them anew, and frees them after it while the graph still uses
    them. In a pool that nothing else allocates from, such a block is only ever a
    workspace again. Never released."""
    if begin:
        pool = _body_pools.get(device)
        if pool is None:
            pool = _body_pools[device] = torch.cuda.graph_pool_handle()
        torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool)
    else:
        torch._C._cuda_endAllocateToPool(device, _body_pools[device])


def _hand_condition_kernel(mod, device: int) -> None:
    """Compile the conditional node's condition kernel for ``device`` once; a failure
    leaves captured backwards recomputing, and says why once."""
    if device in _conditional_devices:
        return
    func = 0
    try:
        from ..backends.cupy import kernels
        func = kernels.function(device, "set_condition")
    except Exception as exc:   # noqa: BLE001 (any compile or load failure: recompute instead)
        log.warning("bitsparse: captured backwards will recompute (the conditional node's "
                    "kernel did not build: %s)", exc)
    _conditional_devices[device] = func
    if not _conditionals_off:
        mod.set_condition_kernel(device, func)


def conditional_nodes(device: int) -> bool:
    """Whether a relu_linear backward captured into a CUDA graph on ``device`` reads its
    packed block where the pack was clean (a conditional node) rather than recomputing."""
    mod = _cuda
    return bool(mod is not None and mod.graph_conditionals(device))


def replay_recomputes(policy_id: int) -> int:
    """How many replays of the policy's captured backwards recomputed, as far as the device
    has run them: their pinned host counter, which kernels/bitsparse_graph.cu's condition
    kernel adds to (no CUDA call, no wait)."""
    mod = _cuda
    return mod.replay_count(policy_id) if mod is not None else 0


@contextlib.contextmanager
def no_conditional_nodes():
    """Within this block, backwards captured into CUDA graphs recompute every time (as
    without conditional nodes): for comparisons and tests."""
    global _conditionals_off
    mod = cuda_module()
    with _lock:
        _conditionals_off += 1
        if mod is not None:
            for device in _conditional_devices:
                mod.set_condition_kernel(device, 0)
    try:
        yield
    finally:
        with _lock:
            _conditionals_off -= 1
            if mod is not None and not _conditionals_off:
                for device, func in _conditional_devices.items():
                    mod.set_condition_kernel(device, func)


def gated_plan_templates(plan_r: host.PackPlan, plan_u: host.PackPlan, device: int):
    """The launches of a gated op's two plans, or None where one is missing: relu(g)'s
    pack (mode RELU_GATED: it reads u too), gated backward and ``r * u`` from both blocks
    (u's planes by role); u's masked pack (relu(g)'s mask by role)."""
    r = {"pack": pack_template(plan_r, device),
         "gated": unpack_template(plan_r, abi.Op.GATED, device, u_plan=plan_u),
         "gated_product": unpack_template(plan_r, abi.Op.GATED_PRODUCT, device, u_plan=plan_u)}
    u = {"pack": pack_template(plan_u, device)}
    if any(t is None for t in (*r.values(), *u.values())):
        return None
    return r, u


def register(mod, plan: host.PackPlan, device: int, launches=None):
    """A new C++ handle of ``plan`` on ``device`` (``launches``: its templates, by default
    :func:`plan_templates`'), or None where the C++ path does not take it (chunks longer
    than the unpack tile; the table full, after 65536 plans of shapes that never repeat:
    those run the Python path)."""
    if plan.lay.chunk_log2 != DEFAULT_CHUNK_LOG2:
        return None
    launches = launches or plan_templates(plan, device)
    if launches is None:
        return None
    if mod is _cuda:
        _hand_condition_kernel(mod, device)
    with _lock:
        handle = mod.add_plan(plan.lay.numel, plan.nbytes, plan.scratch_bytes,
                              plan.status_offset, [off for off, _ in plan.spans], launches)
        if handle < 0:
            return None
        _plans[handle] = plan
    return handle


def register_gated(mod, plan_r: host.PackPlan, plan_u: host.PackPlan, device: int):
    """``(relu(g)'s handle, u's handle)`` of a gated op on ``device``, or None where the
    C++ path does not take it."""
    if plan_r.lay.chunk_log2 != DEFAULT_CHUNK_LOG2:
        return None
    templates = gated_plan_templates(plan_r, plan_u, device)
    if templates is None:
        return None
    handles = (register(mod, plan_r, device, templates[0]),
               register(mod, plan_u, device, templates[1]))
    return None if None in handles else handles


# --------------------------------------------------------------------------- #
# The op                                                                      #
# --------------------------------------------------------------------------- #
def _module_for(t: torch.Tensor):
    """The extension for an op on ``t``'s device (CUDA, or the CPU under
    :func:`emulate_on_host`), or None where the Python path runs."""
    if _off:
        return None
    if not t.is_cuda:       # only a test's host emulation gets here (see emulate_on_host)
        return _emulation
    return _cuda or cuda_module()


def _handle(mod, square: bool, shape, dtype, capacity: int, encoding: int, device: int):
    """The C++ handle of a plan (registered on its first use), or None where the C++
    path does not take it."""
    key = (square, tuple(shape), dtype, capacity, encoding, device)
    handle = _handles.get(key, -1)
    if handle == -1:        # first call of this shape and capacity: one registration
        plan = _ops._plan(shape, dtype, capacity, square, encoding, DEFAULT_CHUNK_LOG2)
        handle = _handles[key] = register(mod, plan, device)
    return handle


def _gated_handles(mod, shape, dtype, capacity: int, encoding: int, u_encoding: int,
                   device: int):
    """``(relu(g)'s handle, u's handle)`` of a gated op's plans (registered on their first
    use), or None where the C++ path does not take them."""
    key = ("gated", tuple(shape), dtype, capacity, encoding, u_encoding, device)
    handles = _handles.get(key, -1)
    if handles == -1:
        plan_r = _ops._gate_plan(shape, dtype, capacity, encoding, DEFAULT_CHUNK_LOG2)
        plan_u = _ops._u_plan(shape, dtype, capacity, u_encoding, DEFAULT_CHUNK_LOG2)
        handles = _handles[key] = register_gated(mod, plan_r, plan_u, device)
    return handles


def gated_relu_linear(g, u, weight, bias, x, wg, bg, wu, bu, capacity: int, encoding: int,
                      u_encoding: int, mm_dtype, policy: C.CapacityPolicy):
    """``F.linear(relu(g) * u, weight, bias)`` through the C++ path, relu(g) and u packed
    for a C++ backward; None where that path does not apply (the caller then takes the
    Python one). ``g`` and ``u`` are contiguous, ``(x, wg, bg, wu, bu)`` their recompute
    source. Offloaded calls take the Python path."""
    mod = _module_for(g)
    if mod is None:
        return None
    handles = _gated_handles(mod, g.shape, g.dtype, capacity, encoding, u_encoding,
                             g.get_device())
    if handles is None:
        return None
    return mod.gated_relu_linear(g, u, weight, bias, x, wg, bg, wu, bu, capacity, *handles,
                                 mm_dtype, policy.id if policy is not None else 0)


def relu_linear(a, weight, bias, x, w1, b1, capacity: int, square: bool, encoding: int,
                mm_dtype, policy: C.CapacityPolicy, offload=None):
    """``F.linear(relu(a)[**2], weight, bias)`` through the C++ path, with the activation
    packed for a C++ backward; None where that path does not apply (the caller then
    takes the Python one). ``a`` is a contiguous CUDA tensor and ``(x, w1, b1)`` its
    recompute source; ``offload``: an :class:`.offload.Offloader` that keeps the block
    in pinned host memory until the backward takes it back (its C++ engine, called from
    the C++ node), or None."""
    mod = _module_for(a)
    if mod is None:
        return None
    handle = _handle(mod, square, a.shape, a.dtype, capacity, encoding, a.get_device())
    if handle is None:
        return None
    return mod.relu_linear(a, weight, bias, x, w1, b1, capacity, handle, square, mm_dtype,
                           policy.id if policy is not None else 0,
                           offload.engine if offload is not None else None)


def plain_handle(t: torch.Tensor, plan: host.PackPlan):
    """``(extension, handle)`` of a plain pack plan (mode PACK) for ``t``'s device, for
    :class:`~.hooks.compress_saved_tensors`' packs and unpacks; ``(None, None)`` where
    the Python path runs (the extension off or not built, CPU tensors outside
    :func:`emulate_on_host`, a plan it does not take)."""
    mod = _module_for(t)
    if mod is None:
        return None, None
    key = (plan, t.get_device())
    handle = _handles.get(key, -1)
    if handle == -1:
        handle = _handles[key] = register(mod, plan, t.get_device())
    return (mod, handle) if handle is not None else (None, None)


def plain_unpack(block: torch.Tensor, handle: int, shape, dtype: torch.dtype):
    """The dense tensor of a block that :func:`plain_handle`'s extension packed, or None
    where the extension cannot decode it now (the block's layout is ``ops.pack_plain``'s:
    the Python unpack reads it)."""
    mod = _module_for(block)
    return None if mod is None else mod.hooks_unpack(handle, block, shape, dtype)


def _handle_for(square: bool, shape, dtype, capacity: int, encoding: int, device: int) -> int:
    """The extension's question on a plan it has not seen: its handle, or -1 for the
    Python path."""
    handle = _handle(module(), square, shape, dtype, capacity, encoding, device)
    return -1 if handle is None else handle


def _gated_handles_for(shape, dtype, capacity: int, encoding: int, u_encoding: int,
                       device: int) -> tuple:
    """The extension's question on a gated op's plans it has not seen: their two handles,
    or ``(-1, -1)`` for the Python path."""
    handles = _gated_handles(module(), shape, dtype, capacity, encoding, u_encoding, device)
    return (-1, -1) if handles is None else handles


# The dispatcher's CUDA kernels of bitsparse::relu_linear, gated_relu_linear and their
# backwards until the extension's own are registered: the first CUDA call builds (or
# loads) it, which registers them and puts them into ops.CUDA_KERNELS in place of these.
# (Under emulate_on_host, CPU tensors reach the extension's kernels through these too.)
def relu_linear_kernel(*args):
    mod = _module_for(args[0])
    return (mod.relu_linear_kernel if mod is not None else _ops.relu_linear)(*args)


def relu_linear_backward_kernel(*args):
    mod = _module_for(args[1])
    return (mod.relu_linear_backward_kernel if mod is not None
            else _ops.relu_linear_backward)(*args)


def gated_relu_linear_kernel(*args):
    mod = _module_for(args[0])
    return (mod.gated_relu_linear_kernel if mod is not None else _ops.gated_relu_linear)(*args)


def gated_relu_linear_backward_kernel(*args):
    mod = _module_for(args[1])
    return (mod.gated_relu_linear_backward_kernel if mod is not None
            else _ops.gated_relu_linear_backward)(*args)


_ops.CUDA_KERNELS.update(relu_linear=relu_linear_kernel,
                         relu_linear_backward=relu_linear_backward_kernel,
                         gated_relu_linear=gated_relu_linear_kernel,
                         gated_relu_linear_backward=gated_relu_linear_backward_kernel)
# Exact packs of torch CUDA tensors (any backend) wait for their count and shrink here.
shrink.register(_exact_shrink)
