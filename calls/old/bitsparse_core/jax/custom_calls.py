"""The project's pack and unpack kernels as XLA custom calls (``jax.ffi``): the FFN ops'
``impl="ffi"`` path.

Three targets, each registered for ``cuda`` and ``cpu``:

``bitsparse_relu_pack``  ``a [, u]`` -> ``mask, offsets, values, signs, status``
    ``[, u values, u signs, u status], scratch``: ``pack(relu(a))`` at a fixed capacity
    and, for the gated FFN, ``u``'s values at its mask (a masked pack). On CUDA the
    fused pack kernel (mode RELU, writing the planes only) and the masked pack kernel,
    queued on XLA's stream through :mod:`bitsparse_core.backends.cuda.host`; ``scratch``
    is theirs, a result only so that XLA allocates it.
``bitsparse_unpack``     ``mask, offsets, values, signs`` -> the dense tensor.
``bitsparse_relu_backward``  ``grad, mask`` -> ReLU's input gradient: ``grad`` where the
    mask's bit is set, else zero (the mask-select kernel). It reads the mask plane as it
    is, so XLA keeps no decoded form of the mask in memory.

On CPU the handlers run the NumPy reference functions on host memory: the same planes,
through the same custom-call plumbing, so CI tests the FFI path without a GPU.

Planes are the format's sections at the layout's lengths, each rounded up to a whole
4-byte word with zeros (the kernels store words); the status result is the GPU status
area (u32 status bits, u32 pad, u64 count). Leading dimensions beyond the block's index
independent packs (``vmap`` with ``broadcast_all``: the FFN ops' ``shards``).
Shapes come from static attributes and the operands' dims, never from data.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .. import dtypes as _dt
from ..backends.cuda import abi, host
from ..errors import InputError
from ..spec import format as _fmt
from ..spec.format import Encoding
from . import xla_ffi
from .codec import NAN_ABOVE

PACK_TARGET = "bitsparse_relu_pack"
UNPACK_TARGET = "bitsparse_unpack"
RELU_BACKWARD_TARGET = "bitsparse_relu_backward"
STATUS_WORDS = abi.STATUS_BYTES // 4
_WORD = 4


def _words(n: int) -> int:
    """Bytes of ``n`` rounded up to whole 4-byte words."""
    return -(-n // _WORD) * _WORD


@dataclass(frozen=True)
class PlaneSpec:
    """The result lengths of one block's pack (bytes, word-rounded; offsets: entries)."""
    mask: int
    offsets: int
    values: int
    signs: int
    u_values: int
    u_signs: int
    scratch: int


@functools.lru_cache(maxsize=1024)
def plane_spec(shape: tuple, dtype: _dt.DType, encoding: Encoding, capacity: int,
               chunk_log2: int, u_encoding: Encoding | None) -> PlaneSpec:
    lay = _fmt.cached_layout(shape, dtype, encoding, capacity, chunk_log2)
    scratch = host.pack_scratch_bytes(lay.numel, dtype)   # relu_pack's, and a masked pack's
    u_values = u_signs = 0
    if u_encoding is not None:
        ulay = _fmt.cached_layout(shape, dtype, u_encoding, capacity, chunk_log2)
        u_values, u_signs = _words(ulay.values[1]), _words(ulay.signs[1])
    return PlaneSpec(_words(lay.mask[1]), lay.n_chunks + 1, _words(lay.values[1]),
                     _words(lay.signs[1]), u_values, u_signs, max(scratch, _WORD))


# --------------------------------------------------------------------------- #
# The JAX side: result shapes, attributes, ffi_call                           #
# --------------------------------------------------------------------------- #
def _u8(n):
    return jax.ShapeDtypeStruct((n,), jnp.uint8)


