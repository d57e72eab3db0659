"""The JAX FFI path: XLA's FFI ABI in ctypes, and the pack / unpack custom calls.

On CPU the custom calls run the NumPy reference functions behind the same handlers
(the same attributes, result shapes, batching and sharding rules as on a GPU), so
these tests check the whole plumbing in CI; the GPU tests at the end check the CUDA
handlers' planes against the reference.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.backends.cuda import abi  # noqa: E402
from bitsparse_core.jax import codec, custom_calls, ffn, xla_ffi  # noqa: E402
from bitsparse_core.spec import ops as reference_ops  # noqa: E402
from bitsparse_core.spec.codec import pack_array  # noqa: E402
from bitsparse_core.spec.format import Encoding  # noqa: E402
from bitsparse_core.spec.planes import encode_values  # noqa: E402
from helpers import ALL_DTYPES, jax_gpu, random_tensor, same_bits  # noqa: E402

PLANES = ("mask", "offsets", "values", "signs")


# --------------------------------------------------------------------------- #
# The ABI                                                                     #
# --------------------------------------------------------------------------- #
def test_api_version_is_the_installed_jaxlibs():
    import os
    import re
    major, minor = xla_ffi.api_version()
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    assert f"#define XLA_FFI_API_MAJOR {major}" in text
    assert re.search(rf"#define XLA_FFI_API_MINOR\s+{minor}\b", text)


_SEEN = {}


def _probe(frame: xla_ffi.CallFrame) -> None:
    """Writes operand + k to its result; records what it was handed; fails on demand."""
    (a,), (out,) = frame.args, frame.rets
    _SEEN.update(attrs=dict(frame.attrs), a=a, out=out, device=frame.device_ordinal)
    try:
        _SEEN["stream"] = frame.stream
    except xla_ffi.HandlerError as exc:     # a CPU call has no stream to give
        _SEEN["stream"] = str(exc)
    if frame.attrs["mode"] == "raise":
        raise ValueError("probe asked to fail")
    if frame.attrs["mode"] == "invalid":
        raise xla_ffi.HandlerError("probe says the argument is bad", invalid=True)
    n = int(np.prod(a.shape))
    src = np.frombuffer((ctypes.c_float * n).from_address(a.data), np.float32)
    dst = np.frombuffer((ctypes.c_float * n).from_address(out.data), np.float32)
    dst[...] = src + frame.attrs["k"]


def _probe_call(x, k, mode="ok"):
    xla_ffi.register("bitsparse_test_probe", _probe, "cpu")
    call = jax.ffi.ffi_call("bitsparse_test_probe", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            vmap_method="broadcast_all")
    return call(x, k=np.float32(k), n=np.int64(-5), flag=True, mode=mode,
                dims=np.array([3, 1, 4], np.int64))


def test_handler_sees_operands_results_and_attributes():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    got = jax.jit(lambda x: _probe_call(x, 2.5))(x)
    assert np.array_equal(np.asarray(got), np.asarray(x) + 2.5)
    assert _SEEN["attrs"] == {"k": 2.5, "n": -5, "flag": True, "mode": "ok", "dims": (3, 1, 4)}
    assert _SEEN["a"].shape == _SEEN["out"].shape == (3, 4)
    # the API table's last entry (DeviceOrdinal_Get) answers: its layout is read right
    assert _SEEN["device"] == 0 and "XLA_FFI_Stream_Get failed" in _SEEN["stream"]
    assert _SEEN["a"].dtype == xla_ffi.DTYPE_CODES["float32"] and _SEEN["a"].row_bytes == 16
    # vmap with broadcast_all hands the handler the batch as a leading dimension
    batched = jax.vmap(lambda r: _probe_call(r, 1.0))(x)
    assert _SEEN["a"].shape == (3, 4) and np.array_equal(np.asarray(batched), np.asarray(x) + 1)
    # registering again under the same name is a no-op, not XLA's duplicate error
    xla_ffi.register("bitsparse_test_probe", _probe, "cpu")
    assert xla_ffi.registered("bitsparse_test_probe", "CPU")


@pytest.mark.parametrize("mode,fragment", [("raise", "ValueError: probe asked to fail"),
                                           ("invalid", "INVALID_ARGUMENT")])
def test_handler_exceptions_become_xla_errors(mode, fragment):
    x = jnp.ones((2, 2), jnp.float32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(lambda x: _probe_call(x, 0.0, mode))(x))
    assert fragment in str(info.value)
    # the process is fine afterwards
    again = jax.jit(lambda x: _probe_call(x, 1.0))(x)
    assert np.array_equal(np.asarray(again), np.full((2, 2), 2.0))


# --------------------------------------------------------------------------- #
# The custom calls against the reference                                      #
# --------------------------------------------------------------------------- #
def _relu_input(rng, shape, dtype):
    """Random bit patterns with specials (NaN payloads, ±0, ±inf, subnormals); -NaN kept
    in a few so that nosign's status bit is exercised."""
    return random_tensor(rng, shape, dtype, 0.3)


