"""The JAX adapter: codec planes equal the reference's; FFN gradients equal plain JAX's."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import bitsparse_core as bc  # noqa: E402
from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.spec import ops as reference_ops  # noqa: E402
from bitsparse_core.errors import (CapacityOverflowError, EncodingError,  # noqa: E402
                                   InputError)
from bitsparse_core.jax import codec, ffn  # noqa: E402
from bitsparse_core.spec.codec import encode_values, pack_array  # noqa: E402
from helpers import ALL_DTYPES, ENCODINGS, jax_gpu, random_tensor, same_bits  # noqa: E402

PLANES = ("mask", "offsets", "values", "signs")


def assert_planes_equal(jp: codec.JaxPacked, ref):
    got = jp.to_packed_tensor()
    for name in PLANES:
        a, b = getattr(ref, name), getattr(got, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), name


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    u = np.dtype(f"u{a.dtype.itemsize}")
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(u), b.view(u))


def trees_bit_identical(t1, t2) -> bool:
    l1, l2 = jax.tree_util.tree_leaves(t1), jax.tree_util.tree_leaves(t2)
    return len(l1) == len(l2) and all(bits_equal(a, b) for a, b in zip(l1, l2))


# --------------------------------------------------------------------------- #
# Codec                                                                       #
# --------------------------------------------------------------------------- #
def test_import_without_jax():
    code = ("import sys; sys.modules['jax'] = None\n"
            "import bitsparse_core, numpy as np\n"
            "p = bitsparse_core.pack(np.arange(5, dtype=np.float32))\n"
            "assert p.nnz == 4\n"
            "try:\n    import bitsparse_core.jax.codec\nexcept ImportError:\n    pass\n"
            "else:\n    raise SystemExit('bitsparse_core.jax imported without jax')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_pack_planes_equal_reference(dtype, encoding):
    rng = np.random.default_rng([dtype.bits, dtype.dl_code, len(encoding)])
    x = random_tensor(rng, (5, 211), dtype, 0.6, signed=(encoding != "nosign"))
    nnz = int(np.count_nonzero(x.view(dtype.uint)))
    for capacity in (nnz, nnz - 5, x.size):    # exact, overflowed, worst case
        jp = codec.pack(jnp.asarray(x), capacity=capacity, encoding=encoding, chunk_log2=9)
        assert_planes_equal(jp, pack_array(x, dtype, encoding, chunk_log2=9, capacity=capacity))
        assert int(jp.nnz) == nnz
        assert bool(jp.overflowed) == (capacity < nnz)
        if capacity >= nnz:
            assert same_bits(codec.unpack(jp), x, dtype)
        else:
            with pytest.raises(CapacityOverflowError):
                codec.unpack(jp)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (8,), (513,), (3, 0, 2), (2, 1024)],
                         ids=str)
def test_pack_edge_shapes(shape):
    rng = np.random.default_rng(len(shape) + sum(shape))
    x = random_tensor(rng, shape, D.BFLOAT16, 0.5)
    jp = codec.pack(jnp.asarray(x), encoding="signplane", chunk_log2=9)   # exact capacity
    assert_planes_equal(jp, pack_array(x, D.BFLOAT16, "signplane", chunk_log2=9))
    assert same_bits(codec.unpack(jp), x, D.BFLOAT16)
    # the serialized buffer validates and decodes with the reference codec
    buf = jp.to_packed_tensor().to_bytes()
    bc.validate(buf)
    assert same_bits(bc.unpack(bc.from_bytes(buf)), x, D.BFLOAT16)


def test_auto_encoding_and_nosign_errors():
    x = np.array([0.0, -1.5, 2.0, 0.0], np.float32)
    assert codec.pack(jnp.asarray(x)).encoding == bc.Encoding.RAW
    assert codec.pack(jnp.asarray(np.abs(x))).encoding == bc.Encoding.NOSIGN
    with pytest.raises(EncodingError):
        codec.pack(jnp.asarray(x), encoding="nosign")
    with pytest.raises(EncodingError):      # data-dependent: cannot be traced
        jax.jit(lambda a: codec.pack(a, capacity=4))(jnp.asarray(x))
    # under jit an illegal nosign is recorded in status, and check() raises
    jp = jax.jit(lambda a: codec.pack(a, capacity=4, encoding="nosign"))(jnp.asarray(x))
    assert int(jp.status) & codec.STATUS_NOSIGN
    with pytest.raises(EncodingError):
        jp.check()


def test_jit_vmap_and_overflow_guard():
    rng = np.random.default_rng(7)
    xs = random_tensor(rng, (3, 600), D.FLOAT16, 0.7)
    cap = 150
    f = jax.jit(jax.vmap(lambda a: codec.pack(a, capacity=cap, encoding="raw", chunk_log2=9)))
    batched = f(jnp.asarray(xs))
    for i in range(3):
        one = jax.tree_util.tree_map(lambda t: t[i], batched)
        assert_planes_equal(one, pack_array(xs[i], D.FLOAT16, "raw", chunk_log2=9, capacity=cap))

    x = jnp.asarray(xs[0])
    nnz = int(np.count_nonzero(xs[0].view(np.uint16)))
    with pytest.raises(CapacityOverflowError):   # under jit, no fallback: refused at trace
        jax.jit(lambda a: codec.unpack(codec.pack(a, capacity=nnz, encoding="raw")))(x)
    marker = jnp.full(x.shape, 7.0, x.dtype)
    roundtrip = jax.jit(lambda a, c: codec.unpack(codec.pack(a, capacity=c, encoding="raw"),
                                                  fallback=lambda: marker), static_argnums=1)
    assert same_bits(roundtrip(x, nnz), xs[0], D.FLOAT16)               # fits: decoded
    assert same_bits(roundtrip(x, nnz - 1), np.asarray(marker), D.FLOAT16)  # overflow: fallback


def test_relu_and_masked_planes_equal_reference_ops():
    rng = np.random.default_rng(11)
    a = random_tensor(rng, (9, 300), D.BFLOAT16, 0.1)
    ab = a.view(np.uint16)
    ab[(ab & 0x7FFF) > 0x7F80] &= 0x7FFF    # relu keeps NaNs: a -NaN would make nosign illegal
    u = random_tensor(rng, (9, 300), D.BFLOAT16, 0.1)
    _, ref_r = reference_ops.relu_pack(a, D.BFLOAT16, chunk_log2=9)
    nnz = ref_r.nnz
    for cap in (nnz, nnz + 9):
        p_r, p_u = codec.relu_pack_planes(jnp.asarray(a), capacity=cap, chunk_log2=9,
                                          u=jnp.asarray(u))
        assert_planes_equal(p_r, pack_array(reference_ops.relu_bits(a, D.BFLOAT16), D.BFLOAT16,
                                            "nosign", chunk_log2=9, capacity=cap))
        ref_u = reference_ops.masked_pack(u, D.BFLOAT16, ref_r)
        stored = u.reshape(-1).view(np.uint16)[reference_ops.mask_of(ref_r).reshape(-1)]
        values, signs = encode_values(stored, D.BFLOAT16, bc.Encoding.SIGNPLANE, cap)
        got = p_u.to_packed_tensor()
        assert np.array_equal(got.mask, ref_u.mask) and np.array_equal(got.offsets, ref_u.offsets)
        assert np.array_equal(got.values, values) and np.array_equal(got.signs, signs)
        if cap == nnz:   # at capacity = nnz these are exactly reference masked_pack's planes
            assert np.array_equal(got.values, ref_u.values)
            assert np.array_equal(got.signs, ref_u.signs)
        # masked_pack from a packed mask gives the same planes
        again = codec.masked_pack(jnp.asarray(u), p_r).to_packed_tensor()
        assert np.array_equal(again.values, values) and np.array_equal(again.signs, signs)
        dense_u = np.where(reference_ops.mask_of(ref_r), u, np.zeros((), u.dtype))
        assert same_bits(codec.unpack_masked(p_u), dense_u, D.BFLOAT16)
        assert np.array_equal(np.asarray(codec.mask_of(p_r)), reference_ops.mask_of(ref_r))


def test_from_packed_tensor_and_dlpack():
    rng = np.random.default_rng(5)
    x = random_tensor(rng, (4, 777), D.FLOAT8_E4M3FN, 0.4)
    ref = bc.pack(x, encoding="signplane", chunk_log2=9)
    assert same_bits(codec.unpack(codec.from_packed_tensor(ref)), x, D.FLOAT8_E4M3FN)
    # bitsparse_core.pack takes CPU jax arrays through DLPack, bf16 and fp8 included
    for dt, sparsity in ((D.BFLOAT16, 0.5), (D.FLOAT8_E5M2, 0.8), (D.FLOAT32, 0.0)):
        y = random_tensor(rng, (3, 129), dt, sparsity)
        p = bc.pack(jnp.asarray(y), chunk_log2=9)
        assert p.backend.name == "numpy"
        q = pack_array(y, dt, "auto", chunk_log2=9)
        for name in PLANES:
            assert np.array_equal(getattr(p, name), getattr(q, name))
        back = jax.dlpack.from_dlpack(bc.unpack(p))     # and the result goes back to JAX
        assert back.dtype == jnp.dtype(dt.numpy) and bits_equal(back, y)


# --------------------------------------------------------------------------- #
# FFN ops                                                                     #
# --------------------------------------------------------------------------- #
T, DM, F = 40, 64, 192          # T*F = 7680 elements: 15 chunks of 512


def _setup(kind, seed=0):
    layers = ffn.init_stack(jax.random.PRNGKey(seed), 2, DM, F, kind=kind)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (T, DM), jnp.float32).astype(jnp.bfloat16)
    return layers, x


def _loss(layers, x, kind, mode, cfg):
    out = ffn.apply_stack(layers, x, kind=kind, mode=mode, cfg=cfg)
    return jnp.sum(jnp.square(out.astype(jnp.float32)))


def _first_layer_packed(layer, x, kind, cfg):
    """The packed residual the first layer's forward saves (to assert overflow or not)."""
    if kind == "gated":
        res = ffn._gated_ffn_fwd(x, x, layer["w1"], layer["b1"], layer["wu"], None, layer["w2"],
                                 cfg)[1]
        return res[-2]
    return ffn._relu_ffn_fwd(x, layer["w1"], layer["b1"], layer["w2"], cfg, kind == "relu2")[1][-1]


