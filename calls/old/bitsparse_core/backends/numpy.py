"""The ``numpy`` backend: the reference codec and reference ops behind the registry contract."""

from __future__ import annotations

import numpy as np

from ..dlpack import exportable, to_numpy
from ..errors import OutputMismatchError
from ..packed import PackedTensor
from ..spec import format as _fmt
from ..spec import ops as reference_ops
from ..spec.codec import pack_array, unpack_planes


class NumpyBackend:
    """CPU backend: the reference codec behind the registry contract."""

    name = "numpy"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        arr, dt = to_numpy(x, dtype)
        return pack_array(arr, dt, encoding, chunk_log2=chunk_log2, capacity=capacity)

    def unpack(self, p: PackedTensor, *, out=None, stream=None, allocator=None):
        p.check()
        target = None
        if out is not None:
            target, dt = to_numpy(out)
            if dt != p.dtype or tuple(target.shape) != tuple(p.shape):
                raise OutputMismatchError(f"out has {dt.name}{tuple(target.shape)}; "
                                          f"need {p.dtype.name}{tuple(p.shape)}")
            if not target.flags.writeable:
                raise OutputMismatchError("out is read-only")
        result = unpack_planes(p, p.mask, p.values, p.signs, target)
        return out if out is not None else result

    # ----------------------------------------------------------- fused ops
    def relu_pack(self, a, *, square=False, dtype=None, encoding="nosign",
                  chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, capacity=None, stream=None, allocator=None):
        arr, dt = to_numpy(a, dtype)
        y, p = reference_ops.relu_pack(arr, dt, square=square, encoding=encoding,
                                       chunk_log2=chunk_log2, capacity=capacity)
        return exportable(y), p

    def relu_backward(self, grad, p, *, stream=None, allocator=None):
        return exportable(reference_ops.relu_backward(self._grad(grad, p), p))

    def relu2_backward(self, grad, p, *, stream=None, allocator=None):
        p.check()
        return exportable(reference_ops.relu2_backward(self._grad(grad, p), p))

    def masked_pack(self, u, p_mask, *, dtype=None, encoding="signplane", stream=None,
                    allocator=None):
        arr, dt = to_numpy(u, dtype)
        if tuple(arr.shape) != tuple(p_mask.shape) or dt != p_mask.dtype:
            raise OutputMismatchError(f"u is {dt.name}{tuple(arr.shape)}, mask tensor is "
                                      f"{p_mask.dtype.name}{tuple(p_mask.shape)}")
        return reference_ops.masked_pack(arr, dt, p_mask, encoding=encoding)

    def gated_backward(self, grad, p_r, p_u, *, stream=None, allocator=None):
        p_r.check()
        p_u.check()                    # every packed input is checked for overflow
        gg, gu = reference_ops.gated_backward(self._grad(grad, p_r), p_r, p_u)
        return exportable(gg), exportable(gu)

    @staticmethod
    def _grad(grad, p):
        arr, dt = to_numpy(grad)
        if dt != p.dtype or tuple(arr.shape) != tuple(p.shape):
            raise OutputMismatchError(f"grad is {dt.name}{tuple(arr.shape)}; the packed "
                                      f"activation is {p.dtype.name}{tuple(p.shape)}")
        return arr

    # ------------------------------------------------------------- helpers
    def read_nnz(self, p) -> int:
        return int(p.offsets[-1])

    def read_status(self, p) -> int:
        return 0

    def to_numpy(self, array) -> np.ndarray:
        return np.asarray(array)
