"""The C++ host path of the FFN op (bitsparse_core/torch/native.py) on the CPU.

Its launches are checked against the Python host protocol with the driver faked:
for the same plan and pointers, the parameter bytes the C++ ``Launch`` passes must be
those of the record ``backends/cuda/host`` fills. The GPU behaviour (bit identity with
the Python path and with dense, no syncs, graph capture) is in tests/test_torch_gpu.py.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import re
import shutil
import sysconfig

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.backends.cuda import abi, host, slots  # noqa: E402
from bitsparse_core.spec.format import DEFAULT_CHUNK_LOG2, Encoding  # noqa: E402
from bitsparse_core.torch import native  # noqa: E402


def _compiler() -> bool:
    return bool(shutil.which(sysconfig.get_config_var("CXX") or "c++") or shutil.which("c++")
                or shutil.which("g++"))


@pytest.fixture(scope="module")
def ext():
    if not _compiler():
        pytest.skip("no C++ compiler: the native path cannot be built here")
    return native.build()


@pytest.fixture
def python_launches(monkeypatch):
    """Records the bytes of every record the Python host protocol launches with."""
    calls = []

    def record(kind):
        def fn(func, grid, block, smem, stream, args):
            calls.append((kind, func, grid, smem,
                          ctypes.string_at(ctypes.addressof(args), ctypes.sizeof(args))))
        return fn
    monkeypatch.setattr(host, "kernel", lambda device, *key: hash(key) & 0xFFFF_FFFF)
    monkeypatch.setattr(host.driver, "resident_blocks", lambda *a: 264)
    monkeypatch.setattr(host.driver, "sm_count", lambda device: 132)
    monkeypatch.setattr(host.driver, "launch_cooperative", record("coop"))
    monkeypatch.setattr(host.driver, "launch", record("launch"))
    monkeypatch.setattr(host.driver, "memset0", lambda ptr, n, stream: None)
    host._RECORDS.__dict__.clear()
    yield calls
    host._RECORDS.__dict__.clear()


BLOCK, X, Y, SCRATCH, G, OUT, OUT2, SLOT = (0x7F00_0000_0000 + k * 0x1000_0000
                                            for k in range(8))


def _roles(**given):
    return [given.get(name, 0) for name in native.ROLE_NAMES]


CASES = [((8, 1024), D.BFLOAT16, Encoding.NOSIGN, 0.25),
         ((3, 7, 333), D.FLOAT16, Encoding.RAW, 0.5),
         ((5000,), D.FLOAT32, Encoding.SIGNPLANE, 0.1),
         ((64, 96), D.FLOAT8_E4M3FN, Encoding.NOSIGN, 1.0),
         ((0,), D.BFLOAT16, Encoding.NOSIGN, 0.5)]


@pytest.mark.parametrize("shape,dtype,enc,density", CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("mode", [abi.Mode.RELU, abi.Mode.RELU2], ids=["relu", "relu2"])
def test_native_launches_match_the_python_records(ext, python_launches, shape, dtype, enc,
                                                  density, mode):
    numel = 1
    for s in shape:
        numel *= s
    plan = host.pack_plan(shape, dtype, enc, int(density * numel), DEFAULT_CHUNK_LOG2, mode)
    launches = native.plan_templates(plan, 0)
    handle = ext.add_plan(plan.lay.numel, plan.nbytes, plan.scratch_bytes, plan.status_offset,
                          [off for off, _ in plan.spans], launches)
    assert handle >= 0
    # the pack
    host.enqueue_pack(plan, 0, 0x5EED, X, BLOCK, SCRATCH, Y, zero_tail=False)
    if numel:
        kind, func, grid, smem, want = python_launches.pop()
        assert (kind, func, grid, smem) == ("coop",) + launches["pack"][:2] + (launches["pack"][3],)
        assert ext.launch_params(handle, "pack", BLOCK, _roles(x=X, y=Y, scratch=SCRATCH)) == want
        # an unaligned x and no y flip their flags as the Python record does
        host.enqueue_pack(plan, 0, 0x5EED, X + 2, BLOCK, SCRATCH, 0, zero_tail=False)
        want = python_launches.pop()[-1]
        assert ext.launch_params(handle, "pack", BLOCK, _roles(x=X + 2, scratch=SCRATCH)) == want
        # the host slot the kernel writes its count to
        host.enqueue_pack(plan, 0, 0x5EED, X, BLOCK, SCRATCH, Y, zero_tail=False, slot=SLOT)
        want = python_launches.pop()[-1]
        assert ext.launch_params(handle, "pack", BLOCK,
                                 _roles(x=X, y=Y, scratch=SCRATCH, slot=SLOT)) == want
    # the backward's kernels
    planes = plan.planes(BLOCK)
    ops = ({"unpack": abi.Op.UNPACK, "relu2": abi.Op.RELU2,
            "relu2_and_square": abi.Op.RELU2_AND_SQUARE} if mode == abi.Mode.RELU2
           else {"unpack": abi.Op.UNPACK})
    for name, op in ops.items():
        g = G if op != abi.Op.UNPACK else 0
        o2 = OUT2 if op == abi.Op.RELU2_AND_SQUARE else 0
        host.enqueue_unpack(plan.lay, planes, op, 0, 0x5EED, OUT, grad=g, out2=o2)
        if numel:
            kind, func, grid, smem, want = python_launches.pop()
            assert (kind, func, grid) == ("launch",) + launches[name][:2], name
            assert ext.launch_params(handle, name, BLOCK, _roles(g=g, out=OUT, out2=o2)) == want
    if mode == abi.Mode.RELU:
        host.enqueue_relu_backward(plan.lay, planes, 0, 0x5EED, G, OUT + 4)
        if numel:
            kind, func, grid, smem, want = python_launches.pop()
            assert (kind, func, grid) == ("launch",) + launches["mask_select"][:2]
            assert ext.launch_params(handle, "mask_select", BLOCK, _roles(g=G, out=OUT + 4)) == want
    assert not python_launches


@pytest.mark.parametrize("shape,dtype,enc,density", CASES[:4],
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("u_enc", [Encoding.SIGNPLANE, Encoding.RAW], ids=["signplane", "raw"])
def test_native_gated_launches_match_the_python_records(ext, python_launches, shape, dtype, enc,
                                                        density, u_enc):
    """A gated op's launches (ops.gated_relu_linear and its backward on the Python path):
    relu(g)'s pack reads u too (it writes relu(g) * u), u's masked pack reads relu(g)'s
    mask, the gated backward and r * u read u's values and signs, all passed as roles."""
    numel = 1
    for s in shape:
        numel *= s
    cap = int(density * numel)
    plan_r = host.pack_plan(shape, dtype, enc, cap, DEFAULT_CHUNK_LOG2, abi.Mode.RELU_GATED)
    plan_u = host.pack_plan(shape, dtype, u_enc, cap, DEFAULT_CHUNK_LOG2, abi.Mode.MASKED)
    r_launches, u_launches = native.gated_plan_templates(plan_r, plan_u, 0)
    hr, hu = (ext.add_plan(p.lay.numel, p.nbytes, p.scratch_bytes, p.status_offset,
                           [off for off, _ in p.spans], t)
              for p, t in ((plan_r, r_launches), (plan_u, u_launches)))
    block_u = BLOCK + 0x100_0000
    pr, pu = plan_r.planes(BLOCK), plan_u.planes(block_u)
    mask_roles = dict(mask=pr.mask, offsets=pr.offsets)
    if numel:
        host.enqueue_pack(plan_r, 0, 0x5EED, X, BLOCK, SCRATCH, Y, zero_tail=False, slot=SLOT,
                          u=X + 0x40_0000)
        kind, func, grid, smem, want = python_launches.pop()
        assert (func, grid) == r_launches["pack"][:2]
        assert ext.launch_params(hr, "pack", BLOCK, _roles(x=X, y=Y, scratch=SCRATCH, slot=SLOT,
                                                           u=X + 0x40_0000)) == want
        with pytest.raises(ValueError, match="RELU_GATED"):     # u is its factor: never 0
            host.enqueue_pack(plan_r, 0, 0x5EED, X, BLOCK, SCRATCH, Y, zero_tail=False)
    host.enqueue_pack(plan_u, 0, 0x5EED, X, block_u, SCRATCH, in_planes=pr, zero_tail=False)
    want = python_launches.pop()[-1]
    assert ext.launch_params(hu, "pack", block_u, _roles(x=X, scratch=SCRATCH, **mask_roles)) == want
    companion = pr._replace(values=pu.values, values_len=pu.values_len, signs=pu.signs,
                            signs_len=pu.signs_len)
    host.enqueue_unpack(plan_r.lay, pr, abi.Op.GATED, 0, 0x5EED, G, grad=G, out2=OUT2,
                        pu=companion, u_encoding=u_enc)
    kind, func, grid, smem, want = python_launches.pop()
    assert (func, grid) == r_launches["gated"][:2]
    assert ext.launch_params(hr, "gated", BLOCK, _roles(g=G, out=G, out2=OUT2, uvalues=pu.values,
                                                        usigns=pu.signs)) == want
    # r * u from both blocks (the weight gradient's input)
    host.enqueue_unpack(plan_r.lay, pr, abi.Op.GATED_PRODUCT, 0, 0x5EED, OUT, pu=companion,
                        u_encoding=u_enc)
    kind, func, grid, smem, want = python_launches.pop()
    assert (func, grid) == r_launches["gated_product"][:2]
    assert func != r_launches["gated"][0]
    assert ext.launch_params(hr, "gated_product", BLOCK,
                             _roles(out=OUT, uvalues=pu.values, usigns=pu.signs)) == want
    assert not python_launches