IMPL = pytest.mark.parametrize("impl", ffn.IMPLS)


@IMPL
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
@pytest.mark.parametrize("density", [0.5, 0.05], ids=["fits", "overflows"])
def test_ffn_gradients_bit_identical(kind, density, impl):
    layers, x = _setup(kind)
    cfg = ffn.PackConfig(density=density, chunk_log2=9, impl=impl)
    p = _first_layer_packed(layers[0], x, kind, cfg)
    frac = int(p.nnz) / p.numel
    assert 0.1 < frac < 0.35            # b1 makes ~80% of pre-activations negative
    assert bool(p.overflowed) == (density < frac)
    grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)), static_argnums=(2, 3, 4))
    ref = grad(layers, x, kind, "dense", cfg)
    got = grad(layers, x, kind, "packed", cfg)
    assert trees_bit_identical(ref, got)


def test_ffn_eager_grad_and_no_bias():
    layers, x = _setup("relu", seed=3)
    cfg = ffn.PackConfig(density=0.4, chunk_log2=9)
    ref = jax.grad(lambda w1, w2: jnp.sum(jnp.dot(jax.nn.relu(jnp.dot(x, w1)), w2)
                                          .astype(jnp.float32) ** 2), argnums=(0, 1))
    got = jax.grad(lambda w1, w2: jnp.sum(ffn.relu_ffn(x, w1, None, w2, cfg)
                                          .astype(jnp.float32) ** 2), argnums=(0, 1))
    l0 = layers[0]
    assert trees_bit_identical(ref(l0["w1"], l0["w2"]), got(l0["w1"], l0["w2"]))


