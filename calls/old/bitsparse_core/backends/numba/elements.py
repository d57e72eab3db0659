"""One element type as the kernel factories see it: its bit-layout constants,
its float arithmetic (:mod:`bitsparse_core.bitfloat` on the device) and the
loads and stores of a group of 8 elements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, int64

from ... import bitfloat
from .common import _as_f32, _as_u32, _u


@dataclass(frozen=True)
class Elem:
    """The per-dtype constants and device functions. A Numba closure captures
    ints and device functions, not this object: factories copy what they use
    into locals before defining their kernels."""

    name: str
    BITS: int
    ITEM: int          # bytes per element = uint64 words per group
    EMASK: int
    SIGN: int
    W: int             # stream code width
    WMASK: int
    PER_WORD: int      # elements per uint64 word
    GE: int            # elements per 32-bit word
    ENP: Any           # the NumPy type, for views
    widen: Any         # bitfloat's device functions
    narrow: Any
    is_pos: Any
    fmul: Any
    load_group: Any
    store_group: Any


def make_group_io(BITS, ITEM, PER_WORD, EMASK):
    """(load_group, store_group): the 8 patterns of a group, from and to a dense
    array, as ITEM uint64 words when ``fast`` (the group is whole and the array
    8-byte aligned), else element by element."""
    @cuda.jit(device=True)
    def load_group(xe, x64, fast, numel, g, v):
        """v[0..8) = patterns of group g (0 past numel). ``fast``: uint64 loads."""
        if fast:
            for q in range(ITEM):
                w = int64(x64[_u(g * ITEM + q)])
                for j in range(PER_WORD):
                    v[q * PER_WORD + j] = (w >> (j * BITS)) & EMASK
        else:
            for j in range(8):
                e = g * 8 + j
                if e < numel:
                    v[j] = int64(xe[_u(e)])
                else:
                    v[j] = 0

    @cuda.jit(device=True)
    def store_group(oe, o64, fast, numel, g, v):
        if fast:
            for q in range(ITEM):
                w = int64(0)
                for j in range(PER_WORD):
                    w |= v[q * PER_WORD + j] << (j * BITS)
                o64[_u(g * ITEM + q)] = w
        else:
            for j in range(8):
                e = g * 8 + j
                if e < numel:
                    oe[_u(e)] = v[j]

    return load_group, store_group


def elem(name: str) -> Elem:
    bits = bitfloat.FORMATS[name][0]
    F = bitfloat.make(name, cuda.jit(device=True), _as_f32, _as_u32)
    item = bits // 8
    per_word = 8 // item
    load_group, store_group = make_group_io(bits, item, per_word, (1 << bits) - 1)
    return Elem(name=name, BITS=bits, ITEM=item, EMASK=(1 << bits) - 1, SIGN=1 << (bits - 1),
                W=bits - 1, WMASK=(1 << (bits - 1)) - 1, PER_WORD=per_word, GE=32 // bits,
                ENP={8: np.uint8, 16: np.uint16, 32: np.uint32}[bits],
                widen=F.widen, narrow=F.narrow, is_pos=F.is_pos, fmul=F.fmul,
                load_group=load_group, store_group=store_group)
