"""The Numba backend's launches by function handle (backends/numba/launch.py), on the CPU.

The record's layout is checked here against Numba's own marshalling of the same
arguments (``_Kernel._prepare_args``, run on a stand-in kernel), and the guards that
keep a kernel on the dispatcher are exercised with a stand-in dispatcher. The
driver's side (the function handle, ``cuFuncGetParamInfo``, the launch itself) runs
only on a GPU: tests/test_gpu_numba.py runs every Numba op through it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

numba_types = pytest.importorskip("numba.core.types")

from bitsparse_core.backends.numba import launch as L  # noqa: E402

U8 = np.dtype(np.uint8)
U64 = np.dtype(np.uint64)


class _Kernel:
    """What HandleLaunch reads of a compiled Numba kernel."""

    def __init__(self, argument_types, **attrs):
        self.argument_types = argument_types
        self.__dict__.update(attrs)

    # Numba's marshalling of a 1-D array, an integer or a boolean (as in numba-cuda's
    # _Kernel._prepare_args), for the values check.
    def _prepare_args(self, ty, val, stream, retr, kernelargs):
        if isinstance(ty, numba_types.Array):
            kernelargs += [0, 0, val.size, val.itemsize, val.ptr, *val.shape, *val.strides]
        elif isinstance(ty, numba_types.Integer):
            kernelargs.append(getattr(ctypes, f"c_{ty}")(val))
        else:
            kernelargs.append(val)


class _DeviceArray:
    def __init__(self, a: L.KernelArray):
        self.size, self.itemsize, self.ptr = a.count, a.dtype.itemsize, a.ptr
        self.shape, self.strides = (a.count,), (a.dtype.itemsize,)


TYPES = [numba_types.Array(numba_types.uint8, 1, "C"), numba_types.int64, numba_types.boolean,
         numba_types.uint32, numba_types.Array(numba_types.uint64, 1, "C")]


def _args(n=1000, flag=True):
    return [L.KernelArray(0x7000_0000 + 64, n, U8, None), n * 3, flag, 7,
            L.KernelArray(0x7100_0000 if n else 0, n // 8, U64, None)]


def _sizes(kernel):
    return [8, 8, 8, 8, 8, 8, 8, 8, 1, 4, 8, 8, 8, 8, 8, 8, 8]


@pytest.fixture
def no_driver(monkeypatch):
    """The driver's answers where there is no GPU: a handle, and the parameter sizes of
    TYPES as NVVM lays them out."""
    monkeypatch.setattr(L, "_function_handle", lambda kernel: 0x1234)
    monkeypatch.setattr(L, "_param_sizes", lambda func: _sizes(None))


def test_kernel_array_is_plain_data():
    a = L.KernelArray(4096, 10, U8, owner := object())
    assert (a.ptr, a.count, a.size, a.dtype, a.owner) == (4096, 10, 10, U8, owner)
    assert L.kinds_of([a, 3, True]) == (U8, int, bool)


@pytest.mark.parametrize("n,flag", [(1000, True), (0, False), (8, True)])
def test_record_matches_numbas_marshalling(no_driver, n, flag):
    kernel = _Kernel(TYPES)
    args = _args(n, flag)
    launch = L.HandleLaunch(kernel, args)
    launch.fill(args)
    numba_args = [_DeviceArray(a) if isinstance(a, L.KernelArray) else a for a in args]
    assert launch.values() == L.numba_values(kernel, numba_args, 0)
    assert [ctypes.sizeof(f) for f in launch.fields] == _sizes(None)
    # the launch's void** points at the fields, in order
    assert [launch.pointers[i] for i in range(len(launch.fields))] == \
        [ctypes.addressof(f) for f in launch.fields]


def test_a_refill_changes_only_what_the_arguments_say(no_driver):
    launch = L.HandleLaunch(_Kernel(TYPES), _args())
    launch.fill(_args(1000, True))
    first = launch.values()
    launch.fill(_args(16, False))
    second = launch.values()
    changed = [i for i, (a, b) in enumerate(zip(first, second)) if a != b]
    # count and shape of both arrays, the int, the bool
    assert changed == [2, 5, 7, 8, 12, 15]


def test_parameter_sizes_that_differ_keep_the_dispatcher(monkeypatch):
    monkeypatch.setattr(L, "_function_handle", lambda kernel: 0x1234)
    monkeypatch.setattr(L, "_param_sizes", lambda func: _sizes(None)[:-1])
    with pytest.raises(TypeError, match="parameter sizes"):
        L.HandleLaunch(_Kernel(TYPES), _args())
    monkeypatch.setattr(L, "_param_sizes", lambda func: None)     # a driver that cannot say
    with pytest.raises(TypeError):
        L.HandleLaunch(_Kernel(TYPES), _args())


@pytest.mark.parametrize("ty", [numba_types.Array(numba_types.uint8, 2, "C"),
                                numba_types.Array(numba_types.uint8, 1, "A"),
                                numba_types.float32])
def test_argument_types_not_covered_raise(no_driver, ty):
    with pytest.raises(TypeError, match="not"):
        L.HandleLaunch(_Kernel([ty]), [L.KernelArray(64, 4, U8, None)])


class _Dispatcher:
    """A Numba dispatcher stand-in: ``d[grid, block, stream](*args)`` runs ``kernel``'s
    pre-launch callbacks, as numba-cuda's launch configuration does."""

    def __init__(self, kernel, callbacks=True):
        self.kernel, self.callbacks, self.calls = kernel, callbacks, 0

    def __getitem__(self, config):
        outer = self

        class Config:
            def __init__(self):
                if outer.callbacks:
                    self.pre_launch_callbacks = []

            def __call__(self, *args):
                outer.calls += 1
                for cb in getattr(self, "pre_launch_callbacks", []):
                    cb(outer.kernel, self)
        return Config()