@IMPL
def test_residuals_are_packed(impl):
    """What the forward saves: inputs and packed planes, no activation-sized array."""
    layers, x = _setup("gated")
    cfg = ffn.PackConfig(density=0.3, chunk_log2=9, impl=impl)
    for kind in ("relu", "relu2", "gated"):
        def saved(mode):
            _, f_vjp = jax.vjp(lambda ls: _loss(ls, x, kind, mode, cfg), layers)
            return jax.tree_util.tree_leaves(f_vjp)
        dense, packed = saved("dense"), saved("packed")
        assert any(t.shape == (T, F) for t in dense)
        assert not any(t.shape == (T, F) for t in packed)
        # beyond the parameters and the block inputs: the activations, dense or packed
        inputs = {(DM, F), (F, DM), (F,), (T, DM)}
        act = {m: sum(t.nbytes for t in leaves if t.shape not in inputs)
               for m, leaves in (("dense", dense), ("packed", packed))}
        per_act = T * F * 2 * len(layers) * (2 if kind == "gated" else 1)
        assert act["dense"] >= per_act
        assert act["packed"] < 0.4 * per_act      # density 0.3: ~1/16 mask + 0.3 values


def _saved_residuals(fn, *args) -> list:
    """``jax.ad_checkpoint.print_saved_residuals``'s lines: what the backward keeps."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return buf.getvalue().splitlines()


@IMPL
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
def test_packed_residuals_are_named_for_remat_policies(kind, impl):
    """Under jax.checkpoint, a policy naming PACKED_NAME keeps the packed planes and
    nothing activation-sized; without the name (nothing saveable) they are recomputed.
    Gradients stay bit-identical to dense either way."""
    from bitsparse_core.jax import PACKED_NAME
    layers, x = _setup(kind)
    cfg = ffn.PackConfig(density=0.3, chunk_log2=9, impl=impl)
    block = lambda ls, x: _loss(ls, x, kind, "packed", cfg)   # noqa: E731
    cp = jax.checkpoint_policies
    named = _saved_residuals(jax.checkpoint(block, policy=cp.save_only_these_names(PACKED_NAME)),
                             layers, x)
    assert sum(f"named '{PACKED_NAME}'" in line for line in named) >= 5 * len(layers)
    assert not any(f"[{T},{F}]" in line for line in named)
    none = _saved_residuals(jax.checkpoint(block, policy=cp.nothing_saveable), layers, x)
    assert not any(PACKED_NAME in line for line in none)
    ref = jax.jit(jax.grad(lambda ls: _loss(ls, x, kind, "dense", cfg)))(layers)
    for policy in (cp.save_only_these_names(PACKED_NAME), cp.nothing_saveable):
        got = jax.jit(jax.grad(jax.checkpoint(lambda ls: block(ls, x), policy=policy)))(layers)
        assert trees_bit_identical(ref, got)


@IMPL
def test_packed_residuals_offload_to_pinned_host_by_name(impl):
    """JAX's own offload policy moves the named packed planes to host memory (where the
    platform has a pinned_host memory kind), and the gradients stay bit-identical."""
    from bitsparse_core.jax import PACKED_NAME
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip(f"no pinned_host memory kind on {jax.devices()[0]} ({sorted(kinds)})")
    layers, x = _setup("relu2")
    cfg = ffn.PackConfig(density=0.3, chunk_log2=9, impl=impl)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[PACKED_NAME],
        offload_src="device", offload_dst="pinned_host")
    block = jax.checkpoint(lambda ls: _loss(ls, x, "relu2", "packed", cfg), policy=policy)
    saved = _saved_residuals(block, layers)
    assert any("<host>" in line for line in saved), saved
    ref = jax.jit(jax.grad(lambda ls: _loss(ls, x, "relu2", "dense", cfg)))(layers)
    assert trees_bit_identical(ref, jax.jit(jax.grad(block))(layers))


@IMPL
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
@pytest.mark.parametrize("density", [0.5, 0.05], ids=["fits", "overflows"])
def test_ffn_packed_in_blocks_bit_identical(kind, density, impl):
    """``PackConfig(shards=4)``: four independent packs along the leading axis, the same
    gradients as dense (an overflow in any block recomputes)."""
    layers, x = _setup(kind)
    cfg = ffn.PackConfig(density=density, chunk_log2=9, shards=4, impl=impl)
    grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)), static_argnums=(2, 3, 4))
    assert trees_bit_identical(grad(layers, x, kind, "dense", cfg),
                               grad(layers, x, kind, "packed", cfg))
    p = ffn._pack(jnp.dot(x, layers[0]["w1"]), cfg)
    assert p.mask.shape[0] == 4 and p.shape == (T // 4, F)


def test_pack_config_shards_are_checked():
    with pytest.raises(ValueError, match="shards"):
        ffn.PackConfig(shards=0)
    with pytest.raises(ValueError, match="shards"):
        ffn.PackConfig(shards=2.0)
    layers, x = _setup("relu")
    with pytest.raises(ValueError, match="divide the leading axis"):
        jax.grad(_loss)(layers, x, "relu", "packed", ffn.PackConfig(shards=3))   # 40 rows


@IMPL
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
def test_sharded_jit_packs_locally(kind, impl):
    """Two fake CPU devices, the input sharded along the tokens: with shards=2 the packed
    stack's compiled gradient gathers nothing (dense gathers nothing either; one global
    pack would all-gather the activation, 4 per layer); its one extra collective is the
    all-reduce of the layers' overflow flags (pred scalars). Gradients bit-identical.
    The FFI path's custom calls say they keep the blocks' sharding (blockwise)."""
    import json
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, os.path.join(here, "jax_sharded.py"), kind, impl],
                         check=True, capture_output=True, text=True, env=env, timeout=600)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["bit_identical"], r
    assert r["packed"]["all-gather"] == r["dense"]["all-gather"] == 0, r
    for op in ("collective-permute", "all-to-all", "reduce-scatter"):
        assert r["packed"][op] == r["dense"][op], r
    assert r["packed"]["all-reduce"] <= r["dense"]["all-reduce"] + 1, r


@IMPL
@pytest.mark.parametrize("density", [0.5, 0.05], ids=["fits", "overflows"])
def test_backward_reads_the_packed_values(density, impl):
    """Corrupting the saved values changes the gradient unless the batch overflowed
    (then the backward recomputes from x and ignores them)."""
    layers, x = _setup("relu2")
    l0 = layers[0]
    cfg = ffn.PackConfig(density=density, chunk_log2=9, impl=impl)
    _, res = ffn._relu_ffn_fwd(x, l0["w1"], l0["b1"], l0["w2"], cfg, True)
    g = jnp.ones((T, DM), jnp.bfloat16)
    good = ffn._relu_ffn_bwd(cfg, True, res, g)
    p = res[-1]
    bad_p = codec.JaxPacked(p.mask, p.offsets, jnp.zeros_like(p.values), p.signs, p.status,
                            p.shape, p.dtype, p.encoding, p.chunk_log2, p.capacity)
    bad = ffn._relu_ffn_bwd(cfg, True, res[:-1] + (bad_p,), g)
    assert trees_bit_identical(good, bad) == bool(p.overflowed)


def test_relu_rule_matches_reference_ops():
    """The relu FFN's pre-activation gradient is reference relu_backward (mask only)."""
    layers, x = _setup("relu", seed=9)
    l0 = layers[0]
    cfg = ffn.PackConfig(density=0.5, chunk_log2=9)
    a = jnp.dot(x, l0["w1"]) + l0["b1"]
    g = jax.random.normal(jax.random.PRNGKey(4), (T, DM), jnp.float32).astype(jnp.bfloat16)
    _, res = ffn._relu_ffn_fwd(x, l0["w1"], l0["b1"], l0["w2"], cfg, False)
    _, vjp_a = jax.vjp(lambda a_: jnp.dot(jax.nn.relu(a_), l0["w2"]), a)
    dy = jnp.dot(g, l0["w2"].T)
    p_ref = pack_array(reference_ops.relu_bits(np.asarray(a), D.BFLOAT16), D.BFLOAT16, "nosign",
                       chunk_log2=9)
    expect = reference_ops.relu_backward(np.asarray(dy), p_ref)
    assert bits_equal(vjp_a(g)[0], expect)
    assert_planes_equal(res[-1], pack_array(reference_ops.relu_bits(np.asarray(a), D.BFLOAT16),
                                            D.BFLOAT16, "nosign", chunk_log2=9,
                                            capacity=res[-1].capacity))


