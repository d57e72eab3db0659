"""The NumPy reference codec: round trips, encodings, capacity, sizes, exhaustive patterns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import bitsparse_core as bc
import bitsparse_core.spec.planes
from bitsparse_core import dtypes as D
from bitsparse_core.spec import format as F
from helpers import ALL_DTYPES, ENCODINGS, random_tensor, same_bits, special_patterns

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (8,), (9,), (511,), (512,), (513,), (33, 65),
          (2, 3, 5, 7), (4097,), (3, 4096)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_round_trip_and_size(dtype, encoding, shape, sparsity):
    rng = np.random.default_rng(abs(hash((dtype.name, encoding, shape, sparsity))) % 2**32)
    x = random_tensor(rng, shape, dtype, sparsity, signed=(encoding != "nosign"))
    p = bc.pack(x, encoding=encoding, chunk_log2=9)
    assert p.encoding.name.lower() == encoding
    assert p.nnz == int(np.count_nonzero(x.view(dtype.uint)))
    y = bc.unpack(p)
    assert same_bits(y, x, dtype)
    buf = p.to_bytes()
    assert len(buf) == bc.packed_size(shape, dtype, encoding, p.nnz, chunk_log2=9) == p.nbytes
    assert same_bits(bc.unpack(bc.from_bytes(buf)), x, dtype)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(ALL_DTYPES), encoding=st.sampled_from(ENCODINGS + ("auto",)),
       shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
       sparsity=st.floats(0, 1), seed=st.integers(0, 2**32 - 1),
       chunk_log2=st.integers(F.MIN_CHUNK_LOG2, 13))
def test_round_trip_property(dtype, encoding, shape, sparsity, seed, chunk_log2):
    rng = np.random.default_rng(seed)
    x = random_tensor(rng, tuple(shape), dtype, sparsity, signed=(encoding != "nosign"))
    p = bc.pack(x, encoding=encoding, chunk_log2=chunk_log2)
    buf = p.to_bytes()
    bc.validate(buf)
    assert len(buf) == F.packed_size(tuple(shape), dtype, p.encoding, p.nnz, chunk_log2)
    assert same_bits(bc.unpack(bc.from_bytes(buf)), x, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_bit_pattern_round_trips(dtype, encoding):
    """All 65,536 (16-bit) or 256 (8-bit) patterns; for fp32 a strided sweep plus specials."""
    if dtype.bits == 32:
        pats = np.concatenate([np.arange(0, 2**32, 65521, dtype=np.uint64).astype(np.uint32),
                               special_patterns(dtype)])
    else:
        pats = np.arange(1 << dtype.bits, dtype=np.uint64).astype(dtype.uint)
    if encoding == "nosign":
        pats = pats[(pats >> (dtype.bits - 1)) == 0]
    x = pats.view(dtype.numpy)
    p = bc.pack(x, encoding=encoding)
    assert same_bits(bc.unpack(bc.from_bytes(p.to_bytes())), x, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_nosign_refuses_sign_bits_and_auto_falls_back(dtype):
    x = np.zeros(100, dtype=dtype.uint)
    x[7] = dtype.sign_mask  # -0.0 is nonzero and negative
    x = x.view(dtype.numpy)
    with pytest.raises(bc.EncodingError):
        bc.pack(x, encoding="nosign")
    assert bc.pack(x, encoding="auto").encoding == bc.Encoding.RAW
    x2 = np.abs(random_tensor(np.random.default_rng(1), (100,), dtype, 0.5, signed=False))
    assert bc.pack(x2, encoding="auto").encoding == bc.Encoding.NOSIGN


def test_negative_zero_nan_payload_inf_subnormal_survive():
    bits = np.array([0x8000, 0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x8001, 0, 0x3F80],
                    dtype=np.uint16)
    x = bits.view(D.BFLOAT16.numpy)
    for enc in ("raw", "signplane"):
        p = bc.pack(x, encoding=enc)
        assert p.nnz == 8
        assert np.array_equal(np.asarray(bc.unpack(p)).view(np.uint16), bits)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fixed_capacity_keeps_first_values_and_reports_overflow(encoding):
    rng = np.random.default_rng(5)
    x = random_tensor(rng, (3000,), D.BFLOAT16, 0.5, signed=(encoding != "nosign"))
    exact = bc.pack(x, encoding=encoding, chunk_log2=9)
    roomy = bc.pack(x, encoding=encoding, chunk_log2=9, capacity=exact.nnz + 100)
    assert roomy.capacity == exact.nnz + 100 and not roomy.overflowed
    assert same_bits(bc.unpack(roomy), x, D.BFLOAT16)
    assert roomy.to_bytes() == exact.to_bytes()  # serializing trims capacity to nnz
    cap = exact.nnz // 2
    tight = bc.pack(x, encoding=encoding, chunk_log2=9, capacity=cap)
    assert tight.nnz == exact.nnz and tight.overflowed
    assert len(tight.values) == F.values_nbytes(D.BFLOAT16, tight.encoding, cap)
    full = bc.pack(x, encoding="raw").values.view("<u2")
    # The values that fit stay valid: the first `cap` stored patterns, in order.
    assert np.array_equal(bc.spec.planes.decode_values(tight, tight.values, tight.signs, cap),
                          full[:cap])
    with pytest.raises(bc.CapacityOverflowError):
        tight.check()
    with pytest.raises(bc.CapacityOverflowError):
        bc.unpack(tight)
    with pytest.raises(bc.CapacityOverflowError):
        tight.to_bytes()


def test_capacity_out_of_range():
    with pytest.raises(bc.CapacityError):
        bc.pack(np.ones(10, np.float32), capacity=11)
    with pytest.raises(bc.CapacityError):
        bc.pack(np.ones(10, np.float32), capacity=-1)


@pytest.mark.parametrize("capacity", [1.9, 0.5, 3.0, "100", "3", True, False, np.True_, [3],
                                      np.float32(2)], ids=repr)
@pytest.mark.parametrize("fn", ["pack", "relu_pack"])
def test_capacity_must_be_an_int(capacity, fn):
    """Before: 1.9 became 1, "100" became 100 and True became 1, silently."""
    x = np.ones(10, np.float32)
    with pytest.raises(bc.CapacityError, match="must be an int"):
        getattr(bc, fn)(x, capacity=capacity)


@pytest.mark.parametrize("capacity", [7, np.int64(7), np.uint8(7)], ids=repr)
def test_integer_capacities_are_accepted(capacity):
    p = bc.pack(np.ones(10, np.float32), capacity=capacity)
    assert p.capacity == 7 and type(p.capacity) is int and p.overflowed


@pytest.mark.parametrize("chunk_log2", [9.0, 9.5, "9", True])
def test_chunk_log2_must_be_an_int(chunk_log2):
    with pytest.raises(bc.ChunkSizeError):
        bc.pack(np.ones(10, np.float32), chunk_log2=chunk_log2)


@pytest.mark.parametrize("ndim", [32, 33, 64])
def test_high_ndim_round_trips(ndim):
    """A spec-valid ndim-33..64 buffer decodes (NumPy >= 2.0 holds 64 dimensions)."""
    shape = (2, 3) + (1,) * (ndim - 2)
    x = random_tensor(np.random.default_rng(ndim), shape, D.BFLOAT16, 0.3)
    buf = bc.pack(x, encoding="raw", chunk_log2=9).to_bytes()
    assert bc.validate(buf).shape == shape
    assert same_bits(bc.unpack(bc.from_bytes(buf)), x, D.BFLOAT16)


def test_nan_products_follow_one_rule():
    """The reference's float32 products keep the first NaN operand (quieted) and give
    0xFFC00000 for 0 * inf, whatever the installed NumPy's multiply does (2.2 keeps the
    second NaN of two, 2.4 the first)."""
    from bitsparse_core.spec.ops import mul_f32
    bits = np.array([0x7F800001, 0xFFC01234, 0x7FC00000, 0x3F800000, 0, 0x7F800000, 0x80000000],
                    dtype=np.uint32)
    a, b = np.repeat(bits, bits.size), np.tile(bits, bits.size)
    got = mul_f32(a.view(np.float32), b.view(np.float32)).view(np.uint32)
    for x, y, z in zip(a, b, got):
        nan = lambda v: (int(v) & 0x7FFFFFFF) > 0x7F800000  # noqa: E731
        if nan(x):
            assert z == x | 0x00400000
        elif nan(y):
            assert z == y | 0x00400000
        elif {int(x) & 0x7FFFFFFF, int(y) & 0x7FFFFFFF} == {0, 0x7F800000}:
            assert z == 0xFFC00000
        else:
            assert z == (np.float32(x.view(np.float32)) * np.float32(y.view(np.float32))).view(np.uint32)
    assert mul_f32(np.float32(2), np.float32(3)).shape == ()


def test_unpack_into_out_and_out_mismatch():
    rng = np.random.default_rng(2)
    x = random_tensor(rng, (17, 9), D.FLOAT16, 0.7)
    p = bc.pack(x, encoding="raw")
    out = np.full((17, 9), 7, dtype=np.float16)
    assert bc.unpack(p, out=out) is out
    assert same_bits(out, x, D.FLOAT16)
    with pytest.raises(bc.OutputMismatchError):
        bc.unpack(p, out=np.empty((9, 17), np.float16))
    with pytest.raises(bc.OutputMismatchError):
        bc.unpack(p, out=np.empty((17, 9), np.float32))


def test_input_validation_errors():
    with pytest.raises(bc.UnsupportedDTypeError):
        bc.pack(np.ones(4, np.float64))
    with pytest.raises(bc.UnsupportedDTypeError):
        bc.pack(np.ones(4, np.int32))
    with pytest.raises(bc.NonContiguousError):
        bc.pack(np.ones((4, 4), np.float32)[:, ::2])
    with pytest.raises(bc.EncodingError):
        bc.pack(np.ones(4, np.float32), encoding="zstd")
    with pytest.raises(bc.ChunkSizeError):
        bc.pack(np.ones(4, np.float32), chunk_log2=8)
    with pytest.raises(bc.BackendUnavailableError):
        bc.pack(np.ones(4, np.float32), backend="nope")
    with pytest.raises(TypeError):
        bc.unpack(b"not a packed tensor")


def test_integer_bits_with_dtype_override():
    bits = np.array([0, 0x3F80, 0, 0xC000], dtype=np.uint16)
    p = bc.pack(bits, dtype="bfloat16", encoding="signplane")
    assert p.dtype is D.BFLOAT16 and p.nnz == 2
    assert np.array_equal(np.asarray(bc.unpack(p)).view(np.uint16), bits)
    with pytest.raises(bc.UnsupportedDTypeError):
        bc.pack(bits, dtype="float32")


class _FakeCudaTensor:
    """A DLPack producer that claims to live on a CUDA device."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):  # pragma: no cover - must never be called
        raise AssertionError("a CUDA tensor must not be imported by the CPU path")