def test_long_chunks_stay_on_the_python_path(ext, python_launches):
    """Chunks longer than the unpack tile need a prefix scan the C++ path does not make."""
    plan = host.pack_plan((4, 65536), D.BFLOAT16, Encoding.NOSIGN, 1000, 16, abi.Mode.RELU)
    assert native.plan_templates(plan, 0) is None
    assert native.register(ext, plan, 0) is None
    plan12 = host.pack_plan((4, 65536), D.BFLOAT16, Encoding.NOSIGN, 1000, DEFAULT_CHUNK_LOG2,
                            abi.Mode.RELU)
    handle = native.register(ext, plan12, 0)
    assert handle is not None and native._plans[handle] is plan12


def test_bad_templates_are_refused(ext):
    rec = abi.MaskSelectArgs()
    good = native.launch_template(1, 1, 0, False, rec, ("mask",), (("g", "g", "g_aligned", False),))
    spans = [0, 0, 0, 0]
    assert ext.add_plan(10, 64, 0, 0, spans, {"mask_select": good}) >= 0
    with pytest.raises(RuntimeError, match="unknown launch"):
        ext.add_plan(10, 64, 0, 0, spans, {"bogus": good})
    outside = good[:7] + ([10_000],) + good[8:]
    with pytest.raises(RuntimeError, match="outside the record"):
        ext.add_plan(10, 64, 0, 0, spans, {"mask_select": outside})
    assert ext.N_ROLES == len(native.ROLE_NAMES)     # Python names every C++ role, in order
    unknown = len(native.ROLE_NAMES)
    with pytest.raises(RuntimeError, match="unknown role"):
        ext.add_plan(10, 64, 0, 0, spans, {"mask_select": good[:8] + ([(unknown, 0, -1, False)],)})
    with pytest.raises(RuntimeError, match="unknown plan handle"):
        ext.launch_params(1 << 20, "pack", 0, _roles())


def test_setting(monkeypatch):
    for value, want in (("0", "off"), ("off", "off"), ("1", "on"), ("ON", "on"), ("", "auto"),
                        ("auto", "auto")):
        monkeypatch.setenv(native.ENV, value)
        assert native.setting() == want


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setenv(native.ENV, "auto")

    def broken():
        raise OSError("no compiler here")
    monkeypatch.setattr(native, "build", broken)
    with caplog.at_level(logging.WARNING, logger="bitsparse_core.torch"):
        assert native.module() is None
    assert "could not be built" in caplog.text and "no compiler here" in caplog.text
    assert native.module() is None              # tried once
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(OSError, match="no compiler"):
        native.module()
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(native, "build", lambda: pytest.fail("built although turned off"))
    assert native.module() is None


def test_cpu_tensors_never_take_the_native_path(monkeypatch):
    """The C++ path is for CUDA tensors; on CPU (no emulation) the FFN runs the NumPy
    reference codec through the Python op."""
    from bitsparse_core.torch import relu_ffn
    results = []
    inner = native.relu_linear
    monkeypatch.setattr(native, "relu_linear",
                        lambda *a, **k: results.append(inner(*a, **k)) or results[-1])
    monkeypatch.setattr(native, "module", lambda: pytest.fail("built for a CPU tensor"))
    x = torch.randn(4, 16, requires_grad=True)
    w1, w2 = torch.randn(32, 16), torch.randn(16, 32)
    relu_ffn(x, w1, None, w2, None, square=True).sum().backward()
    assert x.grad is not None and results == [None]