def test_bad_arguments():
    x = jnp.ones((4, 4), jnp.bfloat16)
    with pytest.raises(bc.errors.CapacityError):
        jax.jit(lambda a: codec.pack(a, encoding="raw"))(x)     # traced: capacity required
    with pytest.raises(bc.errors.CapacityError):
        codec.pack(x, capacity=17)
    with pytest.raises(bc.errors.UnsupportedDTypeError):
        codec.pack(jnp.ones(3, jnp.int32), capacity=3)
    with pytest.raises(InputError):
        jax.jit(lambda a: codec.pack(a, capacity=3, encoding="raw").check())(x)


def test_import_without_jax_says_what_to_install():
    code = ("import sys; sys.modules['jax'] = None\n"
            "try:\n    import bitsparse_core.jax\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ImportError") and "needs JAX" in out and "pip install" in out


@pytest.mark.parametrize("capacity", [0.5, 1.9, 3.0, "100", True, None], ids=repr)
def test_capacity_must_be_an_int(capacity):
    x = jnp.asarray(np.array([[1.0, 0, 2, 3]], np.float32))
    if capacity is None:
        assert codec.pack(x).capacity == 3          # eager exact pack
        return
    with pytest.raises(bc.errors.CapacityError, match="must be an int"):
        codec.pack(x, capacity=capacity)
    with pytest.raises(bc.errors.CapacityError, match="must be an int"):
        codec.relu_pack_planes(x, capacity=capacity)


