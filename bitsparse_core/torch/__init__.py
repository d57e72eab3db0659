"""PyTorch adapter: FFN autograd ops and modules that keep activations packed, and
``compress_saved_tensors`` for any eager model.

``import bitsparse_core`` never imports torch; this subpackage needs it.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("bitsparse_core.torch needs PyTorch (pip install 'bitsparse_core[torch]' "
                      "or torch>=2.4); the rest of bitsparse_core works without it") from exc

from .capacity import (CapacityPolicy, adapt_to_replays, capacity_policies, freeze_capacity,
                       thaw_capacity)
from .convert import ConvertReport, convert
from .functional import (ENCODINGS, GatedReLULinearFunction, ReLULinearFunction,
                         gated_relu_ffn, gated_relu_linear, relu_ffn, relu_linear)
from .hooks import SavedStats, compress_saved_tensors
from .modules import PackedReGLUFFN, PackedReLU2FFN, PackedReLUFFN
from .offload import Offloader

__all__ = ["CapacityPolicy", "adapt_to_replays", "capacity_policies", "freeze_capacity",
           "thaw_capacity",
           "relu_linear", "gated_relu_linear", "relu_ffn", "gated_relu_ffn", "ReLULinearFunction",
           "GatedReLULinearFunction", "PackedReLUFFN", "PackedReLU2FFN", "PackedReGLUFFN",
           "compress_saved_tensors", "SavedStats", "ENCODINGS", "convert", "ConvertReport",
           "Offloader"]
