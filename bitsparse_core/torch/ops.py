"""The PyTorch custom ops of the packed-activation path (namespace ``bitsparse``).

``bitsparse::relu_linear`` computes ``F.linear(relu(a), W, b)`` (``relu(a)**2``
when ``square``) and returns, beside the output, the packed ``relu(a)`` at a fixed
capacity as ONE uint8 block (the layout of :func:`..backends.cuda.host.pack_plan`).
The pack's *ticket* for its device-side counters (:mod:`.capacity`) is kept beside the
block, not returned: every output is on the input's device (a CPU output would keep the op
out of inductor's CUDA graphs).
``bitsparse::relu_linear_backward`` takes the block back: where the ticket shows the
pack clean, it unpacks (and runs the fused activation gradient); where it shows
an overflow, it recomputes the activation from the FFN input with the same GEMM as
the forward, so the gradients are bit-identical in every case. Where the count has
not come back yet (the host is ahead of the GPU), the call site's policy either
watches the pinned slot until it lands or recomputes (``CapacityPolicy.pending``).
Inside a CUDA graph capture the host cannot know the count: the C++ path's backward
lets the device pick between the two (a conditional node), the Python path recomputes.
No CUDA synchronize is made.

Each op has a fake (meta) implementation, shapes from the format's layout at the
given capacity, so ``torch.compile`` traces them without a graph break; the
autograd formula joining the two is ``functional.ReLULinearFunction``. CUDA tensors go to the
kernels through :mod:`..backends.cuda.host` by pointer, on torch's current stream,
with memory from torch's caching allocator; CPU tensors through the NumPy
reference codec.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .. import dtypes as _dt
from ..backends import get_backend
from ..backends.cuda import abi, host
from ..backends.cuda.interop import torch_stream
from ..errors import CapacityOverflowError, EncodingError, UnsupportedTransformError
from ..packed import PackedTensor
from ..spec import format as _fmt
from ..spec import ops as reference_ops
from ..spec.codec import pack_array
from ..spec.format import DEFAULT_CHUNK_LOG2, Encoding
from . import _bridge as B
from . import capacity as C



_PLANS: dict = {}
_MAX_PLANS = 4096


def _plan_of(mode: abi.Mode, a_shape, dtype: torch.dtype, capacity: int, encoding: int,
             chunk_log2: int) -> host.PackPlan:
    """The pack plan of a call, looked up by a key that is cheap to hash."""
    key = (mode, tuple(a_shape), dtype, capacity, encoding, chunk_log2)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:   # shapes that vary step by step: start afresh
            _PLANS.clear()
        plan = _PLANS[key] = host.pack_plan(tuple(int(s) for s in a_shape), B.TORCH_TO_BS[dtype],
                                            Encoding(encoding), int(capacity), int(chunk_log2),
                                            mode)
    return plan


def _plan(a_shape, dtype: torch.dtype, capacity: int, square: bool, encoding: int,
          chunk_log2: int) -> host.PackPlan:
    mode = abi.Mode.RELU2 if square else abi.Mode.RELU
    return _plan_of(mode, a_shape, dtype, capacity, encoding, chunk_log2)


def _gate_plan(a_shape, dtype: torch.dtype, capacity: int, encoding: int,
               chunk_log2: int) -> host.PackPlan:
    """relu(g)'s plan in a gated op: ReLU's layout, whose CUDA pack also writes relu(g) * u."""
    return _plan_of(abi.Mode.RELU_GATED, a_shape, dtype, capacity, encoding, chunk_log2)


def _block_nbytes(mode: abi.Mode, a_shape, dtype: torch.dtype, capacity, encoding: int,
                  chunk_log2: int):
    """A block's bytes at ``capacity`` for the fake kernels. Under torch.compile an adaptive
    capacity is symbolic (:meth:`.capacity.CapacityPolicy.traced_capacity`): the values
    and signs are the block's last sections, so its size is the plan's at capacity 0
    plus theirs, the size formula's arithmetic on the symbol (any other int-like too)."""
    if type(capacity) is int:
        return _plan_of(mode, a_shape, dtype, capacity, encoding, chunk_log2).nbytes
    empty = _plan_of(mode, a_shape, dtype, 0, encoding, chunk_log2)
    bs_dtype, enc = B.TORCH_TO_BS[dtype], Encoding(encoding)
    return (empty.nbytes + _fmt.align(_fmt.values_nbytes(bs_dtype, enc, capacity))
            + _fmt.align(_fmt.signs_nbytes(enc, capacity)))


def plain_plan(shape, dtype: torch.dtype, capacity: int, encoding: int) -> host.PackPlan:
    """The plan of a plain pack (no activation fused) at a fixed capacity."""
    return _plan_of(abi.Mode.PACK, shape, dtype, capacity, encoding, DEFAULT_CHUNK_LOG2)


def _stream(device: torch.device) -> int:
    return torch_stream(device.index)


# --------------------------------------------------------------------------- #
# The block as a PackedTensor view (the CPU path and tests)                   #
# --------------------------------------------------------------------------- #
def block_view(block: torch.Tensor, plan: host.PackPlan) -> PackedTensor:
    """A numpy-backend PackedTensor viewing a CPU block's planes (no copy)."""
    raw = block.numpy()
    planes = [raw[off:off + n] for off, n in plan.spans]
    planes[1] = planes[1].view(f"<u{plan.lay.offset_width}")
    status, nnz = _host_status(block, plan)
    lay = plan.lay
    return PackedTensor(lay.shape, lay.dtype, lay.encoding, lay.chunk_log2, lay.capacity, *planes,
                        backend=get_backend("numpy"), device=("cpu", 0), _nnz=nnz)