def relu_pack(a, *, capacity: int, encoding: Encoding, chunk_log2: int, u=None,
              u_encoding: Encoding | None = None):
    """The planes of ``pack(relu_bits(a))`` (and of ``u`` at its mask) as arrays:
    ``(mask, offsets, values, signs, status[, u_values, u_signs, u_status])``, with
    ``status`` the int32 status word of :class:`~bitsparse_core.jax.codec.JaxPacked`."""
    register()
    dtype = _dt.resolve(jnp.dtype(a.dtype))
    if u is not None and (jnp.dtype(u.dtype) != jnp.dtype(a.dtype) or u.shape != a.shape):
        raise InputError(f"u is {u.dtype}{tuple(u.shape)}, a is {a.dtype}{tuple(a.shape)}")
    if _fmt.offset_width(_fmt.numel_of(a.shape)) != 4:
        raise InputError(f"a block of {_fmt.numel_of(a.shape)} elements: the FFI path packs "
                         "fewer than 2**32 per block (use PackConfig(shards=...))")
    spec = plane_spec(tuple(a.shape), dtype, encoding, capacity, chunk_log2,
                      u_encoding if u is not None else None)
    results = [_u8(spec.mask), jax.ShapeDtypeStruct((spec.offsets,), jnp.uint32),
               _u8(spec.values), _u8(spec.signs),
               jax.ShapeDtypeStruct((STATUS_WORDS,), jnp.uint32)]
    if u is not None:
        results += [_u8(spec.u_values), _u8(spec.u_signs),
                    jax.ShapeDtypeStruct((STATUS_WORDS,), jnp.uint32)]
    results.append(_u8(spec.scratch))
    call = jax.ffi.ffi_call(PACK_TARGET, results, vmap_method="broadcast_all")
    operands = (a,) if u is None else (a, u)
    out = call(*operands, capacity=np.int64(capacity), chunk_log2=np.int32(chunk_log2),
               encoding=np.int32(int(encoding)),
               u_encoding=np.int32(int(u_encoding) if u is not None else -1),
               block_ndim=np.int32(a.ndim))
    planes = list(out[:-1])
    planes[4] = _status_word(planes[4])
    if u is not None:
        planes[7] = _status_word(planes[7])
    return tuple(planes)


def _status_word(area):
    """The JAX codec's status: the nosign bit of the status area's first word (its
    overflow bit is read from the offsets, as the JAX codec does)."""
    return (area[0] & jnp.uint32(abi.STATUS_NOSIGN_VIOLATION)).astype(jnp.int32)


def unpack(mask, offsets, values, signs, *, shape: tuple, dtype: _dt.DType,
           encoding: Encoding, capacity: int, chunk_log2: int):
    """The dense tensor of the planes (values past ``capacity`` read as zero: callers
    guard overflow as the JAX codec's ``decode_dense`` callers do)."""
    register()
    call = jax.ffi.ffi_call(UNPACK_TARGET, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype.numpy)),
                            vmap_method="broadcast_all")
    return call(mask, offsets, values, signs, capacity=np.int64(capacity),
                chunk_log2=np.int32(chunk_log2), encoding=np.int32(int(encoding)))


def relu_backward(grad, mask, *, encoding: Encoding, capacity: int, chunk_log2: int):
    """ReLU's input gradient from the mask plane alone: ``grad`` where the bit is set,
    else zero (complete after an overflow too: the mask always is). ``grad`` has the
    packed tensor's shape and dtype; the layout arguments are the pack's."""
    register()
    call = jax.ffi.ffi_call(RELU_BACKWARD_TARGET, jax.ShapeDtypeStruct(grad.shape, grad.dtype),
                            vmap_method="broadcast_all")
    return call(grad, mask, capacity=np.int64(capacity), chunk_log2=np.int32(chunk_log2),
                encoding=np.int32(int(encoding)))


