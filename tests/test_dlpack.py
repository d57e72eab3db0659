"""The DLPack bridge: any producer in, DLPack-exportable arrays out, for all five dtypes.

The producer side follows the DLPack >= 1.0 / array API protocol: versioned or legacy
capsules by ``max_version``, ``copy`` (with the is-copied flag), ``dl_device``,
``BufferError`` for what cannot be done, and capsules that never leak -- consumed,
unconsumed, or handed to a consumer that raises.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest

import bitsparse_core as bc
from bitsparse_core import dlpack
from bitsparse_core import dtypes as D
from bitsparse_core.spec import codec as reference
from helpers import ALL_DTYPES, random_tensor, same_bits

NUMPY_NATIVE = (D.FLOAT16, D.FLOAT32)          # numpy has DLPack codes for these two only
# Versioned capsules come from NumPy's exporter, which makes them from NumPy 2.1 on
# (before, our arrays export legacy capsules only, as the protocol allows); NumPy's
# from_dlpack takes copy= / device= from 2.1 on too.
NUMPY_21 = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
needs_numpy_21 = pytest.mark.skipif(not NUMPY_21, reason="needs NumPy >= 2.1")
MAX_VERSIONS = [None, (0, 8), (1, 0), (1, 1), (2, 0)]
COPIES = [None, True, False]
dtype_ids = pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)


def _result(dtype, shape=(13, 11), seed=0):
    x = random_tensor(np.random.default_rng(seed), shape, dtype, 0.6)
    return x, bc.unpack(bc.pack(x, encoding="raw"))


def _versioned(max_version) -> bool:
    """Whether a capsule asked for with ``max_version`` is a versioned one."""
    return max_version is not None and max_version[0] >= 1 and NUMPY_21


def _versioned_struct(cap):
    """The DLManagedTensorVersioned of an unused versioned capsule (for version / flags)."""
    ptr = dlpack._api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
    return dlpack.DLManagedTensorVersioned.from_address(ptr)


def _refs(a) -> int:
    """References to the array owning ``a``'s memory (what every capsule of ``a`` holds:
    NumPy's exporter keeps the data's owner, not the view, alive)."""
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return sys.getrefcount(a)


def _is(cap, name: bytes) -> bool:
    return bool(dlpack._api.PyCapsule_IsValid(cap, name))


def _bits(t, dtype):
    """A torch tensor's bit patterns as a NumPy array of ``dtype`` (any shape, strides)."""
    import torch
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(dtype.numpy).reshape(tuple(t.shape))


class _Unraisable:
    """Collects what Python reports as 'Exception ignored' (a capsule destructor that
    failed, for instance) while the block runs."""

    def __enter__(self):
        self.seen, self._prev = [], sys.unraisablehook
        sys.unraisablehook = self.seen.append
        return self

    def __exit__(self, *exc):
        sys.unraisablehook = self._prev


# --------------------------------------------------------------------------- #
# Round trips                                                                 #
# --------------------------------------------------------------------------- #
@dtype_ids
def test_unpack_result_exports_and_reimports_through_dlpack(dtype):
    x, y = _result(dtype)
    assert y.__dlpack_device__() == (1, 0)
    imp = dlpack.import_capsule(y.__dlpack__())
    assert (imp.code, imp.bits, imp.shape) == (dtype.dl_code, dtype.bits, (13, 11))
    again = dlpack.numpy_from_imported(imp, dtype)
    assert same_bits(again, x, dtype)
    # The re-imported view must stay valid after the exporter is gone.
    del y, imp
    assert same_bits(again.copy(), x, dtype)


def test_numpy_native_dtypes_use_numpy_export():
    y = bc.unpack(bc.pack(np.arange(6, dtype=np.float32)))
    assert np.array_equal(np.from_dlpack(y), np.arange(6, dtype=np.float32))


def test_other_dtypes_defer_to_numpy():
    y = dlpack.exportable(np.arange(6, dtype=np.float32)).astype(np.float64)
    assert isinstance(y, dlpack.DLPackArray)
    got = np.from_dlpack(y)
    assert got.dtype == np.float64 and np.array_equal(got, np.arange(6))


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


