"""Format v1 in jax.numpy: pack into a fixed capacity, unpack, LSB-first bit streams.

Everything here traces: shapes depend only on static arguments (shape, dtype,
encoding, chunk size, capacity), never on the data, so it runs under jit, vmap
and grad on any JAX backend. The planes are byte-identical to the NumPy
reference codec's ``pack(x, capacity=K)``.

How the ranks are found without an element-wide scan: the mask is built as
32-bit words; a word's popcount gives per-word counts, one short scan per chunk
turns those into each word's first rank, and an element's rank is its word's
first rank plus the popcount of the lower bits of its word. Only the word-level
scan (numel/32 entries) is a prefix sum; the rest is elementwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import dtypes as _dt
from ..spec import format as _fmt
from ..errors import CapacityError, CapacityOverflowError, EncodingError, InputError
from ..backends import get_backend
from ..packed import PackedTensor

Encoding = _fmt.Encoding

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
MAX_NUMEL = (1 << 31) - 1   # ranks and indices are int32 (jax's default index width)
STATUS_NOSIGN = 1           # status bit 0: nosign met a set sign bit (as the GPU backends)


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def dtype_of(x) -> _dt.DType:
    return _dt.resolve(jnp.dtype(x.dtype))


# --------------------------------------------------------------------------- #
# The packed pytree                                                           #
# --------------------------------------------------------------------------- #
@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class JaxPacked:
    """A packed tensor whose planes are JAX arrays (a pytree: it can be a jit
    argument or result, a custom_vjp residual, or a vmap operand).

    ``nnz`` is ``offsets[-1]``, the true count even after an overflow; only the
    first ``capacity`` values are kept. ``status`` is an int32 error word. Planes
    made by the custom calls (``impl="ffi"``) carry zeros up to a whole 4-byte
    word past the layout's lengths; :meth:`to_packed_tensor` trims them.
    """

    mask: jax.Array
    offsets: jax.Array
    values: jax.Array
    signs: jax.Array
    status: jax.Array
    shape: tuple
    dtype: _dt.DType
    encoding: Encoding
    chunk_log2: int
    capacity: int
    shares_mask: bool = False

    def tree_flatten(self):
        return ((self.mask, self.offsets, self.values, self.signs, self.status),
                (self.shape, self.dtype, self.encoding, self.chunk_log2, self.capacity,
                 self.shares_mask))

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def numel(self) -> int:
        return _fmt.numel_of(self.shape)

    @property
    def nnz(self) -> jax.Array:
        return self.offsets[-1]

    @property
    def overflowed(self) -> jax.Array:
        """Traced bool: more nonzeros arrived than ``capacity`` (values were dropped)."""
        return self.offsets[-1] > jnp.uint32(self.capacity)

    @property
    def layout(self) -> _fmt.Layout:
        return _fmt.layout(self.shape, self.dtype, self.encoding, self.capacity, self.chunk_log2)

    @property
    def nbytes(self) -> int:
        """Bytes of the four planes (what this residual costs in device memory)."""
        return int(self.mask.size + self.offsets.size * self.offsets.dtype.itemsize
                   + self.values.size + self.signs.size)

    def check(self) -> "JaxPacked":
        """Eagerly raise :class:`EncodingError` / :class:`CapacityOverflowError`; return self.

        Under jit the counters are traced, so there is nothing to check yet: use
        :attr:`overflowed` with ``lax.cond`` (as the FFN ops do) instead.
        """
        if is_traced(self.offsets) or is_traced(self.status):
            raise InputError("JaxPacked.check() needs concrete planes; under jit branch on "
                             "p.overflowed with lax.cond instead")
        if int(self.status) & STATUS_NOSIGN:
            raise EncodingError("nosign encoding: a stored value has its sign bit set; "
                                "use encoding='signplane' or 'raw'")
        nnz = int(self.offsets[-1])
        if nnz > self.capacity:
            raise CapacityOverflowError(f"{nnz} nonzeros exceed capacity {self.capacity}; "
                                        f"{nnz - self.capacity} values were dropped")
        return self

    def to_packed_tensor(self) -> PackedTensor:
        """The same planes as a host :class:`PackedTensor` (eager only): serialize it,
        compare it with the reference codec, or unpack it with any backend."""
        if is_traced(self.mask):
            raise InputError("to_packed_tensor() needs concrete planes (call it outside jit)")
        lay = self.layout
        # trimmed to the layout's lengths: planes from the custom calls carry zeros
        # up to a whole 4-byte word
        planes = [np.asarray(jax.device_get(getattr(self, n)))[:lay.sections[n][1] // size]
                  for n, size in (("mask", 1), ("offsets", 4), ("values", 1), ("signs", 1))]
        extra = {"shares_mask": True} if self.shares_mask else {}
        return PackedTensor(tuple(self.shape), self.dtype, self.encoding, self.chunk_log2,
                            self.capacity, *planes, backend=get_backend("numpy"), device=("cpu", 0),
                            _nnz=int(planes[1][-1]), extra=extra)


def from_packed_tensor(p: PackedTensor) -> JaxPacked:
    """A :class:`JaxPacked` holding ``p``'s planes (copied to JAX's default device)."""
    from ..packed import host_plane
    planes = [jnp.asarray(host_plane(p, n)) for n in ("mask", "offsets", "values", "signs")]
    if planes[1].dtype != jnp.uint32:
        raise InputError("64-bit chunk offsets (numel >= 2**32) are beyond the JAX codec")
    return JaxPacked(*planes, jnp.zeros((), jnp.int32), tuple(p.shape), p.dtype, p.encoding,
                     p.chunk_log2, p.capacity, bool(p.extra.get("shares_mask", False)))


# --------------------------------------------------------------------------- #
# Bit streams                                                                 #
# --------------------------------------------------------------------------- #
def stream_pack(codes: jax.Array, width: int, count: int) -> jax.Array:
    """LSB-first stream of ``codes`` (uint32, each < 2**width, 7 <= width <= 31) as
    ``ceil(count*width/8)`` bytes. ``codes`` has a multiple of 8 entries, zeros past
    ``count``; eight codes fill exactly ``width`` bytes, so output byte t of a group
    is built from at most two codes chosen at trace time."""
    groups = codes.reshape(-1, 8)
    cols = []
    for t in range(width):
        i0, sh = divmod(8 * t, width)
        byte = groups[:, i0] >> sh
        if sh + 8 > width and i0 + 1 < 8:
            byte = byte | (groups[:, i0 + 1] << (width - sh))
        cols.append((byte & 0xFF).astype(jnp.uint8))
    out = jnp.stack(cols, axis=1).reshape(-1) if cols else jnp.zeros((0,), jnp.uint8)
    return out[:(count * width + 7) // 8]


def stream_unpack(stream: jax.Array, width: int, count: int) -> jax.Array:
    """Inverse of :func:`stream_pack`: ``ceil(count/8)*8`` uint32 codes (the first
    ``count`` are the stream's; the rest decode the zero padding)."""
    groups = -(-count // 8)
    body = _fit(stream, groups * width)
    b = body.reshape(groups, width).astype(jnp.uint32)
    lo = jnp.uint32((1 << width) - 1)
    lanes = []
    for i in range(8):
        first, s = divmod(i * width, 8)
        code = jnp.zeros((groups,), jnp.uint32)
        for k in range((s + width + 7) // 8):
            shift = 8 * k - s
            col = b[:, first + k]
            code = code | (col << shift if shift >= 0 else col >> -shift)
        lanes.append(code & lo)
    return jnp.stack(lanes, axis=1).reshape(-1)


def _fit(v: jax.Array, n: int) -> jax.Array:
    """``v`` cut or zero-padded to ``n`` entries (lax.pad: XLA fuses it into consumers)."""
    if v.size >= n:
        return v[:n]
    return jnp.pad(v, (0, n - v.size))


def _bytes_le(words: jax.Array, itemsize: int) -> jax.Array:
    """Little-endian bytes of unsigned ``words`` (explicit shifts: no reliance on the
    byte order of a bitcast)."""
    if itemsize == 1:
        return words.astype(jnp.uint8)
    w = words.astype(jnp.uint32)
    return jnp.stack([((w >> (8 * k)) & 0xFF).astype(jnp.uint8) for k in range(itemsize)],
                     axis=1).reshape(-1)


def _from_bytes_le(raw: jax.Array, itemsize: int, utype) -> jax.Array:
    if itemsize == 1:
        return raw.astype(utype)
    b = raw.reshape(-1, itemsize).astype(jnp.uint32)
    w = b[:, 0]
    for k in range(1, itemsize):
        w = w | (b[:, k] << (8 * k))
    return w.astype(utype)


def _bits_lsb_first(flags: jax.Array) -> jax.Array:
    """Bool vector -> uint8 bytes, LSB-first, zero padding bits."""
    n = flags.size
    padded = _fit(flags.astype(jnp.uint8), -(-n // 8) * 8)
    return jnp.sum(padded.reshape(-1, 8) << jnp.arange(8, dtype=jnp.uint8), axis=1,
                   dtype=jnp.uint8)


# --------------------------------------------------------------------------- #
# Ranks                                                                       #
# --------------------------------------------------------------------------- #
def _words_from_flags(nz: jax.Array) -> jax.Array:
    n = nz.size
    n_words = -(-n // 32)
    padded = _fit(nz.astype(jnp.uint32), n_words * 32)
    return jnp.sum(padded.reshape(n_words, 32) << jnp.arange(32, dtype=jnp.uint32), axis=1,
                   dtype=jnp.uint32)


def _words_from_mask(mask: jax.Array, numel: int) -> jax.Array:
    n_words = -(-numel // 32)
    padded = _fit(mask.astype(jnp.uint32), n_words * 4)
    return jnp.sum(padded.reshape(n_words, 4) << (8 * jnp.arange(4, dtype=jnp.uint32)), axis=1,
                   dtype=jnp.uint32)


def _word_counts(words: jax.Array, numel: int, chunk_log2: int):
    """(per-chunk counts, exclusive within-chunk prefix of each word as an
    (n_chunks, words per chunk) array), int32."""
    wpc = 1 << (chunk_log2 - 5)
    n_chunks = -(-numel // (1 << chunk_log2))
    pc = lax.population_count(words).astype(jnp.int32)
    pc = _fit(pc, n_chunks * wpc).reshape(n_chunks, wpc)
    return jnp.sum(pc, axis=1), jnp.cumsum(pc, axis=1) - pc


def _word_first(within: jax.Array, starts: jax.Array, n_words: int) -> jax.Array:
    """Rank of the first set bit of each word: chunk start + prefix inside the chunk."""
    return (within + starts[:, None]).reshape(-1)[:n_words]


def _element_ranks(words: jax.Array, word_first: jax.Array, numel: int) -> jax.Array:
    """Rank (stored-value index) of every element: first rank of its word plus the
    set bits below it in that word."""
    below = (jnp.uint32(1) << jnp.arange(32, dtype=jnp.uint32)) - jnp.uint32(1)
    within = lax.population_count(words[:, None] & below[None, :]).astype(jnp.int32)
    return (word_first[:, None] + within).reshape(-1)[:numel]


def _flags_of_words(words: jax.Array, numel: int) -> jax.Array:
    bit = (words[:, None] >> jnp.arange(32, dtype=jnp.uint32)[None, :]) & jnp.uint32(1)
    return bit.reshape(-1)[:numel].astype(bool)


def _compact(bits: jax.Array, keep: jax.Array, ranks: jax.Array, slots: int) -> jax.Array:
    """``bits[keep]`` placed at ``ranks`` in a zeroed buffer of ``slots`` entries.

    Dropped elements get distinct negative indices, so every index is unique (XLA
    may then store without atomics) and the out-of-bounds ones are skipped.
    """
    j = jnp.arange(bits.size, dtype=jnp.int32)
    idx = jnp.where(keep, ranks, -1 - j)
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
    return lax.scatter(jnp.zeros((slots,), bits.dtype), idx[:, None], bits, dnums,
                       indices_are_sorted=False, unique_indices=True,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)


# --------------------------------------------------------------------------- #
# Pack / unpack (traceable cores)                                             #
# --------------------------------------------------------------------------- #
def _encode(stored: jax.Array, dtype: _dt.DType, encoding: Encoding, capacity: int):
    """(values plane, signs plane) of ``stored`` (``ceil(capacity/8)*8`` slots, zeros
    past the last stored value)."""
    if encoding == Encoding.RAW:
        values = _bytes_le(stored, dtype.itemsize)[:capacity * dtype.itemsize]
    else:
        mag = (stored & (dtype.sign_mask - 1)).astype(jnp.uint32)
        values = stream_pack(mag, dtype.magnitude_bits, capacity)
    if encoding == Encoding.SIGNPLANE:
        signs = _bits_lsb_first((stored >> (dtype.bits - 1)).astype(bool))[:(capacity + 7) // 8]
    else:
        signs = jnp.zeros((0,), jnp.uint8)
    return values, signs


def _decode(p: JaxPacked) -> jax.Array:
    """The ``capacity`` stored bit patterns (padded to a multiple of 8) as uint."""
    dtype, utype, cap = p.dtype, _UINT[p.dtype.bits], p.capacity
    slots = -(-cap // 8) * 8
    if p.encoding == Encoding.RAW:
        raw = _fit(p.values, slots * dtype.itemsize)
        return _from_bytes_le(raw, dtype.itemsize, utype)
    out = stream_unpack(p.values, dtype.magnitude_bits, cap)
    if p.encoding == Encoding.SIGNPLANE:
        sb = _fit(p.signs, slots // 8)
        bit = (sb[:, None] >> jnp.arange(8, dtype=jnp.uint8)[None, :]) & jnp.uint8(1)
        out = out | (bit.reshape(-1).astype(jnp.uint32) << (dtype.bits - 1))
    return out.astype(utype)


def _pack_bits(bits: jax.Array, dtype: _dt.DType, encoding: Encoding, capacity: int,
               chunk_log2: int):
    """All planes of the flat uint array ``bits`` plus (ranks, nz) for masked packing."""
    numel = bits.size
    nz = bits != 0
    words = _words_from_flags(nz)
    counts, within = _word_counts(words, numel, chunk_log2)
    starts = jnp.cumsum(counts) - counts
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.uint32),
                               jnp.cumsum(counts).astype(jnp.uint32)])
    ranks = _element_ranks(words, _word_first(within, starts, words.size), numel)
    slots = -(-capacity // 8) * 8
    stored = _compact(bits, nz & (ranks < capacity), ranks, slots)
    values, signs = _encode(stored, dtype, encoding, capacity)
    status = jnp.zeros((), jnp.int32)
    if encoding == Encoding.NOSIGN:
        sign_seen = jnp.any(nz & ((bits >> (dtype.bits - 1)) != 0))
        status = jnp.where(sign_seen, STATUS_NOSIGN, 0).astype(jnp.int32)
    mask = _bits_lsb_first(nz)
    return (mask, offsets, values, signs, status), ranks, nz


def _ranks_of(p: JaxPacked):
    """(ranks, nz) of every element, read from the mask and offsets planes."""
    numel = p.numel
    words = _words_from_mask(p.mask, numel)
    _, within = _word_counts(words, numel, p.chunk_log2)
    starts = p.offsets[:-1].astype(jnp.int32)
    return (_element_ranks(words, _word_first(within, starts, words.size), numel),
            _flags_of_words(words, numel))


def decode_dense(p: JaxPacked) -> jax.Array:
    """Dense tensor from the planes, assuming no overflow (values past ``capacity``
    would read as zero). Callers guard with ``p.overflowed``; see :func:`unpack`."""
    dtype, utype = p.dtype, _UINT[p.dtype.bits]
    ranks, nz = _ranks_of(p)
    stored = _decode(p)
    if stored.size == 0:
        flat = jnp.zeros((p.numel,), utype)
    else:
        have = nz & (ranks < p.capacity)
        flat = jnp.where(have, stored[jnp.clip(ranks, 0, stored.size - 1)], utype(0))
    return lax.bitcast_convert_type(flat, jnp.dtype(dtype.numpy)).reshape(p.shape)


def mask_of(p: JaxPacked) -> jax.Array:
    """Bool tensor, True where the element is nonzero (complete even after overflow)."""
    return _flags_of_words(_words_from_mask(p.mask, p.numel), p.numel).reshape(p.shape)


# --------------------------------------------------------------------------- #
# Public API                                                                  #
# --------------------------------------------------------------------------- #
def capacity_for(numel: int, density: float) -> int:
    """Value slots for a density bound: ``ceil(density * numel)``, at most numel."""
    density = check_density(density)
    return min(int(numel), int(math.ceil(density * int(numel))))


def check_capacity(capacity, numel: int) -> int:
    """A value-slot count: an int in [0, numel] (``capacity=0.5`` or ``"100"`` is a
    mistake, not something to round), else :class:`CapacityError`."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise CapacityError(f"capacity={capacity!r} must be an int number of value slots "
                            "(or pass density= for a fraction of the elements)")
    if not 0 <= int(capacity) <= numel:
        raise CapacityError(f"capacity={capacity} must lie in [0, numel={numel}]")
    return int(capacity)


def check_density(density) -> float:
    """A density bound: a real number in [0, 1], else :class:`CapacityError`."""
    if isinstance(density, bool) or not isinstance(density, (int, float, np.integer, np.floating)):
        raise CapacityError(f"density={density!r} must be a number in [0, 1]")
    if not 0.0 <= float(density) <= 1.0:  # NaN fails too
        raise CapacityError(f"density={density} must lie in [0, 1]")
    return float(density)


def relu_encoding(encoding) -> Encoding:
    """The encoding of a ReLU output: ``"auto"`` is nosign (relu keeps no negative value
    but a negative NaN, which sets ``status``), as the torch adapter resolves it."""
    if isinstance(encoding, str) and encoding.lower() == "auto":
        return Encoding.NOSIGN
    return Encoding.parse(encoding)


def companion_encoding(encoding) -> Encoding:
    """The encoding of gated companion values (signed): ``"auto"`` is signplane, the
    encoding that holds any sign without a scan of the data (traceable)."""
    if isinstance(encoding, str) and encoding.lower() == "auto":
        return Encoding.SIGNPLANE
    return Encoding.parse(encoding)


def _check_input(x) -> _dt.DType:
    dtype = dtype_of(x)
    numel = _fmt.numel_of(x.shape)
    if numel > MAX_NUMEL:
        raise InputError(f"numel={numel} exceeds {MAX_NUMEL}: the JAX codec indexes with "
                         "int32; split the tensor")
    return dtype


def _resolve_capacity(x, numel, capacity, density, nnz_if_eager):
    if capacity is not None and density is not None:
        raise CapacityError("give capacity or density, not both")
    if density is not None:
        return capacity_for(numel, density)
    if capacity is not None:
        return check_capacity(capacity, numel)
    if is_traced(x):
        raise CapacityError("under jit the values buffer needs a static size: pass "
                            "capacity= or density=")
    return nnz_if_eager()


def _resolve_encoding(x, encoding, bits, dtype):
    if isinstance(encoding, str) and encoding.lower() == "auto":
        if is_traced(x):
            raise EncodingError("encoding='auto' depends on the data, so it cannot be traced; "
                                "pass 'raw', 'nosign' or 'signplane' under jit")
        neg = bool(jnp.any((bits >> (dtype.bits - 1)) != 0))
        return Encoding.RAW if neg else Encoding.NOSIGN
    return Encoding.parse(encoding)


@partial(jax.jit, static_argnames=("dtype", "encoding", "capacity", "chunk_log2"))
def _pack_jit(bits, dtype, encoding, capacity, chunk_log2):
    return _pack_bits(bits, dtype, encoding, capacity, chunk_log2)[0]


def pack(x, *, capacity=None, density=None, encoding="auto",
         chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2) -> JaxPacked:
    """Pack a JAX array (any of the five dtypes) into a fixed number of value slots.

    capacity / density: the slot count, or a bound on the fraction of nonzeros
    (``ceil(density*numel)`` slots). Eagerly, leaving both out packs exactly
    (capacity = nnz, like the reference ``pack``); under jit one is required.
    Overflow keeps the first ``capacity`` values; ``p.overflowed`` says so (traced)
    and ``p.check()`` raises (eager).
    encoding: 'raw', 'nosign', 'signplane', or 'auto' (eager only). Eagerly an
    illegal 'nosign' raises :class:`EncodingError`; under jit it sets ``status``.
    """
    _fmt.check_chunk_log2(chunk_log2)
    x = jnp.asarray(x)
    dtype = _check_input(x)
    bits = lax.bitcast_convert_type(x.reshape(-1), _UINT[dtype.bits])
    numel = bits.size
    encoding = _resolve_encoding(x, encoding, bits, dtype)
    capacity = _resolve_capacity(x, numel, capacity, density,
                                 lambda: int(jnp.count_nonzero(bits)))
    planes = _pack_jit(bits, dtype, encoding, capacity, chunk_log2)
    p = JaxPacked(*planes, tuple(x.shape), dtype, encoding, chunk_log2, capacity)
    if not is_traced(x) and int(p.status) & STATUS_NOSIGN:
        raise EncodingError("nosign encoding: a stored value has its sign bit set; "
                            "use encoding='signplane' or 'raw'")
    return p


def unpack(p: JaxPacked, *, fallback=None) -> jax.Array:
    """The dense tensor of ``p``, bit-exact.

    Never returns truncated data: eagerly an overflowed ``p`` raises
    :class:`CapacityOverflowError`; under jit, unless ``capacity == numel`` (no
    overflow possible), ``fallback`` -- a zero-argument function recomputing the
    tensor -- is required, and ``lax.cond`` runs it when ``p.overflowed``.
    """
    if p.shares_mask:
        raise InputError("a masked_pack tensor stores zeros at its mask's positions; "
                         "unpack it with unpack_masked(p, p_mask)")
    return _guarded(p, lambda: _decode_jit(p), fallback)


_decode_jit = jax.jit(lambda p: decode_dense(p))


def _guarded(p: JaxPacked, decode, fallback):
    if p.capacity >= p.numel:
        return decode()
    if not is_traced(p.offsets):
        p.check()
        return decode()
    if fallback is None:
        raise CapacityOverflowError(
            f"under jit a capacity-{p.capacity} tensor of {p.numel} elements may have "
            "overflowed; pass fallback= (a function recomputing the dense tensor)")
    return lax.cond(p.overflowed, fallback, decode)


# Largest non-NaN magnitude pattern of each dtype (e4m3fn has no inf: 0x7E is 448).
NAN_ABOVE = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000,
              "float8_e4m3fn": 0x7E, "float8_e5m2": 0x7C}


def relu_bits(a: jax.Array) -> jax.Array:
    """relu(a) as every bitsparse backend computes it: a where a > 0 or a is NaN,
    else +0 (-0.0 is dropped; NaN payloads and subnormals are kept).

    Decided on the bit patterns, not with float compares: XLA on CPU treats
    subnormals as zero in compares and canonicalizes NaNs in selects, and the
    packed planes must equal the reference codec's bit for bit.
    """
    dtype = dtype_of(a)
    utype = _UINT[dtype.bits]
    bits = lax.bitcast_convert_type(a, utype)
    sign = utype(dtype.sign_mask)
    positive = (bits & sign) == 0
    nan = (bits & utype(dtype.sign_mask - 1)) > utype(NAN_ABOVE[dtype.name])
    kept = jnp.where(positive | nan, bits, utype(0))
    return lax.bitcast_convert_type(kept, a.dtype)


def relu_pack_planes(a: jax.Array, *, capacity: int, encoding="nosign",
                     chunk_log2: int = _fmt.DEFAULT_CHUNK_LOG2, u=None, u_encoding="signplane"):
    """``pack(relu_bits(a))`` into ``capacity`` slots, and, if ``u`` is given, ``u``'s
    values at the same positions (the gated companion, sharing mask and offsets).
    Traceable; the building block of the FFN ops."""
    _fmt.check_chunk_log2(chunk_log2)
    dtype = _check_input(a)
    encoding = relu_encoding(encoding)
    capacity = check_capacity(capacity, _fmt.numel_of(a.shape))
    r = relu_bits(a)
    bits = lax.bitcast_convert_type(r.reshape(-1), _UINT[dtype.bits])
    planes, ranks, nz = _pack_bits(bits, dtype, encoding, capacity, chunk_log2)
    p_r = JaxPacked(*planes, tuple(a.shape), dtype, encoding, chunk_log2, capacity)
    if u is None:
        return p_r
    return p_r, _masked_from_ranks(u, p_r, ranks, nz, companion_encoding(u_encoding))


def _masked_from_ranks(u, p_mask, ranks, nz, encoding):
    dtype = dtype_of(u)
    if dtype != p_mask.dtype or tuple(u.shape) != tuple(p_mask.shape):
        raise InputError(f"u is {dtype.name}{tuple(u.shape)}, the mask tensor is "
                         f"{p_mask.dtype.name}{tuple(p_mask.shape)}")
    ubits = lax.bitcast_convert_type(u.reshape(-1), _UINT[dtype.bits])
    slots = -(-p_mask.capacity // 8) * 8
    stored = _compact(ubits, nz & (ranks < p_mask.capacity), ranks, slots)
    values, signs = _encode(stored, dtype, encoding, p_mask.capacity)
    status = jnp.zeros((), jnp.int32)
    if encoding == Encoding.NOSIGN:
        status = jnp.where(jnp.any(nz & ((ubits >> (dtype.bits - 1)) != 0)),
                           STATUS_NOSIGN, 0).astype(jnp.int32)
    return JaxPacked(p_mask.mask, p_mask.offsets, values, signs, status, p_mask.shape, dtype,
                     encoding, p_mask.chunk_log2, p_mask.capacity, True)


def masked_pack(u: jax.Array, p_mask: JaxPacked, *, encoding="signplane") -> JaxPacked:
    """``u``'s bit patterns at ``p_mask``'s set positions (zeros included), sharing its
    mask and offsets and capacity (reference_ops.masked_pack at fixed capacity).
    ``encoding="auto"`` is signplane (see :func:`companion_encoding`)."""
    encoding = companion_encoding(encoding)
    ranks, nz = _ranks_of(p_mask)
    return _masked_from_ranks(jnp.asarray(u), p_mask, ranks, nz, encoding)


def unpack_masked(p_u: JaxPacked, *, fallback=None):
    """Dense tensor of a masked_pack result: its values at the mask's positions, +0
    elsewhere (guarded against overflow like :func:`unpack`)."""
    return _guarded(p_u, lambda: _decode_jit(p_u), fallback)