def _host_status(block: torch.Tensor, plan: host.PackPlan):
    raw = block.numpy()[plan.status_offset:plan.status_offset + 16]
    return int(raw[:4].view(np.uint32)[0]), int(raw[8:].view(np.uint64)[0])


def _pack_cpu(a: torch.Tensor, plan: host.PackPlan, square: bool):
    lay = plan.lay
    y, p = reference_ops.relu_pack(_to_numpy(a, lay.dtype), lay.dtype, square=square,
                                   encoding=lay.encoding, chunk_log2=lay.chunk_log2,
                                   capacity=lay.capacity)
    status = abi.STATUS_OVERFLOW if p.nnz > lay.capacity else 0
    return _from_numpy(y, a.dtype, a.shape), _host_block(plan, p, status, p.nnz)


def _host_block(plan: host.PackPlan, p: Optional[PackedTensor], status: int,
                nnz: int) -> torch.Tensor:
    """A CPU block laid out by ``plan`` holding ``p``'s planes (none: its data is unusable,
    only the status area says why) and the status area the kernel would write."""
    block = torch.zeros(plan.nbytes, dtype=torch.uint8, device="cpu")
    raw = block.numpy()
    if p is not None:
        for (off, n), plane in zip(plan.spans, (p.mask, p.offsets, p.values, p.signs)):
            raw[off:off + n] = np.asarray(plane).view(np.uint8).reshape(-1)[:n]
    raw[plan.status_offset:plan.status_offset + 4] = np.array([status], np.uint32).view(np.uint8)
    raw[plan.status_offset + 8:plan.status_offset + 16] = np.array([nnz], np.uint64).view(np.uint8)
    return block


def _plain_pack_cpu(a: torch.Tensor, plan: host.PackPlan) -> torch.Tensor:
    """The block the plain pack kernel makes, from the NumPy reference: a value with its
    sign bit set under nosign is a violation (status bit, data unusable), as on the GPU."""
    lay = plan.lay
    arr = _to_numpy(a, lay.dtype)
    bits = arr.reshape(-1).view(lay.dtype.uint)
    nnz = int(np.count_nonzero(bits))
    status = abi.STATUS_OVERFLOW if nnz > lay.capacity else 0
    if lay.encoding == Encoding.NOSIGN and np.any(bits >> (lay.dtype.bits - 1)):
        return _host_block(plan, None, status | abi.STATUS_NOSIGN_VIOLATION, nnz)
    p = pack_array(arr, lay.dtype, lay.encoding, chunk_log2=lay.chunk_log2,
                   capacity=lay.capacity)
    return _host_block(plan, p, status, nnz)


def _to_numpy(t: torch.Tensor, dtype: _dt.DType) -> np.ndarray:
    """A CPU tensor's bits as a NumPy array of the format dtype (no copy)."""
    return B.bits_view(t.detach().contiguous()).numpy().view(dtype.numpy)


def _from_numpy(arr, dtype: torch.dtype, shape) -> torch.Tensor:
    """A NumPy result as a torch tensor of ``dtype`` (through its bits: NumPy has no
    bf16 / fp8 torch can take)."""
    bits = np.ascontiguousarray(arr).view(f"i{dtype.itemsize}")
    return torch.from_numpy(bits).view(dtype).view(shape)