def _reference(a, u, dtype, enc, uenc, cap, chunk_log2):
    r = reference_ops.relu_bits(a, dtype)
    ref_r = pack_array(r, dtype, "raw", chunk_log2=chunk_log2, capacity=cap)  # mask, offsets
    bits = r.reshape(-1).view(dtype.uint)
    stored = bits[bits != 0]
    values, signs = encode_values(stored, dtype, enc, cap)
    nosign_bad = enc == Encoding.NOSIGN and bool(np.any(stored >> (dtype.bits - 1)))
    out = {"mask": ref_r.mask, "offsets": ref_r.offsets, "values": values, "signs": signs,
           "status": int(nosign_bad)}
    if u is not None:
        ustored = u.reshape(-1).view(dtype.uint)[bits != 0]
        out["u_values"], out["u_signs"] = encode_values(ustored, dtype, uenc, cap)
        out["u_status"] = int(uenc == Encoding.NOSIGN and bool(np.any(ustored >> (dtype.bits - 1))))
    return out, int(stored.size)


def _check_planes(got, ref, nnz, cap, u_prefix=None):
    """``u_prefix``: ``(value bytes, sign bytes)`` of u's stored values, where only those
    are compared (the CUDA masked pack leaves u's slots past the count unwritten: no
    reader goes there); u's planes are skipped where nosign could not store its signs."""
    names = ["mask", "offsets", "values", "signs", "status"]
    if "u_values" in ref:
        names += ["u_values", "u_signs", "u_status"]
    for name, g in zip(names, got):
        g = np.asarray(g)
        want = np.asarray(ref[name])
        if name.endswith("status"):
            assert int(g) == want, name
            continue
        if u_prefix is not None and name in ("u_values", "u_signs"):
            if not ref["u_status"]:
                n = u_prefix[name == "u_signs"]
                assert np.array_equal(g[:n], want[:n]), name
            continue
        assert g.size >= want.size and g.size % 4 == 0 or name == "offsets", (name, g.size)
        assert np.array_equal(g[:want.size], want), name
        assert not np.any(g[want.size:]), f"{name}: word padding must be zero"
    assert int(np.asarray(got[1])[-1]) == nnz


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("enc,uenc", [(Encoding.NOSIGN, Encoding.SIGNPLANE),
                                      (Encoding.RAW, Encoding.RAW),
                                      (Encoding.SIGNPLANE, Encoding.NOSIGN)],
                         ids=["nosign+signplane", "raw+raw", "signplane+nosign"])
