"""torch <-> bitsparse_core: the dtypes the adapter packs, their bit views, the
devices it runs on.

The kernels themselves are queued by pointer (:mod:`.ops`), on torch's current
stream, with memory from torch's caching allocator; nothing crosses DLPack.
"""

from __future__ import annotations

import torch

from .. import dtypes as _dt
from ..errors import UnsupportedDTypeError, UnsupportedDeviceError

TORCH_TO_BS = {
    torch.bfloat16: _dt.BFLOAT16,
    torch.float16: _dt.FLOAT16,
    torch.float32: _dt.FLOAT32,
}
for _name, _d in (("float8_e4m3fn", _dt.FLOAT8_E4M3FN), ("float8_e5m2", _dt.FLOAT8_E5M2)):
    if hasattr(torch, _name):
        TORCH_TO_BS[getattr(torch, _name)] = _d
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integers of its width (its bit patterns)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def bs_dtype(dtype: torch.dtype) -> _dt.DType:
    """The format dtype of a torch dtype, or a clear error."""
    try:
        return TORCH_TO_BS[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in TORCH_TO_BS)
        raise UnsupportedDTypeError(f"bitsparse_core.torch packs {names}; got {dtype}") from None


def check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedDeviceError(f"bitsparse_core.torch runs on CPU and CUDA tensors, "
                                     f"not {device.type}")

