"""Autograd ops of the FFN patterns, keeping the activation packed between forward and backward.

Each op covers the activation *and the matmul after it*: that second matmul is
the only other user of the dense activation, so once it has run nothing holds
the dense tensor and it is freed; the op saves only the packed planes (and the
weight, which autograd keeps anyway). The first matmul stays ordinary PyTorch.

Bit-identity with the plain PyTorch FFN (``nn.Linear`` + ``torch.relu`` /
``torch.square`` / ``*``) is a design requirement, so the backward formulas
repeat PyTorch's own for ``linear``: ``grad_in = grad @ W``,
``grad_W = grad.T @ h``, ``grad_b = grad.sum(0)``, on the same 2-D views, in the
same dtypes, and autocast is resolved the way autocast resolves ``linear``
(weights cast to the autocast dtype by a differentiable ``.to``). The
activation gradients are the fused backend ops, whose reference semantics are
PyTorch's (``threshold_backward`` zeroes the gradient where ``relu(a) <= 0``).

Where the results can differ from PyTorch's, all with non-finite or
signed-zero data (see ``docs/torch.md``):

* a pre-activation of exactly ``-0.0``: ``torch.relu`` keeps ``-0.0``, the
  packed ReLU stores ``+0.0``; gradients are the same, and a product sum only
  differs if every term of it is a zero;
* NaN activations: ReLU² and gated gradients at a NaN are 0 here, NaN in
  PyTorch (ReLU's mask-only gradient passes NaN positions like PyTorch);
* gated: ``relu(g) * u`` is recomputed for ``grad_W2`` from ``u`` stored only
  where ``g > 0``, so an infinite/NaN ``u`` where ``g <= 0`` (a NaN in the
  dense product) and the sign of the zero products are not reproduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _bridge as B
from . import ops as _ops   # also registers torch.ops.bitsparse
from ..spec.format import DEFAULT_CHUNK_LOG2, Encoding
from ..errors import UnsupportedTransformError
from . import native as _native
from . import offload as _offload
from . import capacity as _capacity
from .capacity import CapacityPolicy

ENCODINGS = ("raw", "nosign", "signplane", "auto")


def _check_encoding(encoding: str, what: str = "encoding") -> str:
    if type(encoding) is str and encoding in ENCODINGS:   # the common case, per call
        return encoding
    if not isinstance(encoding, str) or encoding.lower() not in ENCODINGS:
        raise ValueError(f"{what}={encoding!r}; use one of {', '.join(ENCODINGS)}")
    return encoding.lower()


def _check_input(t: torch.Tensor, name: str) -> None:
    if not (t.is_cuda or t.is_cpu):                  # (t.device makes an object per call)
        B.check_device(t.device)
    B.bs_dtype(t.dtype)
    if t.layout != torch.strided:
        raise B.UnsupportedDeviceError(f"{name}: only strided (dense) tensors can be packed")


def _device_type(t: torch.Tensor) -> str:
    """``t.device.type`` without making a device object (the ops run once per layer)."""
    return "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type


def _check_backend(backend: str, device_type: str) -> None:
    if backend == "auto":
        return
    if backend != ("cupy" if device_type == "cuda" else "numpy"):
        raise B.UnsupportedDeviceError(f"backend={backend!r} for a {device_type} tensor: the "
                                       "torch ops run the CuPy-compiled kernels on CUDA and the "
                                       "NumPy reference on CPU")


def _autocast_dtype(device_type: str):
    """The dtype autocast would run ``linear`` in on this device type, or None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _autocast(t, dtype):
    """What autocast's ``linear`` does to an argument: floating tensors (not float64)
    are cast to the autocast dtype, differentiably."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


# --------------------------------------------------------------------------- #
# Functional API                                                              #
# --------------------------------------------------------------------------- #
# "auto" would need a scan of the activation before packing; relu(a) holds no negative
# value but a negative NaN, so nosign is its encoding.
_ENCODING_IDS = {"raw": int(Encoding.RAW), "nosign": int(Encoding.NOSIGN),
                 "signplane": int(Encoding.SIGNPLANE), "auto": int(Encoding.NOSIGN)}


def _encoding_id(encoding: str) -> int:
    return _ENCODING_IDS[encoding]


_FUNCTIONAL_POLICIES: dict = {}
_MAX_FUNCTIONAL_POLICIES = 256   # shapes vary with sequence length: keep the newest


def _shared_policy(density, shape, dtype, square):
    """The capacity policy of a call that brings none: a fixed density's, or one shared by
    every functional call of this shape (adapting as a module's would)."""
    key = (tuple(shape), dtype, square, density)
    pol = _FUNCTIONAL_POLICIES.get(key)
    if pol is None:
        if len(_FUNCTIONAL_POLICIES) >= _MAX_FUNCTIONAL_POLICIES:
            _FUNCTIONAL_POLICIES.pop(next(iter(_FUNCTIONAL_POLICIES)))
        pol = _FUNCTIONAL_POLICIES[key] = CapacityPolicy(density)
    return pol


def relu_linear(a, weight, bias=None, *, square: bool = False, encoding: str = "nosign",
                density: float | None = None, policy: CapacityPolicy | None = None,
                recompute=None, backend: str = "auto", offload=None):
    """``F.linear(torch.relu(a), weight, bias)`` (``torch.relu(a)**2`` if ``square``),
    storing the activation packed for backward at a fixed capacity, with no host sync.

    ``recompute=(x, w1, b1)``, what made ``a = F.linear(x, w1, b1)``, lets a batch
    that overflows the capacity recompute the activation exactly in backward;
    without it such a backward waits for the pack's count and raises
    :class:`~bitsparse_core.errors.CapacityOverflowError` on overflow
    (:func:`relu_ffn` and the modules always pass it). ``density`` bounds the
    nonzero fraction; by default the capacity adapts (:class:`CapacityPolicy`).
    ``offload``: True or an :class:`~bitsparse_core.torch.offload.Offloader` keeps the
    packed block in pinned host memory until backward (eager mode only).
    """
    _check_input(a, "a")
    encoding = _check_encoding(encoding)
    device_type = _device_type(a)
    _check_backend(backend, device_type)
    mm = _autocast_dtype(device_type)
    weight, bias = _autocast(weight, mm), _autocast(bias, mm)
    mm_dtype = mm if mm is not None and a.dtype != mm else None
    x, w1, b1 = recompute if recompute is not None else (None, None, None)
    a = a.contiguous()
    pol = policy if policy is not None else _shared_policy(density, a.shape, a.dtype,
                                                           bool(square))
    traced = _traced()
    off = _offloader(offload, traced, device_type)
    capacity = pol.traced_capacity(a.numel()) if traced else pol.capacity(a.numel())
    square, enc = bool(square), _encoding_id(encoding)
    args = (a, weight, bias, x, w1, b1, capacity, square, enc, DEFAULT_CHUNK_LOG2, mm_dtype,
            pol.id, off)
    if x is not None and not traced and _no_modes(args, 6):
        # the C++ host path (CUDA; None where it does not apply)
        out = _native.relu_linear(a, weight, bias, x, w1, b1, capacity, square, enc, mm_dtype,
                                  pol, off)
        if out is not None:
            return out
    if traced:
        out, _ = ReLULinearFunction.apply(*args)
    else:
        # Function.apply binds the arguments to forward's signature (inspect.signature,
        # tens of microseconds per call) before the C++ apply; all thirteen are passed
        # positionally, so binding changes nothing and is skipped in eager.
        out, _ = _RELU_LINEAR_APPLY(*args)
    return out


def _eager_call(x, w1, b1, w2, b2, square, encoding, policy):
    """:func:`relu_ffn` in eager mode (no trace, no autocast, no offload, backend ``"auto"``:
    the caller checked those): on the C++ path, the first GEMM and the op are one call (the
    extension's ``relu_ffn_call`` makes the other checks). ``(out, a)``; ``(None, None)``
    where that path does not take the call, ``(None, a)`` where it declined after the first
    GEMM; the caller then takes :func:`relu_linear`, every check included. Its Python is
    per layer on a host-paced step's critical path."""
    enc = _ENCODING_IDS.get(encoding) if type(encoding) is str else None
    mod = _native._module_for(x)
    shape = x.shape
    k = shape[-1] if shape else 0   # a 0-d x: F.linear's own error, on the full path
    if enc is None or mod is None or not k:
        return None, None
    return mod.relu_ffn_call(x, w1, b1, w2, b2, policy.capacity(x.numel() // k * w1.shape[0]),
                             bool(square), enc, policy.id)


def _traced() -> bool:
    """Under torch.compile or a torch.func transform (Function.apply's full path)."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))


def _call(name: str, args: tuple, n_tensors: int):
    """``torch.ops.bitsparse.<name>(*args)``. In plain eager (CUDA or CPU tensors; no trace,
    no dispatch or function mode such as ``torch.device(...)``, no tensor subclass among
    the first ``n_tensors`` arguments) its kernel is called directly (the Python one, or
    on CUDA the C++ host path's where it has one, ``ops.CUDA_KERNELS``): the
    dispatcher's boxing of a dozen arguments costs tens of µs per call on a training
    step's critical path. Under the profiler the call keeps the op's name."""
    lead = args[0]
    if (lead.is_cuda or lead.is_cpu) and _plain_eager(args, n_tensors):
        impl = (lead.is_cuda and _ops.CUDA_KERNELS.get(name)) or _ops.IMPLS[name]
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(f"bitsparse::{name}"):
                return impl(*args)
        return impl(*args)
    return getattr(torch.ops.bitsparse, name)(*args)


def _plain_eager(args: tuple, n_tensors: int) -> bool:
    """Plain eager: no trace and :func:`_no_modes`."""
    return not _traced() and _no_modes(args, n_tensors)


def _no_modes(args: tuple, n_tensors: int) -> bool:
    """No dispatch or function mode (such as ``torch.device(...)``), no JIT trace, no
    tensor subclass among the first ``n_tensors`` arguments."""
    return (not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._get_tracing_state()
            and _PLAIN.issuperset(map(type, args[:n_tensors])))


def _taken_back(stash, ticket):
    """An offloaded block back on the device (a second backward through it raises), its
    pack's ticket kept beside it again: the copy is a new block."""
    block = stash.take()
    if block.device.type == "cuda":
        _capacity.BLOCK_TICKETS.remember(block, ticket)
    return block


def _no_zero_grads(ctx) -> None:
    """Eager autograd would hand backward a zero tensor for every non-differentiable output
    (a fill of the block-sized buffer per layer); None instead. A trace keeps its own
    rule (tensors), which backward takes as well."""
    if not _traced():
        ctx.set_materialize_grads(False)


def _offloader(offload, traced: bool, device_type: str):
    """The call's :class:`~.offload.Offloader`, or None; offloading is eager-only (its
    copies are ordered by events on a side stream, which neither a trace nor a CUDA
    graph capture keeps)."""
    off = _offload.resolve(offload)
    if off is not None and (traced or (device_type == "cuda"
                                       and torch.cuda.is_current_stream_capturing())):
        raise UnsupportedTransformError(
            "offload= runs in eager mode only: not under torch.compile, torch.func or a CUDA "
            "graph capture; pass offload=None there")
    return off


class ReLULinearFunction(torch.autograd.Function):
    """Autograd of ``bitsparse::relu_linear``: saves the packed block, the weight and the
    recompute source; the backward is ``bitsparse::relu_linear_backward``.
    Forward and ``setup_context`` are separate, so torch.func and torch.compile take it."""

    @staticmethod
    def forward(a, weight, bias, x, w1, b1, capacity, square, encoding, chunk_log2, mm_dtype,
                policy, offload=None):
        config = _ops.op_config(square, encoding, chunk_log2, mm_dtype)
        return _call("relu_linear", (a, weight, bias, x, w1, b1, capacity, config, policy), 6)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (a, weight, bias, x, w1, b1, capacity, square, encoding, chunk_log2, mm_dtype, policy,
         offload) = inputs
        _, block = output
        ctx.mark_non_differentiable(block)
        _no_zero_grads(ctx)
        if offload is not None:      # the block goes to the host; backward takes it back
            ctx.stashed = (offload.stash(block), _ops.block_ticket(block))
            ctx.save_for_backward(weight, x, w1, b1)
        else:
            ctx.stashed = None
            ctx.save_for_backward(block, weight, x, w1, b1)
        ctx.meta = (a.dtype, bias is not None, capacity, square, encoding, chunk_log2,
                    mm_dtype, policy)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_block):
        if grad_out is None:             # the output was not used: nothing flows back
            return (None,) * 13
        if ctx.stashed is not None:
            weight, x, w1, b1 = ctx.saved_tensors
            block = _taken_back(*ctx.stashed)
        else:
            block, weight, x, w1, b1 = ctx.saved_tensors
        a_dtype, has_bias, capacity, square, encoding, chunk_log2, mm_dtype, policy = ctx.meta
        need = ctx.needs_input_grad
        needs = (_ops.NEED_A if need[0] else 0) | (_ops.NEED_W if need[1] else 0)
        grad_out = grad_out.contiguous()
        config = _ops.op_config(square, encoding, chunk_log2, mm_dtype, a_dtype, has_bias, needs)
        grad_a, grad_w, _ = _call("relu_linear_backward", (
            grad_out, block, weight, x, w1, b1, capacity, config, policy), 6)
        # The bias gradient outside the op, PyTorch's linear's own: under torch.compile
        # it is then the compiler's reduction, as in the dense model's graph.
        _, grad_b = _ops._linear_bias_grad(grad_out, weight, has_bias,
                                           _ops.NEED_B if has_bias and need[2] else 0)
        return (grad_a if need[0] else None, grad_w if need[1] else None,
                grad_b if has_bias and need[2] else None) + (None,) * 10

    @staticmethod
    def vmap(info, in_dims, *args):
        raise UnsupportedTransformError(
            "bitsparse's packed ReLU ops have no batching rule (the packed block's size is "
            "fixed per call); apply torch.func.vmap outside them or use the dense FFN")


# The C++ apply under Function.apply, bound to ReLULinearFunction.
_RELU_LINEAR_APPLY = super(torch.autograd.Function, ReLULinearFunction).apply


class GatedReLULinearFunction(torch.autograd.Function):
    """Autograd of ``bitsparse::gated_relu_linear``: saves the two packed blocks (relu(g),
    and u where g > 0), the weight and the recompute source; the backward
    is ``bitsparse::gated_relu_linear_backward``."""

    @staticmethod
    def forward(g, u, weight, bias, x, wg, bg, wu, bu, capacity, encoding, u_encoding,
                chunk_log2, mm_dtype, policy, offload=None):
        return _call("gated_relu_linear", (g, u, weight, bias, x, wg, bg, wu, bu, capacity,
                                           encoding, u_encoding, chunk_log2, mm_dtype, policy), 9)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (g, u, weight, bias, x, wg, bg, wu, bu, capacity, encoding, u_encoding, chunk_log2,
         mm_dtype, policy, offload) = inputs
        _, block_r, block_u = output
        ctx.mark_non_differentiable(block_r, block_u)
        _no_zero_grads(ctx)
        if offload is not None:      # both blocks go to the host; backward takes them back
            ctx.stashed = (offload.stash(block_r), offload.stash(block_u),
                           _ops.block_ticket(block_r))
            ctx.save_for_backward(weight, x, wg, bg, wu, bu)
        else:
            ctx.stashed = None
            ctx.save_for_backward(block_r, block_u, weight, x, wg, bg, wu, bu)
        ctx.meta = (list(g.shape), g.dtype, bias is not None, capacity, encoding, u_encoding,
                    chunk_log2, mm_dtype, policy)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_r, _grad_u):
        if grad_out is None:
            return (None,) * 16
        if ctx.stashed is not None:  # taken in the reverse of the order they were stashed
            weight, x, wg, bg, wu, bu = ctx.saved_tensors
            block_u = ctx.stashed[1].take()
            block_r = _taken_back(ctx.stashed[0], ctx.stashed[2])
        else:
            block_r, block_u, weight, x, wg, bg, wu, bu = ctx.saved_tensors
        a_shape, a_dtype, has_bias, capacity, encoding, u_encoding, chunk_log2, mm_dtype, \
            policy = ctx.meta
        need = ctx.needs_input_grad
        needs = (_ops.NEED_A if need[0] or need[1] else 0) | (_ops.NEED_W if need[2] else 0)
        grad_out = grad_out.contiguous()
        grad_g, grad_u, grad_w, _ = _call("gated_relu_linear_backward", (
            grad_out, block_r, block_u, weight, x, wg, bg, wu, bu, a_shape,
            a_dtype, has_bias, capacity, encoding, u_encoding, chunk_log2, mm_dtype, policy,
            needs), 9)
        _, grad_b = _ops._linear_bias_grad(grad_out, weight, has_bias,   # as ReLU's, above
                                           _ops.NEED_B if has_bias and need[3] else 0)
        return (grad_g if need[0] else None, grad_u if need[1] else None,
                grad_w if need[2] else None, grad_b if has_bias and need[3] else None) \
            + (None,) * 12

    @staticmethod
    def vmap(info, in_dims, *args):
        ReLULinearFunction.vmap(info, in_dims, *args)


_GATED_APPLY = super(torch.autograd.Function, GatedReLULinearFunction).apply


def _u_encoding_id(encoding: str, u_encoding: str | None) -> int:
    """u's encoding: signplane by default (u is signed), raw beside a raw relu(g)."""
    if u_encoding is None:
        u_encoding = "raw" if encoding == "raw" else "signplane"
    u_encoding = _check_encoding(u_encoding, "u_encoding")
    if u_encoding == "nosign":
        raise ValueError("u_encoding='nosign' would drop the signs of u, which is signed; use "
                         "'signplane' (the default) or 'raw'")
    return int(Encoding.SIGNPLANE if u_encoding == "auto" else Encoding.parse(u_encoding))


def gated_relu_linear(g, u, weight, bias=None, *, encoding: str = "nosign",
                      u_encoding: str | None = None, density: float | None = None,
                      policy: CapacityPolicy | None = None, recompute=None,
                      backend: str = "auto", offload=None):
    """``F.linear(torch.relu(g) * u, weight, bias)`` (ReGLU), storing relu(g) packed and
    ``u`` only where ``g > 0`` (``u_encoding`` defaults to ``signplane``, or ``raw``
    when ``encoding='raw'``), at a fixed capacity, with no host sync.

    ``recompute=(x, w_gate, b_gate, w_up, b_up)``, what made ``g`` and ``u``, lets a
    batch that overflows the capacity recompute both exactly in backward; without it
    such a backward waits for the pack's count and raises on overflow
    (:func:`gated_relu_ffn` and :class:`PackedReGLUFFN` always pass it). ``offload``: as
    for :func:`relu_linear` (both blocks).
    """
    _check_input(g, "g")
    _check_input(u, "u")
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        raise ValueError(f"gate and up must match: {g.dtype}{tuple(g.shape)} on {g.device} "
                         f"vs {u.dtype}{tuple(u.shape)} on {u.device}")
    encoding = _check_encoding(encoding)
    u_enc = _u_encoding_id(encoding, u_encoding)
    device_type = _device_type(g)
    _check_backend(backend, device_type)
    mm = _autocast_dtype(device_type)
    weight, bias = _autocast(weight, mm), _autocast(bias, mm)
    mm_dtype = mm if mm is not None and g.dtype != mm else None
    x, wg, bg, wu, bu = recompute if recompute is not None else (None,) * 5
    g, u = g.contiguous(), u.contiguous()
    pol = policy if policy is not None else _shared_policy(density, g.shape, g.dtype, "gated")
    traced = _traced()
    capacity = pol.traced_capacity(g.numel()) if traced else pol.capacity(g.numel())
    enc = _encoding_id(encoding)
    off = _offloader(offload, traced, device_type)
    args = (g, u, weight, bias, x, wg, bg, wu, bu, capacity, enc, u_enc, DEFAULT_CHUNK_LOG2,
            mm_dtype, pol.id, off)
    if x is not None and off is None and not traced and _no_modes(args, 9):
        # the C++ host path (CUDA; None where it does not apply)
        out = _native.gated_relu_linear(g, u, weight, bias, x, wg, bg, wu, bu, capacity, enc,
                                        u_enc, mm_dtype, pol)
        if out is not None:
            return out
    if traced:
        out, _, _ = GatedReLULinearFunction.apply(*args)
    else:   # see relu_linear
        out, _, _ = _GATED_APPLY(*args)
    return out


def _linear_outside_autocast(mm, *linears):
    """``F.linear(x, w, b)`` of each ``(x, w, b)``, on arguments already cast the way
    autocast would (``mm``: its dtype, None where autocast is off: the context manager
    then costs more than the calls), in one autocast-off context."""
    if mm is None:
        return [F.linear(x, w, b) for x, w, b in linears]
    with torch.autocast(linears[0][0].device.type, enabled=False):
        return [F.linear(x, w, b) for x, w, b in linears]


def relu_ffn(x, w1, b1, w2, b2, *, square: bool = False, encoding: str = "nosign",
             density: float | None = None, policy: CapacityPolicy | None = None,
             backend: str = "auto", offload=None):
    """``relu(x W1ᵀ + b1) W2ᵀ + b2`` (ReLU² when ``square``) with the activation stored
    packed: no host sync, exact on every batch (an overflowing one recomputes the
    activation from ``x`` in backward with the forward's own GEMM)."""
    mm = _autocast_dtype(_device_type(x))
    if mm is not None:
        # The casts autocast's linear would make, made explicitly so the recompute
        # sees exactly the tensors the first GEMM used (and saves nothing new).
        x, w1, b1 = _autocast(x, mm), _autocast(w1, mm), _autocast(b1, mm)
        a, = _linear_outside_autocast(mm, (x, w1, b1))
    else:
        a = None
        # the trace check first: dynamo reads it, and must not see the extension's call
        if offload is None and backend == "auto" and not _traced():
            if policy is None and x.dim():   # relu_linear's shared policy, a's shape ahead
                policy = _shared_policy(density, (*x.shape[:-1], w1.shape[0]), x.dtype,
                                        bool(square))
            if policy is not None:
                out, a = _eager_call(x, w1, b1, w2, b2, square, encoding, policy)
                if out is not None:
                    return out
        if a is None:
            a = F.linear(x, w1, b1)
    return relu_linear(a, w2, b2, square=square, encoding=encoding, density=density,
                       policy=policy, recompute=(x, w1, b1), backend=backend, offload=offload)


def gated_relu_ffn(x, w_gate, b_gate, w_up, b_up, w2, b2, *, encoding: str = "nosign",
                   u_encoding: str | None = None, density: float | None = None,
                   policy: CapacityPolicy | None = None, backend: str = "auto", offload=None):
    """``(relu(x Wgᵀ + bg) * (x Wuᵀ + bu)) W2ᵀ + b2`` with both activations stored packed:
    no host sync, exact on every batch (an overflowing one recomputes both from ``x``
    in backward with the forward's own GEMMs)."""
    mm = _autocast_dtype(_device_type(x))
    xg = xu = x
    if mm is not None:
        # One cast of x per GEMM, as autocast makes them: x's two gradients then meet in
        # x's own dtype, as in the dense FFN. The casts hold the same bits, so the
        # recompute needs only one of them.
        xg, xu = _autocast(x, mm), _autocast(x, mm)
        w_gate, b_gate, w_up, b_up = (_autocast(t, mm) for t in (w_gate, b_gate, w_up, b_up))
    g, u = _linear_outside_autocast(mm, (xg, w_gate, b_gate), (xu, w_up, b_up))
    return gated_relu_linear(g, u, w2, b2, encoding=encoding, u_encoding=u_encoding,
                             density=density, policy=policy,
                             recompute=(xg, w_gate, b_gate, w_up, b_up), backend=backend,
                             offload=offload)
