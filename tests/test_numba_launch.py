"""The Numba backend's launches by function handle (backends/numba/launch.py), on the CPU.

The record's layout is checked here against Numba's own marshalling of the same
arguments (``_Kernel._prepare_args``, run on a stand-in kernel), and the guards that
keep a kernel on the dispatcher are exercised with a stand-in dispatcher; a pack
plan's records of its own (BoundLaunch, backend._PackLaunches) are checked against
what the platform's launches fill, on stand-in memory; the entry points' one driver
query for the context and its device is checked with a stand-in driver. The
driver's side (the function handle, ``cuFuncGetParamInfo``, the launch itself) runs
only on a GPU: tests/test_gpu_numba.py runs every Numba op through it.
"""

from __future__ import annotations

import ctypes
import threading

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


def _layout(sizes):
    """(offset, size) of each parameter as the driver gives them: each at the next
    multiple of its size."""
    layout, end = [], 0
    for size in sizes:
        end = -(-end // size) * size
        layout.append((end, size))
        end += size
    return layout


@pytest.fixture
def no_driver(monkeypatch):
    """The driver's answers where there is no GPU: a handle, and the parameter sizes of
    TYPES as NVVM lays them out."""
    monkeypatch.setattr(L, "_function_handle", lambda kernel: 0x1234)
    monkeypatch.setattr(L, "_param_layout", lambda func: _layout(_sizes(None)))


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
    # the fields lie in one buffer at the driver's offsets, which the launch's extra
    # array names with its size; the void** (for a cooperative launch) points at them
    base = ctypes.addressof(launch.buffer)
    assert [(ctypes.addressof(f) - base, ctypes.sizeof(f)) for f in launch.fields] == \
        _layout(_sizes(None))
    assert ctypes.sizeof(launch.buffer) == 128 and base % 8 == 0
    extra = [launch.extra[i] for i in range(5)]
    assert extra[0] == 1 and extra[1] == base and extra[2] == 2 and extra[4] is None
    assert ctypes.c_size_t.from_address(extra[3]).value == 128   # the parameters end there
    assert [launch.pointers[i] for i in range(len(launch.fields))] == \
        [ctypes.addressof(f) for f in launch.fields]


def test_the_buffer_size_given_the_driver_is_where_the_parameters_end(monkeypatch):
    """A kernel whose parameters end on a boolean: the buffer is whole 8-byte words, the
    size the launch names is the parameters' end (the driver refuses a larger one)."""
    monkeypatch.setattr(L, "_function_handle", lambda kernel: 0x1234)
    sizes = [8] * 7 + [1]
    monkeypatch.setattr(L, "_param_layout", lambda func: _layout(sizes))
    launch = L.HandleLaunch(_Kernel(TYPES[:1] + [numba_types.boolean]),
                            [L.KernelArray(64, 4, U8, None), True])
    assert ctypes.sizeof(launch.buffer) == 64
    assert ctypes.c_size_t.from_address(launch.extra[3]).value == 57


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
    monkeypatch.setattr(L, "_param_layout", lambda func: _layout(_sizes(None)[:-1]))
    with pytest.raises(TypeError, match="parameter sizes"):
        L.HandleLaunch(_Kernel(TYPES), _args())
    monkeypatch.setattr(L, "_param_layout", lambda func: None)     # a driver that cannot say
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


# --------------------------------------------------------------------------- #
# records bound to a call's buffers (a pack plan's launches)                  #
# --------------------------------------------------------------------------- #
class _Buf:
    """A device buffer stand-in: what KernelArray owners and the platform read."""

    def __init__(self, ptr):
        self.ptr = ptr


def _bound_args(a, b, n=1000, flag=True):
    """TYPES' arguments with the first array 64 bytes into ``a`` and the second at ``b``."""
    return [L.KernelArray(a.ptr + 64 if n else 0, n, U8, a), n * 3, flag, 7,
            L.KernelArray(b.ptr if n else 0, n // 8, U64, b)]


@pytest.mark.parametrize("n", [1000, 0])
def test_a_bound_launch_writes_the_data_pointers_of_its_buffers(no_driver, monkeypatch, n):
    """A BoundLaunch built from one call's arguments, launched with other addresses of
    the same buffers, launches the record a fill of that call's arguments would make:
    only the non-empty arrays' data fields change."""
    launched = []
    monkeypatch.setattr(L.driver, "launch_packed", lambda func, grid, block, smem, stream, rec:
                        launched.append((func, grid, block, stream, rec.values())))
    kernel = _Kernel(TYPES)
    a, b = _Buf(0x7000_0000), _Buf(0x7100_0000)
    first = _bound_args(a, b, n)
    bound = L.BoundLaunch(L.HandleLaunch(kernel, first), L.Launch(object(), 4, 256, first),
                          (a, b), (a.ptr, b.ptr))
    a2, b2 = _Buf(0x9000_0008), _Buf(0x5000_0000)
    bound(11, [a2.ptr, b2.ptr])
    want = L.HandleLaunch(kernel, first)
    want.fill(_bound_args(a2, b2, n))
    assert launched == [(0x1234, 4, 256, 11, want.values())]
    assert len(bound.data) == (2 if n else 0)
    assert bound.record.kernel is kernel


def test_a_bound_launch_needs_every_array_in_its_buffers(no_driver):
    a, b = _Buf(0x7000_0000), _Buf(0x7100_0000)
    args = _bound_args(a, b)
    with pytest.raises(TypeError, match="none of"):
        L.BoundLaunch(L.HandleLaunch(_Kernel(TYPES), args), L.Launch(object(), 4, 256, args),
                      (a,), (a.ptr,))


def test_per_thread_entries_are_the_threads_own_and_bounded():
    cache, plan, other = L.PerThread(3), object(), object()
    cache.put(("k", id(plan)), plan, "record")
    assert cache.get(("k", id(plan)), plan) == "record"
    assert cache.get(("k", id(plan)), other) is None        # another object, the same id
    seen = []
    t = threading.Thread(target=lambda: seen.append(cache.get(("k", id(plan)), plan)))
    t.start()
    t.join()
    assert seen == [None]
    for i in range(3):
        cache.put(i, plan, i)
    assert cache.get(("k", id(plan)), plan) is None and cache.get(2, plan) == 2


class _CompiledStandIn:
    """A compiled kernel stand-in for a dispatcher: argument types from the arguments."""

    sizes: dict = {}

    def __init__(self, dispatcher, args):
        from numba.np.numpy_support import from_dtype
        self.dispatcher, self.argument_types, sizes = dispatcher, [], []
        for a in args:
            if type(a) is L.KernelArray:
                self.argument_types.append(numba_types.Array(from_dtype(a.dtype), 1, "C"))
                sizes += [8] * 7
            elif type(a) is bool:
                self.argument_types.append(numba_types.boolean)
                sizes.append(1)
            else:
                self.argument_types.append(numba_types.int64)
                sizes.append(8)
        self.sizes[id(dispatcher)] = sizes


def _records_on_stand_ins(monkeypatch):
    """The Numba backend module with kernels' handles and parameter sizes taken from
    :class:`_CompiledStandIn` (records built and checked with no GPU); skips under the
    simulator, where the backend runs _SimPlatform."""
    backend = pytest.importorskip("bitsparse_core.backends.numba.backend")
    if backend.K.SIM:
        pytest.skip("under the CUDA simulator the backend runs _SimPlatform")
    monkeypatch.setattr(L, "_function_handle", lambda kernel: id(kernel.dispatcher))
    monkeypatch.setattr(L, "_param_layout",
                        lambda func: _layout(_CompiledStandIn.sizes[func]))
    return backend


def _record_platform(backend, launched):
    """A _GpuPlatform on stand-in memory: allocations at fixed addresses, fills and
    launches written to ``launched`` (a launch as the record its arguments fill)."""
    class RecordingPlatform(backend._GpuPlatform):
        def __init__(self):
            self._local = threading.local()
            self.next = 1 << 32
            self.slots = 0

        def take_slot(self):            # pinned slots at changing addresses
            self.slots += 1
            return (1 << 43) + (self.slots % 3) * 16

        def alloc(self, nbytes, st, allocator):
            buf = _Buf(self.next)
            self.next += nbytes + 4096
            return buf

        def import_plane(self, plane):
            return plane

        def memset0(self, buf, off, nbytes, st):
            launched.append(("memset", buf.ptr + off, nbytes, st[0]))

        def launch(self, kernel, grid, block, st, *args):
            cache = self._local.__dict__.setdefault("launches", {})
            key = (kernel, st[2], L.kinds_of(args))
            if key not in cache:
                cache[key] = L.HandleLaunch(_CompiledStandIn(kernel, args), args)
            cache[key].fill(args)
            launched.append((id(kernel), grid, block, st[0], cache[key].values()))
    return RecordingPlatform()


@pytest.mark.parametrize("fill_limit", [0, None])
def test_pack_plans_launch_by_their_own_records_what_the_platform_would(monkeypatch, fill_limit):
    """_run_pack's records (a plan's third call on: the first marks it, the second
    builds them) launch the records that P.launch fills from the views of each call,
    for inputs at changing and differently aligned addresses, in every pack variant:
    fixed capacity, the worst case of an exact pack (two blocks, its count to a pinned
    slot at a changing address), relu_pack with y, masked_pack; with k_finish (``fill_limit`` 0) and without (the default's, these
    packs being small). The run without records is the reference."""
    backend = _records_on_stand_ins(monkeypatch)
    from types import SimpleNamespace

    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda.abi import Mode
    from bitsparse_core.backends.cuda.host import pack_plan
    from bitsparse_core.spec.format import Encoding
    K, dt = backend.K, _dt.BFLOAT16
    variant = K.COMMITTED if fill_limit is None else K.PackVariant(fill_limit=fill_limit)
    be, shape, st = backend.NumbaBackend(variant), (3, 20001), (7, None, 0)
    numel = shape[0] * shape[1]

    def plan(enc, cap, mode=Mode.PACK):
        return pack_plan(shape, dt, enc, cap, 12, mode)

    def calls(P):
        for turn in range(7):
            # turns 0-2 and 4-6 alternate addresses; 3 onwards x is 2 bytes off 8
            x = _Buf((1 << 40) + (turn % 2) * (1 << 30) + (2 if turn >= 3 else 0))
            y = _Buf((1 << 41) + (turn % 2) * (1 << 30))
            for enc, cap, fixed in ((Encoding.NOSIGN, 9000, True), (Encoding.RAW, 9000, True),
                                    (Encoding.SIGNPLANE, numel, False)):
                backend._NumbaSteps(be, P, st, x, dt, K.MODE_PACK, None, None).run(
                    plan(enc, cap), fixed, count=not fixed)
            backend._NumbaSteps(be, P, st, x, dt, K.MODE_RELU, None, y).run(
                plan(Encoding.NOSIGN, 9000, Mode.RELU), True)
            masked = plan(Encoding.SIGNPLANE, 7000, Mode.MASKED)
            recipe = backend._recipe(masked, be.variant)
            al = backend._Alloc(P, masked, recipe.sections(False), st, None)
            p_mask = SimpleNamespace(mask=_Buf((1 << 42) + (turn % 2) * 64))
            be._run_pack(P, st, x, recipe, K.MODE_MASKED, al, None, p_mask, zero_tail=False)

    class NoRecords(L.PerThread):
        def get(self, key, anchor):
            return None

    reference, launched, by_driver = [], [], []
    monkeypatch.setattr(backend, "_PACK_LAUNCHES", NoRecords(1024))
    calls(_record_platform(backend, reference))

    def driver_launch(func, grid, block, smem, stream, rec):
        by_driver.append(func)
        launched.append((func, grid, block, stream, rec.values()))
    monkeypatch.setattr(L.driver, "launch_packed", driver_launch)
    monkeypatch.setattr(backend, "_PACK_LAUNCHES", L.PerThread(1024))
    calls(_record_platform(backend, launched))
    assert launched == reference
    # turns 2, 5 and 6: the pack and finish of 4 variants, the pack of raw and masked;
    # the pack alone of all 5 where the fill zeroed the values
    assert len(by_driver) == 3 * (4 * 2 + 2 if fill_limit == 0 else 5)


def test_unpack_family_launches_by_its_own_records_what_the_platform_would(monkeypatch):
    """The unpack family's records (NumbaBackend._queue: a key's third call on) launch
    the records that P.launch fills from each call's views, for planes, gradients and
    outputs at changing and differently aligned addresses, in every op: unpack,
    relu2_backward, relu_backward, gated_backward with u packed under r's mask (op 2) and
    under its own (op 3, u unpacked first), and an unpack whose chunks are larger than
    the kernel's tile (a scratch per call: never a record). The run without records is
    the reference."""
    backend = _records_on_stand_ins(monkeypatch)
    from types import SimpleNamespace

    from bitsparse_core import dtypes as _dt
    from bitsparse_core.spec.format import Encoding, cached_layout
    dt, shape, st = _dt.BFLOAT16, (3, 20001), (7, None, 0)
    numel = shape[0] * shape[1]
    be = backend.NumbaBackend()

    def packed(base, enc, cap, chunk_log2=12, mask=None, offsets=None):
        """A packed tensor's stand-in: its planes at ``base`` (+1 byte for odd values)."""
        return SimpleNamespace(
            shape=shape, numel=numel, dtype=dt, encoding=enc, chunk_log2=chunk_log2,
            layout=cached_layout(shape, dt, enc, cap, chunk_log2),
            mask=mask or _Buf(base), offsets=offsets or _Buf(base + (1 << 20)),
            values=_Buf(base + (2 << 20) + (base >> 24) % 2), signs=_Buf(base + (3 << 20)))

    def calls(P):
        for turn in range(7):
            at = (1 << 40) + (turn % 2) * (1 << 30) + (turn >= 3) * (1 << 24)
            odd = 2 if turn >= 3 else 0          # from turn 3 the gradient is 2 bytes off 8
            p = packed(at, Encoding.NOSIGN, 9000)
            p_big = packed(at + (8 << 20), Encoding.SIGNPLANE, 9000, chunk_log2=16)
            p_u = packed(at + (16 << 20), Encoding.SIGNPLANE, 9000, mask=p.mask,
                         offsets=p.offsets)
            p_own = packed(at + (24 << 20), Encoding.RAW, numel)
            g = _Buf((1 << 41) + (turn % 2) * 4096 + odd)
            outs = [_Buf((1 << 42) + k * (1 << 28) + (turn % 2) * 4096) for k in range(3)]
            be._decode(P, st, p, 0, None, outs[0], None)
            be._decode(P, st, p, 1, g, outs[1], None)
            be._decode(P, st, p_big, 0, None, outs[2], None)
            be._gated(P, st, p, p_u, g, outs[0], outs[1], None)
            be._gated(P, st, p, p_own, g, outs[1], outs[2], None)
            be._relu_backward(P, st, p, g, outs[2])

    def platform(launched):
        P = _record_platform(backend, launched)

        def new_dense(shape_, dt_, st_, allocator):     # 256-byte aligned, as allocators give
            buf = P.alloc(-(-numel * dt_.itemsize // 256) * 256, st_, allocator)
            return buf, buf

        P.new_dense = new_dense
        return P

    class NoRecords(L.PerThread):
        def get(self, key, anchor):
            return None

    reference, launched, by_driver = [], [], []
    monkeypatch.setattr(backend, "_OP_LAUNCHES", NoRecords(1024))
    calls(platform(reference))

    def driver_launch(func, grid, block, smem, stream, rec):
        by_driver.append(func)
        launched.append((func, grid, block, stream, rec.values()))
    monkeypatch.setattr(L.driver, "launch_packed", driver_launch)
    monkeypatch.setattr(backend, "_OP_LAUNCHES", L.PerThread(1024))
    calls(platform(launched))
    assert launched == reference
    # turns 2, 5 and 6: unpack, relu2_backward, both gated (op 3 with its u's unpack)
    # and relu_backward by records; the large chunks' unpack (three launches) never
    assert len(by_driver) == 3 * 6


def test_small_packs_zero_their_values_with_the_scratch_and_run_no_finish():
    """Up to the variant's fill limit, the fill before a pack covers its values, signs,
    status area and the scratch's zeroed head (one range of one allocation, in both
    layouts) and the tiles OR their shared words (no k_finish); past it, or with the
    limit 0, the fill is the scratch's head alone."""
    backend = pytest.importorskip("bitsparse_core.backends.numba.backend")
    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda.abi import Mode
    from bitsparse_core.backends.cuda.host import pack_plan
    from bitsparse_core.spec.format import Encoding
    K = backend.K
    small = pack_plan((3, 20001), _dt.BFLOAT16, Encoding.SIGNPLANE, 9000, 12, Mode.PACK)
    for split in (False, True):
        rec = backend._recipe(small, K.COMMITTED)
        sec = rec.sections(split)
        vi, vo, _ = sec.at["values"]
        si, so = sec.scratch
        assert sec.ored and vi == si and sec.fill == (vi, vo, so + rec.head - vo)
        assert sec.at["signs"][0] == vi and vo < sec.at["signs"][1] < so
        off = backend._recipe(small, K.PackVariant(fill_limit=0)).sections(split)
        assert not off.ored and off.fill == (si, so, rec.head)
    big = pack_plan((4096, 4096), _dt.BFLOAT16, Encoding.NOSIGN, 1 << 23, 12, Mode.PACK)
    sec = backend._recipe(big, K.COMMITTED).sections(False)
    assert sec.at["values"][2] > K.PackVariant.fill_limit
    assert not sec.ored and sec.fill[1] == sec.scratch[1]


def test_entry_points_ask_the_driver_once_and_forget_the_device(monkeypatch):
    """An entry point with a current context asks the driver once (cuCtxGetDevice) and
    keeps the device for the call, where the platform reads it without asking again;
    the device is forgotten when the call returns or raises, a nested entry point
    leaves its caller's, and without a context the entry point runs in a Numba context
    scope. (On a GPU: test_gpu_numba's entry-point test.)"""
    backend = pytest.importorskip("bitsparse_core.backends.numba.backend")
    if backend.K.SIM:
        pytest.skip("under the simulator every entry point runs in its scope")
    asked = []
    device = {"now": 3}

    def current_device():
        asked.append(device["now"])
        return device["now"]

    monkeypatch.setattr(backend.driver, "current_device", current_device)
    scoped_calls = []

    def require_context(method):
        def scoped(*args, **kwargs):
            scoped_calls.append(method.__name__)
            return method(*args, **kwargs)
        return scoped

    monkeypatch.setattr(backend._cuda, "require_context", require_context)
    platform = backend._GpuPlatform.__new__(backend._GpuPlatform)   # _dev needs only .cuda

    @backend._one_context
    def inner():
        return platform._dev()

    @backend._one_context
    def outer(fail=False):
        seen = [platform._dev()]
        device["now"] = 5                     # the inner entry point's context
        seen.append(inner())
        seen.append(platform._dev())          # the caller's device again
        if fail:
            raise RuntimeError("an op that fails")
        return seen

    assert outer() == [3, 5, 3] and asked == [3, 5]
    assert getattr(backend._ENTRY, "device", None) is None
    device["now"], asked[:] = 3, []
    with pytest.raises(RuntimeError):
        outer(fail=True)
    assert getattr(backend._ENTRY, "device", None) is None and asked == [3, 5]
    # No current context: the entry point runs in a Numba scope, whose context (here a
    # stand-in's device 7) the platform then asks Numba for.
    device["now"] = None

    class _Scope:
        id = 7
    platform.cuda = type("numba_cuda", (), {"get_current_device": staticmethod(_Scope)})
    assert scoped_calls == [] and inner() == 7 and scoped_calls == ["inner"]


def test_unpack_prefetch_is_refused_by_name_before_sm90(monkeypatch):
    """PackVariant(unpack_prefetch=True) builds cp.async.bulk.prefetch, which older GPUs
    lack: the kernels are refused with UnsupportedDeviceError on such a device, built on
    sm_90, and built where no device can be asked (an offline SASS build)."""
    from numba import cuda

    from bitsparse_core.backends.numba import kernels as K
    from bitsparse_core.errors import UnsupportedDeviceError

    if K.SIM:
        pytest.skip("the simulator has no compute capability to check")

    class Device:
        compute_capability = (8, 0)

    monkeypatch.setattr(cuda, "get_current_device", lambda: Device())
    with pytest.raises(UnsupportedDeviceError, match="9.0"):
        K.DtypeKernels("bfloat16", K.PackVariant(unpack_prefetch=True))
    Device.compute_capability = (9, 0)
    assert K.DtypeKernels("bfloat16", K.PackVariant(unpack_prefetch=True)).unpack

    def no_driver():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(cuda, "get_current_device", no_driver)
    assert K.DtypeKernels("bfloat16", K.PackVariant(unpack_prefetch=True)).unpack


def test_the_default_prefetches_where_the_device_has_it(monkeypatch):
    """The default variant's unpack family asks for L2 prefetches on sm_90 and later, is
    built without them on an older device or where no device can be asked, and never
    raises for it (an explicit True does: the test above)."""
    from numba import cuda

    from bitsparse_core.backends.numba import kernels as K

    if K.SIM:
        assert K.DtypeKernels("bfloat16", K.PackVariant()).prefetch
        return

    class Device:
        compute_capability = (8, 0)

    monkeypatch.setattr(cuda, "get_current_device", lambda: Device())
    assert not K.DtypeKernels("bfloat16", K.PackVariant()).prefetch
    Device.compute_capability = (9, 0)
    assert K.DtypeKernels("bfloat16", K.PackVariant()).prefetch

    def no_driver():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(cuda, "get_current_device", no_driver)
    assert not K.DtypeKernels("bfloat16", K.PackVariant()).prefetch
    assert not K.DtypeKernels("bfloat16", K.PackVariant(unpack_prefetch=False)).prefetch


def test_fixed_packs_run_whole_by_one_object_what_the_steps_would(monkeypatch):
    """A fixed-capacity pack whose arguments this thread has packed with twice runs by
    one object (``_FixedPack``, from the third call on): the fills and launches it
    queues and the packed tensor it returns (capacity, count, every plane's address,
    length, dtype and owner, status, stream) are those of the protocol's steps, for
    pack (nosign, raw, signplane), relu_pack with y and masked_pack, with inputs at
    changing and differently aligned addresses. Calls the protocol treats apart never
    take it: ``capacity=True``, ``encoding="auto"``, another kernel variant."""
    backend = _records_on_stand_ins(monkeypatch)
    from types import SimpleNamespace

    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda import interop
    from bitsparse_core.errors import CapacityError
    from bitsparse_core.spec.format import Encoding
    K, dt = backend.K, _dt.BFLOAT16
    be, shape, st = backend.NumbaBackend(), (3, 20001), (7, None, 0)

    class DevBuf(_Buf):
        device = 0

    def describe(p):
        def plane(a):
            if a is None or isinstance(a, _Buf):
                return a and ("mask tensor's", a.ptr)
            return (a.ptr, a.shape, a.dtype, a.device, a.stream, a._owner.ptr)
        return (p.shape, p.dtype, p.encoding, p.chunk_log2, p.capacity, p._nnz, p.device,
                p.extra, *(plane(getattr(p, n)) for n in
                           ("mask", "offsets", "values", "signs", "status")))

    def calls(P, made):
        monkeypatch.setattr(backend, "_platform", lambda: P)
        monkeypatch.setattr(backend.driver, "current_device", lambda: 0)
        P.stream = lambda stream: st
        P.order_after = lambda p, st_: None
        for turn in range(6):
            # turns 0-1 and 3-5 alternate addresses; from turn 3, x is 2 bytes off 8
            x = DevBuf((1 << 40) + (turn % 2) * (1 << 30) + (2 if turn >= 3 else 0))
            y = DevBuf((1 << 41) + (turn % 2) * (1 << 30))
            P.import_dense = lambda t, dtype, st_: (t, shape, dt)
            for enc, cap in (("nosign", 9000), (Encoding.RAW, 9000), ("signplane", 9000),
                             ("auto", 9000)):
                made.append(describe(be._pack(P, st, x, shape, dt, K.MODE_PACK, enc, 12,
                                              cap, None)))
            with pytest.raises(CapacityError, match="bool"):      # equal to 1, not an int
                be._pack(P, st, x, shape, dt, K.MODE_PACK, "nosign", 12, True, None)
            made.append(describe(be._pack(P, st, x, shape, dt, K.MODE_RELU, "nosign", 12, 9000,
                                          None, y)))
            p_mask = SimpleNamespace(device=("cuda", 0), shape=shape, dtype=dt, nnz=7000,
                                     chunk_log2=12, mask=DevBuf((1 << 42) + (turn % 2) * 64),
                                     offsets=DevBuf(1 << 43))
            made.append(describe(backend.NumbaBackend.masked_pack(be, x, p_mask)))

    def platform(launched):
        P = _record_platform(backend, launched)
        alloc = P.alloc

        def alloc_dev(nbytes, st_, allocator):
            return DevBuf(alloc(nbytes, st_, allocator).ptr)
        P.alloc = alloc_dev
        P.ci = interop
        P.take_slot = lambda: 0              # "auto" waits for its status: none is read here
        P.wait_slot = lambda slot, st_: (0, 9000)
        return P

    class NoRecords(L.PerThread):
        def get(self, key, anchor):
            return None

    reference, launched, ref_made, made = [], [], [], []
    monkeypatch.setattr(backend, "_PACK_LAUNCHES", NoRecords(1024))
    monkeypatch.setattr(backend, "_FIXED_PACKS", NoRecords(1024))
    calls(platform(reference), ref_made)

    def driver_launch(func, grid, block, smem, stream, rec):
        launched.append((func, grid, block, stream, rec.values()))
    monkeypatch.setattr(L.driver, "launch_packed", driver_launch)
    monkeypatch.setattr(backend, "_PACK_LAUNCHES", L.PerThread(1024))
    fixed_packs = L.PerThread(1024)
    monkeypatch.setattr(backend, "_FIXED_PACKS", fixed_packs)
    taken = []
    original = backend._FixedPack.__call__
    monkeypatch.setattr(backend._FixedPack, "__call__",
                        lambda self, *a, **k: taken.append(self.lay) or original(self, *a, **k))
    calls(platform(launched), made)
    assert launched == reference
    assert made == ref_made
    # from the third turn of each alignment: nosign, raw, signplane, relu and masked
    assert len(taken) == 5 * 2
    other = backend.NumbaBackend(K.PackVariant(fill_limit=0))     # the same arguments
    other._pack(platform([]), st, DevBuf(1 << 40), shape, dt, K.MODE_PACK, "nosign", 12, 9000,
                None)
    assert len(taken) == 5 * 2
    kept = fixed_packs._entries()
    assert {k[3] for k in kept} == {"nosign", Encoding.RAW, "signplane", Encoding.SIGNPLANE}
    assert all(type(k[5]) is int and k[5] is not True for k in kept)
    assert all(anchor is be.variant for anchor, _ in kept.values())