# --------------------------------------------------------------------------- #
# An exact pack's wait and shrink (kernels/torch_host_exact.h) on host memory #
# --------------------------------------------------------------------------- #
class ExactDriver:
    """cuMemcpyDtoDAsync, cuStreamQuery and cuStreamSynchronize on host memory: the copy
    a memmove, the stream's state what a test sets (``landing``: a count written into
    the slot when the stream is first synchronized, as a kernel finishing would)."""

    NOT_READY, FAILED = 600, 700

    def __init__(self):
        from ctypes import c_int, c_size_t, c_uint64, c_void_p
        copy = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p)
        query = ctypes.CFUNCTYPE(c_int, c_void_p)
        self.copies, self.queries, self.syncs = [], 0, 0
        self.query_rc, self.landing = 0, None
        self._fns = [copy(self._copy), query(self._query), query(self._sync)]

    def entry_points(self):
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]

    def _copy(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        self.copies.append((dst, src, n))
        return 0

    def _query(self, stream):
        self.queries += 1
        return self.query_rc

    def _sync(self, stream):
        self.syncs += 1
        if self.landing is not None:
            slots.write(*self.landing)
        return 0


def _host_slot(status=None, nnz=None):
    """A slot in host memory (pinned memory needs a GPU), its sentinels or a count."""
    buf = np.zeros(abi.SLOT_BYTES, dtype=np.uint8)
    slots.write(buf.ctypes.data, abi.SLOT_SENTINEL32 if status is None else status,
                abi.SLOT_SENTINEL64 if nnz is None else nnz)
    return buf


def _exact_shrink(ext, slot, tail, plan):
    return ext.exact_shrink(slot.ctypes.data, 0, torch.device("cpu"), tail.ctypes.data,
                            plan.lay.capacity, *host.tail_terms(plan),
                            abi.STATUS_NOSIGN_VIOLATION)


@pytest.fixture
def exact_driver(ext):
    drv = ExactDriver()
    ext.set_exact_driver(*drv.entry_points())
    return drv


@pytest.mark.parametrize("dtype,enc", [(D.BFLOAT16, Encoding.NOSIGN), (D.FLOAT16, Encoding.RAW),
                                       (D.FLOAT32, Encoding.SIGNPLANE),
                                       (D.FLOAT8_E4M3FN, Encoding.SIGNPLANE),
                                       (D.FLOAT8_E5M2, Encoding.NOSIGN)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_exact_shrink_lays_out_the_tail_as_tail_shrink(ext, exact_driver, dtype, enc):
    """The C++ exact_shrink copies what host.tail_shrink's copies would, into a tail of its
    size, for counts from 0 to the worst case (odd ones too: partial bytes of values
    and signs)."""
    rng = np.random.default_rng(7)
    plan = host.pack_plan((3, 1001), dtype, enc, 3003, DEFAULT_CHUNK_LOG2)
    tail = rng.integers(0, 256, size=plan.tail_bytes, dtype=np.uint8)
    for nnz in (0, 1, 7, 8, 9, 1000, 2999, 3003):
        exact_driver.copies.clear()
        status, got_nnz, t = _exact_shrink(ext, _host_slot(0, nnz), tail, plan)
        want = host.tail_shrink(plan, nnz)
        assert (status, got_nnz) == (0, nnz)
        assert t.dtype == torch.uint8 and t.numel() == want.nbytes
        dst = t.data_ptr()
        assert exact_driver.copies == [(dst + d, tail.ctypes.data + s, n) for d, s, n in want.copies]
        got = t.numpy()
        for d, s, n in want.copies:
            assert np.array_equal(got[d:d + n], tail[s:s + n])


def test_exact_shrink_refuses_a_nosign_violation_and_a_count_past_the_plan(ext, exact_driver):
    plan = host.pack_plan((4096,), D.BFLOAT16, Encoding.NOSIGN, 4096, DEFAULT_CHUNK_LOG2)
    tail = np.zeros(plan.tail_bytes, dtype=np.uint8)
    status, nnz, t = _exact_shrink(ext, _host_slot(abi.STATUS_NOSIGN_VIOLATION, 17), tail, plan)
    assert (status, nnz, t) == (abi.STATUS_NOSIGN_VIOLATION, 17, None)
    assert exact_driver.copies == []
    with pytest.raises(RuntimeError, match="outside the plan's capacity"):
        _exact_shrink(ext, _host_slot(0, 4097), tail, plan)


def test_exact_shrink_waits_for_the_count_and_raises_where_none_comes(ext, exact_driver):
    """A count not yet written: the stream is queried while the kernel is said to run,
    synchronized once the spin's time is up, and the count read after it; a stream done
    without a count, or a failed one, raises instead of hanging."""
    plan = host.pack_plan((4096,), D.BFLOAT16, Encoding.NOSIGN, 4096, DEFAULT_CHUNK_LOG2)
    tail = np.zeros(plan.tail_bytes, dtype=np.uint8)
    slot = _host_slot()
    exact_driver.query_rc = ExactDriver.NOT_READY
    exact_driver.landing = (slot.ctypes.data, 0, 300)
    status, nnz, t = _exact_shrink(ext, slot, tail, plan)
    assert (status, nnz) == (0, 300) and exact_driver.syncs == 1 and exact_driver.queries > 0
    assert t.numel() == host.tail_shrink(plan, 300).nbytes
    exact_driver.landing = None
    exact_driver.query_rc = 0                       # done, and nothing written
    with pytest.raises(RuntimeError, match="without writing its count"):
        _exact_shrink(ext, _host_slot(), tail, plan)
    exact_driver.query_rc = ExactDriver.FAILED
    with pytest.raises(RuntimeError, match="exact pack's stream"):
        _exact_shrink(ext, _host_slot(), tail, plan)


def test_exact_shrink_is_registered_for_torch_allocations_on_the_current_stream(monkeypatch):
    """backends/cuda/shrink.py takes the native steps only for PyTorch's allocator on
    torch's current stream; there it gives the slot back and wraps the tail."""
    from bitsparse_core.backends.cuda import interop as ci
    from bitsparse_core.backends.cuda import shrink

    assert shrink._native is native._exact_shrink
    plan = host.pack_plan((4096,), D.BFLOAT16, Encoding.NOSIGN, 4096, DEFAULT_CHUNK_LOG2)
    calls, released = [], []
    monkeypatch.setattr(shrink, "_native", lambda *a: calls.append(a) or (0, 5, torch.zeros(64,
                                                                                dtype=torch.uint8)))
    monkeypatch.setattr(ci, "torch_stream", lambda device: 0x51)
    monkeypatch.setattr(slots, "release", released.append)
    assert shrink.wait_and_shrink(plan, 0x1000, 0x51, 0, 0x2000, None) is None
    assert shrink.wait_and_shrink(plan, 0x1000, 0x52, 0, 0x2000, ci.torch_allocator) is None
    assert calls == [] and released == []
    status, nnz, (buf, exact) = shrink.wait_and_shrink(plan, 0x1000, 0x51, 0, 0x2000,
                                                       ci.torch_allocator)
    assert (status, nnz, exact) == (0, 5, host.tail_shrink(plan, 5))
    assert buf.nbytes == exact.nbytes and buf.ptr == buf.owner.data_ptr()
    assert calls == [(0x1000, 0x51, 0, 0x2000, plan)] and released == [0x1000]
    monkeypatch.setattr(shrink, "_native", lambda *a: None)      # the extension off
    assert shrink.wait_and_shrink(plan, 0x1000, 0x51, 0, 0x2000, ci.torch_allocator) is None


# --------------------------------------------------------------------------- #
# The whole C++ path on the CPU: a driver whose "kernels" run the reference   #
# --------------------------------------------------------------------------- #
class HostDriver:
    """CUDA driver entry points as C callbacks that run each launched kernel's reference
    semantics on host memory (the pack through ``ops._pack_cpu``, the unpack family
    through ``spec.ops``), so that the C++ autograd node runs end to end on CPU tensors.
    Kernels are told apart by the ids the faked ``host.kernel`` hands out; a handler's
    exception becomes a driver error the C++ side raises."""

    ERROR = 999

    def __init__(self):
        from ctypes import POINTER, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p
        u = [c_uint] * 7
        launch = ctypes.CFUNCTYPE(c_int, c_void_p, *u, c_void_p, POINTER(c_void_p), c_void_p)
        coop = ctypes.CFUNCTYPE(c_int, c_void_p, *u, c_void_p, POINTER(c_void_p))
        memset = ctypes.CFUNCTYPE(c_int, c_uint64, c_ubyte, c_size_t, c_void_p)
        copy = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint64, c_size_t, c_void_p)
        name = ctypes.CFUNCTYPE(c_int, c_int, POINTER(c_char_p))
        self.keys, self.blocks, self.errors, self.launches = {}, {}, [], []
        self.companions = {}    # a gated op's u: its values' address -> (block, plan)
        self.block_copies = 0
        self._name = ctypes.c_char_p(b"EMULATED_KERNEL_FAILED")
        self._fns = [launch(self._launch), coop(self._coop), memset(self._memset),
                     copy(self._copy), name(self._error_name)]

    def entry_points(self):
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]

    def kernel(self, device, *key):
        return self.keys.setdefault(key, len(self.keys) + 1)

    # the driver calls ------------------------------------------------------
    def _guarded(self, fn, *args):
        try:
            fn(*args)
            return 0
        except Exception as exc:     # noqa: BLE001 - reported through the driver's error
            self.errors.append(exc)
            return self.ERROR

    def _launch(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return self._guarded(self._run, func, params)

    def _coop(self, func, gx, gy, gz, bx, by, bz, smem, stream, params):
        return self._guarded(self._run, func, params)

    def _memset(self, ptr, value, n, stream):
        ctypes.memset(ptr, value, n)
        return 0

    def _copy(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        # a whole block copied (offloading's copies out and back): its plan goes with it
        moved = [(k, p) for k, p in self.blocks.items() if k - p.spans[0][0] == src]
        for k, plan in moved:
            if n >= plan.nbytes:
                self.blocks[dst + plan.spans[0][0]] = plan
                self.block_copies += 1
        return 0

    def _error_name(self, rc, out):
        out[0] = self._name.value
        return 0

    # the kernels -----------------------------------------------------------
    def _run(self, func, params):
        key = next(k for k, i in self.keys.items() if i == func)
        cls = {"pack": abi.PackArgs, "unpack": abi.UnpackArgs,
               "mask_select": abi.MaskSelectArgs}[key[0]]
        rec = {name: ctype.from_address(params[i]).value
               for i, (name, ctype) in enumerate(cls._fields_)}
        self.launches.append((key, rec))
        getattr(self, "_" + key[0])(key, rec)

    @staticmethod
    def _dtype(fmt):
        return {int(f): D.resolve(name) for name, f in abi.FMT_OF.items()}[fmt]

    @staticmethod
    def _host(addr, nbytes):
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))

    def _tensor(self, addr, plan):
        lay = plan.lay
        raw = self._host(addr, lay.numel * lay.dtype.itemsize).copy()
        return torch.from_numpy(raw.view(f"i{lay.dtype.itemsize}")).view(
            getattr(torch, lay.dtype.name))

    def _pack(self, key, r):
        from bitsparse_core.torch import ops
        _, fmt, enc, mode, _ = key
        plan = host.pack_plan((r["numel"],), self._dtype(fmt), Encoding(enc), r["cap"],
                              r["chunk_log2"], abi.Mode(mode))
        if mode == abi.Mode.MASKED:
            self._masked_pack(plan, r)
            return
        block = r["mask"] - plan.spans[0][0]
        assert (r["offsets"], r["status"]) == (block + plan.spans[1][0], block + plan.status_offset)
        x = self._tensor(r["x"], plan)
        assert bool(r["u"]) == (mode == abi.Mode.RELU_GATED)
        if mode == abi.Mode.PACK:    # the saved-tensor hooks' plain pack
            y, host_block = None, ops._plain_pack_cpu(x, plan)
        else:
            y, host_block = ops._pack_cpu(x, plan, mode == abi.Mode.RELU2)
        if mode == abi.Mode.RELU_GATED:     # y = relu(g) * u, the gated op's activation
            from bitsparse_core.spec import ops as reference_ops
            dt = plan.lay.dtype
            h, _ = reference_ops.gated_relu_pack(ops._to_numpy(x, dt),
                                                 ops._to_numpy(self._tensor(r["u"], plan), dt), dt)
            y = ops._from_numpy(h, x.dtype, x.shape)
        ctypes.memmove(block, host_block.data_ptr(), plan.nbytes)
        if r["slot"]:     # the kernel's copy of its status and count, in host memory
            head = self._host(plan.status(block), 16)
            slots.write(r["slot"], int(head[:4].view(np.uint32)[0]),
                        int(head[8:].view(np.uint64)[0]))
        if r["y"]:
            ctypes.memmove(r["y"], y.data_ptr(), y.numel() * y.element_size())
        self.blocks[block] = plan

    def _masked_pack(self, plan, r):
        """A gated op's u, packed where relu(g)'s mask (at ``r["mask"]``) is set."""
        from bitsparse_core.torch import ops
        plan_r = self.blocks[r["mask"]]
        block = r["values"] - plan.spans[2][0]
        assert r["status"] == block + plan.status_offset and not r["slot"]
        u = self._tensor(r["x"], plan)
        block_r = torch.from_numpy(self._host(r["mask"], plan_r.nbytes).copy())
        host_block = ops._masked_pack_cpu(u, block_r, plan_r, plan)
        ctypes.memmove(block, host_block.data_ptr(), plan.nbytes)
        self.companions[r["values"]] = (block, plan)

    def _companion(self, mask, plan_r, values):
        """u's packed view: relu(g)'s mask and offsets (its block at ``mask``) beside u's
        values (at ``values``) and signs."""
        from bitsparse_core.torch import ops
        block, plan_u = self.companions[values]
        block_r = torch.from_numpy(self._host(mask, plan_r.nbytes).copy())
        block_u = torch.from_numpy(self._host(block, plan_u.nbytes).copy())
        return ops._companion_view(block_r, plan_r, block_u, plan_u)

    def _view(self, mask, fmt=None):
        """The packed tensor at ``mask``; ``fmt``: the kernel's element format, where the
        pack's was only a bit width (a plain pack's kernels move bits)."""
        from bitsparse_core.torch import ops
        plan = self.blocks[mask]
        if fmt is not None and self._dtype(fmt) != plan.lay.dtype:
            lay = plan.lay
            plan = host.pack_plan(lay.shape, self._dtype(fmt), lay.encoding, lay.capacity,
                                  lay.chunk_log2, plan.mode)
        raw = torch.from_numpy(self._host(mask, plan.nbytes).copy())
        return plan, ops.block_view(raw, plan)

    def _out(self, addr, arr):
        arr = np.ascontiguousarray(arr)
        ctypes.memmove(addr, arr.ctypes.data, arr.nbytes)

    def _grad(self, r, plan):
        lay = plan.lay
        return self._host(r["g"], lay.numel * lay.dtype.itemsize).copy().view(lay.dtype.numpy)

    def _unpack(self, key, r):
        from bitsparse_core.backends import get_backend
        from bitsparse_core.spec import ops as reference_ops
        plan, p = self._view(r["mask"], key[1])
        op = abi.Op(key[2])
        if r["values"] in self.companions:      # u's unpack, beside relu(g)'s mask
            assert op == abi.Op.UNPACK, op
            p = self._companion(r["mask"], plan, r["values"])
        if op == abi.Op.UNPACK:
            self._out(r["out"], np.asarray(get_backend("numpy").unpack(p)))
            return
        if op == abi.Op.GATED_PRODUCT:      # no gradient
            assert not r["g"]
            self._out(r["out"], reference_ops.gated_product(
                p, self._companion(r["mask"], plan, r["uvalues"])))
            return
        grad = self._grad(r, plan)
        if op == abi.Op.GATED:
            p_u = self._companion(r["mask"], plan, r["uvalues"])
            grad_g, grad_u = reference_ops.gated_backward(grad.reshape(p.shape), p, p_u)
            self._out(r["out"], grad_g)
            self._out(r["out2"], grad_u)
            return
        self._out(r["out"], reference_ops.relu2_backward(grad.reshape(p.shape), p))
        if op == abi.Op.RELU2_AND_SQUARE:
            r32 = np.asarray(get_backend("numpy").unpack(p)).astype(np.float32)
            self._out(r["out2"], reference_ops.mul_f32(r32, r32).astype(plan.lay.dtype.numpy))
        else:
            assert op == abi.Op.RELU2, op

    def _mask_select(self, key, r):
        from bitsparse_core.spec import ops as reference_ops
        plan, p = self._view(r["mask"])
        self._out(r["out"], reference_ops.relu_backward(self._grad(r, plan).reshape(p.shape), p))


@pytest.fixture
def emulated(ext, monkeypatch):
    """The C++ path taking CPU tensors, its kernels run by :class:`HostDriver`."""
    from bitsparse_core.torch import capacity as C
    drv = HostDriver()
    monkeypatch.setattr(host, "kernel", drv.kernel)
    monkeypatch.setattr(host.driver, "resident_blocks", lambda *a: 264)
    monkeypatch.setattr(host.driver, "sm_count", lambda device: 132)
    # no CUDA here, so no graph capture: the slot ring itself (claim_slot asks CUDA)
    monkeypatch.setattr(C, "claim_slot", C.SLAB.acquire)
    monkeypatch.setattr(native, "_handles", {})
    host._RECORDS.__dict__.clear()
    with native.emulate_on_host(drv.entry_points()):
        yield drv
    host._RECORDS.__dict__.clear()
    assert not drv.errors, drv.errors


EMULATED_CASES = ["relu", "relu2", "relu2-no-bias", "relu-overflow", "relu2-overflow",
                  "relu2-autocast", "reglu", "reglu-no-bias", "reglu-overflow", "reglu-autocast"]


@pytest.mark.parametrize("case", EMULATED_CASES)
def test_emulated_native_training_is_bit_identical(emulated, case):
    """Three AdamW steps of a 2-layer packed FFN stack (ReLU, ReLU², ReGLU) through the C++
    nodes (their kernels emulated on the host): losses, gradients and parameters equal
    dense PyTorch's, and the Python path's; overflowing batches recompute (counted)."""
    import copy
    from torch_models import assert_same_training, make_pair, train
    kind = case.split("-")[0]
    dtype = torch.float32 if "autocast" in case else torch.bfloat16
    dense, ours = make_pair(kind, "nosign", d=32, f=96, dtype=dtype)
    if "no-bias" in case:
        for net in (dense, ours):
            for blk in net.blocks:
                for lin in blk.children():
                    lin.bias = None
    if "overflow" in case:
        for blk in ours.blocks:
            blk.capacity_policy.density = 0.01
    python = copy.deepcopy(ours)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    target = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(2))
    autocast = torch.bfloat16 if "autocast" in case else None
    got = train(ours, x, target, autocast=autocast)
    packs = [k for k, _ in emulated.launches if k[0] == "pack"]
    per_layer = 2 if kind == "reglu" else 1     # ReGLU: relu(g), then u where g > 0
    assert len(packs) == 3 * 2 * per_layer, "the C++ path did not run"
    with native.python_path():
        assert_same_training(train(python, x, target, autocast=autocast), got)
    assert_same_training(train(dense, x, target, autocast=autocast), got)
    stats = [blk.stats() for blk in ours.blocks]
    if "overflow" in case:
        assert all(s["overflows"] == 3 and s["recomputes"] == 3 for s in stats)
        assert not [k for k, _ in emulated.launches if k[0] != "pack"]   # nothing decoded
    else:
        assert all(s["recomputes"] == 0 for s in stats)
        decoded = {k[:3] if k[0] == "unpack" else k[:1] for k, _ in emulated.launches
                   if k[0] != "pack"}
        assert decoded
        if kind == "reglu":     # relu(g) * u from both blocks, the gated kernel's gradients
            fmt = abi.FMT_OF["bfloat16"]
            assert decoded == {("unpack", fmt, abi.Op.GATED_PRODUCT),
                               ("unpack", fmt, abi.Op.GATED)}


