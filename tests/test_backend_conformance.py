"""Backend conformance: every registered backend against the NumPy reference, bit for bit.

One suite for all backends, in the style of numcodecs' ``check_encode_decode``:
a few generic checkers (``check_pack``, ``check_unpack``, ``check_relu_pack``,
``check_backward``, ``check_masked_pack``, ``check_gated_backward``) run every
public entry point of one backend and compare whole planes and dense results
with :mod:`bitsparse_core.spec.codec` / :mod:`bitsparse_core.spec.ops`. The
tests only choose data; an adapter per backend kind (:class:`HostAdapter` for
NumPy memory, :class:`CudaAdapter` for CuPy memory) moves NumPy truth to the
backend's device and results back, so no checker knows which backend it runs.

Backends are ``bitsparse_core.registered_backends()``:

* CPU backends (``numpy``) run in this process;
* CUDA backends (``cupy``, ``numba``) run in this process on a real GPU, marked
  ``gpu`` (skipped cleanly where there is none);
* ``numba-sim``: the numba backend under Numba's CUDA simulator, in a child
  pytest process of this module (``test_simulator_conformance``): the simulator
  must be switched on (``NUMBA_ENABLE_CUDASIM=1``) before ``numba.cuda`` is first
  imported. Run this file with the variable set and only the simulator cases
  run, in-process. Simulator tensors stay at a few thousand elements.

What is covered, for every backend: every op (pack, unpack with and without
``out=``, relu_pack plain and squared, relu_backward, relu2_backward,
masked_pack, gated_backward with a shared and an own mask, to_bytes), every
dtype, every encoding (raw, nosign, signplane, auto), exact and fixed capacity
(room to spare, exact fit, overflow: ``check``, ``unpack`` and ``to_bytes``
raise, the first ``capacity`` values stay valid), nosign refusals, special bit
patterns, empty / 0-d / odd sizes, misaligned inputs and outputs, chunk_log2 9,
12 and 16 (larger than any tile). GPU only: explicit streams, consumers on
another stream than the producer, and cross-backend agreement (each CUDA
backend unpacks the other's tensors; same planes byte for byte).

Contracts some backends break today (the backend rewrite fixes them; the tests
are deliberately not xfailed):

* ``test_gated_backward_refuses_overflowed_operand[...-p_u-...]``: gated_backward
  must raise CapacityOverflowError when ``p_u`` (not only ``p_r``) overflowed
  (numpy: a wrong gradient under nosign / signplane, a ValueError under raw).
* ``test_consumer_stream_waits_for_producer`` (GPU): an op on stream s2 reading
  a tensor whose planes are still being written on s1 must wait for s1 (cupy,
  on an H200: relu2_backward, masked_pack, gated_backward, and unpack of an
  exact pack and of a masked_pack tensor).
* fixed capacity = numel (``test_fixed_capacity``, ``test_empty_and_odd_sizes``,
  ``test_masked_pack_of_a_pending_mask`` on GPU): the value slots past nnz are
  padding and must be zero, as the reference's (cupy skips zeroing them when
  capacity == numel).
"""

from __future__ import annotations

import itertools
import sys
import zlib

import numpy as np
import pytest

import bitsparse_core as bc
from bitsparse_core import dtypes as D
from bitsparse_core.errors import (CapacityOverflowError, EncodingError, NotSerializableError,
                                   OutputMismatchError)
from bitsparse_core.spec import codec as R
from bitsparse_core.spec import ops as RO
from bitsparse_core.spec.planes import decode_values
from gpu_util import assert_same_bits, assert_same_planes, plane_bytes
from helpers import ALL_DTYPES, SIM_ACTIVE, random_tensor, run_in_simulator, special_patterns

ENCODINGS = ("raw", "nosign", "signplane", "auto")
STORED = ("raw", "nosign", "signplane")          # the encodings a buffer can hold
SIMULATED = ("numba",)                           # backends that run under the simulator

# The data holds infinities, NaNs and extremes on purpose: float warnings of the
# reference products (and of the numpy backend, which runs them) are expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def IDS(value):
    if isinstance(value, D.DType):
        return value.name
    return str(value) if isinstance(value, tuple) else None


# --------------------------------------------------------------------------- #
# The backends                                                                #
# --------------------------------------------------------------------------- #
def _backend_params():
    params = []
    for name, device in bc.registered_backends().items():
        if SIM_ACTIVE:
            if name in SIMULATED:
                params.append(pytest.param(name, id=f"{name}-sim"))
        elif device == "cpu":
            params.append(pytest.param(name, id=name))
        else:
            params.append(pytest.param(name, id=name, marks=pytest.mark.gpu))
    return params


BACKENDS = _backend_params()

if SIM_ACTIVE:
    # The simulator runs a block's threads as Python threads meeting at barriers;
    # a shorter GIL switch interval gets them there sooner (about a third faster).
    sys.setswitchinterval(5e-4)
else:
    def test_simulator_conformance():
        """This module again, in a child process, on the numba backend under the simulator."""
        run_in_simulator(__file__)