# --------------------------------------------------------------------------- #
# CUDA: the kernels by pointer on torch's current stream                      #
# --------------------------------------------------------------------------- #
def _pack_cuda(a: torch.Tensor, plan: host.PackPlan, u: Optional[torch.Tensor] = None):
    """``(y, block, ticket)``: y is relu(a) (squared for RELU2, times ``u`` for
    RELU_GATED); the pack kernel writes its status and count into a pinned slot (none
    while a graph is captured)."""
    device = a.device
    stream = _stream(device)
    numel, item = a.numel(), a.element_size()
    yelems = -(-numel * item // 16) * 16 // item
    # The pack's scratch rides at the end of y's allocation: it is dead once the
    # kernels have run, and y is freed right after the second GEMM.
    ystore = torch.empty(yelems + -(-plan.scratch_bytes // item), dtype=a.dtype, device=device)
    block = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    yptr = ystore.data_ptr()
    ticket = _enqueue_pack(a, plan, block, stream, yptr + yelems * item, C.claim_slot(), yptr,
                           u=u)
    return ystore.as_strided(a.shape, a.stride()), block, ticket


def _enqueue_pack(a: torch.Tensor, plan: host.PackPlan, block: torch.Tensor, stream: int,
                  scratch: int, claimed, y: int = 0, u: Optional[torch.Tensor] = None):
    """Queue the pack of ``a`` into ``block`` on ``stream``, the kernel writing its status
    and count into the slot ``claimed`` (:func:`.capacity.claim_slot`: ``(address,
    ticket)``, address 0 for none; the slot reads pending until both land); returns the
    ticket (whatever names the slot to the caller: a tensor, or a slot key)."""
    slot, ticket = claimed
    # zero_tail=False: nothing reads a block's value slots past its count (the block is
    # never serialized), so the fixed-capacity zeroing of the public pack is skipped.
    host.enqueue_pack(plan, a.device.index, stream, a.data_ptr(), block.data_ptr(), scratch, y,
                      zero_tail=False, slot=slot, u=u.data_ptr() if u is not None else 0)
    return ticket


def plain_block_bytes(plan: host.PackPlan, cuda: bool) -> int:
    """The device (or host) bytes :func:`pack_plain`'s block holds while it lives."""
    return plan.nbytes + (plan.scratch_bytes if cuda else 0)


def pack_plain(a: torch.Tensor, plan: host.PackPlan):
    """``(block, key, known)``: ``a`` packed by ``plan`` (mode PACK) without a sync, for the
    saved-tensor hooks. On CUDA ``known`` is None and the slot ``key`` (``(index,
    generation)`` in :data:`.capacity.SLAB`) receives the status and count (the kernel
    writes them there); where every pinned slot is in flight (or a graph is being
    captured) nothing is queued and ``block`` is None: a pack whose count cannot come
    back is of no use to the hooks. On CPU the NumPy reference packs at once, ``known``
    is its ``(status, nnz)`` and ``key`` is ``(HOST_FINAL, 0)``."""
    if a.device.type != "cuda":
        block = _plain_pack_cpu(a, plan)
        return block, (C.HOST_FINAL, 0), _host_status(block, plan)
    slot, i, gen = C.claim_slot_key()
    if not slot:
        return None, (i, gen), None
    # One allocation per op: the pack's scratch (dead once the kernel ran; about 1 % of
    # the block at 90 % zeros, kept while the block lives) rides behind the block, a view
    # of the allocation's first nbytes.
    whole = torch.empty(plan.nbytes + plan.scratch_bytes, dtype=torch.uint8, device=a.device)
    block = whole[:plan.nbytes]
    return block, _enqueue_pack(a, plan, block, _stream(a.device),
                                block.data_ptr() + plan.nbytes, (slot, (i, gen))), None


def _unpack_cuda(block: torch.Tensor, plan: host.PackPlan, op: abi.Op, out: torch.Tensor,
                 grad: Optional[torch.Tensor] = None, planes: Optional[host.Planes] = None,
                 **gated) -> None:
    """Queue an unpack-family kernel over ``block`` (``planes``: its planes where they
    are not the plan's own, a masked companion's; ``gated``: out2 / pu / u_encoding)."""
    dev = block.get_device()
    stream = torch_stream(dev)
    lay = plan.lay
    planes = planes or plan.planes(block.data_ptr())
    nprefix = host.prefix_scratch_bytes(lay, op)
    if not nprefix:
        host.enqueue_unpack(lay, planes, op, dev, stream, out.data_ptr(),
                            grad=grad.data_ptr() if grad is not None else 0, **gated)
        return
    # Chunks larger than a tile: per-tile counts, summed by torch on the same stream.
    prefix = torch.empty(nprefix // 8, dtype=torch.int64, device=block.device)

    def scan(ptr: int, n: int) -> None:
        counts = prefix[1:n + 1]
        counts.copy_(torch.cumsum(counts, 0))

    host.enqueue_unpack(lay, planes, op, dev, stream, out.data_ptr(),
                        grad=grad.data_ptr() if grad is not None else 0,
                        prefix=prefix.data_ptr(), prefix_scan=scan, **gated)


# --------------------------------------------------------------------------- #
# The ops                                                                     #
# --------------------------------------------------------------------------- #
# Registered through the low-level Library API: a Python kernel straight in the
# dispatcher. torch.library.custom_op wraps each call in its autograd and
# dynamo-disable layers, ~100 us per call on the development CPU (bench/NOTES.md); the
# autograd formula lives in ReLULinearFunction (functional.py) instead.
_LIB = torch.library.Library("bitsparse", "DEF")
# The ops' outputs are all on the inputs' device (a pack's ticket stays beside its block,
# capacity.BLOCK_TICKETS), so inductor's CUDA graphs (``mode="reduce-overhead"``) capture
# them with the rest of the graph; a captured backward reads the blocks where its pack was
# clean, on the device (kernels/torch_host_graphs.h).
_LIB.define("relu_linear(Tensor a, Tensor weight, Tensor? bias, Tensor? x, Tensor? w1, "
            "Tensor? b1, SymInt capacity, int config, int policy) -> (Tensor, Tensor)")
_LIB.define("relu_linear_backward(Tensor grad_out, Tensor block, Tensor weight, "
            "Tensor? x, Tensor? w1, Tensor? b1, SymInt capacity, int config, int policy) "
            "-> (Tensor, Tensor, Tensor)")
# ``needs`` of relu_linear_backward: which gradients autograd asks for.
NEED_A, NEED_W, NEED_B = 1, 2, 4


class OpConfig(NamedTuple):
    """The static arguments of ``relu_linear`` (the first four) and of
    ``relu_linear_backward`` (all), which the ops take as one integer (:func:`op_config`):
    a compiled graph's wrapper calls each op from Python every layer, and parsing an
    argument costs host time there (a ``ScalarType`` more than an ``int``).
    ``kernels/torch_ffn_host.cpp``'s ``decode_config`` reads the same bits."""
    square: bool
    encoding: int
    chunk_log2: int
    mm_dtype: Optional[torch.dtype]
    a_dtype: Optional[torch.dtype] = None
    has_bias: bool = False
    needs: int = 0


# (field, bits), from bit 0 up; a dtype is its index in _bridge.TORCH_TO_BS, mm_dtype's
# plus one (0: None)
CONFIG_FIELDS = (("square", 1), ("encoding", 2), ("chunk_log2", 5), ("mm_dtype", 3),
                 ("a_dtype", 3), ("has_bias", 1), ("needs", 3))
_DTYPES = tuple(B.TORCH_TO_BS)
_CONFIGS: dict = {}     # config integer -> OpConfig


def op_config(square: bool, encoding: int, chunk_log2: int, mm_dtype: Optional[torch.dtype],
              a_dtype: Optional[torch.dtype] = None, has_bias: bool = False,
              needs: int = 0) -> int:
    """The integer the ops take for these arguments (:class:`OpConfig`)."""
    values = {"square": int(bool(square)), "encoding": int(encoding),
              "chunk_log2": int(chunk_log2),
              "mm_dtype": 0 if mm_dtype is None else _DTYPES.index(mm_dtype) + 1,
              "a_dtype": 0 if a_dtype is None else _DTYPES.index(a_dtype),
              "has_bias": int(bool(has_bias)), "needs": int(needs)}
    config, shift = 0, 0
    for name, bits in CONFIG_FIELDS:
        if not 0 <= values[name] < 1 << bits:
            raise ValueError(f"bitsparse: {name}={values[name]} does not fit the op config")
        config |= values[name] << shift
        shift += bits
    return config


def decode_config(config: int) -> OpConfig:
    """:func:`op_config`'s arguments back (a dtype field of 0 reads as None / the first)."""
    cfg = _CONFIGS.get(config)
    if cfg is None:
        fields, shift = {}, 0
        for name, bits in CONFIG_FIELDS:
            fields[name] = (config >> shift) & ((1 << bits) - 1)
            shift += bits
        if config >> shift:
            raise ValueError(f"bitsparse: op config {config} has bits past its fields")
        for name, index in (("mm_dtype", fields["mm_dtype"] - 1), ("a_dtype", fields["a_dtype"])):
            if index >= len(_DTYPES):
                raise ValueError(f"bitsparse: op config {config} names dtype {index} of "
                                 f"{len(_DTYPES)} ({name})")
        cfg = _CONFIGS[config] = OpConfig(
            bool(fields["square"]), fields["encoding"], fields["chunk_log2"],
            None if fields["mm_dtype"] == 0 else _DTYPES[fields["mm_dtype"] - 1],
            _DTYPES[fields["a_dtype"]], bool(fields["has_bias"]), fields["needs"])
    return cfg


IMPLS: dict = {}   # op name -> its Python kernel (functional.py calls them directly in eager)
# op name -> the CUDA kernel that stands in for its Python one: native.py's C++ host
# path, which itself runs the Python kernel where that path does not apply
CUDA_KERNELS: dict = {}


def _register(name: str):
    """Register a function as the kernel of ``bitsparse::name`` for every backend (on
    CUDA, behind :data:`CUDA_KERNELS`). It is the composite kernel, so that the C++ host
    path (:mod:`.native`) can register the op's CUDA kernel itself, which then takes
    precedence, without overriding a registration made here."""
    def deco(fn):
        def kernel(*args):
            lead = args[0]
            if lead.is_cuda:
                return CUDA_KERNELS.get(name, fn)(*args)
            if not lead.is_cpu:      # the composite kernel is also every other backend's
                B.check_device(lead.device)
            return fn(*args)
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        IMPLS[name] = fn
        return fn
    return deco


@_register("relu_linear")
def relu_linear(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                x: Optional[torch.Tensor], w1: Optional[torch.Tensor], b1: Optional[torch.Tensor],
                capacity: int, config: int, policy: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(relu(a)[**2], W, b), packed block)``; ``x, w1, b1`` (what made
    ``a = F.linear(x, w1, b1)``) are kept only for an exact recompute in backward;
    ``config``: :func:`op_config`'s square, encoding, chunk size and GEMM dtype. A CUDA
    pack's ticket is kept beside its block (:data:`.capacity.BLOCK_TICKETS`)."""
    square, encoding, chunk_log2, mm_dtype = decode_config(config)[:4]
    plan = _plan(a.shape, a.dtype, capacity, square, encoding, chunk_log2)
    pol = C.POLICIES.get(policy)
    if a.device.type == "cuda":
        y, block, ticket = _pack_cuda(a, plan)
        C.BLOCK_TICKETS.remember(block, ticket)
        known = None
    else:
        y, block = _pack_cpu(a, plan, square)
        ticket = C.fixed_ticket(C.HOST_FINAL)
        known = _host_status(block, plan)
    if pol is not None:
        pol.track(ticket, a.numel(), int(capacity), known)
    out = F.linear(y if mm_dtype is None else y.to(mm_dtype), weight, bias)
    return out, block


@torch.library.register_fake("bitsparse::relu_linear")
def _(a, weight, bias, x, w1, b1, capacity, config, policy):
    square, encoding, chunk_log2, mm_dtype = decode_config(config)[:4]
    mode = abi.Mode.RELU2 if square else abi.Mode.RELU
    nbytes = _block_nbytes(mode, a.shape, a.dtype, capacity, encoding, chunk_log2)
    out = a.new_empty((*a.shape[:-1], weight.shape[0]), dtype=mm_dtype or a.dtype)
    return out, a.new_empty((nbytes,), dtype=torch.uint8)


def block_ticket(block: torch.Tensor) -> torch.Tensor:
    """The ticket of the pack that made ``block``: a host pack's is final
    (``HOST_FINAL``), a CUDA pack's kept beside its block (``NO_SLOT`` where none is)."""
    if block.device.type != "cuda":
        return C.fixed_ticket(C.HOST_FINAL)
    return C.BLOCK_TICKETS.ticket(block)


def _state(block: torch.Tensor, ticket: torch.Tensor, plan: host.PackPlan):
    """``(status, nnz)`` of the pack, or None while the host cannot know it."""
    if ticket.tolist()[0] == C.HOST_FINAL:
        return _host_status(block, plan)
    return C.SLAB.read(ticket)


def _linear_bias_grad(grad_out, weight, has_bias: bool, needs: int):
    """``(g2, grad_b)``: the 2-D view of ``grad_out`` and PyTorch's ``linear`` bias
    gradient (empty where no bias or not asked for)."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    grad_b = (g2.sum([0], keepdim=True).view(g2.shape[-1]) if has_bias and needs & NEED_B
              else weight.new_empty((0,)))
    return g2, grad_b


def _linear_weight_grad(g2, h, mm_dtype) -> torch.Tensor:
    """``grad_W = g2ᵀ h`` on the 2-D views, ``h`` cast as the forward's GEMM had it."""
    hm = h if mm_dtype is None else h.to(mm_dtype)
    return g2.t().mm(hm.reshape(-1, hm.shape[-1]))


def _linear_input_grad(g2, weight, a_shape, a_dtype) -> torch.Tensor:
    """``grad_h = g2 W`` back in the activation's shape and dtype."""
    grad_h = g2.mm(weight).view(a_shape)
    return grad_h if grad_h.dtype == a_dtype else grad_h.to(a_dtype)


def backward_a_shape(grad_out: torch.Tensor, weight: torch.Tensor) -> list:
    """The activation's shape, from the backward's inputs: ``grad_out``'s leading dims and
    the weight's input features."""
    return [*grad_out.shape[:-1], weight.shape[1]]


@_register("relu_linear_backward")
def relu_linear_backward(grad_out: torch.Tensor, block: torch.Tensor,
                         weight: torch.Tensor, x: Optional[torch.Tensor],
                         w1: Optional[torch.Tensor], b1: Optional[torch.Tensor],
                         capacity: int, config: int, policy: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_a, grad_W, grad_b)`` of :func:`relu_linear`, repeating PyTorch's own
    ``linear`` backward on the 2-D views; a gradient not in ``needs`` (or grad_b
    without a bias) comes back empty and is not computed. ``config``: :func:`op_config`'s
    every field (the activation's dtype, the bias, the gradients asked for)."""
    square, encoding, chunk_log2, mm_dtype, a_dtype, has_bias, needs = decode_config(config)
    a_shape = backward_a_shape(grad_out, weight)
    plan = _plan(a_shape, a_dtype, capacity, square, encoding, chunk_log2)
    clean = _clean_state(block, block_ticket(block), plan, C.POLICIES.get(policy),
                         x is not None, "relu_linear")
    g2, grad_b = _linear_bias_grad(grad_out, weight, has_bias, needs)
    if clean and square and needs & NEED_A and needs & NEED_W and block.device.type == "cuda":
        # one decode gives both the input gradient and the second GEMM's input
        grad_a, h = _relu2_grad_and_square_(
            _linear_input_grad(g2, weight, a_shape, a_dtype), block, plan)
        return grad_a, _linear_weight_grad(g2, h, mm_dtype), grad_b
    grad_a = grad_out.new_empty((0,), dtype=a_dtype)
    grad_w = weight.new_empty((0,))
    # a clean gradient reads the packed block: r only for the weight gradient
    if clean and needs & NEED_W:
        r = _unpack(block, plan, a_shape, a_dtype)
    elif not clean and needs & (NEED_A | NEED_W):
        with torch.autocast(grad_out.device.type, enabled=False):
            r = torch.relu(F.linear(x, w1, b1))
    if needs & NEED_W:
        # the forward's relu(a)**2, rounded the same single way; in place where r is
        # not needed again
        grad_w = _linear_weight_grad(g2, (r.mul_(r) if clean else r * r) if square else r,
                                     mm_dtype)
        if clean:
            del r          # stream-ordered: grad_h may take its memory next
    if needs & NEED_A:
        grad_h = _linear_input_grad(g2, weight, a_shape, a_dtype)
        if clean:
            grad_a = _activation_grad_(grad_h, block, plan, square)
        elif square:
            grad_a = torch.ops.aten.threshold_backward(grad_h * (2 * r), r, 0)
        else:
            grad_a = torch.ops.aten.threshold_backward(grad_h, r, 0)
    return grad_a, grad_w, grad_b


@torch.library.register_fake("bitsparse::relu_linear_backward")
def _(grad_out, block, weight, x, w1, b1, capacity, config, policy):
    _, _, _, _, a_dtype, has_bias, needs = decode_config(config)
    a_shape = backward_a_shape(grad_out, weight)
    grad_a = grad_out.new_empty(a_shape if needs & NEED_A else (0,), dtype=a_dtype)
    grad_w = weight.new_empty(weight.shape if needs & NEED_W else (0,))
    grad_b = weight.new_empty((weight.shape[0],) if has_bias and needs & NEED_B else (0,))
    return grad_a, grad_w, grad_b


def _wait(block, ticket, plan):
    """The pack's state, waiting for it on the host (only for a relu_linear without a
    recompute source whose count has not come back)."""
    if block.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise UnsupportedTransformError(
                "a relu_linear without a recompute source cannot be captured in a CUDA graph "
                "(its backward would have to wait for the pack's count); pass "
                "recompute=(x, w1, b1) or use relu_ffn")
        torch.cuda.current_stream(block.device).synchronize()
    state = _state(block, ticket, plan)
    if state is None:   # no slot was taken (graph capture): read the block itself
        return _host_status(block.cpu(), plan)
    return state


def _unpack(block, plan, a_shape, a_dtype) -> torch.Tensor:
    if block.device.type != "cuda":
        p = block_view(block, plan)
        return _from_numpy(get_backend("numpy").unpack(p), a_dtype, a_shape)
    out = torch.empty(a_shape, dtype=a_dtype, device=block.device)
    _unpack_cuda(block, plan, abi.Op.UNPACK, out)
    return out


# The backward's fused gradients are written over ``grad_h``, the caller's own fresh
# buffer (every kernel thread reads its gradient vector before it stores there): the
# backward then holds no more activation-sized buffers than dense PyTorch's.
def _activation_grad_(grad_h, block, plan, square) -> torch.Tensor:
    """relu's (mask only) or relu²'s (2 r grad) input gradient from the packed block, in
    place of ``grad_h`` on CUDA."""
    if block.device.type != "cuda":
        p = block_view(block, plan)
        fn = reference_ops.relu2_backward if square else reference_ops.relu_backward
        return _from_numpy(fn(_to_numpy(grad_h, plan.lay.dtype), p), grad_h.dtype, grad_h.shape)
    grad_h = grad_h.contiguous()
    if square:
        _unpack_cuda(block, plan, abi.Op.RELU2, grad_h, grad=grad_h)
    else:
        host.enqueue_relu_backward(plan.lay, plan.planes(block.data_ptr()), block.device.index,
                                   _stream(block.device),
                                   grad_h.data_ptr(), grad_h.data_ptr())
    return grad_h


def _relu2_grad_and_square_(grad_h, block, plan):
    """``(grad_a, h)`` of ReLU² from one decode of a CUDA block: the input gradient (in
    place of ``grad_h``), and ``h = relu(a)²`` rounded as the forward's kernel rounded it
    (the second GEMM's input). ReLU keeps two kernels (unpack, then the mask-only
    gradient): a fused one measured slower there (bench/NOTES.md)."""
    grad_h = grad_h.contiguous()
    h = torch.empty_like(grad_h)
    _unpack_cuda(block, plan, abi.Op.RELU2_AND_SQUARE, grad_h, grad=grad_h, out2=h.data_ptr())
    return grad_h, h


# --------------------------------------------------------------------------- #
# Gated (ReGLU): relu(g) packed, u where g > 0 behind the same mask           #
# --------------------------------------------------------------------------- #
_LIB.define("gated_relu_linear(Tensor g, Tensor u, Tensor weight, Tensor? bias, Tensor? x, "
            "Tensor? wg, Tensor? bg, Tensor? wu, Tensor? bu, SymInt capacity, int encoding, "
            "int u_encoding, int chunk_log2, ScalarType? mm_dtype, int policy) "
            "-> (Tensor, Tensor, Tensor)")
_LIB.define("gated_relu_linear_backward(Tensor grad_out, Tensor block_r, Tensor block_u, "
            "Tensor weight, Tensor? x, Tensor? wg, Tensor? bg, Tensor? wu, "
            "Tensor? bu, int[] a_shape, ScalarType a_dtype, bool has_bias, SymInt capacity, "
            "int encoding, int u_encoding, int chunk_log2, ScalarType? mm_dtype, int policy, "
            "int needs) -> (Tensor, Tensor, Tensor, Tensor)")
# ``needs`` of gated_relu_linear_backward: NEED_A covers both grad_g and grad_u.


def _u_plan(a_shape, dtype: torch.dtype, capacity: int, u_encoding: int,
            chunk_log2: int) -> host.PackPlan:
    return _plan_of(abi.Mode.MASKED, a_shape, dtype, capacity, u_encoding, chunk_log2)


def _companion_planes(plan_r, block_r, plan_u, block_u) -> host.Planes:
    """u's planes: r's mask and offsets, u's own values and signs."""
    pr, pu = plan_r.planes(block_r.data_ptr()), plan_u.planes(block_u.data_ptr())
    return pr._replace(values=pu.values, values_len=pu.values_len, signs=pu.signs,
                       signs_len=pu.signs_len)


def _masked_pack_cpu(u: torch.Tensor, block_r: torch.Tensor, plan_r, plan_u) -> torch.Tensor:
    lay = plan_u.lay
    p = reference_ops.masked_pack(_to_numpy(u, lay.dtype), lay.dtype, block_view(block_r, plan_r),
                                  encoding=lay.encoding)
    block = torch.zeros(plan_u.nbytes, dtype=torch.uint8)
    raw = block.numpy()
    for (off, n), plane in zip(plan_u.spans[2:], (p.values, p.signs)):
        src = np.asarray(plane).view(np.uint8).reshape(-1)[:n]   # the first `capacity` values
        raw[off:off + src.size] = src
    return block


@_register("gated_relu_linear")
def gated_relu_linear(g, u, weight, bias, x, wg, bg, wu, bu, capacity: int, encoding: int,
                      u_encoding: int, chunk_log2: int, mm_dtype: Optional[torch.dtype],
                      policy: int):
    """``(F.linear(relu(g) * u, W, b), block of relu(g), block of u where g > 0)`` (a CUDA
    pack's ticket kept beside ``block_r``, :data:`.capacity.BLOCK_TICKETS`);
    ``x, wg, bg, wu, bu`` (what made ``g`` and ``u``) are kept only for the exact
    recompute of an overflowed pack. One capacity serves both: u stores a value exactly
    where relu(g) does."""
    plan_r = _gate_plan(g.shape, g.dtype, capacity, encoding, chunk_log2)
    plan_u = _u_plan(g.shape, g.dtype, capacity, u_encoding, chunk_log2)
    pol = C.POLICIES.get(policy)
    if g.device.type == "cuda":
        # relu(g)'s pack writes h = relu(g) * u (each product rounded once; a NaN's
        # payload as reference_ops.mul_f32 has it), reading u as g's twin
        if u.shape != g.shape or u.dtype != g.dtype or u.device != g.device:
            raise ValueError(f"gate and up must match: {g.dtype}{tuple(g.shape)} on "
                             f"{g.device} vs {u.dtype}{tuple(u.shape)} on {u.device}")
        g, u = g.contiguous(), u.contiguous()
        h, block_r, ticket = _pack_cuda(g, plan_r, u)
        C.BLOCK_TICKETS.remember(block_r, ticket)
        block_u = torch.empty(plan_u.nbytes, dtype=torch.uint8, device=g.device)
        scratch = torch.empty(max(plan_u.scratch_bytes, 1), dtype=torch.uint8, device=g.device)
        host.enqueue_pack(plan_u, g.device.index, _stream(g.device), u.data_ptr(),
                          block_u.data_ptr(), scratch.data_ptr(),
                          in_planes=plan_r.planes(block_r.data_ptr()), zero_tail=False)
        known = None
    else:
        r, block_r = _pack_cpu(g, plan_r, False)
        block_u = _masked_pack_cpu(u, block_r, plan_r, plan_u)
        ticket = C.fixed_ticket(C.HOST_FINAL)
        known = _host_status(block_r, plan_r)
        h = torch.mul(r, u)
        del r
    if pol is not None:
        pol.track(ticket, g.numel(), int(capacity), known)
    with torch.autocast(g.device.type, enabled=False):
        out = F.linear(h if mm_dtype is None else h.to(mm_dtype), weight, bias)
    return out, block_r, block_u


@torch.library.register_fake("bitsparse::gated_relu_linear")
def _(g, u, weight, bias, x, wg, bg, wu, bu, capacity, encoding, u_encoding, chunk_log2,
      mm_dtype, policy):
    r_bytes = _block_nbytes(abi.Mode.RELU, g.shape, g.dtype, capacity, encoding, chunk_log2)
    u_bytes = _block_nbytes(abi.Mode.MASKED, g.shape, g.dtype, capacity, u_encoding, chunk_log2)
    out = g.new_empty((*g.shape[:-1], weight.shape[0]), dtype=mm_dtype or g.dtype)
    return (out, g.new_empty((r_bytes,), dtype=torch.uint8),
            g.new_empty((u_bytes,), dtype=torch.uint8))


def _clean_state(block, ticket, plan, pol, recompute_source: bool, what: str) -> bool:
    """Whether a backward may read the packed values: the pack's count when it is back
    (else waited for or treated as unknown, per the policy); without a recompute source
    the host waits and an overflow raises."""
    state = _state(block, ticket, plan)
    if state is None and recompute_source and pol is not None:
        state = pol.wait(ticket)
    clean = state is not None and state[0] == 0
    if pol is not None:
        pol.poll()
    if clean:
        return True
    if not recompute_source:
        state = _wait(block, ticket, plan)
        if state[0] & abi.STATUS_NOSIGN_VIOLATION:
            raise EncodingError("nosign encoding: relu kept a negative NaN, whose sign bit "
                                "nosign cannot store; use encoding='signplane' or 'raw', or "
                                "pass recompute= (the FFN input and weights)")
        if state[0] != 0:
            raise CapacityOverflowError(
                f"{state[1]} nonzeros overflowed the capacity {plan.lay.capacity} of a {what} "
                "that has no recompute source; pass recompute= (the FFN input and weights) or "
                "use the FFN function (relu_ffn, gated_relu_ffn)")
        return True
    if pol is not None:
        pol.recomputes += 1
        pol.unknown += state is None
    return False


@_register("gated_relu_linear_backward")
def gated_relu_linear_backward(grad_out, block_r, block_u, weight, x, wg, bg, wu, bu,
                               a_shape: List[int], a_dtype: torch.dtype, has_bias: bool,
                               capacity: int, encoding: int, u_encoding: int, chunk_log2: int,
                               mm_dtype: Optional[torch.dtype], policy: int, needs: int):
    """``(grad_g, grad_u, grad_W, grad_b)`` of :func:`gated_relu_linear`: from the packed
    blocks where the pack is clean, else from ``g`` and ``u`` recomputed with the
    forward's GEMMs; PyTorch's own ``linear`` backward on the 2-D views."""
    plan_r = _gate_plan(a_shape, a_dtype, capacity, encoding, chunk_log2)
    plan_u = _u_plan(a_shape, a_dtype, capacity, u_encoding, chunk_log2)
    pol = C.POLICIES.get(policy)
    clean = _clean_state(block_r, block_ticket(block_r), plan_r, pol, x is not None,
                         "gated_relu_linear")
    g2, grad_b = _linear_bias_grad(grad_out, weight, has_bias, needs)
    grad_g = grad_u = grad_out.new_empty((0,), dtype=a_dtype)
    grad_w = weight.new_empty((0,))
    if not needs & (NEED_A | NEED_W):
        return grad_g, grad_u, grad_w, grad_b
    if not clean:
        with torch.autocast(grad_out.device.type, enabled=False):
            r = torch.relu(F.linear(x, wg, bg))
            u = F.linear(x, wu, bu)
    if needs & NEED_W:
        # a clean gradient reads the packed blocks: r * u only for the weight gradient
        if not clean:
            h = r * u
        elif block_r.device.type == "cuda":     # one kernel forms it from both blocks
            h = _gated_product(block_r, plan_r, block_u, plan_u, a_shape, a_dtype)
        else:
            h = _unpack(block_r, plan_r, a_shape, a_dtype).mul_(
                _unpack_companion(block_r, plan_r, block_u, plan_u, a_shape, a_dtype))
        grad_w = _linear_weight_grad(g2, h, mm_dtype)
        del h              # stream-ordered: the gradients may take its memory next
    if needs & NEED_A:
        grad_h = _linear_input_grad(g2, weight, a_shape, a_dtype)
        if clean:
            grad_g, grad_u = _gated_grad_(grad_h, block_r, plan_r, block_u, plan_u)
        else:   # what autograd does for relu(g) * u
            grad_g = torch.ops.aten.threshold_backward(grad_h * u, r, 0)
            grad_u = grad_h * r
    return grad_g, grad_u, grad_w, grad_b


@torch.library.register_fake("bitsparse::gated_relu_linear_backward")
def _(grad_out, block_r, block_u, weight, x, wg, bg, wu, bu, a_shape, a_dtype, has_bias,
      capacity, encoding, u_encoding, chunk_log2, mm_dtype, policy, needs):
    shape = a_shape if needs & NEED_A else (0,)
    grad_w = weight.new_empty(weight.shape if needs & NEED_W else (0,))
    grad_b = weight.new_empty((weight.shape[0],) if has_bias and needs & NEED_B else (0,))
    return (grad_out.new_empty(shape, dtype=a_dtype), grad_out.new_empty(shape, dtype=a_dtype),
            grad_w, grad_b)


def _unpack_companion(block_r, plan_r, block_u, plan_u, a_shape, a_dtype) -> torch.Tensor:
    """u where relu(g) > 0, zeros elsewhere."""
    if block_r.device.type != "cuda":
        pu = _companion_view(block_r, plan_r, block_u, plan_u)
        return _from_numpy(get_backend("numpy").unpack(pu), a_dtype, a_shape)
    out = torch.empty(a_shape, dtype=a_dtype, device=block_r.device)
    _unpack_cuda(block_u, plan_u, abi.Op.UNPACK, out,
                 planes=_companion_planes(plan_r, block_r, plan_u, block_u))
    return out


def _companion_view(block_r, plan_r, block_u, plan_u) -> PackedTensor:
    """A numpy-backend PackedTensor of u's CPU block, sharing r's mask and offsets."""
    p_r = block_view(block_r, plan_r)
    raw = block_u.numpy()
    (vo, vn), (so, sn) = plan_u.spans[2:]
    lay = plan_u.lay
    return PackedTensor(lay.shape, lay.dtype, lay.encoding, lay.chunk_log2, lay.capacity,
                        p_r.mask, p_r.offsets, raw[vo:vo + vn], raw[so:so + sn],
                        backend=get_backend("numpy"), device=("cpu", 0), _nnz=p_r.nnz,
                        extra={"shares_mask": True})


def _gated_grad_(grad_h, block_r, plan_r, block_u, plan_u):
    """``(grad_g, grad_u)`` from the packed blocks, grad_g in place of ``grad_h`` on CUDA."""
    if block_r.device.type != "cuda":
        p_r = block_view(block_r, plan_r)
        p_u = _companion_view(block_r, plan_r, block_u, plan_u)
        gg, gu = reference_ops.gated_backward(_to_numpy(grad_h, plan_r.lay.dtype), p_r, p_u)
        return (_from_numpy(gg, grad_h.dtype, grad_h.shape),
                _from_numpy(gu, grad_h.dtype, grad_h.shape))
    grad_h = grad_h.contiguous()
    gu = torch.empty_like(grad_h)
    _unpack_cuda(block_r, plan_r, abi.Op.GATED, grad_h, grad=grad_h, out2=gu.data_ptr(),
                 pu=_companion_planes(plan_r, block_r, plan_u, block_u),
                 u_encoding=plan_u.lay.encoding)
    return grad_h, gu


def _gated_product(block_r, plan_r, block_u, plan_u, a_shape, a_dtype) -> torch.Tensor:
    """``h = relu(g) * u`` from both CUDA blocks in one kernel, the second GEMM's input. It
    equals the forward's h (each rounded by ``reference_ops.mul_f32``'s rule) except where
    u was infinite or NaN and g <= 0: the forward's h is NaN there, this one +0 (u is not
    stored there)."""
    h = torch.empty(a_shape, dtype=a_dtype, device=block_r.device)
    _unpack_cuda(block_r, plan_r, abi.Op.GATED_PRODUCT, h,
                 pu=_companion_planes(plan_r, block_r, plan_u, block_u),
                 u_encoding=plan_u.lay.encoding)
    return h


def BENCH_CASES(shape, dtype, device):
    """Zero-argument callables of each op on fresh inputs (bench/host_overhead.py)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = (torch.randn(shape, device=device, generator=gen) - 1.28).to(dtype)
    d = shape[-1]
    w = (torch.randn((64, d), device=device, generator=gen) / d ** 0.5).to(dtype)
    cap = int(0.15 * a.numel())
    enc = int(Encoding.NOSIGN)
    op, op_backward = torch.ops.bitsparse.relu_linear, torch.ops.bitsparse.relu_linear_backward
    config = op_config(True, enc, 12, None)
    out, block = op(a, w, None, None, None, None, cap, config, 0)
    g = torch.randn_like(out)
    plan = _plan(a.shape, a.dtype, cap, True, enc, 12)
    y = torch.empty_like(a)
    return {
        "relu_pack": lambda: _pack_cuda(a, plan),
        "unpack": lambda: _unpack_cuda(block, plan, abi.Op.UNPACK, y),
        "relu2_backward": lambda: _unpack_cuda(block, plan, abi.Op.RELU2, y, grad=a),
        "relu_linear": lambda: op(a, w, None, None, None, None, cap, config, 0),
        "relu_linear_backward": lambda: op_backward(
            g, block, w, None, None, None, cap,
            op_config(True, enc, 12, None, a.dtype, False, NEED_A | NEED_W), 0),
    }