@pytest.mark.parametrize("kind,frozen", [("relu2", "fc1"), ("relu2", "fc2"), ("relu2", "input"),
                                         ("reglu", "gate_proj"), ("reglu", "up_proj"),
                                         ("reglu", "down_proj"), ("reglu", "input")])
def test_emulated_native_computes_only_the_gradients_asked_for(emulated, kind, frozen):
    from torch_models import make_pair
    dense, ours = make_pair(kind, "raw", d=16, f=64, layers=1)
    blk, ref = ours.blocks[0], dense.blocks[0]
    x = torch.randn(24, 16, requires_grad=frozen != "input")
    for m in (blk, ref):
        if frozen != "input":
            getattr(m, frozen).requires_grad_(False)
    outs = [m(x) for m in (blk, ref)]
    assert torch.equal(outs[0], outs[1])
    params = [p for p in blk.parameters() if p.requires_grad]
    wants = torch.autograd.grad(outs[1].square().sum(),
                                [p for p in ref.parameters() if p.requires_grad])
    gots = torch.autograd.grad(outs[0].square().sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(gots, wants))


@pytest.mark.parametrize("kind", ["relu2", "reglu"])
def test_emulated_module_call_under_a_dispatch_mode_goes_through_the_dispatcher(emulated, kind):
    """A module's direct call of the C++ path is for plain eager only: under a dispatch mode
    the call goes through torch.ops, so the mode sees ``bitsparse.relu_linear`` (or
    ``gated_relu_linear``), whose kernels are the extension's; the results, forward and
    backward, are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch_models import make_pair
    _, ours = make_pair(kind, "nosign", d=16, f=64, layers=1)
    blk = ours.blocks[0]
    x = torch.randn(24, 16, requires_grad=True)
    eager = blk(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, *blk.parameters()])
    assert [k for k, _ in emulated.launches if k[0] == "pack"], "the C++ path did not run"
    launches = len(emulated.launches)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        logged = blk(x)
        logged_grads = torch.autograd.grad(logged.square().sum(), [x, *blk.parameters()])
    op = "bitsparse.gated_relu_linear" if kind == "reglu" else "bitsparse.relu_linear"
    assert any(s.startswith(op + ".") for s in seen), seen
    assert any(s.startswith(op + "_backward") for s in seen), seen
    assert len(emulated.launches) > launches    # the dispatcher reached the extension's kernels
    assert torch.equal(eager, logged)
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, logged_grads))


def test_emulated_module_call_of_a_dtype_not_stored_raises_the_named_error(emulated):
    """The module's direct call checks the dtype as the op does: float64 raises
    UnsupportedDTypeError, as on the Python path, and launches nothing."""
    from bitsparse_core.errors import UnsupportedDTypeError
    from bitsparse_core.torch import PackedReLUFFN
    m = PackedReLUFFN(8, 16, dtype=torch.float64)
    with pytest.raises(UnsupportedDTypeError):
        m(torch.randn(4, 8, dtype=torch.float64))
    assert not emulated.launches


def test_emulated_eager_call_takes_plain_eager_calls_only(emulated):
    """relu_ffn's one call into the extension (the first GEMM and the op) answers
    ``(out, a)`` for plain tensors, ``a`` being ``F.linear(x, w1, b1)`` and ``out`` the dense
    FFN's; it declines, ``(None, None)``, for a tensor subclass, an unstored dtype, a 0-d
    input, under ``python_path()`` and under a function mode, before any GEMM or launch."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from bitsparse_core.torch import functional as FN
    from bitsparse_core.torch.capacity import CapacityPolicy
    g = torch.Generator().manual_seed(3)
    x, w1, b1 = torch.randn(6, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(16)
    w2, b2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    pol = CapacityPolicy(None)
    out, a = FN._eager_call(x, w1, b1, w2, b2, False, "nosign", pol)
    assert torch.equal(a, F.linear(x, w1, b1))
    assert torch.equal(out, F.linear(torch.relu(a), w2, b2))
    assert pol.stats()["packs"] == 1
    launches = len(emulated.launches)

    class Sub(torch.Tensor):
        pass

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert FN._eager_call(x.as_subclass(Sub), w1, b1, w2, b2, False, "nosign", pol) == (None, None)
    assert FN._eager_call(x, w1, b1, w2.as_subclass(Sub), b2, False, "nosign", pol) == (None, None)
    assert FN._eager_call(x.double(), w1.double(), b1.double(), w2.double(), b2.double(),
                           False, "nosign", pol) == (None, None)
    assert FN._eager_call(torch.tensor(1.0), w1, b1, w2, b2, False, "nosign", pol) == (None, None)
    with native.python_path():
        assert FN._eager_call(x, w1, b1, w2, b2, False, "nosign", pol) == (None, None)
    with Mode():
        assert FN._eager_call(x, w1, b1, w2, b2, False, "nosign", pol) == (None, None)
    assert len(emulated.launches) == launches and pol.stats()["packs"] == 1


def test_emulated_functional_relu_ffn_takes_the_one_call(emulated, monkeypatch):
    """The functional relu_ffn without a policy takes the same one call as a module, at
    relu_linear's shared policy for its shape; the result is the dense FFN's, and its
    gradients too."""
    import torch.nn.functional as F
    from bitsparse_core.torch import functional as FN
    from bitsparse_core.torch import relu_ffn
    calls = []
    real = native._emulation.relu_ffn_call
    monkeypatch.setattr(native._emulation, "relu_ffn_call",
                        lambda *a: calls.append(a[5]) or real(*a))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    w1, b1 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    w2, b2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    out = relu_ffn(x, w1, b1, w2, b2, square=True)
    pol = FN._shared_policy(None, (2, 5, 16), torch.float32, True)
    assert calls == [pol.capacity(2 * 5 * 16)] and pol.stats()["packs"] == 1
    xd = x.detach().requires_grad_(True)
    want = F.linear(torch.relu(F.linear(xd, w1, b1)) ** 2, w2, b2)
    assert torch.equal(out, want)
    gy = torch.randn(out.shape, generator=g)
    assert torch.equal(torch.autograd.grad(out, x, gy)[0], torch.autograd.grad(want, xd, gy)[0])


def test_emulated_native_twice_through_one_graph_and_hooks(emulated):
    """retain_graph: two backwards through one C++ node give the same gradients; an outer
    saved_tensors_hooks sees the node's saved tensors (the packed block among them)."""
    from torch_models import make_pair
    _, ours = make_pair("relu", "nosign", d=16, f=64, layers=1)
    x = torch.randn(24, 16, requires_grad=True)
    seen = []

    def pack(t):
        seen.append(t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ours(x).square().sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    second = torch.autograd.grad(out, x)[0]
    assert torch.equal(first, second) and torch.uint8 in seen


def test_emulated_native_node_has_edges_to_a_weight_and_bias_only(emulated):
    """The C++ node's edges are the op's differentiable inputs (a, weight, bias): the
    recompute source (x, w1, b1) gets its gradients through a, once, as in dense PyTorch."""
    from torch_models import make_pair
    dense, ours = make_pair("relu", "nosign", d=16, f=64, layers=1)
    x = torch.randn(24, 16, requires_grad=True)
    out = ours.blocks[0](x)
    assert out.grad_fn.name() == "bitsparse::ReLULinearBackward"
    a_fn, w_fn, b_fn = (fn for fn, _ in out.grad_fn.next_functions)
    assert a_fn.name().startswith("Addmm")   # the first GEMM's node
    assert w_fn.variable is ours.blocks[0].fc2.weight and b_fn.variable is ours.blocks[0].fc2.bias
    got = torch.autograd.grad(out.square().sum(), [x, *ours.blocks[0].parameters()])
    xd = x.detach().requires_grad_(True)
    want = torch.autograd.grad(dense.blocks[0](xd).square().sum(),
                               [xd, *dense.blocks[0].parameters()])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_emulated_native_under_checkpoint_is_bit_identical(emulated, reentrant):
    """torch.utils.checkpoint around the packed layers: the C++ node's saves go through the
    checkpoint's hooks (non-reentrant) or its recomputed forward (reentrant), training is
    the checkpointed dense model's bit for bit, and the recompute packs again."""
    from torch_models import assert_same_training, make_pair, train
    dense, ours = make_pair("relu2", "nosign", checkpoint=reentrant)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)
    x.requires_grad_(True)
    assert_same_training(train(dense, x, target), train(ours, x, target))
    packs = sum(k[0] == "pack" for k, _ in emulated.launches)
    assert packs == 2 * 3 * 2   # two layers, three steps, forward and its recompute


def test_emulated_native_without_grad_packs_and_builds_no_node(emulated):
    """Under no_grad, inference_mode or with nothing requiring a gradient the C++ op still
    packs (the policy counts it) and returns a tensor without a grad_fn; the dense result
    is equal."""
    from torch_models import make_pair
    dense, ours = make_pair("relu2", "nosign", d=16, f=64, layers=1)
    blk = ours.blocks[0]
    x = torch.randn(24, 16)
    with torch.no_grad():
        out = blk(x)
    assert out.grad_fn is None and not out.requires_grad
    assert blk.stats()["packs"] == 1
    assert [k for k, _ in emulated.launches if k[0] == "pack"]
    with torch.no_grad():
        assert torch.equal(out, dense.blocks[0](x))
    blk.requires_grad_(False)   # grad mode on, nothing asks for a gradient
    frozen = blk(x)
    assert frozen.grad_fn is None and torch.equal(frozen, out) and blk.stats()["packs"] == 2
    with torch.inference_mode():
        inferred = blk(x)
    assert torch.equal(inferred, out) and blk.stats()["packs"] == 3


@pytest.mark.parametrize("kind,op", [("relu", "ReLU"), ("reglu", "ReGLU")])
def test_emulated_native_backward_is_once_differentiable(emulated, kind, op):
    """create_graph=True: the first-order gradients are dense PyTorch's; differentiating
    them again raises (the backward's kernels are not differentiable), as the Python
    path's once_differentiable does, rather than giving a wrong second derivative."""
    from torch_models import make_pair
    dense, ours = make_pair(kind, "nosign", d=16, f=64, layers=1)
    x = torch.randn(24, 16, requires_grad=True)
    g, = torch.autograd.grad(ours.blocks[0](x).square().sum(), x, create_graph=True)
    want, = torch.autograd.grad(dense.blocks[0](x).square().sum(), x, create_graph=True)
    assert torch.equal(g, want) and g.requires_grad
    with pytest.raises(RuntimeError, match=f"packed {op} op's backward .* differentiate twice"):
        g.sum().backward()


def test_emulated_native_forward_mode_ad_raises(emulated):
    """Forward-mode AD has no rule in the C++ op: a dual input raises an error that says
    so, never a tangent silently dropped."""
    import torch.autograd.forward_ad as fwAD
    from torch_models import make_pair
    _, ours = make_pair("relu", "nosign", d=16, f=64, layers=1)
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(24, 16), torch.randn(24, 16))
        with pytest.raises(RuntimeError, match="forward-mode"):
            ours.blocks[0](x)