class HostAdapter:
    """A backend taking NumPy arrays: the CPU backends, and numba under the simulator
    (whose "device" memory is NumPy arrays)."""

    gpu = False
    xp = np          # the array module of the backend's memory

    def __init__(self, name):
        self.name = name
        self.be = bc.get_backend(name)
        self.sim = self.be.device_type != "cpu"
        self.scale = "sim" if self.sim else "cpu"

    def put(self, x, via="typed", offset=0):
        """``(obj, kwargs)``: ``x`` on the device, with its true dtype (``typed``) or as
        unsigned-integer bits plus ``dtype=`` (``bits``); ``offset`` elements past an
        aligned address."""
        dt = D.resolve(x.dtype)
        flat = np.asarray(x, order="C").reshape(-1).view(dt.uint)
        base = self.xp.zeros(flat.size + offset, dtype=dt.uint)
        base[offset:] = self.xp.asarray(flat)
        bits = base[offset:].reshape(x.shape)
        if via == "bits":
            return bits, {"dtype": dt.name}
        return self._typed(bits, dt), {}

    def _typed(self, bits, dt):
        return bits.view(dt.numpy)

    def empty(self, shape, dt, offset=0):
        """A poisoned ``out=`` target: every byte the backend fails to write shows."""
        n = int(np.prod(shape, dtype=np.int64))
        base = self.xp.full((n + offset) * dt.itemsize, 0xA5, dtype=np.uint8).view(dt.uint)
        return self._typed(base[offset:].reshape(shape), dt)

    def host(self, arr) -> np.ndarray:
        return np.array(self.be.to_numpy(arr))

    def pack(self, x, *, via="bits", offset=0, **kw):
        obj, extra = self.put(x, via, offset)
        if self.sim:           # a NumPy input is a CPU tensor to the registry: call directly
            return self.be.pack(obj, **extra, **kw)
        return bc.pack(obj, backend=self.name, **extra, **kw)

    def relu_pack(self, a, *, via="bits", **kw):
        obj, extra = self.put(a, via)
        if self.sim:
            return self.be.relu_pack(obj, **extra, **kw)
        return bc.relu_pack(obj, backend=self.name, **extra, **kw)


class CudaAdapter(HostAdapter):
    """A CUDA backend on a real GPU: inputs are CuPy arrays (bf16 / fp8 as their bits
    with ``dtype=``, or wrapped to export their true dtype through DLPack)."""

    gpu = True

    def __init__(self, name):
        self.cp = self.xp = pytest.importorskip("cupy")
        from bitsparse_core.backends.cuda import interop
        self.ci = interop
        super().__init__(name)
        self.sim, self.scale = False, "gpu"
        self._spin = None

    def _typed(self, bits, dt):
        """CuPy bits exported with their true dtype (CuPy has no bf16 / fp8)."""
        return self.ci.CudaArray(bits.data.ptr, bits.shape, dt, bits.device.id, bits,
                                 self.cp.cuda.get_current_stream().ptr)

    # -- streams ---------------------------------------------------------------
    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def spin(self, stream, cycles=100_000_000):
        """Keep ``stream`` busy for ``cycles`` GPU clocks (tens of milliseconds)."""
        if self._spin is None:
            self._spin = self.cp.RawKernel(r'''
extern "C" __global__ void bitsparse_test_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}''', "bitsparse_test_spin")
        with stream:
            self._spin((1,), (1,), (np.int64(cycles),))

    def slow_allocator(self, cycles=400_000_000):
        """An allocator whose memory is poisoned and then held back, in stream order,
        behind a busy kernel: every write into it lands long after the call returned."""
        def alloc(nbytes, device, stream):
            cp = self.cp
            with cp.cuda.Device(device), cp.cuda.ExternalStream(stream, device) as s:
                buf = cp.full(nbytes, 0xA5, dtype=cp.uint8)
                self.spin(s, cycles)
            return buf
        return alloc


@pytest.fixture(params=BACKENDS, scope="module")
def A(request):
    name = request.param
    if not bc.backend_available(name):
        pytest.skip(f"backend {name!r} is not available here")
    if SIM_ACTIVE:
        from bitsparse_core.backends.numba import kernels
        assert kernels.SIM, "the numba kernels did not pick their simulator path"
    if bc.get_backend(name).device_type == "cpu" or SIM_ACTIVE:
        return HostAdapter(name)
    return CudaAdapter(name)


def size(A, sim, cpu, gpu):
    """A size for this adapter: simulator cases stay small."""
    return {"sim": sim, "cpu": cpu, "gpu": gpu}[A.scale]


