"""LSB-first bit streams of fixed-width codes, vectorised with NumPy.

Stream bit ``k`` is bit ``k % 8`` of byte ``k // 8`` (equivalently bit ``k % 32``
of little-endian 32-bit word ``k // 32``); code ``i`` of width ``w`` occupies
stream bits ``[i*w, (i+1)*w)``, its least significant bit first. Eight codes of
width ``w`` fill exactly ``w`` bytes, so the work is done eight codes at a time
as up to four 64-bit words: no per-element Python loop.
"""

from __future__ import annotations

import numpy as np

_U64 = np.dtype("<u8")


def nbytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


def pack(codes: np.ndarray, width: int) -> np.ndarray:
    """Pack unsigned ``codes`` (each < 2**width, width <= 32) into a uint8 stream."""
    n = codes.size
    groups = -(-n // 8)
    padded = np.zeros(groups * 8, dtype=_U64)
    padded[:n] = codes.ravel()
    lanes = padded.reshape(groups, 8)
    words = np.zeros((groups, 4), dtype=_U64)
    for k in range(8):
        bit = k * width
        q, r = divmod(bit, 64)
        v = lanes[:, k]
        words[:, q] |= v << np.uint64(r)
        if r + width > 64:
            words[:, q + 1] |= v >> np.uint64(64 - r)
    out = words.view(np.uint8).reshape(groups, 32)[:, :width].reshape(-1)
    return out[:nbytes(n, width)].copy()


def unpack(stream: np.ndarray, width: int, count: int, dtype) -> np.ndarray:
    """Inverse of :func:`pack`: the first ``count`` codes of ``stream`` as ``dtype``."""
    groups = -(-count // 8)
    raw = np.zeros((groups, 32), dtype=np.uint8)
    body = np.asarray(stream, dtype=np.uint8).ravel()[:groups * width]
    flat = np.zeros(groups * width, dtype=np.uint8)
    flat[:body.size] = body
    raw[:, :width] = flat.reshape(groups, width)
    words = raw.view(_U64)
    lo_mask = np.uint64((1 << width) - 1)
    lanes = np.empty((groups, 8), dtype=_U64)
    for k in range(8):
        bit = k * width
        q, r = divmod(bit, 64)
        v = words[:, q] >> np.uint64(r)
        if r + width > 64:
            v = v | (words[:, q + 1] << np.uint64(64 - r))
        lanes[:, k] = v & lo_mask
    return lanes.reshape(-1)[:count].astype(dtype)