@pytest.mark.parametrize("kind", ["relu", "relu2"])
@pytest.mark.parametrize("frozen", ["none", "fc2"])
def test_emulated_backward_writes_its_gradient_over_grad_h(emulated, kind, frozen):
    """A clean backward's gradient kernel writes over the gradient it reads (grad_h, the
    backward's own buffer), and the activation is decoded only where the weight gradient
    needs it (ReLU: a plain unpack; ReLU²: the fused decode that also gives relu(a)²)."""
    from torch_models import make_pair
    _, ours = make_pair(kind, "nosign", d=16, f=64, layers=1)
    if frozen == "fc2":
        ours.blocks[0].fc2.requires_grad_(False)
    x = torch.randn(32, 16)
    ours(x).square().sum().backward()
    grads = [(k, r) for k, r in emulated.launches if k[0] != "pack"]
    ops = [abi.Op(k[2]).name if k[0] == "unpack" else k[0] for k, _ in grads]
    decode = ["UNPACK"] if kind == "relu" and frozen == "none" else []
    grad_op = ("mask_select" if kind == "relu"
               else "RELU2_AND_SQUARE" if frozen == "none" else "RELU2")
    assert ops == decode + [grad_op]
    assert grads[-1][1]["out"] == grads[-1][1]["g"]


