"""The C++ host path of the FFN op (bitsparse_core/torch/native.py) on the CPU.

Its launches are checked against the Python host protocol with the driver faked:
for the same plan and pointers, the parameter bytes the C++ ``Launch`` passes must be
those of the record ``backends/cuda/host`` fills. The GPU behaviour (bit identity with
the Python path and with dense, no syncs, graph capture) is in tests/test_torch_gpu.py.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import sysconfig

import pytest

torch = pytest.importorskip("torch")

from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.backends.cuda import abi, host  # noqa: E402
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


BLOCK, X, Y, SCRATCH, G, OUT, OUT2 = (0x7F00_0000_0000 + k * 0x1000_0000 for k in range(7))


def _roles(**given):
    return [given.get(name, 0) for name in native.ROLE_NAMES]


CASES = [((8, 1024), D.BFLOAT16, Encoding.NOSIGN, 0.25), ((3, 7, 333), D.FLOAT16, Encoding.RAW, 0.5),
         ((5000,), D.FLOAT32, Encoding.SIGNPLANE, 0.1), ((64, 96), D.FLOAT8_E4M3FN, Encoding.NOSIGN, 1.0),
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
                          launches)
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


def test_long_chunks_stay_on_the_python_path(ext, python_launches):
    """Chunks longer than the unpack tile need a prefix scan the C++ path does not make."""
    plan = host.pack_plan((4, 65536), D.BFLOAT16, Encoding.NOSIGN, 1000, 16, abi.Mode.RELU)
    assert native.plan_templates(plan, 0) is None
    assert native.register(ext, plan, 0) is None


def test_bad_templates_are_refused(ext):
    rec = abi.MaskSelectArgs()
    good = native.launch_template(1, 1, 0, False, rec, ("mask",), (("g", "g", "g_aligned", False),))
    assert ext.add_plan(10, 64, 0, 0, {"mask_select": good}) >= 0
    with pytest.raises(RuntimeError, match="unknown launch"):
        ext.add_plan(10, 64, 0, 0, {"gated": good})
    outside = good[:7] + ([10_000],) + good[8:]
    with pytest.raises(RuntimeError, match="outside the record"):
        ext.add_plan(10, 64, 0, 0, {"mask_select": outside})
    with pytest.raises(RuntimeError, match="unknown role"):
        ext.add_plan(10, 64, 0, 0, {"mask_select": good[:8] + ([(9, 0, -1, False)],)})
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
    """The C++ path is for CUDA tensors; on CPU the FFN runs the NumPy reference codec."""
    from bitsparse_core.torch import relu_ffn
    monkeypatch.setattr(native, "relu_linear", lambda *a, **k: pytest.fail("native on CPU"))
    x = torch.randn(4, 16, requires_grad=True)
    w1, w2 = torch.randn(32, 16), torch.randn(16, 32)
    relu_ffn(x, w1, None, w2, None, square=True).sum().backward()
    assert x.grad is not None