def test_gpu_input_without_gpu_backend_is_a_clear_error():
    if any(bc.backend_available(n) for n in ("cupy", "numba")):
        pytest.skip("a GPU backend is available here")
    with pytest.raises(bc.UnsupportedDeviceError, match="never copies"):
        bc.pack(_FakeCudaTensor())
    with pytest.raises((bc.UnsupportedDeviceError, bc.BackendUnavailableError)):
        bc.pack(np.ones(3, np.float32), backend="cupy")


def test_packed_tensor_properties():
    x = np.zeros((64, 64), np.float32)
    x[::4] = 1.0
    p = bc.pack(x)
    assert p.shape == (64, 64) and p.numel == 4096 and p.nnz == 1024
    assert p.dense_nbytes == 4096 * 4
    assert p.ratio == pytest.approx(p.dense_nbytes / p.nbytes)
    assert set(p.planes) == {"mask", "offsets", "values", "signs"}
    assert "nnz=1024" in repr(p)


def test_masked_pack_auto_is_signplane():
    x = np.maximum(np.linspace(-1, 1, 64, dtype=np.float32), 0)
    u = np.linspace(-2, 2, 64, dtype=np.float32)
    q = bc.masked_pack(u, bc.pack(x), encoding="auto")
    assert q.encoding == bc.Encoding.SIGNPLANE


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_gated_relu_pack_and_product(dtype):
    """The gated op's two products (reference of the RELU_GATED pack and the GATED_PRODUCT
    decode): h = relu(g) * u over every element, relu(g)'s planes as relu_pack packs them;
    from the planes, r * u where the mask is set and +0 elsewhere, also where u was
    infinite or NaN (the dense h is NaN there)."""
    from bitsparse_core.spec import codec, ops
    rng = np.random.default_rng(63)
    g = random_tensor(rng, (5, 777), dtype, 0.3)
    u = random_tensor(rng, (5, 777), dtype, 0.2)
    r = ops.relu_bits(g, dtype)
    h, p = ops.gated_relu_pack(g, u, dtype, encoding="raw")
    with np.errstate(over="ignore"):
        want = ops.mul_f32(r.astype(np.float32), u.astype(np.float32)).astype(dtype.numpy)
    assert same_bits(h, want, dtype)
    ref = codec.pack_array(r, dtype, "raw")
    assert bytes(np.asarray(p.mask)) == bytes(np.asarray(ref.mask))
    assert bytes(np.asarray(p.values)) == bytes(np.asarray(ref.values))
    p_u = ops.masked_pack(u, dtype, p, encoding="signplane")
    got = ops.gated_product(p, p_u)
    keep = ops.mask_of(p)
    assert same_bits(got[keep], want[keep], dtype)
    assert not np.any(got[~keep].view(dtype.uint))              # +0, sign bit clear
    assert (~keep & np.isnan(want.astype(np.float32))).any()     # that case was drawn