def blockwise(fn, *args):
    """``fn(*args)`` for ``fn`` batched over the leading axis of every operand and result
    (independent packs), telling XLA's SPMD partitioner so: each device runs ``fn`` on
    its own blocks and nothing is gathered (a custom call is otherwise opaque to the
    partitioner, which would replicate its operands)."""
    from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec

    out_avals = jax.eval_shape(fn, *args)
    names = iter(f"d{k}" for k in range(10_000))

    def mapping(aval):
        return ("b",) + tuple(next(names) for _ in aval.shape[1:])

    leaves = jax.tree_util.tree_leaves
    rule = SdyShardingRule(tuple(mapping(a) for a in leaves(args)),
                           tuple(mapping(a) for a in leaves(out_avals)))

    def keep_blocks(mesh, arg_shapes, result_shape):
        first = leaves(arg_shapes)[0].sharding
        axis = first.spec[0] if len(first.spec) else None

        def on_blocks(a):
            return NamedSharding(mesh, PartitionSpec(axis, *[None] * (a.ndim - 1)))
        return (jax.tree_util.tree_map(on_blocks, result_shape),
                jax.tree_util.tree_map(on_blocks, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        results, operands = keep_blocks(mesh, arg_shapes, result_shape)
        return mesh, fn, results, operands

    def body(*operands):           # a plain signature for custom_partitioning to bind
        return fn(*operands)

    call = custom_partitioning(body)
    call.def_partition(partition=partition,
                       infer_sharding_from_operands=lambda *a: keep_blocks(*a)[0],
                       sharding_rule=rule)
    return call(*args)


def chunk_supported(shape: tuple, dtype: _dt.DType, chunk_log2: int) -> bool:
    """Whether the unpack kernel decodes this chunk size without a prefix scan of tile
    counts (chunks no longer than its tile; the default size always is)."""
    tile = abi.tile_elems(dtype, abi.unpack_rounds(dtype, abi.Op.UNPACK))
    return (1 << chunk_log2) <= tile or _fmt.numel_of(shape) == 0


# --------------------------------------------------------------------------- #
# The handlers                                                                #
# --------------------------------------------------------------------------- #
_DTYPE_OF_CODE = {code: name for name, code in xla_ffi.DTYPE_CODES.items()}


def _block(frame_buffer, ndim: int):
    """(block shape, number of blocks) of an operand whose trailing ``ndim`` dims are
    one pack's."""
    shape = frame_buffer.shape
    if len(shape) < ndim:
        raise xla_ffi.HandlerError(f"operand of rank {len(shape)} is below the block's "
                                   f"{ndim}", invalid=True)
    lead = shape[:len(shape) - ndim]
    return tuple(shape[len(shape) - ndim:]), math.prod(lead)


def _pack_handler(engine):
    def handle(frame: xla_ffi.CallFrame) -> None:
        at = frame.attrs
        a = frame.args[0]
        dtype = _dt.resolve(_DTYPE_OF_CODE[a.dtype])
        shape, blocks = _block(a, at["block_ndim"])
        enc = Encoding(at["encoding"])
        uenc = Encoding(at["u_encoding"]) if len(frame.args) > 1 else None
        spec = plane_spec(shape, dtype, enc, at["capacity"], at["chunk_log2"], uenc)
        engine.pack(frame, shape, dtype, enc, uenc, at["capacity"], at["chunk_log2"], spec,
                    blocks)
    return handle


def _unpack_handler(engine):
    def handle(frame: xla_ffi.CallFrame) -> None:
        at = frame.attrs
        out = frame.rets[0]
        dtype = _dt.resolve(_DTYPE_OF_CODE[out.dtype])
        mask = frame.args[0]
        shape, blocks = _block(out, len(out.shape) - (len(mask.shape) - 1))
        lay = _fmt.cached_layout(shape, dtype, Encoding(at["encoding"]), at["capacity"],
                                 at["chunk_log2"])
        engine.unpack(frame, lay, blocks)
    return handle


def _relu_backward_handler(engine):
    def handle(frame: xla_ffi.CallFrame) -> None:
        at = frame.attrs
        out = frame.rets[0]
        dtype = _dt.resolve(_DTYPE_OF_CODE[out.dtype])
        shape, blocks = _block(out, len(out.shape) - (len(frame.args[1].shape) - 1))
        lay = _fmt.cached_layout(shape, dtype, Encoding(at["encoding"]), at["capacity"],
                                 at["chunk_log2"])
        engine.relu_backward(frame, lay, blocks)
    return handle


def _strides(*buffers):
    """Bytes from one block's plane to the next's, per buffer."""
    return [b.row_bytes for b in buffers]


class _CudaEngine:
    """Queues the kernels on XLA's stream: never allocates, never synchronizes."""

    def pack(self, frame, shape, dtype, enc, uenc, capacity, chunk_log2, spec, blocks):
        device, stream = frame.device_ordinal, frame.stream
        plan = host.pack_plan(shape, dtype, enc, capacity, chunk_log2, abi.Mode.RELU)
        uplan = (None if uenc is None else
                 host.pack_plan(shape, dtype, uenc, capacity, chunk_log2, abi.Mode.MASKED))
        rets = frame.rets
        strides = _strides(*rets)
        elem = dtype.itemsize * _fmt.numel_of(shape)
        # The kernel stores the mask bytewise up to its last element; the rest of the
        # plane's last word is zeroed so that every result byte is defined.
        mask_len = plan.spans[0][1]
        mask_pad = -mask_len % 4
        with _OnDevice(device):
            for i in range(blocks):
                p = [r.data + i * s for r, s in zip(rets, strides)]
                host.enqueue_pack_planes(plan, device, stream, frame.args[0].data + i * elem,
                                         p[0], p[1], p[2], p[3], p[4], p[-1])
                if mask_pad and mask_len:
                    host.driver.memset0(p[0] + mask_len, mask_pad, stream)
                if uplan is not None:      # u at the mask just written, no offsets
                    host.enqueue_pack_planes(uplan, device, stream,
                                             frame.args[1].data + i * elem, p[0], 0, p[5],
                                             p[6], p[7], p[-1])

    def unpack(self, frame, lay, blocks):
        if not chunk_supported(lay.shape, lay.dtype, lay.chunk_log2):
            raise xla_ffi.HandlerError(f"chunk_log2={lay.chunk_log2} is longer than the "
                                       "unpack kernel's tile; the FFI path needs shorter "
                                       "chunks", invalid=True)
        device, stream = frame.device_ordinal, frame.stream
        args = frame.args
        strides = _strides(*args)
        elem = lay.dtype.itemsize * lay.numel
        with _OnDevice(device):
            for i in range(blocks):
                m, o, v, s = (b.data + i * st for b, st in zip(args, strides))
                planes = host.Planes(m, lay.mask[1], o, 0, v, lay.values[1], s, lay.signs[1])
                host.enqueue_unpack(lay, planes, abi.Op.UNPACK, device, stream,
                                    frame.rets[0].data + i * elem)

    def relu_backward(self, frame, lay, blocks):
        device, stream = frame.device_ordinal, frame.stream
        grad, mask = frame.args
        elem = lay.dtype.itemsize * lay.numel
        with _OnDevice(device):
            for i in range(blocks):
                planes = host.Planes(mask.data + i * mask.row_bytes, lay.mask[1], 0, 0, 0, 0,
                                     0, 0)
                host.enqueue_relu_backward(lay, planes, device, stream, grad.data + i * elem,
                                           frame.rets[0].data + i * elem)


class _OnDevice:
    """The device's primary context current on this thread while kernels are queued
    (XLA's thread may hold none; CuPy compiles and loads the kernels in it)."""

    def __init__(self, device: int):
        try:
            import cupy
        except ImportError as exc:
            raise xla_ffi.HandlerError("the CUDA FFI path needs CuPy (pip install "
                                       "'bitsparse_core[cuda]'), which compiles the kernels"
                                       ) from exc
        self._dev = cupy.cuda.Device(device)

    def __enter__(self):
        self._dev.__enter__()

    def __exit__(self, *exc):
        self._dev.__exit__(*exc)


def _host_array(buf, dtype, count: int, offset: int = 0) -> np.ndarray:
    """``count`` items of ``dtype`` at ``buf.data + offset`` as a writable NumPy view."""
    if count == 0:
        return np.zeros(0, dtype)
    raw = (ctypes.c_uint8 * (count * np.dtype(dtype).itemsize)).from_address(buf.data + offset)
    return np.frombuffer(raw, dtype=dtype)


class _CpuEngine:
    """The NumPy reference functions on XLA's host buffers (the executable spec: the
    planes every GPU kernel must reproduce)."""

    def pack(self, frame, shape, dtype, enc, uenc, capacity, chunk_log2, spec, blocks):
        from ..spec.planes import chunk_offsets, encode_values
        numel = _fmt.numel_of(shape)
        rets = frame.rets
        strides = _strides(*rets)
        for i in range(blocks):
            out = [_host_array(r, np.uint8, s, i * s) for r, s in zip(rets, strides)]
            for o in out:
                o[...] = 0
            a = _host_array(frame.args[0], dtype.numpy, numel, i * numel * dtype.itemsize)
            bits = _relu_bits(a.view(dtype.uint), dtype)
            nonzero = bits != 0
            stored = bits[nonzero]
            mask = np.packbits(nonzero, bitorder="little")
            offsets = chunk_offsets(mask, numel, chunk_log2).astype(np.uint32)
            values, signs = encode_values(stored, dtype, enc, capacity)
            _put(out[0], mask), _put(out[1], offsets), _put(out[2], values), _put(out[3], signs)
            _put(out[4], _status_area(stored, dtype, enc, capacity))
            if uenc is not None:
                u = _host_array(frame.args[1], dtype.numpy, numel, i * numel * dtype.itemsize)
                ustored = u.view(dtype.uint)[nonzero]
                uvalues, usigns = encode_values(ustored, dtype, uenc, capacity)
                _put(out[5], uvalues), _put(out[6], usigns)
                _put(out[7], _status_area(ustored, dtype, uenc, capacity))

    def unpack(self, frame, lay, blocks):
        from ..spec.planes import decode_values
        args = frame.args
        strides = _strides(*args)
        dtype, numel = lay.dtype, lay.numel
        for i in range(blocks):
            mask = _host_array(args[0], np.uint8, lay.mask[1], i * strides[0])
            offsets = _host_array(args[1], np.uint32, lay.n_chunks + 1, i * strides[1])
            values = _host_array(args[2], np.uint8, lay.values[1], i * strides[2])
            signs = _host_array(args[3], np.uint8, lay.signs[1], i * strides[3])
            out = _host_array(frame.rets[0], dtype.uint, numel, i * numel * dtype.itemsize)
            nonzero = np.unpackbits(mask, count=numel, bitorder="little").view(bool)
            count = min(int(offsets[-1]), lay.capacity)
            stored = decode_values(lay, values, signs, count)
            # An overflowed pack's values past the capacity read as zero (its callers
            # take the recompute path; the result only has to be safe to compute).
            full = np.zeros(int(nonzero.sum()), dtype.uint)
            full[:count] = stored
            out[...] = 0
            out[nonzero] = full

    def relu_backward(self, frame, lay, blocks):
        grad, mask = frame.args
        dtype, numel = lay.dtype, lay.numel
        for i in range(blocks):
            bits = np.unpackbits(_host_array(mask, np.uint8, lay.mask[1], i * mask.row_bytes),
                                 count=numel, bitorder="little").view(bool)
            g = _host_array(grad, dtype.uint, numel, i * numel * dtype.itemsize)
            out = _host_array(frame.rets[0], dtype.uint, numel, i * numel * dtype.itemsize)
            out[...] = np.where(bits, g, np.zeros((), dtype.uint))


def _relu_bits(bits: np.ndarray, dtype: _dt.DType) -> np.ndarray:
    """reference_ops.relu_bits decided on the bit patterns: XLA's CPU threads run with
    subnormals flushed, so a float compare there would drop positive subnormals."""
    sign = np.array(dtype.sign_mask, dtype.uint)
    keep = ((bits & sign) == 0) | ((bits & (sign - 1)) > NAN_ABOVE[dtype.name])
    return np.where(keep, bits, np.zeros((), dtype.uint))


def _put(dst: np.ndarray, src: np.ndarray) -> None:
    raw = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
    dst[:raw.size] = raw


def _status_area(stored: np.ndarray, dtype: _dt.DType, enc: Encoding, capacity: int) -> np.ndarray:
    area = np.zeros(STATUS_WORDS, np.uint32)
    if enc == Encoding.NOSIGN and np.any(stored >> (dtype.bits - 1)):
        area[0] |= abi.STATUS_NOSIGN_VIOLATION
    if stored.size > capacity:
        area[0] |= abi.STATUS_OVERFLOW
    area[2:4] = np.array([stored.size], np.uint64).view(np.uint32)
    return area


_REGISTERED = threading.Event()
_REGISTER_LOCK = threading.Lock()


def register() -> None:
    """Register the targets' handlers for ``cpu`` and ``cuda`` (once per process)."""
    if _REGISTERED.is_set():
        return
    with _REGISTER_LOCK:
        if _REGISTERED.is_set():
            return
        for platform, engine in (("cpu", _CpuEngine()), ("CUDA", _CudaEngine())):
            xla_ffi.register(PACK_TARGET, _pack_handler(engine), platform)
            xla_ffi.register(UNPACK_TARGET, _unpack_handler(engine), platform)
            xla_ffi.register(RELU_BACKWARD_TARGET, _relu_backward_handler(engine), platform)
        _REGISTERED.set()