def test_numpy_int_capacity_is_an_int():
    x = jnp.asarray(np.array([1.0, 0, 2, 3], np.float32))
    assert codec.pack(x, capacity=np.int64(3)).capacity == 3
    assert codec.relu_pack_planes(x, capacity=np.int32(2)).capacity == 2


def test_masked_pack_auto_is_signplane_eager_and_traced():
    rng = np.random.default_rng(2)
    a = jnp.asarray(random_tensor(rng, (4, 96), D.BFLOAT16, 0.4))
    u = jnp.asarray(random_tensor(rng, (4, 96), D.BFLOAT16, 0.0))
    p = codec.relu_pack_planes(a, capacity=4 * 96)
    want = codec.masked_pack(u, p, encoding="signplane")
    for got in (codec.masked_pack(u, p, encoding="auto"),
                jax.jit(lambda u, p: codec.masked_pack(u, p, encoding="auto"))(u, p)):
        assert got.encoding == bc.Encoding.SIGNPLANE
        assert trees_bit_identical(got, want)
    p_r, p_u = codec.relu_pack_planes(a, capacity=4 * 96, encoding="auto", u=u,
                                      u_encoding="auto")
    assert (p_r.encoding, p_u.encoding) == (bc.Encoding.NOSIGN, bc.Encoding.SIGNPLANE)