# --------------------------------------------------------------------------- #
# Producer: the protocol, read back with our own consumer                     #
# --------------------------------------------------------------------------- #
@dtype_ids
@pytest.mark.parametrize("max_version", MAX_VERSIONS, ids=str)
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
@pytest.mark.parametrize("dl_device", [None, (1, 0)], ids=["own", "cpu"])
def test_capsule_follows_the_protocol(dtype, max_version, copy, dl_device):
    x, y = _result(dtype)
    cap = y.__dlpack__(max_version=max_version, dl_device=dl_device, copy=copy)
    versioned = _versioned(max_version)
    assert _is(cap, b"dltensor_versioned") == versioned
    assert _is(cap, b"dltensor") == (not versioned)
    if versioned:
        m = _versioned_struct(cap)
        assert (m.version.major, m.version.minor) == dlpack.DLPACK_VERSION
        assert m.flags == (dlpack.FLAG_IS_COPIED if copy else 0)
    imp = dlpack.import_capsule(cap)
    assert (imp.device_type, imp.device_id, imp.code, imp.bits, imp.lanes) == (
        1, 0, dtype.dl_code, dtype.bits, 1)
    assert (imp.data == y.ctypes.data) == (not copy)
    assert same_bits(dlpack.numpy_from_imported(imp, dtype), x, dtype)
    assert _is(cap, b"used_dltensor_versioned" if versioned else b"used_dltensor")


@dtype_ids
@pytest.mark.parametrize("dl_device", [(2, 0), (1, 1), (3, 0), (13, 0), (1, -1)], ids=str)
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
def test_other_devices_are_refused_with_buffer_error(dtype, dl_device, copy):
    _, y = _result(dtype)
    with pytest.raises(BufferError, match="device"):
        y.__dlpack__(max_version=(1, 0), dl_device=dl_device, copy=copy)


@dtype_ids
def test_stream_on_cpu_and_malformed_arguments(dtype):
    _, y = _result(dtype)
    for stream in (1, 2, -1, 0):
        with pytest.raises(BufferError, match="stream"):
            y.__dlpack__(stream=stream)
    bad = [{"max_version": "1.0"}, {"max_version": (1,)}, {"max_version": (1.0, 0)},
           {"dl_device": 1}, {"dl_device": (1,)}, {"dl_device": ("cpu", 0)},
           {"copy": "yes"}, {"copy": 1}]
    for kwargs in bad:
        with pytest.raises(TypeError):
            y.__dlpack__(**kwargs)


def test_zero_dim_empty_and_strided_views_export():
    torch = pytest.importorskip("torch")
    for dtype in ALL_DTYPES:
        x, y = _result(dtype, shape=(6, 8))
        for view, ref in ((y[2, 3, ...], x[2, 3, ...]), (y[:, ::2], x[:, ::2]), (y[:0], x[:0]),
                          (y[1:1, :], x[1:1, :])):
            for copy in COPIES:
                t = torch.from_dlpack(view, copy=copy)
                assert tuple(t.shape) == ref.shape
                assert same_bits(_bits(t, dtype), ref, dtype)


@needs_numpy_21
def test_read_only_arrays():
    _, y = _result(D.BFLOAT16)
    y.flags.writeable = False
    with pytest.raises(BufferError, match="readonly"):   # legacy capsules cannot say it
        y.__dlpack__()
    cap = y.__dlpack__(max_version=(1, 0))
    assert _versioned_struct(cap).flags == dlpack.FLAG_READ_ONLY
    view = dlpack.numpy_from_imported(dlpack.import_capsule(cap), D.BFLOAT16)
    assert not view.flags.writeable
    # a copy is ours to write
    cap = y.__dlpack__(max_version=(1, 0), copy=True)
    assert _versioned_struct(cap).flags == dlpack.FLAG_IS_COPIED
    assert dlpack.numpy_from_imported(dlpack.import_capsule(cap), D.BFLOAT16).flags.writeable


