"""The DLPack bridge: any producer in, DLPack-exportable arrays out, for all five dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import bitsparse_core as bc
from bitsparse_core import dlpack
from bitsparse_core import dtypes as D
from helpers import ALL_DTYPES, random_tensor, same_bits


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_unpack_result_exports_and_reimports_through_dlpack(dtype):
    x = random_tensor(np.random.default_rng(0), (13, 11), dtype, 0.6)
    y = bc.unpack(bc.pack(x, encoding="raw"))
    assert y.__dlpack_device__() == (1, 0)
    imp = dlpack.import_capsule(y.__dlpack__())
    assert (imp.code, imp.bits, imp.shape) == (dtype.dl_code, dtype.bits, (13, 11))
    again = dlpack.numpy_from_imported(imp, dtype)
    assert same_bits(again, x, dtype)
    # The re-imported view must stay valid after the exporter is gone.
    del y, imp
    assert same_bits(again.copy(), x, dtype)


def test_unconsumed_capsule_is_released():
    y = dlpack.exportable(np.ones(4, D.BFLOAT16.numpy))
    before = len(dlpack._LIVE)
    cap = y.__dlpack__()
    assert len(dlpack._LIVE) == before + 1
    del cap
    assert len(dlpack._LIVE) == before


def test_numpy_native_dtypes_use_numpy_export():
    y = bc.unpack(bc.pack(np.arange(6, dtype=np.float32)))
    assert np.array_equal(np.from_dlpack(y), np.arange(6, dtype=np.float32))


def test_non_contiguous_dlpack_producer_is_refused():
    torch = pytest.importorskip("torch")
    x = torch.zeros(8, 8, dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(bc.NonContiguousError):
        bc.pack(x)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_torch_cpu_tensors_round_trip(name):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, name)
    x = torch.randn(33, 17).relu().to(tdt)
    x[0, 0] = -0.0
    p = bc.pack(x, encoding="auto")
    assert p.dtype is D.resolve(name)
    back = torch.from_dlpack(bc.unpack(p))
    assert back.dtype == tdt
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))


def test_unsupported_lanes_and_dtype_pairs():
    with pytest.raises(bc.UnsupportedDTypeError):
        dlpack.resolve_dtype(2, 64, 1)
    with pytest.raises(bc.UnsupportedDTypeError):
        dlpack.resolve_dtype(2, 32, 4)
    assert dlpack.resolve_dtype(1, 8, 1, override="float8_e5m2") is D.FLOAT8_E5M2