def _numba_args(args):
    return [_DeviceArray(a) if isinstance(a, L.KernelArray) else a for a in args]


def test_first_launch_runs_the_dispatcher_and_returns_the_checked_record(no_driver):
    d = _Dispatcher(_Kernel(TYPES))
    args = _args()
    launch = L.first_launch(d, 4, 256, 0, args, _numba_args(args))
    assert d.calls == 1 and isinstance(launch, L.HandleLaunch)


@pytest.mark.parametrize("attrs", [{"launch_config_sensitive": True}, {"debug": True},
                                   {"extensions": [object()]}])
def test_kernels_the_record_does_not_cover_keep_the_dispatcher(no_driver, attrs):
    d = _Dispatcher(_Kernel(TYPES, **attrs))
    args = _args()
    assert L.first_launch(d, 4, 256, 0, args, _numba_args(args)) is None
    assert d.calls == 1


def test_a_marshalling_that_differs_keeps_the_dispatcher(no_driver):
    class Shifted(_Kernel):
        def _prepare_args(self, ty, val, stream, retr, kernelargs):
            super()._prepare_args(ty, val, stream, retr, kernelargs)
            if isinstance(ty, numba_types.Array):      # e.g. a new field in a later Numba
                kernelargs.insert(len(kernelargs) - 3, 0)
    d = _Dispatcher(Shifted(TYPES))
    args = _args()
    assert L.first_launch(d, 4, 256, 0, args, _numba_args(args)) is None


def test_without_launch_callbacks_the_dispatcher_stays(no_driver):
    d = _Dispatcher(_Kernel(TYPES), callbacks=False)
    args = _args()
    assert L.first_launch(d, 4, 256, 0, args, _numba_args(args)) is None
    assert d.calls == 1


def test_the_platform_launches_by_handle_after_the_first_launch(monkeypatch):
    """_GpuPlatform.launch's cache: the first launch of a kernel for a set of argument
    kinds goes through the dispatcher with Numba device arrays and keeps what
    first_launch returns; later ones call that; a kernel first_launch did not cover
    (None) keeps the dispatcher; other argument kinds or another device start afresh."""
    backend = pytest.importorskip("bitsparse_core.backends.numba.backend")
    if backend.K.SIM:
        pytest.skip("under the CUDA simulator the backend runs _SimPlatform")
    P = backend._GpuPlatform()
    monkeypatch.setattr(P, "_device_array", lambda a: ("numba array", a.ptr))
    handled, firsts = [], []

    def fake_first(dispatcher, grid, block, stream, args, numba_args):
        firsts.append((dispatcher, numba_args))
        dispatcher.calls += 1
        return None if dispatcher.keep else (lambda g, b, s, a: handled.append((g, b, s, a)))
    monkeypatch.setattr(backend, "first_launch", fake_first)

    class Dispatcher:
        def __init__(self, keep):
            self.keep, self.calls = keep, 0

        def __getitem__(self, config):
            return lambda *numba_args: setattr(self, "calls", self.calls + 1)

    st = (5, "numba stream", 0)         # (handle, Numba stream, device)
    k = Dispatcher(keep=False)
    args = [L.KernelArray(4096, 10, U8, None), 3, True]
    P.launch(k, 4, 256, st, *args)
    assert k.calls == 1 and firsts[0][1] == [("numba array", 4096), 3, True] and not handled
    P.launch(k, 8, 256, st, *args)
    P.launch(k, 2, 128, st, L.KernelArray(8192, 99, U8, None), 7, False)   # same kinds
    assert k.calls == 1 and [h[:3] for h in handled] == [(8, 256, 5), (2, 128, 5)]
    P.launch(k, 4, 256, st, L.KernelArray(4096, 10, U64, None), 3, True)   # another dtype
    P.launch(k, 4, 256, (5, "numba stream", 1), *args)                    # another device
    assert k.calls == 3 and len(handled) == 2
    P.launch(k, 0, 256, st, *args)                                         # an empty grid
    assert k.calls == 3 and len(handled) == 2

    kept = Dispatcher(keep=True)
    for _ in range(3):
        P.launch(kept, 4, 256, st, *args)
    assert kept.calls == 3 and len(firsts) == 4     # first_launch once, the dispatcher after