# --------------------------------------------------------------------------- #
# Producer, as torch.from_dlpack and numpy.from_dlpack see it                 #
# --------------------------------------------------------------------------- #
@dtype_ids
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_torch_from_dlpack_honours_copy(dtype, copy, device):
    torch = pytest.importorskip("torch")
    x, y = _result(dtype)
    t = torch.from_dlpack(y, copy=copy, device=device)
    assert str(t.dtype) == f"torch.{dtype.name}"
    assert same_bits(_bits(t, dtype), x, dtype)
    assert (t.data_ptr() == y.ctypes.data) == (copy is not True)
    y.view(dtype.uint)[...] = 0           # a copy must not see later writes; an alias must
    assert bool(torch.all(t.view(torch.uint8) == 0)) == (copy is not True)


@dtype_ids
@pytest.mark.parametrize("max_version", MAX_VERSIONS, ids=str)
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
def test_torch_imports_every_capsule_kind(dtype, max_version, copy):
    """torch.from_dlpack always asks for (1, 0); handed a capsule it takes either kind."""
    torch = pytest.importorskip("torch")
    x, y = _result(dtype)
    t = torch.from_dlpack(y.__dlpack__(max_version=max_version, copy=copy))
    assert same_bits(_bits(t, dtype), x, dtype)
    assert (t.data_ptr() == y.ctypes.data) == (not copy)


class _LegacyOnly:
    """A consumer's view of an old producer: ``max_version`` is dropped, legacy capsules."""

    def __init__(self, y):
        self.y = y

    def __dlpack__(self, *, max_version=None, **kwargs):
        return self.y.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.y.__dlpack_device__()


@needs_numpy_21
@pytest.mark.parametrize("dtype", NUMPY_NATIVE, ids=lambda d: d.name)
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_numpy_from_dlpack_honours_copy(dtype, copy, device, legacy):
    x, y = _result(dtype)
    got = np.from_dlpack(_LegacyOnly(y) if legacy else y, copy=copy, device=device)
    assert got.dtype == dtype.numpy and same_bits(got, x, dtype)
    assert np.shares_memory(got, y) == (copy is not True)
    # numpy makes a legacy import read-only; a versioned one keeps our writable flag
    assert got.flags.writeable == (not legacy)


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d not in NUMPY_NATIVE],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_numpy_from_dlpack_refuses_bf16_fp8_cleanly_without_leaking(dtype, copy, legacy):
    """NumPy has no bf16 / fp8 dtype: its from_dlpack raises (RuntimeError up to 2.4,
    BufferError later -- its choice), never SystemError, and every capsule is freed."""
    if copy is not None and not NUMPY_21:
        pytest.skip("numpy.from_dlpack takes copy= from NumPy 2.1")
    _, y = _result(dtype)
    src = _LegacyOnly(y) if legacy else y
    kwargs = {} if copy is None else {"copy": copy}
    gc.collect()
    before = _refs(y)
    with _Unraisable() as unraisable:
        for _ in range(50):
            with pytest.raises((BufferError, TypeError, RuntimeError)) as info:
                np.from_dlpack(src, **kwargs)
            assert type(info.value) is not SystemError
            assert "dtype" in str(info.value)
    del info
    gc.collect()
    assert unraisable.seen == []
    assert _refs(y) == before     # 50 calls, none leaked


