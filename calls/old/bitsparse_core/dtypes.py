"""The five element types of format v1, named by their DLPack (code, bits) pairs.

A :class:`DType` ties together what every layer needs: the DLPack pair written in
the header, the NumPy / ml_dtypes dtype of the CPU reference, and the unsigned
integer type of the same width that all codecs actually work on (a codec only
ever moves bit patterns, never does float arithmetic on values).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import UnknownDTypeError, UnsupportedDTypeError

# DLPack's DLDataTypeCode values (dlpack.h, v1.1).
DL_FLOAT = 2
DL_BFLOAT = 4
DL_FLOAT8_E4M3FN = 10
DL_FLOAT8_E5M2 = 12


@dataclass(frozen=True)
class DType:
    name: str          # canonical name, as torch/jax/ml_dtypes spell it
    dl_code: int       # DLPack type code
    bits: int          # element width in bits (8, 16 or 32)
    numpy: np.dtype    # NumPy dtype of the CPU reference (ml_dtypes for bf16/fp8)

    def __hash__(self) -> int:     # equal DTypes share a name; hot-path caches key on it
        return hash(self.name)

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def uint(self) -> np.dtype:
        """Unsigned integer dtype of the same width (little-endian)."""
        return np.dtype(f"<u{self.itemsize}")

    @property
    def magnitude_bits(self) -> int:
        """Bits per value in the nosign / signplane streams: the width minus the sign."""
        return self.bits - 1

    @property
    def sign_mask(self) -> int:
        return 1 << (self.bits - 1)

    def __repr__(self) -> str:  # short, for error messages and tables
        return f"DType({self.name})"


BFLOAT16 = DType("bfloat16", DL_BFLOAT, 16, np.dtype(ml_dtypes.bfloat16))
FLOAT16 = DType("float16", DL_FLOAT, 16, np.dtype(np.float16))
FLOAT32 = DType("float32", DL_FLOAT, 32, np.dtype(np.float32))
FLOAT8_E4M3FN = DType("float8_e4m3fn", DL_FLOAT8_E4M3FN, 8, np.dtype(ml_dtypes.float8_e4m3fn))
FLOAT8_E5M2 = DType("float8_e5m2", DL_FLOAT8_E5M2, 8, np.dtype(ml_dtypes.float8_e5m2))

ALL = (BFLOAT16, FLOAT16, FLOAT32, FLOAT8_E4M3FN, FLOAT8_E5M2)

_BY_DL = {(d.dl_code, d.bits): d for d in ALL}
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME.update({"bf16": BFLOAT16, "fp16": FLOAT16, "half": FLOAT16, "fp32": FLOAT32,
                 "float": FLOAT32, "fp8_e4m3fn": FLOAT8_E4M3FN, "fp8_e5m2": FLOAT8_E5M2,
                 "e4m3fn": FLOAT8_E4M3FN, "e5m2": FLOAT8_E5M2})


def from_dlpack_pair(code: int, bits: int, *, in_header: bool = False) -> DType:
    """Look a dtype up by its DLPack (code, bits) pair."""
    try:
        return _BY_DL[(int(code), int(bits))]
    except KeyError:
        cls = UnknownDTypeError if in_header else UnsupportedDTypeError
        raise cls(f"DLPack dtype (code={code}, bits={bits}) is not one of "
                  f"{', '.join(d.name for d in ALL)}") from None


def resolve(spec) -> DType:
    """Accept a DType, a name ('bfloat16', 'bf16', ...), a NumPy dtype or a
    framework dtype object whose str() ends in one of the names (torch.bfloat16)."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        key = spec
    else:
        try:
            npd = np.dtype(spec)
        except TypeError:
            npd = None
        if npd is not None:
            for d in ALL:
                if d.numpy == npd:
                    return d
            raise UnsupportedDTypeError(f"dtype {npd} is not supported; use one of "
                                        f"{', '.join(d.name for d in ALL)}")
        key = str(spec).rsplit(".", 1)[-1]  # 'torch.bfloat16' -> 'bfloat16'
    try:
        return _BY_NAME[key]
    except KeyError:
        raise UnsupportedDTypeError(f"dtype {spec!r} is not supported; use one of "
                                    f"{', '.join(d.name for d in ALL)}") from None