def test_relu_pack_planes_equal_reference(dtype, enc, uenc):
    rng = np.random.default_rng(dtype.bits * 7 + int(enc))
    for shape in [(0,), (1,), (7, 33), (3, 1373)]:
        a = _relu_input(rng, shape, dtype)
        u = random_tensor(rng, shape, dtype, 0.0)
        numel = a.size
        nnz = int(np.count_nonzero(reference_ops.relu_bits(a, dtype).view(dtype.uint)))
        for cap in sorted({0, max(nnz - 5, 0), nnz, min(nnz + 11, numel), numel}):
            ref, n = _reference(a, u, dtype, enc, uenc, cap, 9)
            f = jax.jit(lambda a, u: custom_calls.relu_pack(a, capacity=cap, encoding=enc,
                                                            chunk_log2=9, u=u, u_encoding=uenc))
            _check_planes(f(jnp.asarray(a), jnp.asarray(u)), ref, n, cap)
            # without u: the first five results only
            got = custom_calls.relu_pack(jnp.asarray(a), capacity=cap, encoding=enc, chunk_log2=9)
            assert len(got) == 5
            _check_planes(got, {k: v for k, v in ref.items() if not k.startswith("u_")}, n, cap)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_planes_equal_the_jnp_codecs_and_unpack(dtype):
    """The FFI planes are the jax.numpy codec's (trimmed), and the unpack custom call
    decodes both; overflow reads as the codec's decode_dense does (values past the
    capacity are zero)."""
    rng = np.random.default_rng(dtype.bits)
    a = jnp.asarray(_relu_input(rng, (5, 777), dtype))
    u = jnp.asarray(random_tensor(rng, (5, 777), dtype, 0.0))
    for cap in (300, 5 * 777):
        cfg = ffn.PackConfig(density=cap / (5 * 777), chunk_log2=9, impl="ffi",
                             encoding="raw" if dtype.bits == 8 else "nosign")
        p_r, p_u = ffn._pack(a, cfg, u=u)
        q_r, q_u = codec.relu_pack_planes(a, capacity=p_r.capacity, encoding=cfg.encoding,
                                          chunk_log2=9, u=u, u_encoding=cfg.u_encoding)
        for got, want in ((p_r, q_r), (p_u, q_u)):
            gt, wt = got.to_packed_tensor(), want.to_packed_tensor()
            for name in PLANES:
                assert np.array_equal(getattr(gt, name), getattr(wt, name)), name
            assert int(got.status) == int(want.status)
            assert bool(got.overflowed) == bool(want.overflowed) == (cap == 300)
            dense = jax.jit(lambda p: ffn._decode(p, cfg))(got)
            assert same_bits(dense, codec.decode_dense(want), dtype)


def test_chunk_sizes_beyond_the_unpack_tile_decode_in_jnp():
    """chunk_log2=16 (longer than the unpack kernel's tile) packs through the custom call
    and decodes with the jax.numpy codec; gradients stay bit-identical to dense."""
    assert not custom_calls.chunk_supported((40, 192), D.BFLOAT16, 16)
    assert custom_calls.chunk_supported((40, 192), D.BFLOAT16, 12)
    layers = ffn.init_stack(jax.random.PRNGKey(0), 2, 64, 192, kind="relu2")
    x = jax.random.normal(jax.random.PRNGKey(1), (40, 64), jnp.float32).astype(jnp.bfloat16)

    def loss(layers, mode, cfg):
        out = ffn.apply_stack(layers, x, kind="relu2", mode=mode, cfg=cfg)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))
    cfg = ffn.PackConfig(density=0.5, chunk_log2=16, impl="ffi")
    g = jax.jit(jax.grad(loss), static_argnums=(1, 2))
    ref, got = g(layers, "dense", cfg), g(layers, "packed", cfg)
    assert all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
               for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)))