# --------------------------------------------------------------------------- #
# Capsule lifetime: the deleter runs exactly once, whoever ends up owning it   #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
@pytest.mark.parametrize("copy", [None, True], ids=["alias", "copy"])
def test_unconsumed_capsules_are_released(max_version, copy):
    base = np.ones(64, np.uint16)
    y = dlpack.exportable(base.view(D.BFLOAT16.numpy))
    before = sys.getrefcount(base)
    caps = [y.__dlpack__(max_version=max_version, copy=copy) for _ in range(50)]
    assert sys.getrefcount(base) == before + (0 if copy else 50)   # each alias holds the data
    del caps
    assert sys.getrefcount(base) == before
    ref = weakref.ref(base)
    del y, base
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_consumed_capsules_are_released_once(max_version):
    torch = pytest.importorskip("torch")
    _, y = _result(D.FLOAT8_E5M2)
    before = _refs(y)
    for _ in range(50):
        t = torch.from_dlpack(y.__dlpack__(max_version=max_version))
        imp = dlpack.import_capsule(y.__dlpack__(max_version=max_version))
        view = dlpack.numpy_from_imported(imp, D.FLOAT8_E5M2)
    assert _refs(y) == before + 2       # the last tensor and the last view
    del t, imp, view
    gc.collect()
    assert _refs(y) == before     # a second deleter call would go below


@needs_numpy_21
def test_capsule_of_a_newer_major_version_is_left_to_its_destructor():
    _, y = _result(D.BFLOAT16)
    before = _refs(y)
    cap = y.__dlpack__(max_version=(1, 0))
    _versioned_struct(cap).version.major = 2
    with pytest.raises(BufferError, match="major version"):
        dlpack.import_capsule(cap)
    assert _is(cap, b"dltensor_versioned") and _refs(y) == before + 1  # unused: not ours
    del cap
    assert _refs(y) == before


def test_consumer_raising_does_not_leak_and_reports_nothing():
    """A consumer that fails after taking the capsule (here: our own, on a dtype it
    cannot read) leaves no capsule behind and no 'Exception ignored' report."""
    _, y = _result(D.BFLOAT16)
    before = _refs(y)
    with _Unraisable() as unraisable:
        for _ in range(50):
            with pytest.raises(bc.UnsupportedDTypeError):
                bc.pack(_LegacyOnly(y), dtype="float16")
    gc.collect()
    assert unraisable.seen == [] and _refs(y) == before


# --------------------------------------------------------------------------- #
# Consumer                                                                    #
# --------------------------------------------------------------------------- #
class _Producer:
    """A third-party CPU producer of the full protocol (here backed by our own array)."""

    def __init__(self, y):
        self.y, self.calls = y, []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.y.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)


def test_consumer_asks_for_versioned_capsules_and_honours_read_only():
    x, y = _result(D.BFLOAT16)
    prod = _Producer(y)
    p = bc.pack(prod)
    assert prod.calls[-1].get("max_version") == dlpack.DLPACK_VERSION
    assert same_bits(bc.unpack(p), x, D.BFLOAT16)
    out = dlpack.exportable(np.zeros_like(x))
    out.flags.writeable = False
    with pytest.raises((bc.OutputMismatchError, BufferError), match="read-?only"):
        bc.unpack(p, out=_Producer(out))      # before NumPy 2.1: its exporter refuses
    assert not out.view(np.uint16).any()
    # a producer that predates max_version is asked again without it
    assert same_bits(bc.unpack(bc.pack(_LegacyOnly(y))), x, D.BFLOAT16)


def test_torch_tensor_requiring_grad_is_packed():
    """pack only reads: a tensor that requires grad is taken as its detached alias
    (torch itself refuses to export it through DLPack)."""
    torch = pytest.importorskip("torch")
    for tdt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        x = torch.randn(9, 70).relu().to(tdt).requires_grad_(tdt.is_floating_point
                                                               and tdt.itemsize > 1)
        if not x.requires_grad:
            continue
        p = bc.pack(x)
        assert x.requires_grad and x.grad is None
        back = torch.from_dlpack(bc.unpack(p))
        assert torch.equal(back.view(torch.uint8), x.detach().view(torch.uint8))
        y, q = bc.relu_pack(x, encoding="signplane")
        assert torch.equal(torch.from_dlpack(y).view(torch.uint8),
                           x.detach().relu().view(torch.uint8))