def test_pack_config_auto_under_grad():
    kind = "gated"                          # both encodings: the ReLU output's and u's
    layers, x = _setup(kind)
    auto = ffn.PackConfig(density=0.3, encoding="auto", u_encoding="AUTO", chunk_log2=9)
    assert (auto.encoding, auto.u_encoding) == ("nosign", "signplane")
    assert auto == ffn.PackConfig(density=0.3, chunk_log2=9)    # the same static key
    g_auto = jax.grad(_loss)(layers, x, kind, "packed", auto)
    g_ref = jax.grad(_loss)(layers, x, kind, "packed", ffn.PackConfig(density=0.3, chunk_log2=9))
    assert trees_bit_identical(g_auto, g_ref)


@pytest.mark.parametrize("kwargs,error", [
    ({"density": 2.0}, bc.errors.CapacityError), ({"density": -0.1}, bc.errors.CapacityError),
    ({"density": float("nan")}, bc.errors.CapacityError),
    ({"density": "0.5"}, bc.errors.CapacityError), ({"density": True}, bc.errors.CapacityError),
    ({"encoding": "bogus"}, EncodingError), ({"encoding": None}, EncodingError),
    ({"u_encoding": "zip"}, EncodingError),
    ({"chunk_log2": 3}, bc.errors.ChunkSizeError), ({"chunk_log2": 12.5}, bc.errors.ChunkSizeError),
], ids=lambda v: repr(v) if isinstance(v, dict) else v.__name__)
def test_pack_config_is_checked_when_made(kwargs, error):
    with pytest.raises(error):
        ffn.PackConfig(**kwargs)


