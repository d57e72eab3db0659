"""custom_vjp FFN ops whose saved activation is packed (bitmask + offsets + values).

Each op covers up projection, activation and down projection, because the down
projection's weight gradient needs the activation: an activation-only op would
leave the dense output saved by the following matmul. Saved for the backward:
the op's inputs (x and the weights, which plain autodiff saves too) and the
packed ReLU output -- never the dense pre-activation or activation.

Gradients are bit-identical to plain autodiff of the dense FFN
(``jnp.dot`` / ``jax.nn.relu`` / ``jnp.square`` / ``*``): the backward uses
``jax.vjp`` of the very same dense building blocks, so the primitives, their
order and their dtypes are those autodiff would emit. Only the activation's
own rule is ours, and it selects exactly what ``jax.nn.relu``'s rule selects
(``select(a > 0, g, 0)``); see docs/jax.md for the NaN / -0.0 corners.

Who packs and unpacks is ``PackConfig.impl``: the jax.numpy codec, or the
project's kernels as XLA custom calls (:mod:`.custom_calls`); either way the
forward's dense activation is ``jax.nn.relu``'s, as in the dense graph.

Values live in a fixed-capacity buffer (``density`` bounds the fraction of
nonzeros). If a batch overflows it, the backward recomputes the activation
from the saved input under ``lax.cond``: never truncated, only slower. That
recomputed matmul is compiled separately from the forward one; on CPU its bits
match, on an H200 at full size they did not always (docs/jax.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ..errors import ChunkSizeError
from ..spec import format as _fmt
from ..spec.format import Encoding
from . import codec, custom_calls


IMPLS = ("jnp", "ffi")


@dataclass(frozen=True)
class PackConfig:
    """Static packing parameters of an FFN op (hashable: a jit static argument).

    Checked when made, not at trace time: ``density`` must be a number in [0, 1]
    (:class:`CapacityError`), the encodings known names (:class:`EncodingError`),
    ``chunk_log2`` in the format's range. ``"auto"`` is resolved here to what it
    means for these ops: nosign for the ReLU output, signplane for the companion.
    """
    density: float = 0.25          # bound on the fraction of positive pre-activations
    encoding: str = "nosign"       # ReLU outputs never carry a sign bit
    u_encoding: str = "signplane"  # gated companion values are signed
    chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2
    # Independent packs of equal blocks along the leading axis (each at its own capacity):
    # a multiple of the data-parallel shard count keeps packing local to each shard under
    # jit with sharded inputs (the pack's scans then never cross a block, so XLA's SPMD
    # partitioner splits them without gathering the activation).
    shards: int = 1
    # Who packs and unpacks: "jnp", the jax.numpy codec (any JAX backend); "ffi", the
    # project's kernels as XLA custom calls (custom_calls.py: the CUDA kernels on XLA's
    # stream on a GPU, the NumPy reference on CPU). Both give the same planes.
    impl: str = "jnp"

    def __post_init__(self):
        set_ = partial(object.__setattr__, self)
        set_("density", codec.check_density(self.density))
        set_("encoding", codec.relu_encoding(self.encoding).name.lower())
        set_("u_encoding", codec.companion_encoding(self.u_encoding).name.lower())
        if isinstance(self.chunk_log2, bool) or not isinstance(self.chunk_log2, int):
            raise ChunkSizeError(f"chunk_log2={self.chunk_log2!r} must be an int")
        _fmt.check_chunk_log2(self.chunk_log2)
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"shards={self.shards!r} must be an int >= 1")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: use one of {IMPLS}")

    def capacity(self, shape) -> int:
        return codec.capacity_for(_fmt.numel_of(shape), self.density)

    def blocks(self, shape) -> tuple:
        """The shape of one block of an activation of ``shape`` (its leading axis split)."""
        if self.shards == 1:
            return tuple(shape)
        if not shape or shape[0] % self.shards:
            raise ValueError(f"shards={self.shards} must divide the leading axis of the "
                             f"activation, whose shape is {tuple(shape)}")
        return (shape[0] // self.shards, *shape[1:])


def _up(x, w, b):
    """``x @ w (+ b)``: the up projection exactly as the dense reference writes it."""
    a = jnp.dot(x, w)
    return a if b is None else a + b


def _recompute_up(x, w, b):
    """The up projection again, for the overflow path, compiled like the forward's.
    Inside the ``lax.cond`` branch XLA would otherwise fuse the bias add into the
    cuBLAS epilogue (fp32 accumulator + bias, rounded once) where the forward rounds
    the product before adding (measured on the H200 with
    ``bench/jax_recompute_probe.py``): barriers around the inputs and the result keep
    the matmul, the add and the activation apart as in the forward."""
    x, w, b = lax.optimization_barrier((x, w, b))
    return lax.optimization_barrier(_up(x, w, b))


def _dw2_first(dy, dw2):
    """``dy`` and ``dw2`` as they are, ``dw2`` computed before anything that reads ``dy``
    from here on: the decoded activation (``dw2``'s input) is then dead before ReLU's
    input gradient is allocated. Left to itself XLA ran the FFI path's gradient custom
    call first and kept three activation-sized buffers live at once (the step's temp
    memory 3 % above the jax.numpy path's; ``bench/jax_temp_probe.py``)."""
    return lax.optimization_barrier((dy, dw2))


@partial(jax.jit, static_argnums=0)
def _vjp_apply(fn, ct, *primals):
    return jax.vjp(fn, *primals)[1](ct)


def _vjp(fn, *primals):
    """Cotangent function of ``fn`` at ``primals`` (autodiff's own transpose rules).

    Under jit, so the primal recomputation that jax.vjp implies is dead code XLA
    removes, even when the backward runs eagerly.
    """
    return lambda ct: _vjp_apply(fn, ct, *primals)


# The name every packed residual carries (``jax.ad_checkpoint.checkpoint_name``): under
# ``jax.checkpoint`` a policy can save or offload them by it, e.g.
# ``save_and_offload_only_these_names(names_which_can_be_saved=[],
# names_which_can_be_offloaded=[PACKED_NAME], offload_src="device", offload_dst="pinned_host")``.
PACKED_NAME = "bitsparse_packed"


def _pack(a, cfg: PackConfig, u=None):
    """``pack(relu(a))`` (and u's companion), one pack per block of ``cfg.shards``."""
    block = cfg.blocks(a.shape)

    def one(a, u):
        if cfg.impl == "ffi":
            return _pack_ffi(a, cfg, cfg.capacity(block), u)
        return codec.relu_pack_planes(a, capacity=cfg.capacity(block), encoding=cfg.encoding,
                                      chunk_log2=cfg.chunk_log2, u=u,
                                      u_encoding=cfg.u_encoding)
    if cfg.shards == 1:
        packed = one(a, u)
    else:
        split = lambda t: None if t is None else t.reshape(cfg.shards, *block)   # noqa: E731
        packed = _blocks(jax.vmap(one), cfg, split(a), split(u))
    return jax.tree_util.tree_map(lambda t: checkpoint_name(t, PACKED_NAME), packed)


def _pack_ffi(a, cfg: PackConfig, capacity: int, u=None):
    """:func:`codec.relu_pack_planes` through the ``bitsparse_relu_pack`` custom call."""
    enc, uenc = Encoding.parse(cfg.encoding), Encoding.parse(cfg.u_encoding)
    dtype = codec.dtype_of(a)
    planes = custom_calls.relu_pack(a, capacity=capacity, encoding=enc,
                                    chunk_log2=cfg.chunk_log2, u=u, u_encoding=uenc)
    meta = (tuple(a.shape), dtype)
    p_r = codec.JaxPacked(*planes[:5], *meta, enc, cfg.chunk_log2, capacity)
    if u is None:
        return p_r
    return p_r, codec.JaxPacked(planes[0], planes[1], *planes[5:8], *meta, uenc,
                                cfg.chunk_log2, capacity, True)


def _decode(p, cfg: PackConfig):
    """The dense tensor of one (not overflowed) block, by the configured implementation;
    the jax.numpy decode where the unpack kernel does not take the chunk size."""
    if cfg.impl == "ffi" and custom_calls.chunk_supported(p.shape, p.dtype, p.chunk_log2):
        return custom_calls.unpack(p.mask, p.offsets, p.values, p.signs, shape=p.shape,
                                   dtype=p.dtype, encoding=p.encoding, capacity=p.capacity,
                                   chunk_log2=p.chunk_log2)
    return codec.decode_dense(p)


def _blocks(batched, cfg: PackConfig, *args):
    """``batched(*args)`` over the blocks' leading axis; the custom calls of the FFI path
    are told the axis is theirs to keep sharded (the jax.numpy path needs no telling)."""
    if cfg.impl == "ffi":
        return custom_calls.blockwise(batched, *args)
    return batched(*args)


def _per_block(fn, p, cfg: PackConfig, custom_call: bool = False):
    """``fn`` of a packed residual, block by block where ``cfg.shards`` split it.
    ``custom_call``: ``fn`` runs one (the others stay jax.numpy that XLA may fuse into
    their consumers, which a custom partitioning boundary would prevent)."""
    if cfg.shards == 1:
        return fn(p)
    return _blocks(jax.vmap(fn), cfg, p) if custom_call else jax.vmap(fn)(p)


def _overflowed(p, cfg: PackConfig):
    return _per_block(lambda q: q.overflowed, p, cfg).any()


def _dense(p, cfg: PackConfig, shape):
    return _per_block(partial(_decode, cfg=cfg), p, cfg, custom_call=True).reshape(shape)


def _mask(p, cfg: PackConfig, shape):
    return _per_block(codec.mask_of, p, cfg).reshape(shape)


def _relu_grad(p, cfg: PackConfig, g, shape):
    """ReLU's input gradient by the mask alone: ``g`` where the bit is set, else zero.
    The FFI path reads the mask plane in one custom call; the jax.numpy path selects
    by :func:`codec.mask_of`, which XLA fuses into its consumers."""
    if cfg.impl != "ffi":
        return jnp.where(_mask(p, cfg, shape), g, jnp.zeros((), g.dtype))

    def one(q, gb):
        return custom_calls.relu_backward(gb, q.mask, encoding=q.encoding,
                                          capacity=q.capacity, chunk_log2=q.chunk_log2)
    if cfg.shards == 1:
        return one(p, g)
    return _blocks(jax.vmap(one), cfg, p, g.reshape(cfg.shards, *cfg.blocks(shape))).reshape(shape)


# --------------------------------------------------------------------------- #
# ReLU and ReLU² FFN                                                          #
# --------------------------------------------------------------------------- #
def _act(r, square: bool):
    return jnp.square(r) if square else r


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _relu_ffn(x, w1, b1, w2, cfg, square):
    return jnp.dot(_act(jax.nn.relu(_up(x, w1, b1)), square), w2)


def _relu_ffn_fwd(x, w1, b1, w2, cfg, square):
    a = _up(x, w1, b1)
    out = jnp.dot(_act(jax.nn.relu(a), square), w2)
    return out, (x, w1, b1, w2, _pack(a, cfg))


def _relu_ffn_bwd(cfg, square, res, g):
    x, w1, b1, w2, p = res
    shape = (*x.shape[:-1], w1.shape[-1])
    # r = relu(a), from the packed values, or recomputed if the batch overflowed.
    r = lax.cond(_overflowed(p, cfg), lambda: jax.nn.relu(_recompute_up(x, w1, b1)),
                 lambda: _dense(p, cfg, shape))
    y = _act(r, square)
    dy, dw2 = _vjp(jnp.dot, y, w2)(g)
    if square:
        (dr,) = _vjp(jnp.square, r)(dy)
        da = jnp.where(r > 0, dr, jnp.zeros((), dr.dtype))
    else:
        # The mask alone decides (complete even after an overflow).
        dy, dw2 = _dw2_first(dy, dw2)
        da = _relu_grad(p, cfg, dy, shape)
    dx, dw1, db1 = _vjp(_up, x, w1, b1)(da)
    return dx, dw1, db1, dw2


_relu_ffn.defvjp(_relu_ffn_fwd, _relu_ffn_bwd)


def relu_ffn(x, w1, b1, w2, cfg: PackConfig = PackConfig()):
    """``relu(x @ w1 + b1) @ w2`` (``b1`` may be None), saving ``pack(relu(a))``."""
    return _relu_ffn(x, w1, b1, w2, cfg, False)


def relu2_ffn(x, w1, b1, w2, cfg: PackConfig = PackConfig()):
    """``relu(x @ w1 + b1)**2 @ w2`` (``b1`` may be None), saving ``pack(relu(a))``;
    the backward recomputes ``r**2`` and ``2 r`` from the packed ``r``."""
    return _relu_ffn(x, w1, b1, w2, cfg, True)


# --------------------------------------------------------------------------- #
# Gated ReLU FFN                                                              #
# --------------------------------------------------------------------------- #
# x enters twice (x_u, x_g) so that autodiff itself accumulates the two input
# gradients with the residual stream's, in the order it would for the dense
# ``relu(x @ wg) * (x @ wu)`` (u's contribution first): float addition is not
# associative, so summing them here would change the bits.
@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gated_ffn(x_u, x_g, wg, bg, wu, bu, w2, cfg):
    return jnp.dot(jax.nn.relu(_up(x_g, wg, bg)) * _up(x_u, wu, bu), w2)


def _gated_ffn_fwd(x_u, x_g, wg, bg, wu, bu, w2, cfg):
    ag = _up(x_g, wg, bg)
    u = _up(x_u, wu, bu)
    out = jnp.dot(jax.nn.relu(ag) * u, w2)
    p_r, p_u = _pack(ag, cfg, u=u)
    return out, (x_u, x_g, wg, bg, wu, bu, w2, p_r, p_u)


def _gated_ffn_bwd(cfg, res, g):
    x_u, x_g, wg, bg, wu, bu, w2, p_r, p_u = res
    shape = (*x_g.shape[:-1], wg.shape[-1])
    r, u = lax.cond(_overflowed(p_r, cfg),
                    lambda: (jax.nn.relu(_recompute_up(x_g, wg, bg)),
                             _recompute_up(x_u, wu, bu)),
                    lambda: (_dense(p_r, cfg, shape), _dense(p_u, cfg, shape)))
    h = r * u
    dh, dw2 = _vjp(jnp.dot, h, w2)(g)
    dr, du = _vjp(jnp.multiply, r, u)(dh)
    dag = jnp.where(r > 0, dr, jnp.zeros((), dr.dtype))
    dx_u, dwu, dbu = _vjp(_up, x_u, wu, bu)(du)
    dx_g, dwg, dbg = _vjp(_up, x_g, wg, bg)(dag)
    return dx_u, dx_g, dwg, dbg, dwu, dbu, dw2


_gated_ffn.defvjp(_gated_ffn_fwd, _gated_ffn_bwd)


def gated_ffn(x, wg, wu, w2, bg=None, bu=None, cfg: PackConfig = PackConfig()):
    """``(relu(x @ wg + bg) * (x @ wu + bu)) @ w2``, saving ``pack(relu(g))`` and ``u``
    at its mask's positions (the gated companion plane)."""
    return _gated_ffn(x, x, wg, bg, wu, bu, w2, cfg)


# --------------------------------------------------------------------------- #
# A small FFN stack: init / apply                                             #
# --------------------------------------------------------------------------- #
def init_stack(key, n_layers: int, d: int, f: int, *, kind: str = "relu",
               dtype=jnp.bfloat16, negative_fraction: float = 0.8):
    """Parameters of ``n_layers`` residual FFN blocks ``x + ffn(x)``.

    Weights are N(0, 1/fan_in); the up-projection bias is set so that, for unit
    inputs, about ``negative_fraction`` of pre-activations are negative.
    """
    from statistics import NormalDist
    shift = NormalDist().inv_cdf(negative_fraction)
    layers = []
    for k in jax.random.split(key, n_layers):
        k1, k2, k3 = jax.random.split(k, 3)
        w1 = (jax.random.normal(k1, (d, f), jnp.float32) / d ** 0.5).astype(dtype)
        w2 = (jax.random.normal(k2, (f, d), jnp.float32) / f ** 0.5).astype(dtype)
        b1 = jnp.full((f,), -shift, dtype)
        layer = {"w1": w1, "b1": b1, "w2": w2}
        if kind == "gated":
            layer["wu"] = (jax.random.normal(k3, (d, f), jnp.float32) / d ** 0.5).astype(dtype)
        layers.append(layer)
    return layers


def dense_block(layer, x, kind: str):
    """The plain JAX reference block (no packing), as autodiff sees it."""
    if kind == "relu":
        return jnp.dot(jax.nn.relu(jnp.dot(x, layer["w1"]) + layer["b1"]), layer["w2"])
    if kind == "relu2":
        return jnp.dot(jnp.square(jax.nn.relu(jnp.dot(x, layer["w1"]) + layer["b1"])),
                       layer["w2"])
    if kind == "gated":
        return jnp.dot(jax.nn.relu(jnp.dot(x, layer["w1"]) + layer["b1"])
                       * jnp.dot(x, layer["wu"]), layer["w2"])
    raise ValueError(f"unknown FFN kind {kind!r}; use 'relu', 'relu2' or 'gated'")


def packed_block(layer, x, kind: str, cfg: PackConfig = PackConfig()):
    """The same block through the packed custom_vjp ops."""
    if kind == "relu":
        return relu_ffn(x, layer["w1"], layer["b1"], layer["w2"], cfg)
    if kind == "relu2":
        return relu2_ffn(x, layer["w1"], layer["b1"], layer["w2"], cfg)
    if kind == "gated":
        return gated_ffn(x, layer["w1"], layer["wu"], layer["w2"], bg=layer["b1"], cfg=cfg)
    raise ValueError(f"unknown FFN kind {kind!r}; use 'relu', 'relu2' or 'gated'")


def apply_stack(layers, x, *, kind: str = "relu", mode: str = "packed",
                cfg: PackConfig = PackConfig()):
    """Run the residual stack. mode: 'packed' (these ops), 'dense' (plain JAX) or
    'checkpoint' (plain JAX under jax.checkpoint, one block at a time)."""
    if mode == "packed":
        block = partial(packed_block, kind=kind, cfg=cfg)
    elif mode == "dense":
        block = partial(dense_block, kind=kind)
    elif mode == "checkpoint":
        block = jax.checkpoint(partial(dense_block, kind=kind))
    else:
        raise ValueError(f"unknown mode {mode!r}; use 'packed', 'dense' or 'checkpoint'")
    for layer in layers:
        x = x + block(layer, x)
    return x