@pytest.mark.parametrize("shape", [(3, 0), (2, 0, 4), (0,), (0, 5), (4, 0, 0)], ids=str)
@pytest.mark.parametrize("name", ["bfloat16", "float32", "float8_e5m2"])
def test_empty_torch_tensors_are_contiguous(shape, name):
    """torch gives empty tensors strides that look non-contiguous ((3, 0) has (1, 1)),
    and .contiguous() keeps them; an empty tensor has no layout to get wrong."""
    torch = pytest.importorskip("torch")
    for make in (torch.empty, torch.zeros):
        x = make(*shape, dtype=getattr(torch, name))
        for t in (x, x.contiguous()):
            p = bc.pack(t)
            assert p.shape == shape and p.nnz == 0
            back = torch.from_dlpack(bc.unpack(p))
            assert back.shape == x.shape and back.dtype == x.dtype
            y, q = bc.relu_pack(t)
            assert tuple(y.shape) == shape and q.nnz == 0


# --------------------------------------------------------------------------- #
# The CUDA producer (CudaArray), on a CPU with a fake runtime                  #
# --------------------------------------------------------------------------- #
class _FakeRuntime:
    """cupy.cuda.runtime's calls CudaArray makes, on host memory (records them)."""
    memcpyDeviceToHost, memcpyDeviceToDevice = 2, 3

    def __init__(self):
        self.calls, self.device = [], 0

    def getDevice(self):
        return self.device

    def setDevice(self, d):
        self.device = d

    def memcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        self.calls.append(("copy", kind, stream))

    def streamSynchronize(self, stream):
        self.calls.append(("sync", stream))


class _HostBuffer:
    """What an allocator returns (``__cuda_array_interface__``), backed by host memory."""

    def __init__(self, nbytes):
        self.mem = np.zeros(max(nbytes, 1), np.uint8)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                         "data": (self.mem.ctypes.data, False)}


@pytest.fixture
def fake_cuda(monkeypatch):
    from bitsparse_core.backends.cuda import interop
    rt, waits = _FakeRuntime(), []
    monkeypatch.setattr(interop, "_runtime", lambda: rt)
    monkeypatch.setattr(interop, "default_buffer", lambda n, dev, stream: interop.allocate(
        n, dev, stream, lambda n, d, s: _HostBuffer(n)))
    monkeypatch.setattr(interop, "stream_wait", lambda c, p, d: waits.append((c, p, d)))

    def make(dtype, shape=(5, 7)):
        x = random_tensor(np.random.default_rng(3), shape, dtype, 0.5)
        host = np.ascontiguousarray(x)
        return x, interop.CudaArray(host.ctypes.data, shape, dtype, 0, host, stream=7)
    return make, rt, waits


@dtype_ids
@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
@pytest.mark.parametrize("copy", COPIES, ids=lambda c: f"copy={c}")
def test_cuda_array_export_on_its_device(fake_cuda, dtype, max_version, copy):
    make, rt, waits = fake_cuda
    x, a = make(dtype)
    before = sys.getrefcount(a)
    cap = a.__dlpack__(stream=5, max_version=max_version, dl_device=(2, 0), copy=copy)
    assert waits == [(5, 7, 0)]                         # our work ordered before stream 5
    if _versioned(max_version):
        assert _versioned_struct(cap).flags == (dlpack.FLAG_IS_COPIED if copy else 0)
    imp = dlpack.import_capsule(cap)
    assert (imp.device_type, imp.device_id, imp.code, imp.shape) == (2, 0, dtype.dl_code,
                                                                     (5, 7))
    assert (imp.data == a.ptr) == (not copy)
    assert rt.calls == ([("copy", rt.memcpyDeviceToDevice, 5)] if copy else [])
    assert same_bits(dlpack.numpy_from_imported(imp, dtype), x, dtype)
    del cap, imp
    gc.collect()
    assert sys.getrefcount(a) == before


