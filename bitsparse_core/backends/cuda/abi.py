"""The kernel ABI: ids, tile geometry and one argument record per kernel signature.

Python is the one source of these facts. :func:`header` renders the ids and the
block geometry as C ``#define``s; the CUDA sources get that text prepended when
they are compiled (and ``kernels/bitsparse_abi.h``, which the host-side C++ tests
include, is the same text, checked by a test). Each ``*Args`` record is a ctypes
structure laid out as the kernel's parameter list, so a launch fills named fields
of a record built once instead of passing two dozen positional scalars.
"""

from __future__ import annotations

import ctypes
import enum

from ... import dtypes as _dt
from ...spec.format import Encoding


class Fmt(enum.IntEnum):
    """Element formats of the kernel templates (``Fmt<FMT>`` in bitsparse_common.cuh)."""
    BF16 = 0
    FP16 = 1
    FP32 = 2
    E4M3 = 3
    E5M2 = 4


class Mode(enum.IntEnum):
    """What the pack kernel reads and writes besides the planes."""
    PACK = 0      # plain pack of x
    RELU = 1      # pack relu(x), write y = relu(x)
    RELU2 = 2     # pack relu(x), write y = relu(x)**2
    MASKED = 3    # pack x at the positions of an existing mask
    RELU_GATED = 4   # pack relu(x), write y = relu(x) * u (the gated op's activation)


class Op(enum.IntEnum):
    """What the unpack kernel computes from the decoded values."""
    UNPACK = 0        # the dense tensor
    RELU2 = 1         # 2 r grad where r > 0 (ReLU²'s input gradient)
    GATED = 2         # (grad u [r > 0], grad r) from two planes sharing a mask
    GATED_DENSE = 3   # the same with u given dense
    RELU2_AND_SQUARE = 4   # (2 r grad where r > 0, r² as the forward rounded it)
    GATED_PRODUCT = 5      # r u from GATED's two planes (the second GEMM's input)


FMT_OF = {"bfloat16": Fmt.BF16, "float16": Fmt.FP16, "float32": Fmt.FP32,
          "float8_e4m3fn": Fmt.E4M3, "float8_e5m2": Fmt.E5M2}
# Kernels that only move bits have one instantiation per width.
BITS_FMT = {8: Fmt.E4M3, 16: Fmt.BF16, 32: Fmt.FP32}

THREADS = 256                 # threads per block of every kernel
WARPS = THREADS // 32
# Rounds per warp of each kernel family: the tile is WARPS x R x 32 lanes x one
# 16-byte vector. Every pack mode (relu_pack's too) takes PACK_ROUNDS; FUSED_ROUNDS is
# the fused unpack-family ops'. Unpack tiles are whole default-size chunks (4096 elements).
PACK_ROUNDS = 4
FUSED_ROUNDS = 2
UNPACK_ROUNDS = 4
STATUS_BYTES = 64             # u32 status, u32 pad, u64 nnz, padding
SLOT_BYTES = 16               # a pinned host slot the pack kernel writes: u32 status, u32 pad, u64 nnz
SLOT_SENTINEL32 = 0xFFFFFFFF  # a slot's status before the kernel writes it (a status uses bits 0-1)
SLOT_SENTINEL64 = (1 << 64) - 1   # its count before (no count is all ones)
STATUS_NOSIGN_VIOLATION = 1   # status bits written by the pack kernel
STATUS_OVERFLOW = 2


