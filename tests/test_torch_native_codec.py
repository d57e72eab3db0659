"""The public codec ops' C++ host path for torch tensors (bitsparse_core/torch/native_codec.py).

On the CPU: its launch templates against the records the Python host protocol fills for
the same pointers (any capacity, any alignment), the whole path end to end on host
memory (the C++ extension with ``test_torch_native.HostDriver``'s reference kernels),
which calls the public ops send it and which it leaves to the Python path. On the GPU:
the same bits as the CuPy backend's Python path and the reference, on torch's stream
and allocator, with no sync.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.backends import get_backend  # noqa: E402
from bitsparse_core.backends.cuda import abi, host  # noqa: E402
from bitsparse_core.errors import CapacityOverflowError, EncodingError  # noqa: E402
from bitsparse_core.spec import codec as reference, format as fmt, ops as reference_ops  # noqa: E402
from bitsparse_core.spec.format import DEFAULT_CHUNK_LOG2, Encoding  # noqa: E402
from bitsparse_core.torch import native, native_codec as nc  # noqa: E402
from gpu_util import fresh_rng, random_bits  # noqa: E402
from test_torch_native import (BLOCK, G, OUT, OUT2, SCRATCH, X, Y, HostDriver,  # noqa: E402,F401
                               emulated, ext, python_launches)
from test_torch_native import _roles as named_roles  # noqa: E402

Mode, Op = abi.Mode, abi.Op
STREAM = 0x5EED
TORCH_DTYPES = {D.BFLOAT16: torch.bfloat16, D.FLOAT16: torch.float16, D.FLOAT32: torch.float32,
                D.FLOAT8_E4M3FN: torch.float8_e4m3fn, D.FLOAT8_E5M2: torch.float8_e5m2}


def _roles(planes=None, u=None, **given):
    """A call's roles: the planes' addresses and lengths (``u``: gated's u), then the
    named pointers."""
    if planes is not None:
        given.update(mask=planes.mask, mask_len=planes.mask_len, offsets=planes.offsets,
                     values=planes.values, values_len=planes.values_len, signs=planes.signs,
                     signs_len=planes.signs_len)
    if u is not None:
        given.update(uvalues=u.values, uvalues_len=u.values_len, usigns=u.signs,
                     usigns_len=u.signs_len)
    return named_roles(**given)


CASES = [((8, 1024), D.BFLOAT16, Encoding.NOSIGN, 0.25),
         ((3, 7, 333), D.FLOAT16, Encoding.RAW, 0.5),
         ((5000,), D.FLOAT32, Encoding.SIGNPLANE, 0.1),
         ((64, 96), D.FLOAT8_E4M3FN, Encoding.NOSIGN, 1.0),
         ((40001,), D.FLOAT8_E5M2, Encoding.SIGNPLANE, 0.3)]
_ids = lambda v: getattr(v, "name", str(v))  # noqa: E731


def _numel(shape):
    return int(np.prod(shape, dtype=np.int64))


# --------------------------------------------------------------------------- #
# Templates against the Python host protocol's records                        #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("shape,dtype,enc,density", CASES, ids=_ids)
@pytest.mark.parametrize("mode", [Mode.PACK, Mode.RELU, Mode.RELU2], ids=_ids)
def test_pack_templates_match_the_python_records(ext, python_launches, shape, dtype, enc,
                                                 density, mode):
    """The public pack (fixed capacity: the value slots past the count zeroed), an
    aligned and an unaligned input, with and without relu_pack's dense output."""
    plan = host.pack_plan(shape, dtype, enc, int(density * _numel(shape)), DEFAULT_CHUNK_LOG2,
                          mode)
    template = native.pack_template(plan, 0, zero_tail=True)
    launch = ext.add_public_launch(template)
    y = 0 if mode == Mode.PACK else Y
    for x in (X, X + 2):
        host.enqueue_pack(plan, 0, STREAM, x, BLOCK, SCRATCH, y, zero_tail=True)
        kind, func, grid, smem, want = python_launches.pop()
        assert (kind, func, grid, smem) == ("coop", template[0], template[1], template[3])
        assert ext.public_launch_params(launch, BLOCK, _roles(x=x, y=y, scratch=SCRATCH)) == want
    assert not python_launches


@pytest.mark.parametrize("u_enc", [Encoding.SIGNPLANE, Encoding.RAW, Encoding.NOSIGN], ids=_ids)
def test_masked_pack_template_reads_the_mask_tensors_planes(ext, python_launches, u_enc):
    shape, dtype = (3, 5000), D.BFLOAT16
    mask_planes = host.pack_plan(shape, dtype, Encoding.NOSIGN, 4000, DEFAULT_CHUNK_LOG2,
                                 Mode.RELU).planes(BLOCK + (1 << 24))
    plan = host.pack_plan(shape, dtype, u_enc, 3777, DEFAULT_CHUNK_LOG2, Mode.MASKED)
    launch = ext.add_public_launch(native.pack_template(plan, 0, zero_tail=True))
    host.enqueue_pack(plan, 0, STREAM, X, BLOCK, SCRATCH, in_planes=mask_planes, zero_tail=True)
    want = python_launches.pop()[-1]
    assert ext.public_launch_params(launch, BLOCK, _roles(mask_planes, x=X, scratch=SCRATCH)) == want


@pytest.mark.parametrize("shape,dtype,enc,density", CASES, ids=_ids)
def test_unpack_templates_take_any_capacity(ext, python_launches, shape, dtype, enc, density):
    """One template per op, dtype, encoding and size serves every capacity (exact packs
    each have their own): the planes' addresses and lengths are the call's."""
    numel = _numel(shape)
    lay = fmt.cached_layout(shape, dtype, enc, int(density * numel), DEFAULT_CHUNK_LOG2)
    launches = {op: ext.add_public_launch(nc.unpack_template(lay, op, None, 0))
                for op in (Op.UNPACK, Op.RELU2)}
    select = ext.add_public_launch(nc.mask_select_template(lay, 0))
    for cap in (int(density * numel), numel // 3, 0):
        plan = host.pack_plan(shape, dtype, enc, cap, DEFAULT_CHUNK_LOG2, Mode.RELU)
        planes = plan.planes(BLOCK + 64 * cap)
        for op, launch in launches.items():
            g = G if op == Op.RELU2 else 0
            host.enqueue_unpack(plan.lay, planes, op, 0, STREAM, OUT + 2 * cap, grad=g)
            kind, func, grid, _, want = python_launches.pop()
            assert (kind, func, grid) == ("launch", *nc.unpack_template(lay, op, None, 0)[:2])
            assert ext.public_launch_params(launch, 0, _roles(planes, g=g, out=OUT + 2 * cap)) == want
        host.enqueue_relu_backward(plan.lay, planes, 0, STREAM, G + 2, OUT + 4)
        want = python_launches.pop()[-1]
        assert ext.public_launch_params(select, 0, _roles(planes, g=G + 2, out=OUT + 4)) == want
    assert not python_launches


@pytest.mark.parametrize("u_enc", [Encoding.SIGNPLANE, Encoding.RAW, Encoding.NOSIGN], ids=_ids)
def test_gated_template_reads_both_tensors(ext, python_launches, u_enc):
    shape, dtype = (5, 3001), D.BFLOAT16
    lay = fmt.cached_layout(shape, dtype, Encoding.NOSIGN, 7000, DEFAULT_CHUNK_LOG2)
    launch = ext.add_public_launch(nc.unpack_template(lay, Op.GATED, u_enc, 0))
    for cap in (7000, 1234):
        pr = host.pack_plan(shape, dtype, Encoding.NOSIGN, cap, DEFAULT_CHUNK_LOG2,
                            Mode.RELU).planes(BLOCK)
        pu = host.pack_plan(shape, dtype, u_enc, cap, DEFAULT_CHUNK_LOG2, Mode.MASKED).planes(
            BLOCK + (1 << 24))._replace(mask=pr.mask, offsets=pr.offsets)
        host.enqueue_unpack(lay, pr, Op.GATED, 0, STREAM, OUT, grad=G + 6, out2=OUT2, pu=pu,
                            u_encoding=u_enc)
        want = python_launches.pop()[-1]
        assert ext.public_launch_params(launch, 0, _roles(pr, pu, g=G + 6, out=OUT,
                                                          out2=OUT2)) == want


def test_long_chunks_have_no_unpack_template(ext, python_launches):
    lay = fmt.cached_layout((4, 65536), D.BFLOAT16, Encoding.NOSIGN, 1000, 16)
    assert nc.unpack_template(lay, Op.UNPACK, None, 0) is None


# --------------------------------------------------------------------------- #
# The whole path on host memory                                               #
# --------------------------------------------------------------------------- #
@pytest.fixture
def codec(emulated, monkeypatch):
    """native_codec on the emulated extension, naming the CuPy backend (not importable
    here: only its object is needed) in the packed tensors it makes."""
    monkeypatch.setattr(nc, "_cupy", get_backend("cupy"))
    nc._forget()    # templates of an earlier driver name kernels this one does not know
    yield emulated
    nc._forget()


def _tensor(bits: np.ndarray, dtype: D.DType) -> torch.Tensor:
    raw = np.ascontiguousarray(bits).view(f"i{dtype.itemsize}")
    return torch.from_numpy(raw.copy()).view(TORCH_DTYPES[dtype])


def _host_bytes(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes) if nbytes else b""


def _plane_bytes(plane) -> bytes:
    return _host_bytes(plane.ptr, plane.shape[0] * plane.dtype.itemsize)


def _dense_bytes(arr) -> bytes:
    """A dense result's bytes: a CudaArray over host memory, or a tensor, or NumPy."""
    if isinstance(arr, torch.Tensor):
        return arr.contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(arr, np.ndarray):
        return arr.tobytes()
    return _host_bytes(arr.ptr, arr.nbytes)


def _assert_planes(p, ref):
    assert (p.shape, p.dtype, p.encoding, p.capacity) == (ref.shape, ref.dtype, ref.encoding,
                                                          ref.capacity)
    for name in ("mask", "offsets", "values", "signs"):
        want = np.ascontiguousarray(getattr(ref, name)).tobytes()
        assert _plane_bytes(getattr(p, name)) == want, name


EMULATED = [(D.BFLOAT16, Encoding.NOSIGN, (3, 1000)), (D.FLOAT16, Encoding.SIGNPLANE, (4099,)),
            (D.FLOAT32, Encoding.RAW, (2, 3, 777)), (D.FLOAT8_E4M3FN, Encoding.NOSIGN, (64, 65)),
            (D.FLOAT8_E5M2, Encoding.SIGNPLANE, (9000,))]


@pytest.mark.parametrize("dtype,enc,shape", EMULATED, ids=_ids)
def test_emulated_pack_unpack_and_backward_are_the_reference(codec, dtype, enc, shape):
    rng = np.random.default_rng(11)
    xb = random_bits(rng, shape, dtype, 0.8, signs=enc != Encoding.NOSIGN)
    x = _tensor(xb, dtype)
    nnz = int(np.count_nonzero(xb.view(dtype.uint)))
    p = nc.pack(x, enc.name.lower(), nnz)
    assert p.backend is get_backend("cupy") and p.extra["torch"] and p.device == ("cuda", 0)
    ref = reference.pack_array(xb, dtype, enc, capacity=nnz)
    _assert_planes(p, ref)
    p._nnz, p.status = nnz, None     # what check() would read from the device
    assert _dense_bytes(nc.unpack(p, None)) == xb.tobytes()
    out = torch.zeros_like(x)
    assert nc.unpack(p, out) is out and _dense_bytes(out) == xb.tobytes()
    gb = random_bits(rng, shape, dtype, 0.0)
    g = _tensor(gb, dtype)
    assert _dense_bytes(nc.relu_backward(g, p)) == reference_ops.relu_backward(gb, ref).tobytes()
    assert (_dense_bytes(nc.relu2_backward(g, p))
            == reference_ops.relu2_backward(gb, ref).tobytes())


@pytest.mark.parametrize("square", [False, True], ids=["relu", "relu2"])
def test_emulated_relu_pack_is_the_reference(codec, square):
    rng = np.random.default_rng(5)
    ab = (rng.standard_normal((7, 1500)) - 0.5).astype(D.BFLOAT16.numpy)   # no NaN: nosign
    cap = int(np.count_nonzero(reference_ops.relu_bits(ab, D.BFLOAT16).view(np.uint16)))
    y, p = nc.relu_pack(_tensor(ab, D.BFLOAT16), square, "nosign", cap)
    y_ref, p_ref = reference_ops.relu_pack(ab, D.BFLOAT16, square=square, capacity=cap)
    _assert_planes(p, p_ref)
    assert y.shape == (7, 1500) and y.dtype is D.BFLOAT16
    assert _dense_bytes(y) == y_ref.tobytes()


def test_emulated_path_leaves_other_calls_to_python(codec):
    rng = np.random.default_rng(3)
    xb = random_bits(rng, (64, 64), D.BFLOAT16, 0.8, signs=False)
    x = _tensor(xb, D.BFLOAT16)
    assert nc.pack(x.t(), "nosign", 100) is None                 # not contiguous
    assert nc.pack(x, "auto", 4096) is None                      # waits for the status
    assert nc.pack(x, ["nosign"], 100) is None                   # unhashable: Python names it
    assert nc.pack(x[:0], "nosign", 0) is None                   # empty
    assert nc.pack(x.view(torch.int16), "raw", 100) is None      # needs dtype=
    assert nc.pack(xb, "nosign", 100) is None                    # not a torch tensor
    p_ref = reference.pack_array(xb, D.BFLOAT16, "nosign")
    assert nc.unpack(p_ref, None) is None                        # another backend's
    p = nc.pack(x, "nosign", 4096)
    p._nnz, p.status = int(np.count_nonzero(xb.view(np.uint16))), None
    assert nc.unpack(p, torch.empty(64, 64, dtype=torch.float16)) is None   # out's dtype
    assert nc.unpack(p, torch.empty(64, 65, dtype=torch.bfloat16)[:, :64]) is None
    assert nc.relu_backward(x.t(), p) is None
    assert nc.relu2_backward(x[:32], p) is None
    assert nc.gated_backward(x, p, p_ref) is None
    assert nc.unpack("not packed", None) is None
    with native.python_path():
        assert nc.pack(x, "nosign", 4096) is None
        assert nc.unpack(p, None) is None


def test_emulated_caches_start_afresh_when_full(codec, monkeypatch):
    """Shapes that never repeat: past ``_MAX_ENTRIES`` calls the entries and the
    extension's templates go, and later calls still decode right."""
    monkeypatch.setattr(nc, "_MAX_ENTRIES", 2)
    rng = np.random.default_rng(9)
    for n in (300, 301, 302, 303, 304):
        xb = random_bits(rng, (n,), D.FLOAT16, 0.7, signs=False)
        p = nc.pack(_tensor(xb, D.FLOAT16), "nosign", n)
        p._nnz, p.status = int(np.count_nonzero(xb.view(np.uint16))), None
        assert _dense_bytes(nc.unpack(p, None)) == xb.tobytes()
        assert len(nc._PACKS) <= 2 and len(nc._UNPACKS) <= 2


def test_emulated_ids_from_before_a_reset_queue_nothing(codec):
    """An id another thread took before the extension forgot its templates finds nothing
    after (even where its index holds a new template): the call goes to Python."""
    rng = np.random.default_rng(4)
    xb = random_bits(rng, (2, 512), D.BFLOAT16, 0.8, signs=False)
    x = _tensor(xb, D.BFLOAT16)
    p = nc.pack(x, "nosign", 1024)
    p._nnz, p.status = int(np.count_nonzero(xb.view(np.uint16))), None
    stale = dict(nc._PACKS), dict(nc._UNPACKS)
    assert nc.unpack(p, None) is not None
    native._emulation.forget_public_launches()          # the extension's side of a reset
    launches = len(codec.launches)
    assert nc.pack(x, "nosign", 1024) is None and nc.unpack(p, None) is None
    assert len(codec.launches) == launches               # nothing queued
    nc._forget()
    assert nc.pack(x, "nosign", 1024) is not None                   # made again
    (key, old), = stale[0].items()
    assert nc._PACKS[key].launch != old.launch                      # same index, new generation
    with pytest.raises(RuntimeError, match="unknown public launch"):
        native._emulation.public_launch_params(old.launch, 0, _roles())


# --------------------------------------------------------------------------- #
# Which calls the public ops send (no extension needed)                        #
# --------------------------------------------------------------------------- #
class _Spy:
    """Stands in for the native path: records each call and takes none."""
    backends = nc.BACKENDS

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args):
            self.calls.append(name)
            return None
        return record


def test_public_ops_send_only_calls_under_torchs_defaults(monkeypatch):
    spy = _Spy()
    monkeypatch.setattr(bc, "_native_codec", spy)
    x = np.zeros((4, 64), np.float32)
    x[0, :5] = 1.0
    p = bc.pack(x, capacity=8, encoding="raw")                   # sent, then Python
    assert spy.calls == ["pack"] and p.capacity == 8
    for kwargs in ({}, {"capacity": 8, "dtype": "float32"}, {"capacity": 8, "chunk_log2": 10},
                   {"capacity": 8, "backend": "numpy"}, {"capacity": True},
                   {"capacity": 8, "stream": 0}, {"capacity": 8, "allocator": object()}):
        with contextlib.suppress(Exception):
            bc.pack(x, **kwargs)
    assert spy.calls == ["pack"]
    bc.relu_pack(x, capacity=8)
    bc.unpack(p)
    bc.unpack(p, out=np.empty_like(x))
    bc.relu_backward(x, p)
    bc.relu2_backward(x, p)
    p_u = bc.masked_pack(x, p)
    bc.gated_backward(x, p, p_u)
    assert spy.calls == ["pack", "relu_pack", "unpack", "unpack", "relu_backward",
                         "relu2_backward", "masked_pack", "gated_backward"]
    spy.calls.clear()
    for call in (lambda: bc.unpack(p, stream=0), lambda: bc.relu_backward(x, p, allocator=1),
                 lambda: bc.masked_pack(x, p, dtype="float32"),
                 lambda: bc.relu_pack(x, capacity=8, stream=0)):
        with contextlib.suppress(Exception):
            call()
    assert spy.calls == []


# --------------------------------------------------------------------------- #
# On the GPU                                                                  #
# --------------------------------------------------------------------------- #
def _cuda_ready() -> bool:
    return torch.cuda.is_available() and bc.backend_available("cupy")


def gpu(test):
    """The ``gpu`` marker, and a skip where there is none."""
    skip = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU, torch with CUDA and CuPy")
    return pytest.mark.gpu(skip(test))


def _taken(monkeypatch) -> list:
    """Names of the public ops the native path took (returned a result for)."""
    bc.pack(torch.ones(8, device="cuda"), capacity=8)     # attaches the path
    if native.cuda_module() is None:
        pytest.fail(f"the C++ path did not build on this GPU machine: {native.build_error()}")
    assert bc._native_codec is nc._NativeCodec
    taken = []
    for name in ("pack", "relu_pack", "masked_pack", "unpack", "relu_backward",
                 "relu2_backward", "gated_backward"):
        def spy(*args, _name=name, _fn=getattr(nc, name)):
            out = _fn(*args)
            if out is not None:
                taken.append(_name)
            return out
        monkeypatch.setattr(nc._NativeCodec, name, staticmethod(spy))
    return taken


def _cuda(bits: np.ndarray, dtype: D.DType) -> torch.Tensor:
    return _tensor(bits, dtype).cuda()


def _relu_like_cuda(seed: int, shape, sparsity: float):
    """``(bits, CUDA tensor)``: bf16 with no sign bit set (nosign-legal), specials included."""
    xb = random_bits(np.random.default_rng(seed), shape, D.BFLOAT16, sparsity, signs=False)
    return xb, _cuda(xb, D.BFLOAT16)


def _bits(arr) -> bytes:
    t = torch.from_dlpack(arr) if not isinstance(arr, torch.Tensor) else arr
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _same_packed(p, q):
    assert (p.shape, p.dtype, p.encoding, p.capacity, p.nnz) == (q.shape, q.dtype, q.encoding,
                                                                 q.capacity, q.nnz)
    for name in ("mask", "offsets", "values", "signs"):
        assert _bits(getattr(p, name)) == _bits(getattr(q, name)), name


GPU_CASES = [(D.BFLOAT16, Encoding.NOSIGN, (8, 1024)), (D.FLOAT16, Encoding.SIGNPLANE, (3, 7, 333)),
             (D.FLOAT32, Encoding.RAW, (5000,)), (D.FLOAT8_E4M3FN, Encoding.NOSIGN, (64, 96)),
             (D.FLOAT8_E5M2, Encoding.SIGNPLANE, (1, 40999))]


@pytest.mark.parametrize("dtype,enc,shape", GPU_CASES, ids=_ids)
@gpu
def test_native_public_ops_match_python_and_reference_cuda(request, monkeypatch, dtype, enc,
                                                           shape):
    rng = fresh_rng(request)
    taken = _taken(monkeypatch)
    xb = random_bits(rng, shape, dtype, 0.85, signs=enc != Encoding.NOSIGN)
    ab = random_bits(rng, shape, dtype, 0.1)
    ub = random_bits(rng, shape, dtype, 0.0)
    gb = random_bits(rng, shape, dtype, 0.0)
    x, a, u, g = (_cuda(b, dtype) for b in (xb, ab, ub, gb))
    nnz = int(np.count_nonzero(xb.view(dtype.uint)))
    name = enc.name.lower()

    def run():
        p = bc.pack(x, capacity=nnz, encoding=name)
        y, pr = bc.relu_pack(a, square=True, capacity=x.numel())
        mask = bc.pack(x, encoding=name)                  # exact: its count known
        pu = bc.masked_pack(u, mask, encoding="signplane")
        out = torch.empty_like(x)
        bc.unpack(p, out=out)
        return (p, y, pr, pu, bc.unpack(p), out, bc.relu_backward(g, p), bc.relu2_backward(g, p),
                *bc.gated_backward(g, mask, pu))

    ours = run()
    assert sorted(set(taken)) == ["gated_backward", "masked_pack", "pack", "relu2_backward",
                                  "relu_backward", "relu_pack", "unpack"]
    taken.clear()
    with native.python_path():
        python = run()
    assert taken == []
    for k in (0, 2, 3):
        _same_packed(ours[k], python[k])
    for k in (1, 4, 5, 6, 7, 8, 9):
        assert _bits(ours[k]) == _bits(python[k]), k
    ref = reference.pack_array(xb, dtype, enc, capacity=nnz)
    assert _bits(ours[0].values) == np.asarray(ref.values).tobytes()
    assert _bits(ours[4]) == xb.tobytes() == _bits(ours[5])
    assert _bits(ours[6]) == reference_ops.relu_backward(gb, ref).tobytes()
    assert _bits(ours[7]) == reference_ops.relu2_backward(gb, ref).tobytes()
    # y does not depend on the encoding (a's NaNs with the sign set break nosign's pack)
    y_ref, _ = reference_ops.relu_pack(ab, dtype, square=True, encoding="raw")
    assert _bits(ours[1]) == y_ref.tobytes()


@gpu
def test_native_public_ops_use_torchs_stream_and_allocator_without_syncs_cuda(monkeypatch):
    taken = _taken(monkeypatch)
    xb, x = _relu_like_cuda(1, (512, 1024), 0.9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            p = bc.pack(x, capacity=x.numel() // 5, encoding="nosign")
            y, _ = bc.relu_pack(x, capacity=x.numel() // 5)
        assert (torch.cuda.memory_allocated() - before
                >= p.nbytes - p.layout.header_size + x.nbytes)
        assert p.extra["stream"] == side.cuda_stream
        out = bc.unpack(p)       # on the current stream: ordered after the side stream's pack
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert taken == ["pack", "relu_pack", "unpack"]
    assert out.stream == torch.cuda.current_stream().cuda_stream
    assert _bits(out) == xb.tobytes()


@gpu
def test_native_public_ops_report_overflow_and_sign_violations_cuda(monkeypatch):
    taken = _taken(monkeypatch)
    xb, x = _relu_like_cuda(2, (4, 4096), 0.5)
    nnz = int(np.count_nonzero(xb.view(np.uint16)))
    p = bc.pack(x, capacity=nnz - 7, encoding="nosign")
    with pytest.raises(CapacityOverflowError):
        bc.unpack(p)
    q = bc.pack(-x, capacity=nnz, encoding="nosign")
    with pytest.raises(EncodingError):
        q.check()
    assert taken == ["pack", "pack"]