def test_cuda_array_streams(fake_cuda):
    make, rt, waits = fake_cuda
    _, a = make(D.BFLOAT16)
    a.__dlpack__()
    a.__dlpack__(stream=-1, copy=True)                 # no ordering; the copy runs on ours
    assert waits == [(1, 7, 0)] and rt.calls == [("copy", rt.memcpyDeviceToDevice, 7)]
    for bad in (0, -2):
        with pytest.raises(BufferError, match="stream"):
            a.__dlpack__(stream=bad)
    with pytest.raises(TypeError):
        a.__dlpack__(stream="legacy")


@pytest.mark.parametrize("dl_device", [(2, 1), (13, 0), (3, 0), (1, 1)], ids=str)
def test_cuda_array_refuses_other_devices(fake_cuda, dl_device):
    make, _, _ = fake_cuda
    _, a = make(D.FLOAT16)
    with pytest.raises(BufferError, match="device"):
        a.__dlpack__(dl_device=dl_device)


@dtype_ids
@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_cuda_array_export_to_cpu_copies(fake_cuda, dtype, max_version):
    make, rt, waits = fake_cuda
    x, a = make(dtype)
    with pytest.raises(dlpack.CopyRefusedError) as info:
        a.__dlpack__(dl_device=(1, 0), copy=False)
    assert isinstance(info.value, BufferError) and isinstance(info.value, ValueError)
    assert rt.calls == []
    # A consumer's stream on our device (torch passes its current one) is accepted: the
    # host copy is complete when the export returns, so it needs no ordering.
    for copy, stream in ((None, None), (True, None), (None, 5)):
        rt.calls.clear()
        cap = a.__dlpack__(dl_device=(1, 0), copy=copy, max_version=max_version, stream=stream)
        assert rt.calls[-1] == ("sync", 7)
        if _versioned(max_version):
            assert _versioned_struct(cap).flags == dlpack.FLAG_IS_COPIED
        imp = dlpack.import_capsule(cap)
        assert (imp.device_type, imp.device_id) == (1, 0) and imp.data != a.ptr
        assert same_bits(dlpack.numpy_from_imported(imp, dtype), x, dtype)


def test_cuda_array_cpu_export_reaches_torch(fake_cuda):
    torch = pytest.importorskip("torch")
    make, _, _ = fake_cuda
    x, a = make(D.BFLOAT16)
    t = torch.from_dlpack(a.__dlpack__(dl_device=(1, 0), max_version=(1, 0)))
    assert t.device.type == "cpu" and t.dtype == torch.bfloat16
    assert same_bits(_bits(t, D.BFLOAT16), x, D.BFLOAT16)