def tile_elems(dtype: _dt.DType, rounds: int) -> int:
    return WARPS * rounds * 32 * (16 // dtype.itemsize)


def unpack_rounds(dtype: _dt.DType, op: Op) -> int:
    """fp32 (4 elements per vector) doubles the rounds so its tiles hold as many
    elements as 16-bit ones: whole default-size chunks."""
    r = UNPACK_ROUNDS if op == Op.UNPACK else FUSED_ROUNDS
    return 2 * r if dtype.bits == 32 else r


def stream_width(dtype: _dt.DType, enc: Encoding) -> int:
    return dtype.bits if enc == Encoding.RAW else dtype.bits - 1


def pack_scratch_bytes(n_tiles: int) -> int:
    """Pack scratch (zeroed before launch): the tile counter and the grid barrier's count
    (8 bytes each), an 8-byte count descriptor per tile (padded to an even count), a
    16-byte edge record per tile, an 8-byte group descriptor per 32 tiles (padded to an
    even count). A multiple of 16 bytes: callers lay several out back to back."""
    return 16 + 8 * (n_tiles + n_tiles % 2) + 16 * n_tiles + 16 * -(-n_tiles // 64)


def pack_smem_bytes(dtype: _dt.DType, encoding: Encoding, rounds: int) -> int:
    """Dynamic shared memory of a pack kernel: two ``BsPackBuf`` (bitsparse_pack.cu)."""
    bits = 8 * dtype.itemsize
    tile = tile_elems(dtype, rounds)
    words = (tile * bits // 32 + 4                                           # stage
             + (tile // 32 + 4 if encoding == Encoding.SIGNPLANE else 1)    # signs
             + 2 + 8 * rounds)                                             # n, neg, rel
    return 2 * (-(-4 * words // 16) * 16)


def header() -> str:
    """The C ``#define``s of the ids and geometry above (kernels/bitsparse_abi.h)."""
    lines = ["// Generated from bitsparse_core/backends/cuda/abi.py (abi.header()); do not edit.",
             "#pragma once"]
    for name, value in ([(f"BS_{f.name}", int(f)) for f in Fmt]
                        + [(f"BS_MODE_{m.name}", int(m)) for m in Mode]
                        + [(f"BS_OP_{o.name}", int(o)) for o in Op]
                        + [("BS_THREADS", THREADS), ("BS_WARPS", WARPS),
                           ("BS_STATUS_NOSIGN_VIOLATION", STATUS_NOSIGN_VIOLATION),
                           ("BS_STATUS_OVERFLOW", STATUS_OVERFLOW)]):
        lines.append(f"#define {name} {value}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- #
# Argument records, field for field the kernels' parameter lists              #
# --------------------------------------------------------------------------- #
_U64, _I32 = ctypes.c_uint64, ctypes.c_int32


class _Args(ctypes.Structure):
    """Base of the records: ``pointers`` is the ``void**`` array a launch passes,
    built once per record (each entry points at one field)."""

    def __init__(self):
        super().__init__()
        base = ctypes.addressof(self)
        offsets = [getattr(type(self), name).offset for name, _ in self._fields_]
        self.pointers = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])

    def set(self, **fields) -> "_Args":
        for name, value in fields.items():
            setattr(self, name, value)
        return self


class PackArgs(_Args):
    """``bitsparse_pack<FMT, ENC, MODE, R>`` (bitsparse_pack.cu)."""
    _fields_ = [("x", _U64), ("numel", _U64), ("x_aligned", _I32), ("mask", _U64),
                ("mask_len", _U64), ("offsets", _U64), ("off64", _I32), ("chunk_log2", _I32),
                ("values", _U64), ("signs", _U64), ("cap", _U64), ("y", _U64), ("y_aligned", _I32),
                ("scratch", _U64), ("status", _U64), ("n_tiles", _U64),
                ("zero_values_words", _U64), ("zero_signs_words", _U64), ("slot", _U64),
                ("u", _U64), ("u_aligned", _I32)]


class UnpackArgs(_Args):
    """``bitsparse_unpack<FMT, OP, R, ENC, UENC>`` (bitsparse_unpack.cu)."""
    _fields_ = [("numel", _U64), ("chunk_log2", _I32), ("prefix_mode", _I32), ("offsets", _U64),
                ("off64", _I32), ("prefix", _U64), ("mask", _U64), ("mask_len", _U64),
                ("values", _U64), ("values_len", _U64), ("signs", _U64), ("signs_len", _U64),
                ("uvalues", _U64), ("uvalues_len", _U64), ("usigns", _U64), ("usigns_len", _U64),
                ("g", _U64), ("g_aligned", _I32), ("ud", _U64), ("ud_aligned", _I32),
                ("out", _U64), ("out_aligned", _I32), ("out2", _U64), ("out2_aligned", _I32)]


class MaskSelectArgs(_Args):
    """``bitsparse_mask_select<FMT>``: ReLU's gradient from the mask alone."""
    _fields_ = [("g", _U64), ("g_aligned", _I32), ("mask", _U64), ("mask_len", _U64),
                ("numel", _U64), ("out", _U64), ("out_aligned", _I32)]


class TileCountsArgs(_Args):
    """``bitsparse_tile_counts<FMT, R>``: set mask bits per unpack tile."""
    _fields_ = [("mask", _U64), ("mask_len", _U64), ("numel", _U64), ("counts", _U64)]
