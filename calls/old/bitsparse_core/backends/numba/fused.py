"""``relu_backward``: grad where the mask bit is set, else +0, one group of 8
elements per thread (the other fused ops expand packed values: :mod:`.unpack`)."""

from __future__ import annotations

from numba import cuda, int32, int64


def make_relu_backward(el):
    """k_relu_backward of element type ``el``."""
    load_group, store_group = el.load_group, el.store_group

    @cuda.jit
    def k_relu_backward(mask, numel, ge, g64, guse64, oe, o64, ouse64):
        """grad where the mask bit is set, else +0: one group per thread."""
        v = cuda.local.array(8, int64)
        ngroups = (numel + 7) >> 3
        g = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        step = int64(cuda.gridDim.x) * cuda.blockDim.x
        while g < ngroups:
            full = g * 8 + 8 <= numel
            load_group(ge, g64, guse64 and full, numel, g, v)
            byte = int32(mask[g])
            for j in range(8):
                if ((byte >> j) & 1) == 0:
                    v[j] = 0
            store_group(oe, o64, ouse64 and full, numel, g, v)
            g += step

    return k_relu_backward