@pytest.mark.parametrize("np_dtype,code", [("u1", 1), ("<u4", 1), ("<u8", 1), ("<i4", 0)])
def test_device_plane_describes_its_integers(fake_cuda, np_dtype, code):
    """A packed tensor's plane on a GPU: its dtype is NumPy's, its bytes export through
    the array interface and DLPack with that dtype's code, and ``get`` copies them."""
    from bitsparse_core.backends.cuda import interop
    _, rt, waits = fake_cuda
    host = np.arange(24, dtype=np.uint8)
    buf = interop.DeviceBuffer(host.ctypes.data, host.nbytes, 0, host)
    plane = interop.plane_of(buf, 8, 16, np_dtype, 7)
    want = host[8:24].view(np_dtype)
    assert plane.dtype == np.dtype(np_dtype) and len(plane) == plane.shape[0] == want.size
    assert plane.nbytes == 16 and interop.plane_ptr(plane) == host.ctypes.data + 8
    assert interop.plane_len(plane) == want.size
    cai = plane.__cuda_array_interface__
    assert cai["typestr"] == want.dtype.str and cai["data"][0] == host.ctypes.data + 8
    assert cai["stream"] == 7
    got = plane.get()
    assert type(got) is np.ndarray and got.dtype == want.dtype and np.array_equal(got, want)
    assert rt.calls[-1] == ("sync", 7)                 # the copy waited for the producer
    imp = dlpack.import_capsule(plane.__dlpack__(stream=5))
    assert (imp.code, imp.bits, imp.shape, imp.data) == (code, 8 * want.itemsize,
                                                         (want.size,), plane.ptr)
    assert waits[-1] == (5, 7, 0)
    empty = interop.plane_of(buf, 0, 0, np_dtype, 7)
    assert interop.plane_ptr(empty) == 0 and interop.plane_len(empty) == 0
    with pytest.raises(TypeError, match="never allocated"):   # a view, not an allocation
        interop.DevicePlane.empty((4,), bc.dtypes.BFLOAT16, 0, 7)
    # a plane packs again only with a dtype= naming the bits it holds
    if np.dtype(np_dtype).itemsize in (1, 4):
        with pytest.raises(bc.UnsupportedDTypeError):
            interop.import_cuda(plane, stream=7)
        name = "float8_e4m3fn" if np.dtype(np_dtype).itemsize == 1 else "float32"
        assert interop.import_cuda(plane, dtype=name, stream=7).dtype.name == name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_planes_view_in_cupy_and_torch(backend):
    """The planes of a GPU pack are views: CuPy and torch read them without a copy, and
    they hold the reference's bytes."""
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    if not bc.backend_available(backend):
        pytest.skip(f"{backend} unavailable")
    x = random_tensor(np.random.default_rng(5), (3, 1000), D.BFLOAT16, 0.7)
    d = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    p = bc.pack(d, encoding="signplane", backend=backend)
    ref = reference.pack_array(x, D.BFLOAT16, "signplane")
    for name in ("mask", "offsets", "values", "signs"):
        plane, want = getattr(p, name), np.asarray(getattr(ref, name))
        c = cp.asarray(plane)
        assert c.data.ptr == plane.ptr and c.dtype == plane.dtype
        assert np.array_equal(cp.asnumpy(c), want)
        if plane.dtype == np.uint8:        # torch's uint32 / uint64 support few ops
            t = torch.from_dlpack(plane)
            assert t.data_ptr() == plane.ptr and np.array_equal(t.cpu().numpy(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_gpu_unpack_result_follows_the_protocol(name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    x = torch.randn(64, 33, device="cuda").relu().to(getattr(torch, name))
    y = bc.unpack(bc.pack(x, backend="cupy"))
    alias = torch.from_dlpack(y)
    copy = torch.from_dlpack(y, copy=True)
    assert alias.data_ptr() == y.ptr and copy.data_ptr() != y.ptr
    assert torch.equal(copy.view(torch.uint8), x.view(torch.uint8))
    host = torch.from_dlpack(y, device="cpu")
    assert host.device.type == "cpu" and torch.equal(host.view(torch.uint8),
                                                      x.cpu().view(torch.uint8))
    with pytest.raises((BufferError, ValueError)):
        torch.from_dlpack(y, device="cpu", copy=False)


def test_torch_block_on_the_current_device_skips_the_device_switch(monkeypatch):
    """``interop.torch_buffer`` takes a block on torch's current device straight from the
    binding torch's ``caching_allocator_alloc`` calls, and on another device (or before
    torch has set CUDA up) through that function; either way a ``TorchBlock`` gives it
    back through torch's delete, and the legacy default stream (1) asks for the null
    stream's pool."""
    torch = pytest.importorskip("torch")
    from bitsparse_core.backends.cuda import interop as ci
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc",
                        lambda n, s: calls.append(("raw", n, s)) or 4096, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete",
                        lambda p: calls.append(("delete", p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc",
                        lambda n, d, s: calls.append(("public", n, d, s)) or 8192)
    b = ci.torch_buffer(100, 1, 1)
    assert (b.ptr, b.nbytes, b.device) == (4096, 100, 1)
    c = ci.torch_buffer(200, 0, 77)
    assert c.ptr == 8192
    del b, c
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ci.torch_buffer(300, 1, 77)
    assert calls == [("raw", 100, 0), ("public", 200, 0, 77), ("delete", 4096), ("delete", 8192),
                     ("public", 300, 1, 77), ("delete", 8192)]
    assert ci.torch_buffer(0, 1, 77).owner is None and len(calls) == 6