def test_emulated_hooks_pack_and_unpack_through_the_extension(emulated):
    """compress_saved_tensors' packs and unpacks queued from C++ (``hooks_pack`` /
    ``hooks_unpack``, mode PACK), the C++ front in front: training bit-identical to plain,
    each clean pack's count read from its slot of the extension's ring, and its decode
    (and the second node's reuse of it) done by the front without Python, as are the new
    packs at sites whose capacity has settled."""
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import compress_saved_tensors
    from bitsparse_core.torch import hooks as H
    from torch_models import Hooked, assert_same_training, relu_mlp, train
    torch.manual_seed(0)
    x, target = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    in_python = []

    def python_unpack(obj, _unpack=hooks._unpack):
        if type(obj) is H._Packed and obj.state == H.CLEAN:
            in_python.append(obj)
        return _unpack(obj)
    hooks._unpack = python_unpack    # what hooks._unpack_saved calls
    new_in_python = []
    hooks._pack_new = lambda *a, _pack_new=hooks._pack_new: (new_in_python.append(a[1]),
                                                             _pack_new(*a))[1]
    steps = 6
    rec_plain = train(relu_mlp(), x, target, steps=steps)
    rec_hooks = train(Hooked(relu_mlp(), hooks), x, target, steps=steps)
    rec_hooks = [(l, {k[len("inner."):]: v for k, v in g.items()},
                  {k[len("inner."):]: v for k, v in p.items()}) for l, g, p in rec_hooks]
    assert_same_training(rec_plain, rec_hooks)
    assert hooks.stats.packed == 2 * steps and hooks.stats.unpacked == 2 * steps
    packs = [rec for key, rec in emulated.launches
             if key[0] == "pack" and key[3] == abi.Mode.PACK]
    unpacks = [rec for key, rec in emulated.launches
               if key[0] == "unpack" and key[2] == abi.Op.UNPACK]
    assert len(packs) == hooks.stats.tried >= 6 and len(unpacks) == hooks.stats.unpacked
    assert hooks.stats.reused == hooks.stats.shared == 2 * steps and not in_python
    # the first packs at each site, and those after a count moved its bucket, were Python's
    assert 2 <= len(new_in_python) < hooks.stats.tried
    ring = C.SLAB.slots   # the extension's slots lie above Python's
    assert all(rec["slot"] >= C.SLAB.base() + 16 * ring for rec in packs)


def test_emulated_hooks_new_pack_of_a_view_in_cpp(emulated):
    """A site whose saves are views of their base (the base packed, the save kept as a
    view of the pack) packs in C++ once its capacity settles, and each save unpacks to
    its own shape: the gradients equal plain PyTorch's step after step."""
    from bitsparse_core.torch import compress_saved_tensors

    class SavesFlat(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            r = torch.relu(a)
            ctx.save_for_backward(r.view(-1))
            return r * 3

        @staticmethod
        def backward(ctx, g):
            (flat,) = ctx.saved_tensors
            assert flat.dim() == 1
            return g * 3 * (flat.view(g.shape) > 0)

    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    new_in_python = []
    hooks._pack_new = lambda *a, _pack_new=hooks._pack_new: (new_in_python.append(a[1]),
                                                             _pack_new(*a))[1]
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        a = (torch.randn(32, 64, generator=g) - 1.0).requires_grad_()
        with hooks:
            out = SavesFlat.apply(a)
        out.square().sum().backward()
        r = torch.relu(a.detach())
        assert torch.equal(a.grad, 2 * r * 3 * 3 * (r > 0))
    assert hooks.stats.packed == 6 and len(new_in_python) < hooks.stats.tried


def test_emulated_driver_error_is_raised(emulated, monkeypatch):
    """A failing launch surfaces as a named error, not as wrong data."""
    from bitsparse_core.torch import relu_ffn
    monkeypatch.setattr(emulated, "_pack", lambda key, r: 1 / 0)
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="EMULATED_KERNEL_FAILED"):
        relu_ffn(x, torch.randn(32, 16), None, torch.randn(16, 32), None)
    assert isinstance(emulated.errors.pop(), ZeroDivisionError)


def test_emulated_backward_reads_the_slot_and_polls_every_8th(emulated, monkeypatch):
    """A clean pack whose count has landed is read from its pinned slot in C++: Python's
    policy is asked on a module's first backward and every 8th after it (its poll, which
    moves the capacity), and whenever the slot does not show the pack clean."""
    from torch_models import make_pair
    calls = []

    def counting(handle, policy, ticket, block, recompute_source, gated):
        calls.append(policy)
        return native._pack_is_clean(handle, policy, ticket, block, recompute_source, gated)
    emulated_mod = native.module()
    emulated_mod.set_state_fn(counting)
    try:
        _, ours = make_pair("relu2", "nosign", d=16, f=64, layers=2)
        x = torch.randn(32, 16)
        full = [blk.capacity_policy.capacity(32 * 64) for blk in ours.blocks]
        for _ in range(17):
            ours(x).square().sum().backward()
        ids = [blk.capacity_policy.id for blk in ours.blocks]
        assert sorted(calls) == sorted(ids * 3)        # backwards 1, 9 and 17 of each
        # the first poll took in the first count: the capacity left its full start
        assert all(blk.capacity_policy.capacity(32 * 64) < c for blk, c in zip(ours.blocks, full))
        calls.clear()
        for blk in ours.blocks:                         # now every pack overflows
            blk.capacity_policy.density = 0.01
        ours(x).square().sum().backward()
        assert sorted(calls) == sorted(ids)
        assert all(blk.stats()["recomputes"] == 1 for blk in ours.blocks)
    finally:
        emulated_mod.set_state_fn(native._pack_is_clean)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_emulated_native_other_dtypes_and_empty_batches(emulated, dtype):
    """fp16 / fp32 activations, and a batch of no tokens (the block holds only its empty
    planes; no kernel runs), through the C++ node, against dense PyTorch."""
    from torch_models import make_pair
    for tokens in (24, 0):
        dense, ours = make_pair("relu2", "raw", d=16, f=64, layers=1, dtype=dtype)
        x = torch.randn(tokens, 16, dtype=dtype)
        outs = [m(x) for m in (ours, dense)]
        assert torch.equal(outs[0], outs[1])
        grads = [torch.autograd.grad(o.float().square().sum(), list(m.parameters()))
                 for o, m in zip(outs, (ours, dense))]
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert {(k[1], k[5]) for k in native._handles if native._handles[k] is not None} == \
        {((24, 64), -1), ((0, 64), -1)}     # both shapes took the C++ path


# --------------------------------------------------------------------------- #
# The dispatcher's kernels (torch.compile graphs, CUDA graphs, torch.ops)      #
# --------------------------------------------------------------------------- #
@pytest.fixture
def op_kernels(emulated, monkeypatch):
    """The C++ halves of the op behind the Python autograd function, as the dispatcher's
    CUDA kernels run them under torch.compile: ``_call`` takes ``ops.IMPLS`` for CPU
    tensors, which here are the native kernels (emulated driver); the eager C++ node is
    kept out of the way."""
    from bitsparse_core.torch import ops
    for name in ("relu_linear", "gated_relu_linear"):
        monkeypatch.setattr(native, name, lambda *a, **k: None)
        for op in (name, name + "_backward"):
            monkeypatch.setitem(ops.IMPLS, op, getattr(native, op + "_kernel"))
    return emulated


def test_the_op_kernels_stand_in_for_the_python_ones_on_cuda():
    """Until the extension is loaded for CUDA, the trampolines that load it; from then on
    the extension's own kernels (those it registered with the dispatcher)."""
    from bitsparse_core.torch import ops
    mod = native._built.get("module")
    names = ("relu_linear", "relu_linear_backward", "gated_relu_linear",
             "gated_relu_linear_backward")
    kinds = [{name: getattr(native, name + "_kernel") for name in names}]
    if mod is not None:
        kinds.append({name: getattr(mod, name + "_kernel") for name in names})
    assert ops.CUDA_KERNELS in kinds