def test_vmapped_custom_calls_pack_each_block():
    rng = np.random.default_rng(5)
    a = random_tensor(rng, (4, 3, 200), D.BFLOAT16, 0.5)
    batched = jax.jit(jax.vmap(lambda t: custom_calls.relu_pack(
        t, capacity=250, encoding=Encoding.RAW, chunk_log2=9)))(jnp.asarray(a))
    assert batched[0].shape[0] == 4
    for i in range(4):
        ref, n = _reference(a[i], None, D.BFLOAT16, Encoding.RAW, None, 250, 9)
        _check_planes([t[i] for t in batched], ref, n, 250)
    dense = jax.vmap(lambda m, o, v, s: custom_calls.unpack(
        m, o, v, s, shape=(3, 200), dtype=D.BFLOAT16, encoding=Encoding.RAW, capacity=250,
        chunk_log2=9))(*batched[:4])
    for i in range(4):
        r = reference_ops.relu_bits(a[i], D.BFLOAT16)
        if np.count_nonzero(r.view(np.uint16)) <= 250:
            assert same_bits(dense[i], r, D.BFLOAT16)


def _check_relu_backward(dtype, shapes, dev=None):
    """The relu_backward custom call is grad where the pack's mask bit is set, else
    +0, bit for bit (NaN payloads of grad kept), for one block and for vmapped blocks
    (an overflowed pack's mask included: it is always complete)."""
    rng = np.random.default_rng(dtype.bits + 7)
    put = (lambda t: jax.device_put(jnp.asarray(t), dev)) if dev else jnp.asarray
    for shape in shapes:
        a = _relu_input(rng, (3, *shape), dtype)
        g = random_tensor(rng, (3, *shape), dtype, 0.0)
        n = int(np.prod(shape))
        for cap in (n, n // 10):
            planes = jax.jit(jax.vmap(lambda t: custom_calls.relu_pack(
                t, capacity=cap, encoding=Encoding.RAW, chunk_log2=9)))(put(a))
            got = jax.jit(jax.vmap(lambda gb, m: custom_calls.relu_backward(
                gb, m, encoding=Encoding.RAW, capacity=cap, chunk_log2=9)))(put(g), planes[0])
            keep = reference_ops.relu_bits(a, dtype).view(dtype.uint) != 0
            want = np.where(keep, g.view(dtype.uint), np.zeros((), dtype.uint))
            assert np.asarray(got).view(dtype.uint).tobytes() == want.tobytes(), (shape, cap)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_relu_backward_custom_call_selects_by_the_mask(dtype):
    _check_relu_backward(dtype, [(0,), (7, 33), (5, 777)])


def test_impl_is_checked():
    with pytest.raises(ValueError, match="impl"):
        ffn.PackConfig(impl="cuda")
    assert ffn.PackConfig(impl="ffi") != ffn.PackConfig()       # a different static key


def test_mismatched_companion_is_refused():
    a = jnp.ones((4, 8), jnp.bfloat16)
    from bitsparse_core.errors import InputError
    with pytest.raises(InputError, match="u is"):
        custom_calls.relu_pack(a, capacity=8, encoding=Encoding.NOSIGN, chunk_log2=9,
                               u=jnp.ones((4, 8), jnp.float32), u_encoding=Encoding.RAW)


# --------------------------------------------------------------------------- #
# GPU: the CUDA handlers                                                      #
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_gpu_relu_pack_planes_equal_reference(dtype):
    dev = jax_gpu()
    pytest.importorskip("cupy")
    rng = np.random.default_rng(dtype.bits + 1)
    for enc, uenc in ((Encoding.NOSIGN, Encoding.SIGNPLANE), (Encoding.RAW, Encoding.RAW),
                      (Encoding.SIGNPLANE, Encoding.NOSIGN)):
        for shape in [(0,), (7, 33), (64, 3001)]:
            a = _relu_input(rng, shape, dtype)
            u = random_tensor(rng, shape, dtype, 0.0)
            nnz = int(np.count_nonzero(reference_ops.relu_bits(a, dtype).view(dtype.uint)))
            for cap in sorted({max(nnz - 100, 0), nnz, min(nnz + 1000, a.size)}):
                ref, n = _reference(a, u, dtype, enc, uenc, cap, 12)
                f = jax.jit(lambda a, u: custom_calls.relu_pack(
                    a, capacity=cap, encoding=enc, chunk_log2=12, u=u, u_encoding=uenc))
                got = f(jax.device_put(jnp.asarray(a), dev), jax.device_put(jnp.asarray(u), dev))
                assert got[0].devices() == {dev}
                stored = min(n, cap)
                _check_planes(got, ref, n, cap, u_prefix=(
                    -(-stored * abi.stream_width(dtype, uenc) // 8),
                    -(-stored // 8) if uenc == Encoding.SIGNPLANE else 0))
                if n <= cap and not ref["status"]:   # (nosign cannot store a -NaN's sign)
                    dense = custom_calls.unpack(*got[:4], shape=shape, dtype=dtype, encoding=enc,
                                                capacity=cap, chunk_log2=12)
                    assert same_bits(dense, reference_ops.relu_bits(a, dtype), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_gpu_relu_backward_custom_call_selects_by_the_mask(dtype):
    dev = jax_gpu()
    pytest.importorskip("cupy")
    _check_relu_backward(dtype, [(0,), (7, 33), (64, 3001)], dev)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
def test_gpu_ffi_blocks_bit_identical(kind):
    """shards=4 on one GPU: the batched custom calls pack and decode each block."""
    dev = jax_gpu()
    pytest.importorskip("cupy")
    layers = ffn.init_stack(jax.random.PRNGKey(0), 2, 256, 1024, kind=kind)
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 256), jnp.float32).astype(jnp.bfloat16)
    layers, x = jax.device_put((layers, x), dev)

    def loss(layers, x, mode, cfg):
        out = ffn.apply_stack(layers, x, kind=kind, mode=mode, cfg=cfg)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
    for density in (0.3, 0.05):
        cfg = ffn.PackConfig(density=density, shards=4, impl="ffi")
        ref, got = grad(layers, x, "dense", cfg), grad(layers, x, "packed", cfg)
        for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
            a, b = np.asarray(a), np.asarray(b)
            u = np.dtype(f"u{a.dtype.itemsize}")
            assert np.array_equal(a.view(u), b.view(u))


# --------------------------------------------------------------------------- #
# The CUDA engine's launches, on CPU with the driver faked                    #
# --------------------------------------------------------------------------- #
class _FakeFrame:
    def __init__(self, args, rets, attrs):
        self.args, self.rets, self.attrs = args, rets, attrs
        self.device_ordinal, self.stream = 0, 0x5EED


@pytest.fixture
def fake_driver(monkeypatch):
    """Records every launch (the argument record's fields at launch time) and fill."""
    from bitsparse_core.backends.cuda import host
    calls = []

    def record(kind):
        def fn(func, grid, block, smem, stream, args):
            calls.append((kind, func, stream, {n: getattr(args, n) for n, _ in args._fields_}))
        return fn
    monkeypatch.setattr(host, "kernel", lambda device, *key: hash(key) & 0xFFFF)
    monkeypatch.setattr(host.driver, "resident_blocks", lambda *a: 264)
    monkeypatch.setattr(host.driver, "launch_cooperative", record("coop"))
    monkeypatch.setattr(host.driver, "launch", record("launch"))
    monkeypatch.setattr(host.driver, "memset0",
                        lambda ptr, n, stream: calls.append(("memset", ptr, n, stream)))
    monkeypatch.setattr(custom_calls, "_OnDevice", lambda device: _NoContext())
    host._RECORDS.__dict__.clear()          # launches built with the fakes only
    yield calls
    host._RECORDS.__dict__.clear()


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _buffers(shapes_and_codes, base):
    out, addr = [], base
    for shape, code in shapes_and_codes:
        out.append(xla_ffi.Buffer(code, addr, shape))
        addr += 1 << 24
    return out


def test_cuda_engine_packs_each_block_into_its_planes(fake_driver):
    """Two blocks, gated: per block a fused pack (mode RELU, no dense output) into that
    block's rows of every plane, then a masked pack reading the mask just written and
    writing no offsets; scratch zeroed before each, all on XLA's stream."""
    from bitsparse_core.backends.cuda import host
    shape, cap = (3, 700), 500
    dtype, enc, uenc = D.BFLOAT16, Encoding.NOSIGN, Encoding.SIGNPLANE
    spec = custom_calls.plane_spec(shape, dtype, enc, cap, 9, uenc)
    u8, u32, bf16 = (xla_ffi.DTYPE_CODES[n] for n in ("uint8", "uint32", "bfloat16"))
    args = _buffers([((2, *shape), bf16), ((2, *shape), bf16)], 0x10_0000_0000)
    rets = _buffers([((2, spec.mask), u8), ((2, spec.offsets), u32), ((2, spec.values), u8),
                     ((2, spec.signs), u8), ((2, 16), u32), ((2, spec.u_values), u8),
                     ((2, spec.u_signs), u8), ((2, 16), u32), ((2, spec.scratch), u8)],
                    0x20_0000_0000)
    attrs = {"capacity": cap, "chunk_log2": 9, "encoding": int(enc), "u_encoding": int(uenc),
             "block_ndim": 2}
    custom_calls._pack_handler(custom_calls._CudaEngine())(_FakeFrame(args, rets, attrs))
    launches = [c for c in fake_driver if c[0] == "coop"]
    fills = [c for c in fake_driver if c[0] == "memset"]
    mask_len = custom_calls._fmt.cached_layout(shape, dtype, enc, cap, 9).mask[1]
    assert mask_len % 4     # the mask plane's last word has padding bytes
    pads = fills[1::3]      # per block: scratch, the mask's padding, the masked pack's scratch
    fills = [f for k, f in enumerate(fills) if k % 3 != 1]
    assert len(launches) == 4 and len(fills) == 4 and len(pads) == 2
    assert all(c[2] == 0x5EED for c in launches) and all(c[3] == 0x5EED for c in fills)
    plan = host.pack_plan(shape, dtype, enc, cap, 9, abi.Mode.RELU)
    uplan = host.pack_plan(shape, dtype, uenc, cap, 9, abi.Mode.MASKED)
    elem = 2 * 3 * 700
    for i in range(2):
        r, m = launches[2 * i][3], launches[2 * i + 1][3]
        row = lambda k: rets[k].data + i * rets[k].row_bytes      # noqa: E731
        assert r["x"] == args[0].data + i * elem and m["x"] == args[1].data + i * elem
        assert (r["mask"], r["offsets"], r["values"], r["signs"], r["status"], r["scratch"]) == \
            (row(0), row(1), row(2), row(3), row(4), row(8))
        assert r["y"] == 0 and r["cap"] == cap and r["numel"] == 2100
        assert (m["mask"], m["offsets"], m["values"], m["signs"], m["status"], m["scratch"]) == \
            (row(0), 0, row(5), row(6), row(7), row(8))
        assert fills[2 * i][1:3] == (row(8), plan.scratch_bytes)
        assert pads[i][1:3] == (row(0) + mask_len, -mask_len % 4)
        assert fills[2 * i + 1][1:3] == (row(8), uplan.scratch_bytes)
        # the kernel's word stores stay inside each word-rounded plane
        assert 4 * r["zero_values_words"] <= spec.values and 4 * r["zero_signs_words"] <= spec.signs
        assert spec.scratch >= max(plan.scratch_bytes, uplan.scratch_bytes)


def test_cuda_engine_empty_block_zeroes_offsets_and_status(fake_driver):
    u8, u32, bf16 = (xla_ffi.DTYPE_CODES[n] for n in ("uint8", "uint32", "bfloat16"))
    spec = custom_calls.plane_spec((0,), D.BFLOAT16, Encoding.NOSIGN, 0, 9, None)
    args = _buffers([((0,), bf16)], 0x10_0000_0000)
    rets = _buffers([((spec.mask,), u8), ((spec.offsets,), u32), ((spec.values,), u8),
                     ((spec.signs,), u8), ((16,), u32), ((spec.scratch,), u8)], 0x20_0000_0000)
    attrs = {"capacity": 0, "chunk_log2": 9, "encoding": int(Encoding.NOSIGN), "u_encoding": -1,
             "block_ndim": 1}
    custom_calls._pack_handler(custom_calls._CudaEngine())(_FakeFrame(args, rets, attrs))
    assert not [c for c in fake_driver if c[0] == "coop"]
    assert {c[1:3] for c in fake_driver} == {(rets[1].data, 4), (rets[4].data, abi.STATUS_BYTES)}


def test_cuda_engine_unpacks_each_block(fake_driver):
    shape, cap = (4, 512), 900
    lay = custom_calls._fmt.cached_layout(shape, D.BFLOAT16, Encoding.SIGNPLANE, cap, 9)
    spec = custom_calls.plane_spec(shape, D.BFLOAT16, Encoding.SIGNPLANE, cap, 9, None)
    u8, u32, bf16 = (xla_ffi.DTYPE_CODES[n] for n in ("uint8", "uint32", "bfloat16"))
    args = _buffers([((3, spec.mask), u8), ((3, spec.offsets), u32), ((3, spec.values), u8),
                     ((3, spec.signs), u8)], 0x10_0000_0000)
    rets = _buffers([((3, *shape), bf16)], 0x20_0000_0000)
    attrs = {"capacity": cap, "chunk_log2": 9, "encoding": int(Encoding.SIGNPLANE)}
    custom_calls._unpack_handler(custom_calls._CudaEngine())(_FakeFrame(args, rets, attrs))
    launches = [c for c in fake_driver if c[0] == "launch"]
    assert len(launches) == 3
    for i, (_, _, stream, r) in enumerate(launches):
        assert stream == 0x5EED
        assert (r["mask"], r["offsets"], r["values"], r["signs"]) == tuple(
            a.data + i * a.row_bytes for a in args)
        assert (r["mask_len"], r["values_len"], r["signs_len"]) == (lay.mask[1], lay.values[1],
                                                                      lay.signs[1])
        assert r["out"] == rets[0].data + i * 4 * 512 * 2 and r["prefix"] == 0


def test_cuda_engine_relu_backward_selects_each_block(fake_driver, monkeypatch):
    """One mask-select launch per block on XLA's stream: that block's grad, mask row and
    output, the mask's length from the layout."""
    from bitsparse_core.backends.cuda import host
    monkeypatch.setattr(host.driver, "sm_count", lambda device: 132)
    shape, cap = (4, 513), 900
    lay = custom_calls._fmt.cached_layout(shape, D.BFLOAT16, Encoding.NOSIGN, cap, 9)
    spec = custom_calls.plane_spec(shape, D.BFLOAT16, Encoding.NOSIGN, cap, 9, None)
    u8, bf16 = (xla_ffi.DTYPE_CODES[n] for n in ("uint8", "bfloat16"))
    args = _buffers([((3, *shape), bf16), ((3, spec.mask), u8)], 0x10_0000_0000)
    rets = _buffers([((3, *shape), bf16)], 0x20_0000_0000)
    attrs = {"capacity": cap, "chunk_log2": 9, "encoding": int(Encoding.NOSIGN)}
    custom_calls._relu_backward_handler(custom_calls._CudaEngine())(
        _FakeFrame(args, rets, attrs))
    launches = [c for c in fake_driver if c[0] == "launch"]
    assert len(launches) == 3
    elem = 4 * 513 * 2
    for i, (_, _, stream, r) in enumerate(launches):
        assert stream == 0x5EED
        assert (r["g"], r["mask"], r["out"]) == (args[0].data + i * elem,
                                                 args[1].data + i * args[1].row_bytes,
                                                 rets[0].data + i * elem)
        assert (r["mask_len"], r["numel"]) == (lay.mask[1], 4 * 513)