def test_pack_config_normalises_names():
    cfg = ffn.PackConfig(density=1, encoding="RAW", u_encoding=bc.Encoding.NOSIGN)
    assert (cfg.density, cfg.encoding, cfg.u_encoding) == (1.0, "raw", "nosign")
    assert hash(cfg) == hash(ffn.PackConfig(density=1.0, encoding="raw", u_encoding="nosign"))


# --------------------------------------------------------------------------- #
# GPU                                                                         #
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,encoding", [(D.BFLOAT16, "nosign"), (D.FLOAT16, "signplane"),
                                            (D.FLOAT32, "raw"), (D.FLOAT8_E5M2, "signplane")],
                         ids=lambda v: getattr(v, "name", v))
def test_gpu_pack_planes_equal_reference(dtype, encoding):
    dev = jax_gpu()
    rng = np.random.default_rng(dtype.bits)
    x = random_tensor(rng, (64, 3001), dtype, 0.8, signed=(encoding != "nosign"))
    nnz = int(np.count_nonzero(x.view(dtype.uint)))
    xg = jax.device_put(jnp.asarray(x), dev)
    for cap in (nnz - 100, nnz + 1000):
        jp = jax.jit(lambda a, c=cap: codec.pack(a, capacity=c, encoding=encoding))(xg)
        assert jp.mask.devices() == {dev}
        assert_planes_equal(jp, pack_array(x, dtype, encoding, capacity=cap))
        if cap >= nnz:
            assert same_bits(np.asarray(codec.unpack(jp)), x, dtype)


@pytest.mark.gpu
@IMPL
@pytest.mark.parametrize("kind", ["relu", "relu2", "gated"])
@pytest.mark.parametrize("density", [0.3, 0.05], ids=["fits", "overflows"])
def test_gpu_ffn_gradients_bit_identical(kind, density, impl):
    dev = jax_gpu()
    layers = ffn.init_stack(jax.random.PRNGKey(0), 2, 256, 1024, kind=kind)
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 256), jnp.float32).astype(jnp.bfloat16)
    layers, x = jax.device_put((layers, x), dev)
    cfg = ffn.PackConfig(density=density, impl=impl)
    grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)), static_argnums=(2, 3, 4))
    assert trees_bit_identical(grad(layers, x, kind, "dense", cfg),
                               grad(layers, x, kind, "packed", cfg))


@pytest.mark.gpu
def test_gpu_bitsparse_pack_of_jax_array():
    """Eager bitsparse_core.pack on a GPU jax array goes through DLPack to a CUDA backend."""
    dev = jax_gpu()
    if not (bc.backend_available("cupy") or bc.backend_available("numba")):
        pytest.skip("no CUDA backend of bitsparse_core available")
    rng = np.random.default_rng(2)
    x = random_tensor(rng, (32, 1000), D.BFLOAT16, 0.7)
    p = bc.pack(jax.device_put(jnp.asarray(x), dev), chunk_log2=9)
    q = pack_array(x, D.BFLOAT16, "auto", chunk_log2=9)
    for name in PLANES:
        from bitsparse_core.packed import host_plane
        assert np.array_equal(host_plane(p, name), getattr(q, name))