@pytest.fixture
def rng(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- #
# Data                                                                        #
# --------------------------------------------------------------------------- #
def _nan(x):
    return np.isnan(np.asarray(x).astype(np.float32))


def no_neg_nan(x, dt):
    """x with the sign of negative NaNs cleared (relu keeps NaN, nosign would refuse)."""
    b = np.asarray(x, order="C").view(dt.uint).copy()
    b[_nan(x)] &= np.array(dt.sign_mask - 1, dtype=dt.uint)
    return b.view(dt.numpy)


def unsigned(x, dt):
    return (np.asarray(x, order="C").view(dt.uint) & np.array(dt.sign_mask - 1, dt.uint)).view(dt.numpy)


def defined_grad(g, *others):
    """Where grad and an operand are both NaN, the reference's NaN payload depends on
    NumPy's loop (see bitfloat), so grad gets a plain value there."""
    both = _nan(g) & np.logical_or.reduce([_nan(o) for o in others])
    return np.where(both, np.ones((), g.dtype), g).astype(g.dtype)


def nnz_of(x, dt) -> int:
    return int(np.count_nonzero(np.asarray(x, order="C").view(dt.uint)))


# --------------------------------------------------------------------------- #
# Checkers                                                                    #
# --------------------------------------------------------------------------- #
def assert_planes(p, ref, where=""):
    """Metadata, plane dtypes and every plane's bytes as the reference's."""
    assert p.chunk_log2 == ref.chunk_log2, where
    assert p.numel == ref.numel and p.layout == ref.layout, where
    for name in ("mask", "offsets", "values", "signs"):
        got = p.backend.to_numpy(getattr(p, name))
        assert np.dtype(got.dtype) == np.dtype(getattr(ref, name).dtype), f"{where}: {name} dtype"
    assert_same_planes(p, ref, where)


def assert_host(A, arr, want, where=""):
    assert_same_bits(A.host(arr), want, where)


def check_unpack(A, p, x, where=""):
    """``unpack`` (a new array and, off the simulator, ``out=``: on the simulator
    test_misaligned_input_and_out has it) returns ``x`` bit for bit."""
    dt = D.resolve(x.dtype)
    y = bc.unpack(p)
    assert_host(A, y, x, f"{where} unpack")
    if A.sim:
        return
    out = A.empty(x.shape, dt)
    assert bc.unpack(p, out=out) is out
    assert_host(A, out, x, f"{where} unpack(out=)")


def check_overflow(A, p, ref, x, where=""):
    """An overflowed pack: reported by check / unpack / to_bytes; the first
    ``capacity`` stored values are there and valid."""
    dt = p.dtype
    assert p.overflowed and p.nnz == ref.nnz > p.capacity, where
    with pytest.raises(CapacityOverflowError):
        p.check()
    with pytest.raises(CapacityOverflowError):
        bc.unpack(p)
    with pytest.raises(CapacityOverflowError):
        p.to_bytes()
    bits = np.asarray(x, order="C").reshape(-1).view(dt.uint)
    kept = decode_values(p, plane_bytes(p, "values"), plane_bytes(p, "signs"), p.capacity)
    assert np.array_equal(kept, bits[bits != 0][:p.capacity]), f"{where}: kept values"


def check_pack(A, x, encoding, *, chunk_log2=9, capacity=None, via="bits", offset=0,
               where=""):
    """Pack ``x`` on ``A``: the reference's planes; then the round trip (or, on
    overflow, the overflow report). Returns the packed tensor."""
    dt = D.resolve(x.dtype)
    where = f"{A.name} {dt.name} {encoding} {x.shape} c={chunk_log2} cap={capacity} {where}"
    ref = R.pack_array(np.asarray(x, order="C"), dt, encoding, chunk_log2=chunk_log2,
                       capacity=capacity)
    p = A.pack(x, via=via, offset=offset, encoding=encoding, chunk_log2=chunk_log2,
               capacity=capacity)
    if capacity is not None and encoding != "auto" and p.backend.device_type == "cuda":
        assert p._nnz is None, f"{where}: a fixed-capacity pack must not sync"
    assert_planes(p, ref, where)
    assert p.nnz == ref.nnz == nnz_of(x, dt), where
    if ref.nnz > ref.capacity:
        check_overflow(A, p, ref, x, where)
        return p
    assert p.check() is p and not p.overflowed
    assert p.to_bytes() == ref.to_bytes(), f"{where}: serialized"
    check_unpack(A, p, x, where)
    return p


def check_relu_pack(A, a, *, square=False, encoding="nosign", chunk_log2=9, capacity=None):
    """relu_pack's dense output and planes; returns (p, reference p)."""
    dt = D.resolve(a.dtype)
    where = f"{A.name} relu_pack {dt.name} square={square} {encoding} cap={capacity}"
    with np.errstate(all="ignore"):
        y_ref, p_ref = RO.relu_pack(a, dt, square=square, encoding=encoding,
                                    chunk_log2=chunk_log2, capacity=capacity)
    y, p = A.relu_pack(a, square=square, encoding=encoding, chunk_log2=chunk_log2,
                       capacity=capacity)
    assert_host(A, y, y_ref, where)
    assert_planes(p, p_ref, where)
    if p_ref.nnz > p_ref.capacity:
        check_overflow(A, p, p_ref, RO.relu_bits(a, dt), where)
    return p, p_ref


def check_backward(A, g, p, p_ref):
    """relu_backward and relu2_backward from ``p`` as the reference's from ``p_ref``."""
    G, _ = A.put(g)
    assert_host(A, bc.relu_backward(G, p), RO.relu_backward(g, p_ref), f"{A.name} relu_backward")
    with np.errstate(all="ignore"):
        want = RO.relu2_backward(g, p_ref)
    assert_host(A, bc.relu2_backward(G, p), want, f"{A.name} relu2_backward")


def check_masked_pack(A, u, p, p_ref, encoding):
    """masked_pack's companion planes (sharing p's mask); returns (p_u, reference)."""
    dt = p.dtype
    pu_ref = RO.masked_pack(u, dt, p_ref, encoding=encoding)
    obj, kw = A.put(u, "bits")
    p_u = bc.masked_pack(obj, p, encoding=encoding, **kw)
    assert_planes(p_u, pu_ref, f"{A.name} masked_pack {dt.name} {encoding}")
    assert p_u.check() is p_u
    with pytest.raises(NotSerializableError):
        p_u.to_bytes()
    return p_u, pu_ref


def check_gated_backward(A, g, p_r, p_u, pr_ref, pu_ref):
    with np.errstate(all="ignore"):
        gg_ref, gu_ref = RO.gated_backward(g, pr_ref, pu_ref)
    G, _ = A.put(g)
    gg, gu = bc.gated_backward(G, p_r, p_u)
    assert_host(A, gg, gg_ref, f"{A.name} gated grad_g")
    assert_host(A, gu, gu_ref, f"{A.name} gated grad_u")


# --------------------------------------------------------------------------- #
# pack / unpack                                                               #
# --------------------------------------------------------------------------- #
def cases(argnames, full, sim=None):
    """Parametrize over ``full``; in the simulator's process over ``sim`` when given
    (fewer cases, rotating: every simulator kernel launch costs a fraction of a second)."""
    return pytest.mark.parametrize(argnames, sim if SIM_ACTIVE and sim is not None else full,
                                   ids=IDS)


def product(*lists):
    return list(itertools.product(*lists))


def rotate(dtypes, options):
    """One option per dtype, in turn."""
    return [(d, options[i % len(options)]) for i, d in enumerate(dtypes)]


@cases("dtype,encoding", product(ALL_DTYPES, ENCODINGS))
def test_pack_unpack_exact(A, rng, dtype, encoding):
    shapes = size(A, [(4, 275)], [(4, 275), (33, 65), (4097,)], [(3, 70001), (1 << 20,)])
    for shape in shapes:
        for sparsity in size(A, (0.5,), (0.0, 0.5, 0.97), (0.0, 0.6, 0.99, 1.0)):
            x = random_tensor(rng, shape, dtype, sparsity, signed=encoding != "nosign")
            check_pack(A, x, encoding, chunk_log2=9 if A.sim else 12)


@cases("dtype", ALL_DTYPES)
def test_auto_picks_nosign_when_legal(A, rng, dtype):
    x = random_tensor(rng, (300,), dtype, 0.3, signed=False)
    assert check_pack(A, x, "auto").encoding == bc.Encoding.NOSIGN
    if A.sim:          # auto on signed data: test_pack_unpack_exact
        return
    x.view(dtype.uint)[7] = dtype.sign_mask                     # -0.0: stored, with a sign
    assert check_pack(A, x, "auto").encoding == bc.Encoding.RAW


@cases("dtype,encoding", product(ALL_DTYPES, ENCODINGS),
       product(ALL_DTYPES, STORED) + [(D.BFLOAT16, "auto"), (D.FLOAT8_E4M3FN, "auto")])
def test_fixed_capacity(A, rng, dtype, encoding):
    """Room to spare, exact fit, overflow, capacity 0 and capacity numel: the
    reference's planes at that capacity (value slots past nnz zero), overflow
    reported; typed (DLPack) inputs."""
    n = size(A, 1030, 5000, 4 * 100003)
    x = random_tensor(rng, (n,), dtype, 0.6, signed=encoding != "nosign")
    nnz = nnz_of(x, dtype)
    caps = (nnz + 37, nnz, nnz - 29, 0, n)            # n: the worst case, no tail to cut
    if A.sim:          # one case per test, rotating over dtypes and encodings
        caps = (caps[(ALL_DTYPES.index(dtype) + ENCODINGS.index(encoding)) % 3],)
    for cap in caps:
        check_pack(A, x, encoding, capacity=cap, via="typed")


@cases("dtype,encoding", product(ALL_DTYPES, ENCODINGS), rotate(ALL_DTYPES, ENCODINGS))
def test_special_bit_patterns(A, rng, dtype, encoding):
    """-0.0, NaN payloads, ±inf, subnormals and extremes between zeros, exact and
    (off the simulator) at a capacity that cuts them off."""
    pats = special_patterns(dtype)
    if encoding == "nosign":
        pats = pats & np.array(dtype.sign_mask - 1, dtype=dtype.uint)
    n = size(A, 700, 5003, 200003)
    bits = rng.choice(pats, n).astype(dtype.uint)
    bits[rng.random(n) < 0.3] = 0
    x = bits.view(dtype.numpy)
    check_pack(A, x, encoding)
    if encoding != "auto" and not A.sim:
        check_pack(A, x, encoding, capacity=nnz_of(x, dtype) // 2, chunk_log2=10)


@cases("dtype", ALL_DTYPES, [D.FLOAT16])      # the simulator: also tests/test_numba_sim.py
def test_nosign_refuses_sign_bits(A, rng, dtype):
    """A set sign bit under nosign: refused at pack time (exact) or reported by
    check (fixed capacity); auto falls back to raw."""
    x = random_tensor(rng, (size(A, 600, 5000, 50001),), dtype, 0.5, signed=False)
    x.view(dtype.uint)[x.size - 23] = dtype.sign_mask | 3
    with pytest.raises(EncodingError):
        A.pack(x, encoding="nosign")
    with pytest.raises(EncodingError):    # at pack time or, without a sync, by check
        A.pack(x, encoding="nosign", capacity=x.size).check()
    assert check_pack(A, x, "auto", capacity=x.size - 1).encoding == bc.Encoding.RAW


@cases("shape", [(), (0,), (3, 0), (1,), (7,), (9,), (513,), (2, 3, 5, 7)],
       [(), (0,), (3, 0), (1,), (9,)])
def test_empty_and_odd_sizes(A, rng, shape):
    """0-d, empty and sizes that end inside a byte, a word and a chunk, for every op
    (the simulator: bf16 only)."""
    numel = int(np.prod(shape, dtype=np.int64))
    for dt in (D.BFLOAT16,) if A.sim else ALL_DTYPES:
        x = random_tensor(rng, shape, dt, 0.3)
        for cap in (None, numel):
            check_pack(A, x, "signplane", capacity=cap)
        if A.sim and shape not in ((), (9,)):
            continue
        a = no_neg_nan(random_tensor(rng, shape, dt, 0.3), dt)
        g = random_tensor(rng, shape, dt, 0.1)
        u = random_tensor(rng, shape, dt, 0.2)
        p, p_ref = check_relu_pack(A, a, square=True)
        check_backward(A, g, p, p_ref)
        p_u, pu_ref = check_masked_pack(A, u, p, p_ref, "signplane")
        check_gated_backward(A, defined_grad(g, a, u), p, p_u, p_ref, pu_ref)


@cases("dtype,chunk_log2", product((D.BFLOAT16, D.FLOAT32, D.FLOAT8_E5M2), (9, 12, 16)),
       [(D.FLOAT32, 12), (D.FLOAT8_E5M2, 16)])
def test_chunk_sizes(A, rng, dtype, chunk_log2):
    """Chunks smaller than a tile, the default, and larger than any tile (the
    per-tile prefix of the unpack-family ops); pack, unpack, relu2_backward and
    gated_backward over them."""
    n = size(A, 2600, 70001, 3 * (1 << 17) + 4099)
    x = random_tensor(rng, (n,), dtype, 0.4)
    xb = x.view(dtype.uint)
    xb[n // 3:n // 3 + size(A, 1100, 9000, 40000)] = 0          # empty tiles
    xb[n // 3 + 100] = 1                                          # ... but for one value
    for enc in ("signplane",) if A.sim else ("raw", "signplane"):
        check_pack(A, x, enc, chunk_log2=chunk_log2)
    a = no_neg_nan(x, dtype)
    g = random_tensor(rng, (n,), dtype, 0.05)
    u = random_tensor(rng, (n,), dtype, 0.1)
    p, p_ref = check_relu_pack(A, a, chunk_log2=chunk_log2)
    check_backward(A, g, p, p_ref)
    p_u, pu_ref = check_masked_pack(A, u, p, p_ref, "signplane")
    check_gated_backward(A, defined_grad(g, a, u), p, p_u, p_ref, pu_ref)


@cases("dtype", [D.FLOAT16, D.BFLOAT16, D.FLOAT8_E4M3FN], [D.BFLOAT16, D.FLOAT8_E4M3FN])
def test_misaligned_input_and_out(A, rng, dtype):
    """Inputs and ``out=`` one element past an aligned address (element-wise paths)."""
    n = size(A, 1500, 5001, 123457)
    x = random_tensor(rng, (n,), dtype, 0.5)
    p = check_pack(A, x, "signplane", offset=1)
    out = A.empty((n,), dtype, offset=1)
    assert bc.unpack(p, out=out) is out
    assert_host(A, out, x, "misaligned out")


@cases("dtype", [D.FLOAT16, D.FLOAT8_E5M2], [D.FLOAT16])
def test_out_mismatch_refused(A, rng, dtype):
    x = random_tensor(rng, (40,), dtype, 0.5)
    p = A.pack(x, encoding="raw")
    other = D.FLOAT32 if dtype.bits != 32 else D.FLOAT16
    for shape, dt in (((41,), dtype), ((40,), other), ((5, 8), dtype)):
        with pytest.raises(OutputMismatchError):
            bc.unpack(p, out=A.empty(shape, dt))


# --------------------------------------------------------------------------- #
# fused ops                                                                   #
# --------------------------------------------------------------------------- #
@cases("dtype,square", product(ALL_DTYPES, (False, True)))
def test_relu_pack(A, rng, dtype, square):
    """relu_pack exact (nosign, and raw / signplane off the simulator), at a fixed
    capacity with room (signplane) and, off the simulator, exact fit and overflow."""
    shape = size(A, (4, 275), (64, 1001), (3, 70001))
    a = no_neg_nan(random_tensor(rng, shape, dtype, 0.2), dtype)
    nnz = nnz_of(RO.relu_bits(a, dtype), dtype)
    todo = [("nosign", None), ("signplane", nnz + 5)]
    if not A.sim:
        todo += [("raw", None), ("signplane", None), ("nosign", nnz), ("raw", nnz - 17)]
    for enc, cap in todo:
        check_relu_pack(A, a, square=square, encoding=enc, capacity=cap)


@cases("dtype", [D.BFLOAT16, D.FLOAT8_E5M2])
def test_relu_pack_negative_nan(A, rng, dtype):
    """relu keeps NaN with its sign, so nosign must refuse a negative NaN."""
    a = random_tensor(rng, (500,), dtype, 0.2)
    a.view(dtype.uint)[123] = dtype.sign_mask | (dtype.sign_mask - 1)    # -NaN
    with pytest.raises(EncodingError):
        RO.relu_pack(a, dtype, encoding="nosign")
    with pytest.raises(EncodingError):
        A.relu_pack(a, encoding="nosign")
    with pytest.raises(EncodingError):    # at pack time or, without a sync, by check
        A.relu_pack(a, encoding="nosign", capacity=500)[1].check()
    check_relu_pack(A, a, encoding="signplane")


@cases("dtype", ALL_DTYPES)
def test_backward_ops(A, rng, dtype):
    """relu_backward and relu2_backward from an exact and (off the simulator) a
    fixed-capacity pack (count pending); relu2_backward refuses an overflowed one."""
    shape = size(A, (4, 275), (64, 1001), (3, 70001))
    a = no_neg_nan(random_tensor(rng, shape, dtype, 0.2), dtype)
    g = random_tensor(rng, shape, dtype, 0.05)
    p, p_ref = check_relu_pack(A, a)
    check_backward(A, g, p, p_ref)
    if A.sim:
        return
    nnz = p_ref.nnz
    p, p_ref = check_relu_pack(A, a, encoding="signplane", capacity=nnz + 3)
    check_backward(A, g, p, p_ref)
    _, p = A.relu_pack(a, encoding="signplane", capacity=nnz - 1)
    with pytest.raises(CapacityOverflowError):
        bc.relu2_backward(A.put(g)[0], p)


@cases("dtype,encoding", product(ALL_DTYPES, STORED),
       [(D.BFLOAT16, "signplane"), (D.FLOAT16, "raw"), (D.FLOAT32, "nosign"),
        (D.FLOAT8_E4M3FN, "signplane"), (D.FLOAT8_E5M2, "raw")])
def test_masked_pack_and_gated_backward(A, rng, dtype, encoding):
    """masked_pack's companion planes, and gated_backward from them; and from a p_u
    with a mask of its own (the dense path; on the simulator for float16 only)."""
    shape = size(A, (4, 275), (64, 1001), (3, 70001))
    gate = no_neg_nan(random_tensor(rng, shape, dtype, 0.2), dtype)
    u = random_tensor(rng, shape, dtype, 0.1, signed=encoding != "nosign")
    g = defined_grad(random_tensor(rng, shape, dtype, 0.05), gate, u)
    p_r, pr_ref = check_relu_pack(A, gate)
    p_u, pu_ref = check_masked_pack(A, u, p_r, pr_ref, encoding)
    check_gated_backward(A, g, p_r, p_u, pr_ref, pu_ref)
    if A.sim and dtype is not D.FLOAT16:
        return
    pu2 = check_pack(A, u, encoding)
    check_gated_backward(A, g, p_r, pu2, pr_ref, R.pack_array(u, dtype, encoding))


@cases("dtype", [D.BFLOAT16, D.FLOAT32])
def test_masked_pack_of_a_pending_mask(A, rng, dtype):
    """The mask tensor packed at a fixed capacity (count pending) with large chunks."""
    n = size(A, 2500, 20000, 300001)
    gate = no_neg_nan(random_tensor(rng, (n,), dtype, 0.3), dtype)
    u = random_tensor(rng, (n,), dtype, 0.1)
    g = defined_grad(random_tensor(rng, (n,), dtype, 0.0), gate, u)
    p_r, pr_ref = check_relu_pack(A, gate, chunk_log2=11, capacity=n)
    p_u, pu_ref = check_masked_pack(A, u, p_r, pr_ref, "signplane")
    check_gated_backward(A, g, p_r, p_u, pr_ref, pu_ref)
    check_backward(A, g, p_r, pr_ref)


def test_masked_pack_nosign_violation(A, rng):
    dtype = D.FLOAT16
    gate = random_tensor(rng, (700,), dtype, 0.0, signed=False)
    gate.view(dtype.uint)[gate.view(dtype.uint) == 0] = 1
    u = random_tensor(rng, (700,), dtype, 0.0, signed=False)
    u.view(dtype.uint)[650] |= np.uint16(0x8000)
    _, p_r = A.relu_pack(gate, encoding="nosign")
    obj, kw = A.put(u, "bits")
    with pytest.raises(EncodingError):     # at masked_pack time or by check
        bc.masked_pack(obj, p_r, encoding="nosign", **kw).check()


@cases("dtype,which,encoding", product(ALL_DTYPES, ("p_r", "p_u"), STORED),
       [(D.BFLOAT16, "p_u", "raw"), (D.FLOAT32, "p_u", "nosign"),
        (D.FLOAT8_E4M3FN, "p_u", "signplane"), (D.FLOAT16, "p_r", "signplane")])
def test_gated_backward_refuses_overflowed_operand(A, rng, dtype, which, encoding):
    """KNOWN DIVERGENCE (p_u): gated_backward must raise CapacityOverflowError when
    either operand overflowed its fixed capacity, never return a gradient computed
    from truncated values. p_u is u at p_r's set positions, packed on its own."""
    shape = size(A, (600,), (3000,), (3, 70001))
    gate = no_neg_nan(random_tensor(rng, shape, dtype, 0.3), dtype)
    u = random_tensor(rng, shape, dtype, 0.0, signed=encoding != "nosign")
    g = random_tensor(rng, shape, dtype, 0.0)
    r_bits = RO.relu_bits(gate, dtype)
    u_masked = np.where(r_bits.view(dtype.uint) != 0, u, np.zeros((), dtype.numpy))
    nnz_r, nnz_u = nnz_of(r_bits, dtype), nnz_of(u_masked, dtype)
    _, p_r = A.relu_pack(gate, encoding="nosign",
                         capacity=nnz_r // 2 if which == "p_r" else None)
    p_u = A.pack(u_masked, encoding=encoding,
                 capacity=nnz_u // 2 if which == "p_u" else None)
    assert (p_r if which == "p_r" else p_u).overflowed
    with pytest.raises(CapacityOverflowError):
        bc.gated_backward(A.put(g)[0], p_r, p_u)


# --------------------------------------------------------------------------- #
# GPU only: streams                                                           #
# --------------------------------------------------------------------------- #
GPU_BACKENDS = [b for b in BACKENDS if b.marks]       # the CUDA backends, on a real GPU
on_gpu = pytest.mark.parametrize("A", GPU_BACKENDS, indirect=True)


@on_gpu
@cases("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN, D.FLOAT32])
def test_explicit_streams(A, rng, dtype):
    """Every op with an explicit non-default stream; producers and consumers on
    different streams, ordered by the caller."""
    n = 1 << 20
    s1, s2 = A.stream(), A.stream()
    x = random_tensor(rng, (n,), dtype, 0.7)
    a = no_neg_nan(x, dtype)
    g = random_tensor(rng, (n,), dtype, 0.05)
    u = random_tensor(rng, (n,), dtype, 0.1)
    g = defined_grad(g, a, u)
    X, kw = A.put(x, "bits")
    Aa, _ = A.put(a, "bits")
    G, _ = A.put(g)
    U, _ = A.put(u, "bits")
    A.cp.cuda.Device().synchronize()
    for cap in (None, n // 2):
        ref = R.pack_array(x, dtype, "signplane", capacity=cap)
        p = bc.pack(X, backend=A.name, encoding="signplane", capacity=cap, stream=s1, **kw)
        assert_planes(p, ref, f"pack on s1 cap={cap}")
        assert_host(A, bc.unpack(p, stream=s1), x, "unpack on s1")
        s2.wait_event(s1.record())
        assert_host(A, bc.unpack(p, stream=s2), x, "unpack on s2")
    y_ref, p_ref = RO.relu_pack(a, dtype)
    y, p = bc.relu_pack(Aa, backend=A.name, stream=s1, **kw)
    assert_host(A, y, y_ref, "relu_pack y on s1")
    assert_planes(p, p_ref, "relu_pack on s1")
    s2.wait_event(s1.record())
    assert_host(A, bc.relu_backward(G, p, stream=s2), RO.relu_backward(g, p_ref), "relu_bwd s2")
    with np.errstate(all="ignore"):
        want2 = RO.relu2_backward(g, p_ref)
        pu_ref = RO.masked_pack(u, dtype, p_ref)
        gg_ref, gu_ref = RO.gated_backward(g, p_ref, pu_ref)
    assert_host(A, bc.relu2_backward(G, p, stream=s2), want2, "relu2_bwd s2")
    p_u = bc.masked_pack(U, p, stream=s2, **kw)
    assert_planes(p_u, pu_ref, "masked_pack s2")
    gg, gu = bc.gated_backward(G, p, p_u, stream=s2)
    assert_host(A, gg, gg_ref, "gated grad_g s2")
    assert_host(A, gu, gu_ref, "gated grad_u s2")


CONSUMERS = ["relu_backward", "relu2_backward", "masked_pack", "gated_backward",
             "unpack-masked", "unpack-exact", "unpack-fixed"]


@on_gpu
@pytest.mark.parametrize("consumer", CONSUMERS)
def test_consumer_stream_waits_for_producer(A, rng, consumer):
    """KNOWN DIVERGENCE: an op on stream s2 that reads a packed tensor made on s1
    must be ordered after the work that writes its planes (the producer's stream),
    with no sync by the caller. The producer's writes are held back on s1 (a busy
    kernel first, and an allocator that poisons its memory and then keeps s1 busy),
    so a consumer that does not wait reads poison. A first round syncs s1 before
    the consumer: it must pass everywhere, and it loads every kernel involved
    (a first launch can synchronize the device, hiding the race). Best effort the
    other way round: an implicit device sync elsewhere (a cudaMalloc) can hide a
    missing wait, but a backend that waits never fails here."""
    dtype = D.BFLOAT16
    n = 1 << 22
    s1, s2 = A.stream(), A.stream()
    slow = A.slow_allocator()
    a = no_neg_nan(random_tensor(rng, (n,), dtype, 0.6), dtype)
    g = random_tensor(rng, (n,), dtype, 0.05)
    u = random_tensor(rng, (n,), dtype, 0.1)
    g = defined_grad(g, a, u)
    Aa, kw = A.put(a, "bits")
    G, _ = A.put(g)
    U, _ = A.put(u, "bits")
    with np.errstate(all="ignore"):
        _, p_ref = RO.relu_pack(a, dtype)
        pu_ref = RO.masked_pack(u, dtype, p_ref)
        gg_ref, gu_ref = RO.gated_backward(g, p_ref, pu_ref)
    with s2:           # a free block in s2's memory pool: no cudaMalloc (which may sync
        A.cp.empty(1 << 28, dtype=A.cp.uint8)      # the device) while s1 is busy

    def relu_pack_s1(capacity=None):
        return bc.relu_pack(Aa, backend=A.name, stream=s1, allocator=slow, capacity=capacity,
                            **kw)[1]

    for synced in (True, False):
        p = p_u = None          # the last round's memory back to the pool first
        where = f"{consumer} on s2 of a tensor written on s1 ({'synced' if synced else 'no sync'})"
        _, p_r = bc.relu_pack(Aa, backend=A.name, stream=s1, **kw)   # finished before the spin
        A.cp.cuda.Device().synchronize()
        A.spin(s1)
        if consumer in ("unpack-exact", "unpack-fixed", "relu_backward", "relu2_backward",
                        "masked_pack"):
            p = relu_pack_s1(n if consumer in ("unpack-fixed", "relu_backward") else None)
        else:                                        # p_u still being written on s1
            p_u = bc.masked_pack(U, p_r, stream=s1, allocator=slow, **kw)
        if synced:
            s1.synchronize()
        if consumer in ("unpack-exact", "unpack-fixed"):
            assert_host(A, bc.unpack(p, stream=s2), RO.relu_bits(a, dtype), where)
        elif consumer == "unpack-masked":
            want = np.where(RO.mask_of(p_ref), u, np.zeros((), dtype.numpy))
            assert_host(A, bc.unpack(p_u, stream=s2), want, where)
        elif consumer == "relu_backward":
            assert_host(A, bc.relu_backward(G, p, stream=s2), RO.relu_backward(g, p_ref), where)
        elif consumer == "relu2_backward":
            with np.errstate(all="ignore"):
                want = RO.relu2_backward(g, p_ref)
            assert_host(A, bc.relu2_backward(G, p, stream=s2), want, where)
        elif consumer == "masked_pack":
            p_u = bc.masked_pack(U, p, stream=s2, **kw)
            A.cp.cuda.Device().synchronize()
            assert_planes(p_u, pu_ref, where)
        else:
            gg, gu = bc.gated_backward(G, p_r, p_u, stream=s2)
            assert_host(A, gu, gu_ref, f"{where}: grad_u")
            assert_host(A, gg, gg_ref, f"{where}: grad_g")


# --------------------------------------------------------------------------- #
# GPU only: cross-backend agreement                                           #
# --------------------------------------------------------------------------- #
_CUDA = [n for n, d in bc.registered_backends().items() if d == "cuda"]
PAIRS = [pytest.param(a, b, id=f"{a}-to-{b}", marks=pytest.mark.gpu)
         for a in _CUDA for b in _CUDA if a != b and not SIM_ACTIVE]


@cases("dtype", ALL_DTYPES)
@pytest.mark.parametrize("maker,user", PAIRS)
def test_cross_backend(rng, maker, user, dtype):
    """A tensor packed by one CUDA backend: the other packs the same planes byte for
    byte, unpacks it, and runs the fused ops on it."""
    for name in (maker, user):
        if not bc.backend_available(name):
            pytest.skip(f"backend {name!r} is not available here")
    M, U = CudaAdapter(maker), CudaAdapter(user)
    for shape, enc, cap in (((5, 77777), "raw", None), ((5, 77777), "signplane", None),
                            (((1 << 20) + 5,), "nosign", None), ((300001,), "signplane", 120000),
                            ((300001,), "auto", 200000)):
        x = random_tensor(rng, shape, dtype, 0.6, signed=enc != "nosign")
        pm = check_pack(M, x, enc, capacity=cap, chunk_log2=12)
        pu = U.pack(x, encoding=enc, capacity=cap, chunk_log2=12)
        assert_planes(pu, pm, f"{maker} vs {user} {shape} {enc} cap={cap}")
        if not pm.overflowed:
            assert_host(U, U.be.unpack(pm), x, f"{user} unpacks {maker}'s")
    shape = (2, 50021)
    a = no_neg_nan(random_tensor(rng, shape, dtype, 0.4), dtype)
    g = random_tensor(rng, shape, dtype, 0.05)
    u = random_tensor(rng, shape, dtype, 0.1)
    g = defined_grad(g, a, u)
    pm, p_ref = check_relu_pack(M, a, square=True)
    check_backward(U, g, _as(U, pm), p_ref)
    p_u, pu_ref = check_masked_pack(U, u, _as(U, pm), p_ref, "signplane")
    check_gated_backward(U, g, _as(U, pm), p_u, p_ref, pu_ref)
    check_gated_backward(M, g, pm, _as(M, p_u), p_ref, pu_ref)


def _as(A, p):
    """``p``'s planes, handed to backend ``A`` (its ops dispatch on ``p.backend``)."""
    import dataclasses
    return dataclasses.replace(p, backend=A.be, extra=dict(p.extra))