@pytest.mark.parametrize("case", ["relu2", "relu-overflow", "relu2-autocast", "relu2-no-source",
                                  "reglu", "reglu-overflow", "reglu-autocast"])
def test_op_kernels_train_bit_identically(op_kernels, case):
    """Three AdamW steps through the dispatcher kernels' C++ halves: dense's losses,
    gradients and parameters; an overflow recomputes; with no recompute source a clean
    backward reads its count from the slot."""
    from bitsparse_core.torch import relu_linear
    from torch_models import assert_same_training, make_pair, train
    kind = case.split("-")[0]
    dtype = torch.float32 if "autocast" in case else torch.bfloat16
    dense, ours = make_pair(kind, "nosign", d=32, f=96, dtype=dtype)
    if "overflow" in case:
        for blk in ours.blocks:
            blk.capacity_policy.density = 0.01
    if "no-source" in case:      # relu_linear without recompute=: the Python autograd path
        for blk in ours.blocks:
            blk.forward = lambda t, b=blk: relu_linear(b.fc1(t), b.fc2.weight, b.fc2.bias,
                                                       square=True, policy=b.capacity_policy)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    target = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(2))
    autocast = torch.bfloat16 if "autocast" in case else None
    got = train(ours, x, target, autocast=autocast)
    per_layer = 2 if kind == "reglu" else 1     # ReGLU: relu(g), then u where g > 0
    assert len([k for k, _ in op_kernels.launches if k[0] == "pack"]) == 3 * 2 * per_layer
    assert_same_training(train(dense, x, target, autocast=autocast), got)
    recomputes = [blk.stats()["recomputes"] for blk in ours.blocks]
    assert recomputes == ([3, 3] if "overflow" in case else [0, 0])


@pytest.mark.parametrize("needs", [1, 2, 4, 3, 7, 0])
def test_op_kernels_match_the_python_kernels(op_kernels, needs):
    """Both halves against ops.relu_linear(_backward) for the same arguments: the same
    output and block bytes, and for each ``needs`` the same gradients, empty where not
    asked for (as the fake kernel says)."""
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import ops
    g = torch.Generator().manual_seed(needs)
    a = torch.randn(24, 64, generator=g).to(torch.bfloat16)
    w, b = torch.randn(16, 64, generator=g).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=0.75)
    args = _op_args(pol, a, w, b)
    out, block = native.relu_linear_kernel(*args)
    out_py, block_py = ops.relu_linear(*args)
    assert torch.equal(out, out_py) and torch.equal(block, block_py)
    assert _extension_slot(block) >= 0 and _extension_slot(block_py) == C.NO_SLOT
    grad_out = torch.randn(24, 16, generator=g).to(torch.bfloat16)
    rest = _backward_args(pol, args, needs=needs)
    got = native.relu_linear_backward_kernel(grad_out, block, w, None, None, None, *rest)
    want = ops.relu_linear_backward(grad_out, block_py, w, None, None, None, *rest)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("needs", [1, 2, 4, 3, 7, 0])
def test_gated_op_kernels_match_the_python_kernels(op_kernels, needs):
    """The gated op's C++ halves against ops.gated_relu_linear(_backward) for the same
    arguments: the same output and bytes of both blocks, and for each ``needs`` the same
    gradients, empty where not asked for."""
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import ops
    gen = torch.Generator().manual_seed(needs)
    g, u = (torch.randn(24, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    w, b = torch.randn(16, 64, generator=gen).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=0.75)
    cap, enc, u_enc = pol.capacity(g.numel()), int(Encoding.NOSIGN), int(Encoding.SIGNPLANE)
    args = (g, u, w, b, None, None, None, None, None, cap, enc, u_enc, DEFAULT_CHUNK_LOG2, None,
            pol.id)
    got_fw, want_fw = native.gated_relu_linear_kernel(*args), ops.gated_relu_linear(*args)
    assert all(torch.equal(x, y) for x, y in zip(got_fw, want_fw))
    assert _extension_slot(got_fw[1]) >= 0
    grad_out = torch.randn(24, 16, generator=gen).to(torch.bfloat16)
    rest = ([24, 64], torch.bfloat16, True, cap, enc, u_enc, DEFAULT_CHUNK_LOG2, None, pol.id,
            needs)
    got = native.gated_relu_linear_backward_kernel(grad_out, *got_fw[1:], w, *(None,) * 5, *rest)
    want = ops.gated_relu_linear_backward(grad_out, *want_fw[1:], w, *(None,) * 5, *rest)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


def test_gated_op_kernel_overflow_without_a_recompute_source_raises(op_kernels):
    """As for ReLU: the gated backward of an overflowed pack with no recompute source waits
    for its count and raises the named error, naming the gated op."""
    from bitsparse_core.errors import CapacityOverflowError
    from bitsparse_core.torch import capacity as C
    g, u = torch.randn(24, 64).to(torch.bfloat16), torch.randn(24, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=0.05)
    cap, enc, u_enc = pol.capacity(g.numel()), int(Encoding.NOSIGN), int(Encoding.SIGNPLANE)
    out, block_r, block_u = native.gated_relu_linear_kernel(
        g, u, w, None, None, None, None, None, None, cap, enc, u_enc, DEFAULT_CHUNK_LOG2, None,
        pol.id)
    with pytest.raises(CapacityOverflowError, match="gated_relu_linear that has no recompute"):
        native.gated_relu_linear_backward_kernel(
            torch.ones_like(out), block_r, block_u, w, *(None,) * 5, [24, 64], torch.bfloat16,
            False, cap, enc, u_enc, DEFAULT_CHUNK_LOG2, None, pol.id, 1)


def test_op_kernel_overflow_without_a_recompute_source_raises(op_kernels):
    """An overflowed pack with no recompute source: the backward waits for its count and
    raises the named error, never returns a wrong gradient."""
    from bitsparse_core.errors import CapacityOverflowError
    from bitsparse_core.torch import capacity as C
    a = torch.randn(24, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=0.05)
    args = _op_args(pol, a, w, None, square=False)
    out, block = native.relu_linear_kernel(*args)
    with pytest.raises(CapacityOverflowError, match="no recompute source"):
        native.relu_linear_backward_kernel(torch.ones_like(out), block, w, None, None,
                                           None, *_backward_args(pol, args, square=False,
                                                                 has_bias=False, needs=1))


def test_op_kernels_leave_long_chunks_and_python_path_to_python(op_kernels, monkeypatch):
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import ops
    a = torch.randn(8, 32).to(torch.bfloat16)
    w = torch.randn(4, 32).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=1.0)
    for chunk_log2, off in ((DEFAULT_CHUNK_LOG2 + 2, False), (DEFAULT_CHUNK_LOG2, True)):
        op_kernels.launches.clear()
        args = (a, w, None, None, None, None, a.numel(),
                ops.op_config(False, int(Encoding.RAW), chunk_log2, None), pol.id)
        if off:
            with native.python_path():
                out, block = native.relu_linear_kernel(*args)
        else:
            out, block = native.relu_linear_kernel(*args)
        assert _extension_slot(block) == C.NO_SLOT and not op_kernels.launches  # Python ran
        assert torch.equal(out, ops.relu_linear(*args)[0])


def _extension_slot(block) -> int:
    """The slot of the extension's ring that the dispatcher kernel's pack of ``block``
    took (kept beside the block), NO_SLOT where the Python kernel made it."""
    return native.module().block_ticket(block)[0]


def _op_args(pol, a, w, b, square=True, encoding=Encoding.NOSIGN):
    from bitsparse_core.torch import ops
    return (a, w, b, None, None, None, pol.capacity(a.numel()),
            ops.op_config(square, int(encoding), DEFAULT_CHUNK_LOG2, None), pol.id)


def _backward_args(pol, args, square=True, encoding=Encoding.NOSIGN, has_bias=True, needs=7):
    """The backward op's arguments after its tensors, for a forward called with ``args``."""
    from bitsparse_core.torch import ops
    return (args[6], ops.op_config(square, int(encoding), DEFAULT_CHUNK_LOG2, None,
                                   args[0].dtype, has_bias, needs), pol.id)


def test_op_config_decodes_the_same_in_cpp(ext):
    """The ops' one-integer static arguments: C++ reads every field as Python wrote it,
    and a value that does not fit its field is refused."""
    from bitsparse_core.torch import _bridge
    from bitsparse_core.torch import ops
    ext = native.module()     # loaded: it holds the dtypes the fields index
    dtypes = list(_bridge.TORCH_TO_BS)
    for square, enc, chunk, mm, a_dtype, has_bias, needs in itertools.product(
            (False, True), (0, 1, 2), (5, DEFAULT_CHUNK_LOG2, 31), (None, *dtypes),
            dtypes, (False, True), (0, 3, 7)):
        config = ops.op_config(square, enc, chunk, mm, a_dtype, has_bias, needs)
        want = (square, enc, chunk, mm, a_dtype, has_bias, needs)
        assert tuple(ops.decode_config(config)) == want
        assert ext.decode_config(config) == want
    with pytest.raises(ValueError, match="does not fit"):
        ops.op_config(True, 4, DEFAULT_CHUNK_LOG2, None)
    with pytest.raises(ValueError, match="bits past"):
        ops.decode_config(1 << 40)
    with pytest.raises(RuntimeError, match="bits past"):
        ext.decode_config(1 << 40)
    past = len(dtypes) << 11            # the a_dtype field (bits 11-13) past the known dtypes
    with pytest.raises(ValueError, match="names dtype"):
        ops.decode_config(past)
    with pytest.raises(RuntimeError, match="names dtype"):
        ext.decode_config(past)


