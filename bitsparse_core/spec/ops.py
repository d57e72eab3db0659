"""Reference (NumPy) semantics of the fused activation ops every backend offers.

These are the executable spec of the GPU kernels' fused paths: a GPU result
must equal these bit for bit. Float products are formed exactly in float32
(a product of two bf16/fp16/fp8 values always fits) and rounded once to the
tensor's dtype, round-to-nearest-even -- the same single rounding PyTorch's
elementwise kernels perform. A NaN product follows one fixed rule (:func:`mul_f32`),
not whichever NaN operand the installed NumPy's loops happen to keep.

ReLU here is ``r = a if a > 0 else +0.0``, with NaN passed through (as
``torch.relu`` does); ``-0.0`` becomes ``+0.0``, so a packed ReLU output has a
sign bit set only for a negative NaN (which ``nosign`` then refuses).

Where these rules meet PyTorch's: ``relu_backward`` (mask only) equals
``threshold_backward`` everywhere, NaN included. ``relu2_backward`` and the
gated ``grad_g`` give +0 where ``r`` is NaN; PyTorch propagates the NaN there.
The forward activation is NaN in that case either way.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as _dt
from ..backends.registry import get_backend
from ..errors import EncodingError
from ..packed import PackedTensor
from . import format as _fmt
from .codec import pack_array, unpack_planes
from .planes import encode_values


def relu_bits(a: np.ndarray, dtype: _dt.DType) -> np.ndarray:
    """relu(a) as computed by every backend: keep a where a > 0 or a is NaN, else +0."""
    f = a.astype(np.float32)
    keep = (f > 0) | np.isnan(f)
    return np.where(keep, a, np.zeros((), dtype=dtype.numpy)).astype(dtype.numpy)


_F32_QUIET = np.uint32(0x00400000)
_F32_DEFAULT_NAN = np.uint32(0xFFC00000)


def mul_f32(a, b) -> np.ndarray:
    """The float32 product ``a * b`` with x86 SSE's NaN rule, which the GPU kernels
    reproduce: a NaN operand gives the first NaN operand, quieted; an invalid product
    (0 * inf) gives the default NaN 0xFFC00000. NumPy alone does not fix this: which
    NaN of two its multiply keeps differs between versions (NumPy 2.2 keeps the
    second, 2.4 the first) and between platforms."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32))
    out = np.empty(a.shape, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        np.multiply(a, b, out=out)
    nan = np.isnan(out)
    if nan.any():
        a_nan, b_nan = np.isnan(a), np.isnan(b)
        bits = np.where(a_nan, a.view(np.uint32) | _F32_QUIET,
                        np.where(b_nan, b.view(np.uint32) | _F32_QUIET, _F32_DEFAULT_NAN))
        out.view(np.uint32)[nan] = bits[nan]
    return out


def _round(x32: np.ndarray, dtype: _dt.DType) -> np.ndarray:
    with np.errstate(over="ignore"):       # past the dtype's range rounds to infinity
        return x32.astype(dtype.numpy)


def relu_pack(a: np.ndarray, dtype: _dt.DType, *, square: bool = False, encoding="nosign",
              chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2, capacity=None):
    """``(y, p)``: the dense ``relu(a)`` (``relu(a)**2`` if ``square``) for the next
    matmul, and ``p = pack(relu(a))`` -- the unsquared ReLU, from which both
    backward rules and the square can be recomputed."""
    r = relu_bits(a, dtype)
    p = pack_array(r, dtype, encoding, chunk_log2=chunk_log2, capacity=capacity)
    if square:
        r32 = r.astype(np.float32)
        y = _round(mul_f32(r32, r32), dtype)
    else:
        y = r.copy()
    return y, p


def gated_relu_pack(g: np.ndarray, u: np.ndarray, dtype: _dt.DType, *, encoding="nosign",
                    chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2, capacity=None):
    """``(h, p)``: the gated op's activation ``h = relu(g) * u``, each product rounded
    once (every element formed: an infinite or NaN ``u`` where ``relu(g)`` is +0 gives
    NaN), and ``p = pack(relu(g))``."""
    r = relu_bits(g, dtype)
    p = pack_array(r, dtype, encoding, chunk_log2=chunk_log2, capacity=capacity)
    h = _round(mul_f32(r.astype(np.float32), np.asarray(u).astype(np.float32)), dtype)
    return h, p


def mask_of(p: PackedTensor) -> np.ndarray:
    return np.unpackbits(np.asarray(p.mask, dtype=np.uint8), count=p.numel,
                         bitorder="little").view(bool).reshape(p.shape)


def relu_backward(grad: np.ndarray, p: PackedTensor) -> np.ndarray:
    """``grad`` where the mask bit is set, else +0 (reads only the mask)."""
    return np.where(mask_of(p), grad, np.zeros((), dtype=grad.dtype)).astype(grad.dtype)


def relu2_backward(grad: np.ndarray, p: PackedTensor) -> np.ndarray:
    """``d relu(a)**2 / da * grad = 2 r grad`` where ``r > 0``, else +0 (NaN r gives +0)."""
    r = unpack_planes(p, p.mask, p.values, p.signs).view(p.dtype.numpy)
    r32 = np.asarray(r, dtype=np.float32)
    g = _round(mul_f32(grad, mul_f32(2.0, r32)), p.dtype)
    return np.where(r32 > 0, g, np.zeros((), dtype=p.dtype.numpy)).astype(p.dtype.numpy)


_MASKED_NAMES = {"auto": _fmt.Encoding.SIGNPLANE,
                 **{e.name.lower(): e for e in _fmt.Encoding}}


def masked_encoding(encoding) -> _fmt.Encoding:
    """A masked pack's encoding; ``"auto"`` is signplane (the companion is signed)."""
    known = _MASKED_NAMES.get(encoding) if type(encoding) is str else None
    if known is not None:                 # the lower-case names, without parsing
        return known
    if isinstance(encoding, str) and encoding.lower() == "auto":
        return _fmt.Encoding.SIGNPLANE
    return _fmt.Encoding.parse(encoding)


def masked_pack(u: np.ndarray, dtype: _dt.DType, p_mask: PackedTensor, *,
                encoding="signplane") -> PackedTensor:
    """``u``'s bit patterns at the positions set in ``p_mask``'s mask (zeros included),
    sharing that mask and its chunk offsets: the gated-ReLU companion plane.

    The result is an in-memory tensor only (a stored value may be zero, which a
    standalone format-v1 buffer forbids); ``to_bytes`` refuses it. ``"auto"`` means
    signplane: the companion ``u`` is signed (as in the torch and JAX adapters).
    """
    encoding = masked_encoding(encoding)
    bits = u.reshape(-1).view(dtype.uint)
    stored = bits[mask_of(p_mask).reshape(-1)]
    if encoding == _fmt.Encoding.NOSIGN and np.any(stored >> (dtype.bits - 1)):
        raise EncodingError("nosign encoding: a gated value has its sign bit set")
    values, signs = encode_values(stored, dtype, encoding, stored.size)
    return PackedTensor(tuple(u.shape), dtype, encoding, p_mask.chunk_log2, stored.size,
                        p_mask.mask, p_mask.offsets, values, signs, backend=get_backend("numpy"),
                        device=("cpu", 0), _nnz=int(stored.size), extra={"shares_mask": True})


def gated_backward(grad: np.ndarray, p_r: PackedTensor, p_u: PackedTensor):
    """For ``h = relu(g) * u``: ``(grad_g, grad_u)`` with ``grad_u = grad * r`` and
    ``grad_g = grad * u`` where ``r > 0``, else +0; each product rounded once."""
    dtype = p_r.dtype
    r = unpack_planes(p_r, p_r.mask, p_r.values, p_r.signs)
    u = unpack_planes(p_u, p_u.mask, p_u.values, p_u.signs)
    r32, u32, g32 = (np.asarray(t, dtype=np.float32) for t in (r, u, grad))
    zero = np.zeros((), dtype=dtype.numpy)
    grad_u = _round(mul_f32(g32, r32), dtype)
    grad_g = np.where(r32 > 0, _round(mul_f32(g32, u32), dtype), zero).astype(dtype.numpy)
    return grad_g, grad_u


def gated_product(p_r: PackedTensor, p_u: PackedTensor) -> np.ndarray:
    """``r * u`` from the two packed planes, rounded once: the gated op's activation,
    which the second GEMM's weight gradient reads. ``u`` is stored only where the mask
    is set, so this is +0 elsewhere, also where the dense ``u`` was infinite or NaN
    (whose dense product with +0 is NaN)."""
    r = unpack_planes(p_r, p_r.mask, p_r.values, p_r.signs)
    u = unpack_planes(p_u, p_u.mask, p_u.values, p_u.signs)
    r32, u32 = (np.asarray(t, dtype=np.float32) for t in (r, u))
    return _round(mul_f32(r32, u32), p_r.dtype)