def test_the_dispatcher_runs_the_extension_kernels(emulated):
    """The extension registers its kernels with the dispatcher (CPU here, under the
    emulation; CUDA on a GPU): ``torch.ops`` calls reach them with no Python kernel on
    the way. The pack's slot comes from the extension's own ring of the slab and is kept
    beside the block, the pack is queued for its policy (drained when the policy reports
    or polls), and the results equal the Python kernels'. python_path() and an
    unregistered key go to Python."""
    from bitsparse_core.torch import capacity as C
    from bitsparse_core.torch import ops
    g = torch.Generator().manual_seed(3)
    a = torch.randn(24, 64, generator=g).to(torch.bfloat16)
    w, b = torch.randn(16, 64, generator=g).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=0.75)
    args = _op_args(pol, a, w, b)
    out, block = torch.ops.bitsparse.relu_linear(*args)
    assert [k[0] for k, _ in emulated.launches] == ["pack"]
    slot, gen = native.module().block_ticket(block)
    assert C.SLAB.slots <= slot < C.SLAB.total                  # the extension's ring
    assert C.SLAB.read_slot(slot, gen) == (0, int((a > 0).sum()))   # its count landed there
    assert native.module().block_ticket(block.clone())[0] == C.NO_SLOT   # not a copy's
    out_py, block_py = ops.relu_linear(*args)
    assert torch.equal(out, out_py) and torch.equal(block, block_py)
    assert pol.stats()["packs"] == 2                            # one each way
    pol.poll()
    assert not pol._pending and pol.max_density == int((a > 0).sum()) / a.numel()
    grad_out = torch.randn(24, 16, generator=g).to(torch.bfloat16)
    rest = _backward_args(pol, args)
    got = torch.ops.bitsparse.relu_linear_backward(grad_out, block, w, None, None, None, *rest)
    want = ops.relu_linear_backward(grad_out, block_py, w, None, None, None, *rest)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert [k[0] for k, _ in emulated.launches][-1] == "unpack"  # the fused decode ran
    with native.python_path():
        assert _extension_slot(torch.ops.bitsparse.relu_linear(*args)[1]) == C.NO_SLOT
    mod = native.module()
    mod.unregister_kernels("CPU")
    try:
        assert _extension_slot(torch.ops.bitsparse.relu_linear(*args)[1]) == C.NO_SLOT
    finally:
        mod.register_kernels("CPU")
    assert _extension_slot(torch.ops.bitsparse.relu_linear(*args)[1]) >= C.SLAB.slots


def test_the_extension_ring_skips_slots_in_flight(emulated):
    """A slot whose count has not landed is not taken again when the ring comes round,
    and a ticket whose slot was taken again reads as lost, never as the new pack's."""
    from bitsparse_core.torch import capacity as C
    a = torch.randn(8, 32).to(torch.bfloat16)
    w = torch.randn(4, 32).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=1.0)
    args = _op_args(pol, a, w, None)
    first = native.module().block_ticket(torch.ops.bitsparse.relu_linear(*args)[1])
    slot = first[0]
    C.SLAB.status[4 * slot] = C.SENTINEL             # as if its copy were still on its way
    ring = range(C.SLAB.slots, C.SLAB.total)
    in_flight = {i for i in ring if C.SLAB.status[4 * i] == C.SENTINEL}   # slot among them
    free = set(ring) - in_flight
    seen = {_extension_slot(torch.ops.bitsparse.relu_linear(*args)[1])
            for _ in range(len(free))}
    assert seen == free
    C.SLAB.status[4 * slot] = 0
    again = native.module().block_ticket(torch.ops.bitsparse.relu_linear(*args)[1])
    assert again[0] == slot and C.SLAB.lost_slot(*first) and not C.SLAB.lost_slot(*again)


def test_emulated_compiled_training_runs_the_extension_kernels(emulated):
    """torch.compile (aot_eager, fullgraph) of the packed stack: the graph's op calls go
    through the dispatcher to the extension's kernels, and training is the compiled dense
    model's bit for bit."""
    from torch_models import assert_same_training, make_pair, train
    dense, ours = make_pair("relu2", "nosign", d=32, f=96, dtype=torch.bfloat16)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    target = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    try:
        got = train(torch.compile(ours, backend="aot_eager", fullgraph=True), x, target)
        packs = [k for k, _ in emulated.launches if k[0] == "pack"]
        want = train(torch.compile(dense, backend="aot_eager", fullgraph=True), x, target)
    finally:
        torch._dynamo.reset()
    assert len(packs) >= 3 * 2
    assert_same_training(want, got)


def test_emulated_native_offload_stashes_through_the_offloader(emulated):
    """offload= takes the C++ node too: its forward hands the block to the offload
    engine and its backward takes it back (the next ones fetched ahead), with no Python
    between them, the pack's count sent ahead of the block. Training is dense's bit for
    bit, the offloader counts every block, a second backward says why it cannot run, and
    a forward without backward gives its host buffers back."""
    import gc
    from bitsparse_core.torch.offload import Offloader
    from torch_models import assert_same_training, make_pair, train
    dense, ours = make_pair("relu2", "nosign", layers=3)
    off = Offloader(ahead=1)
    for blk in ours.blocks:
        blk.offload = off
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(3, 16, 32, generator=g), torch.randn(3, 16, 32, generator=g)
    assert_same_training(train(dense, x, target), train(ours, x, target))
    assert sum(k[0] == "pack" for k, _ in emulated.launches) == 3 * 3   # the C++ node packed
    st = off.stats()
    assert st["offloaded"] == 9 and st["kept_on_device"] == 0
    assert emulated.block_copies == 2 * 9        # every block out and back, by the engine
    # each pack's count reached its slot (sent on the offloader's stream): read there,
    # neither waited for nor recomputed
    assert all(blk.stats()["recomputes"] == blk.stats()["waits"] == 0 for blk in ours.blocks)
    assert st["late"] == 3 and st["prefetched"] == 6
    assert off.pool.free_bytes() == off.pool.held
    loss = ours(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    del loss
    gc.collect()
    y = ours(x)
    assert off.pool.free_bytes() < off.pool.held
    del y
    gc.collect()
    assert off.pool.free_bytes() == off.pool.held


def test_a_plan_the_extension_does_not_take_runs_the_python_kernel(emulated, monkeypatch):
    """The extension asks Python for a plan it has not seen; where none is made (the plan
    table full, say) the op's Python kernel runs, and the answer is kept: Python is not
    asked again for the same plan."""
    from bitsparse_core.torch import capacity as C
    asked = []

    def refuse(mod, plan, device):
        asked.append(plan.lay.numel)
        return None
    monkeypatch.setattr(native, "register", refuse)
    a = torch.randn(8, 48).to(torch.bfloat16)
    w = torch.randn(4, 48).to(torch.bfloat16)
    pol = C.CapacityPolicy(density=1.0)
    args = _op_args(pol, a, w, None)
    for _ in range(2):
        emulated.launches.clear()
        out, block = torch.ops.bitsparse.relu_linear(*args)
        assert _extension_slot(block) == C.NO_SLOT and not emulated.launches
    assert asked == [a.numel()]


def test_build_flags_follow_the_headers(monkeypatch, tmp_path):
    """torch's JIT build hashes only the listed sources and the flags: the hash of the
    parts the source includes rides in a flag, so editing one of them rebuilds."""
    import shutil as sh

    from torch.utils import cpp_extension
    for path in native.kernel_dir().glob("torch_*"):
        sh.copy(path, tmp_path / path.name)
    assert len(list(tmp_path.glob(native.HEADERS))) >= 4
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw["extra_cflags"]))
    monkeypatch.setattr(native, "kernel_dir", lambda: tmp_path)
    native.build()
    native.build()
    part = tmp_path / "torch_host_slots.h"
    part.write_text(part.read_text() + "\n// edited\n")
    native.build()
    assert seen[0] == seen[1] != seen[2]


def test_front_remembers_as_many_sites_as_python():
    # the C++ front's bound on the sites it keeps records of is sites.MAX_SITES
    from bitsparse_core.torch import sites
    text = (native.kernel_dir() / "torch_host_hooks.h").read_text()
    bound = re.search(r"constexpr size_t kMaxSites = (\d+);", text)
    assert bound is not None and int(bound.group(1)) == sites.MAX_SITES
